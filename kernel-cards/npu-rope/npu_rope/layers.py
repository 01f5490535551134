"""Layers that `kernels.kernelize` swaps into transformers' apply_rotary_pos_emb function-modules.

One layer per way transformers writes the function (see `rotary.Style`); all share its signature
`(q, k, cos, sin, unsqueeze_dim=1)`. kernels allows a layer no members beyond `forward` and its two
flags, so each layer is made by `_layer`, with the style in the closure.
"""

from __future__ import annotations

import torch
from torch import nn

from .rotary import Style, apply_rotary_pos_emb


def _layer(name: str, style: Style, doc: str) -> type[nn.Module]:
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, style)

    # torch.compile of the fused path is not verified on Ascend hardware yet.
    namespace = {"__doc__": doc, "__module__": __name__, "forward": forward, "has_backward": True}
    namespace["can_torch_compile"] = False
    return type(name, (nn.Module,), namespace)


RotaryPosEmb = _layer("RotaryPosEmb", "llama", "apply_rotary_pos_emb as LlamaModel writes it.")
RotaryPosEmbCastBack = _layer(
    "RotaryPosEmbCastBack", "cast_back", "As RotaryPosEmb, then cast back to the q/k dtypes (Olmo family)."
)
RotaryPosEmbFloat32 = _layer(
    "RotaryPosEmbFloat32", "float32", "Rotation in float32, cast back once (ESM, ModernBERT, Evolla, HunYuan-VL)."
)
RotaryPosEmbHalfAngles = _layer(
    "RotaryPosEmbHalfAngles", "half_angles", "cos/sin over half the head dim, first/second-half rotation (GPT-OSS)."
)
