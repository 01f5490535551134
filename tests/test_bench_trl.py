"""`make bench`'s rows of TRL's fused LM head (the extra column npu-linear-cross-entropy's bench spec declares,
`TRL_HEAD`, counted by scripts/bench/outside.py beside transformers' eager loss and the card): TRL offers the npu no
fused path at the pinned version, the head counted is TRL's own (it computes eager's loss and never calls the card's
op, which the card on the same tensors does), the rows hold the figures they claim, and without trl the bench says so
and counts no such rows."""

from __future__ import annotations

import sys

import torch
from bench import configs, outside, report
from bench.cards import card_named
from bench.cards import npu_linear_cross_entropy as spec
from bench.rows import OUTSIDE_STUDY
from kernels import get_local_kernel

from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import VOCAB, tiny_causal_lm

LOSS_OP = "npu_cross_entropy_loss"
LLAMA = configs.CONFIGS["llama-3-8b"]
CARD = card_named("npu-linear-cross-entropy")
REGION = spec.OUTSIDE_REGION


def test_trl_gives_the_npu_its_torch_fallback():
    """trl 1.16.0 folds its head's tiles with Triton only on cuda and xpu (trl/kernels/chunked_logprob.py:48-49), and
    its logits-side log-prob and entropy kernel likewise (trl/trainer/utils.py:510-537): on the npu both take torch
    ops. If a TRL upgrade adds the npu, this fails, and docs/models.md's evidence is to be read again."""
    from trl.kernels.chunked_logprob import _use_triton
    from trl.trainer.utils import _supports_trl_loss_kernel

    assert _use_triton(torch.device("npu")) is False
    assert _supports_trl_loss_kernel(torch.zeros(2, 8, device="npu")) is False


def test_trls_head_computes_eagers_loss_and_never_calls_the_card(npu_kernels):
    """TRL's head, set on a tiny Llama as TRL's trainers set it, on the emulated npu: the loss and dL/dh of eager's
    loss, and no call of the card's fused op; the card on the same tensors gives the same and calls it (the control)."""
    card = get_local_kernel(npu_kernels / "npu-linear-cross-entropy")
    model = tiny_causal_lm("llama").to("npu").train()
    hidden = torch.randn(2, 7, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to("npu")
    hidden.requires_grad_()
    labels = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    labels[:, :2] = -100  # a prompt: not scored
    labels = labels.to("npu")

    def loss_and_grad(run) -> tuple[torch.Tensor, torch.Tensor, int]:
        with emulation.count_op_calls() as calls:
            loss = run()
            (grad,) = torch.autograd.grad(loss, [hidden])
        return loss.detach(), grad, calls[LOSS_OP]

    eager = loss_and_grad(lambda: card.linear_cross_entropy_eager(hidden, model.lm_head, labels, VOCAB)[0])
    fused = loss_and_grad(lambda: card.linear_cross_entropy(hidden, model.lm_head, labels, VOCAB)[0])
    spec.install_head(model, hidden, spec.SFT_OUTPUTS)
    trl = loss_and_grad(lambda: spec.head_loss(model, labels))
    assert eager[2] == trl[2] == 0 < fused[2]
    for got in (fused, trl):
        torch.testing.assert_close(got[0], eager[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], eager[1], rtol=1e-5, atol=1e-6)


def test_trls_head_is_counted_as_its_torch_fallback(npu_kernels):
    """Counted on fake tensors at Llama-3-8B's size, 1 x 512: TRL's head projects its tiles (mm), sums its backward in
    float32 addmm_, runs no fused op, and computes more than the loss (SFTTrainer's entropy and top-1 cost ops over
    the log-probabilities alone)."""
    vocab = spec.MODELS["llama-3-8b"]
    sft, alone = (outside.measure(CARD, REGION, "llama-3-8b", study, 1, 512).tally for study in spec.TRL_STUDIES)
    assert spec.TRL_STUDIES == {"TRL head": spec.SFT_OUTPUTS, "TRL head, log-probs only": spec.LOSS_ONLY_OUTPUTS}
    tiles = -(-vocab // 32_768)  # one token tile (511 tokens) by the vocabulary's 32,768-word tiles
    assert sft.by_op()["mm"] == alone.by_op()["mm"] == 2 * tiles  # forward, and the backward's recompute
    assert sft.by_op()["addmm_"] == 2 * tiles  # dL/dh and dL/dW, per tile
    assert not any(op.startswith("npu_") for op in sft.by_op())
    assert sft.ops > alone.ops > 0 and sft.bytes > alone.bytes > 0
    assert 0 < sft.memory.saved_bytes < sft.memory.peak_bytes


def test_trl_rows_stand_beside_eager_and_the_card(npu_kernels):
    """--quick, Llama-3-8B: per study of TRL_STUDIES, one row per unit whose eager and card figures are the loss
    region's own rows' and whose `extra` figure is TRL's head; the report table shows them."""
    rows = outside.outside_rows(CARD, REGION, [LLAMA], quick=True)
    layer = {r.unit: r for r in rows if r.study == OUTSIDE_STUDY}
    for study in spec.TRL_STUDIES:
        trl = {r.unit: r for r in rows if r.study == study}
        assert set(trl) == set(outside.UNITS)
        for unit, r in trl.items():
            assert (r.eager, r.kernelized, r.floor) == (layer[unit].eager, layer[unit].kernelized, layer[unit].floor)
            assert r.extra is not None and r.extra > 0
    sft, alone = ({r.unit: r.extra for r in rows if r.study == study} for study in spec.TRL_STUDIES)
    assert sft["ops"] > alone["ops"]
    text = "\n".join(report.outside_tables(CARD, REGION, rows))
    assert "TRL's head computes" in text and f"trl {spec.trl_version()}" in text
    assert text.count("| Llama-3-8B | 1 x 512 |") == len(spec.TRL_STUDIES)  # after the chunk table, a row per study


def test_without_trl_the_bench_says_so_and_counts_no_trl_rows(npu_kernels, monkeypatch, capsys):
    """trl missing: `trl_absent` says so, the loss region's rows are counted without TRL's, the log and the report
    table say why. The control: with trl, `trl_absent` is None."""
    assert spec.trl_absent() is None
    for name in [name for name in sys.modules if name == "trl" or name.startswith("trl.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "trl", None)
    reason = spec.trl_absent()
    assert reason is not None and reason.startswith("trl is not installed")
    rows = outside.outside_rows(CARD, REGION, [LLAMA], quick=True)
    assert {r.study for r in rows} == {OUTSIDE_STUDY} and all(r.extra is None for r in rows)
    assert f"TRL's fused LM head: not counted ({reason})" in capsys.readouterr().out
    assert report.outside_tables(CARD, REGION, rows)[-2:] == ["", f"TRL's fused LM head: not counted here ({reason})."]
