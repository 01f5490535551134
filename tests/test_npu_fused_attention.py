"""npu-fused-attention on the emulated npu: op-level parity, the fused path proven by counters, the eager forms, the
model families, the host syncs per forward, and how the card is selected.

Parity follows flash-attention's idiom: the card's error against a float64 reference is at most twice the error of the
model's eager attention in the same dtype, forward and backward; the reference is written here from the masking rules
(causal bottom-right, window `j > i - W`, padding, packed sequences), not from the card's code. Padding queries are
left out of the comparison: the card writes 0 there, eager a value no later layer reads.
"""

from __future__ import annotations

import ast
import copy
import inspect
import logging
import re
import sys
import textwrap

import proof
import pytest
import torch
from numerics import assert_within_twice_eagers_error
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention

from npu_hub_kernels import _kernels_compat as compat
from npu_hub_kernels import apply_npu_kernels, attention_modules, register_npu_kernels
from npu_hub_kernels.cards import CARDS
from npu_hub_kernels.doctor import diagnose, format_report
from npu_hub_kernels.models import FUSED_CLASSES, fingerprints
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import TINY_WIDTHS, tiny_causal_lm, tiny_config_values, token_ids

NAME = "npu_fused_attention"
OP = "npu_fusion_attention"


@pytest.fixture
def registered(built_cards):
    register_npu_kernels(local_dir=built_cards, kernels=NAME)
    return built_cards


def attention_module(kv_heads: int) -> LlamaAttention:
    config = AutoConfig.for_model("llama", **tiny_config_values("llama", num_key_value_heads=kv_heads))
    return LlamaAttention(config, layer_idx=0).eval()


def reference(q, k, v, scale, window=None, padding=None, numbers=None) -> torch.Tensor:
    """Float64 attention [B, Sq, N, Dv] under the masking rules, written from them (see the module docstring)."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    q_len, kv_len = q.shape[2], k.shape[2]
    i = torch.arange(q_len)[:, None] + (kv_len - q_len)
    j = torch.arange(kv_len)[None, :]
    kept = (j <= i)[None, None]
    if window is not None:
        kept = kept & (j > i - window)
    if padding is not None:
        kept = kept & padding[:, None, None, :]
    if numbers is not None:
        kept = kept & (numbers[:, None, :, None] == numbers[:, None, None, :])
    scores = (q @ k.transpose(2, 3) * scale).masked_fill(~kept, float("-inf"))
    return (scores.softmax(-1).nan_to_num() @ v).transpose(1, 2)


CASES = {
    "causal": dict(q_len=24),
    "decode": dict(q_len=1),
    "decode 3": dict(q_len=3),
    "window": dict(q_len=24, window=4),
    "window decode": dict(q_len=2, window=4),
    "left padding": dict(q_len=24, padding="left"),
    "left padding decode": dict(q_len=1, padding="left"),
    "right padding": dict(q_len=24, padding="right"),
    "left padding window": dict(q_len=24, padding="left", window=4),
    "packed": dict(q_len=24, packed=True),
    "packed window": dict(q_len=24, packed=True, window=3),
    "mqa": dict(q_len=24, kv_heads=1),
    "mha": dict(q_len=24, kv_heads=4),
    "dv < dqk": dict(q_len=24, value_dim=8),
}


def case_inputs(name: str, dtype: torch.dtype):
    """(module, q, k, v, mask, kwargs, window, valid query positions [B, Sq], padding, numbers) of a case."""
    case = CASES[name]
    kv_heads, q_len, kv_len = case.get("kv_heads", 2), case["q_len"], 24
    batch = 1 if case.get("packed") else 2
    generator = torch.Generator().manual_seed(sorted(CASES).index(name))
    q = torch.randn(batch, 4, q_len, 16, generator=generator).to(dtype)
    k = torch.randn(batch, kv_heads, kv_len, 16, generator=generator).to(dtype)
    v = torch.randn(batch, kv_heads, kv_len, case.get("value_dim", 16), generator=generator).to(dtype)
    padding = numbers = mask = None
    kwargs = {}
    valid = torch.ones(batch, q_len, dtype=torch.bool)
    if case.get("padding"):
        padding = torch.ones(batch, kv_len, dtype=torch.bool)
        padding[0, :5] = False if case["padding"] == "left" else padding[0, :5]
        padding[1, -6:] = False if case["padding"] == "right" else padding[1, -6:]
        if case["padding"] == "left":
            padding[1, :2] = False
        mask = padding
        valid = padding[:, kv_len - q_len :]
    if case.get("packed"):
        cu = torch.tensor([0, 10, 19, 24], dtype=torch.int32)
        numbers = torch.searchsorted(cu[1:].long(), torch.arange(kv_len), right=True)[None]
        kwargs = dict(cu_seq_lens_q=cu.to("npu"), cu_seq_lens_k=cu.to("npu"), max_length_q=10, max_length_k=10)
    return attention_module(kv_heads), q, k, v, mask, kwargs, case.get("window"), valid, padding, numbers


def card_mask(card, padding, q_len, kv_len, window, device):
    """What the card's mask function makes of a padding mask for a causal self-attention (the queries the last
    keys), as transformers' create_causal_mask calls it (create_sliding_window_causal_mask with a window)."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    function = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    return card.fused_attention_mask(
        batch_size=padding.shape[0],
        q_length=q_len,
        kv_length=kv_len,
        q_offset=kv_len - q_len,
        mask_function=function,
        attention_mask=padding.to(device),
        dtype=torch.float32,
        device=torch.device(device),
    )


def run(card, function, module, q, k, v, mask, kwargs, window, device, valid):
    """The attention output [B, Sq, N, Dv] and the q, k, v gradients of a fixed random projection of it.

    The projection reads the valid queries only, as a loss reads no padding token. A padding mask goes through the
    card's mask function, as in a model."""
    q, k, v = (t.detach().to(device).requires_grad_() for t in (q, k, v))
    mask = None if mask is None else card_mask(card, mask, q.shape[2], k.shape[2], window, device)
    moved = {name: value.to(device) if torch.is_tensor(value) else value for name, value in kwargs.items()}
    output, _ = function(module, q, k, v, mask, scaling=module.scaling, sliding_window=window, **moved)
    weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(7)) * valid[:, :, None, None]
    weights = weights.to(device, output.dtype)
    (output * weights).sum().backward()
    return output, weights, q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_error_at_most_twice_eager_error_forward_and_backward(card, name, dtype):
    module, q, k, v, mask, kwargs, window, valid, padding, numbers = case_inputs(name, dtype)
    with emulation.count_op_calls() as calls:
        fused = [t.cpu() for t in run(card, card.fused_attention, module, q, k, v, mask, kwargs, window, "npu", valid)]
    assert calls[OP] == 1
    host_kwargs = {key: value.cpu() if torch.is_tensor(value) else value for key, value in kwargs.items()}
    with emulation.count_op_calls() as calls:
        eager = run(card, card.fused_attention_eager, module, q, k, v, mask, host_kwargs, window, "cpu", valid)
    assert calls[OP] == 0
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    expected = reference(q64, k64, v64, module.scaling, window, padding, numbers)
    (expected * fused[1].double()).sum().backward()
    rows = valid[:, :, None, None]
    fused_rows, eager_rows, expected_rows = (t.double().masked_fill(~rows, 0) for t in (fused[0], eager[0], expected))
    assert_within_twice_eagers_error(fused_rows, eager_rows, expected_rows, "output")
    exact = (q64.grad, k64.grad, v64.grad)
    for what, fused_grad, eager_grad, want in zip("qkv", fused[2:], eager[2:], exact, strict=True):
        assert_within_twice_eagers_error(fused_grad, eager_grad, want, f"d{what}")


def test_host_tensors_and_other_dtypes_run_eager_exactly_and_say_why(card):
    module, q, k, v, *_ = case_inputs("causal", torch.float32)
    with emulation.count_op_calls() as calls:
        fused, _ = card.fused_attention(module, q, k, v, None, scaling=module.scaling)
    assert calls[OP] == 0
    assert torch.equal(fused, card.fused_attention_eager(module, q, k, v, None, scaling=module.scaling)[0])
    assert "not on an npu device" in card.fused_attention_unavailable_reason(module, q, k, v, None)
    q64, k64, v64 = (t.double().to("npu") for t in (q, k, v))
    reason = card.fused_attention_unavailable_reason(module, q64, k64, v64, None)
    assert "float64" in reason
    with emulation.count_op_calls() as calls:
        card.fused_attention(module, q64, k64, v64, None, scaling=module.scaling)
    assert calls[OP] == 0


def test_under_autocast_float32_q_k_and_bfloat16_v_fuse_cast_as_sdpas_are(card):
    """Trainer's bf16=True: q/k in float32 (eager's rotary promotes them), v in bfloat16 (a linear under autocast).
    Under autocast the card casts the three to bfloat16, as autocast casts sdpa's, and fuses; its output is eager's
    dtype and within twice eager-under-autocast's error against float64, with gradients for q, k and v. Without
    autocast the same dtypes run eager, which raises as eager's matmul does, and say why (the negative control)."""
    module, q, k, v, *_ = case_inputs("causal", torch.float32)
    q, k, v = (t.to("npu").requires_grad_() for t in (q, k, v.to(torch.bfloat16)))
    expected = reference(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), module.scaling)
    results = {}
    for name, function in (("fused", card.fused_attention), ("eager", card.fused_attention_eager)):
        with torch.autocast("npu", dtype=torch.bfloat16), emulation.count_op_calls() as calls:
            out = function(module, q, k, v, None, scaling=module.scaling)[0]
        assert calls[OP] == (name == "fused"), name
        grads = torch.autograd.grad(out.float().sum(), (q, k, v))
        assert [g.dtype for g in grads] == [torch.float32, torch.float32, torch.bfloat16]
        results[name] = out
    assert results["fused"].dtype == results["eager"].dtype == torch.bfloat16
    assert_within_twice_eagers_error(results["fused"].cpu(), results["eager"].cpu(), expected, "output")
    with torch.autocast("npu", dtype=torch.bfloat16):  # autocast casts no float64: nor does the card
        assert "float64" in card.fused_attention_unavailable_reason(module, q, k.double(), v, None)
    assert "dtypes torch.float32/torch.float32/torch.bfloat16" in card.fused_attention_unavailable_reason(
        module, q, k, v, None
    )
    with emulation.count_op_calls() as calls, pytest.raises(RuntimeError, match="same dtype"):
        card.fused_attention(module, q, k, v, None, scaling=module.scaling)
    assert calls[OP] == 0


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (dict(softcap=30.0), "soft-capping"),
        (dict(output_attentions=True), "output_attentions"),
    ],
)
def test_forms_the_op_has_not_run_the_models_eager_attention(card, extra, said):
    module, q, k, v, *_ = case_inputs("causal", torch.bfloat16)
    q, k, v = (t.to("npu") for t in (q, k, v))
    extra = {key: value.to("npu") if torch.is_tensor(value) else value for key, value in extra.items()}
    assert said in card.fused_attention_unavailable_reason(module, q, k, v, None, **extra)
    with emulation.count_op_calls() as calls:
        out, _ = card.fused_attention(module, q, k, v, None, scaling=module.scaling, **extra)
    assert calls[OP] == 0
    expected, _ = card.fused_attention_eager(module, q, k, v, None, scaling=module.scaling, **extra)
    assert torch.equal(out.cpu(), expected.cpu())


def test_shift_labels_in_the_call_fuse_and_change_nothing(card):
    """DeepSpeed's Ulysses data-loader adapter puts shift_labels in every batch and the model passes them to each
    attention call with its other keywords: the loss's targets, which change no attention, fuse. Another tensor the
    card does not know (T5's position_bias) runs eager, saying so (the control)."""
    module, q, k, v, *_ = case_inputs("causal", torch.bfloat16)
    q, k, v = (t.to("npu") for t in (q, k, v))
    shift_labels = torch.randint(0, 96, (q.shape[0], q.shape[2])).to("npu")
    assert card.fused_attention_unavailable_reason(module, q, k, v, None, shift_labels=shift_labels) is None
    with emulation.count_op_calls() as calls:
        with_labels, _ = card.fused_attention(module, q, k, v, None, scaling=module.scaling, shift_labels=shift_labels)
        without, _ = card.fused_attention(module, q, k, v, None, scaling=module.scaling)
    assert calls[OP] == 2
    assert torch.equal(with_labels.cpu(), without.cpu())
    bias = torch.zeros(1, q.shape[1], q.shape[2], k.shape[2]).to("npu")
    reason = card.fused_attention_unavailable_reason(module, q, k, v, None, position_bias=bias)
    assert "passes position_bias" in reason


def test_packed_rows_over_a_million_tokens_together_run_eager_and_say_why(card):
    """The TND call takes every row's tokens at once, at most 1M (the op's T limit): two packed rows of 2^19 + 1
    tokens each are over it, though each row alone is under the 1M of S; one row fewer fuses (the control)."""
    module = attention_module(kv_heads=1)
    rows, seq = 2, 2**19 + 1
    q, k, v = (torch.zeros(rows, 1, seq, 8, device="npu") for _ in range(3))
    positions = torch.cat([torch.arange(seq // 2), torch.arange(seq - seq // 2)]).expand(rows, seq).to("npu")
    reason = card.fused_attention_unavailable_reason(module, q, k, v, None, position_ids=positions)
    assert reason == f"{rows * seq} tokens in one varlen (TND) call, every row's together: the op takes at most 1M"
    one_row = card.fused_attention_unavailable_reason(module, q[:1], k[:1], v[:1], None, position_ids=positions[:1])
    assert one_row is None


def test_a_four_d_mask_runs_eager_with_it(card):
    module, q, k, v, *_ = case_inputs("causal", torch.bfloat16)
    q, k, v = (t.to("npu") for t in (q, k, v))
    mask = torch.zeros(2, 1, 24, 24, dtype=torch.bfloat16)
    mask[..., 3:, :3] = torch.finfo(torch.bfloat16).min  # no causal pattern: bidirectional with a blocked prefix
    mask = mask.to("npu")
    assert "4-D attention mask" in card.fused_attention_unavailable_reason(module, q, k, v, mask)
    with emulation.count_op_calls() as calls:
        out, _ = card.fused_attention(module, q, k, v, mask, scaling=module.scaling)
    assert calls[OP] == 0
    expected, _ = LlamaAttention.forward.__globals__["eager_attention_forward"](module, q, k, v, mask, module.scaling)
    assert torch.equal(out.cpu(), expected.cpu())


def test_dropout_keeps_the_expected_output_on_average(card):
    """keep_prob = 1 - dropout in training: the mean of many draws tends to the output without dropout."""
    module, q, k, v, *_ = case_inputs("causal", torch.float32)
    module.train()
    q, k, v = (t.to("npu") for t in (q, k, v))
    plain, _ = card.fused_attention(module.eval(), q, k, v, None, dropout=0.3, scaling=module.scaling)
    module.train()
    draws = [card.fused_attention(module, q, k, v, None, dropout=0.3, scaling=module.scaling)[0] for _ in range(64)]
    single_error = (draws[0] - plain).abs().mean().item()
    mean_error = (torch.stack(draws).mean(0) - plain).abs().mean().item()
    assert single_error > 0.05  # dropout happened
    assert mean_error < single_error / 4  # unbiased: the error shrinks like 1/sqrt(draws)


FAMILIES = {
    "llama": {},
    "qwen3": {},
    "mistral": {"sliding_window": 4},
    "gemma3_text": {"sliding_window": 4},
}


def _logits_and_grads(model, ids, **inputs):
    """Logits, and the parameters' gradients of a loss over the tokens the mask keeps (a loss reads no padding)."""
    model.zero_grad()
    logits = model(ids, **inputs).logits
    kept = inputs.get("attention_mask", torch.ones_like(ids))[..., None]
    (logits.float().square() * kept).mean().backward()
    return logits.detach().cpu(), {n: p.grad.detach().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.slow) if f == "gemma3_text" else f for f in FAMILIES]
)
def test_families_give_eager_logits_gradients_and_tokens(registered, family):
    model = tiny_causal_lm(family, **FAMILIES[family]).to("npu")
    ids = token_ids(2, 24).to("npu")
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[0, :5] = 0
    mask = mask.to("npu")
    results = {}
    for implementation in ("eager", NAME):
        model.set_attn_implementation(implementation)
        with emulation.count_op_calls() as calls:
            results[implementation] = (
                _logits_and_grads(model, ids),
                _logits_and_grads(model, ids, attention_mask=mask),
                model.generate(ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=6, do_sample=False).cpu(),
            )
        results[implementation] += (calls[OP],)
    eager, fused = results["eager"], results[NAME]
    assert eager[3] == 0 and fused[3] >= 4 * model.config.num_hidden_layers  # fused, and its negative control
    kept = mask.bool().cpu()
    torch.testing.assert_close(fused[0][0], eager[0][0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(fused[1][0][kept], eager[1][0][kept], atol=2e-5, rtol=1e-4)
    for (name, fused_grad), eager_grad in zip(fused[1][1].items(), eager[1][1].values(), strict=True):
        torch.testing.assert_close(fused_grad, eager_grad, atol=2e-5, rtol=1e-3, msg=name)
    assert torch.equal(fused[2], eager[2])


def test_training_after_a_first_call_in_inference_mode_fuses_and_gets_gradients(card, monkeypatch):
    """The first call on a device in inference mode (generate) makes the op's cached compressed mask; a training call
    after it saves that mask for backward, which PyTorch refuses for an inference tensor."""
    monkeypatch.setattr(sys.modules[f"{card.__name__}._device_constants"], "_CONSTANTS", {})
    module = attention_module(kv_heads=2).to("npu")
    q, k, v = (torch.randn(1, heads, 8, 16).to("npu") for heads in (4, 2, 2))
    with torch.inference_mode():
        card.fused_attention(module, q, k, v, None, scaling=0.25)
    q.requires_grad_()
    with emulation.count_op_calls() as calls:
        out, _ = card.fused_attention(module.train(), q, k, v, None, scaling=0.25)
        out.sum().backward()
    assert calls[OP] == 1 and q.grad is not None


@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens"])
def test_a_packed_mistral_batch_gives_eager_logits_and_gradients(registered, how):
    model = tiny_causal_lm("mistral", sliding_window=4).to("npu")
    ids = token_ids(1, 24).to("npu")
    positions = torch.cat([torch.arange(10), torch.arange(9), torch.arange(5)])[None].to("npu")
    inputs = dict(position_ids=positions, use_cache=False)
    model.set_attn_implementation("eager")
    eager = _logits_and_grads(model, ids, **inputs)
    if how == "cu_seq_lens":
        cu = torch.tensor([0, 10, 19, 24], dtype=torch.int32).to("npu")
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=10, max_length_k=10)
    model.set_attn_implementation(NAME)
    with emulation.count_op_calls() as calls:
        fused = _logits_and_grads(model, ids, **inputs)
    assert calls[OP] == model.config.num_hidden_layers
    unpacked = _logits_and_grads(model, ids, use_cache=False)  # negative control: packing matters here
    assert (unpacked[0] - eager[0]).abs().max() > 1e-2
    torch.testing.assert_close(fused[0], eager[0], atol=2e-5, rtol=1e-4)
    for (name, fused_grad), eager_grad in zip(fused[1].items(), eager[1].values(), strict=True):
        torch.testing.assert_close(fused_grad, eager_grad, atol=2e-5, rtol=1e-3, msg=name)


SYNC_BATCHES = {"unpadded": 0, "left-padded": 1, "packed by position_ids": 1, "packed by cu_seq_lens": 1}
"""Each batch form, and the host syncs the card may add to a forward and backward (the issue: none unpadded, one per
forward for padding or packing, shared by every layer and layer type)."""


def sync_inputs(batch: str, padded_row: int = 0) -> tuple[torch.Tensor, dict]:
    """Token ids and forward inputs of a 24-token batch of the form `batch` (a key of SYNC_BATCHES)."""
    ids = token_ids(2 if batch == "left-padded" else 1, 24).to("npu")
    inputs = {"use_cache": False}
    if batch == "left-padded":
        mask = torch.ones(2, 24, dtype=torch.long)
        mask[padded_row, :5] = 0
        inputs["attention_mask"] = mask.to("npu")
    if batch.startswith("packed"):
        inputs["position_ids"] = torch.cat([torch.arange(10), torch.arange(14)])[None].to("npu")
    if batch == "packed by cu_seq_lens":
        cu = torch.tensor([0, 10, 24], dtype=torch.int32).to("npu")
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=14, max_length_k=14)
    return ids, inputs


def tiny_hybrid(family: str) -> torch.nn.Module:
    """A 4-layer model on the npu: Llama, or Gemma3 with sliding and full layers (two mask kinds per forward)."""
    if family == "llama":
        return tiny_causal_lm("llama", num_hidden_layers=4).to("npu").train()
    layer_types = ["sliding_attention", "full_attention"] * 2
    return tiny_causal_lm(family, num_hidden_layers=4, sliding_window=4, layer_types=layer_types).to("npu").train()


def card_syncs(model: torch.nn.Module, ids: torch.Tensor, inputs: dict) -> tuple[int, int]:
    """(the host syncs the card adds to a forward and backward, the op's calls in it).

    What the card adds is counted against the same step with eager attention, which makes only transformers' own
    syncs (its packed-sequence check, one per mask kind), none of an attention implementation's."""
    counts = {}
    for implementation in ("eager", NAME):
        model.set_attn_implementation(implementation)
        with emulation.count_host_syncs() as syncs, emulation.count_op_calls() as calls:
            model(ids, **inputs).logits.float().mean().backward()
        counts[implementation] = sum(syncs.values())
    return counts[NAME] - counts["eager"], calls[OP]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("batch", list(SYNC_BATCHES))
def test_host_syncs_per_forward_and_backward(registered, family, batch):
    """The card's host syncs over a 4-layer forward and backward: exactly the allowed count, shared by every layer
    and, in Gemma3, by its sliding and full layers; a second forward reads its own batch again (no stale plan)."""
    model = tiny_hybrid(family)
    ids, inputs = sync_inputs(batch)
    assert card_syncs(model, ids, inputs) == (SYNC_BATCHES[batch], 4)
    ids, inputs = sync_inputs(batch, padded_row=1)
    assert card_syncs(model, ids, inputs) == (SYNC_BATCHES[batch], 4)


@pytest.mark.parametrize("batch", ["left-padded", "packed by position_ids"])
def test_a_hybrid_model_reads_each_mask_kind_once_without_the_shared_read(card, registered, monkeypatch, batch):
    """Negative control of the shared read: with the mask function recording nothing, Gemma3's sliding and full
    masks are read on their own, two syncs per forward, which the counter sees."""
    monkeypatch.setattr(sys.modules[f"{card.__name__}.masks"], "expect_host_read", lambda mask: None)
    ids, inputs = sync_inputs(batch)
    assert card_syncs(tiny_hybrid("gemma3_text"), ids, inputs) == (2, 4)


def test_apply_npu_kernels_selects_the_card_where_the_attention_is_the_default(built_cards):
    model = apply_npu_kernels(tiny_causal_lm("llama").to("npu"), kernels=NAME, local_dir=built_cards)
    assert model.config._attn_implementation == NAME
    kept = tiny_causal_lm("llama").to("npu")
    kept.set_attn_implementation("eager")
    assert apply_npu_kernels(kept, kernels=NAME, local_dir=built_cards).config._attn_implementation == "eager"
    other = apply_npu_kernels(tiny_causal_lm("llama").to("npu"), kernels="npu_fused_rmsnorm", local_dir=built_cards)
    assert other.config._attn_implementation == "sdpa"  # the card left out of the selection: sdpa kept


def test_flash_attention_2_with_windows_on_the_npu_is_warned(built_cards, caplog):
    model = tiny_causal_lm("mistral", sliding_window=4).to("npu")
    model.config._attn_implementation_internal = "flash_attention_2"
    with caplog.at_level(logging.WARNING, logger="npu_hub_kernels"):
        apply_npu_kernels(model, kernels=NAME, local_dir=built_cards)
    assert any(
        'attn_implementation="npu_fused_attention"' in r.message and "sliding windows" in r.message
        for r in caplog.records
    )
    caplog.clear()
    llama = tiny_causal_lm("llama").to("npu")  # negative control: no window, no sinks
    llama.config._attn_implementation_internal = "flash_attention_2"
    with caplog.at_level(logging.WARNING, logger="npu_hub_kernels"):
        apply_npu_kernels(llama, kernels=NAME, local_dir=built_cards)
    assert not any("drops" in r.message for r in caplog.records)


def test_the_doctor_names_the_fix_for_flash_attention_2_dropping_windows(offline_hub):
    model = tiny_causal_lm("gemma3_text", sliding_window=4).to("npu")
    model.config._attn_implementation_internal = "flash_attention_2"
    report = diagnose(offline_hub, model=model)
    assert report.model.attention == "flash_attention_2"
    (warning,) = report.model.warnings
    assert "sliding windows" in warning and f'attn_implementation="{NAME}"' in warning
    assert warning in format_report(report)
    model.config._attn_implementation_internal = "sdpa"  # negative control: sdpa keeps the windows
    assert diagnose(offline_hub, model=model).model.warnings == []


def tiny_gpt_oss() -> torch.nn.Module:
    """A 2-layer gpt-oss (a sliding and a full layer, 4 experts) with random attention sinks, on the npu."""
    config = AutoConfig.for_model(
        "gpt_oss", **TINY_WIDTHS, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=4
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    return model.to("npu")


@pytest.mark.slow
def test_gpt_oss_sinks_fuse_from_cann_8_5_and_run_eager_before(card, registered, cann_version):
    model = tiny_gpt_oss()
    ids = token_ids(2, 24).to("npu")
    model.set_attn_implementation("eager")
    eager = _logits_and_grads(model, ids)
    eager_tokens = model.generate(ids[:, :8], max_new_tokens=6, do_sample=False)
    model.set_attn_implementation(NAME)
    with emulation.count_op_calls() as calls:
        fused = _logits_and_grads(model, ids)
        tokens = model.generate(ids[:, :8], max_new_tokens=6, do_sample=False)
    assert calls[OP] >= 2 * model.config.num_hidden_layers
    torch.testing.assert_close(fused[0], eager[0], atol=2e-5, rtol=1e-4)
    for (name, fused_grad), eager_grad in zip(fused[1].items(), eager[1].values(), strict=True):
        torch.testing.assert_close(fused_grad, eager_grad, atol=2e-5, rtol=1e-3, msg=name)  # the sinks' included
    assert torch.equal(tokens, eager_tokens)
    cann_version("8.3.RC1")  # before CANN 8.5 the op has no sink: the model's eager attention, exactly
    with emulation.count_op_calls() as calls:
        old = _logits_and_grads(model, ids)
    assert calls[OP] == 0
    assert torch.equal(old[0], eager[0])
    attention = model.model.layers[0].self_attn
    q, k = torch.zeros(1, 4, 3, 16, device="npu"), torch.zeros(1, 2, 3, 16, device="npu")
    assert "CANN 8.5" in card.fused_attention_unavailable_reason(attention, q, k, k, None, s_aux=attention.sinks)


@pytest.mark.slow
def test_trl_padding_free_sft_trains_to_eagers_losses(built_cards, tmp_path):
    """SFTTrainer with padding_free=True (one packed row with cu_seq_lens per batch) on the npu with the card gives
    the losses of the same run with eager attention on the host, every layer's attention fused."""
    from datasets import Dataset
    from test_trl import logged_losses, settings, tokenizer
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    tiny_causal_lm("llama").save_pretrained(tmp_path / "source")
    rows = [list(range(4, 4 + length)) for length in (5, 9, 7, 6, 8, 4)]
    dataset = Dataset.from_dict({"input_ids": rows})
    common = dict(padding_free=True, gradient_checkpointing=False, max_length=None)
    eager = SFTTrainer(
        str(tmp_path / "source"),
        args=SFTConfig(
            **settings(tmp_path / "eager", use_cpu=True, model_init_kwargs={"attn_implementation": "eager"}, **common)
        ),
        train_dataset=dataset,
        processing_class=tokenizer(),
    )
    eager.train()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "source").to("npu")
    model = apply_npu_kernels(model, kernels=NAME, local_dir=built_cards)
    assert model.config._attn_implementation == NAME
    trainer = SFTTrainer(
        model,
        args=SFTConfig(**settings(tmp_path / "npu", **common)),
        train_dataset=dataset,
        processing_class=tokenizer(),
    )
    with emulation.count_op_calls() as calls:
        trainer.train()
    steps = len(logged_losses(trainer))
    assert steps > 0 and calls[OP] == steps * model.config.num_hidden_layers
    torch.testing.assert_close(logged_losses(trainer), logged_losses(eager), rtol=1e-5, atol=0)


class VariableLengthRows(torch.utils.data.Dataset):
    """Causal-LM examples of 4 to 9 random token ids each (no special ids), for padding-free batches."""

    def __init__(self, examples: int = 16, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(4, 10, (examples,), generator=generator).tolist()
        self.rows = [torch.randint(4, 96, (n,), generator=generator).tolist() for n in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


@pytest.mark.slow
@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_trainer_with_flattening_collator_trains_to_eagers_losses(built_cards, tmp_path, flash_kwargs):
    """transformers' Trainer with DataCollatorWithFlattening (padding-free: one packed row per batch, sequences told
    by restarting position_ids, or by cu_seq_lens too) on the npu with the card gives the losses of the same run with
    eager attention on the host; every layer's attention fused at every forward (gradient checkpointing's recompute
    included), none in the eager run (negative control)."""
    from test_training_stacks import logged_losses, training_args
    from transformers import DataCollatorWithFlattening, Trainer

    tiny_causal_lm("llama").save_pretrained(tmp_path / "source")
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    eager_model = AutoModelForCausalLM.from_pretrained(tmp_path / "source", attn_implementation="eager")
    common = dict(save_strategy="no", max_steps=3)
    eager = Trainer(
        eager_model,
        training_args(tmp_path / "eager", use_cpu=True, **common),
        train_dataset=VariableLengthRows(),
        data_collator=collator,
    )
    with emulation.count_op_calls() as eager_calls:
        eager.train()
    assert eager_calls[OP] == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "source").to("npu")
    model = apply_npu_kernels(model, kernels=NAME, local_dir=built_cards)
    assert model.config._attn_implementation == NAME
    trainer = Trainer(
        model, training_args(tmp_path / "npu", **common), train_dataset=VariableLengthRows(), data_collator=collator
    )
    with emulation.count_op_calls() as calls:
        trainer.train()
    steps = len(logged_losses(trainer))
    assert steps == 3 and model.is_gradient_checkpointing
    assert calls[OP] == steps * 2 * model.config.num_hidden_layers  # forward and checkpointing's recompute
    torch.testing.assert_close(logged_losses(trainer), logged_losses(eager), rtol=1e-5, atol=0)


def test_overlaid_and_chunked_masks_are_eagers_own_so_those_calls_run_eager(registered):
    """A model's overlay on the causal mask (a prefix here, image tokens in Gemma3) and Llama4's chunked attention are
    masks the op cannot express: the card's mask function returns eager's own 4-D mask for them, which the attention
    function runs eager with, saying why; a plain causal mask is a description of the op's causal mode, no mask."""
    from transformers.masking_utils import create_causal_mask, create_chunked_causal_mask

    model = tiny_causal_lm("llama")
    model.config.attention_chunk_size = 4
    embeds = torch.zeros(2, 10, 64, device="npu")
    masks = {}
    for implementation in ("eager", NAME):
        model.config._attn_implementation_internal = implementation
        masks[implementation] = (
            create_causal_mask(
                model.config, embeds, None, None, position_ids=None, or_mask_function=lambda *i: i[3] < 3
            ),
            create_chunked_causal_mask(model.config, embeds, None, None, position_ids=None),
            create_causal_mask(model.config, embeds, None, None, position_ids=None),
        )
    overlaid, chunked, plain = masks[NAME]
    assert torch.equal(overlaid.cpu(), masks["eager"][0].cpu()) and overlaid.dim() == 4
    assert torch.equal(chunked.cpu(), masks["eager"][1].cpu()) and chunked.dim() == 4
    assert "or_mask" in overlaid.npu_fused_attention_eager_reason
    assert "chunked" in chunked.npu_fused_attention_eager_reason
    description = plain.npu_fused_attention_description  # negative control: the op's causal mode
    assert plain.shape == (2, 10) and bool(plain.all()) and description.causal and description.codes is None


# The attention table, proven on each transformers release (marker model_tables: scripts/model_tables.py, `make
# prove-transformers`). The card replaces one call of each listed class, its attention function's; the rest of the
# class is transformers' own code either way. So a listed class is proven where (1) its source makes that call in a
# form the card fuses, and (2) a reference model whose attention makes the call in the same form gives eager's logits
# with the card on this release, padded and packed (which also proves the card's mask function against this
# release's masking_utils). The fingerprint of each class that passes is recorded
# (models/proven/npu_fused_attention.json), and apply_npu_kernels selects the card only for models whose attention
# classes have proven code.

ATTENTION_RULES = FUSED_CLASSES[NAME]
PLAIN_KEYWORDS = {"dropout", "scaling", "attention_mask", "position_ids"}
"""The keywords of the plain call (position_ids is passed through to the attention function, which reads none)."""
FORM_REFERENCES = {
    "s_aux": ("gpt_oss.modeling_gpt_oss.GptOssAttention", "gpt_oss"),
    "sliding_window": ("mistral.modeling_mistral.MistralAttention", "mistral"),
    None: ("llama.modeling_llama.LlamaAttention", "llama"),
}
"""The keyword a call adds to the plain form (sinks first: gpt-oss passes both) -> its reference class and family."""


def _own_method(cls: type, name: str) -> ast.FunctionDef | None:
    """The syntax tree of the class's own method `name` (None when it inherits it), past a decorator's wrapper (the
    `__init__` kernels' use_kernelized_func wraps keeps the original in its closure)."""
    method = cls.__dict__.get(name)
    if method is None:
        return None
    method = (name == "__init__" and compat.decorated_init(cls)) or inspect.unwrap(method)
    return ast.parse(textwrap.dedent(inspect.getsource(method))).body[0]


def attention_call_form(cls: type) -> tuple[str | None, str | None]:
    """(the keyword of FORM_REFERENCES the class's attention call adds, why the call is not a fused form or None).

    The fused forms: the forward gets the function with `ALL_ATTENTION_FUNCTIONS.get_interface(
    self.config._attn_implementation, eager_attention_forward)` (its modeling file's own eager function, which the
    card's eager forms call) and calls it as `(self, query, key, value[, mask], <PLAIN_KEYWORDS and sliding_window or
    s_aux>, **kwargs)`; the class is causal (`self.is_causal = True`, or not Gemma's bidirectional option)."""
    forward, init = _own_method(cls, "forward"), _own_method(cls, "__init__")
    if forward is None or init is None:
        return None, "no forward or __init__ of its own"
    getter = "ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)"
    names = {
        target.id
        for node in ast.walk(forward)
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None and ast.unparse(node.value) == getter
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    }
    eager = getattr(sys.modules[cls.__module__], "eager_attention_forward", None)
    if not names or getattr(eager, "__module__", None) != cls.__module__:
        return None, "does not get its attention function with its modeling file's eager_attention_forward as default"
    causal = [
        ast.unparse(node.value)
        for node in ast.walk(init)
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["self.is_causal"]
    ]
    if len(causal) != 1 or not (causal[0] == "True" or re.fullmatch(r"not .*use_bidirectional_attention.*", causal[0])):
        return None, f"is_causal set to {causal}"
    calls = [n for n in ast.walk(forward) if isinstance(n, ast.Call) and ast.unparse(n.func) in names]
    if not calls:
        return None, "never calls its attention function"
    added = set()
    for call in calls:
        keywords = {k.arg for k in call.keywords}
        mask = len(call.args) == 5 or (len(call.args) == 4 and "attention_mask" in keywords)
        if ast.unparse(call.args[0]) != "self" or not mask or None not in keywords:
            return None, f"calls {ast.unparse(call)[:80]}"
        added |= keywords - PLAIN_KEYWORDS - {None}
    if not added <= {"sliding_window", "s_aux"}:
        return None, f"passes {sorted(added)} to its attention function"
    return ("s_aux" if "s_aux" in added else added.pop() if added else None), None


def fused_logits_equal_eagers(model: torch.nn.Module) -> None:
    """Raise unless the model gives eager's logits with the card, padded (batch 2) and packed (restarting
    position_ids), every layer fused, and none with eager (negative control)."""
    ids = token_ids(2, 24).to("npu")
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[0, :5] = 0
    positions = torch.cat([torch.arange(10), torch.arange(14)])[None]
    batches = [(ids, dict(attention_mask=mask.to("npu"))), (ids[:1], dict(position_ids=positions.to("npu")))]
    for batch, inputs in batches:
        logits = {}
        for implementation in ("eager", NAME):
            model.set_attn_implementation(implementation)
            with torch.no_grad(), emulation.count_op_calls() as calls:
                logits[implementation] = model(batch, use_cache=False, **inputs).logits.cpu()
            assert calls[OP] == (implementation == NAME) * model.config.num_hidden_layers, (implementation, calls)
        kept = inputs.get("attention_mask", torch.ones_like(batch)).bool().cpu()
        torch.testing.assert_close(logits[NAME][kept], logits["eager"][kept], atol=2e-5, rtol=1e-4)


def reference_model(family: str) -> torch.nn.Module:
    return tiny_gpt_oss() if family == "gpt_oss" else tiny_causal_lm(family, sliding_window=4).to("npu")


@pytest.mark.slow
@pytest.mark.model_tables
def test_every_fused_attention_class_calls_the_attention_in_a_form_its_reference_proves(registered):
    rules = {rule.path: rule for rule in ATTENTION_RULES}
    holds = {
        keyword: proof.reference_holds(
            rules[path], lambda family=family: fused_logits_equal_eagers(reference_model(family))
        )
        for keyword, (path, family) in FORM_REFERENCES.items()
    }
    failures = []
    for rule in proof.proven_rules(ATTENTION_RULES):
        keyword, problem = attention_call_form(rule.installed())
        if problem is None and not holds[keyword]:
            problem = f"its reference {FORM_REFERENCES[keyword][0]} does not give eager's logits with the card"
        if problem is not None:
            failures.append(f"{rule.path}: {problem}")
        proof.verdict(rule.path, problem is None)
    assert failures == []


@pytest.mark.parametrize("reason", ["logit soft-capping", "bidirectional attention", "passes a position bias"])
def test_the_call_form_check_refuses_a_class_left_out_for_its_call(reason):
    """Negative control of the proofs' form check: the first class the table leaves out for a soft-capped,
    bidirectional or biased call is not of a fused form."""
    from npu_hub_kernels.models import ClassRule
    from npu_hub_kernels.models import npu_fused_attention as table

    path = min(path for path, why in table.LEFT_OUT.items() if why.startswith(reason))
    assert attention_call_form(ClassRule(path, "", NAME).installed())[1] is not None, path


def test_a_model_whose_attention_code_is_not_proven_keeps_its_attention_and_says_why(built_cards, monkeypatch):
    """Negative control of the proofs: LlamaAttention with its proven fingerprint replaced keeps sdpa under
    apply_npu_kernels, naming the releases proven; with the real file the card is selected."""
    card = CARDS[NAME]
    path = "llama.modeling_llama.LlamaAttention"
    real = fingerprints.proven_of(card)
    assert path in real  # proven on some release (scripts/model_tables.py prove)
    monkeypatch.setattr(
        fingerprints, "proven_of", lambda c: {**real, path: {"0" * 16: ["5.22.2"]}} if c is card else {}
    )
    from npu_hub_kernels.attention import attention_kept_reason

    model = tiny_causal_lm("llama").to("npu")
    reason = attention_kept_reason(model, card)
    assert "differs from the code proven on 5.22.2" in reason and path in reason
    assert apply_npu_kernels(model, kernels=NAME, local_dir=built_cards).config._attn_implementation == "sdpa"
    monkeypatch.undo()
    assert apply_npu_kernels(model, kernels=NAME, local_dir=built_cards).config._attn_implementation == NAME


def test_a_mask_built_for_other_lengths_is_refused_naming_both(card):
    """A model that changes its queries or keys after building the mask (RecurrentGemma in decoding): the described
    mask no longer says which keys each query sees, and the reason names the call's lengths and the mask's."""
    module, q, k, v, *_ = case_inputs("causal", torch.bfloat16)
    q, k, v = (t.to("npu") for t in (q, k, v))
    mask = card_mask(card, torch.ones(2, 24, dtype=torch.bool), 24, 24, None, "npu")
    assert card.fused_attention_unavailable_reason(module, q, k, v, mask) is None  # negative control
    reason = card.fused_attention_unavailable_reason(module, q[..., -1:, :], k, v, mask)
    assert reason.startswith("the model attends 1 queries to 24 keys in batch 2, but its mask was built for 24 queries")


class _Logits(torch.nn.Module):
    """A model's logits from (ids, attention mask): what torch.jit.trace takes."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits


@pytest.mark.parametrize("tracer", ["torch.compile", "torch.jit.trace"])
def test_a_traced_model_runs_its_eager_attention_for_any_batchs_padding(built_cards, tracer):
    """The fused form reads the batch's padding on the host: a traced graph would freeze the traced batch's. Under
    torch.compile and torch.jit.trace the model runs its own eager attention, so a batch padded otherwise than the
    traced one gets eager's logits (negative control: the untraced model calls the op)."""
    plain = tiny_causal_lm("llama").to("npu").eval()
    model = apply_npu_kernels(copy.deepcopy(plain), kernels=NAME, local_dir=built_cards)
    ids = token_ids(seq=8).to("npu")
    traced_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8], device="npu")
    other_mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1]], device="npu")
    with torch.no_grad():
        with emulation.count_op_calls() as calls:
            _Logits(model)(ids, other_mask)
        assert calls[OP] > 0
        if tracer == "torch.compile":
            traced = torch.compile(_Logits(model), backend="eager")
        else:
            traced = torch.jit.trace(_Logits(model), (ids, traced_mask), check_trace=False)
        with emulation.count_op_calls() as calls:
            got = traced(ids, other_mask)
        want = _Logits(plain)(ids, other_mask)
    assert calls[OP] == 0
    kept = other_mask.bool()
    torch.testing.assert_close(got[kept].cpu(), want[kept].cpu(), rtol=1e-5, atol=1e-5)
    assert any(tracer in (row.eager_reason or "") for row in attention_modules(model)), attention_modules(model)


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_a_recorded_backward_through_the_op_raises_saying_what_to_do(built_cards, padded):
    """The op's backward has no derivative: a gradient penalty (create_graph) raises instead of being silently wrong,
    and what the message says to do works; a plain backward is the op's (control)."""
    model = apply_npu_kernels(tiny_causal_lm("llama").to("npu"), kernels=NAME, local_dir=built_cards).train()
    ids = token_ids(seq=8).to("npu")
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8], device="npu") if padded else torch.ones_like(ids)
    params = [p for p in model.parameters() if p.requires_grad]

    def penalty():
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        grads = torch.autograd.grad(loss, params, create_graph=True)
        return sum(g.pow(2).sum() for g in grads)

    with emulation.count_op_calls() as calls:
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    assert calls[OP] == 2 and all(p.grad is not None for p in params)
    with pytest.raises(RuntimeError, match=r"backward has no derivative.*set_attn_implementation"):
        penalty()
    model.set_attn_implementation("sdpa")
    penalty().backward()
