"""npu-moe: transformers v5 MoE experts on Huawei Ascend NPUs (npu_grouped_matmul and the MoE routing ops)."""

from . import layers
from ._build import VARIANT
from .experts import experts_forward, experts_sorted, experts_unavailable_reason

__all__ = ["VARIANT", "experts_forward", "experts_sorted", "experts_unavailable_reason", "layers"]
