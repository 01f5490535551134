"""DeepSpeed Ulysses sequence parallelism with the cards, end to end on the emulated npu: 2 processes, the Trainer.

Each rank runs what a user runs on an Ascend host: TrainingArguments with ZeRO-3 and
`ParallelismConfig(sp_backend="deepspeed", sp_size=2)` first, which starts a plain "hccl" process group (no "cpu"
backend) and makes transformers build the tiny Llama under `deepspeed.zero.Init`; then the eager reference weights
loaded into it (gathered, written by rank 0), `apply_npu_kernels` (the attention card becomes the model's
attention), `set_sequence_parallel_attention(args)` (the card's name, which accelerate's constructor refuses) and
one Trainer step on one 16-token sequence, 8 tokens a rank. DeepSpeed's Ulysses wrapper gathers the sequence and
splits the heads, and calls the card on the whole sequence with the local heads.

Compared with single-process eager training on the same global sequence (the test process): the loss (every rank
holds the global mean, `deepspeed_sp_compute_loss`) and every parameter's full gradient under ZeRO-3, which averages
the SP ranks' gradients (ZeRO-1/2 would sum them: DeepSpeed's own behaviour), float32 to rounding. The card's fused
op ran once a layer on each rank, on the gathered sequence; the control: the same run with the attention card left
out (sp_attn_implementation "sdpa") gives the same numbers with no fused attention.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from distributed import run_distributed

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.skipif(
    os.environ.get("NPU_HUB_KERNELS_ALL_SP") != "1",
    reason="`make test-long-context` (CI) runs it; `make test`'s Ulysses sample is tests/test_ulysses_sp.py's",
)

WORLD = SP = 2
SEQ = 16
LAYERS = 2  # tiny models
TIMEOUT = 400
ZERO3 = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
}
"""ZeRO-3 with every parameter partitioned (the Trainer fills the "auto" values)."""
ATTENTION_CARD = "npu_fused_attention"
OTHER_CARDS = "npu_fused_rmsnorm,npu_fused_rope,npu_fused_swiglu"
"""The control's selection: every card but the attention card (npu-linear-cross-entropy: shift_labels under SP are
H2's test matrix)."""


def sequence() -> dict[str, torch.Tensor]:
    """The one training sequence (host): token ids, labels and positions 0..SEQ-1."""
    ids = torch.randint(3, 96, (SEQ,), generator=torch.Generator().manual_seed(7))
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(SEQ)}


def _rank_main(built_cards: str, output_dir: str, with_attention_card: bool) -> dict:
    """One rank: the Trainer step under Ulysses SP 2 and ZeRO-3; what it computed and what ran."""
    import deepspeed
    import torch.distributed as dist
    import torch_npu
    from accelerate.parallelism_config import ParallelismConfig
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import safe_get_full_grad
    from kernels import Mode
    from transformers import Trainer, TrainingArguments
    from transformers.integrations import is_deepspeed_zero3_enabled

    from npu_hub_kernels import apply_npu_kernels, attention_modules, set_sequence_parallel_attention
    from npu_hub_kernels.testing import emulation
    from npu_hub_kernels.testing.tiny_models import tiny_causal_lm

    reference = tiny_causal_lm("llama").state_dict()  # as the test process builds it
    args = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=1, max_steps=1, learning_rate=1e-3, report_to=[],
        disable_tqdm=True, save_strategy="no", deepspeed=ZERO3, seed=0, max_grad_norm=0.0,
        parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=SP),
    )  # fmt: skip
    group = {"backend": dist.get_backend(), "zero3": is_deepspeed_zero3_enabled()}
    model = tiny_causal_lm("llama")  # under zero.Init: partitioned as it is made
    group["partitioned"] = all(p.numel() == 0 for p in model.parameters())
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if dist.get_rank() == 0:
            model.load_state_dict(reference)
    model.train()
    kernels = f"{OTHER_CARDS},{ATTENTION_CARD}" if with_attention_card else OTHER_CARDS
    apply_npu_kernels(model, kernels=kernels, mode=Mode.TRAINING, local_dir=built_cards)
    set_sequence_parallel_attention(args, model)
    seen, grads, losses = [], [], []

    def record_inputs(module, inputs, kwargs):
        seen.append({k: kwargs[k].detach().cpu() for k in ("input_ids", "position_ids", "shift_labels") if k in kwargs})

    model.register_forward_pre_hook(record_inputs, with_kwargs=True)

    class RecordingTrainer(Trainer):
        def compute_loss(self, *a, **k):
            loss = super().compute_loss(*a, **k)
            losses.append(loss.item())
            return loss

    step = DeepSpeedEngine.step  # this process's engine class only, restored below

    def recording_step(engine, *a, **k):  # the gradients ZeRO-3 reduced, before the optimizer uses them
        grads.append({n: safe_get_full_grad(p).cpu() for n, p in engine.module.named_parameters()})
        return step(engine, *a, **k)

    fused_attention = torch_npu.npu_fusion_attention  # the emulated op the card calls, as torch_npu.<op>
    queries = []

    def recording_attention(query, *a, **k):  # the query the card hands the op: [batch, sequence, heads, dim]
        queries.append(tuple(query.shape))
        return fused_attention(query, *a, **k)

    DeepSpeedEngine.step, torch_npu.npu_fusion_attention = recording_step, recording_attention
    try:
        trainer = RecordingTrainer(model=model, args=args, train_dataset=[sequence()])
        with emulation.count_op_calls() as calls:
            trainer.train()
    finally:
        DeepSpeedEngine.step, torch_npu.npu_fusion_attention = step, fused_attention
    return {
        "group": group, "losses": losses, "grads": grads, "seen": seen, "calls": dict(calls), "queries": queries,
        "attention": model.config._attn_implementation, "wrapped": _what_ulysses_wraps(model),
        "forms": sorted({run.form or run.eager_reason or "" for run in attention_modules(model)}),
    }  # fmt: skip


def _what_ulysses_wraps(model) -> dict:
    """Whether DeepSpeed installed its wrapper under the model's attention name (the wrapper's own name), and what
    the class-wide registration of that name is (for the card: the card's `CardFunction`). That the wrapper calls it
    is what the fused op's count on the gathered sequence shows."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = model.config._attn_implementation
    wrapper = ALL_ATTENTION_FUNCTIONS[name]
    return {
        "wrapper": f"{wrapper.__module__}.{wrapper.__qualname__}",
        "registered": type(AttentionInterface._global_mapping[name]).__name__,
    }


def _eager_reference() -> dict:
    """Single-process eager on the global sequence: its loss and every parameter's gradient."""
    from npu_hub_kernels.testing.tiny_models import tiny_causal_lm

    model = tiny_causal_lm("llama").train()
    row = sequence()
    loss = model(input_ids=row["input_ids"][None], labels=row["labels"][None]).loss
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def _launch(built_cards: Path, scratch: Path, with_attention_card: bool) -> list[dict]:
    env = {"DS_ACCELERATOR": "npu", "ASCEND_HOME_PATH": str(scratch), "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
    output = scratch / ("card" if with_attention_card else "control")
    return run_distributed(
        _rank_main, str(built_cards), str(output), with_attention_card, world_size=WORLD, timeout=TIMEOUT, env=env
    )


@pytest.fixture(scope="module")
def eager() -> dict:
    return _eager_reference()


@pytest.fixture(scope="module")
def fused_ranks(built_cards, tmp_path_factory) -> list[dict]:
    return _launch(built_cards, tmp_path_factory.mktemp("ulysses-card"), with_attention_card=True)


@pytest.fixture(scope="module")
def control_ranks(built_cards, tmp_path_factory) -> list[dict]:
    return _launch(built_cards, tmp_path_factory.mktemp("ulysses-control"), with_attention_card=False)


def _assert_as_eager(ranks: list[dict], eager: dict, what: str) -> None:
    """Each rank: one step on the global sequence, its halves in rank order; eager's loss and gradients."""
    row = sequence()
    halves = [ranks[rank]["seen"][0] for rank in range(WORLD)]
    assert torch.equal(torch.cat([h["input_ids"] for h in halves], dim=1)[0], row["input_ids"]), what
    assert torch.equal(torch.cat([h["position_ids"] for h in halves], dim=1)[0], row["position_ids"]), what
    for rank, results in enumerate(ranks):
        where = f"{what}, rank {rank}"
        assert results["group"] == {"backend": "hccl", "zero3": True, "partitioned": True}, (where, results["group"])
        assert len(results["losses"]) == len(results["grads"]) == 1, (where, results["losses"])
        torch.testing.assert_close(results["losses"][0], eager["loss"], rtol=0, atol=1e-6, msg=where)
        grads = results["grads"][0]
        assert grads.keys() == eager["grads"].keys()
        for name, value in eager["grads"].items():
            torch.testing.assert_close(grads[name], value, rtol=1e-5, atol=1e-7, msg=f"{where}: {name}")


@pytest.mark.slow
def test_ulysses_sp2_zero3_trainer_trains_as_eager_with_the_card_fused(fused_ranks, eager):
    """Plain "hccl", ZeRO-3 under zero.Init, SP 2 through the Trainer: eager's loss and gradients; the card's op ran
    once a layer on each rank on the gathered sequence (SEQ tokens, the rank's 2 of 4 heads), under DeepSpeed's
    wrapper around the card's registered function."""
    _assert_as_eager(fused_ranks, eager, "card")
    for rank, results in enumerate(fused_ranks):
        assert results["attention"] == ATTENTION_CARD, results["attention"]
        assert "uattn_wrapper" in results["wrapped"]["wrapper"], results["wrapped"]
        assert results["wrapped"]["registered"] == "CardFunction", results["wrapped"]
        assert results["calls"].get("npu_fusion_attention") == LAYERS, (rank, results["calls"])
        heads, head_dim = 4 // SP, 16  # tiny Llama: 4 query heads of 16, 2 a rank
        assert results["queries"] == [(1, SEQ, heads, head_dim)] * LAYERS, (rank, results["queries"])
        assert results["forms"] == ["causal, BSND"], results["forms"]  # every attention module's last call fused


@pytest.mark.slow
def test_the_control_without_the_attention_card_runs_no_fused_attention(control_ranks, eager):
    """The same run with the attention card left out (sp_attn_implementation "sdpa"): eager's numbers, and no
    npu_fusion_attention call, so the count above is the card's."""
    _assert_as_eager(control_ranks, eager, "control")
    for rank, results in enumerate(control_ranks):
        assert results["attention"] == "sdpa" and "uattn_wrapper" in results["wrapped"]["wrapper"], results
        assert "npu_fusion_attention" not in results["calls"], (rank, results["calls"])
        assert results["calls"].get("npu_rms_norm", 0) > 0, (rank, results["calls"])  # the other cards did run
