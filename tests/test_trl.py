"""TRL's trainers (trl 1.16.0) on the cards, on the emulated npu: SFTTrainer and DPOTrainer, with the model loaded
with `use_kernels=True` (TRL's advice, `model_init_kwargs={"use_kernels": True}`) and with `apply_npu_kernels`
applied before the trainer.

TRL sets its own fused LM head as the forward of the `*ForCausalLM` model (`trl.trainer.utils.add_fused_lm_head`),
and transformers kernelizes a `use_kernels=True` model again at every train()/eval(). npu-hub-kernels never replaces
a forward another library set: kernelize keeps TRL's head (so npu-linear-cross-entropy does not run, and
`kept_forwards` says why), and every other card fuses under it.

What each run is compared with: the same run without the cards on the host, fp32 (the emulated npu computes every
op that is not fused with the host's own kernels, and a host run cannot pick up the family's shared rotary
function-module that a kernelize switches for the whole process). Logged losses within rtol 1e-5; every fused op of
every step counted (tests/test_training_stacks.py's accounting: forward, checkpointing's recompute, backward). Tiny
models with random weights, datasets built in memory and a word-level tokenizer made here: nothing is downloaded.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from datasets import Dataset
from test_training_stacks import forward_calls, per_step_calls, times
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from npu_hub_kernels import CARDS, apply_npu_kernels, kept_forwards, swapped_modules
from npu_hub_kernels.models import MODEL_CLASSES
from npu_hub_kernels.report import ROOT_MODULE
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import VOCAB, tiny_causal_lm

STEPS = 2
BATCH = 2
TRL_HEAD = "trl.trainer.utils.add_fused_lm_head.<locals>._fused_forward"
"""The forward TRL's trainers set on the model, by the name `kept_forwards` gives it."""
LOSS_CARD = "npu-linear-cross-entropy"
OTHER_CARDS = {
    CARDS[kernel_id].repo_name
    for kernel_id, rules in MODEL_CLASSES.items()
    if any(rule.module == "transformers.models.llama.modeling_llama" for rule in rules)
} - {LOSS_CARD}
"""The cards whose tables swap a Llama class, besides npu-linear-cross-entropy (read from the tables, not listed)."""
LOADS = ["use_kernels=True", "apply_npu_kernels"]


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer of the tiny models' vocabulary: "t<id>" is token <id>; t0 pads, t1 and t2 begin and
    end, t3 is unknown."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3"
    )


def random_ids(count: int, length: int, seed: int) -> list[list[int]]:
    """`count` rows of `length` token ids (none of the special ones 0-3)."""
    return torch.randint(4, VOCAB, (count, length), generator=torch.Generator().manual_seed(seed)).tolist()


def sft_dataset() -> Dataset:
    """Pre-tokenized language-modelling examples: SFTTrainer takes their `input_ids` as they are."""
    return Dataset.from_dict({"input_ids": random_ids(STEPS * BATCH, 8, seed=0)})


def dpo_dataset() -> Dataset:
    """Preference examples as text of the tokenizer's words (each ends in a space, so that the EOS DPOTrainer appends
    stays a word of its own)."""

    def text(rows: list[list[int]]) -> list[str]:
        return ["".join(f"t{i} " for i in row) for row in rows]

    count = STEPS * BATCH
    return Dataset.from_dict(
        {
            "prompt": text(random_ids(count, 5, seed=1)),
            "chosen": text(random_ids(count, 4, seed=2)),
            "rejected": text(random_ids(count, 3, seed=3)),
        }
    )


def settings(output_dir, **overrides) -> dict:
    """A few logged fp32 steps, TRL's defaults otherwise (gradient checkpointing on); nothing saved or reported."""
    return dict(
        output_dir=str(output_dir),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        bf16=False,
        **overrides,
    )


def logged_losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def loaded_on_npu(source, load: str, built_cards) -> dict:
    """The trainer's model arguments for one way of loading the cards: the checkpoint's path with use_kernels=True
    for TRL to load, or the model itself on the npu with `apply_npu_kernels` applied."""
    if load == "use_kernels=True":
        return dict(model=str(source), model_init_kwargs={"use_kernels": True, "device_map": "npu"})
    model = apply_npu_kernels(AutoModelForCausalLM.from_pretrained(source).to("npu"), local_dir=built_cards)
    return dict(model=model)


def assert_trls_head_kept_and_the_other_cards_fused(model) -> None:
    """TRL's head is the model's forward, kept and said so; every other card swaps what it swaps in a tiny Llama."""
    assert [(kept.module, kept.forward, kept.card) for kept in kept_forwards(model)] == [
        (ROOT_MODULE, TRL_HEAD, LOSS_CARD)
    ]
    assert {swap.card for swap in swapped_modules(model)} == OTHER_CARDS


@pytest.fixture
def source(tmp_path):
    """A tiny Llama checkpoint on disk (random weights)."""
    tiny_causal_lm("llama").save_pretrained(tmp_path / "source")
    return tmp_path / "source"


@pytest.mark.parametrize("load", LOADS)
def test_sft_trainer_trains_with_its_own_head_and_the_other_cards_fused(npu_kernels, source, tmp_path, load):
    """SFTTrainer's steps on the npu with the cards give the losses of the same run without them on the host; every
    step fuses the norms, rotary and MLPs (with checkpointing's recompute) and runs TRL's loss head, not the card's."""
    eager = SFTTrainer(
        str(source),
        args=SFTConfig(**settings(tmp_path / "eager", use_cpu=True)),
        train_dataset=sft_dataset(),
        processing_class=tokenizer(),
    )
    with emulation.count_op_calls() as eager_calls:
        eager.train()
    assert eager_calls == {} and eager.args.device.type == "cpu"

    model_args = loaded_on_npu(source, load, npu_kernels)
    trainer = SFTTrainer(
        model_args.pop("model"),
        args=SFTConfig(**settings(tmp_path / "npu", **model_args)),
        train_dataset=sft_dataset(),
        processing_class=tokenizer(),
    )
    with emulation.count_op_calls() as calls:
        trainer.train()
    model = trainer.model
    assert trainer.args.device.type == "npu" and model.device.type == "npu" and model.is_gradient_checkpointing
    assert_trls_head_kept_and_the_other_cards_fused(model)
    assert dict(calls) == times(per_step_calls(model), STEPS)
    losses = logged_losses(trainer)
    assert len(losses) == STEPS
    torch.testing.assert_close(losses, logged_losses(eager), rtol=1e-5, atol=0)


@pytest.mark.parametrize("load", LOADS)
def test_dpo_trainer_trains_with_its_own_heads_and_the_other_cards_fused(npu_kernels, source, tmp_path, load):
    """DPOTrainer's steps on the npu with the cards (the policy and its reference model loaded the same way) give the
    losses of the same run without them on the host; each step fuses the policy's forward and backward (chosen and
    rejected in one batch, with checkpointing's recompute) and the reference's forward, both under TRL's heads."""
    eager = DPOTrainer(
        str(source),
        args=DPOConfig(**settings(tmp_path / "eager", use_cpu=True)),
        train_dataset=dpo_dataset(),
        processing_class=tokenizer(),
    )
    with emulation.count_op_calls() as eager_calls:
        eager.train()
    assert eager_calls == {} and eager.args.device.type == "cpu"

    model_args = loaded_on_npu(source, load, npu_kernels)
    model = model_args.pop("model")
    # TRL loads the reference with the policy's model_init_kwargs; a model object's reference is ours to give
    reference = None if isinstance(model, str) else loaded_on_npu(source, load, npu_kernels)["model"]
    trainer = DPOTrainer(
        model,
        ref_model=reference,
        args=DPOConfig(**settings(tmp_path / "npu", **model_args)),
        train_dataset=dpo_dataset(),
        processing_class=tokenizer(),
    )
    with emulation.count_op_calls() as calls:
        trainer.train()
    policy, reference = trainer.model, trainer.ref_model
    assert trainer.args.device.type == "npu" and policy.device.type == reference.device.type == "npu"
    for model in (policy, reference):
        assert_trls_head_kept_and_the_other_cards_fused(model)
    assert dict(calls) == times(dict(Counter(per_step_calls(policy)) + Counter(forward_calls(reference))), STEPS)
    losses = logged_losses(trainer)
    assert len(losses) == STEPS
    torch.testing.assert_close(losses, logged_losses(eager), rtol=1e-5, atol=0)
