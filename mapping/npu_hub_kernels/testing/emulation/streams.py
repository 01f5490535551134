"""Streams, events and allocator statistics of the emulated npu, as DDP, FSDP2 and DeepSpeed's NPU accelerator use them.

The emulated device runs every op synchronously on the host, in program order, on one stream. So:
- `torch.npu.Stream()`, `current_stream()` and `default_stream()` give that one stream (a `torch.Stream` of the
  npu device, so `tensor.record_stream(stream)` accepts it); waiting on a stream or an event returns at once,
  because everything issued before has already run;
- `tensor.record_stream(stream)` does nothing: no op is ever in flight when a buffer is freed;
- `torch.npu.Event` records the host clock, so `elapsed_time` is the wall time between two records, in ms;
- `torch.npu.memory_stats()` is empty: there is no caching allocator (no cached blocks, no allocation retries).

DeepSpeed (deepspeed/accelerator/npu_accelerator.py) treats the npu as an asynchronous device and calls these on
every ZeRO-3 gather, release and reduction; a real torch_npu provides them with the same signatures.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

_PRIVATEUSE1 = 20
"""c10's DeviceType index of PrivateUse1, the backend the emulation names "npu"."""


class Event:
    """`torch.npu.Event`: a point on the host clock (the device is synchronous, so every wait returns at once)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._recorded_at: float | None = None

    def record(self, stream: torch.Stream | None = None) -> None:
        self._recorded_at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Everything issued before the record has run."""

    def wait(self, stream: torch.Stream | None = None) -> None:
        """A stream waiting on this event: it has already happened."""

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds from this event's record to `end_event`'s, as torch_npu gives them."""
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("elapsed_time needs both events recorded (Event.record())")
        return (end_event._recorded_at - self._recorded_at) * 1000.0


class Stream(torch.Stream):
    """`torch.npu.Stream`: the emulated device's one stream, whatever priority is asked for."""

    def __new__(cls, device=None, priority: int = 0, **kwargs) -> Stream:
        return super().__new__(cls, stream_id=0, device_index=0, device_type=_PRIVATEUSE1)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Every op issued on the stream has run."""

    def wait_stream(self, stream: torch.Stream) -> None:
        """Ordering between streams: there is one stream, already in order."""

    def wait_event(self, event: Event) -> None:
        """The event has already happened."""

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event


_THE_STREAM = Stream()


class EmulatedNpuStreams:
    """The stream, event and allocator part of `torch.npu` (mixed into the emulated `torch.npu` module)."""

    Stream = Stream
    Event = Event

    @staticmethod
    def current_stream(device=None) -> Stream:
        return _THE_STREAM

    @staticmethod
    def default_stream(device=None) -> Stream:
        return _THE_STREAM

    @staticmethod
    @contextlib.contextmanager
    def stream(stream: torch.Stream | None) -> Iterator[None]:
        """Ops in the block run on `stream`: the one stream there is."""
        yield

    @staticmethod
    def set_stream(stream: torch.Stream) -> None:
        """Make `stream` current: there is one stream, always current."""

    @staticmethod
    def memory_stats(device=None) -> dict[str, int]:
        """No caching allocator on the emulated device: no statistics."""
        return {}


def record_stream(tensor: torch.Tensor, stream: torch.Stream) -> None:
    """`aten::record_stream` on host data: nothing to defer, no op of the emulated device is ever in flight."""
