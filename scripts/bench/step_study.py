"""The bench.csv rows of the counted training step: per step model, eager, ours and the peer, and its estimates.

`step_rows` runs every step study of the bench: the step (`step.derived_step`) per model of `step.STEP_MODELS` with
its estimated time, its bytes and time by category (`CategoryRow`) and its largest 'other' ops (`OtherOpRow`); the
time model's validation (`step_validation`); the decode step (`decode_rows`); and the step as Trainer's `bf16=True`
runs it (`mixed_precision_rows`). `step_report` renders these rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .markdown import human_bytes
from .peer import Peer
from .rows import ESTIMATE_STUDY, MIXED_PRECISION_STUDY, Row, log
from .step import (
    CATEGORY_STUDY,
    DECODE_STUDY,
    LARGEST_OTHER_OPS,
    OTHER_OP,
    OTHER_OPS_STUDY,
    QUICK_STEP_SHAPE,
    STEP_KIND,
    STEP_MODELS,
    STEP_SHAPE,
    STEP_STUDY,
    VARIANTS,
    Figures,
    StepModel,
    categories,
    derived_step,
    estimated_seconds,
    measure_decode,
)
from .step_validation import validation_rows

UNITS = {"ops": "ops", "bytes": "bytes", "flops": "FLOPs", "peak bytes": "peak bytes", "saved bytes": "saved bytes"}
DERIVED_NOTE = (
    "derived: measured whole at 2 and 3 layers on fake tensors, carried to {layers} layers "
    "(exact for ops, bytes, FLOPs; peak: params + AdamW state {state} + the step's peak of live bytes)"
)


def step_rows(peer: Peer | None, quick: bool, build, keys: tuple[str, ...] = tuple(STEP_MODELS)) -> list[Row]:
    """Return the bench.csv rows of the counted training step of each model and its estimates.

    The rows cover each model (eager, ours, the peer's), its estimated time and its bytes and time by category; then the
    time model's validation and the decode-step estimate."""
    batch, seq = QUICK_STEP_SHAPE if quick else STEP_SHAPE
    rows = []
    try:
        for key in keys:
            started = time.perf_counter()
            model = STEP_MODELS[key]
            variants = [v for v in VARIANTS if v != "peer" or peer is not None]
            steps = {v: derived_step(model, batch, seq, v, peer=peer, build=build) for v in variants}
            rows += _rows_of(model, batch, seq, steps)
            seconds = time.perf_counter() - started
            log(f"  counted training step {model.spec.name}, batch {batch}, seq {seq}: {seconds:.1f} s")
        rows += [validation.csv_row() for validation in validation_rows(build, quick, keys)]
        rows += decode_rows(peer, build, keys)
        rows += mixed_precision_rows(peer, build, batch, seq, keys)
    finally:
        from npu_hub_kernels import register_npu_kernels

        register_npu_kernels(local_dir=build)  # every card again, after the one-card selections of the validation
    return rows


def _rows_of(model: StepModel, batch: int, seq: int, steps: dict[str, Figures]) -> list[Row]:
    name, peer = model.spec.name, steps.get("peer")
    note = DERIVED_NOTE.format(layers=model.layers, state=human_bytes(steps["eager"]["state bytes"]))
    common = dict(batch=batch, seq=seq, model=name, experts=model.spec.experts, kind=STEP_KIND)
    rows = []
    for figure, unit in UNITS.items():
        rows.append(
            Row(
                "counted", name, STEP_KIND, "fwd+bwd+AdamW", eager=steps["eager"][figure],
                kernelized=steps["kernelized"][figure], peer=peer[figure] if peer else None, unit=unit,
                note=note, study=STEP_STUDY, **common,
            )
        )  # fmt: skip
    rows.append(
        Row(
            "estimated", name, "estimated step time (Atlas A2 model)", "fwd+bwd+AdamW",
            eager=estimated_seconds(steps["eager"]) * 1e3, kernelized=estimated_seconds(steps["kernelized"]) * 1e3,
            peer=estimated_seconds(peer) * 1e3 if peer else None, unit="ms",
            note="estimate (not a measurement): scripts/bench/device_model.py; device "
            + ", ".join(f"{v} {s['device s'] * 1e3:.0f} ms" for v, s in steps.items())
            + "; host " + ", ".join(f"{v} {s['host s'] * 1e3:.0f} ms" for v, s in steps.items()),
            study=ESTIMATE_STUDY, **common,
        )
    )  # fmt: skip
    for kind in categories():
        for figure, unit, scale in (("bytes", "bytes", 1), ("device s", "ms", 1e3)):
            label = f"{figure}: {kind}"
            split = CategoryRow(
                name, model.spec.experts, batch, seq, kind, unit, eager=steps["eager"][label] * scale,
                kernelized=steps["kernelized"][label] * scale, peer=peer[label] * scale if peer else None,
            )  # fmt: skip
            rows.append(split.csv_row())
    ours = steps["kernelized"].values
    largest = sorted((n for n in ours if n.startswith(OTHER_OP)), key=lambda n: (-ours[n], n))[:LARGEST_OTHER_OPS]
    for label in largest:
        other = OtherOpRow(
            name, model.spec.experts, batch, seq, label.removeprefix(OTHER_OP), eager=steps["eager"][label] * 1e3,
            kernelized=ours[label] * 1e3, peer=peer[label] * 1e3 if peer else None,
        )  # fmt: skip
        rows.append(other.csv_row())
    return rows


@dataclass(frozen=True)
class CategoryRow:
    """One category of a step's ops (`categories()`): its counted bytes or its estimated device time, per variant."""

    model: str  # ModelSpec.name
    experts: int | None
    batch: int
    seq: int
    category: str  # one of `categories()`
    unit: str  # "bytes" (counted) or "ms" (estimated device time)
    eager: float
    kernelized: float
    peer: float | None

    def csv_row(self) -> Row:
        """Return its line of bench.csv: the category in the op and path columns."""
        counted = self.unit == "bytes"
        return Row(
            "counted" if counted else "estimated", self.model, self.category, "fwd+bwd+AdamW", eager=self.eager,
            kernelized=self.kernelized, peer=self.peer, unit=self.unit,
            note="share of the step" if counted else "estimate: device time of these ops", study=CATEGORY_STUDY,
            path=self.category, batch=self.batch, seq=self.seq, model=self.model, experts=self.experts, kind=STEP_KIND,
        )  # fmt: skip

    @classmethod
    def of(cls, row: Row) -> CategoryRow:
        """The category row a line of bench.csv holds (what `csv_row` wrote)."""
        return cls(
            model=row.model, experts=row.experts, batch=row.batch, seq=row.seq, category=row.path, unit=row.unit,
            eager=row.eager, kernelized=row.kernelized, peer=row.peer,
        )  # fmt: skip


def category_rows(rows: list[Row], unit: str) -> list[CategoryRow]:
    """The step's categories in `unit` ("bytes" or "ms"), in the rows' order."""
    return [CategoryRow.of(r) for r in rows if r.study == CATEGORY_STUDY and r.unit == unit]


@dataclass(frozen=True)
class OtherOpRow:
    """One aten op of the step's `OTHER` category: its estimated device time over the step (ms), per variant."""

    model: str  # ModelSpec.name
    experts: int | None
    batch: int
    seq: int
    aten_op: str
    eager: float
    kernelized: float
    peer: float | None

    def csv_row(self) -> Row:
        """Return its line of bench.csv: the aten op in the op and path columns."""
        return Row(
            "estimated", self.model, self.aten_op, "fwd+bwd+AdamW", self.batch, self.seq, eager=self.eager,
            kernelized=self.kernelized, peer=self.peer, unit="ms",
            note="estimate: device time of this aten op in the 'other' category, summed over the step",
            study=OTHER_OPS_STUDY, kind=STEP_KIND, path=self.aten_op, model=self.model, experts=self.experts,
        )  # fmt: skip

    @classmethod
    def of(cls, row: Row) -> OtherOpRow:
        """The other-op row a line of bench.csv holds (what `csv_row` wrote)."""
        return cls(
            model=row.model, experts=row.experts, batch=row.batch, seq=row.seq, aten_op=row.path, eager=row.eager,
            kernelized=row.kernelized, peer=row.peer,
        )  # fmt: skip


def decode_rows(peer: Peer | None, build, keys: tuple[str, ...] = tuple(STEP_MODELS)) -> list[Row]:
    """The estimated decode step (one token, batch 1) per model: device and host time; the host bounds it."""
    rows = []
    for key in keys:
        model = STEP_MODELS[key]
        variants = [v for v in VARIANTS if v != "peer" or peer is not None]
        steps = {}
        for v in variants:
            two = measure_decode(model.spec, 2, model.vocab, v, peer)
            three = measure_decode(model.spec, 3, model.vocab, v, peer)
            steps[v] = two.scaled(three, model.layers - 2)
        peer_step = steps.get("peer")
        rows.append(
            Row(
                "estimated", model.spec.name, "decode step, one token (Atlas A2 model)", "fwd", 1, 1,
                eager=estimated_seconds(steps["eager"]) * 1e3, kernelized=estimated_seconds(steps["kernelized"]) * 1e3,
                peer=estimated_seconds(peer_step) * 1e3 if peer_step else None, unit="ms",
                note="estimate: " + "; ".join(
                    f"{v} {s['ops']:.0f} ops, device {s['device s'] * 1e3:.2f} ms, host {s['host s'] * 1e3:.2f} ms"
                    for v, s in steps.items()
                ),
                study=DECODE_STUDY, model=model.spec.name, experts=model.spec.experts, kind=STEP_KIND,
            )
        )  # fmt: skip
    return rows


MIXED_PRECISION_MODELS = ("llama-3-8b",)
"""The step models also counted as Trainer's `bf16=True` trains them: float32 weights, AdamW state and gradients, the
forward under `torch.autocast("npu", bfloat16)`: every matmul casts its float32 weight to bfloat16 on each call, sdpa
its float32 q and k (`accounting`'s stand-ins see the operands autocast gives the kernel)."""


@dataclass(frozen=True)
class MixedPrecisionRow:
    """One figure of a model's training step under Trainer's `bf16=True`, eager against ours and the peer."""

    model: str  # ModelSpec.name
    batch: int
    seq: int
    unit: str  # "ops", "bytes" or "ms" (the estimated step time)
    eager: float
    kernelized: float
    peer: float | None

    def csv_row(self) -> Row:
        """Return its line of bench.csv: counted for ops and bytes, estimated for the time."""
        mode, op = (
            ("estimated", "estimated step time (Atlas A2 model)") if self.unit == "ms" else ("counted", STEP_KIND)
        )
        return Row(
            mode, f"{self.model}, float32 weights, bf16 autocast", op, "fwd+bwd+AdamW", self.batch, self.seq,
            eager=self.eager, kernelized=self.kernelized, peer=self.peer, unit=self.unit,
            study=MIXED_PRECISION_STUDY, model=self.model, kind=STEP_KIND,
        )  # fmt: skip

    @classmethod
    def of(cls, row: Row) -> MixedPrecisionRow:
        """The mixed-precision row a line of bench.csv holds (what `csv_row` wrote)."""
        return cls(row.model, row.batch, row.seq, row.unit, row.eager, row.kernelized, row.peer)


def mixed_precision_rows(
    peer: Peer | None, build, batch: int, seq: int, keys: tuple[str, ...] = tuple(STEP_MODELS)
) -> list[Row]:
    """Return the rows of each model of `MIXED_PRECISION_MODELS` in `keys`: its step under Trainer's `bf16=True`."""
    rows = []
    for key in (key for key in MIXED_PRECISION_MODELS if key in keys):
        model = STEP_MODELS[key]
        variants = [v for v in VARIANTS if v != "peer" or peer is not None]
        steps = {v: derived_step(model, batch, seq, v, peer=peer, build=build, mixed=True) for v in variants}
        for unit, value in (("ops", lambda f: f["ops"]), ("bytes", lambda f: f["bytes"]), ("ms", _estimated_ms)):
            eager, ours, theirs = (value(steps[v]) if v in steps else None for v in VARIANTS)
            rows.append(MixedPrecisionRow(model.spec.name, batch, seq, unit, eager, ours, theirs).csv_row())
        log(f"  counted mixed-precision training step {model.spec.name}, batch {batch}, seq {seq}")
    return rows


def _estimated_ms(figures: Figures) -> float:
    return estimated_seconds(figures) * 1e3
