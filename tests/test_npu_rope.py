"""npu-rope, op level: the card's apply_rotary_pos_emb against a float64 reference, and which path runs.

Parity follows flash-attention's idiom: the kernel's error against float64 is at most twice the
error of transformers' eager math in the same dtype. The fused path is proven by the emulated op's
call counter (one call for q, one for k); every fallback is proven to skip it and to equal eager.
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch
from numerics import assert_within_twice_eagers_error, relative_error

from npu_hub_kernels.testing import emulation

INTERLEAVED = {"pairs", "pairs_partial", "pairs_float32", "pairs_half_angles", "glm", "glm_partial", "glm_float32"}
"""Styles on npu_rotary_mul's 'interleave' mode, which takes cos/sin without a batch dim."""
PARTIAL = {"llama_partial", "pairs_partial", "glm_partial"}
"""Styles whose transformers functions (Phi3, Glm4v, Glm4) rotate only the leading cos.shape[-1] dims."""

TRANSFORMERS_FUNCTION = {
    "llama": "llama.modeling_llama.apply_rotary_pos_emb",
    "llama_partial": "phi3.modeling_phi3.apply_rotary_pos_emb",  # Llama's math, plus partial rotary
    "cast_back": "olmo2.modeling_olmo2.apply_rotary_pos_emb",
    "float32": "esm.modeling_esm.apply_rotary_pos_emb",
    "half_angles": "gpt_oss.modeling_gpt_oss.apply_rotary_pos_emb",
    "pairs": "blt.modeling_blt.apply_rotary_pos_emb",
    "pairs_partial": "glm4v.modeling_glm4v.apply_rotary_pos_emb",
    "pairs_float32": "cohere.modeling_cohere.apply_rotary_pos_emb",
    "pairs_half_angles": "openai_privacy_filter.modeling_openai_privacy_filter.apply_rotary_pos_emb",
    "glm": "helium.modeling_helium.apply_rotary_pos_emb",
    "glm_partial": "glm4.modeling_glm4.apply_rotary_pos_emb",
    "glm_float32": "ernie4_5.modeling_ernie4_5.apply_rotary_pos_emb",
    "deinterleave": "deepseek_v3.modeling_deepseek_v3.apply_rotary_pos_emb_interleave",
}
"""One transformers function per style: eager PyTorch for the parity idiom (and, in float64, the reference)."""
STYLES = list(TRANSFORMERS_FUNCTION)
FP64_TWIN = {"float32": "llama", "pairs_float32": "pairs", "glm_float32": "glm"}
"""Styles that upcast to float32 inside; in float64 their reference is the same math without the upcast."""


def test_every_style_of_the_card_is_tested(card):
    assert set(card.STYLES) == set(STYLES)


def transformers_function(style):
    module, _, name = TRANSFORMERS_FUNCTION[style].rpartition(".")
    return getattr(importlib.import_module(f"transformers.models.{module}"), name)


def rotary_inputs(
    batch,
    q_heads,
    kv_heads,
    seq,
    head_dim,
    dtype,
    cos_batch=None,
    unsqueeze_dim=1,
    seed=0,
    style="llama",
    rotary_dim=None,
):
    """q, k and cos/sin laid out as transformers passes them to a function of `style`."""
    g = torch.Generator().manual_seed(seed)
    shape = (lambda h: (batch, h, seq, head_dim)) if unsqueeze_dim == 1 else (lambda h: (batch, seq, h, head_dim))
    q = torch.randn(shape(q_heads), generator=g).to(dtype)
    k = torch.randn(shape(kv_heads), generator=g).to(dtype)
    angles = torch.rand(cos_batch or batch, seq, (rotary_dim or head_dim) // 2, generator=g) * 6.28
    if style in ("half_angles", "pairs_half_angles"):
        emb = angles
    elif style in ("pairs", "pairs_partial", "pairs_float32"):
        emb = angles.repeat_interleave(2, dim=-1)
    else:
        emb = torch.cat((angles, angles), dim=-1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


def npu(*tensors):
    return [t.to("npu") for t in tensors]


def transformers_eager(q, k, cos, sin, unsqueeze_dim, style):
    return transformers_function(style)(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def reference_fp64(q, k, cos, sin, unsqueeze_dim, style):
    style = FP64_TWIN.get(style, style)
    return transformers_eager(*(t.double() for t in (q, k, cos, sin)), unsqueeze_dim, style)


def random_cases(count: int, seed: int):
    rng = random.Random(seed)
    for i in range(count):
        kv_heads = rng.choice([1, 2, 4])
        yield dict(
            batch=rng.choice([1, 2, 3]),
            q_heads=kv_heads * rng.choice([1, 2, 4]),
            kv_heads=kv_heads,
            seq=rng.choice([1, 7, 13, 32]),
            head_dim=rng.choice([64, 80, 96, 128, 256]),
            cos_batch=rng.choice([None, 1]),
            unsqueeze_dim=rng.choice([1, 2]),
            seed=i,
            rotary_dim=rng.choice([None, None, 32]),
        )


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize(("dtype", "seed"), [(torch.float32, 0), (torch.bfloat16, 1), (torch.float16, 2)])
def test_fused_error_at_most_twice_eager_error(card, style, dtype, seed):
    for case in random_cases(12, seed):
        if style in INTERLEAVED:
            case["cos_batch"] = 1
        if style not in PARTIAL:
            case["rotary_dim"] = None
        q, k, cos, sin = rotary_inputs(dtype=dtype, style=style, **case)
        dim = case["unsqueeze_dim"]
        with emulation.count_op_calls() as calls:
            fused = [t.cpu() for t in card.apply_rotary_pos_emb(*npu(q, k, cos, sin), dim, style)]
        assert calls["npu_rotary_mul"] == 2, case
        eager = transformers_eager(q, k, cos, sin, dim, style)
        for got, want, ref in zip(fused, eager, reference_fp64(q, k, cos, sin, dim, style), strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert_within_twice_eagers_error(got, want, ref, case)


@pytest.mark.parametrize("style", STYLES)
def test_fp32_fused_equals_eager_exactly(card, style):
    """Fused, the card's eager path and transformers' own function agree bit for bit in float32."""
    q, k, cos, sin = rotary_inputs(2, 8, 2, 9, 128, torch.float32, cos_batch=1, style=style)
    with emulation.count_op_calls() as calls:
        fused = card.apply_rotary_pos_emb(*npu(q, k, cos, sin), 1, style)
    assert calls["npu_rotary_mul"] == 2
    eager = card.apply_rotary_pos_emb_eager(q, k, cos, sin, 1, style)
    for got, want, original in zip(fused, eager, transformers_eager(q, k, cos, sin, 1, style), strict=True):
        assert torch.equal(got.cpu(), want) and torch.equal(want, original)


@pytest.mark.parametrize("style", sorted(PARTIAL))
def test_partial_rotary_rotates_the_leading_dims_and_passes_the_rest(card, style):
    q, k, cos, sin = rotary_inputs(1, 4, 2, 7, 128, torch.float32, style=style, rotary_dim=64)
    with emulation.count_op_calls() as calls:
        fused = card.apply_rotary_pos_emb(*npu(q, k, cos, sin), 1, style)
    assert calls["npu_rotary_mul"] == 2
    for got, x, original in zip(fused, (q, k), transformers_eager(q, k, cos, sin, 1, style), strict=True):
        assert torch.equal(got.cpu(), original)
        assert torch.equal(got.cpu()[..., 64:], x[..., 64:])


def test_interleave_mode_with_per_batch_cos_takes_the_eager_path(card):
    """npu_rotary_mul's 'interleave' mode takes cos/sin without a batch dim: batch-B cos/sin fall back."""
    q, k, cos, sin = rotary_inputs(2, 4, 2, 5, 64, torch.float32, style="glm")
    assert "batch dim" in card.apply_rotary_pos_emb_unavailable_reason(*npu(q, k, cos, sin), 1, "glm")
    with emulation.count_op_calls() as calls:
        fused = card.apply_rotary_pos_emb(*npu(q, k, cos, sin), 1, "glm")
    assert calls["npu_rotary_mul"] == 0
    for got, want in zip(fused, transformers_eager(q, k, cos, sin, 1, "glm"), strict=True):
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("style", ["cast_back", "float32"])
def test_styles_that_compute_in_float32_are_exact_with_bf16_q_and_float32_cos(card, style):
    q, k, _, _ = rotary_inputs(2, 4, 2, 5, 64, torch.bfloat16)
    _, _, cos, sin = rotary_inputs(2, 4, 2, 5, 64, torch.float32)
    with emulation.count_op_calls() as calls:
        fused = card.apply_rotary_pos_emb(*npu(q, k, cos, sin), 1, style)
    assert calls["npu_rotary_mul"] == 2
    for got, want in zip(fused, card.apply_rotary_pos_emb_eager(q, k, cos, sin, 1, style), strict=True):
        assert got.dtype == torch.bfloat16 and torch.equal(got.cpu(), want)


@pytest.mark.parametrize("style", STYLES)
def test_backward_reaches_q_k_cos_and_sin(card, style):
    q, k, cos, sin = rotary_inputs(2, 4, 2, 5, 64, torch.float32, cos_batch=1, style=style)
    leaves = [t.clone().requires_grad_() for t in (q, k, cos, sin)]
    npu_leaves = [t.clone().to("npu").requires_grad_() for t in (q, k, cos, sin)]
    sum(x.pow(2).sum() for x in transformers_eager(*leaves, 1, style)).backward()
    with emulation.count_op_calls() as calls:
        sum(x.pow(2).sum() for x in card.apply_rotary_pos_emb(*npu_leaves, 1, style)).backward()
    assert calls["npu_rotary_mul"] == 2
    for got, want in zip(npu_leaves, leaves, strict=True):
        torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-5, atol=1e-5)


def _gradient_penalty(rotary, leaves):
    """A gradient penalty through a rotary function: the squared norm of the first-order gradients of a loss
    nonlinear in its outputs, differentiated again (`create_graph=True`); the leaves' .grad are its gradients."""
    first = torch.autograd.grad(sum(x.sin().sum() for x in rotary(*leaves)), leaves, create_graph=True)
    sum(g.pow(2).sum() for g in first).backward()


@pytest.mark.parametrize("style", STYLES)
def test_a_double_backward_gives_eagers_second_order_gradients(card, style):
    """npu_rotary_mul_backward has no derivative (torch_npu's fallback warns and passes no second-order gradient):
    where autograd records the backward, the card differentiates eager's math instead, so a gradient penalty (and a
    Hessian-vector product) gives eager's gradients in q, k, cos and sin, while the forward stays fused."""
    q, k, cos, sin = rotary_inputs(2, 4, 2, 5, 64, torch.float32, cos_batch=1, style=style)
    leaves = [t.clone().requires_grad_() for t in (q, k, cos, sin)]
    npu_leaves = [t.clone().to("npu").requires_grad_() for t in (q, k, cos, sin)]
    _gradient_penalty(lambda *xs: transformers_eager(*xs, 1, style), leaves)
    with emulation.count_op_calls() as calls:
        _gradient_penalty(lambda *xs: card.apply_rotary_pos_emb(*xs, 1, style), npu_leaves)
    assert calls["npu_rotary_mul"] == 2
    for got, want in zip(npu_leaves, leaves, strict=True):
        torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-5, atol=1e-5)
    # a Hessian-vector product in q: d/dq <d loss/dq, v>
    v = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    hvp = {}
    for run, rotary, device in (
        ("eager", lambda *xs: transformers_eager(*xs, 1, style), "cpu"),
        ("npu", lambda *xs: card.apply_rotary_pos_emb(*xs, 1, style), "npu"),
    ):
        q_leaf = q.clone().to(device).requires_grad_()
        loss = sum(x.sin().sum() for x in rotary(q_leaf, *(t.to(device) for t in (k, cos, sin))))
        (grad_q,) = torch.autograd.grad(loss, q_leaf, create_graph=True)
        (hvp[run],) = torch.autograd.grad((grad_q * v.to(device)).sum(), q_leaf)
    torch.testing.assert_close(hvp["npu"].cpu(), hvp["eager"], rtol=1e-5, atol=1e-5)


def test_a_batch_the_op_reads_as_sbnd_is_fused(card):
    """Per-batch cos on BSND memory, [B, S, 1, D], is also npu_rotary_mul's SBND form (S=B): with a batch of 1000 or
    more and a short sequence the device takes it within SBND's limits, so the card does not fall back."""
    q, k, cos, sin = projected_qk(batch=1000, q_heads=2, kv_heads=2, seq=3, head_dim=8)
    assert card.apply_rotary_pos_emb_unavailable_reason(q, k, cos, sin) is None
    with emulation.count_op_calls() as calls:
        fused = card.apply_rotary_pos_emb(q, k, cos, sin)
    assert dict(calls) == {"npu_rotary_mul": 2}
    for got, want in zip(fused, card.apply_rotary_pos_emb_eager(q, k, cos, sin), strict=True):
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-6, atol=1e-6)


def _fallback_cases():
    return {
        "head dim >= 896": (rotary_inputs(1, 2, 2, 3, 896, torch.float32), "below 896"),
        # cos shared by the batch: read as BNSD or BSND, B=1000 in both (per-batch cos would also read as SBND)
        "batch >= 1000": (rotary_inputs(1000, 2, 2, 3, 8, torch.float32, cos_batch=1), "below 1000"),
        "heads >= 1000": (rotary_inputs(1, 1000, 1000, 1, 8, torch.float32), "below 1000"),
        "empty sequence": (rotary_inputs(2, 4, 2, 0, 64, torch.float32), "empty input"),
        "float64": (rotary_inputs(2, 4, 2, 5, 64, torch.float64), "float64"),
        "cos dtype differs": (  # float32 q/k, bfloat16 cos/sin: rotate(q) * sin is rounded to neither (a bf16 q/k
            # with float32 cos/sin is rotated cast to float32: test_bfloat16_q_k_with_float32_angles_fuse_...)
            (*rotary_inputs(2, 4, 2, 5, 64, torch.float32)[:2], *rotary_inputs(2, 4, 2, 5, 64, torch.bfloat16)[2:]),
            "differs",
        ),
    }


@pytest.mark.parametrize("case", list(_fallback_cases()))
def test_unsupported_inputs_take_the_exact_eager_path(card, case):
    (q, k, cos, sin), reason = _fallback_cases()[case]
    assert reason in card.apply_rotary_pos_emb_unavailable_reason(*npu(q, k, cos, sin))
    with emulation.count_op_calls() as calls:
        fused = card.apply_rotary_pos_emb(*npu(q, k, cos, sin))
    assert calls["npu_rotary_mul"] == 0
    for got, want in zip(fused, card.apply_rotary_pos_emb_eager(q, k, cos, sin), strict=True):
        assert torch.equal(got.cpu(), want)


def test_odd_head_dim_and_three_dim_inputs_take_the_eager_path(card):
    q, k = torch.randn(2, 5, 63), torch.randn(2, 5, 63)  # 3-D [B, S, D] with an odd D
    cos, sin = torch.randn(2, 5, 63), torch.randn(2, 5, 63)
    assert "4-D" in card.apply_rotary_pos_emb_unavailable_reason(*npu(q, k, cos, sin), 0)
    with emulation.count_op_calls() as calls:
        fused = card.apply_rotary_pos_emb(*npu(q, k, cos, sin), 0)
    assert calls["npu_rotary_mul"] == 0
    for got, want in zip(fused, card.apply_rotary_pos_emb_eager(q, k, cos, sin, 0), strict=True):
        assert torch.equal(got.cpu(), want)
    q4, cos_odd = torch.randn(1, 2, 3, 63), torch.randn(1, 3, 63)
    assert "must be even" in card.apply_rotary_pos_emb_unavailable_reason(*npu(q4, q4, cos_odd, cos_odd))


def test_host_tensors_take_the_eager_path(card):
    q, k, cos, sin = rotary_inputs(2, 4, 2, 5, 64, torch.float32)
    with emulation.count_op_calls() as calls:
        fused = card.apply_rotary_pos_emb(q, k, cos, sin)
    assert calls["npu_rotary_mul"] == 0
    for got, want in zip(fused, card.apply_rotary_pos_emb_eager(q, k, cos, sin), strict=True):
        assert torch.equal(got, want)


def test_layers_take_both_transformers_signatures(card):
    """Layers with the older signature take (q, k, cos, sin, position_ids, unsqueeze_dim); position_ids is unused."""
    q, k, cos, sin = rotary_inputs(2, 4, 2, 5, 64, torch.float32, unsqueeze_dim=2)
    position_ids = torch.arange(5).expand(2, 5)
    current = card.layers.RotaryPosEmb()(*npu(q, k, cos, sin), 2)
    with emulation.count_op_calls() as calls:
        older = card.layers.RotaryPosEmbPositionIds()(*npu(q, k, cos, sin, position_ids), 2)
    assert calls["npu_rotary_mul"] == 2
    for got, want in zip(older, current, strict=True):
        assert torch.equal(got.cpu(), want.cpu())


def projected_qk(batch=2, q_heads=8, kv_heads=2, seq=5, head_dim=64, dtype=torch.float32, cos_batch=None, seed=0):
    """q/k as transformers' attention makes them: `[B, H, S, D]` transposes of `[B, S, H, D]` projections (npu)."""
    q, k, cos, sin = rotary_inputs(batch, q_heads, kv_heads, seq, head_dim, dtype, cos_batch, 2, seed)
    q, k, cos, sin = npu(q, k, cos, sin)
    return q.transpose(1, 2), k.transpose(1, 2), cos, sin


def test_transposed_projections_are_rotated_on_their_own_memory_without_copies(card):
    """Training (grad on): npu_rotary_mul runs on the BSND memory q/k already have, once for q and once for k,
    and nothing else runs: no copies of q/k, no copies of cos/sin. The results keep q/k's layout."""
    from bench.accounting import count_device_ops

    q, k, cos, sin = projected_qk()
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    with count_device_ops() as tally:  # counts the ops (the fused ops' outputs there are shapes only)
        card.apply_rotary_pos_emb(q, k, cos, sin)
    assert tally.by_op() == {"npu_rotary_mul": 2}
    fused = card.apply_rotary_pos_emb(q, k, cos, sin)
    for got, want, x in zip(fused, card.apply_rotary_pos_emb_eager(q, k, cos, sin), (q, k), strict=True):
        assert got.stride() == x.stride()
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-6, atol=1e-6)
    with count_device_ops() as tally:
        sum(t.pow(2).sum() for t in card.apply_rotary_pos_emb(q, k, cos, sin)).backward()
    assert tally.by_op()["npu_rotary_mul_backward"] == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_inference_mode_rotates_q_and_k_in_one_call_in_place(card, dtype, head_dim):
    q, k, cos, sin = projected_qk(head_dim=head_dim, dtype=dtype)
    expected = card.apply_rotary_pos_emb_eager(q.cpu(), k.cpu(), cos.cpu(), sin.cpu())
    with torch.inference_mode(), emulation.count_op_calls() as calls:
        q_in, k_in = q.clone(), k.clone()  # inference tensors of the same layout, as the projections would be
        assert card.apply_rotary_pos_emb_unavailable_reason(q_in, k_in, cos, sin, in_place=True) is None
        fused = card.apply_rotary_pos_emb(q_in, k_in, cos, sin)
    assert dict(calls) == {"npu_apply_rotary_pos_emb": 1}
    assert fused[0] is q_in and fused[1] is k_in  # rotated in place
    for got, want in zip(fused, expected, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
        else:  # the op computes in float32 and rounds once; eager rounds after each step
            torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2e-2, atol=2e-2)


def _in_place_case(case):
    q, k, cos, sin = projected_qk()
    if case == "head dim 80":
        q, k, cos, sin = projected_qk(head_dim=80)
    elif case == "cos shared by the batch":
        q, k, cos, sin = projected_qk(cos_batch=1)
    elif case == "q/k contiguous BNSD":
        q, k = q.contiguous(), k.contiguous()
    elif case == "float32 cos with bf16 q/k":
        q, k = q.bfloat16(), k.bfloat16()
    return (q, k, cos, sin), {
        "head dim 80": "head dim 80",
        "cos shared by the batch": "no broadcast over the batch",
        "q/k contiguous BNSD": "not BSND in memory",
        "float32 cos with bf16 q/k": "must share one of",
    }[case]


@pytest.mark.parametrize(
    "case", ["head dim 80", "cos shared by the batch", "q/k contiguous BNSD", "float32 cos with bf16 q/k"]
)
def test_outside_its_limits_the_one_call_op_is_not_used_and_the_reason_is_given(card, case):
    (q, k, cos, sin), reason = _in_place_case(case)
    with torch.inference_mode():
        assert reason in card.apply_rotary_pos_emb_unavailable_reason(q, k, cos, sin, in_place=True)
        with emulation.count_op_calls() as calls:
            fused = card.apply_rotary_pos_emb(q, k, cos, sin)
    assert calls["npu_apply_rotary_pos_emb"] == 0
    assert calls["npu_rotary_mul"] == 2  # float32 cos with bf16 q/k: q/k rotated cast to float32, as eager promotes
    for got, want in zip(fused, card.apply_rotary_pos_emb_eager(q, k, cos, sin), strict=True):
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("head_dim", "cann", "in_place"), [(64, "9.1.0", True), (64, "8.5.0", False), (128, "8.5.0", True)]
)
def test_the_one_call_op_takes_head_dim_64_from_cann_9_1(card, cann_version, head_dim, cann, in_place):
    """npu_apply_rotary_pos_emb's head dim 64 is documented from op-plugin 26.1.0 (CANN 9.1); the CANN kernel docs
    before it take 128 only: on older CANN a head dim of 64 takes the two-call path."""
    cann_version(cann)
    q, k, cos, sin = projected_qk(head_dim=head_dim)
    with torch.inference_mode():
        q, k = q.clone(), k.clone()
        expected = card.apply_rotary_pos_emb_eager(q.clone(), k.clone(), cos, sin)
        reason = card.apply_rotary_pos_emb_unavailable_reason(q, k, cos, sin, in_place=True)
        with emulation.count_op_calls() as calls:
            fused = card.apply_rotary_pos_emb(q, k, cos, sin)
    assert (reason is None) == in_place and (in_place or "CANN 9.1" in reason)
    assert dict(calls) == ({"npu_apply_rotary_pos_emb": 1} if in_place else {"npu_rotary_mul": 2})
    for got, want in zip(fused, expected, strict=True):
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("dtype", "kv_heads", "fits"),
    [(torch.float32, 12, True), (torch.float32, 13, False), (torch.bfloat16, 13, False), (torch.float16, 88, True),
     (torch.float16, 89, False)],
)  # fmt: skip
def test_the_one_call_op_takes_the_heads_its_on_chip_memory_holds(card, dtype, kv_heads, fits):
    """aclnnApplyRotaryPosEmb's UB formula on A2/A3's 192 KiB: 76 q and k heads in all in float32 and bfloat16, 152
    in float16. More take the two-call path."""
    q, k, cos, sin = projected_qk(batch=1, q_heads=64, kv_heads=kv_heads, seq=2, head_dim=128, dtype=dtype)
    with torch.inference_mode():
        q, k = q.clone(), k.clone()
        reason = card.apply_rotary_pos_emb_unavailable_reason(q, k, cos, sin, in_place=True)
        with emulation.count_op_calls() as calls:
            card.apply_rotary_pos_emb(q, k, cos, sin)
    assert (reason is None) == fits and (fits or "on-chip memory" in reason)
    assert dict(calls) == ({"npu_apply_rotary_pos_emb": 1} if fits else {"npu_rotary_mul": 2})


def test_cos_and_sin_need_one_shape_and_either_needing_gradients_holds_the_backward_limit(card):
    """npu_rotary_mul takes r1 and r2 of one shape; its backward computes dcos/dsin when either requires grad, with
    batch x heads at most 1024. The card runs eager otherwise."""
    q, k, cos, sin = rotary_inputs(2, 4, 2, 5, 64, torch.float32, cos_batch=1)
    wide_sin = sin.expand(2, 5, 64).contiguous()
    assert "differ in shape" in card.apply_rotary_pos_emb_unavailable_reason(*npu(q, k, cos, wide_sin))
    q, k, cos, sin = npu(*rotary_inputs(5, 205, 205, 1, 8, torch.float32, cos_batch=1))
    assert card.apply_rotary_pos_emb_unavailable_reason(q, k, cos, sin) is None
    sin.requires_grad_()
    assert "above 1024" in card.apply_rotary_pos_emb_unavailable_reason(q, k, cos, sin)
    with emulation.count_op_calls() as calls:
        sum(t.sum() for t in card.apply_rotary_pos_emb(q, k, cos, sin)).backward()
    assert calls["npu_rotary_mul"] == 0 and sin.grad is not None


def _views_of_one_buffer(k_offset: int):
    """q and k as transformers passes them ([B, H, S, D] transposes of BSND memory), k starting `k_offset`
    elements after q in one buffer; and the angles."""
    q, _, cos, sin = projected_qk()
    bsnd = q.transpose(1, 2).shape
    with torch.inference_mode():
        buffer = torch.randn(q.numel() + k_offset).to("npu")
        q_view, k_view = (buffer[start : start + q.numel()].view(bsnd).transpose(1, 2) for start in (0, k_offset))
    return q_view, k_view, cos, sin


@pytest.mark.parametrize("k_offset", [0, 64, 2 * 5 * 8 * 64])  # the same, overlapping, side by side
def test_in_place_op_is_not_used_when_q_and_k_share_memory(card, k_offset):
    """apply_rotary_pos_emb(x, x, ...) and overlapping q/k: the in-place op would rotate the shared elements twice;
    they take the out-of-place path and give eager's result. q and k side by side in one buffer (no overlap) still
    take the one-call op."""
    q, k, cos, sin = _views_of_one_buffer(k_offset)
    overlap = k_offset < q.numel()
    with torch.inference_mode():
        expected = card.apply_rotary_pos_emb_eager(q.clone(), k.clone(), cos, sin)
        reason = card.apply_rotary_pos_emb_unavailable_reason(q, k, cos, sin, in_place=True)
        with emulation.count_op_calls() as calls:
            fused = card.apply_rotary_pos_emb(q, k, cos, sin)
    if overlap:
        assert "share memory" in reason
        assert dict(calls) == {"npu_rotary_mul": 2}
    else:
        assert reason is None and dict(calls) == {"npu_apply_rotary_pos_emb": 1}
    for got, want in zip(fused, expected, strict=True):
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-6, atol=1e-6)


def test_the_one_call_op_is_never_used_with_grad_or_for_other_styles(card):
    q, k, cos, sin = projected_qk()
    reason = card.apply_rotary_pos_emb_unavailable_reason
    assert "not in inference mode" in reason(q, k, cos, sin, in_place=True)
    assert reason(q, k, cos, sin) is None  # the two-call path runs
    with torch.no_grad():  # no_grad is not inference mode: q/k may be needed elsewhere
        assert "not in inference mode" in reason(q, k, cos, sin, in_place=True)
    with torch.inference_mode():
        assert "style 'cast_back'" in reason(q, k, cos, sin, style="cast_back", in_place=True)


@pytest.mark.parametrize("style", sorted(set(STYLES) - PARTIAL))
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 32), (16, 14)])
def test_strict_styles_fail_on_narrower_cos_as_their_transformers_function_fails(card, style, head_dim, rotary_dim):
    """Llama's function (and every other strict one) raises when cos/sin are narrower than q/k; the card's layer
    for it must not rotate the leading dims instead (that would hide a caller's bug)."""
    q, k, cos, sin = rotary_inputs(1, 2, 2, 3, head_dim, torch.float32, style=style)
    narrow = (t[..., : rotary_dim // (2 if style in ("half_angles", "pairs_half_angles") else 1)] for t in (cos, sin))
    cos, sin = narrow
    with pytest.raises(RuntimeError):
        transformers_eager(q, k, cos, sin, 1, style)
    with pytest.raises(RuntimeError), emulation.count_op_calls() as calls:
        card.apply_rotary_pos_emb(*npu(q, k, cos, sin), 1, style)
    assert calls["npu_rotary_mul"] == 0


def test_a_rotary_call_that_raises_leaves_its_own_reason_not_the_previous_calls(card):
    """A call whose math raises (interleaved pairs of an odd head dim, as transformers' own raises) records why it did
    not fuse; the module's last reason is never the previous call's (issue 39)."""
    fallbacks = importlib.import_module(f"{card.__name__}._fallbacks")
    module = torch.nn.Module()
    q, cos = torch.randn(1, 2, 3, 8), torch.randn(1, 3, 8)
    card.apply_rotary_pos_emb(q, q, cos, cos, 1, "pairs", module=module)  # host tensors: eager, with that reason
    before = fallbacks.eager_record(module).last
    assert "not on an npu device" in before
    q_odd, cos_odd = npu(torch.randn(1, 2, 3, 7), torch.randn(1, 3, 7))
    with pytest.raises(RuntimeError):
        card.apply_rotary_pos_emb(q_odd, q_odd, cos_odd, cos_odd, 1, "pairs", module=module)
    with pytest.raises(RuntimeError):  # what transformers' own interleaved rotation raises there
        transformers_eager(*(t.cpu() for t in (q_odd, q_odd, cos_odd, cos_odd)), 1, "pairs")
    assert fallbacks.eager_record(module).last not in (None, before)


@pytest.mark.parametrize("style", ["llama", "llama_partial", "pairs"])
def test_bfloat16_q_k_with_float32_angles_fuse_as_eager_promotes_them(card, style):
    """Under autocast q/k come out of bfloat16 linears while cos/sin stay float32: eager's products promote to
    float32; the card rotates q/k cast to float32 (exact) with npu_rotary_mul, in eager's output dtype (issue 39)."""
    head_dim = 16
    rotary_dim = head_dim // 2 if style.endswith("partial") else head_dim
    q = torch.randn(2, 4, 5, head_dim).to(torch.bfloat16).to("npu").requires_grad_()
    k = torch.randn(2, 2, 5, head_dim).to(torch.bfloat16).to("npu").requires_grad_()
    cos, sin = (torch.randn(1 if style == "pairs" else 2, 5, rotary_dim).to("npu") for _ in range(2))
    assert card.apply_rotary_pos_emb_unavailable_reason(q, k, cos, sin, 1, style) is None
    results = []
    for run in ("fused", "eager", "float64"):
        inputs = (
            (q, k, cos, sin) if run != "float64" else [t.detach().double().requires_grad_() for t in (q, k, cos, sin)]
        )
        with emulation.count_op_calls() as calls:
            if run == "fused":
                out = card.apply_rotary_pos_emb(*inputs, 1, style)
            else:
                out = transformers_eager(*inputs, 1, style)
        assert calls["npu_rotary_mul"] == (2 if run == "fused" else 0)
        grads = torch.autograd.grad(sum((o.float() ** 2).sum() for o in out), inputs[:2])
        results.append((*out, *grads))
    (*fused_out, fused_dq, fused_dk), (*eager_out, eager_dq, eager_dk), (*_, ref_dq, ref_dk) = results
    for got, want in zip(fused_out, eager_out, strict=True):  # the forward: eager's float32 products, exactly
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # dq, dk in bfloat16: eager rounds each of the two products' gradients, the cast rounds their float32 sum once
    for got, want, ref in ((fused_dq, eager_dq, ref_dq), (fused_dk, eager_dk, ref_dk)):
        assert got.dtype == want.dtype == torch.bfloat16
        assert relative_error(got, ref) <= 2 * relative_error(want, ref)
