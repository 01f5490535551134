"""The longest trainable sequence: per-device peak memory of a long-sequence training step, counted, and the search.

One training step of Llama-3-8B and Qwen3-8B (`LONG_MODELS`) at batch 1 x a long sequence, bfloat16, each decoder layer
checkpointed, on fake tensors under the torch_npu emulation, its memory counted as `memory` counts it (the storages ops
allocate, live until their last reference dies, checked after every op). The setups (`SETUPS`): eager transformers
(sdpa), the peer (LLaMA-Factory's NPU kernels), ours (kernelize), ours with DeepSpeed Ulysses sequence parallelism over
every device and DeepSpeed's `TiledMLP` around each MLP (`npu_hub_kernels.tile_mlp`; the loss card is the tiled loss: it
already computes the logits chunk by chunk), and that with the checkpointed hidden states and the optimizer on the host.

What is counted, on one rank: the forward with labels and the backward of the model at 2 and 3 decoder layers, carried
to L layers as the step bench carries it (`Figures.scaled`; exact while the peak falls at the same point of the step,
checked against a model counted whole in tests/test_bench_long_context.py), and AdamW's step over the rank's shard.
What is modelled, each stated in the rows' notes and docs/bench.md:

- **Checkpointing**: each decoder layer keeps only its input and runs its forward again in the backward (`_Checkpoint`,
  what transformers' gradient checkpointing does per layer). Offloaded: that input is copied to the host in the
  forward and back in the backward (ALST's checkpoint offload); host tensors are not device memory.
- **ZeRO-3 over the devices**, as DeepSpeed 0.19 allocates it under `bf16: {enabled: true}` (what Trainer's
  `bf16=True` with a ZeRO-3 config gives; `STATES_MIXED`), per parameter, each device keeping 1/N of every term
  (deepspeed/runtime/zero/stage3.py in the pinned 0.19.8): the bfloat16 parameter partition (2 bytes, `lp_param_buffer`,
  :972), the gradient partition in `gradient_accumulation_dtype` (2 bytes: the model's dtype unless
  `data_types.grad_accum_dtype` says otherwise, engine.py:1806-1807; `grad_partitions_flat_buffer`, :791-793), the
  float32 master copy (4 bytes, `fp32_partitioned_groups_flat`, :1170-1172, in `master_weights_and_grads_dtype`,
  float32 unless bf16/fp16 master weights are asked for, base_optimizer.py:525-530) and AdamW's two moments, made on
  that float32 master (8 bytes: the optimizer steps `fp32_partitioned_groups_flat`, :1235-1237): 16 bytes a parameter
  (ALST, arXiv 2506.13996, counts 18; the gradient partition here stays bf16). In the optimizer's step one sub-group
  (`sub_group_size`, 10^9 elements by default, zero/config.py:182; formed as :1210-1233) at a time gets its gradient
  flattened and cast to float32 (:2686-2693), counted with AdamW's temporaries (`measure_optimizer_step`). The
  reduce-scatter's contiguous bucket (`reduce_bucket_size`, 5 x 10^8 elements by default, zero/config.py:113; bf16,
  :780-784) lives on the device throughout. `STATES_BF16` is DeepSpeed's documented leaner layout,
  `bf16: {bf16_master_weights_and_grads: true, bf16_optimizer_states: true}` (precision_config.py:63-70): the bf16
  partition is the master (:1162-1167) and the moments are bfloat16, 8 bytes a parameter. A module's parameters are
  gathered whole for its forward and backward, modelled as the largest module's plus one decoder layer prefetched (none
  on 1 device, which holds them all); a parameter's gradient is counted whole when the backward makes it and freed
  right after (the reduce-scatter keeps 1/N, in the states). Optimizer offload (ZeRO-Offload,
  `offload_optimizer: {device: cpu}`): `self.device` is the host (:333), so the gradient partition, the float32 master,
  the moments and the step live there (DeepSpeedCPUAdam); the device keeps the bf16 partition and the bucket.
- **Ulysses SP over N devices**: each rank runs the model on S/N tokens; inside attention an all-to-all gives each rank
  all S tokens of heads/N (query, key, value), and one back gives its S/N tokens of every head (DeepSpeed's
  `UlyssesSPAttentionHF`). The all-to-all is modelled (`_AllToAll`: a new tensor of the other layout, as its output
  buffer), its bytes sent per rank tallied; the attention between runs as counted, with the card's function.
- The data-parallel setups (no SP) on N devices: every device trains its own sequence; only the states shrink.
- **Checkpoint offload** (ALST's): the checkpointed inputs go to the host; it is its own setup, with the optimizer on
  the device or with ZeRO-Offload too.

The longest sequence (`longest`): the counted peak is fitted through three lengths as a + b S + c S^2 and solved for
the device's memory (`DEVICE_BYTES`), then checked by counting: the answer fits, and the next length at least 1% longer
does not; where the fit misses (the peak moves), bisection on counts until that holds.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

from npu_hub_kernels import tile_mlp

from .accounting import count_device_ops, fake_module
from .attention import card_implementation, unpacked_batches
from .memory import MemoryTracker
from .peer import Peer
from .rows import LONGEST_STUDY, Row, log
from .step import STEP_MODELS, Figures, StepModel, build_step_model, estimated_seconds, figures_of

LONG_MODELS = ("llama-3-8b", "qwen3-8b")
DEVICE_BYTES = 64e9
"""An Atlas A2 (Ascend 910B) device's 64 GB of HBM, taken as 64 x 10^9 bytes: no allowance for the runtime's reserve,
the allocator's caching and fragmentation or a kernel's workspace (none is modelled)."""
DEVICES = (1, 8)
SP_STEP_SEQ = 131_072
"""The length of the estimated SP step (tokens over the SP group)."""
FIT_LENGTHS = (8192, 32_768, 131_072)
"""The lengths (tokens) the peak is counted at to fit a + b S + c S^2 (short: cheap to count; the answer is counted)."""
QUADRATIC_SHARE = 0.05
"""The fit keeps its S^2 term only if that term is this share of the peak's growth over the fitted lengths or more
(a dense mask, attention scores); else the line through the two longest lengths (the chunks' rounding is no curve)."""
GRANULE = 1024
"""Lengths are searched in multiples of GRANULE tokens per rank."""
LONGEST_SEARCHED = 1 << 26
"""No length beyond this is counted (64M tokens): a setup that fits there is reported as at least this."""

SETUP_STUDY, CURVE_STUDY, SP_STEP_STUDY = "longest sequence, by setup", "long-context memory", "long-context SP step"
STATES = "parameters+optimizer"
CHECKPOINTS = "checkpointed hidden states"
ALL_TO_ALL = "all-to-all bytes"


@dataclass(frozen=True)
class StatesLayout:
    """Where ZeRO-3 keeps a parameter's training state: bytes a parameter on the device, summed over all devices.

    Named by the DeepSpeed setting that gives it; each device keeps 1/N of every term (see the module doc)."""

    setting: str
    parameter: int  # the bf16 parameter partition
    gradient: int  # the gradient partition (gradient_accumulation_dtype)
    master: int  # the master copy the optimizer steps (0: the bf16 partition is the master)
    moments: int  # AdamW's exp_avg and exp_avg_sq, in the master's dtype
    master_dtype: torch.dtype

    def per_parameter(self, optimizer_offload: bool) -> int:
        """Bytes a parameter on the devices: the bf16 partition alone when the optimizer is on the host."""
        if optimizer_offload:
            return self.parameter
        return self.parameter + self.gradient + self.master + self.moments


STATES_MIXED = StatesLayout("bf16 enabled (DeepSpeed's default mixed precision)", 2, 2, 4, 2 * 4, torch.float32)
STATES_BF16 = StatesLayout("bf16_master_weights_and_grads + bf16_optimizer_states", 2, 2, 0, 2 * 2, torch.bfloat16)
SUB_GROUP_ELEMENTS = 1_000_000_000
"""DeepSpeed's default `sub_group_size` (zero/config.py:182): the optimizer steps the shard this many elements at a
time, each sub-group's gradient cast to the master's dtype for its step."""
REDUCE_BUCKET_BYTES = 500_000_000 * 2
"""DeepSpeed's default `reduce_bucket_size` (5 x 10^8 elements, zero/config.py:113) in bfloat16: the contiguous
gradient bucket ZeRO-3 keeps on the device (stage3.py:780-784, `contiguous_gradients` on by default)."""


@dataclass(frozen=True)
class Setup:
    """A way to train at long sequence: the variant's forwards, Ulysses SP over every device, tiled MLP, offload.

    `offload`: the checkpointed hidden states on the host; `optimizer_offload`: ZeRO-Offload; `states`: ZeRO-3's
    layout of the parameters' training state."""

    name: str
    variant: str  # eager | kernelized | peer (as the step bench's VARIANTS)
    sequence_parallel: bool = False
    tiled_mlp: bool = False
    offload: bool = False
    optimizer_offload: bool = False
    states: StatesLayout = STATES_MIXED

    def counted_as(self) -> tuple:
        """What the forward and backward's count depends on (not the states' layout or where the optimizer runs)."""
        return self.variant, self.sequence_parallel, self.tiled_mlp, self.offload


EAGER = Setup("eager HF (sdpa)", "eager")
PEER = Setup("peer", "peer")
OURS = Setup("ours", "kernelized")
_SP_TILED = dict(variant="kernelized", sequence_parallel=True, tiled_mlp=True)
OURS_SP = Setup("ours + Ulysses SP + tiled MLP", **_SP_TILED)
OURS_SP_CHECKPOINT_OFFLOAD = Setup("ours + Ulysses SP + tiled MLP + checkpoint offload", **_SP_TILED, offload=True)
OURS_SP_OFFLOAD = Setup(
    "ours + Ulysses SP + tiled MLP + checkpoint and optimizer offload", **_SP_TILED, offload=True,
    optimizer_offload=True,
)  # fmt: skip
OURS_SP_BF16_STATES = Setup(
    "ours + Ulysses SP + tiled MLP + checkpoint offload, bf16 master and moments", **_SP_TILED, offload=True,
    states=STATES_BF16,
)  # fmt: skip
SETUPS = (EAGER, PEER, OURS, OURS_SP, OURS_SP_CHECKPOINT_OFFLOAD, OURS_SP_OFFLOAD, OURS_SP_BF16_STATES)
SP_SETUPS = (OURS_SP, OURS_SP_CHECKPOINT_OFFLOAD, OURS_SP_OFFLOAD)
"""The SP setups the targets read: DeepSpeed's default mixed precision (the bf16-state one is shown, not counted)."""


class DeviceMemory(MemoryTracker):
    """`MemoryTracker` for device memory only (host tensors are not counted), naming what is live at the peak.

    `at_peak`: the bytes live at the peak by what they are (`_what`); storages tagged with `tag` are that tag."""

    def __init__(self, names: dict[int, str], sequences: set[int]) -> None:
        super().__init__()
        self.names = names  # a last dimension -> what a tensor of it is (vocabulary: logits, ...)
        self.sequences = sequences  # the lengths a [..., S, S] mask would have
        self.what: dict[int, str] = {}
        self.at_peak: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "cpu":
                continue
            key = t.untyped_storage()._cdata
            if key not in inputs and key not in self.live:
                self._allocated(t.untyped_storage())
                self.what[key] = self._what(t)
        if self.live_bytes > self.peak:
            self.peak = self.live_bytes
            self.at_peak = Counter()
            for key, (size, _) in self.live.items():
                self.at_peak[self.what.get(key, "other activations")] += size
        return out

    def _what(self, t: torch.Tensor) -> str:
        if t.dim() >= 2 and t.shape[-1] == t.shape[-2] and t.shape[-1] in self.sequences:
            return "dense mask" if t.dtype == torch.bool else "attention scores (S x S)"
        return self.names.get(t.shape[-1] if t.dim() else 0, "other activations")

    def tag(self, t: torch.Tensor, what: str) -> None:
        """Name what an allocated storage is (the checkpointed inputs)."""
        key = t.untyped_storage()._cdata
        if key in self.live:
            self.what[key] = what


class _Checkpoint(torch.autograd.Function):
    """A decoder layer run without keeping its activations.

    Its input is kept (or put on the host) and its forward runs again in the backward."""

    @staticmethod
    def forward(ctx, run: Callable, keep: Callable, hidden: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.device, ctx.kept = run, hidden.device, keep(hidden)
        with torch.no_grad():
            return run(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden = ctx.kept.to(ctx.device).detach().requires_grad_()
        del ctx.kept
        with torch.enable_grad():
            out = ctx.run(hidden)
        torch.autograd.backward(out, grad)
        return None, None, hidden.grad


class _AllToAll(torch.autograd.Function):
    """Ulysses' all-to-all on fake tensors: a new tensor of the other layout (the output buffer), each way.

    The bytes a rank sends ((N - 1) / N of its tensor) are appended to `sent`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shape: tuple[int, ...], ranks: int, sent: list[int]) -> torch.Tensor:
        ctx.shape, ctx.ranks, ctx.sent = x.shape, ranks, sent
        sent.append(x.nbytes * (ranks - 1) // ranks)
        return x.new_empty(shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.sent.append(grad.nbytes * (ctx.ranks - 1) // ctx.ranks)
        return grad.new_empty(ctx.shape), None, None, None


ULYSSES = "ulysses_npu_bench"
"""The name the bench registers its Ulysses attention under, around the card's attention function."""


@contextlib.contextmanager
def ulysses_attention(ranks: int, sent: list[int]) -> Iterator[str]:
    """Register Ulysses attention over `ranks` ranks around the card's function (and its mask) for the block.

    Each rank's query, key and value [B, H, S/N, D] go through `_AllToAll` to [B, H/N, S, D] (key and value heads
    replicated up to one per rank, as DeepSpeed does when they are fewer than the ranks), the card attends with no mask
    (Ulysses drops it; the card's causal band) and its output [B, S, H/N, D] goes back to [B, S/N, H, D]."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = card_implementation()[1]
    core = AttentionInterface._global_mapping[name]

    def attend(module, query, key, value, attention_mask, **kwargs):
        b, heads, s, d = query.shape
        kv = max(key.shape[1] // ranks, 1)
        q = _AllToAll.apply(query, (b, heads // ranks, s * ranks, d), ranks, sent)
        k = _AllToAll.apply(key, (b, kv, s * ranks, d), ranks, sent)
        v = _AllToAll.apply(value, (b, kv, s * ranks, value.shape[-1]), ranks, sent)
        kwargs.pop("position_ids", None)  # whole sequences: Ulysses' gathered ids would say no packing
        out, _ = core(module, q, k, v, None, **kwargs)
        return _AllToAll.apply(out, (b, s, heads, out.shape[-1]), ranks, sent), None

    AttentionInterface.register(ULYSSES, attend)
    AttentionMaskInterface.register(ULYSSES, AttentionMaskInterface._global_mapping[name])
    try:
        yield ULYSSES
    finally:
        del AttentionInterface._global_mapping[ULYSSES]
        del AttentionMaskInterface._global_mapping[ULYSSES]


def _checkpointed(layer: nn.Module, keep: Callable) -> None:
    forward = layer.forward

    def run(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return _Checkpoint.apply(lambda h: forward(h, *args, **kwargs), keep, hidden_states)

    layer.forward = run


def _variant(model: nn.Module, setup: Setup, peer: Peer | None):
    """Give the model the setup's forwards; the context that runs it."""
    from kernels import Mode, kernelize

    if setup.variant == "peer":
        return peer.apply(model).active()
    kernelize(model, mode=Mode.TRAINING, device="npu" if setup.variant == "kernelized" else "cpu")
    if setup.variant == "kernelized":
        model.set_attn_implementation(card_implementation()[1])
    return contextlib.nullcontext()


def measure_long_step(model: StepModel, layers: int, seq: int, setup: Setup, ranks: int, peer: Peer | None = None):
    """Count one rank's forward and backward of the model with `layers` layers at `seq` tokens, whole, on fake tensors.

    The tokens are over `ranks` SP ranks when the setup has SP. Figures: the peak of live bytes and what is live there,
    ops and time by category (`figures_of`), the all-to-all bytes the rank sends."""
    spec = model.spec
    net = build_step_model(spec, layers, model.vocab).train()
    fake_mode = FakeTensorMode()
    fake_module(net, fake_mode, "npu")
    running = _variant(net, setup, peer)
    sp = ranks if setup.sequence_parallel else 1
    sent: list[int] = []
    names = {model.vocab: "logits", spec.config["intermediate_size"]: "MLP activations"}
    names[spec.config["head_dim"]] = "attention activations"
    names[spec.config["hidden_size"]] = "hidden-state activations"
    tracker = DeviceMemory(names, {seq, seq // sp})
    host = torch.device("cpu")

    def keep(hidden: torch.Tensor) -> torch.Tensor:
        if setup.offload:
            return hidden.to(host)
        tracker.tag(hidden, CHECKPOINTS)
        return hidden

    if setup.tiled_mlp:
        tile_mlp(net)  # as users tile: DeepSpeed's TiledMLP around each MLP card's layer, ceil(S / hidden) tiles
    for layer in net.model.layers:
        _checkpointed(layer, keep)
    hooks = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)) for p in net.parameters()]
    ulysses = ulysses_attention(sp, sent) if sp > 1 else contextlib.nullcontext()
    with fake_mode, running, ulysses as attention, unpacked_batches():
        if attention:
            net.set_attn_implementation(attention)
        ids = torch.empty(1, seq // sp, dtype=torch.long, device="npu")
        with torch.no_grad(), count_device_ops():  # uncounted: what a first call caches (the card's compressed mask)
            net(input_ids=ids[:, :GRANULE], use_cache=False)
        sent.clear()
        try:
            saving = torch.autograd.graph.saved_tensors_hooks(tracker._pack, lambda held: held.tensor)
            with tracker, saving, count_device_ops() as passes:
                loss = net(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                del loss
        finally:
            tracker.close()
            for hook in hooks:
                hook.remove()
    figures = figures_of(passes.records, [], tracker.peak, tracker.saved, 0)
    figures.values.update({f"at peak: {what}": size for what, size in tracker.at_peak.items()})
    figures.values[ALL_TO_ALL] = sum(sent)
    return figures


def measure_optimizer_step(elements: int, layout: StatesLayout) -> Figures:
    """Count AdamW(foreach)'s step over one optimizer sub-group of `elements` on a device, as ZeRO-3 steps it.

    The sub-group's bf16 gradient flattened and cast to the master's dtype (stage3.py:2686-2693), then AdamW on the
    flat master (its moments made beforehand: a step after the first; step counters on the device, `capturable`).
    Figures: its ops and time (`figures_of`) and its peak of live bytes beyond the states ("optimizer peak bytes")."""
    fake_mode = FakeTensorMode()
    with fake_mode:
        master = nn.Parameter(torch.empty(elements, dtype=layout.master_dtype, device="npu"))
        optimizer = torch.optim.AdamW([master], lr=1e-5, foreach=True, capturable=True)
        master.grad = torch.empty_like(master)
        optimizer.step()
        master.grad = None
        tracker = DeviceMemory({}, set())
        try:
            with tracker, count_device_ops() as tally:
                flat = torch.empty(elements, dtype=torch.bfloat16, device="npu")  # the flattened gradient partition
                master.grad = flat.to(layout.master_dtype)
                del flat
                optimizer.step()
                master.grad = None
        finally:
            tracker.close()
    figures = figures_of([], tally.records, 0, 0, 0)
    figures.values["optimizer peak bytes"] = tracker.peak
    return figures


_PARAMS: dict[str, tuple[int, int, int, tuple[int, ...]]] = {}


def parameter_counts(model: StepModel) -> tuple[int, int, int]:
    """The model's parameter count, the largest module's outside the decoder layers, and one decoder layer's."""
    return _parameters(model)[:3]


def _parameters(model: StepModel) -> tuple[int, int, int, tuple[int, ...]]:
    """`parameter_counts` and every parameter's size in the model's order (the layers' repeated)."""
    if model.spec.name not in _PARAMS:
        net = build_step_model(model.spec, 1, model.vocab)
        named = [(name, p.numel()) for name, p in net.named_parameters()]
        layer = [n for name, n in named if ".layers." in name]
        before = [n for name, n in named[: next(i for i, (name, _) in enumerate(named) if ".layers." in name)]]
        after = [n for name, n in named[len(before) + len(layer) :]]
        sizes = (*before, *layer * model.layers, *after)
        largest = max(n for name, n in named if ".layers." not in name)
        _PARAMS[model.spec.name] = sum(sizes), largest, sum(layer), sizes
    return _PARAMS[model.spec.name]


def sub_groups(model: StepModel, devices: int) -> list[int]:
    """The elements of each optimizer sub-group on one device, as ZeRO-3 forms them (stage3.py:1210-1233).

    Each parameter's partition (ceil(numel / N)) in the model's order, a sub-group closed once it reaches
    `SUB_GROUP_ELEMENTS` (one parameter group: Trainer's second, the few norms without weight decay, is left out)."""
    groups, current = [], 0
    for size in _parameters(model)[3]:
        current += math.ceil(size / devices)
        if current >= SUB_GROUP_ELEMENTS:
            groups.append(current)
            current = 0
    return [*groups, current] if current else groups


def states_bytes(model: StepModel, devices: int, setup: Setup) -> int:
    """The bytes of ZeRO-3's states on one device during the forward and backward (see the module doc).

    The setup's layout's bytes a parameter over the devices, the gathered parameters and the gradient bucket."""
    total, largest, layer = parameter_counts(model)
    per_parameter = setup.states.per_parameter(setup.optimizer_offload)
    gathered = 0 if devices == 1 else 2 * (largest + layer)
    return per_parameter * math.ceil(total / devices) + gathered + REDUCE_BUCKET_BYTES


@dataclass(frozen=True)
class Peak:
    """The counted peak of one device's step at one length: its bytes and what is live there."""

    seq: int
    bytes: int
    parts: dict[str, int]

    def largest(self) -> str:
        """What takes the most of the peak."""
        return max(self.parts, key=self.parts.get)

    def bound(self, longer: Peak | None) -> str:
        """What keeps a longer length from fitting.

        The part that grows most from this peak to `longer`'s (a longer length's); none longer: the largest part."""
        if longer is None:
            return self.largest()
        return max(longer.parts, key=lambda what: longer.parts[what] - self.parts.get(what, 0))


class LongStep:
    """The counted steps of a model in each setup, derived to its layers and cached by (setup, SP ranks, length)."""

    def __init__(self, model: StepModel, peer: Peer | None = None) -> None:
        self.model, self.peer = model, peer
        self.cache: dict[tuple, Figures] = {}

    def figures(self, setup: Setup, devices: int, seq: int) -> Figures:
        """One rank's forward and backward, derived to the model's layers (`Figures.scaled` from 2 and 3 layers)."""
        ranks = devices if setup.sequence_parallel else 1
        key = (setup.counted_as(), ranks, seq)
        if key not in self.cache:
            two, three = (measure_long_step(self.model, n, seq, setup, ranks, self.peer) for n in (2, 3))
            self.cache[key] = two.scaled(three, self.model.layers - 2)
        return self.cache[key]

    def optimizer(self, devices: int, layout: StatesLayout) -> Figures:
        """AdamW's step over one device's shard, sub-group by sub-group: ops summed, the largest sub-group's peak."""
        key = (devices, layout)
        if key not in self.cache:
            counts = Counter(sub_groups(self.model, devices))
            steps = {n: measure_optimizer_step(n, layout) for n in counts}
            total = Counter()
            for n, f in steps.items():
                total.update({what: value * counts[n] for what, value in f.values.items()})
            total["optimizer peak bytes"] = max(f["optimizer peak bytes"] for f in steps.values())
            self.cache[key] = Figures(total)
        return self.cache[key]

    def step(self, setup: Setup, devices: int, seq: int) -> Figures:
        """One device's whole step: forward, backward and (unless offloaded to the host) AdamW's step on its shard."""
        f = self.figures(setup, devices, seq)
        if setup.optimizer_offload:
            return f
        return Figures(f.values + self.optimizer(devices, setup.states).values)

    def peak(self, setup: Setup, devices: int, seq: int) -> Peak:
        """One device's peak over the step at `seq` tokens.

        The larger of the forward and backward's with the states (`states_bytes`) and the optimizer step's: the
        states (the gathered parameters released) and the largest sub-group's step (`measure_optimizer_step`)."""
        f = self.figures(setup, devices, seq)
        states = states_bytes(self.model, devices, setup)
        if not setup.optimizer_offload:
            resident = setup.states.per_parameter(False) * math.ceil(parameter_counts(self.model)[0] / devices)
            optimizer = self.optimizer(devices, setup.states)["optimizer peak bytes"] + resident + REDUCE_BUCKET_BYTES
            if optimizer > f["peak bytes"] + states:
                return Peak(seq, int(optimizer), {STATES: int(optimizer)})
        parts = {n.removeprefix("at peak: "): int(v) for n, v in f.values.items() if n.startswith("at peak: ")}
        parts = {n: v for n, v in parts.items() if v > 0}
        return Peak(seq, int(f["peak bytes"] + states), {STATES: states, **parts})


def fit_length(points: list[tuple[int, float]], limit: float) -> int:
    """The length at which a + b S + c S^2 through three counted (length, bytes) points reaches `limit`.

    The largest positive root (0: never below it); the line through the two longest points when the S^2 term is small
    (`QUADRATIC_SHARE`) or negative."""
    (x0, y0), (x1, y1), (x2, y2) = sorted(points)
    d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
    c = (d12 - d01) / (x2 - x0)
    b = d01 - c * (x0 + x1)
    a = y0 - b * x0 - c * x0 * x0
    if c * x2 * x2 < QUADRATIC_SHARE * (y2 - y0):
        c = 0.0
    if c > 0:
        root = (-b + math.sqrt(b * b - 4 * c * (a - limit))) / (2 * c) if b * b >= 4 * c * (a - limit) else 0.0
    elif d12 > 0:
        root = x2 + (limit - y2) / d12
    else:
        root = float(LONGEST_SEARCHED)
    return max(0, int(root))


@dataclass(frozen=True)
class Longest:
    """The longest length that fits (counted), the next counted length that does not, and every peak counted."""

    fits: Peak | None  # None: not even `granule` tokens fit
    exceeds: Peak | None  # None: the search reached LONGEST_SEARCHED
    counted: tuple[Peak, ...]


def longest(
    peak: Callable[[int], Peak], granule: int, limit: float = DEVICE_BYTES, fit: tuple[int, ...] = FIT_LENGTHS
) -> Longest:
    """Search the longest length (a multiple of `granule`) whose counted peak is at most `limit`.

    Fitted from three counts (at the lengths `fit`), then counted at the answer and at the next length >= 1% longer;
    bisection on counts until the longest fitting and the shortest exceeding length are that close."""
    counted: dict[int, Peak] = {}

    def at(seq: int) -> Peak:
        if seq not in counted:
            counted[seq] = peak(seq)
        return counted[seq]

    def down(seq: float) -> int:
        return max(granule, int(seq) // granule * granule)

    def next_after(seq: int) -> int:
        return max(seq + granule, math.ceil(seq * 1.01 / granule) * granule)

    if at(granule).bytes > limit:  # the states alone, or the shortest length, do not fit
        return Longest(None, counted[granule], (counted[granule],))
    fitted = fit_length([(s, at(down(s)).bytes) for s in fit], limit)
    candidate = min(down(fitted), LONGEST_SEARCHED)
    if at(candidate).bytes <= limit and candidate < LONGEST_SEARCHED:
        at(next_after(candidate))
    while True:
        fits = [s for s, p in counted.items() if p.bytes <= limit]
        over = [s for s, p in counted.items() if p.bytes > limit and s > max(fits, default=0)]
        lo, hi = max(fits, default=0), min(over, default=None)
        if hi is None and lo >= LONGEST_SEARCHED:
            break
        if hi is not None and (hi <= next_after(lo) if lo else hi <= granule):
            break
        seq = min(2 * lo, LONGEST_SEARCHED) if hi is None else down((lo + hi) // 2)
        if seq in counted or seq <= lo:
            seq = next_after(lo) if lo else granule
        at(seq)
    return Longest(counted.get(lo), counted.get(hi) if hi else None, tuple(counted[s] for s in sorted(counted)))


@dataclass(frozen=True)
class LongestRow:
    """A setup's longest trainable sequence on some devices, with its peak and bound.

    The next length counted, which does not fit, and its peak come with it."""

    model: str
    setup: str
    devices: int
    seq: int  # 0: none fits
    peak: float  # bytes at seq (0: none fits)
    bound: str
    exceeds_seq: int | None
    exceeds_peak: float | None
    parts: str

    def csv_row(self) -> Row:
        """Its line of bench.csv: the length in the seq column, its peak in the kernelized one, the devices as path."""
        over = f"; {self.exceeds_seq} tokens: {self.exceeds_peak:.4g} bytes" if self.exceeds_seq else ""
        return Row(
            "counted", self.model, self.setup, "fwd+bwd+AdamW", 1, self.seq, kernelized=self.peak, unit="peak bytes",
            note=f"bound: {self.bound}; at the peak: {self.parts}{over}", study=SETUP_STUDY, variant=self.setup,
            path=str(self.devices), model=self.model, kind="training step", chunk=self.exceeds_seq,
        )  # fmt: skip

    @classmethod
    def of(cls, row: Row) -> LongestRow:
        """The row a line of bench.csv holds (what `csv_row` wrote)."""
        bound, parts = row.note.removeprefix("bound: ").split("; at the peak: ", 1)
        over = parts.split("; ", 1)
        exceeds = float(over[1].split(": ")[1].split()[0]) if len(over) > 1 else None
        seq, devices = int(row.seq), int(row.path)
        return cls(row.model, row.variant, devices, seq, row.kernelized, bound, row.chunk, exceeds, over[0])


def _parts_text(peak: Peak) -> str:
    return ", ".join(f"{what} {size / 1e9:.1f} GB" for what, size in sorted(peak.parts.items(), key=lambda i: -i[1]))


def longest_rows(peer: Peer | None, keys: tuple[str, ...] = LONG_MODELS) -> list[Row]:
    """Return the rows of the longest trainable sequence of each model, and of its SP step.

    Per model, setup and device count: the longest sequence that fits (`SETUP_STUDY`), with the memory curve counted
    on the way (`CURVE_STUDY`), and per device count eager's, the peer's and ours with SP (`LONGEST_STUDY`); then the
    SP step at `SP_STEP_SEQ` over 8 devices, estimated by category, and its all-to-all volume per layer."""
    rows: list[Row] = []
    for key in keys:
        step = LongStep(STEP_MODELS[key], peer)
        setups = [s for s in SETUPS if s.variant != "peer" or peer is not None]
        for devices in DEVICES:
            found = {setup: _longest_row(step, setup, devices) for setup in setups}
            for setup, (row, curve) in found.items():
                rows += [row.csv_row(), *curve]
                log(f"  longest sequence {row.model}, {setup.name}, {devices} device(s): {row.seq} ({row.bound})")
            best = max((s for s in found if s in SP_SETUPS), key=lambda s: found[s][0].seq)
            seqs = {s.variant: found[s][0].seq for s in found if not s.sequence_parallel}
            rows.append(
                Row(
                    "counted", step.model.spec.name, "longest trainable sequence", "fwd+bwd+AdamW", 1,
                    found[best][0].seq, eager=seqs["eager"], kernelized=found[best][0].seq, peer=seqs.get("peer"),
                    unit="tokens", note=f"ours + SP: {best.name}; ours without SP: {seqs['kernelized']} tokens",
                    study=LONGEST_STUDY, variant=best.name, path=str(devices), model=step.model.spec.name,
                    kind="training step",
                )
            )  # fmt: skip
        rows += sp_step_rows(step)
    return rows


def _longest_row(step: LongStep, setup: Setup, devices: int) -> tuple[LongestRow, list[Row]]:
    """The setup's longest sequence on `devices` devices, and a row per length counted on the way."""
    granule = GRANULE * (devices if setup.sequence_parallel else 1)
    found = longest(functools.partial(step.peak, setup, devices), granule)
    fits, over, name = found.fits, found.exceeds, step.model.spec.name
    shown = fits or found.counted[0]
    bound = fits.bound(over) if fits else shown.largest()
    row = LongestRow(
        name, setup.name, devices, fits.seq if fits else 0, fits.bytes if fits else 0, bound,
        over.seq if over else None, over.bytes if over else None, _parts_text(shown),
    )  # fmt: skip
    curve = [
        Row(
            "counted", name, setup.name, "fwd+bwd+AdamW", 1, p.seq, kernelized=p.bytes, unit="peak bytes",
            note=f"largest part: {p.largest()}", study=CURVE_STUDY, variant=setup.name, path=str(devices), model=name,
            kind="training step",
        )
        for p in found.counted
    ]  # fmt: skip
    return row, curve


def sp_step_rows(step: LongStep, devices: int = 8) -> list[Row]:
    """Return the rows of the SP step at `SP_STEP_SEQ` tokens over `devices` (ours + Ulysses SP + tiled MLP).

    One rank's estimated time by category, as the step bench splits it, and the all-to-all bytes a rank sends per
    decoder layer."""
    from .step import categories

    f = step.step(OURS_SP, devices, SP_STEP_SEQ)
    per_layer = f[ALL_TO_ALL] / step.model.layers
    name = step.model.spec.name
    common = dict(study=SP_STEP_STUDY, model=name, kind="training step", variant=OURS_SP.name, path=str(devices))
    rows = [
        Row(
            "estimated", name, what, "fwd+bwd+AdamW", 1, SP_STEP_SEQ, kernelized=f[f"device s: {what}"] * 1e3,
            unit="ms", note="estimate: device time of these ops on one rank (Atlas A2 model)", **common,
        )
        for what in categories()
    ]  # fmt: skip
    note = (
        f"estimate: one rank, {f['ops']:.0f} ops, device {f['device s'] * 1e3:.0f} ms, host {f['host s'] * 1e3:.0f} "
        "ms; checkpoint and tiled-MLP recompute counted; communication (all-to-all, ZeRO-3 gathers) not modelled"
    )
    rows.append(
        Row("estimated", name, "estimated step time (Atlas A2 model)", "fwd+bwd+AdamW", 1, SP_STEP_SEQ,
            kernelized=estimated_seconds(f) * 1e3, unit="ms", note=note, **common)
    )  # fmt: skip
    rows.append(
        Row("counted", name, "all-to-all per decoder layer", "fwd+bwd", 1, SP_STEP_SEQ, kernelized=per_layer,
            unit="bytes", note="bytes one rank sends: q, k, v and the output forward, their gradients backward",
            **common)
    )  # fmt: skip
    return rows
