"""The emulated torch_npu ops against Huawei's own test cases and CPU goldens.

Restated from Ascend/op-plugin `test/test_custom_ops/` at commit 517f2e7d0f202f38b76310706cb977ca2388ad21
(test_npu_rotary_mul.py, test_npu_rotary_mul_backward.py, test_npu_rms_norm.py, test_npu_rms_norm_backward.py,
test_npu_swi_glu.py, test_npu_swi_glu_backward.py, test_npu_apply_rotary_pos_emb.py): the shapes, dtypes,
layouts and what each golden computes, written here from the op semantics. Only the cases op-plugin's CI runs:
the ones it skips there ("not supported by the CI version": 3-D rotary_mul, the `rotate` matrix, TND
npu_apply_rotary_pos_emb) are left out as it leaves them out. Tolerances: op-plugin's assertRtolEqual
(1e-3 for float16, 1e-4 for float32, bfloat16 compared as float32) unless a test names its own.

Not restated yet: test_npu_grouped_matmul.py and test_npu_moe_token_permute_and_unpermute*.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch_npu

OP_PLUGIN_COMMIT = "517f2e7d0f202f38b76310706cb977ca2388ad21"
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


def rotate_golden(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, mode: str) -> torch.Tensor:
    """The golden of test_npu_rotary_mul: r1 * x + r2 * rotation(x), in the inputs' dtype."""
    if mode == "half":
        x1, x2 = torch.chunk(x, 2, -1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).reshape(x.shape)
    return r1 * x + r2 * rotated


HALF_SHAPES = [  # x, r1 (= r2): BSND 1S1D, SBND SB11... as op-plugin lists them; the last is read as BSND or SBND
    ((2, 8192, 5, 128), (1, 8192, 1, 128)),
    ((8192, 2, 5, 128), (8192, 1, 1, 128)),
    ((2048, 4, 32, 64), (2048, 4, 1, 64)),
]
INTERLEAVE_SHAPES = [
    ((2, 2, 5, 128), (1, 2, 1, 128)),
    ((2, 24, 5, 128), (1, 1, 5, 128)),
    ((128, 4, 4, 256), (1, 1, 4, 256)),
    ((64, 8, 8, 512), (1, 1, 8, 512)),
]


def _rand(shape, dtype, seed):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("mode", "shapes"), [("half", HALF_SHAPES), ("interleave", INTERLEAVE_SHAPES)])
def test_rotary_mul_forward(mode, shapes, dtype):
    for seed, (x_shape, r_shape) in enumerate(shapes):
        x, r1, r2 = (_rand(shape, dtype, seed * 3 + i) for i, shape in enumerate((x_shape, r_shape, r_shape)))
        out = torch_npu.npu_rotary_mul(x.to("npu"), r1.to("npu"), r2.to("npu"), rotary_mode=mode)
        close(out, rotate_golden(x, r1, r2, mode), RTOL[dtype])


@pytest.mark.slow
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
            golden = rotate_golden(*cpu, mode)
            golden.backward(torch.ones_like(golden))
            out = torch_npu.npu_rotary_mul(*npu, rotary_mode=mode)
            out.backward(torch.ones_like(out))
            for got, want in zip(npu, cpu, strict=True):  # r1/r2 sum over the broadcast axes: float32 tolerance
                close(got.grad, want.grad, 1e-3 if dtype == torch.float16 else 1e-4)


def test_rotary_mul_refuses_an_unknown_mode():
    x, r = torch.rand(2, 2, 5, 128).to("npu"), torch.rand(1, 2, 1, 128).to("npu")
    with pytest.raises(RuntimeError, match="rotary_mode"):
        torch_npu.npu_rotary_mul(x, r, r, "quarter")


def rms_norm_golden(x: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """test_npu_rms_norm's golden: float32 x * rsqrt(mean(x^2) + eps) * gamma, cast to x's dtype; and rstd."""
    x32 = x.float()
    rstd = 1 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * rstd * gamma.float()).to(x.dtype), rstd


@pytest.mark.slow
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16])  # test_rms_norm, test_rms_norm_mix_dtype
def test_rms_norm_forward(x_dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(1024, 12288, generator=g) * 100).to(x_dtype)
    gamma = torch.rand(12288, generator=g) * 100  # float32 in both cases
    y, rstd = torch_npu.npu_rms_norm(x.to("npu"), gamma.to("npu"))
    want_y, want_rstd = rms_norm_golden(x, gamma)
    close(y, want_y, RTOL[x_dtype])
    close(rstd, want_rstd, 1e-4)


def test_rms_norm_backward():
    """test_npu_rms_norm_backward's golden, [10, 128] float32 with values up to 100."""
    g = torch.Generator().manual_seed(1)
    x, gamma, grad_y = (torch.rand(shape, generator=g) * 100 for shape in ((10, 128), (128,), (10, 128)))
    rstd = 1 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    dgamma = (grad_y * x * rstd).sum(0)
    dx = grad_y * gamma * rstd - x * (rstd**3 * grad_y * gamma * x).sum(1, keepdim=True) / 128
    x_npu, gamma_npu = x.to("npu").requires_grad_(), gamma.to("npu").requires_grad_()
    torch_npu.npu_rms_norm(x_npu, gamma_npu)[0].backward(grad_y.to("npu"))
    close(x_npu.grad, dx, 1e-4)
    close(gamma_npu.grad, dgamma, 1e-4)


SWIGLU_SHAPE = (8192, 1, 3904 * 2)


@pytest.mark.slow
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


@pytest.mark.slow
def test_apply_rotary_pos_emb_bsnd():
    """test_npu_apply_rotary_pos_emb: float16 BSND q/k [4, 1024, 16, 128], cos/sin [4, 1024, 1, 128], 'half',
    in place; op-plugin's tolerance 0.001."""
    q, k, cos, sin = (
        _rand(shape, torch.float16, seed)
        for seed, shape in enumerate([(4, 1024, 16, 128), (4, 1024, 16, 128), (4, 1024, 1, 128), (4, 1024, 1, 128)])
    )
    q_npu, k_npu = q.to("npu"), k.to("npu")
    with torch.inference_mode():
        out = torch_npu.npu_apply_rotary_pos_emb(q_npu, k_npu, cos.to("npu"), sin.to("npu"), "BSND", "half")
    assert out[0] is q_npu and out[1] is k_npu
    for got, x in zip(out, (q, k), strict=True):
        close(got, rotate_golden(x, cos, sin, "half"), 1e-3)
