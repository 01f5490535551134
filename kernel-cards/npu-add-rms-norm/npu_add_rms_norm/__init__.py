"""npu-add-rms-norm: a decoder layer's residual add and the following RMSNorm, fused for training on Huawei Ascend NPUs.

The forward is torch_npu.npu_add_rms_norm, the backward torch_npu.npu_rms_norm_backward; a float32 operand with a
float16 or bfloat16 one (autocast) is added as eager adds it and normalised by torch_npu.npu_rms_norm.
"""

from . import layers
from ._build import VARIANT
from .add_rms_norm import add_rms_norm, add_rms_norm_eager, add_rms_norm_unavailable_reason

__all__ = ["VARIANT", "add_rms_norm", "add_rms_norm_eager", "add_rms_norm_unavailable_reason", "layers"]
