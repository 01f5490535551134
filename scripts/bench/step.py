"""The counted training step: a whole model's forward, backward and AdamW step, and its estimated time on an Atlas A2.

Per model of `STEP_MODELS` at the bench's full size (batch 8 x sequence 4096; `--quick`: 1 x 512), bfloat16: the
embedding, every decoder layer, the final norm, the LM head and the loss (transformers' ForCausalLM with labels),
`loss.backward()`, then `torch.optim.AdamW(foreach=True)` step and `zero_grad()`: device ops, bytes, matmul FLOPs,
and the memory over the step, eager (transformers), ours (the default path: `kernelize` alone) and the peer
(LLaMA-Factory's kernels), on fake tensors under the torch_npu emulation (`accounting`, `memory`).

Derived, exactly: an 8B model cannot be materialised here even as fake tensors in reasonable time (the eager experts
loop of Qwen3-30B-A3B runs hundreds of ops per layer), so the step is measured whole at 2 and 3 decoder layers and
carried to the model's L layers: figure(L) = figure(2) + (L - 2) x (figure(3) - figure(2)). Ops, bytes, FLOPs and the
estimated times are sums over ops and every decoder layer runs the same ops, so this is exact; the peak of live bytes
is exact once the peak falls at the same point of the step for every L (it then grows by the same amount per layer):
tests/test_bench_step.py checks both against tiny models measured whole at more layers (the peak: exact for a dense
model, within 0.5% for an MoE one, whose first layers shift it). Memory: the parameters and the
optimizer state (AdamW's two moments, in the parameters' dtype: torch's default for bfloat16 parameters) exist before
the step and are added to the peak, stated; the gradients are allocated by the backward and counted in it.

Ops that touch only host tensors (the optimizer's step counters, which torch keeps on the CPU unless `capturable`) are
not device ops and are left out. `AdamW(foreach=True)`: torch's default on an npu device (a foreach-capable backend);
each `_foreach_*` op is one op (CANN's aclnnForeach* kernels take the whole list).

The time model (`device_model`, constants cited there) then estimates each figure's time, and `validation_rows`
checks that model against published step-level gains: same model, same fusion, the batch the source gives or one
stated as assumed. The decode step (batch 1, one token, forward in inference mode) is where the host, not the device,
bounds the step (`decode_rows`).
"""

from __future__ import annotations

import contextlib
import functools
import time
import tomllib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .accounting import OpRecord, Tally, count_device_ops, fake_module
from .attention import UnpackedReads, card_implementation, unpacked_batches
from .cards import specs
from .configs import CONFIGS, DTYPE, ModelSpec
from .device_model import HOST_PER_OP, device_seconds
from .markdown import human_bytes, table
from .memory import tracking_memory
from .peer import Peer
from .rows import ESTIMATE_STUDY, Row, log
from .targets import LAYER_TARGET_SHAPE


@dataclass(frozen=True)
class StepModel:
    """A model of the step: the spec that shapes a decoder layer, its number of layers and its vocabulary."""

    spec: ModelSpec
    layers: int
    vocab: int


# Llama-2-7B (meta-llama/Llama-2-7b-hf config.json): hidden_size 4096, intermediate_size 11008, 32 heads, 32 key-value
# heads, 32 layers, vocab_size 32000, rms_norm_eps 1e-05: the model of MindSpeed's published gains.
LLAMA_2_7B = ModelSpec(
    "Llama-2-7B",
    "llama",
    dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        rms_norm_eps=1e-5,
    ),
)
# num_hidden_layers and vocab_size from each model's config.json: Meta-Llama-3-8B 32 and 128256, Qwen3-8B 36 and
# 151936, Qwen3-30B-A3B 48 and 151936, gemma-3-4b-pt's text_config 34 and 262208 (Gemma3TextConfig's vocabulary:
# the tokenizer's 262144 and the image tokens).
STEP_MODELS: dict[str, StepModel] = {
    "llama-3-8b": StepModel(CONFIGS["llama-3-8b"], 32, 128_256),
    "qwen3-8b": StepModel(CONFIGS["qwen3-8b"], 36, 151_936),
    "qwen3-30b-a3b": StepModel(CONFIGS["qwen3-30b-a3b"], 48, 151_936),
    "llama-2-7b": StepModel(LLAMA_2_7B, 32, 32_000),
    "gemma-3-4b": StepModel(CONFIGS["gemma-3-4b"], 34, 262_208),
}
STEP_SHAPE = LAYER_TARGET_SHAPE
QUICK_STEP_SHAPE = (1, 512)
VARIANTS = ("eager", "kernelized", "peer")
"""eager: transformers; kernelized: the default path (kernelize alone); peer: LLaMA-Factory's NPU kernels."""
STEP_STUDY, CATEGORY_STUDY = "step", "step by category"
OTHER_OPS_STUDY = "step, largest other ops"
OTHER_OP = "device s, other op: "
"""The figures of the ops of `OTHER` by aten op: this prefix, then the op's name."""
LARGEST_OTHER_OPS = 6
"""How many of the largest 'other' ops (by our estimated time) the bench reports per model."""
VALIDATION_STUDY, DECODE_STUDY = "step model validation", "decode step estimate"
STEP_KIND = "training step"
UNTOUCHED = ("matmuls", "attention", "embedding", "optimizer")
"""The categories of what no card touches: the matrix products, the attention no card fuses (sdpa's kernel: the fused
attention op is its card's, `_card_categories`), the embedding gather and its backward, the AdamW update."""
OTHER = "other (elementwise, casts, copies)"
"""Everything else: elementwise ops, casts, copies (the unfused regions and the glue between them)."""
_MATMUL_OPS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "addbmm", "addbmm_", "_grouped_mm"}
_MATMUL_OPS |= {"npu_grouped_matmul"}
_ATTENTION_OPS = {"scaled_dot_product_attention", "scaled_dot_product_attention_backward"}
_EMBEDDING_OPS = {"embedding", "embedding_dense_backward"}


@functools.cache
def _card_categories() -> dict[str, str]:
    """Each card's fused torch_npu op (and its backward) -> the card's category, "<card> ops".

    Matrix products stay aside: npu_grouped_matmul is a matmul."""
    return {
        op: f"{card.repo_name} ops"
        for card, spec in specs()
        for name in spec.FUSED_OPS
        if name not in _MATMUL_OPS
        for op in (name, f"{name}_backward")
    }


@functools.cache
def categories() -> tuple[str, ...]:
    """What a step's ops are, by op: what no card touches (`UNTOUCHED`), each card's fused ops, then `OTHER`."""
    return (*UNTOUCHED, *dict.fromkeys(_card_categories().values()), OTHER)


def category(record: OpRecord, optimizer: bool) -> str:
    """The category (`categories()`) of one op of a step."""
    if optimizer:
        return UNTOUCHED[3]
    if record.name in _MATMUL_OPS:
        return UNTOUCHED[0]
    if record.name in _ATTENTION_OPS:
        return UNTOUCHED[1]
    if record.name in _EMBEDDING_OPS:
        return UNTOUCHED[2]
    return _card_categories().get(record.name, OTHER)


class _HostOps(TorchDispatchMode):
    """Inside `count_device_ops`: takes the records of ops whose tensors are all host tensors out of the tally."""

    def __init__(self, tally: Tally) -> None:
        super().__init__()
        self.tally = tally
        self.dropped = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = len(self.tally.records)
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if tensors and all(t.device.type == "cpu" for t in tensors) and len(self.tally.records) > before:
            self.dropped += len(self.tally.records) - before
            del self.tally.records[before:]
        return out


@contextlib.contextmanager
def _device_ops(experts: int | None = None) -> Iterator[Tally]:
    """`count_device_ops`, without the ops on host tensors only."""
    with count_device_ops(experts=experts) as tally, _HostOps(tally):
        yield tally


@dataclass
class Figures:
    """The counted and estimated figures of one step (or of one layer's share of it): named numbers, additive."""

    values: Counter = field(default_factory=Counter)

    def __getitem__(self, name: str) -> float:
        return self.values[name]

    def scaled(self, other: Figures, times: int) -> Figures:
        """self + times x (other - self), figure by figure (the step carried from 1 layer to more)."""
        names = set(self.values) | set(other.values)
        return Figures(Counter({n: self.values[n] + times * (other.values[n] - self.values[n]) for n in names}))


def figures_of(
    forward_backward: list[OpRecord], optimizer: list[OpRecord], peak: int, saved: int, base: int
) -> Figures:
    """A step's figures from its ops (forward and backward, then the optimizer's) and its memory."""
    values: Counter = Counter()
    for records, is_optimizer in ((forward_backward, False), (optimizer, True)):
        for r in records:
            seconds = device_seconds([r])
            kind = category(r, is_optimizer)
            values["ops"] += 1
            values["bytes"] += r.reads + r.writes
            values["flops"] += r.flops
            values["device s"] += seconds
            values[f"bytes: {kind}"] += r.reads + r.writes
            values[f"device s: {kind}"] += seconds
            values[f"ops: {kind}"] += 1
            if kind == OTHER:
                values[f"{OTHER_OP}{r.name}"] += seconds
    values["host s"] = values["ops"] * HOST_PER_OP.value
    values["peak bytes"] = base + peak
    values["saved bytes"] = saved
    values["state bytes"] = base
    return Figures(values)


def estimated_seconds(f: Figures) -> float:
    """A step's estimated time: the device's or the host's, whichever is longer (`device_model`)."""
    return max(f["device s"], f["host s"])


def build_step_model(spec: ModelSpec, layers: int, vocab: int, dtype: torch.dtype = DTYPE) -> nn.Module:
    """The whole causal LM with `layers` decoder layers on the meta device: `dtype` (bfloat16), sdpa, eager experts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(spec.model_type, **dict(spec.config, num_hidden_layers=layers, vocab_size=vocab))
    options = {"experts_implementation": "eager"} if spec.experts else {}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype, **options)


def _apply_variant(model: nn.Module, variant: str, peer: Peer | None, build, kernels: tuple[str, ...]):
    """Give the model a variant's forwards; returns the context that runs it (the peer's patches, or nothing)."""
    from kernels import Mode, kernelize

    from npu_hub_kernels import apply_npu_kernels

    if variant == "peer":
        return peer.apply(model).active()
    if kernels:
        apply_npu_kernels(model, kernels=list(kernels), mode=Mode.TRAINING, local_dir=build)
    else:
        kernelize(model, mode=Mode.TRAINING, device="npu" if variant == "kernelized" else "cpu")
    return contextlib.nullcontext()


def measure_step(
    spec: ModelSpec,
    layers: int,
    vocab: int,
    batch: int,
    seq: int,
    variant: str = "eager",
    peer: Peer | None = None,
    build=None,
    kernels: tuple[str, ...] = (),
    inputs: Callable[[], dict] | None = None,
    attention: str | None = None,
    mixed: bool = False,
) -> Figures:
    """Measure one training step of the model with `layers` layers, whole, on fake tensors.

    The step is forward with labels, `loss.backward()` (the model's output dropped first, as a trainer does),
    AdamW(foreach=True) step and zero_grad, its optimizer state made beforehand (a step after the first). `kernels`:
    only these cards (kernel ids, `apply_npu_kernels`), for the variant "kernelized". `inputs`: the model's inputs
    (made inside the fake mode; default input_ids and labels [batch, seq]); `attention`: the attention implementation
    to set (default: the cards' in a kernelized step, as `apply_npu_kernels` sets it, else the model's sdpa); `mixed`:
    Trainer's `bf16=True` (`MIXED_PRECISION_MODELS`): float32 weights and AdamW state, the forward under autocast."""
    model = build_step_model(spec, layers, vocab, torch.float32 if mixed else DTYPE).train()
    fake_mode = FakeTensorMode()
    fake_module(model, fake_mode, "npu")
    running = _apply_variant(model, variant, peer, build, kernels)
    attention = attention or _cards_attention(variant, kernels)
    if attention is not None:
        model.set_attn_implementation(attention)
    # host reads of fake data answer as real data would: a default batch is whole sequences (no packing), labels lie
    # in the vocabulary
    reads = unpacked_batches() if inputs is None else UnpackedReads()
    with fake_mode, running:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-5, foreach=True)
        for p in params:  # the state of a step after the first: AdamW's moments exist before it
            p.grad = torch.empty_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state = sum(t.nbytes for s in optimizer.state.values() for t in s.values() if t.device.type != "cpu")
        base = sum(p.nbytes for p in model.parameters()) + state
        ids = torch.empty(batch, seq, dtype=torch.long, device="npu")
        batch_inputs = inputs() if inputs is not None else {"input_ids": ids, "labels": ids}
        with tracking_memory() as tracker:
            autocast = torch.autocast("npu", dtype=DTYPE) if mixed else contextlib.nullcontext()
            with _device_ops(spec.experts) as passes, reads:
                with autocast:  # as Trainer's bf16=True: the forward and the loss; backward follows its casts
                    loss = model(**batch_inputs, use_cache=False).loss
                loss.backward()
                del loss
            with _device_ops() as update:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    memory = tracker.memory
    return figures_of(passes.records, update.records, memory.peak_bytes, memory.saved_bytes, base)


def _cards_attention(variant: str, kernels: tuple[str, ...]) -> str | None:
    """The attention the cards set in a kernelized step (`apply_npu_kernels` does on an sdpa model), else None."""
    found = card_implementation()
    if variant != "kernelized" or found is None or (kernels and found[0].kernel_id not in kernels):
        return None
    return found[1]


def derived_step(model: StepModel, batch: int, seq: int, variant: str = "eager", **options) -> Figures:
    """The step of the whole model, derived from the step measured whole at 2 and 3 layers (see the module doc)."""
    two = measure_step(model.spec, 2, model.vocab, batch, seq, variant, **options)
    three = measure_step(model.spec, 3, model.vocab, batch, seq, variant, **options)
    return two.scaled(three, model.layers - 2)


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


def measure_decode(spec: ModelSpec, layers: int, vocab: int, variant: str, peer: Peer | None) -> Figures:
    """One decode token of the model (batch 1, sequence 1, no cache), forward in inference mode, measured whole."""
    from kernels import Mode, kernelize

    model = build_step_model(spec, layers, vocab).eval()
    fake_mode = FakeTensorMode()
    fake_module(model, fake_mode, "npu")
    if variant == "peer":
        running = peer.apply(model).active()
    else:
        kernelize(model, mode=Mode.INFERENCE, device="npu" if variant == "kernelized" else "cpu")
        running = contextlib.nullcontext()
    with fake_mode, running, torch.inference_mode(), _device_ops(spec.experts) as tally:
        ids = torch.empty(1, 1, dtype=torch.long, device="npu")
        model(input_ids=ids, use_cache=False)
    return figures_of(tally.records, [], 0, 0, 0)


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


MIXED_PRECISION_STUDY = "step, mixed precision"
MIXED_PRECISION_MODELS = ("llama-3-8b",)
"""The step models also counted as Trainer's `bf16=True` trains them: float32 weights, AdamW state and gradients, the
forward under `torch.autocast("npu", bfloat16)` (every matmul casts its float32 weight to bfloat16 on each call)."""


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


def _mixed_precision_table(rows: list[MixedPrecisionRow], peer: bool) -> list[str]:
    if not rows:
        return []
    body = [
        [r.model, "estimated step time (**estimate**)" if r.unit == "ms" else r.unit, _cell(r.eager, r.unit),
         _cell(r.kernelized, r.unit), *([_cell(r.peer, r.unit)] if peer else []), f"{r.kernelized / r.eager:.3f}"]
        for r in rows
    ]  # fmt: skip
    title = (
        "The training step as Trainer's `bf16=True` runs it (float32 weights, gradients and AdamW state; forward under "
        "`torch.autocast` bfloat16, so each matmul casts its weight on every call), batch "
        f"{rows[0].batch} x sequence {rows[0].seq}, derived as the step above:"
    )
    header = ["model", "figure", "eager", "ours", *(["peer"] if peer else []), "ours / eager"]
    return ["", title, "", *table(header, body)]


def _cell(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("bytes", "peak bytes", "saved bytes"):
        return human_bytes(value)
    if unit == "FLOPs":
        return f"{value / 1e15:.2f} PFLOP"
    if unit == "ms":
        return f"{value / 1e3:.2f} s" if value >= 1e3 else f"{value:.2f} ms"
    return f"{value:.0f}"


def step_section(rows: list[Row]) -> list[str]:
    """Render the summary's training-step section.

    It holds the counted step per model, its estimated time, the bytes by category, the time model's validation against
    published figures, the decode-step estimate and the step under Trainer's mixed precision."""
    counted = [r for r in rows if r.study == STEP_STUDY]
    if not counted:
        return []
    peer = any(r.peer is not None for r in counted)
    variants = ["eager", "ours", *(["peer"] if peer else [])]
    by = {(r.model, r.unit): r for r in counted}
    estimates = {r.model: r for r in rows if r.study == ESTIMATE_STUDY}
    models = list(dict.fromkeys(r.model for r in counted))
    body = []
    for model in models:
        for unit in (*UNITS.values(), "ms"):
            r = by.get((model, unit)) if unit != "ms" else estimates.get(model)
            if r is None:
                continue
            label = "estimated step time (**estimate**, Atlas A2 model)" if unit == "ms" else unit
            values = [r.eager, r.kernelized, *([r.peer] if peer else [])]
            ours = f"{r.kernelized / r.eager:.2f}" if r.eager else "-"
            body.append([model, label, *(_cell(v, unit) for v in values), ours])
    first = counted[0]
    title = (
        f"Counted training step, batch {first.batch} x sequence {first.seq}, bfloat16: embedding, every decoder layer, "
        "final norm, LM head and loss, backward, AdamW(foreach) step (ours: the default path, kernelize alone). "
        "Ops, bytes and FLOPs derived exactly from the model measured whole at 2 and 3 layers "
        "(`scripts/bench/step.py`); peak memory includes the bfloat16 parameters, AdamW's two moments (bfloat16) "
        "and the gradients. The "
        "estimated time is a model, not a measurement (`docs/step-model.md`); it is shown in the step chart "
        "(step.png):"
    )
    lines = ["", title, "", *table(["model", "figure", *variants, "ours / eager"], body)]
    lines += _category_table(category_rows(rows, "bytes"), models)
    lines += _time_table(category_rows(rows, "ms"), rows, models)
    lines += _other_ops_table([OtherOpRow.of(r) for r in rows if r.study == OTHER_OPS_STUDY], peer)
    lines += _validation_table([ValidationRow.of(r) for r in rows if r.study == VALIDATION_STUDY])
    lines += _decode_table(rows, peer)
    mixed = [MixedPrecisionRow.of(r) for r in rows if r.study == MIXED_PRECISION_STUDY]
    lines += _mixed_precision_table(mixed, peer)
    return lines


def _variant_categories(chosen: list[CategoryRow], models: list[str]):
    """(model, variant, its CategoryRow field, {category: value}) for each model's variant with every category."""
    for model in models:
        for variant, attr in (("eager", "eager"), ("ours", "kernelized"), ("peer", "peer")):
            values = {r.category: getattr(r, attr) for r in chosen if r.model == model}
            if values and all(v is not None for v in values.values()):
                yield model, variant, attr, values


def _category_table(chosen: list[CategoryRow], models: list[str]) -> list[str]:
    if not chosen:
        return []
    body = []
    for model, variant, _, values in _variant_categories(chosen, models):
        total = sum(values.values())
        untouched = sum(values[c] for c in UNTOUCHED) / total
        shares = (f"{values[c] / total:.0%}" for c in categories())
        body.append([model, variant, *shares, f"**{untouched:.0%}**"])
    title = (
        "Where the step's bytes go, by op (counted; share of each step's bytes). The first four are what no card "
        "touches: the next fusion target is the largest share there, or the 'other' ops the cards leave:"
    )
    return ["", title, "", *table(["model", "variant", *categories(), "no card touches"], body)]


def _time_table(chosen: list[CategoryRow], rows: list[Row], models: list[str]) -> list[str]:
    """Where the step's estimated time goes: per model and variant, the device seconds of each category."""
    estimates = {r.model: r for r in rows if r.study == ESTIMATE_STUDY}
    if not chosen:
        return []
    body = []
    for model, variant, attr, values in _variant_categories(chosen, models):
        step = getattr(estimates[model], attr) if model in estimates else None
        cells = (_cell(values[c], "ms") for c in categories())
        body.append([model, variant, *cells, _cell(sum(values.values()), "ms"), _cell(step, "ms")])
    title = (
        "Where the step's estimated time goes, by op (**estimate**, Atlas A2 model: each op's device time, "
        "summed by category; the step is the device's sum or the host's per-op cost, whichever is longer):"
    )
    header = ["model", "variant", *categories(), "device", "estimated step"]
    return ["", title, "", *table(header, body)]


def _other_ops_table(chosen: list[OtherOpRow], peer: bool) -> list[str]:
    """The largest ops of the 'other' category, by our estimated time, per model: where the next fusion would pay."""
    if not chosen:
        return []
    body = [
        [r.model, r.aten_op, _cell(r.eager, "ms"), _cell(r.kernelized, "ms"), *([_cell(r.peer, "ms")] if peer else [])]
        for r in chosen
    ]
    title = (
        f"The {LARGEST_OTHER_OPS} largest aten ops of the '{OTHER}' category in our step, per model (**estimate**: "
        "device time of every call of the op over the step; the next fusion to make is among them):"
    )
    return ["", title, "", *table(["model", "aten op", "eager", "ours", *(["peer"] if peer else [])], body)]


def _validation_table(rows: list[ValidationRow]) -> list[str]:
    if not rows:
        return []
    body = [
        [
            r.source,
            r.claim,
            r.model,
            f"{r.batch} x {r.seq}",
            f"{r.published:.3g}",
            f"{r.predicted:.3g}",
            r.error,
            r.assumptions,
        ]
        for r in rows
    ]
    title = (
        "The time model checked against published step-level figures (same model and fusion; the batch the source "
        "gives, else the stated assumption); prediction from the model's constants only, nothing fitted to these "
        "figures. Units: throughput and step time in %, ratio eager / fused, peak memory saved in GB:"
    )
    header = ["source", "published claim", "model", "batch x seq", "published", "predicted", "error", "assumptions"]
    return ["", title, "", *table(header, body)]


def _decode_table(rows: list[Row], peer: bool) -> list[str]:
    chosen = [r for r in rows if r.study == DECODE_STUDY]
    if not chosen:
        return []
    body = [
        [r.model, _cell(r.eager, "ms"), _cell(r.kernelized, "ms"), *([_cell(r.peer, "ms")] if peer else []), r.note]
        for r in chosen
    ]
    title = (
        "Estimated decode step (one token, batch 1, forward in inference mode, no KV cache), **estimate**: the host "
        f"issues every op at {HOST_PER_OP.value * 1e6:.1f} us (device_model.HOST_PER_OP), so the op count, not the "
        "bytes, bounds it:"
    )
    header = ["model", "eager", "ours", *(["peer"] if peer else []), "ops and where the time goes"]
    return ["", title, "", *table(header, body)]


def write_step_chart(rows: list[Row], path) -> str | None:
    """step.png: per model, the estimated step time split by category, eager vs ours vs the peer (an estimate)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no step.png: matplotlib is not installed"
    chosen = category_rows(rows, "ms")
    if not chosen:
        return None
    models = list(dict.fromkeys(r.model for r in chosen))
    variants = [("eager", "eager"), ("ours", "kernelized"), ("peer", "peer")]
    variants = [v for v in variants if all(getattr(r, v[1]) is not None for r in chosen)]
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        bottoms = [0.0] * len(variants)
        colors = plt.get_cmap("tab20").colors
        for i, kind in enumerate(categories()):
            r = next(r for r in chosen if r.model == model and r.category == kind)
            values = [getattr(r, attr) / 1e3 for _, attr in variants]
            ax.bar([v for v, _ in variants], values, bottom=bottoms, color=colors[i % len(colors)], label=kind)
            bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
        for x, total in enumerate(bottoms):
            ax.text(x, total, f"{total:.2f} s", ha="center", va="bottom", fontsize=8)
        ax.set_title(model, fontsize=10)
        ax.set_ylabel("estimated device time per step, s (estimate)")
    fig.legend(*axes[0][0].get_legend_handles_labels(), fontsize=7, loc="center right")  # beside the bars
    first = chosen[0]
    fig.suptitle(
        f"Training step, batch {first.batch} x seq {first.seq}: estimated Atlas A2 device time by category "
        "(an estimate from counted bytes and FLOPs, docs/step-model.md)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
