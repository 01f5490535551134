"""The kernel cards, by kernel id, read from each card's own `kernel-cards/<card>/card.toml`.

card.toml is the one place a card is declared: its Hub repository name, kernel id (after LLaMA-Factory's
NPU kernel plugins: `npu_fused_rmsnorm`, ...), API version, layers, the region of a decoder layer it
fuses (as `make bench` names it), the torch_npu ops its package calls, the layers that DeepSpeed
ZeRO-3 must treat as leaf modules and the files of `kernel-cards/shared/` its package imports. The
build, the mapping, the publisher and the bench all read it from here; the card's other pieces are
found by its package name (CONTRIBUTING.md lists them, tests/test_card_pieces.py holds every card to
them). Installed, the card.toml files are the package data of `npu_hub_kernels.card_configs` (see pyproject.toml).
"""

from __future__ import annotations

import importlib
import importlib.resources
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from huggingface_hub.utils import HFValidationError, validate_repo_id

DEFAULT_ORG = "npu-hub-kernels"
ORG_ENV = "NPU_HUB_KERNELS_ORG"
"""Environment variable naming the Hub organisation the cards are loaded from."""


REQUIRED_KEYS = frozenset(
    {"name", "kernel_id", "version", "license", "description", "layers", "region", "fused_ops", "tags"}
)
OPTIONAL_KEYS = frozenset({"shared", "zero3_leaf_layers", "sequence_tiled_layers"})


@dataclass(frozen=True)
class Card:
    """One card, as its card.toml declares it."""

    kernel_id: str
    repo_name: str
    layers: tuple[str, ...]
    region: str
    fused_ops: tuple[str, ...]
    shared: tuple[str, ...]
    version: int
    license: str
    description: str
    tags: tuple[str, ...]
    zero3_leaf_layers: tuple[str, ...]
    sequence_tiled_layers: tuple[str, ...]

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str = "card.toml") -> Card:
        """Parse a card.toml's contents; `source` names it in errors."""
        missing = REQUIRED_KEYS - set(config)
        if missing:
            raise ValueError(f"{source} misses {', '.join(sorted(missing))}")
        unknown = set(config) - REQUIRED_KEYS - OPTIONAL_KEYS
        if unknown:
            raise ValueError(f"{source} has unknown keys {', '.join(sorted(unknown))} (misspelt?)")
        for key in ("zero3_leaf_layers", "sequence_tiled_layers"):
            stray = set(config.get(key, ())) - set(config["layers"])
            if stray:
                raise ValueError(f"{source}: {key} names {', '.join(sorted(stray))}, not among its layers")
        return cls(
            kernel_id=config["kernel_id"],
            repo_name=config["name"],
            layers=tuple(config["layers"]),
            region=config["region"],
            fused_ops=tuple(config["fused_ops"]),
            shared=tuple(config.get("shared", ())),
            version=int(config["version"]),
            license=config["license"],
            description=config["description"],
            tags=tuple(config["tags"]),
            zero3_leaf_layers=tuple(config.get("zero3_leaf_layers", ())),
            sequence_tiled_layers=tuple(config.get("sequence_tiled_layers", ())),
        )

    @classmethod
    def from_file(cls, path: Path) -> Card:
        return cls.from_config(tomllib.loads(path.read_text()), str(path))

    @property
    def python_name(self) -> str:
        """The card's package name: its repo name with "-" as "_"."""
        return self.repo_name.replace("-", "_")

    def repo_id(self, org: str) -> str:
        return f"{org}/{self.repo_name}"

    def mapping_name(self, layer: str) -> str:
        """The kernels-mapping key of one of this card's layers.

        Namespaced so that transformers' own mapping (which re-registers "RMSNorm" on every
        `use_kernels` load and train()/eval() switch) can never overwrite it.
        """
        return f"{self.repo_name}:{layer}"


def _load_cards() -> dict[str, Card]:
    root = importlib.resources.files("npu_hub_kernels.card_configs")
    configs = sorted((entry.name, entry / "card.toml") for entry in root.iterdir() if (entry / "card.toml").is_file())
    cards = [Card.from_config(tomllib.loads(config.read_text()), f"{name}/card.toml") for name, config in configs]
    return {card.kernel_id: card for card in cards}


CARDS: dict[str, Card] = _load_cards()
"""Kernel id -> card, in the order of the cards' names."""


def card_piece(package: str, card: Card) -> ModuleType | None:
    """The card's module `<package>.<card package name>`, or None when that module does not exist.

    It is a piece found by the card's name; an import error inside it propagates.
    """
    name = f"{package}.{card.python_name}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:
            raise
        return None


def resolve_org(org: str | None) -> str:
    """The argument, else $NPU_HUB_KERNELS_ORG (when set and not empty), else the default organisation.

    Raises ValueError, saying what a Hub organisation name takes, for a malformed one (an empty argument
    included: it does not mean the default).
    """
    if org is None:
        org = os.environ.get(ORG_ENV) or DEFAULT_ORG
        source = f"{ORG_ENV}=" if org != DEFAULT_ORG else ""
    else:
        source = "org="
    problem = org_name_problem(org)
    if problem:
        raise ValueError(source + problem)
    return org


def org_name_problem(org: object) -> str | None:
    """Why `org` cannot name a Hub organisation (huggingface_hub's own repo id rule), or None."""
    if not isinstance(org, str):
        return f"{org!r} is not a Hub organisation name: pass a string"
    try:
        validate_repo_id(f"{org}/{next(iter(CARDS.values())).repo_name}")
    except HFValidationError as error:
        return (
            f"{org!r} is not a Hub organisation name: it takes letters, digits, '-', '_' and '.', neither starts nor "
            f"ends with '-' or '.', and has no '/', '--' or '..' (huggingface_hub: {error})"
        )
    return None


def version_problem(version: object) -> str | None:
    """Why `version` is not a card API version (a whole number from 1, the Hub branch v<N>), or None."""
    if isinstance(version, bool) or not isinstance(version, int):
        return f"{version!r} is not a card version: a whole number from 1 (the Hub branch v<N>)"
    if version < 1:
        return f"{version} is not a card version: versions start at 1 (the Hub branch v1)"
    return None
