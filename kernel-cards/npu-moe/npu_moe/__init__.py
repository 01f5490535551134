"""npu-moe: transformers v5 MoE experts on Huawei Ascend NPUs (npu_grouped_matmul and the MoE routing ops)."""

from . import layers
from ._build import VARIANT
from .experts import swiglu_experts, swiglu_experts_eager, swiglu_experts_unavailable_reason

__all__ = ["VARIANT", "layers", "swiglu_experts", "swiglu_experts_eager", "swiglu_experts_unavailable_reason"]
