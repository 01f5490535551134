"""Input checks shared by the emulated ops, and the call counter that proves an op ran."""

from __future__ import annotations

from collections import Counter

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The floating-point dtypes the emulated fused ops take, as the real ones do."""

OP_CALLS: Counter[str] = Counter()
"""How many times each emulated torch_npu op was called in this process."""


def require_npu(op: str, **tensors: torch.Tensor) -> None:
    """Count the call, then fail like the real op when an input is not on the npu device."""
    OP_CALLS[op] += 1
    for name, t in tensors.items():
        if t.device.type != "npu":
            raise RuntimeError(f"{op}: expected {name} on an npu device, got {t.device}")


def cann_at_least(version: tuple[int, int]) -> bool:
    """Whether the CANN the emulated host reports (`torch.version.cann`, "9.1.0", "8.3.RC1") is `version` or later.

    `version` is (major, minor); `emulation.install(cann_version=...)` and `set_cann_version` set what is reported.
    """
    major, minor = torch.version.cann.split(".")[:2]  # type: ignore[attr-defined]
    return (int(major), int(minor)) >= version
