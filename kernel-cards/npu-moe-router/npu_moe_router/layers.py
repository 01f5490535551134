"""The layers that `kernels.kernelize` swaps into transformers' MoE routers (forward only, no state)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .router import moe_router_top_k


class SoftmaxTopKRouter(nn.Module):
    """Qwen2-MoE style: softmax in float32, top-k, renormalised when `norm_topk_prob`, cast to the logits' dtype."""

    has_backward = True
    # torch.compile of the fused path is not verified on Ascend hardware yet.
    can_torch_compile = False

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        router_logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        weights, ids = moe_router_top_k(
            router_logits, self.top_k, scoring="softmax", renormalize=self.norm_topk_prob, module=self
        )
        return router_logits, weights, ids


class RenormalisedSoftmaxTopKRouter(nn.Module):
    """Qwen3-VL-MoE style: softmax top-k always renormalised, cast to the logits' dtype (the top-k logits' softmax)."""

    has_backward = True
    can_torch_compile = False

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        router_logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        weights, ids = moe_router_top_k(router_logits, self.top_k, scoring="softmax", renormalize=True, module=self)
        return router_logits, weights, ids


class RenormalisedFloat32SoftmaxTopKRouter(nn.Module):
    """Mixtral style: softmax top-k always renormalised, the weights left in float32 (the top-k logits' softmax)."""

    has_backward = True
    can_torch_compile = False

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        router_logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        weights, ids = moe_router_top_k(
            router_logits, self.top_k, scoring="softmax", renormalize=True, cast_weights=False, module=self
        )
        return router_logits, weights, ids


class SigmoidGroupTopKRouter(nn.Module):
    """DeepSeek-V3 style: float32 logits, sigmoid, group top-k on scores + correction bias, renormalised, scaled."""

    has_backward = True
    can_torch_compile = False

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        weights, ids = moe_router_top_k(
            router_logits,
            self.top_k,
            scoring="sigmoid",
            renormalize=self.norm_topk_prob,
            eps=1e-20,
            bias=self.e_score_correction_bias,
            num_groups=self.num_group,
            topk_groups=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            module=self,
        )
        return router_logits, weights, ids
