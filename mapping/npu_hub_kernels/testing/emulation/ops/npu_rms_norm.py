"""Emulated `torch_npu.npu_rms_norm`: the contract in docs/torch-npu-ops.md, section "npu_rms_norm".

Everything in fp32 with one final cast: `rstd = rsqrt(mean(x.float()**2) + eps)`,
`y = (x.float() * rstd * gamma.float()).to(x.dtype)`; rstd is float32 with the normalised dims kept
as size 1. Backward as the op's `npu_rms_norm_backward(grad, x, gamma, rstd)` (dx, and dgamma in fp32 that
autograd casts to gamma's dtype; rstd has no gradient), keeping x, gamma and rstd for it, as the op does;
`rms_norm_grads` is that math, which npu-add-rms-norm's emulated `npu_rms_norm_backward` exposes as the op.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..checks import FLOAT_DTYPES, require_npu

__all__ = ["npu_rms_norm"]


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    require_npu("npu_rms_norm", x=x, gamma=gamma)
    if x.dtype not in FLOAT_DTYPES:
        raise RuntimeError(f"npu_rms_norm: x dtype {x.dtype} is not supported (fp16, bf16, fp32)")
    if gamma.dtype != x.dtype and gamma.dtype != torch.float32:
        raise RuntimeError(f"npu_rms_norm: gamma dtype {gamma.dtype} must equal x dtype {x.dtype} or be float32")
    if not 2 <= x.dim() <= 8:
        raise RuntimeError(f"npu_rms_norm: x must have 2 to 8 dims, got {x.dim()}")
    if gamma.dim() > x.dim() or tuple(x.shape[x.dim() - gamma.dim() :]) != tuple(gamma.shape):
        raise RuntimeError(
            f"npu_rms_norm: gamma shape {tuple(gamma.shape)} must equal the trailing dims of x {tuple(x.shape)}"
        )

    return _RmsNorm.apply(x, gamma, epsilon)


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(dim=_normalised_dims(x, gamma), keepdim=True) + epsilon)
        ctx.save_for_backward(x, gamma, rstd)
        ctx.mark_non_differentiable(rstd)
        return (x32 * rstd * gamma.float()).to(x.dtype), rstd

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: torch.Tensor, _grad_rstd):
        x, gamma, rstd = ctx.saved_tensors
        grad_x, grad_gamma = rms_norm_grads(grad_y, x, gamma, rstd)
        return grad_x, grad_gamma, None  # dgamma in float32, as the op's node returns it: autograd casts it


def rms_norm_grads(
    grad_y: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The math of `npu_rms_norm_backward(dy, x, gamma, rstd) -> (dx in x's dtype, dgamma in float32)`.

    d/dx of x * rstd(x) * gamma: `rstd * (g - x * rstd^2 * mean(g * x))` with g = grad_y * gamma, and dgamma the
    sum of `grad_y * x * rstd` over the leading dims; float32 inside.
    """
    dims = _normalised_dims(x, gamma)
    x32, grad32 = x.float(), grad_y.float()
    scaled = grad32 * gamma.float()
    grad_x = rstd * (scaled - x32 * rstd.pow(2) * (scaled * x32).mean(dim=dims, keepdim=True))
    grad_gamma = (grad32 * x32 * rstd).sum(dim=tuple(range(x.dim() - gamma.dim())))
    return grad_x.to(x.dtype), grad_gamma


def _normalised_dims(x: torch.Tensor, gamma: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(x.dim() - gamma.dim(), x.dim()))
