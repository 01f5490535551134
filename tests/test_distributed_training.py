"""Kernelized tiny models trained on 2 ranks of the emulated npu (process group "hccl"), under DDP and FSDP2, each
run against the same run without kernels.

Per model family, one 2-process run (tests/distributed.py) trains every engine configuration of ENGINES, first all
without kernels, then all with the cards registered from the local build and applied with `apply_npu_kernels` in
TRAINING mode (after PEFT, before wrapping, as LLaMA-Factory v1 does). The runs without kernels go first because a
kernelize switches the family's rotary function process-wide (docs/models.md). Each rank trains on its own fixed
batches, AdamW, STEPS steps. What each kernelized run must show, per rank:

- numbers: float32 runs give eager's losses and final full parameters (gathered with `full_tensor()`) to 1e-5. The
  bf16 mixed-precision run (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`) is judged by the project's
  idiom (tests/numerics.py): against the float32 run without kernels, its losses, parameter updates and weight sums
  are at most twice as far as the bf16 run without kernels (plus a floor for one rounding draw).
- fusion: the fused op calls of every step equal those of one forward and backward of the same kernelized model in
  one process (no engine), with the norms, rotary, SwiGLU and fused attention (and the experts' ops for MoE) among
  them; the run without kernels calls none (negative control).
- the weights each forward reads follow the optimizer (the frozen-weights regression of issue 16): a forward
  pre-hook on every MLP sums its parameters as the forward sees them; the sums change at every step and equal
  those of the run without kernels.
- memory: `torch.npu.memory_allocated()` (the bytes of the distinct buffers behind live npu tensors, see
  emulation/device.py) after each step, gradients dropped, measured from the same baseline, is no larger than
  the run without kernels. A kernel that keeps a second copy of weights resident (a packed gate/up buffer next to
  FSDP's shards) shows here.
- the loss with the lm_head a unit of its own (Llama): fused every step as above (computed as the lm_head's call,
  which FSDP2's hooks unshard and reshard around); an lm_head unit whose MixedPrecisionPolicy sets output_dtype (it
  would cast the loss) says why it runs eager, and runs exactly eager, no fused op.
"""

from __future__ import annotations

import datetime
import gc
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from kernels import Mode, get_local_kernel
from numerics import relative_error
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from npu_hub_kernels import apply_npu_kernels
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm, token_ids

STEPS = 3
LEARNING_RATE = 1e-3
FP32_TOLERANCE = 1e-5
BF16_FLOOR = 1e-3
"""Added to twice eager bf16's error: one rounding draw of a few tiny values (as tests/test_training_stacks.py)."""


def lora_config() -> LoraConfig:
    """A fresh LoRA config for each model: peft fills a config in as it wraps a model (an MoE model's expert
    parameters become its target_parameters), so a shared one would carry that to the next model."""
    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)


LORA_LEFT_OUT = {
    "qwen3_moe": "peft 0.21 wraps the experts' 3-D parameters (ParamWrapper, also with exclude_modules=['experts']) "
    "in a parametrization that reads lora_A/lora_B's weights without calling their modules; LLaMA-Factory v1's "
    "leaf-wise fully_shard leaves those weights sharded DTensors outside their own forward, so the forward fails "
    "without kernels too (a DTensor meets a plain tensor)",
}
"""Model type -> why its LoRA engine is not run."""
LM_HEAD_UNIT_LEFT_OUT = {
    "qwen3_moe": "npu-linear-cross-entropy leaves Qwen3-MoE's forward (with the router's auxiliary loss) unswapped: "
    "its lm_head as a unit of its own would show only what the plain FSDP2 run shows",
}
"""Model type -> why its lm_head-unit engine is not run."""


@dataclass(frozen=True)
class Engine:
    """How a run wraps the model."""

    wrapper: str  # "ddp" or "fsdp2"
    reshard_after_forward: bool = True
    bf16: bool = False
    lora: bool = False
    lm_head_unit: bool = False  # lm_head sharded as a unit of its own before the decoder layers and the root


ENGINES = {
    "ddp": Engine("ddp"),
    "fsdp2": Engine("fsdp2"),
    "fsdp2, reshard_after_forward=False": Engine("fsdp2", reshard_after_forward=False),
    "fsdp2, bf16 mixed precision": Engine("fsdp2", bf16=True),
    "fsdp2, LoRA leaves sharded on their own": Engine("fsdp2", lora=True),
    "fsdp2, lm_head a unit of its own": Engine("fsdp2", lm_head_unit=True),
}
FP32_REFERENCE = {"fsdp2, bf16 mixed precision": "fsdp2"}
"""bf16 run -> the float32 run (without kernels) its errors are measured against."""


@dataclass
class Run:
    """What one rank saw in one run (host tensors and numbers only: it travels back pickled)."""

    losses: list[float] = field(default_factory=list)
    calls: list[dict[str, int]] = field(default_factory=list)
    """The fused op calls of each step (forward, backward, optimizer step)."""
    mlp_weight_sums: list[list[float]] = field(default_factory=list)
    """Per step, the sum of each MLP's parameters as its forward read them."""
    memory: list[int] = field(default_factory=list)
    """Per step, npu bytes in use after the step (gradients dropped) above the bytes in use before the model."""
    initial: dict[str, torch.Tensor] = field(default_factory=dict)
    final: dict[str, torch.Tensor] = field(default_factory=dict)
    plain_calls: dict[str, int] = field(default_factory=dict)
    """The fused op calls of one forward and backward of the same model in one process, no engine."""


# --- In each rank ----------------------------------------------------------------------------------------------


def train_every_engine(model_type: str, built_cards: str) -> tuple[dict[str, dict[bool, Run]], dict | None]:
    """One rank: every engine of ENGINES without kernels, then with them. Returns {engine: {kernels: Run}}, and
    `lm_head_unit_casting_its_output` where the lm_head-unit engine runs."""
    dist.init_process_group("hccl", timeout=datetime.timedelta(seconds=60))
    gc.collect()
    gc.freeze()  # the libraries' objects: later collections (before each memory reading) scan only the runs' own
    runs: dict[str, dict[bool, Run]] = {name: {} for name in engines(model_type)}
    for with_kernels in (False, True):
        for name, engine in engines(model_type).items():
            runs[name][with_kernels] = train(model_type, engine, built_cards if with_kernels else None)
    return runs, None if model_type in LM_HEAD_UNIT_LEFT_OUT else lm_head_unit_casting_its_output(built_cards)


def lm_head_unit_casting_its_output(built_cards: str) -> dict:
    """An lm_head FSDP2 unit whose MixedPrecisionPolicy sets output_dtype, which would cast the loss where eager casts
    the logits: the card's reason, its fused op calls, and whether its (loss, logits) are eager's."""
    card = get_local_kernel(Path(built_cards) / "npu-linear-cross-entropy")
    torch.manual_seed(0)
    head = fully_shard(nn.Linear(16, 32).to("npu"), mp_policy=MixedPrecisionPolicy(output_dtype=torch.float16))
    hidden, labels = torch.randn(2, 5, 16, device="npu", requires_grad=True), torch.randint(0, 32, (2, 5)).to("npu")
    reason = card.linear_cross_entropy_unavailable_reason(hidden, head, labels, 32)
    with emulation.count_op_calls() as calls:
        got = card.linear_cross_entropy(hidden, head, labels, 32)
    want = card.linear_cross_entropy_eager(hidden, head, labels, 32)
    return {"reason": reason, "calls": dict(calls), "eager": all(map(torch.equal, got, want))}


def engines(model_type: str) -> dict[str, Engine]:
    return {
        name: e
        for name, e in ENGINES.items()
        if not (e.lora and model_type in LORA_LEFT_OUT) and not (e.lm_head_unit and model_type in LM_HEAD_UNIT_LEFT_OUT)
    }


def new_model(model_type: str, engine: Engine, built_cards: str | None) -> nn.Module:
    """The tiny model on the npu, LoRA-wrapped if asked, kernelized if `built_cards` (after PEFT, before sharding)."""
    model = tiny_causal_lm(model_type).to("npu").train()
    if engine.lora:
        model = get_peft_model(model, lora_config())
    if built_cards is not None:
        model = apply_npu_kernels(model, mode=Mode.TRAINING, local_dir=built_cards)
    return model


def plain_calls(model_type: str, engine: Engine, built_cards: str) -> dict[str, int]:
    """Fused calls of one forward and backward of the kernelized model alone in this process (bf16 for a bf16 run)."""
    model = new_model(model_type, engine, built_cards)
    if engine.bf16:
        model = model.to(torch.bfloat16)
    ids = batch(0)
    with emulation.count_op_calls() as calls:
        model(ids, labels=ids).loss.backward()
    return dict(calls)


def batch(step: int) -> torch.Tensor:
    """This rank's batch of a step (every run of the rank sees the same ones)."""
    return token_ids(batch=2, seq=7, seed=1000 * dist.get_rank() + step).to("npu")


def train(model_type: str, engine: Engine, built_cards: str | None) -> Run:
    run = Run()
    if built_cards is not None:
        run.plain_calls = plain_calls(model_type, engine, built_cards)
    # the last collective of the run before may still hold its buffers (the emulated hccl's gloo work keeps them until
    # the next work on the group): a barrier issues that next work, so the baseline counts nothing of that run
    dist.barrier()
    gc.collect()
    baseline = torch.npu.memory_allocated()
    model = wrap(new_model(model_type, engine, built_cards), engine)
    run.initial = full_parameters(model)
    for layer in decoder_layers(model):
        layer.mlp.register_forward_pre_hook(record_weight_sums(run))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    for step in range(STEPS):
        run.mlp_weight_sums.append([])
        ids = batch(step)
        with emulation.count_op_calls() as calls:
            loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.losses.append(loss.item())
        run.calls.append(dict(calls))
        del loss
        dist.barrier()  # as before the baseline: the step's last collective may still hold its buffers until then
        gc.collect()
        run.memory.append(torch.npu.memory_allocated() - baseline)
    run.final = full_parameters(model)
    return run


def wrap(model: nn.Module, engine: Engine) -> nn.Module:
    if engine.wrapper == "ddp":
        return DistributedDataParallel(model)
    precision = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if engine.bf16 else None,
        reduce_dtype=torch.float32 if engine.bf16 else None,
    )
    shard = {"reshard_after_forward": engine.reshard_after_forward, "mp_policy": precision}
    if engine.lora:  # LLaMA-Factory v1 (FSDP2Engine.prepare_model): each trainable leaf on its own, first
        for module in model.modules():
            if next(module.children(), None) is None and any(p.requires_grad for p in module.parameters(False)):
                fully_shard(module, **shard)
    if engine.lm_head_unit:  # its hooks gather its weight for its own call, in which the card computes the loss
        fully_shard(model.lm_head, **shard)
    for layer in decoder_layers(model):
        fully_shard(layer, **shard)
    fully_shard(model, **shard)
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def record_weight_sums(run: Run):
    def hook(mlp: nn.Module, args) -> None:
        with torch.no_grad():
            run.mlp_weight_sums[-1].append(sum(p.double().sum().item() for p in mlp.parameters()))

    return hook


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (FSDP2's shards gathered), float32 on the host, by its name in the unwrapped model."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    trainable = {name.removeprefix("module.") for name, p in model.named_parameters() if p.requires_grad}
    if not trainable <= set(state):
        raise AssertionError(f"state dict lacks trainable parameters: {sorted(trainable - set(state))[:5]}")
    return {name: state[name].detach().float().cpu() for name in sorted(trainable)}


# --- In the test process ---------------------------------------------------------------------------------------

MODEL_TYPES = ["llama", "qwen3_moe"]
"""One family per kind of layer the engines shard: dense (norms, RoPE, split MLPs) and MoE (3-D expert weights).
Qwen3 (a Llama plus q/k norms, the same RMSNorm card on the same sharded decoder-layer unit) was a third run of
the dense path: it is trained on 2 ranks under DeepSpeed ZeRO-3 (tests/test_deepspeed_zero3.py), and its q/k
norms fused, exact, in one process (tests/test_mapping.py, tests/test_training_stacks.py)."""
FUSED_EVERY_STEP = {
    # npu-linear-cross-entropy too: the lm_head in the root unit (its parameters plain in the root's forward), or a
    # unit of its own (the loss computed as lm_head's call, inside which FSDP2 has unsharded its weight); and
    # npu-fused-attention, which apply_npu_kernels makes the model's attention (its default sdpa replaced)
    "llama": {"npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_cross_entropy_loss", "npu_fusion_attention"},
    "qwen3_moe": {
        "npu_fusion_attention",
        "npu_rms_norm",
        "npu_rotary_mul",
        "npu_grouped_matmul",
        "npu_moe_token_permute",
        "npu_cross_entropy_loss",
    },
}
"""Ops that must be among each kernelized step's calls (the rest is whatever the plain model calls). With LoRA,
gate_proj/up_proj are peft Linears (base layer plus adapter): whether the SwiGLU card fuses them is the card's
own contract, so there the fused calls must equal the plain model's, with npu_swiglu not required."""
NOT_REQUIRED_WITH_LORA = {"npu_swiglu"}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_kernelized_training_under_ddp_and_fsdp2_equals_eager(built_cards, model_type):
    ranks = run_distributed(train_every_engine, model_type, str(built_cards), world_size=2, timeout=170)
    problems = []
    for rank, (runs, casting_unit) in enumerate(ranks):
        if casting_unit is not None and not (
            "output" in casting_unit["reason"] and casting_unit["calls"] == {} and casting_unit["eager"]
        ):
            problems.append(f"rank {rank}: an lm_head unit casting its output fused or is not eager: {casting_unit}")
        for name, engine in engines(model_type).items():
            eager, fused = runs[name][False], runs[name][True]
            where = f"rank {rank}, {name}"
            reference = runs[FP32_REFERENCE[name]][False] if engine.bf16 else None
            problems += check_numbers(where, eager, fused, reference)
            required = FUSED_EVERY_STEP[model_type] - (NOT_REQUIRED_WITH_LORA if engine.lora else set())
            problems += check_fusion(where, required, eager, fused)
            problems += check_weights_follow_the_optimizer(where, eager, fused, reference)
            problems += check_memory(where, eager, fused)
    assert not problems, "\n".join(problems)


def check_numbers(where: str, eager: Run, fused: Run, fp32_reference: Run | None) -> list[str]:
    problems = []
    if fp32_reference is None:
        if not close(fused.losses, eager.losses):
            problems.append(f"{where}: losses {fused.losses} != eager {eager.losses}")
        for name, value in eager.final.items():
            if not close(fused.final[name], value):
                error = (fused.final[name] - value).abs().max().item()
                problems.append(f"{where}: final {name} differs from eager by {error:.3g}")
        return problems
    for step, (loss, eager_loss, ref) in enumerate(zip(fused.losses, eager.losses, fp32_reference.losses, strict=True)):
        if abs(loss - ref) > 2 * abs(eager_loss - ref) + BF16_FLOOR:
            problems.append(f"{where}: step {step} loss {loss} vs fp32 {ref}; eager bf16 {eager_loss}")
    # The whole model's update (AdamW's steps are nearly signs: on one 64-entry norm weight, which entries a rounding
    # flips is one random draw).
    reference_update, eager_update, fused_update = (whole_update(run) for run in (fp32_reference, eager, fused))
    eager_error = relative_error(eager_update, reference_update)
    error = relative_error(fused_update, reference_update)
    if error > 2 * eager_error + BF16_FLOOR:
        problems.append(f"{where}: the parameters' update is off fp32 by {error:.3g}, eager bf16 by {eager_error:.3g}")
    return problems


def whole_update(run: Run) -> torch.Tensor:
    return torch.cat([(run.final[name] - run.initial[name]).flatten() for name in sorted(run.final)])


def check_fusion(where: str, required: set[str], eager: Run, fused: Run) -> list[str]:
    problems = []
    if any(eager.calls):
        problems.append(f"{where}: the run without kernels called fused ops {eager.calls}")
    if not required <= set(fused.plain_calls):
        problems.append(f"{where}: the kernelized model alone calls only {fused.plain_calls}")
    for step, calls in enumerate(fused.calls):
        if calls != fused.plain_calls:
            problems.append(f"{where}: step {step} called {calls}; the model alone calls {fused.plain_calls}")
    return problems


def check_weights_follow_the_optimizer(where: str, eager: Run, fused: Run, fp32_reference: Run | None) -> list[str]:
    problems = []
    for step in range(1, STEPS):
        pairs = zip(fused.mlp_weight_sums[step - 1], fused.mlp_weight_sums[step], strict=True)
        for mlp, (before, now) in enumerate(pairs):
            if before == now:
                problems.append(f"{where}: MLP {mlp} read the same weights at steps {step - 1} and {step} (frozen)")
    fused_sums = torch.tensor(fused.mlp_weight_sums, dtype=torch.float64)
    eager_sums = torch.tensor(eager.mlp_weight_sums, dtype=torch.float64)
    if fp32_reference is None:
        if not close(fused_sums, eager_sums):
            problems.append(f"{where}: MLP weight sums {fused.mlp_weight_sums} != eager {eager.mlp_weight_sums}")
        return problems
    reference = torch.tensor(fp32_reference.mlp_weight_sums, dtype=torch.float64)
    if (fused_sums - reference).abs().max() > 2 * (eager_sums - reference).abs().max() + BF16_FLOOR:
        problems.append(f"{where}: MLP weight sums {fused.mlp_weight_sums}, eager {eager.mlp_weight_sums}")
    return problems


def check_memory(where: str, eager: Run, fused: Run) -> list[str]:
    extra = [f - e for f, e in zip(fused.memory, eager.memory, strict=True)]
    if max(extra) > 0:
        return [f"{where}: npu bytes in use after each step exceed eager's by {extra} (eager: {eager.memory})"]
    return []


def close(a, b) -> bool:
    return torch.allclose(torch.as_tensor(a), torch.as_tensor(b), rtol=FP32_TOLERANCE, atol=FP32_TOLERANCE)
