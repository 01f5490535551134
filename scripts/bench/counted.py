"""Counted: the device ops and bytes of full-size decoder layers and their fused regions, on fake tensors.

Per model and shape: the eager layer (transformers' forwards), the kernelized layer (the default path:
kernelize alone, after one uncounted warm-up forward), the peer (LLaMA-Factory's NPU kernels applied to a
layer of its own, `peer`) and the floor (`floors`), per region kind and for the whole layer, forward in
inference mode and forward+backward with grad, and with grad the memory (`memory`: saved and peak bytes). Also
the experts sweep: one MoE layer with more and more experts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from npu_hub_kernels.cards import Card

from .accounting import Memory, Tally, count_device_ops, fake_module
from .cards import LAYER, NO_CARD, BeforeCardTarget, kinds
from .configs import CONFIGS, DTYPE, PHASES, ModelSpec, experts_key
from .device_model import device_seconds
from .floors import documented_of, floor_of, floor_peak, floor_saved_of
from .memory import tracking_memory
from .peer import Patches, Peer
from .regions import (
    WITHOUT_LAYER_CARD,
    Region,
    capture,
    find_regions,
    forward_backward,
    layer_inputs,
    region_call,
    resolve,
    set_variant,
)
from .rows import ESTIMATE_UNIT, MEMORY_UNITS, ExpertsSweepRow, Row, log
from .targets import BEFORE_CARD_STUDY, counted_target


@dataclass
class Measured:
    """The counted tallies of one region kind (or the layer) per variant, and its floor.

    The tallies come with their memory (forward+backward), and the floor as (ops, bytes) and as memory
    (forward+backward; `floors`)."""

    eager: Tally
    kernelized: Tally | None  # None: no card fuses this region (yet)
    floor: tuple[int, int]
    peer: Tally | None = None  # None: no peer column
    peer_patched: bool | None = None  # False: the peer leaves the region to transformers
    floor_memory: Memory | None = None  # None: not measured (forward alone)
    documented: tuple[int, int] | None = None  # (ops, bytes) at the documented minimum; None: its spec states none


PEER_LAYER = "model.layers.0."
"""The measured layer's name in its model (what the peer's patches are named by)."""


def build_model(spec: ModelSpec, experts: int | None = None) -> nn.Module:
    """Build the model with one decoder layer on the meta device.

    It has bfloat16, sdpa attention, transformers' eager experts loop (the one an experts card replaces); `experts`
    overrides the model's number of experts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = dict(spec.config, num_hidden_layers=1)
    if experts is not None:
        overrides[experts_key(spec)] = experts
    config = AutoConfig.for_model(spec.model_type, **overrides)
    options = {"experts_implementation": "eager"} if spec.experts else {}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=DTYPE, **options)


def build_layer(spec: ModelSpec, fake_mode: FakeTensorMode, experts: int | None = None) -> nn.Module:
    """Decoder layer 0 of the model, with fake weights (of `fake_mode`) on the npu device."""
    return fake_module(build_model(spec, experts).model.layers[0], fake_mode, "npu")


def fresh(value: Any) -> Any:
    """New empty tensors with the layouts (sizes, strides, dtypes, devices, requires_grad) of those in `value`.

    Each keeps its tensor's Python attributes: what a mask function attached for its attention function (the
    attention card's mask description) goes with the mask."""

    def make(t):
        if not isinstance(t, torch.Tensor):
            return t
        new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        new.__dict__.update(t.__dict__)
        return new.requires_grad_(t.requires_grad and t.is_floating_point())

    return tree_map(make, value)


def count_run(fn: Callable, args: tuple, kwargs: dict, params: Iterable, phase: str, experts: int | None) -> Tally:
    """Count the device ops of fn on fresh fake inputs with the layouts of args/kwargs.

    It counts forward or forward+backward; with the backward, also its memory (`memory`, in the tally's `memory`)."""
    args, kwargs = fresh((args, kwargs))
    memory = tracking_memory() if phase != "fwd" else contextlib.nullcontext()
    with memory as tracker, count_device_ops(experts=experts) as tally:
        forward_backward(fn, args, kwargs, params, phase, torch.empty_like)
    tally.memory = tracker.memory if tracker is not None else None
    return tally


def peer_layer(spec: ModelSpec, fake_mode: FakeTensorMode, peer: Peer, experts: int | None = None):
    """Return decoder layer 0 of a model of its own with the peer's kernels applied, and the peer's patches.

    The layer has fake weights on the npu device."""
    model = build_model(spec, experts)
    patches = peer.apply(model)
    return fake_module(model.model.layers[0], fake_mode, "npu"), patches


def account(
    spec: ModelSpec,
    batch: int,
    seq: int,
    experts: int | None = None,
    peer: Peer | None = None,
    kernelized: str = "kernelized",
    phases: tuple[str, ...] = PHASES,
) -> dict[tuple[str, str], Measured]:
    """Count the tallies per (region kind or "decoder layer", phase) of every variant and the floor.

    The variants are eager, kernelized (the default path, or the variant `kernelized` names: `regions.set_variant`), the
    peer's (when given) and the floor. On fake tensors of a fresh fake mode; `experts` overrides the model's."""
    experts = experts or spec.experts
    fake_mode = FakeTensorMode()
    layer = build_layer(spec, fake_mode, experts)  # eager and kernelized: the same layer, its forwards swapped
    regions = find_regions(layer, kernelized)
    peered = peer_layer(spec, fake_mode, peer, experts) if peer is not None else None
    patched: dict[str, bool] = {}
    results: dict[tuple[str, str], Measured] = {}
    with fake_mode:
        args, kwargs = layer_inputs(spec, batch, seq, torch.empty)
        set_variant(layer, "eager")
        capture(layer, regions, args, kwargs, count_device_ops(experts=experts))
        set_variant(layer, kernelized)
        with count_device_ops(experts=experts):  # uncounted: what a first call with grad makes once per process
            layer(*args, **kwargs)  # (the cards' device constants: npu-rms-norm's float32 1 of its 1 + weight)
        for phase in phases:
            tallies: dict[tuple[str, str], Tally | None] = {}
            for variant in ("eager", "kernelized"):
                set_variant(layer, kernelized if variant == "kernelized" else variant)
                tallies[(LAYER, variant)] = count_run(layer, args, kwargs, layer.parameters(), phase, experts)
                for region in regions:
                    if variant != "eager" and region.card is None:
                        tallies[(region.name, variant)] = None
                        continue
                    fn, params = region_call(layer, region, variant)
                    tallies[(region.name, variant)] = count_run(fn, region.args, region.kwargs, params, phase, experts)
            if peered is not None:
                set_variant(layer, "eager")  # what the peer leaves alone runs transformers' forwards
                patched = _count_peer(peered, regions, args, kwargs, phase, experts, tallies)
            results.update(_combine(regions, layer, tallies, phase, patched))
        set_variant(layer, "eager")  # leave the shared rotary function-modules as they were
    return results


def _count_peer(
    peered: tuple[nn.Module, Patches], regions: list[Region], args, kwargs, phase: str, experts, tallies: dict
) -> dict[str, bool]:
    """Count the peer's layer and regions into `tallies` (variant "peer"); returns whether it patched each region."""
    layer, patches = peered
    patched = {}
    with patches.active():
        tallies[(LAYER, "peer")] = count_run(layer, args, kwargs, layer.parameters(), phase, experts)
        for region in regions:
            fn, params, patched[region.name] = patches.region(layer, region, PEER_LAYER)
            tallies[(region.name, "peer")] = count_run(fn, region.args, region.kwargs, params, phase, experts)
    return patched


def _combine(
    regions: list[Region], layer: nn.Module, tallies: dict, phase: str, patched: dict[str, bool]
) -> dict[tuple[str, str], Measured]:
    """Sum the regions of each kind into one tally per kind and one for the layer.

    The layer's floor is what runs outside the regions plus each region's floor (the peer plays no part in the floor).
    Memory, with the backward: a kind keeps the sum of its regions' saved bytes and peaks at the largest of their peaks
    (they run one after the other); floors as `floors` says."""
    out = {}
    floors = {r.name: floor_of(r, resolve(layer, r.name), phase) for r in regions}
    documented = {r.name: documented_of(r, resolve(layer, r.name), phase) for r in regions}
    with_grad = phase != "fwd"  # memory is measured with the backward only
    floor_memory = _region_floor_memory(regions, layer, tallies) if with_grad else {}
    for kind in (k for k in kinds() if any(r.kind == k for r in regions)):
        names = [r.name for r in regions if r.kind == kind]
        out[(kind, phase)] = Measured(
            eager=_sum([tallies[(n, "eager")] for n in names]),
            kernelized=_sum([tallies[(n, "kernelized")] for n in names]),
            floor=(sum(floors[n][0] for n in names), sum(floors[n][1] for n in names)),
            peer=_sum([tallies.get((n, "peer")) for n in names]),
            peer_patched=any(patched[n] for n in names) if patched else None,
            floor_memory=_kind_memory([floor_memory[n] for n in names]) if with_grad else None,
            documented=_sum_pairs([documented[n] for n in names]),
        )
    rests = []  # what runs outside the regions, per variant with every region measured
    for variant in ("eager", "kernelized"):
        layer_run, in_regions = tallies.get((LAYER, variant)), _sum([tallies.get((r.name, variant)) for r in regions])
        if layer_run is not None and in_regions is not None:
            rests.append((layer_run.ops - in_regions.ops, layer_run.bytes - in_regions.bytes))
    rest = min(rests)  # eager regions can hand gradients on in layouts that cost a copy outside them
    out[(LAYER, phase)] = Measured(
        eager=tallies[(LAYER, "eager")],
        kernelized=tallies[(LAYER, "kernelized")],
        floor=(rest[0] + sum(f[0] for f in floors.values()), rest[1] + sum(f[1] for f in floors.values())),
        peer=tallies.get((LAYER, "peer")),
        peer_patched=any(patched.values()) if patched else None,
        floor_memory=_layer_floor_memory(regions, tallies, floor_memory) if with_grad else None,
    )
    return out


def _sum_pairs(pairs: list[tuple[int, int] | None]) -> tuple[int, int] | None:
    """The (ops, bytes) pairs summed; None when any is None."""
    if any(p is None for p in pairs):
        return None
    return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


def _measured_variants(tallies: dict, names: list[str]) -> list[list[Memory]]:
    """Per variant (eager, kernelized) whose every named run was measured: the memory of each run, in order."""
    runs = [[tallies.get((n, variant)) for n in names] for variant in ("eager", "kernelized")]
    return [[t.memory for t in variant] for variant in runs if all(t is not None for t in variant)]


def _region_floor_memory(regions: list[Region], layer: nn.Module, tallies: dict) -> dict[str, Memory]:
    """Each region's floor memory: its spec's floor_saved, and the peak `floors.floor_peak` derives from it."""
    out = {}
    for r in regions:
        saved = floor_saved_of(r, resolve(layer, r.name))
        out[r.name] = Memory(saved, floor_peak(saved, [runs[0] for runs in _measured_variants(tallies, [r.name])]))
    return out


def _layer_floor_memory(regions: list[Region], tallies: dict, region_floors: dict[str, Memory]) -> Memory:
    """Return the layer's floor memory (saved and peak bytes).

    It is what is kept outside the regions (the least over the variants) plus each region's floor_saved; its peak
    derived by `floors.floor_peak`."""
    names = [LAYER, *(r.name for r in regions)]
    variants = _measured_variants(tallies, names)
    outside = min(layer.saved_bytes - sum(m.saved_bytes for m in inside) for layer, *inside in variants)
    saved = outside + sum(m.saved_bytes for m in region_floors.values())
    return Memory(saved, floor_peak(saved, [layer for layer, *_ in variants]))


def _kind_memory(memories: list[Memory | None]) -> Memory | None:
    """The memory of a region kind's regions, run one after the other: their saved bytes summed, the largest peak."""
    if any(m is None for m in memories):
        return None
    return Memory(sum(m.saved_bytes for m in memories), max(m.peak_bytes for m in memories))


def _sum(tallies: list[Tally | None]) -> Tally | None:
    if any(t is None for t in tallies):
        return None
    return Tally([record for t in tallies for record in t.records], _kind_memory([t.memory for t in tallies]))


def unit_value(tally: Tally | None, unit: str) -> float | None:
    """A tally's figure in a unit; None without the tally or its memory.

    The units: "ops", "bytes", one of MEMORY_UNITS, or ESTIMATE_UNIT (its ops' estimated device time)."""
    if tally is None:
        return None
    if unit == ESTIMATE_UNIT:
        return device_seconds(tally.records) * 1e3
    if unit in MEMORY_UNITS:
        return memory_value(tally.memory, unit)
    return tally.ops if unit == "ops" else tally.bytes


def memory_value(memory: Memory | None, unit: str) -> int | None:
    """A memory's figure in one of MEMORY_UNITS; None without the memory."""
    if memory is None:
        return None
    return memory.saved_bytes if unit == MEMORY_UNITS[0] else memory.peak_bytes


def _note(kernelized: Tally | None, peer_patched: bool | None) -> str:
    notes = [NO_CARD] if kernelized is None else []
    notes += [PEER_NOT_PATCHED] if peer_patched is False else []
    return "; ".join(notes)


PEER_NOT_PATCHED = "peer: not patched (left to transformers)"


def counted_rows(spec: ModelSpec, shapes: Iterable[tuple[int, int]], peer: Peer | None = None) -> list[Row]:
    """Return the bench.csv rows of one model's counted regions and decoder layer.

    They hold ops and bytes per region kind and per decoder layer, per shape and phase, and forward+backward the memory
    (saved and peak bytes)."""
    rows = []
    for batch, seq in shapes:
        started = time.perf_counter()
        for (kind, phase), m in account(spec, batch, seq, peer=peer).items():
            units = [("ops", m.floor[0]), ("bytes", m.floor[1]), (ESTIMATE_UNIT, None)]
            units += [(unit, memory_value(m.floor_memory, unit)) for unit in MEMORY_UNITS] if m.floor_memory else []
            for unit, floor in units:
                row = Row(
                    "estimated" if unit == ESTIMATE_UNIT else "counted", spec.name, kind, phase, batch, seq,
                    eager=unit_value(m.eager, unit), kernelized=unit_value(m.kernelized, unit), floor=floor,
                    peer=unit_value(m.peer, unit), unit=unit, note=_note(m.kernelized, m.peer_patched),
                    study="layer", kind=kind, model=spec.name, experts=spec.experts, peer_patched=m.peer_patched,
                    documented=_documented_value(m.documented, unit),
                )  # fmt: skip
                row.target = counted_target(row)
                rows.append(row)
        log(f"  counted {spec.name}, batch {batch}, seq {seq}: {time.perf_counter() - started:.1f} s")
    return rows


def _documented_value(documented: tuple[int, int] | None, unit: str) -> int | None:
    """The documented minimum's figure in a counted unit (ops or bytes); None for other units or none stated."""
    return None if documented is None else {"ops": documented[0], "bytes": documented[1]}.get(unit)


def before_card_rows(
    card: Card, target: BeforeCardTarget, specs: Iterable[ModelSpec], shape: tuple[int, int]
) -> list[Row]:
    """Return the bench.csv rows of the decoder layer without a card that swaps the layer itself.

    The layer is counted without that card (`regions.WITHOUT_LAYER_CARD`), forward+backward, ops and bytes, for the
    models of `specs` the card's target names: its floor is the one the card's `BeforeCardTarget` holds the default path
    to."""
    rows = []
    batch, seq = shape
    for spec in (spec for spec in specs if spec.name in target.models):
        started = time.perf_counter()
        m = account(spec, batch, seq, kernelized=WITHOUT_LAYER_CARD, phases=("fwd+bwd",))[(LAYER, "fwd+bwd")]
        for unit, floor in (("ops", m.floor[0]), ("bytes", m.floor[1])):
            row = Row(
                "counted", spec.name, LAYER, "fwd+bwd", batch, seq,
                eager=unit_value(m.eager, unit), kernelized=unit_value(m.kernelized, unit), floor=floor, unit=unit,
                note=f"the layer without {card.repo_name}", study=BEFORE_CARD_STUDY, kind=LAYER,
                variant=f"without {card.repo_name}", model=spec.name, experts=spec.experts,
            )  # fmt: skip
            rows.append(row)
        seconds = time.perf_counter() - started
        log(f"  counted {spec.name} without {card.repo_name}, batch {batch}, seq {seq}: {seconds:.1f} s")
    return rows


def experts_sweep_rows(
    card: Card, model: str, experts_counts: Iterable[int], batch: int = 1, seq: int = 512, peer: Peer | None = None
) -> list[Row]:
    """Return the bench.csv rows of the experts sweep of a card's region (its spec's EXPERTS_SWEEP).

    It counts the region of the layer of `model` (a CONFIGS key) with other numbers of experts, transformers' eager loop
    and its default grouped_mm, against the card, the peer and the floor (ops and bytes, forward and
    forward+backward)."""
    base = CONFIGS[model]
    rows = []
    for experts in experts_counts:
        fake_mode = FakeTensorMode()
        layer = build_layer(base, fake_mode, experts)
        region = next(r for r in find_regions(layer) if r.kind == card.region)
        module = resolve(layer, region.name)
        peered = peer_layer(base, fake_mode, peer, experts) if peer is not None else None
        with fake_mode:
            set_variant(layer, "eager")
            capture(layer, [region], *layer_inputs(base, batch, seq, torch.empty), count_device_ops(experts=experts))
            for phase in PHASES:
                floor = floor_of(region, module, phase)
                kernelized = None
                if region.card is not None:
                    set_variant(layer, "kernelized")
                    kernelized = count_run(module, region.args, region.kwargs, module.parameters(), phase, experts)
                set_variant(layer, "eager")
                peer_run, peer_patched = None, None
                if peered is not None:
                    with peered[1].active():
                        fn, params, peer_patched = peered[1].region(peered[0], region, PEER_LAYER)
                        peer_run = count_run(fn, region.args, region.kwargs, params, phase, experts)
                for implementation in ("eager", "grouped_mm"):
                    module.config._experts_implementation = implementation
                    eager = count_run(module, region.args, region.kwargs, module.parameters(), phase, experts)
                    for unit, index in (("ops", 0), ("bytes", 1)):
                        sweep = ExpertsSweepRow(
                            base.name, experts, card.region, implementation, phase, batch, seq, unit,
                            eager=unit_value(eager, unit), kernelized=unit_value(kernelized, unit), floor=floor[index],
                            peer=unit_value(peer_run, unit), peer_patched=peer_patched,
                            note=_note(kernelized, peer_patched),
                        )  # fmt: skip
                        rows.append(sweep.csv_row())
                module.config._experts_implementation = "eager"
        log(f"  counted experts sweep, {experts} experts")
    return rows
