"""npu-swiglu's cases: its ops' rules (`CASES`), the card at and just past each limit (`LIMITS`), its forms.

The rules are npu_swiglu's, npu_swiglu_backward's, npu_geglu's and npu_geglu_grad's. The backward's refusals go through
the op's autograd node where its gradient can be wrong (`grad_fn.apply`, or `backward` with a non-contiguous
gradient), and through the op otherwise (what the node checks on x and dim, the forward has checked already).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..forms import Form, Widths, linear, randn
from . import npu, torch_npu

BF16, F64 = torch.bfloat16, torch.float64
ONES_8D = (1, 1, 1, 1, 1, 1, 2)


def _swiglu(x: torch.Tensor, dim: int = -1, grad: torch.Tensor | None = None) -> None:
    """npu_swiglu forward, and its backward with `grad` when given (x must require grad then)."""
    out = torch_npu.npu_swiglu(x, dim=dim)
    if grad is not None:
        out.backward(grad)


def _node(x: torch.Tensor, grad: torch.Tensor) -> None:
    """npu_swiglu's autograd node called with `grad` as is: torch_npu.npu_swiglu_backward(grad, self, dim)."""
    torch_npu.npu_swiglu(x.requires_grad_()).grad_fn.apply(grad)


def _geglu(x: torch.Tensor, dim: int = -1, approximate: int = 1, grad: torch.Tensor | None = None) -> None:
    """npu_geglu forward as the card calls it (GELU on the first half), and its backward with `grad` when given."""
    out, _ = torch_npu.npu_geglu(x, dim=dim, approximate=approximate, activate_left=True)
    if grad is not None:
        out.backward(grad)


def _geglu_node(x: torch.Tensor, grad: torch.Tensor) -> None:
    """npu_geglu's autograd node called with `grad` as is: torch_npu.npu_geglu_grad(grad, self, result1, ...)."""
    out, _ = torch_npu.npu_geglu(x.requires_grad_(), activate_left=True)
    out.grad_fn.apply(grad, None)


CASES = {
    "npu_swiglu/x-dtype": (
        lambda: _swiglu(npu(4, 8, dtype=BF16)),
        lambda: _swiglu(npu(4, 8, dtype=F64)),
    ),
    "npu_swiglu/x-rank": (
        lambda: _swiglu(npu(8)),
        lambda: _swiglu(npu(*ONES_8D, 1, 8)),
    ),
    "npu_swiglu/dim-range": (
        lambda: _swiglu(npu(4, 8), dim=-2),
        lambda: _swiglu(npu(4, 8), dim=2),
    ),
    "npu_swiglu/x-contiguous": (
        lambda: _swiglu(npu(6, 8)),
        lambda: _swiglu(npu(8, 6).t()),
    ),
    "npu_swiglu/x-nonempty": (
        lambda: _swiglu(npu(1, 8)),
        lambda: _swiglu(npu(0, 8)),
    ),
    "npu_swiglu/x-even": (
        lambda: _swiglu(npu(2, 4, 3), dim=1),
        lambda: _swiglu(npu(4, 7)),
    ),
    "npu_swiglu_backward/x-dtype": (
        lambda: _swiglu(npu(4, 8, dtype=BF16, grad=True), grad=npu(4, 4, dtype=BF16)),
        lambda: torch_npu.npu_swiglu_backward(npu(4, 4, dtype=F64), npu(4, 8, dtype=F64)),
    ),
    "npu_swiglu_backward/grad_output-dtype": (
        lambda: _node(npu(4, 8), npu(4, 4)),
        lambda: _node(npu(4, 8), npu(4, 4, dtype=BF16)),
    ),
    "npu_swiglu_backward/x-rank": (
        lambda: _swiglu(npu(*ONES_8D, 8, grad=True), grad=npu(*ONES_8D, 4)),
        lambda: torch_npu.npu_swiglu_backward(npu(*ONES_8D, 1, 4), npu(*ONES_8D, 1, 8)),
    ),
    "npu_swiglu_backward/dim-range": (
        lambda: _swiglu(npu(4, 8, grad=True), dim=0, grad=npu(2, 8)),
        lambda: torch_npu.npu_swiglu_backward(npu(4, 4), npu(4, 8), dim=2),
    ),
    "npu_swiglu_backward/x-nonempty": (
        lambda: torch_npu.npu_swiglu_backward(npu(1, 4), npu(1, 8)),
        lambda: torch_npu.npu_swiglu_backward(npu(0, 4), npu(0, 8)),
    ),
    "npu_swiglu_backward/grad_output-nonempty": (
        lambda: _node(npu(1, 8), npu(1, 4)),
        lambda: _node(npu(1, 8), npu(0, 4)),
    ),
    "npu_swiglu_backward/grad_output-shape": (
        lambda: _node(npu(4, 8), npu(4, 4)),
        lambda: _node(npu(4, 8), npu(4, 8)),
    ),
    "npu_swiglu_backward/grad_output-contiguous": (
        lambda: _swiglu(npu(4, 8, grad=True), grad=npu(4, 4)),
        lambda: _swiglu(npu(4, 8, grad=True), grad=npu(4, 4).t().contiguous().t()),
    ),
    "npu_geglu/x-dtype": (
        lambda: _geglu(npu(4, 8, dtype=BF16)),
        lambda: _geglu(npu(4, 8, dtype=F64)),
    ),
    "npu_geglu/x-rank": (
        lambda: _geglu(npu(*ONES_8D, 8)),
        lambda: _geglu(npu(*ONES_8D, 1, 8)),
    ),
    "npu_geglu/dim-range": (
        lambda: _geglu(npu(4, 8), dim=-2),
        lambda: _geglu(npu(4, 8), dim=2),
    ),
    "npu_geglu/approximate": (
        lambda: _geglu(npu(4, 8), approximate=1),
        lambda: _geglu(npu(4, 8), approximate=2),
    ),
    "npu_geglu/x-even": (
        lambda: _geglu(npu(2, 4, 3), dim=1),
        lambda: _geglu(npu(4, 7)),
    ),
    "npu_geglu_grad/grad_output-dtype": (
        lambda: torch_npu.npu_geglu_grad(npu(4, 4, dtype=BF16), npu(4, 8, dtype=BF16), npu(4, 4, dtype=BF16)),
        lambda: torch_npu.npu_geglu_grad(npu(4, 4, dtype=F64), npu(4, 8, dtype=F64), npu(4, 4, dtype=F64)),
    ),
    "npu_geglu_grad/x-dtype": (
        lambda: _geglu_node(npu(4, 8), npu(4, 4)),
        lambda: _geglu_node(npu(4, 8), npu(4, 4, dtype=BF16)),
    ),
    "npu_geglu_grad/x-rank": (
        lambda: _geglu(npu(*ONES_8D, 8, grad=True), grad=npu(*ONES_8D, 4)),
        lambda: torch_npu.npu_geglu_grad(npu(*ONES_8D, 1, 4), npu(*ONES_8D, 1, 8), npu(*ONES_8D, 1, 4)),
    ),
    "npu_geglu_grad/dim-range": (
        lambda: _geglu(npu(4, 8, grad=True), dim=0, grad=npu(2, 8)),
        lambda: torch_npu.npu_geglu_grad(npu(4, 4), npu(4, 8), npu(4, 4), dim=2),
    ),
    "npu_geglu_grad/approximate": (
        lambda: torch_npu.npu_geglu_grad(npu(4, 4), npu(4, 8), npu(4, 4), approximate=1),
        lambda: torch_npu.npu_geglu_grad(npu(4, 4), npu(4, 8), npu(4, 4), approximate=-1),
    ),
    "npu_geglu_grad/grad_output-shape": (
        lambda: _geglu_node(npu(4, 8), npu(4, 4)),
        lambda: _geglu_node(npu(4, 8), npu(4, 8)),
    ),
    "npu_geglu_grad/gelu-shape": (
        lambda: torch_npu.npu_geglu_grad(npu(4, 4), npu(4, 8), npu(4, 4)),
        lambda: torch_npu.npu_geglu_grad(npu(4, 4), npu(4, 8), npu(4, 1)),
    ),
}

HIDDEN, INNER = 8, 4


def _linear(inputs: int, outputs: int, dtype: torch.dtype) -> nn.Linear:
    return nn.Linear(inputs, outputs, bias=False).to(dtype).to("npu")


def _split_case(shape, dtype=torch.float32, op="swiglu"):
    """The card's split MLP, forward and backward on x of `shape`: `swiglu_mlp`, or with `op="geglu"` `geglu_mlp`.

    `geglu_mlp` is the GELU-tanh gate's."""

    def make(card):
        x = npu(*shape, dtype=dtype, grad=True)
        gate, up, down = _linear(HIDDEN, INNER, dtype), _linear(HIDDEN, INNER, dtype), _linear(INNER, HIDDEN, dtype)
        act = nn.GELU(approximate="tanh") if op == "geglu" else nn.SiLU()
        mlp, reason = getattr(card, f"{op}_mlp"), getattr(card, f"{op}_mlp_unavailable_reason")

        def run():
            mlp(x, gate, up, down, act).float().pow(2).sum().backward()

        return run, lambda: reason(x, gate, up, act)

    return make


def _gate_up_case(shape, dtype=torch.float32):
    """The card's `swiglu_gate_up_mlp` (one gate_up_proj) forward and backward on x of `shape`.

    (An odd number of features, which the card's reason refuses too, is no MLP eager computes either.)
    """

    def make(card):
        x = npu(*shape, dtype=dtype, grad=True)
        gate_up, down = _linear(HIDDEN, 2 * INNER, dtype), _linear(INNER, HIDDEN, dtype)
        act = nn.SiLU()

        def run():
            card.swiglu_gate_up_mlp(x, gate_up, down, act).float().pow(2).sum().backward()

        return run, lambda: card.swiglu_gate_up_mlp_unavailable_reason(x, gate_up, act)

    return make


LIMITS = {
    "gate_up: 1-D x (npu_swiglu's fewest dims)": _gate_up_case((HIDDEN,)),
    "gate_up: 8-D x (the most dims)": _gate_up_case((*ONES_8D, HIDDEN)),
    "gate_up: 9-D x (one dim more)": _gate_up_case((*ONES_8D, 1, HIDDEN)),
    "gate_up: one token": _gate_up_case((1, HIDDEN)),
    "gate_up: no tokens (empty x)": _gate_up_case((0, HIDDEN)),
    "gate_up: float64 (not a dtype of the op)": _gate_up_case((4, HIDDEN), F64),
    "split: 1-D x (as [1, H] rows: [2, 1, I] to the op)": _split_case((HIDDEN,)),
    "split: 9-D x (as rows: [2, T, I] to the op)": _split_case((*ONES_8D, 1, HIDDEN)),
    "split: one token": _split_case((1, HIDDEN)),
    "split: no tokens (empty x)": _split_case((0, HIDDEN)),
    "split: float64 (not a dtype of the op)": _split_case((4, HIDDEN), F64),
    "split: bfloat16": _split_case((4, HIDDEN), BF16),
    "geglu: 1-D x (as [1, H] rows: [2, 1, I] to the op)": _split_case((HIDDEN,), op="geglu"),
    "geglu: 9-D x (as rows: [2, T, I] to the op)": _split_case((*ONES_8D, 1, HIDDEN), op="geglu"),
    "geglu: one token": _split_case((1, HIDDEN), op="geglu"),
    "geglu: no tokens (empty x)": _split_case((0, HIDDEN), op="geglu"),
    "geglu: float64 (not a dtype of the op)": _split_case((4, HIDDEN), F64, op="geglu"),
    "geglu: bfloat16": _split_case((4, HIDDEN), BF16, op="geglu"),
}


def _mlp_tensors(widths: Widths, generator: torch.Generator, *names_and_shapes: tuple[str, int, int]):
    """x [1, tokens, hidden] and each named weight [out, in], scaled as a trained layer's (1 / sqrt(in))."""
    tensors = {"x": randn(1, widths.tokens, widths.hidden, generator=generator)}
    for name, out, inner in names_and_shapes:
        tensors[name] = randn(out, inner, generator=generator, scale=inner**-0.5)
    return tensors


def _mlp_flops(widths: Widths) -> float:
    """The MLP's three matmuls, forward (2 per multiply-add) and backward (4)."""
    return 6.0 * widths.tokens * 3 * widths.hidden * widths.intermediate


def _split_form(op: str, layer: str, activation: Callable[[], nn.Module]) -> Form:
    """The split MLP (gate_proj, up_proj, down_proj) through the card's `<op>_mlp`, with `activation` as its act_fn."""

    def make(widths, generator):
        hidden, inner = widths.hidden, widths.intermediate
        return _mlp_tensors(widths, generator, ("gate", inner, hidden), ("up", inner, hidden), ("down", hidden, inner))

    def call(function):
        return lambda card, t: getattr(card, function)(
            t["x"], linear(t["gate"]), linear(t["up"]), linear(t["down"]), activation()
        )

    return Form(
        layers=(layer,),
        make=make,
        fused=call(f"{op}_mlp"),
        eager=call(f"{op}_mlp_eager"),
        reason=lambda card, t: getattr(card, f"{op}_mlp_unavailable_reason")(
            t["x"], linear(t["gate"]), linear(t["up"]), activation()
        ),
        grads=("x", "gate", "up", "down"),
        flops=_mlp_flops,
    )


def _gate_up_form() -> Form:
    def make(widths, generator):
        hidden, inner = widths.hidden, widths.intermediate
        return _mlp_tensors(widths, generator, ("gate_up", 2 * inner, hidden), ("down", hidden, inner))

    def call(function):
        return lambda card, t: getattr(card, function)(t["x"], linear(t["gate_up"]), linear(t["down"]), nn.SiLU())

    return Form(
        layers=("SwiGLUGateUpMLP",),
        make=make,
        fused=call("swiglu_gate_up_mlp"),
        eager=call("swiglu_gate_up_mlp_eager"),
        reason=lambda card, t: card.swiglu_gate_up_mlp_unavailable_reason(t["x"], linear(t["gate_up"]), nn.SiLU()),
        grads=("x", "gate_up", "down"),
        flops=_mlp_flops,
    )


FORMS = {
    "split gate_proj / up_proj": _split_form("swiglu", "SwiGLUMLP", nn.SiLU),
    "one gate_up_proj": _gate_up_form(),
    "split GELU-tanh gate (Gemma)": _split_form("geglu", "GeGLUMLP", lambda: nn.GELU(approximate="tanh")),
}
