"""One gate, one voice: each card layer decides fused-or-eager in its op's `<op>_unavailable_reason`, and says why it
ran eager without being asked (kernel-cards/shared/_fallbacks.py): once per (module class, reason) at DEBUG on the
logger `npu_hub_kernels.<card>`, and as the module's last reason, which `swapped_modules` and the doctor read.
"""

from __future__ import annotations

import json
import logging
from types import MethodType

import pytest
import torch
from kernels import Mode, get_local_kernel, kernelize
from torch import nn

from npu_hub_kernels import swapped_modules
from npu_hub_kernels.doctor import diagnose, format_report
from npu_hub_kernels.report import ROOT_MODULE
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm, token_ids

NOT_A_TRAINING_STEP = "not a training step (the model in eval(), or gradients off)"


class _NormOfThisTest(nn.Module):
    """A norm class no other test uses: what its layer says is said for it alone."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.variance_epsilon = 1e-6


def _norm_running(card, device: str) -> nn.Module:
    """A norm whose forward is the card's RMSNorm layer, bound on the instance as kernelize binds it."""
    norm = _NormOfThisTest().to(device)
    norm.forward = MethodType(card.layers.RMSNorm.forward, norm)
    return norm


def test_each_class_and_reason_is_said_once_at_debug_and_the_last_reason_kept(built_cards, caplog):
    card = get_local_kernel(built_cards / "npu-rms-norm")
    records = card._fallbacks
    caplog.set_level(logging.DEBUG, logger="npu_hub_kernels.npu-rms-norm")
    on_host, other_on_host, on_npu = _norm_running(card, "cpu"), _norm_running(card, "cpu"), _norm_running(card, "npu")
    x = torch.randn(2, 3, 8)
    for _ in range(3):
        on_host(x)
    other_on_host(x)  # same class, same reason: said already
    on_npu(x.double().to("npu"))  # same class, another reason: said once more
    said = [r.getMessage() for r in caplog.records if r.name == "npu_hub_kernels.npu-rms-norm"]
    assert len(said) == 2, said
    assert "_NormOfThisTest runs eager: tensor on cpu, not on an npu device" in said[0]
    assert "float64" in said[1] and all(r.levelno == logging.DEBUG for r in caplog.records)
    host_record = records.eager_record(on_host)
    assert host_record.last == "tensor on cpu, not on an npu device"
    assert host_record.counts == {"tensor on cpu, not on an npu device": 3}
    with emulation.count_op_calls() as calls:
        on_npu(x.to("npu"))  # fused: the last reason is cleared, the counts stay
    assert calls["npu_rms_norm"] == 1 and records.eager_record(on_npu).last is None
    assert list(records.eager_record(on_npu).counts.values()) == [1]
    on_npu(x.double().to("npu"))  # eager again; then inputs the card already let fuse, which skip the check
    on_npu(x.to("npu"))
    assert records.eager_record(on_npu).last is None


def test_a_module_that_always_fused_has_no_record(built_cards):
    card = get_local_kernel(built_cards / "npu-rms-norm")
    norm = _norm_running(card, "npu")
    norm(torch.randn(2, 8, device="npu"))
    assert card._fallbacks.eager_record(norm) is None


@pytest.fixture
def llama(npu_kernels):
    """A tiny Llama kernelized for training on the npu: every card's layer runs in it."""
    return kernelize(tiny_causal_lm("llama").train().to("npu"), mode=Mode.TRAINING, device="npu")


def _loss_swap(model: nn.Module):
    (swap,) = [s for s in swapped_modules(model) if s.card == "npu-linear-cross-entropy"]
    return swap


def test_swapped_modules_give_each_modules_last_eager_reason_eval_with_labels_included(llama):
    """The model in eval() with labels runs the class's forward: reported as eager, with why (it was reported as
    fused when the layer decided silently); a training step then fuses and clears the last reason."""
    ids = token_ids().to("npu")
    assert _loss_swap(llama).eager_reason is None and _loss_swap(llama).eager_calls == ()  # never ran
    llama.eval()
    with emulation.count_op_calls() as calls:
        llama(input_ids=ids, labels=ids)
    assert calls["npu_cross_entropy_loss"] == 0
    swap = _loss_swap(llama)
    assert swap.module == ROOT_MODULE and swap.eager_reason.startswith(NOT_A_TRAINING_STEP)
    norm = next(s for s in swapped_modules(llama, card="npu-rms-norm") if s.module == "model.norm")
    assert norm.eager_reason is None  # the norm fused in the same call
    llama.train()
    with emulation.count_op_calls() as calls:
        llama(input_ids=ids, labels=ids)
    assert calls["npu_cross_entropy_loss"] == 1
    swap = _loss_swap(llama)
    assert swap.eager_reason is None and [count for _, count in swap.eager_calls] == [1]


def test_the_doctor_lists_every_reason_a_modules_layer_ran_eager_for(offline_hub, llama):
    """xformers-style: every reason, each with how many calls, and the last call's, in the text and the JSON alike."""
    ids = token_ids().to("npu")
    llama(input_ids=ids)  # training, no labels
    llama.eval()
    llama(input_ids=ids, labels=ids)
    llama(input_ids=ids, labels=ids)
    report = diagnose(offline_hub, model=llama)
    eager = {swap.module: swap for swap in report.model.eager}[ROOT_MODULE]
    assert eager.eager_reason.startswith(NOT_A_TRAINING_STEP)
    text = format_report(report)
    row = "\n  eager       <root> (LlamaForCausalLM, npu-linear-cross-entropy:CausalLM): last call: not a training step"
    assert row in text
    assert "\n    1 call: no labels" in text and "\n    2 calls: not a training step" in text
    as_json = json.loads(json.dumps(report.as_dict()))["model"]["eager"]
    assert {swap["module"]: swap["eager_reason"] for swap in as_json}[ROOT_MODULE] == eager.eager_reason
