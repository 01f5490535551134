"""Count the device operations of a forward (and backward) and the bytes each one reads and writes.

Used by `make bench` to set eager transformers against the kernelized model and against a floor, for
full-size decoder layers, without computing anything: the model runs on fake tensors
(`torch._subclasses.FakeTensorMode`) that carry shapes, dtypes, strides and the "npu" device of the
emulation, but no data. It lives with the bench, not in the installed package: it relies on private
torch APIs (dispatch keys, the fake-tensor memo, `torch.library` internals), and only the bench and
its tests use it.

What counts as one device operation:
- every aten op that reaches the dispatcher below autograd and would launch a kernel on a device:
  not views and metadata (`view`, `transpose`, `expand`, `detach`, `_unsafe_view`, ...), not bare
  allocations (`empty*`, `new_empty*`); `_local_scalar_dense` (a device-to-host read, e.g. `bool(t)`) counts.
  Composite ops (CompositeImplicitAutograd: `linear`, `reshape`, `contiguous`, `to`, ...) are counted as
  the ops they decompose into, as autograd decomposes them; in `torch.inference_mode()`, where autograd
  is skipped and they would reach the count whole (a `reshape` that copies would pass for a view), they
  are decomposed here;
- every fused op (the torch_npu ops of the emulation, and `F.scaled_dot_product_attention`, which an
  Ascend device runs as one flash-attention kernel) counts ONCE forward and ONCE backward. Their
  internals are never run here: `count_device_ops` swaps each for a stand-in that makes outputs of the
  right shape (`fused_ops()`: the rules of each card's bench spec, and sdpa's), records one op, and, when
  autograd needs it, one `<op>_backward` op. Under `torch.autocast("npu")` a stand-in first casts its operands as
  the npu's autocast casts the op's before its kernel (sdpa's to the autocast dtype, the torch_npu ops' not at all),
  each cast counted as the op it is: the kernel reads what the device's would, at the rate of its operands.

Bytes of an op: the distinct bytes of each tensor it reads plus each tensor it writes (a broadcast
dimension, stride 0, is read once). Gathers (`index`, `index_select`, `gather`, `embedding`) read only
the gathered elements; scatters into a tensor (`index_add_`, `index_put_`, `scatter_add_`, ...) touch
only as many elements as their source holds. An op that overwrites a tensor (`copy_`, `fill_`, `out=`)
does not read it. A fused op reads its tensor inputs and writes its outputs; its backward reads the
output gradients plus what the torch_npu backward kernel reads (`FusedOp.backward_reads`) and writes
the input gradients, in the inputs' dtypes or in float32 where the kernel writes float32
(`FusedOp.float32_grads`): autograd's cast of such a gradient to its input's dtype counts as the op it is.

Routing of MoE layers depends on data, which fake tensors lack: with `experts=E`, data-dependent ops
on fake tensors are answered as balanced routing would answer them (every expert is hit and receives
tokens*top_k/E token copies, at least one: an expert the hit mask names has a copy; scalar reads are 0,
"not the placeholder expert"). Real tensors are never answered: their routing is real.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from npu_hub_kernels.testing.emulation.autocast import autocast_arguments

aten = torch.ops.aten

_NOT_LAUNCHES = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"}
_NOT_LAUNCHES |= {"_unsafe_view", "lift_fresh", "resize_", "set_"}
"""Allocations and metadata changes that schema alias annotations do not mark as views."""
_OVERWRITES = {aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default}
"""In-place ops that write their `self` without reading it."""
_GATHERS = {aten.index.Tensor, aten.index_select.default, aten.gather.default, aten.embedding.default}
_SCATTERS = {
    aten.index_add_.default: ("source", True),
    aten.index_copy_.default: ("source", False),
    aten.index_put_.default: ("values", None),
    aten._index_put_impl_.default: ("values", None),
    aten.scatter_.src: ("src", False),
    aten.scatter_add_.default: ("src", True),
}
"""In-place scatter -> (the argument whose size is the number of elements touched, whether `self` is
also read there; None: read when `accumulate` is set)."""
_NATIVE_ON_NPU = ("silu_backward",)
"""aten ops with a CPU kernel and a torch_npu kernel but none on the emulated device, where autograd would run
their CompositeImplicitAutograd decomposition instead (7 ops for silu_backward) of the one kernel a device
runs. `count_device_ops` registers a kernel for them. Found by counting the eager decoder layers' ops on the
emulated device and on CPU: this is the only one that differs."""
_native: dict[str, Any] = {"depth": 0, "library": None}


def tensor_bytes(t: torch.Tensor) -> int:
    """Distinct bytes of a tensor as an op reads it: broadcast (stride-0) dimensions count once."""
    if t.numel() == 0:
        return 0
    return math.prod(size for size, stride in zip(t.shape, t.stride(), strict=True) if stride != 0) * t.element_size()


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _sum_bytes(value: Any) -> int:
    return sum(tensor_bytes(t) for t in _tensors(value))


@dataclass(frozen=True)
class Memory:
    """Bytes kept for backward at the end of the forward, and the peak of live bytes (how `memory` measures them)."""

    saved_bytes: int
    peak_bytes: int


@dataclass(frozen=True)
class OpRecord:
    """One device operation: its name, the bytes it read and wrote, its matmul FLOPs and the elements it wrote.

    flops: the multiply-adds of a matrix product, counted 2 per multiply-add (`matmul_flops`; fused ops: their
    `FusedOp.flops`); 0 for every other op. elements: the elements of the tensors it wrote (the vector work of an
    elementwise op, one per element). operand_bytes: the element size of a matrix product's operands (2: bfloat16 or
    float16, 4: float32), which sets the cube's rate whatever it writes (a float32 out of 16-bit operands runs at the
    16-bit rate); 0 for an op with no matrix product."""

    name: str
    reads: int
    writes: int
    flops: int = 0
    elements: int = 0
    operand_bytes: int = 0


@dataclass
class Tally:
    """The device operations recorded in a block: how many, and the bytes they read and wrote."""

    records: list[OpRecord] = field(default_factory=list)
    memory: Memory | None = None
    """The block's memory, when measured (`memory.tracking_memory`, forward+backward runs of the counted bench)."""

    def add(
        self, name: str, reads: int, writes: int, flops: int = 0, elements: int = 0, operand_bytes: int = 0
    ) -> None:
        self.records.append(OpRecord(name, reads, writes, flops, elements, operand_bytes))

    @property
    def ops(self) -> int:
        return len(self.records)

    @property
    def bytes(self) -> int:
        return sum(r.reads + r.writes for r in self.records)

    @property
    def flops(self) -> int:
        return sum(r.flops for r in self.records)

    def by_op(self) -> Counter[str]:
        """Op name -> how many times it ran."""
        return Counter(r.name for r in self.records)


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _aten_bytes(func, args: tuple, kwargs: dict, out: Any) -> tuple[int, int] | None:
    """(reads, writes) of an aten op that launches a kernel, None for views, metadata and allocations."""
    if func.namespace != "aten" or func._opname in _NOT_LAUNCHES or _is_view(func):
        return None
    if func is aten._local_scalar_dense.default:
        return args[0].element_size(), 0
    named = {arg.name: value for arg, value in zip(func._schema.arguments, args, strict=False)} | kwargs
    writable = [arg for arg in func._schema.arguments if arg.alias_info is not None and arg.alias_info.is_write]
    written = {arg.name for arg in writable} & named.keys()
    returns = func._schema.returns
    outs = out if len(returns) > 1 else (out,)
    fresh = [t for r, o in zip(returns, outs, strict=False) if r.alias_info is None for t in _tensors(o)]
    if not written and not fresh:
        return None  # asserts and other ops that neither write a tensor nor return one
    if func in _GATHERS:
        reads = _sum_bytes([v for k, v in named.items() if k not in ("self", "weight")]) + _sum_bytes(fresh)
        return reads, _sum_bytes(fresh)
    if func in _SCATTERS:
        source, reads_self = _SCATTERS[func]
        reads_self = named.get("accumulate", False) if reads_self is None else reads_self
        touched = named[source].numel() * named["self"].element_size()
        reads = _sum_bytes([v for k, v in named.items() if k != "self"]) + (touched if reads_self else 0)
        return reads, touched
    overwritten = {arg.name for arg in writable if arg.kwarg_only or func in _OVERWRITES}  # out= and copy_-like
    reads = _sum_bytes([v for k, v in named.items() if k not in overwritten])
    writes = _sum_bytes([named[k] for k in written]) + _sum_bytes(fresh)
    return reads, writes


_MATMULS = {
    "mm": ("self", "mat2"),
    "addmm": ("mat1", "mat2"),
    "addmm_": ("mat1", "mat2"),
    "bmm": ("self", "mat2"),
    "baddbmm": ("batch1", "batch2"),
    "baddbmm_": ("batch1", "batch2"),
    "addbmm": ("batch1", "batch2"),
    "addbmm_": ("batch1", "batch2"),
}
"""The aten matrix products (what composite ops such as linear and matmul decompose into), every overload (in place,
out=), by name -> their two operands."""


def _matmul_operands(func, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The two operands of an aten matrix product (`_MATMULS`), None for any other op."""
    operands = _MATMULS.get(func.overloadpacket.__name__) if func.namespace == "aten" else None
    if operands is None:
        return None
    named = {arg.name: value for arg, value in zip(func._schema.arguments, args, strict=False)} | kwargs
    a, b = (named[name] for name in operands)
    return a, b


def matmul_flops(func, args: tuple, kwargs: dict) -> int:
    """Return the FLOPs of an aten matrix product, 2 x its multiply-adds, and 0 for any other op.

    A product [.., M, K] @ [.., K, N] counts 2 * batch * M * K * N; the bias or accumulator add of addmm and baddbmm is
    not counted."""
    operands = _matmul_operands(func, args, kwargs)
    if operands is None:
        return 0
    a, b = operands
    return 2 * math.prod(a.shape) * b.shape[-1]


def matmul_operand_bytes(func, args: tuple, kwargs: dict) -> int:
    """The element size of an aten matrix product's operands (the wider of the two), 0 for any other op."""
    operands = _matmul_operands(func, args, kwargs)
    return 0 if operands is None else max(t.element_size() for t in operands)


def _written_elements(func, args: tuple, kwargs: dict, out: Any) -> int:
    """The elements of the tensors an aten op writes: its fresh outputs and the arguments it writes in place."""
    named = {arg.name: value for arg, value in zip(func._schema.arguments, args, strict=False)} | kwargs
    writable = [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    written = [named[name] for name in writable if name in named]
    returns = func._schema.returns
    outs = out if len(returns) > 1 else (out,)
    fresh = [t for r, o in zip(returns, outs, strict=False) if r.alias_info is None for t in _tensors(o)]
    return sum(t.numel() for t in _tensors(written) + fresh)


class BalancedRouting:
    """Answers for the data-dependent ops of MoE routing on fake tensors, as balanced routing would give them."""

    def __init__(self, experts: int) -> None:
        self.experts = experts

    def answer(self, func, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """(answered, result) for `func` on these arguments; not answered for real tensors and other ops."""
        x = args[0] if args else None
        if not isinstance(x, FakeTensor):
            return False, None
        if func is aten.nonzero.default:
            # The mask of experts hit ([E] or [E+1]): all E. One expert's [top_k, tokens] mask: its share, and at
            # least one copy, as it is hit (with fewer copies than experts, at decode, a share rounded down to none
            # would have every expert's loop read its weights and multiply no row)
            if x.dim() == 1 and x.numel() in (self.experts, self.experts + 1):
                rows = self.experts
            else:
                rows = max(1, x.numel() // self.experts) if x.numel() else 0
            return True, torch.zeros((rows, x.dim()), dtype=torch.long, device=x.device)
        if func is aten.bincount.default:
            minlength = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            return True, torch.zeros(max(minlength, self.experts), dtype=torch.long, device=x.device)
        if func is aten._local_scalar_dense.default:
            return True, False if x.dtype == torch.bool else 0
        return False, None


_BACKEND_KEYS = {"cpu": "CPU", "npu": "PrivateUse1", "meta": "Meta"}
"""The dispatch key of a device's kernels (the emulated npu device is PrivateUse1)."""


def _decomposes(func, args: tuple, kwargs: dict) -> bool:
    """Return whether autograd would decompose `func` before any kernel runs.

    That is, a CompositeImplicitAutograd op without a kernel of its own for its tensors' devices. Outside inference mode
    such ops never reach the count whole."""
    name = func.name()
    if func.namespace != "aten":
        return False
    if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"):
        return False
    keys = {_BACKEND_KEYS.get(t.device.type, "CPU") for t in _tensors((args, kwargs))}
    return not any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key) for key in keys)


class _Recorder(TorchDispatchMode):
    def __init__(self, tally: Tally, routing: BalancedRouting | None) -> None:
        super().__init__()
        self.tally = tally
        self.routing = routing

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _decomposes(func, args, kwargs):  # only in inference mode: count the ops it is made of
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        answered, out = self.routing.answer(func, args, kwargs) if self.routing else (False, None)
        if not answered:
            out = func(*args, **kwargs)
        counted = _aten_bytes(func, args, kwargs, out)
        if counted is not None:
            flops, elements = matmul_flops(func, args, kwargs), _written_elements(func, args, kwargs, out)
            operand_bytes = matmul_operand_bytes(func, args, kwargs)
            self.tally.add(str(func.overloadpacket.__name__), *counted, flops, elements, operand_bytes)
        return out


def empty_of(like: torch.Tensor, shape=None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty tensor on like's device, of like's shape and dtype unless given (a fused op's output)."""
    return torch.empty(like.shape if shape is None else shape, dtype=dtype or like.dtype, device=like.device)


@dataclass(frozen=True)
class FusedOp:
    """How the accounting sees one fused op.

    outputs: makes empty outputs of the op's shapes and dtypes, structured as the op returns them,
        from its bound arguments.
    grads_for: the arguments its backward gives gradients for (none: the op has no autograd, as
        npu_grouped_matmul on the device).
    backward_reads: what its backward kernel reads besides the output gradients, from the bound
        arguments and the outputs. It is also what the op's autograd node keeps for backward (what stays in
        memory between forward and backward, `memory`), unless `keeps` says otherwise.
    keeps: what the op's autograd node keeps for backward, where that differs from what its backward kernel
        reads (docs/torch-npu-ops.md's table); None: `backward_reads`.
    float32_grads: the arguments (of `grads_for`) whose gradient the backward kernel writes in float32 whatever
        their dtype (npu_rms_norm's dgamma). Autograd casts such a gradient to its argument's dtype, one op of its
        own, which the count records as it records any op autograd runs.
    flops, backward_flops: the matrix-product FLOPs of the op and of its backward kernel (2 per multiply-add), from
        the bound arguments and the outputs; None: 0 (an op with no matrix product).
    """

    outputs: Callable[[dict[str, Any]], Any]
    grads_for: tuple[str, ...] = ()
    backward_reads: Callable[[dict[str, Any], Any], list] = lambda args, out: []
    keeps: Callable[[dict[str, Any], Any], list] | None = None
    float32_grads: tuple[str, ...] = ()
    flops: Callable[[dict[str, Any], Any], int] | None = None
    backward_flops: Callable[[dict[str, Any], Any], int] | None = None

    def kept(self, args: dict[str, Any], out: Any) -> list[torch.Tensor]:
        """The tensors the op's autograd node keeps for backward."""
        return _tensors((self.keeps or self.backward_reads)(args, out))


def _sdpa_outputs(a: dict[str, Any]) -> torch.Tensor:
    q = a["query"]
    return empty_of(q, (*q.shape[:-1], a["value"].shape[-1]))


def _sdpa_signature(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The signature of F.scaled_dot_product_attention (a builtin, which inspect cannot read)."""


def attention_pairs(q_len: int, k_len: int, causal: bool) -> int:
    """Return the (query, key) pairs attention computes per batch and head.

    That is all of them, or with `is_causal` those of torch's causal mask (lower triangle aligned at the top left: query
    i sees keys 0..i)."""
    if not causal:
        return q_len * k_len
    if q_len <= k_len:
        return q_len * (q_len + 1) // 2
    return k_len * (k_len + 1) // 2 + (q_len - k_len) * k_len


def _sdpa_flops(a: dict[str, Any], backward: bool) -> int:
    """Return the FLOPs of flash attention's matrix products per batch and query head.

    They are its products over the pairs it computes (`attention_pairs`): forward S = QK^T and O = PV (2 D_qk + 2 D_v
    per pair); backward recomputes S, then dV = P^T dO, dP = dO V^T, dQ = dS K and dK = dS^T Q (6 D_qk + 4 D_v per
    pair)."""
    q, k, v = a["query"], a["key"], a["value"]
    causal = bool(a["is_causal"]) and a["attn_mask"] is None
    heads = math.prod(q.shape[:-2])
    pairs = attention_pairs(q.shape[-2], k.shape[-2], causal)
    d_qk, d_v = q.shape[-1], v.shape[-1]
    return heads * pairs * ((6 * d_qk + 4 * d_v) if backward else (2 * d_qk + 2 * d_v))


SDPA = "scaled_dot_product_attention"
SDPA_RULE = FusedOp(
    _sdpa_outputs,
    ("query", "key", "value"),
    lambda a, out: [a["query"], a["key"], a["value"], out],
    flops=lambda a, out: _sdpa_flops(a, False),
    backward_flops=lambda a, out: _sdpa_flops(a, True),
)
"""F.scaled_dot_product_attention, which an Ascend device runs as one flash-attention kernel."""


@functools.cache
def fused_ops() -> dict[str, FusedOp]:
    """Return the fused ops `count_device_ops` counts as one op each way, by name.

    They are the torch_npu ops of every card's bench spec (`FUSED_OPS` of scripts/bench/cards/<card>.py), and F.sdpa."""
    from .cards import specs

    return {name: rule for _, spec in specs() for name, rule in spec.FUSED_OPS.items()} | {SDPA: SDPA_RULE}


class _FusedAutograd(torch.autograd.Function):
    """Connects a fused op's outputs to its differentiable inputs; its backward records one op.

    It keeps for backward what the real op keeps (and nothing else, so that `memory` sees what the device would
    hold)."""

    @staticmethod
    def forward(ctx, outputs: tuple, kept: list, on_backward: Callable, *inputs: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.on_backward = on_backward
        ctx.save_for_backward(*kept)
        ctx.mark_non_differentiable(*[t for t in outputs if isinstance(t, torch.Tensor) and not t.is_floating_point()])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        return None, None, None, *ctx.on_backward(grads, ctx.needs_input_grad[3:])


def _counted(name: str, spec: FusedOp, signature: inspect.Signature, tally: Tally) -> Callable:
    """Stand in for a fused op: outputs of the right shapes, one recorded op forward and one backward.

    It sees the operands the device's kernel gets: under `torch.autocast("npu")` it first casts them as the npu's
    autocast policy casts the op's (sdpa's q, k and v to the autocast dtype; the torch_npu ops as they are given), each
    cast an op of its own with its gradient's cast back, as autocast runs them below a real op's call. With autograd
    recording, it keeps the tensors the real op keeps; its backward holds only their sizes otherwise."""

    def op(*args, **kwargs):
        args, kwargs = autocast_arguments(name, args, kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        outputs = spec.outputs(arguments)
        flops = spec.flops(arguments, outputs) if spec.flops else 0
        operand_bytes = _tensors(arguments)[0].element_size() if flops else 0  # its first tensor: x, query
        written = sum(t.numel() for t in _tensors(outputs))
        tally.add(name, _sum_bytes(arguments), _sum_bytes(outputs), flops, written, operand_bytes)
        names = [n for n in spec.grads_for if isinstance(arguments.get(n), torch.Tensor)]
        inputs = [arguments[n] for n in names]
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
            return outputs
        flat, tree = tree_flatten(outputs)
        reads = _sum_bytes(spec.backward_reads(arguments, outputs))
        backward_flops = spec.backward_flops(arguments, outputs) if spec.backward_flops else 0
        layouts = [
            (t.shape, torch.float32 if n in spec.float32_grads else t.dtype, t.device)
            for n, t in zip(names, inputs, strict=True)
        ]

        def on_backward(grads: tuple, needed: tuple[bool, ...]) -> list[torch.Tensor | None]:
            input_grads = [
                torch.empty(shape, dtype=dtype, device=device) if need else None
                for (shape, dtype, device), need in zip(layouts, needed, strict=True)
            ]
            tally.add(
                f"{name}_backward",
                _sum_bytes([g for g in grads if g is not None]) + reads,
                _sum_bytes(input_grads),
                backward_flops,
                sum(g.numel() for g in input_grads if g is not None),
                operand_bytes if backward_flops else 0,
            )
            return input_grads

        kept = spec.kept(arguments, outputs)
        return tree_unflatten(list(_FusedAutograd.apply(tuple(flat), kept, on_backward, *inputs)), tree)

    return op


def _emulated_ops() -> dict[str, Callable]:
    """The emulated ops of the `torch_npu` module (defined in npu_hub_kernels.testing.emulation's op files)."""
    torch_npu = sys.modules.get("torch_npu")
    if torch_npu is None or not getattr(torch_npu, "__emulated__", False):
        raise RuntimeError(
            "count_device_ops needs the torch_npu emulation: call npu_hub_kernels.testing.emulation.install()"
        )
    return {
        name: fn
        for name, fn in vars(torch_npu).items()
        if callable(fn) and getattr(fn, "__module__", "").startswith("npu_hub_kernels.testing.emulation.")
    }


@contextmanager
def count_device_ops(*, experts: int | None = None) -> Iterator[Tally]:
    """Yield a Tally of the device operations run inside the block, forward and backward (see module doc).

    Enter it inside the FakeTensorMode (if any), so that it sees the ops first. `experts`: answer MoE
    routing on fake tensors as balanced routing over that many experts.
    """
    ops = _emulated_ops()
    rules = fused_ops()
    missing = sorted(set(ops) - set(rules))
    if missing:
        raise NotImplementedError(
            f"no accounting rule for torch_npu.{', '.join(missing)}: add it to FUSED_OPS in the bench spec "
            "(scripts/bench/cards/<card>.py) of the card whose emulation module brings it"
        )
    tally = Tally()
    torch_npu = sys.modules["torch_npu"]
    stand_ins = {
        (torch_npu, name): _counted(name, rules[name], inspect.signature(fn), tally) for name, fn in ops.items()
    }
    stand_ins[(F, SDPA)] = _counted(SDPA, rules[SDPA], inspect.signature(_sdpa_signature), tally)
    originals = {key: getattr(*key) for key in stand_ins}
    try:
        _register_native_kernels()
        for (owner, name), stand_in in stand_ins.items():
            setattr(owner, name, stand_in)
        with _Recorder(tally, BalancedRouting(experts) if experts else None):
            yield tally
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
        _release_native_kernels()


def _register_native_kernels() -> None:
    """Give the ops of _NATIVE_ON_NPU a kernel on the emulated device (PrivateUse1) while counting.

    Tensors of the emulation and fake tensors are dispatched in Python before it, so it only keeps autograd from
    decomposing them; it computes on host copies should anything reach it."""
    _native["depth"] += 1
    if _native["library"] is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    for name in _NATIVE_ON_NPU:
        op = getattr(aten, name).default

        def on_host(*args, op=op):
            device = next(t.device for t in args if isinstance(t, torch.Tensor))
            return op(*[t.cpu() if isinstance(t, torch.Tensor) else t for t in args]).to(device)

        library.impl(name, on_host, "PrivateUse1")
    _native["library"] = library


def _release_native_kernels() -> None:
    _native["depth"] -= 1
    if _native["depth"] == 0 and _native["library"] is not None:
        _native["library"]._destroy()  # deregisters the kernels (torch.library has no public way)
        _native["library"] = None


def fake_module(module: nn.Module, fake_mode: FakeTensorMode, device: str | torch.device) -> nn.Module:
    """Give a module built on the meta device fake parameters and buffers on `device`, in place.

    The fake tensors are made directly (not through `fake_mode.from_tensor`)."""
    device = torch.device(device)
    if device.index is None and device.type != "cpu":
        device = torch.device(device.type, 0)
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            raise ValueError(f"fake_module takes a module on the meta device, found a tensor on {t.device}")
        if id(t) not in made:
            made[id(t)] = FakeTensor(fake_mode, t.detach(), device)
            if isinstance(t, nn.Parameter):
                made[id(t)] = nn.Parameter(made[id(t)], requires_grad=t.requires_grad)
        return made[id(t)]

    for m in module.modules():
        for registry in (m._parameters, m._buffers):
            for name, t in registry.items():
                if t is not None:
                    registry[name] = fake(t)
    return module
