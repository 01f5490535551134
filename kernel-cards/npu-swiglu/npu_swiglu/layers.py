"""Layers that `kernels.kernelize` swaps into transformers' gated MLP modules (forward only, no state).

Each reads the submodules of the MLP it replaces and checks its activation on every call: an MLP whose activation is
not the layer's (SiLU, or GELU-tanh for GeGLUMLP) at runtime (another `hidden_act`, or `act_fn` replaced) runs its
eager math.
"""

from __future__ import annotations

import torch
from torch import nn

from .geglu import geglu_mlp
from .swiglu import activation_of, swiglu_gate_up_mlp, swiglu_mlp


class SwiGLUMLP(nn.Module):
    """`down_proj(act_fn(gate_proj(x)) * up_proj(x))`: Llama, Mistral, Qwen2/3, DeepseekV3, OLMo, Granite, ..."""

    has_backward = True
    # torch.compile of the fused path is not verified on Ascend hardware yet.
    can_torch_compile = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_mlp(x, self.gate_proj, self.up_proj, self.down_proj, activation_of(self), module=self)


class SwiGLUGateUpMLP(nn.Module):
    """`down_proj(up * act(gate))` with `gate, up = gate_up_proj(x).chunk(2, -1)`: Phi3, Glm4, ..."""

    has_backward = True
    can_torch_compile = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return swiglu_gate_up_mlp(hidden_states, self.gate_up_proj, self.down_proj, activation_of(self), module=self)


class GeGLUMLP(nn.Module):
    """`down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))`: Gemma, Gemma 2, Gemma 3, Gemma 4's text MLP, ..."""

    has_backward = True
    can_torch_compile = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return geglu_mlp(x, self.gate_proj, self.up_proj, self.down_proj, activation_of(self), module=self)
