"""npu-swiglu: SiLU-gated MLPs on Huawei Ascend NPUs through torch_npu.npu_swiglu."""

from . import layers
from ._build import VARIANT
from .swiglu import (
    fused_mlp,
    pack_gate_up,
    packed_gate_up_weight,
    split_mlp,
    split_unavailable_reason,
    swiglu_unavailable_reason,
)

__all__ = [
    "VARIANT",
    "fused_mlp",
    "layers",
    "pack_gate_up",
    "packed_gate_up_weight",
    "split_mlp",
    "split_unavailable_reason",
    "swiglu_unavailable_reason",
]
