"""RMSNorm on torch_npu.npu_rms_norm, with the eager math of transformers wherever the op does not apply.

transformers' RMSNorm classes scale the normalised input in one of three ways; `npu_rms_norm`
(float32 inside, one cast at the end) serves all three:

- "plain" (LlamaRMSNorm): `weight * normalize(x).to(dtype)`; the fused result is exact in float32
  and within one rounding step in float16/bfloat16 (transformers rounds before the multiply).
- "zero_centered" (Gemma3RMSNorm): `(normalize(x) * (1 + weight.float())).to(dtype)`; exact.
- "float32_scale" (Olmo2RMSNorm): `(weight.float() * normalize(x)).to(dtype)`; exact.

Backward: npu_rms_norm's own autograd node (npu_rms_norm_backward). That op has no derivative, so in a backward that
autograd records (create_graph: a gradient penalty, a Hessian-vector product) the fused output's gradient is that of
eager's math on the same x and weight instead (`with_eager_double_backward`): the second-order gradients are eager's.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ._double_backward import with_eager_double_backward
from ._fallbacks import ran_eager
from ._npu import FUSED_DTYPES, npu_unavailable_reason, torch_npu
from ._rms_norm_forms import Scaling, check_scaling, rms_norm_math


def rms_norm_unavailable_reason(x: torch.Tensor, weight: torch.Tensor, scaling: Scaling = "plain") -> str | None:
    """Why `npu_rms_norm` will not run for these inputs (the eager math runs instead), or None."""
    check_scaling(scaling)
    reason = npu_unavailable_reason(x, weight)
    if reason is not None:
        return reason
    dtype, weight_dtype = x.dtype, weight.dtype
    if dtype not in FUSED_DTYPES:
        return f"dtype {dtype} is not supported by npu_rms_norm (float16, bfloat16, float32)"
    if scaling == "plain":
        if weight_dtype is not dtype:  # a dtype is a singleton
            return f"weight dtype {weight_dtype} differs from input dtype {dtype}: eager promotes the output dtype"
    elif scaling == "float32_scale" and weight_dtype not in (dtype, torch.float32):
        return f"npu_rms_norm takes a weight in the input dtype or float32, not {weight_dtype} with {dtype}"
    shape = x.shape
    if not 2 <= len(shape) <= 8:
        return f"npu_rms_norm takes 2 to 8 dims, got {len(shape)}"
    if 0 in shape:
        return "empty input"
    weight_shape = weight.shape
    if len(weight_shape) != 1 or weight_shape[0] != shape[-1]:
        return f"weight shape {tuple(weight_shape)} does not match the last dim of the input {tuple(shape)}"
    return None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, scaling: Scaling = "plain", *, module: nn.Module | None = None
) -> torch.Tensor:
    """RMSNorm of the last dim of x, scaled by weight the way `scaling` says.

    Fused on npu tensors (second-order gradients: eager's, see the module's docstring) as `rms_norm_unavailable_reason`
    decides, recorded for `module` (the layer's own, when a layer calls it).
    """
    if ran_eager(module, rms_norm_unavailable_reason(x, weight, scaling)):
        return rms_norm_eager(x, weight, eps, scaling)
    gamma = 1.0 + weight.float() if scaling == "zero_centered" else weight
    fused = torch_npu.npu_rms_norm(x.contiguous(), gamma, epsilon=eps)[0]
    if not torch.is_grad_enabled():  # autograd records nothing: with_eager_double_backward would return fused as it is
        return fused
    return with_eager_double_backward(fused, partial(rms_norm_math, eps=eps, scaling=scaling), x, weight)


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float, scaling: Scaling = "plain") -> torch.Tensor:
    """The forward of transformers' LlamaRMSNorm, Gemma3RMSNorm or Olmo2RMSNorm, operation for operation."""
    return rms_norm_math(x, weight, eps, scaling)
