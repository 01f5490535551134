"""The path users get, with no extra call: `register_npu_kernels()`, then `from_pretrained(..., device_map="npu",
use_kernels=True)`. Split SiLU-gated MLPs (gate_proj/up_proj) must fuse there, and keep fusing through casts and
mode switches, with the same Parameter objects. Negative controls: LoRA-wrapped projections and a GELU MLP never
fuse, and give the eager result. Training and saving on this path: tests/test_training_stacks.py (a deep-copied
reference, Trainer with gradient checkpointing) and tests/test_checkpoints.py.
"""

from __future__ import annotations

import pytest
import torch
from numerics import max_error
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from npu_hub_kernels import swapped_modules
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm as tiny_model
from npu_hub_kernels.testing.tiny_models import token_ids

SPLIT_MLP_FAMILIES = ["llama", "qwen3"]


def mlp_count(model) -> int:
    return sum(hasattr(m, "gate_proj") and hasattr(m, "up_proj") for m in model.modules())


def load(tmp_path, model_type: str):
    """The family's tiny model saved, then loaded the way the README says: device_map="npu", use_kernels=True."""
    source = tiny_model(model_type)
    source.save_pretrained(tmp_path / model_type)
    return source, AutoModelForCausalLM.from_pretrained(tmp_path / model_type, device_map="npu", use_kernels=True)


def logits(model, ids=None):
    ids = token_ids() if ids is None else ids
    with torch.no_grad():
        return model(ids.to(next(model.parameters()).device)).logits.float().cpu()


@pytest.mark.parametrize("model_type", SPLIT_MLP_FAMILIES)
def test_split_mlps_fuse_on_the_default_path_through_casts_modes_and_training(npu_kernels, tmp_path, model_type):
    source, model = load(tmp_path, model_type)
    params = dict(model.named_parameters())
    saved = {k: v.clone() for k, v in source.state_dict().items()}
    mlps = mlp_count(model)
    assert len(swapped_modules(model, card="npu-swiglu")) == mlps

    with emulation.count_op_calls() as calls:  # eval, float32
        out = logits(model)
    assert calls["npu_swiglu"] == mlps
    torch.testing.assert_close(out, logits(source), rtol=1e-5, atol=1e-5)
    state = model.state_dict()
    assert state.keys() == saved.keys() and all(torch.equal(state[k].cpu(), v) for k, v in saved.items())

    model.to(torch.bfloat16)  # a cast reallocates the weights: the next call reads them where they now are
    with emulation.count_op_calls() as calls:
        out = logits(model)
    assert calls["npu_swiglu"] == mlps
    eager_bf16_error = max_error(logits(tiny_model(model_type, dtype=torch.bfloat16)), logits(source))
    assert max_error(out, logits(source)) <= 2 * eager_bf16_error + 1e-3

    model.train()
    ids = token_ids().to("npu")
    with emulation.count_op_calls() as calls:
        model(ids, labels=ids).loss.backward()
    assert calls["npu_swiglu"] == mlps
    assert all(p.grad is not None for name, p in model.named_parameters() if "gate_proj" in name or "up_proj" in name)
    model.eval()
    with emulation.count_op_calls() as calls:
        logits(model)
    assert calls["npu_swiglu"] == mlps
    assert all(p is params[name] for name, p in model.named_parameters()) and len(params) == len(
        dict(model.named_parameters())
    )


def test_lora_wrapped_mlps_never_fuse_and_match_eager(npu_kernels, tmp_path):
    """Negative control: PEFT wraps gate_proj/up_proj; the layer must not touch them (eager path, same numbers)."""
    source, model = load(tmp_path, "llama")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    torch.manual_seed(0)
    eager = get_peft_model(source, lora)
    torch.manual_seed(0)
    wrapped = get_peft_model(model, lora)
    storages = {n: p.untyped_storage().data_ptr() for n, p in wrapped.named_parameters()}
    with emulation.count_op_calls() as calls:
        out = logits(wrapped)
    assert calls["npu_swiglu"] == 0 and calls["npu_rms_norm"] > 0
    assert {n: p.untyped_storage().data_ptr() for n, p in wrapped.named_parameters()} == storages
    torch.testing.assert_close(out, logits(eager), rtol=1e-5, atol=1e-5)


def test_a_gelu_mlp_never_fuses(npu_kernels, tmp_path):
    source = tiny_model("llama")
    source.config.hidden_act = "gelu"
    gelu = type(source)(source.config).eval()
    gelu.load_state_dict(source.state_dict())
    gelu.save_pretrained(tmp_path / "gelu")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "gelu", device_map="npu", use_kernels=True)
    with emulation.count_op_calls() as calls:
        out = logits(model)
    assert calls["npu_swiglu"] == 0 and calls["npu_rms_norm"] > 0
    torch.testing.assert_close(out, logits(gelu), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_inference_mode_rotates_q_and_k_of_a_layer_in_one_call(npu_kernels, tmp_path, model_type):
    """Head dim 64 and per-row positions: one in-place npu_apply_rotary_pos_emb per layer, no npu_rotary_mul;
    with no_grad instead of inference_mode, or positions shared by the batch, two npu_rotary_mul per layer."""
    source = tiny_model(model_type, head_dim=64)
    source.save_pretrained(tmp_path / "hd64")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hd64", device_map="npu", use_kernels=True)
    layers = model.config.num_hidden_layers
    ids = token_ids()
    positions = torch.arange(ids.shape[1]).expand_as(ids)  # [B, S]: cos/sin per batch row
    eager = source(ids, position_ids=positions).logits.detach()
    with torch.inference_mode(), emulation.count_op_calls() as calls:
        out = model(ids.to("npu"), position_ids=positions.to("npu")).logits.cpu()
    assert calls["npu_apply_rotary_pos_emb"] == layers and calls["npu_rotary_mul"] == 0
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), emulation.count_op_calls() as calls:
        out = model(ids.to("npu"), position_ids=positions.to("npu")).logits.cpu()
    assert calls["npu_apply_rotary_pos_emb"] == 0 and calls["npu_rotary_mul"] == 2 * layers
    with torch.inference_mode(), emulation.count_op_calls() as calls:
        model(ids.to("npu")).logits.cpu()  # positions [1, S]: cos shared by the batch, which the op cannot take
    assert calls["npu_apply_rotary_pos_emb"] == 0 and calls["npu_rotary_mul"] == 2 * layers


@pytest.mark.parametrize(("model_type", "kept"), [("llama", "q_proj"), ("qwen3", "k_norm")])
def test_a_hook_that_keeps_q_or_k_sees_them_unrotated_as_under_eager(npu_kernels, tmp_path, model_type, kept):
    """A forward hook that keeps a projection's or q/k norm's output (activation capture, steering) holds the memory
    the in-place rotation would write: that layer rotates out of place, so the hook keeps eager's values; the layers
    without a hook still take the one in-place call."""
    source = tiny_model(model_type, head_dim=64)
    source.save_pretrained(tmp_path / "hd64")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hd64", device_map="npu", use_kernels=True)
    ids = token_ids()
    positions = torch.arange(ids.shape[1]).expand_as(ids)  # [B, S]: the in-place op's form
    seen = {}
    for name, net in (("eager", source), ("fused", model)):
        module = net.get_submodule(f"model.layers.0.self_attn.{kept}")
        handle = module.register_forward_hook(lambda _module, _args, out, name=name: seen.setdefault(name, out))
        device = next(net.parameters()).device
        with torch.inference_mode(), emulation.count_op_calls() as calls:
            net(ids.to(device), position_ids=positions.to(device))
        handle.remove()
    layers = model.config.num_hidden_layers
    assert calls["npu_apply_rotary_pos_emb"] == layers - 1 and calls["npu_rotary_mul"] == 2
    torch.testing.assert_close(seen["fused"].cpu(), seen["eager"], rtol=1e-5, atol=1e-5)


def test_a_vision_language_model_fed_images_trains_as_eager(npu_kernels, tmp_path):
    """Qwen2.5-VL with an image in each of two sequences, one left-padded: its RMSNorms and SwiGLU MLPs fuse, and the
    loss and every gradient are eager's. Its vision tower indexes npu tensors with
    a window index built on the host, which torch_npu moves to the device (docs/emulation.md)."""
    image, start, end = 90, 92, 93  # token ids inside the tiny vocabulary
    source = tiny_model("qwen2_5_vl", image_token_id=image, vision_start_token_id=start, vision_end_token_id=end)
    source.save_pretrained(tmp_path / "vl")
    model = type(source).from_pretrained(tmp_path / "vl", device_map="npu", use_kernels=True).train()
    eager = source.to("npu").train()
    ids = torch.tensor([[1, 2, start, *[image] * 4, end, 5, 6, 7, 8], [0, 0, 5, 6, start, *[image] * 4, end, 9, 10]])
    mask = (torch.arange(12) >= torch.tensor([[0], [2]])).long()
    vision = source.config.vision_config
    patch = 3 * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(32, patch, generator=torch.Generator().manual_seed(1))  # 2 images of 4 x 4 patches
    batch = {
        "input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100),
        "pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4]]),
    }  # fmt: skip
    batch = {name: value.to("npu") for name, value in batch.items()}
    losses = []
    for net in (eager, model):
        with emulation.count_op_calls() as calls:
            loss = net(**batch).loss
            loss.backward()
        losses.append(loss.detach().cpu())
        fused = calls["npu_rms_norm"] + calls["npu_swiglu"]
        assert fused == 0 if net is eager else calls["npu_rms_norm"] > 0 and calls["npu_swiglu"] > 0
    torch.testing.assert_close(losses[1], losses[0])
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), grads[name].grad.cpu(), msg=name)


def test_inputs_embeds_made_under_inference_mode_train_as_eager(npu_kernels, tmp_path):
    """A frozen encoder's features, made under torch.inference_mode, fed as inputs_embeds to a model that trains:
    every fused op sees them or what they become, and the loss and gradients are eager's."""
    source, model = load(tmp_path, "llama")
    eager = source.to("npu")
    ids = token_ids().to("npu")
    results = []
    for net in (eager, model.train()):
        with torch.inference_mode():
            embeds = net.get_input_embeddings()(ids)
        with emulation.count_op_calls() as calls:
            loss = net.train()(inputs_embeds=embeds, labels=ids).loss
            loss.backward()
        assert (calls["npu_rms_norm"] > 0) is (net is model)
        grads = {name: p.grad.cpu() for name, p in net.named_parameters() if p.grad is not None}
        results.append((loss.detach().cpu(), grads))
    torch.testing.assert_close(results[1][0], results[0][0])
    assert results[1][1].keys() == results[0][1].keys() and len(results[0][1]) > 1
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, msg=name)
