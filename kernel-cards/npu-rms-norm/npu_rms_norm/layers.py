"""Layers that `kernels.kernelize` swaps into transformers' norm modules (forward only, no state).

Each reads the parameters of the module it replaces: `weight` and `variance_epsilon` or `eps`. Each forward is marked
as computing its norm class's forward (`computes_the_norm_forward`): npu-add-rms-norm, which reads the weight of a
decoder layer's post-attention norm instead of calling it, still fuses when kernelize bound this forward on the norm.
"""

from __future__ import annotations

import torch
from torch import nn

from ._internals import weight_of
from ._rms_norm_forms import computes_the_norm_forward, epsilon_of
from .rms_norm import rms_norm


class RMSNorm(nn.Module):
    """`weight * normalize(x).to(dtype)`: Llama, Mistral, Qwen2/3 (and their q/k norms), DeepseekV3, Phi3, Glm4, ..."""

    has_backward = True
    # torch.compile of the fused path is not verified on Ascend hardware yet.
    can_torch_compile = False

    @computes_the_norm_forward
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, weight_of(self), epsilon_of(self), "plain", module=self)


class RMSNormZeroCentered(nn.Module):
    """`(normalize(x) * (1 + weight)).to(dtype)` in float32: Gemma, Gemma2, Gemma3, Qwen3-Next, Qwen3.5, ..."""

    has_backward = True
    can_torch_compile = False

    @computes_the_norm_forward
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, weight_of(self), epsilon_of(self), "zero_centered", module=self)


class RMSNormFloat32Scale(nn.Module):
    """`(weight.float() * normalize(x)).to(dtype)`: Olmo2, Olmo3, GptOss, DeepseekV4, NemotronH, ..."""

    has_backward = True
    can_torch_compile = False

    @computes_the_norm_forward
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, weight_of(self), epsilon_of(self), "float32_scale", module=self)
