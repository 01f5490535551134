"""The attention region: the attention core of a decoder layer, counted for each attention implementation.

The region is the call of the attention function inside a model's attention module (transformers'
`ALL_ATTENTION_FUNCTIONS[implementation](module, query, key, value, attention_mask, ...)`): after the projections and
the rotary embedding, before the output projection. Per model and shape, three implementations, each with the mask
transformers builds for it (the model's own `create_causal_mask` / `create_sliding_window_causal_mask` under that
implementation's mask function):

- eager: "sdpa", transformers' default (on the npu torch_npu runs F.scaled_dot_product_attention as one fused
  attention kernel when the mask is None or bool: the bench's sdpa rule, one op each way reading q, k, v and the
  mask). A window, padding or packing becomes a dense [B, 1, S, S] bool mask (a window alone: one [S, S] broadcast
  over the batch), which the op reads; grouped-query
  attention repeats K/V whenever a mask is passed (`repeat_kv`).
- peer: "flash_attention_2" on an npu host, transformers' own integrations/npu_flash_attention.py (one
  npu_fusion_attention each way; it drops the sliding window, so its figures there are those of plain causal
  attention: a wrong result, counted as it runs).
- the card (its spec's `ATTENTION_IMPLEMENTATION`): npu_fusion_attention with the op's band modes.

How: the model (one decoder layer, on the meta device, then fake weights on the emulated npu) runs forward on fake
tensors until its first attention call, whose arguments are kept (`capture_call`); the call is then counted alone
forward (inference mode) and forward+backward with its memory, as the layer's regions are (`counted.count_run`). Rows:
`AttentionRow` (study `ATTENTION_STUDY` in bench.csv), the floor from the card's spec; the card's COUNTED_TARGETS
hold them.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from npu_hub_kernels.cards import Card

from .accounting import Tally, count_device_ops, fake_module
from .cards import with_piece
from .configs import DTYPE, PHASES, ModelSpec
from .counted import count_run, memory_value, unit_value
from .markdown import human_bytes, table
from .rows import ATTENTION_STUDY, ESTIMATE_UNIT, MEMORY_UNITS, Row, largest_shape, log
from .targets import counted_target

EAGER, PEER = "sdpa", "flash_attention_2"
"""transformers' default attention (eager column) and its built-in npu flash path (peer column)."""
ATTENTION_SHAPES = ((8, 4096), (1, 4096), (8, 512))
QUICK_ATTENTION_SHAPES = ((1, 512),)

# google/gemma-3-12b-pt config.json: hidden_size 3840, num_attention_heads 16, num_key_value_heads 8, head_dim 256,
# sliding_window 1024 (five sliding layers to one full one; layer 0 slides), query_pre_attn_scalar 256.
GEMMA3_12B = ModelSpec(
    "Gemma-3-12B",
    "gemma3_text",
    dict(
        hidden_size=3840,
        intermediate_size=15360,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=1024,
        rms_norm_eps=1e-6,
    ),
)
WINDOW_MODELS = (GEMMA3_12B,)
"""Models whose first layer attends through a sliding window."""


@dataclass
class Call:
    """One attention call as the model makes it: the function, its module and its arguments."""

    function: Any
    module: nn.Module
    args: tuple
    kwargs: dict


class _Captured(Exception):
    pass


def card_implementation() -> tuple[Card, str] | None:
    """The attention card and the name its function is registered under, or None without one."""
    found = with_piece("ATTENTION_IMPLEMENTATION")
    return found[0] if found else None


@contextlib.contextmanager
def _flash_path_counted() -> Iterator[None]:
    """Let transformers' npu flash path reach the counted stand-in of npu_fusion_attention.

    Its module imported the op by name at import time, and caches its 2048 x 2048 mask per device across fake modes:
    both are set for the block and put back after. transformers caches whether torch_npu is there: asked before the
    emulation was installed (the bench's imports), it would send flash_attention_2 to the Hub instead; it is asked
    again."""
    from transformers.integrations import npu_flash_attention as flash
    from transformers.utils import import_utils

    import_utils.is_torch_npu_available.cache_clear()

    saved = flash.__dict__.get("npu_fusion_attention"), dict(flash.ATTN_MASK_NPU_CACHE)
    flash.npu_fusion_attention = lambda *args, **kwargs: sys.modules["torch_npu"].npu_fusion_attention(*args, **kwargs)
    flash.ATTN_MASK_NPU_CACHE.clear()
    try:
        yield
    finally:
        flash.ATTN_MASK_NPU_CACHE.clear()
        flash.ATTN_MASK_NPU_CACHE.update(saved[1])
        if saved[0] is None:
            del flash.npu_fusion_attention
        else:
            flash.npu_fusion_attention = saved[0]


class UnpackedReads(TorchDispatchMode):
    """Answers the host reads of fake tensors as a batch of whole, unpadded sequences answers them: False, 0.

    transformers' flash path asks whether position ids restart (`_is_packed_sequence`: a `bool()` of a sum) at batch
    1; a batch of whole sequences answers no. The loss card reads its labels' smallest and largest values (0: in the
    vocabulary). The read still counts as the op it is (a device-to-host sync)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and _unknown(args[0]):
            return False if args[0].dtype == torch.bool else 0
        return func(*args, **(kwargs or {}))


def _unknown(tensor: torch.Tensor) -> bool:
    """A fake tensor whose values the fake mode does not keep (not one of its constants)."""
    return isinstance(tensor, FakeTensor) and tensor.constant is None


@contextlib.contextmanager
def unpacked_batches() -> Iterator[None]:
    """Inside a fake mode: let transformers see a batch of whole sequences, as real position ids would show it.

    On fake tensors transformers cannot read the position ids (`is_tracing` counts a FakeTensor as tracing), so it
    assumes packing and builds a dense block mask even for a batch of whole sequences; a device run with real
    position ids finds none and builds no mask (sdpa's `is_causal`). For the block, `find_packed_sequence_indices`
    answers as it does for real unpacked position ids, and so do host reads of fake tensors (`UnpackedReads`)."""
    from transformers import masking_utils

    found = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        with UnpackedReads():
            yield
    finally:
        masking_utils.find_packed_sequence_indices = found


def build_attention_model(spec: ModelSpec, implementation: str) -> nn.Module:
    """The model with one decoder layer on the meta device, bfloat16, with the attention implementation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = dict(spec.config, num_hidden_layers=1)
    if "layer_types" in overrides:  # the first layer's
        overrides["layer_types"] = overrides["layer_types"][:1]
    config = AutoConfig.for_model(spec.model_type, **overrides)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=implementation, dtype=DTYPE)


def capture_call(model: nn.Module, inputs: dict[str, torch.Tensor]) -> Call:
    """Run the model forward until its first attention call and return that call (inside the fake mode)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = model.config._attn_implementation
    function = ALL_ATTENTION_FUNCTIONS[implementation]
    calls: list[Call] = []

    def capture(module, *args, **kwargs):
        calls.append(Call(function, module, args, kwargs))
        raise _Captured

    ALL_ATTENTION_FUNCTIONS[implementation] = capture  # the global map: what the model's modules look up
    try:
        with count_device_ops(), contextlib.suppress(_Captured):
            model(**inputs, use_cache=False)
    finally:
        ALL_ATTENTION_FUNCTIONS[implementation] = function
    return calls[0]


def count_call(call: Call, phase: str) -> Tally:
    """Count the attention call alone (fresh fake inputs of the call's layouts), forward or forward+backward."""
    run = functools.partial(call.function, call.module)
    return count_run(run, call.args, call.kwargs, [], phase, None)


def measure(
    spec: ModelSpec, implementation: str, batch: int, seq: int, fake_mode: FakeTensorMode
) -> tuple[Call, dict[str, Tally]]:
    """The attention call of the model's first layer at batch x seq, and its tallies per phase.

    One fake mode for every call of a study (`attention_rows`): the attention functions cache their compressed mask
    per device. One uncounted warm-up call with grad (a mask made in inference mode could not be kept by autograd)
    makes that mask, as a model's first layer does once for the whole run."""
    model = build_attention_model(spec, implementation).train()
    fake_module(model, fake_mode, "npu")
    with fake_mode, unpacked_batches():
        ids = torch.empty(batch, seq, dtype=torch.long, device="npu")
        call = capture_call(model, {"input_ids": ids})
        with torch.no_grad(), count_device_ops():
            call.function(call.module, *call.args, **call.kwargs)
        return call, {phase: count_call(call, phase) for phase in PHASES}


def scenario(spec: ModelSpec) -> str:
    """The attention the model's first layer computes: "causal", or "window W"."""
    window = spec.config.get("sliding_window")
    return "causal" if window is None else f"window {window}"


@dataclass(frozen=True)
class AttentionRow:
    """One figure of a model's attention region: sdpa, flash_attention_2 and the card, against the card's floor."""

    model: str  # ModelSpec.name
    scenario: str  # `scenario`: "causal" or "window W"
    region: str  # the card's region kind
    phase: str
    batch: int
    seq: int
    unit: str
    sdpa: float | None
    flash_attention_2: float | None
    card: float | None
    floor: float | None

    def csv_row(self) -> Row:
        """Return its line of bench.csv.

        sdpa (transformers' default) is in the eager column, the card in the kernelized one, flash_attention_2 (on an
        npu host) in the extra one and the scenario in the path one."""
        window = " (drops the window: plain causal, a wrong result)" if "window" in self.scenario else ""
        return Row(
            "estimated" if self.unit == ESTIMATE_UNIT else "counted", self.model, self.region, self.phase, self.batch,
            self.seq, eager=self.sdpa, kernelized=self.card, floor=self.floor, extra=self.flash_attention_2,
            unit=self.unit, study=ATTENTION_STUDY, kind=self.region, path=self.scenario, model=self.model,
            note="extra: transformers' flash_attention_2 on the npu" + window,
        )  # fmt: skip

    @classmethod
    def of(cls, row: Row) -> AttentionRow:
        """The attention row a line of bench.csv holds (what `csv_row` wrote)."""
        return cls(
            model=row.model, scenario=row.path, region=row.kind, phase=row.phase, batch=row.batch, seq=row.seq,
            unit=row.unit, sdpa=row.eager, flash_attention_2=row.extra, card=row.kernelized, floor=row.floor,
        )  # fmt: skip


def attention_rows(specs: list[ModelSpec], quick: bool) -> list[Row]:
    """Return the bench.csv rows of the attention region: eager, transformers' npu flash path and the card.

    Per model (`specs`, and the window models) and shape (the window models at the largest shape only): ops, bytes and
    FLOPs forward and forward+backward, saved and peak bytes forward+backward; floor from the card's spec."""
    from .cards import spec as spec_of

    found = card_implementation()
    if found is None:
        return []
    card, name = found
    card_spec = spec_of(card)
    shapes = QUICK_ATTENTION_SHAPES if quick else ATTENTION_SHAPES
    plan = [(s, shape) for s in specs for shape in shapes]
    plan += [(s, shapes[0]) for s in WINDOW_MODELS]
    rows = []
    fake_mode = FakeTensorMode()
    with _flash_path_counted():
        for model, (batch, seq) in plan:
            rows += _model_rows(card, card_spec, name, model, batch, seq, fake_mode)
    for row in rows:
        row.target = counted_target(row)
    return rows


def _model_rows(card: Card, card_spec, name: str, model: ModelSpec, batch: int, seq: int, fake_mode) -> list[Row]:
    """The rows of one model and shape: eager, transformers' flash path and the card against the card's floor."""
    rows = []
    started = time.perf_counter()
    call, eager = measure(model, EAGER, batch, seq, fake_mode)
    _, peer = measure(model, PEER, batch, seq, fake_mode)
    _, fused = measure(model, name, batch, seq, fake_mode)
    (q, k, v) = call.args[:3]
    forward, backward = card_spec.floor(call.module, q, k, v)
    floors = {"fwd": forward, "fwd+bwd": (forward[0] + backward[0], forward[1] + backward[1])}
    saved = card_spec.floor_saved(call.module, q, k, v)
    for phase in PHASES:
        units = ["ops", "bytes", "FLOPs", *(MEMORY_UNITS if phase != "fwd" else ()), ESTIMATE_UNIT]
        for unit in units:
            floor = {"ops": floors[phase][0], "bytes": floors[phase][1], MEMORY_UNITS[0]: saved}.get(unit)
            row = AttentionRow(
                model.name, scenario(model), card.region, phase, batch, seq, unit, sdpa=_value(eager[phase], unit),
                flash_attention_2=_value(peer[phase], unit), card=_value(fused[phase], unit), floor=floor,
            )  # fmt: skip
            rows.append(row.csv_row())
    log(f"  counted attention region {model.name}, batch {batch}, seq {seq}: {time.perf_counter() - started:.1f} s")
    return rows


def _value(tally: Tally, unit: str) -> float | None:
    if unit == "FLOPs":
        return tally.flops
    if unit in MEMORY_UNITS:
        return memory_value(tally.memory, unit)
    return unit_value(tally, unit)


ATTENTION_UNITS = ("ops", "bytes", "FLOPs", *MEMORY_UNITS)


def _cell(value: float | None, unit: str) -> str:

    if value is None:
        return "-"
    if unit == "ops":
        return f"{value:.0f}"
    if unit == "FLOPs":
        return f"{value / 1e12:.2f} T"
    return human_bytes(value)


def attention_section(rows: list[Row]) -> list[str]:
    """Render the attention region's table: per model and attention, forward+backward at the largest shape counted.

    Ops, bytes, matmul FLOPs, saved and peak bytes of transformers' sdpa, its npu flash path and the card, against the
    card's floor."""

    chosen = [AttentionRow.of(r) for r in rows if r.study == ATTENTION_STUDY]
    if not chosen:
        return []
    batch, seq = largest_shape(chosen)
    chosen = [r for r in chosen if (r.batch, r.seq) == (batch, seq) and r.phase == "fwd+bwd"]
    body = []
    for model, case in dict.fromkeys((r.model, r.scenario) for r in chosen):
        by_unit = {r.unit: r for r in chosen if (r.model, r.scenario) == (model, case)}
        cells = [model, case]
        for unit in ATTENTION_UNITS:
            r = by_unit[unit]
            cells.append(" / ".join(_cell(v, unit) for v in (r.sdpa, r.flash_attention_2, r.card, r.floor)))
        body.append(cells)
    kind = chosen[0].region
    columns = "sdpa / FA2 / card / floor"
    header = ["model", "attention", *(f"{unit} {columns}" for unit in ATTENTION_UNITS)]
    title = (
        f"Counted, the {kind} region (the attention function's call in the attention module, not the projections), "
        f"forward+backward, batch {batch}, sequence {seq}, bfloat16, with the mask transformers builds for each: "
        "sdpa (transformers' default; on the npu one fused attention kernel, reading the dense S x S bool mask it "
        "gets with a window, broadcast over the batch, and repeating K/V when it gets a mask), FA2 (transformers' "
        "flash_attention_2 on an npu host: `integrations/npu_flash_attention.py`, which drops the window and "
        "computes plain causal attention, a wrong result), the card (`npu_fusion_attention` with its band modes) "
        "and the card's floor. FLOPs: matrix products over the (query, key) pairs each kernel computes. Saved: "
        "sdpa's stand-in keeps q, k, v and the output, not flash attention's softmax statistics; the card's op "
        "keeps two float32 8-wide statistics per row and head, the floor one log-sum-exp "
        "(`scripts/bench/attention.py`):"
    )
    return ["", title, "", *table(header, body)]
