"""What the bench knows about the cards, in one place: the region kind each card fuses, and the card functions
the bench calls directly (per-call overhead, the torch-universal fallback).

The function names are looked up here only (`FUNCTIONS`), so a rename in the cards is a one-line change.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch import nn

from npu_hub_kernels import CARDS

KINDS = {card.repo_name: card.region for card in CARDS.values()}
"""Region kind, by the card that fuses it: the `region` of each card's card.toml."""
CARD_OF = {kind: card for card, kind in KINDS.items()}
LAYER = "decoder layer"
"""The kind of a whole decoder layer's rows."""
NO_CARD = "no card yet"

FUNCTIONS = {
    "RMSNorm": "rms_norm",
    "RoPE": "apply_rotary_pos_emb",
    "SwiGLU MLP": "swiglu_mlp",
}
"""Region kind -> the card package's function that a kernelized module of that kind calls."""


def direct_call(kind: str, card: ModuleType, module: nn.Module | None) -> Callable[..., Any]:
    """The card's function for `kind`, as the card's layer calls it for `module` (a transformers module of that
    kind, or None for the rotary function, which has no state): a callable taking the call's tensors. The function
    is looked up once, here, so that timing the callable times the function, not the lookup."""
    function = getattr(card, FUNCTIONS[kind])
    if kind == "RMSNorm":
        return lambda x: function(x, module.weight, module.variance_epsilon, "plain")
    if kind == "RoPE":
        return lambda q, k, cos, sin: function(q, k, cos, sin, 1, "llama")
    if kind == "SwiGLU MLP":
        return lambda x: function(x, module.gate_proj, module.up_proj, module.down_proj, module.act_fn)
    raise ValueError(f"no direct call for {kind}")
