"""Emulated `torch_npu.npu_swiglu`: the contract in docs/torch-npu-ops.md, section "npu_swiglu".

`a, b = chunk(x, 2, dim)`; `out = silu(a) * b` with the FIRST half gated, in float32 with one cast
back. The input must be contiguous and even along `dim`. Backward as the op's (`npu_swiglu_backward`:
float32 inside, the gradient cast to x's dtype), keeping x alone for it, as the op does.

Limits: `LEDGER`, npu_swiglu's rules and npu_swiglu_backward's, which the autograd node checks on what op-plugin's
derivatives.yaml hands it (`npu_swiglu_backward(grad, self, dim)`). `npu_swiglu_backward` here is that op
(`torch.ops.npu.npu_swiglu_backward`; torch_npu does not expose it as `torch_npu.npu_swiglu_backward`).
"""

from __future__ import annotations

import torch

from ..backward import device_backward
from ..checks import FLOAT_DTYPES, require_npu
from ..ledger import OP_PLUGIN, OPS_NN, enforce, op_doc, rules

__all__ = ["npu_swiglu"]

_API_DOC = f"{OP_PLUGIN}:docs/zh/custom_APIs/torch_npu/（beta）torch_npu-npu_swiglu.md"
_SWIGLU_DOC = f"{OPS_NN}:activation/swi_glu/docs/aclnnSwiGlu.md"
_SWIGLU_GRAD_DOC = f"{OPS_NN}:activation/swi_glu_grad/docs/aclnnSwiGluGrad.md"


def _dim_in_range(x: torch.Tensor, dim: int) -> bool:
    return -x.dim() <= dim <= x.dim() - 1


def _halved(x: torch.Tensor, dim: int) -> tuple[int, ...]:
    """x's shape with the `dim` axis halved: the forward's output, the backward's grad_output."""
    shape = list(x.shape)
    shape[dim] //= 2
    return tuple(shape)


NPU_SWIGLU = rules(
    "npu_swiglu",
    ("x-dtype", "x is float32, float16 or bfloat16", op_doc(4404), lambda c: c.x.dtype in FLOAT_DTYPES),
    ("x-rank", "x has 1 to 8 dims", op_doc(4404), lambda c: 1 <= c.x.dim() <= 8),
    ("dim-range", "dim lies in [-x.dim(), x.dim()-1]", f"{_SWIGLU_DOC}:98", lambda c: _dim_in_range(c.x, c.dim)),
    ("x-contiguous", "x is contiguous", f"{_SWIGLU_DOC}:92", lambda c: c.x.is_contiguous()),
    (
        "x-nonempty",
        "x is not empty",
        f"{_API_DOC}:28",
        lambda c: c.x.numel() > 0,
        "aclnnSwiGlu.md:88 takes an empty x on A2/A3; the torch_npu API doc refuses it: the stricter holds",
    ),
    ("x-even", "x's size along dim is even", f"{_SWIGLU_DOC}:88", lambda c: c.x.shape[c.dim] % 2 == 0),
)
"""npu_swiglu's limits. The docstring's 支持的型号 (_op_plugin_docs.py:4410) names the Atlas A2 training series
only; aclnnSwiGlu lists A3 as well: the emulation stands for both."""

NPU_SWIGLU_BACKWARD = rules(
    "npu_swiglu_backward",
    ("x-dtype", "x is bfloat16, float16 or float32", f"{_SWIGLU_GRAD_DOC}:103", lambda c: c.x.dtype in FLOAT_DTYPES),
    (
        "grad_output-dtype",
        "grad_output has x's dtype",
        f"{_SWIGLU_GRAD_DOC}:92",
        lambda c: c.grad_output.dtype == c.x.dtype,
    ),
    ("x-rank", "x has 1 to 8 dims", f"{_SWIGLU_GRAD_DOC}:105", lambda c: 1 <= c.x.dim() <= 8),
    (
        "dim-range",
        "dim lies in [-x.dim(), x.dim()-1]",
        f"{_SWIGLU_GRAD_DOC}:112",
        lambda c: _dim_in_range(c.x, c.dim),
    ),
    ("x-nonempty", "x is not empty", f"{_SWIGLU_GRAD_DOC}:102", lambda c: c.x.numel() > 0),
    ("grad_output-nonempty", "grad_output is not empty", f"{_SWIGLU_GRAD_DOC}:92", lambda c: c.grad_output.numel() > 0),
    (
        "grad_output-shape",
        "grad_output has x's shape with the dim axis half x's (so x's is even)",
        f"{_SWIGLU_GRAD_DOC}:92",
        lambda c: c.x.shape[c.dim] % 2 == 0 and tuple(c.grad_output.shape) == _halved(c.x, c.dim),
    ),
    (
        "grad_output-contiguous",
        "grad_output is contiguous",
        f"{_SWIGLU_GRAD_DOC}:96",
        lambda c: c.grad_output.is_contiguous(),
        "x may be non-contiguous (line 106). Line 102's 'shape不支持非64字节对齐' is not enforced: the forward doc "
        "(aclnnSwiGlu.md:138) scopes it to the Atlas inference series, as swi_glu_tiling.cpp checks it (DAV_2002 only)",
    ),
)
"""npu_swiglu_backward's limits (aclnnSwiGluGrad on Atlas A2/A3)."""

LEDGER = NPU_SWIGLU + NPU_SWIGLU_BACKWARD


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    require_npu("npu_swiglu", x=x)
    enforce(NPU_SWIGLU, x=x, dim=dim)
    return _Swiglu.apply(x, dim)


def npu_swiglu_backward(grad_output: torch.Tensor, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The op npu_swiglu's autograd node calls: the gradient of `_swiglu` at x, float32 inside, in x's dtype."""
    enforce(NPU_SWIGLU_BACKWARD, grad_output=grad_output, x=x, dim=dim)
    with torch.enable_grad():
        leaf = x.detach().requires_grad_()
        (grad,) = torch.autograd.grad(_swiglu(leaf, dim), leaf, grad_output)
    return grad


class _Swiglu(torch.autograd.Function):
    """npu_swiglu, keeping x alone for backward (`derivatives.yaml`: `self: npu_swiglu_backward(grad, self, dim)`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.set_materialize_grads(False)  # an unused output: no gradient, no backward op run
        ctx.dim = dim
        ctx.save_for_backward(x)
        return _swiglu(x, dim)

    @staticmethod
    @device_backward("npu_swiglu_backward")
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        return npu_swiglu_backward(grad, x, ctx.dim), None


def _swiglu(x: torch.Tensor, dim: int) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
