"""npu-moe-router: each swapped router class against its own forward, the fused op counted, and the fallbacks.

A bare instance of each class (the attributes its forward reads) runs its own forward on the host; the
kernelized copy runs on the emulated npu. float32 and bfloat16 give the class's result exactly: the op
computes in float32 as the routers do, and casts once as they do (see `assert_same_routing` for ties).
Every fused call is counted, with the negative control of the same class configured so that the op
does not reproduce it.
"""

from __future__ import annotations

import importlib
from collections import Counter

import proof
import pytest
import torch
from kernels import Mode, kernelize
from numerics import relative_error
from torch import nn

from npu_hub_kernels import swapped_modules
from npu_hub_kernels.models import MODEL_CLASSES, ClassRule
from npu_hub_kernels.testing import emulation

RULES = MODEL_CLASSES["npu_fused_moe_router"]
OP = "npu_moe_gating_top_k"
RENORMALISED_OP = "npu_moe_gating_top_k_softmax_v2"


def bare_router(rule: ClassRule, *, experts: int, hidden: int, top_k: int, renormalize: bool, seed: int = 0):
    """An instance of the class holding only what its forward reads: weight, sizes, routing settings."""
    cls = getattr(importlib.import_module(rule.module), rule.class_name)
    router = cls.__new__(cls)
    torch.nn.Module.__init__(router)
    g = torch.Generator().manual_seed(seed)
    router.weight = torch.nn.Parameter(torch.randn(experts, hidden, generator=g))
    router.top_k, router.num_experts, router.hidden_dim, router.norm_topk_prob = top_k, experts, hidden, renormalize
    if rule.layer == "SigmoidGroupTopKRouter":
        router.e_score_correction_bias = torch.nn.Buffer(torch.randn(experts, generator=g) * 0.1)
        router.num_group, router.topk_group, router.routed_scaling_factor = 4, 2, 2.5
    return router


def in_id_order(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def run_both(rule: ClassRule, dtype: torch.dtype, renormalize: bool, *, tokens: int = 24):
    router = bare_router(rule, experts=32, hidden=16, top_k=4, renormalize=renormalize).to(dtype)
    x = torch.randn(2, tokens // 2, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        expected = router(x)
        holder = kernelize(torch.nn.Sequential(router).to("npu"), mode=Mode.INFERENCE, device="npu")
        with emulation.count_op_calls() as calls:
            got = [t.cpu() for t in holder[0](x.to("npu"))]
    return holder, expected, got, calls


def assert_same_routing(expected, got) -> None:
    """Same logits; each token the same experts with the same weights, compared in id order (DeepSeek-V3 style
    routers do not sort their top-k). Tokens with equal logits (bfloat16 has few values) may break a tie between
    experts differently (the op: lower id first; torch.topk: unspecified): there only the weights are compared."""
    (logits, weights, ids), (got_logits, got_weights, got_ids) = expected, got
    assert torch.equal(got_logits, logits)
    assert got_ids.dtype == ids.dtype == torch.int64 and got_weights.dtype == weights.dtype
    # the renormalising sum adds the k weights in the op's order, not the class's: equal up to that rounding
    rtol = 1e-6 if weights.dtype == torch.float32 else 0
    torch.testing.assert_close(got_weights.sort(-1).values, weights.sort(-1).values, rtol=rtol, atol=0)
    untied = torch.tensor([row.unique().numel() == row.numel() for row in logits])
    assert untied.float().mean() >= 0.5, "too many tied tokens for the check to mean anything"
    (weights, ids), (got_weights, got_ids) = in_id_order(weights, ids), in_id_order(got_weights, got_ids)
    assert torch.equal(got_ids[untied], ids[untied])
    torch.testing.assert_close(got_weights[untied], weights[untied], rtol=rtol, atol=0)


FUSING = {
    "SoftmaxTopKRouter": False,
    "RenormalisedSoftmaxTopKRouter": True,
    "RenormalisedFloat32SoftmaxTopKRouter": True,
    "SigmoidGroupTopKRouter": True,
}
"""The norm_topk_prob under which each layer's class is what it fuses (an op, or for the renormalised softmax
layers where no op can, the top-k logits' softmax)."""
TOP_LOGITS_LAYERS = ("RenormalisedSoftmaxTopKRouter", "RenormalisedFloat32SoftmaxTopKRouter")


def runs_the_renormalised_op(layer: str, dtype: torch.dtype) -> bool:
    """Whether a layer runs npu_moe_gating_top_k_softmax_v2 without grad: its weights are in the logits' dtype
    (always, or float32 weights from float32 logits)."""
    return layer == "RenormalisedSoftmaxTopKRouter" or (layer in TOP_LOGITS_LAYERS and dtype == torch.float32)


def aten_ops(fn) -> list[tuple[str, tuple[int, ...]]]:
    """The aten ops `fn()` runs, each with the shape of its first tensor argument (how a form is proven to run)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            seen.append((func.overloadpacket.__name__, tuple(first.shape) if first is not None else ()))
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return seen


def assert_top_logits_form(ops: list[tuple[str, tuple[int, ...]]], tokens: int, experts: int, top_k: int) -> None:
    """Proof the renormalised softmax ran as two ops: top-k of the [T, E] logits, softmax of the [T, k] only."""
    assert ("topk", (tokens, experts)) in ops, ops
    softmaxes = [shape for name, shape in ops if name == "_softmax"]
    assert softmaxes == [(tokens, top_k)], ops


@pytest.mark.model_tables
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule", proof.proven_rules(RULES), ids=lambda rule: rule.path.rpartition(".")[2])
def test_swapped_router_gives_its_class_result_fused(npu_kernels, rule, dtype):
    """One op (softmax without renormalisation, sigmoid; renormalised softmax with weights in the logits' dtype), or
    the two-op softmax of the top-k logits (bf16 logits with float32 weights; any renormalised softmax with grad)."""
    with proof.checking(rule.path):
        holder, expected, got, calls = run_both(rule, dtype, FUSING[rule.layer])
        assert [s.layer for s in swapped_modules(holder)] == [rule.layer]
        renormalised_op = runs_the_renormalised_op(rule.layer, dtype)
        assert calls[OP] == (0 if rule.layer in TOP_LOGITS_LAYERS else 1)
        assert calls[RENORMALISED_OP] == int(renormalised_op)
        assert_same_routing(expected, got)
        if rule.layer in TOP_LOGITS_LAYERS:
            x = torch.randn(24, 16).to(dtype).to("npu")
            if not renormalised_op:
                with torch.no_grad():
                    assert_top_logits_form(aten_ops(lambda: holder[0](x)), tokens=24, experts=32, top_k=4)
            with emulation.count_op_calls() as recorded:  # autograd records: the op has no backward
                assert_top_logits_form(aten_ops(lambda: holder[0](x.requires_grad_())), tokens=24, experts=32, top_k=4)
            assert recorded[RENORMALISED_OP] == 0


@pytest.mark.model_tables
@pytest.mark.parametrize(
    "rule", [r for r in proof.proven_rules(RULES) if r.layer not in TOP_LOGITS_LAYERS], ids=lambda rule: rule.path
)
def test_router_the_op_does_not_reproduce_keeps_its_class_math(npu_kernels, rule):
    """Negative control: the other norm_topk_prob (sigmoid without renormalisation: eager; renormalised softmax:
    the top-k logits' softmax)."""
    with proof.checking(rule.path):
        _, expected, got, calls = run_both(rule, torch.float32, not FUSING[rule.layer])
        assert calls[OP] == 0
        assert_same_routing(expected, got)


def test_softmax_router_trains_without_the_op_its_backward_refuses(npu_kernels):
    """npu_moe_gating_top_k_backward takes norm_type 1 only: a softmax router that autograd records runs eager
    (no op call), with eager's gradients; without grad the same router calls the op."""
    rule = next(r for r in RULES if r.layer == "SoftmaxTopKRouter")
    router = bare_router(rule, experts=32, hidden=16, top_k=4, renormalize=False)
    module = kernelize(torch.nn.Sequential(router).to("npu"), mode=Mode.TRAINING, device="npu")[0]
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(2))
    leaf = x.clone().to("npu").requires_grad_()
    with emulation.count_op_calls() as calls:
        _, weights, ids = module(leaf)
        (in_id_order(weights, ids)[0] * torch.arange(1.0, 5.0, device="npu")).sum().backward()
    assert calls[OP] == 0
    reference = x.clone().requires_grad_()
    cpu_router = bare_router(rule, experts=32, hidden=16, top_k=4, renormalize=False)
    _, weights, ids = cpu_router(reference)
    (in_id_order(weights, ids)[0] * torch.arange(1.0, 5.0)).sum().backward()
    torch.testing.assert_close(leaf.grad.cpu(), reference.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(module.weight.grad.cpu(), cpu_router.weight.grad, rtol=1e-6, atol=1e-7)
    with torch.no_grad(), emulation.count_op_calls() as calls:
        module(x.to("npu"))
    assert calls[OP] == 1


TRAINED_LAYERS = ["SigmoidGroupTopKRouter", "RenormalisedSoftmaxTopKRouter", "RenormalisedFloat32SoftmaxTopKRouter"]
"""The layers that fuse while autograd records (the op with its backward, or the top-k logits' softmax)."""
SCALE = torch.arange(1.0, 5.0)
"""What each of the k weights (in id order) is multiplied by in the tests' losses."""


def trained_both(layer: str, tokens: int, differentiate) -> tuple[nn.Module, torch.Tensor, dict, Counter]:
    """(the class's router, its input, the gradients of input and weight of the class ("eager", on the host) and of its
    kernelized copy ("npu"), the op calls of the copy's run): `differentiate(leaf, module, weights, ids)` runs each
    backward."""
    rule = next(r for r in RULES if r.layer == layer)
    router = bare_router(rule, experts=32, hidden=16, top_k=4, renormalize=FUSING[rule.layer])
    x = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(2))
    grads = {}
    for run in ("eager", "npu"):
        module = router
        if run == "npu":
            module = kernelize(torch.nn.Sequential(router).to("npu"), mode=Mode.TRAINING, device="npu")[0]
        leaf = x.clone().to("npu" if run == "npu" else "cpu").requires_grad_()
        with emulation.count_op_calls() as calls:
            _, weights, ids = module(leaf)
            differentiate(leaf, module, weights, ids)
        grads[run] = (leaf.grad.cpu().double(), module.weight.grad.cpu().double())
        module.weight.grad = None
    return router, x, grads, calls


@pytest.mark.parametrize("layer", TRAINED_LAYERS)
def test_gradients_through_the_fused_router(npu_kernels, layer):
    """Training: the sigmoid op's backward (from the norm_out it keeps, so out_flag is on) gives the class's
    gradients; autograd through the top-k logits' softmax is at most twice the class's error against float64 (the
    class's softmax is float32 whatever its input, so the reference is the routing's math in float64; relative L2
    errors over 256 tokens, as numerics.relative_error measures them)."""

    def differentiate(leaf, module, weights, ids):
        (in_id_order(weights, ids)[0] * SCALE.to(leaf.device)).sum().backward()

    router, x, grads, calls = trained_both(layer, 256, differentiate)
    assert calls[OP] == (0 if layer in TOP_LOGITS_LAYERS else 1) and calls[RENORMALISED_OP] == 0
    if layer not in TOP_LOGITS_LAYERS:
        for got, want in zip(grads["npu"], grads["eager"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        return
    x64, weight64 = x.double().requires_grad_(), router.weight.detach().cpu().double().requires_grad_()
    probs = torch.softmax(x64 @ weight64.t(), dim=-1)
    top = probs.topk(4, dim=-1)
    (in_id_order(top.values / top.values.sum(-1, keepdim=True), top.indices)[0] * SCALE).sum().backward()
    for got, eager, reference in zip(grads["npu"], grads["eager"], (x64.grad, weight64.grad), strict=True):
        assert relative_error(got, reference) <= 2 * relative_error(eager, reference)


@pytest.mark.parametrize("layer", TRAINED_LAYERS)
def test_a_double_backward_gives_the_class_second_order_gradients(npu_kernels, layer):
    """A gradient penalty (the squared norm of the first-order gradients in the input and the router weight,
    differentiated again): npu_moe_gating_top_k_backward has no derivative, so where autograd records the backward
    the card differentiates eager's weights for the op's experts instead, and the sigmoid router, still one op call,
    gives its class's second-order gradients. The top-k logits' softmax is plain autograd (the control)."""

    def differentiate(leaf, module, weights, ids):
        loss = (in_id_order(weights, ids)[0].pow(2) * SCALE.to(leaf.device)).sum()
        first = torch.autograd.grad(loss, (leaf, module.weight), create_graph=True)
        sum(g.pow(2).sum() for g in first).backward()

    _, _, grads, calls = trained_both(layer, 64, differentiate)
    assert calls[OP] == (0 if layer in TOP_LOGITS_LAYERS else 1)
    for got, want in zip(grads["npu"], grads["eager"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_tied_probabilities_pick_the_larger_logit_with_eager_weights(card):
    """Where eager's float32 probabilities of two experts tie though their logits differ (a few ulps apart), the
    top-k logits' softmax picks the larger logit and gives the tied weight; eager picks one of the tied experts."""
    base = torch.tensor(1e-3)  # small logits: a step of one ulp is far below one ulp of the probabilities
    for ulps in range(1, 64):  # the smallest logit step whose softmax probabilities still round equal
        step = torch.nextafter(base, torch.tensor(2.0)) - base
        logits = torch.tensor([[base, base + ulps * step, -3.0, -4.0, -5.0]])
        probs = torch.softmax(logits, dim=-1)
        if probs[0, 0] == probs[0, 1] and logits[0, 1] > logits[0, 0]:
            break
    else:
        pytest.skip("no float32 tie of distinct logits found")
    eager_weights, eager_ids = card.moe_router_top_k_eager(logits, 1, scoring="softmax", renormalize=True)
    weights, ids = card.moe_router_top_k(logits.to("npu"), 1, scoring="softmax", renormalize=True)
    assert ids.item() == 1 and eager_ids.item() in (0, 1)
    assert torch.equal(weights.cpu(), eager_weights)


def test_renormalised_softmax_runs_the_op_only_where_it_gives_what_the_class_returns(card):
    """npu_moe_gating_top_k_softmax_v2 (renorm 1): one call without grad, eager's ids and weights; not while autograd
    records (the op has no backward) nor for float32 weights of bf16 logits (it writes the logits' dtype), where the
    top-k logits' softmax runs and the reason says why."""
    logits = torch.randn(16, 32, generator=torch.Generator().manual_seed(6))
    settings = {"scoring": "softmax", "renormalize": True}
    for dtype, cast in ((torch.float32, True), (torch.bfloat16, True), (torch.float32, False)):
        on_device = logits.to(dtype).to("npu")
        assert card.moe_router_top_k_unavailable_reason(on_device, 4, **settings, cast_weights=cast) is None
        with emulation.count_op_calls() as calls:
            weights, ids = card.moe_router_top_k(on_device, 4, **settings, cast_weights=cast)
        assert calls[RENORMALISED_OP] == 1 and ids.dtype == torch.int64
        want = card.moe_router_top_k_eager(logits.to(dtype), 4, **settings, cast_weights=cast)
        assert_same_routing((logits.to(dtype), *want), (logits.to(dtype), weights.cpu(), ids.cpu()))
    refusals = {
        "has no backward": (logits.to("npu").requires_grad_(), True),
        "writes them in the logits' dtype": (logits.bfloat16().to("npu"), False),
    }
    for reason, (on_device, cast) in refusals.items():
        assert reason in card.moe_router_top_k_unavailable_reason(on_device, 4, **settings, cast_weights=cast)
        with emulation.count_op_calls() as calls:
            card.moe_router_top_k(on_device, 4, **settings, cast_weights=cast)
        assert calls[RENORMALISED_OP] == 0


@pytest.mark.parametrize("soc", ["Ascend310P3", "Ascend910ProB", "Ascend950PR", "Ascend910B3", "Ascend910_9391"])
def test_the_gating_ops_run_on_the_socs_their_docs_list_only(card, monkeypatch, soc):
    """npu_moe_gating_top_k and npu_moe_gating_top_k_softmax_v2 are documented on Atlas A2/A3 only (产品支持情况):
    elsewhere each routing form says so and runs eager's math, with no gating op called."""
    monkeypatch.setattr(torch.npu, "get_device_name", lambda device=None: soc)
    listed = soc.startswith(("Ascend910B", "Ascend910_93"))
    logits = torch.randn(8, 32, generator=torch.Generator().manual_seed(8))
    forms = {
        RENORMALISED_OP: {"scoring": "softmax", "renormalize": True},
        OP: {"scoring": "sigmoid", "renormalize": True},
    }
    for op, settings in forms.items():
        reason = card.moe_router_top_k_unavailable_reason(logits.to("npu"), 4, **settings)
        assert (reason is None) if listed else (f"{op} runs on Atlas A2/A3 only" in reason and soc in reason), soc
        with torch.no_grad(), emulation.count_op_calls() as calls:
            weights, ids = card.moe_router_top_k(logits.to("npu"), 4, **settings)
        assert calls[op] == listed, (soc, op)
        want = card.moe_router_top_k_eager(logits, 4, **settings)
        assert_same_routing((logits, *want), (logits, weights.cpu(), ids.cpu()))


def test_renormalised_softmax_weights_within_the_idiom_of_a_float64_reference(card):
    """The top-k logits' softmax is no farther from float64 than eager's renormalised top-k (bf16 and fp32)."""
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(64, 60, generator=torch.Generator().manual_seed(5)).to(dtype)
        probs = torch.softmax(logits.double(), dim=-1).topk(8, dim=-1)
        reference = probs.values / probs.values.sum(-1, keepdim=True)
        eager, _ = card.moe_router_top_k_eager(logits, 8, scoring="softmax", renormalize=True)
        fused, ids = card.moe_router_top_k(logits.to("npu"), 8, scoring="softmax", renormalize=True)
        untied = torch.tensor([row.unique().numel() == row.numel() for row in logits])
        assert torch.equal(ids.cpu()[untied], probs.indices[untied]) and untied.any()
        eager_error = (eager.double() - reference).abs().max()
        assert (fused.cpu().double() - reference).abs().max() <= 2 * eager_error + 1e-7


def test_bfloat16_softmax_weights_within_the_idiom_of_a_float64_reference(card):
    """bf16 logits: the op's weights are no farther from float64 than eager's (both cast once, from float32)."""
    logits = torch.randn(64, 60, generator=torch.Generator().manual_seed(3)).bfloat16()
    reference = torch.softmax(logits.double(), dim=-1).topk(6, dim=-1)
    eager, _ = card.moe_router_top_k_eager(logits, 6, scoring="softmax", renormalize=False)
    with emulation.count_op_calls() as calls:
        fused, ids = card.moe_router_top_k(logits.to("npu"), 6, scoring="softmax", renormalize=False)
    untied = torch.tensor([row.unique().numel() == row.numel() for row in logits])
    assert calls[OP] == 1 and torch.equal(ids.cpu()[untied], reference.indices[untied]) and untied.any()
    eager_error = (eager.double() - reference.values).abs().max()
    assert (fused.cpu().double() - reference.values).abs().max() <= 2 * eager_error + 1e-7
    assert torch.equal(fused.cpu(), eager)  # the same float32 math and one cast: the same bits


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"device": "cpu"}, "not on an npu device"),
        ({"renormalize": True, "top_k": 40}, "outside [1, min(experts, 1024)]"),
        ({"experts": 2, "top_k": 1}, "more than 2 per group (one group too)"),
        ({"scoring": "sigmoid", "renormalize": False}, "sigmoid mode always renormalises"),
        ({"experts": 2050}, "at most 2048"),
        ({"scoring": "sigmoid", "renormalize": True, "num_groups": 25}, "more than 2 per group"),
        ({"top_k": 40}, "outside [1, 32]"),
        ({"dtype": torch.float64}, "not supported"),
    ],
    ids=[
        "host",
        "softmax renormalised, k above",
        "two experts",
        "sigmoid plain",
        "2050 experts",
        "groups of 2",
        "k above",
        "float64",
    ],
)
def test_fallback_reasons_and_the_eager_result(card, change, reason):
    """Each limit of the op: the reason says why, and the eager math runs (no fused call) with the same result."""
    settings = {"device": "npu", "experts": 32 if "num_groups" not in change else 50, "dtype": torch.float32}
    settings |= {"scoring": "softmax", "renormalize": False, "top_k": 4} | change
    logits = torch.randn(8, settings["experts"], generator=torch.Generator().manual_seed(4)).to(settings["dtype"])
    kwargs = {k: settings[k] for k in ("scoring", "renormalize")} | {"num_groups": settings.get("num_groups", 1)}
    on_device = logits.to(settings["device"])
    assert reason in card.moe_router_top_k_unavailable_reason(on_device, settings["top_k"], **kwargs)
    if settings["top_k"] > settings["experts"]:
        return  # no routing of more experts than there are
    with emulation.count_op_calls() as calls:
        got = card.moe_router_top_k(on_device, settings["top_k"], **kwargs)
    want = card.moe_router_top_k_eager(logits, settings["top_k"], **kwargs)
    assert calls[OP] == 0
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w)


def test_router_logits_a_transpose_of_their_memory_train_as_eager(card):
    """Logits that are a transposed view (non-contiguous) requiring grad: the gating op writes new contiguous outputs,
    as the device does, so its backward takes its own expert ids; the gradient is eager's."""
    torch.manual_seed(0)
    base, cotangent = torch.randn(8, 6), torch.randn(6, 2)
    grads = {}
    for name, router in (("eager", card.moe_router_top_k_eager), ("fused", card.moe_router_top_k)):
        leaf = base.to("npu").requires_grad_()
        weights, _ = router(leaf.t(), 2, scoring="sigmoid", renormalize=True, eps=1e-20, routed_scaling_factor=2.5)
        (weights * cotangent.to("npu")).sum().backward()
        grads[name] = leaf.grad.cpu()
    torch.testing.assert_close(grads["fused"], grads["eager"], rtol=1e-4, atol=1e-6)
