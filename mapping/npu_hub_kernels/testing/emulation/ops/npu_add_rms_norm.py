"""Emulated `torch_npu.npu_add_rms_norm` and `torch_npu.npu_rms_norm_backward`: the contracts in
docs/torch-npu-ops.md, sections "npu_add_rms_norm" and "npu_rms_norm_backward".

`npu_add_rms_norm(x1, x2, gamma, epsilon)`: the sum `x = x1 + x2` rounded to the inputs' dtype (op-plugin's golden
adds in the input dtype), then the RMSNorm of that rounded sum in float32 with one final cast:
`rstd = rsqrt(mean(x.float()**2) + eps)`, `y = (x.float() * rstd * gamma.float()).to(dtype)`; returns (y, rstd, x).
It has no backward: differentiating through it raises, as torch_npu's autograd error fallback does.

`npu_rms_norm_backward(dy, x, gamma, rstd) -> (dx, dgamma)`: the backward npu_rms_norm's autograd node calls, as an
op of its own (dgamma in float32); its math is the one the emulated npu_rms_norm's backward runs (one source:
`ops/npu_rms_norm.py`'s `rms_norm_grads`). No derivative of its own.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..checks import FLOAT_DTYPES, require_npu
from .npu_rms_norm import rms_norm_grads

__all__ = ["npu_add_rms_norm", "npu_rms_norm_backward"]


def npu_add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    require_npu("npu_add_rms_norm", x1=x1, x2=x2, gamma=gamma)
    if x1.dtype not in FLOAT_DTYPES:
        raise RuntimeError(f"npu_add_rms_norm: x1 dtype {x1.dtype} is not supported (fp16, bf16, fp32)")
    if x2.dtype != x1.dtype or gamma.dtype != x1.dtype:
        raise RuntimeError(
            f"npu_add_rms_norm: x2 ({x2.dtype}) and gamma ({gamma.dtype}) must have x1's dtype {x1.dtype}"
        )
    if not 1 <= x1.dim() <= 8:
        raise RuntimeError(f"npu_add_rms_norm: x1 must have 1 to 8 dims, got {x1.dim()}")
    if x2.shape != x1.shape:
        raise RuntimeError(f"npu_add_rms_norm: x2 shape {tuple(x2.shape)} must equal x1 shape {tuple(x1.shape)}")
    if gamma.dim() > x1.dim() or tuple(x1.shape[x1.dim() - gamma.dim() :]) != tuple(gamma.shape):
        raise RuntimeError(
            f"npu_add_rms_norm: gamma shape {tuple(gamma.shape)} must equal the trailing dims of x1 {tuple(x1.shape)}"
        )
    return _ForwardOnly.apply(x1, x2, gamma, epsilon)


class _ForwardOnly(torch.autograd.Function):
    """The op's math; its backward raises like torch_npu's AutogradErrorFallback (nothing is kept for it)."""

    @staticmethod
    def forward(ctx, x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float):
        x = (x1.float() + x2.float()).to(x1.dtype)
        dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + epsilon)
        return (x32 * rstd * gamma.float()).to(x1.dtype), rstd, x

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        raise RuntimeError("derivative for 'npu::npu_add_rms_norm' is not implemented")


def npu_rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    require_npu("npu_rms_norm_backward", dy=dy, x=x, gamma=gamma, rstd=rstd)
    if x.dtype not in FLOAT_DTYPES or dy.dtype != x.dtype:
        raise RuntimeError(f"npu_rms_norm_backward: dy ({dy.dtype}) and x ({x.dtype}) must be one of fp16, bf16, fp32")
    if gamma.dtype not in (x.dtype, torch.float32):
        raise RuntimeError(
            f"npu_rms_norm_backward: gamma dtype {gamma.dtype} must equal x dtype {x.dtype} or be float32"
        )
    if rstd.dtype != torch.float32:
        raise RuntimeError(f"npu_rms_norm_backward: rstd must be float32, got {rstd.dtype}")
    if dy.shape != x.shape:
        raise RuntimeError(f"npu_rms_norm_backward: dy shape {tuple(dy.shape)} must equal x shape {tuple(x.shape)}")
    with torch.no_grad():
        return rms_norm_grads(dy, x, gamma, rstd)
