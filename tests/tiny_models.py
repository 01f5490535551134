"""Tiny random-weight transformers models built from configs (nothing is downloaded)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

VOCAB = 96

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)

CONFIGS = {
    "llama": {},
    "qwen3": {},
    "gemma3_text": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "olmo2": {},
}
"""Model type -> config overrides; the norms cover the card's three layers (Olmo2: float32 scale)."""


def tiny_model(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> PreTrainedModel:
    config = AutoConfig.for_model(model_type, **{**_COMMON, **CONFIGS[model_type]})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # norms start at ones/zeros: make their weights matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5).add_(1.0 if "gemma" not in model_type else 0.0)
    return model.eval()


def token_ids(batch: int = 2, seq: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def norm_module_count(model: torch.nn.Module) -> int:
    return sum(1 for _, m in model.named_modules() if type(m).__name__.endswith("RMSNorm"))
