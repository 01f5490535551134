"""One call each rule of the constraint ledger accepts and one it refuses, per card: `ledger_cases/<card package>.py`.

Each module's `CASES` maps a rule id (`<op>/<name>`) to `(accepted, refused)`: two functions with no arguments that
call the op (or run its autograd backward). `refused` must break that rule and no rule before it, so the op raises
`DeviceRefusal` naming it; `accepted` must raise nothing. tests/test_ledger.py runs them all.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from npu_hub_kernels.testing import emulation


def npu(*shape: int, dtype: torch.dtype = torch.float32, grad: bool = False) -> torch.Tensor:
    """A random tensor on the emulated npu device (requiring grad when asked)."""
    t = torch.randn(shape, dtype=torch.float32).to(dtype).to("npu")
    return t.requires_grad_() if grad else t


def npu_int(high: int, *shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Random integers in [0, high) on the emulated npu device."""
    return torch.randint(0, high, shape, dtype=dtype).to("npu")


@contextmanager
def reporting_cann(version: str | None) -> Iterator[None]:
    """The emulated host reports CANN `version` inside the block (None: leave it as it is)."""
    if version is None:
        yield
        return
    before = torch.version.cann
    emulation.set_cann_version(version)
    try:
        yield
    finally:
        emulation.set_cann_version(before)
