"""npu-rms-norm, op level: the card's functions against a float64 reference, and which path runs.

Parity follows flash-attention's idiom: the kernel's error against float64 is at most twice the
error of transformers' eager math in the same dtype. The fused path is proven by the emulated op's
call counter; every fallback case is proven to skip it and to equal the eager math exactly.
"""

from __future__ import annotations

import contextlib
import importlib
import random
import sys
import types

import pytest
import torch
import torch.utils._pytree as pytree
from numerics import assert_within_twice_eagers_error

from npu_hub_kernels.testing import emulation

SCALINGS = ["plain", "zero_centered", "float32_scale"]


def reference_fp64(x: torch.Tensor, weight: torch.Tensor, eps: float, scaling: str) -> torch.Tensor:
    x64 = x.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    scale = 1.0 + weight.double() if scaling == "zero_centered" else weight.double()
    return normed * scale


def random_cases(count: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(count):
        hidden = rng.choice([1, 7, 16, 80, 128, 257, 1024])
        lead = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
        yield (*lead, hidden), rng.choice([1e-6, 1e-5])


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_error_at_most_twice_eager_error(card, scaling, dtype):
    for shape, eps in random_cases(12, seed=hash((scaling, str(dtype))) % 1000):
        x = torch.randn(shape, dtype=dtype) * 3
        weight = (torch.randn(shape[-1]) * 0.5 + (0.0 if scaling == "zero_centered" else 1.0)).to(dtype)
        with emulation.count_op_calls() as calls:
            fused = card.rms_norm(x.to("npu"), weight.to("npu"), eps, scaling).cpu()
        # no autograd: a zero-centred norm runs as one npu_gemma_rms_norm, the others on npu_rms_norm
        one_kernel = scaling == "zero_centered"
        assert (calls["npu_gemma_rms_norm"], calls["npu_rms_norm"]) == ((1, 0) if one_kernel else (0, 1))
        eager = card.rms_norm_eager(x, weight, eps, scaling)
        assert fused.dtype == eager.dtype and fused.shape == eager.shape
        reference = reference_fp64(x, weight, eps, scaling)
        assert_within_twice_eagers_error(fused, eager, reference, shape)


@pytest.mark.parametrize("scaling", ["zero_centered", "float32_scale"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_is_exact_where_the_math_is_fp32_then_cast(card, scaling, dtype):
    x = torch.randn(3, 5, 64, dtype=dtype)
    weight = torch.randn(64, dtype=dtype)
    fused = card.rms_norm(x.to("npu"), weight.to("npu"), 1e-6, scaling).cpu()
    assert torch.equal(fused, card.rms_norm_eager(x, weight, 1e-6, scaling))


@pytest.mark.parametrize("scaling", SCALINGS)
def test_backward_matches_eager(card, scaling):
    x = torch.randn(2, 6, 32, requires_grad=True)
    weight = torch.randn(32, requires_grad=True)
    card.rms_norm_eager(x, weight, 1e-6, scaling).pow(2).sum().backward()
    x_npu = x.detach().to("npu").requires_grad_()
    w_npu = weight.detach().to("npu").requires_grad_()
    with emulation.count_op_calls() as calls:
        card.rms_norm(x_npu, w_npu, 1e-6, scaling).pow(2).sum().backward()
    assert calls["npu_rms_norm"] == 1
    torch.testing.assert_close(x_npu.grad.cpu(), x.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w_npu.grad.cpu(), weight.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_an_inference_tensor_input_trains_the_weight_as_eager_does(card, scaling, layout):
    """inputs_embeds made under torch.inference_mode (a frozen encoder's features) reach the first norm as an
    inference tensor, which torch refuses to keep for backward: the op is given a copy, and the weight's gradient is
    eager's (eager keeps only tensors it made)."""
    with torch.inference_mode():
        x = torch.randn(2, 6, 4, 32).to("npu")
    x = x if layout == "contiguous" else x.transpose(1, 2)
    weight = torch.randn(32)
    w_eager = weight.clone().requires_grad_()
    card.rms_norm_eager(x.cpu(), w_eager, 1e-6, scaling).pow(2).sum().backward()
    w_npu = weight.to("npu").requires_grad_()
    with emulation.count_op_calls() as calls:
        out = card.rms_norm(x, w_npu, 1e-6, scaling)
        out.pow(2).sum().backward()
    assert calls["npu_rms_norm"] == 1 and out.shape == x.shape
    torch.testing.assert_close(out.detach().cpu(), card.rms_norm_eager(x.cpu(), weight, 1e-6, scaling))
    torch.testing.assert_close(w_npu.grad.cpu(), w_eager.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_an_inference_tensor_weight_with_an_input_that_trains_answers_where_eager_does(card, scaling):
    """A norm weight made under torch.inference_mode (a frozen model loaded there) with an input that trains. Eager's
    zero-centred norm keeps only `1 + weight`, a tensor it made, and answers: the fused path, which keeps the weight
    for eager's second order, keeps a copy and gives eager's gradient. The other two keep the weight itself, eager's
    multiply as npu_rms_norm: both raise torch's error."""
    with torch.inference_mode():
        weight = torch.randn(32).to("npu")
    x = torch.randn(2, 6, 32).to("npu")
    results = {}
    for name, norm in (("eager", card.rms_norm_eager), ("fused", card.rms_norm)):
        x_grad = x.clone().requires_grad_()
        try:
            norm(x_grad, weight, 1e-6, scaling).pow(2).sum().backward()
            results[name] = x_grad.grad.cpu()
        except RuntimeError as error:
            results[name] = str(error).splitlines()[0]
    if scaling == "zero_centered":
        torch.testing.assert_close(results["fused"], results["eager"], rtol=1e-4, atol=1e-5)
    else:
        assert results["fused"] == results["eager"] and "Inference tensors cannot be saved" in results["eager"]


GEMMA3_NORM_INPUTS = {
    "hidden states [B, S, H]": lambda: torch.randn(2, 5, 96) * 3,
    "q/k norm input [B, N, S, D], a transpose of [B, S, N, D] memory": lambda: (torch.randn(2, 5, 4, 64) * 3).transpose(
        1, 2
    ),
}


@pytest.mark.parametrize("inputs", list(GEMMA3_NORM_INPUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gemma3_norms_forward_and_backward_at_most_twice_eagers_error(card, inputs, dtype):
    """Gemma3's zero-centred norms as its decoder layer calls them, with grad (npu_rms_norm on 1 + weight) and without
    (one npu_gemma_rms_norm): forward and gradients within twice eager's error against float64, and the output in
    eager's layout (the q/k norm's transposed input is not copied)."""
    x = GEMMA3_NORM_INPUTS[inputs]().to(dtype)
    weight = (torch.randn(x.shape[-1]) * 0.5).to(dtype)
    grad_y = torch.randn(x.shape, dtype=torch.float64)
    x64, w64 = (t.double().requires_grad_() for t in (x, weight))
    reference = reference_fp64(x64, w64, 1e-6, "zero_centered")
    reference_grads = torch.autograd.grad(reference, (x64, w64), grad_y)
    results = {}
    for name, function in (("eager", card.rms_norm_eager), ("fused", card.rms_norm)):
        x_npu, w_npu = (t.to("npu").requires_grad_() for t in (x, weight))
        with emulation.count_op_calls() as calls:
            out = function(x_npu, w_npu, 1e-6, "zero_centered")
            grads = torch.autograd.grad(out, (x_npu, w_npu), grad_y.to(dtype).to("npu"))
            with torch.inference_mode():
                inference_out = function(x_npu, w_npu, 1e-6, "zero_centered")
        fused = name == "fused"
        assert (calls["npu_rms_norm"], calls["npu_gemma_rms_norm"]) == ((1, 1) if fused else (0, 0))
        assert out.stride() == inference_out.stride() == x.stride()
        results[name] = [t.cpu().double() for t in (out, *grads, inference_out)]
    for index, want in enumerate((reference, *reference_grads, reference)):
        assert_within_twice_eagers_error(results["fused"][index], results["eager"][index], want.detach(), index)


def test_one_kernel_reasons(card, monkeypatch):
    """Where the zero-centred norm does not run as one npu_gemma_rms_norm, npu_rms_norm on 1 + weight runs and
    `rms_norm_unavailable_reason(..., one_kernel=True)` says why; the call gives eager's result either way."""
    x, weight = (torch.randn(4, 16) * 3).bfloat16(), (torch.randn(16) * 0.5).bfloat16()
    torch_npu = emulation.install()
    cases = {
        "plain": (x.float(), weight.float(), "plain", "zero_centered) only"),  # exact in float32
        "float32 weight": (x, weight.float(), "zero_centered", "takes gamma in x's dtype"),
        "x with overlapping rows": (x[:1].to("npu").expand(4, 16), weight, "zero_centered", "contiguous tensors only"),
        "no such op": (x, weight, "zero_centered", "this torch_npu has no npu_gemma_rms_norm"),
        "Ascend 950": (x, weight, "zero_centered", "Atlas A2/A3 only"),
    }
    for case, (x_case, w_case, scaling, reason) in cases.items():
        with monkeypatch.context() as patch:
            if case == "no such op":
                patch.delattr(torch_npu, "npu_gemma_rms_norm")
            if case == "Ascend 950":
                patch.setattr(torch.npu, "get_device_name", lambda device=None: "Ascend950PR")
            x_npu, w_npu = x_case.to("npu"), w_case.to("npu")
            assert reason in card.rms_norm_unavailable_reason(x_npu, w_npu, scaling, one_kernel=True), case
            assert card.rms_norm_unavailable_reason(x_npu, w_npu, scaling) is None
            with torch.inference_mode(), emulation.count_op_calls() as calls:
                out = card.rms_norm(x_npu, w_npu, 1e-6, scaling).cpu()
        assert (calls["npu_gemma_rms_norm"], calls["npu_rms_norm"]) == (0, 1), case
        eager = card.rms_norm_eager(x_case.cpu(), w_case.cpu(), 1e-6, scaling)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
    x_npu, w_npu = (t.to("npu").requires_grad_() for t in (x, weight))
    assert "autograd records" in card.rms_norm_unavailable_reason(x_npu, w_npu, "zero_centered", one_kernel=True)
    with torch.no_grad():
        assert card.rms_norm_unavailable_reason(x_npu, w_npu, "zero_centered", one_kernel=True) is None


def _fallback_cases():
    w = torch.randn(16)
    return {
        "float64": (torch.randn(4, 16, dtype=torch.float64), w.double(), "plain", "float64"),
        "empty batch": (torch.randn(0, 5, 16), w, "plain", "empty input"),
        "one dim": (torch.randn(16), w, "plain", "2 to 8 dims"),
        "weight dtype differs": (torch.randn(4, 16, dtype=torch.bfloat16), w, "plain", "differs from input dtype"),
        "fp16 input, bf16 weight": (
            torch.randn(4, 16, dtype=torch.float16),
            w.bfloat16(),
            "float32_scale",
            "input dtype or float32",
        ),
    }


@pytest.mark.parametrize("case", list(_fallback_cases()))
def test_unsupported_inputs_take_the_exact_eager_path(card, case):
    x, weight, scaling, reason = _fallback_cases()[case]
    assert reason in card.rms_norm_unavailable_reason(x.to("npu"), weight.to("npu"), scaling)
    with emulation.count_op_calls() as calls:
        out = card.rms_norm(x.to("npu"), weight.to("npu"), 1e-6, scaling)
    assert calls["npu_rms_norm"] == calls["npu_gemma_rms_norm"] == 0
    assert out.device.type == "npu"
    assert torch.equal(out.cpu(), card.rms_norm_eager(x, weight, 1e-6, scaling))


def test_host_tensors_take_the_eager_path(card):
    x, weight = torch.randn(4, 16), torch.randn(16)
    assert "not on an npu device" in card.rms_norm_unavailable_reason(x, weight, "plain")
    with emulation.count_op_calls() as calls:
        out = card.rms_norm(x, weight, 1e-6)
    assert calls["npu_rms_norm"] == 0 and out.device.type == "cpu"
    assert torch.equal(out, card.rms_norm_eager(x, weight, 1e-6))


def test_non_contiguous_input_is_fused_and_correct(card):
    x = torch.randn(4, 16, 6).transpose(1, 2)  # [4, 6, 16], last-dim stride 6
    weight = torch.randn(16)
    assert not x.is_contiguous()
    with emulation.count_op_calls() as calls:
        out = card.rms_norm(x.to("npu"), weight.to("npu"), 1e-6).cpu()
    assert calls["npu_rms_norm"] == 1
    torch.testing.assert_close(out, card.rms_norm_eager(x, weight, 1e-6), rtol=1e-6, atol=1e-6)


def test_layers_follow_the_kernels_layer_rules(card):
    for name in ("RMSNorm", "RMSNormZeroCentered", "RMSNormFloat32Scale"):
        layer = getattr(card.layers, name)
        assert layer.__init__ is torch.nn.Module.__init__
        assert layer.has_backward is True and layer.can_torch_compile is False


@pytest.mark.parametrize("scaling", ["zero-centered", "gemma", None, "Plain", ""])
@pytest.mark.parametrize("device", ["cpu", "npu"])
def test_unknown_scaling_is_refused_naming_the_accepted_ones(card, scaling, device):
    x, weight = torch.randn(2, 8).to(device), torch.ones(8).to(device)
    for call in (card.rms_norm, card.rms_norm_eager):
        with pytest.raises(ValueError, match="pass one of 'plain', 'zero_centered', 'float32_scale'"):
            call(x, weight, 1e-6, scaling)
    with pytest.raises(ValueError, match=f"scaling={scaling!r}"):
        card.rms_norm_unavailable_reason(x, weight, scaling)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_a_hessian_vector_product_is_eagers(card, scaling):
    """Issue 30: npu_rms_norm_backward has no derivative (torch_npu's autograd fallback, which the emulation follows,
    warns and passes none when autograd records a backward), so the card differentiates eager's math in a recorded
    backward: the second-order gradients are eager's, the forward and a plain backward still the fused op's."""
    generator = torch.Generator().manual_seed(3)
    x, weight, v_x, v_w = (torch.randn(shape, generator=generator) for shape in ((2, 6, 32), (32,), (2, 6, 32), (32,)))
    results = {}
    for name, function in (("eager", card.rms_norm_eager), ("fused", card.rms_norm)):
        x_npu, w_npu = (t.to("npu").requires_grad_() for t in (x, weight))
        with emulation.count_op_calls() as calls:
            loss = function(x_npu, w_npu, 1e-6, scaling).pow(3).sum()
            grad_x, grad_w = torch.autograd.grad(loss, (x_npu, w_npu), create_graph=True)
            ((grad_x * v_x.to("npu")).sum() + (grad_w * v_w.to("npu")).sum()).backward()  # the product with (v_x, v_w)
        assert calls["npu_rms_norm"] == (name == "fused")
        results[name] = (x_npu.grad.cpu(), w_npu.grad.cpu())
    for got, want in zip(results["fused"], results["eager"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _gemma3_norm(dtype: torch.dtype, hidden: int = 64) -> torch.nn.Module:
    """transformers' Gemma3RMSNorm on the npu, its weight random around 0 (zero-centred), in `dtype`."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    norm = Gemma3RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(5)) * 0.5)
    return norm.to(dtype).to("npu")


def _norm_ops(card, norm: torch.nn.Module, x: torch.Tensor) -> dict[str, int]:
    """The device ops of the card's norm of x with the norm's weight, forward and backward (`count_device_ops`)."""
    from bench.accounting import count_device_ops

    x, grad_out = x.detach().requires_grad_(), torch.ones_like(x)
    with count_device_ops() as tally:
        out = card.rms_norm(x, norm.weight, norm.eps, "zero_centered")
        torch.autograd.grad(out, (x, norm.weight), grad_out)
    return tally.by_op()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_gemma3_norm_with_grad_runs_its_documented_minimum_of_four_ops(card, dtype, monkeypatch):
    """Gemma3's norm with grad: `1 + weight.float()` as one add (a bfloat16 weight plus the card's float32 1, one
    mixed-dtype aclnnAdd), npu_rms_norm, npu_rms_norm_backward and autograd's one cast of the float32 dweight: 4 ops
    (a float32 weight: the add and the two norm ops, 3). The negative control, eager's cast-then-add, counts 5 with a
    bfloat16 weight."""
    norm, x = _gemma3_norm(dtype), (torch.randn(2, 5, 64) * 3).to(dtype).to("npu")
    _norm_ops(card, norm, x)  # the first call on a device makes the kept float32 1 (once per process)
    ops = _norm_ops(card, norm, x)
    bf16 = dtype == torch.bfloat16
    assert ops == {"add": 1, "npu_rms_norm": 1, "npu_rms_norm_backward": 1, **({"_to_copy": 1} if bf16 else {})}
    assert sum(ops.values()) == (4 if bf16 else 3)
    rms_norm_module = sys.modules[f"{card.__name__}.rms_norm"]
    monkeypatch.setattr(rms_norm_module, "_one_plus", lambda weight: 1.0 + weight.float())  # eager's two kernels
    assert sum(_norm_ops(card, norm, x).values()) == (5 if bf16 else 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_gemma3_norm_with_grad_gives_eagers_forward_and_gradients(card, dtype):
    """Against transformers' Gemma3RMSNorm itself: the forward equals eager's exactly (float32 inside, `1 + w` in
    float32 as eager adds it, one rounding at the end), both gradients within twice eager's error against float64."""
    norm = _gemma3_norm(dtype)
    x = (torch.randn(2, 5, 64) * 3).to(dtype)
    grad_y = torch.randn(x.shape, dtype=torch.float64)
    x64, w64 = x.double().requires_grad_(), norm.weight.detach().cpu().double().requires_grad_()
    reference = reference_fp64(x64, w64, 1e-6, "zero_centered")
    reference_grads = torch.autograd.grad(reference, (x64, w64), grad_y)
    results = {}
    for name, function in (
        ("eager", norm),
        ("fused", lambda h: card.rms_norm(h, norm.weight, norm.eps, "zero_centered")),
    ):
        x_npu = x.to("npu").requires_grad_()
        with emulation.count_op_calls() as calls:
            out = function(x_npu)
            grads = torch.autograd.grad(out, (x_npu, norm.weight), grad_y.to(dtype).to("npu"))
        assert calls["npu_rms_norm"] == (name == "fused")
        assert grads[1].dtype == dtype
        results[name] = [t.cpu() for t in (out, *grads)]
    assert torch.equal(results["fused"][0], results["eager"][0])
    for index, want in enumerate(reference_grads, start=1):
        got, eager = (results[name][index].double() for name in ("fused", "eager"))
        assert_within_twice_eagers_error(got, eager, want, index)


def test_the_kept_float32_one_is_per_device_and_mode_and_no_state_of_the_module(card, monkeypatch):
    """The float32 1 of `1 + weight` (`device_constant`): one per device, made outside inference mode even when the
    first call is inside it (a training call after it may keep it), made anew for fake tensors of another fake mode
    (the bench's fresh modes cannot mix), and no parameter or buffer of the norm."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    constants = sys.modules[f"{card.__name__}._device_constants"]
    monkeypatch.setattr(constants, "_CONSTANTS", {})
    one_plus = sys.modules[f"{card.__name__}.rms_norm"]._one_plus
    norm = _gemma3_norm(torch.bfloat16)
    x = (torch.randn(3, 64) * 3).half().to("npu")  # float16 x, bfloat16 weight: never one npu_gemma_rms_norm
    with torch.inference_mode():
        inference_out = card.rms_norm(x, norm.weight, norm.eps, "zero_centered")
    ((_, device), one), *others = constants._CONSTANTS.items()
    assert not others and device == x.device and not one.is_inference()
    assert (one.dtype, one.shape, one.item()) == (torch.float32, (1,), 1.0)
    out = card.rms_norm(x.requires_grad_(), norm.weight, norm.eps, "zero_centered")
    out.sum().backward()
    assert torch.equal(out.detach().cpu(), inference_out.cpu()) and norm.weight.grad.dtype == torch.bfloat16
    assert [name for name, _ in norm.named_parameters()] == ["weight"] and not list(norm.named_buffers())
    for device in ("cpu", "meta"):
        weight = norm.weight.detach().to(device)
        assert one_plus(weight).device == weight.device and one_plus(weight).dtype == torch.float32
    modes = [FakeTensorMode(), FakeTensorMode()]
    for mode in modes:
        with mode:
            weight = torch.empty(64, dtype=torch.bfloat16, device="npu")
            assert one_plus(weight).fake_mode is mode
    assert len(constants._CONSTANTS) == 3  # npu (the last fake mode's), cpu, meta
    assert torch.equal(one_plus(norm.weight.detach()).cpu(), 1.0 + norm.weight.detach().cpu().float())


def test_the_kept_float32_one_stays_float32_when_zero_init_wraps_torch_ones(card, monkeypatch):
    """DeepSpeed's `zero.Init` wraps torch.ones to cast what it makes to the training dtype in place: a first call
    inside it must still keep a float32 1, or every later `1 + weight` of the process is rounded to bfloat16. The
    Gemma3 norm then gives eager's forward exactly, inside the wrapper and after it. Negative control: the wrapper
    does make torch.ones bfloat16."""
    from deepspeed.runtime.zero import partition_parameters

    constants = sys.modules[f"{card.__name__}._device_constants"]
    monkeypatch.setattr(constants, "_CONSTANTS", {})
    norm = _gemma3_norm(torch.bfloat16)
    x = (torch.randn(2, 5, 64) * 3).bfloat16().to("npu").requires_grad_()
    wrapped = partition_parameters.zero_wrapper_for_fp_tensor_constructor(torch.ones, torch.bfloat16, None)
    assert wrapped(1, dtype=torch.float32, device="npu").dtype == torch.bfloat16  # the negative control
    with monkeypatch.context() as inside_zero_init:
        inside_zero_init.setattr(torch, "ones", wrapped)
        with emulation.count_op_calls() as calls:
            inside = card.rms_norm(x, norm.weight, norm.eps, "zero_centered")
        assert calls["npu_rms_norm"] == 1
    assert [one.dtype for one in constants._CONSTANTS.values()] == [torch.float32]
    after = card.rms_norm(x, norm.weight, norm.eps, "zero_centered")
    assert torch.equal(inside, norm(x)) and torch.equal(after, norm(x))


def test_fake_tensors_used_outside_their_mode_get_the_kept_one_of_their_mode(card, monkeypatch):
    """PyTorch runs a fake tensor's ops in its own fake mode outside `with mode:` too (eager's Gemma3 norm does): the
    kept 1 is made in that mode, not as a real npu tensor the fake weight could not be added to."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    constants = sys.modules[f"{card.__name__}._device_constants"]
    monkeypatch.setattr(constants, "_CONSTANTS", {})
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(2, 5, 64, dtype=torch.bfloat16, device="npu", requires_grad=True)
        weight = torch.nn.Parameter(torch.empty(64, dtype=torch.bfloat16, device="npu"))
    out = card.rms_norm(x, weight, 1e-6, "zero_centered")  # outside the mode
    x_grad, weight_grad = torch.autograd.grad(out.float().sum(), (x, weight))
    assert out.fake_mode is mode and (out.shape, out.dtype) == (x.shape, x.dtype)
    assert (x_grad.dtype, weight_grad.dtype) == (torch.bfloat16, torch.bfloat16)
    assert [one.fake_mode for one in constants._CONSTANTS.values()] == [mode]


@pytest.mark.parametrize("route", ["rms_norm", "the layer, no grad"])
def test_a_call_that_read_like_a_fused_one_skips_the_check_and_any_change_is_refused_as_before(
    card, route, monkeypatch
):
    """`rms_norm` remembers what its check read of the calls it let fuse (scaling, x's and the weight's class, device,
    dtype and shape) and skips the check for a call that reads the same; so does the layer, whose no-grad call of such
    inputs runs the op itself (`layer_forward`). Negative control: the same inputs again are not checked. Each change
    of one of those, the weight changed in place included (same Parameter, `.data` reassigned), is checked afresh and
    refused with the check's reason, eager's result; a torch.func transform is seen on every call; requires_grad,
    which only the one-kernel form reads, still turns that form off."""
    rms_norm_module = sys.modules[f"{card.__name__}.rms_norm"]
    eager_record = sys.modules[f"{card.__name__}._fallbacks"].eager_record
    check, checked = rms_norm_module._fused_unavailable_reason, []
    rms_norm_module._FUSING_INPUTS.clear()  # the set itself: the layers hold it by name
    owner = torch.nn.Module()
    owner.variance_epsilon = 1e-6
    owner.forward = types.MethodType(card.layers.RMSNorm.forward, owner)  # as kernelize binds it

    layer_calls = []
    monkeypatch.setattr(
        card.layers, "rms_norm", lambda *args, **kwargs: layer_calls.append(1) or card.rms_norm(*args, **kwargs)
    )

    def call(x, weight, scaling):
        if route == "rms_norm" or scaling != "plain":
            return card.rms_norm(x, weight, 1e-6, scaling, module=owner)
        owner._parameters["weight"] = weight  # the norm's weight, whatever it is (a plain tensor included)
        with torch.no_grad():
            return owner(x)

    def run(x, weight, scaling="plain"):
        with emulation.count_op_calls() as calls, _recording_checks(rms_norm_module, checked, check):
            out = call(x, weight, scaling)
        fused = calls["npu_rms_norm"] + calls["npu_gemma_rms_norm"]
        if not fused:
            assert torch.equal(out.cpu(), card.rms_norm_eager(x.cpu(), weight.detach().cpu(), 1e-6, scaling))
        return fused, eager_record(owner).last if eager_record(owner) else None

    x = torch.randn(4, 16, dtype=torch.bfloat16).to("npu")
    weight = torch.nn.Parameter(torch.randn(16, dtype=torch.bfloat16).to("npu"), requires_grad=False)
    assert run(x, weight) == (1, None) and len(checked) == 1
    assert run(x.clone(), weight) == (1, None) and len(checked) == 1  # the negative control: remembered, not checked
    assert len(layer_calls) == (1 if route == "the layer, no grad" else 0)  # the layer ran the op itself the 2nd time
    changes = {
        "x dtype": (lambda: (x.half(), weight), "differs from input dtype"),
        "both on the host": (lambda: (x.cpu(), weight.data.cpu()), "not on an npu device"),
        "x rank": (lambda: (x[0], weight), "2 to 8 dims"),
        "x empty": (lambda: (x[:0], weight), "empty input"),
        "x width": (lambda: (x[:, :1].contiguous(), weight), "does not match the last dim"),
        "weight dtype in place": (lambda: (x, _reassigned(weight, weight.data.float())), "differs from input dtype"),
        "weight shape in place": (lambda: (x, _reassigned(weight, weight.data.view(1, 16))), "does not match the last"),
    }
    for case, (change, reason) in changes.items():
        original = weight.data
        fused, last = run(*change())
        assert fused == 0 and reason in last, case
        weight.data = original
        assert run(x, weight) == (1, None), case  # back to the remembered inputs: fused again, not checked
    assert len(checked) == 1 + len(changes)
    x16, w32 = x.clone(), weight.data.float()
    assert run(x16, w32, "float32_scale") == (1, None)  # a float32 weight fuses at float32_scale ...
    assert "differs from input dtype" in run(x16, w32, "plain")[1]  # ... the same tensors at another scaling do not
    if route == "the layer, no grad":  # Olmo2's layer on its float32 weight: its second call runs the op itself
        olmo = torch.nn.Module()
        olmo.variance_epsilon, olmo.weight = 1e-6, torch.nn.Parameter(w32, requires_grad=False)
        olmo.forward = types.MethodType(card.layers.RMSNormFloat32Scale.forward, olmo)
        calls_before = len(layer_calls)
        rms_norm_module._FUSING_INPUTS.clear()  # its first call checked
        with torch.no_grad(), emulation.count_op_calls() as calls:
            outs = [olmo(x16) for _ in range(2)]
        assert calls["npu_rms_norm"] == 2 and len(layer_calls) == calls_before + 1  # the negative control: the 1st
        expected = card.rms_norm_eager(x16.cpu(), w32.cpu(), 1e-6, "float32_scale")
        assert all(torch.equal(out.cpu(), expected) for out in outs)
    with torch.no_grad(), emulation.count_op_calls() as calls, _recording_checks(rms_norm_module, checked, check):
        # x itself, not the batched rows: on the device a batched tensor is a torch.Tensor on the npu too
        torch.func.vmap(lambda rows: rows + call(x, weight, "plain"))(torch.stack([x, x]))
    assert calls["npu_rms_norm"] == 0 and "vmap transform is active" in eager_record(owner).last
    gemma_weight = weight.data.clone()
    with emulation.count_op_calls() as calls:
        with torch.no_grad():
            card.rms_norm(x, gemma_weight, 1e-6, "zero_centered")
        card.rms_norm(x, gemma_weight.requires_grad_(), 1e-6, "zero_centered")  # read as the call before, but
    assert (calls["npu_gemma_rms_norm"], calls["npu_rms_norm"]) == (1, 1)  # autograd records it: the other form


@contextlib.contextmanager
def _recording_checks(module, checked: list, check):
    """Inside: each call of the card's check appends its arguments to `checked` first."""
    module._fused_unavailable_reason = lambda *args: checked.append(args) or check(*args)
    try:
        yield
    finally:
        module._fused_unavailable_reason = check


def _reassigned(weight: torch.nn.Parameter, data: torch.Tensor) -> torch.nn.Parameter:
    """The same Parameter with its data replaced in place (as `module.to(dtype)` does): its identity unchanged."""
    weight.data = data
    return weight


@pytest.mark.parametrize(("family", "norm_class"), [("llama", "LlamaRMSNorm"), ("gemma3", "Gemma3RMSNorm")])
def test_the_layer_reads_weight_and_epsilon_without_the_modules_getattr(card, monkeypatch, family, norm_class):
    """Llama's norms name their epsilon `variance_epsilon`, Gemma's `eps`: a name read as an attribute that the module
    lacks goes through nn.Module.__getattr__, which raises and is caught (about 1 us a call). The layer reads the
    weight and both names where the module holds them: no __getattr__ call in its call, for either family, and eager's
    result. Negative control: reading a name the module lacks is counted."""
    norm_type = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), norm_class)
    layer = card.layers.RMSNormZeroCentered if family == "gemma3" else card.layers.RMSNorm
    norm = norm_type(16, eps=1e-5).to("npu")
    norm.forward = types.MethodType(layer.forward, norm)  # as kernelize binds it
    x = torch.randn(2, 16).to("npu")
    expected = norm_type.forward(norm, x)
    getattr_calls = []
    original = torch.nn.Module.__getattr__
    monkeypatch.setattr(
        torch.nn.Module, "__getattr__", lambda self, name: getattr_calls.append(name) or original(self, name)
    )
    with emulation.count_op_calls() as calls:
        out = norm(x)
    torch.testing.assert_close(out.cpu(), expected.cpu())
    assert calls["npu_rms_norm"] + calls["npu_gemma_rms_norm"] == 1 and getattr_calls == []
    assert getattr(norm, "variance_epsilon" if family == "gemma3" else "eps", None) is None
    assert len(getattr_calls) == 1  # the negative control: a name the module lacks goes through __getattr__


class _Wrapped(torch.Tensor):
    """A wrapper subclass reporting the device it is given (an index-less "npu": get_device() -1, as on the host)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: str | None = None):
        wrapped = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), dtype=inner.dtype, device=device or inner.device
        )
        wrapped.inner = inner
        return wrapped

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, _Wrapped) else t  # noqa: E731
        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))
        return pytree.tree_map(lambda t: _Wrapped(t) if isinstance(t, torch.Tensor) else t, out)


def test_remembered_devices_tell_the_host_from_the_npu_and_two_npus_apart(card):
    """x's device is remembered by index, the weight's as a device: after a fused call of a wrapper subclass on an
    index-less npu (index -1, as on the host), the same class on the host is checked afresh and refused, eager's
    answer. x and the weight on two npus are refused with why (eager's math refuses them): no fused op call."""
    x, weight = torch.randn(4, 16), torch.randn(16)
    with torch.no_grad(), emulation.count_op_calls() as calls:
        card.rms_norm(_Wrapped(x.to("npu"), "npu"), _Wrapped(weight.to("npu"), "npu"), 1e-6)
        host_x, host_weight = _Wrapped(x, "cpu"), _Wrapped(weight, "cpu")
        reason = card.rms_norm_unavailable_reason(host_x, host_weight)
        out = card.rms_norm(host_x, host_weight, 1e-6)
    assert calls["npu_rms_norm"] == 1 and "not on an npu device" in reason  # the negative control: the npu call fused
    assert torch.equal(out.inner, card.rms_norm_eager(x, weight, 1e-6))
    other_npu = torch.Tensor._make_wrapper_subclass(
        type(weight.to("npu")), weight.shape, strides=weight.stride(), dtype=weight.dtype, device="npu:1"
    )
    other_npu._cpu = weight  # the emulation's npu tensor holds its data on the host
    reason = card.rms_norm_unavailable_reason(x.to("npu"), other_npu)
    assert reason.startswith("x on npu:0 and the weight on npu:1"), reason
