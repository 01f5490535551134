"""Autograd for emulated ops that keeps for backward what the real op keeps: its inputs, not float32 intermediates.

The float32 intermediates of the emulation's math are not kept, so memory measured on the emulation means what it
means on a device.

`keeping_inputs(math, *inputs)` runs `math(*inputs)` without recording it, saves the inputs alone, and in
backward runs `math` again on them under autograd: the same float32 ops, so the same gradients as autograd
through `math` would give, from what torch_npu's generated autograd node keeps (op-plugin derivatives.yaml).
With `check_backward`, backward first calls `check_backward(grad, *inputs)` on the kept inputs: the backward op's
own limits (its ledger rules), checked on what the op's autograd node hands that op.

`device_backward(op)` decorates an emulated op's autograd backward with what the device does when autograd records
that backward (`create_graph=True`): the backward op (`op`, e.g. npu_rms_norm_backward) has no derivative of its own
(no derivatives.yaml entry), so torch_npu's autograd fallback (Ascend/pytorch
`torch_npu/csrc/aten/VariableFallbackKernel.cpp`, PyTorch's "warn" mode) gives its outputs a node that, in the
second backward, warns and passes no gradient. The first-order gradients are the op's; the second order through
them is missing, silently but for the warning, as on the device. Where no gradient reaches an op's output, its
backward op does not run (the nodes set `ctx.set_materialize_grads(False)`, as torch's generated nodes skip an
undefined gradient), so a card that routes a recorded backward elsewhere leaves no warning behind.

`without_derivative(op, result, *sources)` is that fallback for a forward op with no derivative at all
(npu_gemma_rms_norm): its result warns in backward and passes its sources no gradient.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch


def device_backward(op: str) -> Callable:
    """Decorate an autograd Function's `backward(ctx, *grads)` that runs the device op `op`, as the device runs it.

    The backward is computed without recording, and, when autograd records it, its tensor results are wrapped as
    torch_npu's fallback wraps an op without a derivative (see the module's docstring).
    """

    def decorate(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if all(grad is None for grad in grads):  # no gradient reaches the op: its backward op does not run
                return (None,) * len(ctx.needs_input_grad)
            if not torch.is_grad_enabled():  # a plain backward (the saved tensors are unpacked once: checkpointing)
                return backward(ctx, *grads)
            sources = [t for t in (*grads, *ctx.saved_tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
            with torch.no_grad():
                results = backward(ctx, *grads)
            if not sources:
                return results
            single = not isinstance(results, tuple)
            wrapped = tuple(
                _NoDerivative.apply(op, t, *sources) if isinstance(t, torch.Tensor) else t
                for t in ((results,) if single else results)
            )
            return wrapped[0] if single else wrapped

        return wrapper

    return decorate


def without_derivative(op: str, result: torch.Tensor, *sources: torch.Tensor) -> torch.Tensor:
    """`result` of the device op `op`, which has no derivative, as torch_npu's autograd fallback hands it back.

    Where autograd records and a source requires grad, the result gets a node that warns and passes no gradient to
    the sources (PyTorch's "warn" mode); else it is returned as it is.
    """
    needing = [t for t in sources if t.requires_grad]
    if not torch.is_grad_enabled() or not needing:
        return result
    return _NoDerivative.apply(op, result, *needing)


class _NoDerivative(torch.autograd.Function):
    """A result of `op` computed in a recorded backward, whose own backward warns and passes no gradient.

    It is connected to the backward's inputs that require grad, as torch_npu's fallback connects it; differentiating
    through it warns and gives them nothing.
    """

    @staticmethod
    def forward(ctx, op: str, result: torch.Tensor, *sources: torch.Tensor) -> torch.Tensor:
        ctx.op, ctx.sources = op, len(sources)
        return result.view_as(result)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        warnings.warn(
            f"{ctx.op}: an autograd kernel was not registered to the AutogradPrivateUse1 key, but we are trying to "
            "backprop through it (torch_npu's autograd fallback): no gradient flows through it, so these "
            "second-order gradients are incomplete",
            stacklevel=2,
        )
        return None, None, *([None] * ctx.sources)


def keeping_inputs(
    math: Callable[..., torch.Tensor],
    *inputs: torch.Tensor,
    backward_op: str,
    check_backward: Callable[..., None] | None = None,
) -> torch.Tensor:
    """`math(*inputs)`, differentiable in every input, keeping only the inputs for backward.

    The backward is the device op `backward_op` (`device_backward`); it first runs `check_backward(grad, *inputs)`
    when given (it raises for a call the backward op refuses).
    """
    return _RecomputedFromInputs.apply(math, backward_op, check_backward, *inputs)


class _RecomputedFromInputs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, math: Callable[..., torch.Tensor], backward_op: str, check_backward: Callable[..., None] | None,
        *inputs: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        ctx.set_materialize_grads(False)  # an unused output: no gradient, no backward op run
        ctx.math, ctx.backward_op = math, backward_op
        ctx.check_backward = check_backward
        ctx.save_for_backward(*inputs)
        return math(*inputs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return device_backward(ctx.backward_op)(_recomputed_backward)(ctx, grad)


def _recomputed_backward(ctx, grad: torch.Tensor):
    """The recomputing backward of `keeping_inputs`: the float32 forward again on the kept inputs, under autograd."""
    kept = ctx.saved_tensors
    if ctx.check_backward is not None:
        ctx.check_backward(grad, *kept)
    needs = ctx.needs_input_grad[3:]
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(need) for t, need in zip(kept, needs, strict=True)]
        out = ctx.math(*leaves)
    grads = iter(torch.autograd.grad(out, [leaf for leaf in leaves if leaf.requires_grad], grad.detach()))
    return None, None, None, *(next(grads) if need else None for need in needs)
