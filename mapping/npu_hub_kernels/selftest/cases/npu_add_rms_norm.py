"""npu-add-rms-norm's cases: its ops' rules (`CASES`), the card at and just past each limit (`LIMITS`), its forms.

npu_add_rms_norm's and npu_rms_norm_backward's rules; npu_rms_norm_backward's rules hold both for the op called
directly and in npu_rms_norm's autograd node (the gamma-rank case shows the node refusing what the forward accepts).
"""

from __future__ import annotations

import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.helium.modeling_helium import HeliumRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from ..forms import HALF_DTYPES, Form, Widths, randn
from . import npu, torch_npu
from .npu_rms_norm import EPS, norm_tensors

BF16, F16, F64 = torch.bfloat16, torch.float16, torch.float64
ONES_8D = (1, 1, 1, 1, 1, 1, 2)


def _add_rms_norm(x1, x2, gamma, epsilon: float = 1e-6) -> None:
    torch_npu.npu_add_rms_norm(x1, x2, gamma, epsilon)


def _backward(dy, x, gamma, rstd) -> None:
    torch_npu.npu_rms_norm_backward(dy, x, gamma, rstd)


def _rms_norm_backward_through_autograd(x, gamma) -> None:
    """npu_rms_norm forward, then its autograd node: npu_rms_norm_backward(grad, self, gamma, result1)."""
    y, _ = torch_npu.npu_rms_norm(x.requires_grad_(), gamma.requires_grad_())
    y.float().pow(2).sum().backward()


def _rows(*shape, dtype=torch.float32):
    """(dy, x, gamma over the last dim, rstd as npu_rms_norm returns it) for x of `shape`."""
    return npu(*shape, dtype=dtype), npu(*shape, dtype=dtype), npu(shape[-1], dtype=dtype), npu(*shape[:-1], 1)


CASES = {
    "npu_add_rms_norm/x1-dtype": (
        lambda: _add_rms_norm(npu(4, 8, dtype=BF16), npu(4, 8, dtype=BF16), npu(8, dtype=BF16)),
        lambda: _add_rms_norm(npu(4, 8, dtype=F64), npu(4, 8, dtype=F64), npu(8, dtype=F64)),
    ),
    "npu_add_rms_norm/x2-dtype": (
        lambda: _add_rms_norm(npu(4, 8, dtype=F16), npu(4, 8, dtype=F16), npu(8, dtype=F16)),
        lambda: _add_rms_norm(npu(4, 8, dtype=F16), npu(4, 8), npu(8, dtype=F16)),
    ),
    "npu_add_rms_norm/gamma-dtype": (
        lambda: _add_rms_norm(npu(4, 8), npu(4, 8), npu(8)),
        lambda: _add_rms_norm(npu(4, 8, dtype=BF16), npu(4, 8, dtype=BF16), npu(8)),  # unlike npu_rms_norm
    ),
    "npu_add_rms_norm/x1-rank": (
        lambda: _add_rms_norm(npu(8), npu(8), npu(8)),  # 1-D is taken, unlike npu_rms_norm
        lambda: _add_rms_norm(npu(*ONES_8D, 1, 8), npu(*ONES_8D, 1, 8), npu(8)),
    ),
    "npu_add_rms_norm/x1-nonempty": (
        lambda: _add_rms_norm(npu(1, 8), npu(1, 8), npu(8)),
        lambda: _add_rms_norm(npu(0, 8), npu(0, 8), npu(8)),
    ),
    "npu_add_rms_norm/x2-nonempty": (
        lambda: _add_rms_norm(npu(1, 8), npu(1, 8), npu(8)),
        lambda: _add_rms_norm(npu(1, 8), npu(0, 8), npu(8)),
    ),
    "npu_add_rms_norm/gamma-nonempty": (
        lambda: _add_rms_norm(npu(1, 8), npu(1, 8), npu(8)),
        lambda: _add_rms_norm(npu(1, 8), npu(1, 8), npu(0)),
    ),
    "npu_add_rms_norm/x2-shape": (
        lambda: _add_rms_norm(npu(4, 8), npu(4, 8), npu(8)),
        lambda: _add_rms_norm(npu(4, 8), npu(1, 8), npu(8)),  # no broadcasting
    ),
    "npu_add_rms_norm/gamma-rank": (
        lambda: _add_rms_norm(npu(2, 4, 8), npu(2, 4, 8), npu(4, 8)),
        lambda: _add_rms_norm(npu(2, 8), npu(2, 8), torch.tensor(1.0).to("npu")),
    ),
    "npu_add_rms_norm/gamma-shape": (
        lambda: _add_rms_norm(npu(4, 8), npu(4, 8), npu(8)),
        lambda: _add_rms_norm(npu(4, 8), npu(4, 8), npu(4)),
    ),
    "npu_add_rms_norm/epsilon-nonnegative": (
        lambda: _add_rms_norm(npu(4, 8), npu(4, 8), npu(8), epsilon=0.0),
        lambda: _add_rms_norm(npu(4, 8), npu(4, 8), npu(8), epsilon=-1e-6),
    ),
    "npu_rms_norm_backward/dy-dtype": (
        lambda: _backward(*_rows(4, 8, dtype=BF16)),
        lambda: _backward(*_rows(4, 8, dtype=F64)),
    ),
    "npu_rms_norm_backward/x-dtype": (
        lambda: _backward(*_rows(4, 8, dtype=F16)),
        lambda: _backward(npu(4, 8), npu(4, 8, dtype=F16), npu(8), npu(4, 1)),
    ),
    "npu_rms_norm_backward/gamma-dtype": (
        lambda: _backward(npu(4, 8, dtype=BF16), npu(4, 8, dtype=BF16), npu(8), npu(4, 1)),  # float32 gamma
        lambda: _backward(npu(4, 8, dtype=BF16), npu(4, 8, dtype=BF16), npu(8, dtype=F16), npu(4, 1)),
    ),
    "npu_rms_norm_backward/rstd-dtype": (
        lambda: _backward(*_rows(4, 8)),
        lambda: _backward(npu(4, 8), npu(4, 8), npu(8), npu(4, 1, dtype=BF16)),
    ),
    "npu_rms_norm_backward/dy-rank": (
        lambda: _rms_norm_backward_through_autograd(npu(*ONES_8D, 8), npu(8)),
        lambda: _backward(npu(8), npu(8), npu(8), npu(1)),
    ),
    "npu_rms_norm_backward/x-shape": (
        lambda: _backward(*_rows(3, 8)),
        lambda: _backward(npu(4, 8), npu(3, 8), npu(8), npu(3, 1)),
    ),
    "npu_rms_norm_backward/gamma-rank": (
        lambda: _rms_norm_backward_through_autograd(npu(2, 3, 4, 8), npu(3, 4, 8)),
        # npu_rms_norm takes an 8-D gamma over an 8-D x; its backward does not
        lambda: _rms_norm_backward_through_autograd(npu(*ONES_8D, 8), npu(*ONES_8D, 8)),
    ),
    "npu_rms_norm_backward/gamma-shape": (
        lambda: _backward(*_rows(4, 8)),
        lambda: _backward(npu(4, 8), npu(4, 8), npu(4), npu(4, 1)),
    ),
    "npu_rms_norm_backward/rstd-shape": (
        lambda: _backward(npu(4, 8), npu(4, 8), npu(8), npu(4)),  # rstd as the doc writes it, x's leading dims
        lambda: _backward(npu(4, 8), npu(4, 8), npu(8), npu(4, 8)),
    ),
}

NORMS = {"plain": LlamaRMSNorm, "zero_centered": GemmaRMSNorm, "float32_scale": HeliumRMSNorm}


def _card_case(shape, dtype=torch.float32, scaling="plain", weight_dtype=None, eps=1e-6):
    """The card's `add_rms_norm` forward and backward on inputs of `shape` (its reason on the same inputs)."""

    def make(card):
        residual, update = (npu(*shape, dtype=dtype, grad=True) for _ in range(2))
        norm = NORMS[scaling](shape[-1], eps=eps).to(weight_dtype or dtype).to("npu")
        family = type(norm).__module__

        def run():
            normed, summed = card.add_rms_norm(residual, update, norm, scaling, family)
            (normed.float().pow(2).sum() + summed.float().sum()).backward()

        return run, lambda: card.add_rms_norm_unavailable_reason(residual, update, norm, scaling, family)

    return make


LIMITS = {
    "2-D input (npu_rms_norm_backward's fewest dims)": _card_case((4, 8)),
    "1-D input (npu_add_rms_norm takes it, its backward npu_rms_norm_backward does not)": _card_case((8,)),
    "8-D input (the most dims)": _card_case((*ONES_8D, 8)),
    "9-D input (one dim more)": _card_case((*ONES_8D, 1, 8)),
    "one row": _card_case((1, 8)),
    "no rows (empty inputs)": _card_case((0, 8)),
    "epsilon 0 (the least npu_add_rms_norm takes)": _card_case((4, 8), eps=0.0),
    "negative epsilon": _card_case((4, 8), eps=-1e-6),
    "float32 weight with float32 input (float32_scale)": _card_case((4, 8), scaling="float32_scale"),
    "float32 weight with bfloat16 input (float32_scale: gamma takes the input dtype)": _card_case(
        (4, 8), BF16, "float32_scale", torch.float32
    ),
    "1 + weight in float32 (zero_centered)": _card_case((4, 8), scaling="zero_centered"),
    "1 + weight with bfloat16 input (zero_centered)": _card_case((4, 8), BF16, "zero_centered"),
    "float64 input (not a dtype of the op)": _card_case((4, 8), F64),
}


def _norm(scaling: str, weight: torch.Tensor) -> torch.nn.Module:
    """The transformers norm of `scaling` holding `weight` itself."""
    norm = NORMS[scaling](1, eps=EPS)
    norm.weight = weight if isinstance(weight, torch.nn.Parameter) else torch.nn.Parameter(weight, requires_grad=False)
    return norm


def _add_norm_form(scaling: str, layer: str, dtypes: tuple[torch.dtype, ...] = HALF_DTYPES) -> Form:
    def make(widths: Widths, generator: torch.Generator) -> dict[str, torch.Tensor]:
        tensors = norm_tensors(widths, generator, scaling)
        update = randn(1, widths.tokens, widths.hidden, generator=generator)
        return {"residual": tensors.pop("x"), "update": update, **tensors}

    def fused(card, t):
        norm = _norm(scaling, t["weight"])
        return card.add_rms_norm(t["residual"], t["update"], norm, scaling, type(norm).__module__)

    def reason(card, t):
        norm = _norm(scaling, t["weight"])
        return card.add_rms_norm_unavailable_reason(t["residual"], t["update"], norm, scaling, type(norm).__module__)

    return Form(
        layers=(layer,),
        make=make,
        fused=fused,
        eager=lambda card, t: card.add_rms_norm_eager(t["residual"], t["update"], _norm(scaling, t["weight"])),
        reason=reason,
        grads=("residual", "update", "weight"),
        kept={"weight": torch.float32} if scaling == "float32_scale" else {},
        dtypes=dtypes,
    )


FORMS = {
    "plain": _add_norm_form("plain", "DecoderLayer"),
    # the op takes gamma in the input dtype: these two fuse in float32 only (the card's reasons say so otherwise)
    "zero_centered (1 + weight)": _add_norm_form("zero_centered", "DecoderLayerZeroCentered", (torch.float32,)),
    "float32_scale (float32 weight)": _add_norm_form("float32_scale", "DecoderLayerFloat32Scale", (torch.float32,)),
}
