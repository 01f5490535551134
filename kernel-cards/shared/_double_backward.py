"""Eager's second-order gradients for a fused op's output (the build copies this file into the cards that list it).

A fused op's backward on the device is another op with no derivative of its own (op-plugin's derivatives.yaml has
none for npu_rms_norm_backward, npu_rotary_mul_backward, npu_swiglu_backward, npu_cross_entropy_loss_backward, ...):
in a backward that autograd records (`create_graph=True`: gradient penalties, Hessian-vector products), torch_npu's
autograd fallback gives that op's outputs a node that warns and passes no gradient, so second-order gradients would
be silently wrong. `with_eager_double_backward` keeps the op's own backward for every plain backward and, in a
recorded one, differentiates eager's math on the same inputs instead, so the second order is eager's.

Under a torch.func transform (grad, vmap, jvp, ...) the autograd Function it applies cannot be transformed (it marks
its outputs dirty, which vmap's generated rule refuses, and its backward calls autograd itself), so there it returns
eager's math on the inputs, which torch.func transforms as it does eager's: the cards' layers run eager under a
transform anyway, saying why (`_npu.npu_unavailable_reason`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._internals import functorch_transform
from ._npu import keepable


def with_eager_double_backward(
    fused: torch.Tensor | tuple[torch.Tensor, ...], eager: Callable[..., object], *inputs: torch.Tensor | None
):
    """Return `fused` as it is, with eager's gradient where autograd records the backward.

    `fused` is the fused op's output, a tensor or a tuple of them, computed from `inputs`. Its gradient is the fused
    op's in a plain backward and, in a backward autograd records, that of `eager(*inputs)` (the same structure as
    `fused`), differentiable. Under a torch.func transform that records this forward, `eager(*inputs)` is returned
    in its place (the module's docstring says why). Costs nothing unless autograd records this forward."""
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in inputs):
        return fused
    if functorch_transform() is not None:
        out = eager(*inputs)
        if isinstance(fused, torch.Tensor):
            return out
        return (out,) if isinstance(out, torch.Tensor) else tuple(out)
    outputs = (fused,) if isinstance(fused, torch.Tensor) else tuple(fused)
    inputs = tuple(t if t is None else keepable(t) for t in inputs)
    result = _EagerWhenRecorded.apply(eager, len(outputs), *outputs, *inputs)
    if isinstance(fused, torch.Tensor):
        return result
    return tuple(result) if len(outputs) > 1 else (result,)


class _EagerWhenRecorded(torch.autograd.Function):
    """The identity on the fused outputs, with eager's math in a backward autograd records.

    Its backward hands the gradient to the fused op's node, or, recorded, to eager's math on the inputs (and none to the
    fused op's node, whose backward has no derivative). The outputs are the fused tensors themselves, marked dirty (as
    an in-place op marks them), not views made inside the Function: PyTorch refuses in-place edits of such views, and
    transformers' code (Mixtral's router jitter, OLMoE's clip_qkv) and users' hooks edit a norm's output in place."""

    @staticmethod
    def forward(ctx, eager, count: int, *tensors):
        ctx.eager, ctx.count = eager, count
        outputs, inputs = tensors[:count], tensors[count:]
        ctx.none_inputs = [t is None for t in inputs]
        ctx.save_for_backward(*(t for t in inputs if t is not None))
        ctx.mark_dirty(*outputs)
        return outputs if count > 1 else outputs[0]

    @staticmethod
    def backward(ctx, *grads):
        inputs_given = len(ctx.none_inputs)
        if not torch.is_grad_enabled():  # a plain backward: the fused op's own
            return None, None, *grads, *([None] * inputs_given)
        saved = iter(ctx.saved_tensors)
        # aliases: each input a graph node of its own, so that an input computed from another (routing weights from
        # the hidden states) gets only its own partial derivative, which autograd then carries back through its graph
        inputs = [None if none else _alias(next(saved)) for none in ctx.none_inputs]
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        out = ctx.eager(*inputs)
        outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad]
        found = torch.autograd.grad(
            [o for o, _ in pairs], wanted, [g for _, g in pairs], create_graph=True, allow_unused=True
        )
        by_input = dict(zip(map(id, wanted), found, strict=True))
        return None, None, *([None] * ctx.count), *(None if t is None else by_input.get(id(t)) for t in inputs)


def _alias(t: torch.Tensor) -> torch.Tensor:
    """`t` as a view of itself: a new node of the graph, differentiable back to `t`."""
    return t.view_as(t)
