"""npu-fused-attention: transformers attention on Huawei Ascend NPUs through torch_npu.npu_fusion_attention."""

from ._build import VARIANT
from .fused_attention import fused_attention, fused_attention_eager, fused_attention_unavailable_reason
from .masks import fused_attention_mask

ATTENTION_NAME = "npu_fused_attention"
"""The name to register `fused_attention` under in transformers' AttentionInterface, and `fused_attention_mask`
under in its AttentionMaskInterface (no "flash" and no "/": transformers gives such names other meanings)."""

__all__ = [
    "ATTENTION_NAME",
    "VARIANT",
    "fused_attention",
    "fused_attention_eager",
    "fused_attention_mask",
    "fused_attention_unavailable_reason",
]
