"""The layer `kernels.kernelize` swaps into transformers' apply_rotary_pos_emb function-modules."""

from __future__ import annotations

import torch
from torch import nn

from .rotary import apply_rotary_pos_emb


class RotaryPosEmb(nn.Module):
    """`apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)` with the rotate_half convention."""

    has_backward = True
    # torch.compile of the fused path is not verified on Ascend hardware yet.
    can_torch_compile = False

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
