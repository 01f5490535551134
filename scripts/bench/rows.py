"""One measurement (a line of bench.csv), with typed fields to select rows by, and the CSV."""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass
from pathlib import Path

MEMORY_UNITS = ("saved bytes", "peak bytes")
"""The units of the counted memory rows (forward+backward; `memory`): kept for backward, peak live."""
ESTIMATE_UNIT = "ms (estimate)"
"""The unit of a region's estimated Atlas A2 device time (`device_model`, from its counted ops): mode "estimated"."""
EMULATED = "emulated (not a device measurement)"
"""The note of device timings taken on the emulation."""
OUTSIDE_STUDY = "outside the layer"
"""The study of a region outside the decoder layer, counted on its own (`outside`): the card at its default."""
ATTENTION_STUDY = "attention region"
"""The study of the attention core of a layer, counted per attention implementation (`attention`)."""
REGION_STUDIES = ("layer", OUTSIDE_STUDY, ATTENTION_STUDY)
"""The studies of a region's own counted rows: held to its card's COUNTED_TARGETS, shown in the counted and memory
tables."""
CHUNK_STUDY = "chunk sweep"
"""The study of a region outside the decoder layer counted with the card at other tokens per chunk (`Row.chunk`)."""
ESTIMATE_STUDY = "step estimate"
"""The study of a whole training step's estimated Atlas A2 time (`step`), which the step targets read (`targets`)."""
MIXED_PRECISION_STUDY = "step, mixed precision"
"""The study of a training step as Trainer's `bf16=True` runs it (`step_study.MIXED_PRECISION_MODELS`): its ops, bytes
and estimated time (unit "ms"), which the step targets read too (`targets`)."""
EXPERTS_SWEEP_STUDY = "experts sweep"
"""The study of an MoE region counted with other numbers of experts (`ExpertsSweepRow`)."""
LONGEST_STUDY = "longest sequence"
"""The study of the longest trainable sequence per model and device count (`long_context`), in tokens: eager HF's in
the eager column, the peer's, and ours with Ulysses SP in the kernelized one (the longest of its setups, named in
`variant`); the devices in `path`. The targets read it (`targets`)."""


@dataclass
class Row:
    """One measurement: a line of bench.csv.

    `config`, `op` and `note` are labels for people; select rows by the typed fields below them, never by
    label text.
    """

    mode: str  # counted | timed | parity
    config: str
    op: str
    phase: str  # fwd | fwd+bwd | host
    batch: int | str = ""
    seq: int | str = ""
    eager: float | None = None
    kernelized: float | None = None
    floor: float | None = None
    peer: float | None = None
    """The peer (LLaMA-Factory's NPU kernels) on the same layer or region; None: no peer column."""
    unit: str = ""
    """Counted: "ops", "bytes" (moved by the ops), or one of MEMORY_UNITS. Timed: a time unit."""
    target: str = ""
    note: str = ""
    machine: str = ""
    versions: str = ""
    study: str = ""
    """What the row belongs to. Counted: "layer" (a decoder layer and its regions), EXPERTS_SWEEP_STUDY, OUTSIDE_STUDY
    and CHUNK_STUDY (a region outside the decoder layer), an extra column's studies (`cards.ExtraColumn`).
    Timed: "kernelize", "call overhead", "host cost" (a card's call against a bare module call, ops stubbed),
    "get_kernel", "fallback" (torch-universal on CPU), "device", "training".
    Parity: `peer.PARITY_STUDY` (a peer kernel's output against eager on a tiny model family)."""
    kind: str = ""
    """The region kind (a card's card.toml `region`) or "decoder layer"; "" for none."""
    variant: str = "default"
    """The kernelized column's variant: "default", kernelize alone (what users get)."""
    path: str = ""
    """What a study's rows vary beside the columns, written by its typed row: the experts implementation
    (`ExpertsSweepRow`), the step's category or aten op (`step_study.CategoryRow`, `step_study.OtherOpRow`), the
    validation's figure kind (`step_validation.ValidationRow`), the attention region's mask scenario
    (`attention.AttentionRow`)."""
    model: str = ""
    """The model's name (ModelSpec.name)."""
    experts: int | None = None
    """The number of experts of an MoE layer."""
    emulated: bool = False
    """A device timing taken on the emulation (not a device measurement)."""
    peer_patched: bool | None = None
    """Whether the peer patched the region (False: it leaves it to transformers, and the peer column is eager's)."""
    outcome: str = ""
    """Peer parity: what the check found (`peer.OUTCOMES`)."""
    chunk: int | None = None
    """The tokens per chunk the kernelized column ran, for a region outside the decoder layer whose card computes in
    chunks (`cards.OutsideRegion`); None: not chunked."""
    extra: float | None = None
    """The extra column of a region outside the decoder layer (`cards.ExtraColumn`, e.g. TRL's fused LM head): its
    figure, on the same region as the eager and kernelized ones; the row's study names the column's variant. Also
    written by the typed rows of `attention.AttentionRow` (flash_attention_2) and `padding_free.PaddingFreeRow`
    (packed through sdpa). None: not measured."""
    documented: float | None = None
    """Counted ops or bytes of a region whose card's spec defines `documented_minimum`: the region as the fewest
    torch_npu calls the device documents that compute it (the floor where those reach it); None: not stated."""

    @property
    def ratio(self) -> float | None:
        """Counted rows: kernelized / floor. Timed rows: kernelized / eager (below 1: faster)."""
        base = self.floor if self.mode == "counted" else self.eager
        return None if not base or self.kernelized is None else self.kernelized / base


CSV_COLUMNS = ["machine", "versions", "mode", "config", "op", "phase", "batch", "seq"]
CSV_COLUMNS += ["eager", "kernelized", "floor", "peer", "ratio", "unit", "target", "note"]
CSV_COLUMNS += ["study", "kind", "variant", "path", "model", "experts", "emulated", "peer_patched", "outcome"]
CSV_COLUMNS += ["chunk", "extra", "documented"]


@dataclass(frozen=True)
class ExpertsSweepRow:
    """An MoE region counted with `experts` experts under one experts implementation (`counted.experts_sweep_rows`)."""

    model: str  # ModelSpec.name
    experts: int
    region: str  # the card's region kind
    implementation: str  # the eager column's experts implementation: "eager" (the per-expert loop) or "grouped_mm"
    phase: str
    batch: int
    seq: int
    unit: str  # "ops" or "bytes"
    eager: float | None
    kernelized: float | None  # None: the region has no card
    floor: float | None
    peer: float | None
    peer_patched: bool | None
    note: str

    def csv_row(self) -> Row:
        """Return its line of bench.csv: the implementation in the path column."""
        return Row(
            "counted", f"{self.model}, {self.experts} experts", f"{self.region} (transformers {self.implementation})",
            self.phase, self.batch, self.seq, eager=self.eager, kernelized=self.kernelized, floor=self.floor,
            peer=self.peer, unit=self.unit, target="independent of #experts" if self.unit == "ops" else "",
            note=self.note, study=EXPERTS_SWEEP_STUDY, kind=self.region, path=self.implementation, model=self.model,
            experts=self.experts, peer_patched=self.peer_patched,
        )  # fmt: skip

    @classmethod
    def of(cls, row: Row) -> ExpertsSweepRow:
        """The experts sweep row a line of bench.csv holds (what `csv_row` wrote)."""
        return cls(
            model=row.model, experts=row.experts, region=row.kind, implementation=row.path, phase=row.phase,
            batch=row.batch, seq=row.seq, unit=row.unit, eager=row.eager, kernelized=row.kernelized, floor=row.floor,
            peer=row.peer, peer_patched=row.peer_patched, note=row.note,
        )  # fmt: skip


def sweep_ops(rows: list[Row], region: str) -> list[ExpertsSweepRow]:
    """The experts sweep's forward+backward op counts of the region `region`, in the rows' order."""
    return [
        ExpertsSweepRow.of(r)
        for r in rows
        if r.study == EXPERTS_SWEEP_STUDY and r.kind == region and r.unit == "ops" and r.phase == "fwd+bwd"
    ]


def write_csv(rows: list[Row], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for row in rows:
            values = {**asdict(row), "ratio": row.ratio}
            writer.writerow(["" if values[c] is None else _csv_value(values[c]) for c in CSV_COLUMNS])


def _csv_value(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def log(message: str) -> None:
    print(message, flush=True)


def largest_shape(rows: list[Row]) -> tuple[int, int]:
    """The (batch, seq) of the most tokens among the rows."""
    _, batch, seq = max((r.batch * r.seq, r.batch, r.seq) for r in rows)
    return batch, seq
