"""What the cards are held to: counted targets (kernelized against the floor) and host-side ones (timed).

The targets' types, with which the cards' specs declare theirs, are declarations of `bench.cards`."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from npu_hub_kernels.cards import Card

from .cards import LAYER, NO_CARD, BeforeCardTarget, CountedTarget, specs, with_piece
from .configs import activation_bytes
from .rows import (
    ESTIMATE_STUDY,
    ESTIMATE_UNIT,
    LONGEST_STUDY,
    MIXED_PRECISION_STUDY,
    REGION_STUDIES,
    Row,
    sweep_ops,
)
from .timed import (
    FALLBACK_TOLERANCE,
    HOST_COST_BOUND,
    HOST_COST_STUDY,
    KERNELIZE_TARGET_MS,
    OVERHEAD_STUDY,
    OVERHEAD_TARGET_US,
    CallOverheadRow,
    HostCostRow,
)

LAYER_BYTES_TOLERANCE = 1.03
LAYER_TARGET_SHAPE = (8, 4096)
"""The kernelized decoder layer within 3% of the floor's bytes, forward+backward at batch 8 x sequence 4096."""
REGION_TIME_PHASES = ("fwd", "fwd+bwd")
"""Every card's region at most eager's region in estimated device time (Atlas A2 model), in these phases, at every
size the bench counts."""
STEP_AHEAD_OF_PEER = 1.03
"""Our training step's estimated time at most the peer's / 1.03 on every step model (issue 35), in bfloat16 and as
Trainer's `bf16=True` runs it (mixed precision, issue 46)."""
STEP_TARGET_KIND = "training step"
"""The kind of the step's targets (no region's)."""
LONGEST_OVER_EAGER = 16
"""Ours with Ulysses SP trains at least 16 x eager HF's longest sequence on the same devices (issue 44)."""
LONGEST_TOKENS = {"Llama-3-8B": 1_000_000}
"""The longest sequence ours with Ulysses SP trains on `LONGEST_DEVICES` x 64 GB, at least (issue 44; ALST, arXiv
2506.13996: 3.7M tokens for Llama-8B on 8 x 80 GB H100)."""
LONGEST_DEVICES = 8
"""The device count of the longest-sequence targets."""


BEFORE_CARD_STUDY = "layer without the card"
"""The study of the counted rows of a decoder layer without the card that swaps it (variant: "without <card>")."""


LAYER_TARGET = CountedTarget("bytes", ("fwd+bwd",), LAYER_BYTES_TOLERANCE, LAYER_TARGET_SHAPE, kind=LAYER)


@functools.cache
def counted_targets() -> tuple[CountedTarget, ...]:
    """Return every counted target: each card's, then the decoder layer's.

    A card's are its spec's COUNTED_TARGETS, of its region, then its region's estimated time at most eager's
    (`REGION_TIME_PHASES`), in the order of the cards."""
    cards = tuple(
        target
        for card, spec in specs()
        for target in (
            *(dataclasses.replace(t, kind=card.region) for t in spec.COUNTED_TARGETS),
            CountedTarget(ESTIMATE_UNIT, REGION_TIME_PHASES, 1, against="eager", kind=card.region),
        )
    )
    return (*cards, LAYER_TARGET)


def counted_target(row: Row) -> str:
    """The target a counted row is held to, as the CSV states it ("" for none)."""
    return next((t.text.removeprefix("kernelized ") for t in counted_targets() if t.applies(row)), "")


def unmeasured(rows: list[Row]) -> list[str]:
    """The counted targets no region row speaks of at any shape, each named "<kind>: <target>".

    On a run over every bench model, such a target's region occurs in none of them: it would be held to nothing."""
    return [
        f"{t.kind}: {t.text} ({' and '.join(t.phases)})"
        for t in counted_targets()
        if not any(dataclasses.replace(t, shape=None).applies(r) for r in rows)
    ]


def require_every_target_measured(rows: list[Row]) -> None:
    """Fail (SystemExit) naming each counted target the rows of a run over every bench model do not measure."""
    missing = unmeasured(rows)
    if missing:
        raise SystemExit(
            "bench: no bench model has the region of these targets, so nothing holds them: "
            + "; ".join(missing)
            + ". Give the bench a model with the region (scripts/bench/configs.py, or the OUTSIDE_REGION of the card's"
            " spec), or drop the target."
        )


@dataclass(frozen=True)
class Result:
    """A target and what was measured: met True or False, or None when there is nothing to measure yet."""

    kind: str  # the region kind it is about, "decoder layer", or "" (host-side)
    target: str
    measured: str
    met: bool | None


def evaluate(rows: list[Row]) -> list[Result]:
    """Every target the rows measure, in the order of the summary."""
    out = []
    layer = [r for r in rows if r.study in REGION_STUDIES]
    for target in counted_targets():
        held = [r for r in layer if target.applies(r)]
        if not held:
            continue
        phases = " and ".join(target.phases)
        if target.shape is not None:  # one target per model
            for r in held:
                label = f"{r.model} {target.kind}: {target.text} ({phases}, batch {r.batch} x seq {r.seq})"
                share = (
                    f"{r.kernelized / r.eager:.3f} x eager" if target.against == "eager" else f"{r.ratio:.3f} x floor"
                )
                out.append(Result(target.kind, label, share, target.met(r)))
            continue
        label = f"{target.kind}: {target.text} ({phases})"
        uncovered = sorted({r.model for r in held if r.kernelized is None}, key=[r.model for r in held].index)
        held = [r for r in held if r.kernelized is not None]
        if not held:
            out.append(Result(target.kind, label, NO_CARD, None))
            continue
        if target.against == "documented":
            text = _against_documented(target, held)
        elif target.unit == "ops":
            worst = [max((r for r in held if r.phase == p), key=lambda r: r.ratio) for p in target.phases]
            text = ", ".join(f"{r.kernelized:.0f} vs {r.floor:.0f} ({r.phase}, {r.model})" for r in worst)
        elif target.against == "eager":
            worst_bytes = max(held, key=lambda r: r.kernelized / r.eager)
            share = worst_bytes.kernelized / worst_bytes.eager
            size = f"batch {worst_bytes.batch} x seq {worst_bytes.seq}"
            text = f"up to {share:.3f} x eager ({worst_bytes.phase}, {worst_bytes.model}, {size})"
        else:
            worst_bytes = max(held, key=lambda r: r.ratio)
            text = f"up to {worst_bytes.ratio:.3f} x floor ({worst_bytes.phase}, {worst_bytes.model})"
        if uncovered:  # the models whose region no card swaps: held to nothing, named
            text += f"; {NO_CARD} for {', '.join(uncovered)}"
        out.append(Result(target.kind, label, text, all(target.met(r) for r in held)))
    for card, _ in with_piece("EXPERTS_SWEEP"):
        out += _experts_sweep(card, rows)
    for card, target in with_piece("BEFORE_CARD_TARGET"):
        out += _before_card(card, target, rows)
    out += _step(rows)
    out += _longest(rows)
    out += _host(rows)
    return out


def _against_documented(target: CountedTarget, held: list[Row]) -> str:
    """What rows held to their documented minimum measure: per phase, the row furthest above it (ops: the counts)."""

    def share(r: Row) -> float:
        return r.kernelized / r.documented

    phases = [p for p in target.phases if any(r.phase == p for r in held)]
    worst = [max((r for r in held if r.phase == p), key=share) for p in phases]
    if target.unit == "ops":
        return ", ".join(f"{r.kernelized:.0f} vs {r.documented:.0f} ({r.phase}, {r.model})" for r in worst)
    r = max(worst, key=share)
    return f"up to {share(r):.3f} x documented minimum ({r.phase}, {r.model}, batch {r.batch} x seq {r.seq})"


def _step(rows: list[Row]) -> list[Result]:
    """Per step row (each step model; the mixed-precision ones): our estimated step at most the peer's / 1.03.

    The row's config names the step: the model's name, or it with the mixed precision it runs (`step_study`)."""
    out = []
    steps = (r for r in rows if r.study == ESTIMATE_STUDY or (r.study == MIXED_PRECISION_STUDY and r.unit == "ms"))
    for r in (r for r in steps if r.peer is not None and r.kernelized):
        label = f"{r.config} {STEP_TARGET_KIND}: estimated time <= peer / {STEP_AHEAD_OF_PEER:g} (batch {r.batch} x "
        label += f"seq {r.seq}, estimate)"
        ahead = r.peer / r.kernelized
        measured = f"peer / ours {ahead:.3f} ({r.kernelized / 1e3:.2f} vs {r.peer / 1e3:.2f} s)"
        out.append(Result(STEP_TARGET_KIND, label, measured, ahead >= STEP_AHEAD_OF_PEER))
    return out


def _longest(rows: list[Row]) -> list[Result]:
    """Per model, on `LONGEST_DEVICES` devices: the longest-sequence targets, met or not.

    Ours with SP at least `LONGEST_OVER_EAGER` x eager HF's longest sequence, and at least `LONGEST_TOKENS` where the
    model has one (counted peaks, `long_context`)."""
    out = []
    for r in (r for r in rows if r.study == LONGEST_STUDY and r.path == str(LONGEST_DEVICES)):
        where = f"{r.model} longest trainable sequence on {LONGEST_DEVICES} x 64 GB (counted)"
        ours = f"{r.kernelized:,.0f} tokens ({r.variant})"
        ratio = r.kernelized / r.eager if r.eager else float("inf")
        label = f"{where}: ours + SP >= {LONGEST_OVER_EAGER} x eager HF's"
        measured = f"{ours} vs eager {r.eager:,.0f}: {ratio:.1f} x"
        out.append(Result(STEP_TARGET_KIND, label, measured, ratio >= LONGEST_OVER_EAGER))
        if r.model in LONGEST_TOKENS:
            label = f"{where}: ours + SP >= {LONGEST_TOKENS[r.model]:,} tokens"
            out.append(Result(STEP_TARGET_KIND, label, ours, r.kernelized >= LONGEST_TOKENS[r.model]))
    return out


def _experts_sweep(card: Card, rows: list[Row]) -> list[Result]:
    """The experts sweep of a card's region: the card's op count the same for every number of experts."""
    label = f"{card.region}: op count independent of #experts"
    loop = [r for r in sweep_ops(rows, card.region) if r.implementation == "eager"]
    if not loop:
        return []
    experts = "/".join(str(r.experts) for r in loop)
    eager = "/".join(f"{r.eager:.0f}" for r in loop)
    if any(r.kernelized is None for r in loop):
        return [Result(card.region, label, f"{NO_CARD}; eager loop {eager}", None)]
    counts = sorted({int(r.kernelized) for r in loop})
    text = f"{card.repo_name} {'/'.join(map(str, counts))} ops for {experts} experts, fwd+bwd (eager loop: {eager})"
    return [Result(card.region, label, text, len(counts) == 1)]


def _before_card(card: Card, target: BeforeCardTarget, rows: list[Row]) -> list[Result]:
    """Return the rows without the card: the default path's decoder layer against the layer without the card.

    One per model and shape counted without the card: the default path's decoder layer (forward+backward) against the
    kernelized layer without the card, ops and bytes (`BeforeCardTarget`)."""
    out = []
    variant = f"without {card.repo_name}"
    before = [r for r in rows if r.study == BEFORE_CARD_STUDY and r.variant == variant and r.phase == "fwd+bwd"]
    layers = {
        (r.model, r.unit, r.batch, r.seq): r
        for r in rows
        if (r.study, r.kind, r.phase) == ("layer", LAYER, "fwd+bwd") and r.kernelized is not None
    }
    for b in before:
        default = layers.get((b.model, b.unit, b.batch, b.seq))
        if default is None:
            continue
        where = f"{b.model} {LAYER} with {card.repo_name}"
        shape = f"fwd+bwd, batch {b.batch} x seq {b.seq}"
        if b.unit == "bytes":
            activation = activation_bytes(b.model, b.batch, b.seq)
            fewer = f"{target.fewer_activations} activation" + "s" * (target.fewer_activations != 1)
            label = f"{where}: kernelized bytes <= the layer without it - {fewer} ({shape})"
            saved = (b.kernelized - default.kernelized) / activation
            measured = f"{saved:.3f} activations fewer ({default.kernelized / 1e9:.2f} vs {b.kernelized / 1e9:.2f} GB)"
            met = default.kernelized <= b.kernelized - target.fewer_activations * activation
            out.append(Result(LAYER, label, measured, met))
        elif b.unit == "ops":
            label = f"{where}: kernelized op count <= the layer without it - {target.fewer_ops} ({shape})"
            measured = f"{default.kernelized:.0f} vs {b.kernelized:.0f}"
            out.append(Result(LAYER, label, measured, default.kernelized <= b.kernelized - target.fewer_ops))
    return out


def _host(rows: list[Row]) -> list[Result]:
    out = []
    timed = [r for r in rows if r.mode == "timed" and not r.emulated]
    for r in (r for r in timed if r.study == "kernelize"):
        met = r.kernelized < KERNELIZE_TARGET_MS
        out.append(Result("", f"kernelize of 32 layers < {KERNELIZE_TARGET_MS:g} ms", f"{r.kernelized:.1f} ms", met))
    overheads = [CallOverheadRow.of(r) for r in timed if r.study == OVERHEAD_STUDY]
    if overheads:
        text = ", ".join(f"{r.region} {r.overhead_us:.2f} us" for r in overheads)
        met = all(r.overhead_us < OVERHEAD_TARGET_US for r in overheads)
        out.append(Result("", f"per-call overhead < {OVERHEAD_TARGET_US:g} us", text, met))
    for r in (HostCostRow.of(r) for r in timed if r.study == HOST_COST_STUDY):
        label = f"{r.region}: host cost of a call <= {HOST_COST_BOUND:g} x a bare module call (decode, ops stubbed)"
        measured = f"{r.ratio:.2f} x ({r.call_us:.1f} vs {r.bare_us:.1f} us)"
        out.append(Result(r.region, label, measured, r.ratio <= HOST_COST_BOUND))
    fallbacks = [(r.kind, r.ratio) for r in timed if r.study == "fallback"]
    if fallbacks:
        text = ", ".join(f"{kind} {ratio:.2f} x eager" for kind, ratio in fallbacks)
        met = all(ratio <= FALLBACK_TOLERANCE for _, ratio in fallbacks)
        label = f"torch-universal fallback not slower than eager (<= {FALLBACK_TOLERANCE:g} x)"
        out.append(Result("", label, text, met))
    return out
