"""npu-linear-cross-entropy: the transformers `*ForCausalLM` classes its layers replace, and those it leaves out.

Established from the forward of every `*ForCausalLM` class of transformers 5.22.2, read as source (docstring and
annotations dropped, the loss_function's positional arguments named as ForCausalLMLoss names them, a base model
output's `[0]` read as its `last_hidden_state`) and grouped by identical text. Each layer reproduces one group whose
lm_head and loss lines are exactly `logits = self.<head>(hidden_states)` then `self.loss_function(logits=logits,
labels=labels, vocab_size=..., **kwargs)`; the groups differ in how they reach the base model and the head, what they
take and what they return (layers.LAYERS). tests/test_npu_linear_cross_entropy.py re-proves that every listed class
has its group's forward, that every `*ForCausalLM` class is listed or left out, and each reason from the source.
The MoE groups that add the router's auxiliary loss (`loss += <coefficient> * aux_loss.to(loss.device)` when
output_router_logits is on) have layers of their own, which add it as the class does (layers.AuxLoss); HYV3's forward
is MoeCausalLM's with an explicit `aux_loss=None`, the output field's default.
"""

from __future__ import annotations

from . import _survey

_CAUSAL_LM = (  # self.model, lm_head on the last hidden states, self.loss_function, CausalLMOutputWithPast
    "apertus.modeling_apertus.ApertusForCausalLM",
    "arcee.modeling_arcee.ArceeForCausalLM",
    "bitnet.modeling_bitnet.BitNetForCausalLM",
    "cwm.modeling_cwm.CwmForCausalLM",
    "diffllama.modeling_diffllama.DiffLlamaForCausalLM",
    "emu3.modeling_emu3.Emu3ForCausalLM",
    "ernie4_5.modeling_ernie4_5.Ernie4_5ForCausalLM",
    "exaone4.modeling_exaone4.Exaone4ForCausalLM",
    "gemma.modeling_gemma.GemmaForCausalLM",
    "glm.modeling_glm.GlmForCausalLM",
    "glm4.modeling_glm4.Glm4ForCausalLM",
    "helium.modeling_helium.HeliumForCausalLM",
    "hunyuan_v1_dense.modeling_hunyuan_v1_dense.HunYuanDenseV1ForCausalLM",
    "jais2.modeling_jais2.Jais2ForCausalLM",
    "lfm2.modeling_lfm2.Lfm2ForCausalLM",
    "llama.modeling_llama.LlamaForCausalLM",
    "ministral.modeling_ministral.MinistralForCausalLM",
    "ministral3.modeling_ministral3.Ministral3ForCausalLM",
    "mistral.modeling_mistral.MistralForCausalLM",
    "olmo.modeling_olmo.OlmoForCausalLM",
    "olmo2.modeling_olmo2.Olmo2ForCausalLM",
    "olmo3.modeling_olmo3.Olmo3ForCausalLM",
    "olmo_hybrid.modeling_olmo_hybrid.OlmoHybridForCausalLM",
    "persimmon.modeling_persimmon.PersimmonForCausalLM",
    "phi.modeling_phi.PhiForCausalLM",
    "phi3.modeling_phi3.Phi3ForCausalLM",
    "qwen2.modeling_qwen2.Qwen2ForCausalLM",
    "qwen3.modeling_qwen3.Qwen3ForCausalLM",
    "qwen3_5.modeling_qwen3_5.Qwen3_5ForCausalLM",
    "seed_oss.modeling_seed_oss.SeedOssForCausalLM",
    "smollm3.modeling_smollm3.SmolLM3ForCausalLM",
    "stablelm.modeling_stablelm.StableLmForCausalLM",
    "starcoder2.modeling_starcoder2.Starcoder2ForCausalLM",
    "youtu.modeling_youtu.YoutuForCausalLM",
)
_MOE_CAUSAL_LM = (  # the same, MoeCausalLMOutputWithPast with the base model's router_logits, no aux loss
    "aria.modeling_aria.AriaTextForCausalLM",
    "axk1.modeling_axk1.AXK1ForCausalLM",
    "axk2.modeling_axk2.AXK2ForCausalLM",
    "bailing_hybrid.modeling_bailing_hybrid.BailingHybridForCausalLM",
    "deepseek_v2.modeling_deepseek_v2.DeepseekV2ForCausalLM",
    "deepseek_v3.modeling_deepseek_v3.DeepseekV3ForCausalLM",
    "deepseek_v32.modeling_deepseek_v32.DeepseekV32ForCausalLM",
    "dots1.modeling_dots1.Dots1ForCausalLM",
    "exaone_moe.modeling_exaone_moe.ExaoneMoeForCausalLM",
    "glm4_moe.modeling_glm4_moe.Glm4MoeForCausalLM",
    "glm4_moe_lite.modeling_glm4_moe_lite.Glm4MoeLiteForCausalLM",
    "glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaForCausalLM",
    "hunyuan_v1_moe.modeling_hunyuan_v1_moe.HunYuanMoEV1ForCausalLM",
    "hy_v3.modeling_hy_v3.HYV3ForCausalLM",  # with an explicit aux_loss=None, the output field's default
    "kimi_linear.modeling_kimi_linear.KimiLinearForCausalLM",
    "kolibri1.modeling_kolibri1.Kolibri1ForCausalLM",
    "lfm2_moe.modeling_lfm2_moe.Lfm2MoeForCausalLM",
    "llama4.modeling_llama4.Llama4ForCausalLM",
    "longcat_flash.modeling_longcat_flash.LongcatFlashForCausalLM",
    "mimo_v2_flash.modeling_mimo_v2_flash.MiMoV2FlashForCausalLM",
    "mistral4.modeling_mistral4.Mistral4ForCausalLM",
    "solar_open.modeling_solar_open.SolarOpenForCausalLM",
)


_MOE_CAUSAL_LM_WITH_AUX_LOSS = (  # the same, output_router_logits, adds router_aux_loss_coef * load_balancing_loss_func
    "deepseek_v4.modeling_deepseek_v4.DeepseekV4ForCausalLM",
    "ernie4_5_moe.modeling_ernie4_5_moe.Ernie4_5_MoeForCausalLM",
    "flex_olmo.modeling_flex_olmo.FlexOlmoForCausalLM",
    "flint.modeling_flint.FlintForCausalLM",
    "gpt_oss.modeling_gpt_oss.GptOssForCausalLM",
    "jamba.modeling_jamba.JambaForCausalLM",
    "laguna.modeling_laguna.LagunaForCausalLM",
    "mellum.modeling_mellum.MellumForCausalLM",
    "minimax.modeling_minimax.MiniMaxForCausalLM",
    "minimax_m2.modeling_minimax_m2.MiniMaxM2ForCausalLM",
    "minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLForCausalLM",
    "mixtral.modeling_mixtral.MixtralForCausalLM",
    "olmoe.modeling_olmoe.OlmoeForCausalLM",
    "phimoe.modeling_phimoe.PhimoeForCausalLM",
    "qwen2_moe.modeling_qwen2_moe.Qwen2MoeForCausalLM",
    "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeForCausalLM",
    "qwen3_moe.modeling_qwen3_moe.Qwen3MoeForCausalLM",
    "qwen3_next.modeling_qwen3_next.Qwen3NextForCausalLM",
    "qwen4_exp.modeling_qwen4_exp.Qwen4ExpForCausalLM",
)

# The groups that differ from the Llama and MoE ones only in how they reach the base model and the lm_head, what they
# take and what they return (layers.LAYERS): their lm_head and loss lines are the default ones.
_OTHER_FORMS = {
    "GPTNeoXCausalLM": ("gpt_neox.modeling_gpt_neox.GPTNeoXForCausalLM",),
    "NemotronCausalLM": (  # the loss given self.vocab_size
        "nemotron.modeling_nemotron.NemotronForCausalLM",
        "zamba.modeling_zamba.ZambaForCausalLM",
        "zamba2.modeling_zamba2.Zamba2ForCausalLM",
    ),
    "BloomCausalLM": ("bloom.modeling_bloom.BloomForCausalLM", "mpt.modeling_mpt.MptForCausalLM"),
    "FalconCausalLM": ("falcon.modeling_falcon.FalconForCausalLM",),
    "GPTJCausalLM": ("codegen.modeling_codegen.CodeGenForCausalLM", "gptj.modeling_gptj.GPTJForCausalLM"),
    "GPTNeoCausalLM": ("gpt_neo.modeling_gpt_neo.GPTNeoForCausalLM",),
    "GPTBigCodeCausalLM": ("gpt_bigcode.modeling_gpt_bigcode.GPTBigCodeForCausalLM",),
    "OPTCausalLM": ("opt.modeling_opt.OPTForCausalLM",),
    "BioGptCausalLM": ("biogpt.modeling_biogpt.BioGptForCausalLM",),
    "GPTNeoXJapaneseCausalLM": ("gpt_neox_japanese.modeling_gpt_neox_japanese.GPTNeoXJapaneseForCausalLM",),
}

SWAPPED: dict[str, tuple[str, ...]] = {
    "CausalLM": _CAUSAL_LM,
    "MoeCausalLM": _MOE_CAUSAL_LM,
    "MoeCausalLMWithAuxLoss": _MOE_CAUSAL_LM_WITH_AUX_LOSS,
    "DbrxCausalLM": ("dbrx.modeling_dbrx.DbrxForCausalLM",),  # the same on its base model self.transformer
    "JetMoeCausalLM": ("jetmoe.modeling_jetmoe.JetMoeForCausalLM",),  # aux_loss_coef, config.vocab_size
    "DogeCausalLM": ("doge.modeling_doge.DogeForCausalLM",),  # is_moe, num_keys in the load-balancing loss
    **_OTHER_FORMS,
}
"""Layer -> the classes whose forward it replaces. Per call, the loss is fused only with labels, transformers'
ForCausalLMLoss as the model's loss_function and a plain lm_head (linear_cross_entropy_unavailable_reason)."""

_SOFTCAP = "final logit soft-capping (tanh) between the lm_head and the loss"
_SCALED = "scales the hidden states or the logits between the last layer and the loss (logits_scaling, logit_scale)"
_OWN_LOSS = "computes its own loss (CrossEntropyLoss or another), not the model's loss_function"
_HEAD_TRANSFORM = (
    "its head transforms the last hidden states (dense, activation, LayerNorm: a BERT-style prediction head) before "
    "the vocabulary Linear; the layers fuse a Linear lm_head on the last hidden states"
)
_Z_LOSS = "adds a z-loss (the squared logsumexp of the logits) to the loss when config.z_loss_coefficient > 0"
_CODEBOOK_HEADS = "one head per audio codebook (codebooks_head, chosen by position), the loss from position 1 on"
_IMAGE_TOKENS_DROPPED = "drops the image tokens' logits (num_image_tokens) and shifts the labels itself for the loss"
_CAPTURED_OUTPUTS = (
    "the default loss, but its forward is wrapped in capture_outputs (hidden states and attentions recorded by "
    "hooks) and merge_with_config_defaults, which a swapped-in forward would drop"
)
_STATE_SPACE = (
    "the default loss, but a recurrent model's forward: its cache (cache_params or state) in and out of the backbone "
    "and an output class without past_key_values and attentions, which no layer builds"
)
_OWN_FORM = "the default loss, in a forward form no layer reproduces (one or two classes have it): {}"
_ROUTER_LOGITS_WITHOUT_AUX = _OWN_FORM.format(
    "output_router_logits (config default) to the base model, no aux loss, self.vocab_size"
)

LEFT_OUT: dict[str, str] = {
    "afmoe.modeling_afmoe.AfmoeForCausalLM": _ROUTER_LOGITS_WITHOUT_AUX,
    "bamba.modeling_bamba.BambaForCausalLM": _Z_LOSS,
    "bart.modeling_bart.BartForCausalLM": _OWN_LOSS,
    "beam.modeling_beam.BeamForCausalLM": _SOFTCAP,
    "big_bird.modeling_big_bird.BigBirdForCausalLM": _HEAD_TRANSFORM,
    "bigbird_pegasus.modeling_bigbird_pegasus.BigBirdPegasusForCausalLM": _OWN_LOSS,
    "blenderbot.modeling_blenderbot.BlenderbotForCausalLM": _OWN_LOSS,
    "blenderbot_small.modeling_blenderbot_small.BlenderbotSmallForCausalLM": _OWN_LOSS,
    "blt.modeling_blt.BltForCausalLM": _OWN_FORM.format(
        "cross-attention arguments, logits cast to float32, self.vocab_size"
    ),
    "camembert.modeling_camembert.CamembertForCausalLM": _HEAD_TRANSFORM,
    "clvp.modeling_clvp.ClvpForCausalLM": _OWN_LOSS,
    "cohere.modeling_cohere.CohereForCausalLM": _SCALED,
    "cohere2.modeling_cohere2.Cohere2ForCausalLM": _SCALED,
    "cohere2_moe.modeling_cohere2_moe.Cohere2MoeForCausalLM": _SCALED,
    "cohere_compass.modeling_cohere_compass.CohereCompassForCausalLM": _SCALED,
    "cpmant.modeling_cpmant.CpmAntForCausalLM": _OWN_LOSS,
    "csm.modeling_csm.CsmDepthDecoderForCausalLM": _CODEBOOK_HEADS,
    "data2vec.modeling_data2vec_text.Data2VecTextForCausalLM": _HEAD_TRANSFORM,
    "electra.modeling_electra.ElectraForCausalLM": _HEAD_TRANSFORM,
    "ernie.modeling_ernie.ErnieForCausalLM": _HEAD_TRANSFORM,
    "falcon_h1.modeling_falcon_h1.FalconH1ForCausalLM": _SCALED,
    "falcon_mamba.modeling_falcon_mamba.FalconMambaForCausalLM": _STATE_SPACE,
    "fuyu.modeling_fuyu.FuyuForCausalLM": _OWN_FORM.format(
        "image patches to the base model, the text config's vocab_size"
    ),
    "gemma2.modeling_gemma2.Gemma2ForCausalLM": _SOFTCAP,
    "gemma3.modeling_gemma3.Gemma3ForCausalLM": _SOFTCAP,
    "gemma3n.modeling_gemma3n.Gemma3nForCausalLM": _SOFTCAP,
    "gemma4.modeling_gemma4.Gemma4ForCausalLM": _SOFTCAP,
    "gemma4_assistant.modeling_gemma4_assistant.Gemma4AssistantForCausalLM": _OWN_LOSS,
    "gemma4_unified.modeling_gemma4_unified.Gemma4UnifiedForCausalLM": _SOFTCAP,
    "gemma4_unified_assistant.modeling_gemma4_unified_assistant.Gemma4UnifiedAssistantForCausalLM": _OWN_LOSS,
    "git.modeling_git.GitForCausalLM": _IMAGE_TOKENS_DROPPED,
    "granite.modeling_granite.GraniteForCausalLM": _SCALED,
    "granite_swa.modeling_granite_swa.GraniteSWAForCausalLM": _SCALED,
    "granitemoe.modeling_granitemoe.GraniteMoeForCausalLM": _SCALED,
    "granitemoe_swa.modeling_granitemoe_swa.GraniteMoeSWAForCausalLM": _SCALED,
    "granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridForCausalLM": _SCALED,
    "granitemoeshared.modeling_granitemoeshared.GraniteMoeSharedForCausalLM": _SCALED,
    "hrm_text.modeling_hrm_text.HrmTextForCausalLM": _OWN_FORM.format("token_type_ids to the base model"),
    "hy_v4.modeling_hy_v4.HYV4ForCausalLM": _OWN_FORM.format("hidden states cast to the lm_head's dtype, MoE outputs"),
    "hyperclovax.modeling_hyperclovax.HyperCLOVAXForCausalLM": _SCALED,
    "inkling.modeling_inkling.InklingForCausalLM": _SCALED,
    "kosmos2.modeling_kosmos2.Kosmos2TextForCausalLM": _OWN_FORM.format(
        "image embeddings and encoder states to the base model"
    ),
    "kosmos2_5.modeling_kosmos2_5.Kosmos2_5TextForCausalLM": _OWN_FORM.format("image embeddings to the base model"),
    "mamba.modeling_mamba.MambaForCausalLM": _STATE_SPACE,
    "mamba2.modeling_mamba2.Mamba2ForCausalLM": _STATE_SPACE,
    "marian.modeling_marian.MarianForCausalLM": _OWN_LOSS,
    "mbart.modeling_mbart.MBartForCausalLM": _OWN_LOSS,
    "megatron_bert.modeling_megatron_bert.MegatronBertForCausalLM": _HEAD_TRANSFORM,
    "minicpm3.modeling_minicpm3.MiniCPM3ForCausalLM": _SCALED,
    "mllama.modeling_mllama.MllamaForCausalLM": _OWN_FORM.format(
        "cross-attention inputs, logits cast to float32, self.vocab_size"
    ),
    "modernbert_decoder.modeling_modernbert_decoder.ModernBertDecoderForCausalLM": _HEAD_TRANSFORM,
    "moshi.modeling_moshi.MoshiForCausalLM": _OWN_FORM.format(
        "MoshiCausalLMOutputWithPast, with the last hidden state"
    ),
    "musicgen.modeling_musicgen.MusicgenForCausalLM": _OWN_LOSS,
    "musicgen_melody.modeling_musicgen_melody.MusicgenMelodyForCausalLM": _OWN_LOSS,
    "mvp.modeling_mvp.MvpForCausalLM": _OWN_LOSS,
    "nanochat.modeling_nanochat.NanoChatForCausalLM": _SOFTCAP,
    "nemotron_h.modeling_nemotron_h.NemotronHForCausalLM": _OWN_FORM.format(
        "logits cast to float32, self.vocab_size, MoE outputs"
    ),
    "pegasus.modeling_pegasus.PegasusForCausalLM": _OWN_LOSS,
    "phi4_multimodal.modeling_phi4_multimodal.Phi4MultimodalForCausalLM": _OWN_FORM.format(
        "image and audio inputs to the base model, self.vocab_size"
    ),
    "plbart.modeling_plbart.PLBartForCausalLM": _OWN_LOSS,
    "prophetnet.modeling_prophetnet.ProphetNetForCausalLM": _OWN_LOSS,
    "recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaForCausalLM": _SOFTCAP,
    "rembert.modeling_rembert.RemBertForCausalLM": _HEAD_TRANSFORM,
    "roberta.modeling_roberta.RobertaForCausalLM": _HEAD_TRANSFORM,
    "roberta_prelayernorm.modeling_roberta_prelayernorm.RobertaPreLayerNormForCausalLM": _HEAD_TRANSFORM,
    "roc_bert.modeling_roc_bert.RoCBertForCausalLM": _HEAD_TRANSFORM,
    "roformer.modeling_roformer.RoFormerForCausalLM": _HEAD_TRANSFORM,
    "rwkv.modeling_rwkv.RwkvForCausalLM": _STATE_SPACE,
    "trocr.modeling_trocr.TrOCRForCausalLM": _OWN_LOSS,
    "vaultgemma.modeling_vaultgemma.VaultGemmaForCausalLM": _SOFTCAP,
    "whisper.modeling_whisper.WhisperForCausalLM": _OWN_LOSS,
    "xglm.modeling_xglm.XGLMForCausalLM": _CAPTURED_OUTPUTS,
    "xlm_roberta.modeling_xlm_roberta.XLMRobertaForCausalLM": _HEAD_TRANSFORM,
    "xlm_roberta_xl.modeling_xlm_roberta_xl.XLMRobertaXLForCausalLM": _HEAD_TRANSFORM,
    "xlstm.modeling_xlstm.xLSTMForCausalLM": _SOFTCAP,
    "xmod.modeling_xmod.XmodForCausalLM": _HEAD_TRANSFORM,
    "zaya.modeling_zaya.ZayaForCausalLM": _ROUTER_LOGITS_WITHOUT_AUX,
}
"""Class -> why no layer reproduces it."""


def candidates() -> set[str]:
    """The classes that look like this card's region: every `*ForCausalLM` class with a forward of its own."""
    return {c.path for c in _survey.classes() if c.name.endswith("ForCausalLM") and c.method("forward") is not None}
