"""The emulated npu device and torch_npu ops: real numbers, real dtypes, real failures."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch
import torch_npu
from numerics import gelu_tanh_golden, rotary_golden

from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm, token_ids


def _rms_norm_math(x: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-6, dtype=torch.float64, dims=-1):
    """x * rsqrt(mean(x^2 over dims) + eps) * gamma, computed in dtype."""
    x, gamma = x.to(dtype), gamma.to(dtype)
    return x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps) * gamma


def _tol(dtype):
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}.get(
        dtype, dict(rtol=2e-3, atol=2e-3)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 48), (2, 3, 4, 16)])
def test_npu_rms_norm_matches_fp32_then_cast(dtype, shape):
    x = torch.randn(shape, dtype=dtype)
    gamma = torch.randn(shape[-1], dtype=dtype)
    y, rstd = torch_npu.npu_rms_norm(x.to("npu"), gamma.to("npu"), epsilon=1e-5)
    assert y.device.type == "npu" and y.dtype == dtype and y.shape == x.shape
    assert rstd.dtype == torch.float32 and rstd.shape == (*shape[:-1], 1)
    assert torch.equal(y.cpu(), _rms_norm_math(x, gamma, 1e-5, torch.float32).to(dtype))  # float32, then cast
    torch.testing.assert_close(y.cpu().double(), _rms_norm_math(x, gamma, 1e-5), **_tol(dtype))


def test_npu_rms_norm_two_dim_gamma_normalises_trailing_dims():
    x = torch.randn(2, 3, 4, 8)
    gamma = torch.randn(4, 8)
    y, rstd = torch_npu.npu_rms_norm(x.to("npu"), gamma.to("npu"))
    assert rstd.shape == (2, 3, 1, 1)
    torch.testing.assert_close(y.cpu().double(), _rms_norm_math(x, gamma, dims=(-2, -1)), rtol=1e-5, atol=1e-5)


def test_npu_rms_norm_bf16_input_with_fp32_gamma():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    gamma = torch.randn(32)
    y, _ = torch_npu.npu_rms_norm(x.to("npu"), gamma.to("npu"))
    assert y.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("x", "gamma", "message"),
    [
        (torch.randn(4, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64), "npu_rms_norm/x-dtype"),
        (torch.randn(4, 8), torch.randn(8, dtype=torch.bfloat16), "npu_rms_norm/gamma-dtype"),
        (torch.randn(8), torch.randn(8), "npu_rms_norm/x-rank"),
        (torch.randn(4, 8), torch.randn(6), "npu_rms_norm/gamma-shape"),
    ],
)
def test_npu_rms_norm_rejects_what_the_real_op_rejects(x, gamma, message):
    with pytest.raises(emulation.DeviceRefusal, match=message):
        torch_npu.npu_rms_norm(x.to("npu"), gamma.to("npu"))


def test_npu_rms_norm_backward_matches_fp64_autograd():
    x = torch.randn(3, 5, 32, requires_grad=True)
    gamma = torch.randn(32, requires_grad=True)
    x_npu = x.detach().to("npu").requires_grad_()
    gamma_npu = gamma.detach().to("npu").requires_grad_()
    torch_npu.npu_rms_norm(x_npu, gamma_npu)[0].pow(2).sum().backward()
    _rms_norm_math(x, gamma).pow(2).sum().backward()
    torch.testing.assert_close(x_npu.grad.cpu(), x.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gamma_npu.grad.cpu(), gamma.grad, rtol=1e-4, atol=1e-4)


def test_npu_rms_norm_backward_node_gives_dgamma_in_float32_which_autograd_casts():
    """The op's node returns npu_rms_norm_backward's outputs: dgamma in float32 (its meta registration); the
    gradient gamma receives is autograd's cast of it to gamma's dtype."""
    x = torch.randn(3, 8, device="npu", dtype=torch.bfloat16, requires_grad=True)
    gamma = torch.randn(8, device="npu", dtype=torch.bfloat16, requires_grad=True)
    y, _ = torch_npu.npu_rms_norm(x, gamma)
    grad_y = torch.randn_like(y)
    grad_x, grad_gamma, _ = y.grad_fn.apply(grad_y, None)
    assert (grad_x.dtype, grad_gamma.dtype) == (torch.bfloat16, torch.float32)
    y.backward(grad_y)
    assert gamma.grad.dtype == torch.bfloat16 and torch.equal(gamma.grad, grad_gamma.to(torch.bfloat16))


def test_ops_count_their_calls_and_refuse_host_tensors():
    x = torch.randn(2, 8)
    with emulation.count_op_calls() as calls:
        torch_npu.npu_rms_norm(x.to("npu"), torch.ones(8, device="npu"))
        torch_npu.npu_rms_norm(x.to("npu"), torch.ones(8, device="npu"))
    assert calls == {"npu_rms_norm": 2}
    with pytest.raises(RuntimeError, match="expected x on an npu device"):
        torch_npu.npu_rms_norm(x, torch.ones(8))
    with emulation.count_op_calls() as calls:
        x * 2
    assert calls == {}


def test_device_behaves_like_a_device():
    x = torch.randn(3, 4)
    on_npu = x.to("npu")
    assert on_npu.device == torch.device("npu", 0) and on_npu.is_npu
    assert torch.equal(on_npu.cpu(), x) and type(on_npu.cpu()) is torch.Tensor
    assert torch.zeros(2, device="npu").device.type == "npu"
    assert torch.tensor([1.0, 2.0], device="npu").device.type == "npu"
    assert not on_npu.t().is_contiguous()
    linear = torch.nn.Linear(4, 2).to("npu")
    assert linear.weight.device.type == "npu"
    linear(on_npu).sum().backward()
    assert linear.weight.grad.device.type == "npu"
    with pytest.raises(RuntimeError, match="same device"):
        on_npu + x
    assert torch.npu.is_available() and torch.npu.device_count() == 1


def test_views_keep_the_kind_of_tensor_they_view_as_torch_does():
    """A view of an inference tensor is one, in or out of inference mode; a view of a normal tensor is normal, in or
    out of it (torch's rules, which the host tensor beside them shows)."""
    with torch.inference_mode():
        inference, host_inference = torch.randn(2, 3).to("npu"), torch.randn(2, 3)
    normal = torch.randn(2, 3).to("npu")
    assert host_inference.t().is_inference() and inference.t().is_inference() and inference[0].is_inference()
    assert not (inference + 1).is_inference() and not normal.t().is_inference()
    # ops that may alias copy a strided tensor instead (contiguous, reshape): a copy made here is normal, as on the host
    assert inference.reshape(-1).is_inference() and host_inference.reshape(-1).is_inference()
    assert not inference.t().contiguous().is_inference() and not host_inference.t().contiguous().is_inference()
    assert not inference.t().reshape(-1).is_inference()
    with torch.inference_mode():
        assert inference.t().is_inference() and not normal.t().is_inference()


def test_to_moves_and_casts_in_inference_mode_as_outside_it():
    """In inference mode `Tensor.to` reaches the device undecomposed (aten.to.device, .other, .dtype_layout): its
    device argument decides where the result lives, as outside inference mode."""
    for mode in (torch.inference_mode(), contextlib.nullcontext()):
        with mode:
            x, host = torch.arange(3.0).to("npu"), torch.zeros(1, dtype=torch.float64)
            for moved in (x.to("cpu", torch.float64), x.to(host), x.to(device="cpu", dtype=torch.float64)):
                assert type(moved) is torch.Tensor and moved.dtype == torch.float64 and moved.tolist() == [0, 1, 2]
            assert x.to(torch.float16).device.type == "npu" and host.to("npu", torch.float32).device.type == "npu"


def test_a_move_to_the_host_is_a_copy_of_its_own():
    """`.cpu()` copies device memory to the host: writing the copy leaves the device tensor as it was, and a copy made
    outside inference mode is a normal tensor, even of an inference tensor (whose `.to` is reached undecomposed)."""
    with torch.inference_mode():
        inference = torch.zeros(3).to("npu")
    for device_tensor in (inference, torch.zeros(3).to("npu")):
        host = device_tensor.cpu()
        host += 1
        assert not host.is_inference() and device_tensor.cpu().tolist() == [0.0, 0.0, 0.0]


def test_advanced_indexing_takes_host_indices_as_torch_npu_moves_them_to_the_device():
    """torch_npu moves host index tensors of index/index_put to the indexed tensor's device (AdvancedIndex.cpp)."""
    x = torch.arange(12.0).view(4, 3)
    on_npu, rows, mask = x.to("npu"), torch.tensor([0, 2]), torch.tensor([True, False, True, False])
    assert torch.equal(on_npu[rows].cpu(), x[rows]) and on_npu[rows].device.type == "npu"
    assert torch.equal(on_npu[mask].cpu(), x[mask])
    written = on_npu.clone()
    written[rows] = torch.zeros(2, 3, device="npu")
    assert torch.equal(written.cpu(), x.index_put((rows,), torch.zeros(2, 3)))
    with pytest.raises(RuntimeError, match="same device"):  # only the indices: the indexed tensor is checked
        x[rows.to("npu")]


@pytest.mark.parametrize("device", [None, 0, "npu", "npu:0", torch.device("npu", 0)], ids=str)
def test_the_device_names_itself_as_torch_npu_does(device):
    """torch_npu answers CANN's SoC name (an Atlas A2's); TRL's trainers ask it at construction."""
    assert torch.npu.get_device_name(device) == "Ascend910B3"


@pytest.mark.parametrize("device", [1, "npu:1", torch.device("npu", 1)], ids=str)
def test_the_name_of_a_device_there_is_not_is_refused_as_torch_npu_refuses_it(device):
    with pytest.raises(AssertionError, match="Invalid device id"):
        torch.npu.get_device_name(device)


def _same_as_on_the_host(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.device.type == "npu" and got.device == torch.device("npu", 0)
    assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize(
    "make",
    [
        lambda device: torch.arange(512, device=device),
        lambda device: torch.arange(2, 11, 3, device=device),
        lambda device: torch.arange(0.0, 1.0, 0.125, device=device, dtype=torch.bfloat16),
    ],
    ids=["arange", "arange-step", "arange-bf16"],
)
def test_factories_that_fill_an_out_tensor_give_it_their_size(make):
    """arange with device="npu" fills an empty npu tensor through its out= form, which resizes it."""
    _same_as_on_the_host(make("npu"), make("cpu"))


A, B = torch.randn(3, 4), torch.randn(4, 5)
OUT_CALLS = {
    "add": lambda out, device: torch.add(A.to(device), A.to(device), out=out),
    "cat": lambda out, device: torch.cat([A.to(device), A.to(device)], dim=1, out=out),
    "mm": lambda out, device: torch.mm(A.to(device), B.to(device), out=out),
    "arange": lambda out, device: torch.arange(1, 8, out=out),
    "sum": lambda out, device: torch.sum(A.to(device), dim=0, out=out),
}


@pytest.mark.parametrize("name", OUT_CALLS)
def test_out_ops_resize_their_out_tensor_as_on_the_host(name):
    """An empty `out=` tensor is resized by the op: the npu tensor the call returns, and is, reads the op's sizes."""
    call = OUT_CALLS[name]
    want = call(torch.empty(0), "cpu")
    out = torch.empty(0, device="npu")
    got = call(out, "npu")
    assert got is out
    _same_as_on_the_host(out, want)


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t.unsqueeze_(0),
        lambda t: t.t_(),
        lambda t: t.resize_(2, 5),
        lambda t: t.as_strided_((2, 2), (1, 3), 1),
    ],
    ids=["unsqueeze_", "t_", "resize_", "as_strided_"],
)
def test_in_place_ops_that_change_sizes_change_the_npu_tensor(change):
    x = torch.arange(12.0).reshape(3, 4)
    on_npu = x.to("npu")
    assert change(on_npu) is on_npu
    _same_as_on_the_host(on_npu, change(x))


def test_host_reports_cann_and_kernels_sees_it(cann_version):
    from npu_hub_kernels._kernels_compat import backend

    assert torch_npu.utils.collect_env.get_cann_version() == emulation.DEFAULT_CANN_VERSION
    assert backend().variant_str == "cann91"
    cann_version("8.3.RC1")
    assert backend().variant_str == "cann83"
    with pytest.raises(ValueError, match="CANN versions look like"):
        cann_version("9")


@pytest.mark.parametrize("torch_version", ["2.12.1", "2.14.0+cpu"])
def test_install_refuses_a_torch_it_is_not_tested_with(torch_version):
    code = (
        f"import torch; torch.__version__ = {torch_version!r}\n"
        "from npu_hub_kernels.testing import emulation\n"
        "emulation.install()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert f"tested with torch 2.13 only (it uses private torch hooks) and torch {torch_version} is installed" in (
        result.stderr
    )
    assert "install torch==2.13.0" in result.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_npu_rotary_mul_matches_the_formula(dtype, mode):
    x, r1, r2 = (torch.randn(shape, dtype=dtype) for shape in ((2, 4, 5, 64), (1, 1, 5, 64), (1, 1, 5, 64)))
    with emulation.count_op_calls() as calls:
        out = torch_npu.npu_rotary_mul(x.to("npu"), r1.to("npu"), r2.to("npu"), rotary_mode=mode)
    assert calls == {"npu_rotary_mul": 1} and out.dtype == dtype and out.shape == x.shape
    expected = rotary_golden(x.double(), r1.double(), r2.double(), mode)
    torch.testing.assert_close(out.cpu().double(), expected, **_tol(dtype))
    assert torch.equal(out.cpu(), rotary_golden(x.float(), r1.float(), r2.float(), mode).to(dtype))


@pytest.mark.parametrize(
    ("x_shape", "r_shape", "mode", "message"),
    [
        ((2, 4, 5, 63), (1, 1, 5, 63), "half", "npu_rotary_mul/head-dim"),
        ((1, 2, 3, 896), (1, 1, 3, 896), "half", "npu_rotary_mul/head-dim"),
        ((1000, 2, 3, 8), (1, 1, 3, 8), "half", "npu_rotary_mul/half-limits"),
        ((2, 1000, 3, 8), (1, 1, 3, 8), "half", "npu_rotary_mul/half-limits"),
        ((10, 100, 3, 8), (1, 1, 3, 8), "interleave", "npu_rotary_mul/interleave-limits"),
        ((2, 4, 3, 8), (2, 1, 3, 8), "interleave", "npu_rotary_mul/interleave-forms"),
        ((5, 8), (5, 8), "half", "npu_rotary_mul/rank"),
        ((2, 2, 5, 128), (1, 2, 1, 128), "quarter", "npu_rotary_mul/rotary-mode"),
        # x read as BSND (r of form 1S1D or BS1D): the limits of the layout the op reads
        ((2, 5, 1000, 8), (1, 5, 1, 8), "half", "npu_rotary_mul/half-limits"),
        ((2, 5, 4, 8), (1, 5, 4, 8), "half", "npu_rotary_mul/half-forms"),
        ((2, 5, 4, 8), (2, 5, 1, 8), "interleave", "npu_rotary_mul/interleave-forms"),
        ((2, 5, 600, 8), (1, 5, 1, 8), "interleave", "npu_rotary_mul/interleave-limits"),
    ],
)
def test_npu_rotary_mul_enforces_the_layout_limits(x_shape, r_shape, mode, message):
    x, r = torch.randn(x_shape, device="npu"), torch.randn(r_shape, device="npu")
    with pytest.raises(RuntimeError, match=message):
        torch_npu.npu_rotary_mul(x, r, r, rotary_mode=mode)


def test_npu_rotary_mul_rotate_matrix_is_not_emulated():
    x, r = torch.randn(2, 5, 4, 8, device="npu"), torch.randn(1, 5, 1, 8, device="npu")
    with pytest.raises(NotImplementedError, match="rotate matrix"):
        torch_npu.npu_rotary_mul(x, r, r, "half", torch.eye(8, device="npu"))


def test_npu_rotary_mul_backward_reaches_x_r1_and_r2():
    x, r1, r2 = (torch.randn(s, dtype=torch.float64) for s in ((2, 3, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8)))
    leaves = [t.float().to("npu").requires_grad_() for t in (x, r1, r2)]
    torch_npu.npu_rotary_mul(*leaves).pow(2).sum().backward()
    refs = [t.clone().requires_grad_() for t in (x, r1, r2)]
    rotary_golden(*refs).pow(2).sum().backward()
    for got, ref in zip(leaves, refs, strict=True):
        torch.testing.assert_close(got.grad.cpu().double(), ref.grad, rtol=1e-4, atol=1e-4)


def test_integer_histc_counts_as_on_a_device():
    """transformers' MoE routing counts expert ids with histc on int tensors: devices allow it, CPU does not."""
    ids = torch.tensor([0, 3, 3, 1, 3], dtype=torch.int64)
    counts = torch.histc(ids.to("npu"), bins=4, min=0, max=3)
    assert counts.device.type == "npu" and counts.dtype == torch.int64
    assert counts.cpu().tolist() == [1, 1, 0, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_npu_swiglu_gates_the_first_half(dtype):
    x = torch.randn(3, 5, 2 * 24, dtype=dtype)
    with emulation.count_op_calls() as calls:
        out = torch_npu.npu_swiglu(x.to("npu"))
    assert calls == {"npu_swiglu": 1} and out.dtype == dtype and out.shape == (3, 5, 24)
    gate, up = x.double().chunk(2, dim=-1)
    torch.testing.assert_close(out.cpu().double(), torch.nn.functional.silu(gate) * up, **_tol(dtype))
    gate32, up32 = x.float().chunk(2, dim=-1)
    assert torch.equal(out.cpu(), (torch.nn.functional.silu(gate32) * up32).to(dtype))
    up_first = torch.nn.functional.silu(up32) * gate32
    assert not torch.allclose(out.cpu().float(), up_first)  # the half order matters


@pytest.mark.parametrize("activate_left", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_npu_geglu_activates_the_half_activate_left_names(dtype, activate_left):
    """aclnnGeGluV3: activate_left=True gives gelu(A) * B, False (the default) A * gelu(B), A the first half."""
    x = torch.randn(3, 5, 2 * 24, dtype=dtype)
    with emulation.count_op_calls() as calls:
        out, gelu = torch_npu.npu_geglu(x.to("npu"), dim=-1, approximate=1, activate_left=activate_left)
    assert calls == {"npu_geglu": 1} and out.dtype == gelu.dtype == dtype and out.shape == gelu.shape == (3, 5, 24)
    first, second = x.double().chunk(2, dim=-1)
    activated, other = (first, second) if activate_left else (second, first)
    want = torch.nn.functional.gelu(activated, approximate="tanh")
    torch.testing.assert_close(gelu.cpu().double(), want, **_tol(dtype))
    torch.testing.assert_close(out.cpu().double(), want * other, **_tol(dtype))
    swapped = torch.nn.functional.gelu(other, approximate="tanh") * activated
    assert not torch.allclose(out.cpu().double(), swapped, **_tol(dtype))  # the half order matters


def test_npu_geglu_erf_form_is_not_emulated():
    """approximate=0 is a documented form no card calls: it raises, never computes something else."""
    with pytest.raises(NotImplementedError, match="approximate=0"):
        torch_npu.npu_geglu(torch.randn(4, 8).to("npu"), approximate=0)


@pytest.mark.parametrize(
    ("x", "message"),
    [
        (torch.randn(4, 7), "npu_swiglu/x-even"),
        (torch.randn(8, 6).t(), "npu_swiglu/x-contiguous"),
        (torch.randn(4, 6, dtype=torch.float64), "npu_swiglu/x-dtype"),
    ],
)
def test_npu_swiglu_enforces_its_input_rules(x, message):
    with pytest.raises(emulation.DeviceRefusal, match=message):
        torch_npu.npu_swiglu(x.to("npu"))


def test_npu_swiglu_backward_matches_autograd_of_the_formula():
    x = torch.randn(4, 16, dtype=torch.float64)
    leaf = x.float().to("npu").requires_grad_()
    torch_npu.npu_swiglu(leaf).pow(2).sum().backward()
    ref = x.clone().requires_grad_()
    gate, up = ref.chunk(2, dim=-1)
    (torch.nn.functional.silu(gate) * up).pow(2).sum().backward()
    torch.testing.assert_close(leaf.grad.cpu().double(), ref.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("x_shape", "r_shape"),
    [
        ((2, 4, 5, 8), (1, 1, 5, 8)),
        ((2, 4, 5, 8), (2, 1, 5, 8)),
        ((2, 5, 4, 8), (1, 5, 1, 8)),
        ((2, 5, 4, 8), (2, 5, 1, 8)),
    ],
    ids=["BNSD 11SD", "BNSD B1SD", "BSND 1S1D", "BSND BS1D"],
)
def test_npu_rotary_mul_takes_each_layout_and_returns_it_row_major(x_shape, r_shape):
    x = torch.randn(x_shape).to("npu").transpose(1, 2).contiguous().transpose(1, 2)  # x's shape, other strides
    r1, r2 = torch.randn(r_shape).to("npu"), torch.randn(r_shape).to("npu")
    out = torch_npu.npu_rotary_mul(x, r1, r2)
    assert out.shape == x.shape and out.is_contiguous()
    expected = rotary_golden(*(t.cpu().double() for t in (x, r1, r2)))
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-5)


def test_npu_apply_rotary_pos_emb_rotates_q_and_k_in_place():
    q, k = torch.randn(2, 5, 8, 64), torch.randn(2, 5, 2, 64)
    cos, sin = torch.randn(2, 5, 1, 64), torch.randn(2, 5, 1, 64)
    q_npu, k_npu = q.to("npu"), k.to("npu")
    with emulation.count_op_calls() as calls:
        out = torch_npu.npu_apply_rotary_pos_emb(q_npu, k_npu, cos.to("npu"), sin.to("npu"))
    assert calls == {"npu_apply_rotary_pos_emb": 1} and out[0] is q_npu and out[1] is k_npu
    for got, x in zip(out, (q, k), strict=True):
        torch.testing.assert_close(got.cpu(), rotary_golden(x, cos, sin), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layout": "BNSD"}, "npu_apply_rotary_pos_emb/layout"),
        ({"head_dim": 80}, "npu_apply_rotary_pos_emb/head-dim"),
        ({"cos_batch": 1}, "npu_apply_rotary_pos_emb/leading-dims"),
        ({"cos_dtype": torch.float16}, "npu_apply_rotary_pos_emb/same-dtype"),
        ({"grad": True}, "npu_apply_rotary_pos_emb/no-autograd"),
    ],
)
def test_npu_apply_rotary_pos_emb_enforces_its_limits(change, message):
    d = change.get("head_dim", 64)
    q, k = torch.randn(2, 5, 8, d, device="npu"), torch.randn(2, 5, 2, d, device="npu")
    cos = torch.randn(change.get("cos_batch", 2), 5, 1, d, device="npu").to(change.get("cos_dtype", torch.float32))
    q.requires_grad_(change.get("grad", False))
    with pytest.raises(RuntimeError, match=message):
        torch_npu.npu_apply_rotary_pos_emb(q, k, cos, cos, layout=change.get("layout", "BSND"))


CASTS = {
    "to(bfloat16)": lambda model: model.to(torch.bfloat16),
    "half()": lambda model: model.half(),
}


@pytest.mark.parametrize("cast", CASTS)
def test_a_cast_after_a_forward_whose_output_is_kept_works_as_on_a_device(cast):
    ids = token_ids()
    model = tiny_causal_lm("llama").to("npu")
    params = list(model.parameters())
    kept = model(ids.to("npu")).logits  # with its autograd graph, which holds the weights
    before = kept.detach().cpu().clone()
    CASTS[cast](model)
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))  # cast in place, as on a device
    on_host = CASTS[cast](tiny_causal_lm("llama"))
    assert {p.dtype for p in model.parameters()} == {on_host.lm_head.weight.dtype} != {torch.float32}
    for (name, value), expected in zip(model.state_dict().items(), on_host.state_dict().values(), strict=True):
        assert torch.equal(value.cpu(), expected), name
    reference = CASTS[cast](tiny_causal_lm("llama").to("npu"))  # the same cast with no forward before it
    with torch.no_grad():
        assert torch.equal(model(ids.to("npu")).logits.cpu(), reference(ids.to("npu")).logits.cpu())
    assert torch.equal(kept.detach().cpu(), before)


def test_tied_weights_stay_tied_through_moves_and_casts():
    model = tiny_causal_lm("gemma3_text")
    assert model.config.tie_word_embeddings

    def tied(device_type, dtype):
        embedding, head = model.get_input_embeddings().weight, model.lm_head.weight
        return head is embedding and (embedding.device.type, embedding.dtype) == (device_type, dtype)

    model.to("npu")
    assert tied("npu", torch.float32)
    kept = model(token_ids().to("npu")).logits
    model.to(torch.bfloat16)
    assert tied("npu", torch.bfloat16)
    model.half()
    assert tied("npu", torch.float16)
    del kept  # moving between host and device swaps the tensors, which an autograd graph would hold
    model.to("cpu")
    assert tied("cpu", torch.float16)


def test_module_conversions_leave_the_swap_flag_as_the_user_set_it():
    future = torch.__future__
    assert not future.get_swap_module_params_on_conversion()  # torch's default, untouched by install()
    linear = torch.nn.Linear(4, 4).to("npu").to(torch.bfloat16).cpu()
    assert not future.get_swap_module_params_on_conversion()
    future.set_swap_module_params_on_conversion(True)
    try:
        linear.to("npu").float().to("cpu")
        assert future.get_swap_module_params_on_conversion()
    finally:
        future.set_swap_module_params_on_conversion(False)
    assert linear.weight.device.type == "cpu" and linear.weight.dtype == torch.float32


def test_assigning_data_of_an_npu_tensor_moves_its_values_too():
    param = torch.nn.Parameter(torch.zeros(2, 3, device="npu"))
    new = torch.arange(6.0).reshape(3, 2).to(torch.bfloat16).to("npu")
    param.data = new
    assert (param.shape, param.dtype) == ((3, 2), torch.bfloat16)
    assert torch.equal(param.detach().cpu(), new.cpu()) and torch.equal((param * 2).cpu(), new.cpu() * 2)
    with pytest.raises(RuntimeError):
        param.data = torch.zeros(3, 2)  # a host tensor: the emulation cannot move a device tensor's storage


def test_accelerate_moves_npu_parameters_and_loads_a_checkpoint_split_between_npu_and_cpu(tmp_path):
    """set_module_tensor_to_device remakes a parameter with `type(param)(value, requires_grad=...)`; a
    device_map split between npu and cpu and load_checkpoint_in_model go through it."""
    from accelerate.utils import load_checkpoint_in_model, set_module_tensor_to_device
    from safetensors.torch import save_file

    layer = torch.nn.Linear(4, 3).to("npu")
    set_module_tensor_to_device(layer, "weight", "npu", value=torch.ones(3, 4))
    assert layer.weight.device.type == "npu" and torch.equal(layer.weight.cpu(), torch.ones(3, 4))
    set_module_tensor_to_device(layer, "bias", "cpu", value=torch.full((3,), 2.0))
    assert layer.bias.device.type == "cpu" and layer.bias.requires_grad

    source = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    save_file(source.state_dict(), tmp_path / "model.safetensors")
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    load_checkpoint_in_model(model, str(tmp_path / "model.safetensors"), device_map={"0": "npu", "1": "cpu"})
    assert [p.device.type for p in model.parameters()] == ["npu", "npu", "cpu", "cpu"]
    for got, want in zip(model.state_dict().values(), source.state_dict().values(), strict=True):
        assert torch.equal(got.cpu(), want)


def _saved_for_backward(run):
    """`run()`'s result and the tensors autograd keeps for its backward, in the order they were saved."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return run(), saved


def _assert_saved_exactly(saved, expected):
    """The tensors kept are these very tensors (no float32 copy, no index copy), in any order."""
    assert len(saved) == len(expected) and all(any(s is e for s in saved) for e in expected), [
        (t.dtype, tuple(t.shape)) for t in saved
    ]


def _bf16_leaf(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).bfloat16().to("npu").requires_grad_()


def _grads_of(leaves, out):
    """The gradients of `out` (weighted by a fixed pattern) for `leaves`, as host tensors."""
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype).to(out.device)
    return [g.cpu() for g in torch.autograd.grad(out, leaves, weights)]


def _unpermute_float_math(permuted, sorted_indices, probs):
    """What the emulation computed through autograd before it kept the op's tensors: float32 inside, one cast."""
    top_k = probs.shape[1] if probs is not None else 1
    gathered = permuted[sorted_indices.long()].float().unflatten(0, (-1, top_k))
    if probs is not None:
        gathered = gathered * probs.float().unsqueeze(-1)
    return gathered.sum(dim=1).to(permuted.dtype)


@pytest.mark.parametrize(
    ("with_probs", "cann", "keeps_tokens"),
    [(True, "9.1.0", True), (False, "9.1.0", False), (False, "8.5.0", True)],
    ids=["probs", "no probs, CANN 9.1", "no probs, CANN 8.5"],
)
def test_npu_moe_token_unpermute_keeps_what_the_op_keeps_for_backward(cann_version, with_probs, cann, keeps_tokens):
    """op-plugin's adapter keeps sorted_indices, probs, and permuted_tokens only with probs or before CANN 9.1
    (MoeTokenUnpermuteKernelNpuOpApi.cpp; test_unpermute_backward_saved_tensors_*), never a float32 [T, K, H]
    copy; the gradients are those of the float32 math, bit for bit."""
    cann_version(cann)
    tokens, top_k = 6, 2 if with_probs else 1
    permuted = _bf16_leaf(tokens * top_k, 16)
    sorted_indices = torch.randperm(tokens * top_k, generator=torch.Generator().manual_seed(0)).int().to("npu")
    probs = torch.rand(tokens, top_k).to("npu").requires_grad_() if with_probs else None
    out, saved = _saved_for_backward(lambda: torch_npu.npu_moe_token_unpermute(permuted, sorted_indices, probs=probs))
    _assert_saved_exactly(saved, [sorted_indices] + [permuted] * keeps_tokens + ([probs] if with_probs else []))
    leaves = [permuted] + ([probs] if with_probs else [])
    grads = _grads_of(leaves, out)
    expected = _grads_of(leaves, _unpermute_float_math(permuted, sorted_indices, probs))
    assert [g.dtype for g in grads] == [torch.bfloat16] + [torch.float32] * with_probs  # each input's dtype
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))


def test_npu_moe_token_permute_keeps_only_sorted_indices_for_backward():
    """op-plugin derivatives.yaml: npu_moe_token_permute_grad_v2(grad, sorted_indices, tokens' rows and dtype);
    each token's gradient is the float32 sum of its K copies' gradients, cast once."""
    tokens = _bf16_leaf(5, 16)
    indices = torch.tensor([[0, 2], [1, 0], [2, 2], [0, 1], [1, 2]]).to("npu")
    (permuted, sorted_indices), saved = _saved_for_backward(lambda: torch_npu.npu_moe_token_permute(tokens, indices))
    _assert_saved_exactly(saved, [sorted_indices])
    (grad,) = _grads_of([tokens], permuted)
    weights = torch.linspace(-1, 1, permuted.numel()).reshape(permuted.shape).bfloat16()
    expected = weights.float()[sorted_indices.cpu().long()].unflatten(0, (5, 2)).sum(1).bfloat16()
    assert torch.equal(grad, expected)


def test_npu_swiglu_keeps_its_input_alone_for_backward():
    """op-plugin derivatives.yaml: npu_swiglu_backward(grad, self, dim); gradients as autograd of the float32 math."""
    x = _bf16_leaf(4, 3, 16)
    out, saved = _saved_for_backward(lambda: torch_npu.npu_swiglu(x, dim=-1))
    _assert_saved_exactly(saved, [x])
    gate, up = x.float().chunk(2, dim=-1)
    assert torch.equal(_grads_of([x], out)[0], _grads_of([x], (torch.nn.functional.silu(gate) * up).bfloat16())[0])


def test_npu_geglu_keeps_x_and_its_gelu_output_for_backward():
    """op-plugin derivatives.yaml: npu_geglu_grad(grad, self, result1, ...): x and the gelu output (x's dtype) are
    kept, and the other half's gradient is grad * that kept gelu (ops-nn's golden), float32 inside, one cast."""
    x = _bf16_leaf(4, 3, 16, scale=2.0)
    (out, gelu), saved = _saved_for_backward(lambda: torch_npu.npu_geglu(x, dim=-1, activate_left=True))
    _assert_saved_exactly(saved, [x, gelu])
    assert not gelu.requires_grad and gelu.dtype == out.dtype == torch.bfloat16
    gate, up = x.detach().cpu().float().chunk(2, dim=-1)
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape).bfloat16().float()
    _, slope = gelu_tanh_golden(gate)
    expected = torch.cat((weights * up * slope, weights * gelu.cpu().float()), dim=-1).bfloat16()
    (grad,) = _grads_of([x], out)
    torch.testing.assert_close(grad.float(), expected.float(), rtol=1e-2, atol=1e-3)  # one bf16 ulp
    assert torch.equal(grad[..., 8:], expected[..., 8:])  # the kept, rounded gelu: exactly


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_npu_rotary_mul_keeps_x_r1_and_r2_for_backward(mode):
    """op-plugin derivatives.yaml: npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode)."""
    x, r1, r2 = _bf16_leaf(2, 3, 4, 8), _bf16_leaf(1, 1, 4, 8), _bf16_leaf(1, 1, 4, 8)
    out, saved = _saved_for_backward(lambda: torch_npu.npu_rotary_mul(x, r1, r2, rotary_mode=mode))
    _assert_saved_exactly(saved, [x, r1, r2])
    expected = _grads_of([x, r1, r2], rotary_golden(x.float(), r1.float(), r2.float(), mode).bfloat16())
    assert all(torch.equal(g, e) for g, e in zip(_grads_of([x, r1, r2], out), expected, strict=True))


def test_npu_rms_norm_keeps_x_gamma_and_rstd_for_backward():
    """op-plugin derivatives.yaml: npu_rms_norm_backward(grad, self, gamma, rstd); gradients within float32
    rounding of autograd through the float32 math, in x's and gamma's dtypes."""
    x, gamma = _bf16_leaf(3, 5, 32, scale=4.0), _bf16_leaf(32)
    (y, rstd), saved = _saved_for_backward(lambda: torch_npu.npu_rms_norm(x, gamma))
    _assert_saved_exactly(saved, [x, gamma, rstd])
    reference = _rms_norm_math(x, gamma, dtype=torch.float32).bfloat16()
    for got, want in zip(_grads_of([x, gamma], y), _grads_of([x, gamma], reference), strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_npu_cross_entropy_loss_keeps_log_prob_and_target_for_backward(reduction):
    """op-plugin derivatives.yaml: npu_cross_entropy_loss_backward(grads[0], result1 (log_prob), target, weight, ...);
    gradients within float32 rounding of autograd through the float32 math, in the input's dtype."""
    x = _bf16_leaf(6, 40, scale=3.0)
    target = torch.tensor([0, 5, 39, 7, 7, 1], device="npu")
    (loss, log_prob, zloss, lse), saved = _saved_for_backward(
        lambda: torch_npu.npu_cross_entropy_loss(x, target, reduction=reduction)
    )
    _assert_saved_exactly(saved, [log_prob, target])
    assert log_prob.dtype == loss.dtype == torch.bfloat16 and zloss.numel() == lse.numel() == 0
    math = torch.nn.functional.cross_entropy(x.float(), target, reduction=reduction).reshape(loss.shape)
    torch.testing.assert_close(_grads_of([x], loss)[0].float(), _grads_of([x], math)[0].float(), rtol=2e-2, atol=1e-3)


def test_a_recorded_backward_of_an_op_without_a_derivative_warns_and_passes_no_second_order():
    """create_graph=True through npu_rms_norm: its backward op has no derivative (derivatives.yaml), so torch_npu's
    autograd fallback gives the first-order gradient a node that warns and passes nothing: a Hessian-vector product
    through it misses the norm's second order, as on the device (the cards differentiate eager's math instead)."""
    x = torch.randn(3, 16).to("npu").requires_grad_()
    gamma = torch.randn(16).to("npu").requires_grad_()
    y, _ = torch_npu.npu_rms_norm(x, gamma)
    (grad_x,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    assert grad_x.requires_grad  # connected, as the fallback connects it
    with pytest.warns(UserWarning, match="npu_rms_norm_backward: an autograd kernel was not registered"):
        grad_x.sum().backward()
    for leaf in (x, gamma):  # no second-order gradient reaches them
        assert leaf.grad is None or not leaf.grad.cpu().any()


@pytest.mark.parametrize("keep_prob", [1.0, 0.9])
def test_npu_fusion_attention_keeps_what_its_node_keeps_for_backward(keep_prob):
    """op-plugin derivatives.yaml:149: the node keeps query, key, value, atten_mask, sink and the results
    attention_out, softmax_max, softmax_sum (float32 [B, N, Sq, 8]) and the empty softmax_out, never the float32
    probabilities nor, with dropout, a mask (only the seed, offset and numels ints: the grad regenerates it)."""
    q, k, v = _bf16_leaf(1, 4, 6, 8), _bf16_leaf(1, 2, 6, 8), _bf16_leaf(1, 2, 6, 8)
    sink = torch.zeros(4).to("npu").requires_grad_()
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1).to("npu")
    out, saved = _saved_for_backward(
        lambda: torch_npu.npu_fusion_attention(
            q, k, v, 4, "BNSD", atten_mask=mask, scale=0.3, keep_prob=keep_prob, sparse_mode=3, sink=sink
        )
    )
    _assert_saved_exactly(saved, [q, k, v, mask, sink, *out[:4]])
    assert out[1].dtype == out[2].dtype == torch.float32 and tuple(out[1].shape) == (1, 4, 6, 8)
    assert out[3].numel() == 0
    grads = torch.autograd.grad(out[0], [q, k, v, sink], torch.ones_like(out[0]))
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3 + [torch.float32]


def test_npu_fusion_attention_refuses_host_tensors():
    """The adapter refuses a tensor that is not on the npu, optional ones included (FlashAttentionKernelNpuOpApi.cpp:
    format_trans, lines 77-87); the call is counted, as every emulated op's is."""
    q, k, v = (torch.randn(1, 2, 4, 8).to("npu") for _ in range(3))
    host_mask = torch.zeros(4, 4, dtype=torch.bool)
    with emulation.count_op_calls() as calls, pytest.raises(RuntimeError, match="expected atten_mask on an npu device"):
        torch_npu.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=host_mask)
    assert calls["npu_fusion_attention"] == 1
    with pytest.raises(RuntimeError, match="expected query on an npu device"):
        torch_npu.npu_fusion_attention(q.cpu(), k, v, 2, "BNSD")
