"""The step's time model checked against published step-level figures (`published.toml`).

Each figure of `PUBLISHED` is predicted with the same model and the same fusion (the cards of the same ops, alone), at
the batch the source gives or the one stated as assumed, from steps derived as `step.derived_step`
(docs/step-model.md#validation).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from .rows import Row, log
from .step import STEP_MODELS, VALIDATION_STUDY, Figures, derived_step, estimated_seconds


@dataclass(frozen=True)
class Published:
    """A published step-level figure and how the model predicts it.

    what: "throughput %" (gain of tokens per second), "step time %" (change of the step's time), "memory %"
    (change of peak memory), "step time ratio" (eager / fused), "peak GB" (peak memory saved, GB).
    kernels: the cards that make the same fusion (kernel ids); the eager step is the baseline.
    """

    source: str
    claim: str
    model: str
    kernels: tuple[str, ...]
    what: str
    value: float
    batch: int
    seq: int
    assumed: str


PUBLISHED_FILE = Path(__file__).with_name("published.toml")


def load_published(path: Path = PUBLISHED_FILE) -> tuple[Published, ...]:
    """The published figures of `path` (scripts/bench/published.toml), in order."""
    entries = tomllib.loads(path.read_text())["published"]
    return tuple(Published(**dict(entry, kernels=tuple(entry["kernels"]))) for entry in entries)


PUBLISHED: tuple[Published, ...] = load_published()


def predict(claim: Published, eager: Figures, fused: Figures) -> float:
    """The model's prediction of a published figure, from the eager and the fused steps."""
    te, tf = estimated_seconds(eager), estimated_seconds(fused)
    if claim.what == "throughput %":
        return (te / tf - 1) * 100
    if claim.what == "step time %":
        return (tf / te - 1) * 100
    if claim.what == "step time ratio":
        return te / tf
    if claim.what == "memory %":
        return (fused["peak bytes"] / eager["peak bytes"] - 1) * 100
    if claim.what == "peak GB":
        return (eager["peak bytes"] - fused["peak bytes"]) / 1e9
    raise ValueError(f"unknown published figure {claim.what!r}")


def error_text(claim: Published, predicted: float) -> str:
    """The prediction's error: in points for percentages, relative otherwise."""
    if claim.what.endswith("%"):
        return f"{predicted - claim.value:+.1f} points"
    return f"{(predicted / claim.value - 1) * 100:+.0f}%"


@dataclass(frozen=True)
class ValidationRow:
    """A published step-level figure beside the time model's prediction of it: a row of the validation table."""

    source: str
    claim: str
    model: str  # ModelSpec.name
    batch: int
    seq: int
    published: float
    predicted: float
    what: str  # the figure's kind and unit (Published.what)
    error: str  # `error_text`: in points for percentages, relative otherwise
    assumptions: str

    def csv_row(self) -> Row:
        """Return its line of bench.csv.

        The published figure is in the eager column, the prediction in the kernelized one, the error in the target one
        and the figure's kind in the unit and path ones."""
        return Row(
            "estimated", self.source, self.claim, "fwd+bwd+AdamW", self.batch, self.seq, eager=self.published,
            kernelized=self.predicted, unit=self.what, target=self.error, note=self.assumptions,
            study=VALIDATION_STUDY, model=self.model, path=self.what,
        )  # fmt: skip

    @classmethod
    def of(cls, row: Row) -> ValidationRow:
        """The validation row a line of bench.csv holds (what `csv_row` wrote)."""
        return cls(
            source=row.config, claim=row.op, model=row.model, batch=row.batch, seq=row.seq, published=row.eager,
            predicted=row.kernelized, what=row.unit, error=row.target, assumptions=row.note,
        )  # fmt: skip


def validation_rows(build, quick: bool = False, keys: tuple[str, ...] = tuple(STEP_MODELS)) -> list[ValidationRow]:
    """Return rows setting each published figure about a model of `keys` beside the model's prediction.

    The figures are those of `PUBLISHED`, at the source's model and batch (or the stated assumption; `quick`: 1 x 512),
    from steps derived as `derived_step`."""
    cache: dict[tuple, Figures] = {}

    def step(key: str, batch: int, seq: int, kernels: tuple[str, ...]) -> Figures:
        if (key, batch, seq, kernels) not in cache:
            variant = "kernelized" if kernels else "eager"
            cache[(key, batch, seq, kernels)] = derived_step(
                STEP_MODELS[key], batch, seq, variant, build=build, kernels=kernels
            )
        return cache[(key, batch, seq, kernels)]

    rows = []
    for claim in (claim for claim in PUBLISHED if claim.model in keys):
        batch, seq = (1, 512) if quick else (claim.batch, claim.seq)
        predicted = predict(claim, step(claim.model, batch, seq, ()), step(claim.model, batch, seq, claim.kernels))
        rows.append(
            ValidationRow(
                claim.source, claim.claim, STEP_MODELS[claim.model].spec.name, batch, seq, published=claim.value,
                predicted=predicted, what=claim.what, error=error_text(claim, predicted),
                assumptions=f"assumed: {claim.assumed}; fused: {', '.join(claim.kernels)}",
            )
        )  # fmt: skip
    log(f"  step model validation: {len(rows)} published figures")
    return rows
