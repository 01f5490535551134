"""npu-rms-norm: RMSNorm on Huawei Ascend NPUs through torch_npu.npu_rms_norm."""

from . import layers
from ._build import VARIANT
from .rms_norm import fused_unavailable_reason, rms_norm, rms_norm_eager

__all__ = ["VARIANT", "fused_unavailable_reason", "layers", "rms_norm", "rms_norm_eager"]
