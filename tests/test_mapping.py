"""The npu mapping on tiny random-weight models: what is swapped, that the fused op ran, and parity.

Parity in bfloat16 follows flash-attention's idiom at model level: the kernelized model's error
against the float32 eager model is at most twice the eager bfloat16 model's error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch
from conftest import run_python
from kernels import Mode, kernelize, use_kernel_mapping
from numerics import max_error, relative_error, train_steps
from transformers import AutoModelForCausalLM
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from npu_hub_kernels import (
    apply_npu_kernels,
    available_kernels,
    register_npu_kernels,
    select_kernels,
    swapped_modules,
    unregister_npu_kernels,
)
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import (
    TINY_CONFIGS,
    gating_op_routers,
    norm_module_count,
    renormalised_op_routers,
    token_ids,
)
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm as tiny_model


@dataclass(frozen=True)
class Expected:
    """What each card swaps into a tiny model of one family."""

    norm: str | None = "RMSNorm"  # the npu-rms-norm layer of its norms (None: LayerNorm)
    rope: tuple[str, ...] = ("RotaryPosEmb",)  # the npu-rope layers of each attention module
    mlp: str | None = "SwiGLUMLP"  # the npu-swiglu layer of its dense MLPs (None: neither SiLU- nor GELU-tanh-gated)
    moe: bool = False  # whether its MoE layers' Experts modules run npu-moe
    router: bool = False  # whether its MoE routers run npu-moe-router's fused op (one per MoE layer)
    decoder: str | None = None  # the npu-add-rms-norm layer of its decoder layers (None: not swapped)


EXPECTED = {
    "llama": Expected(decoder="DecoderLayer"),
    "mistral": Expected(decoder="DecoderLayer"),
    "qwen2": Expected(decoder="DecoderLayer"),
    "qwen3": Expected(decoder="DecoderLayer"),
    "qwen3_moe": Expected(moe=True, router=True, decoder="DecoderLayer"),  # routed experts only: no dense MLP
    "gemma3_text": Expected(norm="RMSNormZeroCentered", mlp="GeGLUMLP"),  # GELU-tanh MLP: npu_geglu
    "olmo2": Expected(norm="RMSNormFloat32Scale", rope=("RotaryPosEmbCastBack",)),
    "phi3": Expected(rope=("RotaryPosEmbPartial",), mlp="SwiGLUGateUpMLP"),  # partial rotary
    "glm4": Expected(rope=("RotaryPosEmbGlmPartial",), mlp="SwiGLUGateUpMLP"),
    "gpt_neox": Expected(norm=None, rope=("RotaryPosEmbPartial",), mlp=None),  # LayerNorm, GELU MLP, partial rotary
    # DeepseekV3Attention calls apply_rotary_pos_emb_interleave (rope_interleave=True), else apply_rotary_pos_emb:
    # the registry attaches both, so both are swapped; the fused op counts show which one runs.
    "deepseek_v3": Expected(
        rope=("RotaryPosEmb", "RotaryPosEmbDeinterleave"), moe=True, router=True, decoder="DecoderLayer"
    ),  # + shared experts
    "qwen2_moe": Expected(moe=True, router=True, decoder="DecoderLayer"),  # + shared expert (npu-swiglu)
    "mixtral": Expected(moe=True, router=True),  # renormalised softmax: npu_moe_gating_top_k_softmax_v2 without grad
    "olmoe": Expected(moe=True, router=True, decoder="DecoderLayer"),
    "granite": Expected(),
    "cohere": Expected(norm=None, rope=("RotaryPosEmbPairsFloat32",)),
    "olmo": Expected(norm=None, rope=("RotaryPosEmbCastBack",)),
    "helium": Expected(norm="RMSNormFloat32Scale", rope=("RotaryPosEmbGlm",), decoder="DecoderLayerFloat32Scale"),
    "smollm3": Expected(decoder="DecoderLayer"),
    "gemma2": Expected(norm="RMSNormZeroCentered", mlp="GeGLUMLP"),  # GELU-tanh MLP: npu_geglu
    "gpt2": Expected(norm=None, rope=(), mlp=None),  # LayerNorm, learned positions, GELU MLP
    "qwen2_5_vl": Expected(),  # mrope
}
MODEL_TYPES = list(EXPECTED)


def test_every_tiny_model_has_expectations():
    assert set(EXPECTED) == set(TINY_CONFIGS)


def layer_count(model) -> int:
    return model.config.get_text_config().num_hidden_layers


def gated_mlp_count(model) -> int:
    """Dense MLP-like modules of the language model: a gate_proj or gate_up_proj Linear (SiLU or not)."""
    return sum(
        isinstance(getattr(m, "gate_proj", None), torch.nn.Linear)
        or isinstance(getattr(m, "gate_up_proj", None), torch.nn.Linear)
        for m in model.get_decoder().modules()
    )


def experts_count(model) -> int:
    """Experts modules (3-D gate_up_proj) of the language model."""
    return sum(
        getattr(getattr(m, "gate_up_proj", None), "dim", lambda: 0)() == 3 for m in model.get_decoder().modules()
    )


def expected_calls(model_type: str, model, backward: bool = False, recording: bool | None = None) -> dict[str, int]:
    """Fused op calls of one forward (and backward) of a kernelized model: per Experts module one
    permute, two grouped matmuls (four more in backward: dx and dW of each), one swiglu, one unpermute; per dense
    gated MLP one npu_swiglu, or one npu_geglu for a GELU-tanh one (GeGLUMLP); per router
    that calls the op (`gating_op_routers`: not a softmax router while autograd records) one npu_moe_gating_top_k
    (its backward is the op's derivative, no call of its own), per renormalised softmax router where autograd does not
    record one npu_moe_gating_top_k_softmax_v2 (`renormalised_op_routers`); per fused decoder
    layer one npu_add_rms_norm in place of its post_attention_layernorm's npu_rms_norm, and one
    npu_rms_norm_backward in backward; per attention layer one npu_fusion_attention where the card is the model's
    attention. Where autograd records nothing (`recording`, by default `backward`), zero-centred norms run as
    npu_gemma_rms_norm instead of npu_rms_norm."""
    expected = EXPECTED[model_type]
    experts = experts_count(model) if expected.moe else 0
    decoders = layer_count(model) if expected.decoder else 0
    dense = gated_mlp_count(model) if expected.mlp else 0
    geglu = dense if expected.mlp == "GeGLUMLP" else 0
    one_kernel = expected.norm == "RMSNormZeroCentered" and not (backward if recording is None else recording)
    calls = {
        "npu_gemma_rms_norm" if one_kernel else "npu_rms_norm": norm_module_count(model) - decoders,
        "npu_add_rms_norm": decoders,
        "npu_rms_norm_backward": decoders if backward else 0,
        "npu_rotary_mul": 2 * layer_count(model) if expected.rope else 0,
        "npu_swiglu": dense - geglu + experts,
        "npu_geglu": geglu,
        "npu_moe_token_permute": experts,
        "npu_grouped_matmul": (6 if backward else 2) * experts,
        "npu_moe_token_unpermute": experts,
        "npu_moe_gating_top_k": gating_op_routers(model, training=backward) if expected.router else 0,
        "npu_moe_gating_top_k_softmax_v2": renormalised_op_routers(model, training=backward) if expected.router else 0,
        "npu_fusion_attention": attention_calls(model),
    }
    return {op: n for op, n in calls.items() if n}


def attention_calls(model) -> int:
    """npu_fusion_attention calls of one forward: one per attention layer where npu-fused-attention is the model's
    attention (apply_npu_kernels selects it where the model's was sdpa), none elsewhere (its backward has none)."""
    return layer_count(model) if model.config._attn_implementation == "npu_fused_attention" else 0


def forward(model, ids, embeds=None):
    """Logits as float32 on the host; gradients only flow from inputs_embeds that require them."""
    device = next(model.parameters()).device
    if embeds is not None:
        return model(inputs_embeds=embeds.to(device)).logits.float().cpu()
    with torch.no_grad():
        return model(ids.to(device)).logits.float().cpu()


def kernelized(model_type: str, dtype=torch.float32, mode=Mode.INFERENCE):
    """A tiny model on npu, kernelized for npu (nothing else: the path users get)."""
    return kernelize(tiny_model(model_type, dtype=dtype).to("npu"), mode=mode, device="npu")


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_kernelized_fp32_forward_matches_eager_and_every_fused_op_ran(npu_kernels, model_type):
    """Every norm, both rotary calls of every layer and every SiLU-gated MLP ran fused; the rest did not."""
    ids = token_ids()
    eager = forward(tiny_model(model_type), ids)
    model = kernelized(model_type)
    with emulation.count_op_calls() as calls:
        fused = forward(model, ids)
    assert dict(calls) == expected_calls(model_type, model)
    expected = EXPECTED[model_type]
    rope_swaps = swapped_modules(model, card="npu-rope")
    assert sorted(s.layer for s in rope_swaps) == sorted(expected.rope * layer_count(model))
    norm_swaps = swapped_modules(model.get_decoder(), card="npu-rms-norm")
    assert len(norm_swaps) == norm_module_count(model) and {s.layer for s in norm_swaps} <= {expected.norm}
    mlp_swaps = swapped_modules(model.get_decoder(), card="npu-swiglu")
    assert len(mlp_swaps) == (gated_mlp_count(model) if expected.mlp else 0)
    assert {s.layer for s in mlp_swaps} <= {expected.mlp}
    moe_swaps = swapped_modules(model.get_decoder(), card="npu-moe")
    assert [s.layer for s in moe_swaps] == ["SwiGLUExperts"] * (experts_count(model) if expected.moe else 0)
    decoder_swaps = swapped_modules(model.get_decoder(), card="npu-add-rms-norm")
    assert [s.layer for s in decoder_swaps] == [expected.decoder] * (layer_count(model) if expected.decoder else 0)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "granite", "phi3", "gemma3_text"])
def test_gated_mlps_fuse_with_no_call_and_leave_every_parameter_where_it_lives(npu_kernels, model_type):
    """Every gated MLP fuses on the first forward, with no call from the user; no parameter changes object,
    storage or size of storage (each storage holds exactly its parameter: nothing shares a buffer)."""
    ids = token_ids()
    eager = forward(tiny_model(model_type), ids)
    model = kernelize(tiny_model(model_type).to("npu"), mode=Mode.INFERENCE, device="npu")
    where = {n: (id(p), p.data_ptr(), p.untyped_storage().nbytes()) for n, p in model.named_parameters()}
    with emulation.count_op_calls() as calls:
        out = forward(model, ids)
    assert calls["npu_geglu" if EXPECTED[model_type].mlp == "GeGLUMLP" else "npu_swiglu"] == gated_mlp_count(model)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    assert {n: (id(p), p.data_ptr(), p.untyped_storage().nbytes()) for n, p in model.named_parameters()} == where
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_without_registration_nothing_is_fused(model_type):
    """A process that registered nothing: kernels' mapping as a fresh process has it. (An earlier
    `use_kernels=True` load in this process adds transformers' own liger entry, which an offline
    host cannot load.)"""
    model = tiny_model(model_type).to("npu")
    with use_kernel_mapping({}, inherit_mapping=False):
        kernelize(model, mode=Mode.INFERENCE, device="npu", use_fallback=True)
    with emulation.count_op_calls() as calls:
        forward(model, token_ids())
    assert calls == {} and swapped_modules(model) == []


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_bf16_forward_error_at_most_twice_eager(npu_kernels, model_type):
    ids = token_ids()
    reference = forward(tiny_model(model_type), ids)
    eager_model = tiny_model(model_type, dtype=torch.bfloat16)
    eager_error = max_error(forward(eager_model, ids), reference)
    model = kernelized(model_type, dtype=torch.bfloat16)
    with emulation.count_op_calls() as calls:
        fused = forward(model, ids)
    assert dict(calls) == expected_calls(model_type, model)
    assert max_error(fused, reference) <= 2 * eager_error + 1e-3, (max_error(fused, reference), eager_error)


def _gradients(model, embeds):
    model.train()
    embeds = embeds.clone().to(next(model.parameters()).device).requires_grad_()
    forward(model, None, embeds).pow(2).mean().backward()
    grads = {name: p.grad.float().cpu() for name, p in model.named_parameters() if p.grad is not None}
    grads["inputs_embeds"] = embeds.grad.float().cpu()
    return grads


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_training_gradients_match_eager(npu_kernels, model_type):
    embeds = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(3))
    reference = _gradients(tiny_model(model_type), embeds)
    eager_bf16 = _gradients(tiny_model(model_type, dtype=torch.bfloat16), embeds.bfloat16())
    for dtype in (torch.float32, torch.bfloat16):
        model = kernelized(model_type, dtype=dtype, mode=Mode.TRAINING)
        with emulation.count_op_calls() as calls:
            grads = _gradients(model, embeds.to(dtype))
        assert dict(calls) == expected_calls(model_type, model, backward=True)
        assert set(grads) == set(reference)
        for name, grad in grads.items():
            if dtype == torch.float32:
                torch.testing.assert_close(grad, reference[name], rtol=1e-4, atol=1e-5, msg=name)
            else:  # relative L2 error: a max over few tiny gradient entries is one rounding draw
                eager_error = relative_error(eager_bf16[name], reference[name])
                assert relative_error(grad, reference[name]) <= 2 * eager_error + 1e-3, name


def test_qwen2_5_vl_multimodal_positions_are_fused_and_match_eager(npu_kernels):
    """mrope: temporal/height/width position streams that differ (as for image tokens) give cos/sin
    combined by mrope_section in transformers' rotary embedding; the card rotates with them exactly."""
    model = tiny_model("qwen2_5_vl")
    ids = token_ids()
    steps = torch.arange(7)
    position_ids = torch.stack((steps, steps // 2, 6 - steps))[:, None, :].expand(3, 2, 7)
    with torch.no_grad():
        eager = model(ids, position_ids=position_ids).logits
        plain = model(ids).logits
        kernelize(model.to("npu"), mode=Mode.INFERENCE, device="npu")
        with emulation.count_op_calls() as calls:
            fused = model(ids.to("npu"), position_ids=position_ids.to("npu")).logits.cpu()
    assert calls["npu_rotary_mul"] == 2 * layer_count(model)
    assert not torch.allclose(eager, plain)  # the sections really differ from 1-D positions
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)


def test_host_tensors_under_the_npu_mapping_give_the_eager_result(npu_kernels):
    model = tiny_model("llama")
    eager = forward(model, token_ids())
    kernelize(model, mode=Mode.INFERENCE, device="npu")
    assert len(swapped_modules(model, card="npu-rms-norm")) == norm_module_count(model)
    with emulation.count_op_calls() as calls:
        out = forward(model, token_ids())
    assert calls["npu_rms_norm"] == 0
    assert torch.equal(out, eager)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text"])
def test_use_kernels_survives_train_and_eval_switches(npu_kernels, model_type, tmp_path):
    """transformers re-registers its own "RMSNorm" mapping at load and at every train()/eval() switch."""
    source = tiny_model(model_type)
    eager = forward(source, token_ids())
    source.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="npu", use_kernels=True)
    assert model.device.type == "npu"
    norms = norm_module_count(model) - (layer_count(model) if EXPECTED[model_type].decoder else 0)
    one_kernel = "npu_gemma_rms_norm" if EXPECTED[model_type].norm == "RMSNormZeroCentered" else "npu_rms_norm"
    for switch in (None, "train", "eval", "train"):
        if switch:
            getattr(model, switch)()
        with emulation.count_op_calls() as calls:
            out = forward(model, token_ids())  # no grad: zero-centred norms run as one npu_gemma_rms_norm
        assert calls[one_kernel] == norms, switch
        assert len(swapped_modules(model, card="npu-rms-norm")) == norm_module_count(model)
        torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    with emulation.count_op_calls() as calls:
        model(token_ids().to("npu"), labels=token_ids().to("npu")).loss.backward()
    assert calls["npu_rms_norm"] == norms
    assert all(p.grad is not None for name, p in model.named_parameters() if "norm" in name)


def test_use_kernels_without_registration_takes_transformers_own_npu_entry(tmp_path):
    """Negative control: transformers maps "RMSNorm" on npu to liger-kernels on the Hub, which an
    offline host cannot load: the load fails. With npu-hub-kernels registered (above) it does not."""
    tiny_model("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="liger-kernels"):
        AutoModelForCausalLM.from_pretrained(tmp_path, device_map="npu", use_kernels=True)


def test_unregister_restores_the_classes(built_cards):
    assert LlamaRMSNorm.kernel_layer_name == "RMSNorm" and not hasattr(Gemma3RMSNorm, "kernel_layer_name")
    register_npu_kernels(local_dir=built_cards)
    assert LlamaRMSNorm.kernel_layer_name == "npu-rms-norm:RMSNorm"
    assert Gemma3RMSNorm.kernel_layer_name == "npu-rms-norm:RMSNormZeroCentered"
    unregister_npu_kernels()
    assert LlamaRMSNorm.kernel_layer_name == "RMSNorm" and not hasattr(Gemma3RMSNorm, "kernel_layer_name")
    assert "kernel_condition" in LlamaRMSNorm.__dict__ and "kernel_condition" not in Gemma3RMSNorm.__dict__


def test_classes_imported_after_registration_are_retagged():
    out = run_python(
        "import sys\n"
        "from npu_hub_kernels import register_npu_kernels\n"
        "assert 'transformers.models.olmo3.modeling_olmo3' not in sys.modules\n"
        "register_npu_kernels()\n"
        "from transformers.models.olmo3.modeling_olmo3 import Olmo3RMSNorm\n"
        "print(Olmo3RMSNorm.kernel_layer_name)\n"
    )
    assert out.strip() == "npu-rms-norm:RMSNormFloat32Scale"


def test_a_subclass_with_other_math_is_not_swapped(npu_kernels):
    class ScaledNorm(LlamaRMSNorm):
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    norm = ScaledNorm(16).to("npu")
    kernelize(torch.nn.Sequential(norm), mode=Mode.INFERENCE, device="npu")
    x = torch.randn(3, 16)
    torch.testing.assert_close(norm(x.to("npu")).cpu(), 2 * LlamaRMSNorm(16)(x))
    assert swapped_modules(norm) == []


def test_kernel_selection_follows_the_apply_default_kernels_contract():
    assert available_kernels() == [
        "npu_fused_add_rmsnorm",
        "npu_fused_attention",
        "npu_fused_linear_cross_entropy",
        "npu_fused_moe",
        "npu_fused_moe_router",
        "npu_fused_rmsnorm",
        "npu_fused_rope",
        "npu_fused_swiglu",
    ]
    assert [c.kernel_id for c in select_kernels("auto")] == available_kernels()
    assert [c.kernel_id for c in select_kernels(True)] == available_kernels()
    assert select_kernels(None) == [] and select_kernels(False) == []
    assert [c.kernel_id for c in select_kernels("npu_fused_rmsnorm, ")] == ["npu_fused_rmsnorm"]
    assert [c.kernel_id for c in select_kernels(["npu_fused_rmsnorm"])] == ["npu_fused_rmsnorm"]
    with pytest.raises(
        ValueError, match=r"Unknown kernel id.*'npu_fused_nope'.*Available: " + ", ".join(available_kernels())
    ):
        select_kernels("npu_fused_rmsnorm,npu_fused_nope")


def test_apply_npu_kernels(built_cards, caplog):
    model = tiny_model("qwen3").to("npu")
    assert apply_npu_kernels(model, kernels=None, local_dir=built_cards) is model
    assert swapped_modules(model, card="npu-rms-norm") == [] and LlamaRMSNorm.kernel_layer_name == "RMSNorm"
    try:
        apply_npu_kernels(model, kernels="npu_fused_rmsnorm", local_dir=built_cards)
        assert len(swapped_modules(model, card="npu-rms-norm")) == norm_module_count(model)
        with caplog.at_level(logging.WARNING, logger="npu_hub_kernels.registry"):
            apply_npu_kernels(tiny_model("llama"), local_dir=built_cards)
        assert "the model is on cpu" in caplog.text
    finally:
        unregister_npu_kernels()


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_a_selection_applies_to_the_model_whatever_was_registered_before(built_cards, family):
    """After an "auto" registration, apply_npu_kernels(model, "npu_fused_rmsnorm") fuses the norms only, in a
    family never kernelized before; "auto" on the same model then fuses everything (the negative control)."""
    register_npu_kernels(local_dir=built_cards)
    try:
        model = tiny_model(family).to("npu")
        eager = forward(model, token_ids())
        apply_npu_kernels(model, kernels="npu_fused_rmsnorm", local_dir=built_cards)
        assert {swap.card for swap in swapped_modules(model)} == {"npu-rms-norm"}
        with emulation.count_op_calls() as calls:
            torch.testing.assert_close(forward(model, token_ids()), eager, rtol=1e-5, atol=1e-5)
        assert set(calls) == {"npu_rms_norm"}
        apply_npu_kernels(model, kernels="auto", local_dir=built_cards)
        decoder = {"npu-add-rms-norm"} if EXPECTED[family].decoder else set()
        everything = {"npu-rms-norm", "npu-rope", "npu-swiglu", "npu-linear-cross-entropy", *decoder}
        assert {swap.card for swap in swapped_modules(model)} == everything
        with emulation.count_op_calls() as calls:
            forward(model, token_ids())
        assert {"npu_rms_norm", "npu_rotary_mul", "npu_swiglu"} <= set(calls)
    finally:
        unregister_npu_kernels()


def test_rotary_function_is_shared_by_all_models_of_a_family(npu_kernels):
    """transformers keeps one apply_rotary_pos_emb function-module per modeling file: kernelizing one
    Llama switches it for every Llama in the process. The switched function is fused only on npu
    tensors and gives the exact eager result elsewhere, so a CPU model is unaffected."""
    on_npu, on_cpu = tiny_model("llama").to("npu"), tiny_model("llama")
    eager = forward(on_cpu, token_ids())
    kernelize(on_npu, mode=Mode.INFERENCE, device="npu")
    assert len(swapped_modules(on_cpu, card="npu-rope")) == on_cpu.config.num_hidden_layers
    with emulation.count_op_calls() as calls:
        assert torch.equal(forward(on_cpu, token_ids()), eager)
    assert calls["npu_rotary_mul"] == 0


def test_a_silu_shaped_mlp_built_with_another_activation_runs_its_own_forward(npu_kernels):
    """LlamaMLP is listed, but a config may give it GELU: the layer checks the activation on every call."""
    model = tiny_model("llama")
    model.config.hidden_act = "gelu"
    gelu_model = type(model)(model.config).eval()
    gelu_model.load_state_dict(model.state_dict())
    eager = forward(gelu_model, token_ids())
    kernelize(gelu_model.to("npu"), mode=Mode.INFERENCE, device="npu")
    with emulation.count_op_calls() as calls:
        out = forward(gelu_model, token_ids())
    assert calls["npu_swiglu"] == 0 and calls["npu_rms_norm"] > 0
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["gelu", "gelu_new"])
def test_a_gemma_mlp_built_with_another_gelu_runs_its_own_forward(npu_kernels, activation):
    """Gemma3MLP is listed for GELU-tanh (gelu_pytorch_tanh); a config giving it the erf GELU, or the tanh formula in
    Python ops, runs its eager forward: npu_geglu's approximate=1 is F.gelu(approximate="tanh") only."""
    model = tiny_model("gemma3_text")
    model.config.hidden_activation = activation
    other = type(model)(model.config).eval()
    other.load_state_dict(model.state_dict())
    eager = forward(other, token_ids())
    kernelize(other.to("npu"), mode=Mode.INFERENCE, device="npu")
    with emulation.count_op_calls() as calls:
        out = forward(other, token_ids())
    assert calls["npu_geglu"] == 0 and calls["npu_swiglu"] == 0 and calls["npu_gemma_rms_norm"] > 0  # no grad
    assert {s.layer for s in swapped_modules(other.get_decoder(), card="npu-swiglu")} == {"GeGLUMLP"}
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)


MOE_MODEL_TYPES = [t for t, expected in EXPECTED.items() if expected.moe]


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_moe_training_converges_like_eager(npu_kernels, model_type):
    """The convergence idiom: a few optimizer steps give the same losses as eager, and every parameter
    moves the same way: its update differs from eager's by at most 0.1% (relative L2). The experts run the
    fused grouped matmuls and, where the family's router is one npu-moe-router fuses, the router its fused
    gating op (trained through the op's backward)."""
    batches = [token_ids(seed=s) for s in range(4)]

    def train(model):
        return train_steps(model, batches, lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))

    eager_losses, eager_updates = train(tiny_model(model_type))
    model = kernelized(model_type, mode=Mode.TRAINING)
    with emulation.count_op_calls() as calls:
        losses, updates = train(model)
    moe_layers = experts_count(tiny_model(model_type))
    assert calls["npu_grouped_matmul"] == 6 * moe_layers * len(batches)
    routers = gating_op_routers(model, training=True) if EXPECTED[model_type].router else 0
    assert calls["npu_moe_gating_top_k"] == routers * len(batches)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-4, atol=1e-5)
    moved = {name: relative_error(update, eager_updates[name]) for name, update in updates.items()}
    assert max(moved.values()) <= 1e-3, max(moved.items(), key=lambda item: item[1])


def test_kernelize_takes_precedence_over_the_experts_implementation_switch(npu_kernels):
    """transformers dispatches Experts.forward on config._experts_implementation; kernelize binds the card's
    forward on the instance, so switching implementations afterwards does not undo the swap."""
    model = kernelized("qwen3_moe")
    reference = forward(tiny_model("qwen3_moe"), token_ids())
    for implementation in ("eager", "grouped_mm", "batched_mm"):
        model.set_experts_implementation(implementation)
        with emulation.count_op_calls() as calls:
            out = forward(model, token_ids())
        assert calls["npu_grouped_matmul"] == 2 * experts_count(model), implementation
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
