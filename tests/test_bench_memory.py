"""The bench's memory measure (scripts/bench/memory.py): hand-counted cases, a negative control, what the fused
stand-ins keep against what the emulated ops keep, and eager against kernelized on a region."""

from __future__ import annotations

import pytest
import torch
from bench import cards, configs, counted, regions
from bench.accounting import Memory, count_device_ops, fake_module, fused_ops
from bench.memory import measure_memory
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from npu_hub_kernels import CARDS

F32 = 4
TINY_LLAMA = configs.TINY_SPECS[0]
Z = 4 * 16 * F32
"""Bytes of a float32 [4, 16]: x [4, 8] through a Linear(8 -> 16)."""


def _linear_then(after):
    """(x [4, 8] float32 requiring grad, the weight [16, 8], fn(x) = after(linear(x))) on fake npu tensors."""
    x = torch.empty(4, 8, device="npu", requires_grad=True)
    weight = torch.nn.Parameter(torch.empty(16, 8, device="npu"))
    return x, weight, lambda x: after(torch.nn.functional.linear(x, weight))


def test_linear_relu_keeps_the_relu_output_and_peaks_as_counted_by_hand():
    """relu(linear(x)): mm keeps x and the weight (baseline, not counted), relu keeps its output y: saved Z. Peak,
    in the backward: y (held by the caller), dy, dz = relu's backward, and mm's backward writes dx [4, 8] and
    dW [16, 8] while dz lives (z itself died after the forward: nothing keeps it)."""
    with FakeTensorMode():
        x, weight, fn = _linear_then(torch.relu)
        memory = measure_memory(fn, (x,), {}, [weight])
    assert memory == Memory(saved_bytes=Z, peak_bytes=3 * Z + 4 * 8 * F32 + 16 * 8 * F32)


def test_an_extra_saved_tensor_is_counted_and_a_tensor_saved_twice_once():
    """Negative control: relu(z) * z makes the mul keep z beside relu's output (2 Z saved, one more than relu(z)
    alone); relu(z) * relu(z) keeps the one output twice, counted once (Z); x * w keeps only baseline (0) and
    peaks at its output, the output's gradient, dx and dw."""
    with FakeTensorMode():
        x, weight, extra = _linear_then(lambda z: torch.relu(z) * z)
        _, _, twice = _linear_then(lambda z: (lambda y: y * y)(torch.relu(z)))
        assert measure_memory(extra, (x,), {}, [weight]).saved_bytes == 2 * Z
        assert measure_memory(twice, (x,), {}, [weight]).saved_bytes == Z
        w = torch.nn.Parameter(torch.empty(4, 8, device="npu"))
        assert measure_memory(lambda x: x * w, (x,), {}, [w]) == Memory(saved_bytes=0, peak_bytes=4 * 4 * 8 * F32)


def _saved_layouts(run) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The (shape, dtype) of each tensor autograd keeps for `run()`'s backward, sorted."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sorted(saved, key=str)


def _op_calls():
    """A call of each emulated torch_npu op that has a backward, its float tensors requiring grad."""
    npu = {"device": "npu"}
    leaf = lambda *shape: torch.randn(*shape, **npu).requires_grad_()  # noqa: E731
    indices = torch.tensor([[0, 2], [1, 0], [2, 2], [0, 1], [1, 2]], **npu)
    order = torch.argsort(indices.flatten(), stable=True).to(torch.int32)
    return {
        "npu_rms_norm": ((leaf(2, 3, 8), leaf(8)), {}),
        "npu_rotary_mul": ((leaf(1, 2, 4, 8), *torch.randn(2, 1, 1, 4, 8, **npu)), {}),  # x alone needs grad
        "npu_swiglu": ((leaf(4, 16),), {}),
        "npu_moe_token_permute": ((leaf(5, 8), indices), {}),
        "npu_moe_token_unpermute": ((leaf(10, 8), order), {"probs": leaf(5, 2)}),
        "npu_moe_gating_top_k": ((leaf(6, 8), 2), {"out_flag": True}),
        "npu_fusion_attention": (
            (leaf(2, 6, 4, 8), leaf(2, 6, 2, 8), leaf(2, 6, 2, 8), 4, "BSND"),
            {"atten_mask": torch.ones(2048, 2048, dtype=torch.bool, **npu).triu(1), "sparse_mode": 3},
        ),
    }


@pytest.mark.parametrize("name", list(_op_calls()))
def test_each_fused_stand_in_keeps_what_the_emulated_op_keeps(name):
    """The bench's stand-in of each fused op (its FusedOp rule) keeps for backward tensors of the shapes and dtypes
    the emulated op keeps (which keeps what the device keeps: tests/test_emulation.py); npu_rotary_mul keeps x
    even when only x needs a gradient, though its backward kernel then does not read it."""
    import torch_npu

    args, kwargs = _op_calls()[name]
    real = _saved_layouts(lambda: getattr(torch_npu, name)(*args, **kwargs))
    with count_device_ops():
        stand_in = _saved_layouts(lambda: getattr(torch_npu, name)(*args, **kwargs))
    assert stand_in == real and real


def test_what_rotary_mul_keeps_is_not_what_its_backward_reads():
    """Negative control of the test above: with only x needing a gradient, npu_rotary_mul's backward kernel reads
    r1 and r2 alone, but its autograd node keeps x too; a stand-in keeping what the backward reads would keep less."""
    import torch_npu

    (x, r1, r2), _ = _op_calls()["npu_rotary_mul"]
    real = _saved_layouts(lambda: torch_npu.npu_rotary_mul(x, r1, r2))
    bound = {"x": x, "r1": r1, "r2": r2}
    reads = fused_ops()["npu_rotary_mul"].backward_reads(bound, None)
    assert sorted(((tuple(t.shape), t.dtype) for t in reads), key=str) != real
    assert len(reads) == len(real) - 1


def _fake_norm(fake_mode: FakeTensorMode) -> LlamaRMSNorm:
    with torch.device("meta"):
        norm = LlamaRMSNorm(64).to(torch.bfloat16)
    return fake_module(norm, fake_mode, "npu")


def test_eager_rms_norm_keeps_its_float32_input_copy_npu_rms_norm_only_rstd(npu_kernels):
    """LlamaRMSNorm of x [2, 8, 64] bf16: eager keeps x in float32 (pow, mul), rsqrt's output [2, 8, 1] float32 and
    the normalised x cast back to bf16 (the weight's mul); npu_rms_norm keeps x and the weight (baseline) and rstd
    [2, 8, 1] float32."""
    x_bf16, x_f32, rstd = 2 * 8 * 64 * 2, 2 * 8 * 64 * F32, 2 * 8 * F32
    fake_mode = FakeTensorMode()
    norm = _fake_norm(fake_mode)
    saved = {}
    for variant in ("eager", "kernelized"):
        regions.set_variant(norm, variant)
        with fake_mode:
            x = torch.empty(2, 8, 64, dtype=torch.bfloat16, device="npu", requires_grad=True)
            saved[variant] = measure_memory(norm, (x,), {}, norm.parameters()).saved_bytes
    regions.set_variant(norm, "eager")
    assert saved == {"eager": x_f32 + rstd + x_bf16, "kernelized": rstd}


def test_counted_run_measures_memory_with_grad_only(npu_kernels):
    """The counted bench's runs carry their memory forward+backward (the tally's `memory`), and none in inference."""
    fake_mode = FakeTensorMode()
    norm = _fake_norm(fake_mode)
    regions.set_variant(norm, "kernelized")
    with fake_mode:
        x = torch.empty(2, 8, 64, dtype=torch.bfloat16, device="npu", requires_grad=True)
        runs = {p: counted.count_run(norm, (x,), {}, norm.parameters(), p, None) for p in ("fwd", "fwd+bwd")}
        assert runs["fwd+bwd"].memory == measure_memory(norm, (x,), {}, norm.parameters())
    regions.set_variant(norm, "eager")
    assert runs["fwd"].memory is None


def test_layer_memory_rows_add_up_and_the_fused_regions_keep_their_floor(npu_kernels):
    """Tiny Llama, forward+backward: the layer's floor keeps what is kept outside the regions (the least over eager
    and kernelized) plus each region's floor_saved, and its floor peak is those saved bytes plus the least transient
    part of the measured layers; the SwiGLU MLP keeps exactly its floor (h and a), eager more; RMSNorm's floor keeps
    nothing beyond its input, npu_rms_norm its rstd, eager its float32 copy of x."""
    results = counted.account(TINY_LLAMA, 2, 16)
    assert all(m.floor_memory is None for (_, phase), m in results.items() if phase == "fwd")
    trained = {kind: m for (kind, phase), m in results.items() if phase == "fwd+bwd"}
    layer, region_kinds = trained.pop(cards.LAYER), trained
    variants = [(layer.eager, [m.eager for m in region_kinds.values()])]
    variants += [(layer.kernelized, [m.kernelized for m in region_kinds.values()])]
    outside = min(whole.memory.saved_bytes - sum(t.memory.saved_bytes for t in parts) for whole, parts in variants)
    floors = sum(m.floor_memory.saved_bytes for m in region_kinds.values())
    assert layer.floor_memory.saved_bytes == outside + floors
    transient = min(t.memory.peak_bytes - t.memory.saved_bytes for t in (layer.eager, layer.kernelized))
    assert layer.floor_memory.peak_bytes == layer.floor_memory.saved_bytes + transient
    mlp, norm = trained["SwiGLU MLP"], trained["RMSNorm"]
    tokens, inner = 2 * 16, TINY_LLAMA.config["intermediate_size"]
    assert mlp.kernelized.memory.saved_bytes == mlp.floor_memory.saved_bytes == tokens * 3 * inner * 2
    assert mlp.eager.memory.saved_bytes == tokens * 4 * inner * 2  # gate, up, silu(gate), their product
    assert norm.floor_memory.saved_bytes == 0
    # the input norm (the post-attention one is npu-add-rms-norm's): one float32 rstd per row
    assert norm.kernelized.memory.saved_bytes == tokens * F32
    add_norm = trained[CARDS["npu_fused_add_rmsnorm"].region]  # keeps the sum (its floor) and the rstd
    assert add_norm.floor_memory.saved_bytes == tokens * TINY_LLAMA.config["hidden_size"] * 2
    assert add_norm.kernelized.memory.saved_bytes == add_norm.floor_memory.saved_bytes + tokens * F32
    assert norm.eager.memory.saved_bytes > norm.kernelized.memory.saved_bytes
