"""The floor of a fused region: the region run as the fewest kernels that compute it, each reading its inputs once
and writing its outputs once. Each card's floor, and why it is what it is, is its spec's `floor`
(`scripts/bench/cards/<card>.py`).

- Decoder layer: what runs outside those regions (projections, attention, residual adds), plus every
  region at its floor. "Outside" is the layer's run minus its regions' runs, the least of the eager and
  kernelized runs (an eager region may hand its gradient on in a layout that costs a copy outside it:
  eager RoPE hands dq/dk on as BNSD tensors, which the projections' backward copies).
"""

from __future__ import annotations

import torch
from torch import nn

from .cards import card_of_kind, spec
from .regions import Region

Floor = tuple[tuple[int, int], tuple[int, int]]
"""((ops, bytes) forward, (ops, bytes) backward)."""


def dense_bytes(t: torch.Tensor) -> int:
    """Bytes of a dense tensor of t's shape and dtype (an output or a gradient of t)."""
    return t.numel() * t.element_size()


def floor_of(region: Region, module: nn.Module, phase: str) -> tuple[int, int]:
    """(ops, bytes) of a region at its floor, for the phase: the floor of the card that fuses its kind."""
    fwd, bwd = spec(card_of_kind(region.kind)).floor(module, *region.args, *region.kwargs.values())
    return fwd if phase == "fwd" else (fwd[0] + bwd[0], fwd[1] + bwd[1])
