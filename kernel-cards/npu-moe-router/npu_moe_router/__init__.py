"""npu-moe-router: transformers' MoE routers on Huawei Ascend NPUs (torch_npu.npu_moe_gating_top_k)."""

from . import layers
from ._build import VARIANT
from .router import moe_router_top_k, moe_router_top_k_eager, moe_router_top_k_unavailable_reason

__all__ = ["VARIANT", "layers", "moe_router_top_k", "moe_router_top_k_eager", "moe_router_top_k_unavailable_reason"]
