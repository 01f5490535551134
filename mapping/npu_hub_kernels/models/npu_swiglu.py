"""npu-swiglu: the transformers dense gated MLP classes each layer replaces, and those it leaves out.

Established by a numerical survey of every MLP-like class of transformers 5.22.2 (each built from its
own config, its forward compared with both formulas, its activation flipped through the config,
dropout raised in train()); re-proved per class by tests/test_model_table_parity.py. Every class with
gate_proj/up_proj or a gate_up_proj Linear is listed or left out, and so is every T5-style gated MLP
(wi_0/wi_1), the other spelling of a GELU-gated MLP.
"""

from __future__ import annotations

from . import _survey

# layer SwiGLUMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)), SiLU from the config (Llama4: `activation_fn`)
_SPLIT = (
    "afmoe.modeling_afmoe.AfmoeMLP",
    "aimv2.modeling_aimv2.Aimv2MLP",
    "aria.modeling_aria.AriaSharedExpertsMLP",
    "axk1.modeling_axk1.AXK1MLP",
    "axk2.modeling_axk2.AXK2MLP",
    "bailing_hybrid.modeling_bailing_hybrid.BailingHybridMLP",
    "bamba.modeling_bamba.BambaMLP",
    "beam.modeling_beam.BeamMLP",
    "blt.modeling_blt.BltMLP",
    "chameleon.modeling_chameleon.ChameleonMLP",
    "cohere.modeling_cohere.CohereMLP",
    "cohere2.modeling_cohere2.Cohere2MLP",
    "cohere2_moe.modeling_cohere2_moe.Cohere2MoeMLP",
    "cohere_compass.modeling_cohere_compass.CohereCompassMLP",
    "csm.modeling_csm.CsmMLP",
    "cwm.modeling_cwm.CwmMLP",
    "deepseek_ocr2.modeling_deepseek_ocr2.DeepseekOcr2TextMLP",
    "deepseek_ocr2.modeling_deepseek_ocr2.DeepseekOcr2VisionMLP",
    "deepseek_v2.modeling_deepseek_v2.DeepseekV2MLP",
    "deepseek_v3.modeling_deepseek_v3.DeepseekV3MLP",
    "deepseek_v32.modeling_deepseek_v32.DeepseekV32MLP",
    "deimv2.modeling_deimv2.Deimv2SwiGLUFFN",
    "diffllama.modeling_diffllama.DiffLlamaMLP",
    "dinov2.modeling_dinov2.Dinov2SwiGLUFFN",
    "dinov2_with_registers.modeling_dinov2_with_registers.Dinov2WithRegistersSwiGLUFFN",
    "doge.modeling_doge.DogeMLP",
    "dots1.modeling_dots1.Dots1MLP",
    "emu3.modeling_emu3.Emu3MLP",
    "eomt.modeling_eomt.EomtSwiGLUFFN",
    "ernie4_5.modeling_ernie4_5.Ernie4_5MLP",
    "ernie4_5_moe.modeling_ernie4_5_moe.Ernie4_5_MoeMLP",
    "ernie4_5_vl_moe.modeling_ernie4_5_vl_moe.Ernie4_5_VLMoeMLP",
    "esmc.modeling_esmc.EsmcMLP",
    "eurobert.modeling_eurobert.EuroBertMLP",
    "evolla.modeling_evolla.EvollaMLP",
    "exaone4.modeling_exaone4.Exaone4MLP",
    "exaone4_5.modeling_exaone4_5.Exaone4_5_MLP",
    "exaone_moe.modeling_exaone_moe.ExaoneMoeMLP",
    "flex_olmo.modeling_flex_olmo.FlexOlmoMLP",
    "flint.modeling_flint.FlintMLP",
    "glm4_moe.modeling_glm4_moe.Glm4MoeMLP",
    "glm4_moe_lite.modeling_glm4_moe_lite.Glm4MoeLiteMLP",
    "glm4v.modeling_glm4v.Glm4VisionMlp",
    "glm4v_moe.modeling_glm4v_moe.Glm4vMoeTextMLP",
    "glm4v_moe.modeling_glm4v_moe.Glm4vMoeisionMlp",
    "glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaMLP",
    "glm_ocr.modeling_glm_ocr.GlmOcrVisionMlp",
    "granite.modeling_granite.GraniteMLP",
    "granite4_vision.modeling_granite4_vision.Granite4VisionTextMLP",
    "granite_swa.modeling_granite_swa.GraniteSWAMLP",
    "helium.modeling_helium.HeliumMLP",
    "higgs_audio_v2.modeling_higgs_audio_v2.HiggsAudioV2MLP",
    "hrm_text.modeling_hrm_text.HrmTextMLP",
    "hunyuan_v1_dense.modeling_hunyuan_v1_dense.HunYuanDenseV1MLP",
    "hunyuan_v1_moe.modeling_hunyuan_v1_moe.HunYuanMoEV1MLP",
    "hunyuan_vl.modeling_hunyuan_vl.HunYuanVLMLP",
    "hy_v3.modeling_hy_v3.HYV3MLP",
    "hy_v4.modeling_hy_v4.HYV4MLP",
    "hyperclovax.modeling_hyperclovax.HyperCLOVAXMLP",
    "idefics.modeling_idefics.IdeficsMLP",
    "idefics2.modeling_idefics2.Idefics2MLP",
    "jamba.modeling_jamba.JambaMLP",
    "kimi_linear.modeling_kimi_linear.KimiLinearMLP",
    "kolibri1.modeling_kolibri1.Kolibri1MLP",
    "laguna.modeling_laguna.LagunaMLP",
    "llama.modeling_llama.LlamaMLP",
    "llama4.modeling_llama4.Llama4TextMLP",
    "longcat_flash.modeling_longcat_flash.LongcatFlashMLP",
    "mellum.modeling_mellum.MellumMLP",
    "mimo_v2_flash.modeling_mimo_v2_flash.MiMoV2FlashMLP",
    "minicpm3.modeling_minicpm3.MiniCPM3MLP",
    "ministral.modeling_ministral.MinistralMLP",
    "ministral3.modeling_ministral3.Ministral3MLP",
    "mistral.modeling_mistral.MistralMLP",
    "mistral4.modeling_mistral4.Mistral4MLP",
    "mistral_large4.modeling_mistral_large4.MistralLarge4TextMLP",
    "mllama.modeling_mllama.MllamaTextMLP",
    "molmo2.modeling_molmo2.Molmo2ImageProjectorMLP",
    "molmo2.modeling_molmo2.Molmo2MLP",
    "moonshine_streaming.modeling_moonshine_streaming.MoonshinMoonshineStreamingDecoderMLP",
    "muse_glimmer.modeling_muse_glimmer.MuseGlimmerTextMLP",
    "muse_glimmer_assistant.modeling_muse_glimmer_assistant.MuseGlimmerAssistantMLP",
    "muse_spark.modeling_muse_spark.MuseSparkTextMLP",
    "nomic_bert.modeling_nomic_bert.NomicBertMLP",
    "olmo.modeling_olmo.OlmoMLP",
    "olmo2.modeling_olmo2.Olmo2MLP",
    "olmo3.modeling_olmo3.Olmo3MLP",
    "olmo_hybrid.modeling_olmo_hybrid.OlmoHybridMLP",
    "olmoe.modeling_olmoe.OlmoeMLP",
    "ovis2.modeling_ovis2.Ovis2MLP",
    "ovis2.modeling_ovis2.Ovis2VisionMLP",
    "paddleocr_vl.modeling_paddleocr_vl.PaddleOCRMLP",
    "pe_audio.modeling_pe_audio.PeAudioEncoderMLP",
    "pe_audio_video.modeling_pe_audio_video.PeAudioVideoEncoderMLP",
    "pe_video.modeling_pe_video.PeVideoEncoderMLP",
    "qwen2.modeling_qwen2.Qwen2MLP",
    "qwen2_5_omni.modeling_qwen2_5_omni.Qwen2MLP",
    "qwen2_5_omni.modeling_qwen2_5_omni.Qwen2_5OmniMLP",
    "qwen2_5_vl.modeling_qwen2_5_vl.Qwen2MLP",
    "qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLMLP",
    "qwen2_moe.modeling_qwen2_moe.Qwen2MoeMLP",
    "qwen2_vl.modeling_qwen2_vl.Qwen2MLP",
    "qwen3.modeling_qwen3.Qwen3MLP",
    "qwen3_5.modeling_qwen3_5.Qwen3_5MLP",
    "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeMLP",
    "qwen3_moe.modeling_qwen3_moe.Qwen3MoeMLP",
    "qwen3_next.modeling_qwen3_next.Qwen3NextMLP",
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeCode2WavMlp",
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeMLP",
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeTalkerTextMLP",
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeThinkerTextMLP",
    "qwen3_vl.modeling_qwen3_vl.Qwen3VLTextMLP",
    "qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeTextMLP",
    "qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextMLP",
    "radio.modeling_radio.RadioSwiGLUFFN",
    "rf_detr.modeling_rf_detr.RfDetrDinov2SwiGLUFFN",
    "sapiens2.modeling_sapiens2.Sapiens2GatedMLP",
    "smollm3.modeling_smollm3.SmolLM3MLP",
    "solar_open.modeling_solar_open.SolarOpenMLP",
    "stablelm.modeling_stablelm.StableLmMLP",
    "tipsv2.modeling_tipsv2.Tipsv2VisionSwiGLUFFN",
    "ultrabert.modeling_ultrabert.UltrabertMLP",
    "unlimited_ocr.modeling_unlimited_ocr.UnlimitedOcrTextMLP",
    "videomt.modeling_videomt.VideomtGatedMLP",
    "videomt.modeling_videomt.VideomtSwiGLUFFN",
    "voxtral_realtime.modeling_voxtral_realtime.VoxtralRealtimeMLP",
    "voxtral_realtime.modeling_voxtral_realtime.VoxtralRealtimeTextMLP",
    "youtu.modeling_youtu.YoutuMLP",
)

# layer SwiGLUGateUpMLP: gate, up = gate_up_proj(x).chunk(2, -1); down_proj(up * activation_fn(gate))
_GATE_UP = (
    "dia.modeling_dia.DiaMLP",
    "esmfold2.modeling_esmfold2.EsmFold2SwiGLU",
    "glm.modeling_glm.GlmMLP",
    "glm4.modeling_glm4.Glm4MLP",
    "glm4v.modeling_glm4v.Glm4vTextMLP",
    "glm_image.modeling_glm_image.GlmImageTextMLP",
    "glm_ocr.modeling_glm_ocr.GlmOcrTextMLP",
    "phi3.modeling_phi3.Phi3MLP",
    "phi4_multimodal.modeling_phi4_multimodal.Phi4MultimodalMLP",
)

# layer GeGLUMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)), GELU-tanh (gelu_pytorch_tanh) from the config
_GEGLU = (
    "diffusion_gemma.modeling_diffusion_gemma.DiffusionGemmaText4MLP",
    "embedding_gemma2.modeling_embedding_gemma2.EmbeddingGemma2MLP",
    "gemma.modeling_gemma.GemmaMLP",
    "gemma2.modeling_gemma2.Gemma2MLP",
    "gemma3.modeling_gemma3.Gemma3MLP",
    "gemma4.modeling_gemma4.Gemma4TextMLP",
    "gemma4_unified.modeling_gemma4_unified.Gemma4UnifiedTextMLP",
    "recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaMlp",
    "vaultgemma.modeling_vaultgemma.VaultGemmaMLP",
)

SWAPPED: dict[str, tuple[str, ...]] = {"SwiGLUMLP": _SPLIT, "SwiGLUGateUpMLP": _GATE_UP, "GeGLUMLP": _GEGLU}
"""Layer -> the MLP classes it replaces."""

_GELU = "GELU activation (erf): npu_geglu's approximate=0, not fused yet"
_T5_GATED = (
    "T5's gated MLP (wi_0, wi_1, wo): dropout between the gate and wo, and a cast to wo's dtype (gelu_new, the tanh "
    "formula in Python ops, by default)"
)
_CLAMPED = "clamps the gate/up activations"
_DROPOUT = "dropout in training"
_NORM_INSIDE = "a norm inside the block (a patch merger)"

LEFT_OUT: dict[str, str] = {
    "bitnet.modeling_bitnet.BitNetMLP": "ReLU-squared activation and a norm inside the block",
    "deepseek_v4.modeling_deepseek_v4.DeepseekV4MLP": _CLAMPED,
    "diffusion_gemma.modeling_diffusion_gemma.DiffusionGemmaSelfConditioning": "GELU-tanh, norm, 2nd input",
    "dinov3_vit.modeling_dinov3_vit.DINOv3ViTGatedMLP": _GELU,
    "doge.modeling_doge.DogeCDMoE": "activation sparsity (Gaussian top-k) and a mixture branch",
    "eomt_dinov3.modeling_eomt_dinov3.EomtDinov3GatedMLP": _GELU,
    "falcon_h1.modeling_falcon_h1.FalconH1MLP": "scales the gate input and the output by config.mlp_multipliers",
    "gemma3n.modeling_gemma3n.Gemma3nTextMLP": "GELU-tanh, with activation sparsity in some layers",
    "gemma4.modeling_gemma4.Gemma4VisionMLP": "GELU-tanh, with clippable linears (clamped inputs and outputs)",
    "glm4v.modeling_glm4v.Glm4vVisionPatchMerger": _NORM_INSIDE,
    "glm4v_moe.modeling_glm4v_moe.Glm4vMoeVisionPatchMerger": _NORM_INSIDE,
    "glm5_next.modeling_glm5_next.Glm5NextTextMLP": _CLAMPED,
    "glm5_next.modeling_glm5_next.Glm5NextVisionMLP": _CLAMPED,
    "glm5_next.modeling_glm5_next.Glm5NextVisionPatchMerger": "clamps, with a norm inside the block",
    "glm_ocr.modeling_glm_ocr.GlmOcrVisionPatchMerger": _NORM_INSIDE,
    "gte.modeling_gte.GteMLP": "GELU, with dropout in training",
    "inkling.modeling_inkling.InklingMLP": "scales the output by global_scale",
    "inkling.modeling_inkling.InklingSharedExperts": "stacked expert parameters, not Linears",
    "minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLDenseMLP": "clamps and scales the gate",
    "phi4_multimodal.modeling_phi4_multimodal.Phi4MultimodalAudioMLP": "dropout and a norm inside",
    "pixtral.modeling_pixtral.PixtralMLP": _GELU,
    "seed_oss.modeling_seed_oss.SeedOssMLP": _DROPOUT,
    "step3p7.modeling_step3p7.Step3p7MLP": _CLAMPED,
    "t5gemma.modeling_t5gemma.T5GemmaMLP": "GELU-tanh, with dropout in training",
    "t5gemma2.modeling_t5gemma2.T5Gemma2MLP": "GELU-tanh, with dropout in training",
    "vibevoice.modeling_vibevoice.VibeVoiceMLP": _GELU,
    "zamba.modeling_zamba.ZambaMLP": _GELU,
    "zamba2.modeling_zamba2.Zamba2MLP": "GELU, with an adapter term",
    "kosmos2_5.modeling_kosmos2_5.Kosmos2_5VisionMlp": _T5_GATED,
    "longt5.modeling_longt5.LongT5DenseGatedActDense": _T5_GATED,
    "mt5.modeling_mt5.MT5DenseGatedActDense": _T5_GATED,
    "pix2struct.modeling_pix2struct.Pix2StructTextDenseGatedActDense": _T5_GATED,
    "pix2struct.modeling_pix2struct.Pix2StructVisionMlp": _T5_GATED,
    "pop2piano.modeling_pop2piano.Pop2PianoDenseGatedActDense": _T5_GATED,
    "t5.modeling_t5.T5DenseGatedActDense": _T5_GATED,
    "udop.modeling_udop.UdopDenseGatedActDense": _T5_GATED,
    "umt5.modeling_umt5.UMT5DenseGatedActDense": _T5_GATED,
}


def candidates() -> set[str]:
    """The classes that look like this card's region.

    Those are every class whose own __init__ builds a gate_up_proj Linear, or both gate_proj and up_proj, or T5's
    gated pair wi_0 and wi_1.
    """
    found = set()
    for definition in _survey.classes():
        init = definition.method_source("__init__")
        split = "self.gate_proj =" in init and "self.up_proj =" in init
        t5_gated = "self.wi_0 =" in init and "self.wi_1 =" in init
        if "self.gate_up_proj = nn.Linear(" in init or split or t5_gated:
            found.add(definition.path)
    return found
