"""`make bench`: the fusion accounting (bench.accounting) against hand-computed counts, the floors, the targets,
and the bench (scripts/bench/) end to end on a quick run (counted, host-timed and emulated device-timed)."""

from __future__ import annotations

import ast
import contextlib
import csv
import dataclasses
import inspect
import re
import subprocess
import sys
import types

import pytest
import torch
from bench import cards, configs, counted, padding_free, regions, report, step, step_study, targets, timed
from bench.accounting import count_device_ops, fake_module, fused_ops
from bench.attention import AttentionRow
from bench.cards import npu_rms_norm
from bench.device_model import device_seconds
from bench.padding_free import PaddingFreeRow
from bench.peer import PARITY_TOLERANCE, ParityRow, load_peer, parity_rows
from bench.rows import CSV_COLUMNS, EMULATED, ESTIMATE_UNIT, MEMORY_UNITS, ExpertsSweepRow, Row, write_csv
from conftest import ROOT
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from npu_hub_kernels import CARDS, register_npu_kernels, unregister_npu_kernels
from npu_hub_kernels.testing.emulation.ops import npu_swiglu as swiglu_ops
from npu_hub_kernels.testing.tiny_models import tiny_config_values

BF16 = torch.bfloat16
X, X32, VAR, W, W32 = 2 * 8 * 64 * 2, 2 * 8 * 64 * 4, 2 * 8 * 4, 64 * 2, 64 * 4
"""Bytes of x [2, 8, 64] in bfloat16 and in float32, of its float32 variance [2, 8, 1], of the weight [64] in
bfloat16 and in float32."""
TINY_LLAMA = configs.TINY_SPECS[0]
ADD_NORM = CARDS["npu_fused_add_rmsnorm"].region
"""npu-add-rms-norm's region: the residual add and the post-attention norm of a decoder layer."""
TINY_MOE = configs.TINY_SPECS[1]


def records(tally) -> list[tuple[str, int, int]]:
    return [(r.name, r.reads, r.writes) for r in tally.records]


def fake_norm(fake_mode: FakeTensorMode) -> LlamaRMSNorm:
    with torch.device("meta"):
        norm = LlamaRMSNorm(64).to(BF16)
    return fake_module(norm, fake_mode, "npu")


def run_norm(norm, fake_mode: FakeTensorMode, phase: str):
    with fake_mode:
        x = torch.empty(2, 8, 64, dtype=BF16, device="npu", requires_grad=True)
        return counted.count_run(norm, (x,), {}, norm.parameters(), phase, experts=None)


def test_eager_rms_norm_counted_op_by_op(npu_kernels):
    """LlamaRMSNorm.forward of x [2, 8, 64] bf16: to(float32), pow, mean, + eps, rsqrt, mul, to(bf16), * weight."""
    fake_mode = FakeTensorMode()
    norm = fake_norm(fake_mode)
    regions.set_variant(norm, "eager")
    assert records(run_norm(norm, fake_mode, "fwd")) == [
        ("_to_copy", X, X32),  # x.to(float32)
        ("pow", X32, X32),
        ("mean", X32, VAR),  # keepdim: [2, 8, 1]
        ("add", VAR, VAR),  # + eps, a Python scalar (no tensor read)
        ("rsqrt", VAR, VAR),
        ("mul", X32 + VAR, X32),  # x * rsqrt(variance), broadcast
        ("_to_copy", X32, X),  # .to(bfloat16)
        ("mul", W + X, X),  # weight * ...
    ]


def test_kernelized_rms_norm_is_one_op_reading_its_inputs_and_writing_its_outputs(npu_kernels):
    """npu_rms_norm reads x and the weight, writes y and rstd [2, 8, 1] float32; its backward reads dy, x,
    the weight and rstd and writes dx and dweight in float32, which autograd then casts to the weight's bfloat16;
    nothing the emulation runs inside is counted."""
    fake_mode = FakeTensorMode()
    norm = fake_norm(fake_mode)
    regions.set_variant(norm, "kernelized")
    forward = ("npu_rms_norm", X + W, X + VAR)
    assert records(run_norm(norm, fake_mode, "fwd")) == [forward]
    backward = [("npu_rms_norm_backward", X + X + W + VAR, X + W32), ("_to_copy", W32, W)]
    assert records(run_norm(norm, fake_mode, "fwd+bwd")) == [forward, *backward]
    with fake_mode:
        x = torch.empty(2, 8, 64, dtype=BF16, device="npu")
    assert npu_rms_norm.floor(norm, x) == ((1, X + W + X), (1, X + X + W + X + W))


def test_inference_mode_counts_the_ops_composites_decompose_into():
    """In inference mode autograd is skipped, so composite ops reach the count whole; they are counted as what they
    decompose into, as in grad mode: a reshape of a transposed tensor is a copy, a linear a matmul."""
    fake_mode = FakeTensorMode()
    with fake_mode:
        x, w = torch.empty(2, 8, 64, dtype=BF16, device="npu"), torch.empty(32, 64, dtype=BF16, device="npu")
        counted = {}
        for context in (torch.no_grad, torch.inference_mode):
            with context(), count_device_ops() as tally:
                torch.nn.functional.linear(x, w).transpose(1, 2).reshape(2, -1).contiguous().to(BF16)
            counted[context.__name__] = records(tally)
    y = 2 * 8 * 32 * 2  # bytes of the output [2, 8, 32]
    assert counted["inference_mode"] == counted["no_grad"] == [("mm", X + 32 * 64 * 2, y), ("clone", y, y)]


def test_fused_op_rules_give_the_emulated_ops_shapes():
    """Every emulated torch_npu op has an accounting rule, and the rule's outputs have the op's shapes and dtypes."""
    import torch_npu

    npu = {"device": "npu"}
    tokens, indices = torch.randn(5, 8, **npu), torch.tensor([[0, 2], [1, 0], [2, 2], [0, 1], [1, 2]], **npu)
    counts = torch.tensor([2, 2, 2], **npu)
    calls = {
        "npu_rms_norm": ((torch.randn(2, 3, 8, **npu), torch.randn(8, **npu)), {}),
        "npu_rotary_mul": ((torch.randn(1, 2, 4, 8, **npu), *torch.randn(2, 1, 1, 4, 8, **npu)), {}),
        "npu_swiglu": ((torch.randn(4, 16, **npu),), {}),
        "npu_moe_token_permute": ((tokens, indices), {}),
        "npu_grouped_matmul": (
            ([torch.randn(6, 8, **npu)], [torch.randn(3, 8, 4, **npu)]),
            dict(group_list=counts, group_type=0, group_list_type=1, split_item=2),
        ),
    }
    permuted, order = torch_npu.npu_moe_token_permute(tokens, indices)
    calls["npu_moe_token_unpermute"] = ((permuted, order), {"probs": torch.rand(5, 2, **npu)})
    grouped_k = ([torch.randn(6, 4, **npu).t()], [torch.randn(6, 5, **npu)])  # group_type 2 takes x transposed
    with count_device_ops():  # refuses to run if an emulated op has no rule
        pass
    for name, (args, kwargs) in [
        *calls.items(),
        ("npu_grouped_matmul", (grouped_k, dict(calls["npu_grouped_matmul"][1], group_type=2))),
    ]:
        op = getattr(torch_npu, name)
        bound = inspect.signature(op).bind(*args, **kwargs)
        bound.apply_defaults()
        expected = [(tuple(t.shape), t.dtype) for t in tree_leaves(op(*args, **kwargs))]
        assert [(tuple(t.shape), t.dtype) for t in tree_leaves(fused_ops()[name].outputs(bound.arguments))] == expected


def tiny_layer_records(real: bool) -> dict[tuple[str, str], list]:
    """The op records of a tiny Llama decoder layer, eager and kernelized, forward and forward+backward, on fake
    tensors (as the bench runs) or on real tensors of the emulated device."""
    if real:
        config = AutoConfig.for_model("llama", **dict(TINY_LLAMA.config, num_hidden_layers=1))
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=BF16)
        layer, context = model.model.layers[0].to("npu"), contextlib.nullcontext()
    else:
        context = FakeTensorMode()
        layer = counted.build_layer(TINY_LLAMA, context)
    out = {}
    with context:
        args, kwargs = regions.layer_inputs(TINY_LLAMA, 2, 16, torch.empty)
        for variant in ("eager", "kernelized"):
            regions.set_variant(layer, variant)
            for phase in configs.PHASES:
                out[(variant, phase)] = records(counted.count_run(layer, args, kwargs, layer.parameters(), phase, None))
    regions.set_variant(layer, "eager")
    return out


def test_fake_tensors_count_what_real_tensors_on_the_emulated_device_count(npu_kernels):
    """The accounting runs on fake tensors to afford full sizes; on a tiny layer, real tensors give the same records."""
    assert tiny_layer_records(real=False) == tiny_layer_records(real=True)


@pytest.mark.parametrize("spec", configs.TINY_SPECS, ids=lambda spec: spec.name)
def test_eager_layer_runs_the_ops_on_the_emulated_device_that_it_runs_on_cpu(spec):
    """Ops with a device kernel are not decomposed on the emulated device (silu_backward: one op, not seven)."""
    counts = {}
    for device in ("npu", "cpu"):
        config = AutoConfig.for_model(spec.model_type, **dict(spec.config, num_hidden_layers=1))
        options = {"experts_implementation": "eager"} if spec.experts else {}
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=BF16, **options)
        fake_mode = FakeTensorMode()
        layer = fake_module(model.model.layers[0], fake_mode, device)
        with fake_mode:
            hidden = torch.empty(2, 16, 64, dtype=BF16, device=device, requires_grad=True)
            cos, sin = torch.empty(2, 2, 16, 16, dtype=BF16, device=device)
            kwargs = {"attention_mask": None, "position_embeddings": (cos, sin)}
            counts[device] = counted.count_run(layer, (hidden,), kwargs, layer.parameters(), "fwd+bwd", spec.experts)
    assert counts["npu"].by_op() == counts["cpu"].by_op()
    assert counts["npu"].by_op()["silu_backward"] >= 1


def test_layer_floor_adds_up_and_swiglu_reaches_it_on_the_default_path(npu_kernels):
    """The regions add up: the layer minus its regions (the rest) is the same for every variant but for the copies
    an eager region's gradient layout costs outside it (eager RoPE hands dq/dk on as BNSD, which the projections'
    backward copies; npu-rope hands them on in their BSND memory), so the layer floor is the least rest plus each
    region's floor; and the SwiGLU MLP of the default path (kernelize only) runs exactly its floor's ops and bytes
    at these sizes (decode-like: two matmuls are the cheaper way)."""
    results = counted.account(TINY_LLAMA, 2, 16)
    for phase in configs.PHASES:
        regions = [m for (kind, p), m in results.items() if p == phase and kind != "decoder layer"]
        layer = results[("decoder layer", phase)]
        rests = {}
        for variant in ("eager", "kernelized"):
            ops = getattr(layer, variant).by_op()
            for m in regions:
                ops.subtract(getattr(m, variant).by_op())
            size = getattr(layer, variant).bytes - sum(getattr(m, variant).bytes for m in regions)
            rests[variant] = (+ops, size)
        extra = rests["eager"][0] - rests["kernelized"][0]
        assert not rests["kernelized"][0] - rests["eager"][0] and set(extra) <= {"clone"}, rests
        assert (phase == "fwd") == (not extra)
        rest = (rests["kernelized"][0].total(), rests["kernelized"][1])
        floors = [m.floor for m in regions]
        assert layer.floor == (rest[0] + sum(f[0] for f in floors), rest[1] + sum(f[1] for f in floors))
        mlp = results[("SwiGLU MLP", phase)]
        assert (mlp.kernelized.ops, mlp.kernelized.bytes) == mlp.floor
        assert mlp.kernelized.by_op()["npu_swiglu"] == 1
    assert results[("SwiGLU MLP", "fwd")].floor[0] == 4
    assert results[("RMSNorm", "fwd")].kernelized.by_op() == {"npu_rms_norm": 1}  # post-attention: the next region
    add_norm = results[(ADD_NORM, "fwd")]
    assert add_norm.kernelized.by_op() == {"npu_add_rms_norm": 1} and add_norm.kernelized.ops == add_norm.floor[0]
    assert add_norm.eager.by_op()["add"] == 2  # the residual add, and the norm's variance + eps
    assert add_norm.kernelized.bytes < add_norm.eager.bytes


def test_the_layer_without_the_layer_card_is_counted_with_the_floor_before_it(npu_kernels):
    """Without npu-add-rms-norm's layer (every other card's layer, the decoder layer's own forward) the residual add
    runs outside any region and the post-attention norm is an RMSNorm region again: the floor before the card, one
    op more forward (the add) and one more backward (the add of the sum's two gradients), which the default path
    is held to by the card's BEFORE_CARD_TARGET."""
    before = counted.account(TINY_LLAMA, 2, 16, kernelized=regions.WITHOUT_LAYER_CARD, phases=("fwd+bwd",))
    default = counted.account(TINY_LLAMA, 2, 16, phases=("fwd+bwd",))
    assert {kind for kind, _ in before} == {kind for kind, _ in default} - {ADD_NORM}
    layer_before, layer = before[(cards.LAYER, "fwd+bwd")], default[(cards.LAYER, "fwd+bwd")]
    assert "npu_add_rms_norm" not in layer_before.kernelized.by_op() and layer.kernelized.by_op()["npu_add_rms_norm"]
    norms_before, norms = (m[("RMSNorm", "fwd+bwd")].kernelized.by_op()["npu_rms_norm"] for m in (before, default))
    assert (norms_before, norms) == (2, 1)  # input_layernorm; post_attention_layernorm only without the card
    assert layer_before.floor[0] == layer.floor[0] + 2 and layer_before.floor[1] > layer.floor[1]
    assert layer_before.eager.by_op() == layer.eager.by_op()


@pytest.mark.parametrize(("batch", "seq"), [(1, 1), (2, 16), (4, 128)], ids=["decode", "32 tokens", "512 tokens"])
def test_swiglu_mlp_at_its_floor_and_never_above_eager_at_any_size(npu_kernels, batch, seq):
    """The tiny Llama MLP (hidden 64, inner 96) from one token to 512 (3T > 8I there, where the weights concatenated
    for the call would move fewer bytes but cost a copy): the card runs exactly the floor's ops and bytes, copies no
    weight (no cat), and never moves more bytes nor takes more estimated time than eager."""
    results = counted.account(TINY_LLAMA, batch, seq)
    for phase in configs.PHASES:
        mlp = results[("SwiGLU MLP", phase)]
        assert (mlp.kernelized.ops, mlp.kernelized.bytes) == mlp.floor, phase
        assert "cat" not in mlp.kernelized.by_op(), phase
        assert mlp.kernelized.bytes <= mlp.eager.bytes, phase
        assert device_seconds(mlp.kernelized.records) <= device_seconds(mlp.eager.records), phase


def test_moe_experts_eager_loop_grows_with_the_experts_npu_moe_does_not(npu_kernels):
    """Balanced routing on fake tensors: transformers' eager loop runs the same ops per expert, npu-moe a fixed set."""
    counts = {}
    for experts in (2, 4, 8):
        measured = counted.account(TINY_MOE, 2, 16, experts=experts)[("MoE experts", "fwd+bwd")]
        counts[experts] = (measured.eager.ops, measured.kernelized.ops)
    per_expert = counts[4][0] - counts[2][0]
    assert per_expert > 0 and counts[8][0] - counts[4][0] == 2 * per_expert
    assert len({kernelized for _, kernelized in counts.values()}) == 1


def test_moe_experts_at_decode_every_hit_expert_multiplies_a_row_and_npu_moe_is_not_slower(npu_kernels):
    """One token, top-2 of 8 experts: fewer token copies than experts. Balanced routing names every expert hit, so
    each expert's loop multiplies at least one row (never a share rounded down to none, which would have eager read
    every expert's weights and multiply nothing); npu-moe, which multiplies the token's two copies, is then at most
    eager's estimated time, forward and forward+backward."""
    for phase in configs.PHASES:
        measured = counted.account(TINY_MOE, 1, 1, experts=8)[("MoE experts", phase)]
        products = [r for r in measured.eager.records if r.name == "mm"]
        assert products and all(r.writes > 0 for r in products), phase
        assert device_seconds(measured.kernelized.records) <= device_seconds(measured.eager.records), phase


def test_rope_in_inference_is_one_op_at_the_floor_with_grad_two_each_way(npu_kernels):
    """Head dim 64 (the one-call op takes 64 and 128) and cos with q's batch: in inference mode q and k are rotated
    by one npu_apply_rotary_pos_emb reading and writing exactly the floor's bytes; with grad, npu_rotary_mul runs
    once for q and once for k each way, within the RoPE targets."""
    spec = dataclasses.replace(TINY_LLAMA, config=dict(TINY_LLAMA.config, head_dim=64))
    results = counted.account(spec, 2, 16)
    inference = results[("RoPE", "fwd")]
    assert inference.kernelized.by_op() == {"npu_apply_rotary_pos_emb": 1}
    assert (inference.kernelized.ops, inference.kernelized.bytes) == inference.floor == (1, inference.floor[1])
    training = results[("RoPE", "fwd+bwd")]
    assert training.kernelized.by_op() == {"npu_rotary_mul": 2, "npu_rotary_mul_backward": 2}
    assert (training.kernelized.ops, training.kernelized.bytes) == training.documented == (4, training.documented[1])
    rows = [r for r in counted.counted_rows(spec, [(2, 16)]) if r.kind == "RoPE" and r.phase == "fwd"]
    met = {r.target: r.met for r in targets.evaluate(rows) if r.kind == "RoPE"}
    assert met == {
        "RoPE: kernelized op count = documented minimum (fwd and fwd+bwd)": True,
        "RoPE: kernelized bytes = documented minimum (fwd and fwd+bwd)": True,
        "RoPE: kernelized estimated time <= eager (every size) (fwd and fwd+bwd)": True,
    }


def test_moe_experts_run_at_their_floor_counts_op_included(npu_kernels):
    """npu-moe: one bincount for the tokens per expert, permute, two grouped matmuls, swiglu, unpermute: the floor's
    6 ops forward and 7 backward, and its bytes."""
    for phase in configs.PHASES:
        measured = counted.account(TINY_MOE, 2, 16)[("MoE experts", phase)]
        assert (measured.kernelized.ops, measured.kernelized.bytes) == measured.floor
        assert measured.kernelized.by_op()["bincount"] == 1
    assert measured.floor[0] == 6 + 7


def test_the_default_path_is_the_only_kernelized_variant_and_rows_are_selected_by_typed_fields(npu_kernels):
    """One row per region kind, phase and unit, all of the default path (no packed or unpacked variant); the summary
    and the targets select rows by their typed fields, so relabelling every row changes neither."""
    rows = counted.counted_rows(TINY_LLAMA, [(2, 16)])
    assert {r.variant for r in rows} == {"default"} and {r.study for r in rows} == {"layer"}
    measurements = [(r.kind, r.phase, r.unit) for r in rows]
    assert len(measurements) == len(set(measurements)) == 5 * (2 * 3 + len(MEMORY_UNITS))
    assert {unit for _, phase, unit in measurements if phase == "fwd"} == {
        "ops",
        "bytes",
        ESTIMATE_UNIT,
    }  # memory: grad
    assert {kind for kind, _, _ in measurements} == {"RMSNorm", "RoPE", "SwiGLU MLP", ADD_NORM, cards.LAYER}
    relabelled = [dataclasses.replace(r, op="?", config="?") for r in rows]
    assert targets.evaluate(relabelled) == targets.evaluate(rows)
    assert report.summary(relabelled, "m", "v") == report.summary(rows, "m", "v")
    assert report.card_summary("npu-swiglu", relabelled) == report.card_summary("npu-swiglu", rows)


def test_experts_without_a_card_say_so(built_cards):
    """Until an Experts card is registered, the kernelized column of the experts stays empty: "no card yet"."""
    register_npu_kernels(local_dir=built_cards, kernels="npu_fused_rmsnorm,npu_fused_rope,npu_fused_swiglu")
    try:
        rows = counted.counted_rows(TINY_MOE, [(2, 16)])
    finally:
        unregister_npu_kernels()
    experts = [r for r in rows if r.kind == "MoE experts"]
    assert experts and all(r.kernelized is None and r.note == cards.NO_CARD for r in experts)
    assert all(r.kernelized is not None for r in rows if r.kind == "RMSNorm")
    assert f"| MoE experts: kernelized op count = floor (fwd and fwd+bwd) | {cards.NO_CARD} | - |" in report.summary(
        rows, "m", "v"
    )


@pytest.fixture
def peer(npu_kernels):
    """LLaMA-Factory's NPU kernels (installed without dependencies in the dev environment)."""
    loaded, why = load_peer()
    if loaded is None:
        pytest.skip(why)
    return loaded


def _modeling_globals() -> dict[str, object]:
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    return {
        f"{m.__name__}.{name}": value for m in (modeling_llama, modeling_qwen3_moe) for name, value in vars(m).items()
    }


def test_peer_is_counted_on_its_own_layer_and_leaves_nothing_patched(peer):
    """The peer column: LLaMA-Factory's RMSNorm casts the weight to float32 and back per call (3 ops a norm), its
    RoPE runs npu_rotary_mul for q and for k, its split MLP concatenates gate and up per call, its Qwen3-MoE experts
    take histc counts and casts; it has no router kernel. Its module-global patches are undone: eager and
    kernelized counts are the same with and without the peer, and the modeling files' globals are the objects they
    were."""
    before = _modeling_globals()
    with_peer = counted.account(TINY_MOE, 2, 16, peer=peer)
    assert _modeling_globals() == before
    without = counted.account(TINY_MOE, 2, 16)
    for key, m in with_peer.items():
        assert (m.eager.by_op(), m.kernelized.by_op(), m.floor) == (
            without[key].eager.by_op(),
            without[key].kernelized.by_op(),
            without[key].floor,
        )
        assert m.peer_patched is (key[0] != "MoE router"), key  # LLaMA-Factory 0.9.5 has no router kernel
    assert with_peer[("RMSNorm", "fwd")].peer.by_op() == {"npu_rms_norm": 3, "_to_copy": 6}
    assert with_peer[(ADD_NORM, "fwd")].peer.by_op() == {"add": 1, "npu_rms_norm": 1, "_to_copy": 2}
    assert with_peer[("RoPE", "fwd")].peer.by_op() == {"npu_rotary_mul": 2}
    experts = with_peer[("MoE experts", "fwd")].peer.by_op()
    assert experts["histc"] == 1 and experts["npu_grouped_matmul"] == 2 and experts["_to_copy"] == 3
    mlp = counted.account(TINY_LLAMA, 2, 16, peer=peer)[("SwiGLU MLP", "fwd")].peer.by_op()
    assert mlp == {"mm": 3, "cat": 1, "npu_swiglu": 1}
    mixtral = dataclasses.replace(TINY_MOE, model_type="mixtral", config=tiny_config_values("mixtral"))
    assert counted.account(mixtral, 2, 16, peer=peer)[("MoE experts", "fwd")].peer_patched is False  # Qwen3-MoE only


def test_peer_parity_on_tiny_families(peer):
    """Each peer kernel alone against eager: LLaMA-Factory's RMSNorm matches Llama's but not Gemma3's zero-centred
    norm, which it treats as a plain one; its MoE kernel leaves a dense model alone. Nothing stays patched."""
    before = _modeling_globals()
    rows = {(r.model, r.kind): r for r in parity_rows(peer, ("llama", "gemma3_text"))}
    assert _modeling_globals() == before
    assert rows[("llama", "RMSNorm")].outcome == "matches" and rows[("llama", "RMSNorm")].peer <= PARITY_TOLERANCE
    assert rows[("gemma3_text", "RMSNorm")].outcome == "differs"
    assert rows[("llama", "RoPE")].outcome == "matches"
    assert rows[("llama", "MoE experts")].outcome == "not patched"
    text = report.summary(list(rows.values()), "m", "v", peer=peer.name)
    assert "| npu_fused_rmsnorm | llama | gemma3_text (" in text
    relabelled = [dataclasses.replace(r, op="?", config="?", note="?") for r in rows.values()]
    assert report.summary(relabelled, "m", "v", peer=peer.name) == text  # grouped by typed fields


def test_readme_section_is_rewritten_between_the_markers_only(tmp_path):
    readme = tmp_path / "README.md"
    before, after = "# Title\n\nintro\n\n", "\n\n## Next\n\ntext\n"
    readme.write_text(f"{before}{report.README_BEGIN}\nold figures\n{report.README_END}{after}")
    report.update_readme(readme, "new figures\n")
    expected = f"{before}{report.README_BEGIN}\nnew figures\n{report.README_END}{after}"
    assert readme.read_text() == expected
    report.update_readme(readme, "new figures")
    assert readme.read_text() == expected
    plain = tmp_path / "PLAIN.md"
    plain.write_text("no markers\n")
    with pytest.raises(SystemExit, match="markers"):
        report.update_readme(plain, "x")
    assert plain.read_text() == "no markers\n"


def _targets_of(summary: str) -> list[targets.Result]:
    """The targets table of a summary, read back as results (met: yes, **no**, -)."""
    start = summary.index("| target | measured | met |")
    lines = summary[start:].split("\n\n")[0].splitlines()[2:]
    met = {"yes": True, "**no**": False, "-": None}
    cells = [line.strip("| ").split(" | ") for line in lines]
    return [targets.Result("", target, measured, met[mark]) for target, measured, mark in cells]


def test_quick_bench_writes_csv_chart_summary_and_readme(built_cards, tmp_path):
    """The command end to end: --quick, one model, device timing forced on the emulation (labelled, kept out of the
    README), every table in the tables page (summary.md's), the charts copied beside it, the README section the
    targets met and missed, the step chart and the link to the tables."""
    out, readme = tmp_path / "out", tmp_path / "README.md"
    tables, images = tmp_path / "docs" / "benchmarks.md", tmp_path / "docs" / "images"
    tables.parent.mkdir()
    readme.write_text(f"# x\n{report.README_BEGIN}\n{report.README_END}\nend\n")
    command = [sys.executable, "scripts/bench", "--quick", "--configs", "llama-3-8b", "--device-timing", "on"]
    command += ["--build", str(built_cards), "--out", str(out), "--readme", str(readme), "--org", "bench-test"]
    command += ["--tables", str(tables), "--images", str(images)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "counted Llama-3-8B, batch 1, seq 512" in done.stdout  # progress
    with (out / "bench.csv").open() as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == CSV_COLUMNS
    assert {r["mode"] for r in table} == {"counted", "timed", "parity", "estimated"}
    emulated = [r for r in table if r["note"] == EMULATED]
    assert {r["op"] for r in emulated} >= {"decoder layer", "RMSNorm", "training step (AdamW)"}
    assert not any("packed" in r["op"] for r in table)  # the default path only
    outside_layers = {card.region for card, _ in cards.with_piece("OUTSIDE_REGION")}  # regions outside the layer
    counted = [r for r in table if r["mode"] == "counted" and r["config"] == "Llama-3-8B"]
    assert {r["kind"] for r in counted} >= outside_layers
    before_card = [r for r in counted if r["study"] == targets.BEFORE_CARD_STUDY]
    assert {(r["variant"], r["unit"]) for r in before_card} == {
        ("without npu-add-rms-norm", u) for u in ("ops", "bytes")
    }
    counted = [r for r in counted if r["kind"] not in outside_layers and r["study"] == "layer"]
    assert {r["phase"] for r in counted} == {"fwd", "fwd+bwd"}
    assert {r["unit"] for r in counted} == {"ops", "bytes", *MEMORY_UNITS}
    for chart in ("bench.png", "step.png"):
        assert (out / chart).read_bytes()[:8] == (images / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (out / "summary.md").read_text()
    assert tables.read_text() == report.tables_page(summary, ["images/step.png", "images/bench.png"])
    results = _targets_of(summary)
    assert {r.met for r in results} >= {True, False}  # the section below lists the missed ones
    section = report.readme_summary(results, "docs/benchmarks.md", "docs/images/step.png")
    assert readme.read_text() == f"# x\n{report.README_BEGIN}\n{section}{report.README_END}\nend\n"
    assert "](docs/images/step.png)" in section and "[benchmarks.md](docs/benchmarks.md)" in section
    assert EMULATED not in summary.replace("emulated ones are only in bench.csv", "")
    targets_shown = ("kernelize of 32 layers", "per-call overhead", "host cost of a call", "torch-universal fallback")
    for target in (*targets_shown, "RMSNorm: kernelized"):
        assert target in summary
    assert "Llama-3-8B decoder layer with npu-add-rms-norm: kernelized bytes <= the layer without it - 1" in summary
    assert "counted Llama-3-8B without npu-add-rms-norm, batch 1, seq 512" in done.stdout
    assert "Memory, counted, forward+backward" in summary and "| model | region | saved eager |" in summary
    assert "**Peer**: LLaMA-Factory" in summary and "| peer kernel | matches |" in summary  # the peer column ran
    assert all(r["peer"] for r in counted)


def test_every_card_has_a_complete_bench_spec():
    """Each card's bench spec (scripts/bench/cards/<py>.py) has every piece of the contract; a card without a spec,
    and a spec missing pieces or with an accounting rule for an op its emulation module does not bring, are named."""
    for card in CARDS.values():
        assert cards.missing_pieces(card) == [], card.repo_name
    nameless = dataclasses.replace(next(iter(CARDS.values())), repo_name="npu-nowhere")
    assert cards.missing_pieces(nameless) == [
        "npu-nowhere: no bench spec scripts/bench/cards/npu_nowhere.py (see scripts/bench/cards/__init__.py)"
    ]


def test_a_spec_missing_pieces_is_named_piece_by_piece(monkeypatch):
    """A spec that lacks a floor, its saved bytes and the host timing, gives a counted target its kind, and brings a
    rule for an op the card's emulation module does not bring: each problem in its own sentence."""
    swiglu = CARDS["npu_fused_swiglu"]
    partial = types.ModuleType(cards.spec_name(swiglu))
    partial.COUNTED_TARGETS = (cards.CountedTarget("ops", configs.PHASES, 1, kind=swiglu.region),)
    others = {op: fused_ops()[op] for op in swiglu_ops.__all__ if op != "npu_swiglu"}
    partial.FUSED_OPS = {**others, "npu_rms_norm": fused_ops()["npu_rms_norm"]}  # npu_swiglu's rule left out
    monkeypatch.setitem(sys.modules, cards.spec_name(swiglu), partial)
    where = "npu-swiglu: scripts/bench/cards/npu_swiglu.py"
    source = "npu_hub_kernels/testing/emulation/ops/npu_swiglu.py"
    assert cards.missing_pieces(swiglu) == [
        f"{where} defines no floor",
        f"{where} defines no floor_saved",
        f"{where} defines no HOST_TIMING",
        f"{where}: a counted target sets its kind (card.toml's region is it)",
        f"{where}: FUSED_OPS has no accounting rule for torch_npu.npu_swiglu ({source} brings it)",
        f"{where}: FUSED_OPS has a rule for npu_rms_norm, which {source} does not bring",
    ]


def test_a_host_timing_with_a_direct_call_off_a_llama_layer_or_without_shapes_is_named(monkeypatch):
    """The per-call overhead and fallback rows call a card's function on a Llama layer, with its shapes in the note."""
    rms_norm = CARDS["npu_fused_rmsnorm"]
    where = "npu-rms-norm: scripts/bench/cards/npu_rms_norm.py"
    timing = npu_rms_norm.HOST_TIMING
    monkeypatch.setattr(npu_rms_norm, "HOST_TIMING", dataclasses.replace(timing, model="qwen3_moe"))
    assert cards.missing_pieces(rms_norm) == [f"{where}: HOST_TIMING's direct_call is timed on a Llama layer only"]
    monkeypatch.setattr(npu_rms_norm, "HOST_TIMING", dataclasses.replace(timing, shapes=None))
    assert cards.missing_pieces(rms_norm) == [f"{where}: HOST_TIMING has a direct_call or shapes without the other"]
    monkeypatch.setattr(npu_rms_norm, "HOST_TIMING", dataclasses.replace(timing, direct_call=None, shapes=None))
    assert cards.missing_pieces(rms_norm) == []


PEER_DESCRIPTION = "RMSNorm by class name"
"""The one region name a generic bench module writes: report.peer_text describes LLaMA-Factory's kernels, whose
RMSNorm kernel matches modules by class name (its own rule, not a card's region)."""


def card_literals(source: str) -> list[str]:
    """The string literals (docstrings aside) of Python source that name a card (its repo name) or a card's region
    (as a word: "RMSNorm", not "LlamaRMSNorm")."""
    tree = ast.parse(source)
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}  # and attribute docs
    names = [card.repo_name for card in CARDS.values()] + [card.region for card in CARDS.values()]
    pattern = re.compile("|".join(rf"(?<![\w-]){re.escape(name)}(?![\w-])" for name in names))
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
        and pattern.search(node.value.replace(PEER_DESCRIPTION, ""))
    ]  # fmt: skip


def test_generic_bench_modules_name_no_card_and_no_region():
    """Region names are written once, in card.toml, and per-card facts live in scripts/bench/cards/<py>.py: the
    generic bench modules spell no card's repo name and no region name outside their docstrings."""
    generic = sorted((ROOT / "scripts" / "bench").glob("*.py"))
    assert {path.name for path in generic} >= {"counted.py", "report.py", "timed.py", "targets.py", "chart.py"}
    found = {path.name: card_literals(path.read_text()) for path in generic}
    assert {name: literals for name, literals in found.items() if literals} == {}
    planted = '''"""Docstrings may say RMSNorm and npu-moe."""
kind = "SwiGLU MLP"
"""So may attribute docs: RoPE."""
label = f"MoE experts (transformers {kind})"
card = "npu-rope"
fine = ("LlamaRMSNorm", "npu-hub-kernels", "RMSNorm by class name")
'''
    assert sorted(card_literals(planted)) == ["MoE experts (transformers ", "SwiGLU MLP", "npu-rope"]


def bench_imports_beyond_contract(source: str) -> list[str]:
    """What Python source of a spec (a module of the package bench.cards) imports from the bench package beyond
    `cards.SPEC_IMPORTS`, one "module: name" each (a whole module: "module: *"), relative imports resolved, those
    inside functions included."""
    beyond = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            beyond += [f"{alias.name}: *" for alias in node.names if alias.name.split(".")[0] in ("bench", "scripts")]
        elif isinstance(node, ast.ImportFrom):
            base = ["bench", "cards"][: max(0, 3 - node.level)] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if module.split(".")[0] not in ("bench", "scripts"):
                continue
            allowed = cards.SPEC_IMPORTS.get(module, frozenset())
            beyond += [f"{module}: {alias.name}" for alias in node.names if alias.name not in allowed]
    return beyond


def test_specs_import_only_the_contracts_declarations():
    """A spec declares and the generic modules measure: no spec imports what measures, counts, builds models or
    renders (no bench module, no function of one), only the declaration types and helpers of `SPEC_IMPORTS`."""
    found = {
        card.python_name: bench_imports_beyond_contract(inspect.getsource(module)) for card, module in cards.specs()
    }
    assert {name: names for name, names in found.items() if names} == {}
    planted = """from . import HostTiming, spec
from .. import memory
from ..targets import counted_targets
from .npu_rope import floor
import bench.report


def rows():
    from ..counted import build_model
    from bench.accounting import tensor_bytes
"""
    assert bench_imports_beyond_contract(planted) == [
        "bench.cards: spec", "bench: memory", "bench.targets: counted_targets", "bench.cards.npu_rope: floor",
        "bench.report: *", "bench.counted: build_model",
    ]  # fmt: skip


def test_a_target_no_row_measures_fails_the_bench_naming_it():
    """On a run over every bench model, a counted target whose region occurs in no model stops the bench, named;
    another shape of the region's rows than the target's is enough (the quick run)."""

    def rows_for(kinds: set[str]) -> list[Row]:
        return [
            Row("counted", "m", "", phase, 1, 512, unit=t.unit, study="layer", kind=t.kind, model="m")
            for t in targets.counted_targets() if t.kind in kinds for phase in t.phases
        ]  # fmt: skip

    every = {t.kind for t in targets.counted_targets()}
    targets.require_every_target_measured(rows_for(every))
    with pytest.raises(SystemExit) as stopped:
        targets.require_every_target_measured(rows_for(every - {"RMSNorm"}))
    held = [t for t in targets.counted_targets() if t.kind == "RMSNorm"]
    assert held and all(f"RMSNorm: {t.text}" in str(stopped.value) for t in held)
    assert "SwiGLU MLP" not in str(stopped.value)


def test_a_target_is_held_on_the_models_a_card_swaps_and_names_the_others():
    """A region no card swaps in one model (Mixtral's router) neither hides the target's result on the models whose
    region a card swaps nor counts against it: it is named."""

    def row(model: str, kernelized: float | None, phase: str) -> Row:
        return Row(
            "counted", model, "", phase, 8, 4096, eager=5, kernelized=kernelized, floor=2, unit="ops",
            study="layer", kind="RMSNorm", model=model, documented=2,
        )  # fmt: skip

    rows = [row("A", 2, p) for p in configs.PHASES] + [row("B", None, p) for p in configs.PHASES]
    (result,) = [
        r for r in targets.evaluate(rows) if r.target.startswith("RMSNorm: kernelized op count = documented minimum")
    ]
    assert result.met is True and result.measured.endswith(f"; {cards.NO_CARD} for B")
    worse = [dataclasses.replace(r, kernelized=3) if r.model == "A" else r for r in rows]
    (result,) = [
        r for r in targets.evaluate(worse) if r.target.startswith("RMSNorm: kernelized op count = documented minimum")
    ]
    assert result.met is False
    uncovered = [r for r in rows if r.model == "B"]
    (result,) = [
        r
        for r in targets.evaluate(uncovered)
        if r.target.startswith("RMSNorm: kernelized op count = documented minimum")
    ]
    assert (result.measured, result.met) == (cards.NO_CARD, None)


def _typed_rows() -> list:
    """One of each study's typed rows, with every field set (a parity row that raised has no difference)."""
    kernel = next(iter(CARDS))
    return [
        ExpertsSweepRow(
            "Qwen3-30B-A3B", 64, "moe", "grouped_mm", "fwd+bwd", 1, 512, "ops", 10.0, 4.0, 3.0, 5.0, True, ""
        ),
        step_study.CategoryRow("Qwen3-8B", None, 8, 4096, step.OTHER, "ms", 12.5, 7.25, None),
        step_study.OtherOpRow("Qwen3-8B", None, 8, 4096, "mul", 3.0, 2.0, 2.5),
        AttentionRow("Gemma-3-4B", "window 1024", "attention", "fwd+bwd", 1, 4096, "bytes", 9.0, 8.0, 7.0, 6.0),
        PaddingFreeRow("Llama-3-8B", padding_free.QUICK_LENGTHS, "ops", 100.0, 90.0, None),
        ParityRow("llama", kernel, 1e-6, "matches", "matches; 3 torch_npu calls"),
        ParityRow("qwen3", kernel, None, "raises", "raises; 0 torch_npu calls; ValueError: no"),
        timed.CallOverheadRow("RMSNorm", 1.5, 4.0, "overhead 2.50 us per call; tensors on cpu"),
        timed.HostCostRow("RoPE", 2.0, 3.0, "1.50 x a bare call"),
        step_study.MixedPrecisionRow("Llama-3-8B", 8, 4096, "ms", 9000.0, 8000.0, 8500.0),
    ]


@pytest.mark.parametrize("typed", _typed_rows(), ids=lambda typed: type(typed).__name__)
def test_a_typed_row_reads_back_what_its_csv_line_holds(typed, tmp_path):
    """Each study's typed row: `of(csv_row())` gives it back, and its line is a whole bench.csv line."""
    row = typed.csv_row()
    assert type(typed).of(row) == typed
    report_csv = tmp_path / "bench.csv"
    write_csv([row], report_csv)
    assert next(csv.DictReader(report_csv.open()))["study"] == row.study
