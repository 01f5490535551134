"""Numeric helpers the tests share: error measures of the dtype idioms, the goldens of the emulated ops' tests, and
the training loop of the convergence idiom (a few optimizer steps; compare losses and each parameter's whole update)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of a against b: a max over a few tiny entries would be one rounding draw."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_within_twice_eagers_error(
    fused: torch.Tensor, eager: torch.Tensor, reference: torch.Tensor, what: object = None, error=max_error
) -> None:
    """flash-attention's idiom: fused's error against the float64 reference at most twice eager's (1e-6 of slack for
    an eager that is exact)."""
    fused_error, eager_error = error(fused, reference), error(eager, reference)
    assert fused_error <= 2 * eager_error + 1e-6, (what, fused_error, eager_error)


def rotary_golden(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, mode: str = "half") -> torch.Tensor:
    """The golden of op-plugin's test_npu_rotary_mul: r1 * x + r2 * rotation(x), in the inputs' dtype."""
    if mode == "half":
        x1, x2 = torch.chunk(x, 2, -1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).reshape(x.shape)
    return r1 * x + r2 * rotated


def gelu_tanh_golden(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ops-nn's do_gelu for approximate=1, and its derivative (gelu_grad_tanh's closed form), in x's dtype."""
    c = math.sqrt(2 / math.pi)
    tanh = torch.tanh(c * (x + 0.044715 * x**3))
    slope = 0.5 * (1 + tanh) + 0.5 * x * (1 - tanh**2) * c * (1 + 3 * 0.044715 * x**2)
    return 0.5 * x * (1 + tanh), slope


def train_steps(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    *,
    checkpointing: bool = False,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Causal-LM steps on `batches` (the optimizer made before the first forward, as trainers do).

    Returns:
        The losses, and each parameter's update (its final value minus its first, float32 on the host).
    """
    initial = {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    optimizer = make_optimizer(model.parameters())
    device = next(model.parameters()).device
    losses = []
    for ids in batches:
        loss = model(ids.to(device), labels=ids.to(device)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().float().cpu() - initial[name] for name, p in model.named_parameters()}
