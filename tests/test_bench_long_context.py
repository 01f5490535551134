"""The longest trainable sequence (scripts/bench/long_context.py): counted peaks, their derivation, the search.

- The step derived from 2 and 3 layers equals the step counted whole at 4 (peak, ops, all-to-all bytes), in every
  setup: what lets the bench call the full-size peaks counted.
- Checkpointing keeps one hidden state per layer on the device, offload none; Ulysses sends q, k, v and the output
  each way; tiling shrinks the MLP's part of the peak (each with its negative control).
- ZeRO-3's states are DeepSpeed 0.19's under bf16: bf16 parameter and gradient, float32 master and two float32
  moments a parameter over the devices (16 bytes, not the 8 of all-bfloat16 states), the bf16 partition alone with
  ZeRO-Offload, 8 bytes with DeepSpeed's bf16 master and optimizer states; sub-groups as DeepSpeed forms them.
- The search returns a length that fits and a next counted length, at most 1% (or one granule) longer, that does
  not; the targets read the rows.
"""

from __future__ import annotations

import math

import pytest
import torch
from bench import long_context as lc
from bench.configs import ModelSpec
from bench.long_context_report import long_context_section
from bench.rows import LONGEST_STUDY, Row
from bench.step import StepModel
from bench.targets import LONGEST_OVER_EAGER, evaluate

from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import tiny_config_values

TINY = StepModel(ModelSpec("tiny Llama", "llama", tiny_config_values("llama")), 6, 160)
"""A tiny Llama of 6 layers, its vocabulary (160) apart from its MLP width (96) so that logits are told apart."""
SEQ = 512


@pytest.fixture(autouse=True)
def _emulated():
    emulation.install()


@pytest.mark.parametrize(
    ("setup", "ranks"),
    [
        pytest.param(lc.EAGER, 1, marks=pytest.mark.slow),
        pytest.param(lc.OURS, 1, marks=pytest.mark.slow),
        (lc.OURS_SP, 2),
        pytest.param(lc.OURS_SP_OFFLOAD, 2, marks=pytest.mark.slow),
    ],
    ids=lambda value: value.name if isinstance(value, lc.Setup) else str(value),
)
def test_step_derived_from_two_and_three_layers_equals_the_whole_model(npu_kernels, setup, ranks):
    """The peak, ops and all-to-all bytes at 4 layers counted whole equal those carried from 2 and 3."""
    two, three, four = (lc.measure_long_step(TINY, n, SEQ, setup, ranks) for n in (2, 3, 4))
    derived = two.scaled(three, 2)
    for figure in ("peak bytes", "ops", "bytes", lc.ALL_TO_ALL):
        assert derived[figure] == four[figure], figure


def test_checkpointing_keeps_one_hidden_state_per_layer_and_offload_none(npu_kernels):
    """Each layer more adds its checkpointed input [1, S, hidden] bf16 to the peak; offloaded, nothing (control)."""
    hidden = TINY.spec.config["hidden_size"]
    for setup, per_layer in ((lc.OURS, SEQ * hidden * 2), (lc.OURS_SP_OFFLOAD, 0)):
        two, three = (lc.measure_long_step(TINY, n, SEQ, setup, 1) for n in (2, 3))
        assert three["peak bytes"] - two["peak bytes"] == per_layer
        assert three[f"at peak: {lc.CHECKPOINTS}"] == (3 * per_layer if per_layer else 0)


def test_all_to_all_sends_q_k_v_and_the_output_each_way(npu_kernels):
    """Ulysses' bytes per layer and rank are (N - 1) / N of q, k, v and the output, three times; none without SP.

    Forward, again in the checkpoint's recomputed forward, and their gradients backward, from the shapes by hand;
    none without SP (negative control)."""
    config, ranks = TINY.spec.config, 2
    heads, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    local = SEQ // ranks
    one_way = local * d * 2 * (heads + kv + kv + heads)  # q, k, v, output of the rank's tokens, bf16
    two, three = (lc.measure_long_step(TINY, n, SEQ, lc.OURS_SP, ranks) for n in (2, 3))
    assert three[lc.ALL_TO_ALL] - two[lc.ALL_TO_ALL] == 3 * one_way * (ranks - 1) // ranks
    assert lc.measure_long_step(TINY, 2, SEQ, lc.OURS, ranks)[lc.ALL_TO_ALL] == 0


def test_tiling_and_sequence_parallel_shrink_what_grows_with_the_sequence(npu_kernels):
    """Tiling shrinks the MLP's part of the peak and SP over 2 ranks halves the checkpointed hidden states.

    At a long sequence for the tiny model, each against ours untiled without SP (the control)."""
    seq = 2048
    ours = lc.measure_long_step(TINY, 2, seq, lc.OURS, 1)
    tiled = lc.measure_long_step(TINY, 2, seq, lc.OURS_SP, 1)
    assert tiled["at peak: MLP activations"] < ours["at peak: MLP activations"]
    sp = lc.measure_long_step(TINY, 2, seq, lc.OURS_SP, 2)
    assert sp[f"at peak: {lc.CHECKPOINTS}"] * 2 == ours[f"at peak: {lc.CHECKPOINTS}"]


def test_the_states_are_deepspeeds_mixed_precision_bytes_over_the_devices():
    """Each device keeps 1/N of a bf16 parameter and gradient, a float32 master and AdamW's two float32 moments.

    The bytes a parameter built from the dtypes, not from the layout's fields; the old all-bfloat16 figure (8 bytes)
    fails; ZeRO-Offload leaves the bf16 parameter on the device; the gathered parameters and the bucket come on top."""
    bf16, fp32 = torch.bfloat16.itemsize, torch.float32.itemsize
    total, largest, layer = lc.parameter_counts(TINY)
    mixed = bf16 + bf16 + fp32 + 2 * fp32
    assert mixed == 16 and lc.STATES_MIXED.per_parameter(False) == mixed
    devices = 8
    extra = 2 * (largest + layer) + lc.REDUCE_BUCKET_BYTES
    assert lc.states_bytes(TINY, devices, lc.OURS_SP) == mixed * math.ceil(total / devices) + extra
    assert lc.states_bytes(TINY, devices, lc.OURS_SP) != 8 * math.ceil(total / devices) + extra
    offloaded = lc.states_bytes(TINY, devices, lc.OURS_SP_OFFLOAD)
    assert offloaded == bf16 * math.ceil(total / devices) + extra
    lean = lc.states_bytes(TINY, devices, lc.OURS_SP_BF16_STATES)
    assert lean == (bf16 + bf16 + 2 * bf16) * math.ceil(total / devices) + extra
    assert lc.states_bytes(TINY, 1, lc.OURS) == mixed * total + lc.REDUCE_BUCKET_BYTES


def test_the_optimizer_steps_float32_sub_groups_with_a_float32_gradient(npu_kernels, monkeypatch):
    """DeepSpeed's sub-groups (closed at sub_group_size) cover the shard; a sub-group's step holds its float32 gradient.

    The counted step's peak beyond the states is at least the float32 gradient of the largest sub-group, and 4 bytes
    an element above the bfloat16 layout's (control: its gradient and AdamW's temporary in bfloat16)."""
    monkeypatch.setattr(lc, "SUB_GROUP_ELEMENTS", 10_000)
    groups = lc.sub_groups(TINY, 2)
    sizes = lc._parameters(TINY)[3]
    assert sum(groups) == sum(math.ceil(n / 2) for n in sizes) and len(groups) > 1
    assert all(n >= 10_000 for n in groups[:-1])
    mixed = lc.measure_optimizer_step(max(groups), lc.STATES_MIXED)["optimizer peak bytes"]
    lean = lc.measure_optimizer_step(max(groups), lc.STATES_BF16)["optimizer peak bytes"]
    assert mixed >= torch.float32.itemsize * max(groups) and mixed - lean == 4 * max(groups)


def test_fit_length_solves_the_quadratic_and_the_line():
    """Three points of 5 + 2 S + 0.5 S^2 reach 165 at S = 16; of the line 10 + 3 S, 100 at S = 30."""
    assert lc.fit_length([(1, 7.5), (2, 11), (4, 21)], 165) == 16
    assert lc.fit_length([(1, 13), (5, 25), (9, 37)], 100) == 30


def _synthetic(bytes_at):
    return lambda seq: lc.Peak(seq, bytes_at(seq), {"synthetic": bytes_at(seq)})


@pytest.mark.parametrize(
    "bytes_at",
    [
        lambda s: 10 + 3 * s,  # a line: the fit is right
        lambda s: 10 + 3 * s + (200_000 if s > 3_000_000 else 0),  # the peak moves: the fit misses, bisection finds it
        lambda s: 1e-6 * s * s,  # quadratic
    ],
    ids=("line", "step", "quadratic"),
)
def test_the_search_returns_a_length_that_fits_and_one_just_longer_that_does_not(bytes_at):
    limit = 1e7
    found = lc.longest(_synthetic(bytes_at), 1024, limit)
    assert found.fits.bytes <= limit < found.exceeds.bytes
    assert found.exceeds.seq <= max(found.fits.seq + 1024, math.ceil(found.fits.seq * 1.01 / 1024) * 1024)
    assert all(bytes_at(p.seq) == p.bytes for p in found.counted)


def test_the_search_says_none_fits_when_the_shortest_does_not():
    """Negative control: states above the device's memory; nothing fits, the one count says why."""
    found = lc.longest(_synthetic(lambda s: 2e7 + s), 1024, 1e7)
    assert found.fits is None and found.counted[0].seq == 1024


def test_the_search_on_counted_peaks_of_the_tiny_model(npu_kernels):
    """With a limit the tiny model reaches, the counted peak at the answer fits and the next length's does not."""
    step = lc.LongStep(TINY)
    limit = step.peak(lc.OURS, 8, 3072).bytes
    found = lc.longest(lambda seq: step.peak(lc.OURS, 8, seq), 1024, limit, (1024, 2048, 4096))
    assert found.fits.seq == 3072 and found.exceeds.bytes > limit


def _summary_row(model: str, eager: float, ours: float) -> Row:
    return Row(
        "counted", model, "longest trainable sequence", "fwd+bwd+AdamW", 1, ours, eager=eager, kernelized=ours,
        unit="tokens", study=LONGEST_STUDY, variant=lc.OURS_SP.name, path="8", model=model,
    )  # fmt: skip


def test_the_targets_read_the_longest_rows():
    """16 x eager and 1M tokens for Llama-3-8B: met above, missed below (negative control)."""
    met = evaluate([_summary_row("Llama-3-8B", 30_000, 16 * 30_000 + 1024), _summary_row("Qwen3-8B", 30_000, 1e6)])
    assert [r.met for r in met] == [True, False, True]
    missed = evaluate([_summary_row("Llama-3-8B", 100_000, (LONGEST_OVER_EAGER - 1) * 100_000)])
    assert [r.met for r in missed] == [False, True]


def test_the_section_renders_each_setup_and_its_bound():
    row = lc.LongestRow("Llama-3-8B", lc.OURS.name, 8, 112_640, 6.3e10, lc.CHECKPOINTS, 114_688, 6.41e10, "x 1 GB")
    assert lc.LongestRow.of(row.csv_row()) == row
    curve = [
        Row("counted", "Llama-3-8B", lc.OURS.name, "x", 1, seq, kernelized=4e10 + 2e5 * seq, unit="peak bytes",
            study=lc.CURVE_STUDY, variant=lc.OURS.name, path="8", model="Llama-3-8B")
        for seq in lc.FIT_LENGTHS
    ]  # fmt: skip
    text = "\n".join(long_context_section([row.csv_row(), *curve, _summary_row("Llama-3-8B", 29_696, 1_048_576)]))
    assert "| Llama-3-8B | ours | 8 | 113k |" in text and "35.3 x" in text
    assert text.split("\n")[-1].endswith("| 120k |")  # memory alone: (64e9 - 4e10) / 2e5 tokens


def test_the_bound_is_the_part_that_grows_most_to_the_next_length():
    """The states are the largest part, but the S x S scores appearing at the next length are what bounds it."""
    fits = lc.Peak(100, 60, {lc.STATES: 40, "logits": 20})
    over = lc.Peak(101, 70, {lc.STATES: 40, "logits": 21, "attention scores (S x S)": 9})
    assert (fits.largest(), fits.bound(over), fits.bound(None)) == (lc.STATES, "attention scores (S x S)", lc.STATES)
