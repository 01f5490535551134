"""The padding-free step: one training step on a published SFT length distribution, padded against packed.

The lengths: the dataset card of AdamCodd/recipe-nlg-alpaca (an Alpaca-format SFT set, about 500K examples), token
counts of its whole prompt with the Llama-3 tokenizer, as deciles: 10% 192, 20% 209, 30% 228, 40% 249, 50% 274,
60% 302, 70% 337, 80% 386, 90% 467, maximum 3,285 (https://huggingface.co/datasets/AdamCodd/recipe-nlg-alpaca,
README.md at commit 116994528fa8fbb611bfeb99e099f6b79f9c911c, "Token Distribution Analysis"). No general chat
mixture with published length percentiles turned up in the corpora searched (Tulu 3's SFT mixture card, for one,
gives counts per source but no lengths), so this recipe set is the figure used: it is short-sequence SFT.

The batch: 8 sequences at the deciles 20% to 90% (each stands for a tenth of the data; the 10% decile and the tail
above 90% are left out, so the padded batch's maximum is the 90% decile, 467: a padding smaller than a random batch
would usually have, whose largest of 8 draws lies near the 92nd percentile and the tail reaches 3,285).

Per step model (`PADDING_FREE_MODELS` of `step.STEP_MODELS`), the step (`step.derived_step`: forward with labels,
backward, AdamW) on the default path (`kernelize`: every card's layer), so that only the batch's form and the
attention differ, of:

- padded, sdpa: [8, 467] with the 2-D padding mask, transformers' default attention (a dense [8, 1, 467, 467] mask);
- packed, sdpa: the 8 sequences in one row [1, 2452] with restarting position ids, which transformers turns into a
  dense [1, 1, T, T] block mask (what sdpa gets from TRL's `padding_free` without flash attention);
- packed, the card: the same row with `cu_seq_lens_q/k` and `max_length_q/k` as TRL's `padding_free` collator gives
  them, and the attention card (`npu_fusion_attention` in TND, one call per layer).

On fake tensors the card cannot read `cu_seq_lens` (a host read of device data), so they are made from host values
fake tensors carry (`host_values`): the card's one host read per forward reads them as the device would.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .attention import card_implementation
from .markdown import human_bytes, table
from .rows import Row, log
from .step import STEP_MODELS, StepModel, derived_step, estimated_seconds

SOURCE = (
    "AdamCodd/recipe-nlg-alpaca dataset card (commit 1169945), Llama-3 tokenizer deciles 20%-90%: "
    "https://huggingface.co/datasets/AdamCodd/recipe-nlg-alpaca"
)
DECILES = {10: 192, 20: 209, 30: 228, 40: 249, 50: 274, 60: 302, 70: 337, 80: 386, 90: 467, 100: 3285}
"""The published token counts by percentile (see the module doc)."""
LENGTHS = tuple(DECILES[p] for p in range(20, 100, 10))
"""The batch: 8 sequences at the deciles 20% to 90%."""
QUICK_LENGTHS = tuple(length // 8 for length in LENGTHS)
PADDING_FREE_STUDY = "padding-free step"
PADDING_FREE_MODELS = ("llama-3-8b", "qwen3-8b")
UNITS = {"tokens": "tokens", "ops": "ops", "bytes": "bytes", "flops": "FLOPs", "peak bytes": "peak bytes"}


@dataclass(frozen=True)
class PaddingFreeRow:
    """One figure of a model's padding-free step: the batch padded (sdpa), packed (sdpa) and packed (the card)."""

    model: str  # ModelSpec.name
    lengths: tuple[int, ...]  # the batch's sequence lengths
    unit: str  # "tokens", one of UNITS' units, or "ms" (the estimated step time)
    padded_sdpa: float
    packed_sdpa: float
    packed_card: float | None  # None: no attention card

    def csv_row(self) -> Row:
        """Return its line of bench.csv.

        Padded is in the eager column, packed with the card in the kernelized one, packed through sdpa in the extra one
        and the lengths in the note."""
        op = {"tokens": "step tokens", "ms": "estimated step time (Atlas A2 model)"}.get(self.unit, "training step")
        return Row(
            "estimated" if self.unit == "ms" else "counted", self.model, op, "fwd+bwd+AdamW", len(self.lengths),
            max(self.lengths), eager=self.padded_sdpa, kernelized=self.packed_card, extra=self.packed_sdpa,
            unit=self.unit, note=f"lengths {'/'.join(map(str, self.lengths))} ({SOURCE}); extra: packed through sdpa",
            study=PADDING_FREE_STUDY, model=self.model,
        )  # fmt: skip

    @classmethod
    def of(cls, row: Row) -> PaddingFreeRow:
        """The padding-free row a line of bench.csv holds (what `csv_row` wrote).

        Its lengths are the batch of `LENGTHS` or `QUICK_LENGTHS` with the row's batch and longest sequence."""
        lengths = next(b for b in (LENGTHS, QUICK_LENGTHS) if (len(b), max(b)) == (row.batch, row.seq))
        return cls(row.model, lengths, row.unit, row.eager, row.extra, row.kernelized)


@contextlib.contextmanager
def host_values(lengths: tuple[int, ...]) -> Iterator[None]:
    """Let the card read a packed row of these lengths on fake tensors as it reads a device's: from host values.

    A fake tensor made by `torch.tensor([...])` carries its values while it has at most CONSTANT_NUMEL_LIMIT (1)
    elements; raised for the block, `cu_seq_lens` keep theirs through the card's reshape, cat and `tolist`. The
    sequence ids transformers finds in the restarting position ids (which fake tensors cannot show it) are the
    lengths', made the same way: the card's mask reads them once per forward, as it reads a device's."""
    from torch._subclasses import fake_tensor
    from transformers import masking_utils

    ids = [number for number, length in enumerate(lengths) for _ in range(length)]
    found, before = masking_utils.find_packed_sequence_indices, fake_tensor.CONSTANT_NUMEL_LIMIT
    masking_utils.find_packed_sequence_indices = lambda position_ids: torch.tensor([ids])
    fake_tensor.CONSTANT_NUMEL_LIMIT = max(len(ids), len(lengths) + 1)
    try:
        yield
    finally:
        fake_tensor.CONSTANT_NUMEL_LIMIT = before
        masking_utils.find_packed_sequence_indices = found


def padded_inputs(lengths: tuple[int, ...]) -> Callable[[], dict]:
    """The padded batch [len(lengths), max(lengths)]: input ids, the 2-D padding mask and labels."""

    def make() -> dict:
        shape = (len(lengths), max(lengths))
        ids = torch.empty(shape, dtype=torch.long, device="npu")
        mask = torch.empty(shape, dtype=torch.long, device="npu")
        return {"input_ids": ids, "attention_mask": mask, "labels": ids}

    return make


def packed_inputs(lengths: tuple[int, ...], cu_seq_lens: bool) -> Callable[[], dict]:
    """The packed row [1, sum(lengths)]: input ids, restarting position ids, labels, and TRL's padding-free kwargs.

    TRL's kwargs (`cu_seq_lens`): the cumulative lengths as host-valued tensors (`host_values`), and the longest."""

    def make() -> dict:
        total = sum(lengths)
        ids = torch.empty(1, total, dtype=torch.long, device="npu")
        positions = torch.empty(1, total, dtype=torch.long, device="npu")
        inputs = {"input_ids": ids, "position_ids": positions, "labels": ids}
        if cu_seq_lens:
            ends = [0, *torch.tensor(lengths).cumsum(0).tolist()]
            cu = torch.tensor(ends, dtype=torch.int32)
            inputs |= {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}
            inputs |= {"max_length_q": max(lengths), "max_length_k": max(lengths)}
        return inputs

    return make


def padding_free_steps(model: StepModel, lengths: tuple[int, ...], build) -> dict[str, object]:
    """The derived steps (`step.Figures`) of the padded batch and the packed row, sdpa and the card."""
    found = card_implementation()
    default = dict(variant="kernelized", build=build)
    steps = {
        "padded, sdpa": derived_step(model, 1, 1, inputs=padded_inputs(lengths), attention="sdpa", **default),
        "packed, sdpa": derived_step(model, 1, 1, inputs=packed_inputs(lengths, False), attention="sdpa", **default),
    }
    if found is not None:
        with host_values(lengths):
            packed = packed_inputs(lengths, True)
            steps["packed, card"] = derived_step(model, 1, 1, inputs=packed, attention=found[1], **default)
    return steps


def padding_free_rows(build, quick: bool, keys: tuple[str, ...] = PADDING_FREE_MODELS) -> list[Row]:
    """Return the bench.csv rows of the padding-free step, per model of `keys` among PADDING_FREE_MODELS.

    Padded (eager column) against packed with the card (kernelized) and packed through sdpa (extra): tokens, ops,
    bytes, FLOPs, peak bytes, estimated time."""
    lengths = QUICK_LENGTHS if quick else LENGTHS
    rows = []
    for key in (k for k in keys if k in PADDING_FREE_MODELS):
        started = time.perf_counter()
        model = STEP_MODELS[key]
        steps = padding_free_steps(model, lengths, build)
        padded, packed, card = steps["padded, sdpa"], steps["packed, sdpa"], steps.get("packed, card")
        tokens = {"padded": len(lengths) * max(lengths), "packed": sum(lengths)}
        figures = [("tokens", tokens["padded"], tokens["packed"], tokens["packed"])]
        figures += [(unit, padded[f], packed[f], card[f] if card else None) for f, unit in list(UNITS.items())[1:]]
        times = (estimated_seconds(s) * 1e3 if s else None for s in (padded, packed, card))
        figures.append(("ms", *times))
        for unit, padded_sdpa, packed_sdpa, packed_card in figures:
            row = PaddingFreeRow(model.spec.name, lengths, unit, padded_sdpa, packed_sdpa, packed_card)
            rows.append(row.csv_row())
        log(f"  counted padding-free step {model.spec.name}: {time.perf_counter() - started:.1f} s")
    return rows


def padding_free_section(rows: list[Row]) -> list[str]:
    """Render the padding-free step's table: per model, padded (sdpa) against packed (sdpa, and the card)."""

    chosen = [PaddingFreeRow.of(r) for r in rows if r.study == PADDING_FREE_STUDY]
    if not chosen:
        return []

    def cell(value: float | None, unit: str) -> str:
        if value is None:
            return "-"
        if unit in ("bytes", "peak bytes"):
            return human_bytes(value)
        if unit == "FLOPs":
            return f"{value / 1e15:.2f} PFLOP"
        if unit == "ms":
            return f"{value:.0f} ms"
        return f"{value:.0f}"

    body = []
    for r in chosen:
        ratio = f"{r.packed_card / r.padded_sdpa:.2f}" if r.packed_card and r.padded_sdpa else "-"
        figures = (r.padded_sdpa, r.packed_sdpa, r.packed_card)
        body.append([r.model, r.unit, *(cell(value, r.unit) for value in figures), ratio])
    lengths = "/".join(map(str, chosen[0].lengths))
    title = (
        f"Padding-free step (counted; time: **estimate**, Atlas A2 model): one training step on 8 sequences of "
        f"{lengths} tokens, the deciles 20%-90% of a published SFT length distribution ({SOURCE}), padded to the "
        "batch maximum (transformers' sdpa with the padding mask) against packed into one row (sdpa with the block "
        "mask transformers builds from restarting position ids; the attention card in TND with TRL's "
        "`padding_free` kwargs), each on the default path (every card's layer). Derived from 2 and 3 layers as the "
        "step above "
        "(`scripts/bench/padding_free.py`):"
    )
    header = ["model", "figure", "padded, sdpa", "packed, sdpa", "packed, card", "card / padded"]
    return ["", title, "", *table(header, body)]
