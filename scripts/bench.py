"""Benchmark the cards: fusion accounting (counted) and host-side and device timings (timed).

    python scripts/bench.py [--out .cache/bench] [--build build] [--readme README.md] [--quick]

Counted (mode "counted", not timed, the same on every host): for one full-size decoder layer of
Llama-3-8B, Qwen3-8B, Qwen3-30B-A3B and Mixtral-8x7B (random weights, nothing downloaded), forward
(in `torch.inference_mode()`: it stands for inference) and forward+backward (with grad), batch 1 and 8,
sequence 512 and 4096, bfloat16: the device operations and the bytes they read and write, for eager
transformers and for the kernelized layer under the torch_npu emulation, set against a floor. The
kernelized layer is the default path, what users get from kernelize alone (no other call): npu-swiglu's
split MLPs pack gate/up into one buffer on their first fused call, so one uncounted warm-up forward of
the kernelized layer runs first; packing is a one-time cost, not a per-step one. The layers run on fake
tensors (shapes, no data, no compute), so full sizes cost next to nothing; `npu_hub_kernels.accounting`
says what counts as an operation and how the emulation's internals are kept out. Rows per fused region
kind (summed over the layer's instances) and per layer.

The floor is each fused region run as the fewest kernels that compute it, each reading its inputs once
and writing its outputs once (the `*_floor` functions):
- RMSNorm: 1 op reading x and weight, writing y. Backward: 1 op reading dy, x, weight, writing dx, dweight.
- RoPE: 1 op reading q, k, cos, sin, writing q', k'. Backward: 1 op reading dq', dk', cos, sin, writing dq, dk.
  (npu_apply_rotary_pos_emb is that op in inference; with grad, npu_rotary_mul runs once for q and once for k.)
- SwiGLU MLP: its matmuls stay matmuls (no torch_npu op fuses a matmul with the activation), so 3 ops:
  h = x @ [Wg; Wu] (reads x, Wg, Wu, writes h [T, 2I]); a = silu(h_gate) * h_up (reads h, writes
  a [T, I]); y = a @ Wd (reads a, Wd, writes y). Backward: 5 ops: da = dy @ Wd, dWd = dy^T a,
  dh = swiglu_backward(da, h), dx = dh @ [Wg; Wu], d[Wg; Wu] = dh^T x.
- MoE experts (P = tokens x top_k token copies): 6 ops: the tokens per expert (reads top_k_index, writes E
  int64 counts), permute (reads x and top_k_index, writes the P copies and their int32 order), grouped
  matmul with every expert's [Wg; Wu], swiglu, grouped matmul with Wd, unpermute (weights and sums each
  token's copies). The counts take an op of their own: no torch_npu routing op both returns them and has a
  backward (docs/torch-npu-ops.md, "MoE routing ops and per-expert counts"). Backward: 7 ops (unpermute,
  swiglu, permute, and dX and dW of each grouped matmul).
- Decoder layer: what runs outside those regions (projections, attention, residual adds), plus every
  region at its floor. "Outside" is the layer's run minus its regions' runs, the least of the eager and
  kernelized runs (an eager region may hand its gradient on in a layout that costs a copy outside it).
Gradients are taken with `torch.autograd.grad` (w.r.t. the inputs and parameters), so accumulation
into `.grad` is not counted. MoE layers use transformers' eager experts loop (experts_implementation
"eager"); the experts sweep also shows transformers' default, grouped_mm.

Timed (mode "timed", medians of repeats after warm-up), host side on this machine: kernelize of a
32-layer model, per-call overhead of a kernelized module over its card function, cold (fresh process)
and warm get_kernel of every card from an offline Hub cache, the torch-universal fallback against
eager on CPU tensors. Device side, on an Ascend host: per region and per decoder layer, eager against
kernelized, forward and forward+backward, synchronised, peak memory, and a short training loop. Off an
Ascend host the device part runs only with `--device-timing on`, on the emulation at small shapes,
labelled "emulated (not a device measurement)" and kept out of the summary.

Writes bench.csv (one row per measurement), bench.png and summary.md to --out; --readme PATH rewrites
the part of PATH between `<!-- bench:begin -->` and `<!-- bench:end -->` with the summary.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Before huggingface_hub is imported: get_kernel reads only the local offline cache seeded here (as the demo).
os.environ.setdefault("HF_HUB_CACHE", str(ROOT / ".cache" / "hub"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import csv  # noqa: E402
import importlib.util  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterable  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._pytree import tree_leaves, tree_map  # noqa: E402

from npu_hub_kernels import emulation  # noqa: E402
from npu_hub_kernels.accounting import (  # noqa: E402
    Tally,
    count_device_ops,
    fake_module,
    fake_tensor_mode,
    tensor_bytes,
)
from npu_hub_kernels.cards import resolve_org  # noqa: E402

PHASES = ("fwd", "fwd+bwd")
SHAPES = ((1, 1), (1, 512), (1, 4096), (8, 512), (8, 4096))
"""(batch, sequence) of the counted layers; (1, 1) is one decode step's token."""
QUICK_SHAPES = ((1, 512),)
DTYPE = torch.bfloat16
BYTES_TOLERANCE = 1.05
"""Target: kernelized bytes of RMSNorm, RoPE and SwiGLU MLP within 5% of the floor."""
MOE_BYTES_TOLERANCE = 1.01
"""Target: kernelized bytes of the MoE experts within 1% of the floor."""
LAYER_BYTES_TOLERANCE = 1.03
LAYER_TARGET_SHAPE = (8, 4096)
"""Target: the kernelized decoder layer within 3% of the floor's bytes, forward+backward at batch 8 x sequence 4096."""
ROPE_OPS_PER_DIRECTION = 2
"""Target: RoPE with grad runs at most 2 ops each way (npu_rotary_mul for q and for k); in inference, the floor's 1."""
KERNELIZE_TARGET_MS = 100.0
OVERHEAD_TARGET_US = 10.0
FALLBACK_TOLERANCE = 1.05
"""The fallback counts as not slower than eager when its median is within 5% (timing noise) of eager's."""
EMULATED = "emulated (not a device measurement)"
NO_CARD = "no card yet"
README_BEGIN, README_END = "<!-- bench:begin -->", "<!-- bench:end -->"


@dataclass(frozen=True)
class ModelSpec:
    """A model whose decoder layer is measured: the config values that shape one layer."""

    name: str
    model_type: str
    config: dict
    experts: int | None = None


# From each model's published config.json on the Hugging Face Hub: the values that shape a decoder layer
# (head_dim is hidden_size / num_attention_heads where config.json leaves it out); bfloat16, their torch_dtype.
CONFIGS: dict[str, ModelSpec] = {
    # meta-llama/Meta-Llama-3-8B: hidden_size 4096, intermediate_size 14336, num_attention_heads 32,
    # num_key_value_heads 8, rms_norm_eps 1e-05, hidden_act silu.
    "llama-3-8b": ModelSpec(
        "Llama-3-8B",
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            rms_norm_eps=1e-5,
        ),
    ),
    # Qwen/Qwen3-8B: hidden_size 4096, intermediate_size 12288, num_attention_heads 32, num_key_value_heads 8,
    # head_dim 128, rms_norm_eps 1e-06; an RMSNorm on q and on k per head (q_norm, k_norm).
    "qwen3-8b": ModelSpec(
        "Qwen3-8B",
        "qwen3",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            rms_norm_eps=1e-6,
        ),
    ),
    # Qwen/Qwen3-30B-A3B: hidden_size 2048, num_attention_heads 32, num_key_value_heads 4, head_dim 128,
    # num_experts 128, num_experts_per_tok 8, moe_intermediate_size 768, norm_topk_prob true,
    # decoder_sparse_step 1 and mlp_only_layers [] (every layer is an MoE layer), rms_norm_eps 1e-06.
    "qwen3-30b-a3b": ModelSpec(
        "Qwen3-30B-A3B",
        "qwen3_moe",
        dict(
            hidden_size=2048,
            moe_intermediate_size=768,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rms_norm_eps=1e-6,
        ),
        experts=128,
    ),
    # mistralai/Mixtral-8x7B-v0.1: hidden_size 4096, intermediate_size 14336, num_attention_heads 32,
    # num_key_value_heads 8, num_local_experts 8, num_experts_per_tok 2, rms_norm_eps 1e-05.
    "mixtral-8x7b": ModelSpec(
        "Mixtral-8x7B",
        "mixtral",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            num_local_experts=8,
            num_experts_per_tok=2,
            rms_norm_eps=1e-5,
        ),
        experts=8,
    ),
}
SWEEP_EXPERTS = (8, 16, 32, 64, 128)
"""The experts sweep: Qwen3-30B-A3B's MoE layer with these numbers of experts (top-8, batch 1, seq 512)."""
TINY = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16
)
"""The test suite's tiny widths: for host-side costs, which do not depend on widths."""
TINY_SPECS = (
    ModelSpec("tiny Llama", "llama", TINY),
    ModelSpec(
        "tiny Qwen3-MoE", "qwen3_moe", dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), 4
    ),
)
"""Device timing on the emulation: small shapes, so that the code path runs (and cannot rot) off an Ascend host."""
KINDS = {"npu-rms-norm": "RMSNorm", "npu-rope": "RoPE", "npu-swiglu": "SwiGLU MLP", "npu-moe": "MoE experts"}
"""Region kind, by the card that fuses it."""


@dataclass
class Row:
    """One measurement: a line of bench.csv."""

    mode: str  # counted | timed
    config: str
    op: str
    phase: str  # fwd | fwd+bwd | host
    batch: int | str = ""
    seq: int | str = ""
    eager: float | None = None
    kernelized: float | None = None
    floor: float | None = None
    unit: str = ""
    target: str = ""
    note: str = ""
    machine: str = ""
    versions: str = ""

    @property
    def ratio(self) -> float | None:
        """Counted rows: kernelized / floor. Timed rows: kernelized / eager (below 1: faster)."""
        base = self.floor if self.mode == "counted" else self.eager
        return None if not base or self.kernelized is None else self.kernelized / base


CSV_COLUMNS = ["machine", "versions", "mode", "config", "op", "phase", "batch", "seq"]
CSV_COLUMNS += ["eager", "kernelized", "floor", "ratio", "unit", "target", "note"]


def log(message: str) -> None:
    print(message, flush=True)


# ----------------------------------------------------------------------------------------------------------
# Regions of a decoder layer, shared by the counted and the device-timed modes.


@dataclass
class Region:
    """A fused region of a decoder layer: a module (or function-module) a card swaps, and its call."""

    kind: str
    name: str
    card: str | None  # None: no card swaps it (yet)
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


def set_variant(layer: nn.Module, variant: str) -> None:
    """Give the layer the forwards of a variant: the classes' own ("eager") or the cards' layers for npu
    ("kernelized": kernelize only, the default path). Called before every run: the rotary function-modules
    are shared by the process."""
    from kernels import Mode, kernelize

    kernelize(layer, mode=Mode.TRAINING, device="cpu" if variant == "eager" else "npu")


def find_regions(layer: nn.Module) -> list[Region]:
    """The layer's fused regions: what the cards swap in, plus Experts modules that no card swaps."""
    from npu_hub_kernels import swapped_modules

    set_variant(layer, "kernelized")
    regions = {swap.module: Region(KINDS[swap.card], swap.module, swap.card) for swap in swapped_modules(layer)}
    for name, module in layer.named_modules():
        weight = getattr(module, "gate_up_proj", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 3 and name not in regions:
            regions[name] = Region(KINDS["npu-moe"], name, None)
    return list(regions.values())


def resolve(layer: nn.Module, name: str) -> nn.Module:
    """A module of the layer by qualified name; function-modules are found in their caller's `_kernel_funcs`."""
    try:
        return layer.get_submodule(name)
    except AttributeError:
        parent, _, function = name.rpartition(".")
        return layer.get_submodule(parent)._kernel_funcs[function]


def capture(
    layer: nn.Module, regions: list[Region], args: tuple, kwargs: dict, context: contextlib.AbstractContextManager
) -> None:
    """Keep each region's call (its arguments) from one forward of the layer run inside `context`."""
    captured: dict[str, tuple] = {}
    hooks = []
    for region in regions:

        def hook(module, call_args, call_kwargs, name=region.name):
            captured.setdefault(name, (call_args, call_kwargs))

        hooks.append(resolve(layer, region.name).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with context:
            layer(*args, **kwargs)
    finally:
        for handle in hooks:
            handle.remove()
    for region in regions:
        region.args, region.kwargs = captured[region.name]


def layer_inputs(spec: ModelSpec, batch: int, seq: int, make: Callable) -> tuple[tuple, dict]:
    """A decoder layer's inputs as the model passes them: hidden states, cos/sin, no mask (causal sdpa)."""
    hidden = make(batch, seq, spec.config["hidden_size"], dtype=DTYPE, device="npu").requires_grad_()
    cos, sin = (make(batch, seq, spec.config["head_dim"], dtype=DTYPE, device="npu") for _ in range(2))
    return (hidden,), {"attention_mask": None, "position_embeddings": (cos, sin)}


def _differentiable(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def _forward_backward(fn: Callable, args: tuple, kwargs: dict, params: Iterable, phase: str, make_grad):
    """Run fn forward in inference mode ("fwd": it stands for inference), or forward and the gradients w.r.t. its
    tensor inputs and parameters ("fwd+bwd")."""
    if phase == "fwd":
        with torch.inference_mode():
            fn(*args, **kwargs)
        return
    outs = [t for t in tree_leaves(fn(*args, **kwargs)) if _differentiable(t)]
    wrt = [t for t in tree_leaves((args, kwargs)) if _differentiable(t)] + [p for p in params if p.requires_grad]
    torch.autograd.grad(outs, wrt, [make_grad(t) for t in outs], allow_unused=True)


# ----------------------------------------------------------------------------------------------------------
# Counted: fusion accounting on fake tensors.


@dataclass
class Measured:
    """Tallies of one region kind (or the layer) per variant, and its floor as (ops, bytes)."""

    eager: Tally
    kernelized: Tally | None
    floor: tuple[int, int]


def build_layer(spec: ModelSpec, fake_mode: FakeTensorMode, experts: int | None = None) -> nn.Module:
    """Decoder layer 0 of the model: fake bfloat16 weights on the npu device, sdpa attention, eager experts.
    Make `fake_mode` with `fake_tensor_mode()`, so that the kernelized layer can pack its MLP on first call."""
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = dict(spec.config, num_hidden_layers=1)
    if experts is not None:
        overrides["num_local_experts" if spec.model_type == "mixtral" else "num_experts"] = experts
    config = AutoConfig.for_model(spec.model_type, **overrides)
    options = {"experts_implementation": "eager"} if spec.experts else {}  # the loop npu-moe replaces
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=DTYPE, **options)
    return fake_module(model.model.layers[0], fake_mode, "npu")


def fresh(value: Any) -> Any:
    """New empty tensors with the layouts (sizes, strides, dtypes, devices, requires_grad) of those in `value`."""

    def make(t):
        if not isinstance(t, torch.Tensor):
            return t
        new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return new.requires_grad_(t.requires_grad and t.is_floating_point())

    return tree_map(make, value)


def count_run(fn: Callable, args: tuple, kwargs: dict, params: Iterable, phase: str, experts: int | None) -> Tally:
    """The device ops of fn on fresh fake inputs with the layouts of args/kwargs, forward or forward+backward."""
    args, kwargs = fresh((args, kwargs))
    with count_device_ops(experts=experts) as tally:
        _forward_backward(fn, args, kwargs, params, phase, torch.empty_like)
    return tally


def _dense(t: torch.Tensor) -> int:
    """Bytes of a dense tensor of t's shape and dtype (an output or a gradient of t)."""
    return t.numel() * t.element_size()


Floor = tuple[tuple[int, int], tuple[int, int]]
"""((ops, bytes) forward, (ops, bytes) backward)."""


def rms_norm_floor(module: nn.Module, x: torch.Tensor, *_) -> Floor:
    """One op reading x and the weight, writing y; backward one op reading dy, x, weight, writing dx, dweight."""
    x_b, w_b = tensor_bytes(x), tensor_bytes(module.weight)
    return (1, x_b + w_b + _dense(x)), (1, _dense(x) + x_b + w_b + _dense(x) + w_b)


def rope_floor(module: nn.Module, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *_) -> Floor:
    """One op rotating q and k (reads q, k, cos, sin, writes q', k'); backward likewise on the gradients."""
    angles, qk = tensor_bytes(cos) + tensor_bytes(sin), _dense(q) + _dense(k)
    return (1, tensor_bytes(q) + tensor_bytes(k) + angles + qk), (1, qk + angles + qk)


def swiglu_mlp_floor(module: nn.Module, x: torch.Tensor, *_) -> Floor:
    """Matmul to [gate | up], swiglu, matmul down; backward dX and dW of each matmul and the swiglu backward."""
    hidden, inner = module.down_proj.weight.shape
    tokens, size = x.numel() // x.shape[-1], x.element_size()
    w_d = sum(tensor_bytes(p) for p in module.down_proj.parameters())
    w_gu = sum(tensor_bytes(p) for p in module.parameters()) - w_d
    h, a, y, x_b = tokens * 2 * inner * size, tokens * inner * size, tokens * hidden * size, tensor_bytes(x)
    fwd = (x_b + w_gu + h) + (h + a) + (a + w_d + y)
    bwd = (y + w_d + a) + (y + a + w_d) + (a + h + h) + (h + w_gu + _dense(x)) + (h + x_b + w_gu)
    return (3, fwd), (5, bwd)


def experts_floor(module: nn.Module, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Floor:
    """Counts, permute, grouped matmul, swiglu, grouped matmul, unpermute; backward 7 ops (see the module doc).

    The counts op (top_k_index -> E int64 tokens per expert) is part of the floor: the grouped matmuls need the
    counts, and no torch_npu routing op both returns them and has a backward, so a training step computes them
    beside npu_moe_token_permute (docs/torch-npu-ops.md, "MoE routing ops and per-expert counts")."""
    experts, double_inner, hidden = module.gate_up_proj.shape
    copies, size = top_k_index.numel(), x.element_size()
    w_gu, w_d = tensor_bytes(module.gate_up_proj), tensor_bytes(module.down_proj)
    xp, h, a = copies * hidden * size, copies * double_inner * size, copies * double_inner // 2 * size
    order, counts = copies * 4, experts * 8  # int32 order of the copies, int64 tokens per expert
    idx, probs, y, x_b = tensor_bytes(top_k_index), tensor_bytes(top_k_weights), _dense(x), tensor_bytes(x)
    fwd = (idx + counts) + (x_b + idx + xp + order) + (xp + w_gu + counts + h) + (h + a) + (a + w_d + counts + xp)
    fwd += xp + order + probs + y
    bwd = (y + order + xp + probs + xp + probs) + (xp + w_d + counts + a) + (xp + a + counts + w_d) + (a + h + h)
    bwd += (h + w_gu + counts + xp) + (h + xp + counts + w_gu) + (xp + order + _dense(x))
    return (6, fwd), (7, bwd)


FLOORS = {"RMSNorm": rms_norm_floor, "RoPE": rope_floor, "SwiGLU MLP": swiglu_mlp_floor, "MoE experts": experts_floor}
"""The floor of each region kind from its module and call arguments (see the module doc)."""


def floor_of(region: Region, module: nn.Module, phase: str) -> tuple[int, int]:
    """(ops, bytes) of a region at its floor, for the phase."""
    fwd, bwd = FLOORS[region.kind](module, *region.args, *region.kwargs.values())
    return fwd if phase == "fwd" else (fwd[0] + bwd[0], fwd[1] + bwd[1])


def account(spec: ModelSpec, batch: int, seq: int, experts: int | None = None) -> dict[tuple[str, str], Measured]:
    """Tallies per (region kind or "decoder layer", phase): eager, kernelized (the default path, after one
    uncounted warm-up forward) and the floor. On fake tensors of a fresh fake mode; `experts` overrides the
    model's."""
    experts = experts or spec.experts
    fake_mode = fake_tensor_mode()
    layers = {"eager": build_layer(spec, fake_mode, experts)}
    layers["kernelized"] = layers["eager"]
    regions = find_regions(layers["eager"])
    results: dict[tuple[str, str], Measured] = {}
    with fake_mode:
        args, kwargs = layer_inputs(spec, batch, seq, torch.empty)
        warm_up(layers["kernelized"], args, kwargs, experts)
        set_variant(layers["eager"], "eager")
        capture(layers["eager"], regions, args, kwargs, count_device_ops(experts=experts))
        for phase in PHASES:
            tallies: dict[tuple[str, str], Tally | None] = {}
            for variant, layer in layers.items():
                set_variant(layer, variant)
                tallies[("decoder layer", variant)] = count_run(layer, args, kwargs, layer.parameters(), phase, experts)
                for region in regions:
                    if variant != "eager" and region.card is None:
                        tallies[(region.name, variant)] = None
                        continue
                    module = resolve(layer, region.name)
                    run = count_run(module, region.args, region.kwargs, module.parameters(), phase, experts)
                    tallies[(region.name, variant)] = run
            results.update(_combine(regions, layers["eager"], tallies, phase))
        set_variant(layers["eager"], "eager")  # leave the shared rotary function-modules as they were
    return results


def warm_up(layer: nn.Module, args: tuple, kwargs: dict, experts: int | None) -> None:
    """One uncounted forward of the kernelized layer: what a card does once, on its first call (npu-swiglu packs
    the gate/up weights of split MLPs into one buffer), is not a per-step cost."""
    set_variant(layer, "kernelized")
    count_run(layer, args, kwargs, (), "fwd", experts)  # the tally is dropped


def _combine(regions: list[Region], layer: nn.Module, tallies: dict, phase: str) -> dict[tuple[str, str], Measured]:
    """Sum the regions of each kind; the layer's floor is what runs outside the regions plus each region's floor."""
    out = {}
    floors = {r.name: floor_of(r, resolve(layer, r.name), phase) for r in regions}
    for kind in (k for k in KINDS.values() if any(r.kind == k for r in regions)):
        names = [r.name for r in regions if r.kind == kind]
        out[(kind, phase)] = Measured(
            eager=_sum([tallies[(n, "eager")] for n in names]),
            kernelized=_sum([tallies[(n, "kernelized")] for n in names]),
            floor=(sum(floors[n][0] for n in names), sum(floors[n][1] for n in names)),
        )
    rests = []  # what runs outside the regions, per variant with every region measured
    for variant in ("eager", "kernelized"):
        layer_run, in_regions = (
            tallies.get(("decoder layer", variant)),
            _sum([tallies.get((r.name, variant)) for r in regions]),
        )
        if layer_run is not None and in_regions is not None:
            rests.append((layer_run.ops - in_regions.ops, layer_run.bytes - in_regions.bytes))
    rest = min(rests)  # eager regions can hand gradients on in layouts that cost a copy outside them
    out[("decoder layer", phase)] = Measured(
        eager=tallies[("decoder layer", "eager")],
        kernelized=tallies[("decoder layer", "kernelized")],
        floor=(rest[0] + sum(f[0] for f in floors.values()), rest[1] + sum(f[1] for f in floors.values())),
    )
    return out


def _sum(tallies: list[Tally | None]) -> Tally | None:
    if any(t is None for t in tallies):
        return None
    return Tally([record for t in tallies for record in t.records])


def counted_rows(spec: ModelSpec, shapes: Iterable[tuple[int, int]]) -> list[Row]:
    """bench.csv rows of one model: ops and bytes per region kind and per decoder layer, per shape and phase."""
    rows = []
    for batch, seq in shapes:
        started = time.perf_counter()
        for (kind, phase), m in account(spec, batch, seq).items():
            note = NO_CARD if m.kernelized is None else ""
            for unit, floor in (("ops", m.floor[0]), ("bytes", m.floor[1])):
                value = (lambda t: t.ops) if unit == "ops" else (lambda t: t.bytes)
                row = Row(
                    "counted", spec.name, kind, phase, batch, seq,
                    eager=value(m.eager),
                    kernelized=None if m.kernelized is None else value(m.kernelized),
                    floor=floor, unit=unit, note=note,
                )  # fmt: skip
                row.target = _counted_target(row)
                rows.append(row)
        log(f"  counted {spec.name}, batch {batch}, seq {seq}: {time.perf_counter() - started:.1f} s")
    return rows


@dataclass(frozen=True)
class CountedTarget:
    """A target for the kernelized column of counted rows: kernelized <= bound x floor (bound 1: = floor), for
    these phases, and only at `shape` when given (then one target per model)."""

    kind: str
    unit: str
    phases: tuple[str, ...]
    bound: float
    shape: tuple[int, int] | None = None

    @property
    def text(self) -> str:
        what = "op count" if self.unit == "ops" else "bytes"
        limit = "= floor" if self.bound == 1 else f"<= {self.bound:g} x floor"
        return f"kernelized {what} {limit}"

    def applies(self, row: Row) -> bool:
        shape = self.shape is None or (row.batch, row.seq) == self.shape
        return (row.op, row.unit) == (self.kind, self.unit) and row.phase in self.phases and shape

    def met(self, row: Row) -> bool:
        return row.kernelized == row.floor if self.bound == 1 else row.kernelized <= self.bound * row.floor


COUNTED_TARGETS = (
    CountedTarget("RMSNorm", "ops", PHASES, 1),
    CountedTarget("RMSNorm", "bytes", PHASES, BYTES_TOLERANCE),
    CountedTarget("RoPE", "ops", ("fwd",), 1),  # in inference: one npu_apply_rotary_pos_emb
    CountedTarget("RoPE", "ops", ("fwd+bwd",), ROPE_OPS_PER_DIRECTION),
    CountedTarget("RoPE", "bytes", PHASES, BYTES_TOLERANCE),
    CountedTarget("SwiGLU MLP", "ops", PHASES, 1),
    CountedTarget("SwiGLU MLP", "bytes", PHASES, BYTES_TOLERANCE),
    CountedTarget("MoE experts", "ops", PHASES, 1),
    CountedTarget("MoE experts", "bytes", PHASES, MOE_BYTES_TOLERANCE),
    CountedTarget("decoder layer", "bytes", ("fwd+bwd",), LAYER_BYTES_TOLERANCE, LAYER_TARGET_SHAPE),
)
"""The counted targets (see the module doc)."""


def _counted_target(row: Row) -> str:
    """The target a counted row is held to, as the CSV states it."""
    return next((t.text.removeprefix("kernelized ") for t in COUNTED_TARGETS if t.applies(row)), "")


def experts_sweep_rows(experts_counts: Iterable[int], batch: int = 1, seq: int = 512) -> list[Row]:
    """The MoE experts of Qwen3-30B-A3B's layer with other numbers of experts: transformers' eager loop and its
    default grouped_mm, against npu-moe and the floor (ops and bytes, forward and forward+backward)."""
    base = CONFIGS["qwen3-30b-a3b"]
    rows = []
    for experts in experts_counts:
        fake_mode = fake_tensor_mode()
        layer = build_layer(base, fake_mode, experts)
        region = next(r for r in find_regions(layer) if r.kind == "MoE experts")
        module = resolve(layer, region.name)
        with fake_mode:
            set_variant(layer, "eager")
            capture(layer, [region], *layer_inputs(base, batch, seq, torch.empty), count_device_ops(experts=experts))
            for phase in PHASES:
                floor = floor_of(region, module, phase)
                kernelized = None
                if region.card is not None:
                    set_variant(layer, "kernelized")
                    kernelized = count_run(module, region.args, region.kwargs, module.parameters(), phase, experts)
                set_variant(layer, "eager")
                for implementation in ("eager", "grouped_mm"):
                    module.config._experts_implementation = implementation
                    eager = count_run(module, region.args, region.kwargs, module.parameters(), phase, experts)
                    for unit, index in (("ops", 0), ("bytes", 1)):
                        rows.append(
                            Row(
                                "counted", f"{base.name}, {experts} experts",
                                f"MoE experts (transformers {implementation})", phase, batch, seq,
                                eager=(eager.ops, eager.bytes)[index],
                                kernelized=None if kernelized is None else (kernelized.ops, kernelized.bytes)[index],
                                floor=floor[index], unit=unit,
                                target="independent of #experts" if unit == "ops" else "",
                                note=NO_CARD if kernelized is None else "",
                            )
                        )  # fmt: skip
                module.config._experts_implementation = "eager"
        log(f"  counted experts sweep, {experts} experts")
    return rows


# ----------------------------------------------------------------------------------------------------------
# Timed: host-side costs on this machine.


def median_time(fn: Callable, repeats: int, number: int = 1, warmup: int = 1, sync: Callable = lambda: None) -> float:
    """Median seconds per call of fn over `repeats` samples of `number` calls each, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / number)
    return statistics.median(samples)


def paired_medians(a: Callable, b: Callable, repeats: int, number: int) -> tuple[float, float]:
    """Median seconds per call of a and of b, sampled alternately so that drift hits both alike."""
    samples: tuple[list[float], list[float]] = ([], [])
    a(), b()
    for _ in range(repeats):
        for fn, out in ((a, samples[0]), (b, samples[1])):
            start = time.perf_counter()
            for _ in range(number):
                fn()
            out.append((time.perf_counter() - start) / number)
    return statistics.median(samples[0]), statistics.median(samples[1])


def card_package(module: nn.Module) -> ModuleType:
    """The card package whose layer a kernelized module runs (the layer's forward lives in `<package>.layers`)."""
    return sys.modules[module.forward.__func__.__module__.rpartition(".")[0]]


def tiny_model(layers: int, device: str = "cpu") -> nn.Module:
    """A random-weight Llama of tiny widths with `layers` layers, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **TINY, num_hidden_layers=layers)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device).eval()


def kernelize_rows(repeats: int) -> list[Row]:
    """kernelize of a 32-layer model, its cards already loaded (loading them is get_kernel's row)."""
    from kernels import Mode, kernelize

    from npu_hub_kernels import swapped_modules

    model = tiny_model(32)
    seconds = median_time(lambda: kernelize(model, mode=Mode.INFERENCE, device="npu"), repeats)
    note = f"{len(swapped_modules(model))} modules swapped; median of {repeats}"
    kernelize(model, mode=Mode.INFERENCE, device="cpu")  # the rotary function-modules are shared by the process
    return [
        Row(
            "timed", "Llama, tiny widths, 32 layers", "kernelize", "host",
            kernelized=seconds * 1e3, unit="ms", target=f"< {KERNELIZE_TARGET_MS:g} ms", note=note,
        )
    ]  # fmt: skip


def overhead_rows(device: str, repeats: int, number: int) -> list[Row]:
    """Per-call cost of a kernelized module (eager column: calling its card function directly), tiny tensors."""
    from kernels import Mode, kernelize
    from transformers.models.llama import modeling_llama

    model = tiny_model(1, device)
    kernelize(model, mode=Mode.INFERENCE, device="npu")
    layer, rope = model.model.layers[0], modeling_llama.apply_rotary_pos_emb
    norm, mlp = layer.input_layernorm, layer.mlp
    x = torch.randn(1, 8, TINY["hidden_size"], device=device)
    q, k = torch.randn(1, 4, 8, 16, device=device), torch.randn(1, 2, 8, 16, device=device)
    cos, sin = torch.randn(1, 8, 16, device=device), torch.randn(1, 8, 16, device=device)
    rms, rotary, swiglu = card_package(norm), card_package(rope), card_package(mlp)
    pairs = {
        "RMSNorm": (lambda: norm(x), lambda: rms.rms_norm(x, norm.weight, norm.variance_epsilon, "plain")),
        "RoPE": (lambda: rope(q, k, cos, sin), lambda: rotary.apply_rotary_pos_emb(q, k, cos, sin, 1, "llama")),
        "SwiGLU MLP": (
            lambda: mlp(x),
            lambda: swiglu.split_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn),
        ),
    }
    rows = []
    with torch.no_grad():
        for kind, (module_call, direct_call) in pairs.items():
            module_s, direct_s = paired_medians(module_call, direct_call, repeats, number)
            rows.append(
                Row(
                    "timed", "tiny", f"{kind}: kernelized module vs its function", "host", 1, 8,
                    eager=direct_s * 1e6, kernelized=module_s * 1e6, unit="us",
                    target=f"module - function < {OVERHEAD_TARGET_US:g} us",
                    note=f"overhead {(module_s - direct_s) * 1e6:.2f} us per call; tensors on {device}",
                )
            )  # fmt: skip
    kernelize(model, mode=Mode.INFERENCE, device="cpu")
    return rows


def get_kernel_rows(build: Path, org: str, cold_repeats: int, warm_repeats: int, emulated: bool) -> list[Row]:
    """get_kernel of every built card from an offline Hub cache: cold (in a fresh process) and warm (loaded)."""
    from kernels import get_kernel

    from npu_hub_kernels.offline import card_version, default_cache_dir, seed_offline_cache

    versions = {repo: card_version(build / repo.split("/")[1]) for repo in seed_offline_cache(build, org)}
    code = "\n".join(
        [
            "import time",
            "from npu_hub_kernels import emulation; emulation.install()" if emulated else "",
            "from kernels import get_kernel",
            "start = time.perf_counter()",
            f"for repo, version in {versions!r}.items(): get_kernel(repo, version=version, trust_remote_code=True)",
            "print(time.perf_counter() - start)",
        ]
    )
    env = {**os.environ, "HF_HUB_CACHE": str(default_cache_dir()), "HF_HUB_OFFLINE": "1"}
    cold, process = [], []
    for _ in range(cold_repeats):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
        process.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise RuntimeError(f"cold get_kernel failed:\n{done.stderr}")
        cold.append(float(done.stdout.split()[-1]))

    def load_all() -> None:
        for repo, version in versions.items():
            get_kernel(repo, version=version, trust_remote_code=True)

    warm = median_time(load_all, warm_repeats)
    config = f"{len(versions)} cards, offline Hub cache"
    note = "every card, imports of torch and kernels not included; median of {}"
    whole = f"; the whole fresh process (Python, imports, get_kernel): {statistics.median(process) * 1e3:.0f} ms"
    return [
        Row("timed", config, "get_kernel, cold (fresh process)", "host", kernelized=statistics.median(cold) * 1e3,
            unit="ms", note=note.format(cold_repeats) + whole),
        Row("timed", config, "get_kernel, warm (loaded)", "host", kernelized=warm * 1e3, unit="ms",
            note=note.format(warm_repeats)),
    ]  # fmt: skip


def load_variant(card_dir: Path, variant: str) -> ModuleType:
    """Import one build variant of a built card as a package of its own (not through the kernels loader)."""
    variant_dir = card_dir / "build" / variant
    package_dir = next(p for p in sorted(variant_dir.iterdir()) if (p / "__init__.py").is_file())
    name = f"_bench_{variant.replace('-', '_')}_{package_dir.name}"
    spec = importlib.util.spec_from_file_location(
        name, package_dir / "__init__.py", submodule_search_locations=[str(package_dir)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def fallback_rows(build: Path, repeats: int, quick: bool) -> list[Row]:
    """The torch-universal build on CPU tensors against transformers' eager forward (float32, no module call
    overhead on either side: the class forward against the card function)."""
    from transformers import AutoConfig
    from transformers.models.llama import modeling_llama as llama

    rms, rotary, swiglu = (
        load_variant(build / c, "torch-universal") for c in ("npu-rms-norm", "npu-rope", "npu-swiglu")
    )
    batch, seq, hidden, heads, inner = (2, 64, 256, 4, 512) if quick else (4, 512, 2048, 32, 5632)
    norm = llama.LlamaRMSNorm(hidden)
    mlp = llama.LlamaMLP(AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=inner))
    rope = llama.apply_rotary_pos_emb
    x = torch.randn(batch, seq, hidden)
    q, k = torch.randn(batch, heads, seq, 128), torch.randn(batch, max(heads // 4, 1), seq, 128)
    cos, sin = torch.randn(batch, seq, 128), torch.randn(batch, seq, 128)
    pairs = {
        "RMSNorm": (
            lambda: llama.LlamaRMSNorm.forward(norm, x),
            lambda: rms.rms_norm(x, norm.weight, norm.variance_epsilon, "plain"),
            f"x {tuple(x.shape)}",
        ),
        "RoPE": (
            lambda: type(rope).forward(rope, q, k, cos, sin),
            lambda: rotary.apply_rotary_pos_emb(q, k, cos, sin, 1, "llama"),
            f"q {tuple(q.shape)}, k {tuple(k.shape)}",
        ),
        "SwiGLU MLP": (
            lambda: llama.LlamaMLP.forward(mlp, x),
            lambda: swiglu.split_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn),
            f"x {tuple(x.shape)}, intermediate {inner}",
        ),
    }
    rows = []
    with torch.no_grad():
        for kind, (eager, fallback, shapes) in pairs.items():
            eager_s, fallback_s = paired_medians(eager, fallback, repeats, 1)
            rows.append(
                Row(
                    "timed", "CPU, float32", f"{kind}: torch-universal vs eager", "fwd", batch, seq,
                    eager=eager_s * 1e3, kernelized=fallback_s * 1e3, unit="ms",
                    target=f"<= {FALLBACK_TOLERANCE:g} x eager", note=f"{shapes}; median of {repeats}",
                )
            )  # fmt: skip
    return rows


# ----------------------------------------------------------------------------------------------------------
# Timed: the device (an Ascend host; the emulation with --device-timing on).


def device_rows(
    specs: Iterable[ModelSpec], shapes: Iterable[tuple[int, int]], device: str, emulated: bool, repeats: int
) -> list[Row]:
    """Per region kind and per decoder layer, eager against kernelized (the default path; the warm-up call of each
    median packs split MLPs once), forward and forward+backward, synchronised medians, and the decoder layer's
    peak memory where the device reports it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    rows = []
    for spec in specs:
        for batch, seq in shapes:
            config = AutoConfig.for_model(spec.model_type, **dict(spec.config, num_hidden_layers=1, vocab_size=1024))
            options = {"experts_implementation": "eager"} if spec.experts else {}
            torch.manual_seed(0)
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=DTYPE, **options)
            layer = model.model.layers[0]
            regions = find_regions(layer)
            args, kwargs = layer_inputs(spec, batch, seq, torch.randn)
            set_variant(layer, "eager")
            capture(layer, regions, args, kwargs, contextlib.nullcontext())
            timings: dict[tuple[str, str, str], tuple[float, int | None]] = {}
            for variant in ("eager", "kernelized"):
                set_variant(layer, variant)
                for phase in PHASES:
                    timings[("decoder layer", variant, phase)] = time_run(layer, args, kwargs, phase, repeats, emulated)
                    for region in regions:
                        module = resolve(layer, region.name)
                        run = time_run(module, region.args, region.kwargs, phase, repeats, emulated)
                        timings[(region.name, variant, phase)] = run
            set_variant(layer, "eager")
            rows += _device_rows(spec, batch, seq, regions, timings, emulated)
            log(f"  timed device{' (emulated)' if emulated else ''}: {spec.name}, batch {batch}, seq {seq}")
    return rows


def time_run(
    fn: Callable, args: tuple, kwargs: dict, phase: str, repeats: int, emulated: bool
) -> tuple[float, int | None]:
    """(median seconds, peak bytes or None) of fn forward, or forward and the gradients of its inputs and parameters."""
    args, kwargs = tree_map(_copy, (args, kwargs))
    params = list(fn.parameters()) if isinstance(fn, nn.Module) else []
    stats = None if emulated else torch.npu  # the emulated device keeps no allocator statistics
    if stats is not None:
        stats.reset_peak_memory_stats()
    seconds = median_time(
        lambda: _forward_backward(fn, args, kwargs, params, phase, torch.ones_like),
        repeats,
        sync=torch.npu.synchronize,
    )
    return seconds, None if stats is None else stats.max_memory_allocated()


def _copy(t):
    if not isinstance(t, torch.Tensor):
        return t
    return t.detach().clone().requires_grad_(t.requires_grad and t.is_floating_point())


def _device_rows(
    spec: ModelSpec, batch: int, seq: int, regions: list[Region], timings: dict, emulated: bool
) -> list[Row]:
    names = {kind: [r.name for r in regions if r.kind == kind] for kind in KINDS.values()}
    names = {kind: members for kind, members in names.items() if members}
    names["decoder layer"] = ["decoder layer"]
    note = EMULATED if emulated else ""
    rows = []
    for kind, members in names.items():
        for phase in PHASES:

            def ms(variant: str, members=members, phase=phase) -> float:
                return sum(timings[(n, variant, phase)][0] for n in members) * 1e3

            common = dict(mode="timed", config=spec.name, phase=phase, batch=batch, seq=seq)
            rows.append(Row(op=kind, eager=ms("eager"), kernelized=ms("kernelized"), unit="ms", note=note, **common))
            if kind == "decoder layer":
                peaks = [timings[("decoder layer", v, phase)][1] for v in ("eager", "kernelized")]
                peak_note = note or ("" if None not in peaks else "the device reports no peak memory")
                op = f"{kind} peak memory"
                rows.append(Row(op=op, eager=peaks[0], kernelized=peaks[1], unit="bytes", note=peak_note, **common))
    return rows


def training_rows(device: str, emulated: bool, steps: int) -> list[Row]:
    """Median time of a training step (forward, backward, AdamW) of a small model: eager, then kernelized (the
    default path: the warm-up step packs split MLPs once)."""
    from kernels import Mode, kernelize
    from transformers import AutoConfig, AutoModelForCausalLM

    if emulated:
        spec, overrides, batch, seq = TINY_SPECS[0], dict(num_hidden_layers=2), 2, 32
    else:  # two of Llama-3-8B's layers, a smaller vocabulary
        spec, overrides, batch, seq = CONFIGS["llama-3-8b"], dict(num_hidden_layers=2, vocab_size=32000), 1, 2048
    config = AutoConfig.for_model(spec.model_type, **dict(spec.config, **overrides))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=DTYPE).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)

    def step_time() -> float:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step() -> None:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        return median_time(step, steps, sync=torch.npu.synchronize)

    eager = step_time()
    kernelize(model, mode=Mode.TRAINING, device="npu")
    kernelized = step_time()
    kernelize(model, mode=Mode.TRAINING, device="cpu")
    log(f"  timed training step{' (emulated)' if emulated else ''}")
    return [
        Row(
            "timed", f"{spec.name}, {config.num_hidden_layers} layers, vocab {config.vocab_size}",
            "training step (AdamW)", "fwd+bwd", batch, seq, eager=eager * 1e3, kernelized=kernelized * 1e3,
            unit="ms", note=EMULATED if emulated else f"median of {steps} steps",
        )
    ]  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# Outputs: CSV, summary, README section, chart.


def write_csv(rows: list[Row], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for row in rows:
            values = {**asdict(row), "ratio": row.ratio}
            writer.writerow(["" if values[c] is None else _csv_value(values[c]) for c in CSV_COLUMNS])


def _csv_value(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _number(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return human_bytes(value) if unit == "bytes" else f"{value:.0f}" if unit == "ops" else f"{value:.3g}"


def _experts_of(row: Row) -> int:
    """The number of experts of an experts-sweep row ("Qwen3-30B-A3B, 8 experts")."""
    return int(row.config.rsplit(", ", 1)[1].split()[0])


def _is_sweep(row: Row) -> bool:
    return row.mode == "counted" and row.config.endswith(" experts")


def _is_emulated(row: Row) -> bool:
    return row.note.startswith(EMULATED)


def targets(rows: list[Row]) -> list[tuple[str, str, bool | None]]:
    """(target, what was measured, met: True, False or None when there is nothing to measure yet)."""
    counted = [r for r in rows if r.mode == "counted" and not _is_sweep(r)]
    out = []
    for target in COUNTED_TARGETS:
        held = [r for r in counted if target.applies(r)]
        if not held:
            continue
        phases = " and ".join(target.phases)
        if target.shape is not None:  # one target per model
            for r in held:
                label = f"{r.config} {target.kind}: {target.text} ({phases}, batch {r.batch} x seq {r.seq})"
                out.append((label, f"{r.ratio:.3f} x floor", target.met(r)))
            continue
        label = f"{target.kind}: {target.text} ({phases})"
        if any(r.kernelized is None for r in held):
            out.append((label, NO_CARD, None))
            continue
        if target.unit == "ops":
            worst = [max((r for r in held if r.phase == p), key=lambda r: r.ratio) for p in target.phases]
            text = ", ".join(f"{r.kernelized:.0f} vs {r.floor:.0f} ({r.phase}, {r.config})" for r in worst)
        else:
            worst_bytes = max(held, key=lambda r: r.ratio)
            text = f"up to {worst_bytes.ratio:.3f} x floor ({worst_bytes.phase}, {worst_bytes.config})"
        out.append((label, text, all(target.met(r) for r in held)))
    loop = [r for r in rows if _is_sweep(r) and r.unit == "ops" and r.phase == "fwd+bwd" and r.op.endswith("eager)")]
    if loop:
        experts = "/".join(str(_experts_of(r)) for r in loop)
        eager = "/".join(f"{r.eager:.0f}" for r in loop)
        if any(r.kernelized is None for r in loop):
            out.append(("MoE experts: op count independent of #experts", f"{NO_CARD}; eager loop {eager}", None))
        else:
            counts = sorted({int(r.kernelized) for r in loop})
            text = f"npu-moe {'/'.join(map(str, counts))} ops for {experts} experts, fwd+bwd (eager loop: {eager})"
            out.append(("MoE experts: op count independent of #experts", text, len(counts) == 1))
    timed = [r for r in rows if r.mode == "timed" and not _is_emulated(r)]
    for r in (r for r in timed if r.op == "kernelize"):
        met = r.kernelized < KERNELIZE_TARGET_MS
        out.append((f"kernelize of 32 layers < {KERNELIZE_TARGET_MS:g} ms", f"{r.kernelized:.1f} ms", met))
    overheads = [(r.op.split(":")[0], r.kernelized - r.eager) for r in timed if "vs its function" in r.op]
    if overheads:
        text = ", ".join(f"{kind} {us:.2f} us" for kind, us in overheads)
        out.append(
            (
                f"per-call overhead < {OVERHEAD_TARGET_US:g} us",
                text,
                all(us < OVERHEAD_TARGET_US for _, us in overheads),
            )
        )
    fallbacks = [(r.op.split(":")[0], r.ratio) for r in timed if "torch-universal" in r.op]
    if fallbacks:
        text = ", ".join(f"{kind} {ratio:.2f} x eager" for kind, ratio in fallbacks)
        met = all(ratio <= FALLBACK_TOLERANCE for _, ratio in fallbacks)
        out.append((f"torch-universal fallback not slower than eager (<= {FALLBACK_TOLERANCE:g} x)", text, met))
    return out


def _mlp_prefill_decode_table(counted: list[Row]) -> list[str]:
    """Forward ops and bytes of one SwiGLU MLP call, eager and kernelized: prefill (1 x 4096), decode (1 x 1)."""
    mlp = [r for r in counted if r.phase == "fwd" and r.op == "SwiGLU MLP" and (r.batch, r.seq) in PREFILL_DECODE]
    if not mlp:
        return []
    lines = [
        "",
        "Counted, one SwiGLU MLP call, forward (inference mode), prefill (batch 1, 4096 tokens) and decode (batch 1, "
        "1 token):",
        "",
        "| model | tokens | ops eager | kernelized | bytes eager | kernelized |",
        "|---|---|---|---|---|---|",
    ]
    for ops in sorted((r for r in mlp if r.unit == "ops"), key=lambda r: (r.config, -int(r.seq))):
        size = next(r for r in mlp if r.unit == "bytes" and (r.config, r.seq) == (ops.config, ops.seq))
        lines.append(
            f"| {ops.config} | {ops.seq} | {ops.eager:.0f} | {ops.kernelized:.0f} | {human_bytes(size.eager)} | "
            f"{human_bytes(size.kernelized)} |"
        )
    return lines


PREFILL_DECODE = ((1, 4096), (1, 1))


CARD_REGIONS = {
    "npu-rms-norm": ("RMSNorm",),
    "npu-rope": ("RoPE",),
    "npu-swiglu": ("SwiGLU MLP",),
    "npu-moe": ("MoE experts",),
}
"""Which counted regions each card's benchmark section reports."""


def card_summary(card: str, rows: list[Row]) -> str:
    """A card's share of the summary, for its Hub README: its targets and its regions' counted figures."""
    regions = CARD_REGIONS[card]
    met_text = {True: "yes", False: "no", None: "not measured"}
    lines = [
        "Counted by npu-hub-kernels' `make bench`: device operations and bytes on fake tensors under the torch_npu "
        "emulation, which do not depend on the machine (floor: each fused region as the fewest kernels, each reading "
        "its inputs and writing its outputs once).",
        "",
        "| target | measured | met |",
        "|---|---|---|",
    ]
    lines += [
        f"| {target} | {measured} | {met_text[met]} |"
        for target, measured, met in targets(rows)
        if target.startswith(tuple(region.split(" (")[0] for region in regions))
    ]
    counted = [r for r in rows if r.mode == "counted" and not _is_sweep(r) and r.op in regions]
    if counted:
        _, batch, seq = max((r.batch * r.seq, r.batch, r.seq) for r in counted)
        chosen = [r for r in counted if r.phase == "fwd+bwd" and (r.batch, r.seq) == (batch, seq)]
        lines += [
            "",
            f"Forward+backward, batch {batch}, sequence {seq}, bfloat16:",
            "",
            "| model | region | ops eager | kernelized | floor | bytes eager | kernelized | floor |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for ops in (r for r in chosen if r.unit == "ops"):
            size = next(r for r in chosen if r.unit == "bytes" and (r.config, r.op) == (ops.config, ops.op))
            lines.append(
                f"| {ops.config} | {ops.op} | {ops.eager:.0f} | {ops.kernelized:.0f} | {ops.floor:.0f} | "
                f"{human_bytes(size.eager)} | {human_bytes(size.kernelized)} | {human_bytes(size.floor)} |"
            )
    return "\n".join(lines) + "\n"


def summary(rows: list[Row], machine: str, versions: str, table: str = ".cache/bench/bench.csv") -> str:
    """The markdown summary (summary.md and the README section): counted and timed figures, no emulated timing."""
    met_text = {True: "yes", False: "**no**", None: "-"}
    lines = [
        f"`make bench` (`scripts/bench.py`) on {machine}; {versions}. Every figure: `{table}`.",
        "",
        "- **Counted**, not timed: device operations (kernel launches: aten ops that are not views, and each fused "
        "op once) and the bytes each one reads and writes, for one decoder layer in bfloat16, on fake tensors under "
        "the torch_npu emulation. They do not depend on the machine. Floor: each fused region as the fewest kernels "
        "that compute it, each reading its inputs and writing its outputs once (defined in `scripts/bench.py`).",
        "- Kernelized: the default path, `kernelize` and nothing else. Split MLPs pack gate/up into one buffer on "
        "their first call, a one-time cost: one uncounted warm-up forward runs first. fwd runs in "
        "`torch.inference_mode()` (inference), fwd+bwd with grad (training).",
        "- **Timed**: medians of repeats after warm-up, on the machine above.",
    ]
    device = [r for r in rows if r.mode == "timed" and r.phase in PHASES and r.config != "CPU, float32"]
    real_device = [r for r in device if not _is_emulated(r)]
    if not real_device:
        lines.append("- No Ascend device here, so no device timings (emulated ones are only in bench.csv, labelled).")
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {target} | {measured} | {met_text[met]} |" for target, measured, met in targets(rows)]
    counted = [r for r in rows if r.mode == "counted" and not _is_sweep(r)]
    if counted:
        _, batch, seq = max((r.batch * r.seq, r.batch, r.seq) for r in counted)
        chosen = [r for r in counted if r.phase == "fwd+bwd" and (r.batch, r.seq) == (batch, seq)]
        lines += [
            "",
            f"Counted, forward+backward, batch {batch}, sequence {seq} (ratio: kernelized bytes / floor bytes):",
            "",
            "| model | region | ops eager | kernelized | floor | bytes eager | kernelized | floor | ratio |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for ops in (r for r in chosen if r.unit == "ops"):
            size = next(r for r in chosen if r.unit == "bytes" and (r.config, r.op) == (ops.config, ops.op))
            kernelized = NO_CARD if ops.kernelized is None else f"{ops.kernelized:.0f}"
            ratio = "-" if size.ratio is None else f"{size.ratio:.2f}"
            lines.append(
                f"| {ops.config} | {ops.op} | {ops.eager:.0f} | {kernelized} | {ops.floor:.0f} | "
                f"{human_bytes(size.eager)} | {human_bytes(size.kernelized)} | {human_bytes(size.floor)} | {ratio} |"
            )
    lines += _mlp_prefill_decode_table(counted)
    sweep = [r for r in rows if _is_sweep(r) and r.phase == "fwd+bwd" and r.unit == "ops"]
    if sweep:
        lines += [
            "",
            "Counted, the MoE experts of a Qwen3-30B-A3B layer with E experts (top-8, batch 1, sequence 512), "
            "forward+backward ops:",
            "",
            "| experts | transformers eager loop | transformers grouped_mm | npu-moe | floor |",
            "|---|---|---|---|---|",
        ]
        for loop in (r for r in sweep if r.op.endswith("eager)")):
            grouped = next(r for r in sweep if r.config == loop.config and r.op.endswith("grouped_mm)"))
            kernelized = NO_CARD if loop.kernelized is None else f"{loop.kernelized:.0f}"
            lines.append(
                f"| {_experts_of(loop)} | {loop.eager:.0f} | {grouped.eager:.0f} | {kernelized} | {loop.floor:.0f} |"
            )
    host = [r for r in rows if r.mode == "timed" and (r.phase == "host" or r.config == "CPU, float32")]
    if host:
        lines += [
            "",
            "Timed on this machine, host side:",
            "",
            "| measurement | eager or direct | kernelized | unit | note |",
        ]
        lines.append("|---|---|---|---|---|")
        for r in host:
            eager, kernelized = _number(r.eager, r.unit), _number(r.kernelized, r.unit)
            lines.append(f"| {r.op} ({r.config}) | {eager} | {kernelized} | {r.unit} | {r.note} |")
    if real_device:
        lines += [
            "",
            "Timed on the Ascend device:",
            "",
            "| model | op | phase | batch x seq | eager | kernelized | unit |",
        ]
        lines.append("|---|---|---|---|---|---|---|")
        for r in real_device:
            eager, kernelized = _number(r.eager, r.unit), _number(r.kernelized, r.unit)
            lines.append(
                f"| {r.config} | {r.op} | {r.phase} | {r.batch} x {r.seq} | {eager} | {kernelized} | {r.unit} |"
            )
    return "\n".join(lines) + "\n"


def update_readme(path: Path, text: str) -> None:
    """Replace what lies between the bench markers of `path` with `text`; nothing else changes."""
    content = path.read_text()
    begin, end = content.find(README_BEGIN), content.find(README_END)
    if begin < 0 or end < begin:
        raise SystemExit(f"{path}: no {README_BEGIN} ... {README_END} markers; add them where the bench summary goes")
    path.write_text(content[: begin + len(README_BEGIN)] + "\n" + text.strip() + "\n" + content[end:])


def write_chart(rows: list[Row], path: Path, machine: str) -> str | None:
    """Draw bench.png; returns why no chart was drawn, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no bench.png: matplotlib is not installed (it is a dev requirement: requirements-dev.txt)"
    fig, axes = plt.subplots(2, 2, figsize=(16, 10))
    _chart_layer_ops(axes[0][0], rows)
    _chart_bytes(axes[0][1], rows)
    _chart_sweep(axes[1][0], rows)
    _chart_host(axes[1][1], rows)
    fig.suptitle(f"npu-hub-kernels: counted on fake tensors (emulated torch_npu), timed on {machine}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def _not_run(ax, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def _chart_layer_ops(ax, rows: list[Row]) -> None:
    title = "Device ops of one decoder layer, fwd+bwd (log scale)"
    layers = [
        r for r in rows
        if r.mode == "counted" and r.unit == "ops" and r.phase == "fwd+bwd" and r.op.startswith("decoder layer")
    ]  # fmt: skip
    layers = list({r.config: r for r in layers}.values())
    if not layers:
        return _not_run(ax, title)
    series = (
        ("eager transformers", [r.eager for r in layers]),
        ("kernelized (default path)", [r.kernelized for r in layers]),
        ("floor", [r.floor for r in layers]),
    )
    for offset, (label, values) in zip((-0.27, 0.0, 0.27), series, strict=True):
        bars = ax.bar([i + offset for i in range(len(layers))], values, 0.27, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(layers)), [r.config for r in layers])
    ax.set_yscale("log")
    ax.set_ylabel("device ops")
    ax.set_title(title)
    ax.legend(fontsize=8)


def _chart_bytes(ax, rows: list[Row]) -> None:
    counted = [
        r for r in rows if r.mode == "counted" and r.unit == "bytes" and r.phase == "fwd+bwd" and not _is_sweep(r)
    ]
    kinds = [k for k in ("RMSNorm", "RoPE", "SwiGLU MLP", "MoE experts") if any(r.op == k for r in counted)]
    if not kinds:
        return _not_run(ax, "Bytes moved / floor")
    _, batch, seq = max((r.batch * r.seq, r.batch, r.seq) for r in counted)
    chosen = [r for r in counted if (r.batch, r.seq) == (batch, seq)]
    configs = list(dict.fromkeys(r.config for r in chosen))
    width = 0.8 / len(configs)
    for i, config in enumerate(configs):
        label = config
        for j, kind in enumerate(kinds):
            row = next((r for r in chosen if (r.config, r.op) == (config, kind)), None)
            if row is None:
                continue
            x = j - 0.4 + (i + 0.5) * width
            ax.bar(x, row.eager / row.floor, width, color=f"C{i}", alpha=0.3)
            if row.kernelized is None:
                ax.text(x, 1, NO_CARD, rotation=90, ha="center", va="bottom", fontsize=7)
            else:
                ax.bar(x, row.ratio, width * 0.6, color=f"C{i}", label=label)
                label = None
    ax.axhline(BYTES_TOLERANCE, color="k", linestyle="--", linewidth=0.8, label=f"target: {BYTES_TOLERANCE:g} x floor")
    ax.set_xticks(range(len(kinds)), kinds)
    ax.set_yscale("log")
    ax.set_ylabel("bytes / floor (pale: eager, solid: kernelized)")
    ax.set_title(f"Bytes / floor per fused region, fwd+bwd, batch {batch} x seq {seq} (log scale)")
    ax.legend(fontsize=8)


def _chart_sweep(ax, rows: list[Row]) -> None:
    title = "MoE experts (Qwen3-30B-A3B layer, top-8): ops by number of experts, fwd+bwd"
    sweep = [r for r in rows if _is_sweep(r) and r.unit == "ops" and r.phase == "fwd+bwd"]
    if not sweep:
        return _not_run(ax, title)
    loop = [r for r in sweep if r.op.endswith("eager)")]
    grouped = [r for r in sweep if r.op.endswith("grouped_mm)")]
    experts = [_experts_of(r) for r in loop]
    ax.plot(experts, [r.eager for r in loop], "o-", label="transformers eager loop")
    ax.plot(experts, [r.eager for r in grouped], "s-", label="transformers grouped_mm")
    if all(r.kernelized is not None for r in loop):
        ax.plot(experts, [r.kernelized for r in loop], "^-", label="npu-moe")
    else:
        ax.text(0.5, 0.1, f"npu-moe: {NO_CARD}", transform=ax.transAxes, ha="center")
    ax.plot(experts, [r.floor for r in loop], "k--", label="floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("experts")
    ax.set_ylabel("device ops")
    ax.set_title(title)
    ax.legend(fontsize=8)


def _chart_host(ax, rows: list[Row]) -> None:
    title = "Host side, measured / target (left of the dashed line: target met)"
    bars = []
    for r in rows:
        if r.mode != "timed" or _is_emulated(r):
            continue
        if r.op == "kernelize":
            bars.append((f"kernelize, 32 layers: {r.kernelized:.1f} ms", r.kernelized / KERNELIZE_TARGET_MS))
        elif "vs its function" in r.op:
            us = r.kernelized - r.eager
            bars.append((f"{r.op.split(':')[0]} module call overhead: {us:.2f} us", max(us, 0) / OVERHEAD_TARGET_US))
        elif "torch-universal" in r.op:
            bars.append((f"{r.op.split(':')[0]} fallback: {r.ratio:.2f} x eager", r.ratio / FALLBACK_TOLERANCE))
    if not bars:
        return _not_run(ax, title)
    ax.barh(range(len(bars)), [v for _, v in bars], color=["C2" if v <= 1 else "C3" for _, v in bars])
    ax.set_yticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.axvline(1.0, color="k", linestyle="--", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_title(title)


# ----------------------------------------------------------------------------------------------------------


def real_npu() -> bool:
    """An Ascend host: a real torch_npu (not the emulation) with a device."""
    if emulation.is_installed() or importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401

    return torch.npu.is_available()


def describe_host(emulated: bool) -> tuple[str, str]:
    """(machine, versions) as the CSV and the summary state them."""
    import kernels
    import transformers

    device = "no NPU (torch_npu emulated)" if emulated else f"Ascend {torch.npu.get_device_name(0)}"
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, {device}"
    cann = f"CANN {getattr(torch.version, 'cann', '?')}{' (emulated)' if emulated else ''}"
    versions = (
        f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"kernels {kernels.__version__}, {cann}"
    )
    return machine, versions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".cache" / "bench", help="output folder")
    parser.add_argument("--build", type=Path, default=ROOT / "build", help="folder of built cards (make build)")
    parser.add_argument("--org", default=None, help="Hub organisation of the cards in the offline cache")
    parser.add_argument("--readme", type=Path, help="rewrite the bench section of this file (between its markers)")
    parser.add_argument(
        "--cards-dir",
        type=Path,
        help="write each card's benchmark.md here (kernel-cards/): the build adds it to the card's Hub README",
    )
    parser.add_argument("--quick", action="store_true", help="batch 1 x sequence 512 only, fewer repeats")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--only", choices=("counted", "timed"), help="run one mode only")
    parser.add_argument(
        "--device-timing",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto: on an Ascend host only; on: also on the emulation (small shapes, labelled emulated)",
    )
    args = parser.parse_args(argv)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown config(s) {', '.join(sorted(unknown))}; choose from {', '.join(CONFIGS)}")
    specs = [CONFIGS[name] for name in args.configs.split(",")]
    quick = args.quick
    logging.getLogger("kernels").setLevel(logging.ERROR)  # "no mapping for ... cpu": how the eager forwards return

    from npu_hub_kernels import register_npu_kernels, unregister_npu_kernels

    emulated = not real_npu()
    if emulated:
        emulation.install()
    register_npu_kernels(local_dir=args.build)
    machine, versions = describe_host(emulated)
    log(f"bench: {machine}; {versions}")
    rows: list[Row] = []
    try:
        if args.only in (None, "counted"):
            if emulated:
                log("counted: fusion accounting on fake tensors")
                for spec in specs:
                    rows += counted_rows(spec, QUICK_SHAPES if quick else SHAPES)
                rows += experts_sweep_rows((8, 128) if quick else SWEEP_EXPERTS)
            else:
                log("counted: skipped; it runs on the torch_npu emulation (the counts do not depend on the host)")
        if args.only in (None, "timed"):
            log("timed: host side")
            rows += kernelize_rows(5 if quick else 21)
            rows += overhead_rows("cpu" if emulated else "npu", 5 if quick else 15, 200 if quick else 2000)
            rows += get_kernel_rows(args.build, resolve_org(args.org), 1 if quick else 3, 3 if quick else 10, emulated)
            rows += fallback_rows(args.build, 3 if quick else 9, quick)
            if args.device_timing == "on" or (args.device_timing == "auto" and not emulated):
                log(f"timed: device{' (emulated, not a device measurement)' if emulated else ''}")
                shapes = ((2, 16),) if emulated else QUICK_SHAPES if quick else ((1, 4096),)
                repeats = 3 if quick or emulated else 10
                rows += device_rows(TINY_SPECS if emulated else specs, shapes, "npu", emulated, repeats)
                rows += training_rows("npu", emulated, repeats)
    finally:
        unregister_npu_kernels()
    for row in rows:
        row.machine, row.versions = machine, versions
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "bench.csv")
    table = args.out.resolve() / "bench.csv"
    text = summary(rows, machine, versions, str(table.relative_to(ROOT) if table.is_relative_to(ROOT) else table))
    (args.out / "summary.md").write_text(text)
    problem = write_chart(rows, args.out / "bench.png", machine)
    if args.readme:
        update_readme(args.readme, text)
    for card in CARD_REGIONS if args.cards_dir else ():
        (args.cards_dir / card / "benchmark.md").write_text(card_summary(card, rows))
    log(problem or f"wrote {args.out}: bench.csv ({len(rows)} rows), bench.png, summary.md")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
