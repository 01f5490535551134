"""The models whose decoder layers are measured, and the shapes they are measured at."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from npu_hub_kernels.testing.tiny_models import tiny_config_values

ROOT = Path(__file__).resolve().parents[2]
"""The repository."""
DTYPE = torch.bfloat16
PHASES = ("fwd", "fwd+bwd")
"""fwd: forward in `torch.inference_mode()` (inference); fwd+bwd: forward and backward with grad (training)."""
SHAPES = ((1, 1), (1, 512), (1, 4096), (8, 512), (8, 4096))
"""(batch, sequence) of the counted layers; (1, 1) is one decode step's token."""
QUICK_SHAPES = ((1, 512),)
PREFILL_DECODE = ((1, 4096), (1, 1))
"""The shapes of the per-MLP table: prefill and one decode step."""


@dataclass(frozen=True)
class ModelSpec:
    """A model whose decoder layer is measured: the config values that shape one layer."""

    name: str
    model_type: str
    config: dict
    experts: int | None = None


# From each model's published config.json on the Hugging Face Hub: the values that shape a decoder layer
# (head_dim is hidden_size / num_attention_heads where config.json leaves it out); bfloat16, their torch_dtype.
CONFIGS: dict[str, ModelSpec] = {
    # meta-llama/Meta-Llama-3-8B: hidden_size 4096, intermediate_size 14336, num_attention_heads 32,
    # num_key_value_heads 8, rms_norm_eps 1e-05, hidden_act silu.
    "llama-3-8b": ModelSpec(
        "Llama-3-8B",
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            rms_norm_eps=1e-5,
        ),
    ),
    # Qwen/Qwen3-8B: hidden_size 4096, intermediate_size 12288, num_attention_heads 32, num_key_value_heads 8,
    # head_dim 128, rms_norm_eps 1e-06; an RMSNorm on q and on k per head (q_norm, k_norm).
    "qwen3-8b": ModelSpec(
        "Qwen3-8B",
        "qwen3",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            rms_norm_eps=1e-6,
        ),
    ),
    # Qwen/Qwen3-30B-A3B: hidden_size 2048, num_attention_heads 32, num_key_value_heads 4, head_dim 128,
    # num_experts 128, num_experts_per_tok 8, moe_intermediate_size 768, norm_topk_prob true,
    # decoder_sparse_step 1 and mlp_only_layers [] (every layer is an MoE layer), rms_norm_eps 1e-06.
    "qwen3-30b-a3b": ModelSpec(
        "Qwen3-30B-A3B",
        "qwen3_moe",
        dict(
            hidden_size=2048,
            moe_intermediate_size=768,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rms_norm_eps=1e-6,
        ),
        experts=128,
    ),
    # Qwen/Qwen1.5-MoE-A2.7B: hidden_size 2048, num_attention_heads 16, num_key_value_heads 16 (head_dim 128),
    # num_experts 60, num_experts_per_tok 4, moe_intermediate_size 1408, shared_expert_intermediate_size 5632,
    # norm_topk_prob false (its router is one npu-moe-router fuses), decoder_sparse_step 1, rms_norm_eps 1e-06.
    "qwen1.5-moe-a2.7b": ModelSpec(
        "Qwen1.5-MoE-A2.7B",
        "qwen2_moe",
        dict(
            hidden_size=2048,
            intermediate_size=5632,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            num_attention_heads=16,
            num_key_value_heads=16,
            head_dim=128,
            num_experts=60,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rms_norm_eps=1e-6,
        ),
        experts=60,
    ),
    # mistralai/Mixtral-8x7B-v0.1: hidden_size 4096, intermediate_size 14336, num_attention_heads 32,
    # num_key_value_heads 8, num_local_experts 8, num_experts_per_tok 2, rms_norm_eps 1e-05.
    "mixtral-8x7b": ModelSpec(
        "Mixtral-8x7B",
        "mixtral",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            num_local_experts=8,
            num_experts_per_tok=2,
            rms_norm_eps=1e-5,
        ),
        experts=8,
    ),
    # google/gemma-3-4b-pt, its text_config (a Gemma3TextConfig, run here as Gemma3ForCausalLM): hidden_size 2560,
    # intermediate_size 10240, num_attention_heads 8, num_key_value_heads 4, head_dim 256, query_pre_attn_scalar 256,
    # sliding_window 1024, rms_norm_eps 1e-06, hidden_activation gelu_pytorch_tanh (the GELU-tanh gated MLP
    # npu-swiglu's GeGLUMLP fuses with npu_geglu); four zero-centred RMSNorms per layer and q/k norms.
    "gemma-3-4b": ModelSpec(
        "Gemma-3-4B",
        "gemma3_text",
        dict(
            hidden_size=2560,
            intermediate_size=10240,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=1024,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
        ),
    ),
}
TINY_SPECS = (
    ModelSpec("tiny Llama", "llama", tiny_config_values("llama")),
    ModelSpec("tiny Qwen3-MoE", "qwen3_moe", tiny_config_values("qwen3_moe"), 4),
)
"""The test suite's tiny models (npu_hub_kernels.testing.tiny_models): device timing on the emulation runs at small
shapes, so that the code path runs (and cannot rot) off an Ascend host; host-side costs do not depend on widths."""


def experts_key(spec: ModelSpec) -> str:
    """The config key of the model's number of experts."""
    return "num_local_experts" if spec.model_type == "mixtral" else "num_experts"


def activation_bytes(model: str, batch: int, seq: int) -> int:
    """Bytes of one activation of a bench model's decoder layer: batch x seq x hidden, in `DTYPE` (its name `model`)."""
    spec = next(spec for spec in CONFIGS.values() if spec.name == model)
    return batch * seq * spec.config["hidden_size"] * DTYPE.itemsize
