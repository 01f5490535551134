"""npu-rope: rotary position embedding on Huawei Ascend NPUs through torch_npu's rotary ops.

`apply_rotary_pos_emb` (fused where it can be), `apply_rotary_pos_emb_eager` (the exact fallback)
and `apply_rotary_pos_emb_unavailable_reason` (why the fallback runs), for every rotary style of
transformers in `STYLES`.
"""

from . import layers
from ._build import VARIANT
from .rotary import STYLES, apply_rotary_pos_emb, apply_rotary_pos_emb_eager, apply_rotary_pos_emb_unavailable_reason

__all__ = [
    "STYLES",
    "VARIANT",
    "apply_rotary_pos_emb",
    "apply_rotary_pos_emb_eager",
    "apply_rotary_pos_emb_unavailable_reason",
    "layers",
]
