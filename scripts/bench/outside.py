"""Regions outside the decoder layer, counted from the declaration a card's spec gives (`cards.OutsideRegion`).

Per model and shape the spec declares, forward+backward on fake tensors on the emulated npu: eager, the card at its
default chunk (study OUTSIDE_STUDY: held to the spec's COUNTED_TARGETS, shown in the counted and memory tables like a
layer's regions), the card at each other chunk of the sweep (CHUNK_STUDY), and the extra column's variants (their
studies, the figure in `Row.extra`, beside the same eager and default figures); ops, bytes, saved and peak live bytes
against the spec's floor. Each run is set up outside the count (the spec's callables), then counted: its first
output differentiated with respect to the region's differentiable inputs and its module's parameters, the others kept
until the backward is done.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from npu_hub_kernels.cards import Card

from .accounting import Memory, Tally, count_device_ops, fake_module
from .attention import UnpackedReads
from .cards import OutsideRegion, RegionCall, spec
from .configs import CONFIGS, ModelSpec
from .counted import build_model, memory_value, unit_value
from .floors import Floor, floor_peak
from .memory import tracking_memory
from .rows import CHUNK_STUDY, ESTIMATE_UNIT, MEMORY_UNITS, OUTSIDE_STUDY, Row, log
from .targets import counted_target

UNITS = ("ops", "bytes", *MEMORY_UNITS, ESTIMATE_UNIT)
"""The units of a region outside the decoder layer's rows."""
EAGER, KERNELIZED = "eager", "kernelized"
"""The columns every region outside the decoder layer is counted in; an extra column's are its studies."""


@dataclass
class Counted:
    """One counted run of a region outside the decoder layer, with its floor.

    It holds its tally (with its memory), the region's floor and floor_saved (the spec's, from the run's module and
    inputs), and the tokens per chunk the card ran (None: eager or an extra column)."""

    tally: Tally
    floor: Floor
    floor_saved: int
    chunk: int | None


@functools.cache
def _built(model: str, overrides: tuple[tuple[str, Any], ...]) -> tuple[nn.Module, ModuleType]:
    """Return the model on the meta device and the card package of its kernelized twin, built once per model.

    The model is not kernelized. They are built once per model for every measure of it, each of which copies the
    model."""
    from kernels import Mode, kernelize

    from npu_hub_kernels.report import card_package

    base = CONFIGS[model]
    spec_with = dataclasses.replace(base, config=dict(base.config, **dict(overrides)))
    kernelized = build_model(spec_with)
    kernelize(kernelized, mode=Mode.TRAINING, device="npu")
    package = card_package(kernelized)
    if package is None:
        raise RuntimeError(f"{base.name}'s CausalLM runs no card layer: is its card registered?")
    return build_model(spec_with), package


def measure(
    card: Card, region: OutsideRegion, model: str, column: str, batch: int, seq: int, chunk: int | None = None
) -> Counted:
    """Count the region of `model` forward+backward in one column, on fake tensors.

    `model` is an `OutsideRegion.models` key. It counts in `column` (EAGER, KERNELIZED at `chunk` tokens per chunk
    (None: the card's default), or a study of the region's extra column), at batch x seq, on fake tensors of a fresh
    fake mode."""
    plain, package = _built(model, tuple(sorted(region.models[model].items())))
    fake_mode = FakeTensorMode()
    copied = copy.deepcopy(plain)
    module = fake_module(copied.get_submodule(region.module), fake_mode, "npu")  # in place: the model holds it
    with fake_mode:
        inputs = region.inputs(module, batch, seq)
        call = RegionCall(copied, module, inputs, package, chunk)
        if column == EAGER:
            run = region.eager(call)
        elif column == KERNELIZED:
            run = region.kernelized(call)
        else:
            run = region.extra.run(call, column)
        wrt = [t for t in inputs if t.requires_grad] + [p for p in module.parameters() if p.requires_grad]
        with tracking_memory() as tracker, count_device_ops() as tally, UnpackedReads():
            outputs = run()
            torch.autograd.grad(outputs[0], wrt, torch.empty_like(outputs[0]))
            del outputs
        card_spec = spec(card)
        floor, saved = card_spec.floor(module, *inputs), card_spec.floor_saved(module, *inputs)
        ran = (chunk or region.default_chunk(call)) if column == KERNELIZED else None
    tally.memory = tracker.memory
    return Counted(tally, floor, saved, ran)


def outside_rows(card: Card, region: OutsideRegion, specs: Iterable[ModelSpec], quick: bool) -> list[Row]:
    """Return the bench.csv rows of a card's region outside the decoder layer.

    They cover the region for its models among `specs`, forward+backward at each of its shapes (its quick ones with
    --quick): eager against the card's default (OUTSIDE_STUDY), at the chunk shape without --quick the card at each
    other chunk of the sweep (CHUNK_STUDY), and the extra column's variants beside eager and the default (their
    studies); without the extra column (`absent`), the log says why."""
    specs = list(specs)
    extra = region.extra
    absent = extra.absent() if extra is not None else None
    if absent:
        log(f"  {extra.label}: not counted ({absent})")
    rows: list[Row] = []
    for model in (key for key in region.models if CONFIGS[key] in specs):
        name = CONFIGS[model].name
        for batch, seq in region.quick_shapes if quick else region.shapes:
            eager = measure(card, region, model, EAGER, batch, seq)
            default = measure(card, region, model, KERNELIZED, batch, seq)
            sweep = region.chunks if (batch, seq) == region.chunk_shape and not quick else ()
            swept = [measure(card, region, model, KERNELIZED, batch, seq, chunk) for chunk in sweep]
            runs = [
                (OUTSIDE_STUDY, default, None),
                *((CHUNK_STUDY, m, None) for m in swept if m.chunk != default.chunk),
            ]
            for study in extra.studies if extra is not None and not absent else ():
                runs.append((study, default, measure(card, region, model, study, batch, seq)))
            floor = _floor(eager, default)
            for study, fused, other in runs:
                rows += _rows(card, name, (batch, seq), study, eager, fused, other, floor)
            log(f"  counted {name} {card.region}, batch {batch}, seq {seq}")
    return rows


def _floor(eager: Counted, default: Counted) -> dict[str, int]:
    """Return the region's floor per unit, forward+backward.

    It is the spec's floor and floor_saved, and the peak `floors.floor_peak` derives from eager's run and the card's
    default."""
    (fwd_ops, fwd_bytes), (bwd_ops, bwd_bytes) = eager.floor
    peak = floor_peak(eager.floor_saved, [eager.tally.memory, default.tally.memory])
    memory = Memory(eager.floor_saved, peak)
    return {
        "ops": fwd_ops + bwd_ops,
        "bytes": fwd_bytes + bwd_bytes,
        **{u: memory_value(memory, u) for u in MEMORY_UNITS},
        ESTIMATE_UNIT: None,
    }


def _rows(
    card: Card,
    model: str,
    shape: tuple[int, int],
    study: str,
    eager: Counted,
    fused: Counted,
    extra: Counted | None,
    floor: dict[str, int],
) -> list[Row]:
    """Return one row per unit of the region at `shape`.

    The rows are eager, the card's run `fused` and the extra column's run, if any, against the floor (`_floor`), with
    the target each row is held to."""
    rows = []
    for unit in UNITS:
        row = Row(
            "estimated" if unit == ESTIMATE_UNIT else "counted", model, card.region, "fwd+bwd", *shape,
            eager=unit_value(eager.tally, unit),
            kernelized=unit_value(fused.tally, unit), floor=floor[unit], unit=unit, study=study, kind=card.region,
            model=model, chunk=fused.chunk, extra=None if extra is None else unit_value(extra.tally, unit),
        )  # fmt: skip
        row.target = counted_target(row)
        rows.append(row)
    return rows
