"""npu-swiglu, op level: the card's MLP functions against a float64 reference, and which path runs.

Parity follows flash-attention's idiom: the kernel's error against float64 is at most twice the
error of eager PyTorch (the transformers MLP formula) in the same dtype. The fused path is proven
by the emulated op's call counter; every fallback is proven to skip it and to equal eager.
"""

from __future__ import annotations

import random

import pytest
import torch
from kernels import get_local_kernel
from torch import nn
from transformers.activations import ACT2FN

from npu_hub_kernels import emulation


@pytest.fixture(scope="module")
def card(built_cards):
    return get_local_kernel(built_cards / "npu-swiglu")


class SplitMLP(nn.Module):
    """transformers' LlamaMLP, as a reference: `down_proj(act_fn(gate_proj(x)) * up_proj(x))`."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act_fn = ACT2FN["silu"]  # transformers SiLUActivation, as ACT2FN gives it

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class FusedMLP(nn.Module):
    """transformers' Phi3MLP, as a reference: gate rows first in gate_up_proj."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.activation_fn = nn.SiLU()

    def forward(self, hidden_states):
        gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


def kernel_output(card, mlp, x):
    if isinstance(mlp, FusedMLP):
        return card.swiglu_gate_up_mlp(x, mlp.gate_up_proj, mlp.down_proj, mlp.activation_fn)
    return card.swiglu_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn)


def unavailable_reason(card, mlp, x):
    if isinstance(mlp, FusedMLP):
        return card.swiglu_gate_up_mlp_unavailable_reason(x, mlp.gate_up_proj, mlp.activation_fn)
    return card.swiglu_mlp_unavailable_reason(x, mlp.gate_proj, mlp.up_proj, mlp.act_fn)


def make(shape: str, hidden: int, intermediate: int, dtype, bias=False, seed=0):
    torch.manual_seed(seed)
    mlp = FusedMLP(hidden, intermediate) if shape == "fused" else SplitMLP(hidden, intermediate, bias)
    return mlp.to(dtype)


def on_npu(card, mlp):
    """A copy of mlp on the npu device (split projections unpacked: the first fused call packs them)."""
    return _copy(mlp).to("npu")


def _copy(mlp):
    clone = type(mlp).__new__(type(mlp))
    clone.__dict__ = {**mlp.__dict__, "_modules": {k: _copy_linear(v) for k, v in mlp._modules.items()}}
    return clone


def _copy_linear(module):
    if not isinstance(module, nn.Linear):
        return module
    copy = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
    copy.load_state_dict(module.state_dict())
    return copy.to(module.weight.dtype)


def random_cases(count, seed):
    rng = random.Random(seed)
    for i in range(count):
        yield dict(
            hidden=rng.choice([16, 40, 64]),
            intermediate=rng.choice([24, 36, 100, 128]),  # not all multiples of 8
            tokens=rng.choice([(1, 1), (1, 7), (3, 5), (2, 13)]),
            bias=rng.choice([False, True]),
            seed=i,
        )


@pytest.mark.parametrize("shape", ["split", "fused"])
@pytest.mark.parametrize(("dtype", "seed"), [(torch.float32, 0), (torch.bfloat16, 1), (torch.float16, 2)])
def test_fused_error_at_most_twice_eager_error(card, shape, dtype, seed):
    for case in random_cases(8, seed):
        mlp = make(shape, case["hidden"], case["intermediate"], dtype, bias=case["bias"], seed=case["seed"])
        x = torch.randn(*case["tokens"], case["hidden"], generator=torch.Generator().manual_seed(seed)).to(dtype)
        with torch.no_grad():
            eager = mlp(x)
            reference = _copy(mlp).double()(x.double())
            npu_mlp = on_npu(card, mlp)
            with emulation.count_op_calls() as calls:
                fused = kernel_output(card, npu_mlp, x.to("npu")).cpu()
        assert calls["npu_swiglu"] == 1, case
        assert fused.dtype == dtype and fused.shape == eager.shape
        fused_error = (fused.double() - reference).abs().max().item()
        eager_error = (eager.double() - reference).abs().max().item()
        assert fused_error <= 2 * eager_error + 1e-6, (case, fused_error, eager_error)


@pytest.mark.parametrize("shape", ["split", "fused"])
def test_backward_matches_eager(card, shape):
    mlp = make(shape, 32, 48, torch.float32, bias=shape == "split")
    x = torch.randn(2, 5, 32)
    leaf = x.clone().requires_grad_()
    mlp(leaf).pow(2).sum().backward()
    npu_mlp = on_npu(card, mlp)
    npu_leaf = x.to("npu").requires_grad_()
    with emulation.count_op_calls() as calls:
        kernel_output(card, npu_mlp, npu_leaf).pow(2).sum().backward()
    assert calls["npu_swiglu"] == 1
    torch.testing.assert_close(npu_leaf.grad.cpu(), leaf.grad, rtol=1e-5, atol=1e-5)
    for (name, got), (_, want) in zip(npu_mlp.named_parameters(), mlp.named_parameters(), strict=True):
        torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_packing_keeps_parameters_and_state_dict_entries(card):
    mlp = make("split", 16, 24, torch.float32).to("npu")
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    before = {k: v.cpu().clone() for k, v in mlp.state_dict().items()}
    assert card.packed_gate_up_weight(mlp.gate_proj, mlp.up_proj) is None
    card.pack_gate_up(mlp.gate_proj, mlp.up_proj)
    assert mlp.gate_proj.weight is gate and mlp.up_proj.weight is up
    packed = card.packed_gate_up_weight(mlp.gate_proj, mlp.up_proj)
    assert packed.shape == (48, 16) and torch.equal(
        packed.cpu(), torch.cat((before["gate_proj.weight"], before["up_proj.weight"]))
    )
    assert all(torch.equal(v.cpu(), before[k]) for k, v in mlp.state_dict().items())
    with torch.no_grad():  # an optimizer's in-place update keeps the packing
        mlp.up_proj.weight.add_(1.0)
    assert torch.equal(card.packed_gate_up_weight(mlp.gate_proj, mlp.up_proj)[24:].cpu(), before["up_proj.weight"] + 1)


def split_output(card, mlp, x):
    with torch.no_grad(), emulation.count_op_calls() as calls:
        out = card.swiglu_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn)
    return out, calls["npu_swiglu"]


def test_split_mlp_packs_its_weights_on_the_first_fused_call_and_keeps_them_packed(card):
    """No call from the user: the first fused call packs (same Parameter objects and state dict), later calls
    find the layout in place; an optimizer made before the first call keeps training the same tensors."""
    mlp = make("split", 16, 24, torch.float32, bias=True).to("npu")
    params = dict(mlp.named_parameters())
    before = {k: v.cpu().clone() for k, v in mlp.state_dict().items()}
    optimizer = torch.optim.AdamW(mlp.parameters(), lr=1e-2)
    x = torch.randn(3, 16).to("npu")
    assert card.packed_gate_up_weight(mlp.gate_proj, mlp.up_proj) is None
    assert card.swiglu_mlp_unavailable_reason(x, mlp.gate_proj, mlp.up_proj, mlp.act_fn) is None
    out, fused = split_output(card, mlp, x)
    assert fused == 1
    torch.testing.assert_close(out.cpu(), _copy(mlp).cpu()(x.cpu()), rtol=1e-6, atol=1e-6)
    assert dict(mlp.named_parameters()) == params and all(p is params[k] for k, p in mlp.named_parameters())
    assert all(torch.equal(v.cpu(), before[k]) for k, v in mlp.state_dict().items())
    packed = card.packed_gate_up_weight(mlp.gate_proj, mlp.up_proj)
    address = packed.data_ptr()
    mlp(x).sum().backward()  # the module's own forward: gradients on the packed parameters
    card.swiglu_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn).sum().backward()
    optimizer.step()
    assert card.packed_gate_up_weight(mlp.gate_proj, mlp.up_proj).data_ptr() == address  # updated in place
    assert not torch.equal(mlp.up_proj.weight.cpu(), before["up_proj.weight"])


@pytest.mark.parametrize("change", ["bfloat16 cast", "half", "move to host and back", "load_state_dict(assign=True)"])
def test_a_change_that_reallocates_the_weights_is_packed_again_on_the_next_call(card, change):
    mlp = make("split", 16, 24, torch.float32).to("npu")
    gate = mlp.gate_proj.weight
    x = torch.randn(3, 16)
    assert split_output(card, mlp, x.to("npu"))[1] == 1
    if change == "bfloat16 cast":
        mlp.to(torch.bfloat16)
    elif change == "half":
        mlp.half()
    elif change == "move to host and back":
        mlp.cpu().to("npu")
    else:
        mlp.load_state_dict({k: v.clone() for k, v in mlp.state_dict().items()}, assign=True)
    dtype = mlp.gate_proj.weight.dtype
    assert card.packed_gate_up_weight(mlp.gate_proj, mlp.up_proj) is None
    out, fused = split_output(card, mlp, x.to("npu", dtype))
    assert fused == 1 and card.packed_gate_up_weight(mlp.gate_proj, mlp.up_proj) is not None
    if change != "load_state_dict(assign=True)":  # assign=True may hand in new Parameter objects: torch's choice
        assert mlp.gate_proj.weight is gate
    expected = _copy(mlp).cpu()(x.to(dtype))
    torch.testing.assert_close(out.cpu(), expected, **({} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}))


def test_packing_inside_inference_mode_leaves_trainable_parameters(card):
    mlp = make("split", 16, 24, torch.float32).to("npu")
    x = torch.randn(3, 16).to("npu")
    with torch.inference_mode():
        card.swiglu_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn)
    assert (
        not mlp.gate_proj.weight.is_inference() and card.packed_gate_up_weight(mlp.gate_proj, mlp.up_proj) is not None
    )
    leaf = x.clone().requires_grad_()
    card.swiglu_mlp(leaf, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn).sum().backward()
    assert mlp.gate_proj.weight.grad is not None and leaf.grad is not None


def _owned_elsewhere(mlp, case):
    """Mark or lay out mlp's gate/up weights as a system that owns them would."""
    if case == "DeepSpeed ZeRO-3":
        mlp.gate_proj.weight.ds_id = 7  # what ZeRO-3 sets on the parameters it partitions
    elif case == "view into a flat buffer":
        flat = torch.zeros(3 * 24 * 16, device="npu")  # gate and up with a gap between them
        for i, linear in enumerate((mlp.gate_proj, mlp.up_proj)):
            view = flat[2 * i * 384 : (2 * i + 1) * 384].view(24, 16)
            view.copy_(linear.weight.detach())
            linear.weight = nn.Parameter(view)
    elif case == "held by a live autograd graph":
        mlp._graph = mlp.gate_proj(torch.randn(2, 16, device="npu")).sum()  # keeps AccumulateGrad alive
        torch.autograd.graph.get_gradient_edge(mlp.gate_proj.weight)
    elif case == "gradient hook":
        mlp.up_proj.weight.register_hook(lambda grad: grad)
    elif case == "hooked projection (as adapters are)":
        mlp.up_proj.register_forward_hook(lambda module, args, out: out * 2)
    return {
        "DeepSpeed ZeRO-3": "ZeRO-3",
        "view into a flat buffer": "view into a larger buffer",
        "held by a live autograd graph": "live autograd graph",
        "gradient hook": "gradient hooks",
        "hooked projection (as adapters are)": "not two plain nn.Linear",
    }[case]


@pytest.mark.parametrize(
    "case",
    [
        "DeepSpeed ZeRO-3",
        "view into a flat buffer",
        "held by a live autograd graph",
        "gradient hook",
        "hooked projection (as adapters are)",
    ],
)
def test_weights_another_system_owns_are_never_rewritten_and_the_reason_is_given(card, case):
    mlp = make("split", 16, 24, torch.float32).to("npu")
    reason = _owned_elsewhere(mlp, case)
    storages = [p.untyped_storage().data_ptr() for p in mlp.parameters()]
    x = torch.randn(3, 16)
    assert reason in card.swiglu_mlp_unavailable_reason(x.to("npu"), mlp.gate_proj, mlp.up_proj, mlp.act_fn)
    assert not card.pack_gate_up(mlp.gate_proj, mlp.up_proj)
    out, fused = split_output(card, mlp, x.to("npu"))
    assert fused == 0 and [p.untyped_storage().data_ptr() for p in mlp.parameters()] == storages
    with torch.no_grad():
        torch.testing.assert_close(out.cpu(), _copy(mlp).cpu()(x) if "hooked" not in case else out.cpu())


class ScaledSiLU(nn.SiLU):
    """Named like SiLU, computes something else: only the exact SiLU type is fused."""

    def forward(self, x):
        return 2 * super().forward(x)


def _fallback_cases():
    return {
        "float64": (torch.float64, (3, 16), None, "float64"),
        "empty batch": (torch.float32, (0, 16), None, "empty input"),
        "GELU activation": (torch.float32, (3, 16), nn.GELU(), "not SiLU"),
        "act_fn replaced by a SiLU subclass": (torch.float32, (3, 16), ScaledSiLU(), "not SiLU"),
    }


@pytest.mark.parametrize("shape", ["split", "fused"])
@pytest.mark.parametrize("case", list(_fallback_cases()))
def test_unsupported_inputs_take_the_exact_eager_path(card, shape, case):
    dtype, x_shape, act, reason = _fallback_cases()[case]
    mlp = make(shape, 16, 24, dtype)
    if act is not None:
        setattr(mlp, "activation_fn" if shape == "fused" else "act_fn", act)
    x = torch.randn(x_shape, dtype=dtype)
    with torch.no_grad():
        expected = mlp(x)
        npu_mlp = on_npu(card, mlp)
        assert reason in unavailable_reason(card, npu_mlp, x.to("npu"))
        with emulation.count_op_calls() as calls:
            got = kernel_output(card, npu_mlp, x.to("npu"))
    assert calls["npu_swiglu"] == 0
    assert torch.equal(got.cpu(), expected)


def test_non_contiguous_input_is_fused_and_correct(card):
    mlp = make("split", 16, 24, torch.float32)
    x = torch.randn(16, 5).t()  # [5, 16], not contiguous
    assert not x.is_contiguous()
    with torch.no_grad():
        npu_mlp = on_npu(card, mlp)
        with emulation.count_op_calls() as calls:
            got = kernel_output(card, npu_mlp, x.to("npu"))
    assert calls["npu_swiglu"] == 1
    torch.testing.assert_close(got.cpu(), mlp(x), rtol=1e-6, atol=1e-6)


def test_lora_wrapped_projection_is_not_packed(card):
    """A projection that is not a plain Linear (here a hooked one, as adapters are) never takes the packed matmul."""
    mlp = make("split", 16, 24, torch.float32)
    npu_mlp = on_npu(card, mlp)
    npu_mlp.up_proj.register_forward_hook(lambda module, args, out: out * 2)
    x = torch.randn(3, 16)
    assert card.packed_gate_up_weight(npu_mlp.gate_proj, npu_mlp.up_proj) is None
    with torch.no_grad(), emulation.count_op_calls() as calls:
        got = kernel_output(card, npu_mlp, x.to("npu"))
    assert calls["npu_swiglu"] == 0
    with torch.no_grad():
        expected = mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x) * 2)
    torch.testing.assert_close(got.cpu(), expected)


def test_host_tensors_take_the_eager_path(card):
    mlp = make("fused", 16, 24, torch.float32)
    x = torch.randn(3, 16)
    with torch.no_grad(), emulation.count_op_calls() as calls:
        got = kernel_output(card, mlp, x)
    assert calls["npu_swiglu"] == 0
    assert torch.equal(got, mlp(x))
