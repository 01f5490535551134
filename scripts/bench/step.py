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

The time model (`device_model`, constants cited there) then estimates each figure's time. This module measures a step
(`measure_step`, `derived_step`, `measure_decode`) and sorts its ops into categories; `step_study` makes the bench.csv
rows of every step study (the step, by category, the decode step, mixed precision), `step_validation` checks the time
model against published step-level gains (same model, same fusion, the batch the source gives or one stated as
assumed), and `step_report` renders the summary's step section and step.png.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

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
from .memory import tracking_memory
from .peer import Peer
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
    Trainer's `bf16=True` (`step_study.MIXED_PRECISION_MODELS`): float32 weights and AdamW state, the forward under
    autocast."""
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
        first_reads = unpacked_batches() if inputs is None else UnpackedReads()
        with count_device_ops(experts=spec.experts), first_reads, _autocast(mixed):
            # uncounted: what a first call makes once per process (the attention card's compressed mask; with grad,
            # the float32 one of a zero-centred norm), which a step after the first does not pay, whichever study ran
            # before in this process; its graph is dropped unused
            model(**batch_inputs, use_cache=False)
        with tracking_memory() as tracker:
            autocast = _autocast(mixed)
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


def _autocast(mixed: bool) -> contextlib.AbstractContextManager:
    """Trainer's `bf16=True` on the npu (autocast to bfloat16) for a mixed-precision step, else nothing."""
    return torch.autocast("npu", dtype=DTYPE) if mixed else contextlib.nullcontext()


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
