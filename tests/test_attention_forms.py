"""The attention card against eager on every form a user reaches: one differential harness (issue 43).

Each case builds a tiny model with random weights, runs it with transformers' eager attention and with the card on
the same weights and inputs, and compares what a user reads: the logits of the tokens the mask keeps, the loss, every
parameter's gradient, and for generation the tokens and first-step logits. The op counter says whether the card
fused: every case names what it expects (`FUSED`, or `EAGER` with the words of the reason, which
`attention_modules` must report), so a form that silently fused wrong, or silently stopped fusing, fails here.

The axes: every family the card is selected for (`apply_npu_kernels`' rule, read from the model tables) x input
forms (`FORMS`) x train/eval x float32/bfloat16, generation with every cache implementation `generate` offers
(`CACHES`), and the forms of `SPECIAL` (token-type overlays, a bidirectional flag, cross-attention, a static cache
forward). The full product runs when NPU_HUB_KERNELS_ALL_FORMS=1 (`make test-forms`, which CI runs); `make test`
runs a sample that covers every value of every axis.
"""

from __future__ import annotations

import copy
import itertools
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DataCollatorWithFlattening

from npu_hub_kernels import attention_modules, register_npu_kernels
from npu_hub_kernels.attention import attention_kept_reason
from npu_hub_kernels.cards import CARDS
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import TINY_CONFIGS, tiny_causal_lm, tiny_config_values, token_ids

NAME = "npu_fused_attention"
OP = "npu_fusion_attention"
FUSED = "fused"
SEQ = 12
ALL = os.environ.get("NPU_HUB_KERNELS_ALL_FORMS") == "1"
HALF_ULP = 2.0**-9
"""Half of bfloat16's relative spacing (8 bits of mantissa)."""


def mean_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (got - want).abs().mean()


def _families() -> dict[str, dict]:
    """Every tiny family whose attention `apply_npu_kernels` gives the card, and the windowed ones at a short window."""
    families = {}
    for family in TINY_CONFIGS:
        try:
            model = tiny_causal_lm(family)
        except (ValueError, KeyError):
            continue  # an image-text family: no causal LM class
        if attention_kept_reason(model, CARDS[NAME]) is None:
            families[family] = {}
    families["mistral, window 4"] = {"sliding_window": 4}
    families["gemma3_text, window 4"] = {"sliding_window": 4}
    return families


FAMILIES = _families()


def build(family: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return tiny_causal_lm(family.split(",")[0], dtype=dtype, **FAMILIES[family]).to("npu")


def _packed(lengths: tuple[int, ...]) -> dict:
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    # no cache: with one, transformers reads no packing from the position ids (nor does eager attend by it)
    return {"input_ids": token_ids(1, sum(lengths)), "position_ids": positions, "use_cache": False}


def _cu(lengths: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _padded(rows: list[tuple[int, int]]) -> dict:
    """Rows of (left padding, right padding) around SEQ - both tokens."""
    mask = torch.ones(len(rows), SEQ, dtype=torch.long)
    for row, (left, right) in enumerate(rows):
        mask[row, :left] = 0
        mask[row, SEQ - right :] = 0
    return {"input_ids": token_ids(len(rows), SEQ), "attention_mask": mask}


def _flattening() -> dict:
    features = [{"input_ids": token_ids(1, n, seed=n)[0].tolist()} for n in (5, 1, 6)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")(features)
    return {**{key: value for key, value in batch.items() if key != "labels"}, "use_cache": False}


FORMS = {
    "unpadded": lambda: {"input_ids": token_ids(2, SEQ)},
    "left padding": lambda: _padded([(3, 0), (0, 0)]),
    "right padding": lambda: _padded([(0, 0), (0, 4)]),
    "all-padding row": lambda: _padded([(0, 2), (SEQ, 0)]),
    "packed by position_ids": lambda: _packed((5, 6, 1)),
    "packed by cu_seq_lens": lambda: {**_packed((5, 6, 1)), "cu_seq_lens_q": _cu((5, 6, 1)),
                                      "cu_seq_lens_k": _cu((5, 6, 1)), "max_length_q": 6, "max_length_k": 6},
    "one-token segments": lambda: _packed((1, 1, 4, 1, 5)),
    "DataCollatorWithFlattening": _flattening,
}  # fmt: skip


def _on_npu(inputs: dict) -> dict:
    return {key: value.to("npu") if torch.is_tensor(value) else value for key, value in inputs.items()}


def _kept(inputs: dict, model: torch.nn.Module | None = None) -> torch.Tensor:
    """The positions whose query sees some key (through every layer's window, `model`'s): those a user may read.

    A right-padded prompt's last position is one (generate reads it). A query that sees no key (a left pad) gets
    sdpa's 0 from the card where eager averages every value: a value no later layer reads."""
    mask = inputs.get("attention_mask")
    if mask is None:
        return torch.ones_like(inputs["input_ids"], dtype=torch.bool)
    seen = mask.long().cumsum(1)
    window = None if model is None else getattr(model.config, "sliding_window", None)
    if window and window < seen.shape[1]:  # (Qwen2-MoE's config says 0 for none)
        seen = seen - torch.nn.functional.pad(seen, (window, 0))[:, : seen.shape[1]]
    return seen.cpu() > 0


def run_both(model: torch.nn.Module, inputs: dict, train: bool, kept: torch.Tensor | None = None):
    """(eager's, the card's) logits, loss and gradients, and the op's calls under the card (eager: 0 asserted).

    The loss reads the logits of the `kept` tokens (default: those the attention mask keeps)."""
    kept = _kept(inputs, model) if kept is None else kept
    results, calls = {}, {}
    for name in ("eager", NAME):
        model.set_attn_implementation(name)
        model.train(train)
        model.zero_grad()
        with emulation.count_op_calls() as counted:
            out = model(**_on_npu(inputs))
            weights = kept.to("npu")[..., None]
            loss = (out.logits.float().square() * weights).sum() / weights.sum().clamp(min=1)
            loss.backward()
        grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
        results[name] = (out.logits.detach().cpu(), loss.detach().cpu(), grads)
        calls[name] = counted[OP]
    assert calls["eager"] == 0
    return results["eager"], results[NAME], calls[NAME]


def assert_eagers_answer(eager, fused, kept: torch.Tensor, dtype: torch.dtype, reference=None) -> None:
    """The card's logits (kept tokens), loss and gradients equal eager's: to rounding in float32; in a half dtype
    each within twice eager's error against `reference`, eager in float32 on the same weights (flash-attention's
    rule; float32, as grouped_mm has no float64: a MoE router's top-k can flip between two half-precision runs, so
    they need not agree with each other). The error is the mean absolute one, with half a bfloat16 ulp of the
    reference's mean magnitude as slack: through a whole model one logit an ulp off is rounding, not a form."""
    pairs = [("logits", fused[0][kept], eager[0][kept]), ("loss", fused[1], eager[1])]
    pairs += [(name, fused[2][name], grad) for name, grad in eager[2].items()]
    assert fused[2].keys() == eager[2].keys()
    expected = None
    if reference is not None:
        expected = {"logits": reference[0][kept], "loss": reference[1], **reference[2]}
    for name, got, want in pairs:
        if expected is None:
            scale = want.float().abs().max().clamp(min=1e-6)
            error = (got.float() - want.float()).abs().max() / scale
            assert error <= 1e-3, f"{name}: relative error {error:.2e}"
        else:
            reference_of = expected[name].double()
            fused_error, eager_error = mean_error(got.double(), reference_of), mean_error(want.double(), reference_of)
            slack = HALF_ULP * reference_of.abs().mean()
            assert fused_error <= 2 * eager_error + slack, (name, fused_error, eager_error)


def float32_eager(model: torch.nn.Module, inputs: dict, train: bool, kept: torch.Tensor | None = None):
    """Eager's logits, loss and gradients in float32 on `model`'s weights (the reference of a half dtype)."""
    reference = copy.deepcopy(model).to(torch.float32)
    reference.set_attn_implementation("eager")
    reference.train(train)
    out = reference(**_on_npu(inputs))
    weights = (_kept(inputs, model) if kept is None else kept).to("npu")[..., None]
    loss = (out.logits.float().square() * weights).sum() / weights.sum().clamp(min=1)
    loss.backward()
    grads = {n: p.grad.detach().cpu() for n, p in reference.named_parameters() if p.grad is not None}
    return out.logits.detach().cpu(), loss.detach().cpu(), grads


def check_reported(model: torch.nn.Module, expected: str) -> None:
    """What `attention_modules` says of the model's attention: the form every call fused, or the words of a reason
    some call ran eager for."""
    reports = [r for r in attention_modules(model) if r.form or r.eager_calls]  # the modules that ran
    assert reports, "no attention module reported"
    if expected == FUSED:
        assert all(r.form is not None and not r.eager_calls for r in reports), reports
    else:
        assert any(expected in reason for r in reports for reason, _ in r.eager_calls), reports


@pytest.fixture(scope="module")
def registered(built_cards):
    register_npu_kernels(local_dir=built_cards, kernels=NAME)
    return built_cards


def _sample(axes: list[list]) -> list[tuple]:
    """Every combination (ALL) or a sample in which each value of each axis occurs at least once."""
    if ALL:
        return list(itertools.product(*axes))
    longest = max(len(axis) for axis in axes)
    return [tuple(axis[(i + shift) % len(axis)] for shift, axis in enumerate(axes)) for i in range(longest)]


DTYPES = [torch.float32, torch.bfloat16]
FORWARD_CASES = _sample([list(FAMILIES), list(FORMS), [True, False], DTYPES])


@pytest.mark.slow
@pytest.mark.parametrize(("family", "form", "train", "dtype"), FORWARD_CASES, ids=str)
def test_each_input_form_gives_eagers_logits_loss_and_gradients_fused(registered, family, form, train, dtype):
    model = build(family, dtype)
    inputs = FORMS[form]()
    eager, fused, calls = run_both(model, inputs, train)
    assert calls == model.config.num_hidden_layers  # one fused call per layer: the form is the op's
    reference = None if dtype == torch.float32 else float32_eager(model, inputs, train)
    assert_eagers_answer(eager, fused, _kept(inputs, model), dtype, reference)
    check_reported(model, FUSED)


def test_a_collators_reused_buffer_gives_each_batchs_own_sequences(registered):
    """A collator that rewrites its cu_seq_lens buffer in place between batches: each batch is its own (the plan is
    never kept on the tensor), and the position ids, which the mask describes, decide."""
    model = build("llama")
    buffer = _cu((5, 6, 1))
    first = {**_packed((5, 6, 1)), "cu_seq_lens_q": buffer, "cu_seq_lens_k": buffer}
    run_both(model, first, True)
    buffer.copy_(_cu((2, 3, 7)))
    second = {**_packed((2, 3, 7)), "cu_seq_lens_q": buffer, "cu_seq_lens_k": buffer}
    eager, fused, calls = run_both(model, second, True)
    assert calls == model.config.num_hidden_layers
    assert_eagers_answer(eager, fused, _kept(second), torch.float32)


CACHES = ["dynamic", "static", "sliding_window", "hybrid"]
"""generate's cache implementations, but the offloaded ones: on an npu they need CUDA streams in transformers 5.22,
and fail the same under eager (test_offloaded_caches_fail_as_eager_does)."""
PROMPTS = {
    "all-ones mask": [(0, 0), (0, 0)],
    "left padding": [(3, 0), (0, 0)],
    "right padding": [(0, 0), (0, 3)],
    "no mask": None,
    "pad token inside, no mask": None,
}
"""Prompts of 2 rows: a mask's rows as (left, right) padding, or no mask (generate infers one from the pad token)."""
GENERATE_CASES = _sample([list(FAMILIES), CACHES, list(PROMPTS)])


def _prompt(prompt: str) -> dict:
    """The prompt's inputs: token ids free of the pad token (0) unless the prompt holds one inside a row."""
    rows = PROMPTS[prompt]
    inputs = _padded(rows or [(0, 0), (0, 0)])
    kept = inputs["attention_mask"].bool()
    inputs["input_ids"] = torch.where(kept & (inputs["input_ids"] == 0), 3, inputs["input_ids"])
    if rows is None:
        inputs.pop("attention_mask")
    if prompt.startswith("pad token inside"):
        inputs["input_ids"][0, 5] = 0
    return inputs


def _generate(model: torch.nn.Module, cache: str, prompt: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    options = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with emulation.count_op_calls() as calls:
        out = model.generate(**_on_npu(_prompt(prompt)), cache_implementation=cache, **options)
    return out.sequences.cpu(), out.logits[0].cpu(), calls[OP]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "cache", "prompt"), GENERATE_CASES, ids=str)
def test_generate_with_each_cache_gives_eagers_tokens_and_logits_fused(registered, family, cache, prompt):
    """Fused at every step, but for a window over a prompt whose inferred mask has a hole: eager, saying so."""
    model = build(family).eval()
    model.generation_config.pad_token_id = 0
    model.set_attn_implementation("eager")
    eager_tokens, eager_logits, _ = _generate(model, cache, prompt)
    model.set_attn_implementation(NAME)
    tokens, logits, calls = _generate(model, cache, prompt)
    windowed = (getattr(model.config, "sliding_window", None) or SEQ + 5) < SEQ + 5  # a window that masks a key
    hole = prompt.startswith("pad token inside") and windowed
    assert calls >= (0 if hole else 5 * model.config.num_hidden_layers)
    torch.testing.assert_close(logits, eager_logits, atol=3e-5, rtol=1e-3)
    assert torch.equal(tokens, eager_tokens)
    check_reported(model, "holes inside a row and a sliding window" if hole else FUSED)


@pytest.mark.parametrize("cache", ["offloaded", "offloaded_static"])
def test_offloaded_caches_fail_as_eager_does(registered, cache):
    model = build("llama").eval()
    errors = []
    for name in ("eager", NAME):
        model.set_attn_implementation(name)
        with pytest.raises(AssertionError, match="CUDA") as raised:
            _generate(model, cache, "all-ones mask")
        errors.append(str(raised.value))
    assert errors[0] == errors[1]


def test_a_static_cache_forward_without_a_mask_gives_eagers_logits_fused(registered):
    """A StaticCache of 32 slots, 12 tokens and no mask: the 20 empty slots are not attended (issue 43, form 1)."""
    from transformers import StaticCache

    model = build("llama").eval()
    results = {}
    for name in ("eager", NAME):
        model.set_attn_implementation(name)
        cache = StaticCache(config=model.config, max_cache_len=32)
        with emulation.count_op_calls() as calls, torch.no_grad():
            first = model(token_ids(2, SEQ).to("npu"), past_key_values=cache).logits
            step = model(token_ids(2, 1, seed=5).to("npu"), past_key_values=cache).logits
        results[name] = (first.cpu(), step.cpu(), calls[OP])
    assert results[NAME][2] == 2 * model.config.num_hidden_layers and results["eager"][2] == 0
    for fused, eager in zip(results[NAME][:2], results["eager"][:2], strict=True):
        torch.testing.assert_close(fused, eager, atol=3e-5, rtol=1e-3)


def _gemma_bidirectional() -> torch.nn.Module:
    """GemmaForCausalLM whose attention modules say is_causal False, under the causal mask the model builds."""
    config = AutoConfig.for_model("gemma", **tiny_config_values("llama"), use_bidirectional_attention=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to("npu")


def _gemma3_image_model() -> torch.nn.Module:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = tiny_config_values("gemma3_text", sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=95)
    torch.manual_seed(0)
    return Gemma3ForConditionalGeneration(config).to("npu")


def _image_tokens(rows: int) -> dict:
    inputs = _padded([(3, 0)] + [(0, 0)] * (rows - 1))
    token_types = torch.zeros_like(inputs["input_ids"])
    token_types[:, 4:8] = 1
    return {**inputs, "token_type_ids": token_types}


def _paligemma() -> torch.nn.Module:
    """PaliGemma: a Gemma language model whose attention modules say is_causal False, and a SigLIP tower."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    text = dict(tiny_config_values("llama"), model_type="gemma")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    config = PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=95, projection_dim=64)
    torch.manual_seed(0)
    return PaliGemmaForConditionalGeneration(config).to("npu")


def _prefix_tokens() -> dict:
    """A padded batch whose first 6 tokens are PaliGemma's prefix (token type 0: bidirectional among themselves)."""
    inputs = _padded([(3, 0), (0, 0)])
    token_types = torch.ones_like(inputs["input_ids"])
    token_types[:, :6] = 0
    return {**inputs, "token_type_ids": token_types}


def _bart() -> torch.nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                        pad_token_id=0, dropout=0.0, attention_dropout=0.0)  # fmt: skip
    torch.manual_seed(0)
    return BartForConditionalGeneration(config).to("npu")


def _t5() -> torch.nn.Module:
    """T5: its attention takes a relative position bias, which the op cannot add."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, dropout_rate=0.0,
                      relative_attention_num_buckets=8, pad_token_id=0, decoder_start_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    return T5ForConditionalGeneration(config).to("npu")


def _cross_inputs() -> dict:
    encoder = _padded([(0, 5), (0, 0)])
    return {
        "input_ids": encoder["input_ids"],
        "attention_mask": encoder["attention_mask"],
        "decoder_input_ids": token_ids(2, 7, seed=3),
    }


SPECIAL = {
    "Gemma, use_bidirectional_attention, padded": (_gemma_bidirectional, lambda: _padded([(3, 0), (0, 2)]), FUSED),
    "Gemma3 image tokens, padded": (_gemma3_image_model, lambda: _image_tokens(2), "the mask composes"),
    "Gemma3 image tokens, unpadded": (
        _gemma3_image_model,
        lambda: {**_image_tokens(2), "attention_mask": None},
        "the mask composes",
    ),
    "PaliGemma prefix tokens, padded": (_paligemma, _prefix_tokens, "the mask composes"),
    "PaliGemma text only, padded": (_paligemma, lambda: _padded([(3, 0), (0, 2)]), FUSED),
    "BART cross-attention, right-padded encoder": (_bart, _cross_inputs, FUSED),
    "T5 relative position bias": (_t5, _cross_inputs, "position_bias"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SPECIAL))
def test_overlays_flags_and_cross_attention_give_eagers_answer(registered, case):
    make_model, make_inputs, expected = SPECIAL[case]
    model = make_model()
    inputs = {key: value for key, value in make_inputs().items() if value is not None}
    kept = _kept(inputs, model) if "decoder_input_ids" not in inputs else torch.ones(2, 7, dtype=torch.bool)
    eager, fused, calls = run_both(model, inputs, train=True, kept=kept)
    assert (calls > 0) == (expected == FUSED), calls
    assert_eagers_answer(eager, fused, kept, torch.float32)
    check_reported(model, expected)


def test_an_all_padding_batch_gives_sdpas_zeros_without_calling_the_op(registered):
    """Every query sees no key: sdpa's answer is 0 for each (eager's averages every value); the card gives sdpa's,
    with no call of the op, whose varlen form takes no empty batch, and a gradient for every parameter."""
    model = build("llama")
    inputs = _on_npu({"input_ids": token_ids(2, SEQ), "attention_mask": torch.zeros(2, SEQ, dtype=torch.long)})
    logits = {}
    for name in ("sdpa", NAME):
        model.set_attn_implementation(name)
        model.zero_grad(set_to_none=True)
        with emulation.count_op_calls() as calls:
            out = model(**inputs).logits
            out.float().square().mean().backward()  # every parameter gets a gradient, as under sdpa (DDP needs it)
        logits[name] = out.detach().cpu()
        assert all(p.grad is not None for p in model.parameters()), name
    assert calls[OP] == 0
    torch.testing.assert_close(logits[NAME], logits["sdpa"], atol=3e-5, rtol=1e-3)


def test_the_harness_catches_a_wrong_form(registered, monkeypatch):
    """Negative control: the comparison fails when the card is told to ignore the padding (a form it fused wrong)."""
    model = build("llama")
    inputs = _padded([(3, 0), (0, 0)])
    eager, _, _ = run_both(model, inputs, train=True)
    wrong, _, _ = run_both(model, {"input_ids": inputs["input_ids"]}, train=True)
    with pytest.raises(AssertionError):
        assert_eagers_answer(eager, wrong, _kept(inputs), torch.float32)


def test_the_sample_covers_every_value_of_every_axis():
    for cases, axes in ((FORWARD_CASES, [FAMILIES, FORMS, [True, False], DTYPES]), (GENERATE_CASES, [FAMILIES, CACHES,
                        PROMPTS])):  # fmt: skip
        for position, axis in enumerate(axes):
            assert {case[position] for case in cases} == set(axis)


def test_the_doctor_shows_each_attention_modules_form_and_eager_reason(registered, offline_hub):
    """`diagnose(model=...)` lists each attention module with the form its last call fused, or why it ran eager."""
    from npu_hub_kernels.doctor import diagnose, format_report

    model = build("mistral, window 4")
    model.set_attn_implementation(NAME)
    model(**_on_npu(_padded([(3, 0), (0, 0)])))
    text = format_report(diagnose(offline_hub, model=model))
    assert (
        "fused" in text and "model.layers.0.self_attn (MistralAttention): causal, window 4, TND of 2 sequences" in text
    )
    custom = torch.zeros(2, 1, SEQ, SEQ, device="npu")  # a 4-D mask of the user's: eager, saying so
    model(token_ids(2, SEQ).to("npu"), attention_mask=custom)
    runs = diagnose(offline_hub, model=model).model.attention_runs
    assert [run.module for run in runs] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all("4-D attention mask" in run.eager_reason and run.form is None for run in runs)
    assert "ran eager" in format_report(diagnose(offline_hub, model=model))


def _packed_rows(rows: list[tuple[int, ...]], cu_seq_lens: bool = False) -> dict:
    """Rows of packed sequences of one length each (a micro-batch of several packed rows), with the cu_seq_lens of
    every sequence of the micro-batch laid end to end when asked (what a custom collator may pass with several rows)."""
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])
    inputs = {"input_ids": token_ids(len(rows), positions.shape[1]), "position_ids": positions, "use_cache": False}
    if cu_seq_lens:
        ends = torch.tensor([0, *(n for lengths in rows for n in lengths)]).cumsum(0).to(torch.int32)
        inputs.update(cu_seq_lens_q=ends, cu_seq_lens_k=ends, max_length_q=max(map(max, rows)))
        inputs["max_length_k"] = inputs["max_length_q"]
    return inputs


@pytest.mark.parametrize(
    "rows, cu_seq_lens",
    [([(5, 6, 1)], False), ([(5, 6, 1), (12,), (3, 9)], False), ([(4, 8), (3, 9), (12,)], True)],
    ids=["one row", "three rows", "three rows with cu_seq_lens"],
)
@pytest.mark.parametrize("family", ["llama", "mistral, window 4"])
def test_a_wrapper_that_drops_the_mask_packs_by_the_position_ids(registered, family, rows, cu_seq_lens):
    """DeepSpeed's Ulysses wrapper calls the attention with no mask and the (gathered) position ids: restarting
    position ids are packed sequences, row by row in a micro-batch of several rows, as transformers' masks read them;
    eager with the model's own packed mask is the reference. cu_seq_lens describe one row: with several rows, the
    position ids decide (reading the cu_seq_lens there attended across documents)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    card = ALL_ATTENTION_FUNCTIONS[NAME]
    AttentionInterface.register("npu_fused_attention_no_mask", lambda *args, **kwargs: card(*args[:4], None, **kwargs))
    model = build(family)
    inputs = _packed_rows(rows, cu_seq_lens)
    model.set_attn_implementation("eager")
    eager = model(**_on_npu(inputs)).logits.cpu()
    model.config._attn_implementation_internal = "npu_fused_attention_no_mask"  # the mask function stays the card's
    for module in model.modules():
        if hasattr(module, "config"):
            module.config._attn_implementation_internal = "npu_fused_attention_no_mask"
    with emulation.count_op_calls() as calls:
        wrapped = model(**_on_npu(inputs)).logits.cpu()
    assert calls[OP] == model.config.num_hidden_layers
    torch.testing.assert_close(wrapped, eager, atol=3e-5, rtol=1e-3)
    model.to(torch.float64)  # the op takes no float64: the card's eager path, which builds the same packed mask
    with emulation.count_op_calls() as calls:
        fallback = model(**_on_npu(inputs)).logits.cpu()
    assert calls[OP] == 0
    model.set_attn_implementation("eager")
    torch.testing.assert_close(fallback, model(**_on_npu(inputs)).logits.cpu(), atol=1e-12, rtol=0)
