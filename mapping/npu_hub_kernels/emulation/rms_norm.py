"""Emulated `torch_npu.npu_rms_norm`: the contract in docs/torch-npu-ops.md, section "npu_rms_norm".

Everything in fp32 with one final cast: `rstd = rsqrt(mean(x.float()**2) + eps)`,
`y = (x.float() * rstd * gamma.float()).to(x.dtype)`; rstd is float32 with the normalised dims kept
as size 1. Autograd through these fp32 ops gives the op's backward (dx, and dgamma in fp32 that
autograd casts to gamma's dtype).
"""

from __future__ import annotations

import torch

from .checks import FLOAT_DTYPES, require_npu


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

    reduce_dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=reduce_dims, keepdim=True) + epsilon)
    y = (x32 * rstd * gamma.float()).to(x.dtype)
    return y, rstd
