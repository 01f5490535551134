"""npu-moe, op level: the card's experts forward and backward against a float64 loop, and which path runs.

The reference is the experts formula written as a plain loop in float64:
`out[t] = sum_j w[t, j] * down[e] @ (silu(gate[e] @ x_t) * (up[e] @ x_t))`, e = top_k_index[t, j].
Parity follows flash-attention's idiom against transformers' own eager experts loop in the same
dtype. The grouped path is proven by the emulated ops' call counters. Under torch.compile and torch.export the
layer runs the module's own forward: the module and a tiny model give what they give without the card, traced alike.
"""

from __future__ import annotations

import copy
import random
from types import MethodType

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from npu_hub_kernels.testing import emulation

SILU = ACT2FN["silu"]
FUSED_OPS = ("npu_moe_token_permute", "npu_grouped_matmul", "npu_swiglu", "npu_moe_token_unpermute")
"""The torch_npu ops the card's grouped path calls (its card.toml's fused_ops)."""


def routing(tokens: int, experts: int, top_k: int, rng: random.Random, *, skew: str = "random"):
    """top_k_index [T, k] (distinct experts per token) and top_k_weights [T, k] as a router gives them."""
    rows = []
    for _ in range(tokens):
        if skew == "one_expert":
            rows.append([0, *rng.sample(range(1, experts), top_k - 1)])
        else:
            rows.append(rng.sample(range(experts), top_k))
    index = torch.tensor(rows, dtype=torch.int64)
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    return index, weights


def expert_weights(experts: int, hidden: int, inner: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inner, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inner, generator=g) / inner**0.5
    return gate_up, down


def loop_reference(x, index, weights, gate_up, down):
    """The formula, token by token, in float64."""
    x, weights, gate_up, down = x.double(), weights.double(), gate_up.double(), down.double()
    inner = down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(index.shape[1]):
            e = int(index[t, j])
            gate, up = gate_up[e, :inner] @ x[t], gate_up[e, inner:] @ x[t]
            out[t] += weights[t, j] * (down[e] @ (F.silu(gate) * up))
    return out


def transformers_eager(x, index, weights, gate_up, down):
    """transformers' eager experts loop (Qwen3MoeExperts with the "eager" implementation) in the input dtype."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    experts = Qwen3MoeExperts.__new__(Qwen3MoeExperts)
    torch.nn.Module.__init__(experts)
    experts.num_experts, experts.act_fn = gate_up.shape[0], SILU
    experts.gate_up_proj, experts.down_proj = torch.nn.Parameter(gate_up), torch.nn.Parameter(down)
    experts.config = type("Config", (), {"_experts_implementation": "eager"})()
    with torch.no_grad():
        return Qwen3MoeExperts.forward.__wrapped__(experts, x, index, weights)


def npu(*tensors):
    return [t.to("npu") for t in tensors]


CASES = {
    "random": dict(tokens=13, experts=8, top_k=2),
    "top_k 1": dict(tokens=11, experts=6, top_k=1),
    "top_k = E": dict(tokens=7, experts=4, top_k=4),
    "all tokens on one expert": dict(tokens=9, experts=8, top_k=1, skew="one_expert"),
    "experts with no tokens": dict(tokens=2, experts=16, top_k=2),
    "one token": dict(tokens=1, experts=8, top_k=2),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_path_error_at_most_twice_eager_error(card, case, dtype):
    params = dict(CASES[case])
    skew = params.pop("skew", "random")
    rng = random.Random(case)
    index, weights = routing(params["tokens"], params["experts"], params["top_k"], rng, skew=skew)
    gate_up, down = expert_weights(params["experts"], 32, 24, seed=len(case))
    x = torch.randn(params["tokens"], 32, generator=torch.Generator().manual_seed(1))
    x, gate_up, down = (t.to(dtype) for t in (x, gate_up, down))
    weights = weights.to(dtype)
    reference = loop_reference(x, index, weights, gate_up, down)
    eager = transformers_eager(x, index, weights, gate_up, down)
    with emulation.count_op_calls() as calls, torch.no_grad():
        got = card.swiglu_experts(*npu(x, index, weights, gate_up, down), SILU).cpu()
    assert calls == {
        "npu_moe_token_permute": 1,
        "npu_grouped_matmul": 2,
        "npu_swiglu": 1,
        "npu_moe_token_unpermute": 1,
    }
    assert got.dtype == dtype and got.shape == x.shape
    fused_error = (got.double() - reference).abs().max().item()
    eager_error = (eager.double() - reference).abs().max().item()
    assert fused_error <= 2 * eager_error + 1e-6, (fused_error, eager_error)


@pytest.mark.parametrize("seed", range(6))
def test_randomized_routing_matches_the_loop(card, seed):
    """Hypothesis-style: random sizes, E, k, routing and weights; float32 against the float64 loop."""
    rng = random.Random(seed)
    experts = rng.choice([1, 2, 3, 8, 17, 64])
    top_k = rng.randint(1, min(experts, 6))
    tokens = rng.choice([1, 3, 10, 33])
    hidden, inner = rng.choice([8, 24, 40]), rng.choice([4, 20, 36])
    index, weights = routing(tokens, experts, top_k, rng)
    gate_up, down = expert_weights(experts, hidden, inner, seed)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got = card.swiglu_experts(*npu(x, index, weights, gate_up, down), SILU).cpu()
        universal = card.swiglu_experts_eager(x, index, weights, gate_up, down, SILU)
    reference = loop_reference(x, index, weights, gate_up, down)
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(universal.double(), reference, rtol=1e-5, atol=1e-5)


def test_float32_routing_weights_with_bfloat16_hidden_states(card):
    """Mixtral's router hands float32 weights to bfloat16 experts; the output stays bfloat16."""
    rng = random.Random(5)
    index, weights = routing(12, 8, 2, rng)
    gate_up, down = (t.bfloat16() for t in expert_weights(8, 32, 24, seed=5))
    x = torch.randn(12, 32).bfloat16()
    reference = loop_reference(x, index, weights, gate_up, down)
    eager = transformers_eager(x, index, weights, gate_up, down)
    with torch.no_grad():
        got = card.swiglu_experts(*npu(x, index, weights, gate_up, down), SILU).cpu()
    assert got.dtype == torch.bfloat16
    assert (got.double() - reference).abs().max() <= 2 * (eager.double() - reference).abs().max() + 1e-6


def test_backward_gives_input_weight_and_routing_gradients(card):
    rng = random.Random(7)
    index, weights = routing(10, 6, 2, rng)
    index[:, 0] = 0  # expert 0 busy, some experts idle
    gate_up, down = expert_weights(6, 16, 12, seed=7)
    x = torch.randn(10, 16)
    leaves = [t.clone().double().requires_grad_() for t in (x, weights, gate_up, down)]
    loop_reference(leaves[0], index, *leaves[1:]).pow(2).sum().backward()
    npu_leaves = [t.clone().to("npu").requires_grad_() for t in (x, weights, gate_up, down)]
    with emulation.count_op_calls() as calls:
        out = card.swiglu_experts(npu_leaves[0], index.to("npu"), *npu_leaves[1:], SILU)
        out.pow(2).sum().backward()
    assert calls["npu_grouped_matmul"] == 2 + 4  # forward: gate_up, down; backward: dx and dW of each
    for name, got, want in zip(("x", "weights", "gate_up_proj", "down_proj"), npu_leaves, leaves, strict=True):
        torch.testing.assert_close(got.grad.cpu().double(), want.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("made_in_inference_mode", ["hidden states", "expert ids", "routing weights"])
def test_routing_made_in_inference_mode_trains_the_experts_as_eager(card, made_in_inference_mode):
    """An input made under torch.inference_mode (a frozen router or encoder run there) cannot be kept for backward;
    the grouped path keeps copies where an op or eager's second order keeps it, and the experts' gradients are
    eager's (eager keeps only tensors it made from them)."""
    rng = random.Random(7)
    index, weights = routing(10, 6, 2, rng)
    gate_up, down = expert_weights(6, 16, 12, seed=7)
    inputs = {"hidden states": torch.randn(10, 16), "expert ids": index, "routing weights": weights}
    on_npu = {name: t.to("npu") for name, t in inputs.items()}
    with torch.inference_mode():
        on_npu[made_in_inference_mode] = inputs[made_in_inference_mode].to("npu")
    grads = {}
    for name, experts in (("eager", card.swiglu_experts_eager), ("fused", card.swiglu_experts)):
        weights_npu = [t.clone().to("npu").requires_grad_() for t in (gate_up, down)]
        with emulation.count_op_calls() as calls:
            experts(on_npu["hidden states"], on_npu["expert ids"], on_npu["routing weights"], *weights_npu, SILU).pow(
                2
            ).sum().backward()
        assert (calls["npu_grouped_matmul"] > 0) is (name == "fused")
        grads[name] = [t.grad.cpu() for t in weights_npu]
    for got, want in zip(grads["fused"], grads["eager"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_one_expert_trains_on_the_grouped_path(card):
    """One expert: its count goes to npu_grouped_matmul as a cumsum (group_list_type 0), since the op refuses a
    counts list of length 1 (rule npu_grouped_matmul/group-list-length); forward and backward stay fused."""
    index, weights = routing(5, 1, 1, random.Random(23))
    gate_up, down = expert_weights(1, 8, 4, seed=23)
    x = torch.randn(5, 8)
    leaves = [t.clone().double().requires_grad_() for t in (x, weights, gate_up, down)]
    loop_reference(leaves[0], index, *leaves[1:]).pow(2).sum().backward()
    npu_leaves = [t.clone().to("npu").requires_grad_() for t in (x, weights, gate_up, down)]
    with emulation.count_op_calls() as calls:
        card.swiglu_experts(npu_leaves[0], index.to("npu"), *npu_leaves[1:], SILU).pow(2).sum().backward()
    assert calls["npu_grouped_matmul"] == 6
    for name, got, want in zip(("x", "weights", "gate_up_proj", "down_proj"), npu_leaves, leaves, strict=True):
        torch.testing.assert_close(got.grad.cpu().double(), want.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_grouped_matmul_has_no_autograd_of_its_own():
    """The reason for the card's backward: the device op's outputs carry no graph."""
    torch_npu = emulation.install()
    x = torch.randn(4, 3).to("npu").requires_grad_()
    w = torch.randn(2, 3, 5).to("npu")
    y = torch_npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 3]).to("npu"), group_type=0,
                                     group_list_type=1, split_item=2)[0]  # fmt: skip
    assert not y.requires_grad


def test_too_many_experts_take_the_sorted_path(card):
    rng = random.Random(9)
    index, weights = routing(6, 1100, 2, rng)
    gate_up, down = expert_weights(1100, 8, 4, seed=9)
    x = torch.randn(6, 8)
    assert "at most 1024 groups" in card.swiglu_experts_unavailable_reason(*npu(x, index, gate_up, down), SILU)
    with emulation.count_op_calls() as calls, torch.no_grad():
        got = card.swiglu_experts(*npu(x, index, weights, gate_up, down), SILU).cpu()
    assert calls["npu_grouped_matmul"] == 0
    torch.testing.assert_close(got.double(), loop_reference(x, index, weights, gate_up, down), rtol=1e-5, atol=1e-5)


def test_placeholder_expert_ids_are_dropped_as_eager_drops_them(card):
    """Expert parallelism marks tokens routed elsewhere with id E; transformers' loop skips them."""
    rng = random.Random(11)
    index, weights = routing(8, 4, 2, rng)
    index[::3, 1] = 4  # placeholder
    gate_up, down = expert_weights(4, 16, 8, seed=11)
    x = torch.randn(8, 16)
    eager = transformers_eager(x, index, weights, gate_up, down)
    with torch.no_grad(), emulation.count_op_calls() as calls:
        got = card.swiglu_experts(*npu(x, index, weights, gate_up, down), SILU).cpu()
    assert calls["npu_grouped_matmul"] == 0
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)


def test_non_silu_activation_and_host_tensors_take_the_sorted_path(card):
    rng = random.Random(13)
    index, weights = routing(5, 4, 2, rng)
    gate_up, down = expert_weights(4, 16, 8, seed=13)
    x = torch.randn(5, 16)
    gelu = ACT2FN["gelu"]
    assert "not SiLU" in card.swiglu_experts_unavailable_reason(*npu(x, index, gate_up, down), gelu)
    with torch.no_grad(), emulation.count_op_calls() as calls:
        on_host = card.swiglu_experts(x, index, weights, gate_up, down, SILU)
        with_gelu = card.swiglu_experts(*npu(x, index, weights, gate_up, down), gelu).cpu()
    assert calls == {}
    torch.testing.assert_close(on_host.double(), loop_reference(x, index, weights, gate_up, down), rtol=1e-5, atol=1e-5)
    inner = down.shape[2]
    expected = torch.zeros_like(x)
    for t in range(5):
        for j in range(2):
            e = int(index[t, j])
            hidden = gelu(gate_up[e, :inner] @ x[t]) * (gate_up[e, inner:] @ x[t])
            expected[t] += weights[t, j] * (down[e] @ hidden)
    torch.testing.assert_close(with_gelu, expected, rtol=1e-5, atol=1e-5)


def test_universal_fallback_equals_transformers_eager_loop_in_float32(card):
    rng = random.Random(17)
    index, weights = routing(20, 8, 2, rng)
    gate_up, down = expert_weights(8, 32, 16, seed=17)
    x = torch.randn(20, 32)
    torch.testing.assert_close(
        card.swiglu_experts_eager(x, index, weights, gate_up, down, SILU),
        transformers_eager(x, index, weights, gate_up, down),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize("on_npu", [True, False], ids=["npu", "host"])
def test_expert_ids_above_the_placeholder_raise_as_eager_raises(card, on_npu):
    """Eager transformers raises for ids above E (one_hot with E + 1 classes); so do both paths: a router bug
    must not silently drop token copies."""
    rng = random.Random(19)
    index, weights = routing(6, 4, 2, rng)
    index[2, 0] = 5  # E + 1
    gate_up, down = expert_weights(4, 16, 8, seed=19)
    x = torch.randn(6, 16)
    with pytest.raises(RuntimeError, match="num_classes"):
        transformers_eager(x, index, weights, gate_up, down)
    tensors = npu(x, index, weights, gate_up, down) if on_npu else (x, index, weights, gate_up, down)
    with pytest.raises(ValueError, match=r"expert id 5, above 4.*Check the router"):
        card.swiglu_experts(*tensors, SILU)


def experts_module(implementation: str, experts: int = 6, hidden: int = 16, inner: int = 8, seed: int = 29):
    """transformers' Qwen3MoeExperts on the npu, running the given experts implementation ("eager": one act_fn call
    per expert with tokens; "grouped_mm": one call)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inner, num_experts=experts, hidden_act="silu")
    config._experts_implementation = implementation
    module = Qwen3MoeExperts(config)
    gate_up, down = expert_weights(experts, hidden, inner, seed)
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up)
        module.down_proj.copy_(down)
    return module.to("npu")


def kernelized(card, module):
    """A copy of the module with the card's layer as its forward, set on the instance as kernelize sets it."""
    fused = copy.deepcopy(module)
    fused.forward = MethodType(card.layers.SwiGLUExperts.forward, fused)
    return fused


def routed(tokens: int, experts: int, seed: int):
    x = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(seed)).to("npu")
    index, weights = routing(tokens, experts, 2, random.Random(seed))
    return x, index.to("npu"), weights.to("npu")


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("hook", ["forward hook", "forward pre-hook", "instance forward"])
def test_a_hooked_act_fn_is_called_as_the_module_calls_it(card, implementation, hook):
    """The grouped path computes act_fn's SiLU without calling it: with a hook of the user's own on act_fn or a forward
    replaced on its instance (accelerate's hooks), the layer runs the module's own forward, which calls act_fn as
    eager does (once per expert with tokens, or once: its experts implementation decides), so the hook sees each call
    and its edit counts (issue 30)."""
    module = experts_module(implementation)
    fused = kernelized(card, module)
    x, index, weights = routed(12, 6, seed=31)
    results = []
    for model in (module, fused):
        seen = []
        act = model.act_fn
        if hook == "forward hook":
            act.register_forward_hook(lambda m, args, out, seen=seen: seen.append(1) or out * 1.25)
        elif hook == "forward pre-hook":
            act.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(1) or (args[0] * 0.5,))
        else:
            act.forward = lambda hidden, seen=seen, own=act.forward: seen.append(1) or own(hidden) * 1.25
        with torch.no_grad(), emulation.count_op_calls() as calls:
            results.append((model(x, index, weights).cpu(), len(seen), calls["npu_grouped_matmul"]))
    (want, want_calls, _), (got, got_calls, grouped) = results
    assert grouped == 0 and got_calls == want_calls == (1 if implementation == "grouped_mm" else len(index.unique()))
    assert torch.equal(got, want)
    reason = card.swiglu_experts_unavailable_reason(x, index, fused.gate_up_proj, fused.down_proj, fused.act_fn)
    assert ("not SiLU" if hook == "instance forward" else "act_fn has hooks of its own") in reason


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_global_module_hooks_see_act_fn_called_as_eager_calls_it(card, implementation):
    """Module hooks registered for every module (register_module_forward_hook) see act_fn called as often as the
    module without the card calls it; once they are removed the layer fuses again (issue 30)."""
    module = experts_module(implementation)
    fused = kernelized(card, module)
    x, index, weights = routed(12, 6, seed=37)
    results = []
    for model in (module, fused):
        seen = []

        def record(m, args, out, seen=seen, act_fn=model.act_fn):
            if m is act_fn:
                seen.append(1)

        handle = torch.nn.modules.module.register_module_forward_hook(record)
        try:
            reason = card.swiglu_experts_unavailable_reason(x, index, model.gate_up_proj, model.down_proj, model.act_fn)
            with torch.no_grad(), emulation.count_op_calls() as calls:
                results.append((model(x, index, weights).cpu(), len(seen), calls["npu_grouped_matmul"], reason))
        finally:
            handle.remove()
    (want, want_calls, _, _), (got, got_calls, grouped, reason) = results
    assert grouped == 0 and got_calls == want_calls == (1 if implementation == "grouped_mm" else len(index.unique()))
    assert "module hooks are registered" in reason and torch.equal(got, want)
    with torch.no_grad(), emulation.count_op_calls() as calls:
        torch.testing.assert_close(fused(x, index, weights).cpu(), want, rtol=1e-5, atol=1e-6)
    assert calls["npu_grouped_matmul"] == 2


def _engine_hook(module, args, out):
    return out


_engine_hook.__module__ = "deepspeed.runtime.zero.parameter_offload"  # where DeepSpeed's ZeRO-3 hooks are defined


def test_deepspeed_hooks_on_act_fn_keep_the_grouped_path(card):
    """DeepSpeed ZeRO-3 hooks every module of a model, act_fn included; those hooks gather and release act_fn's
    parameters, of which it has none, and change nothing it computes: the experts still fuse."""
    fused = kernelized(card, experts_module("grouped_mm"))
    fused.act_fn.register_forward_hook(_engine_hook)
    x, index, weights = routed(12, 6, seed=41)
    assert card.swiglu_experts_unavailable_reason(x, index, fused.gate_up_proj, fused.down_proj, fused.act_fn) is None
    with torch.no_grad(), emulation.count_op_calls() as calls:
        fused(x, index, weights)
    assert calls["npu_grouped_matmul"] == 2


def test_a_double_backward_gives_eagers_second_order_gradients(card):
    """A gradient penalty through the experts and the router that routed them (its weights computed from the same
    hidden states): the device ops' backwards have no derivative and npu_grouped_matmul has no autograd, so a recorded
    backward differentiates the eager math; the second-order gradients of the hidden states, the router and the expert
    weights are the module's own (issue 30). The forward and the first-order backward stay grouped."""
    module = experts_module("eager")
    fused = kernelized(card, module)
    x0 = torch.randn(12, 16, generator=torch.Generator().manual_seed(43)).to("npu")
    router0 = torch.randn(6, 16, generator=torch.Generator().manual_seed(44)).to("npu")

    def penalty_gradients(model):
        x, router = x0.clone().requires_grad_(), router0.clone().requires_grad_()
        weights, index = torch.softmax(x @ router.t(), dim=-1).topk(2, dim=-1)
        params = [x, router, model.gate_up_proj, model.down_proj]
        with emulation.count_op_calls() as calls:
            out = model(x, index, weights)
        first = torch.autograd.grad(out.square().sum(), params, create_graph=True)
        sum(g.square().sum() for g in first).backward()
        return [t.grad.cpu() for t in params], calls["npu_grouped_matmul"]

    want, _ = penalty_gradients(module)
    got, grouped = penalty_gradients(fused)
    assert grouped == 2
    for name, g, w in zip(("x", "router", "gate_up_proj", "down_proj"), got, want, strict=True):
        scale = w.abs().max().item()  # float32 rounding of sums over experts: to 1e-4 of the largest entry
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * scale, msg=lambda m, n=name: f"{n}: {m}")


def _traced(module, trace: str | None, *inputs: torch.Tensor):
    """`module(*inputs)` as `trace` runs it: None (untraced), torch.compile with the backend "eager" or "aot_eager", or
    "export" (the module of torch.export's program)."""
    if trace == "export":
        return torch.export.export(module, inputs).module()(*inputs)
    if trace is not None:
        torch._dynamo.reset()
        return torch.compile(module, backend=trace)(*inputs)
    return module(*inputs)


def _traced_experts_are_the_modules(card, trace: str, implementation: str) -> None:
    """The kernelized experts module traced by `trace` runs the module's own forward: its output and gradients are the
    module's traced the same way, no fused op runs, and the layer's last reason names the tracer; the same module's
    next untraced call is grouped (the control)."""
    module = experts_module(implementation)
    fused = kernelized(card, module)
    x, index, weights = routed(12, 6, seed=47)
    results = []
    for model in (module, fused):
        model.zero_grad()
        with emulation.count_op_calls() as calls:
            out = _traced(model, trace, x, index, weights)
            out.square().sum().backward()
        results.append((out.detach().cpu(), model.gate_up_proj.grad.cpu(), model.down_proj.grad.cpu()))
    assert not any(calls[op] for op in FUSED_OPS)
    for got, want in zip(results[1], results[0], strict=True):
        assert torch.equal(got, want)
    tracer = "torch.export" if trace == "export" else "torch.compile or torch.export"
    assert card._fallbacks.eager_record(fused).last.startswith(f"{tracer} traces the call: the grouped path reads")
    with torch.no_grad(), emulation.count_op_calls() as calls:
        fused(x, index, weights)
    assert calls["npu_grouped_matmul"] == 2 and card._fallbacks.eager_record(fused).last is None


def test_an_exported_experts_module_runs_its_own_forward_saying_why(card):
    """torch.export of the kernelized experts (the attack's repro_export_moe: GuardOnDataDependentSymNode on the
    per-expert counts' bincount): under a tracer the layer runs the module's own forward, which exports."""
    _traced_experts_are_the_modules(card, "export", "grouped_mm")


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("trace", ["eager", "aot_eager"])
def test_compiled_experts_modules_run_their_own_forward_saying_why(card, trace, implementation):
    """torch.compile (backends eager and aot_eager) of the kernelized experts, both experts implementations."""
    _traced_experts_are_the_modules(card, trace, implementation)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_type", "trace"), [("mixtral", "export"), ("qwen3_moe", "export"), ("qwen3_moe", "eager")]
)
def test_traced_kernelized_moe_models_give_the_plain_models_answer(npu_kernels, model_type, trace):
    """A tiny MoE model with this card applied, exported or compiled (backend eager): the logits of the model without
    it traced the same way, each experts layer saying the tracer. Not Mixtral compiled: the model without the card
    does not compile on the emulated npu either (dynamo's RecursionError in its router)."""
    from npu_hub_kernels import apply_npu_kernels, swapped_modules
    from npu_hub_kernels.testing.tiny_models import tiny_causal_lm, token_ids

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, use_cache=False).logits

    plain = tiny_causal_lm(model_type).to("npu")
    fused = apply_npu_kernels(copy.deepcopy(plain), kernels="npu_fused_moe", local_dir=npu_kernels)
    ids = token_ids().to("npu")
    with torch.no_grad():
        want = _traced(Logits(plain).eval(), trace, ids)
        with emulation.count_op_calls() as calls:
            got = _traced(Logits(fused).eval(), trace, ids)
    assert not any(calls[op] for op in FUSED_OPS) and torch.equal(got, want)
    tracer = "torch.export" if trace == "export" else "torch.compile or torch.export"
    reasons = {swap.eager_reason for swap in swapped_modules(fused, card="npu-moe")}
    assert len(reasons) == 1 and reasons.pop().startswith(f"{tracer} traces the call: the grouped path reads")
