"""Emulated `torch_npu.npu_add_rms_norm` and `torch_npu.npu_rms_norm_backward`, as docs/torch-npu-ops.md states them.

The contracts are in docs/torch-npu-ops.md, sections "npu_add_rms_norm" and "npu_rms_norm_backward".

`npu_add_rms_norm(x1, x2, gamma, epsilon)`: the sum `x = x1 + x2` rounded to the inputs' dtype (op-plugin's golden
adds in the input dtype), then the RMSNorm of that rounded sum in float32 with one final cast:
`rstd = rsqrt(mean(x.float()**2) + eps)`, `y = (x.float() * rstd * gamma.float()).to(dtype)`; returns (y, rstd, x).
It has no backward: differentiating through it raises, as torch_npu's autograd error fallback does.

`npu_rms_norm_backward(dy, x, gamma, rstd) -> (dx, dgamma)`: the backward npu_rms_norm's autograd node calls, as an
op of its own (dgamma in float32); its math is the one the emulated npu_rms_norm's backward runs (one source:
`ops/npu_rms_norm.py`'s `rms_norm_grads`). No derivative of its own.

Limits: `LEDGER`, npu_add_rms_norm's rules, then npu_rms_norm_backward's (`NPU_RMS_NORM_BACKWARD`, defined beside
that math in `ops/npu_rms_norm.py`, whose autograd node checks them too).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..checks import FLOAT_DTYPES, require_npu
from ..ledger import OP_PLUGIN, OPS_NN, enforce, rules
from .npu_rms_norm import NPU_RMS_NORM_BACKWARD, rms_norm_grads

__all__ = ["npu_add_rms_norm", "npu_rms_norm_backward"]

_API_DOC = f"{OP_PLUGIN}:docs/zh/custom_APIs/torch_npu/torch_npu-npu_add_rms_norm.md"
_ADD_RMS_NORM_DOC = f"{OPS_NN}:norm/add_rms_norm/docs/aclnnAddRmsNorm.md"
_EMPTY_NOTE = "aclnnAddRmsNorm.md takes empty tensors; the torch_npu API doc refuses them: the stricter holds"

NPU_ADD_RMS_NORM = rules(
    "npu_add_rms_norm",
    ("x1-dtype", "x1 is float32, float16 or bfloat16", f"{_API_DOC}:33", lambda c: c.x1.dtype in FLOAT_DTYPES),
    ("x2-dtype", "x2 has x1's dtype", f"{_ADD_RMS_NORM_DOC}:104", lambda c: c.x2.dtype == c.x1.dtype),
    ("gamma-dtype", "gamma has x1's dtype", f"{_API_DOC}:35", lambda c: c.gamma.dtype == c.x1.dtype),
    ("x1-rank", "x1 has 1 to 8 dims", f"{_API_DOC}:33", lambda c: 1 <= c.x1.dim() <= 8),
    ("x1-nonempty", "x1 is not empty", f"{_API_DOC}:33", lambda c: c.x1.numel() > 0, _EMPTY_NOTE),
    ("x2-nonempty", "x2 is not empty", f"{_API_DOC}:34", lambda c: c.x2.numel() > 0, _EMPTY_NOTE),
    ("gamma-nonempty", "gamma is not empty", f"{_API_DOC}:35", lambda c: c.gamma.numel() > 0, _EMPTY_NOTE),
    ("x2-shape", "x2 has x1's shape", f"{_ADD_RMS_NORM_DOC}:104", lambda c: c.x2.shape == c.x1.shape),
    ("gamma-rank", "gamma has 1 to 8 dims", f"{_ADD_RMS_NORM_DOC}:117", lambda c: 1 <= c.gamma.dim() <= 8),
    (
        "gamma-shape",
        "gamma's shape is x1's trailing dims (the normalised ones)",
        f"{_API_DOC}:35",
        lambda c: c.gamma.dim() <= c.x1.dim() and tuple(c.x1.shape[c.x1.dim() - c.gamma.dim() :]) == c.gamma.shape,
    ),
    ("epsilon-nonnegative", "epsilon is at least 0", f"{_ADD_RMS_NORM_DOC}:124", lambda c: c.epsilon >= 0),
)
"""npu_add_rms_norm's limits on Atlas A2/A3 (torch_npu always asks for rstd and x: the aclnn table's rows without
them, which take gamma as [1, last dim], are not its calls)."""

LEDGER = NPU_ADD_RMS_NORM + NPU_RMS_NORM_BACKWARD


def npu_add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    require_npu("npu_add_rms_norm", x1=x1, x2=x2, gamma=gamma)
    enforce(NPU_ADD_RMS_NORM, x1=x1, x2=x2, gamma=gamma, epsilon=epsilon)
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
    enforce(NPU_RMS_NORM_BACKWARD, dy=dy, x=x, gamma=gamma, rstd=rstd)
    with torch.no_grad():
        return rms_norm_grads(dy, x, gamma, rstd)
