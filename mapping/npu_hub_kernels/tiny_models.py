"""Tiny random-weight transformers models, built from configs (nothing downloaded), for checking a
kernelized model against eager on any host: used by the demo and the tests, and handy for yours."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

VOCAB = 96

_TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

TINY_CONFIGS = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "gemma3_text": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "olmo2": {},
}
"""Model type -> config overrides. Their norms cover all three npu-rms-norm layers, their rotary
functions the Llama and cast-back layers of npu-rope."""


def tiny_causal_lm(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> PreTrainedModel:
    """A 2-layer causal LM in eval mode; norm weights randomised so that they matter."""
    config = AutoConfig.for_model(model_type, **{**_TINY, **TINY_CONFIGS[model_type]})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    zero_centered = model_type.startswith("gemma")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5).add_(0.0 if zero_centered else 1.0)
    return model.eval()


def token_ids(batch: int = 2, seq: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def norm_module_count(model: torch.nn.Module) -> int:
    return sum(1 for _, m in model.named_modules() if type(m).__name__.endswith("RMSNorm"))
