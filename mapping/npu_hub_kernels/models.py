"""Which transformers classes each card's layers replace: the one place that knows models by class.

For npu-rope the listed objects are `apply_rotary_pos_emb` function-modules (transformers turns the
decorated function into a module instance); their class is what gets retagged.

Class paths are relative to `transformers.models` (`<model>.<modeling file>.<class>`), checked
against transformers 5.22.2. A class is listed only when the card's layer computes exactly what its
forward computes: established numerically for every norm class of transformers 5.22.2 (a survey of
all 200 RMSNorm-like classes against each formula in float32 and bfloat16), and re-proved for every
listed class by tests/test_models_table.py. Classes that look alike but compute something else are
in LEFT_OUT with the reason, and are never swapped.
"""

from __future__ import annotations

from dataclasses import dataclass

# npu-rms-norm, layer RMSNorm: weight * normalize(x).to(dtype)   (LlamaRMSNorm)
PLAIN_NORMS = (
    "aimv2.modeling_aimv2.Aimv2RMSNorm",
    "apertus.modeling_apertus.ApertusRMSNorm",
    "arcee.modeling_arcee.ArceeRMSNorm",
    "aria.modeling_aria.AriaTextRMSNorm",
    "axk1.modeling_axk1.AXK1RMSNorm",
    "axk2.modeling_axk2.AXK2RMSNorm",
    "bailing_hybrid.modeling_bailing_hybrid.BailingHybridRMSNorm",
    "bamba.modeling_bamba.BambaRMSNorm",
    "bitnet.modeling_bitnet.BitNetRMSNorm",
    "blt.modeling_blt.BltRMSNorm",
    "chameleon.modeling_chameleon.ChameleonRMSNorm",
    "clvp.modeling_clvp.ClvpRMSNorm",
    "cohere2_moe.modeling_cohere2_moe.Cohere2MoeRMSNorm",
    "cosmos3_edge.modeling_cosmos3_edge.Cosmos3EdgeTextRMSNorm",
    "csm.modeling_csm.CsmRMSNorm",
    "cwm.modeling_cwm.CwmRMSNorm",
    "deepseek_ocr2.modeling_deepseek_ocr2.DeepseekOcr2TextRMSNorm",
    "deepseek_ocr2.modeling_deepseek_ocr2.DeepseekOcr2VisionRMSNorm",
    "deepseek_v2.modeling_deepseek_v2.DeepseekV2RMSNorm",
    "deepseek_v3.modeling_deepseek_v3.DeepseekV3RMSNorm",
    "deepseek_v32.modeling_deepseek_v32.DeepseekV32RMSNorm",
    "deimv2.modeling_deimv2.Deimv2RMSNorm",
    "dia.modeling_dia.DiaRMSNorm",
    "diffllama.modeling_diffllama.DiffLlamaRMSNorm",
    "doge.modeling_doge.DogeRMSNorm",
    "dots1.modeling_dots1.Dots1RMSNorm",
    "emu3.modeling_emu3.Emu3RMSNorm",
    "ernie4_5.modeling_ernie4_5.Ernie4_5RMSNorm",
    "ernie4_5_moe.modeling_ernie4_5_moe.Ernie4_5_MoeRMSNorm",
    "ernie4_5_vl_moe.modeling_ernie4_5_vl_moe.Ernie4_5_VLMoeRMSNorm",
    "eurobert.modeling_eurobert.EuroBertRMSNorm",
    "evolla.modeling_evolla.EvollaRMSNorm",
    "exaone4.modeling_exaone4.Exaone4RMSNorm",
    "exaone4_5.modeling_exaone4_5.Exaone4_5_RMSNorm",
    "exaone_moe.modeling_exaone_moe.ExaoneMoeRMSNorm",
    "falcon_h1.modeling_falcon_h1.FalconH1RMSNorm",
    "falcon_mamba.modeling_falcon_mamba.FalconMambaRMSNorm",
    "glm.modeling_glm.GlmRMSNorm",
    "glm4.modeling_glm4.Glm4RMSNorm",
    "glm4_moe.modeling_glm4_moe.Glm4MoeRMSNorm",
    "glm4_moe_lite.modeling_glm4_moe_lite.Glm4MoeLiteRMSNorm",
    "glm4v.modeling_glm4v.Glm4vRMSNorm",
    "glm4v_moe.modeling_glm4v_moe.Glm4vMoeRMSNorm",
    "glm4v_moe.modeling_glm4v_moe.Glm4vMoeTextRMSNorm",
    "glm5_next.modeling_glm5_next.Glm5NextRMSNorm",
    "glm5_next.modeling_glm5_next.Glm5NextTextRMSNorm",
    "glm_image.modeling_glm_image.GlmImageRMSNorm",
    "glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaRMSNorm",
    "glm_ocr.modeling_glm_ocr.GlmOcrRMSNorm",
    "granite.modeling_granite.GraniteRMSNorm",
    "granite4_vision.modeling_granite4_vision.Granite4VisionTextRMSNorm",
    "granite_swa.modeling_granite_swa.GraniteSWARMSNorm",
    "granitemoe.modeling_granitemoe.GraniteMoeRMSNorm",
    "granitemoe_swa.modeling_granitemoe_swa.GraniteMoeSWARMSNorm",
    "granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridRMSNorm",
    "granitemoeshared.modeling_granitemoeshared.GraniteMoeSharedRMSNorm",
    "higgs_audio_v2.modeling_higgs_audio_v2.HiggsAudioV2RMSNorm",
    "hunyuan_v1_dense.modeling_hunyuan_v1_dense.HunYuanDenseV1RMSNorm",
    "hunyuan_v1_moe.modeling_hunyuan_v1_moe.HunYuanMoEV1RMSNorm",
    "hunyuan_vl.modeling_hunyuan_vl.HunYuanVLRMSNorm",
    "hy_v3.modeling_hy_v3.HYV3RMSNorm",
    "hy_v4.modeling_hy_v4.HYV4RMSNorm",
    "hyperclovax.modeling_hyperclovax.HyperCLOVAXRMSNorm",
    "idefics.modeling_idefics.IdeficsRMSNorm",
    "idefics2.modeling_idefics2.Idefics2RMSNorm",
    "idefics3.modeling_idefics3.Idefics3RMSNorm",
    "inkling.modeling_inkling.InklingRMSNorm",
    "internvl.modeling_internvl.InternVLVisionRMSNorm",
    "jamba.modeling_jamba.JambaRMSNorm",
    "jetmoe.modeling_jetmoe.JetMoeRMSNorm",
    "kimi_linear.modeling_kimi_linear.KimiLinearRMSNorm",
    "kolibri1.modeling_kolibri1.Kolibri1RMSNorm",
    "laguna.modeling_laguna.LagunaRMSNorm",
    "lfm2.modeling_lfm2.Lfm2RMSNorm",
    "lfm2_moe.modeling_lfm2_moe.Lfm2MoeRMSNorm",
    "lighton_ocr.modeling_lighton_ocr.LightOnOcrRMSNorm",
    "llama.modeling_llama.LlamaRMSNorm",
    "llama4.modeling_llama4.Llama4TextRMSNorm",
    "longcat_flash.modeling_longcat_flash.LongcatFlashRMSNorm",
    "mamba.modeling_mamba.MambaRMSNorm",
    "mamba2.modeling_mamba2.Mamba2RMSNorm",
    "mellum.modeling_mellum.MellumRMSNorm",
    "mimo_v2_flash.modeling_mimo_v2_flash.MiMoV2FlashRMSNorm",
    "minicpm3.modeling_minicpm3.MiniCPM3RMSNorm",
    "minimax.modeling_minimax.MiniMaxRMSNorm",
    "minimax_m2.modeling_minimax_m2.MiniMaxM2RMSNorm",
    "ministral.modeling_ministral.MinistralRMSNorm",
    "ministral3.modeling_ministral3.Ministral3RMSNorm",
    "mistral.modeling_mistral.MistralRMSNorm",
    "mistral3.modeling_mistral3.Mistral3RMSNorm",
    "mistral4.modeling_mistral4.Mistral4RMSNorm",
    "mistral_large4.modeling_mistral_large4.MistralLarge4RMSNorm",
    "mixtral.modeling_mixtral.MixtralRMSNorm",
    "mllama.modeling_mllama.MllamaTextRMSNorm",
    "molmo2.modeling_molmo2.Molmo2RMSNorm",
    "muse_glimmer_assistant.modeling_muse_glimmer_assistant.MuseGlimmerAssistantRMSNorm",
    "neucodec.modeling_neucodec.NeuCodecRMSNorm",
    "olmoe.modeling_olmoe.OlmoeRMSNorm",
    "ovis2.modeling_ovis2.Ovis2RMSNorm",
    "paddleocr_vl.modeling_paddleocr_vl.PaddleOCRRMSNorm",
    "pe_audio.modeling_pe_audio.PeAudioEncoderRMSNorm",
    "pe_audio_video.modeling_pe_audio_video.PeAudioVideoEncoderRMSNorm",
    "pe_video.modeling_pe_video.PeVideoEncoderRMSNorm",
    "phi3.modeling_phi3.Phi3RMSNorm",
    "phi4_multimodal.modeling_phi4_multimodal.Phi4MultimodalRMSNorm",
    "pixtral.modeling_pixtral.PixtralRMSNorm",
    "qianfan_ocr.modeling_qianfan_ocr.QianfanOCRVisionRMSNorm",
    "qwen2.modeling_qwen2.Qwen2RMSNorm",
    "qwen2_5_omni.modeling_qwen2_5_omni.Qwen2_5OmniRMSNorm",
    "qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLRMSNorm",
    "qwen2_moe.modeling_qwen2_moe.Qwen2MoeRMSNorm",
    "qwen2_vl.modeling_qwen2_vl.Qwen2VLRMSNorm",
    "qwen3.modeling_qwen3.Qwen3RMSNorm",
    "qwen3_moe.modeling_qwen3_moe.Qwen3MoeRMSNorm",
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeCode2WavRMSNorm",
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeRMSNorm",
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeTextRMSNorm",
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeThinkerTextRMSNorm",
    "qwen3_vl.modeling_qwen3_vl.Qwen3VLTextRMSNorm",
    "qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeTextRMSNorm",
    "sapiens2.modeling_sapiens2.Sapiens2RMSNorm",
    "seed_oss.modeling_seed_oss.SeedOssRMSNorm",
    "smollm3.modeling_smollm3.SmolLM3RMSNorm",
    "solar_open.modeling_solar_open.SolarOpenRMSNorm",
    "timesfm.modeling_timesfm.TimesFmRMSNorm",
    "timesfm2_5.modeling_timesfm2_5.TimesFm2_5RMSNorm",
    "ultrabert.modeling_ultrabert.UltrabertRMSNorm",
    "ultravbert.modeling_ultravbert.UltraVBertRMSNorm",
    "unlimited_ocr.modeling_unlimited_ocr.UnlimitedOcrTextRMSNorm",
    "vibevoice.modeling_vibevoice.VibeVoiceRMSNorm",
    "vibevoice_acoustic_tokenizer.modeling_vibevoice_acoustic_tokenizer.VibeVoiceAcousticTokenizerRMSNorm",
    "vibevoice_asr.modeling_vibevoice_asr.VibeVoiceAsrRMSNorm",
    "voxtral_realtime.modeling_voxtral_realtime.VoxtralRealtimeRMSNorm",
    "xcodec2.modeling_xcodec2.Xcodec2RMSNorm",
    "youtu.modeling_youtu.YoutuRMSNorm",
    "zamba.modeling_zamba.ZambaRMSNorm",
    "zamba2.modeling_zamba2.Zamba2RMSNorm",
    "zaya.modeling_zaya.ZayaRMSNorm",
)

# npu-rms-norm, layer RMSNormZeroCentered: (normalize(x) * (1 + weight.float())).to(dtype)   (Gemma3RMSNorm)
ZERO_CENTERED_NORMS = (
    "gemma.modeling_gemma.GemmaRMSNorm",
    "gemma2.modeling_gemma2.Gemma2RMSNorm",
    "gemma3.modeling_gemma3.Gemma3RMSNorm",
    "minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLRMSNorm",
    "muse_glimmer.modeling_muse_glimmer.MuseGlimmerTextCenteredRMSNorm",
    "qwen3_5.modeling_qwen3_5.Qwen3_5RMSNorm",
    "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeRMSNorm",
    "qwen3_next.modeling_qwen3_next.Qwen3NextRMSNorm",
    "recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaRMSNorm",
    "step3p7.modeling_step3p7.Step3p7RMSNorm",
    "t5gemma.modeling_t5gemma.T5GemmaRMSNorm",
    "t5gemma2.modeling_t5gemma2.T5Gemma2RMSNorm",
    "vaultgemma.modeling_vaultgemma.VaultGemmaRMSNorm",
)

# npu-rms-norm, layer RMSNormFloat32Scale: (weight.float() * normalize(x)).to(dtype)   (Olmo2RMSNorm)
FLOAT32_SCALE_NORMS = (
    "afmoe.modeling_afmoe.AfmoeRMSNorm",
    "beam.modeling_beam.BeamRMSNorm",
    "deepseek_v4.modeling_deepseek_v4.DeepseekV4RMSNorm",
    "flex_olmo.modeling_flex_olmo.FlexOlmoRMSNorm",
    "flint.modeling_flint.FlintRMSNorm",
    "gpt_oss.modeling_gpt_oss.GptOssRMSNorm",
    "helium.modeling_helium.HeliumRMSNorm",
    "kyutai_speech_to_text.modeling_kyutai_speech_to_text.KyutaiSpeechToTextRMSNorm",
    "moshi.modeling_moshi.MoshiRMSNorm",
    "nemotron_h.modeling_nemotron_h.NemotronHRMSNorm",
    "nemotron_h_omni.modeling_nemotron_h_omni.NemotronH_Omni_RMSNorm",
    "olmo2.modeling_olmo2.Olmo2RMSNorm",
    "olmo3.modeling_olmo3.Olmo3RMSNorm",
    "olmo_hybrid.modeling_olmo_hybrid.OlmoHybridRMSNorm",
    "openai_privacy_filter.modeling_openai_privacy_filter.OpenAIPrivacyFilterRMSNorm",
)

# Reasons shared by several left-out classes.
_WITH_SCALE = "with_scale=False drops the weight; a class-level swap cannot tell such instances apart"
_GATED = "gated norm (forward takes a gate)"
_OPTIONAL_GATE = "forward takes an optional gate; the layer takes one argument"
_NO_WEIGHT = "no weight parameter"
_NO_WEIGHT_LOW_PRECISION = "no weight; multiplies by rstd in the input dtype"

# Norm classes of transformers 5.22.2 that no layer reproduces, and why.
LEFT_OUT = {
    "axk2.modeling_axk2.AXK2GatedRMSNorm": "gated by a small MLP of its own",
    "bailing_hybrid.modeling_bailing_hybrid.BailingHybridRMSNormGated": _GATED,
    "bamba.modeling_bamba.BambaRMSNormGated": _OPTIONAL_GATE,
    "deepseek_v4.modeling_deepseek_v4.DeepseekV4UnweightedRMSNorm": _NO_WEIGHT_LOW_PRECISION,
    "diffusion_gemma.modeling_diffusion_gemma.DiffusionGemmaRMSNorm": _WITH_SCALE,
    "embedding_gemma2.modeling_embedding_gemma2.EmbeddingGemma2RMSNorm": _WITH_SCALE,
    "esmfold2.modeling_esmfold2.EsmFold2RMSNorm": _NO_WEIGHT,
    "falcon_h1.modeling_falcon_h1.FalconH1RMSNormGated": "gated, grouped norm (gate, n_groups, norm_before_gate)",
    "falcon_mamba.modeling_falcon_mamba.FalconMambaWeightlessRMSNorm": "its weight is a dummy buffer, unused",
    "gemma3n.modeling_gemma3n.Gemma3nRMSNorm": _WITH_SCALE,
    "gemma4.modeling_gemma4.Gemma4RMSNorm": _WITH_SCALE,
    "gemma4_unified.modeling_gemma4_unified.Gemma4UnifiedRMSNorm": _WITH_SCALE,
    "glm5_next.modeling_glm5_next.Glm5NextTextRMSNormGated": _GATED,
    "glm5_next.modeling_glm5_next.Glm5NextTextUnweightedRMSNorm": _NO_WEIGHT_LOW_PRECISION,
    "granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridRMSNormGated": _OPTIONAL_GATE,
    "hrm_text.modeling_hrm_text.HrmTextRMSNorm": _NO_WEIGHT,
    "hy_v4.modeling_hy_v4.HYV4UnweightedRMSNorm": "returns the rstd factor, not a normalised tensor",
    "kimi_linear.modeling_kimi_linear.KimiLinearRMSNormGated": _GATED,
    "mamba2.modeling_mamba2.MambaRMSNormGated": _OPTIONAL_GATE,
    "muse_glimmer.modeling_muse_glimmer.MuseGlimmerRMSNorm": _WITH_SCALE,
    "muse_spark.modeling_muse_spark.MuseSparkRMSNorm": _WITH_SCALE,
    "muse_spark.modeling_muse_spark.MuseSparkTextCenteredRMSNorm": "forms 1 + weight in the weight dtype",
    "muse_spark.modeling_muse_spark.MuseSparkTextInputScaledRMSNorm": "scales the input before normalising",
    "nanochat.modeling_nanochat.NanoChatRMSNorm": _NO_WEIGHT,
    "nemotron_h.modeling_nemotron_h.NemotronHRMSNormGated": _OPTIONAL_GATE,
    "neomme.modeling_neomme.NeoMMERMSNorm": _WITH_SCALE,
    "olmo_hybrid.modeling_olmo_hybrid.OlmoHybridRMSNormGated": _GATED,
    "qwen3_5.modeling_qwen3_5.Qwen3_5RMSNormGated": _GATED,
    "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeRMSNormGated": _GATED,
    "qwen3_next.modeling_qwen3_next.Qwen3NextRMSNormGated": _GATED,
    "qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextRMSNorm": "optional group_size makes it a per-group norm",
    "qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextRMSNormGated": _GATED,
    "xlstm.modeling_xlstm.xLSTMRMSNorm": "optional bias and weight (use_bias, use_weight) change the math",
    "zamba2.modeling_zamba2.Zamba2RMSNormGated": _OPTIONAL_GATE,
}

# npu-rope: the rotary functions of transformers' modeling files, by the card layer that reproduces them.
# Established by a numerical survey of every module-level apply_rotary_pos_emb(_interleave) of
# transformers 5.22.2 against each rotary style (float32 and bfloat16, full and partial cos/sin), and
# re-proved per function by tests/test_models_table.py. The registry swaps each one whether or not
# transformers decorates or attaches it (see registry.py: it wraps and attaches the rest itself).
ROPE_FUNCTIONS: dict[str, tuple[str, ...]] = {
    # LlamaModel's q * cos + rotate_half(q) * sin; with narrower cos/sin, on the leading dims (Phi3, GPT-NeoX)
    "RotaryPosEmb": (
        "afmoe.modeling_afmoe.apply_rotary_pos_emb",
        "apertus.modeling_apertus.apply_rotary_pos_emb",
        "arcee.modeling_arcee.apply_rotary_pos_emb",
        "aria.modeling_aria.apply_rotary_pos_emb",
        "axk1.modeling_axk1.apply_rotary_pos_emb",
        "axk2.modeling_axk2.apply_rotary_pos_emb",
        "bamba.modeling_bamba.apply_rotary_pos_emb",
        "bitnet.modeling_bitnet.apply_rotary_pos_emb",
        "chameleon.modeling_chameleon.apply_rotary_pos_emb",
        "cohere_compass.modeling_cohere_compass.apply_rotary_pos_emb",
        "cosmos3_edge.modeling_cosmos3_edge.apply_rotary_pos_emb",
        "csm.modeling_csm.apply_rotary_pos_emb",
        "cwm.modeling_cwm.apply_rotary_pos_emb",
        "dbrx.modeling_dbrx.apply_rotary_pos_emb",
        "deepseek_ocr2.modeling_deepseek_ocr2.apply_rotary_pos_emb",
        "deepseek_v3.modeling_deepseek_v3.apply_rotary_pos_emb",
        "deepseek_v32.modeling_deepseek_v32.apply_rotary_pos_emb",
        "dia.modeling_dia.apply_rotary_pos_emb",
        "diffllama.modeling_diffllama.apply_rotary_pos_emb",
        "doge.modeling_doge.apply_rotary_pos_emb",
        "dots1.modeling_dots1.apply_rotary_pos_emb",
        "embedding_gemma2.modeling_embedding_gemma2.apply_rotary_pos_emb",
        "emu3.modeling_emu3.apply_rotary_pos_emb",
        "esmc.modeling_esmc.apply_rotary_pos_emb",
        "esmfold2.modeling_esmfold2.apply_rotary_pos_emb",
        "eurobert.modeling_eurobert.apply_rotary_pos_emb",
        "exaone4.modeling_exaone4.apply_rotary_pos_emb",
        "exaone4_5.modeling_exaone4_5.apply_rotary_pos_emb",
        "exaone_moe.modeling_exaone_moe.apply_rotary_pos_emb",
        "falcon.modeling_falcon.apply_rotary_pos_emb",
        "falcon_h1.modeling_falcon_h1.apply_rotary_pos_emb",
        "flint.modeling_flint.apply_rotary_pos_emb",
        "gemma.modeling_gemma.apply_rotary_pos_emb",
        "gemma2.modeling_gemma2.apply_rotary_pos_emb",
        "gemma3.modeling_gemma3.apply_rotary_pos_emb",
        "glm4_moe.modeling_glm4_moe.apply_rotary_pos_emb",
        "glm4_moe_lite.modeling_glm4_moe_lite.apply_rotary_pos_emb",
        "glm4v_moe.modeling_glm4v_moe.apply_rotary_pos_emb",
        "glm_image.modeling_glm_image.apply_rotary_pos_emb",
        "gpt_neox.modeling_gpt_neox.apply_rotary_pos_emb",
        "gpt_neox_japanese.modeling_gpt_neox_japanese.apply_rotary_pos_emb",
        "gradium_phonon_tts.modeling_gradium_phonon_tts.apply_rotary_pos_emb",
        "granite.modeling_granite.apply_rotary_pos_emb",
        "granite4_vision.modeling_granite4_vision.apply_rotary_pos_emb",
        "granite_swa.modeling_granite_swa.apply_rotary_pos_emb",
        "granitemoe.modeling_granitemoe.apply_rotary_pos_emb",
        "granitemoe_swa.modeling_granitemoe_swa.apply_rotary_pos_emb",
        "granitemoehybrid.modeling_granitemoehybrid.apply_rotary_pos_emb",
        "granitemoeshared.modeling_granitemoeshared.apply_rotary_pos_emb",
        "gte.modeling_gte.apply_rotary_pos_emb",
        "higgs_audio_v2.modeling_higgs_audio_v2.apply_rotary_pos_emb",
        "hrm_text.modeling_hrm_text.apply_rotary_pos_emb",
        "hunyuan_v1_dense.modeling_hunyuan_v1_dense.apply_rotary_pos_emb",
        "hunyuan_v1_moe.modeling_hunyuan_v1_moe.apply_rotary_pos_emb",
        "hy_v3.modeling_hy_v3.apply_rotary_pos_emb",
        "hy_v4.modeling_hy_v4.apply_rotary_pos_emb",
        "hyperclovax.modeling_hyperclovax.apply_rotary_pos_emb",
        "idefics.modeling_idefics.apply_rotary_pos_emb",
        "jais2.modeling_jais2.apply_rotary_pos_emb",
        "jamba.modeling_jamba.apply_rotary_pos_emb",
        "jetmoe.modeling_jetmoe.apply_rotary_pos_emb",
        "jina_embeddings_v3.modeling_jina_embeddings_v3.apply_rotary_pos_emb",
        "kolibri1.modeling_kolibri1.apply_rotary_pos_emb",
        "kyutai_speech_to_text.modeling_kyutai_speech_to_text.apply_rotary_pos_emb",
        "laguna.modeling_laguna.apply_rotary_pos_emb",
        "lasr.modeling_lasr.apply_rotary_pos_emb",
        "lfm2.modeling_lfm2.apply_rotary_pos_emb",
        "lfm2_moe.modeling_lfm2_moe.apply_rotary_pos_emb",
        "llama.modeling_llama.apply_rotary_pos_emb",
        "mellum.modeling_mellum.apply_rotary_pos_emb",
        "mimi.modeling_mimi.apply_rotary_pos_emb",
        "mimo_v2_flash.modeling_mimo_v2_flash.apply_rotary_pos_emb",
        "minicpm3.modeling_minicpm3.apply_rotary_pos_emb",
        "minimax.modeling_minimax.apply_rotary_pos_emb",
        "minimax_m2.modeling_minimax_m2.apply_rotary_pos_emb",
        "minimax_m3_vl.modeling_minimax_m3_vl.apply_rotary_pos_emb",
        "ministral.modeling_ministral.apply_rotary_pos_emb",
        "ministral3.modeling_ministral3.apply_rotary_pos_emb",
        "mistral.modeling_mistral.apply_rotary_pos_emb",
        "mistral4.modeling_mistral4.apply_rotary_pos_emb",
        "mixtral.modeling_mixtral.apply_rotary_pos_emb",
        "mllama.modeling_mllama.apply_rotary_pos_emb",
        "molmo2.modeling_molmo2.apply_rotary_pos_emb",
        "moshi.modeling_moshi.apply_rotary_pos_emb",
        "muse_glimmer.modeling_muse_glimmer.apply_rotary_pos_emb",
        "muse_glimmer_assistant.modeling_muse_glimmer_assistant.apply_rotary_pos_emb",
        "muse_spark.modeling_muse_spark.apply_rotary_pos_emb",
        "nemotron.modeling_nemotron.apply_rotary_pos_emb",
        "nemotron_asr_streaming.modeling_nemotron_asr_streaming.apply_rotary_pos_emb",
        "nemotron_h.modeling_nemotron_h.apply_rotary_pos_emb",
        "neomme.modeling_neomme.apply_rotary_pos_emb",
        "neucodec.modeling_neucodec.apply_rotary_pos_emb",
        "nomic_bert.modeling_nomic_bert.apply_rotary_pos_emb",
        "olmoe.modeling_olmoe.apply_rotary_pos_emb",
        "paddleocr_vl.modeling_paddleocr_vl.apply_rotary_pos_emb",
        "parakeet.modeling_parakeet.apply_rotary_pos_emb",
        "persimmon.modeling_persimmon.apply_rotary_pos_emb",
        "phi.modeling_phi.apply_rotary_pos_emb",
        "phi3.modeling_phi3.apply_rotary_pos_emb",
        "phi4_multimodal.modeling_phi4_multimodal.apply_rotary_pos_emb",
        "phimoe.modeling_phimoe.apply_rotary_pos_emb",
        "pixtral.modeling_pixtral.apply_rotary_pos_emb",
        "pocket_tts.modeling_pocket_tts.apply_rotary_pos_emb",
        "pocket_tts_audio_tokenizer.modeling_pocket_tts_audio_tokenizer.apply_rotary_pos_emb",
        "qwen2.modeling_qwen2.apply_rotary_pos_emb",
        "qwen2_5_omni.modeling_qwen2_5_omni.apply_rotary_pos_emb",
        "qwen2_5_vl.modeling_qwen2_5_vl.apply_rotary_pos_emb",
        "qwen2_moe.modeling_qwen2_moe.apply_rotary_pos_emb",
        "qwen2_vl.modeling_qwen2_vl.apply_rotary_pos_emb",
        "qwen3.modeling_qwen3.apply_rotary_pos_emb",
        "qwen3_5.modeling_qwen3_5.apply_rotary_pos_emb",
        "qwen3_5_moe.modeling_qwen3_5_moe.apply_rotary_pos_emb",
        "qwen3_moe.modeling_qwen3_moe.apply_rotary_pos_emb",
        "qwen3_next.modeling_qwen3_next.apply_rotary_pos_emb",
        "qwen3_omni_moe.modeling_qwen3_omni_moe.apply_rotary_pos_emb",
        "qwen3_vl.modeling_qwen3_vl.apply_rotary_pos_emb",
        "qwen3_vl_moe.modeling_qwen3_vl_moe.apply_rotary_pos_emb",
        "recurrent_gemma.modeling_recurrent_gemma.apply_rotary_pos_emb",
        "seed_oss.modeling_seed_oss.apply_rotary_pos_emb",
        "smollm3.modeling_smollm3.apply_rotary_pos_emb",
        "solar_open.modeling_solar_open.apply_rotary_pos_emb",
        "stablelm.modeling_stablelm.apply_rotary_pos_emb",
        "starcoder2.modeling_starcoder2.apply_rotary_pos_emb",
        "step3p7.modeling_step3p7.apply_rotary_pos_emb",
        "t5gemma.modeling_t5gemma.apply_rotary_pos_emb",
        "t5gemma2.modeling_t5gemma2.apply_rotary_pos_emb",
        "timesfm2_5.modeling_timesfm2_5.apply_rotary_pos_emb",
        "ultrabert.modeling_ultrabert.apply_rotary_pos_emb",
        "unlimited_ocr.modeling_unlimited_ocr.apply_rotary_pos_emb",
        "vaultgemma.modeling_vaultgemma.apply_rotary_pos_emb",
        "voxtral_realtime.modeling_voxtral_realtime.apply_rotary_pos_emb",
        "xcodec2.modeling_xcodec2.apply_rotary_pos_emb",
        "youtu.modeling_youtu.apply_rotary_pos_emb",
        "zamba2.modeling_zamba2.apply_rotary_pos_emb",
        "zaya.modeling_zaya.apply_rotary_pos_emb",
    ),
    # the same with the older (q, k, cos, sin, position_ids=None, unsqueeze_dim=1) signature
    "RotaryPosEmbPositionIds": (
        "glmasr.modeling_glmasr.apply_rotary_pos_emb",
        "nemotron3_5_transcribe.modeling_nemotron3_5_transcribe.apply_rotary_pos_emb",
        "nemotron3_diarization.modeling_nemotron3_diarization.apply_rotary_pos_emb",
    ),
    # the same, then cast back to the q/k dtypes
    "RotaryPosEmbCastBack": (
        "beam.modeling_beam.apply_rotary_pos_emb",
        "flex_olmo.modeling_flex_olmo.apply_rotary_pos_emb",
        "olmo.modeling_olmo.apply_rotary_pos_emb",
        "olmo2.modeling_olmo2.apply_rotary_pos_emb",
        "olmo3.modeling_olmo3.apply_rotary_pos_emb",
        "olmo_hybrid.modeling_olmo_hybrid.apply_rotary_pos_emb",
    ),
    # computed in float32, cast back once
    "RotaryPosEmbFloat32": (
        "esm.modeling_esm.apply_rotary_pos_emb",
        "evolla.modeling_evolla.apply_rotary_pos_emb",
        "hunyuan_vl.modeling_hunyuan_vl.apply_rotary_pos_emb",
        "modernbert.modeling_modernbert.apply_rotary_pos_emb",
        "modernbert_decoder.modeling_modernbert_decoder.apply_rotary_pos_emb",
    ),
    # cos/sin over half the head dim, first/second-half rotation
    "RotaryPosEmbHalfAngles": ("gpt_oss.modeling_gpt_oss.apply_rotary_pos_emb",),
    # interleaved (x[2i], x[2i+1]) pairs with cos/sin as given
    "RotaryPosEmbPairs": (
        "blt.modeling_blt.apply_rotary_pos_emb",
        "glm4v.modeling_glm4v.apply_rotary_pos_emb",
        "glm_ocr.modeling_glm_ocr.apply_rotary_pos_emb",
    ),
    # interleaved pairs in float32, cast back once
    "RotaryPosEmbPairsFloat32": (
        "cohere.modeling_cohere.apply_rotary_pos_emb",
        "cohere2.modeling_cohere2.apply_rotary_pos_emb",
        "cohere2_moe.modeling_cohere2_moe.apply_rotary_pos_emb",
        "efficientloftr.modeling_efficientloftr.apply_rotary_pos_emb",
        "ernie4_5_vl_moe.modeling_ernie4_5_vl_moe.apply_rotary_pos_emb",
        "lightglue.modeling_lightglue.apply_rotary_pos_emb",
    ),
    # interleaved pairs, one cos/sin value per pair
    "RotaryPosEmbPairsHalfAngles": ("openai_privacy_filter.modeling_openai_privacy_filter.apply_rotary_pos_emb",),
    # interleaved pairs, first half of cos/sin repeat-interleaved, leading dims only
    "RotaryPosEmbGlm": (
        "glm.modeling_glm.apply_rotary_pos_emb",
        "glm4.modeling_glm4.apply_rotary_pos_emb",
        "helium.modeling_helium.apply_rotary_pos_emb",
        "moonshine.modeling_moonshine.apply_rotary_pos_emb",
        "moonshine_streaming.modeling_moonshine_streaming.apply_rotary_pos_emb",
        "pe_audio.modeling_pe_audio.apply_rotary_pos_emb",
        "pe_audio_video.modeling_pe_audio_video.apply_rotary_pos_emb",
        "pe_video.modeling_pe_video.apply_rotary_pos_emb",
    ),
    # RotaryPosEmbGlm in float32
    "RotaryPosEmbGlmFloat32": (
        "ernie4_5.modeling_ernie4_5.apply_rotary_pos_emb",
        "ernie4_5_moe.modeling_ernie4_5_moe.apply_rotary_pos_emb",
    ),
    # apply_rotary_pos_emb_interleave: pairs rotated, written evens then odds (position_ids signature)
    "RotaryPosEmbDeinterleave": (
        "axk1.modeling_axk1.apply_rotary_pos_emb_interleave",
        "axk2.modeling_axk2.apply_rotary_pos_emb_interleave",
        "bailing_hybrid.modeling_bailing_hybrid.apply_rotary_pos_emb_interleave",
        "deepseek_v3.modeling_deepseek_v3.apply_rotary_pos_emb_interleave",
        "deepseek_v32.modeling_deepseek_v32.apply_rotary_pos_emb_interleave",
        "glm4_moe_lite.modeling_glm4_moe_lite.apply_rotary_pos_emb_interleave",
        "glm_moe_dsa.modeling_glm_moe_dsa.apply_rotary_pos_emb_interleave",
        "longcat_flash.modeling_longcat_flash.apply_rotary_pos_emb_interleave",
        "mistral4.modeling_mistral4.apply_rotary_pos_emb_interleave",
        "youtu.modeling_youtu.apply_rotary_pos_emb_interleave",
    ),
}

_ONE_TENSOR = "rotates one tensor (x, cos, sin): no (q, k) layer has that signature"
_ONE_TENSOR_SIN_FIRST = "rotates one tensor, (tensor, sin, cos), GPT-J pairs with cos/sin per pair"
_PATCHES_ONLY = "rotates only the patch tokens after the prefix tokens (**kwargs signature)"
_K_NONE = "some callers pass k=None to rotate q alone; the layers rotate both"

ROPE_LEFT_OUT = {
    "clvp.modeling_clvp.apply_rotary_pos_emb": "also rotates v, indexing cos/sin by position_ids inside",
    "codegen.modeling_codegen.apply_rotary_pos_emb": _ONE_TENSOR_SIN_FIRST,
    "deepseek_v4.modeling_deepseek_v4.apply_rotary_pos_emb": _ONE_TENSOR,
    "diffusion_gemma.modeling_diffusion_gemma.apply_rotary_pos_emb": _ONE_TENSOR,
    "dinov3_vit.modeling_dinov3_vit.apply_rotary_pos_emb": _PATCHES_ONLY,
    "eomt_dinov3.modeling_eomt_dinov3.apply_rotary_pos_emb": _PATCHES_ONLY,
    "gemma3n.modeling_gemma3n.apply_rotary_pos_emb": _ONE_TENSOR,
    "gemma4.modeling_gemma4.apply_rotary_pos_emb": _ONE_TENSOR,
    "gemma4_unified.modeling_gemma4_unified.apply_rotary_pos_emb": _ONE_TENSOR,
    "gptj.modeling_gptj.apply_rotary_pos_emb": _ONE_TENSOR_SIN_FIRST,
    "mistral_large4.modeling_mistral_large4.apply_rotary_pos_emb_interleave": _K_NONE,
    "nanochat.modeling_nanochat.apply_rotary_pos_emb": "its rotate_half has the opposite sign (x2, -x1)",
    "qwen4_exp.modeling_qwen4_exp.apply_rotary_pos_emb": _K_NONE,
    "sapiens2.modeling_sapiens2.apply_rotary_pos_emb": _PATCHES_ONLY,
}


@dataclass(frozen=True)
class ClassRule:
    """A transformers class (or function-module: its class) whose forward a card layer replaces."""

    path: str
    layer: str

    @property
    def module(self) -> str:
        return "transformers.models." + self.path.rpartition(".")[0]

    @property
    def class_name(self) -> str:
        return self.path.rpartition(".")[2]


def _rules(layer: str, paths: tuple[str, ...]) -> list[ClassRule]:
    return [ClassRule(path, layer) for path in paths]


MODEL_CLASSES: dict[str, list[ClassRule]] = {
    "npu_fused_rmsnorm": _rules("RMSNorm", PLAIN_NORMS)
    + _rules("RMSNormZeroCentered", ZERO_CENTERED_NORMS)
    + _rules("RMSNormFloat32Scale", FLOAT32_SCALE_NORMS),
    "npu_fused_rope": [ClassRule(path, layer) for layer, paths in ROPE_FUNCTIONS.items() for path in paths],
}
"""Kernel id -> the classes its layers replace."""
