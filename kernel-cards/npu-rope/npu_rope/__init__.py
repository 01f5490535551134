"""npu-rope: rotary position embedding on Huawei Ascend NPUs through torch_npu.npu_rotary_mul."""

from . import layers
from ._build import VARIANT
from .rotary import (
    STYLES,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_eager,
    in_place_unavailable_reason,
    rotary_unavailable_reason,
)

__all__ = [
    "STYLES",
    "VARIANT",
    "apply_rotary_pos_emb",
    "apply_rotary_pos_emb_eager",
    "in_place_unavailable_reason",
    "layers",
    "rotary_unavailable_reason",
]
