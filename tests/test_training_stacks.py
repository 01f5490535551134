"""Kernelized models in what real training stacks do, on the emulated npu: nothing may crash, lose fusion
silently, or make a number wrong.

What each run is compared with:
- float32: the same run without kernels, on the host. The emulated npu computes every op that is not fused
  with the host's own kernels, so an eager run on the host gives the numbers an eager run on the npu gives;
  and a host run cannot pick up the rotary function-module that any kernelize of the family switches for the
  whole process (docs/models.md, "How the rotary functions are reached"). Losses within rtol 1e-4, gradients within
  rtol 1e-4 / atol 1e-5, optimizer updates within 0.1% (relative L2 of whole updates: Adam divides by the root of
  the squared gradients, so a rounding difference in a near-zero entry changes that entry's step).
- mixed precision (float32 weights under `torch.autocast("npu", torch.bfloat16)`): the flash-attention idiom.
  Against a float64 host reference, the kernelized run's error is at most twice the error of the same run
  without kernels under the same autocast on the npu (relative L2 per gradient, absolute for the loss).
- fusion: `emulation.count_op_calls()` over the whole run equals what the swapped modules should call; the runs
  without kernels call no fused op (negative controls).
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from kernels import Mode, kernelize
from numerics import relative_error
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from npu_hub_kernels import kept_forwards, swapped_modules
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.emulation.ops.npu_linear_cross_entropy import ADDMM_DTYPE_OUT
from npu_hub_kernels.testing.tiny_models import (
    VOCAB,
    gating_op_routers,
    norm_module_count,
    renormalised_op_routers,
    token_ids,
)
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm as tiny_model


def layer_count(model) -> int:
    return model.config.num_hidden_layers


def split_mlp_count(model) -> int:
    return sum(isinstance(getattr(m, "gate_proj", None), torch.nn.Linear) for m in model.modules())


def experts_count(model) -> int:
    return sum(getattr(getattr(m, "gate_up_proj", None), "dim", lambda: 0)() == 3 for m in model.modules())


def host_reference(model_type: str, dtype=torch.float64):
    """The family's tiny model on the host, experts as the eager loop (torch's grouped_mm takes no float64)."""
    model = tiny_model(model_type).to(dtype)
    if experts_count(model):
        model.set_experts_implementation("eager")
    return model


# --- Mixed precision ------------------------------------------------------------------------------------------

FLOAT32_OUT = ADDMM_DTYPE_OUT
"""16-bit matmul operands summed into a float32 out (`torch.addmm(..., out_dtype=torch.float32)`), as counted."""
AUTOCAST_CALLS = {
    # Llama: the input and final norms see the float32 residual stream and fuse; the mid residual add meets a
    # bfloat16 attention output (o_proj autocast): eager's sum promotes to float32, and npu-add-rms-norm adds the two
    # as eager does (torch_npu's one mixed-dtype Add kernel) and normalises the sum with npu_rms_norm (its backward
    # is that op's own node, no call of the card's): 3 + 2 npu_rms_norm, no npu_add_rms_norm; q/k come
    # out of bfloat16 linears while cos/sin stay float32: eager's rotary promotes to float32, and the card rotates q/k
    # cast to float32; the MLP input is float32 and fuses, its gate/up matmuls autocast to bfloat16 as gate_proj(x) is,
    # and its float32 x and weights (down_proj's too) get their gradients as float32 sums of those bfloat16 operands
    # (addmm out_dtype: dx's two, one per weight, per split MLP).
    "llama": {
        "npu_rms_norm": 5, "npu_rotary_mul": 4, "npu_swiglu": 2, FLOAT32_OUT: 10,
    },
    # Qwen3: as Llama, but q/k norms get bfloat16 q/k with a float32 weight: eager rounds the normalised q/k to
    # bfloat16 before the float32 weight promotes them, which the op cannot: those norms run eager. Their float32
    # output meets float32 cos/sin: the rotary fuses, in float32.
    "qwen3": {
        "npu_rms_norm": 5, "npu_rotary_mul": 4, "npu_swiglu": 2, FLOAT32_OUT: 10,
    },
    # Qwen3-MoE: as Qwen3; the experts get float32 hidden states and float32 weights (torch_npu's grouped matmul
    # is not autocast): 2 grouped matmuls forward and 4 backward per Experts module, in float32 as eager's.
    "qwen3_moe": {
        "npu_rms_norm": 5,
        "npu_rotary_mul": 4,
        "npu_swiglu": 2,
        "npu_moe_token_permute": 2,
        "npu_grouped_matmul": 12,
        "npu_moe_token_unpermute": 2,
        # the routers (norm_topk_prob off in the tiny config) record autograd: softmax and top-k, no op call
    },
    # DeepSeek-V3 (one MoE layer, one dense): as Llama; its router's logits come out of F.linear, which autocast runs
    # in bfloat16 despite the router's float32 casts: npu_moe_gating_top_k fuses on them, as eager routes on them.
    "deepseek_v3": {
        "npu_rms_norm": 5, "npu_rotary_mul": 4, "npu_swiglu": 3, FLOAT32_OUT: 10,
        "npu_moe_gating_top_k": 1, "npu_moe_token_permute": 1, "npu_grouped_matmul": 6, "npu_moe_token_unpermute": 1,
    },
}  # fmt: skip


def autocast_loss_and_gradients(model, ids, *, autocast: bool = True):
    """(loss, logits, gradients) of one training forward and backward; logits and gradients as float64 on the host."""
    model.train()
    device = next(model.parameters()).device
    ids = ids.to(device)
    with torch.autocast("npu", dtype=torch.bfloat16, enabled=autocast):
        out = model(ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad.double().cpu() for name, p in model.named_parameters() if p.grad is not None}
    return out.loss.double().item(), out.logits, grads


@pytest.mark.parametrize("model_type", list(AUTOCAST_CALLS))
def test_autocast_forward_and_backward_within_the_eager_idiom(npu_kernels, model_type):
    """float32 weights under torch.autocast("npu", bfloat16): what fuses is what every path can compute right
    (AUTOCAST_CALLS, and the loss where npu-linear-cross-entropy swaps the class), the rest falls back; logits, loss
    and every gradient within twice eager autocast's error (the logits of a forward without labels where the loss
    fused: the fused step makes none)."""
    ids = token_ids()
    ref_loss, ref_logits, ref_grads = autocast_loss_and_gradients(host_reference(model_type), ids, autocast=False)
    with emulation.count_op_calls() as eager_calls:
        eager_loss, eager_logits, eager_grads = autocast_loss_and_gradients(tiny_model(model_type).to("npu"), ids)
    # The eager model is not kernelized: nothing fuses, except the family's shared rotary function-module that
    # an earlier kernelize in this process may have switched (exact in float32, README).
    assert set(eager_calls) <= {"npu_rotary_mul"}
    model = kernelize(tiny_model(model_type).to("npu"), mode=Mode.TRAINING, device="npu")
    with emulation.count_op_calls() as calls:
        loss, logits, grads = autocast_loss_and_gradients(model, ids)
    expected = {**AUTOCAST_CALLS[model_type], LOSS_OP: fused_loss(model)}
    assert dict(calls) == {op: n for op, n in expected.items() if n}
    assert (logits is None) == bool(fused_loss(model))
    if logits is None:
        with torch.autocast("npu", dtype=torch.bfloat16), torch.no_grad():
            logits = model(ids.to("npu")).logits
    assert logits.dtype == eager_logits.dtype == torch.bfloat16
    eager_error = relative_error(eager_logits.cpu(), ref_logits)
    assert relative_error(logits.cpu(), ref_logits) <= 2 * eager_error, eager_error
    # The loss averages the logits' rounding errors: one random draw (measured 1e-5 to 1.5e-4 for either run
    # over four batches); 1e-3 is far below what a wrong norm, rotation or activation shifts it by.
    assert abs(loss - ref_loss) <= 2 * abs(eager_loss - ref_loss) + 1e-3, (loss, eager_loss, ref_loss)
    assert set(grads) == set(eager_grads) == set(ref_grads)
    for name, grad in grads.items():
        eager_error = relative_error(eager_grads[name], ref_grads[name])
        assert relative_error(grad, ref_grads[name]) <= 2 * eager_error + 1e-3, (name, eager_error)


# --- transformers' Trainer -----------------------------------------------------------------------------------

STEPS = 4


class RandomTokens(torch.utils.data.Dataset):
    """Causal-LM examples of random token ids (ids 0-2 are pad/bos/eos)."""

    def __init__(self, examples: int = 4 * STEPS, seq: int = 8, seed: int = 0) -> None:
        self.ids = torch.randint(3, VOCAB, (examples, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def training_args(output_dir, **overrides) -> TrainingArguments:
    """A few logged AdamW steps with gradient checkpointing and a checkpoint every 2 steps; the device is the
    accelerator accelerate finds (the npu) unless use_cpu is given."""
    settings = dict(
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=1e-2,
        logging_steps=1,
        save_steps=2,
        gradient_checkpointing=True,
        seed=0,
        report_to=[],
        disable_tqdm=True,
    )
    return TrainingArguments(output_dir=str(output_dir), **{**settings, **overrides})


def logged_losses(trainer: Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def fused_decoder_count(model) -> int:
    """Decoder layers npu-add-rms-norm swaps: each runs npu_add_rms_norm in place of its post-attention norm."""
    return len(swapped_modules(model, card="npu-add-rms-norm"))


def per_step_calls(model, *, checkpointing: bool = True) -> dict[str, int]:
    """Fused calls of one training step (forward and backward) of a kernelized float32 model. Gradient
    checkpointing runs every decoder layer's forward again in backward (the final norm runs once)."""
    forwards = 2 if checkpointing else 1
    experts = experts_count(model)
    decoders = fused_decoder_count(model)
    calls = {
        "npu_cross_entropy_loss": fused_loss(model),
        "npu_rms_norm": (norm_module_count(model) - 1 - decoders) * forwards + 1,
        "npu_add_rms_norm": decoders * forwards,
        "npu_rms_norm_backward": decoders,
        "npu_rotary_mul": 2 * layer_count(model) * forwards,
        "npu_swiglu": (split_mlp_count(model) + experts) * forwards,
        "npu_moe_token_permute": experts * forwards,
        "npu_grouped_matmul": experts * (2 * forwards + 4),  # dx and dW of both grouped linears in backward
        "npu_moe_token_unpermute": experts * forwards,
        "npu_moe_gating_top_k": gating_op_routers(model, training=True) * forwards,
        # npu-fused-attention, where apply_npu_kernels made it the model's attention: one call per attention layer
        "npu_fusion_attention": layer_count(model) * forwards * (model.config._attn_implementation == NAME),
    }
    return {op: n for op, n in calls.items() if n}


NAME = "npu_fused_attention"


def times(calls: dict[str, int], n: int) -> dict[str, int]:
    return {op: count * n for op, count in calls.items()}


def state_on_host(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_trainer_fine_tunes_saves_and_resumes_like_eager(npu_kernels, tmp_path, model_type):
    """`from_pretrained(device_map="npu", use_kernels=True)` fine-tuned by transformers' Trainer on the npu (with
    gradient checkpointing, pinned batches, fused AdamW, checkpoints every 2 steps), then resumed from the
    step-2 checkpoint: the losses and updates of the same Trainer run without kernels on the host, every fused
    op of every step (forward, checkpointing's recompute, backward) counted, and a resumed run that continues
    the uninterrupted one exactly (dense model: see the MoE test below for why not Qwen3-MoE)."""
    tiny_model(model_type).save_pretrained(tmp_path / "source")
    eager = AutoModelForCausalLM.from_pretrained(tmp_path / "source")
    initial = state_on_host(eager)
    eager_trainer = Trainer(eager, training_args(tmp_path / "eager", use_cpu=True), train_dataset=RandomTokens())
    with emulation.count_op_calls() as eager_calls:
        eager_trainer.train()
    assert eager_calls == {} and eager_trainer.args.device.type == "cpu"

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "source", device_map="npu", use_kernels=True)
    trainer = Trainer(model, training_args(tmp_path / "npu"), train_dataset=RandomTokens())
    assert trainer.args.device.type == "npu" and model.device.type == "npu"
    with emulation.count_op_calls() as calls:
        trainer.train()
    assert model.is_gradient_checkpointing
    assert dict(calls) == times(per_step_calls(model), STEPS)
    losses = logged_losses(trainer)
    assert len(losses) == STEPS
    torch.testing.assert_close(losses, logged_losses(eager_trainer), rtol=1e-4, atol=1e-5)
    final, eager_final = state_on_host(model), state_on_host(eager)
    moved = {name: relative_error(final[name] - initial[name], eager_final[name] - initial[name]) for name in initial}
    assert max(moved.values()) <= 1e-3, max(moved.items(), key=lambda item: item[1])
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "npu" / f"checkpoint-{STEPS}").state_dict()
    assert saved.keys() == model.state_dict().keys()
    assert all(torch.equal(saved[name], value.cpu()) for name, value in model.state_dict().items())
    if experts_count(model):
        return

    resumed_model = AutoModelForCausalLM.from_pretrained(tmp_path / "source", device_map="npu", use_kernels=True)
    resumed = Trainer(resumed_model, training_args(tmp_path / "npu"), train_dataset=RandomTokens())
    with emulation.count_op_calls() as resumed_calls:
        resumed.train(resume_from_checkpoint=str(tmp_path / "npu" / "checkpoint-2"))
    assert dict(resumed_calls) == times(per_step_calls(resumed_model), STEPS - 2)
    torch.testing.assert_close(logged_losses(resumed), losses)  # steps 1-2 from the checkpoint, 3-4 run again
    resumed_final = state_on_host(resumed_model)
    for name, value in final.items():
        torch.testing.assert_close(resumed_final[name], value, msg=name)


@pytest.mark.xfail(
    strict=True,
    reason="transformers 5.22.2: Trainer resume loads model.safetensors with load_state_dict(strict=False), without "
    "the weight conversion from_pretrained applies; MoE checkpoints hold the experts per expert "
    "(experts.0.gate_proj.weight, ...), so the fused experts keep their initial weights (a warning lists the keys)",
)
def test_trainer_resume_restores_moe_experts_without_kernels(tmp_path):
    """Why the resume above is checked on a dense model: on the host, with no kernels at all, resuming a
    Qwen3-MoE run does not continue it. (strict xfail: passes once transformers restores the experts.)"""
    tiny_model("qwen3_moe").save_pretrained(tmp_path / "source")
    args = training_args(tmp_path / "run", use_cpu=True, gradient_checkpointing=False)
    trainer = Trainer(AutoModelForCausalLM.from_pretrained(tmp_path / "source"), args, train_dataset=RandomTokens())
    trainer.train()
    resumed = Trainer(AutoModelForCausalLM.from_pretrained(tmp_path / "source"), args, train_dataset=RandomTokens())
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    torch.testing.assert_close(logged_losses(resumed), logged_losses(trainer))


def test_trainer_without_use_kernels_fuses_no_norm_or_mlp(npu_kernels, tmp_path):
    """Negative control: the same npu Trainer run on a model loaded without use_kernels (cards registered) runs no
    fused norm or MLP; the counts above come from the kernels. (Its rotary calls may fuse: the family's shared
    rotary function-module follows the last kernelize of the family, exact in float32, README.)"""
    tiny_model("llama").save_pretrained(tmp_path / "source")
    eager = AutoModelForCausalLM.from_pretrained(tmp_path / "source")
    eager_trainer = Trainer(eager, training_args(tmp_path / "eager", use_cpu=True), train_dataset=RandomTokens())
    eager_trainer.train()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "source", device_map="npu")
    trainer = Trainer(model, training_args(tmp_path / "npu"), train_dataset=RandomTokens())
    with emulation.count_op_calls() as calls:
        trainer.train()
    assert set(calls) <= {"npu_rotary_mul"}
    torch.testing.assert_close(logged_losses(trainer), logged_losses(eager_trainer), rtol=1e-4, atol=1e-5)


def flat_update(model, initial: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every parameter's update, as one vector."""
    return torch.cat(
        [(p.detach().double().cpu() - initial[name].double()).flatten() for name, p in model.named_parameters()]
    )


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_trainer_bf16_mixed_precision_within_the_eager_idiom(npu_kernels, tmp_path, model_type):
    """TrainingArguments(bf16=True): accelerate runs each forward under torch.autocast("npu", bfloat16) on float32
    weights. Against the float32 run on the host, the kernelized run's whole update (all parameters, relative L2)
    is at most twice as far off as the same bf16 run's without kernels; what fuses is what fuses under autocast
    (AUTOCAST_CALLS, per step, with checkpointing's recompute).

    Why the whole update and not each step's loss: AdamW's first steps move every weight by about lr times the
    sign of its gradient, and bfloat16 rounding flips the sign of the near-zero ones, so each bf16 run's later
    losses are one random draw around the float32 trajectory (measured over 6 data seeds: mean loss errors
    0.001 to 0.007 for both runs, in either order), while the whole update's error is steady (kernelized over
    eager 0.87 to 1.10). Losses are checked against that band."""
    tiny_model(model_type).save_pretrained(tmp_path / "source")
    initial = state_on_host(AutoModelForCausalLM.from_pretrained(tmp_path / "source"))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "source")
    reference_trainer = Trainer(reference, training_args(tmp_path / "fp32", use_cpu=True), train_dataset=RandomTokens())
    reference_trainer.train()
    runs = {}
    for kernels in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "source", device_map="npu", use_kernels=kernels)
        trainer = Trainer(model, training_args(tmp_path / f"bf16-{kernels}", bf16=True), train_dataset=RandomTokens())
        with emulation.count_op_calls() as calls:
            trainer.train()
        runs[kernels] = logged_losses(trainer), flat_update(model, initial), dict(calls)
    (eager_losses, eager_update, eager_calls), (losses, update, calls) = runs[False], runs[True]
    assert set(eager_calls) <= {"npu_rotary_mul"}  # the shared rotary function-module, as above
    # use_kernels=True kernelizes again at train() and keeps accelerate's autocast wrapper of the model's forward (a
    # forward another library set), which runs npu-linear-cross-entropy's layer inside: its loss fuses, in bfloat16
    assert hasattr(model.forward, "__wrapped__") and kept_forwards(model) == []  # accelerate's wrapper, of the card
    assert fused_loss(model) == 1  # Qwen3-MoE's too: MoeCausalLMWithAuxLoss adds its router's auxiliary loss
    # bfloat16 q/k with float32 cos/sin: rope fuses on the operand cast up, as eager promotes it; a bfloat16 attention
    # output on the float32 residual: add-rms-norm adds them as eager does and runs npu_rms_norm on the float32 sum,
    # its backward npu_rms_norm's own node (AUTOCAST_CALLS)
    expected = per_step_calls(model)
    expected["npu_rms_norm"] += expected.pop("npu_add_rms_norm")
    del expected["npu_rms_norm_backward"]
    if model_type == "qwen3_moe":  # q/k norms take bfloat16 input: they fall back
        expected["npu_rms_norm"] -= 2 * layer_count(model) * 2
    if split_mlp_count(model):  # float32 gradients of the split MLPs' x and weights, in backward (AUTOCAST_CALLS)
        expected[FLOAT32_OUT] = 5 * split_mlp_count(model)
    assert calls == times(expected, STEPS)
    reference_update = flat_update(reference, initial)
    eager_error = relative_error(eager_update, reference_update)
    assert relative_error(update, reference_update) <= 2 * eager_error, eager_error
    target = logged_losses(reference_trainer)
    band = 2 * max(abs(e - t) for e, t in zip(eager_losses, target, strict=True)) + 5e-3
    assert all(abs(loss - t) <= band for loss, t in zip(losses, target, strict=True)), (losses, eager_losses, target)


# --- PEFT LoRA on all linear layers ----------------------------------------------------------------------------


def lora_config() -> LoraConfig:
    """A fresh LoRA config for each model: peft fills a config in as it wraps a model (an MoE model's expert
    parameters become its target_parameters), so a shared one would carry that to the next model."""
    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)


LORA_ORDERS = ["kernelize, then LoRA", "LoRA, then kernelize"]


def lora_pair(model_type: str, order: str):
    """The same LoRA model twice (the same seed draws the same adapters): on the host without kernels, and on the
    npu kernelized before or after PEFT wraps it."""
    host, npu = tiny_model(model_type), tiny_model(model_type).to("npu")
    if order == LORA_ORDERS[0]:
        kernelize(npu, mode=Mode.TRAINING, device="npu")
    torch.manual_seed(0)
    eager = get_peft_model(host, lora_config())
    torch.manual_seed(0)
    model = get_peft_model(npu, lora_config())
    if order == LORA_ORDERS[1]:
        kernelize(model, mode=Mode.TRAINING, device="npu")
    return eager, model


def loss_and_gradients(model, ids):
    """A training step's loss and gradients (its logits are None where npu-linear-cross-entropy fuses the loss)."""
    model.train()
    device = next(model.parameters()).device
    out = model(ids.to(device), labels=ids.to(device))
    out.loss.backward()
    grads = {name: p.grad.cpu() for name, p in model.named_parameters() if p.grad is not None}
    return out.loss.item(), grads


def logits_of(model, ids) -> torch.Tensor:
    """The logits of a forward without labels, in training mode (dropout off in the tiny models)."""
    model.train()
    with torch.no_grad():
        return model(ids.to(next(model.parameters()).device)).logits.cpu()


LOSS_OP = "npu_cross_entropy_loss"
"""npu-linear-cross-entropy's fused loss: one call per training step with labels (a tiny model's step takes the
log-probability form, whose backward is the op's own autograd node: no call of npu_cross_entropy_loss_backward)."""


def fused_loss(model) -> int:
    """1 where npu-linear-cross-entropy swaps the model's *ForCausalLM forward (its loss fuses in a training step with
    labels: one npu_cross_entropy_loss, and its backward, per step), else 0."""
    return int(bool(swapped_modules(model, card="npu-linear-cross-entropy")))


def forward_calls(model, *, backward: bool = False, mlps: bool = True) -> dict[str, int]:
    """Fused calls of one float32 forward (and backward: a training step with labels) of a kernelized model (`mlps`:
    its split MLPs fuse)."""
    experts = experts_count(model)
    decoders = fused_decoder_count(model)
    calls = {
        LOSS_OP: fused_loss(model) if backward else 0,
        "npu_rms_norm": norm_module_count(model) - decoders,
        "npu_add_rms_norm": decoders,
        "npu_rms_norm_backward": decoders if backward else 0,
        "npu_rotary_mul": 2 * layer_count(model),
        "npu_swiglu": (split_mlp_count(model) if mlps else 0) + experts,
        "npu_moe_token_permute": experts,
        "npu_grouped_matmul": (6 if backward else 2) * experts,
        "npu_moe_token_unpermute": experts,
        "npu_moe_gating_top_k": gating_op_routers(model, training=backward),
        "npu_moe_gating_top_k_softmax_v2": renormalised_op_routers(model, training=backward),
        "npu_fusion_attention": layer_count(model) * (model.config._attn_implementation == NAME),
    }
    return {op: n for op, n in calls.items() if n}


@pytest.mark.parametrize("order", LORA_ORDERS)
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_lora_all_linear_dense_mlps_take_the_eager_path(npu_kernels, model_type, order):
    """LoRA wraps gate/up/down (and q/k/v/o): those MLPs run the card's layer, which must not fuse
    LoRA-wrapped projections: npu_swiglu 0 and the eager numbers. Norms and RoPE still fuse. The loss and every
    LoRA gradient equal the same LoRA model's without kernels; base weights stay frozen."""
    eager, model = lora_pair(model_type, order)
    for mlp in (m for m in model.modules() if hasattr(m, "gate_proj")):
        assert all(isinstance(getattr(mlp, p), LoraLinear) for p in ("gate_proj", "up_proj", "down_proj"))
    ids = token_ids()
    eager_loss, eager_grads = loss_and_gradients(eager, ids)
    with emulation.count_op_calls() as calls:
        loss, grads = loss_and_gradients(model, ids)
    logits, eager_logits = logits_of(model, ids), logits_of(eager, ids)
    assert dict(calls) == forward_calls(model, backward=True, mlps=False)
    assert calls["npu_rms_norm"] and calls["npu_rotary_mul"] and not calls["npu_swiglu"]
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(eager_grads) and all("lora_" in name for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    listed = swapped_modules(model)
    assert {s.card for s in listed} == {
        "npu-rms-norm",
        "npu-rope",
        "npu-swiglu",
        "npu-add-rms-norm",
        "npu-linear-cross-entropy",
    }
    fused_norms = len([s for s in listed if s.card == "npu-add-rms-norm"])  # each fuses its post-attention norm
    assert len([s for s in listed if s.card == "npu-rms-norm"]) - fused_norms == calls["npu_rms_norm"]
    assert 2 * len([s for s in listed if s.card == "npu-rope"]) == calls["npu_rotary_mul"]


@pytest.mark.parametrize("order", LORA_ORDERS)
def test_lora_all_linear_moe_experts_still_fuse(npu_kernels, order):
    """Qwen3-MoE: LoRA wraps the attention projections and, in peft 0.21.2, the Experts module's 3-D
    gate_up_proj/down_proj too (ParamWrapper: the delta is added to the weight the Experts forward reads).
    npu-moe still runs, on the adapted weights (5 device ops per Experts module forward, 4 more backward);
    norms and RoPE fuse. The loss and every LoRA gradient, the experts' adapters included, equal eager LoRA's."""
    eager, model = lora_pair("qwen3_moe", order)
    experts = [name for name, m in model.named_modules() if name.endswith("mlp.experts")]
    assert experts and all(type(model.get_submodule(name)).__name__ == "ParamWrapper" for name in experts)
    ids = token_ids()
    eager_loss, eager_grads = loss_and_gradients(eager, ids)
    with emulation.count_op_calls() as calls:
        loss, grads = loss_and_gradients(model, ids)
    logits, eager_logits = logits_of(model, ids), logits_of(eager, ids)
    assert dict(calls) == forward_calls(model, backward=True)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(eager_grads) and all("lora_" in name for name in grads)
    assert any(name.startswith(f"{e}.") for e in experts for name in grads)  # the experts' adapters learn
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    with model.disable_adapter(), torch.no_grad():  # the adapters change the output: the check above has teeth
        base_logits = model(ids.to("npu")).logits.cpu()
    assert not torch.allclose(base_logits, logits, rtol=1e-3, atol=1e-3)
    listed = swapped_modules(model, card="npu-moe")
    assert len(listed) == calls["npu_moe_token_permute"] == layer_count(model)


# --- A deep-copied reference model beside the trained one (TRL) -----------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_a_deep_copied_reference_stays_while_the_trained_model_moves(npu_kernels, tmp_path, model_type):
    """TRL's reference model: `ref = copy.deepcopy(model)` of the npu policy loaded with use_kernels, frozen and
    kernelized for inference. Each step runs the reference under no_grad, then a policy step (AdamW). The
    reference's logits stay the initial ones exactly while the policy moves; both fuse every step; what
    swapped_modules lists for each is what runs; the policy's losses and updates are the host run's."""
    tiny_model(model_type).save_pretrained(tmp_path / "source")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "source", device_map="npu", use_kernels=True)
    model.train()
    params = dict(model.named_parameters())
    assert fused_loss(model) == 1  # the counts below then hold the loss card's op to one per step
    reference = copy.deepcopy(model)
    reference.eval().requires_grad_(False)
    kernelize(reference, mode=Mode.INFERENCE, device="npu")
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    host = AutoModelForCausalLM.from_pretrained(tmp_path / "source")
    host_reference = copy.deepcopy(host).eval().requires_grad_(False)
    initial = state_on_host(host)
    batches = [token_ids(seed=s) for s in range(3)]
    with torch.no_grad():
        initial_logits = host_reference(batches[0]).logits

    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, host)]
    losses, host_losses = [], []
    for ids in batches:
        for policy, ref, optimizer, record in (
            (model, reference, optimizers[0], losses),
            (host, host_reference, optimizers[1], host_losses),
        ):
            device = next(policy.parameters()).device
            with emulation.count_op_calls() as ref_calls, torch.no_grad():
                ref_logits = ref(batches[0].to(device)).logits.cpu()
            with emulation.count_op_calls() as policy_calls:
                loss = policy(ids.to(device), labels=ids.to(device)).loss
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            record.append(loss.item())
            if device.type == "npu":
                torch.testing.assert_close(ref_logits, initial_logits, rtol=1e-5, atol=1e-5)
                assert dict(ref_calls) == forward_calls(reference)
                assert dict(policy_calls) == forward_calls(model, backward=True)
    torch.testing.assert_close(losses, host_losses, rtol=1e-4, atol=1e-5)
    assert all(p is params[name] for name, p in model.named_parameters())  # the same Parameters, trained in place
    final, host_final = state_on_host(model), state_on_host(host)
    moved = {name: relative_error(final[name] - initial[name], host_final[name] - initial[name]) for name in initial}
    assert max(moved.values()) <= 1e-3, max(moved.items(), key=lambda item: item[1])
    assert all(torch.equal(state_on_host(reference)[name], value) for name, value in initial.items())
    with torch.no_grad():
        moved_logits = model(batches[0].to("npu")).logits.cpu()
    assert not torch.allclose(moved_logits, initial_logits, rtol=1e-3, atol=1e-3)

    for m in (model, reference):  # what is listed runs: one fused call per listed norm, experts; two per rotary
        m.eval()
        listed = Counter(s.card for s in swapped_modules(m))
        with emulation.count_op_calls() as calls, torch.no_grad():
            m(batches[0].to("npu"))
        # a decoder layer npu-add-rms-norm swaps fuses its post-attention norm into npu_add_rms_norm
        assert listed["npu-rms-norm"] - listed["npu-add-rms-norm"] == calls["npu_rms_norm"]
        assert listed["npu-add-rms-norm"] == calls["npu_add_rms_norm"]
        assert 2 * listed["npu-rope"] == calls["npu_rotary_mul"]
        assert listed["npu-moe"] == calls["npu_moe_token_permute"]
        assert listed["npu-swiglu"] + listed["npu-moe"] == calls["npu_swiglu"]


@pytest.mark.parametrize("move", [".to('npu')", "the Trainer"])
def test_trainer_bf16_runs_the_loss_card_on_a_model_loaded_on_the_host(npu_kernels, tmp_path, move):
    """The common way: from_pretrained(use_kernels=True) on the host (kernelize binds the class's own forwards there),
    then the model moved to the npu (by .to() or by the Trainer), then TrainingArguments(bf16=True): accelerate
    wraps the class's own forward in its autocast, and the loss card runs inside that wrapper (issue 39)."""
    tiny_model("llama").save_pretrained(tmp_path / "source")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "source", use_kernels=True)
    if move == ".to('npu')":
        model.to("npu")
    trainer = Trainer(model, training_args(tmp_path / "bf16", bf16=True), train_dataset=RandomTokens())
    with emulation.count_op_calls() as calls:
        trainer.train()
    assert kept_forwards(model) == [], kept_forwards(model)
    assert calls["npu_cross_entropy_loss"] == STEPS and calls["npu_rms_norm"] > 0
