"""The emulated npu device and torch_npu ops: real numbers, real dtypes, real failures."""

from __future__ import annotations

import pytest
import torch
import torch_npu
from npu_hub_kernels import emulation


def _rms_norm_reference(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * gamma.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 48), (2, 3, 4, 16)])
def test_npu_rms_norm_matches_fp32_then_cast(dtype, shape):
    x = torch.randn(shape, dtype=dtype)
    gamma = torch.randn(shape[-1], dtype=dtype)
    y, rstd = torch_npu.npu_rms_norm(x.to("npu"), gamma.to("npu"), epsilon=1e-5)
    assert y.device.type == "npu" and y.dtype == dtype and y.shape == x.shape
    assert rstd.dtype == torch.float32 and rstd.shape == (*shape[:-1], 1)
    x32 = x.float()
    fp32_then_cast = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma.float()).to(dtype)
    assert torch.equal(y.cpu(), fp32_then_cast)
    torch.testing.assert_close(y.cpu().double(), _rms_norm_reference(x, gamma, 1e-5), **_tol(dtype))


def _tol(dtype):
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}.get(
        dtype, dict(rtol=2e-3, atol=2e-3)
    )


def test_npu_rms_norm_two_dim_gamma_normalises_trailing_dims():
    x = torch.randn(2, 3, 4, 8)
    gamma = torch.randn(4, 8)
    y, rstd = torch_npu.npu_rms_norm(x.to("npu"), gamma.to("npu"))
    assert rstd.shape == (2, 3, 1, 1)
    x64 = x.double()
    expected = x64 * torch.rsqrt(x64.pow(2).mean((-2, -1), keepdim=True) + 1e-6) * gamma.double()
    torch.testing.assert_close(y.cpu().double(), expected, rtol=1e-5, atol=1e-5)


def test_npu_rms_norm_bf16_input_with_fp32_gamma():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    gamma = torch.randn(32)
    y, _ = torch_npu.npu_rms_norm(x.to("npu"), gamma.to("npu"))
    assert y.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("x", "gamma", "message"),
    [
        (torch.randn(4, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64), "not supported"),
        (torch.randn(4, 8), torch.randn(8, dtype=torch.bfloat16), "gamma dtype"),
        (torch.randn(8), torch.randn(8), "2 to 8 dims"),
        (torch.randn(4, 8), torch.randn(6), "trailing dims"),
    ],
)
def test_npu_rms_norm_rejects_what_the_real_op_rejects(x, gamma, message):
    with pytest.raises(RuntimeError, match=message):
        torch_npu.npu_rms_norm(x.to("npu"), gamma.to("npu"))


def test_npu_rms_norm_backward_matches_fp64_autograd():
    x = torch.randn(3, 5, 32, requires_grad=True)
    gamma = torch.randn(32, requires_grad=True)
    x_npu = x.detach().to("npu").requires_grad_()
    gamma_npu = gamma.detach().to("npu").requires_grad_()
    torch_npu.npu_rms_norm(x_npu, gamma_npu)[0].pow(2).sum().backward()
    _rms_norm_reference(x, gamma, 1e-6).pow(2).sum().backward()
    torch.testing.assert_close(x_npu.grad.cpu(), x.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gamma_npu.grad.cpu(), gamma.grad, rtol=1e-4, atol=1e-4)


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


def test_host_reports_cann_and_kernels_sees_it():
    from kernels.backends import _backend

    assert torch_npu.utils.collect_env.get_cann_version() == emulation.DEFAULT_CANN_VERSION
    assert _backend().variant_str == "cann91"
    emulation.set_cann_version("8.3.RC1")
    try:
        assert _backend().variant_str == "cann83"
    finally:
        emulation.set_cann_version(emulation.DEFAULT_CANN_VERSION)
    with pytest.raises(ValueError, match="CANN versions look like"):
        emulation.set_cann_version("9")


def test_ops_transformers_imports_but_no_card_uses_say_so():
    with pytest.raises(NotImplementedError, match="not emulated"):
        torch_npu.npu_fusion_attention()
