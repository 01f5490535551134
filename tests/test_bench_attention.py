"""`make bench`'s attention region (bench.attention) and npu_fusion_attention's accounting rule (the npu-fused-attention
card's bench spec): the rule against the emulated op, the region per implementation, its rows, targets and table."""

from __future__ import annotations

import dataclasses
import inspect
import itertools

import pytest
import torch
from bench import attention, configs
from bench.accounting import Tally, _counted, tensor_bytes
from bench.cards import npu_fused_attention as spec
from bench.rows import ATTENTION_STUDY
from bench.targets import evaluate
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves

from npu_hub_kernels.testing.emulation.ops.npu_fused_attention import npu_fusion_attention
from npu_hub_kernels.testing.tiny_models import tiny_config_values

RULE = spec.FUSED_OPS["npu_fusion_attention"]
SIGNATURE = inspect.signature(npu_fusion_attention)
NPU = {"device": "npu"}
TINY_LLAMA = configs.TINY_SPECS[0]
TINY_WINDOW = configs.ModelSpec("tiny Gemma3", "gemma3_text", dict(tiny_config_values("gemma3_text"), sliding_window=8))


def _compressed() -> torch.Tensor:
    return torch.ones(2048, 2048, dtype=torch.bool, **NPU).triu(1)


def _calls() -> dict[str, tuple[tuple, dict]]:
    b, n, kv, s, d = 2, 4, 2, 12, 8
    qkv = lambda *shapes: tuple(torch.randn(*shape, **NPU) for shape in shapes)  # noqa: E731
    return {
        "BSND causal": (
            (*qkv((b, s, n, d), (b, s, kv, d), (b, s, kv, d)), n, "BSND"),
            dict(atten_mask=_compressed(), sparse_mode=3),
        ),
        "BNSD band": (
            (*qkv((b, n, s, d), (b, kv, s, d), (b, kv, s, d)), n, "BNSD"),
            dict(atten_mask=_compressed(), sparse_mode=4, pre_tockens=3, next_tockens=0),
        ),
        "BSH full": ((*qkv((b, s, n * d), (b, s, kv * d), (b, s, kv * d)), n, "BSH"), {}),
        "TND causal": (
            (*qkv((12, n, d), (12, kv, d), (12, kv, d)), n, "TND"),
            dict(atten_mask=_compressed(), sparse_mode=3, actual_seq_qlen=[5, 12], actual_seq_kvlen=[5, 12]),
        ),
    }  # fmt: skip


def _bound(args: tuple, kwargs: dict) -> dict:
    bound = SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _layout(value) -> list:
    return [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t) for t in tree_leaves(value)]


@pytest.mark.parametrize("form", list(_calls()))
def test_the_rule_gives_the_emulated_ops_outputs(form):
    """The rule's outputs have the emulated op's shapes and dtypes (and its three ints), layout by layout."""
    args, kwargs = _calls()[form]
    assert _layout(RULE.outputs(_bound(args, kwargs))) == _layout(npu_fusion_attention(*args, **kwargs))


def _brute_pairs(q_len: int, kv_len: int, pre: int, next_: int, shift: int) -> int:
    return sum(1 for i in range(q_len) for j in range(kv_len) if i - pre <= j - shift <= i + next_)


def test_band_pairs_count_the_pairs_the_band_keeps():
    """band_pairs against counting the pairs one by one, over lengths, bands and shifts (Sq < Skv, = and >)."""
    for q_len, kv_len, pre, next_, shift in itertools.product(
        (1, 3, 7), (1, 4, 7), (0, 2, 2**31 - 1), (0, 1), (0, 3, -2)
    ):
        assert spec.band_pairs(q_len, kv_len, pre, next_, shift) == _brute_pairs(q_len, kv_len, pre, next_, shift)


def test_kept_pairs_per_mode_and_segment():
    """Causal keeps 78 of 144 pairs per row of 12 (two rows), the band W=4 fewer, TND each sequence's own triangle;
    modes 2 and 3 differ once queries are fewer than keys (decode), so the rule does not treat them alike."""
    calls = _calls()
    assert spec.kept_pairs(_bound(*calls["BSND causal"])) == 2 * 78
    assert spec.kept_pairs(_bound(*calls["BNSD band"])) == 2 * _brute_pairs(12, 12, 3, 0, 0)
    assert spec.kept_pairs(_bound(*calls["BSH full"])) == 2 * 144
    assert spec.kept_pairs(_bound(*calls["TND causal"])) == 15 + 28
    q, kv = torch.randn(1, 2, 4, 8, **NPU), torch.randn(1, 6, 4, 8, **NPU)
    decode = {mode: _bound((q, kv, kv, 4, "BSND"), dict(atten_mask=_compressed(), sparse_mode=mode)) for mode in (2, 3)}
    assert (spec.kept_pairs(decode[2]), spec.kept_pairs(decode[3])) == (1 + 2, 5 + 6)


def test_the_stand_in_records_one_op_each_way_despite_the_int_outputs():
    """Counted with grad, the op is one forward and one backward record (its int outputs are not differentiated),
    with the FLOPs of the pairs it keeps, and dq, dk, dv of the inputs' shapes."""
    args, kwargs = _calls()["BSND causal"]
    tally = Tally()
    op = _counted("npu_fusion_attention", RULE, SIGNATURE, tally)
    q, k, v = (t.clone().requires_grad_() for t in args[:3])
    out = op(q, k, v, *args[3:], **kwargs)
    assert out[4:] == (0, 0, 0)
    out[0].sum().backward()
    per_pair = 2 * 8 + 2 * 8
    assert [(r.name, r.flops) for r in tally.records][-2:] == [
        ("npu_fusion_attention", 4 * 2 * 78 * per_pair),
        ("npu_fusion_attention_backward", 4 * 2 * 78 * (6 * 8 + 4 * 8)),
    ]
    assert [t.grad.shape for t in (q, k, v)] == [t.shape for t in args[:3]]


@pytest.fixture(scope="module")
def region(built_cards):
    """Each implementation's attention call of a tiny Llama (causal) and a tiny Gemma3 (window 8), 2 x 32, counted."""
    from npu_hub_kernels import register_npu_kernels

    register_npu_kernels(local_dir=built_cards)
    fake_mode = FakeTensorMode()
    name = attention.card_implementation()[1]
    with attention._flash_path_counted():
        return {
            (model.name, implementation): attention.measure(model, implementation, 2, 32, fake_mode)
            for model in (TINY_LLAMA, TINY_WINDOW)
            for implementation in (attention.EAGER, attention.PEER, name)
        }


def _ops(tally: Tally) -> list[str]:
    return sorted(r.name for r in tally.records)


def test_the_card_runs_one_fused_attention_each_way_and_eager_none(region):
    """The card's call is one npu_fusion_attention forward and one backward, causal and windowed; sdpa's is
    F.scaled_dot_product_attention and never the op (the control)."""
    name = attention.card_implementation()[1]
    for model in (TINY_LLAMA.name, TINY_WINDOW.name):
        _, card = region[(model, name)]
        assert _ops(card["fwd"]) == ["npu_fusion_attention"]
        assert _ops(card["fwd+bwd"]) == ["npu_fusion_attention", "npu_fusion_attention_backward"]
        _, eager = region[(model, attention.EAGER)]
        assert "npu_fusion_attention" not in _ops(eager["fwd+bwd"])
        assert "scaled_dot_product_attention" in _ops(eager["fwd"])


def test_eager_reads_the_dense_window_mask_and_the_card_does_not(region):
    """With a window, sdpa's kernel reads the dense bool mask transformers builds (S x S bytes beyond q, k and v: one
    [S, S] broadcast over the batch without padding); without one, it gets no mask (the control); the card's op reads
    the 4 MB compressed mask."""
    name = attention.card_implementation()[1]
    for model, mask in ((TINY_WINDOW.name, 32 * 32), (TINY_LLAMA.name, 0)):
        call, eager = region[(model, attention.EAGER)]
        assert (0 if call.args[3] is None else tensor_bytes(call.args[3])) == mask
        sdpa = next(r for r in eager["fwd"].records if r.name == "scaled_dot_product_attention")
        repeated = [r for r in eager["fwd"].records if r.name == "clone"][: -1 if mask else None]
        qkv = sum(t.numel() * 2 for t in call.args[:3]) + sum(r.writes - r.reads for r in repeated)
        assert sdpa.reads == qkv + mask
        _, card = region[(model, name)]
        op = next(r for r in card["fwd"].records if r.name == "npu_fusion_attention")
        assert op.reads == sum(t.numel() * 2 for t in call.args[:3]) + 2048 * 2048


def test_the_window_cuts_the_cards_flops_and_transformers_flash_path_drops_it(region):
    """The card computes the band's pairs (fewer FLOPs than causal), transformers' npu flash path the causal ones
    (the window dropped), sdpa every pair (its dense mask); without a window all three compute the causal pairs."""
    name = attention.card_implementation()[1]
    flops = {impl: region[(TINY_WINDOW.name, impl)][1]["fwd"].flops for impl in (attention.EAGER, attention.PEER, name)}
    causal = {impl: region[(TINY_LLAMA.name, impl)][1]["fwd"].flops for impl in (attention.EAGER, attention.PEER, name)}
    assert len(set(causal.values())) == 1
    assert flops[name] < flops[attention.PEER] < flops[attention.EAGER]


def test_attention_rows_hold_the_card_to_its_targets_and_render(built_cards, monkeypatch):
    """The rows (study ATTENTION_STUDY; Llama-3-8B and the window model at 8 x 4096) are held to the card's targets
    (ops and bytes, and the estimated time never above eager's) and meet them; the table has one line per model and
    attention. A card that ran two ops forward
    would miss the op target (the control)."""
    from npu_hub_kernels import register_npu_kernels

    register_npu_kernels(local_dir=built_cards)
    monkeypatch.setattr(attention, "ATTENTION_SHAPES", (spec.TARGET_SHAPE,))
    llama = configs.CONFIGS["llama-3-8b"]
    rows = attention.attention_rows([llama], quick=False)
    assert {r.study for r in rows} == {ATTENTION_STUDY}
    results = [r for r in evaluate(rows) if r.kind == rows[0].kind]
    # ops; the estimated time against eager's; per model the floor's bytes, sdpa's x2
    assert len(results) == 1 + 1 + 2 + 2 * 2 and all(r.met for r in results), [r for r in results if not r.met]
    table = attention.attention_section(rows)
    models = (llama, *attention.WINDOW_MODELS)
    assert sum(line.startswith(f"| {m.name} |") for line in table for m in models) == len(models)
    tampered = [dataclasses.replace(r, kernelized=2) if (r.unit, r.phase) == ("ops", "fwd") else r for r in rows]
    assert any(r.met is False for r in evaluate(tampered) if r.kind == rows[0].kind)


@pytest.fixture(scope="module")
def padding_free_records(built_cards):
    """The op records of a tiny Llama's step (2 layers, default path) per form of a batch of 3 sequences."""
    from bench import padding_free, step

    from npu_hub_kernels import register_npu_kernels

    register_npu_kernels(local_dir=built_cards)
    records, current = {}, {}
    original = step.figures_of

    def spy(passes, update, *memory):
        records[current["form"]] = passes
        return original(passes, update, *memory)

    lengths = (5, 7, 4)
    forms = {
        "padded, sdpa": dict(inputs=padding_free.padded_inputs(lengths), attention="sdpa"),
        "packed, card": dict(
            inputs=padding_free.packed_inputs(lengths, True), attention=attention.card_implementation()[1]
        ),
    }
    step.figures_of = spy
    try:
        for form, options in forms.items():
            current["form"] = form
            with padding_free.host_values(lengths):
                step.measure_step(TINY_LLAMA, 2, 64, 1, 1, "kernelized", build=built_cards, **options)
    finally:
        step.figures_of = original
    return lengths, records


def test_the_packed_step_runs_one_fused_attention_per_layer_in_tnd(padding_free_records):
    """Packed with TRL's kwargs, each of the 2 layers runs one npu_fusion_attention each way, reading q, k, v of the
    packed tokens and the compressed mask, and no sdpa; the padded batch runs sdpa per layer and never the op."""
    lengths, records = padding_free_records
    config = TINY_LLAMA.config
    names = {form: [r.name for r in passes] for form, passes in records.items()}
    assert names["packed, card"].count("npu_fusion_attention") == 2
    assert names["packed, card"].count("npu_fusion_attention_backward") == 2
    assert "scaled_dot_product_attention" not in names["packed, card"]
    assert names["padded, sdpa"].count("scaled_dot_product_attention") == 2
    assert "npu_fusion_attention" not in names["padded, sdpa"]
    tokens, head = sum(lengths), config["head_dim"] * 2
    qkv = tokens * head * (config["num_attention_heads"] + 2 * config["num_key_value_heads"])
    fused = [r for r in records["packed, card"] if r.name == "npu_fusion_attention"]
    assert {r.reads for r in fused} == {qkv + 2048 * 2048}


def test_the_padded_step_reads_the_dense_padding_mask(padding_free_records):
    """Padded to the longest (7), sdpa reads q and K/V repeated to the query heads of [3, 7] tokens plus the dense
    [3, 1, 7, 7] bool mask transformers builds from the padding mask: 3 x 7 x 7 bytes per layer."""
    lengths, records = padding_free_records
    config = TINY_LLAMA.config
    batch, longest = len(lengths), max(lengths)
    qkv = batch * longest * config["head_dim"] * 2 * 3 * config["num_attention_heads"]
    sdpa = [r for r in records["padded, sdpa"] if r.name == "scaled_dot_product_attention"]
    assert {r.reads for r in sdpa} == {qkv + batch * longest * longest}
