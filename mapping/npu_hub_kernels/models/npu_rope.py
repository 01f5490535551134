"""npu-rope: the transformers rotary functions each layer replaces, and those it leaves out.

The listed objects are the module-level `apply_rotary_pos_emb(_interleave)` functions of the modeling
files; transformers turns most of them into function-modules, and the registry wraps the rest (see
`npu_hub_kernels.retag`). Established by a numerical survey of every such function of transformers
5.22.2 against each rotary style (float32 and bfloat16, full and narrower cos/sin), and re-proved per
function by tests/test_model_table_parity.py.
"""

from __future__ import annotations

from . import _survey

SWAPPED: dict[str, tuple[str, ...]] = {
    # LlamaModel's q * cos + rotate_half(q) * sin, cos/sin as wide as q/k (narrower ones fail, as they fail there)
    "RotaryPosEmb": (
        "afmoe.modeling_afmoe.apply_rotary_pos_emb",
        "apertus.modeling_apertus.apply_rotary_pos_emb",
        "arcee.modeling_arcee.apply_rotary_pos_emb",
        "aria.modeling_aria.apply_rotary_pos_emb",
        "axk1.modeling_axk1.apply_rotary_pos_emb",
        "axk2.modeling_axk2.apply_rotary_pos_emb",
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
        "glm4_moe_lite.modeling_glm4_moe_lite.apply_rotary_pos_emb",
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
        "lasr.modeling_lasr.apply_rotary_pos_emb",
        "lfm2.modeling_lfm2.apply_rotary_pos_emb",
        "lfm2_moe.modeling_lfm2_moe.apply_rotary_pos_emb",
        "llama.modeling_llama.apply_rotary_pos_emb",
        "mellum.modeling_mellum.apply_rotary_pos_emb",
        "mimi.modeling_mimi.apply_rotary_pos_emb",
        "minicpm3.modeling_minicpm3.apply_rotary_pos_emb",
        "minimax.modeling_minimax.apply_rotary_pos_emb",
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
        "nemotron_asr_streaming.modeling_nemotron_asr_streaming.apply_rotary_pos_emb",
        "nemotron_h.modeling_nemotron_h.apply_rotary_pos_emb",
        "neucodec.modeling_neucodec.apply_rotary_pos_emb",
        "nomic_bert.modeling_nomic_bert.apply_rotary_pos_emb",
        "olmoe.modeling_olmoe.apply_rotary_pos_emb",
        "paddleocr_vl.modeling_paddleocr_vl.apply_rotary_pos_emb",
        "parakeet.modeling_parakeet.apply_rotary_pos_emb",
        "persimmon.modeling_persimmon.apply_rotary_pos_emb",
        "phi.modeling_phi.apply_rotary_pos_emb",
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
        "qwen3_moe.modeling_qwen3_moe.apply_rotary_pos_emb",
        "qwen3_omni_moe.modeling_qwen3_omni_moe.apply_rotary_pos_emb",
        "qwen3_vl.modeling_qwen3_vl.apply_rotary_pos_emb",
        "qwen3_vl_moe.modeling_qwen3_vl_moe.apply_rotary_pos_emb",
        "seed_oss.modeling_seed_oss.apply_rotary_pos_emb",
        "smollm3.modeling_smollm3.apply_rotary_pos_emb",
        "solar_open.modeling_solar_open.apply_rotary_pos_emb",
        "stablelm.modeling_stablelm.apply_rotary_pos_emb",
        "starcoder2.modeling_starcoder2.apply_rotary_pos_emb",
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
    ),
    # the same, where narrower cos/sin rotate the leading dims and pass the rest (Phi3, GPT-NeoX, Qwen3-Next)
    "RotaryPosEmbPartial": (
        "bamba.modeling_bamba.apply_rotary_pos_emb",
        "glm4_moe.modeling_glm4_moe.apply_rotary_pos_emb",
        "glm4v_moe.modeling_glm4v_moe.apply_rotary_pos_emb",
        "glm_image.modeling_glm_image.apply_rotary_pos_emb",
        "gpt_neox.modeling_gpt_neox.apply_rotary_pos_emb",
        "laguna.modeling_laguna.apply_rotary_pos_emb",
        "mimo_v2_flash.modeling_mimo_v2_flash.apply_rotary_pos_emb",
        "minimax_m2.modeling_minimax_m2.apply_rotary_pos_emb",
        "minimax_m3_vl.modeling_minimax_m3_vl.apply_rotary_pos_emb",
        "nemotron.modeling_nemotron.apply_rotary_pos_emb",
        "neomme.modeling_neomme.apply_rotary_pos_emb",
        "phi3.modeling_phi3.apply_rotary_pos_emb",
        "phi4_multimodal.modeling_phi4_multimodal.apply_rotary_pos_emb",
        "qwen3_5.modeling_qwen3_5.apply_rotary_pos_emb",
        "qwen3_5_moe.modeling_qwen3_5_moe.apply_rotary_pos_emb",
        "qwen3_next.modeling_qwen3_next.apply_rotary_pos_emb",
        "recurrent_gemma.modeling_recurrent_gemma.apply_rotary_pos_emb",
        "step3p7.modeling_step3p7.apply_rotary_pos_emb",
        "zaya.modeling_zaya.apply_rotary_pos_emb",
    ),
    # RotaryPosEmbPartial with the older (q, k, cos, sin, position_ids=None, unsqueeze_dim=1) signature
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
    "RotaryPosEmbPairs": ("blt.modeling_blt.apply_rotary_pos_emb",),
    # the same, where narrower cos/sin rotate the leading dims
    "RotaryPosEmbPairsPartial": (
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
        "helium.modeling_helium.apply_rotary_pos_emb",
        "pe_audio.modeling_pe_audio.apply_rotary_pos_emb",
        "pe_audio_video.modeling_pe_audio_video.apply_rotary_pos_emb",
        "pe_video.modeling_pe_video.apply_rotary_pos_emb",
    ),
    # the same, where narrower cos/sin rotate the leading dims
    "RotaryPosEmbGlmPartial": (
        "glm.modeling_glm.apply_rotary_pos_emb",
        "glm4.modeling_glm4.apply_rotary_pos_emb",
        "moonshine.modeling_moonshine.apply_rotary_pos_emb",
        "moonshine_streaming.modeling_moonshine_streaming.apply_rotary_pos_emb",
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
"""Layer -> the rotary functions it replaces."""

_ONE_TENSOR = "rotates one tensor (x, cos, sin): no (q, k) layer has that signature"
_ONE_TENSOR_SIN_FIRST = "rotates one tensor, (tensor, sin, cos), GPT-J pairs with cos/sin per pair"
_PATCHES_ONLY = "rotates only the patch tokens after the prefix tokens (**kwargs signature)"
_K_NONE = "some callers pass k=None to rotate q alone; the layers rotate both"

LEFT_OUT: dict[str, str] = {
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


def candidates() -> set[str]:
    """The functions that look like this card's region.

    Those are every module-level apply_rotary_pos_emb(_interleave) a modeling file binds (defined, assigned or
    imported; decorated or not).
    """
    return set(_survey.module_names(("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave")))
