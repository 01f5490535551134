"""The cards' bench specs: one module per card, holding everything the bench knows about that card.

Each is `scripts/bench/cards/<py>.py` (`<py>` = `Card.python_name`), found by the card's name; the generic bench modules
iterate over `npu_hub_kernels.CARDS` and these specs, and never name a card or a region.

A card's region kind (the name the bench prints for the region the card fuses: "RMSNorm", ...) is its card.toml
`region`, read through `Card.region`: a spec never spells it.

A spec declares; the generic modules measure. A spec imports from the bench package only the names of
`SPEC_IMPORTS`: the declaration types below (the targets' among them), and the accounting helpers its floor and its
accounting rules are written with. It never imports what measures, counts, builds models or renders
(tests/test_bench.py parses every spec's imports and holds it to that).

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
  (`CountedTarget`, its `kind` left empty: the card's region fills it).
- `FUSED_OPS: dict[str, FusedOp]`: the accounting rule (`bench.accounting.FusedOp`) of every torch_npu op the
  card's emulation module brings (`npu_hub_kernels/testing/emulation/ops/<py>.py`, its `__all__`), and of no other
  op ({} when the card brings none: an op two cards call lives with one of them).
- `HOST_TIMING: HostTiming | None`: where the timed mode finds the card's region in a tiny model (host cost of a
  call) and, on a Llama layer, how it calls the card's function directly (per-call overhead of the kernelized
  module, torch-universal fallback against eager), or None, with a comment saying why the card is not timed on
  the host.

and may define:

- `is_region(module: nn.Module) -> bool`: whether a module of a decoder layer is one the card fuses, so that the
  bench finds it (and reports "no card yet") when no card swaps it.
- `layer_region(layer: nn.Module) -> LayerRegion`: for a card whose layer replaces the decoder layer's own forward,
  the region inside it the card fuses (where it is measured, its arguments, how each variant runs it); required
  of such a card.
- `EXPERTS_SWEEP: ExpertsSweep`: the experts sweep study (the card's region with more and more experts).
- `PREFILL_DECODE_TABLE = True`: the report's table of one region call, forward, at prefill and at decode.
- `OUTSIDE_REGION: OutsideRegion`: for a card whose region is not in a decoder layer (the LM head and loss), the
  region as a declaration: which models and shapes, how eager, the card (and, optionally, an extra column such as
  TRL's fused LM head) run it, and the chunk sweep. The bench counts it (`bench.outside`: study OUTSIDE_STUDY, held
  to COUNTED_TARGETS and shown in the counted and memory tables; CHUNK_STUDY; the extra column's studies) and the
  report renders its tables.
- `BEFORE_CARD_TARGET: BeforeCardTarget`: for a card with `layer_region`, what the whole decoder layer with the
  card is held to against the layer without it (`BeforeCardTarget`); the bench counts that layer for the models it
  names.
- `documented_minimum(module, *call) -> DocumentedMinimum`: the region as the fewest torch_npu calls the device
  documents that compute it for this module and call (the ledger's rules, docs/torch-npu-ops.md), each call moving
  what its contract says it reads and writes: (ops, bytes) forward without autograd, and forward+backward with it.
  It equals the floor wherever the documented ops reach the floor, and is what a target `against="documented"`
  holds the kernelized column to; the spec then also defines `OUT_OF_DOCUMENTED_REACH: str`, why the floor is out
  of the documented ops' reach and where, with its sources (the bench's note prints it).

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

from ..rows import ESTIMATE_UNIT, REGION_STUDIES, Row

LAYER = "decoder layer"
"""The kind of a whole decoder layer's rows."""
NO_CARD = "no card yet"

REQUIRED = ("floor", "floor_saved", "COUNTED_TARGETS", "FUSED_OPS", "HOST_TIMING")
"""The names every spec defines (see the module doc)."""

SPEC_IMPORTS = {
    "bench.cards": frozenset(
        {"HostTiming", "LayerRegion", "ExpertsSweep", "OutsideRegion", "ExtraColumn", "RegionCall", "Run"}
        | {"CountedTarget", "BeforeCardTarget", "BYTES_TOLERANCE", "DocumentedMinimum"}
    ),
    "bench.floors": frozenset({"Floor", "dense_bytes"}),
    "bench.accounting": frozenset({"FusedOp", "empty_of", "tensor_bytes"}),
    "bench.configs": frozenset({"PHASES"}),
}
"""What a spec may import from the bench package, by module: the contract's declaration types, the targets' types
and bound, and the helpers a floor and an accounting rule are written with. Nothing else: no module, and nothing that
measures, counts, builds a model or renders."""


@dataclass(frozen=True)
class HostTiming:
    """Where the timed mode finds a card's region in a decoder layer, and how it calls the card's function directly.

    region: the region's module (or function-module) in a decoder layer of `model`.
    inputs: the tensors of one call of the region, from the layer's config, batch, sequence and device.
    direct_call: the card package's function as the card's layer calls it for that module: a callable taking the
        call's tensors (the function looked up once, so that timing the callable times the function); None: the
        card gets a host-cost row only (the per-call overhead and fallback rows time a Llama layer's cards).
    shapes: the call's shapes as the fallback row's note states them, from the module and the inputs (None with
        direct_call).
    model: the tiny model type (`TINY_CONFIGS`) whose first decoder layer holds the region; a card with a
        direct_call is timed on a Llama layer.
    """

    region: Callable[[nn.Module], Any]
    inputs: Callable[[Any, int, int, str], tuple[torch.Tensor, ...]]
    direct_call: Callable[[ModuleType, Any], Callable[..., Any]] | None = None
    shapes: Callable[[Any, tuple[torch.Tensor, ...]], str] | None = None
    model: str = "llama"


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
    """The experts sweep study: a card's region with each of several numbers of experts.

    That is the region of `model`'s layer (a `configs.CONFIGS` key) with each number of experts (`quick`: with --quick),
    transformers' eager loop and grouped_mm against the card, top-k as the model's, batch 1, sequence 512."""

    model: str
    experts: tuple[int, ...]
    quick: tuple[int, ...]


Run = Callable[[], tuple[torch.Tensor, ...]]
"""A counted run of a region outside the decoder layer: what it returns first is differentiated (its loss), the rest
stays referenced until the backward is done (as a model's outputs do)."""


@dataclass(frozen=True)
class RegionCall:
    """One measurement of a region outside the decoder layer, as the bench hands it to the spec's callables.

    model: the model (one decoder layer, not kernelized, on the meta device but for the region's module), a copy of
        its own: a column may change it.
    module: the region's module in it (`OutsideRegion.module`), with fake weights on the npu.
    inputs: the region's inputs (`OutsideRegion.inputs`), fake, on the npu.
    package: the card's package, as the kernelized model runs it.
    chunk: the tokens per chunk asked of the card (the kernelized column; None: the card's default).
    """

    model: nn.Module
    module: nn.Module
    inputs: tuple[torch.Tensor, ...]
    package: ModuleType
    chunk: int | None = None


@dataclass(frozen=True)
class ExtraColumn:
    """A further implementation of a region outside the decoder layer, counted beside eager and the card.

    It is counted beside eager and the card at every model and shape, one study per variant of it (rows' `extra` field),
    never held to a target.

    name: the column's name in the table's headings ("TRL").
    label: what the column is, in the log and the report ("TRL's fused LM head").
    studies: each variant's study -> what it computes (the table's cell).
    header: the heading of the variant's column in the table.
    run: the counted run (`Run`) of a variant, from the call and the variant's study (set up outside the count).
    absent: None where the column can run, else a sentence saying why not (no rows are counted then).
    title: the table's title.
    """

    name: str
    label: str
    studies: dict[str, str]
    header: str
    run: Callable[[RegionCall, str], Run]
    absent: Callable[[], str | None]
    title: Callable[[], str]


@dataclass(frozen=True)
class OutsideRegion:
    """A card's region that is not in a decoder layer, declared for the bench to count.

    The bench counts it forward+backward on fake tensors (ops, bytes, saved and peak live bytes) for eager and the card,
    at each model and shape, against the spec's floor.

    models: the measured models (`configs.CONFIGS` keys) -> the config values they are built with besides their own.
    module: the region's module in the model (its qualified name, "lm_head"): the floor's module.
    inputs: the region's inputs from its module, batch and sequence (made on the npu inside the bench's fake mode).
    shapes, quick_shapes: the (batch, sequence) measured, and with --quick.
    eager, kernelized: the counted runs (`Run`) of transformers' path and the card's, from the call (set up outside
        the count); the card's at `call.chunk` tokens per chunk.
    default_chunk: the tokens per chunk the card picks by default for the call.
    chunks: the tokens per chunk the card is also counted at, at `chunk_shape` (not with --quick): the chunk table.
    chunk_note: what the chunk table shows, closing its title.
    extra: a further column (`ExtraColumn`), or None.
    """

    models: dict[str, dict[str, Any]]
    module: str
    inputs: Callable[[nn.Module, int, int], tuple[torch.Tensor, ...]]
    shapes: tuple[tuple[int, int], ...]
    quick_shapes: tuple[tuple[int, int], ...]
    eager: Callable[[RegionCall], Run]
    kernelized: Callable[[RegionCall], Run]
    default_chunk: Callable[[RegionCall], int]
    chunks: tuple[int, ...]
    chunk_shape: tuple[int, int]
    chunk_note: str
    extra: ExtraColumn | None = None


BYTES_TOLERANCE = 1.05
"""A region's kernelized bytes within 5% of the floor (the cards' specs hold some regions to less)."""

DocumentedMinimum = tuple[tuple[int, int], tuple[int, int]]
"""A region at its documented minimum (`documented_minimum`): ((ops, bytes) forward without autograd, (ops, bytes)
forward+backward with it)."""


@dataclass(frozen=True)
class CountedTarget:
    """A target for the kernelized column of a region's counted rows.

    It requires kernelized <= bound x floor (bound 1: = floor), or <= bound x eager when `against` is "eager", or
    <= bound x the row's documented minimum (bound 1: = it) when `against` is "documented" (`Row.documented`: the
    floor where torch_npu's documented ops reach it), in these phases, and only at `shape` when given (then one
    target per model). `kind`: the rows' region kind, or "decoder layer"; a card's spec leaves it empty, and
    `targets.counted_targets` sets it to the card's region."""

    unit: str
    phases: tuple[str, ...]
    bound: float
    shape: tuple[int, int] | None = None
    against: str = "floor"
    kind: str = ""

    @property
    def text(self) -> str:
        what = {"ops": "op count", ESTIMATE_UNIT: "estimated time"}.get(self.unit, self.unit)
        if self.against == "eager":
            limit = "eager" if self.bound == 1 else f"{self.bound:g} x eager"
            return f"kernelized {what} <= {limit}" + (" (every size)" if self.shape is None else "")
        base = "documented minimum" if self.against == "documented" else "floor"
        limit = f"= {base}" if self.bound == 1 else f"<= {self.bound:g} x {base}"
        return f"kernelized {what} {limit}"

    def applies(self, row: Row) -> bool:
        """Whether the row is held to the target: a region's own counted row (`rows.REGION_STUDIES`) it covers."""
        return row.study in REGION_STUDIES and self.covers(row)

    def covers(self, row: Row) -> bool:
        """Whether the target speaks of the row's kind, unit, phase and shape, whatever its study."""
        shape = self.shape is None or (row.batch, row.seq) == self.shape
        return (row.kind, row.unit) == (self.kind, self.unit) and row.phase in self.phases and shape

    def met(self, row: Row) -> bool:
        if self.against == "eager":
            return row.kernelized <= self.bound * row.eager
        base = row.documented if self.against == "documented" else row.floor
        if base is None:
            raise ValueError(f"{row.model} {row.kind}: a row held to its documented minimum has none")
        return row.kernelized == base if self.bound == 1 else row.kernelized <= self.bound * base


@dataclass(frozen=True)
class BeforeCardTarget:
    """A card that swaps the decoder layer itself, held to the layer without it.

    Forward+backward, per model of `models` (`configs.CONFIGS` names), the kernelized layer (the default path, the card
    included) at least `fewer_ops` ops and `fewer_activations` activations' bytes (batch x seq x hidden in the model's
    dtype) below the kernelized layer without the card, counted at the shapes of the rows of
    `targets.BEFORE_CARD_STUDY`.

    The layer without the card is the default path where the card's layer is left out (`regions.WITHOUT_LAYER_CARD`:
    every other card's layer, the decoder layer's own forward). `why` says why the target is what it is (the bench's
    note prints it)."""

    fewer_ops: int
    fewer_activations: int
    models: tuple[str, ...]
    why: str


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
    documented = callable(getattr(module, "documented_minimum", None))
    if targets is not None:
        if not targets or not all(isinstance(t, CountedTarget) for t in targets):
            missing.append(f"{card.repo_name}: {where}: COUNTED_TARGETS is not a non-empty tuple of CountedTarget")
        elif any(t.kind for t in targets):
            missing.append(f"{card.repo_name}: {where}: a counted target sets its kind (card.toml's region is it)")
        elif any(t.against == "documented" for t in targets) and not documented:
            missing.append(f"{card.repo_name}: {where}: a target against the documented minimum, no documented_minimum")
    if documented and not getattr(module, "OUT_OF_DOCUMENTED_REACH", ""):
        missing.append(f"{card.repo_name}: {where}: documented_minimum without OUT_OF_DOCUMENTED_REACH (why)")
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
    elif timing is not None and (timing.direct_call is None) != (timing.shapes is None):
        missing.append(f"{card.repo_name}: {where}: HOST_TIMING has a direct_call or shapes without the other")
    elif timing is not None and timing.direct_call is not None and timing.model != "llama":
        missing.append(f"{card.repo_name}: {where}: HOST_TIMING's direct_call is timed on a Llama layer only")
    outside = getattr(module, "OUTSIDE_REGION", None)
    if outside is not None and not isinstance(outside, OutsideRegion):
        missing.append(f"{card.repo_name}: {where}: OUTSIDE_REGION is not an OutsideRegion")
    return missing
