"""Which transformers classes each card's layers replace: the one place that knows models by class.

One module per card, each exporting the same two tables:
- `SWAPPED`: layer -> the class paths (or, for npu-rope, the rotary function paths) it replaces,
  each listed only because the layer computes exactly what that forward computes;
- `LEFT_OUT`: path -> why no layer reproduces it (it is never swapped).

Paths are relative to `transformers.models` (`<model>.<modeling file>.<class or function>`),
checked against transformers 5.22.2. tests/test_models_table.py re-proves every listed path and
that every candidate class of transformers is decided (listed or left out).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from . import moe, npu_moe_router, rms_norm, rope, swiglu

BY_KERNEL_ID: dict[str, ModuleType] = {
    "npu_fused_rmsnorm": rms_norm,
    "npu_fused_rope": rope,
    "npu_fused_swiglu": swiglu,
    "npu_fused_moe": moe,
    "npu_fused_moe_router": npu_moe_router,
}
"""Kernel id -> the module of its tables."""


@dataclass(frozen=True)
class ClassRule:
    """A transformers class (or function-module: its class) whose forward a card layer replaces."""

    path: str
    layer: str

    @property
    def module(self) -> str:
        return "transformers.models." + self.path.rpartition(".")[0]

    @property
    def class_name(self) -> str:
        return self.path.rpartition(".")[2]


MODEL_CLASSES: dict[str, list[ClassRule]] = {
    kernel_id: [ClassRule(path, layer) for layer, paths in tables.SWAPPED.items() for path in paths]
    for kernel_id, tables in BY_KERNEL_ID.items()
}
"""Kernel id -> the classes its layers replace."""
