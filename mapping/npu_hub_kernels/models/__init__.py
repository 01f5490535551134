"""Which transformers classes each card's layers replace: the one place that knows models by class.

One module per card, named after the card's package (`models/<card package>.py`, e.g. `npu_swiglu.py`),
each exporting the same two tables:
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


BY_KERNEL_ID: dict[str, ModuleType] = {kernel_id: table_of(card) for kernel_id, card in CARDS.items()}
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
