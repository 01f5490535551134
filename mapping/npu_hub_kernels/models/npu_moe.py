"""npu-moe: the transformers v5 Experts classes its layer replaces, and those it leaves out.

Layer SwiGLUExperts: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I], act SiLU,
forward(hidden_states, top_k_index, top_k_weights). Established by a numerical survey of every class of
transformers 5.22.2 with 3-D expert weights against an fp64 loop of that formula (random routing, an
expert with no tokens, large inputs to trip clamps); re-proved by tests/test_model_table_parity.py and
tests/test_npu_moe.py.
"""

from __future__ import annotations

from . import _survey

_EXPERTS = (
    "afmoe.modeling_afmoe.AfmoeExperts",
    "axk1.modeling_axk1.AXK1Experts",
    "axk2.modeling_axk2.AXK2Experts",
    "bailing_hybrid.modeling_bailing_hybrid.BailingHybridExperts",
    "beam.modeling_beam.BeamExperts",
    "cohere2_moe.modeling_cohere2_moe.Cohere2MoeExperts",
    "deepseek_ocr2.modeling_deepseek_ocr2.DeepseekOcr2TextExperts",
    "deepseek_v2.modeling_deepseek_v2.DeepseekV2Experts",
    "deepseek_v3.modeling_deepseek_v3.DeepseekV3Experts",
    "deepseek_v32.modeling_deepseek_v32.DeepseekV32Experts",
    "dots1.modeling_dots1.Dots1Experts",
    "ernie4_5_moe.modeling_ernie4_5_moe.Ernie4_5_MoeExperts",
    "ernie4_5_vl_moe.modeling_ernie4_5_vl_moe.Ernie4_5_VLMoeMoeExperts",
    "exaone_moe.modeling_exaone_moe.ExaoneMoeExperts",
    "flex_olmo.modeling_flex_olmo.FlexOlmoExperts",
    "flint.modeling_flint.FlintExperts",
    "glm4_moe.modeling_glm4_moe.Glm4MoeExperts",
    "glm4_moe_lite.modeling_glm4_moe_lite.Glm4MoeLiteExperts",
    "glm4v_moe.modeling_glm4v_moe.Glm4vMoeTextExperts",
    "glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaExperts",
    "granitemoe.modeling_granitemoe.GraniteMoeExperts",
    "granitemoe_swa.modeling_granitemoe_swa.GraniteMoeSWAExperts",
    "granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridExperts",
    "granitemoeshared.modeling_granitemoeshared.GraniteMoeSharedExperts",
    "hunyuan_v1_moe.modeling_hunyuan_v1_moe.HunYuanMoEV1Experts",
    "hy_v3.modeling_hy_v3.HYV3Experts",
    "inkling.modeling_inkling.InklingExperts",
    "jamba.modeling_jamba.JambaExperts",
    "kimi_linear.modeling_kimi_linear.KimiLinearExperts",
    "kolibri1.modeling_kolibri1.Kolibri1Experts",
    "laguna.modeling_laguna.LagunaExperts",
    "lfm2_moe.modeling_lfm2_moe.Lfm2MoeExperts",
    "mellum.modeling_mellum.MellumExperts",
    "mimo_v2_flash.modeling_mimo_v2_flash.MiMoV2FlashExperts",
    "minimax.modeling_minimax.MiniMaxExperts",
    "minimax_m2.modeling_minimax_m2.MiniMaxM2Experts",
    "mistral4.modeling_mistral4.Mistral4Experts",
    "mistral_large4.modeling_mistral_large4.MistralLarge4TextExperts",
    "mixtral.modeling_mixtral.MixtralExperts",
    "olmoe.modeling_olmoe.OlmoeExperts",
    "phimoe.modeling_phimoe.PhimoeExperts",
    "qwen2_moe.modeling_qwen2_moe.Qwen2MoeExperts",
    "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeExperts",
    "qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts",
    "qwen3_next.modeling_qwen3_next.Qwen3NextExperts",
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeTalkerTextExperts",
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeThinkerTextExperts",
    "qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeTextExperts",
    "qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextExperts",
    "solar_open.modeling_solar_open.SolarOpenExperts",
    "unlimited_ocr.modeling_unlimited_ocr.UnlimitedOcrTextExperts",
    "zaya.modeling_zaya.ZayaExperts",
)

SWAPPED: dict[str, tuple[str, ...]] = {"SwiGLUExperts": _EXPERTS}
"""Layer -> the Experts classes it replaces."""

_CLAMPED_EXPERTS = "clamps gate and up at a limit: equal only below it"
_GATED_SIGMOID = "clamp, sigmoid(alpha * gate) instead of SiLU, (up + 1)"
_DENSE_MODULES = "separate dense expert modules, no 3-D weights"

LEFT_OUT: dict[str, str] = {
    "aria.modeling_aria.AriaExperts": "weights stored transposed ([E, H, 2I], used as x @ W)",
    "aria.modeling_aria.AriaSharedExpertsMLP": "shared experts applied to every token, not top-k routed",
    "dbrx.modeling_dbrx.DbrxExperts": "2-D stacked w1/v1/w2 weights, w2 used as x @ W",
    "deepseek_v4.modeling_deepseek_v4.DeepseekV4Experts": _CLAMPED_EXPERTS,
    "diffusion_gemma.modeling_diffusion_gemma.DiffusionGemmaTextExperts": "GELU-tanh activation",
    "gemma4.modeling_gemma4.Gemma4TextExperts": "GELU-tanh activation",
    "glm5_next.modeling_glm5_next.Glm5NextTextExperts": _CLAMPED_EXPERTS,
    "gpt_oss.modeling_gpt_oss.GptOssExperts": "interleaved gate/up, biases, clamp, sigmoid(alpha * gate), (up + 1)",
    "hy_v4.modeling_hy_v4.HYV4Experts": _CLAMPED_EXPERTS,
    "inkling.modeling_inkling.InklingSharedExperts": "shared experts applied to every token, not top-k routed",
    "jetmoe.modeling_jetmoe.JetMoeParallelExperts": "forward(inputs, expert_size): another interface",
    "llama4.modeling_llama4.Llama4TextExperts": "dense bmm over all experts on router-scaled inputs",
    "longcat_flash.modeling_longcat_flash.LongcatFlashExperts": "zero (identity) experts above n_routed_experts",
    "minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLExperts": _GATED_SIGMOID,
    "muse_spark.modeling_muse_spark.MuseSparkExperts": "an RMSNorm on each expert output",
    "nemotron_h.modeling_nemotron_h.NemotronHExperts": "no gate: down(relu(up x) ** 2)",
    "nllb_moe.modeling_nllb_moe.NllbMoeExperts": _DENSE_MODULES,
    "openai_privacy_filter.modeling_openai_privacy_filter.OpenAIPrivacyFilterExperts": _GATED_SIGMOID,
    "step3p7.modeling_step3p7.Step3p7Experts": "a per-layer clamp limit (Step-3.7-Flash clamps some layers)",
    "switch_transformers.modeling_switch_transformers.SwitchTransformersExperts": _DENSE_MODULES,
}


def candidates() -> set[str]:
    """The classes that look like this card's region.

    Those are every class with its own __init__ named like Experts, or holding 3-D expert weights (a gate_up_proj
    Parameter).
    """
    return {
        c.path
        for c in _survey.classes()
        if c.method("__init__") is not None
        and ("Experts" in c.name or "self.gate_up_proj = nn.Parameter(" in c.method_source("__init__"))
    }
