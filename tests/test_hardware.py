"""On a real Ascend host: the cards load their arch variant and the fused op runs on the device.

Run there with `NPU_HUB_KERNELS_REAL_NPU=1 pytest -m npu_hardware tests/test_hardware.py` (the
variable keeps conftest from installing the emulation). Skipped everywhere else.

Every card's fused forms and ledger cases are the selftest's (`npu_hub_kernels.selftest.cases`): a form a card adds
there is tested here and by `python -m npu_hub_kernels selftest`, with the same judge and tolerances.
"""

from __future__ import annotations

import os
import platform

import pytest
import torch
from kernels import Mode, get_local_kernel, kernelize

from npu_hub_kernels import CARDS, register_npu_kernels, swapped_modules, unregister_npu_kernels
from npu_hub_kernels.selftest.cases import NotRunHere, cases_of
from npu_hub_kernels.selftest.forms import judge
from npu_hub_kernels.selftest.run import DEFAULT_MODELS, TOKENS
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


@pytest.mark.parametrize("model_type", ["qwen3_moe", "phi3", "glm4", "deepseek_v3", "gemma3_text", "gemma2"])
def test_every_card_runs_on_the_device_in_a_tiny_model(built_cards, model_type):
    """RoPE (half, GLM interleave, DeepSeek de-interleave), SwiGLU (split: two matmuls into one buffer; and gate_up),
    Gemma's GeGLU MLPs (npu_geglu and its backward) and MoE on hardware, training, against host eager."""
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
    if model_type.startswith("gemma"):  # GELU-tanh gated MLPs
        assert {s.layer for s in swapped_modules(model, card="npu-swiglu")} == {"GeGLUMLP"}
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_npu_geglu_activates_the_first_half_with_activate_left_and_its_backward(built_cards, dtype):
    """The GeGLU MLP's call form on the device (docs/torch-npu-ops.md, "npu_geglu"): `npu_geglu(h, dim=0,
    approximate=1, activate_left=True)` equals `gelu_tanh(first half) * second half` on the [2, T, I] buffer the
    card's two matmuls write, returns that GELU as its second output, and its backward (npu_geglu_grad, from x and
    that kept GELU) is the formula's gradient; with activate_left=False the SECOND half is activated."""
    import torch_npu

    shape, dim = (2, 37, 96), 0
    x = torch.randn(shape, dtype=dtype)
    leaf = x.npu().requires_grad_()
    out, gelu = torch_npu.npu_geglu(leaf, dim=dim, approximate=1, activate_left=True)
    out.float().square().sum().backward()
    reference = x.double().requires_grad_()
    first, second = reference.chunk(2, dim=dim)
    want_gelu = torch.nn.functional.gelu(first, approximate="tanh")
    expected = want_gelu * second
    expected.square().sum().backward()
    tolerance = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float16: {"rtol": 2e-3, "atol": 2e-3}}.get(
        dtype, {"rtol": 2e-2, "atol": 2e-2}
    )
    assert out.dtype == gelu.dtype == dtype and out.shape == gelu.shape == expected.shape
    torch.testing.assert_close(gelu.detach().cpu().double(), want_gelu.detach(), **tolerance)
    torch.testing.assert_close(out.detach().cpu().double(), expected.detach(), **tolerance)
    torch.testing.assert_close(leaf.grad.cpu().double(), reference.grad, **tolerance)
    right, _ = torch_npu.npu_geglu(x.npu(), dim=dim, approximate=1, activate_left=False)
    expected_right = first.detach() * torch.nn.functional.gelu(second.detach(), approximate="tanh")
    torch.testing.assert_close(right.cpu().double(), expected_right, **tolerance)


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


HARDWARE_FORMS = [(card, name, form) for card in CARDS.values() for name, form in cases_of(card).FORMS.items()]
"""Every fused form of every card, as the selftest runs them."""
HARDWARE_CASES = [(rule, calls) for card in CARDS.values() for rule, calls in cases_of(card).CASES.items()]
"""Every ledger rule's call just inside its limit and just past it, as the selftest's probes run them."""


@pytest.mark.parametrize(
    ("card", "name", "form"), HARDWARE_FORMS, ids=[f"{c.repo_name}: {n}" for c, n, _ in HARDWARE_FORMS]
)
def test_every_fused_form_holds_to_eager_on_the_device(built_cards, card, name, form):
    """The selftest's judge at the default models' widths: fused error at most the stated multiple of eager's."""
    loaded = get_local_kernel(built_cards / card.repo_name)
    for widths in (w.with_tokens(TOKENS[-1]) for w in DEFAULT_MODELS if form.applies(w)):
        for dtype in form.dtypes:
            judged = judge(loaded, form, widths, dtype, "npu")
            assert judged.status in ("pass", "eager"), f"{widths.model}, {dtype}: {judged.reason or judged.worst}"


@pytest.mark.parametrize(("rule", "calls"), HARDWARE_CASES, ids=[rule for rule, _ in HARDWARE_CASES])
def test_the_device_accepts_and_refuses_as_the_ledger_says(rule, calls):
    accepted, refused = calls
    try:
        accepted()
        torch.npu.synchronize()
    except NotRunHere as reason:
        pytest.skip(str(reason))
    with pytest.raises(RuntimeError) as refusal:
        refused()
        torch.npu.synchronize()
    if isinstance(refusal.value, NotRunHere):
        pytest.skip(str(refusal.value))


def _float32_out_addmm_reason(built_cards) -> str | None:
    """Why the loss card's weight gradient takes no 16-bit operands on this host (None: it does)."""
    card = get_local_kernel(built_cards / "npu-linear-cross-entropy")
    return card.loss.half_weight_grad_unavailable_reason()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_addmm_sums_16bit_products_into_a_float32_out_in_place_on_the_device(built_cards, dtype):
    """Issue 35's call form: `torch.addmm(acc, g.t(), h, out_dtype=torch.float32, out=acc)` dispatches, writes acc in
    place in float32, and its error against float64 is float32 accumulation's, not a 16-bit rounding's."""
    reason = _float32_out_addmm_reason(built_cards)
    if reason is not None:
        pytest.skip(reason)
    generator = torch.Generator().manual_seed(0)
    acc = torch.randn(4096, 512, generator=generator)
    g = (torch.randn(1024, 4096, generator=generator) / 64).to(dtype)
    h = torch.randn(1024, 512, generator=generator).to(dtype)
    want = acc.double() + g.double().t() @ h.double()
    on_device = acc.npu()
    address = on_device.data_ptr()
    out = torch.addmm(on_device, g.npu().t(), h.npu(), out_dtype=torch.float32, out=on_device)
    assert out.dtype == torch.float32 and out.data_ptr() == address
    error = ((out.cpu().double() - want).norm() / want.norm()).item()
    assert error < 1e-5, error  # a 16-bit rounding of the sum or the products would be about 1e-3


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_addmm_writes_16bit_products_and_a_row_bias_into_a_new_float32_out_on_the_device(built_cards, bias_dtype):
    """The loss card's logits and dL/dh form: `torch.addmm(row, h, w_t, out_dtype=torch.float32, out=new)`, a 1-D
    self aclnnAddmm folds into the matmul as its bias, dispatches and writes new in float32, its error against
    float64 float32 accumulation's (one 16-bit rounding of the result would be about 1e-3)."""
    reason = _float32_out_addmm_reason(built_cards)
    if reason is not None:
        pytest.skip(reason)
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(1024, 512, generator=generator).to(torch.bfloat16)
    w = (torch.randn(4096, 512, generator=generator) / 32).to(torch.bfloat16)
    row = torch.randn(4096, generator=generator).to(bias_dtype)
    want = row.double() + h.double() @ w.double().t()
    out = torch.empty(1024, 4096, dtype=torch.float32, device="npu")
    got = torch.addmm(row.npu(), h.npu(), w.npu().t(), out_dtype=torch.float32, out=out)
    assert got.dtype == torch.float32 and got.data_ptr() == out.data_ptr()
    error = ((got.cpu().double() - want).norm() / want.norm()).item()
    assert error < 1e-5, error


@pytest.mark.parametrize("chunks", [1, 4])
def test_loss_weight_gradient_from_bfloat16_products_within_twice_eagers_error_on_the_device(built_cards, chunks):
    """The loss card's chunked dW on the device (bf16 operands, float32 sum): counted nowhere here, so its error is
    the proof: at most twice eager's (one bf16 GEMM) against float64."""
    reason = _float32_out_addmm_reason(built_cards)
    if reason is not None:
        pytest.skip(reason)
    card = get_local_kernel(built_cards / "npu-linear-cross-entropy")
    generator = torch.Generator().manual_seed(chunks)
    tokens, hidden, vocab = 2048, 256, 8192
    lm_head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(vocab, hidden, generator=generator) / hidden**0.5)
    h = torch.randn(1, tokens, hidden, generator=generator)
    labels = torch.randint(0, vocab, (1, tokens), generator=generator)

    def weight_grad(fn, dtype, device, **kwargs):
        head = torch.nn.Linear(hidden, vocab, bias=False).to(dtype).to(device)
        head.load_state_dict(lm_head.state_dict())
        loss, _ = fn(h.to(dtype).to(device), head, labels.to(device), vocab, **kwargs)
        loss.backward()
        return head.weight.grad.cpu().double()

    reference = weight_grad(card.linear_cross_entropy_eager, torch.float64, "cpu")
    eager = weight_grad(card.linear_cross_entropy_eager, torch.bfloat16, "npu")
    fused = weight_grad(card.linear_cross_entropy, torch.bfloat16, "npu", chunk_tokens=tokens // chunks)
    errors = [((t - reference).norm() / reference.norm()).item() for t in (fused, eager)]
    assert errors[0] <= 2 * errors[1], errors


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
