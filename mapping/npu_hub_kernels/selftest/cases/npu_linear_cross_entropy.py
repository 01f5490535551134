"""Ledger cases of npu_cross_entropy_loss, its backward and addmm.dtype_out, and the loss card's limits.

addmm.dtype_out is the weight gradient's 16-bit product into a float32 sum."""

from __future__ import annotations

import torch

from ..forms import ALL_LAYERS, Form, Widths, linear, randn
from . import made_at_first_use, npu, npu_int, on_cann, torch_npu

loss = torch_npu.npu_cross_entropy_loss
backward = torch_npu.npu_cross_entropy_loss_backward


def _loss(rows: int = 4, classes: int = 6, dtype=torch.float32, grad: bool = False, target=None, **kwargs):
    def call():
        x = npu(rows, classes, dtype=dtype, grad=grad)
        return loss(x, npu_int(classes, rows) if target is None else target, **kwargs)

    return call


def _backward(dtype=torch.float32, grad_dtype=None, reduction: str = "none", **change):
    """The backward's call on the log-probabilities of a [4, 6] forward (what the card passes), with `change`."""

    def call():
        log_prob = torch.log_softmax(torch.randn(4, 6), -1).to(dtype).to("npu")
        grad_shape = (4,) if reduction == "none" else (1,)
        args = {"grad_loss": npu(*grad_shape, dtype=grad_dtype or dtype), "log_prob": log_prob,
                "target": npu_int(6, 4)} | change  # fmt: skip
        return backward(**args, reduction=reduction)

    return call


BF16 = (torch.bfloat16, torch.bfloat16)


def _addmm(mats=BF16, out_dtype=torch.float32, k2: int = 5, self_shape=(4, 3), self_dtype=None, out=None, cann=None):
    """A call of `torch.addmm(self, mat1, mat2, out_dtype=, out=)`, into self itself unless `out` (dtype, shape).

    mat1 is [4, 5] (a transposed view, as the card's), mat2 [k2, 3]."""

    def call():
        mat1, mat2 = npu(5, 4, dtype=mats[0]).t(), npu(k2, 3, dtype=mats[1])
        self = npu(*self_shape, dtype=self_dtype or out_dtype)
        into = self if out is None else npu(*out[1], dtype=out[0])
        with on_cann(cann):
            return torch.addmm(self, mat1, mat2, out_dtype=out_dtype, out=into)

    return call


def _cases() -> dict:
    """`CASES`, made at first use (`made_at_first_use`): some of its calls take npu tensors made once."""
    return {
        "npu_cross_entropy_loss/input-rank": (_loss(), lambda: loss(npu(2, 4, 6), npu_int(6, 2))),
        "npu_cross_entropy_loss/input-dtype": (_loss(dtype=torch.bfloat16), _loss(dtype=torch.float64)),
        "npu_cross_entropy_loss/classes": (_loss(classes=1), lambda: loss(npu(4, 0), npu_int(1, 4))),
        "npu_cross_entropy_loss/rows": (_loss(rows=200_000, classes=1), _loss(rows=200_001, classes=1)),
        "npu_cross_entropy_loss/target": (_loss(), _loss(target=npu_int(6, 4, dtype=torch.int32))),
        "npu_cross_entropy_loss/weight": (_loss(weight=torch.rand(6).to("npu")), _loss(weight=npu(6).double())),
        "npu_cross_entropy_loss/weight-range": (
            _loss(weight=torch.ones(6).to("npu")), _loss(weight=torch.full((6,), 1.5).to("npu")),
        ),
        "npu_cross_entropy_loss/reduction": (_loss(reduction="sum"), _loss(reduction="batchmean")),
        "npu_cross_entropy_loss/ignore-index": (
            _loss(ignore_index=5, reduction="sum"), _loss(ignore_index=6, reduction="sum"),
        ),
        "npu_cross_entropy_loss/label-smoothing": (_loss(label_smoothing=0.5), _loss(label_smoothing=1.0)),
        "npu_cross_entropy_loss/zloss": (_loss(return_zloss=False), _loss(return_zloss=True)),
        "npu_cross_entropy_loss/target-range": (
            _loss(target=torch.tensor([0, 5, 2, 2]).to("npu"), ignore_index=2),
            _loss(target=torch.tensor([0, 5, -100, 2]).to("npu")),
        ),
        "npu_cross_entropy_loss/grad-mean-defaults": (
            _loss(grad=True, reduction="sum", ignore_index=1), _loss(grad=True, ignore_index=1),
        ),
        "npu_cross_entropy_loss/grad-label-smoothing": (
            _loss(label_smoothing=0.1, reduction="sum"), _loss(grad=True, reduction="sum", label_smoothing=0.1),
        ),
        "npu_cross_entropy_loss_backward/log-prob": (_backward(), _backward(log_prob=npu(4, 6).double())),
        "npu_cross_entropy_loss_backward/grad-loss-dtype": (
            _backward(dtype=torch.bfloat16), _backward(dtype=torch.float32, grad_dtype=torch.bfloat16),
        ),
        "npu_cross_entropy_loss_backward/grad-loss-shape": (_backward(reduction="mean"), _backward(grad_loss=npu(1))),
        "npu_cross_entropy_loss_backward/target": (_backward(), _backward(target=npu_int(6, 5))),
        "npu_cross_entropy_loss_backward/target-range": (_backward(), _backward(target=torch.full((4,), 6).to("npu"))),
        "npu_cross_entropy_loss_backward/weight": (
            _backward(weight=torch.rand(6).to("npu")), _backward(weight=torch.rand(5).to("npu")),
        ),
        "npu_cross_entropy_loss_backward/label-smoothing": (_backward(), _backward(label_smoothing=0.1)),
        "npu_cross_entropy_loss_backward/reduction": (_backward(reduction="sum"), _backward(reduction="max")),
        "npu_cross_entropy_loss_backward/zloss": (
            _backward(grad_zloss=npu(0)), _backward(lse_square_scale_for_zloss=0.5),
        ),
        "addmm.dtype_out/mats": (_addmm(), _addmm(k2=6)),
        "addmm.dtype_out/self-shape": (
            _addmm(self_shape=(3,), out=(torch.float32, (4, 3))),
            _addmm(self_shape=(4, 2), out=(torch.float32, (4, 3))),
        ),
        "addmm.dtype_out/mats-dtype": (_addmm(mats=(torch.float16,) * 2), _addmm(mats=(torch.bfloat16, torch.float16))),
        "addmm.dtype_out/out-dtype": (_addmm(), _addmm(mats=(torch.float32,) * 2, out_dtype=torch.bfloat16)),
        "addmm.dtype_out/out": (_addmm(), _addmm(out=(torch.float16, (4, 3)))),
        "addmm.dtype_out/self-dtype": (
            _addmm(out=(torch.float32, (4, 3))), _addmm(self_dtype=torch.float16, out=(torch.float32, (4, 3))),
        ),
        "addmm.dtype_out/cann": (_addmm(cann="9.1.0"), _addmm(cann="9.1.0-beta.3")),
    }  # fmt: skip


__getattr__ = made_at_first_use(globals(), CASES=_cases)


def _linear_cross_entropy(tokens: int, vocab: int = 8, hidden: int = 4, dtype=torch.float32, chunk=None, grad=True):
    """A LIMITS case: the card's fused loss of `tokens` tokens (one sequence), forward and, with `grad`, backward."""

    def make(card):
        lm_head = torch.nn.Linear(hidden, vocab, bias=False).to(dtype).to("npu").requires_grad_(grad)
        hidden_states = npu(1, tokens, hidden, dtype=dtype, grad=grad)
        labels = npu_int(vocab, 1, tokens)

        def run():
            out, _ = card.linear_cross_entropy(hidden_states, lm_head, labels, vocab, chunk_tokens=chunk)
            if grad:
                out.backward()

        return run, lambda: card.linear_cross_entropy_unavailable_reason(hidden_states, lm_head, labels, vocab)

    return make


LIMITS = {
    "bfloat16, the log-probability form": _linear_cross_entropy(16, dtype=torch.bfloat16),
    "bfloat16, the chunked form (grad_loss in log_prob's dtype)": _linear_cross_entropy(
        16, dtype=torch.bfloat16, chunk=4
    ),
    "float16, the chunked form": _linear_cross_entropy(16, dtype=torch.float16, chunk=4),
    "200,000 tokens in one chunk (at the row limit)": _linear_cross_entropy(200_000, vocab=2, hidden=2, chunk=200_000),
    "200,001 tokens, chunked form asked for more rows (past it)": _linear_cross_entropy(
        200_001, vocab=2, hidden=2, chunk=300_000
    ),
    "200,001 tokens, no gradient: the log-probability form (past it)": _linear_cross_entropy(
        200_001, vocab=2, hidden=2, grad=False
    ),
    "float64 (outside the op's dtypes)": _linear_cross_entropy(16, dtype=torch.float64),
}


MAX_FORM_VOCAB = 16384
"""The vocabulary a form's LM head has at most: the op's math is per row over the vocabulary, and a float64
reference of Llama-3's 128,256 x 4,096 head (and its gradient) would take 8 GB of host memory."""
MAX_CHUNKED_VOCAB = 2048
"""The chunked form's, whose 2 x hidden tokens make its float64 reference's matmuls long (0.4 TFLOP at 4,096)."""


def _loss_form(chunked: bool) -> Form:
    """The fused loss of the LM head: chunked (at least 2 x hidden tokens, where the card chunks) or on its logits."""

    def _vocab(widths: Widths) -> int:
        return min(widths.vocab, MAX_CHUNKED_VOCAB if chunked else MAX_FORM_VOCAB)

    def make(widths: Widths, generator: torch.Generator) -> dict[str, torch.Tensor]:
        vocab, tokens = _vocab(widths), widths.tokens
        labels = torch.randint(0, vocab, (1, tokens), generator=generator)
        labels[0, : tokens // 8] = -100  # a prompt's ignored tokens, as in SFT
        return {
            "hidden_states": randn(1, tokens, widths.hidden, generator=generator),
            "lm_head": randn(vocab, widths.hidden, generator=generator, scale=widths.hidden**-0.5),
            "labels": labels,
        }

    def call(function: str):
        def loss(card, t):
            out = getattr(card, function)(t["hidden_states"], linear(t["lm_head"]), t["labels"], t["lm_head"].shape[0])
            return out[0]

        return loss

    return Form(
        layers=ALL_LAYERS,
        make=make,
        fused=call("linear_cross_entropy"),
        eager=call("linear_cross_entropy_eager"),
        reason=lambda card, t: card.linear_cross_entropy_unavailable_reason(
            t["hidden_states"], linear(t["lm_head"]), t["labels"], t["lm_head"].shape[0]
        ),
        grads=("hidden_states", "lm_head"),
        tokens=(lambda widths: 2 * widths.hidden) if chunked else None,
        flops=lambda widths: 6.0 * widths.tokens * _vocab(widths) * widths.hidden,
    )


FORMS = {"loss on the logits": _loss_form(chunked=False), "chunked loss (no logits)": _loss_form(chunked=True)}
