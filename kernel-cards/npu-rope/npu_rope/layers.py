"""The layer `kernels.kernelize` swaps into transformers' apply_rotary_pos_emb function-modules."""

from __future__ import annotations

import torch
from torch import nn

from .rotary import apply_rotary_pos_emb


class RotaryPosEmb(nn.Module):
    """`apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)` as LlamaModel writes it."""

    has_backward = True
    # torch.compile of the fused path is not verified on Ascend hardware yet.
    can_torch_compile = False

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, "llama")


class RotaryPosEmbCastBack(nn.Module):
    """As RotaryPosEmb, then cast back to the q/k dtypes (Olmo, Olmo2, Olmo3, FlexOlmo)."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, "cast_back")


class RotaryPosEmbFloat32(nn.Module):
    """Rotation in float32, cast back once (ESM, ModernBERT, Evolla, HunYuan-VL)."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, "float32")


class RotaryPosEmbHalfAngles(nn.Module):
    """cos/sin over half the head dim, first/second-half rotation (GPT-OSS)."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, "half_angles")
