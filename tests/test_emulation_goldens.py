"""The emulated torch_npu ops against Huawei's own test cases and CPU goldens.

Restated from Ascend/op-plugin `test/test_custom_ops/` at commit 517f2e7d0f202f38b76310706cb977ca2388ad21
(test_npu_rotary_mul.py, test_npu_rotary_mul_backward.py, test_npu_rms_norm.py, test_npu_rms_norm_backward.py,
test_npu_add_rms_norm.py (at 529b54cd45b49a56136351b717c6619bb14f33fc),
test_npu_swi_glu.py, test_npu_swi_glu_backward.py, test_npu_apply_rotary_pos_emb.py,
test_npu_moe_token_permute_and_unpermute.py, test_npu_moe_token_permute_and_unpermute_backward.py,
test_npu_grouped_matmul.py, test_npu_moe_gating_topk.py, test_npu_moe_gating_top_k_softmax_v2.py,
test_npu_moe_gating_top_k_backward.py, test_npu_flash_attention.py (with the example test of torch_npu's
npu_fusion_attention docstring; the cases of an external dropout_mask are forms the emulation refuses),
test_npu_cross_entropy_loss.py and test_npu_gemma_rms_norm.py, whose value cases op-plugin skips "now" on every device:
restated anyway, as the ops' only goldens; and for npu_geglu, which op-plugin tests only in
test/core_tests/test_fake_tensor.py (shapes), that case and its docstring's example, against the goldens of
hicann/ops-nn @ e5c3fa932 (activation/ge_glu_v2/tests/assets/golden.py,
activation/ge_glu_grad_v2/tests/assets/golden.py)): the layouts,
dtypes, limits and what each golden computes, written here from the op semantics. Only the cases op-plugin's CI runs
on Atlas A2 (Ascend910B): the ones it skips there ("not supported by the CI version": 3-D rotary_mul, the `rotate`
matrix, TND npu_apply_rotary_pos_emb; Ascend 950 only) are left out as it leaves them out. Tolerances: op-plugin's
assertRtolEqual (1e-3 for float16, 1e-4 for float32, bfloat16 compared as float32) unless a test names its own.

Shapes: where op-plugin's tensors are large only to be large, the rows are fewer here (each case keeps its
layout, dtype, last dim and the sizes its limits are about, e.g. an S or B of at least 1000); the original shape
is in a comment next to each. The grouped-matmul cases keep op-plugin's shapes.

npu_grouped_matmul forms the emulation refuses by design, because no card calls them (it raises
NotImplementedError naming the form, never computes something else): several x or several weights (group_type
-1, and op-plugin's "multi-multi" cases, x of more than 2 dims included), bias, act_type, every quantised form
(scale, offset, antiquant_scale/offset, per_token_scale, int8/float8/float4 x or weight, the A16W4 and A8W4
cases, the NZ weight format), group_list_type 2. test_npu_grouped_matmul_0_empty_x_w is such a multi-tensor case.
"""

from __future__ import annotations

import numpy
import pytest
import torch
import torch.nn.functional as F
import torch_npu
from numerics import gelu_tanh_golden, rotary_golden

RTOL = {torch.float32: 1e-4, torch.float16: 1e-3}


def close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    """op-plugin's assertRtolEqual rule: an element passes when |got - want| <= rtol, or that difference over
    max(|got|, |want|) is; the comparison fails when more than rtol of the elements miss each test."""
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert got.shape == want.shape
    diff = (got - want).abs()
    misses_absolute = (diff > rtol).sum().item()
    misses_relative = (diff / (torch.maximum(got.abs(), want.abs()) + 1e-9) > rtol).sum().item()
    allowed = got.numel() * rtol
    assert misses_absolute <= allowed or misses_relative <= allowed, (misses_absolute, misses_relative, allowed)


HALF_SHAPES = [  # x, r1 (= r2): BSND 1S1D, SBND S11D with S >= 1000 (an S the B limit would refuse), and a shape
    # that is BSND with B >= 1000 (refused) and SBND with B=4 (taken)
    ((2, 1024, 5, 128), (1, 1024, 1, 128)),  # op-plugin: (2, 8192, 5, 128)
    ((1024, 2, 5, 128), (1024, 1, 1, 128)),  # op-plugin: (8192, 2, 5, 128)
    ((1024, 4, 8, 64), (1024, 4, 1, 64)),  # op-plugin: (2048, 4, 32, 64)
]
INTERLEAVE_SHAPES = [
    ((2, 2, 5, 128), (1, 2, 1, 128)),
    ((2, 24, 5, 128), (1, 1, 5, 128)),
    ((128, 4, 4, 256), (1, 1, 4, 256)),
    ((64, 8, 8, 512), (1, 1, 8, 512)),
]


def _rand(shape, dtype, seed):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _randn(shape, dtype, seed, std=1.0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("mode", "shapes"), [("half", HALF_SHAPES), ("interleave", INTERLEAVE_SHAPES)])
def test_rotary_mul_forward(mode, shapes, dtype):
    for seed, (x_shape, r_shape) in enumerate(shapes):
        x, r1, r2 = (_rand(shape, dtype, seed * 3 + i) for i, shape in enumerate((x_shape, r_shape, r_shape)))
        out = torch_npu.npu_rotary_mul(x.to("npu"), r1.to("npu"), r2.to("npu"), rotary_mode=mode)
        close(out, rotary_golden(x, r1, r2, mode), RTOL[dtype])


@pytest.mark.parametrize(
    ("mode", "shapes", "dtypes"),
    [("half", HALF_SHAPES, [torch.float32]), ("interleave", INTERLEAVE_SHAPES, [torch.float16, torch.float32])],
)
def test_rotary_mul_backward(mode, shapes, dtypes):
    """Gradients of x, r1 and r2 for a gradient of ones, against autograd through the golden."""
    for dtype in dtypes:
        for seed, (x_shape, r_shape) in enumerate(shapes):
            leaves = [_rand(shape, dtype, seed * 3 + i) for i, shape in enumerate((x_shape, r_shape, r_shape))]
            cpu = [t.clone().requires_grad_() for t in leaves]
            npu = [t.to("npu").requires_grad_() for t in leaves]
            golden = rotary_golden(*cpu, mode)
            golden.backward(torch.ones_like(golden))
            out = torch_npu.npu_rotary_mul(*npu, rotary_mode=mode)
            out.backward(torch.ones_like(out))
            for got, want in zip(npu, cpu, strict=True):  # r1/r2 sum over the broadcast axes: float32 tolerance
                close(got.grad, want.grad, 1e-3 if dtype == torch.float16 else 1e-4)


def rms_norm_golden(x: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """test_npu_rms_norm's golden: float32 x * rsqrt(mean(x^2) + eps) * gamma, cast to x's dtype; and rstd."""
    x32 = x.float()
    rstd = 1 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * rstd * gamma.float()).to(x.dtype), rstd


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16])  # test_rms_norm, test_rms_norm_mix_dtype
def test_rms_norm_forward(x_dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(64, 12288, generator=g) * 100).to(x_dtype)  # op-plugin: 1024 rows
    gamma = torch.rand(12288, generator=g) * 100  # float32 in both cases
    y, rstd = torch_npu.npu_rms_norm(x.to("npu"), gamma.to("npu"))
    want_y, want_rstd = rms_norm_golden(x, gamma)
    close(y, want_y, RTOL[x_dtype])
    close(rstd, want_rstd, 1e-4)


def _rms_norm_backward_case():
    """test_npu_rms_norm_backward's inputs ([10, 128] float32 with values up to 100) and golden dx, dgamma."""
    g = torch.Generator().manual_seed(1)
    x, gamma, grad_y = (torch.rand(shape, generator=g) * 100 for shape in ((10, 128), (128,), (10, 128)))
    rstd = 1 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    dgamma = (grad_y * x * rstd).sum(0)
    dx = grad_y * gamma * rstd - x * (rstd**3 * grad_y * gamma * x).sum(1, keepdim=True) / 128
    return x, gamma, grad_y, dx, dgamma


def test_rms_norm_backward():
    x, gamma, grad_y, dx, dgamma = _rms_norm_backward_case()
    x_npu, gamma_npu = x.to("npu").requires_grad_(), gamma.to("npu").requires_grad_()
    torch_npu.npu_rms_norm(x_npu, gamma_npu)[0].backward(grad_y.to("npu"))
    close(x_npu.grad, dx, 1e-4)
    close(gamma_npu.grad, dgamma, 1e-4)


def test_rms_norm_backward_as_an_op_of_its_own():
    """Through torch_npu.npu_rms_norm_backward(dy, x, gamma, rstd) called directly with the forward's rstd: dx in
    x's dtype, dgamma in float32."""
    x, gamma, grad_y, dx, dgamma = _rms_norm_backward_case()
    x_npu, gamma_npu = x.to("npu"), gamma.to("npu")
    _, rstd_npu = torch_npu.npu_rms_norm(x_npu, gamma_npu)
    got_dx, got_dgamma = torch_npu.npu_rms_norm_backward(grad_y.to("npu"), x_npu, gamma_npu, rstd_npu)
    assert got_dgamma.dtype == torch.float32
    close(got_dx, dx, 1e-4)
    close(got_dgamma, dgamma, 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # test_add_rms_norm_fp32, test_add_rms_norm_fp16
def test_add_rms_norm_forward(dtype):
    """test_npu_add_rms_norm's golden: x = x1 + x2 in the inputs' dtype, its RMSNorm in float32 (float16 cast up
    first), y and x cast back; uniform(0, 100) inputs and gamma of x1's dtype."""
    g = torch.Generator().manual_seed(4)
    x1, x2 = ((torch.rand(64, 12288, generator=g) * 100).to(dtype) for _ in range(2))  # op-plugin: 1024 rows
    gamma = (torch.rand(12288, generator=g) * 100).to(dtype)
    x = x1 + x2
    want_y, rstd = rms_norm_golden(x, gamma)
    y, got_rstd, got_x = torch_npu.npu_add_rms_norm(x1.to("npu"), x2.to("npu"), gamma.to("npu"), 1e-6)
    close(y, want_y, RTOL[dtype])
    close(got_rstd, rstd, RTOL[dtype])
    close(got_x, x, RTOL[dtype])
    assert got_x.dtype == dtype and got_rstd.dtype == torch.float32 and tuple(got_rstd.shape) == (64, 1)


def test_add_rms_norm_has_no_backward():
    """op-plugin's autograd error fallback test: the op's backward raises "not implemented"."""
    x1, x2 = (torch.randn(4, 16, dtype=torch.float16).to("npu").requires_grad_() for _ in range(2))
    gamma = torch.randn(16, dtype=torch.float16).to("npu").requires_grad_()
    out = torch_npu.npu_add_rms_norm(x1, x2, gamma, 1e-6)[0]
    with pytest.raises(RuntimeError, match="not implemented"):
        out.float().sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # test_gemma_rms_norm, test_gemma_rms_norm_fp16
def test_gemma_rms_norm_forward(dtype):
    """test_npu_gemma_rms_norm's golden: float32 x * rstd * (gamma + 1), gamma cast to float32 before the 1 is added,
    cast once to x's dtype; rstd float32, [rows, 1] (the meta tests: y has x's dtype). uniform(0, 100), [256, 512]."""
    g = torch.Generator().manual_seed(5)
    x, gamma = ((torch.rand(shape, generator=g) * 100).to(dtype) for shape in ((256, 512), (512,)))
    want_y, rstd = rms_norm_golden(x, gamma.float() + 1)
    y, got_rstd = torch_npu.npu_gemma_rms_norm(x.to("npu"), gamma.to("npu"))
    assert y.dtype == dtype and got_rstd.dtype == torch.float32 and tuple(got_rstd.shape) == (256, 1)
    close(y, want_y, RTOL[dtype])
    close(got_rstd, rstd, 1e-4)


def test_gemma_rms_norm_has_no_derivative():
    """No derivatives.yaml entry, not on the autograd error fallback: torch_npu's generic fallback warns in backward
    and gives the inputs no gradient."""
    x = torch.randn(4, 16).to("npu").requires_grad_()
    gamma = torch.randn(16).to("npu").requires_grad_()
    y = torch_npu.npu_gemma_rms_norm(x, gamma)[0]
    with pytest.warns(UserWarning, match="npu_gemma_rms_norm: an autograd kernel was not registered"):
        y.sum().backward()
    assert x.grad is None and gamma.grad is None


def test_add_rms_norm_refuses_a_gamma_of_another_dtype():
    """The API doc: in single-op mode x2 and gamma take x1's dtype."""
    x = torch.randn(4, 16, dtype=torch.bfloat16).to("npu")
    with pytest.raises(RuntimeError, match="npu_add_rms_norm/gamma-dtype"):
        torch_npu.npu_add_rms_norm(x, x, torch.ones(16).to("npu"), 1e-6)


SWIGLU_SHAPE = (512, 1, 3904 * 2)  # op-plugin: (8192, 1, 7808)


def test_swiglu_forward_and_backward():
    """test_npu_swi_glu(_backward): bf16 [8192, 1, 7808] on the last dim; goldens in float32, cast to bf16."""
    g = torch.Generator().manual_seed(2)
    x = torch.rand(SWIGLU_SHAPE, generator=g).bfloat16()
    grad = torch.rand(*SWIGLU_SHAPE[:-1], SWIGLU_SHAPE[-1] // 2, generator=g).bfloat16()
    a, b = (half.float() for half in torch.chunk(x, 2, dim=-1))
    close(torch_npu.npu_swiglu(x.to("npu"), -1), (F.silu(a) * b).bfloat16(), 1e-4)
    sigmoid = torch.sigmoid(a)
    da = b * (sigmoid + a * (1 - sigmoid) * sigmoid) * grad.float()
    db = grad.float() * a * sigmoid
    x_npu = x.to("npu").requires_grad_()
    torch_npu.npu_swiglu(x_npu, -1).backward(grad.to("npu"))
    close(x_npu.grad, torch.cat((da, db), dim=-1).bfloat16(), 1e-4)


def test_geglu_fake_tensor_case():
    """test_fake_tensor's npu_geglu case: float32 [2, 10, 64], dim=-1, approximate=1, activate_left=False; both
    outputs [2, 10, 32]. Values: ops-nn's golden (the SECOND half activated), float32."""
    x = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(3))
    y, gelu = torch_npu.npu_geglu(x.to("npu"), -1, 1, False)
    assert y.shape == gelu.shape == (2, 10, 32)
    first, second = x.chunk(2, dim=-1)
    want_gelu, _ = gelu_tanh_golden(second)
    close(gelu, want_gelu, RTOL[torch.float32])
    close(y, first * want_gelu, RTOL[torch.float32])


GEGLU_SHAPE = (24, 16, 2560)  # the docstring's example: [24, 9216, 2560]


def test_geglu_docstring_example_forward_and_backward():
    """The docstring's example: float16 uniform(-2, 2), dim=-1, approximate=1; golden in float32, cast to float16.
    Backward as ops-nn's GeGluGradV2 golden from the kept gelu, with activate_left=True as the card calls it."""
    g = torch.Generator().manual_seed(4)
    x = (torch.rand(GEGLU_SHAPE, generator=g) * 4 - 2).half()
    first, second = (half.float() for half in x.chunk(2, dim=-1))
    want_gelu, _ = gelu_tanh_golden(second)
    y, gelu = torch_npu.npu_geglu(x.to("npu"), dim=-1, approximate=1)
    close(gelu, want_gelu.half(), RTOL[torch.float16])
    close(y, (first * want_gelu).half(), RTOL[torch.float16])
    grad = (torch.rand(*GEGLU_SHAPE[:-1], GEGLU_SHAPE[-1] // 2, generator=g) * 2 - 1).half()
    x_npu = x.to("npu").requires_grad_()
    out, kept = torch_npu.npu_geglu(x_npu, dim=-1, approximate=1, activate_left=True)
    out.backward(grad.to("npu"))
    _, slope = gelu_tanh_golden(first)
    want = torch.cat((grad.float() * second * slope, grad.float() * kept.cpu().float()), dim=-1)
    close(x_npu.grad, want.half(), RTOL[torch.float16])


def test_apply_rotary_pos_emb_bsnd():
    """test_npu_apply_rotary_pos_emb: float16 BSND q/k [4, S, 16, 128], cos/sin [4, S, 1, 128], 'half', in place;
    op-plugin's tolerance 0.001. S is 1024 there."""
    q, k, cos, sin = (
        _rand(shape, torch.float16, seed)
        for seed, shape in enumerate([(4, 128, 16, 128), (4, 128, 16, 128), (4, 128, 1, 128), (4, 128, 1, 128)])
    )
    q_npu, k_npu = q.to("npu"), k.to("npu")
    with torch.inference_mode():
        out = torch_npu.npu_apply_rotary_pos_emb(q_npu, k_npu, cos.to("npu"), sin.to("npu"), "BSND", "half")
    assert out[0] is q_npu and out[1] is k_npu
    for got, x in zip(out, (q, k), strict=True):
        close(got, rotary_golden(x, cos, sin, "half"), 1e-3)


def _expert_ids(tokens: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    return torch.randint(0, experts, (tokens, top_k), generator=torch.Generator().manual_seed(seed))


def permute_golden(tokens: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The goldens' `permute`: rows in stable expert order, and that order (the op returns its inverse)."""
    order = torch.argsort(indices.view(-1), stable=True)
    return tokens.index_select(0, order // indices.shape[1]), order


def unpermute_golden(permuted: torch.Tensor, order: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """The goldens' `unpermute`, in the tokens' dtype: rows copied back to token order, weighted, summed over K."""
    top_k = probs.shape[1] if probs is not None else 1
    rows = torch.zeros_like(permuted).index_copy(0, order, permuted).reshape(-1, top_k, permuted.shape[-1])
    return (rows * probs.unsqueeze(-1) if probs is not None else rows).sum(dim=1)


BF16_TOLERANCE = {"rtol": 2e-2, "atol": 1e-5}
"""dtype_tols(bfloat16) of the backward test file; the forward file's TOL_MAPPING (5e-3) is within it."""
MOE_CASES = [  # (tokens, hidden, top_k, experts): op-plugin's are tokens 1024/2048/8192, hidden 6144/8192/12288
    pytest.param(64, 96, top_k, experts, id=f"top{top_k}-{experts}experts") for top_k in (1, 4) for experts in (4, 128)
]


@pytest.mark.parametrize(("tokens", "hidden", "top_k", "experts"), MOE_CASES)
def test_moe_token_permute_forward_and_backward(tokens, hidden, top_k, experts):
    """test_permute: bf16 tokens, int64 expert ids; sorted_indices is the argsort of the golden's order (int32);
    the tokens' gradient for a gradient of ones (each token receives its K copies)."""
    x = _randn((tokens, hidden), torch.bfloat16, 0)
    indices = _expert_ids(tokens, top_k, experts, 1)
    golden_x = x.clone().requires_grad_()
    want_permuted, order = permute_golden(golden_x, indices)
    x_npu = x.to("npu").requires_grad_()
    permuted, sorted_indices = torch_npu.npu_moe_token_permute(x_npu, indices.to("npu"))
    assert torch.allclose(permuted.cpu(), want_permuted, **BF16_TOLERANCE)
    assert torch.equal(sorted_indices.cpu(), torch.argsort(order, stable=True).to(torch.int32))
    want_permuted.backward(torch.ones_like(want_permuted))
    permuted.backward(torch.ones_like(permuted))
    assert torch.allclose(x_npu.grad.cpu(), golden_x.grad, **BF16_TOLERANCE)


@pytest.mark.parametrize(("tokens", "hidden", "top_k", "experts"), MOE_CASES)
def test_moe_token_unpermute_forward_and_backward(tokens, hidden, top_k, experts):
    """test_unpermute: bf16 permuted rows, sorted_indices the int32 stable argsort of random expert ids (the golden
    uses its argsort), probs 1/K in bf16 when K > 1; gradients of permuted rows and probs for a gradient of ones."""
    permuted = _randn((tokens * top_k, hidden), torch.bfloat16, 2)
    sorted_indices = torch.argsort(_expert_ids(tokens, top_k, experts, 3).view(-1), stable=True).to(torch.int32)
    probs = (torch.ones(tokens, top_k) / top_k).bfloat16() if top_k > 1 else None
    golden_permuted, npu_permuted = permuted.clone().requires_grad_(), permuted.to("npu").requires_grad_()
    golden_probs, npu_probs = (None, None) if probs is None else (probs.clone(), probs.to("npu"))
    golden_leaves = [t.requires_grad_() for t in (golden_permuted, golden_probs) if t is not None]
    npu_leaves = [t.requires_grad_() for t in (npu_permuted, npu_probs) if t is not None]
    want = unpermute_golden(golden_permuted, torch.argsort(sorted_indices, stable=True), golden_probs)
    got = torch_npu.npu_moe_token_unpermute(npu_permuted, sorted_indices.to("npu"), probs=npu_probs)
    assert torch.allclose(got.cpu(), want, **BF16_TOLERANCE)
    want.backward(torch.ones_like(want))
    got.backward(torch.ones_like(got))
    for npu_leaf, golden_leaf in zip(npu_leaves, golden_leaves, strict=True):
        assert torch.allclose(npu_leaf.grad.cpu(), golden_leaf.grad, **BF16_TOLERANCE)


@pytest.mark.parametrize("top_k", [1, 4])
def test_moe_token_permute_then_unpermute_gives_the_tokens_back(top_k):
    """test_npu_npu_moe_token_permute_unpermute: the op pair with probs 1/K restores the tokens (exactly for K=1)."""
    x = _randn((64, 96), torch.bfloat16, 4)
    permuted, sorted_indices = torch_npu.npu_moe_token_permute(x.to("npu"), _expert_ids(64, top_k, 4, 5).to("npu"))
    probs = (torch.ones(64, top_k) / top_k).bfloat16().to("npu") if top_k > 1 else None
    restored = torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, probs=probs).cpu()
    assert torch.equal(restored, x) if top_k == 1 else torch.allclose(restored, x, **BF16_TOLERANCE)


@pytest.mark.parametrize("probs_dtype", [torch.float32, None])
def test_moe_token_unpermute_gradient_dtypes(probs_dtype):
    """test_unpermute_grad_mixed_dtype (bf16 rows, float32 probs: each gradient in its input's dtype) and
    test_unpermute_grad_probs_none (no probs: the rows' gradient in bf16). op-plugin: 1024 tokens, hidden 6144."""
    tokens, top_k = 64, 4 if probs_dtype else 1
    permuted = _randn((tokens * top_k, 96), torch.bfloat16, 6).to("npu").requires_grad_()
    sorted_indices = torch.argsort(_expert_ids(tokens, top_k, 8, 7).view(-1), stable=True).to(torch.int32).to("npu")
    probs = (torch.ones(tokens, top_k) / top_k).to(probs_dtype).to("npu").requires_grad_() if probs_dtype else None
    out = torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, probs=probs)
    out.backward(torch.ones_like(out))
    assert permuted.grad.dtype == torch.bfloat16
    assert probs is None or probs.grad.dtype == probs_dtype


def _grouped_matmul_golden(x: torch.Tensor, weights: list[torch.Tensor], bounds: list[int], group_type: int):
    """test_npu_grouped_matmul's supported_op_exec, split_item 3: x split at the cumsum bounds (rows, or columns
    for group_type 2), one matmul per group, concatenated (group_type 2: stacked) into one tensor; in float64."""
    x64 = x.double()
    if group_type == 2:
        return torch.stack([x64[:, a:b] @ w.double() for a, b, w in zip(bounds[:-1], bounds[1:], weights, strict=True)])
    return torch.cat([x64[a:b] @ w.double() for a, b, w in zip(bounds[:-1], bounds[1:], weights, strict=True)])


def _grouped_matmul(x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor, **options) -> list[torch.Tensor]:
    """npu_grouped_matmul of one x and one weight with split_item 3, the form the cards call."""
    return torch_npu.npu_grouped_matmul([x], [weight], group_list=group_list.to("npu"), split_item=3, **options)


@pytest.mark.parametrize("group_list_type", [0, 1])  # op-plugin: cumsum; the card passes counts
@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.float32], ids=["test_npu_grouped_matmul_1", "test_npu_grouped_matmul_9"]
)
def test_grouped_matmul_rows_split_one_3d_weight(dtype, group_list_type):
    """x [1792, 1024] split at rows 256 and 1792 over weight [2, 1024, 256]; split_item 3 gives one [1792, 256]."""
    x, weight = _randn((1792, 1024), dtype, 8, std=0.1), _randn((2, 1024, 256), dtype, 9, std=0.1)
    cumsum = torch.tensor([256, 1792])
    group_list = cumsum if group_list_type == 0 else torch.diff(cumsum, prepend=torch.zeros(1, dtype=torch.int64))
    (out,) = _grouped_matmul(x.to("npu"), weight.to("npu"), group_list, group_type=0, group_list_type=group_list_type)
    assert out.dtype == dtype
    close(out, _grouped_matmul_golden(x, list(weight), [0, 256, 1792], 0), RTOL[dtype])


@pytest.mark.parametrize("group_list_type", [0, 1])
def test_grouped_matmul_k_split(group_list_type):
    """test_npu_grouped_matmul_6: float16 x = x1.T (a transposed view of [1792, 1024]), weight [1792, 256], the
    1792 axis split 256/256/512/768; split_item 3 gives [4, 1024, 256]. The card's weight gradient is this form."""
    x1, weight = _randn((1792, 1024), torch.float16, 10, std=0.1), _randn((1792, 256), torch.float16, 11, std=0.1)
    sizes = torch.tensor([256, 256, 512, 768])
    group_list = sizes.cumsum(0) if group_list_type == 0 else sizes
    x = x1.to("npu").T
    (out,) = _grouped_matmul(x, weight.to("npu"), group_list, group_type=2, group_list_type=group_list_type)
    bounds = [0, *sizes.cumsum(0).tolist()]
    close(out, _grouped_matmul_golden(x1.T, list(weight.split(sizes.tolist())), bounds, 2), 1e-3)


@pytest.mark.parametrize(
    ("group_type", "message"),
    [
        (None, "npu_grouped_matmul/group-type-given"),
        (1, "npu_grouped_matmul/group-type"),
        (3, "npu_grouped_matmul/group-type"),
        (100, "npu_grouped_matmul/group-type"),
    ],
)
def test_grouped_matmul_refuses_a_missing_or_invalid_group_type(group_type, message):
    """test_npu_grouped_matmul_group_list_none and _invalid_group_type: the adapter's checks, as ledger rules."""
    x, weight = torch.randn(1792, 256).half().to("npu"), torch.randn(1792, 256).half().to("npu")
    with pytest.raises(RuntimeError, match=f"rule {message}:"):
        _grouped_matmul(x, weight, torch.tensor([256, 512, 1024, 1792]), group_type=group_type)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"x": 2}, "only one x and one weight"),
        ({"bias": True}, "no bias"),
        ({"scale": True}, "quantised forms"),
        ({"antiquant_scale": True}, "quantised forms"),
        ({"group_list_type": 2}, "group_list_type 2"),
        ({"group_type": -1}, "group_type -1"),
    ],
    ids=["two x", "bias", "scale", "antiquant", "group_list_type 2", "group_type -1"],
)
def test_grouped_matmul_refuses_the_forms_no_card_uses(change, message):
    """The forms listed in this module's docstring raise NotImplementedError naming what is not emulated."""
    x, weight = torch.randn(8, 16).half().to("npu"), torch.randn(2, 16, 4).half().to("npu")
    if "group_list_type" in change:  # documented for int8 x and weight only: with float16 the ledger refuses it
        x, weight = x.to(torch.int8), weight.to(torch.int8)
    kwargs = {"group_list": torch.tensor([3, 8]).to("npu"), "split_item": 3, "group_type": 0}
    kwargs.update({k: v for k, v in change.items() if k in ("group_list_type", "group_type")})
    kwargs.update({k: [torch.ones(4).half().to("npu")] for k in ("bias", "scale", "antiquant_scale") if k in change})
    with pytest.raises(NotImplementedError, match=message):
        torch_npu.npu_grouped_matmul([x] * change.get("x", 1), [weight] * change.get("x", 1), **kwargs)


def gating_top_k_golden(x, bias, k, k_group, group_count, group_select_mode, norm_type, scale, eps=1e-20):
    """The golden of test_npu_moe_gating_topk (numpy, float32): norm, choose on norm + bias within the k_group best
    groups (max or top-2 sum), stable descending order, gather, renormalise in sigmoid mode only, scale."""
    x, bias = x.float().numpy(), bias.float().numpy()
    softmax = numpy.exp(x - numpy.log(numpy.exp(x).sum(-1, keepdims=True)))
    norm = softmax if norm_type == 0 else 1 / (1 + numpy.exp(-x))
    grouped = (norm + bias).reshape(x.shape[0], group_count, -1)
    top_two_sum = numpy.sort(grouped, -1)[..., -2:].sum(-1)
    group_scores = grouped.max(-1) if group_select_mode == 0 else top_two_sum
    kept = numpy.argsort(-group_scores, -1, kind="stable")[:, :k_group]
    dropped = numpy.ones(group_scores.shape, dtype=bool)
    dropped[numpy.arange(x.shape[0])[:, None], kept] = False
    choice = numpy.where(dropped[..., None], -numpy.inf, grouped).reshape(x.shape[0], -1)
    idx = numpy.argsort(-choice, -1, kind="stable")[:, :k]
    y = numpy.take_along_axis(norm, idx, 1)
    if norm_type == 1:
        y = y / (y.sum(-1, keepdims=True) + eps)
    return torch.from_numpy(y * scale), torch.from_numpy(idx.astype(numpy.int32)), torch.from_numpy(norm)


def _gating_case(rows, dtype, k, norm_type=1, group_select_mode=1, scale=1.0, out_flag=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(rows, 256, generator=g) * 4 - 2).to(dtype)  # op-plugin: numpy.random.uniform(-2, 2, ...)
    bias = (torch.rand(256, generator=g) * 4 - 2).to(dtype)
    got = torch_npu.npu_moe_gating_top_k(
        x.to("npu"), k, bias=bias.to("npu"), k_group=4, group_count=8, group_select_mode=group_select_mode, renorm=0,
        norm_type=norm_type, out_flag=out_flag, routed_scaling_factor=scale, eps=1e-20,
    )  # fmt: skip
    want = gating_top_k_golden(x, bias, k, 4, 8, group_select_mode, norm_type, scale)
    return [t.cpu() for t in got], want


@pytest.mark.parametrize(
    ("rows", "dtype", "k", "scale"),
    [
        (8, torch.float32, 6, 1.0),  # test_npu_moe_gating_topk_1
        (1002, torch.float16, 1, 1.0),  # test_npu_moe_gating_topk_2
        (128, torch.bfloat16, 16, 1.0),  # test_npu_moe_gating_topk_3
        (128, torch.bfloat16, 16, 0.0),  # test_npu_moe_gating_topk_4: routed_scaling_factor 0
    ],
    ids=["fp32 k6", "fp16 k1", "bf16 k16", "bf16 scale 0"],
)
def test_moe_gating_top_k_sigmoid_group_cases(rows, dtype, k, scale):
    """op-plugin's four cases: sigmoid, bias, 8 groups of 32, 4 kept by their top-2 sum; y in x's dtype, int32 ids."""
    (y, idx, _), (want_y, want_idx, _) = _gating_case(rows, dtype, k, scale=scale)
    assert y.dtype == dtype and idx.dtype == torch.int32 and y.shape == idx.shape == (rows, k)
    assert torch.equal(idx, want_idx)
    close(y.float(), want_y.to(dtype).float(), RTOL.get(dtype, 1e-4))


def softmax_v2_golden(x, k, finished, renorm, output_softmax):
    """The golden of test_npu_moe_gating_top_k_softmax_v2 (numpy): renorm 0, the float32 softmax's top k; renorm 1,
    the float32 softmax of x's top k; stable descending order; finished rows get the id `experts`."""
    x = x.numpy()
    experts = x.shape[-1]
    softmax = numpy.exp(x.astype(numpy.float32) - x.max(-1, keepdims=True).astype(numpy.float32))
    softmax /= softmax.sum(-1, keepdims=True)
    if renorm == 1:
        idx = numpy.argsort(-x, -1, kind="stable")[:, :k]
        top = numpy.take_along_axis(x, idx, -1).astype(numpy.float32)
        y = numpy.exp(top - top.max(-1, keepdims=True))
        y = (y / y.sum(-1, keepdims=True)).astype(x.dtype)
    else:
        idx = numpy.argsort(-softmax, -1, kind="stable")[:, :k]
        y = numpy.take_along_axis(softmax, idx, -1).astype(x.dtype)
    idx = numpy.where(finished.numpy()[:, None], experts, idx).astype(numpy.int32)
    written = softmax if renorm == 0 and output_softmax else numpy.zeros((0,), numpy.float32)
    return torch.from_numpy(y), torch.from_numpy(idx), torch.from_numpy(written)


@pytest.mark.parametrize(
    ("rows", "k", "experts", "renorm", "output_softmax", "dtype"),
    [
        (10, 2, 200, 0, True, torch.float16),
        (10, 2, 200, 1, False, torch.float32),
        (43, 9, 1256, 1, True, torch.float16),  # op-plugin: 430 rows
        (43, 5, 1256, 0, False, torch.float32),  # op-plugin: 430 rows
        (52, 4, 5120, 1, True, torch.float32),  # op-plugin: 520 rows
    ],
    ids=["fp16 renorm0 softmax", "fp32 renorm1", "fp16 renorm1", "fp32 renorm0", "fp32 renorm1 5120"],
)
def test_moe_gating_top_k_softmax_v2_cases(rows, k, experts, renorm, output_softmax, dtype):
    """A sample of op-plugin's product (rows 10/430/520, k 2/4/5/9, experts 200/1256/5120, renorm 0/1, the softmax
    output asked or not, float16/float32), with its random finished rows: y, the int32 ids and the third output."""
    g = torch.Generator().manual_seed(rows + k)
    x = (torch.rand(rows, experts, generator=g) * 2 - 1).to(dtype)  # op-plugin: numpy.random.uniform(-1, 1, ...)
    finished = torch.rand(rows, generator=g) < 0.5  # op-plugin: uniform(-1, 1).astype(bool): nonzero is True
    got = torch_npu.npu_moe_gating_top_k_softmax_v2(
        x.to("npu"), k=k, finished=finished.to("npu"), renorm=renorm, output_softmax=output_softmax
    )
    (y, idx, written), (want_y, want_idx, want_written) = (
        [t.cpu() for t in got],
        softmax_v2_golden(x, k, finished, renorm, output_softmax),
    )
    assert y.dtype == dtype and idx.dtype == torch.int32 and y.shape == idx.shape == (rows, k)
    assert torch.equal(idx, want_idx)
    close(y.float(), want_y.float(), RTOL.get(dtype, 1e-4))
    assert written.dtype == torch.float32 and written.shape == want_written.shape
    close(written, want_written, 1e-4)


@pytest.mark.parametrize("group_select_mode", [0, 1])
def test_moe_gating_top_k_softmax_mode_never_renormalises(group_select_mode):
    """The API doc's golden with norm_type 0: the top-k softmax probabilities as they are, their sum below 1."""
    (y, idx, norm), (want_y, want_idx, want_norm) = _gating_case(16, torch.float32, 6, 0, group_select_mode, 1.0, True)
    assert torch.equal(idx, want_idx)
    close(y, want_y, 1e-4)
    close(norm, want_norm, 1e-4)
    assert (y.sum(-1) < 1).all()


def test_moe_gating_top_k_norm_out_is_written_only_with_out_flag():
    """norm_out: float32 [N, E] always allocated; the norm with out_flag, unwritten (NaN here) without."""
    (_, _, written), (_, _, want_norm) = _gating_case(8, torch.bfloat16, 6, out_flag=True)
    (_, _, unwritten), _ = _gating_case(8, torch.bfloat16, 6, out_flag=False)
    assert written.dtype == unwritten.dtype == torch.float32 and written.shape == (8, 256)
    close(written, want_norm, 1e-4)
    assert unwritten.isnan().all()


def _megatron_routing(logits, bias, k, scale):
    """The reference of test_npu_moe_gating_top_k_backward (sigmoid score function, expert bias, norm_topk_prob,
    scaling factor): choose on sigmoid + bias, weights sigmoid gathered, divided by sum + 1e-20, scaled."""
    scores = torch.sigmoid(logits)
    idx = torch.topk(scores + bias, k, dim=1).indices
    probs = scores.gather(1, idx)
    return probs / (probs.sum(-1, keepdim=True) + 1e-20) * scale, idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_moe_gating_top_k_backward_against_float64_autograd(dtype, scale):
    """test_npu_moe_gating_top_k_backward: dx of the op (through autograd, out_flag on, and the exposed backward op
    from x_norm) against float64 autograd through the reference routing. op-plugin: 2048 x 192, k 10, bf16."""
    g = torch.Generator().manual_seed(44)
    logits, bias = torch.randn(64, 192, generator=g), torch.randn(192, generator=g) * 0.1
    grad = torch.randn(64, 10, generator=g)
    logits, bias = logits.to(dtype), bias.to(dtype)  # the reference sees the rounded inputs the op sees
    ref = logits.double().requires_grad_()
    y_ref, idx = _megatron_routing(ref, bias.double(), 10, scale)
    y_ref.backward(grad.double())
    x = logits.to("npu").requires_grad_()
    y, expert_idx, _ = torch_npu.npu_moe_gating_top_k(
        x, 10, bias=bias.to("npu"), norm_type=1, out_flag=True, routed_scaling_factor=scale
    )
    y.backward(grad.to(dtype).to("npu"))
    exposed = torch_npu.npu_moe_gating_top_k_backward(
        torch.sigmoid(logits.float()).to("npu"), grad.to(dtype).to("npu"), idx.int().to("npu"), renorm=0, norm_type=1,
        routed_scaling_factor=scale, eps=1e-20,
    )  # fmt: skip
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert torch.equal(expert_idx.cpu().long(), idx)
    for got in (x.grad.cpu(), exposed.cpu()):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), ref.grad, rtol=tolerance, atol=tolerance)


def cross_entropy_golden(x, target, weight, ignore_index, label_smoothing, reduction):
    """The golden of test_npu_cross_entropy_loss: max-subtracted float32 log-softmax, the weighted NLL masked only
    for ignore_index >= 0, the smoothing term, the reduction; loss and log_prob in x's dtype."""
    classes = x.shape[1]
    weight = torch.ones(classes, device=x.device) if weight is None else weight
    x32 = x.float()
    shifted = x32 - x32.max(dim=1, keepdim=True).values
    log_prob = shifted - shifted.exp().sum(-1, keepdim=True).log()
    safe = target if ignore_index < 0 else torch.where(target == ignore_index, 0, target)
    weight_target = weight.gather(0, safe)
    kept = torch.ones_like(weight_target) if ignore_index < 0 else (target != ignore_index).float()
    loss = -log_prob.gather(1, safe.unsqueeze(1)).squeeze(1) * weight_target * kept
    smooth = -(log_prob * weight).sum(-1) * kept
    if reduction == "mean":
        denominator = (weight_target * kept).sum()
        out = (1 - label_smoothing) * loss.sum() / denominator + smooth.sum() / denominator * label_smoothing / classes
    elif reduction == "sum":
        out = (1 - label_smoothing) * loss.sum() + smooth.sum() * label_smoothing / classes
    else:
        out = (1 - label_smoothing) * loss + smooth * label_smoothing / classes
    return out.reshape(-1 if reduction == "none" else 1).to(x.dtype), log_prob.to(x.dtype)


CE_PRECISION = {torch.float32: 2**-10, torch.float16: 2**-7, torch.bfloat16: 2**-6}
"""op-plugin's tolerances for npu_cross_entropy_loss (its prec16 for bfloat16)."""


@pytest.mark.parametrize("classes", [8080, 8192])  # op-plugin: [4096, C]; 512 rows here
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_loss_forward(classes, dtype, reduction):
    x = _randn((512, classes), dtype, seed=classes).to("npu")
    target = torch.arange(512, device="npu")
    loss, log_prob, _, _ = torch_npu.npu_cross_entropy_loss(x, target, reduction=reduction)
    want_loss, want_log_prob = cross_entropy_golden(x, target, None, -100, 0.0, reduction)
    close(loss, want_loss, CE_PRECISION[dtype])
    close(log_prob, want_log_prob, CE_PRECISION[dtype])


@pytest.mark.parametrize("classes", [8080, 8192])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_loss_backward(classes, dtype, reduction):
    x = _randn((512, classes), dtype, seed=classes + 1).to("npu").requires_grad_()
    target = torch.arange(512, device="npu")
    torch_npu.npu_cross_entropy_loss(x, target, reduction=reduction)[0].sum().backward()
    golden = x.detach().clone().requires_grad_()
    cross_entropy_golden(golden, target, None, -100, 0.0, reduction)[0].sum().backward()
    close(x.grad, golden.grad, CE_PRECISION[dtype])


def test_cross_entropy_loss_ignores_only_a_non_negative_ignore_index_and_takes_weights_and_smoothing():
    """The golden's other arguments (its test passes the defaults): weight, ignore_index >= 0, label_smoothing."""
    x = _randn((64, 50), torch.float32, seed=3).to("npu")
    target = torch.randint(0, 50, (64,), generator=torch.Generator().manual_seed(4)).to("npu")
    target[::5] = 7
    weight = torch.rand(50, generator=torch.Generator().manual_seed(5)).to("npu") * 0.9 + 0.1
    for reduction in ("mean", "sum", "none"):
        got, _, _, _ = torch_npu.npu_cross_entropy_loss(x, target, weight, reduction, 7, 0.1)
        close(got, cross_entropy_golden(x, target, weight, 7, 0.1, reduction)[0], CE_PRECISION[torch.float32])
    with pytest.raises(RuntimeError, match="npu_cross_entropy_loss/target-range"):  # -100 ignores nothing: out of range
        torch_npu.npu_cross_entropy_loss(x, torch.where(target == 7, -100, target))


def test_cross_entropy_loss_refuses_what_the_op_refuses():
    x = _randn((8, 10), torch.float32, seed=6).to("npu")
    target = torch.zeros(8, dtype=torch.int64, device="npu")
    with pytest.raises(RuntimeError, match="npu_cross_entropy_loss/zloss"):
        torch_npu.npu_cross_entropy_loss(x, target, return_zloss=True)
    leaf = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="npu_cross_entropy_loss/grad-mean-defaults"):
        torch_npu.npu_cross_entropy_loss(leaf, target, ignore_index=3)
    with pytest.raises(RuntimeError, match="npu_cross_entropy_loss/grad-label-smoothing"):
        torch_npu.npu_cross_entropy_loss(leaf, target, reduction="sum", label_smoothing=0.1)
    with pytest.raises(RuntimeError, match="npu_cross_entropy_loss/input-rank"):
        torch_npu.npu_cross_entropy_loss(x[0], target[:1])


# npu_fusion_attention (test_npu_flash_attention.py, and the docstring's examples, _op_plugin_docs.py:1709-1890)


def attention_golden(q, k, v, scale, keep=None, keep_prob=1.0):
    """op-plugin's CPU golden of one [1 or B, N, Sq, D] batch in float32 (its `tforward`): scores scaled, softmax with
    its row max and row sum (kept as [.., Sq, 1]), kept probabilities scaled by 1/keep_prob, times v.
    Returns (out, probabilities, row max, row sum)."""
    scores = (q @ k.transpose(-1, -2)) * scale
    row_max = scores.amax(-1, keepdim=True)
    exp = torch.exp(scores - row_max)
    row_sum = exp.sum(-1, keepdim=True)
    probs = exp / row_sum
    dropped = probs if keep is None else probs * keep / keep_prob
    return dropped @ v, probs, row_max, row_sum


def attention_golden_grads(dy, q, k, v, probs, scale, keep=None, keep_prob=1.0):
    """op-plugin's CPU golden of the backward (its `tbackward`): dv from the kept probabilities, the softmax gradient
    `P * (dP - rowsum(dP * P))` scaled, then dq and dk. Returns (dq, dk, dv)."""
    grad_probs = dy @ v.transpose(-1, -2)
    if keep is not None:
        grad_probs = grad_probs * keep / keep_prob
    dropped = probs if keep is None else probs * keep / keep_prob
    grad_scores = probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True)) * scale
    return grad_scores @ k, grad_scores.transpose(-1, -2) @ q, dropped.transpose(-1, -2) @ dy


def _heads_repeated(kv, heads):
    """key or value [B, Nkv, S, D] as [B, heads, S, D]: query head h reads kv head h // (heads / Nkv) (the golden's
    broadcastKV_sigle)."""
    return kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _groups_summed(grad, kv_heads):
    """A [B, N, S, D] gradient summed over each group of N / kv_heads query heads (the golden's GQA sum)."""
    return grad.unflatten(1, (kv_heads, grad.shape[1] // kv_heads)).sum(2)


def test_fusion_attention_bsh():
    """test_npu_flash_attention: float16 BNSD [1, 32, 128, 128] as BSH, head_num 32, scale 0.08838; golden in
    float32."""
    q, k, v = (_rand((1, 32, 128, 128), torch.float16, seed) for seed in range(3))
    want = attention_golden(q.float(), k.float(), v.float(), 0.08838)[0].half()
    as_bsh = lambda t: t.transpose(1, 2).flatten(2).to("npu")  # noqa: E731
    out = torch_npu.npu_fusion_attention(as_bsh(q), as_bsh(k), as_bsh(v), 32, "BSH", scale=0.08838)
    close(out[0], want.transpose(1, 2).flatten(2), RTOL[torch.float16])
    assert tuple(out[1].shape) == tuple(out[2].shape) == (1, 32, 128, 8) and out[1].dtype == torch.float32
    assert out[3].numel() == 0 and out[4:] == (0, 0, 1 * 32 * 128 * 128)


@pytest.mark.parametrize("keep_prob", [1.0, 0.9])  # test_npu_flash_attention_tnd(_with_dropmask)
def test_fusion_attention_tnd(keep_prob):
    """TND float16, N1 8 over N2 2 (GQA), D 128, query lengths [1, 2, 3] against key lengths [3, 4, 5], scale
    1/sqrt(D), softmax_layout 'TND': out, softmax_max, softmax_sum ([T, N, 8]) and dq, dk, dv (dk and dv summed over
    each group) against the golden per batch. With dropout the golden takes the mask the op applied, read off the
    output of an identity value (its key length is D) in a first call, which a second call with the same seed and
    offset reproduces: so the grad regenerates the forward's mask."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 8, 2, 128
    uniform = lambda *shape: (2 * (torch.rand(shape, generator=g) - 0.5)).half()  # noqa: E731
    q, k, v, dy = uniform(6, heads, dim), uniform(12, kv_heads, dim), uniform(12, kv_heads, dim), uniform(6, heads, dim)
    q_ends, kv_ends = [1, 3, 6], [3, 7, 12]
    leaves = [t.to("npu").requires_grad_() for t in (q, k, v)]
    torch.manual_seed(7)
    out = torch_npu.npu_fusion_attention(
        *leaves, heads, "TND", scale=dim**-0.5, keep_prob=keep_prob, actual_seq_qlen=q_ends, actual_seq_kvlen=kv_ends,
        softmax_layout="TND",
    )  # fmt: skip
    out[0].backward(dy.to("npu"))
    keeps = _applied_tnd_keeps(q, k, q_ends, kv_ends, heads, dim, keep_prob) if keep_prob < 1 else [None] * 3
    for b, (q0, q1, k0, k1) in enumerate(zip([0, *q_ends], q_ends, [0, *kv_ends], kv_ends, strict=False)):
        per_head = lambda t, lo, hi: t[lo:hi].float().transpose(0, 1).unsqueeze(0)  # noqa: E731
        qb, kb, vb, dyb = per_head(q, q0, q1), per_head(k, k0, k1), per_head(v, k0, k1), per_head(dy, q0, q1)
        kb, vb = _heads_repeated(kb, heads), _heads_repeated(vb, heads)
        want, probs, row_max, row_sum = attention_golden(qb, kb, vb, dim**-0.5, keeps[b], keep_prob)
        dq, dk, dv = attention_golden_grads(dyb, qb, kb, vb, probs, dim**-0.5, keeps[b], keep_prob)
        as_tnd = lambda t: t[0].transpose(0, 1).half()  # noqa: E731
        close(out[0][q0:q1], as_tnd(want), RTOL[torch.float16])
        close(out[1][q0:q1], row_max.expand(-1, -1, -1, 8)[0].transpose(0, 1), RTOL[torch.float32])
        close(out[2][q0:q1], row_sum.expand(-1, -1, -1, 8)[0].transpose(0, 1), RTOL[torch.float32])
        close(leaves[0].grad[q0:q1], as_tnd(dq), RTOL[torch.float16])
        close(leaves[1].grad[k0:k1], as_tnd(_groups_summed(dk, kv_heads)), RTOL[torch.float16])
        close(leaves[2].grad[k0:k1], as_tnd(_groups_summed(dv, kv_heads)), RTOL[torch.float16])


def _applied_tnd_keeps(q, k, q_ends, kv_ends, heads, dim, keep_prob):
    """The keep mask of each batch ([1, N, Sq_b, Skv_b]) a TND call with the seed and offset of the call just made
    applies: the same call again (the generator rewound by torch.manual_seed(7)) with an identity value, whose
    output is the kept, scaled probabilities, nonzero exactly where kept."""
    torch.manual_seed(7)
    total = kv_ends[-1]
    eye = torch.eye(total, dim).half().unsqueeze(1).expand(total, 2, dim).contiguous()
    out = torch_npu.npu_fusion_attention(
        q.to("npu"), k.to("npu"), eye.to("npu"), heads, "TND", scale=dim**-0.5, keep_prob=keep_prob,
        actual_seq_qlen=q_ends, actual_seq_kvlen=kv_ends, softmax_layout="TND",
    )[0].cpu()  # fmt: skip
    keeps = []
    for q0, q1, k0, k1 in zip([0, *q_ends], q_ends, [0, *kv_ends], kv_ends, strict=False):
        kept = out[q0:q1, :, k0:k1] != 0  # key j of batch b is the identity's column k0 + j
        keeps.append(kept.transpose(0, 1).unsqueeze(0).float())
    return keeps


@pytest.mark.parametrize(
    ("mode", "pre", "nxt"), [(0, 128, 128), (1, 65536, 65536), (2, 65536, 0), (3, 65536, 0), (4, 128, 128)]
)
def test_fusion_attention_docstring_sparse_modes(mode, pre, nxt):
    """The docstring's example test (_op_plugin_docs.py:1720-1797): float16 BNSD [1, 8, 256, 256], scale 0.08838,
    sparse modes 0-4 with its pre/next pairs; the golden adds -10000 where its mask (triu above next, tril below pre;
    upper triangle for 2 and 3; none for 1) is set, in float32; precision 0.01. The op gets the dense band for mode 0,
    the compressed 2048 mask for 2-4 and no mask for 1, as the example passes them."""
    q, k, v = (_rand((1, 8, 256, 256), torch.float16, seed) for seed in range(3))
    ones = torch.ones(256, 256)
    band = ones.triu(nxt + 1) + ones.tril(-pre - 1)
    golden_mask = {0: band, 1: torch.zeros(256, 256), 2: ones.triu(1), 3: ones.triu(1), 4: band}[mode]
    scores = q.float() @ k.float().transpose(2, 3) * 0.08838 + golden_mask * -10000.0
    want = (torch.softmax(scores, -1) @ v.float()).half()
    atten_mask = {0: band.bool(), 1: None}.get(mode, torch.ones(2048, 2048, dtype=torch.bool).triu(1))
    out = torch_npu.npu_fusion_attention(
        q.to("npu"), k.to("npu"), v.to("npu"), 8, "BNSD", scale=0.08838, sparse_mode=mode,
        atten_mask=None if atten_mask is None else atten_mask.to("npu"), pre_tockens=pre, next_tockens=nxt,
    )[0]  # fmt: skip
    close(out, want, 0.01)


def _reference_masked(mode, sq, skv, pre, nxt, user=None):
    """The masked positions [Sq, Skv] each sparse mode documents (_op_plugin_docs.py:1636-1645), built as the
    docstring's golden builds them (lines 1745-1767: triu above next, tril below pre), shifted to the bottom-right
    by Skv - Sq in modes 3 and 4."""
    ones = torch.ones(sq, skv, dtype=torch.bool)
    shift = skv - sq if mode in (3, 4) else 0
    if mode in (2, 3):
        return ones.triu(1 + shift)
    band = ones.triu(nxt + 1 + shift) | ones.tril(-pre - 1 + shift)
    if mode == 1:
        return user
    return band if user is None else band | user


def _batches(t, layout, heads, ends=None):
    """A layout's tensor as one [N, S, D] tensor per batch (per cumulative end for TND)."""
    if layout == "TND":
        return [t[start:end].transpose(0, 1) for start, end in zip([0, *ends[:-1]], ends, strict=True)]
    if layout in ("BSH", "SBH"):
        t = t.unflatten(2, (heads, -1))
        t = t.transpose(1, 2) if layout == "BSH" else t.permute(1, 2, 0, 3)
    return list(t.transpose(1, 2) if layout == "BSND" else t)


def _from_batches(parts, layout):
    """The inverse of `_batches`."""
    if layout == "TND":
        return torch.cat([p.transpose(0, 1) for p in parts])
    t = torch.stack(parts)
    if layout in ("BSH", "SBH"):
        t = t.transpose(1, 2) if layout == "BSH" else t.permute(2, 0, 1, 3)
        return t.flatten(2)
    return t.transpose(1, 2) if layout == "BSND" else t


ATTENTION_SHAPES = {  # (query, key, value) per layout: Nq 4 over Nkv 2, D 8, Dv 4, Sq 6 (T 7) against Skv 9 (T 13)
    "BNSD": ((2, 4, 6, 8), (2, 2, 9, 8), (2, 2, 9, 4)),
    "BSND": ((2, 6, 4, 8), (2, 9, 2, 8), (2, 9, 2, 4)),
    "BSH": ((2, 6, 32), (2, 9, 16), (2, 9, 8)),
    "SBH": ((6, 2, 32), (9, 2, 16), (9, 2, 8)),
    "TND": ((7, 4, 8), (13, 2, 8), (13, 2, 4)),
}
TND_ENDS = ([3, 3, 7], [5, 7, 13])  # query lengths 3, 0, 4 against key lengths 5, 2, 6
SPARSE_CASES = {  # name: (sparse_mode, pre_tockens, next_tockens, a mask of one's own)
    "no mask": (0, 2147483647, 2147483647, False),
    "mode 0, mask and band": (0, 2, 1, True),
    "mode 1": (1, 2147483647, 2147483647, True),
    "mode 2": (2, 2147483647, 2147483647, False),
    "mode 3": (3, 2147483647, 2147483647, False),
    "mode 4, window": (4, 2, 0, False),
    "mode 4, band": (4, 1, 2, False),
}


def _float64_batches(layout, heads):
    """Random float64 query, key and value leaves of ATTENTION_SHAPES[layout], the TND ends (None otherwise), and
    the leaves as per-batch [N, S, D] tensors."""
    shapes = ATTENTION_SHAPES[layout]
    leaves = [_randn(shape, torch.float64, seed).requires_grad_() for seed, shape in enumerate(shapes)]
    q_ends, kv_ends = TND_ENDS if layout == "TND" else (None, None)
    batches = [
        _batches(t, layout, h, e) for t, h, e in zip(leaves, (heads, 2, 2), (q_ends, kv_ends, kv_ends), strict=True)
    ]
    return leaves, q_ends, kv_ends, batches


def _own_mask(sq, skv, seed):
    """A random mask (True = masked, about a third) that keeps each row's key j = i."""
    masked = torch.rand(sq, skv, generator=torch.Generator().manual_seed(seed)) < 0.35
    masked[torch.arange(min(sq, skv)), torch.arange(min(sq, skv))] = False
    return masked


@pytest.mark.parametrize("case", SPARSE_CASES)
@pytest.mark.parametrize("layout", ATTENTION_SHAPES)
def test_fusion_attention_against_float64_attention(layout, case):
    """Each layout and sparse mode, forward and backward, against plain attention in float64 with the documented
    mask (autograd for the gradients): GQA without repeated K/V, Dv < Dk, a zero-length TND segment, float32 inputs."""
    mode, pre, nxt, own = SPARSE_CASES[case]
    heads = 4
    leaves, q_ends, kv_ends, (qs, ks, vs) = _float64_batches(layout, heads)
    shape_sq, shape_skv = (4, 6) if layout == "TND" else (6, 9)  # the SS mask: maxSq x maxSkv for TND
    mask = _own_mask(shape_sq, shape_skv, seed=3) if own else None
    outs = []
    for q, k, v in zip(qs, ks, vs, strict=True):
        own_part = mask[: q.shape[1], : k.shape[1]] if own else None
        masked = _reference_masked(mode, q.shape[1], k.shape[1], pre, nxt, own_part)
        scores = (q @ k.repeat_interleave(2, 0).transpose(-1, -2) * 0.3).masked_fill(masked, -torch.inf)
        outs.append(torch.softmax(scores, -1).nan_to_num() @ v.repeat_interleave(2, 0))
    want = _from_batches(outs, layout)
    dy = _randn(want.shape, torch.float64, 9)
    want_grads = torch.autograd.grad(want, leaves, dy)
    npu_leaves = [t.detach().float().to("npu").requires_grad_() for t in leaves]
    atten_mask = mask if own else torch.ones(2048, 2048, dtype=torch.bool).triu(1) if mode else None
    out = torch_npu.npu_fusion_attention(
        *npu_leaves, heads, layout, atten_mask=None if atten_mask is None else atten_mask.to("npu"), scale=0.3,
        pre_tockens=pre, next_tockens=nxt, sparse_mode=mode, actual_seq_qlen=q_ends, actual_seq_kvlen=kv_ends,
    )  # fmt: skip
    out[0].backward(dy.float().to("npu"))
    torch.testing.assert_close(out[0].cpu().double(), want, rtol=1e-5, atol=1e-5)
    for got, expected in zip(npu_leaves, want_grads, strict=True):
        torch.testing.assert_close(got.grad.cpu().double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["BNSD", "TND"])
def test_fusion_attention_sink_against_the_docstring_example(layout):
    """The docstring's sink example (_op_plugin_docs.py:1852-1882): one logit per head joins each row's softmax and
    is dropped before v; here with the causal mode 2, GQA and TND too, forward and backward (dsink float32) against
    float64 autograd."""
    heads = 4
    leaves, q_ends, kv_ends, (qs, ks, vs) = _float64_batches(layout, heads)
    sink = torch.linspace(-0.2, 0.2, heads, dtype=torch.float64).requires_grad_()
    outs = []
    for q, k, v in zip(qs, ks, vs, strict=True):
        scores = (q @ k.repeat_interleave(2, 0).transpose(-1, -2) * 0.3).masked_fill(
            _reference_masked(2, q.shape[1], k.shape[1], 0, 0), -torch.inf
        )
        with_sink = torch.cat([scores, sink.view(heads, 1, 1).expand(heads, q.shape[1], 1)], -1)
        outs.append(torch.softmax(with_sink, -1)[..., :-1] @ v.repeat_interleave(2, 0))
    want = _from_batches(outs, layout)
    dy = _randn(want.shape, torch.float64, 9)
    want_grads = torch.autograd.grad(want, [*leaves, sink], dy)
    npu_leaves = [t.detach().float().to("npu").requires_grad_() for t in (*leaves, sink)]
    out = torch_npu.npu_fusion_attention(
        *npu_leaves[:3], heads, layout, atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1).to("npu"),
        scale=0.3, sparse_mode=2, actual_seq_qlen=q_ends, actual_seq_kvlen=kv_ends, sink=npu_leaves[3],
    )  # fmt: skip
    out[0].backward(dy.float().to("npu"))
    torch.testing.assert_close(out[0].cpu().double(), want, rtol=1e-5, atol=1e-5)
    assert npu_leaves[3].grad.dtype == torch.float32
    for got, expected in zip(npu_leaves, want_grads, strict=True):
        torch.testing.assert_close(got.grad.cpu().double(), expected, rtol=1e-5, atol=1e-5)


def test_fusion_attention_dropout_keeps_keep_prob_and_redraws_per_call():
    """keep_prob 0.8: about 80% kept (read off an identity value), the seed and offset returned with it, a new mask
    per call, the same one after torch.manual_seed; keep_prob 1 returns the seed and offset it was given (the
    adapter overwrites them only when it drops: FlashAttentionKernelNpuOpApi.cpp:491-495)."""
    q, k = (_randn((1, 8, 64, 64), torch.float32, seed).to("npu") for seed in range(2))  # Dv = Dk: an identity v
    eye = torch.eye(64).expand(1, 8, 64, 64).contiguous().to("npu")

    def kept(**options):
        out = torch_npu.npu_fusion_attention(q, k, eye, 8, "BNSD", scale=0.25, keep_prob=0.8, **options)
        return out[0].cpu() != 0, out[4:]

    torch.manual_seed(3)
    first, (_, offset, numels) = kept()
    second, (_, second_offset, _) = kept()
    torch.manual_seed(3)
    again, (_, again_offset, _) = kept()
    assert abs(first.float().mean().item() - 0.8) < 0.01 and numels == 8 * 64 * 64
    assert not torch.equal(first, second) and offset != second_offset
    assert torch.equal(first, again) and offset == again_offset
    full = torch_npu.npu_fusion_attention(q, k, eye, 8, "BNSD", keep_prob=1.0, seed=5, offset=6)
    assert full[4:6] == (5, 6)


@pytest.mark.parametrize(
    ("change", "form"),
    [
        ({"pse": torch.zeros(1, 2, 4, 4)}, "pse"),
        ({"dropout_mask": torch.ones(64, dtype=torch.uint8)}, "dropout_mask"),
        ({"sparse_mode": 6, "prefix": [4]}, "prefix"),
    ],
    ids=["pse", "external dropout_mask", "prefix"],
)
def test_fusion_attention_refuses_the_forms_no_card_uses(change, form):
    """test_npu_flash_attention_with_external_dropout_mask and the pse example are forms no card calls: the
    emulation says so (NotImplementedError naming the form) instead of computing something else."""
    q, k, v = (_randn(shape, torch.float32, 0).to("npu") for shape in ((1, 2, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8)))
    change = {name: value.to("npu") if isinstance(value, torch.Tensor) else value for name, value in change.items()}
    with pytest.raises(NotImplementedError, match=form):
        torch_npu.npu_fusion_attention(q, k, v, 2, "BNSD", **change)


def test_fusion_attention_refuses_a_dense_row_with_every_key_masked():
    """Outside TND a fully masked row's output is not documented (inner_precise 2, _op_plugin_docs.py:1616)."""
    q, k, v = (_randn((1, 2, 4, 8), torch.float32, seed).to("npu") for seed in range(3))
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[2] = True
    with pytest.raises(NotImplementedError, match="every key masked"):
        torch_npu.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=mask.to("npu"))
