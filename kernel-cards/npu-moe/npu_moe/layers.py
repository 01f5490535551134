"""The layer that `kernels.kernelize` swaps into transformers' v5 Experts modules (forward only, no state)."""

from __future__ import annotations

import torch
from torch import nn

from ._fallbacks import ran_eager
from .experts import _following, _ModuleForwardIsEager, swiglu_experts_unavailable_reason


class SwiGLUExperts(nn.Module):
    """Dropless top-k SiLU-gated experts: Qwen2/3-MoE, Mixtral, DeepseekV3, OLMoE, ... (see npu_moe.experts)."""

    has_backward = True
    # torch.compile of the fused path is not verified on Ascend hardware yet.
    can_torch_compile = False

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        reason = swiglu_experts_unavailable_reason(
            hidden_states, top_k_index, self.gate_up_proj, self.down_proj, self.act_fn, top_k_weights=top_k_weights
        )
        own_forward = type(self).forward  # the class's: kernelize sets this layer's forward on the instance only
        if (
            isinstance(reason, _ModuleForwardIsEager)
            and own_forward is not SwiGLUExperts.forward
            and ran_eager(self, reason)
        ):
            # hooks watch act_fn's calls, or torch.func transforms the call: the module's own forward runs exactly as
            # eager (it calls act_fn once, or once per expert with tokens: its experts implementation decides)
            return own_forward(self, hidden_states, top_k_index, top_k_weights)
        args = (hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, self.act_fn)
        return _following(reason, *args, module=self)
