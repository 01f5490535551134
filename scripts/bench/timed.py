"""Timed: host-side costs on this machine, and the device (an Ascend host; the emulation with --device-timing on).

The host cost of a card's call (`host_cost_rows`) is its Python alone: the call's ops are recorded once, then
replayed as stubs (`OpTape`: each op returns the output it gave when recorded, computing nothing), and the kernelized
module is timed against a bare module call (`BareCall`: an nn.Module whose forward issues the same op calls, in order,
and nothing else), interleaved in one run. What the card adds on the host is the ratio of the two. Both run with
tensor subclasses' `__torch_function__` off (`torch._C.DisableTorchFunctionSubclass`): a torch_npu tensor is a plain
torch.Tensor, whose dtype or shape is read in C, where the emulation's tensor subclass would add a Python-level check
to every read (about 70 ns each, measured: 110 against 48 ns for a dtype).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import MethodType, ModuleType
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map

from npu_hub_kernels.report import card_package
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm

from .accounting import _aten_bytes, fused_ops
from .cards import LAYER, kinds, with_piece
from .configs import CONFIGS, DTYPE, PHASES, ROOT, TINY_SPECS, ModelSpec
from .device_model import HOST_PER_OP
from .regions import Region, capture, find_regions, forward_backward, layer_inputs, region_call, set_variant
from .rows import EMULATED, Row, log

KERNELIZE_TARGET_MS = 100.0
"""kernelize of a 32-layer model, its cards loaded, takes under 100 ms (`kernelize_rows`)."""
OVERHEAD_TARGET_US = 10.0
"""A kernelized module's call costs under 10 us more than calling its card function directly (`overhead_rows`)."""
OVERHEAD_STUDY = "call overhead"
"""The study of the timed rows of a kernelized module's call against its card function (`CallOverheadRow`)."""
FALLBACK_TOLERANCE = 1.05
"""The fallback counts as not slower than eager when its median is within 5% (timing noise) of eager's."""
HOST_COST_BOUND = 2.0
"""A card's kernelized module costs the host at most 2 x a bare module call issuing the same ops (`host_cost`)."""
HOST_COST_SHAPE = (1, 1)
"""Decode size, where the host bounds a step: batch 1, one token."""
HOST_COST_STUDY = "host cost"
"""The study of the timed rows of a card's host cost against a bare module call (`HostCostRow`)."""


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


def _calls(a: Callable, b: Callable, inputs: tuple) -> tuple[Callable, Callable]:
    """a and b, each called on the same inputs, as calls without arguments."""
    return lambda: a(*inputs), lambda: b(*inputs)


def _card_of(module: nn.Module) -> ModuleType:
    package = card_package(module)
    if package is None:
        raise RuntimeError(f"{type(module).__name__} runs no card layer: is it kernelized for npu?")
    return package


def kernelize_rows(repeats: int) -> list[Row]:
    """kernelize of a 32-layer model, its cards already loaded (loading them is get_kernel's row)."""
    from kernels import Mode, kernelize

    from npu_hub_kernels import swapped_modules

    model = tiny_causal_lm("llama", num_hidden_layers=32)
    seconds = median_time(lambda: kernelize(model, mode=Mode.INFERENCE, device="npu"), repeats)
    note = f"{len(swapped_modules(model))} modules swapped; median of {repeats}"
    kernelize(model, mode=Mode.INFERENCE, device="cpu")  # the rotary function-modules are shared by the process
    return [
        Row(
            "timed", "Llama, tiny widths, 32 layers", "kernelize", "host",
            kernelized=seconds * 1e3, unit="ms", target=f"< {KERNELIZE_TARGET_MS:g} ms", note=note,
            study="kernelize",
        )
    ]  # fmt: skip


@dataclass(frozen=True)
class CallOverheadRow:
    """A kernelized module's call against a direct call of its card function, tiny tensors (`overhead_rows`)."""

    region: str  # the card's region kind
    function_us: float  # the card function called directly
    module_us: float  # the kernelized module called
    note: str

    @property
    def overhead_us(self) -> float:
        """What the module call adds to the function call."""
        return self.module_us - self.function_us

    def csv_row(self) -> Row:
        """Return its line of bench.csv: the function call in the eager column, the module call in the kernelized."""
        return Row(
            "timed", "tiny", f"{self.region}: kernelized module vs its function", "host", 1, 8,
            eager=self.function_us, kernelized=self.module_us, unit="us",
            target=f"module - function < {OVERHEAD_TARGET_US:g} us",
            note=self.note, study=OVERHEAD_STUDY, kind=self.region,
        )  # fmt: skip

    @classmethod
    def of(cls, row: Row) -> CallOverheadRow:
        """The call overhead row a line of bench.csv holds (what `csv_row` wrote)."""
        return cls(region=row.kind, function_us=row.eager, module_us=row.kernelized, note=row.note)


def overhead_rows(device: str, repeats: int, number: int) -> list[Row]:
    """Return the rows of the per-call cost of each card's kernelized module over its card function.

    Tiny tensors: each card whose HOST_TIMING has a direct_call, on its region of a tiny Llama decoder layer."""
    from kernels import Mode, kernelize

    model = tiny_causal_lm("llama", num_hidden_layers=1).to(device)
    kernelize(model, mode=Mode.INFERENCE, device="npu")
    layer = model.model.layers[0]
    rows = []
    with torch.no_grad():
        for card, timing in direct_calls():
            module = timing.region(layer)
            inputs = timing.inputs(model.config, 1, 8, device)
            function = timing.direct_call(_card_of(module), module)
            module_s, direct_s = paired_medians(*_calls(module, function, inputs), repeats, number)
            note = f"overhead {(module_s - direct_s) * 1e6:.2f} us per call; tensors on {device}"
            rows.append(CallOverheadRow(card.region, direct_s * 1e6, module_s * 1e6, note).csv_row())
    kernelize(model, mode=Mode.INFERENCE, device="cpu")
    return rows


@dataclass
class Step:
    """One op call of a recorded call.

    It holds the op (an aten overload, or the stand-in of a fused torch_npu op), its arguments and what it returned."""

    op: Callable
    args: tuple
    kwargs: dict
    out: Any

    @property
    def name(self) -> str:
        """The op's name: the aten op's ("mm"), or the fused op's ("npu_rms_norm")."""
        if isinstance(self.op, torch._ops.OpOverload):
            return self.op.overloadpacket.__name__
        return getattr(self.op, "__name__", "op")

    @property
    def launches(self) -> bool:
        """Return whether the op launches a kernel on the device.

        It does if it is a fused op, or an aten op that is no view, metadata or allocation (`accounting`; a composite op
        that reaches the dispatcher whole counts once)."""
        if not isinstance(self.op, torch._ops.OpOverload):
            return True
        return _aten_bytes(self.op, self.args, self.kwargs, self.out) is not None


class OpTape(TorchDispatchMode):
    """Records the op calls of a call, then stands in for them.

    Replayed, each op returns what it returned when recorded and computes nothing, so that timing the call times its
    Python only.

    Inside `OpTape.stubbing(torch_npu, names)`, the fused ops `names` of the torch_npu module are replaced by stand-ins
    (recorded as one op each, their insides not run); the aten ops reach the mode. `record()` then the call records
    it; `replay()` switches to stubs; `rewind()` before each replayed call. A replay that calls another op than the
    recording did at that point raises: the call's ops must not depend on anything but its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[Step] = []
        self.recording = True
        self.position = 0

    def record(self) -> None:
        """Forget what was recorded; record the next calls."""
        self.steps, self.recording, self.position = [], True, 0

    def replay(self) -> None:
        """Stub the ops from now on, from the first recorded one."""
        self.recording, self.position = False, 0

    def rewind(self) -> None:
        """The next op is the first recorded one again (before each replayed call)."""
        self.position = 0

    def _next(self, op: Callable) -> Any:
        step = self.steps[self.position]
        self.position += 1
        if step.op is not op:
            raise RuntimeError(f"replayed call ran {op} where the recorded call ran {step.op}")
        return step.out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.recording:
            out = func(*args, **kwargs)
            self.steps.append(Step(func, args, kwargs, out))
            return out
        out = self._next(func)
        # A view returns a new tensor each time (autograd marks it as a view of its base once): a fresh alias.
        if not func.is_view:
            return out
        return tuple(map(_fresh_alias, out)) if isinstance(out, (tuple, list)) else _fresh_alias(out)

    def fused(self, original: Callable) -> Callable:
        """The stand-in of a fused op: recorded as one op (run whole, not through the mode), replayed as a stub."""

        def op(*args, **kwargs):
            if not self.recording:
                return self._next(op)
            with _disable_current_modes():
                out = original(*args, **kwargs)
            self.steps.append(Step(op, args, kwargs, out))
            return out

        op.__name__ = getattr(original, "__name__", "fused op")
        return op

    @contextlib.contextmanager
    def stubbing(self, owner: ModuleType | None, names: Iterable[str]) -> Iterator[OpTape]:
        """Make this tape's stand-ins the fused ops `names` of `owner`, and the tape the dispatch mode, inside.

        `owner` is the torch_npu module (None: none)."""
        originals = {name: getattr(owner, name) for name in names if hasattr(owner, name)} if owner else {}
        try:
            for name, original in originals.items():
                setattr(owner, name, self.fused(original))
            with self:
                yield self
        finally:
            for name, original in originals.items():
                setattr(owner, name, original)


def _fresh_alias(t: Any) -> Any:
    """Return a new tensor object over t's data, without autograd metadata.

    This is a replayed view's output. Return t itself if it is no tensor or an inference tensor."""
    if not isinstance(t, torch.Tensor) or t.is_inference():  # autograd tracks no view of an inference tensor
        return t
    with torch.inference_mode(False):  # a normal tensor's alias: autograd shares its version counter
        if not hasattr(t, "_cpu"):
            return t.detach()
        # an emulated npu tensor: a new wrapper of the same host data
        alias = torch.Tensor._make_wrapper_subclass(
            type(t), t.shape, strides=t.stride(), storage_offset=t.storage_offset(), dtype=t.dtype, device=t.device
        )
        alias._cpu = t._cpu
        return alias


class BareCall(nn.Module):
    """A bare module call: an nn.Module that issues the op calls of a recorded call and does nothing else.

    An nn.Module whose forward issues the op calls of a recorded call, in order (the same arguments, the same
    stand-ins), and does nothing else. Timed under the tape's replay, it is the least a module call running those ops
    costs on the host."""

    def __init__(self, steps: list[Step]) -> None:
        super().__init__()
        self.calls = [(step.op, step.args, step.kwargs) for step in steps]

    def forward(self, *inputs: Any) -> Any:
        out = None
        for op, args, kwargs in self.calls:
            out = op(*args, **kwargs)
        return out


def ratio_to_bare(call_s: float, bare_s: float) -> float:
    """The host cost of a call as a multiple of a bare module call's: call_s / bare_s (both positive)."""
    if call_s <= 0 or bare_s <= 0:
        raise ValueError(f"times must be positive, got call {call_s} s and bare {bare_s} s")
    return call_s / bare_s


def host_cost(
    module: Callable, inputs: tuple, tape: OpTape, repeats: int, number: int, measure: Callable = paired_medians
) -> tuple[float, float, list[Step]]:
    """Time `module(*inputs)` and a bare module call with the same ops under `tape`'s replay.

    Return (seconds per call of `module(*inputs)`, of a bare module call with the same ops, the recorded ops): both
    timed under `tape`'s replay (ops stubbed), interleaved by `measure` (`paired_medians`). Call inside
    `tape.stubbing(...)`."""
    tape.record()
    module(*inputs)
    steps = list(tape.steps)
    bare = BareCall(steps)
    tape.replay()
    for fn in (module, bare):  # each replays the whole tape: the same ops, in the same order
        tape.rewind()
        fn(*inputs)
        if tape.position != len(steps):
            raise RuntimeError(f"{fn} ran {tape.position} of the {len(steps)} recorded op calls")

    def call() -> None:
        tape.rewind()
        module(*inputs)

    def bare_call() -> None:
        tape.rewind()
        bare(*inputs)

    call_s, bare_s = measure(call, bare_call, repeats, number)
    return call_s, bare_s, steps


def host_cost_rows(device: str, repeats: int, number: int, measure: Callable = paired_medians) -> list[Row]:
    """Return the rows of each card's kernelized module's host cost against a bare module call.

    It is measured at decode size (`HOST_COST_SHAPE`, bfloat16, inference mode), its ops stubbed (`OpTape`), as a ratio
    to a bare module call issuing the same ops (`BareCall`), timed interleaved in one run: each card with a HOST_TIMING
    in its spec, on its region of the first decoder layer of a tiny model of its `model` type; subclasses'
    torch-function off, as for torch_npu's plain tensors (the module's docstring)."""
    from kernels import Mode, kernelize

    batch, seq = HOST_COST_SHAPE
    timings = with_piece("HOST_TIMING")
    rows = []
    for model_type in dict.fromkeys(timing.model for _, timing in timings):
        model = tiny_causal_lm(model_type, num_hidden_layers=1).to(device=device, dtype=DTYPE)
        kernelize(model, mode=Mode.INFERENCE, device="npu")
        layer = model.model.layers[0]
        try:
            with torch.inference_mode(), torch._C.DisableTorchFunctionSubclass():
                for card, timing in ((c, t) for c, t in timings if t.model == model_type):
                    module = timing.region(layer)
                    inputs = tuple(
                        t.to(DTYPE) if t.is_floating_point() else t
                        for t in timing.inputs(model.config, batch, seq, device)
                    )
                    tape = OpTape()
                    with tape.stubbing(sys.modules.get("torch_npu"), fused_ops()):
                        call_s, bare_s, steps = host_cost(module, inputs, tape, repeats, number, measure)
                    rows.append(host_cost_row(card.region, call_s, bare_s, steps, device, repeats, number).csv_row())
        finally:
            kernelize(model, mode=Mode.INFERENCE, device="cpu")
    return rows


def direct_calls() -> list[tuple[Any, Any]]:
    """(card, HostTiming) of the cards whose HOST_TIMING has a direct_call (on a Llama layer: the spec check)."""
    return [(card, timing) for card, timing in with_piece("HOST_TIMING") if timing.direct_call is not None]


@dataclass(frozen=True)
class HostCostRow:
    """A card's kernelized module against a bare module call issuing the same ops, ops stubbed (`host_cost_rows`)."""

    region: str  # the card's region kind
    bare_us: float  # the bare module call
    call_us: float  # the kernelized module's call
    note: str

    @property
    def ratio(self) -> float:
        """The call's host cost as a multiple of the bare call's (`ratio_to_bare`)."""
        return ratio_to_bare(self.call_us, self.bare_us)

    def csv_row(self) -> Row:
        """Return its line of bench.csv: the bare call in the eager column, the module's call in the kernelized one."""
        batch, seq = HOST_COST_SHAPE
        return Row(
            "timed", "tiny, bfloat16, decode", f"{self.region}: kernelized module vs a bare call", "host", batch, seq,
            eager=self.bare_us, kernelized=self.call_us, unit="us", target=f"<= {HOST_COST_BOUND:g} x a bare call",
            note=self.note, study=HOST_COST_STUDY, kind=self.region,
        )  # fmt: skip

    @classmethod
    def of(cls, row: Row) -> HostCostRow:
        """The host cost row a line of bench.csv holds (what `csv_row` wrote)."""
        return cls(region=row.kind, bare_us=row.eager, call_us=row.kernelized, note=row.note)


def host_cost_row(
    kind: str, call_s: float, bare_s: float, steps: list[Step], device: str, repeats: int, number: int
) -> HostCostRow:
    """Return the timed row of a card's host cost: the module's call against a bare call, in us.

    The note names the recorded ops and what the card's Python adds to the bare call."""
    ratio = ratio_to_bare(call_s, bare_s)
    launches = [step.name for step in steps if step.launches]
    extra_us = (call_s - bare_s) * 1e6
    note = (
        f"{ratio:.2f} x a bare call; op calls stubbed: {len(steps)}, of which {len(launches)} launch kernels "
        f"({', '.join(launches)}); the card's Python "
        f"beyond the bare call {extra_us:.1f} us per call ({extra_us / (HOST_PER_OP.value * 1e6):.2f} of one op's "
        f"modelled host cost); interleaved, median of {repeats} x {number}; tensors on {device}"
    )
    return HostCostRow(kind, bare_s * 1e6, call_s * 1e6, note)


def get_kernel_rows(build: Path, org: str, cold_repeats: int, warm_repeats: int, emulated: bool) -> list[Row]:
    """get_kernel of every built card from an offline Hub cache: cold (in a fresh process) and warm (loaded)."""
    from kernels import get_kernel

    from npu_hub_kernels.offline import card_version, default_cache_dir, seed_offline_cache

    versions = {repo: card_version(build / repo.split("/")[1]) for repo in seed_offline_cache(build, org)}
    code = "\n".join(
        [
            "import time",
            "from npu_hub_kernels.testing import emulation; emulation.install()" if emulated else "",
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
            unit="ms", note=note.format(cold_repeats) + whole, study="get_kernel"),
        Row("timed", config, "get_kernel, warm (loaded)", "host", kernelized=warm * 1e3, unit="ms",
            note=note.format(warm_repeats), study="get_kernel"),
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
    """Return the rows timing the torch-universal build on CPU tensors against transformers' eager forward.

    Timed (float32, no module call overhead on either side: the class forward against the card function), for each card
    whose HOST_TIMING has a direct_call, on its region of a Llama decoder layer."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    batch, seq, hidden, heads, inner = (2, 64, 256, 4, 512) if quick else (4, 512, 2048, 32, 5632)
    config = AutoConfig.for_model(
        "llama", hidden_size=hidden, intermediate_size=inner, num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1), head_dim=128,
    )  # fmt: skip
    layer = LlamaDecoderLayer(config, layer_idx=0)
    timings = direct_calls()
    universal = {card.repo_name: load_variant(build / card.repo_name, "torch-universal") for card, _ in timings}
    rows = []
    with torch.no_grad():
        for card, timing in timings:
            module = timing.region(layer)
            inputs = timing.inputs(config, batch, seq, "cpu")
            function = timing.direct_call(universal[card.repo_name], module)
            class_forward = MethodType(type(module).forward, module)  # no module call overhead
            eager_s, fallback_s = paired_medians(*_calls(class_forward, function, inputs), repeats, 1)
            rows.append(
                Row(
                    "timed", "CPU, float32", f"{card.region}: torch-universal vs eager", "fwd", batch, seq,
                    eager=eager_s * 1e3, kernelized=fallback_s * 1e3, unit="ms",
                    target=f"<= {FALLBACK_TOLERANCE:g} x eager",
                    note=f"{timing.shapes(module, inputs)}; median of {repeats}", study="fallback", kind=card.region,
                )
            )  # fmt: skip
    return rows


def device_rows(
    specs: Iterable[ModelSpec], shapes: Iterable[tuple[int, int]], device: str, emulated: bool, repeats: int
) -> list[Row]:
    """Return the device-timed rows: eager against kernelized per region kind and per decoder layer.

    Kernelized is the default path; the rows hold forward and forward+backward, synchronised medians, and the decoder
    layer's peak memory where the device reports it."""
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
                    timings[(LAYER, variant, phase)] = time_run(layer, args, kwargs, phase, repeats, emulated)
                    for region in regions:
                        fn, _ = region_call(layer, region, variant)
                        run = time_run(fn, region.args, region.kwargs, phase, repeats, emulated)
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
        lambda: forward_backward(fn, args, kwargs, params, phase, torch.ones_like),
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
    names = {kind: [r.name for r in regions if r.kind == kind] for kind in kinds()}
    names = {kind: members for kind, members in names.items() if members}
    names[LAYER] = [LAYER]
    note = EMULATED if emulated else ""
    rows = []
    for kind, members in names.items():
        for phase in PHASES:

            def ms(variant: str, members=members, phase=phase) -> float:
                return sum(timings[(n, variant, phase)][0] for n in members) * 1e3

            common = dict(
                mode="timed", config=spec.name, phase=phase, batch=batch, seq=seq, study="device", kind=kind,
                model=spec.name, experts=spec.experts, emulated=emulated,
            )  # fmt: skip
            rows.append(Row(op=kind, eager=ms("eager"), kernelized=ms("kernelized"), unit="ms", note=note, **common))
            if kind == LAYER:
                peaks = [timings[(LAYER, v, phase)][1] for v in ("eager", "kernelized")]
                peak_note = note or ("" if None not in peaks else "the device reports no peak memory")
                op = f"{kind} peak memory"
                rows.append(Row(op=op, eager=peaks[0], kernelized=peaks[1], unit="bytes", note=peak_note, **common))
    return rows


def training_rows(device: str, emulated: bool, steps: int) -> list[Row]:
    """Return the rows timing a training step of a small model, eager then kernelized.

    Each row is the median time of a training step (forward, backward, AdamW); kernelized is the default path."""
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
            unit="ms", note=EMULATED if emulated else f"median of {steps} steps", study="training",
            model=spec.name, emulated=emulated,
        )
    ]  # fmt: skip
