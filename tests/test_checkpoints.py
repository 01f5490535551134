"""Checkpoints keep every weight after the cards ran: every way users save writes the model's own tensors.

A kernelized tiny Llama and Qwen3 (split gate/up MLPs, fused) run forwards and AdamW steps on the npu; then
`save_pretrained`, accelerate's `save_model` / `save_state` / `load_state`, safetensors' `save_model` /
`load_model`, huggingface_hub's `save_torch_state_dict` and `torch.save` of single tensors write exactly the keys,
values and sizes of the same model trained without kernels, and reload to its logits. (An earlier design laid
gate/up out in one shared buffer: accelerate then dropped every `up_proj.weight` as a "tied" weight, safetensors
refused to save or load, and `torch.save` of one weight wrote both.)
"""

from __future__ import annotations

import io

import pytest
import safetensors.torch
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from huggingface_hub import save_torch_state_dict
from kernels import Mode, kernelize
from numerics import train_steps

from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm as tiny_model
from npu_hub_kernels.testing.tiny_models import token_ids

FAMILIES = ["llama", "qwen3"]
BATCHES = [token_ids(seed=s) for s in range(2)]


def trained(model_type: str, kernels: bool):
    """The family's tiny model on the npu after 2 AdamW steps (and a forward), kernelized or not."""
    model = tiny_model(model_type).to("npu")
    if kernels:
        kernelize(model, mode=Mode.TRAINING, device="npu")
    with emulation.count_op_calls() as calls:
        train_steps(model, BATCHES, lambda params: torch.optim.AdamW(params, lr=1e-2))
        logits_of(model)
    mlps = sum(hasattr(m, "gate_proj") for m in model.modules())
    assert calls["npu_swiglu"] == (3 * mlps if kernels else 0)  # 2 steps and a forward, or none (control)
    return model


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(token_ids().to(next(model.parameters()).device)).logits.float().cpu()


def host_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def assert_written(got: dict[str, torch.Tensor], model, eager) -> None:
    """What was written: the keys, shapes and dtypes of the model trained without kernels, and the values of the
    model itself, exactly (the two runs' values agree by the convergence idiom, tests/numerics.py)."""
    want, own = host_state(eager), host_state(model)
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].shape == tensor.shape and got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key].cpu(), own[key]), key


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, built_cards):
    """(the model trained with the cards, the same model trained without), for one family."""
    from npu_hub_kernels import register_npu_kernels, unregister_npu_kernels

    eager = trained(request.param, kernels=False)
    register_npu_kernels(local_dir=built_cards)
    try:
        yield request.param, trained(request.param, kernels=True), eager
    finally:
        unregister_npu_kernels()


def reload(model_type: str, state: dict[str, torch.Tensor]):
    model = tiny_model(model_type)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


def test_save_pretrained_writes_eager_tensors_and_reloads_to_the_same_logits(pair, tmp_path):
    _, model, eager = pair
    model.save_pretrained(tmp_path)
    assert_written(safetensors.torch.load_file(tmp_path / "model.safetensors"), model, eager)
    reloaded = type(model).from_pretrained(tmp_path)
    torch.testing.assert_close(logits_of(reloaded), logits_of(model), rtol=1e-5, atol=1e-5)


def test_accelerate_save_model_save_state_and_load_state_keep_every_weight(pair, tmp_path):
    _, model, eager = pair
    # accelerate keeps one state per process: a Trainer(bf16=True) earlier in this process would make this
    # Accelerator's prepare() wrap the shared model's forward in bf16 autocast for the tests after this one
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(mixed_precision="no")
    accelerator.save_model(model, tmp_path / "model")
    saved = safetensors.torch.load_file(tmp_path / "model" / "model.safetensors")
    assert_written(saved, model, eager)
    prepared = accelerator.prepare(model)
    accelerator.save_state(tmp_path / "state")
    state = safetensors.torch.load_file(tmp_path / "state" / "model.safetensors")
    assert_written(state, model, eager)
    expected = logits_of(model)
    with torch.no_grad():
        for p in prepared.parameters():
            p.zero_()
    accelerator.load_state(tmp_path / "state")
    torch.testing.assert_close(logits_of(prepared), expected, rtol=1e-5, atol=1e-5)


def test_safetensors_save_model_and_load_model(pair, tmp_path):
    model_type, model, eager = pair
    safetensors.torch.save_model(model, tmp_path / "model.safetensors")
    assert_written(safetensors.torch.load_file(tmp_path / "model.safetensors"), model, eager)
    fresh = tiny_model(model_type).to("npu")
    missing, unexpected = safetensors.torch.load_model(fresh, tmp_path / "model.safetensors")
    assert not missing and not unexpected
    torch.testing.assert_close(logits_of(fresh), logits_of(model), rtol=1e-5, atol=1e-5)


def test_huggingface_hub_save_torch_state_dict(pair, tmp_path):
    model_type, model, eager = pair
    save_torch_state_dict(model.state_dict(), tmp_path)
    saved = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert_written(saved, model, eager)
    torch.testing.assert_close(logits_of(reload(model_type, saved)), logits_of(model), rtol=1e-5, atol=1e-5)


def test_torch_save_of_one_weight_writes_that_weight_alone(pair):
    _, model, _ = pair
    for name in ("gate_proj", "up_proj"):
        weight = getattr(model.model.layers[0].mlp, name).weight
        buffer = io.BytesIO()
        torch.save(weight.detach(), buffer)
        own_bytes = weight.numel() * weight.element_size()
        assert own_bytes <= buffer.getbuffer().nbytes < own_bytes + 4096, name  # its bytes and a small header
        buffer.seek(0)
        loaded = torch.load(buffer)
        assert loaded.shape == weight.shape and torch.equal(loaded.cpu(), weight.detach().cpu()), name
