"""Numeric helpers the tests share: error measures of the dtype idioms, and the training loop of the
convergence idiom (a few optimizer steps; compare losses and each parameter's whole update)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of a against b: a max over a few tiny entries would be one rounding draw."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


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
