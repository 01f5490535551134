"""Which transformers classes each card's layers replace: the one place that knows models by class.

One module per card, named after the card's package (`models/<card package>.py`, e.g. `npu_swiglu.py`),
each exporting the same two tables:
- `SWAPPED`: layer -> the class paths (or, for npu-rope, the rotary function paths) it replaces,
  each listed only because the layer computes exactly what that forward computes;
- `LEFT_OUT`: path -> why no layer reproduces it (it is never swapped).

Paths are relative to `transformers.models` (`<model>.<modeling file>.<class or function>`),
surveyed against transformers 5.22.2. An attention card's table has no `SWAPPED` classes but a `FUSED`
tuple: the attention classes whose calls it fuses. The parity tests (marker `model_tables`) re-prove every listed
path (`PROVEN_CLASSES`) on each release the package admits, and `models.fingerprints` swaps an installed class (or
lets `apply_npu_kernels` pick an attention card for it) only when its code is code they proved;
tests/test_model_tables.py checks that every candidate class is decided.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from ..cards import CARDS, Card, card_piece


def table_of(card: Card) -> ModuleType:
    """The module of a card's tables, `models/<card package>.py`.

    Raises:
        ModuleNotFoundError: the card has no table module yet, saying which file to add.
    """
    table = card_piece(__name__, card)
    if table is None:
        raise ModuleNotFoundError(
            f"card {card.repo_name} has no model table: add mapping/npu_hub_kernels/models/{card.python_name}.py "
            "with SWAPPED and LEFT_OUT (CONTRIBUTING.md)",
            name=f"{__name__}.{card.python_name}",
        )
    return table


SURVEYED_RELEASE = "5.22.2"
"""The transformers release every table's `candidates()` was surveyed against (tests/test_model_tables.py)."""

BY_KERNEL_ID: dict[str, ModuleType] = {kernel_id: table_of(card) for kernel_id, card in CARDS.items()}
"""Kernel id -> the module of its tables."""


@dataclass(frozen=True)
class ClassRule:
    """A transformers class (or function-module: its class) whose forward a card layer replaces."""

    path: str
    layer: str
    kernel_id: str

    @property
    def module(self) -> str:
        return "transformers.models." + self.path.rpartition(".")[0]

    @property
    def class_name(self) -> str:
        return self.path.rpartition(".")[2]

    def installed(self) -> object | None:
        """The rule's class (or rotary function global) in the installed transformers; None when it lacks it."""
        try:
            return getattr(importlib.import_module(self.module), self.class_name, None)
        except ImportError:
            return None


MODEL_CLASSES: dict[str, list[ClassRule]] = {
    kernel_id: [ClassRule(path, layer, kernel_id) for layer, paths in tables.SWAPPED.items() for path in paths]
    for kernel_id, tables in BY_KERNEL_ID.items()
}
"""Kernel id -> the classes its layers replace."""

ATTENTION_FUNCTION = "fused_attention"
"""An attention card's function (its package's export), which its `FUSED` classes' rules name for a layer."""

FUSED_CLASSES: dict[str, list[ClassRule]] = {
    kernel_id: [ClassRule(path, ATTENTION_FUNCTION, kernel_id) for path in tables.FUSED]
    for kernel_id, tables in BY_KERNEL_ID.items()
    if hasattr(tables, "FUSED")
}
"""Kernel id -> the attention classes an attention card fuses (no layer swaps them: the model's attention function
is the card's, chosen per model, `npu_hub_kernels.attention`)."""

PROVEN_CLASSES: dict[str, list[ClassRule]] = {
    kernel_id: [*rules, *FUSED_CLASSES.get(kernel_id, [])] for kernel_id, rules in MODEL_CLASSES.items()
}
"""Kernel id -> every class its table lists, swapped or fused: the classes whose code the parity tests prove on each
transformers release (`models.fingerprints`)."""
