"""The floor of a fused region, and of the decoder layer, in ops, bytes and memory.

A region's floor is the region run as the fewest kernels that compute it, each reading its inputs once and writing its
outputs once. Each card's floor, and why it is what it is, is its spec's `floor` (`scripts/bench/cards/<card>.py`).

- Decoder layer: what runs outside those regions (projections, attention, residual adds), plus every
  region at its floor. "Outside" is the layer's run minus its regions' runs, the least of the eager and
  kernelized runs (an eager region may hand its gradient on in a layout that costs a copy outside it:
  eager RoPE hands dq/dk on as BNSD tensors, which the projections' backward copies).

Memory (forward+backward, `memory`): a region's floor keeps for backward its spec's `floor_saved`; the decoder
layer's floor keeps what is kept outside the regions (the layer's saved bytes minus its regions', the least of the
eager and kernelized runs: a region's inputs are baseline when it runs alone, so what a region keeps of them
counts outside it) plus every region's floor_saved. Taking the least makes it a lower bound: npu_rms_norm keeps
its bf16 input where eager keeps a float32 copy of it instead, and the eager outside, without that input, is the
one taken. The floor's peak is derived, not counted: its saved bytes plus
the transient part of a measured peak (peak - saved, the least of the eager and kernelized runs: outputs,
gradients and work tensors alive at the peak besides what is kept), as if a run kept only the floor's tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from .accounting import Memory
from .cards import card_of_kind, spec
from .regions import Region

Floor = tuple[tuple[int, int], tuple[int, int]]
"""((ops, bytes) forward, (ops, bytes) backward)."""


def dense_bytes(t: torch.Tensor) -> int:
    """Bytes of a dense tensor of t's shape and dtype (an output or a gradient of t)."""
    return t.numel() * t.element_size()


def floor_saved_of(region: Region, module: nn.Module) -> int:
    """Bytes a region's floor keeps for backward: the floor_saved of the card that fuses its kind."""
    return spec(card_of_kind(region.kind)).floor_saved(module, *region.args, *region.kwargs.values())


def floor_peak(saved: int, runs: list[Memory]) -> int:
    """A floor's peak: its saved bytes plus the least transient part (peak - saved) of the measured runs."""
    return saved + min(m.peak_bytes - m.saved_bytes for m in runs)


def floor_of(region: Region, module: nn.Module, phase: str) -> tuple[int, int]:
    """(ops, bytes) of a region at its floor, for the phase: the floor of the card that fuses its kind."""
    fwd, bwd = spec(card_of_kind(region.kind)).floor(module, *region.args, *region.kwargs.values())
    return fwd if phase == "fwd" else (fwd[0] + bwd[0], fwd[1] + bwd[1])


def documented_of(region: Region, module: nn.Module, phase: str) -> tuple[int, int] | None:
    """(ops, bytes) of a region at its documented minimum for the phase, or None where its spec states none.

    The minimum is the `documented_minimum` of the card that fuses the region's kind."""
    documented_minimum = getattr(spec(card_of_kind(region.kind)), "documented_minimum", None)
    if documented_minimum is None:
        return None
    forward, with_backward = documented_minimum(module, *region.args, *region.kwargs.values())
    return forward if phase == "fwd" else with_backward
