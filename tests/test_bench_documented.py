"""The bench's documented minimum: targets set where no op torch_npu documents reaches a region's floor (issue 46).

A card's spec may state `documented_minimum` (the fewest documented torch_npu calls computing its region); a target
`against="documented"` holds the kernelized column to it, and the bench's note says why the floor is out of reach.
The add+RMSNorm card's layer is held to the layer without it (`BeforeCardTarget`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from bench import cards, configs, counted, report, targets
from bench.cards import npu_moe_router, npu_rms_norm, npu_rope
from bench.rows import Row
from transformers import AutoConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

from npu_hub_kernels import CARDS
from npu_hub_kernels.testing.tiny_models import tiny_config_values

TINY_LLAMA = configs.TINY_SPECS[0]
TINY_GEMMA3 = configs.ModelSpec(
    "tiny Gemma3",
    "gemma3_text",
    {k: v for k, v in tiny_config_values("gemma3_text").items() if k not in ("layer_types", "num_hidden_layers")},
)
"""Gemma3's layer (zero-centred norms, q/k norms) at the test suite's tiny widths, one layer as the bench builds it."""


def test_rope_is_held_to_the_floor_where_the_one_call_op_takes_the_head_dim(npu_kernels):
    """Head dim 64: npu_apply_rotary_pos_emb's ledger rules take q and k, so in inference the documented minimum is
    the floor (1 op, its bytes) and the card runs exactly that; with grad 2 npu_rotary_mul each way, cos and sin read
    once per call."""
    spec = dataclasses.replace(TINY_LLAMA, config=dict(TINY_LLAMA.config, head_dim=64))
    results = counted.account(spec, 2, 16)
    inference, training = results[("RoPE", "fwd")], results[("RoPE", "fwd+bwd")]
    assert inference.documented == inference.floor == (inference.kernelized.ops, inference.kernelized.bytes)
    assert training.documented == (training.kernelized.ops, training.kernelized.bytes)
    angles = 2 * 2 * 16 * 64 * 4  # cos and sin, batch 2 x seq 16 x head dim 64, float32, read once more each way
    assert training.documented == (2 * training.floor[0], training.floor[1] + angles)


def test_rope_of_a_head_dim_the_one_call_op_refuses_is_held_to_two_calls(npu_kernels):
    """Gemma3's head dim (not 64 or 128): npu_apply_rotary_pos_emb/head-dim refuses it, so in inference the documented
    minimum is one npu_rotary_mul for q and one for k, above the floor; the card meets that and not the floor (the
    floor target would miss: the negative control)."""
    assert TINY_GEMMA3.config["head_dim"] not in (64, 128)
    inference = counted.account(TINY_GEMMA3, 1, 8)[("RoPE", "fwd")]
    assert inference.kernelized.by_op() == {"npu_rotary_mul": 2}
    assert inference.documented == (2, inference.documented[1]) and inference.documented[1] > inference.floor[1]
    assert (inference.kernelized.ops, inference.kernelized.bytes) == inference.documented
    rows = [r for r in counted.counted_rows(TINY_GEMMA3, [(1, 8)]) if r.kind == "RoPE" and r.unit == "ops"]
    assert all(r.kernelized == r.documented for r in rows)
    assert any(r.kernelized != r.floor for r in rows)


def test_rms_norm_documented_minimum_counts_the_documented_calls_bytes():
    """A plain bfloat16 norm: npu_rms_norm (rstd float32 per row) in inference; with grad npu_rms_norm_backward's
    float32 dweight and its cast, 1.5 x the floor's bytes at one token. A zero-centred norm with grad: the one-call
    float32 `1 + weight` (bfloat16 + a float32 [1] tensor) before them, 4 ops; in inference npu_gemma_rms_norm."""
    hidden, rows = 64, 3
    x = torch.empty(rows, hidden, dtype=torch.bfloat16)
    X, W, R, G = rows * hidden * 2, hidden * 2, rows * 4, hidden * 4  # x, weight, rstd, float32 gamma
    plain = LlamaRMSNorm(hidden).to(torch.bfloat16)
    inference, training = npu_rms_norm.documented_minimum(plain, x)
    assert inference == (1, X + W + X + R)
    assert training == (3, (X + W + X + R) + (X + X + W + R + X + G) + (G + W))
    zero_centred = Gemma3RMSNorm(hidden).to(torch.bfloat16)
    inference, training = npu_rms_norm.documented_minimum(zero_centred, x)
    assert inference == (1, X + W + X + R)  # npu_gemma_rms_norm: the weight in x's dtype
    assert training == (4, (W + 4 + G) + (X + G + X + R) + (X + X + G + R + X + G) + (G + W))
    float32_weight = Gemma3RMSNorm(hidden)  # npu_gemma_rms_norm/gamma-dtype refuses it: the add before npu_rms_norm
    assert npu_rms_norm.documented_minimum(float32_weight, x)[0] == (2, (G + G) + (X + G + X + R))


def test_rms_norm_states_no_documented_minimum_for_a_form_it_does_not_model():
    """A float32-scale norm (Olmo2's): no documented minimum is stated; a clear error, not a guess."""
    with pytest.raises(ValueError, match=r"no documented minimum for olmo2\.modeling_olmo2\.Olmo2RMSNorm"):
        npu_rms_norm.documented_minimum(Olmo2RMSNorm(8), torch.empty(2, 8))


def _router(cls: type, model_type: str, experts: int, top_k: int, **config) -> torch.nn.Module:
    """A router of `cls` with `experts` experts, top-k `top_k` and hidden 16, its weight bfloat16 on the meta device."""
    values = dict(tiny_config_values(model_type), hidden_size=16, num_experts_per_tok=top_k, **config)
    values["num_local_experts" if model_type == "mixtral" else "num_experts"] = experts
    with torch.device("meta"):
        return cls(AutoConfig.for_model(model_type, **values)).to(torch.bfloat16)


def test_router_documented_minimum_counts_the_documented_calls_bytes():
    """T tokens, E experts, top-k K, bfloat16 logits: in inference the gating op (int32 ids) and their widening, or,
    for Mixtral's float32 weights, aten's top-k and float32 softmax of the k; with grad aten's top-k and softmax with
    autograd's derivatives. Every call by hand, from its contract."""
    T, H, E, K = 3, 16, 8, 2
    x = torch.empty(T, H, dtype=torch.bfloat16)
    L, P = T * E, T * K  # logits and picked elements
    mm = (T * H * 2 + E * H * 2) + L * 2
    backward = 3 * L * 2 + (L * 2 + E * H * 2 + T * H * 2) + (L * 2 + T * H * 2 + E * H * 2)  # add, dx, dW
    gating = (L * 2 + P * 2 + P * 4) + (P * 4 + P * 8)  # bfloat16 weights and int32 ids, then the int64 ids
    top = L * 2 + P * 2 + P * 8  # aten topk of the logits: bfloat16 values, int64 ids
    renormalised = _router(Qwen2MoeTopKRouter, "qwen2_moe", E, K, norm_topk_prob=True)
    inference, training = npu_moe_router.documented_minimum(renormalised, x)
    assert inference == (3, mm + gating)
    forward = top + (P * 2 + P * 4) + (P * 4 + P * 4) + (P * 4 + P * 2)  # topk, cast, _softmax, cast
    routing_backward = (P * 2 + P * 4) + 3 * P * 4 + (P * 4 + P * 2) + (P * 2 + L * 2) + (2 * L * 2 + P * 8 + P * 2)
    assert training == (13, mm + forward + routing_backward + backward)
    mixtral = _router(MixtralTopKRouter, "mixtral", E, K)
    inference, training = npu_moe_router.documented_minimum(mixtral, x)
    forward = top + (P * 2 + P * 4) + (P * 4 + P * 4)  # topk, cast, _softmax: the float32 weights
    assert inference == (4, mm + forward)
    routing_backward = 3 * P * 4 + (P * 4 + P * 2) + (P * 2 + L * 2) + (2 * L * 2 + P * 8 + P * 2)
    assert training == (11, mm + forward + routing_backward + backward)
    plain = _router(Qwen2MoeTopKRouter, "qwen2_moe", E, K, norm_topk_prob=False)
    inference, training = npu_moe_router.documented_minimum(plain, x)
    assert inference == (3, mm + gating)
    forward = (L * 2 + L * 4) + (L * 4 + L * 4) + (L * 4 + P * 4 + P * 8) + (P * 4 + P * 2)  # cast, _softmax, topk
    routing_backward = (P * 2 + P * 4) + (P * 4 + L * 4) + (2 * L * 4 + P * 8 + P * 4) + 3 * L * 4 + (L * 4 + L * 2)
    assert training == (13, mm + forward + routing_backward + backward)


def test_router_documented_minimum_follows_the_gating_ops_ledger():
    """Past both gating ops' limits (more than 2048 experts, top-k above 1024) inference runs aten's path: the float32
    softmax of every expert, its top-k and the cast of the k (not renormalised), one op more than the gating op's 3;
    a sigmoid router has no documented minimum stated: a clear error, not a guess."""
    x = torch.empty(2, 16, dtype=torch.bfloat16)
    plain = _router(Qwen2MoeTopKRouter, "qwen2_moe", 2056, 1025, norm_topk_prob=False)
    inference, training = npu_moe_router.documented_minimum(plain, x)
    assert inference[0] == 5 and training[0] == 13
    with pytest.raises(ValueError, match=r"no documented minimum for deepseek_v3\.modeling_deepseek_v3\."):
        npu_moe_router.documented_minimum(_router(DeepseekV3TopkRouter, "deepseek_v3", 8, 2), x)


@pytest.mark.parametrize(
    ("model_type", "values", "fused"),
    [
        ("qwen3_moe", {"norm_topk_prob": True}, "npu_moe_gating_top_k_softmax_v2"),
        ("qwen2_moe", {"norm_topk_prob": False}, "npu_moe_gating_top_k"),
        ("mixtral", {}, None),
    ],
)
def test_router_runs_at_its_documented_minimum_above_the_floor(npu_kernels, model_type, values, fused):
    """Each softmax router family on a tiny layer: the card's counted ops and bytes are its documented minimum, forward
    (the gating op ran, where one can) and forward+backward; the floor is out of reach (the floor's targets would
    miss: the negative control)."""
    spec = configs.ModelSpec(f"tiny {model_type}", model_type, dict(tiny_config_values(model_type), **values), 4)
    results = counted.account(spec, 1, 8)
    for phase in configs.PHASES:
        measured = results[("MoE router", phase)]
        assert (measured.kernelized.ops, measured.kernelized.bytes) == measured.documented, phase
        assert measured.documented[0] > measured.floor[0] and measured.documented[1] > measured.floor[1], phase
    inference = results[("MoE router", "fwd")].kernelized.by_op()
    assert (fused in inference) if fused else not any(op.startswith("npu_") for op in inference)


def _row(kernelized: float, documented: float | None, unit: str = "ops", phase: str = "fwd") -> Row:
    return Row(
        "counted", "A", "RoPE", phase, 1, 1, eager=10, kernelized=kernelized, floor=1, unit=unit, study="layer",
        kind="RoPE", model="A", documented=documented,
    )  # fmt: skip


def test_a_target_against_the_documented_minimum_is_met_at_it_and_missed_above():
    """`against="documented"` compares with the row's documented minimum, not its floor: met at it (above the floor),
    missed one above it (the negative control), and a row without one is a clear error."""
    exact = cards.CountedTarget("ops", configs.PHASES, 1, against="documented", kind="RoPE")
    assert exact.text == "kernelized op count = documented minimum"
    assert exact.met(_row(2, 2)) and not exact.met(_row(3, 2))
    within = cards.CountedTarget("bytes", configs.PHASES, 1.05, against="documented", kind="RoPE")
    assert within.text == "kernelized bytes <= 1.05 x documented minimum"
    assert within.met(_row(105, 100, "bytes")) and not within.met(_row(106, 100, "bytes"))
    with pytest.raises(ValueError, match="has none"):
        exact.met(_row(2, None))


def test_the_targets_state_the_worst_row_against_the_documented_minimum():
    """The summary's measured text names, per phase, the count against the documented minimum (ops), and the largest
    share of it (bytes)."""
    rows = [_row(2, 2), _row(4, 4, phase="fwd+bwd"), _row(110, 100, "bytes"), _row(100, 100, "bytes", "fwd+bwd")]
    found = {r.target: r for r in targets.evaluate(rows) if "documented" in r.target}
    ops = found["RoPE: kernelized op count = documented minimum (fwd and fwd+bwd)"]
    assert (ops.measured, ops.met) == ("2 vs 2 (fwd, A), 4 vs 4 (fwd+bwd, A)", True)
    size = found["RoPE: kernelized bytes = documented minimum (fwd and fwd+bwd)"]
    assert (size.measured, size.met) == ("up to 1.100 x documented minimum (fwd, A, batch 1 x seq 1)", False)


def test_a_spec_with_a_documented_minimum_says_why_the_floor_is_out_of_reach(monkeypatch):
    """The bench's note prints each spec's reason and the layer card's; a spec stating a documented minimum without a
    reason is an incomplete spec."""
    note = "\n".join(report.documented_reach_note())
    for spec in (npu_rope, npu_rms_norm, npu_moe_router):
        assert spec.OUT_OF_DOCUMENTED_REACH in note
    assert cards.spec(CARDS["npu_fused_add_rmsnorm"]).BEFORE_CARD_TARGET.why in note
    assert "AutogradErrorFallback.cpp" in note and "npu_apply_rotary_pos_emb/head-dim" in note
    assert note in report.readme_summary([], "docs/benchmarks.md")
    card = cards.card_named("npu-rope")
    assert cards.missing_pieces(card) == []
    monkeypatch.delattr(npu_rope, "OUT_OF_DOCUMENTED_REACH")
    assert cards.missing_pieces(card) == [
        "npu-rope: scripts/bench/cards/npu_rope.py: documented_minimum without OUT_OF_DOCUMENTED_REACH (why)"
    ]


def test_the_layer_card_is_held_to_the_layer_without_it_less_one_op_and_one_activation():
    """BEFORE_CARD_TARGET pairs each model's default decoder-layer row with the layer counted without the card: met
    at exactly one op and one activation (batch x seq x hidden x 2 bytes) fewer, missed (the negative controls) at
    one op or one byte more."""
    card = cards.card_named("npu-add-rms-norm")
    target = cards.spec(card).BEFORE_CARD_TARGET
    assert (target.fewer_ops, target.fewer_activations) == (1, 1)
    activation = configs.activation_bytes("Llama-3-8B", 8, 4096)
    assert activation == 8 * 4096 * 4096 * 2

    def row(unit: str, kernelized: float, study: str = "layer", variant: str = "default") -> Row:
        return Row(
            "counted", "Llama-3-8B", cards.LAYER, "fwd+bwd", 8, 4096, eager=2 * kernelized, kernelized=kernelized,
            floor=kernelized / 2, unit=unit, study=study, kind=cards.LAYER, variant=variant, model="Llama-3-8B",
        )  # fmt: skip

    def results(ops: float, size: float) -> list[bool | None]:
        before = dict(study=targets.BEFORE_CARD_STUDY, variant=f"without {card.repo_name}")
        rows = [row("ops", ops), row("bytes", size), row("ops", 43, **before), row("bytes", 10 * activation, **before)]
        return [r.met for r in targets.evaluate(rows) if "the layer without it" in r.target]

    assert results(42, 9 * activation) == [True, True]
    assert results(43, 9 * activation) == [False, True]
    assert results(42, 9 * activation + 1) == [True, False]
