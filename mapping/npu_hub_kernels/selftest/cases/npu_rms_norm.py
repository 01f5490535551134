"""npu-rms-norm's cases: npu_rms_norm's and npu_gemma_rms_norm's rules (`CASES`), its limits (`LIMITS`), forms.

npu_rms_norm_backward's rules, which npu_rms_norm's autograd node checks too, have their cases with the op in
`cases/npu_add_rms_norm.py` (that card's emulated ops list them).
"""

from __future__ import annotations

import torch

from ..forms import Form, Widths, randn
from . import npu, torch_npu

BF16, F16, F64 = torch.bfloat16, torch.float16, torch.float64
ONES_8D = (1, 1, 1, 1, 1, 1, 2)


def _rms_norm(x: torch.Tensor, gamma: torch.Tensor, backward: bool = False) -> None:
    y, _ = torch_npu.npu_rms_norm(x, gamma, epsilon=1e-6)
    if backward:
        y.float().pow(2).sum().backward()


def _gemma_rms_norm(x: torch.Tensor, gamma: torch.Tensor) -> None:
    torch_npu.npu_gemma_rms_norm(x, gamma, epsilon=1e-6)


def _transposed(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A non-contiguous npu tensor of `shape`: the transpose of its first two dims' memory."""
    return npu(shape[1], shape[0], *shape[2:], dtype=dtype).transpose(0, 1)


def _scalar(value: float = 1.0) -> torch.Tensor:
    return torch.tensor(value).to("npu")


CASES = {
    "npu_rms_norm/x-dtype": (
        lambda: _rms_norm(npu(4, 8, dtype=F16), npu(8, dtype=F16)),
        lambda: _rms_norm(npu(4, 8, dtype=F64), npu(8, dtype=F64)),
    ),
    "npu_rms_norm/gamma-dtype": (
        lambda: _rms_norm(npu(4, 8, dtype=BF16, grad=True), npu(8, grad=True), backward=True),
        lambda: _rms_norm(npu(4, 8), npu(8, dtype=BF16)),
    ),
    "npu_rms_norm/x-rank": (
        lambda: _rms_norm(npu(*ONES_8D, 8, grad=True), npu(8, grad=True), backward=True),
        lambda: _rms_norm(npu(8), npu(8)),
    ),
    "npu_rms_norm/gamma-rank": (
        lambda: _rms_norm(npu(2, 4, 8, grad=True), npu(4, 8, grad=True), backward=True),
        lambda: _rms_norm(npu(2, 8), _scalar()),
    ),
    "npu_rms_norm/gamma-shape": (
        lambda: _rms_norm(npu(4, 8), npu(8)),
        lambda: _rms_norm(npu(4, 8), npu(6)),
    ),
    "npu_rms_norm/gamma-nonempty": (
        lambda: _rms_norm(npu(0, 8), npu(8)),  # an empty x is accepted
        lambda: _rms_norm(npu(4, 0), npu(0)),
    ),
    "npu_gemma_rms_norm/x-dtype": (
        lambda: _gemma_rms_norm(npu(4, 8, dtype=BF16), npu(8, dtype=BF16)),
        lambda: _gemma_rms_norm(npu(4, 8, dtype=F64), npu(8, dtype=F64)),
    ),
    "npu_gemma_rms_norm/gamma-dtype": (
        lambda: _gemma_rms_norm(npu(4, 8, dtype=F16), npu(8, dtype=F16)),
        lambda: _gemma_rms_norm(npu(4, 8, dtype=BF16), npu(8)),  # float32 gamma: a pair npu_rms_norm takes, not this op
    ),
    "npu_gemma_rms_norm/x-rank": (
        lambda: _gemma_rms_norm(npu(8), npu(8)),  # one dim (npu_rms_norm takes two at the least)
        lambda: _gemma_rms_norm(npu(*ONES_8D, 1, 8), npu(8)),
    ),
    "npu_gemma_rms_norm/gamma-rank": (
        lambda: _gemma_rms_norm(npu(2, 4, 8), npu(4, 8)),
        lambda: _gemma_rms_norm(npu(2, 8), _scalar()),
    ),
    "npu_gemma_rms_norm/gamma-shape": (
        lambda: _gemma_rms_norm(npu(4, 8), npu(8)),
        lambda: _gemma_rms_norm(npu(4, 8), npu(4)),
    ),
    "npu_gemma_rms_norm/nonempty": (
        lambda: _gemma_rms_norm(npu(1, 8), npu(8)),
        lambda: _gemma_rms_norm(npu(0, 8), npu(8)),
    ),
    "npu_gemma_rms_norm/contiguous": (
        lambda: _gemma_rms_norm(_transposed(4, 3, 8).transpose(0, 1), npu(8)),  # transposed back: contiguous again
        lambda: _gemma_rms_norm(_transposed(4, 3, 8), npu(8)),
    ),
}


def _card_case(shape, dtype=torch.float32, weight_dtype=None, scaling="plain", inference=False, transposed=False):
    """The card's `rms_norm` forward and backward on x of `shape` (its reason on the same inputs).

    `inference`: the forward alone in inference mode, where a zero-centred norm may run as one npu_gemma_rms_norm;
    `transposed`: x is a transpose of its first two dims' memory.
    """

    def make(card):
        x = _transposed(*shape, dtype=dtype) if transposed else npu(*shape, dtype=dtype)
        weight = npu(*shape[-1:], dtype=weight_dtype or dtype)
        if inference:

            def run():
                with torch.inference_mode():
                    card.rms_norm(x, weight, 1e-6, scaling)

        else:
            x.requires_grad_(), weight.requires_grad_()

            def run():
                card.rms_norm(x, weight, 1e-6, scaling).float().pow(2).sum().backward()

        return run, lambda: card.rms_norm_unavailable_reason(x, weight, scaling)

    return make


LIMITS = {
    "2-D x (npu_rms_norm's fewest dims)": _card_case((4, 8)),
    "1-D x (one dim fewer)": _card_case((8,)),
    "8-D x (the most dims)": _card_case((*ONES_8D, 8)),
    "9-D x (one dim more)": _card_case((*ONES_8D, 1, 8)),
    "one row": _card_case((1, 8)),
    "no rows (empty x)": _card_case((0, 8)),
    "float32 weight with bfloat16 x (float32_scale: a pair of the dtype table)": _card_case(
        (4, 8), BF16, torch.float32, "float32_scale"
    ),
    "float16 weight with bfloat16 x (float32_scale: not a pair)": _card_case((4, 8), BF16, F16, "float32_scale"),
    "1 + weight in float32 with bfloat16 x (zero_centered)": _card_case((4, 8), BF16, BF16, "zero_centered"),
    "float64 x (not a dtype of the op)": _card_case((4, 8), F64),
    "zero_centered in inference (one npu_gemma_rms_norm)": _card_case(
        (4, 8), BF16, scaling="zero_centered", inference=True
    ),
    "zero_centered in inference, x a transpose of its memory (the q/k norms')": _card_case(
        (2, 3, 4, 8), BF16, scaling="zero_centered", inference=True, transposed=True
    ),
    "zero_centered in inference, float32 weight with bfloat16 x (not a pair of npu_gemma_rms_norm)": _card_case(
        (4, 8), BF16, torch.float32, "zero_centered", inference=True
    ),
    "zero_centered in inference, 1-D x (npu_gemma_rms_norm takes it, npu_rms_norm does not)": _card_case(
        (8,), BF16, scaling="zero_centered", inference=True
    ),
}


def norm_tensors(widths: Widths, generator: torch.Generator, scaling: str) -> dict[str, torch.Tensor]:
    """x [1, tokens, hidden] and a weight as a model of `scaling` holds it (near 0 for zero_centered, else near 1)."""
    return {
        "x": randn(1, widths.tokens, widths.hidden, generator=generator, scale=3.0),
        "weight": randn(widths.hidden, generator=generator, scale=0.5) + (0.0 if scaling == "zero_centered" else 1.0),
    }


def _norm_form(scaling: str, layer: str, inference: bool = False) -> Form:
    return Form(
        layers=(layer,),
        make=lambda widths, generator: norm_tensors(widths, generator, scaling),
        fused=lambda card, t: card.rms_norm(t["x"], t["weight"], EPS, scaling),
        eager=lambda card, t: card.rms_norm_eager(t["x"], t["weight"], EPS, scaling),
        reason=lambda card, t: card.rms_norm_unavailable_reason(t["x"], t["weight"], scaling, one_kernel=inference),
        grads=() if inference else ("x", "weight"),
        kept={"weight": torch.float32} if scaling == "float32_scale" else {},
        inference=inference,
    )


EPS = 1e-6
FORMS = {
    "plain": _norm_form("plain", "RMSNorm"),
    "zero_centered (1 + weight)": _norm_form("zero_centered", "RMSNormZeroCentered"),
    "zero_centered in inference (npu_gemma_rms_norm)": _norm_form("zero_centered", "RMSNormZeroCentered", True),
    "float32_scale (float32 weight)": _norm_form("float32_scale", "RMSNormFloat32Scale"),
}
