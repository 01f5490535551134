"""Tiny random-weight transformers models, built from configs, for checking a kernelized model against eager.

Nothing is downloaded, and the check runs on any host: the models are used by the demo and the tests, and handy for
yours.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedModel

VOCAB = 96

TINY_WIDTHS = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
"""The widths every tiny model shares (the family overrides of TINY_CONFIGS come on top)."""

_TINY = dict(
    TINY_WIDTHS,
    num_hidden_layers=2,
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
    "phi3": {"partial_rotary_factor": 0.5},
    "glm4": {"partial_rotary_factor": 0.5},
    "gpt_neox": {"rotary_pct": 0.5},
    "deepseek_v3": {
        # Multi-head latent attention: keys and values come per query head out of kv_b_proj, so there are as many
        # key/value heads as query heads (a smaller count makes attention repeat them: 8 key heads for 4 queries).
        "num_key_value_heads": 4,
        "head_dim": 8,  # the rotary part of each head: qk_rope_head_dim
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "rope_interleave": True,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
    "granite": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "cohere": {},
    "olmo": {},
    "helium": {},
    "smollm3": {},
    "gemma2": {},
    "gpt2": {},
    "qwen2_5_vl": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "vision_config": {
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 64,
        },
    },
}
"""Model type -> config overrides. Their norms cover all three npu-rms-norm layers; their rotary
functions cover Llama, cast-back, partial (Phi3, GPT-NeoX), GLM interleaved + partial (Glm4),
DeepSeek de-interleaved (DeepseekV3), Cohere's float32 pairs and multimodal sections (Qwen2.5-VL,
text tokens); their MLPs both SwiGLU shapes, shared experts (Qwen2-MoE, DeepseekV3), and
GELU-tanh (Gemma2, Gemma3) and GELU (GPT-2, GPT-NeoX) MLPs that must stay untouched."""
IMAGE_TEXT_TO_TEXT = {"qwen2_5_vl"}
"""Model types built with AutoModelForImageTextToText (their language model alone is not a causal LM class)."""


def tiny_config_values(model_type: str, **overrides) -> dict:
    """The config values of a tiny `model_type` model (a key of TINY_CONFIGS), with `overrides` on top.

    These are what `tiny_causal_lm` passes to `AutoConfig.for_model`.
    """
    return {**_TINY, **TINY_CONFIGS[model_type], **overrides}


def tiny_causal_lm(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> PreTrainedModel:
    """A 2-layer causal LM (logits from token ids) in eval mode; norm weights randomised so that they matter.

    Args:
        model_type: a key of TINY_CONFIGS.
        dtype: the parameters' dtype.
        seed: the seed of the random weights.
        overrides: config values on top of the tiny ones (e.g. head_dim=64).

    Returns:
        The model, on the host.
    """
    config = AutoConfig.for_model(model_type, **tiny_config_values(model_type, **overrides))
    torch.manual_seed(seed)
    auto_class = AutoModelForImageTextToText if model_type in IMAGE_TEXT_TO_TEXT else AutoModelForCausalLM
    model = auto_class.from_config(config, dtype=dtype)
    zero_centered = model_type.startswith("gemma")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5).add_(0.0 if zero_centered else 1.0)
    return model.eval()


def token_ids(batch: int = 2, seq: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def norm_module_count(model: PreTrainedModel) -> int:
    """RMSNorm modules of the language model: those a forward from token ids runs (not a vision tower's)."""
    return sum(1 for _, m in model.get_decoder().named_modules() if type(m).__name__.endswith("RMSNorm"))


def gating_op_routers(model: torch.nn.Module, *, training: bool) -> int:
    """Router modules of a kernelized model that call npu_moe_gating_top_k in one forward.

    Those are sigmoid routers that renormalise, and, where autograd does not record (`training` False), softmax
    routers that do not (the op's backward takes the sigmoid mode only; renormalised softmax routers run
    npu_moe_gating_top_k_softmax_v2 or the softmax of their top-k logits: `renormalised_op_routers`).
    """
    from npu_hub_kernels.report import swapped_modules

    modules = dict(model.named_modules())
    count = 0
    for swap in swapped_modules(model, card="npu-moe-router"):
        renormalise = getattr(modules[swap.module], "norm_topk_prob", None)
        if swap.layer == "SigmoidGroupTopKRouter":
            count += bool(renormalise)
        elif swap.layer == "SoftmaxTopKRouter":
            count += not renormalise and not training
    return count


def renormalised_op_routers(model: torch.nn.Module, *, training: bool) -> int:
    """Router modules of a kernelized model that call npu_moe_gating_top_k_softmax_v2 in one forward.

    Those are renormalised softmax routers whose weights are in the logits' dtype (or float32 logits), where autograd
    does not record (`training` False): the op has no backward.
    """
    from npu_hub_kernels.report import swapped_modules

    if training:
        return 0
    modules = dict(model.named_modules())
    count = 0
    for swap in swapped_modules(model, card="npu-moe-router"):
        router = modules[swap.module]
        if swap.layer == "SoftmaxTopKRouter":
            count += bool(getattr(router, "norm_topk_prob", None))
        elif swap.layer == "RenormalisedSoftmaxTopKRouter":
            count += 1
        elif swap.layer == "RenormalisedFloat32SoftmaxTopKRouter":
            count += router.weight.dtype == torch.float32  # float32 weights of float32 logits only
    return count
