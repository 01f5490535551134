"""The counted training step (scripts/bench/step*.py) and the Atlas A2 time model (scripts/bench/device_model.py).

- FLOPs are exact: each matrix product counts 2 x its multiply-adds, flash attention its pairs' products.
- The step derived from 1 and 2 layers equals the step measured whole at more layers (tiny models, fake tensors):
  ops, bytes, FLOPs, estimated times and peak memory. That is what lets the bench call the full-size step derived.
- The time model's constants each name a source; the validation rows cover every published figure.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from bench import device_model, step, step_report, step_study, step_validation, targets
from bench.accounting import OpRecord, attention_pairs, count_device_ops
from bench.configs import ModelSpec
from bench.rows import ESTIMATE_STUDY, Row
from torch._subclasses.fake_tensor import FakeTensorMode

from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import tiny_config_values


@pytest.fixture(autouse=True)
def _emulated():
    emulation.install()


def test_matmul_flops_are_two_per_multiply_add():
    """mm, bmm and a linear's forward and backward: 2 M K N each, summed exactly."""
    with FakeTensorMode():
        a = torch.empty(6, 5, device="npu")
        b = torch.empty(5, 7, device="npu")
        x = torch.empty(3, 6, 5, device="npu")
        y = torch.empty(3, 5, 4, device="npu")
        c = torch.empty(6, 7, device="npu")
        with count_device_ops() as tally:
            a @ b
            torch.bmm(x, y)
            c.addmm_(a, b)  # in place: an overload of its own
        assert tally.flops == 2 * (2 * 6 * 5 * 7) + 2 * 3 * 6 * 5 * 4
        w = torch.empty(7, 5, device="npu", requires_grad=True)
        h = torch.empty(6, 5, device="npu", requires_grad=True)
        with count_device_ops() as tally:
            out = F.linear(h, w)
            torch.autograd.grad(out, [h, w], torch.empty_like(out))
        assert tally.flops == 3 * 2 * 6 * 5 * 7  # forward, dX, dW
        assert sum(r.flops > 0 for r in tally.records) == 3


def test_a_float32_sum_of_16bit_products_runs_at_the_16bit_cube_rate():
    """The loss card's weight gradient, addmm(acc, a.t(), b, out_dtype=float32, out=acc) of bfloat16 operands: its
    FLOPs at the 16-bit rate, its bytes the operands plus the float32 sum read and written; the same product of float32
    operands (negative control) at the float32 rate."""
    with FakeTensorMode():
        m, k, n = 1024, 2048, 512  # large enough to be compute-bound in float32
        acc = torch.empty(m, n, device="npu")
        a = torch.empty(k, m, dtype=torch.bfloat16, device="npu")
        b = torch.empty(k, n, dtype=torch.bfloat16, device="npu")
        with count_device_ops() as tally:
            torch.addmm(acc, a.t(), b, out_dtype=torch.float32, out=acc)
            acc.addmm_(a.t().float(), b.float())
    half, single = (r for r in tally.records if r.flops)
    assert (half.operand_bytes, single.operand_bytes) == (2, 4) and half.flops == single.flops == 2 * m * k * n
    assert (half.reads, half.writes) == (4 * m * n + 2 * k * m + 2 * k * n, 4 * m * n)
    assert device_model.device_seconds([half]) == device_model.op_seconds(half, float32=False)
    assert device_model.device_seconds([single]) == device_model.op_seconds(single, float32=True)
    assert device_model.op_seconds(single, float32=True) > device_model.op_seconds(single, float32=False)


@pytest.mark.parametrize(("q_len", "k_len", "causal"), [(5, 5, True), (3, 7, True), (7, 3, True), (4, 6, False)])
def test_attention_pairs_match_the_mask(q_len, k_len, causal):
    """The pairs of torch's causal mask (lower triangle aligned at the top left), counted from the mask itself."""
    mask = torch.ones(q_len, k_len, dtype=torch.bool)
    if causal:
        mask = mask.tril()
    assert attention_pairs(q_len, k_len, causal) == int(mask.sum())


def test_sdpa_flops_forward_and_backward():
    """Flash attention: 2 Dqk + 2 Dv per pair forward, 6 Dqk + 4 Dv backward, per batch and head."""
    batch, heads, seq, dim = 2, 3, 5, 4
    with FakeTensorMode():
        q, k, v = (torch.empty(batch, heads, seq, dim, device="npu", requires_grad=True) for _ in range(3))
        with count_device_ops() as tally:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, [q, k, v], torch.empty_like(out))
    pairs = batch * heads * seq * (seq + 1) // 2
    flops = {r.name: r.flops for r in tally.records}
    assert flops["scaled_dot_product_attention"] == pairs * 4 * dim
    assert flops["scaled_dot_product_attention_backward"] == pairs * 10 * dim


def test_sdpa_under_autocast_runs_on_the_operands_autocast_gives_it():
    """Under torch.autocast("npu", bfloat16) the device casts sdpa's float32 q and k to bfloat16 before its kernel (the
    lower-precision policy): the stand-in counts those casts (and their gradients' casts back) and its kernel reads
    bfloat16 at the 16-bit cube rate; v, bfloat16 already, is not cast. Outside autocast (the control) the kernel
    reads float32 at the float32 rate and nothing is cast."""
    shape = (1, 2, 8, 4)
    size = 1 * 2 * 8 * 4
    tallies = {}
    with FakeTensorMode():
        for autocast in (True, False):
            q, k = (torch.empty(shape, device="npu", requires_grad=True) for _ in range(2))
            v = torch.empty(shape, device="npu", dtype=torch.bfloat16 if autocast else None, requires_grad=True)
            with count_device_ops() as tallies[autocast]:
                with torch.autocast("npu", dtype=torch.bfloat16, enabled=autocast):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                torch.autograd.grad(out, [q, k, v], torch.empty_like(out))
    sdpa = {cast: {r.name: r for r in tally.records if "scaled_dot" in r.name} for cast, tally in tallies.items()}
    names = {cast: [r.name for r in tally.records] for cast, tally in tallies.items()}
    assert names[True].count("_to_copy") == 4  # q and k to bfloat16, their gradients back to float32
    assert "_to_copy" not in names[False]
    for cast, element in ((True, 2), (False, 4)):
        forward = sdpa[cast]["scaled_dot_product_attention"]
        assert (forward.operand_bytes, forward.reads) == (element, 3 * size * element)
        assert sdpa[cast]["scaled_dot_product_attention_backward"].operand_bytes == element


TINY = {
    "llama": ModelSpec("tiny Llama", "llama", tiny_config_values("llama")),
    "qwen3_moe": ModelSpec("tiny Qwen3-MoE", "qwen3_moe", tiny_config_values("qwen3_moe"), 4),
}
FIGURES = ("ops", "bytes", "flops", "peak bytes", "saved bytes", "state bytes")


@pytest.mark.parametrize("family", TINY)
def test_step_derived_from_two_layers_equals_the_whole_model(family):
    """The step of a 5-layer model measured whole equals the step derived from 2 and 3 layers (`derived_step`):
    exactly for the counts, to rounding for the estimated device and host times (float sums); the peak exactly for a
    dense model, within 0.5% for an MoE one."""
    spec = TINY[family]
    vocab = spec.config.get("vocab_size", 128)
    model = step.StepModel(spec, 5, vocab)
    measured = step.measure_step(spec, 5, vocab, 2, 16)
    derived = step.derived_step(model, 2, 16)
    for figure in FIGURES:
        if figure == "peak bytes" and spec.experts:
            assert derived[figure] == pytest.approx(measured[figure], rel=5e-3)
            continue
        assert derived[figure] == measured[figure], figure
    for estimate in ("device s", "host s"):  # float sums of per-op times
        assert derived[estimate] == pytest.approx(measured[estimate], rel=1e-12), estimate
    for kind in step.categories():
        assert derived[f"bytes: {kind}"] == measured[f"bytes: {kind}"], kind


def test_step_counts_the_optimizer_and_leaves_host_ops_out():
    """AdamW(foreach) ops are counted, on device tensors only: the step counters' host ops are not device ops."""
    spec = TINY["llama"]
    figures = step.measure_step(spec, 1, 128, 1, 8)
    assert figures[f"ops: {step.UNTOUCHED[3]}"] > 0
    params = sum(p.numel() for p in step.build_step_model(spec, 1, 128).parameters()) * 2  # bfloat16
    assert figures["state bytes"] == 3 * params  # parameters and AdamW's two moments


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_no_device_constant_is_made_while_a_step_is_counted(npu_kernels, monkeypatch, family):
    """What a first call makes once per process (the cards' device constants: the attention card's compressed mask;
    a zero-centred norm's float32 one, made only with grad) is made in the step's uncounted first forward, never in
    the counted step, so `derived_step`'s figures do not depend on which study ran before it in the process."""
    import sys

    spec = ModelSpec(f"tiny {family}", family, tiny_config_values(family))
    step.measure_step(spec, 2, 128, 1, 8, "kernelized")  # loads the cards
    counting, made = [False], []

    class Spy(dict):
        def __setitem__(self, key, value):
            made.append((key[0], counting[0]))
            super().__setitem__(key, value)

    for name, module in list(sys.modules.items()):
        if name.endswith("._device_constants"):
            monkeypatch.setattr(module, "_CONSTANTS", Spy())
    counted = step._device_ops

    @contextlib.contextmanager
    def flagged(*args, **kwargs):
        with counted(*args, **kwargs) as tally:
            counting[0] = True
            try:
                yield tally
            finally:
                counting[0] = False

    monkeypatch.setattr(step, "_device_ops", flagged)
    step.measure_step(spec, 2, 128, 1, 8, "kernelized")
    names = {name for name, _ in made}
    expected = {"float32 one"} if family.startswith("gemma") else set()
    assert expected <= names and made, f"no constant made: the test would prove nothing ({made})"
    assert not [name for name, during in made if during], made


def test_a_mixed_precision_step_keeps_float32_state_counts_autocasts_casts_and_fuses(npu_kernels):
    """Trainer's bf16=True (`mixed`): float32 weights and AdamW state; autocast's weight casts are counted (more ops
    than the bfloat16 step); the kernelized step fuses under autocast (the cards' ops run, fewer ops than eager's)."""
    spec = TINY["llama"]
    params = sum(p.numel() for p in step.build_step_model(spec, 1, 128).parameters())
    plain = step.measure_step(spec, 1, 128, 1, 8)
    mixed = step.measure_step(spec, 1, 128, 1, 8, mixed=True)
    assert (plain["state bytes"], mixed["state bytes"]) == (3 * params * 2, 3 * params * 4)
    assert mixed["ops"] > plain["ops"]
    fused = step.measure_step(spec, 1, 128, 1, 8, "kernelized", mixed=True)
    card_ops = [kind for kind in step.categories() if kind not in (*step.UNTOUCHED, step.OTHER)]
    assert all(mixed[f"ops: {kind}"] == 0 for kind in card_ops)  # the negative control: eager runs no card op
    assert sum(fused[f"ops: {kind}"] for kind in card_ops) > 0 and fused["ops"] < mixed["ops"]
    row = step_study.MixedPrecisionRow("tiny Llama", 1, 8, "ops", mixed["ops"], fused["ops"], None)
    assert "| tiny Llama | ops |" in "\n".join(step_report._mixed_precision_table([row], peer=False))


def test_no_card_category_is_dead_and_the_fused_attention_op_is_its_cards():
    """Each card column of the split is where some fused op (or its backward) lands: the attention card's
    npu_fusion_attention under "<card> ops", not under the untouched "attention", where sdpa's kernel stays."""
    landed = {
        op: step.category(OpRecord(op, 0, 0), optimizer=False)
        for _, spec in step.specs()
        for name in spec.FUSED_OPS
        for op in (name, f"{name}_backward")
    }
    card_columns = [kind for kind in step.categories() if kind not in (*step.UNTOUCHED, step.OTHER)]
    assert sorted(set(card_columns) - set(landed.values())) == []
    attention_card = next(card for card, spec in step.specs() if "npu_fusion_attention" in spec.FUSED_OPS)
    assert (
        landed["npu_fusion_attention"] == landed["npu_fusion_attention_backward"] == f"{attention_card.repo_name} ops"
    )
    assert step.category(OpRecord("scaled_dot_product_attention", 0, 0), optimizer=False) == step.UNTOUCHED[1]


def test_time_model_constants_are_cited():
    """Every constant names where it comes from: a URL or a DOI."""
    assert device_model.CONSTANTS
    for name, constant in device_model.CONSTANTS.items():
        assert constant.value > 0, name
        assert constant.source.startswith("https://"), name
        assert constant.note, name


def test_op_time_is_a_roofline():
    """An op takes the longest of its bytes at HBM bandwidth, its FLOPs at the cube rate, its elements at the vector
    rate; a step the longer of the device's sum and the host's per-op cost."""
    bw, cube = device_model.HBM_BANDWIDTH.value, device_model.CUBE_BF16.value
    memory_bound = OpRecord("add", int(bw), 0, 0, 1)
    compute_bound = OpRecord("mm", 1, 1, int(2 * cube), 1)
    assert device_model.op_seconds(memory_bound) == pytest.approx(1.0)
    assert device_model.op_seconds(compute_bound) == pytest.approx(2.0)
    tiny = [OpRecord("add", 2, 2, 0, 1)] * 10
    assert device_model.step_seconds(tiny) == pytest.approx(10 * device_model.HOST_PER_OP.value)


def test_every_published_figure_has_a_prediction(monkeypatch):
    """The validation rows: one per published figure, with the published value, the prediction and its error."""
    fake = step.Figures()
    fake.values.update({"device s": 2.0, "host s": 0.1, "peak bytes": 10e9})
    fused = step.Figures()
    fused.values.update({"device s": 1.0, "host s": 0.1, "peak bytes": 8e9})

    def derived(model, batch, seq, variant, **options):
        return fused if options["kernels"] else fake

    monkeypatch.setattr(step_validation, "derived_step", derived)
    rows = step_validation.validation_rows(build=None)
    assert [r.claim for r in rows] == [c.claim for c in step_validation.PUBLISHED]
    for row, claim in zip(rows, step_validation.PUBLISHED, strict=True):
        assert row.published == claim.value
        assert row.predicted == step_validation.predict(claim, fake, fused)
        assert row.error == step_validation.error_text(claim, row.predicted)
        assert step_validation.ValidationRow.of(row.csv_row()) == row  # the summary reads back what bench.csv holds
        assert claim.assumed and claim.kernels
    lines = step_report._validation_table(rows)
    assert all(claim.claim in "\n".join(lines) for claim in step_validation.PUBLISHED)


def test_the_step_target_holds_the_mixed_precision_step_too():
    """Ours at most the peer's / 1.03 on every step row: the bfloat16 step's estimate and the mixed-precision step's
    time (not its ops or bytes); a mixed-precision step 1.016 x ahead of the peer misses it (the control)."""
    bf16 = Row("estimated", "Llama-3-8B", "estimated step time", "fwd+bwd+AdamW", 8, 4096, eager=7189.0,
               kernelized=5890.0, peer=6102.0, unit="ms", study=ESTIMATE_STUDY, model="Llama-3-8B")  # fmt: skip
    mixed = [
        step_study.MixedPrecisionRow("Llama-3-8B", 8, 4096, unit, eager, ours, peer).csv_row()
        for unit, eager, ours, peer in (("ops", 4439, 2351, 2309), ("ms", 8071.2, 6815.1, 6927.1))
    ]
    results = targets._step([bf16, *mixed])
    assert [(r.target.split(" training step")[0], r.met) for r in results] == [
        ("Llama-3-8B", True),
        ("Llama-3-8B, float32 weights, bf16 autocast", False),  # 6927.1 / 6815.1 = 1.016
    ]
    mixed[1].kernelized = 6927.1 / 1.031
    assert targets._step([bf16, *mixed])[1].met
