"""npu-swiglu, op level: the card's MLP functions (SiLU and GELU-tanh gates) against a float64 reference, and which
path runs.

Parity follows flash-attention's idiom: the kernel's error against float64 is at most twice the
error of eager PyTorch (the transformers MLP formula) in the same dtype. The fused path is proven
by the emulated op's call counter; every fallback is proven to skip it and to equal eager.
"""

from __future__ import annotations

import collections
import random
from functools import partial

import pytest
import torch
from numerics import assert_within_twice_eagers_error, relative_error
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.activations import ACT2FN

from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.emulation.ops.npu_linear_cross_entropy import ADDMM_DTYPE_OUT


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


class GeGLUMLP(SplitMLP):
    """transformers' Gemma3MLP, as a reference: the split MLP with `ACT2FN["gelu_pytorch_tanh"]`."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__(hidden, intermediate, bias)
        self.act_fn = ACT2FN["gelu_pytorch_tanh"]


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


def fused_op(shape: str) -> str:
    """The torch_npu op an MLP of this shape fuses with."""
    return "npu_geglu" if shape == "geglu" else "npu_swiglu"


def kernel_output(card, mlp, x):
    if isinstance(mlp, GeGLUMLP):
        return card.geglu_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn)
    if isinstance(mlp, FusedMLP):
        return card.swiglu_gate_up_mlp(x, mlp.gate_up_proj, mlp.down_proj, mlp.activation_fn)
    return card.swiglu_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn)


def unavailable_reason(card, mlp, x):
    if isinstance(mlp, GeGLUMLP):
        return card.geglu_mlp_unavailable_reason(x, mlp.gate_proj, mlp.up_proj, mlp.act_fn)
    if isinstance(mlp, FusedMLP):
        return card.swiglu_gate_up_mlp_unavailable_reason(x, mlp.gate_up_proj, mlp.activation_fn)
    return card.swiglu_mlp_unavailable_reason(x, mlp.gate_proj, mlp.up_proj, mlp.act_fn)


def make(shape: str, hidden: int, intermediate: int, dtype, bias=False, seed=0):
    torch.manual_seed(seed)
    if shape == "fused":
        return FusedMLP(hidden, intermediate).to(dtype)
    return (GeGLUMLP if shape == "geglu" else SplitMLP)(hidden, intermediate, bias).to(dtype)


def on_npu(card, mlp):
    """A copy of mlp on the npu device."""
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


@pytest.mark.parametrize("shape", ["split", "fused", "geglu"])
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
        assert calls[fused_op(shape)] == 1 and sum(calls.values()) == 1, case
        assert fused.dtype == dtype and fused.shape == eager.shape
        assert_within_twice_eagers_error(fused, eager, reference, case)


@pytest.mark.parametrize("shape", ["split", "fused", "geglu"])
def test_backward_matches_eager(card, shape):
    mlp = make(shape, 32, 48, torch.float32, bias=shape != "fused")
    x = torch.randn(2, 5, 32)
    leaf = x.clone().requires_grad_()
    mlp(leaf).pow(2).sum().backward()
    npu_mlp = on_npu(card, mlp)
    npu_leaf = x.to("npu").requires_grad_()
    with emulation.count_op_calls() as calls:
        kernel_output(card, npu_mlp, npu_leaf).pow(2).sum().backward()
    assert calls[fused_op(shape)] == 1
    torch.testing.assert_close(npu_leaf.grad.cpu(), leaf.grad, rtol=1e-5, atol=1e-5)
    for (name, got), (_, want) in zip(npu_mlp.named_parameters(), mlp.named_parameters(), strict=True):
        torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-5, atol=1e-5, msg=name)


def split_output(card, mlp, x):
    with torch.no_grad(), emulation.count_op_calls() as calls:
        out = card.swiglu_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn)
    return out, calls["npu_swiglu"]


def storage_layout(module: nn.Module) -> dict[str, tuple[int, int, int, int]]:
    """Where each parameter's memory lives: (object id, storage address, storage bytes, storage offset)."""
    return {
        name: (id(p), p.untyped_storage().data_ptr(), p.untyped_storage().nbytes(), p.storage_offset())
        for name, p in module.named_parameters()
    }


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "forward and backward"])
@pytest.mark.parametrize("tokens", [3, 160], ids=["few tokens per weight row", "many tokens per weight row"])
def test_gate_and_up_match_eager_at_few_and_many_tokens_per_weight_row(card, tokens, grad):
    """Two matmuls into the halves of one buffer, with few tokens per weight row and with many (T > 4I, 3T > 8I with
    backward, where concatenating the weights would move fewer bytes: the card never does, scripts/bench counts it):
    eager's output and gradients."""
    mlp = make("split", 16, 24, torch.float32, bias=True)
    x = torch.randn(tokens, 16)
    npu_mlp, leaf = on_npu(card, mlp), x.to("npu").requires_grad_(grad)
    with torch.set_grad_enabled(grad), emulation.count_op_calls() as calls:
        out = card.swiglu_mlp(leaf, npu_mlp.gate_proj, npu_mlp.up_proj, npu_mlp.down_proj, npu_mlp.act_fn)
    expected_leaf = x.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        expected = mlp(expected_leaf)
    assert calls["npu_swiglu"] == 1
    torch.testing.assert_close(out.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-5)
    if grad:
        out.square().sum().backward()
        expected.square().sum().backward()
        torch.testing.assert_close(leaf.grad.cpu(), expected_leaf.grad, rtol=1e-5, atol=1e-5)
        for (name, got), want in zip(npu_mlp.named_parameters(), mlp.parameters(), strict=True):
            torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_split_mlp_fuses_without_touching_where_its_weights_live(card):
    """Forward, backward and optimizer steps through the fused path: every Parameter keeps its object, its own
    storage (no shared buffer: each storage holds exactly the parameter) and its state-dict entry; the gradients
    and the updates are eager's."""
    mlp = make("split", 16, 24, torch.float32, bias=True).to("npu")
    reference = _copy(mlp).to("npu")
    layout = storage_layout(mlp)
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in mlp.parameters())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (mlp, reference)]
    for step in range(3):
        x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(step)).to("npu")
        with emulation.count_op_calls() as calls:
            card.swiglu_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn).square().sum().backward()
        reference(x).square().sum().backward()
        assert calls["npu_swiglu"] == 1
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        assert storage_layout(mlp) == layout
        for (name, got), want in zip(mlp.state_dict().items(), reference.state_dict().values(), strict=True):
            torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-5, atol=1e-6, msg=name)


def test_each_call_reads_the_weights_as_they_are_at_that_call(card):
    """Regression for the packed layout that froze weights under FSDP2: whatever the owner does to the weights
    between calls (an update in place, a new tensor behind the same Parameter as FSDP2's all-gather gives,
    a new Parameter), the next call computes with them."""
    mlp = make("split", 16, 24, torch.float32).to("npu")
    x = torch.randn(3, 16)
    owner_buffers = []  # FSDP2 keeps each unsharded Parameter as a view of its all-gather buffer
    for linear in (mlp.gate_proj, mlp.up_proj):
        owner_buffers.append(linear.weight.detach().flatten().clone())
        linear.weight = nn.Parameter(owner_buffers[-1].view(24, 16))
    assert split_output(card, mlp, x.to("npu"))[1] == 1

    def owner_writes_its_buffers(m):  # what each FSDP2 all-gather does before a forward
        for buffer in owner_buffers:
            buffer.copy_(torch.randn(24 * 16))

    def in_place(m):
        with torch.no_grad():
            m.up_proj.weight.mul_(-2.0)

    def new_storage(m):
        m.gate_proj.weight.data = torch.randn(24, 16).to("npu")

    def new_parameter(m):
        m.up_proj.weight = nn.Parameter(torch.randn(24, 16).to("npu"))

    for change in (owner_writes_its_buffers, in_place, new_storage, new_parameter):
        change(mlp)
        out, fused = split_output(card, mlp, x.to("npu"))
        assert fused == 1, change.__name__
        with torch.no_grad():
            torch.testing.assert_close(out.cpu(), _copy(mlp).cpu()(x), rtol=1e-6, atol=1e-6, msg=change.__name__)


@pytest.mark.parametrize("change", ["bfloat16 cast", "half", "move to host and back", "load_state_dict(assign=True)"])
def test_split_mlp_fuses_after_a_change_that_reallocates_the_weights(card, change):
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
    out, fused = split_output(card, mlp, x.to("npu", dtype))
    assert fused == 1
    if change != "load_state_dict(assign=True)":  # assign=True may hand in new Parameter objects: torch's choice
        assert mlp.gate_proj.weight is gate
    expected = _copy(mlp).cpu()(x.to(dtype))
    torch.testing.assert_close(out.cpu(), expected, **({} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}))


def test_a_call_inside_inference_mode_leaves_trainable_parameters(card):
    mlp = make("split", 16, 24, torch.float32).to("npu")
    x = torch.randn(3, 16).to("npu")
    with torch.inference_mode():
        card.swiglu_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn)
    assert not mlp.gate_proj.weight.is_inference()
    leaf = x.clone().requires_grad_()
    card.swiglu_mlp(leaf, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn).sum().backward()
    assert mlp.gate_proj.weight.grad is not None and leaf.grad is not None


def test_autocast_fuses_with_the_linear_casts_and_eager_gradients(card):
    """float32 weights under torch.autocast("npu", bfloat16): the matmuls run in bfloat16 as gate_proj(x) does
    there, the gradients come back in float32, and both equal eager autocast's (same casts, same roundings)."""
    mlp = make("split", 16, 24, torch.float32, bias=True).to("npu")
    reference = _copy(mlp).to("npu")
    x = torch.randn(2, 3, 16).to("npu")
    with torch.autocast("npu", dtype=torch.bfloat16):
        with emulation.count_op_calls() as calls:
            out = card.swiglu_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn)
        expected = reference(x)
    assert calls["npu_swiglu"] == 1 and out.dtype == expected.dtype == torch.bfloat16
    out.float().square().sum().backward()
    expected.float().square().sum().backward()
    torch.testing.assert_close(out.cpu(), expected.cpu(), rtol=1e-2, atol=1e-2)
    for (name, got), want in zip(mlp.named_parameters(), reference.parameters(), strict=True):
        assert got.grad.dtype == torch.float32, name
        torch.testing.assert_close(got.grad.cpu(), want.grad.cpu(), rtol=2e-2, atol=2e-2, msg=name)


class _BackwardCastsOf(TorchDispatchMode):
    """Counts backward's dtype casts (aten `_to_copy` to another dtype) of tensors whose shape is one of `shapes`."""

    def __init__(self, *shapes: tuple[int, ...]):
        super().__init__()
        self.shapes, self.casts = shapes, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cast = func is torch.ops.aten._to_copy.default and kwargs.get("dtype", args[0].dtype) != args[0].dtype
        in_backward = torch._C._current_autograd_node() is not None
        if cast and in_backward and tuple(args[0].shape) in self.shapes:
            self.casts[(tuple(args[0].shape), args[0].dtype, kwargs["dtype"])] += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("shape", ["split", "geglu"])
@pytest.mark.parametrize("cann", ["9.1.0", "9.0.0"])
def test_autocast_float32_gradients_summed_in_float32_without_casts_back(card, cann_version, shape, cann):
    """Trainer's bf16 on float32 x and weights: with the float32 out (CANN 9.1), dx and the gate/up/down weights'
    gradients are the 16-bit operands' products summed in float32 (addmm out_dtype, counted: dx's two, one per weight),
    returned to the float32 tensors themselves, so backward casts nothing of their sizes back to float32; eager's
    autocast rounds each to bfloat16, then casts it. Every gradient within twice eager's error against float64 (at
    most eager's on most draws, one rounding fewer, not on all: an outside pass found 6 of 144 up to 1.15 x). Before
    9.1 (negative control) the card casts as eager's autocast does."""
    cann_version(cann)
    hidden, intermediate = 64, 96
    mlp = make(shape, hidden, intermediate, torch.float32, seed=3)
    x = torch.randn(4, 8, hidden, generator=torch.Generator().manual_seed(3))

    def gradients(run, module, device, dtype=torch.float32):
        module = _copy(module).to(device=device, dtype=dtype)
        leaf = x.to(device=device, dtype=dtype).requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype is torch.float32):
            out = run(leaf, module)
        out.float().square().sum().backward()
        projections = (module.gate_proj, module.up_proj, module.down_proj)
        return leaf.grad.cpu(), *(projection.weight.grad.cpu() for projection in projections)

    def fused(leaf, module):
        fuse = card.geglu_mlp if shape == "geglu" else card.swiglu_mlp
        return fuse(leaf, module.gate_proj, module.up_proj, module.down_proj, module.act_fn)

    weight_shapes = ((intermediate, hidden), (hidden, intermediate), tuple(x.shape))
    with _BackwardCastsOf(*weight_shapes) as counted, emulation.count_op_calls() as calls:
        got = gradients(fused, mlp, "npu")
    eager = gradients(lambda leaf, module: module(leaf), mlp, "npu")
    reference = gradients(lambda leaf, module: module(leaf), mlp, "cpu", torch.float64)
    back = {key: n for key, n in counted.casts.items() if key[1:] == (torch.bfloat16, torch.float32)}
    if cann == "9.1.0":
        assert calls[ADDMM_DTYPE_OUT] == 5 and not back, (calls[ADDMM_DTYPE_OUT], back)
    else:
        assert calls[ADDMM_DTYPE_OUT] == 0 and sum(back.values()) == 4, back  # dx's and each weight's cast back
    for name, f, e, r in zip(("dx", "dW_gate", "dW_up", "dW_down"), got, eager, reference, strict=True):
        assert_within_twice_eagers_error(f, e, r, name, error=relative_error)


@pytest.mark.parametrize("shape", ["split", "geglu"])
@pytest.mark.parametrize("trained", ["everything", "biases and down_proj", "bfloat16 x"])
def test_autocast_gradient_penalty_on_float32_weights_within_twice_eagers_error(card, cann_version, shape, trained):
    """A gradient penalty (create_graph) under bf16 autocast on float32 weights, the float32 outs on (CANN 9.1): the
    recorded backward differentiates eager's math, and the fused gate/up and down_proj functions hand their inputs no
    gradient of their own there (they get a zero one). Each second-order gradient within twice eager's error against
    float64; before, their float32 products ran on that zero gradient under grad mode and addmm's out= raised."""
    cann_version("9.1.0")
    mlp = make(shape, 32, 48, torch.float32, bias=trained != "bfloat16 x", seed=3)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))

    def penalty_gradients(run, module, device, dtype=torch.float32):
        module = _copy(module).to(device=device, dtype=dtype)
        leaf = (x.bfloat16() if trained == "bfloat16 x" else x).to(device=device, dtype=dtype)
        leaf = leaf.bfloat16() if trained == "bfloat16 x" and device == "npu" else leaf
        leaf.requires_grad_(trained != "biases and down_proj")
        for name, parameter in module.named_parameters():
            parameter.requires_grad_(trained != "biases and down_proj" or "down" in name or "bias" in name)
        wanted = [leaf, *module.parameters()]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "npu"):
            out = run(leaf, module).float()
            with emulation.count_op_calls() as recorded:
                first = torch.autograd.grad(
                    out.square().sum(), [t for t in wanted if t.requires_grad], create_graph=True
                )
            # out's own sum: a plain backward through the fused functions as well
            (sum(g.float().square().sum() for g in first) + out.sum()).backward()
        return [t.grad.double().cpu() for t in wanted if t.requires_grad], recorded

    def fused(leaf, module):
        fuse = card.geglu_mlp if shape == "geglu" else card.swiglu_mlp
        return fuse(leaf, module.gate_proj, module.up_proj, module.down_proj, module.act_fn)

    with emulation.count_op_calls() as calls:
        got, recorded = penalty_gradients(fused, mlp, "npu")
    eager, _ = penalty_gradients(lambda leaf, module: module(leaf), mlp, "npu")
    reference, _ = penalty_gradients(lambda leaf, module: module(leaf), mlp, "cpu", torch.float64)
    assert calls[fused_op(shape)] == 1 and calls[ADDMM_DTYPE_OUT] > 0, calls  # the fused forward and plain backward
    assert recorded[ADDMM_DTYPE_OUT] == 0, recorded  # no float32 product on the recorded backward's zeros
    for index, (f, e, r) in enumerate(zip(got, eager, reference, strict=True)):
        assert_within_twice_eagers_error(f, e, r, index, error=relative_error)


def test_a_hooked_down_proj_is_called_and_mixed_dtypes_without_autocast_refused_as_eager(card, cann_version):
    """down_proj's float32 gradient is the card's only where nothing watches its call: a forward hook on it runs (its
    weight gradient eager's, one float32 product fewer: 4 instead of 5). Without autocast, 16-bit x and gate/up with a
    float32 down_proj is a dtype mismatch eager's linear refuses: the card calls down_proj, which refuses it too."""
    cann_version("9.1.0")
    mlp = make("split", 32, 48, torch.float32, seed=3).to("npu")
    x = torch.randn(2, 5, 32).to("npu").requires_grad_()
    seen = []
    mlp.down_proj.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    with torch.autocast("npu", dtype=torch.bfloat16), emulation.count_op_calls() as calls:
        out = card.swiglu_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn)
        out.float().sum().backward()
    assert seen == [torch.bfloat16] and calls[ADDMM_DTYPE_OUT] == 4, (seen, calls)
    mixed = make("split", 32, 48, torch.bfloat16, seed=3).to("npu")
    mixed.down_proj.float()
    with pytest.raises(RuntimeError, match="dtype"):
        mixed(x.detach().bfloat16())  # eager's error ...
    with pytest.raises(RuntimeError, match="dtype"), emulation.count_op_calls() as calls:
        card.swiglu_mlp(x.detach().bfloat16(), mixed.gate_proj, mixed.up_proj, mixed.down_proj, mixed.act_fn)
    assert calls["npu_swiglu"] == 1 and calls[ADDMM_DTYPE_OUT] == 0  # ... the card's, from down_proj's own call


def _fused_although_held(mlp, case):
    """Hold or lay out mlp's gate/up weights as other systems do; none of it stops the fused path any more."""
    if case == "view into a flat buffer":
        flat = torch.zeros(3 * 24 * 16, device="npu")  # gate and up with a gap between them, as a flat parameter
        for i, linear in enumerate((mlp.gate_proj, mlp.up_proj)):
            view = flat[2 * i * 384 : (2 * i + 1) * 384].view(24, 16)
            view.copy_(linear.weight.detach())
            linear.weight = nn.Parameter(view)
    elif case == "held by a live autograd graph":
        mlp._graph = mlp.gate_proj(torch.randn(2, 16, device="npu")).sum()  # keeps AccumulateGrad alive
    elif case == "gradient hook":
        mlp.up_proj.weight.register_hook(lambda grad: grad * 3)


@pytest.mark.parametrize("case", ["view into a flat buffer", "held by a live autograd graph", "gradient hook"])
def test_weights_held_or_laid_out_by_another_system_fuse_as_they_are(card, case):
    mlp = make("split", 16, 24, torch.float32).to("npu")
    _fused_although_held(mlp, case)
    reference = _copy(mlp).to("npu")
    if case == "gradient hook":
        reference.up_proj.weight.register_hook(lambda grad: grad * 3)
    layout = storage_layout(mlp)
    x = torch.randn(3, 16).to("npu")
    assert card.swiglu_mlp_unavailable_reason(x, mlp.gate_proj, mlp.up_proj, mlp.act_fn) is None
    with emulation.count_op_calls() as calls:
        card.swiglu_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn).sum().backward()
    reference(x).sum().backward()
    assert calls["npu_swiglu"] == 1 and storage_layout(mlp) == layout
    for (name, got), want in zip(mlp.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad.cpu(), want.grad.cpu(), rtol=1e-6, atol=1e-6, msg=name)


def test_a_gathered_zero3_weight_of_a_hook_free_projection_fuses(card):
    """Under a ZeRO-3 leaf MLP (npu_hub_kernels.zero3) its projections carry no hooks and hold their gathered
    weights (shape == ds_shape) for the whole forward and backward: the card reads them and fuses."""
    mlp = make("split", 16, 24, torch.float32).to("npu")
    for linear in (mlp.gate_proj, mlp.up_proj):
        linear.weight.ds_id, linear.weight.ds_shape = id(linear), linear.weight.shape
    x = torch.randn(3, 16).to("npu")
    assert card.swiglu_mlp_unavailable_reason(x, mlp.gate_proj, mlp.up_proj, mlp.act_fn) is None
    mlp.up_proj.weight.ds_shape = torch.Size([48, 16])  # partitioned, not gathered here
    assert "DeepSpeed ZeRO-3" in card.swiglu_mlp_unavailable_reason(x, mlp.gate_proj, mlp.up_proj, mlp.act_fn)


def _read_elsewhere(mlp, case):
    """Give mlp's projections an owner that the card cannot read around; returns the reason's key words."""
    if case == "DeepSpeed ZeRO-3":
        mlp.gate_proj.weight.ds_id = 7  # what ZeRO-3 sets on the parameters it partitions
        mlp.gate_proj.weight.ds_shape = torch.Size([24, 16])
        mlp.gate_proj.register_forward_pre_hook(lambda module, args: None)  # its hook gathers it when called
        return "mark_zero3_leaf_mlps"
    if case == "hooked projection (as adapters are)":
        mlp.up_proj.register_forward_hook(lambda module, args, out: out * 2)
        return "not a plain nn.Linear"
    mlp.gate_proj.weight = nn.Parameter(torch.empty(0, device="npu"))  # ZeRO-3's partitioned placeholder
    return "holds no data"


@pytest.mark.parametrize("case", ["DeepSpeed ZeRO-3", "hooked projection (as adapters are)", "empty placeholder"])
def test_projections_the_card_cannot_read_directly_run_eager_with_the_reason(card, case):
    mlp = make("split", 16, 24, torch.float32).to("npu")
    reason = _read_elsewhere(mlp, case)
    x = torch.randn(3, 16).to("npu")
    assert reason in card.swiglu_mlp_unavailable_reason(x, mlp.gate_proj, mlp.up_proj, mlp.act_fn)
    if case == "empty placeholder":
        return  # eager F.linear on the placeholder fails as it does without the card
    layout = storage_layout(mlp)
    out, fused = split_output(card, mlp, x)
    assert fused == 0 and storage_layout(mlp) == layout
    with torch.no_grad():
        torch.testing.assert_close(out, card.swiglu_mlp_eager(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn))


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


@pytest.mark.parametrize("shape", ["split", "fused", "geglu"])
@pytest.mark.parametrize("case", list(_fallback_cases()))
def test_unsupported_inputs_take_the_exact_eager_path(card, shape, case):
    dtype, x_shape, act, reason = _fallback_cases()[case]
    if shape == "geglu":
        reason = reason.replace("SiLU", "GELU-tanh")
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
    assert calls[fused_op(shape)] == 0
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize(
    ("activation", "fuses"),
    [
        (ACT2FN["gelu_pytorch_tanh"], True),
        (nn.GELU(approximate="tanh"), True),
        (ACT2FN["gelu_python_tanh"], False),
        (ACT2FN["gelu_new"], False),
        (ACT2FN["gelu"], False),
        (ACT2FN["silu"], False),
    ],
    ids=["gelu_pytorch_tanh", "nn.GELU(tanh)", "gelu_python_tanh", "gelu_new", "gelu (erf)", "silu"],
)
def test_geglu_fuses_torchs_tanh_gelu_only(card, activation, fuses):
    """npu_geglu(approximate=1) is F.gelu(approximate="tanh"); other GELUs (erf, or the tanh formula in Python ops,
    which rounds differently) and SiLU run the exact eager math, saying why."""
    mlp = make("geglu", 16, 24, torch.bfloat16)
    mlp.act_fn = activation
    x = torch.randn(3, 16).bfloat16()
    npu_mlp = on_npu(card, mlp)
    reason = unavailable_reason(card, npu_mlp, x.to("npu"))
    with torch.no_grad(), emulation.count_op_calls() as calls:
        got = kernel_output(card, npu_mlp, x.to("npu")).cpu()
        expected = mlp(x)
    assert (reason is None, calls["npu_geglu"]) == ((True, 1) if fuses else (False, 0)), reason
    if not fuses:
        assert "is not GELU-tanh" in reason and torch.equal(got, expected)


@pytest.mark.parametrize("shape", ["split", "fused"])
def test_a_nine_dim_input_fuses_as_rows_in_the_split_mlp_and_runs_eager_in_the_gate_up_mlp(card, shape):
    """npu_swiglu takes 1 to 8 dims: gate_up_proj(x) has x's dims, the split MLP's `[2, T, I]` buffer three."""
    mlp = make(shape, 16, 24, torch.float32)
    x = torch.randn(1, 1, 1, 1, 1, 1, 2, 3, 16)
    with torch.no_grad():
        expected = mlp(x)
        npu_mlp = on_npu(card, mlp)
        reason = unavailable_reason(card, npu_mlp, x.to("npu"))
        with emulation.count_op_calls() as calls:
            got = kernel_output(card, npu_mlp, x.to("npu")).cpu()
    if shape == "fused":
        assert "npu_swiglu takes 1 to 8 dims, got 9" in reason and calls["npu_swiglu"] == 0
        assert torch.equal(got, expected)
    else:
        assert reason is None and calls["npu_swiglu"] == 1
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


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


def test_host_tensors_take_the_eager_path(card):
    mlp = make("fused", 16, 24, torch.float32)
    x = torch.randn(3, 16)
    with torch.no_grad(), emulation.count_op_calls() as calls:
        got = kernel_output(card, mlp, x)
    assert calls["npu_swiglu"] == 0
    assert torch.equal(got, mlp(x))


def _mlp_children(mlp) -> dict:
    return {name: child for name, child in mlp.named_children()}


@pytest.mark.parametrize("shape", ["split", "fused"])
@pytest.mark.parametrize("hook", ["forward hook", "forward pre-hook", "full backward hook"])
def test_a_hooked_act_fn_is_called_as_eager_calls_it(card, shape, hook):
    """The fused path computes act_fn's SiLU without calling it: a hook of the user's own on act_fn sends the MLP to
    its eager math, which calls act_fn, so the hook sees its call (and edits its output) as it does without the card
    (issue 30)."""
    mlp = make(shape, 16, 24, torch.float32)
    act_name = "activation_fn" if shape == "fused" else "act_fn"
    setattr(mlp, act_name, ACT2FN["silu"])  # the module's own activation (on_npu shares it with the copy)
    act = getattr(mlp, act_name)
    seen = []
    if hook == "forward hook":
        act.register_forward_hook(lambda module, args, out: seen.append(1) or out * 1.25)
    elif hook == "forward pre-hook":
        act.register_forward_pre_hook(lambda module, args: seen.append(1) or (args[0] * 0.5,))
    else:
        act.register_full_backward_hook(lambda module, grad_in, grad_out: seen.append(1) or (grad_in[0] * 3,))
    x = torch.randn(2, 3, 16)
    leaf = x.clone().requires_grad_()
    expected = mlp(leaf)
    expected.square().sum().backward()
    npu_mlp, npu_leaf = on_npu(card, mlp), x.to("npu").requires_grad_()
    assert "act_fn has hooks of its own" in unavailable_reason(card, npu_mlp, npu_leaf)
    seen.clear()
    with emulation.count_op_calls() as calls:
        got = kernel_output(card, npu_mlp, npu_leaf)
        got.square().sum().backward()
    assert calls["npu_swiglu"] == 0 and seen == [1]
    torch.testing.assert_close(got.detach().cpu(), expected.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(npu_leaf.grad.cpu(), leaf.grad, rtol=1e-6, atol=1e-6)


def test_a_full_backward_hook_on_a_projection_keeps_the_eager_path(card):
    """gate_proj's full backward hook fires only when gate_proj is called: the split MLP calls it (issue 30)."""
    mlp = make("split", 16, 24, torch.float32).to("npu")
    seen = []
    mlp.gate_proj.register_full_backward_hook(lambda module, grad_in, grad_out: seen.append(grad_out[0].shape))
    x = torch.randn(3, 16).to("npu").requires_grad_()
    assert "not a plain nn.Linear" in card.swiglu_mlp_unavailable_reason(x, mlp.gate_proj, mlp.up_proj, mlp.act_fn)
    with emulation.count_op_calls() as calls:
        card.swiglu_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn).sum().backward()
    assert calls["npu_swiglu"] == 0 and seen == [torch.Size([3, 24])]


def _engine_hook(module, args, out):
    return out


_engine_hook.__module__ = "deepspeed.runtime.zero.parameter_offload"  # where DeepSpeed's ZeRO-3 hooks are defined


def test_deepspeed_and_fsdp2_hooks_on_act_fn_keep_the_fused_path(card):
    """An engine's own hooks on act_fn (DeepSpeed ZeRO-3 hooks every module it manages) gather and release act_fn's
    parameters, of which it has none, and change nothing it computes: the MLP still fuses."""
    mlp = make("split", 16, 24, torch.float32).to("npu")
    mlp.act_fn = ACT2FN["silu"]
    mlp.act_fn.register_forward_hook(_engine_hook)
    x = torch.randn(3, 16).to("npu")
    assert card.swiglu_mlp_unavailable_reason(x, mlp.gate_proj, mlp.up_proj, mlp.act_fn) is None
    assert split_output(card, mlp, x)[1] == 1


@pytest.mark.parametrize("shape", ["split", "fused"])
def test_global_module_hooks_see_every_child_eager_calls(card, shape):
    """Module hooks registered for every module (register_module_forward_hook) see the MLP's children called as
    eager calls them: the MLP takes its eager path while they are registered, and fuses again after (issue 30)."""
    mlp = make(shape, 16, 24, torch.float32)
    npu_mlp = on_npu(card, mlp)
    names = {child: name for name, child in _mlp_children(mlp).items()}
    names.update({child: name for name, child in _mlp_children(npu_mlp).items()})
    x = torch.randn(3, 16)
    runs = {}
    for label, run in (("eager", lambda: mlp(x)), ("card", lambda: kernel_output(card, npu_mlp, x.to("npu")))):
        calls_seen = []

        def record(module, args, out, seen=calls_seen):
            if module in names:  # the MLP's children (eager's MLP itself is called too)
                seen.append(names[module])

        handle = torch.nn.modules.module.register_module_forward_hook(record)
        try:
            assert label == "eager" or "module hooks are registered" in unavailable_reason(card, npu_mlp, x.to("npu"))
            with torch.no_grad(), emulation.count_op_calls() as calls:
                out = run().cpu()
        finally:
            handle.remove()
        runs[label] = (calls_seen, out, calls["npu_swiglu"])
    assert runs["card"][0] == runs["eager"][0] and runs["card"][2] == 0
    assert sorted(runs["eager"][0]) == sorted(n for n in _mlp_children(mlp))
    assert torch.equal(runs["card"][1], runs["eager"][1])
    assert unavailable_reason(card, npu_mlp, x.to("npu")) is None


@pytest.mark.parametrize(
    ("shape", "tokens"),
    [("split", 3), ("split", 160), ("fused", 3), ("geglu", 3), ("geglu", 160)],
    ids=["split", "split, many tokens per weight row", "gate_up_proj", "geglu", "geglu, many tokens per weight row"],
)
def test_a_double_backward_gives_eagers_second_order_gradients(card, shape, tokens):
    """A gradient penalty through the fused MLP: npu_swiglu's backward has no derivative on the device, so a recorded
    backward differentiates eager's `silu(gate) * up` instead; the second-order gradients of the input and every
    weight are eager's, while the forward and the first-order backward stay fused (issue 30)."""
    mlp = make(shape, 16, 24, torch.float32, bias=shape != "fused")
    x = torch.randn(tokens, 16)

    def penalty_gradients(model, leaf, output):
        params = [leaf, *model.parameters()]
        first = torch.autograd.grad(output(model, leaf).square().sum(), params, create_graph=True)
        sum(g.square().sum() for g in first).backward()
        return [leaf.grad.cpu(), *(p.grad.cpu() for p in model.parameters())]

    want = penalty_gradients(mlp, x.clone().requires_grad_(), lambda model, leaf: model(leaf))
    npu_mlp = on_npu(card, mlp)
    with emulation.count_op_calls() as calls:
        got = penalty_gradients(npu_mlp, x.to("npu").requires_grad_(), partial(kernel_output, card))
    assert calls[fused_op(shape)] == 1
    for name, g, w in zip(["x", *(n for n, _ in mlp.named_parameters())], got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=name)


class Linear(nn.Linear):
    """A subclass with nn.Linear's own name, as peft's LoRA layer (peft.tuners.lora.layer.Linear) is."""


def test_a_projection_of_a_class_named_linear_is_named_by_its_module(card):
    """The reason names the class with its module: "gate_proj is Linear, not a plain nn.Linear" names neither."""
    mlp = make("split", 16, 24, torch.float32).to("npu")
    mlp.gate_proj.__class__ = Linear
    x = torch.randn(3, 16).to("npu")
    reason = card.swiglu_mlp_unavailable_reason(x, mlp.gate_proj, mlp.up_proj, mlp.act_fn)
    assert f"gate_proj is {__name__}.Linear, not a plain nn.Linear" in reason, reason
