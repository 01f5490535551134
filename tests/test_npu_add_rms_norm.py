"""npu-add-rms-norm: the card's autograd function against eager, which path runs and why, the decoder-layer table
re-derived from transformers' sources, and the kernelized decoder layers at model level on the tiny families (with
every other card kernelized too: the layer calls its submodules).

Parity follows flash-attention's idiom: the fused error against float64 is at most twice eager's error in the same
dtype. The fused path is proven by the emulated ops' call counters next to a negative control; every fallback is
proven to skip the ops and to equal the eager math exactly.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import warnings

import proof
import pytest
import torch
import transformers
from kernels import Mode, kernelize
from numerics import assert_within_twice_eagers_error, relative_error, train_steps
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.helium.modeling_helium import HeliumRMSNorm
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from npu_hub_kernels import apply_npu_kernels, swapped_modules
from npu_hub_kernels.models import MODEL_CLASSES, SURVEYED_RELEASE, _survey
from npu_hub_kernels.models import npu_add_rms_norm as table
from npu_hub_kernels.models import npu_rms_norm as norm_table
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm, token_ids

NORMS = {"plain": LlamaRMSNorm, "zero_centered": GemmaRMSNorm, "float32_scale": HeliumRMSNorm}
LLAMA = LlamaDecoderLayer.__module__
FAMILIES = {"plain": LLAMA, "zero_centered": GemmaRMSNorm.__module__, "float32_scale": HeliumRMSNorm.__module__}
HIDDEN = 64


def make_norm(scaling: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A norm of the form with a random weight around its usual value (0 for 1 + weight norms)."""
    norm = NORMS[scaling](HIDDEN, eps=1e-6)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        norm.weight.copy_(torch.randn(HIDDEN, generator=generator) * 0.5 + (scaling != "zero_centered"))
    return norm.to(dtype)


def inputs(dtype: torch.dtype, seed: int = 1, shape=(2, 5, HIDDEN)) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(shape, generator=generator) * 2).to(dtype) for _ in range(2))


def on_npu(norm: torch.nn.Module, *tensors: torch.Tensor):
    """Copies of the norm and the tensors on the npu, the tensors leaves that require grad."""
    return copy.deepcopy(norm).to("npu"), *(t.detach().to("npu").requires_grad_() for t in tensors)


def run(function, residual, update, norm, *extra):
    """Forward, then backward of a loss using both outputs (as the layer does: the norm's output and the sum);
    returns the outputs and the gradients of residual, update and the weight, on the host."""
    normed, summed = function(residual, update, norm, *extra)
    (normed.float().pow(2).sum() + (summed.float() * 0.5).sum()).backward()
    grads = (residual.grad, update.grad, norm.weight.grad)
    return [t.detach().cpu() for t in (normed, summed, *grads)]


def run_eager(card, norm, residual, update):
    """`run` of the eager math on npu copies."""
    norm, residual, update = on_npu(norm, residual, update)
    return run(card.add_rms_norm_eager, residual, update, norm)


@pytest.mark.parametrize("scaling", list(NORMS))
def test_fused_equals_eager_in_float32_forward_and_backward(card, scaling):
    norm = make_norm(scaling, torch.float32)
    residual, update = inputs(torch.float32)
    eager = run_eager(card, norm, residual, update)
    fused_norm, r, u = on_npu(norm, residual, update)
    with emulation.count_op_calls() as calls:
        fused = run(card.add_rms_norm, r, u, fused_norm, scaling, FAMILIES[scaling])
    assert calls == {"npu_add_rms_norm": 1, "npu_rms_norm_backward": 1}
    assert torch.equal(fused[0], eager[0]) and torch.equal(fused[1], eager[1])  # the forward: exact
    for got, want in zip(fused[2:], eager[2:], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scaling", list(NORMS))
def test_the_sum_is_the_norms_input_in_the_graph_as_in_eagers(card, scaling):
    """A hook or retain_grad on the returned sum sees its whole gradient, its own uses' and the norm's, as in eager's
    graph, where the norm takes the sum as its input (one npu_add_rms_norm call writes both)."""
    norm = make_norm(scaling, torch.float32)
    residual, update = inputs(torch.float32)
    sums = {}
    for name, function, extra in (("eager", card.add_rms_norm_eager, ()), ("fused", card.add_rms_norm, (scaling,))):
        fused_norm, r, u = on_npu(norm, residual, update)
        with emulation.count_op_calls() as calls:
            normed, summed = function(r, u, fused_norm, *extra)
            summed.retain_grad()
            (normed.pow(2).sum() + (summed * 0.5).sum()).backward()
        assert (calls["npu_add_rms_norm"] == 1) is (name == "fused")
        sums[name] = summed.grad.cpu()
    torch.testing.assert_close(sums["fused"], sums["eager"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scaling", ["plain", "float32_scale"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_error_at_most_twice_eager_error(card, scaling, dtype):
    for seed in range(4):
        norm = make_norm(scaling, dtype, seed)
        residual, update = inputs(dtype, seed + 10)
        reference = run_eager(card, copy.deepcopy(norm).double(), residual.double(), update.double())
        eager = run_eager(card, norm, residual, update)
        fused_norm, r, u = on_npu(norm, residual, update)
        with emulation.count_op_calls() as calls:
            fused = run(card.add_rms_norm, r, u, fused_norm, scaling, FAMILIES[scaling])
        assert calls == {"npu_add_rms_norm": 1, "npu_rms_norm_backward": 1}
        assert torch.equal(fused[1], eager[1])  # the sum: rounded to the dtype, as eager's add
        for got, want, ref in zip(fused, eager, reference, strict=True):
            assert got.dtype == want.dtype
            assert_within_twice_eagers_error(got, want, ref, seed)


def test_host_tensors_run_the_eager_math_negative_control(card):
    norm = make_norm("plain", torch.float32)
    residual, update = inputs(torch.float32)
    with emulation.count_op_calls() as calls:
        got = card.add_rms_norm(residual, update, norm, "plain", LLAMA)
    assert calls == {}
    want = card.add_rms_norm_eager(residual, update, norm)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


class _BiasRMSNorm(LlamaRMSNorm):
    """An RMSNorm with a bias the op has no input for."""

    def __init__(self, hidden: int):
        super().__init__(hidden)
        self.bias = torch.nn.Parameter(torch.zeros(hidden))

    def forward(self, hidden_states):
        return super().forward(hidden_states) + self.bias


def _hooked(norm):
    norm.register_forward_pre_hook(lambda module, args: None)
    return norm


def _replaced(norm):
    """A norm whose forward is replaced on its instance (as accelerate's add_hook_to_module does)."""
    original = norm.forward
    norm.forward = lambda hidden_states: original(hidden_states) * 2
    return norm


FALLBACKS = {
    # case: (norm, dtype of residual/update, scaling, family, a phrase of the reason)
    "layer norm": (lambda: torch.nn.LayerNorm(HIDDEN), torch.float32, "plain", LLAMA, "not the RMSNorm"),
    "norm with a bias": (lambda: _BiasRMSNorm(HIDDEN), torch.float32, "plain", None, "not just a weight"),
    "norm of another family": (
        lambda: make_norm("zero_centered", torch.float32),
        torch.float32,
        "plain",
        LLAMA,
        "not the RMSNorm of",
    ),
    "hooked norm": (lambda: _hooked(make_norm("plain", torch.float32)), torch.float32, "plain", LLAMA, "hooks"),
    "norm with a replaced forward": (
        lambda: _replaced(make_norm("plain", torch.float32)),
        torch.float32,
        "plain",
        LLAMA,
        "replaced on its instance",
    ),
    "weight dtype": (lambda: make_norm("plain", torch.float32), torch.bfloat16, "plain", LLAMA, "promotes"),
    "1 + weight in bfloat16": (
        lambda: make_norm("zero_centered", torch.bfloat16),
        torch.bfloat16,
        "zero_centered",
        FAMILIES["zero_centered"],
        "rounding 1 + weight",
    ),
    "float32 weight, bfloat16 input": (
        lambda: make_norm("float32_scale", torch.float32),
        torch.bfloat16,
        "float32_scale",
        FAMILIES["float32_scale"],
        "gamma in the input dtype",
    ),
    "float64": (lambda: make_norm("plain", torch.float64), torch.float64, "plain", LLAMA, "not supported"),
    "negative epsilon (npu_add_rms_norm takes at least 0)": (
        lambda: LlamaRMSNorm(HIDDEN, eps=-1e-6),
        torch.float32,
        "plain",
        LLAMA,
        "epsilon -1e-06 is negative",
    ),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_every_fallback_says_why_skips_the_op_and_equals_eager(card, case):
    make, dtype, scaling, family, phrase = FALLBACKS[case]
    norm = make().to("npu")
    residual, update = (t.to("npu") for t in inputs(dtype))
    reason = card.add_rms_norm_unavailable_reason(residual, update, norm, scaling, family)
    assert reason is not None and phrase in reason, reason
    with emulation.count_op_calls() as calls:
        got = card.add_rms_norm(residual, update, norm, scaling, family)
    assert calls["npu_add_rms_norm"] == 0
    want = card.add_rms_norm_eager(residual, update, norm)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize(
    ("residual_shape", "update_shape", "update_dtype", "phrase"),
    [
        ((2, 3, HIDDEN), (1, 3, HIDDEN), torch.float32, "broadcasts"),
        ((0, 3, HIDDEN), (0, 3, HIDDEN), torch.float32, "empty"),
        ((HIDDEN,), (HIDDEN,), torch.float32, "npu_rms_norm_backward (the backward) 2 to 8"),
        ((2, 3, HIDDEN * 2), (2, 3, HIDDEN * 2), torch.float32, "does not match"),
    ],
)
def test_tensor_fallbacks(card, residual_shape, update_shape, update_dtype, phrase):
    norm = make_norm("plain", torch.float32).to("npu")
    residual = torch.randn(residual_shape).to("npu")
    update = torch.randn(update_shape).to(update_dtype).to("npu")
    reason = card.add_rms_norm_unavailable_reason(residual, update, norm)
    assert reason is not None and phrase in reason, reason
    if phrase == "does not match":
        return  # eager itself cannot multiply these shapes
    with emulation.count_op_calls() as calls:
        got = card.add_rms_norm(residual, update, norm)
    assert calls["npu_add_rms_norm"] == 0
    assert all(torch.equal(g, w) for g, w in zip(got, card.add_rms_norm_eager(residual, update, norm), strict=True))


MIXED_PAIRS = {
    "bfloat16 update": (torch.float32, torch.bfloat16),
    "float16 update": (torch.float32, torch.float16),
    "bfloat16 residual": (torch.bfloat16, torch.float32),
}
"""A float32 and a narrower operand: torch_npu adds them as one mixed-dtype Add kernel (aclnn_add.cpp,
isAddMixDtypeSupport), so the card adds them as eager does and runs npu_rms_norm on the float32 sum."""


@pytest.mark.parametrize("scaling", list(NORMS))
@pytest.mark.parametrize("pair", list(MIXED_PAIRS))
def test_a_mixed_pair_is_added_as_eager_and_normalised_by_npu_rms_norm(card, scaling, pair):
    """A bfloat16 attention output (o_proj under autocast) and the float32 residual: eager's float32 sum exactly, the
    norm's output as eager's (float32: exact), the gradients within float32 rounding of eager's, the narrow operand's
    in its dtype; npu_rms_norm ran in place of npu_add_rms_norm (issue 46), eager ran neither (the negative control)."""
    residual_dtype, update_dtype = MIXED_PAIRS[pair]
    norm = make_norm(scaling, torch.float32).to("npu")
    generator = torch.Generator().manual_seed(3)
    residual, update = (
        (torch.randn(2, 3, HIDDEN, generator=generator) * 2).to(dtype).to("npu").requires_grad_()
        for dtype in (residual_dtype, update_dtype)
    )
    assert card.add_rms_norm_unavailable_reason(residual, update, norm, scaling, FAMILIES[scaling]) is None
    results = {}
    for name, function, extra in (
        ("fused", card.add_rms_norm, (scaling, FAMILIES[scaling])),
        ("eager", card.add_rms_norm_eager, ()),
    ):
        with emulation.count_op_calls() as calls:
            y, summed = function(residual, update, norm, *extra)
            grads = torch.autograd.grad((y * y).sum() + summed.sum(), (residual, update, norm.weight))
        assert dict(calls) == ({"npu_rms_norm": 1} if name == "fused" else {})
        results[name] = (y, summed, *grads)
    fused, eager = results["fused"], results["eager"]
    dtypes = [torch.float32, torch.float32, residual_dtype, update_dtype, torch.float32]
    assert [t.dtype for t in fused] == [t.dtype for t in eager] == dtypes
    assert torch.equal(fused[0], eager[0]) and torch.equal(fused[1], eager[1])
    for got, want in zip(fused[2:], eager[2:], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_bfloat16_and_float16_pair_is_cast_and_fused(card):
    """bfloat16 + float16 (a float32 sum) is no mixed pair of the Add kernel (aclnnAdd casts both): the card casts both
    to float32 (exact) and runs npu_add_rms_norm, with eager's dtypes and numbers (the gradients rounded once to each
    operand's dtype, as eager's)."""
    norm = make_norm("plain", torch.float32).to("npu")
    residual, update = (
        torch.randn(2, 3, HIDDEN).to(dtype).to("npu").requires_grad_() for dtype in (torch.bfloat16, torch.float16)
    )
    results = []
    for fused in (True, False):
        with emulation.count_op_calls() as calls:
            y, summed = (card.add_rms_norm if fused else card.add_rms_norm_eager)(residual, update, norm)
            grads = torch.autograd.grad((y * y).sum() + summed.sum(), (residual, update, norm.weight))
        assert dict(calls) == ({"npu_add_rms_norm": 1, "npu_rms_norm_backward": 1} if fused else {})
        results.append((y, summed, *grads))
    for got, want in zip(*results, strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)  # the narrow operands' gradients: within one rounding step of theirs


def test_unknown_scaling_is_refused(card):
    residual, update = inputs(torch.float32)
    with pytest.raises(ValueError, match="plain"):
        card.add_rms_norm(residual, update, make_norm("plain", torch.float32), "gemma")


# The decoder-layer table, proven on transformers' sources: each listed class has Llama's decoder-layer forward and a
# post-attention norm of its layer's scaling.

_SCALING_OF_NORM_LAYER = {"RMSNorm": "DecoderLayer", "RMSNormZeroCentered": "DecoderLayerZeroCentered",
                          "RMSNormFloat32Scale": "DecoderLayerFloat32Scale"}  # fmt: skip
RULES = MODEL_CLASSES["npu_fused_add_rmsnorm"]


def _post_norm_classes(definition: _survey.Definition) -> list[str]:
    """What `__init__` assigns to self.post_attention_layernorm (the called class's name, or the expression)."""
    init = definition.method("__init__")
    found = []
    for n in ast.walk(init) if init is not None else ():
        if isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Attribute) and t.attr == "post_attention_layernorm" for t in n.targets
        ):
            call = n.value
            found.append(call.func.id if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) else "")
    return found


def _derived_layer(path: str) -> tuple[str | None, str]:
    """The card layer the decoder layer class at `path` needs, from its source (None: none reproduces it), and why."""
    classes = _decoder_layer_classes()
    forward, norms = classes[path].method("forward"), _post_norm_classes(classes[path])
    llama = classes[f"{LLAMA.removeprefix('transformers.models.')}.LlamaDecoderLayer"].method("forward")
    if forward is None or ast.dump(forward) != ast.dump(llama):
        return None, "not Llama's decoder-layer forward"
    if len(set(norms)) != 1 or not norms[0]:
        return None, f"post-attention norms {norms}"
    norm_layer = {p: layer for layer, paths in norm_table.SWAPPED.items() for p in paths}
    layer = _SCALING_OF_NORM_LAYER.get(norm_layer.get(f"{path.rpartition('.')[0]}.{norms[0]}"))
    return layer, f"post-attention norm {norms[0]}"


@functools.cache
def _decoder_layer_classes() -> dict[str, _survey.Definition]:
    return {d.path: d for d in _survey.classes() if d.name.endswith("DecoderLayer")}


@pytest.mark.model_tables
def test_every_listed_decoder_layer_has_the_llama_forward_and_a_norm_of_its_scaling(npu_kernels):
    """Each listed class has the forward of Llama's decoder layer, which the card reproduces: proven numerically on
    this release first (the tiny Llama, fused against eager), so a class is proven only where Llama's is."""
    llama = _decoder_layer_rule("llama")
    reference_proven = proof.reference_holds(llama, lambda: _fused_model_equals_eager("llama"))
    failures = []
    for rule in proof.proven_rules(RULES):
        layer, why = _derived_layer(rule.path) if proof.comparable_with(llama) else (rule.layer, "proven by its code")
        if layer != rule.layer or not reference_proven:
            failures.append(f"{rule.path}: needs {layer} ({why}), listed for {rule.layer}; Llama's: {reference_proven}")
        proof.verdict(rule.path, layer == rule.layer and reference_proven)
    assert failures == []


@pytest.mark.slow
@pytest.mark.skipif(transformers.__version__ != SURVEYED_RELEASE, reason="the table is surveyed on this release")
def test_no_left_out_decoder_layer_is_one_a_layer_reproduces():
    assert {path: _derived_layer(path)[0] for path in table.LEFT_OUT if _derived_layer(path)[0]} == {}


@pytest.mark.model_tables
def test_the_layers_forward_takes_the_parameters_of_the_forward_it_replaces(card):
    for rule in proof.proven_rules(RULES):
        ours = inspect.signature(getattr(card.layers, rule.layer).forward).parameters
        theirs = inspect.signature(rule.installed().forward).parameters
        with proof.checking(rule.path):
            assert [(p.name, p.kind) for p in ours.values()] == [(p.name, p.kind) for p in theirs.values()], rule.path


# Model level: tiny families, every card kernelized.

FUSED_FAMILIES = ["llama", "qwen3", "qwen3_moe", "helium", "deepseek_v3"]


def _layers(model) -> int:
    return model.config.get_text_config().num_hidden_layers


def _decoder_layer_rule(model_type: str):
    """The table's rule for the decoder layer class of the tiny `model_type` (None when it lists none)."""
    model = tiny_causal_lm(model_type)
    cls = type(next(m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")))
    path = f"{cls.__module__.removeprefix('transformers.models.')}.{cls.__name__}"
    return next((rule for rule in RULES if rule.path == path), None)


def _fused_model_equals_eager(model_type: str) -> None:
    """A tiny model of `model_type`, kernelized with every card, gives eager's logits and gradients in float32, with
    the fused op counted in every layer."""
    eager = tiny_causal_lm(model_type).to("npu")
    model = kernelize(tiny_causal_lm(model_type).to("npu"), mode=Mode.TRAINING, device="npu")
    swaps = [s for s in swapped_modules(model) if s.card == "npu-add-rms-norm"]
    assert len(swaps) == _layers(model)
    ids = token_ids().to("npu")
    with emulation.count_op_calls() as calls:
        out = model(ids, labels=ids)
        out.loss.backward()
    assert calls["npu_add_rms_norm"] == _layers(model) and calls["npu_rms_norm_backward"] == _layers(model)
    assert calls["npu_rms_norm"] > 0 and calls["npu_rotary_mul"] > 0  # the other cards run inside the layer
    want = eager(ids, labels=ids)
    want.loss.backward()
    assert torch.equal(out.logits, want.logits)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.model_tables
@pytest.mark.parametrize("model_type", FUSED_FAMILIES)
def test_model_forward_and_backward_equal_eager_in_float32_with_every_card(npu_kernels, model_type):
    rule = _decoder_layer_rule(model_type)
    if rule not in proof.proven_rules(RULES):
        pytest.skip(f"{rule.path}: its code is not proven on this transformers release (it runs eager)")
    with proof.checking(rule.path):
        _fused_model_equals_eager(model_type)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_follows_eager_loss_trajectory(npu_kernels, dtype):
    batches = [token_ids(batch=4, seq=12, seed=seed) for seed in range(8)]

    def adam(params):
        return torch.optim.AdamW(params, lr=3e-3)

    eager_losses, _ = train_steps(tiny_causal_lm("llama", dtype=dtype).to("npu"), batches, adam)
    model = kernelize(tiny_causal_lm("llama", dtype=dtype).to("npu"), mode=Mode.TRAINING, device="npu")
    with emulation.count_op_calls() as calls:
        losses, _ = train_steps(model, batches, adam)
    assert calls["npu_add_rms_norm"] == len(batches) * _layers(model)
    assert losses[-1] < losses[0] and eager_losses[-1] < eager_losses[0]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip(losses, eager_losses, strict=True):
        assert abs(got - want) <= tolerance * abs(want), (losses, eager_losses)


def _layer_under_autocast(model, layer, hidden: torch.Tensor, probe: torch.Tensor, autocast: bool):
    """The layer's output and the gradients of `(output * probe).sum()` for its input and every parameter, on the
    host in float64, the forward under torch.autocast("npu", bfloat16) when `autocast` (Trainer's bf16=True)."""
    device = next(layer.parameters()).device
    hidden = hidden.to(device).requires_grad_()
    position_ids = torch.arange(hidden.shape[1], device=device)[None]
    position_embeddings = model.model.rotary_emb(hidden, position_ids)
    with torch.autocast("npu", dtype=torch.bfloat16, enabled=autocast):
        out = layer(hidden, attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings)
    (out * probe.to(device, out.dtype)).sum().backward()
    grads = {"hidden_states": hidden.grad} | {name: p.grad for name, p in layer.named_parameters()}
    return out.detach().double().cpu(), {name: g.double().cpu() for name, g in grads.items()}


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_decoder_layer_under_autocast_is_within_twice_eagers_error(npu_kernels, model_type):
    """Trainer's bf16=True (float32 weights, a bfloat16 o_proj output meeting the float32 residual): the kernelized
    layer's output and every gradient within twice eager autocast's error against the float64 layer; its mid norm ran
    as npu_rms_norm of the mixed sum (the input norm is npu-rms-norm's), no npu_add_rms_norm. Negative controls: the
    eager layer runs neither op, and the kernelized layer without autocast (one dtype) runs npu_add_rms_norm."""
    model = tiny_causal_lm(model_type)
    generator = torch.Generator().manual_seed(7)
    hidden, probe = (torch.randn(2, 9, model.config.hidden_size, generator=generator) for _ in range(2))
    reference = copy.deepcopy(model).double()
    want, want_grads = _layer_under_autocast(reference, reference.model.layers[0], hidden.double(), probe, False)
    eager = copy.deepcopy(model).to("npu")
    with emulation.count_op_calls() as eager_calls:
        eager_out, eager_grads = _layer_under_autocast(eager, eager.model.layers[0], hidden, probe, True)
    assert not {"npu_rms_norm", "npu_add_rms_norm"} & set(eager_calls)
    fused = kernelize(copy.deepcopy(model).to("npu"), mode=Mode.TRAINING, device="npu")
    layer = fused.model.layers[0]
    with emulation.count_op_calls() as calls:
        out, grads = _layer_under_autocast(fused, layer, hidden, probe, True)
    assert calls["npu_rms_norm"] == 2 and "npu_add_rms_norm" not in calls, dict(calls)  # input norm + mid
    with emulation.count_op_calls() as one_dtype_calls:
        _layer_under_autocast(fused, copy.deepcopy(layer), hidden, probe, False)
    assert one_dtype_calls["npu_add_rms_norm"] == 1, dict(one_dtype_calls)
    assert out.dtype == eager_out.dtype
    assert_within_twice_eagers_error(out, eager_out, want, "output", error=relative_error)
    assert set(grads) == set(eager_grads) == set(want_grads)
    for name, grad in grads.items():
        assert_within_twice_eagers_error(grad, eager_grads[name], want_grads[name], name, error=relative_error)


def test_gradient_checkpointing_recomputes_the_fused_layer(npu_kernels):
    batches = [token_ids(batch=2, seq=8, seed=seed) for seed in range(2)]

    def sgd(params):
        return torch.optim.SGD(params, lr=1e-2)

    eager_losses, eager_updates = train_steps(tiny_causal_lm("llama").to("npu"), batches, sgd)
    model = kernelize(tiny_causal_lm("llama").to("npu"), mode=Mode.TRAINING, device="npu")
    losses, updates = train_steps(model, batches, sgd, checkpointing=True)
    assert losses == pytest.approx(eager_losses, rel=1e-6)
    for name, update in updates.items():
        torch.testing.assert_close(update, eager_updates[name], rtol=1e-4, atol=1e-6, msg=name)


def test_backward_keeps_the_sum_gamma_and_rstd_only(card):
    """What npu_rms_norm's own node keeps (its input, gamma, rstd), not float32 intermediates."""
    norm, residual, update = on_npu(make_norm("plain", torch.bfloat16), *inputs(torch.bfloat16))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _, summed = card.add_rms_norm(residual, update, norm, "plain", LLAMA)
    assert [(tuple(t.shape), t.dtype) for t in saved] == [
        (tuple(summed.shape), torch.bfloat16),
        ((HIDDEN,), torch.bfloat16),
        ((*summed.shape[:-1], 1), torch.float32),
    ]
    assert saved[0].data_ptr() == summed.data_ptr() and saved[1] is norm.weight


# Issue 30: eager's answer in every autograd form, and the hooks users attach to the norm the fused op bypasses.


@pytest.mark.parametrize("update_dtype", [torch.float32, torch.bfloat16], ids=["same dtype", "mixed pair"])
@pytest.mark.parametrize("scaling", list(NORMS))
def test_a_gradient_penalty_gives_eagers_second_order_gradients(card, scaling, update_dtype):
    """A recorded backward (create_graph) differentiates eager's math, with no warning of incomplete second-order
    gradients: npu_add_rms_norm's function raised (once_differentiable), and npu_rms_norm_backward (also what the
    mixed pair's npu_rms_norm runs) has no derivative on the device."""
    norm = make_norm(scaling, torch.float32)
    residual, update = inputs(torch.float32)
    same = {"npu_add_rms_norm": 1, "npu_rms_norm_backward": 1}  # its first-order backward, eager's second order
    fused_calls = same if update_dtype == torch.float32 else {"npu_rms_norm": 1}
    results = {}
    for name, function, extra in (
        ("eager", card.add_rms_norm_eager, ()),
        ("fused", card.add_rms_norm, (scaling, FAMILIES[scaling])),
    ):
        n, r, u = on_npu(norm, residual, update.to(update_dtype))
        with emulation.count_op_calls() as calls, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            normed, summed = function(r, u, n, *extra)
            loss = normed.pow(3).sum() + (normed * summed).sum() + summed.pow(2).sum()
            first = torch.autograd.grad(loss, (r, u, n.weight), create_graph=True)
            sum(g.float().pow(2).sum() for g in first).backward()
        assert dict(calls) == (fused_calls if name == "fused" else {})
        assert not [w for w in caught if "second-order gradients are incomplete" in str(w.message)]
        results[name] = [t.detach().cpu() for t in (*first, r.grad, u.grad, n.weight.grad)]
    for got, want in zip(results["fused"], results["eager"], strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scaling", list(NORMS))
def test_a_plain_backward_still_runs_the_fused_backward_once(card, scaling):
    norm = make_norm(scaling, torch.float32)
    n, r, u = on_npu(norm, *inputs(torch.float32))
    with emulation.count_op_calls() as calls:
        normed, summed = card.add_rms_norm(r, u, n, scaling, FAMILIES[scaling])
        loss = normed.pow(2).sum() + summed.sum()
        loss.backward(retain_graph=True)
        loss.backward()
    assert calls == {"npu_add_rms_norm": 1, "npu_rms_norm_backward": 2}


def _edit(output: torch.Tensor) -> torch.Tensor:
    return output * 1.25


def _hook_runs(model, name: str, how: str) -> tuple[torch.Tensor, dict, dict]:
    """The loss, the gradients and the fused op counts of a training step of `model` with `how` attached to its
    module `name` (removed afterwards)."""
    module = model.get_submodule(name)
    own_forward = vars(module).get("forward")  # where kernelize bound a layer's forward (or the class's own)
    if how == "forward hook":
        handle = module.register_forward_hook(lambda m, args, out: _edit(out))
    elif how == "forward pre-hook":
        handle = module.register_forward_pre_hook(lambda m, args: (_edit(args[0]),))
    elif how == "instance forward":  # as accelerate's add_hook_to_module does, after kernelize
        original = module.forward
        module.forward = lambda *args, **kwargs: _edit(original(*args, **kwargs))
    else:  # accelerate's own
        from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

        class Scale(ModelHook):
            def post_forward(self, module, output):
                return _edit(output)

        add_hook_to_module(module, Scale())
    try:
        model.zero_grad()
        with emulation.count_op_calls() as calls:
            loss = model(token_ids().to("npu"), labels=token_ids().to("npu")).loss
            loss.backward()
    finally:
        if how in ("forward hook", "forward pre-hook"):
            handle.remove()
        elif how == "instance forward":
            del module.forward
        else:
            remove_hook_from_module(module)
        if own_forward is not None:
            module.forward = own_forward
    grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().cpu(), grads, dict(calls)


@pytest.mark.parametrize("how", ["forward hook", "forward pre-hook", "instance forward", "accelerate hook"])
def test_what_users_attach_to_the_norm_runs_as_in_eager(npu_kernels, how):
    """A hook on post_attention_layernorm, or a forward replaced on its instance after kernelize (accelerate's
    add_hook_to_module), runs: that layer calls the norm, the others still fuse, and the step is eager's."""
    name = "model.layers.0.post_attention_layernorm"
    eager = tiny_causal_lm("llama").to("npu")
    model = kernelize(tiny_causal_lm("llama").to("npu"), mode=Mode.TRAINING, device="npu")
    want_loss, want_grads, _ = _hook_runs(eager, name, how)
    loss, grads, calls = _hook_runs(model, name, how)
    assert calls["npu_add_rms_norm"] == _layers(model) - 1
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert sorted(grads) == sorted(want_grads)
    for key, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[key], rtol=1e-4, atol=1e-6, msg=key)
    _, _, calls = _hook_runs(model, "model.layers.0.input_layernorm", "forward hook")  # not bypassed: still fused
    assert calls["npu_add_rms_norm"] == _layers(model)


def test_the_forward_kernelize_binds_on_the_norm_still_fuses(npu_kernels):
    """kernelize binds a forward on each norm's instance (npu-rms-norm's layer, or the class's own when that card is
    not selected): neither is a user's replacement, so the layer fuses."""
    for kernels in ("npu_fused_add_rmsnorm", "npu_fused_add_rmsnorm,npu_fused_rmsnorm"):
        model = apply_npu_kernels(tiny_causal_lm("llama").to("npu").train(), kernels=kernels, local_dir=npu_kernels)
        norm = model.model.layers[0].post_attention_layernorm
        assert "forward" in vars(norm)
        ids = token_ids().to("npu")
        assert card_reason(model) is None
        with emulation.count_op_calls() as calls:
            model(ids, labels=ids).loss.backward()
        assert calls["npu_add_rms_norm"] == _layers(model), kernels


def card_reason(model):
    from npu_hub_kernels.report import card_package

    layer = model.model.layers[0]
    card = card_package(layer)
    residual = torch.randn(2, 3, model.config.hidden_size).to("npu")
    return card.add_rms_norm_unavailable_reason(residual, residual, layer.post_attention_layernorm, "plain", LLAMA)


def test_a_global_module_hook_sees_the_norm_as_in_eager(npu_kernels):
    """register_module_forward_hook (a profiler, a tracer) sees every module eager calls: the layer calls the norm
    while such hooks are registered, says why, and fuses again once they are removed."""
    from torch.nn.modules import module as torch_module

    eager = tiny_causal_lm("llama").to("npu")
    model = kernelize(tiny_causal_lm("llama").to("npu"), mode=Mode.TRAINING, device="npu")
    ids = token_ids().to("npu")
    seen = {}
    for label, m in (("eager", eager), ("fused", model)):
        names = {module: name for name, module in m.named_modules()}
        calls_seen: list[str] = []
        handle = torch_module.register_module_forward_hook(
            lambda module, args, out, names=names, seen=calls_seen: seen.append(names.get(module, "?"))
        )
        try:
            with emulation.count_op_calls() as calls:
                m(ids, labels=ids).loss.backward()
            if label == "fused":
                assert calls["npu_add_rms_norm"] == 0
                assert "every module" in card_reason(model)
        finally:
            handle.remove()
        seen[label] = sorted(n for n in calls_seen if n != "?")
    assert seen["fused"] == seen["eager"]
    assert card_reason(model) is None
    with emulation.count_op_calls() as calls:
        model(ids, labels=ids).loss.backward()
    assert calls["npu_add_rms_norm"] == _layers(model)
