"""DeepSpeed ZeRO-3 on the emulated npu, 2 processes on 127.0.0.1: the cards train as eager does (see below).

Each rank runs DeepSpeed's NPU accelerator (DS_ACCELERATOR=npu, which imports the emulated torch_npu) with ZeRO-3
partitioning every parameter over the 2 ranks, 3 AdamW steps per model, once without kernels and once kernelized in
TRAINING mode by `apply_npu_kernels` (which, deepspeed being imported, marks the split MLPs as ZeRO-3 leaves) before
`deepspeed.initialize`. Every process is bounded in time. npu-linear-cross-entropy fuses the loss of Llama and Qwen3
as lm_head's own call, which DeepSpeed's hooks gather the weight for, as for eager's lm_head (Qwen3-MoE's forward,
with its auxiliary loss, is not swapped: the control without the loss fused).

Per rank (each is a one-NPU host: LOCAL_RANK=0, since the emulated host has one device and DeepSpeed calls
`torch.npu.set_device(LOCAL_RANK)`), over the emulated "hccl" process group, as on an Ascend host.
ASCEND_HOME_PATH is set as CANN's set_env.sh sets it: DeepSpeed's NPU op builder reads it unguarded
(deepspeed/ops/op_builder/npu/builder.py, `installed_cann_path`, 0.19.8: `"ASCEND_HOME_PATH" in os.environ or
os.path.exists(os.environ["ASCEND_HOME_PATH"])` raises KeyError when it is unset).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from numerics import relative_error

pytest.importorskip("deepspeed")

FAMILIES = ("llama", "qwen3", "qwen3_moe")
STEPS = 3
WORLD_SIZE = 2
TIMEOUT = 400
ZERO3_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,  # torch's AdamW: DeepSpeed's own needs its compiled ops
}
"""ZeRO-3 with no persistent parameters: every weight, norms included, is partitioned and gathered by hooks."""
RUNS = ("eager", "kernels+leaves")
"""Without kernels; with `apply_npu_kernels`, which marks the split MLPs as ZeRO-3 leaves when deepspeed is imported
(and, for Llama only, "kernels": `kernelize` alone, no leaves)."""


def _run_ranks(built_cards: Path, scratch: Path) -> list[dict]:
    """Each rank's results of `_rank_main`: 2 processes of the emulated host (tests/distributed.py), each a
    one-NPU host (LOCAL_RANK=0) running DeepSpeed's NPU accelerator."""
    env = {"DS_ACCELERATOR": "npu", "ASCEND_HOME_PATH": str(scratch), "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
    return run_distributed(_rank_main, str(built_cards), world_size=WORLD_SIZE, timeout=TIMEOUT, env=env)


def _rank_main(built_cards: str) -> dict:
    """One rank: every family trained without and with kernels, over the emulated "hccl" process group."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="hccl")
    rank = torch.distributed.get_rank()
    results = {(family, run): _train(family, run, built_cards, rank) for family in FAMILIES for run in RUNS}
    results["llama", "kernels"] = _train("llama", "kernels", built_cards, rank)  # the control: leaves matter
    return results


def _train(family: str, run: str, built_cards: str, rank: int) -> dict:
    """STEPS ZeRO-3 AdamW steps on this rank's batches; losses, full fp32 parameters, op counts, what MLPs saw."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, z3_leaf_module
    from kernels import Mode, kernelize

    from npu_hub_kernels import apply_npu_kernels, register_npu_kernels, unregister_npu_kernels
    from npu_hub_kernels.testing import emulation
    from npu_hub_kernels.testing.tiny_models import tiny_causal_lm
    from npu_hub_kernels.zero3 import mark_zero3_leaf_mlps

    torch.manual_seed(0)
    model = tiny_causal_lm(family).to("npu").train()
    if run == "kernels+leaves":  # deepspeed is imported: apply_npu_kernels marks the split MLPs as leaves itself
        apply_npu_kernels(model, mode=Mode.TRAINING, local_dir=built_cards)
    elif run == "kernels":  # kernelize alone marks nothing
        register_npu_kernels(local_dir=built_cards)
        kernelize(model, mode=Mode.TRAINING, device="npu")
    leaves = [name for name, module in model.named_modules() if z3_leaf_module(module)]
    initial = {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=ZERO3_CONFIG
    )
    seen = _watch_split_mlps(model)  # registered after DeepSpeed's hooks: runs once they have gathered
    lm_head_status = _watch_lm_head_weight(model)
    late = _error_of(mark_zero3_leaf_mlps, model) if run != "eager" else None
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data: the reductions matter
    losses = []
    with emulation.count_op_calls() as calls:
        for _ in range(STEPS):
            ids = torch.randint(3, 96, (2, 8), generator=generator).to("npu")
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    params = {name: safe_get_full_fp32_param(p).cpu() for name, p in engine.module.named_parameters()}
    external = sorted(name for name, module in model.named_modules() if getattr(module, "_external_params", None))
    engine.destroy()
    if run != "eager":
        unregister_npu_kernels()
    return {
        "losses": losses, "params": params, "calls": dict(calls), "leaves": leaves, "seen": seen, "late": late,
        "lm_head_status": lm_head_status, "external": external, "initial": initial,
    }  # fmt: skip


def _error_of(function, *args) -> str | None:
    try:
        function(*args)
    except RuntimeError as error:
        return str(error)
    return None


def _watch_split_mlps(model: torch.nn.Module) -> list[dict]:
    """Record, at each call of a kernelized split MLP, what its forward finds: gate_proj.weight's shape, whether
    gate_proj/up_proj carry hooks, and the card's reason for the eager path (None: fused)."""
    from npu_hub_kernels.report import card_package
    from npu_hub_kernels.zero3 import _runs_split_mlp

    seen = []

    def record(mlp, args):
        card = card_package(mlp)
        hooked = any(p._forward_pre_hooks or p._forward_hooks for p in (mlp.gate_proj, mlp.up_proj))
        reason = card.swiglu_mlp_unavailable_reason(args[0], mlp.gate_proj, mlp.up_proj, mlp.act_fn)
        seen.append({"gate_shape": tuple(mlp.gate_proj.weight.shape), "hooked": hooked, "reason": reason})

    for module in model.modules():
        if _runs_split_mlp(module):
            module.register_forward_pre_hook(record)
    return seen


def _watch_lm_head_weight(model: torch.nn.Module) -> list[str]:
    """Record, as each step's first decoder layer starts, the ZeRO-3 status of lm_head.weight (read from the parameter
    dict without DeepSpeed's getter, which would gather it): whether it is resident through the model's body (from the
    second step on, DeepSpeed's trace-based prefetch may have gathered it early, as it does for eager)."""
    statuses = []

    def record(layer, args):
        statuses.append(dict.get(model.lm_head._parameters, "weight").ds_status.name)

    model.model.layers[0].register_forward_pre_hook(record)
    return statuses


@pytest.fixture(scope="module")
def zero3_ranks(built_cards, tmp_path_factory) -> list[dict]:
    """Each rank's results of every run (one 2-process launch for the module's tests)."""
    return _run_ranks(built_cards, tmp_path_factory.mktemp("zero3"))


@pytest.mark.slow
def test_zero3_two_ranks_train_exactly_as_eager(zero3_ranks):
    """Losses and final full parameters equal eager's (`_assert_same_training`) on each rank; the fused ops ran on
    each rank, the loss once a step (Llama, Qwen3), its lm_head.weight gathered as eager's is at each step and by no
    other module (no external parameter); split MLPs are leaves, so their forward finds gate_proj/up_proj hook-free
    with full weights, and npu_swiglu ran exactly for the calls the card fused (its reason is None)."""
    layers = 2  # tiny models
    for rank, results in enumerate(zero3_ranks):
        for family in FAMILIES:
            eager, fused = results[family, "eager"], results[family, "kernels+leaves"]
            where = f"rank {rank}, {family}"
            _assert_same_training(fused, eager, where)
            calls = fused["calls"]
            assert calls["npu_rms_norm"] >= STEPS * (2 * layers + 1), (where, calls)  # + q/k norms in Qwen3
            assert calls["npu_rotary_mul"] == STEPS * layers * 2, (where, calls)  # q and k
            # the loss: one chunk per step (Qwen3-MoE's with its router's auxiliary loss added as eager adds it)
            assert calls.get("npu_cross_entropy_loss", 0) == STEPS, (where, calls)
            # lm_head.weight gathered as eager gathers it (its own call; DeepSpeed's prefetch), by no other module
            assert fused["lm_head_status"] == eager["lm_head_status"], (where, fused["lm_head_status"])
            assert fused["external"] == eager["external"] == [], (where, fused["external"], eager["external"])
            if family == "qwen3_moe":
                assert calls["npu_moe_token_permute"] == STEPS * layers and calls["npu_grouped_matmul"] > 0, calls
                assert fused["leaves"] == [] and fused["seen"] == [], "tiny Qwen3-MoE has no split MLP"
                continue
            assert fused["leaves"] == [f"model.layers.{i}.mlp" for i in range(layers)], fused["leaves"]
            assert fused["late"] is None, "marking leaves again after the engine is harmless"
            assert len(fused["seen"]) == STEPS * layers
            for call in fused["seen"]:
                assert call["gate_shape"] == (96, 64) and not call["hooked"], (where, call)
            fused_mlp_calls = sum(call["reason"] is None for call in fused["seen"])
            assert calls.get("npu_swiglu", 0) == fused_mlp_calls, (where, calls, fused["seen"][0])


@pytest.mark.slow
def test_zero3_leaf_split_mlps_fuse(zero3_ranks):
    """With the split MLPs as ZeRO-3 leaves, every call of each fuses (npu_swiglu once per MLP call, per rank)."""
    for rank, results in enumerate(zero3_ranks):
        for family in ("llama", "qwen3"):
            fused = results[family, "kernels+leaves"]
            assert [call["reason"] for call in fused["seen"]] == [None] * STEPS * 2, (rank, family, fused["seen"][0])
            assert fused["calls"]["npu_swiglu"] == STEPS * 2, (rank, family, fused["calls"])


@pytest.mark.slow
def test_zero3_split_mlp_without_leaves_sees_partitioned_weights(zero3_ranks):
    """The control: kernelized but not marked, each split MLP finds gate_proj/up_proj carrying ZeRO-3 hooks, so the
    card takes the eager path with a reason and npu_swiglu never runs; the numbers are eager's. (The weight read
    itself is full: inside the engine's forward DeepSpeed gathers a parameter read outside its owner's forward and
    registers it as an external parameter of the reading module.)"""
    for rank, results in enumerate(zero3_ranks):
        unmarked, eager = results["llama", "kernels"], results["llama", "eager"]
        _assert_same_training(unmarked, eager, f"rank {rank}, llama without leaves")
        assert unmarked["leaves"] == [] and len(unmarked["seen"]) == STEPS * 2
        assert "call it before deepspeed.initialize" in unmarked["late"], "marking after the engine must refuse"
        for call in unmarked["seen"]:
            assert call["gate_shape"] == (96, 64) and call["hooked"] and call["reason"], call
        assert "npu_swiglu" not in unmarked["calls"] and unmarked["calls"]["npu_rms_norm"] > 0, unmarked["calls"]


def _assert_same_training(run: dict, eager: dict, where: str) -> None:
    """Eager's losses (1e-5) and final parameters: to 1e-5 where every fused op gives eager's numbers, and where the
    loss is fused (its gradients are eager's up to float32 rounding, which AdamW's normalised steps bring to the
    size of the learning rate on the tiniest gradient entries) by the card's convergence idiom: each parameter's
    whole update within 0.1% (relative L2) of eager's (tests/test_npu_linear_cross_entropy.py)."""
    assert eager["calls"] == {}, f"{where}: the run without kernels ran fused ops {eager['calls']}"
    torch.testing.assert_close(run["losses"], eager["losses"], atol=1e-5, rtol=0, msg=where)
    assert run["params"].keys() == eager["params"].keys()
    fused_loss = "npu_cross_entropy_loss" in run["calls"]
    for name, value in eager["params"].items():
        if fused_loss:
            error = relative_error(run["params"][name] - run["initial"][name], value - eager["initial"][name])
            assert error <= 1e-3, f"{where}: {name}'s update is {error:.3g} off eager's"
        else:
            torch.testing.assert_close(run["params"][name], value, atol=1e-5, rtol=0, msg=f"{where}: {name}")
