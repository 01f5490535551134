"""Layers that `kernels.kernelize` swaps into transformers' decoder layers (forward only, no state).

A decoder layer's mid residual add and its `post_attention_layernorm` are two modules' work in one forward, so the
card replaces the forward of the decoder layer: the one forward shared, source for source, by the decoder-layer
classes of the Llama family of transformers 5.22.2 (npu_hub_kernels.models.npu_add_rms_norm lists them). It calls
the layer's own submodules (input_layernorm, self_attn, mlp), so the cards that swap those still run inside it, and
fuses `residual + attention output` with `post_attention_layernorm` through `add_rms_norm`. The final add feeds the
next layer's input_layernorm, beyond this layer's forward: it stays an add.
"""

from __future__ import annotations

import torch
from torch import nn

from ._rms_norm_forms import Scaling
from .add_rms_norm import add_rms_norm


def family(layer: nn.Module) -> str:
    """The modeling file of the layer's transformers class, past the classes torch puts in front of it.

    FSDP2's `fully_shard` makes the module an instance of a subclass it creates.
    """
    return next(cls.__module__ for cls in type(layer).__mro__ if not cls.__module__.startswith("torch."))


def _decoder_layer_forward(
    layer: nn.Module,
    scaling: Scaling,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.LongTensor | None,
    past_key_values,
    use_cache: bool | None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    kwargs: dict,
) -> torch.Tensor:
    """The Llama-family decoder layer, its mid add and post-attention norm through `add_rms_norm`."""
    residual = hidden_states
    hidden_states = layer.input_layernorm(hidden_states)
    hidden_states, _ = layer.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states, residual = add_rms_norm(
        residual, hidden_states, layer.post_attention_layernorm, scaling, family(layer), module=layer
    )
    hidden_states = layer.mlp(hidden_states)
    return residual + hidden_states


class DecoderLayer(nn.Module):
    """Decoder layers whose post-attention norm scales by its weight (LlamaRMSNorm).

    Llama, Mistral, Qwen2/3, Qwen2/3-MoE, DeepseekV3, ...
    """

    has_backward = True
    # torch.compile of the fused path is not verified on Ascend hardware yet.
    can_torch_compile = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        return _decoder_layer_forward(
            self, "plain", hidden_states, attention_mask, position_ids, past_key_values, use_cache,
            position_embeddings, kwargs,
        )  # fmt: skip


class DecoderLayerZeroCentered(nn.Module):
    """Decoder layers whose post-attention norm scales by (1 + weight) in float32 (GemmaRMSNorm): Gemma."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        return _decoder_layer_forward(
            self, "zero_centered", hidden_states, attention_mask, position_ids, past_key_values, use_cache,
            position_embeddings, kwargs,
        )  # fmt: skip


class DecoderLayerFloat32Scale(nn.Module):
    """Decoder layers whose post-attention norm scales by its weight in float32 (HeliumRMSNorm): Helium, Flint."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        return _decoder_layer_forward(
            self, "float32_scale", hidden_states, attention_mask, position_ids, past_key_values, use_cache,
            position_embeddings, kwargs,
        )  # fmt: skip
