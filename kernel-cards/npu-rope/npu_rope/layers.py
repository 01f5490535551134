"""Layers that `kernels.kernelize` swaps into transformers' rotary function-modules.

One layer per rotary style (see `rotary.STYLES`) and call signature: transformers' current
`(q, k, cos, sin, unsqueeze_dim=1)`, or the older `(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)`
whose position_ids is unused. kernels allows a layer no members beyond `forward` and its two flags,
so each layer is made by `_layer`, with the style in the closure.
"""

from __future__ import annotations

import torch
from torch import nn

from .rotary import STYLES, Style, apply_rotary_pos_emb


def _layer(name: str, style: Style, doc: str, with_position_ids: bool = False) -> type[nn.Module]:
    if style not in STYLES:
        raise ValueError(f"unknown rotary style {style!r}")
    if with_position_ids:

        def forward(
            self,
            q: torch.Tensor,
            k: torch.Tensor,
            cos: torch.Tensor,
            sin: torch.Tensor,
            position_ids: torch.Tensor | None = None,
            unsqueeze_dim: int = 1,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, style, module=self)

    else:

        def forward(
            self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, style, module=self)

    # torch.compile of the fused path is not verified on Ascend hardware yet.
    namespace = {"__doc__": doc, "__module__": __name__, "forward": forward, "has_backward": True}
    namespace["can_torch_compile"] = False
    return type(name, (nn.Module,), namespace)


RotaryPosEmb = _layer("RotaryPosEmb", "llama", "apply_rotary_pos_emb as LlamaModel writes it (cos/sin as wide as q/k).")
RotaryPosEmbPartial = _layer(
    "RotaryPosEmbPartial", "llama_partial", "RotaryPosEmb; narrower cos/sin rotate the leading dims (Phi3, GPT-NeoX)."
)
RotaryPosEmbPositionIds = _layer(
    "RotaryPosEmbPositionIds",
    "llama_partial",
    "RotaryPosEmbPartial with the older position_ids argument.",
    with_position_ids=True,
)
RotaryPosEmbCastBack = _layer(
    "RotaryPosEmbCastBack", "cast_back", "As RotaryPosEmb, then cast back to the q/k dtypes (Olmo family)."
)
RotaryPosEmbFloat32 = _layer(
    "RotaryPosEmbFloat32", "float32", "Rotation in float32, cast back once (ESM, ModernBERT, Evolla, HunYuan-VL)."
)
RotaryPosEmbHalfAngles = _layer(
    "RotaryPosEmbHalfAngles", "half_angles", "cos/sin over half the head dim, first/second-half rotation (GPT-OSS)."
)
RotaryPosEmbPairs = _layer("RotaryPosEmbPairs", "pairs", "Interleaved (x[2i], x[2i+1]) pairs, cos/sin as given (BLT).")
RotaryPosEmbPairsPartial = _layer(
    "RotaryPosEmbPairsPartial", "pairs_partial", "RotaryPosEmbPairs; narrower cos/sin rotate the leading dims (Glm4v)."
)
RotaryPosEmbPairsFloat32 = _layer(
    "RotaryPosEmbPairsFloat32", "pairs_float32", "Interleaved pairs in float32, cast back once (Cohere)."
)
RotaryPosEmbPairsHalfAngles = _layer(
    "RotaryPosEmbPairsHalfAngles", "pairs_half_angles", "Interleaved pairs, one cos/sin value per pair."
)
RotaryPosEmbGlm = _layer(
    "RotaryPosEmbGlm", "glm", "Interleaved pairs, first half of cos/sin repeat-interleaved (Helium, PE audio/video)."
)
RotaryPosEmbGlmPartial = _layer(
    "RotaryPosEmbGlmPartial", "glm_partial", "RotaryPosEmbGlm; narrower cos/sin rotate the leading dims (GLM, Glm4)."
)
RotaryPosEmbGlmFloat32 = _layer("RotaryPosEmbGlmFloat32", "glm_float32", "RotaryPosEmbGlm in float32 (Ernie 4.5).")
RotaryPosEmbDeinterleave = _layer(
    "RotaryPosEmbDeinterleave",
    "deinterleave",
    "DeepSeek-V3's apply_rotary_pos_emb_interleave: pairs rotated, written evens then odds.",
    with_position_ids=True,
)
