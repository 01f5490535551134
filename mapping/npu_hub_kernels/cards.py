"""The kernel cards, by kernel id: which Hub repository holds each one and which layers it offers.

Kernel ids follow LLaMA-Factory's NPU kernel plugins (`npu_fused_rmsnorm`, ...). Each card's source
is kernel-cards/<repo_name>/ (its card.toml must agree with this table: a test checks it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_ORG = "npu-hub-kernels"
ORG_ENV = "NPU_HUB_KERNELS_ORG"
"""Environment variable naming the Hub organisation the cards are loaded from."""


@dataclass(frozen=True)
class Card:
    kernel_id: str
    repo_name: str
    layers: tuple[str, ...]

    def repo_id(self, org: str) -> str:
        return f"{org}/{self.repo_name}"

    def mapping_name(self, layer: str) -> str:
        """The kernels-mapping key of one of this card's layers.

        Namespaced so that transformers' own mapping (which re-registers "RMSNorm" on every
        `use_kernels` load and train()/eval() switch) can never overwrite it.
        """
        return f"{self.repo_name}:{layer}"


CARDS: dict[str, Card] = {
    card.kernel_id: card
    for card in (
        Card("npu_fused_rmsnorm", "npu-rms-norm", ("RMSNorm", "RMSNormZeroCentered", "RMSNormFloat32Scale")),
        Card(
            "npu_fused_rope",
            "npu-rope",
            (
                "RotaryPosEmb",
                "RotaryPosEmbPositionIds",
                "RotaryPosEmbCastBack",
                "RotaryPosEmbFloat32",
                "RotaryPosEmbHalfAngles",
                "RotaryPosEmbPairs",
                "RotaryPosEmbPairsFloat32",
                "RotaryPosEmbPairsHalfAngles",
                "RotaryPosEmbGlm",
                "RotaryPosEmbGlmFloat32",
                "RotaryPosEmbDeinterleave",
            ),
        ),
        Card("npu_fused_swiglu", "npu-swiglu", ("SwiGLUMLP", "SwiGLUFusedMLP")),
        Card("npu_fused_moe", "npu-moe", ("SwiGLUExperts",)),
    )
}


def resolve_org(org: str | None) -> str:
    """The argument, else $NPU_HUB_KERNELS_ORG, else the default organisation."""
    return org or os.environ.get(ORG_ENV) or DEFAULT_ORG
