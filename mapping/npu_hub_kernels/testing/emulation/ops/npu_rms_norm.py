"""Emulated `torch_npu.npu_rms_norm` and `torch_npu.npu_gemma_rms_norm`: docs/torch-npu-ops.md, sections of each.

Everything in fp32 with one final cast: `rstd = rsqrt(mean(x.float()**2) + eps)`,
`y = (x.float() * rstd * gamma.float()).to(x.dtype)`; rstd is float32 with the normalised dims kept
as size 1. Backward as the op's `npu_rms_norm_backward(grad, x, gamma, rstd)` (dx, and dgamma in fp32 that
autograd casts to gamma's dtype; rstd has no gradient), keeping x, gamma and rstd for it, as the op does;
`rms_norm_grads` is that math, which npu-add-rms-norm's emulated `npu_rms_norm_backward` exposes as the op.

`npu_gemma_rms_norm(x, gamma, epsilon)`: the same norm scaled by `1 + gamma`, with gamma in x's dtype added to 1 in
float32 (op-plugin's golden: `gamma_fp32 + 1`), one final cast; rstd float32 as npu_rms_norm's. It has no derivative
(no derivatives.yaml entry): torch_npu's autograd fallback gives its outputs a node that warns and passes no gradient
(`backward.without_derivative`).

Limits: `LEDGER` (npu_rms_norm's rules, then npu_gemma_rms_norm's), and `NPU_RMS_NORM_BACKWARD`, the backward op's
rules, which the autograd node checks on what op-plugin's derivatives.yaml hands it
(`npu_rms_norm_backward(grad, self, gamma, result1)`) and `ops/npu_add_rms_norm.py` checks on calls of the op itself;
that module's `LEDGER` lists them (once).
"""

from __future__ import annotations

import torch

from ..backward import device_backward, without_derivative
from ..checks import FLOAT_DTYPES, require_npu
from ..ledger import OPS_NN, enforce, op_doc, rules

__all__ = ["npu_gemma_rms_norm", "npu_rms_norm"]

_RMS_NORM_DOC = f"{OPS_NN}:norm/rms_norm/docs/aclnnRmsNorm.md"
_RMS_NORM_GRAD_DOC = f"{OPS_NN}:norm/rms_norm_grad/docs/aclnnRmsNormGrad.md"
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _is_trailing(x: torch.Tensor, gamma: torch.Tensor) -> bool:
    """gamma's shape is x's trailing dims (gamma_shape = x_shape[n:])."""
    return gamma.dim() <= x.dim() and tuple(x.shape[x.dim() - gamma.dim() :]) == tuple(gamma.shape)


def _rstd_shapes(x: torch.Tensor, gamma: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """rstd's shape as aclnnRmsNormGrad writes it (x's leading dims) and as npu_rms_norm returns it (ones kept)."""
    leading = tuple(x.shape[: x.dim() - gamma.dim()])
    return leading, leading + (1,) * gamma.dim()


NPU_RMS_NORM = rules(
    "npu_rms_norm",
    ("x-dtype", "x is float16, bfloat16 or float32", op_doc(3447), lambda c: c.x.dtype in FLOAT_DTYPES),
    (
        "gamma-dtype",
        "gamma has x's dtype, or is float32 with a float16 or bfloat16 x",
        f"{_RMS_NORM_DOC}:259",
        lambda c: c.gamma.dtype == c.x.dtype or (c.gamma.dtype == torch.float32 and c.x.dtype in _HALF_DTYPES),
        "the docstring (_op_plugin_docs.py:3448) asks gamma in x's dtype; aclnnRmsNorm's A2/A3 table and the API doc "
        "((beta) torch_npu-npu_rms_norm.md:46) list a float32 gamma with float16/bfloat16 x too, and op-plugin's "
        "test_rms_norm_mix_dtype runs float16 x with float32 gamma on Ascend910B: the ledger takes the table",
    ),
    (
        "x-rank",
        "x has 2 to 8 dims",
        op_doc(3447),
        lambda c: 2 <= c.x.dim() <= 8,
        "aclnnRmsNorm.md:91 allows 1 to 8: the stricter docstring holds",
    ),
    (
        "gamma-rank",
        "gamma has 1 to 8 dims",
        f"{_RMS_NORM_DOC}:101",
        lambda c: 1 <= c.gamma.dim() <= 8,
        "the docstring (_op_plugin_docs.py:3448) says 2 to 8 yet 'usually x's last dim', and its example passes a "
        "1-D gamma: the ledger takes aclnnRmsNorm's 1 to 8",
    ),
    (
        "gamma-shape",
        "gamma's shape is x's trailing dims (gamma_shape = x_shape[n:])",
        f"{_RMS_NORM_DOC}:98",
        lambda c: _is_trailing(c.x, c.gamma),
    ),
    (
        "gamma-nonempty",
        "gamma is not empty",
        f"{_RMS_NORM_DOC}:98",
        lambda c: c.gamma.numel() > 0,
        "the API doc ((beta) torch_npu-npu_rms_norm.md:34) lets gamma be empty, aclnnRmsNorm does not: the stricter "
        "holds (an empty x is accepted)",
    ),
)
"""npu_rms_norm's limits on Atlas A2/A3 (the inference series' 32-byte tail and dtype pairs are not theirs)."""

_GEMMA_DOC = 12162
"""The line of npu_gemma_rms_norm's torch_npu docstring (`_op_plugin_docs.py`) stating x's limits (gamma's next)."""
_GEMMA_ACLNN = "hicann/ops-nn@8ac78fb:norm/gemma_rms_norm/docs/aclnnGemmaRmsNorm_en.md"
_GEMMA_STRICTER = (
    f"the torch_npu docstring refuses it; the CANN kernel's doc ({_GEMMA_ACLNN}, x's and gamma's rows of the "
    "parameter table) accepts it: the stricter holds"
)

NPU_GEMMA_RMS_NORM = rules(
    "npu_gemma_rms_norm",
    ("x-dtype", "x is float32, float16 or bfloat16", op_doc(_GEMMA_DOC), lambda c: c.x.dtype in FLOAT_DTYPES),
    ("gamma-dtype", "gamma has x's dtype", op_doc(_GEMMA_DOC + 1), lambda c: c.gamma.dtype == c.x.dtype),
    ("x-rank", "x has 1 to 8 dims", op_doc(_GEMMA_DOC), lambda c: 1 <= c.x.dim() <= 8),
    ("gamma-rank", "gamma has 1 to 8 dims", op_doc(_GEMMA_DOC + 1), lambda c: 1 <= c.gamma.dim() <= 8),
    (
        "gamma-shape",
        "gamma's shape is x's trailing dims (gamma_shape = input_shape[n:], n < input_shape.dims())",
        op_doc(_GEMMA_DOC + 1),
        lambda c: _is_trailing(c.x, c.gamma),
    ),
    (
        "nonempty",
        "x and gamma are not empty (不支持空进空出)",
        op_doc(_GEMMA_DOC + 9),
        lambda c: c.x.numel() > 0 and c.gamma.numel() > 0,
        _GEMMA_STRICTER,
    ),
    (
        "contiguous",
        "x and gamma are contiguous (不支持非连续tensor)",
        op_doc(_GEMMA_DOC + 10),
        lambda c: c.x.is_contiguous() and c.gamma.is_contiguous(),
        _GEMMA_STRICTER,
    ),
)
"""npu_gemma_rms_norm's limits on Atlas A2/A3, the only products it supports (its docstring's 支持的型号)."""

NPU_RMS_NORM_BACKWARD = rules(
    "npu_rms_norm_backward",
    (
        "dy-dtype",
        "dy is float16, bfloat16 or float32",
        f"{_RMS_NORM_GRAD_DOC}:102",
        lambda c: c.dy.dtype in FLOAT_DTYPES,
    ),
    ("x-dtype", "x has dy's dtype", f"{_RMS_NORM_GRAD_DOC}:274", lambda c: c.x.dtype == c.dy.dtype),
    (
        "gamma-dtype",
        "gamma has x's dtype, or is float32",
        f"{_RMS_NORM_GRAD_DOC}:274",
        lambda c: c.gamma.dtype in (c.x.dtype, torch.float32),
    ),
    ("rstd-dtype", "rstd is float32", f"{_RMS_NORM_GRAD_DOC}:122", lambda c: c.rstd.dtype == torch.float32),
    ("dy-rank", "dy has 2 to 8 dims", f"{_RMS_NORM_GRAD_DOC}:104", lambda c: 2 <= c.dy.dim() <= 8),
    ("x-shape", "x has dy's shape", f"{_RMS_NORM_GRAD_DOC}:111", lambda c: c.x.shape == c.dy.shape),
    ("gamma-rank", "gamma has 1 to 7 dims", f"{_RMS_NORM_GRAD_DOC}:134", lambda c: 1 <= c.gamma.dim() <= 7),
    (
        "gamma-shape",
        "gamma's shape is x's trailing dims (gamma_shape = x_shape[n:])",
        f"{_RMS_NORM_GRAD_DOC}:131",
        lambda c: _is_trailing(c.x, c.gamma),
    ),
    (
        "rstd-shape",
        "rstd's shape is x's leading dims (rstd_shape = x_shape[0:n]), or those with the normalised dims kept as 1 "
        "(as npu_rms_norm returns it)",
        f"{_RMS_NORM_GRAD_DOC}:121",
        lambda c: tuple(c.rstd.shape) in _rstd_shapes(c.x, c.gamma),
        "the doc writes rstd as x_shape[0:n] with 1 to 7 dims, but derivatives.yaml:230 hands the backward "
        "npu_rms_norm's result1, which keeps the normalised dims as 1 (rms_norm_npu_output_size): both forms are "
        "accepted, and rstd's rank is not checked apart from that",
    ),
)
"""npu_rms_norm_backward's limits on Atlas A2/A3: `ops/npu_add_rms_norm.py` lists them in its `LEDGER`."""

LEDGER = NPU_RMS_NORM + NPU_GEMMA_RMS_NORM


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    require_npu("npu_rms_norm", x=x, gamma=gamma)
    enforce(NPU_RMS_NORM, x=x, gamma=gamma, epsilon=epsilon)
    return _RmsNorm.apply(x, gamma, epsilon)


def npu_gemma_rms_norm(
    x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    require_npu("npu_gemma_rms_norm", x=x, gamma=gamma)
    enforce(NPU_GEMMA_RMS_NORM, x=x, gamma=gamma, epsilon=epsilon)
    with torch.no_grad():
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(dim=_normalised_dims(x, gamma), keepdim=True) + epsilon)
        y = (x32 * rstd * (gamma.float() + 1.0)).to(x.dtype)
    return tuple(without_derivative("npu_gemma_rms_norm", t, x, gamma) for t in (y, rstd))


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)  # an unused output: no gradient, no backward op run
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(dim=_normalised_dims(x, gamma), keepdim=True) + epsilon)
        ctx.save_for_backward(x, gamma, rstd)
        ctx.mark_non_differentiable(rstd)
        return (x32 * rstd * gamma.float()).to(x.dtype), rstd

    @staticmethod
    @device_backward("npu_rms_norm_backward")
    def backward(ctx, grad_y: torch.Tensor, _grad_rstd):
        x, gamma, rstd = ctx.saved_tensors
        # derivatives.yaml: self, gamma: npu_rms_norm_backward(grad, self, gamma, result1)
        enforce(NPU_RMS_NORM_BACKWARD, dy=grad_y, x=x, gamma=gamma, rstd=rstd)
        grad_x, grad_gamma = rms_norm_grads(grad_y, x, gamma, rstd)
        return grad_x, grad_gamma, None  # dgamma in float32, as the op's node returns it: autograd casts it


def rms_norm_grads(
    grad_y: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The math of `npu_rms_norm_backward(dy, x, gamma, rstd) -> (dx in x's dtype, dgamma in float32)`.

    d/dx of x * rstd(x) * gamma: `rstd * (g - x * rstd^2 * mean(g * x))` with g = grad_y * gamma, and dgamma the
    sum of `grad_y * x * rstd` over the leading dims; float32 inside. rstd in either of the shapes
    `NPU_RMS_NORM_BACKWARD` accepts (it is viewed with the normalised dims kept as 1).
    """
    dims = _normalised_dims(x, gamma)
    rstd = rstd.reshape(_rstd_shapes(x, gamma)[1])
    x32, grad32 = x.float(), grad_y.float()
    scaled = grad32 * gamma.float()
    grad_x = rstd * (scaled - x32 * rstd.pow(2) * (scaled * x32).mean(dim=dims, keepdim=True))
    grad_gamma = grad32 * x32 * rstd
    if x.dim() > gamma.dim():  # (sum over no dims would sum over all of them)
        grad_gamma = grad_gamma.sum(dim=tuple(range(x.dim() - gamma.dim())))
    return grad_x.to(x.dtype), grad_gamma


def _normalised_dims(x: torch.Tensor, gamma: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(x.dim() - gamma.dim(), x.dim()))
