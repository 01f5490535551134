"""On a real Ascend host: the cards load their arch variant and the fused op runs on the device.

Run there with `NPU_HUB_KERNELS_REAL_NPU=1 pytest -m npu_hardware tests/test_hardware.py` (the
variable keeps conftest from installing the emulation). Skipped everywhere else.
"""

from __future__ import annotations

import os
import platform

import pytest
import torch
from kernels import Mode, get_local_kernel, kernelize

from npu_hub_kernels import register_npu_kernels, swapped_modules, unregister_npu_kernels
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import norm_module_count, token_ids
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm as tiny_model

pytestmark = [
    pytest.mark.npu_hardware,
    pytest.mark.skipif(
        emulation.is_installed() or not (hasattr(torch, "npu") and torch.npu.is_available()),
        reason="needs a real Ascend NPU with torch_npu and CANN (this host has none, or runs the emulation)",
    ),
]


def test_arch_variant_loads_and_fused_norm_matches_host_eager(built_cards):
    card = get_local_kernel(built_cards / "npu-rms-norm")
    torch_version = "".join(torch.__version__.split(".")[:2])
    assert card.VARIANT.startswith(f"torch{torch_version}-cxx11-cann") or card.VARIANT == "torch-npu"
    assert card.VARIANT.endswith(f"{platform.machine()}-linux") or card.VARIANT == "torch-npu"
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(4, 128, 4096, dtype=dtype)
        weight = torch.randn(4096, dtype=dtype)
        assert card.rms_norm_unavailable_reason(x.npu(), weight.npu(), "plain") is None
        got = card.rms_norm(x.npu(), weight.npu(), 1e-6).cpu()
        torch.testing.assert_close(got.float(), card.rms_norm_eager(x, weight, 1e-6).float(), rtol=2e-2, atol=2e-2)


def test_tiny_model_kernelized_on_the_device_matches_eager(built_cards):
    model = tiny_model("qwen3")
    ids = token_ids()
    with torch.no_grad():
        eager = model(ids).logits
    register_npu_kernels(local_dir=built_cards)
    try:
        model = kernelize(model.npu(), mode=Mode.INFERENCE, device="npu")
        with torch.no_grad():
            fused = model(ids.npu()).logits.cpu()
    finally:
        unregister_npu_kernels()
    assert len(swapped_modules(model, card="npu-rms-norm")) == norm_module_count(model)
    torch.testing.assert_close(fused, eager, rtol=1e-3, atol=1e-3)


def test_real_host_is_not_emulated():
    assert os.environ.get("NPU_HUB_KERNELS_REAL_NPU") == "1"


@pytest.mark.parametrize("model_type", ["qwen3_moe", "phi3", "glm4", "deepseek_v3"])
def test_every_card_runs_on_the_device_in_a_tiny_model(built_cards, model_type):
    """RoPE (half, GLM interleave, DeepSeek de-interleave), SwiGLU (split: two matmuls into one buffer; and gate_up)
    and MoE on hardware; then the one-call in-place RoPE op in inference mode (head dim 128)."""
    model = tiny_model(model_type)
    ids = token_ids()
    with torch.no_grad():
        eager = model(ids).logits
    register_npu_kernels(local_dir=built_cards)
    try:
        model = kernelize(model.npu(), mode=Mode.TRAINING, device="npu")
        fused = model(ids.npu()).logits
        fused.float().pow(2).mean().backward()  # the grouped-matmul and gate/up-halves backwards run
    finally:
        unregister_npu_kernels()
    assert swapped_modules(model, card="npu-rope")
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    torch.testing.assert_close(fused.detach().cpu(), eager, rtol=1e-3, atol=1e-3)


def test_inference_mode_rotates_q_and_k_in_one_call_on_the_device(built_cards):
    """npu_apply_rotary_pos_emb in place (BSND, head dim 128, per-row positions) against eager."""
    model = tiny_model("llama", head_dim=128)
    ids = token_ids()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        eager = model(ids, position_ids=positions).logits
    register_npu_kernels(local_dir=built_cards)
    try:
        model = kernelize(model.npu(), mode=Mode.INFERENCE, device="npu")
        with torch.inference_mode():
            fused = model(ids.npu(), position_ids=positions.npu()).logits.cpu()
    finally:
        unregister_npu_kernels()
    torch.testing.assert_close(fused, eager, rtol=1e-3, atol=1e-3)


def test_npu_swiglu_gates_the_halves_of_dim_0_with_its_backward(built_cards):
    """The split MLP's contract on the device: `npu_swiglu(buf, dim=0)` on a [2, T, I] buffer equals
    `silu(buf[0]) * buf[1]`, and its backward passes dim through (docs/torch-npu-ops.md, "npu_swiglu")."""
    import torch_npu

    for dtype in (torch.float32, torch.bfloat16):
        halves = torch.randn(2, 37, 96, dtype=dtype)
        leaf = halves.npu().requires_grad_()
        out = torch_npu.npu_swiglu(leaf, dim=0)
        out.float().square().sum().backward()
        reference = halves.double().requires_grad_()
        expected = torch.nn.functional.silu(reference[0]) * reference[1]
        expected.square().sum().backward()
        assert out.shape == (1, 37, 96)
        tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(out[0].cpu().double(), expected.detach(), **tolerance)
        torch.testing.assert_close(leaf.grad.cpu().double(), reference.grad, **tolerance)


@pytest.mark.parametrize(
    "model_type", ["llama", "qwen2_moe", "deepseek_v3"], ids=["loss card", "softmax router", "sigmoid router"]
)
def test_one_bfloat16_training_step_on_the_device(built_cards, model_type):
    """Issue 26's call forms on the device, in the default use_kernels path of a bf16 training step: the fused loss
    (its backward op given grad_loss in log_prob's float32), a softmax router (no softmax-mode backward: it trains
    eager) and a sigmoid group router (the op and its backward). Loss within bf16 reach of host eager, every
    gradient finite, the weights updated."""
    model = tiny_model(model_type, dtype=torch.bfloat16).train()
    ids = token_ids()
    labels = ids.clone()
    labels[0, :3] = -100  # some ignored tokens, as an SFT prompt's
    eager_loss = model(ids, labels=labels).loss.float()
    register_npu_kernels(local_dir=built_cards)
    try:
        model = kernelize(model.npu(), mode=Mode.TRAINING, device="npu")
        output = model(ids.npu(), labels=labels.npu())
        output.loss.backward()
        before = [p.detach().clone() for p in model.parameters()]
        torch.optim.SGD(model.parameters(), lr=1e-2).step()
    finally:
        unregister_npu_kernels()
    assert swapped_modules(model, card="npu-linear-cross-entropy") and output.logits is None
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters(), strict=True))
    torch.testing.assert_close(output.loss.detach().float().cpu(), eager_loss, rtol=2e-2, atol=2e-2)


ATTENTION_FORMS = {
    "causal prefill": dict(family="llama"),
    "decode with a cache": dict(family="qwen3", generate=True),
    "sliding window": dict(family="mistral", sliding_window=4),
    "sliding layers": dict(family="gemma3_text", sliding_window=4),
    "left padding": dict(family="llama", padding=True),
    "packed by position_ids": dict(family="mistral", sliding_window=4, packed="position_ids"),
    "packed by cu_seq_lens": dict(family="mistral", sliding_window=4, packed="cu_seq_lens"),
    "training with dropout": dict(family="llama", attention_dropout=0.1, train=True),
}


@pytest.mark.parametrize("form", list(ATTENTION_FORMS))
def test_npu_fused_attention_forms_match_eager_on_the_device(built_cards, form):
    """Each fused form of npu-fused-attention on the device against the model's eager attention on the device."""
    case = dict(ATTENTION_FORMS[form])
    family, generate, padding, packed = (case.pop(k, None) for k in ("family", "generate", "padding", "packed"))
    train = case.pop("train", False)
    register_npu_kernels(local_dir=built_cards, kernels="npu_fused_attention")
    # float32 where greedy tokens are compared (no bfloat16 near-ties between two roundings)
    model = tiny_model(family, dtype=torch.float32 if generate else torch.bfloat16, **case).npu()
    ids = token_ids(1 if packed else 2, 24).npu()
    inputs = {"use_cache": False}
    if padding:
        mask = torch.ones(2, 24, dtype=torch.long)
        mask[0, :5] = 0
        inputs["attention_mask"] = mask.npu()
    if packed:
        inputs["position_ids"] = torch.cat([torch.arange(10), torch.arange(14)])[None].npu()
    if packed == "cu_seq_lens":
        cu = torch.tensor([0, 10, 24], dtype=torch.int32).npu()
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=14, max_length_k=14)
    outputs = {}
    for implementation in ("eager", "npu_fused_attention"):
        model.set_attn_implementation(implementation)
        model.train(train)
        logits = model(ids, **inputs).logits
        if train:  # dropout draws differ: check the step runs forward and backward, finite
            logits.float().mean().backward()
            assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
            model.zero_grad()
        outputs[implementation] = logits.detach().float().cpu()
        if generate:
            outputs[implementation + " tokens"] = model.generate(ids[:, :8], max_new_tokens=6, do_sample=False).cpu()
    if not train:
        kept = inputs["attention_mask"].bool().cpu() if padding else torch.ones(outputs["eager"].shape[:2], dtype=bool)
        torch.testing.assert_close(outputs["npu_fused_attention"][kept], outputs["eager"][kept], rtol=3e-2, atol=3e-2)
    if generate:
        assert torch.equal(outputs["npu_fused_attention tokens"], outputs["eager tokens"])
