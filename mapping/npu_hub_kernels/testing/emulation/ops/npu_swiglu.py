"""Emulated `torch_npu.npu_swiglu` and `torch_npu.npu_geglu`: docs/torch-npu-ops.md, sections "npu_swiglu", "npu_geglu".

`a, b = chunk(x, 2, dim)`; `out = silu(a) * b` with the FIRST half gated, in float32 with one cast
back. The input must be contiguous and even along `dim`. Backward as the op's (`npu_swiglu_backward`:
float32 inside, the gradient cast to x's dtype), keeping x alone for it, as the op does.

Limits: `LEDGER`, npu_swiglu's rules and npu_swiglu_backward's, which the autograd node checks on what op-plugin's
derivatives.yaml hands it (`npu_swiglu_backward(grad, self, dim)`). `npu_swiglu_backward` here is that op
(`torch.ops.npu.npu_swiglu_backward`; torch_npu does not expose it as `torch_npu.npu_swiglu_backward`).

npu_geglu (aclnnGeGluV3): `a, b = chunk(x, 2, dim)`; with `activate_left` the FIRST half is activated,
`out = gelu(a) * b`, else the second, `out = a * gelu(b)`; it returns `(out, gelu)` (the activated half's GELU),
both in x's dtype, computed in float32 and cast once (ops-nn's golden). Its autograd node keeps x and that `gelu`
output (derivatives.yaml: `npu_geglu_grad(grad, self, result1, dim, approximate, activate_left)`), and the backward
uses the kept `gelu` for the other half's gradient. Only `approximate=1` (tanh) is emulated: the erf form
(`approximate=0`) raises NotImplementedError, no card calls it.
"""

from __future__ import annotations

import torch

from ..backward import device_backward
from ..checks import FLOAT_DTYPES, require_npu
from ..ledger import OP_PLUGIN, OPS_NN, enforce, op_doc, rules

__all__ = ["npu_geglu", "npu_swiglu"]

_API_DOC = f"{OP_PLUGIN}:docs/zh/custom_APIs/torch_npu/（beta）torch_npu-npu_swiglu.md"
_SWIGLU_DOC = f"{OPS_NN}:activation/swi_glu/docs/aclnnSwiGlu.md"
_SWIGLU_GRAD_DOC = f"{OPS_NN}:activation/swi_glu_grad/docs/aclnnSwiGluGrad.md"
_GEGLU_DOC = f"{OPS_NN}:activation/ge_glu_v2/docs/aclnnGeGluV3.md"
_GEGLU_GRAD_DOC = f"{OPS_NN}:activation/ge_glu_grad_v2/docs/aclnnGeGluV3Backward.md"
_GEGLU_GRAD_API = f"{OPS_NN}:activation/ge_glu_grad_v2/op_host/op_api/aclnn_geglu_backward.cpp"
_GEGLU_META = f"{OP_PLUGIN}:op_plugin/python/meta/_meta_registrations.py"


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

NPU_GEGLU = rules(
    "npu_geglu",
    ("x-dtype", "x is float32, float16 or bfloat16", op_doc(2111), lambda c: c.x.dtype in FLOAT_DTYPES),
    (
        "x-rank",
        "x has 1 to 8 dims",
        f"{_GEGLU_META}:3155",
        lambda c: 1 <= c.x.dim() <= 8,
        "aclnnGeGluV3.md:101 takes 0 to 8 dims; op-plugin's meta registration refuses 0: the stricter holds",
    ),
    ("dim-range", "dim lies in [-x.dim(), x.dim()-1]", op_doc(2119), lambda c: _dim_in_range(c.x, c.dim)),
    ("approximate", "approximate is 0 (none: erf) or 1 (tanh)", op_doc(2113), lambda c: c.approximate in (0, 1)),
    ("x-even", "x's size along dim is even", f"{_GEGLU_DOC}:108", lambda c: c.x.shape[c.dim] % 2 == 0),
)
"""npu_geglu's limits. x may be non-contiguous (op_doc 2111) and empty (aclnn_geglu.cpp returns early); the
docstring names no products (bfloat16 'Atlas A2 训练系列产品支持'); aclnnGeGluV3 lists A2 and A3."""

NPU_GEGLU_GRAD = rules(
    "npu_geglu_grad",
    (
        "grad_output-dtype",
        "grad_output is float32, float16 or bfloat16",
        f"{_GEGLU_GRAD_DOC}:86",
        lambda c: c.grad_output.dtype in FLOAT_DTYPES,
    ),
    (
        "x-dtype",
        "x and gelu have grad_output's dtype",
        f"{_GEGLU_GRAD_API}:71",
        lambda c: c.x.dtype == c.grad_output.dtype == c.gelu.dtype,
    ),
    ("x-rank", "x has 1 to 8 dims", f"{_GEGLU_GRAD_DOC}:98", lambda c: 1 <= c.x.dim() <= 8),
    ("dim-range", "dim lies in [-x.dim(), x.dim()-1]", f"{_GEGLU_GRAD_DOC}:115", lambda c: _dim_in_range(c.x, c.dim)),
    ("approximate", "approximate is 0 or 1", f"{_GEGLU_GRAD_DOC}:125", lambda c: c.approximate in (0, 1)),
    (
        "grad_output-shape",
        "grad_output has x's shape with the dim axis half x's (so x's is even)",
        f"{_GEGLU_GRAD_DOC}:85",
        lambda c: c.x.shape[c.dim] % 2 == 0 and tuple(c.grad_output.shape) == _halved(c.x, c.dim),
    ),
    (
        "gelu-shape",
        "gelu has grad_output's shape",
        f"{_GEGLU_GRAD_DOC}:105",
        lambda c: c.gelu.shape == c.grad_output.shape,
        "all three may be non-contiguous (lines 89, 99, 109)",
    ),
)
"""npu_geglu_grad's limits (aclnnGeGluV3Backward on Atlas A2/A3), on what derivatives.yaml hands it."""

LEDGER = NPU_SWIGLU + NPU_SWIGLU_BACKWARD + NPU_GEGLU + NPU_GEGLU_GRAD


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


def npu_geglu(
    x: torch.Tensor, dim: int = -1, approximate: int = 1, activate_left: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    require_npu("npu_geglu", x=x)
    enforce(NPU_GEGLU, x=x, dim=dim, approximate=approximate)
    _require_tanh(approximate)
    return _Geglu.apply(x, dim, approximate, activate_left)


def npu_geglu_grad(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    gelu: torch.Tensor,
    dim: int = -1,
    approximate: int = 1,
    activate_left: bool = False,
) -> torch.Tensor:
    """The op npu_geglu's autograd node calls: x's gradient from the kept x and gelu, float32 inside, in x's dtype.

    The activated half's gradient is `grad * other * gelu'(activated)`, the other half's `grad * gelu` with the
    kept (rounded) gelu, as ops-nn's golden (activation/ge_glu_grad_v2/tests/assets/golden.py) computes it.
    """
    enforce(NPU_GEGLU_GRAD, grad_output=grad_output, x=x, gelu=gelu, dim=dim, approximate=approximate)
    _require_tanh(approximate)
    activated, other = _halves(x.float(), dim, activate_left)
    grad = grad_output.float()
    with torch.enable_grad():
        leaf = activated.detach().requires_grad_()
        (grad_activated,) = torch.autograd.grad(_gelu_tanh(leaf), leaf, grad * other)
    grad_other = grad * gelu.float()
    halves = (grad_activated, grad_other) if activate_left else (grad_other, grad_activated)
    return torch.cat(halves, dim=dim).to(x.dtype)


def _require_tanh(approximate: int) -> None:
    if approximate != 1:
        raise NotImplementedError("npu_geglu approximate=0 (erf GELU) is not emulated: no card calls it")


def _halves(x: torch.Tensor, dim: int, activate_left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the half GELU activates, the other half) of x along dim."""
    left, right = x.chunk(2, dim=dim)
    return (left, right) if activate_left else (right, left)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


class _Geglu(torch.autograd.Function):
    """npu_geglu, keeping x and its gelu output for backward, as the device's node does.

    derivatives.yaml: `self: npu_geglu_grad(grad, self, result1, dim, approximate, activate_left)` with
    `output_differentiability: [true, false]` (the gelu output has no gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, approximate: int, activate_left: bool):
        ctx.set_materialize_grads(False)
        ctx.dim, ctx.approximate, ctx.activate_left = dim, approximate, activate_left
        activated, other = _halves(x.float(), dim, activate_left)
        gelu = _gelu_tanh(activated)
        out, gelu = (gelu * other).to(x.dtype), gelu.to(x.dtype)
        ctx.mark_non_differentiable(gelu)
        ctx.save_for_backward(x, gelu)
        return out, gelu

    @staticmethod
    @device_backward("npu_geglu_grad")
    def backward(ctx, grad: torch.Tensor | None, _grad_gelu: None):
        x, gelu = ctx.saved_tensors
        return npu_geglu_grad(grad, x, gelu, ctx.dim, ctx.approximate, ctx.activate_left), None, None, None
