"""Kernelized models in what real training stacks do, on the emulated npu: nothing may crash, lose fusion
silently, or make a number wrong.

What each run is compared with:
- float32: the same run without kernels, on the host. The emulated npu computes every op that is not fused
  with the host's own kernels, so an eager run on the host gives the numbers an eager run on the npu gives;
  and a host run cannot pick up the rotary function-module that any kernelize of the family switches for the
  whole process (README, "How the functions are reached"). Losses within rtol 1e-4, gradients within
  rtol 1e-4 / atol 1e-5, optimizer updates within 0.1% (whole-update relative L2, as tests/test_default_path.py).
- mixed precision (float32 weights under `torch.autocast("npu", torch.bfloat16)`): the flash-attention idiom.
  Against a float64 host reference, the kernelized run's error is at most twice the error of the same run
  without kernels under the same autocast on the npu (relative L2 per gradient, absolute for the loss).
- fusion: `emulation.count_op_calls()` over the whole run equals what the swapped modules should call; the runs
  without kernels call no fused op (negative controls).
"""

from __future__ import annotations

import pytest
import torch
from kernels import Mode, kernelize
from transformers.models.llama.modeling_llama import LlamaMLP

from npu_hub_kernels import emulation
from npu_hub_kernels.tiny_models import norm_module_count, token_ids
from npu_hub_kernels.tiny_models import tiny_causal_lm as tiny_model


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def layer_count(model) -> int:
    return model.config.num_hidden_layers


def split_mlp_count(model) -> int:
    return sum(isinstance(getattr(m, "gate_proj", None), torch.nn.Linear) for m in model.modules())


def experts_count(model) -> int:
    return sum(getattr(getattr(m, "gate_up_proj", None), "dim", lambda: 0)() == 3 for m in model.modules())


def host_reference(model_type: str, dtype=torch.float64):
    """The family's tiny model on the host, experts as the eager loop (torch's grouped_mm takes no float64)."""
    model = tiny_model(model_type).to(dtype)
    if experts_count(model):
        model.set_experts_implementation("eager")
    return model


# --- Mixed precision ------------------------------------------------------------------------------------------

AUTOCAST_CALLS = {
    # Llama: every norm sees the float32 residual stream and fuses; q/k come out of bfloat16 linears while
    # cos/sin stay float32, so eager's rotary promotes to float32 and the card falls back (counted 0); the MLP
    # input is float32 and fuses, its packed gate/up matmul autocast to bfloat16 as gate_proj(x) is.
    "llama": {"npu_rms_norm": 5, "npu_swiglu": 2},
    # Qwen3: q/k norms get bfloat16 q/k with a float32 weight: eager promotes, the card falls back (only the 5
    # layer and final norms fuse). Their float32 output meets float32 cos/sin: the rotary fuses, in float32.
    "qwen3": {"npu_rms_norm": 5, "npu_rotary_mul": 4, "npu_swiglu": 2},
    # Qwen3-MoE: as Qwen3; the experts get float32 hidden states and float32 weights (torch_npu's grouped matmul
    # is not autocast): 2 grouped matmuls forward and 4 backward per Experts module, in float32 as eager's.
    "qwen3_moe": {
        "npu_rms_norm": 5,
        "npu_rotary_mul": 4,
        "npu_swiglu": 2,
        "npu_moe_token_permute": 2,
        "npu_grouped_matmul": 12,
        "npu_moe_token_unpermute": 2,
    },
}


def autocast_loss_and_gradients(model, ids, *, autocast: bool = True):
    model.train()
    device = next(model.parameters()).device
    ids = ids.to(device)
    with torch.autocast("npu", dtype=torch.bfloat16, enabled=autocast):
        out = model(ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad.double().cpu() for name, p in model.named_parameters() if p.grad is not None}
    return out.loss.double().item(), grads, out.logits.dtype


@pytest.mark.parametrize("model_type", list(AUTOCAST_CALLS))
def test_autocast_forward_and_backward_within_the_eager_idiom(npu_kernels, model_type):
    """float32 weights under torch.autocast("npu", bfloat16): what fuses is what every path can compute right
    (AUTOCAST_CALLS), the rest falls back; loss and every gradient within twice eager autocast's error."""
    ids = token_ids()
    ref_loss, ref_grads, _ = autocast_loss_and_gradients(host_reference(model_type), ids, autocast=False)
    with emulation.count_op_calls() as eager_calls:
        eager_loss, eager_grads, eager_dtype = autocast_loss_and_gradients(tiny_model(model_type).to("npu"), ids)
    # The eager model is not kernelized: nothing fuses, except the family's shared rotary function-module that
    # an earlier kernelize in this process may have switched (exact in float32, README).
    assert set(eager_calls) <= {"npu_rotary_mul"}
    model = kernelize(tiny_model(model_type).to("npu"), mode=Mode.TRAINING, device="npu")
    with emulation.count_op_calls() as calls:
        loss, grads, dtype = autocast_loss_and_gradients(model, ids)
    assert dict(calls) == AUTOCAST_CALLS[model_type]
    assert dtype == eager_dtype == torch.bfloat16
    assert abs(loss - ref_loss) <= 2 * abs(eager_loss - ref_loss) + 1e-4, (loss, eager_loss, ref_loss)
    assert set(grads) == set(eager_grads) == set(ref_grads)
    for name, grad in grads.items():
        eager_error = relative_error(eager_grads[name], ref_grads[name])
        assert relative_error(grad, ref_grads[name]) <= 2 * eager_error + 1e-3, (name, eager_error)


def test_packed_split_mlp_backward_under_autocast(npu_kernels):
    """Regression: the packed gate/up matmul autocast to bfloat16 in forward, and its backward multiplied the
    bfloat16 gradient with the float32 weight outside autocast ("expected m1 and m2 to have the same dtype").
    It now runs under the forward's autocast state, as eager's linear backward does."""
    config = tiny_model("llama").config
    torch.manual_seed(0)
    weights = LlamaMLP(config).state_dict()
    x = torch.randn(2, 5, config.hidden_size)

    def mlp(dtype=torch.float32):
        module = LlamaMLP(config)
        module.load_state_dict(weights)
        return module.to(dtype)

    def run(module, device, autocast=True):
        module = module.to(device)
        leaf = x.to(device, next(module.parameters()).dtype).requires_grad_()
        with torch.autocast("npu", dtype=torch.bfloat16, enabled=autocast):
            out = module(leaf)
        out.float().pow(2).sum().backward()
        grads = {name: p.grad for name, p in module.named_parameters()}
        assert all(g.dtype == next(module.parameters()).dtype for g in grads.values())
        grads = {name: g.double().cpu() for name, g in {**grads, "x": leaf.grad}.items()}
        return out.double().cpu(), grads, out.dtype

    reference, ref_grads, _ = run(mlp(torch.float64), "cpu", autocast=False)
    eager, eager_grads, eager_dtype = run(mlp(), "npu")
    fused_mlp = mlp()
    kernelize(torch.nn.Sequential(fused_mlp), mode=Mode.TRAINING, device="npu")
    with emulation.count_op_calls() as calls:
        fused, fused_grads, fused_dtype = run(fused_mlp, "npu")
    assert calls == {"npu_swiglu": 1} and fused_dtype == eager_dtype == torch.bfloat16
    assert relative_error(fused, reference) <= 2 * relative_error(eager, reference) + 1e-3
    for name, grad in fused_grads.items():
        eager_error = relative_error(eager_grads[name], ref_grads[name])
        assert relative_error(grad, ref_grads[name]) <= 2 * eager_error + 1e-3, (name, eager_error)


def test_norms_under_autocast_fall_back_where_eager_promotes(npu_kernels):
    """A norm's input is bfloat16 under autocast when it follows a linear (Qwen3's q/k norms) while its weight is
    float32: eager returns float32 (weight * h.to(bfloat16) promotes), which npu_rms_norm cannot: the card runs
    eager's math. On the float32 residual stream (the layer norms) it fuses."""
    model = kernelize(tiny_model("qwen3").to("npu"), mode=Mode.TRAINING, device="npu")
    attention = model.model.layers[0].self_attn
    norm_inputs = {}
    hooks = [
        module.register_forward_pre_hook(lambda m, args, name=name: norm_inputs.__setitem__(name, args[0].dtype))
        for name, module in (("q_norm", attention.q_norm), ("input_layernorm", model.model.layers[0].input_layernorm))
    ]
    with torch.autocast("npu", dtype=torch.bfloat16), emulation.count_op_calls() as calls, torch.no_grad():
        model(token_ids().to("npu"))
    for hook in hooks:
        hook.remove()
    assert norm_inputs == {"q_norm": torch.bfloat16, "input_layernorm": torch.float32}
    assert calls["npu_rms_norm"] == norm_module_count(model) - 2 * layer_count(model)  # all but the q/k norms
