"""The host cost of a card's call (bench.timed.host_cost): the ops recorded and replayed as stubs, the bare module
call issuing the same ops, the ratio between them, its rows and its target. No timing is asserted: the timer is
replaced where a figure is checked."""

from __future__ import annotations

import types

import pytest
import torch
from bench import cards, report, targets, timed
from bench.rows import Row
from torch import nn

from npu_hub_kernels import CARDS


class Toy(nn.Module):
    """One view, one matrix product and one fused op of a stand-in torch_npu module (`owner`)."""

    def __init__(self, owner: types.SimpleNamespace) -> None:
        super().__init__()
        self.owner = owner
        self.weight = nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.owner.npu_fused(torch.mm(x, self.weight.t()))[0]


def fake_torch_npu() -> types.SimpleNamespace:
    """A stand-in torch_npu with one fused op that counts its runs."""
    owner = types.SimpleNamespace(runs=0)

    def npu_fused(x: torch.Tensor) -> tuple[torch.Tensor]:
        owner.runs += 1
        return (x * 2,)

    owner.npu_fused = npu_fused
    return owner


def fixed(call_s: float, bare_s: float):
    """A stand-in for paired_medians: calls each callable once (they must run), then returns the given times."""

    def measure(a, b, repeats, number):
        a(), b()
        return call_s, bare_s

    return measure


def test_ratio_to_bare_is_the_call_over_the_bare_call():
    assert timed.ratio_to_bare(3e-6, 1.5e-6) == pytest.approx(2.0)
    assert timed.ratio_to_bare(1e-6, 4e-6) == pytest.approx(0.25)
    for call_s, bare_s in ((1e-6, 0.0), (0.0, 1e-6), (-1e-6, 1e-6)):
        with pytest.raises(ValueError, match="positive"):
            timed.ratio_to_bare(call_s, bare_s)


def test_the_tape_replays_the_recorded_ops_without_running_them_and_the_bare_call_issues_the_same():
    owner = fake_torch_npu()
    toy, x = Toy(owner), torch.randn(2, 3)
    tape = timed.OpTape()
    with torch.inference_mode(), tape.stubbing(owner, ["npu_fused", "npu_absent"]):
        call_s, bare_s, steps = timed.host_cost(toy, (x,), tape, 1, 1, fixed(2e-6, 1e-6))
        assert owner.runs == 1  # recorded once; the timed calls replayed it
        assert [s.name for s in steps] == ["t", "mm", "npu_fused"]
        assert [s.launches for s in steps] == [False, True, True]  # a view launches nothing
        tape.rewind()
        assert toy(x) is steps[-1].out[0]  # the recorded output itself: nothing computed
        tape.rewind()
        timed.BareCall(steps)(x)
        assert tape.position == len(steps) and owner.runs == 1
    assert owner.npu_fused.__name__ == "npu_fused"  # the original is back
    assert (call_s, bare_s) == (2e-6, 1e-6)


def test_a_call_whose_ops_change_between_calls_is_refused():
    """Negative control: the replay checks each op against the recording."""
    owner = fake_torch_npu()

    class Drifting(Toy):
        calls = 0

        def forward(self, x):
            Drifting.calls += 1
            return torch.mm(x, self.weight.t()) if Drifting.calls > 1 else x + 1

    tape = timed.OpTape()
    with torch.inference_mode(), tape.stubbing(owner, ["npu_fused"]), pytest.raises(RuntimeError, match="recorded"):
        timed.host_cost(Drifting(owner), (torch.randn(2, 3),), tape, 1, 1, fixed(1e-6, 1e-6))


def host_row(kind: str, call_us: float, bare_us: float) -> Row:
    step = timed.Step(torch.ops.aten.mm.default, (torch.ones(1, 1), torch.ones(1, 1)), {}, torch.ones(1, 1))
    return timed.host_cost_row(kind, call_us * 1e-6, bare_us * 1e-6, [step], "npu", 3, 10).csv_row()


def test_a_call_within_two_bare_calls_meets_its_target_and_one_beyond_does_not():
    within, beyond = host_row("RMSNorm", 3.0, 2.0), host_row("RoPE", 5.0, 2.0)
    typed = timed.HostCostRow.of(within)
    assert (typed.bare_us, typed.call_us, typed.ratio, within.ratio) == pytest.approx((2.0, 3.0, 1.5, 1.5))
    assert within.study == timed.HOST_COST_STUDY and within.mode == "timed" and within.unit == "us"
    assert (within.batch, within.seq) == timed.HOST_COST_SHAPE
    assert within.note.startswith("1.50 x a bare call; op calls stubbed: 1, of which 1 launch kernels (mm);")
    results = {r.kind: r for r in targets.evaluate([within, beyond]) if "bare module call" in r.target}
    assert results["RMSNorm"].met is True and results["RMSNorm"].measured.startswith("1.50 x")
    assert results["RoPE"].met is False and results["RoPE"].measured.startswith("2.50 x")  # negative control
    assert "<= 2 x a bare module call" in results["RoPE"].target
    text = report.summary([within, beyond], "machine", "versions")
    assert "Timed on this machine, host side:" in text
    assert "| RoPE: kernelized module vs a bare call (tiny, bfloat16, decode) | 2 | 5 | us |" in text
    assert "| RoPE: host cost of a call <= 2 x a bare module call (decode, ops stubbed) | 2.50 x" in text
    assert "| **no** |" in text


def test_every_timed_card_gets_a_host_cost_row_on_its_fused_path(npu_kernels):
    """On the emulation, with the timer replaced: one row per card with a HOST_TIMING, each call running at least
    one kernel-launching op recorded on the npu device (the fused path, not the eager fallback)."""
    seen = []

    def measure(a, b, repeats, number):
        a(), b()
        seen.append(number)
        return 3e-6, 2e-6

    rows = timed.host_cost_rows("npu", 1, 7, measure)
    timed_cards = [card.region for card, _ in cards.with_piece("HOST_TIMING")]
    assert sorted(r.kind for r in rows) == sorted(timed_cards) and seen == [7] * len(timed_cards)
    assert {"MoE experts", "MoE router"} <= set(timed_cards)  # the MoE cards, on a Qwen3-MoE layer
    assert all(r.ratio == pytest.approx(1.5) for r in rows)
    fused = {name for card in CARDS.values() for name in cards.spec(card).FUSED_OPS}
    for r in rows:
        assert "tensors on npu" in r.note
        launched = r.note.split(" launch kernels (")[1].split(")")[0].split(", ")
        assert fused & set(launched), r.note  # the fused path ran, not the eager fallback
