"""Measure the memory of a forward+backward on fake tensors: the bytes kept for backward and the peak of live bytes.

The model (machine-independent, like the op and byte counts of `accounting`): device memory is the storages that
ops allocate. Inside `tracking_memory()`, a storage that an op returns, that is none of the op's inputs' storages
and that is not already live, is an allocation of its size (`untyped_storage().nbytes()`); it stays live until its
last reference dies (views and in-place results share their base's storage and cost nothing). What exists before
the block (parameters, buffers, the inputs) is the baseline: never counted, neither in the peak nor as saved.

- peak_bytes: the most bytes of live allocations at any moment of the block, checked after every op (when an op's
  inputs and outputs live together), forward and backward. The output gradients and the gradients the backward
  returns (of the inputs and the parameters) count as any allocation.
- saved_bytes (kept for backward): the most bytes, at any moment, of the distinct allocated storages that
  autograd's saved tensors hold (seen with `torch.autograd.graph.saved_tensors_hooks`). Saving happens in the
  forward and the backward releases, so it is what autograd holds at the end of the forward. An input or a
  parameter that an op keeps is not counted: it is baseline, kept regardless.

Fused ops are not run: `accounting.count_device_ops` swaps each for a stand-in that allocates its outputs and keeps
for backward what the real op keeps (`FusedOp.keeps`, docs/torch-npu-ops.md's table), so `measure_memory` runs the
block under it. Allocator effects (caching, fragmentation, alignment, workspaces of a kernel) are not modelled,
nor the softmax statistics that flash attention keeps besides q, k, v and its output (sdpa's stand-in keeps those).

    with fake_mode:
        memory = measure_memory(module, (x,), {}, module.parameters())   # Memory(saved_bytes, peak_bytes)
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .accounting import Memory, count_device_ops
from .regions import forward_backward


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Held:
    """A saved tensor as autograd holds it (the pack hook's result): its death is autograd's release."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class MemoryTracker(TorchDispatchMode):
    """The allocations of the ops run inside it and the saved tensors autograd holds; `memory` reads them.

    A storage's Python object lives exactly as long as the storage (torch preserves it), so a finalizer on it
    says when the storage is freed: the live and saved totals are kept as running sums."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[int, weakref.finalize]] = {}  # storage -> (bytes, its finalizer)
        self.held: Counter[int] = Counter()  # storage -> how many saved tensors autograd holds on it
        self.live_bytes = self.held_bytes = 0
        self.peak = self.saved = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage_key(t) not in inputs and _storage_key(t) not in self.live:
                self._allocated(t.untyped_storage())
        self.peak = max(self.peak, self.live_bytes)
        return out

    def _allocated(self, storage: torch.UntypedStorage) -> None:
        key, size = storage._cdata, storage.nbytes()
        self.live[key] = (size, weakref.finalize(storage, self._freed, key))
        self.live_bytes += size

    def _freed(self, key: int) -> None:
        self.live_bytes -= self.live.pop(key)[0]

    def _pack(self, t: torch.Tensor) -> _Held:
        held = _Held(t)
        key = _storage_key(t)
        if key in self.live:  # allocated in the block, not baseline
            if self.held[key] == 0:
                self.held_bytes += self.live[key][0]
                self.saved = max(self.saved, self.held_bytes)
            self.held[key] += 1
            weakref.finalize(held, self._release, key)
        return held

    def _release(self, key: int) -> None:
        self.held[key] -= 1
        if self.held[key] == 0:
            del self.held[key]
            self.held_bytes -= self.live[key][0]  # held storages are live: the saved tensor keeps them

    def close(self) -> None:
        """Stop watching the storages still live (their finalizers would otherwise outlive the block)."""
        for _, finalizer in self.live.values():
            finalizer.detach()

    @property
    def memory(self) -> Memory:
        return Memory(self.saved, self.peak)


@contextmanager
def tracking_memory() -> Iterator[MemoryTracker]:
    """Track the memory of the block (see the module doc); the tracker's `memory` is final when the block ends.

    Enter it inside the FakeTensorMode (if any) and outside `count_device_ops`, so that it sees the allocations of
    every op that mode and the fused stand-ins run."""
    tracker = MemoryTracker()
    try:
        with tracker, torch.autograd.graph.saved_tensors_hooks(tracker._pack, lambda held: held.tensor):
            yield tracker
    finally:
        tracker.close()


def measure_memory(
    fn: Callable, args: tuple, kwargs: dict, params: Iterable[torch.Tensor], *, experts: int | None = None
) -> Memory:
    """Measure the memory (saved and peak bytes) of fn's forward+backward on fake tensors.

    The backward takes the gradients w.r.t. fn's tensor inputs that require grad and `params`, as the counted bench
    takes them; its fused ops as stand-ins; `experts`: balanced MoE routing on fake tensors (`count_device_ops`). Call
    it inside the FakeTensorMode of fn's tensors."""
    with tracking_memory() as tracker, count_device_ops(experts=experts):
        forward_backward(fn, args, kwargs, params, "fwd+bwd", torch.empty_like)
    return tracker.memory
