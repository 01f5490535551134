"""npu-rms-norm: RMSNorm on Huawei Ascend NPUs through torch_npu.npu_rms_norm."""

from . import layers
from ._build import VARIANT
from .rms_norm import rms_norm, rms_norm_eager, rms_norm_unavailable_reason

__all__ = ["VARIANT", "layers", "rms_norm", "rms_norm_eager", "rms_norm_unavailable_reason"]
