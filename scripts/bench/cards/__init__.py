"""The cards' bench specs: one module `scripts/bench/cards/<py>.py` per card (`<py>` = `Card.python_name`), holding
everything the bench knows about that card, found by the card's name; the generic bench modules iterate over
`npu_hub_kernels.CARDS` and these specs, and never name a card or a region.

A card's region kind (the name the bench prints for the decoder-layer region the card fuses: "RMSNorm", ...) is
its card.toml `region`, read through `Card.region`: a spec never spells it.

The spec contract. `scripts/bench/cards/<py>.py` defines:

- `floor(module, *call) -> Floor`: the region at its floor, ((ops, bytes) forward, (ops, bytes) backward), from
  the region's module and its call's arguments (positional, then the keyword values in order), computed as the
  fewest kernels that compute the region, each reading its inputs once and writing its outputs once. The module
  doc says why the floor is what it is (ops and bytes, forward and backward).
- `floor_saved(module, *call) -> int`: the bytes the floor keeps for backward (`bench.memory`): the tensors its
  backward kernels read that its forward kernels wrote, each once, from the same kernels as `floor`; the region's
  inputs and parameters are kept regardless and not counted (an output that is kept counts). The module doc says
  what is kept and why.
- `COUNTED_TARGETS: tuple[CountedTarget, ...]`: what the kernelized column of the card's region is held to
  (`bench.targets.CountedTarget`, its `kind` left empty: the card's region fills it).
- `FUSED_OPS: dict[str, FusedOp]`: the accounting rule (`bench.accounting.FusedOp`) of every torch_npu op the
  card's emulation module brings (`npu_hub_kernels/testing/emulation/ops/<py>.py`, its `__all__`), and of no other
  op ({} when the card brings none: an op two cards call lives with one of them).
- `HOST_TIMING: HostTiming | None`: how the timed mode calls the card's function directly (per-call overhead of
  the kernelized module, torch-universal fallback against eager), or None, with a comment saying why the card is
  not timed on the host.

and may define:

- `is_region(module: nn.Module) -> bool`: whether a module of a decoder layer is one the card fuses, so that the
  bench finds it (and reports "no card yet") when no card swaps it.
- `layer_region(layer: nn.Module) -> LayerRegion`: for a card whose layer replaces the decoder layer's own forward,
  the region inside it the card fuses (where it is measured, its arguments, how each variant runs it); required
  of such a card.
- `EXPERTS_SWEEP: ExpertsSweep`: the experts sweep study (the card's region with more and more experts).
- `PREFILL_DECODE_TABLE = True`: the report's table of one region call, forward, at prefill and at decode.
- `REGION_ROWS(specs: list[ModelSpec], quick: bool) -> list[Row]`: counted rows of a region that is not in a
  decoder layer (the loss head), for the measured models it knows, measured by the spec itself; rows of study
  "layer" and the card's region kind are held to its COUNTED_TARGETS and shown in the counted table.
- `STUDY_TABLE(rows: list[Row]) -> list[str]`: markdown lines the report prints after the other studies.
- `BEFORE_CARD_TARGET: BeforeCardTarget`: for a card with `layer_region`, what the whole decoder layer with the
  card is held to against the layer's floor without it (`bench.targets.BeforeCardTarget`); the bench counts that
  layer for the models it names.

`missing_pieces(card)` names what a card's spec lacks; tests/test_card_pieces.py holds every card to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from npu_hub_kernels import CARDS
from npu_hub_kernels.cards import Card, card_piece

LAYER = "decoder layer"
"""The kind of a whole decoder layer's rows."""
NO_CARD = "no card yet"

REQUIRED = ("floor", "floor_saved", "COUNTED_TARGETS", "FUSED_OPS", "HOST_TIMING")
"""The names every spec defines (see the module doc)."""


@dataclass(frozen=True)
class HostTiming:
    """How the timed mode calls a card's function directly, for a Llama decoder layer's region of the card.

    region: the region's module (or function-module) in a Llama decoder layer.
    inputs: the tensors of one call of the region, from the layer's config, batch, sequence and device.
    direct_call: the card package's function as the card's layer calls it for that module: a callable taking the
        call's tensors (the function looked up once, so that timing the callable times the function).
    shapes: the call's shapes as the fallback row's note states them, from the module and the inputs.
    """

    region: Callable[[nn.Module], Any]
    inputs: Callable[[Any, int, int, str], tuple[torch.Tensor, ...]]
    direct_call: Callable[[ModuleType, Any], Callable[..., Any]]
    shapes: Callable[[Any, tuple[torch.Tensor, ...]], str]


@dataclass(frozen=True)
class LayerRegion:
    """The fused region of a card that swaps the decoder layer itself, which is no single module's forward.

    anchor: the submodule of the layer whose call the region is measured at (its name, e.g.
        "post_attention_layernorm"); it is the region's module for the floor, and the region replaces any region
        of another card at that name (which the swapped layer no longer runs).
    arguments: the region's call (args, kwargs) from the anchor's captured call.
    run: the callable computing the region in the layer's variant ("eager": the classes' own forwards;
        "kernelized": the card's function, as its layer calls it), from the layer and the variant.
    """

    anchor: str
    arguments: Callable[[tuple, dict], tuple[tuple, dict]]
    run: Callable[[nn.Module, str], Callable[..., Any]]


@dataclass(frozen=True)
class ExpertsSweep:
    """The experts sweep study: the region of `model`'s layer (a `configs.CONFIGS` key) with each number of
    experts (`quick`: with --quick), transformers' eager loop and grouped_mm against the card, top-k as the model's,
    batch 1, sequence 512."""

    model: str
    experts: tuple[int, ...]
    quick: tuple[int, ...]


def spec_name(card: Card) -> str:
    """The module name of a card's spec."""
    return f"{__name__}.{card.python_name}"


def spec(card: Card) -> ModuleType:
    """The card's bench spec, `scripts/bench/cards/<py>.py` (ModuleNotFoundError, saying what to add, without one)."""
    module = card_piece(__name__, card)
    if module is None:
        raise ModuleNotFoundError(
            f"{card.repo_name} has no bench spec: add scripts/bench/cards/{card.python_name}.py (the contract: "
            "scripts/bench/cards/__init__.py)",
            name=spec_name(card),
        )
    return module


def specs() -> list[tuple[Card, ModuleType]]:
    """(card, its spec) of every card, in the order of CARDS."""
    return [(card, spec(card)) for card in CARDS.values()]


def card_named(repo_name: str) -> Card:
    """The card of a repo name ("npu-rope")."""
    return next(card for card in CARDS.values() if card.repo_name == repo_name)


def card_of_kind(kind: str) -> Card:
    """The card that fuses a region kind (its card.toml `region`)."""
    return next(card for card in CARDS.values() if card.region == kind)


def kinds() -> list[str]:
    """Every card's region kind, in the order of CARDS."""
    return [card.region for card in CARDS.values()]


def with_piece(name: str) -> list[tuple[Card, Any]]:
    """(card, the value its spec gives `name`) of the cards whose spec defines the optional piece `name`."""
    return [(card, getattr(module, name)) for card, module in specs() if getattr(module, name, None) is not None]


def missing_pieces(card: Card) -> list[str]:
    """What the card's bench spec lacks, one sentence each naming the piece (empty when it has every piece)."""
    from npu_hub_kernels.testing.emulation import emulated_ops_of

    from ..targets import CountedTarget

    where = f"scripts/bench/cards/{card.python_name}.py"
    module = card_piece(__name__, card)
    if module is None:
        return [f"{card.repo_name}: no bench spec {where} (see scripts/bench/cards/__init__.py)"]
    missing = [f"{card.repo_name}: {where} defines no {name}" for name in REQUIRED if not hasattr(module, name)]
    missing += [
        f"{card.repo_name}: {where}: {name} is not a function"
        for name in ("floor", "floor_saved")
        if hasattr(module, name) and not callable(getattr(module, name))
    ]
    targets = getattr(module, "COUNTED_TARGETS", None)
    if targets is not None:
        if not targets or not all(isinstance(t, CountedTarget) for t in targets):
            missing.append(f"{card.repo_name}: {where}: COUNTED_TARGETS is not a non-empty tuple of CountedTarget")
        elif any(t.kind for t in targets):
            missing.append(f"{card.repo_name}: {where}: a counted target sets its kind (card.toml's region is it)")
    rules = getattr(module, "FUSED_OPS", None)
    if rules is not None:
        ops = set(emulated_ops_of(card))
        source = f"npu_hub_kernels/testing/emulation/ops/{card.python_name}.py"
        missing += [
            f"{card.repo_name}: {where}: FUSED_OPS has no accounting rule for torch_npu.{op} ({source} brings it)"
            for op in sorted(ops - set(rules))
        ]
        missing += [
            f"{card.repo_name}: {where}: FUSED_OPS has a rule for {op}, which {source} does not bring"
            for op in sorted(set(rules) - ops)
        ]
    timing = getattr(module, "HOST_TIMING", None)
    if timing is not None and not isinstance(timing, HostTiming):
        missing.append(f"{card.repo_name}: {where}: HOST_TIMING is neither a HostTiming nor None")
    return missing
