"""The emulated Ascend host under what training stacks do to a device, as torch_npu does it: transformers'
Trainer pins its batches, saves and restores the npu RNG state and the optimizer states of a checkpoint, asks
whether bf16 is supported; TRL deep-copies the model for its reference; mixed precision runs under
`torch.autocast("npu")`. Each of these failed on the emulation before (tests/test_training_stacks.py runs them
end to end)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch_npu
from torch.utils.data import DataLoader, TensorDataset

from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm, token_ids


def test_pin_memory_gives_a_pinned_host_copy():
    """A DataLoader with pin_memory=True (the Trainer's default) pins its batches for the accelerator, the npu."""
    x = torch.randn(3, 4)
    assert not x.is_pinned()
    pinned = x.pin_memory()
    assert pinned.device.type == "cpu" and pinned.is_pinned() and pinned[1:].is_pinned()
    assert torch.equal(pinned, x) and pinned.stride() == x.stride() and pinned.data_ptr() != x.data_ptr()
    assert pinned.pin_memory() is pinned  # already pinned: no second copy
    on_npu = pinned.to("npu", non_blocking=True)
    assert not on_npu.is_pinned() and torch.equal(on_npu.cpu(), x)  # device memory is never "pinned"
    strided = torch.randn(4, 6)[:, ::2]
    assert torch.equal(strided.pin_memory(), strided)
    loader = DataLoader(TensorDataset(torch.arange(8.0).view(4, 2)), batch_size=2, pin_memory=True)
    batches = [batch for (batch,) in loader]
    assert all(batch.is_pinned() for batch in batches)
    assert torch.equal(torch.cat(batches), torch.arange(8.0).view(4, 2))


def test_npu_rng_state_is_the_state_npu_random_numbers_come_from():
    """What the Trainer saves as rng_state.pth["npu"] and sets back on resume."""
    state = torch.npu.random.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    first = torch.randn(5, device="npu").cpu()
    assert not torch.equal(torch.randn(5, device="npu").cpu(), first)
    torch.npu.random.set_rng_state(state)
    assert torch.equal(torch.randn(5, device="npu").cpu(), first)
    torch.npu.set_rng_state_all(torch.npu.get_rng_state_all())
    torch.npu.set_rng_state(state)
    assert torch.equal(torch.randn(5, device="npu").cpu(), first)
    assert torch.npu.is_bf16_supported()


def test_npu_tensors_pickle_as_device_tensors():
    """torch.save of npu tensors (a Trainer checkpoint's optimizer states) loads with weights_only=True, on the npu
    or where map_location says; Parameters stay Parameters."""
    x = torch.randn(3, 4).to("npu")
    saved = {"x": x, "view": x[1:], "ints": torch.arange(3).to("npu"), "param": torch.nn.Parameter(x.clone())}
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    for location, device in ((None, "npu"), ("cpu", "cpu")):
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True, map_location=location)
        assert {k: v.device.type for k, v in loaded.items()} == dict.fromkeys(saved, device)
        assert all(torch.equal(loaded[k].cpu(), v.cpu()) and loaded[k].dtype == v.dtype for k, v in saved.items())
        assert isinstance(loaded["param"], torch.nn.Parameter) and not isinstance(loaded["x"], torch.nn.Parameter)


def test_deepcopy_of_npu_tensors_and_models():
    """A TRL reference model is `copy.deepcopy(model)`: the same shapes and values in new device memory, tensors that
    shared a buffer (views, tied weights, packed gate/up) still share one in the copy."""
    x = torch.randn(3, 4).to("npu").requires_grad_()
    x.grad = torch.ones(3, 4).to("npu")
    y = copy.deepcopy(x)
    assert y.shape == x.shape and y.device == x.device and torch.equal(y.detach().cpu(), x.detach().cpu())
    assert y.data_ptr() != x.data_ptr() and y.requires_grad and torch.equal(y.grad.cpu(), x.grad.cpu())
    buffer = torch.randn(4, 3).to("npu")
    first, second = copy.deepcopy([buffer[:2], buffer[2:]])
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr() and second.storage_offset() == 6
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(x * 2)

    model = tiny_causal_lm("llama", tie_word_embeddings=True).to("npu")
    reference = copy.deepcopy(model)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert isinstance(q, torch.nn.Parameter) and q.shape == p.shape, name
        assert q.data_ptr() != p.data_ptr() and torch.equal(q.detach().cpu(), p.detach().cpu()), name
    with torch.no_grad():
        torch.testing.assert_close(reference(token_ids().to("npu")).logits, model(token_ids().to("npu")).logits)


def test_autocast_on_the_npu_follows_torch_npus_cast_policy():
    a, w = torch.randn(4, 8).to("npu"), torch.randn(3, 8).to("npu")
    embedding = torch.nn.Embedding(5, 8).to("npu")
    with torch.autocast("npu", dtype=torch.bfloat16):
        assert torch.nn.functional.linear(a, w).dtype == torch.bfloat16  # lower precision
        assert (a @ w.t()).dtype == torch.bfloat16
        assert a.double().matmul(a.double().t()).dtype == torch.float64  # float64 is never cast
        assert a.bfloat16().exp().dtype == torch.float32  # float32
        assert torch.softmax(a.bfloat16(), -1).dtype == torch.float32  # float32 output dtype, unless given
        assert torch.softmax(a.bfloat16(), -1, dtype=torch.bfloat16).dtype == torch.bfloat16
        assert a.bfloat16().sum().dtype == torch.float32
        assert torch.addcmul(a, a.bfloat16(), a.bfloat16()).dtype == torch.float32  # promote to the widest
        assert (a.bfloat16() + 1).dtype == torch.bfloat16  # no policy: the op's own dtypes
        assert embedding(torch.tensor([1, 2]).to("npu")).dtype == torch.float32
        y, rstd = torch_npu.npu_rms_norm(a, torch.ones(8).to("npu"))  # torch_npu ops are not cast
        assert y.dtype == torch.float32 and rstd.dtype == torch.float32
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            torch.nn.functional.binary_cross_entropy(torch.rand(3).to("npu"), torch.rand(3).to("npu"))
        host = torch.randn(2, 2)
        assert (host @ host).dtype == torch.float32  # autocast("npu") leaves host tensors alone
    assert torch.nn.functional.linear(a, w).dtype == torch.float32  # outside autocast nothing is cast


def test_autocast_linear_matches_an_explicit_cast_forward_and_backward():
    """The lower-precision policy computes what casting by hand computes, gradients included."""
    x, w = torch.randn(6, 8), torch.randn(5, 8)
    leaves = [t.to("npu").requires_grad_() for t in (x, w)]
    with torch.autocast("npu", dtype=torch.bfloat16), emulation.count_op_calls() as calls:
        out = torch.nn.functional.linear(*leaves)
    out.float().pow(2).sum().backward()
    manual = [t.clone().requires_grad_() for t in (x, w)]
    expected = torch.nn.functional.linear(manual[0].bfloat16(), manual[1].bfloat16())
    expected.float().pow(2).sum().backward()
    assert calls == {} and out.dtype == torch.bfloat16
    assert torch.equal(out.cpu(), expected)
    for leaf, reference in zip(leaves, manual, strict=True):
        assert leaf.grad.dtype == torch.float32 and torch.equal(leaf.grad.cpu(), reference.grad)
