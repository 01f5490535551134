"""npu-moe-router: the transformers MoE router classes its layers replace, and those it leaves out.

Established from the forward of every router class of transformers 5.22.2 (classes named *Router,
*TopkRouter, *TopKRouter, *Gate that route tokens to experts), grouped by identical source, each group
compared with what npu_moe_gating_top_k computes (docs/torch-npu-ops.md); re-proved per class by
tests/test_npu_moe_router.py on a bare instance, in float32 and bfloat16.
"""

from __future__ import annotations

from . import _survey

_SOFTMAX = (  # softmax in float32, top-k, renormalised when norm_topk_prob, cast to the logits' dtype
    "flex_olmo.modeling_flex_olmo.FlexOlmoTopKRouter",
    "mellum.modeling_mellum.MellumTopKRouter",
    "olmoe.modeling_olmoe.OlmoeTopKRouter",
    "qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter",
    "qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter",
    "qwen3_next.modeling_qwen3_next.Qwen3NextTopKRouter",
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeTalkerTextTopKRouter",
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeThinkerTextTopKRouter",
    "qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextTopKRouter",
)
_RENORMALISED = (  # softmax in float32, top-k, always renormalised, cast to the logits' dtype
    "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeTopKRouter",
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeTextTopKRouter",
    "qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeTextTopKRouter",
)
_RENORMALISED_FLOAT32 = (  # softmax of the float32 logits, top-k, always renormalised, weights left in float32
    "minimax.modeling_minimax.MiniMaxTopKRouter",
    "mixtral.modeling_mixtral.MixtralTopKRouter",
)
_SIGMOID_GROUPS = (  # float32 logits, sigmoid, top-2-sum group top-k on scores + bias (-inf), renormalised, scaled
    "axk1.modeling_axk1.AXK1TopkRouter",
    "bailing_hybrid.modeling_bailing_hybrid.BailingHybridTopkRouter",
    "deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter",
    "deepseek_v32.modeling_deepseek_v32.DeepseekV32TopkRouter",
    "dots1.modeling_dots1.Dots1TopkRouter",
    "exaone_moe.modeling_exaone_moe.ExaoneMoeTopkRouter",
    "glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter",
    "glm4_moe_lite.modeling_glm4_moe_lite.Glm4MoeLiteTopkRouter",
    "glm4v_moe.modeling_glm4v_moe.Glm4vMoeTextTopkRouter",
    "glm5_next.modeling_glm5_next.Glm5NextTextTopkRouter",
    "glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaTopkRouter",
    "hy_v4.modeling_hy_v4.HYV4TopkRouter",
    "kimi_linear.modeling_kimi_linear.KimiLinearTopkRouter",
    "mimo_v2_flash.modeling_mimo_v2_flash.MiMoV2FlashTopkRouter",
    "nemotron_h.modeling_nemotron_h.NemotronHTopkRouter",
    "solar_open.modeling_solar_open.SolarOpenTopkRouter",
)

SWAPPED: dict[str, tuple[str, ...]] = {
    "SoftmaxTopKRouter": _SOFTMAX,
    "RenormalisedSoftmaxTopKRouter": _RENORMALISED,
    "RenormalisedFloat32SoftmaxTopKRouter": _RENORMALISED_FLOAT32,
    "SigmoidGroupTopKRouter": _SIGMOID_GROUPS,
}
"""Layer -> the router classes it replaces. Per call, a fused op runs only where it is exact and the device has
its backward: softmax routers with norm_topk_prob False where autograd does not record, sigmoid routers with
norm_topk_prob True; renormalised softmax routers run npu_moe_gating_top_k_softmax_v2 where autograd does not record
(and the weights are in the logits' dtype), else the softmax of their top-k logits (two ops); the others keep the
class's math."""

_SOFTMAX_OF_TOP_LOGITS = "top-k on the logits, softmax over the k chosen: the op's softmax is over all experts"
_NO_RENORM_SIGMOID = (
    "sigmoid weights not renormalised (or with another eps): the op's sigmoid mode divides by sum+1e-20"
)
_UNGROUPED_BIASED_SIGMOID = "sigmoid top-k on scores + bias, renormalised without eps or in another order"
_SOFTMAX_GROUPS = "softmax groups, dropped ones filled with 0 (the op fills -inf), renormalised"
_OTHER_INPUTS = "takes more than hidden_states (bias or input ids passed in): another forward signature"

LEFT_OUT: dict[str, str] = {
    "afmoe.modeling_afmoe.AfmoeTokenChoiceRouter": _OTHER_INPUTS,
    "aria.modeling_aria.AriaTextTopKRouter": _SOFTMAX_OF_TOP_LOGITS,
    "axk2.modeling_axk2.AXK2TopkRouter": "optional groups, dropped groups filled with 0 (the op fills -inf)",
    "beam.modeling_beam.BeamTopKRouter": "no routed_scaling_factor and sorted top-k; not surveyed numerically",
    "cohere2_moe.modeling_cohere2_moe.Cohere2MoeTopKRouter": _SOFTMAX_OF_TOP_LOGITS,
    "dbrx.modeling_dbrx.DbrxRouter": "returns logits only; routing happens in the experts",
    "deepseek_ocr2.modeling_deepseek_ocr2.DeepseekOcr2TextTopkRouter": "softmax groups scored by max, dropped ones 0",
    "deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter": "softmax groups scored by max, dropped ones 0",
    "deepseek_v4.modeling_deepseek_v4.DeepseekV4TopKRouter": "configurable score function (sqrt-softplus)",
    "deepseek_v4.modeling_deepseek_v4.DeepseekV4HashRouter": _OTHER_INPUTS,
    "diffusion_gemma.modeling_diffusion_gemma.DiffusionGemmaTextRouter": "norm inside, per-expert scales",
    "ernie4_5_moe.modeling_ernie4_5_moe.Ernie4_5_MoeTopKRouter": "renormalised with a clamp (moe_norm_min)",
    "ernie4_5_vl_moe.modeling_ernie4_5_vl_moe.Ernie4_5_VLMoeMoeTopKRouter": "renormalised with a clamp",
    "flint.modeling_flint.FlintTopKRouter": _NO_RENORM_SIGMOID,
    "gemma4.modeling_gemma4.Gemma4TextRouter": "norm inside, per-expert scales",
    "gpt_oss.modeling_gpt_oss.GptOssTopKRouter": _SOFTMAX_OF_TOP_LOGITS,
    "granitemoe.modeling_granitemoe.GraniteMoeTopKRouter": _SOFTMAX_OF_TOP_LOGITS,
    "granitemoe_swa.modeling_granitemoe_swa.GraniteMoeSWATopKRouter": _SOFTMAX_OF_TOP_LOGITS,
    "granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridTopKRouter": _SOFTMAX_OF_TOP_LOGITS,
    "granitemoeshared.modeling_granitemoeshared.GraniteMoeSharedTopKRouter": _SOFTMAX_OF_TOP_LOGITS,
    "hunyuan_v1_moe.modeling_hunyuan_v1_moe.HunYuanMoEV1Gate": "its logits from an nn.Linear (wg), in float32",
    "hy_v3.modeling_hy_v3.HYV3TopKRouter": _OTHER_INPUTS,
    "inkling.modeling_inkling.InklingTopkRouter": "shared-expert logits, log-sigmoid weights",
    "jamba.modeling_jamba.JambaTopKRouter": "weights cast to the hidden states' dtype; not surveyed numerically",
    "kolibri1.modeling_kolibri1.Kolibri1TopKRouter": "chooses on logits + bias, sigmoid after the top-k",
    "laguna.modeling_laguna.LagunaTopKRouter": "optional logit soft-capping",
    "lfm2_moe.modeling_lfm2_moe.Lfm2MoeTopKRouter": _OTHER_INPUTS,
    "llama4.modeling_llama4.Llama4Router": "sigmoid of the top-k logits, scores scattered over all experts",
    "longcat_flash.modeling_longcat_flash.LongcatFlashTopkRouter": "its own top-k (zero experts, correction bias)",
    "minimax_m2.modeling_minimax_m2.MiniMaxM2TopKRouter": _OTHER_INPUTS,
    "minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLTopKRouter": _UNGROUPED_BIASED_SIGMOID,
    "mistral4.modeling_mistral4.Mistral4TopkRouter": _SOFTMAX_GROUPS,
    "mistral_large4.modeling_mistral_large4.MistralLarge4TextTopkRouter": _SOFTMAX_GROUPS,
    "muse_spark.modeling_muse_spark.MuseSparkTopkRouter": "logit multiplier, renormalisation eps 1e-15",
    "nllb_moe.modeling_nllb_moe.NllbMoeTop2Router": "capacity-limited top-2 dispatch masks",
    "openai_privacy_filter.modeling_openai_privacy_filter.OpenAIPrivacyFilterTopKRouter": _SOFTMAX_OF_TOP_LOGITS,
    "phimoe.modeling_phimoe.PhimoeTopKRouter": "sparsemixer routing",
    "step3p7.modeling_step3p7.Step3p7TopKRouter": _UNGROUPED_BIASED_SIGMOID,
    "switch_transformers.modeling_switch_transformers.SwitchTransformersTop1Router": "capacity-limited top-1",
    "unlimited_ocr.modeling_unlimited_ocr.UnlimitedOcrTextTopkRouter": "softmax groups scored by max, dropped ones 0",
    "zaya.modeling_zaya.ZayaRouter": "MLP router with a skip class",
    "zaya.modeling_zaya.ZayaRouterMLP": "an MLP producing logits, no routing",
}
"""Router class -> why no layer reproduces it."""


def candidates() -> set[str]:
    """The classes that look like this card's region.

    Those are every class named like a Router, and every Gate whose forward takes a top-k.
    """
    return {
        c.path
        for c in _survey.classes()
        if "Router" in c.name or (c.name.endswith("Gate") and "topk" in c.method_source("forward"))
    }
