"""Autograd for emulated ops that keeps for backward what the real op keeps: its inputs, not the float32
intermediates of the emulation's math (so memory measured on the emulation means what it means on a device).

`keeping_inputs(math, *inputs)` runs `math(*inputs)` without recording it, saves the inputs alone, and in
backward runs `math` again on them under autograd: the same float32 ops, so the same gradients as autograd
through `math` would give, from what torch_npu's generated autograd node keeps (op-plugin derivatives.yaml).
With `check_backward`, backward first calls `check_backward(grad, *inputs)` on the kept inputs: the backward op's
own limits (its ledger rules), checked on what the op's autograd node hands that op.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable


def keeping_inputs(
    math: Callable[..., torch.Tensor],
    *inputs: torch.Tensor,
    check_backward: Callable[..., None] | None = None,
) -> torch.Tensor:
    """`math(*inputs)`, differentiable in every input, keeping only the inputs for backward; backward first runs
    `check_backward(grad, *inputs)` when given (it raises for a call the backward op refuses)."""
    return _RecomputedFromInputs.apply(math, check_backward, *inputs)


class _RecomputedFromInputs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, math: Callable[..., torch.Tensor], check_backward: Callable[..., None] | None, *inputs: torch.Tensor
    ) -> torch.Tensor:
        ctx.math = math
        ctx.check_backward = check_backward
        ctx.save_for_backward(*inputs)
        return math(*inputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        kept = ctx.saved_tensors
        if ctx.check_backward is not None:
            ctx.check_backward(grad, *kept)
        needs = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip(kept, needs, strict=True)]
            out = ctx.math(*leaves)
        grads = iter(torch.autograd.grad(out, [leaf for leaf in leaves if leaf.requires_grad], grad))
        return None, None, *(next(grads) if need else None for need in needs)
