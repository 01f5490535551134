"""npu_hub_kernels.models, the class tables of npu-rms-norm, npu-rope, npu-swiglu and npu-moe, proven on the installed
transformers: every listed class (whose code is proven, tests/proof.py) is swapped and computes what its own forward
computes. Which classes the tables decide is tests/test_model_tables.py's."""

from __future__ import annotations

import importlib
import inspect
import types

import proof
import pytest
import torch
from conftest import imported_modeling_modules
from kernels import Mode, kernelize
from transformers.activations import ACT2FN

from npu_hub_kernels import _kernels_compat as compat
from npu_hub_kernels import swapped_modules
from npu_hub_kernels.models import MODEL_CLASSES, ClassRule
from npu_hub_kernels.testing import emulation

RULES = MODEL_CLASSES["npu_fused_rmsnorm"]
ROPE_RULES = MODEL_CLASSES["npu_fused_rope"]
SWIGLU_RULES = MODEL_CLASSES["npu_fused_swiglu"]
MOE_RULES = MODEL_CLASSES["npu_fused_moe"]


def _class(rule: ClassRule) -> type:
    return getattr(importlib.import_module(rule.module), rule.class_name)


def _all_modeling_classes() -> dict[str, type]:
    """Every class defined in a transformers modeling module, by path relative to transformers.models."""
    return {
        f"{module.__name__.removeprefix('transformers.models.')}.{name}": obj
        for module in imported_modeling_modules()
        for name, obj in vars(module).items()
        if isinstance(obj, type) and obj.__module__ == module.__name__
    }


@pytest.mark.slow
@pytest.mark.model_tables
def test_every_class_transformers_tags_rmsnorm_is_listed():
    """Once npu-hub-kernels is registered, transformers' own npu entry for "RMSNorm" is never reached."""
    listed = {rule.path for rule in RULES}
    tagged = {p for p, c in _all_modeling_classes().items() if c.__dict__.get("kernel_layer_name") == "RMSNorm"}
    assert tagged - listed == set()


@pytest.mark.model_tables
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_listed_class_is_swapped_and_matches_its_own_forward(npu_kernels, dtype):
    failures = []
    for rule in proof.proven_rules(RULES):
        before = len(failures)
        cls = _class(rule)
        torch.manual_seed(0)
        norm = cls(64, eps=1e-5)
        with torch.no_grad():
            norm.weight.normal_(0.5, 0.5)
        norm = norm.to(dtype)
        x = torch.randn(2, 5, 64, dtype=dtype) * 2
        with torch.no_grad():
            expected = norm(x)
            kernelized = kernelize(torch.nn.Sequential(norm).to("npu"), mode=Mode.INFERENCE, device="npu")
            with emulation.count_op_calls() as calls:
                got = kernelized(x.to("npu")).cpu()
        swaps = swapped_modules(kernelized)
        # without autograd a zero-centred norm runs as one npu_gemma_rms_norm, every other as one npu_rms_norm
        if [s.layer for s in swaps] != [rule.layer] or calls["npu_rms_norm"] + calls["npu_gemma_rms_norm"] != 1:
            failures.append(f"{rule.path}: swapped as {[s.layer for s in swaps]}, fused calls {calls}")
            proof.verdict(rule.path, False)
            continue
        exact = dtype == torch.float32 or rule.layer != "RMSNorm"
        if exact and not torch.equal(got, expected):
            failures.append(f"{rule.path}: max diff {(got - expected).abs().max().item()} (expected exact)")
        if not exact:
            x64 = x.double()
            reference = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double().cpu()
            kernel_error = (got.double() - reference).abs().max().item()
            eager_error = (expected.double() - reference).abs().max().item()
            if kernel_error > 2 * eager_error:
                failures.append(f"{rule.path}: error {kernel_error} > 2 x eager error {eager_error}")
        proof.verdict(rule.path, len(failures) == before)
    assert failures == []


def _cos_sin_for(layer: str, angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as the transformers functions of a layer's style expect them (see rotary.STYLES)."""
    if layer.endswith("HalfAngles"):
        emb = angles
    elif layer.startswith("RotaryPosEmbPairs"):
        emb = angles.repeat_interleave(2, dim=-1)
    else:
        emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.model_tables
def test_every_listed_rotary_function_is_swapped_and_matches_the_original(npu_kernels):
    """Each listed rotary function-module (transformers' own, or wrapped by the registry), kernelized
    through an attention module's `_kernel_funcs`, rotates exactly as the function transformers ships
    (float32, GQA, batch-1 cos/sin as models pass them)."""
    failures = []
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 32, generator=g), torch.randn(2, 2, 5, 32, generator=g)
    angles = torch.rand(1, 5, 16, generator=g) * 6.28
    for rule in proof.proven_rules(ROPE_RULES):
        before = len(failures)
        cos, sin = _cos_sin_for(rule.layer, angles)
        function_module = getattr(importlib.import_module(rule.module), rule.class_name)
        original = type(function_module).forward
        with torch.no_grad():
            expected = original(function_module, q, k, cos, sin, unsqueeze_dim=1)
            holder = torch.nn.Module()
            compat.set_own_kernel_funcs(holder, {rule.class_name: function_module})
            kernelize(holder, mode=Mode.INFERENCE, device="npu")
            with emulation.count_op_calls() as calls:
                got = function_module(*(t.to("npu") for t in (q, k, cos, sin)), unsqueeze_dim=1)
        swaps = swapped_modules(holder, card="npu-rope")
        if [s.layer for s in swaps] != [rule.layer] or calls["npu_rotary_mul"] != 2:
            failures.append(f"{rule.path}: swapped as {[s.layer for s in swaps]}, fused calls {calls}")
        elif not all(torch.equal(a.cpu(), b) for a, b in zip(got, expected, strict=True)):
            failures.append(f"{rule.path}: differs from the original")
        proof.verdict(rule.path, len(failures) == before)
    assert failures == []


@pytest.mark.model_tables
def test_every_listed_rotary_function_takes_or_refuses_narrower_cos_as_the_original_does(npu_kernels):
    """cos/sin narrower than q/k: a partial layer rotates the leading dims as the original does; a strict one
    fails where the original fails (Llama's function raises; rotating the leading dims would hide the bug)."""
    failures = []
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 5, 32, generator=g), torch.randn(2, 2, 5, 32, generator=g)
    angles = torch.rand(1, 5, 8, generator=g) * 6.28  # half the rotary width of the test above
    for rule in proof.proven_rules(ROPE_RULES):
        before = len(failures)
        cos, sin = _cos_sin_for(rule.layer, angles)
        function_module = getattr(importlib.import_module(rule.module), rule.class_name)
        with torch.no_grad():
            try:
                expected = type(function_module).forward(function_module, q, k, cos, sin, unsqueeze_dim=1)
            except RuntimeError:
                expected = None
            holder = torch.nn.Module()
            compat.set_own_kernel_funcs(holder, {rule.class_name: function_module})
            kernelize(holder, mode=Mode.INFERENCE, device="npu")
            try:
                got = function_module(*(t.to("npu") for t in (q, k, cos, sin)), unsqueeze_dim=1)
            except RuntimeError:
                got = None
        if (expected is None) != (got is None):
            outcome = {True: "raises", False: "returns"}
            failures.append(f"{rule.path}: original {outcome[expected is None]}, {rule.layer} {outcome[got is None]}")
        elif got is not None and not all(torch.equal(a.cpu(), b) for a, b in zip(got, expected, strict=True)):
            failures.append(f"{rule.path}: differs from the original")
        proof.verdict(rule.path, len(failures) == before)
    assert failures == []


@pytest.mark.model_tables
def test_every_listed_rotary_function_has_a_caller_that_kernelize_reaches(npu_kernels):
    """Each listed function is in the `_kernel_funcs` of at least one class of its modeling file
    (attached by transformers, or by the registry when transformers does not)."""
    unreached = []
    for rule in proof.proven_rules(ROPE_RULES):
        module = importlib.import_module(rule.module)
        function_module = getattr(module, rule.class_name)
        callers = [
            cls
            for cls in vars(module).values()
            if isinstance(cls, type) and function_module in compat.kernel_funcs(cls).values()
        ]
        reached = bool(callers) or _attached_by_transformers(module, function_module)
        if not reached:
            unreached.append(rule.path)
        proof.verdict(rule.path, reached)
    assert unreached == []


def _attached_by_transformers(module, function_module) -> bool:
    """Whether some class of `module` attaches `function_module` in __init__ (kernels' @use_kernelized_func)."""
    return any(
        function_module in compat.attached_at_construction(cls)
        for cls in vars(module).values()
        if isinstance(cls, type)
    )


MLP_ACTIVATION = {"GeGLUMLP": ("gelu_pytorch_tanh", "npu_geglu")}
"""Layer -> (the ACT2FN name its classes' configs give, the op it fuses with); SiLU and npu_swiglu otherwise."""


def _activation_and_op(rule: ClassRule) -> tuple[str, str]:
    return MLP_ACTIVATION.get(rule.layer, ("silu", "npu_swiglu"))


def _bare_mlp(rule: ClassRule, hidden: int, intermediate: int, dtype: torch.dtype) -> torch.nn.Module:
    """An instance of the listed class holding only what the layer reads: its projections and its activation
    (ACT2FN["silu"], or "gelu_pytorch_tanh" for GeGLUMLP, as configs give it). Its own forward then shows what the
    class computes."""
    cls = _class(rule)
    mlp = cls.__new__(cls)
    torch.nn.Module.__init__(mlp)
    if rule.layer == "SwiGLUGateUpMLP":
        mlp.gate_up_proj = torch.nn.Linear(hidden, 2 * intermediate, bias=False)
    else:
        mlp.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        mlp.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
    mlp.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)
    activation = "activation_fn" if "activation_fn" in _init_source(cls) else "act_fn"
    setattr(mlp, activation, ACT2FN[_activation_and_op(rule)[0]])
    return mlp.to(dtype)


def _init_source(cls: type) -> str:
    return inspect.getsource(cls.__init__)


@pytest.mark.model_tables
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_listed_mlp_class_is_swapped_and_matches_its_own_forward(npu_kernels, dtype):
    failures = []
    for rule in proof.proven_rules(SWIGLU_RULES):
        before = len(failures)
        torch.manual_seed(0)
        mlp = _bare_mlp(rule, 32, 40, dtype)
        x = torch.randn(2, 5, 32).to(dtype)
        with torch.no_grad():
            try:
                expected = mlp(x)
            except Exception as error:  # the class needs more than the layer reads
                failures.append(f"{rule.path}: its forward needs more: {error!r}")
                proof.verdict(rule.path, False)
                continue
            holder = kernelize(torch.nn.Sequential(mlp).to("npu"), mode=Mode.INFERENCE, device="npu")
            with emulation.count_op_calls() as calls:
                got = holder(x.to("npu")).cpu()
        swaps = swapped_modules(holder)
        if [s.layer for s in swaps] != [rule.layer] or calls[_activation_and_op(rule)[1]] != 1:
            failures.append(f"{rule.path}: swapped as {[s.layer for s in swaps]}, fused calls {calls}")
        elif dtype == torch.float32 and not torch.allclose(got, expected, rtol=1e-6, atol=1e-6):
            failures.append(f"{rule.path}: max diff {(got - expected).abs().max().item()}")
        elif dtype == torch.bfloat16:
            reference = _bare_mlp(rule, 32, 40, torch.float64)
            reference.load_state_dict({k: v.double() for k, v in mlp.state_dict().items()})
            with torch.no_grad():
                ref = reference(x.double())
            if (got.double() - ref).abs().max() > 2 * (expected.double() - ref).abs().max() + 1e-6:
                failures.append(f"{rule.path}: bf16 error above twice eager's")
        proof.verdict(rule.path, len(failures) == before)
    assert failures == []


def _bare_experts(rule: ClassRule, experts: int, hidden: int, inner: int) -> torch.nn.Module:
    """An instance of the listed Experts class with only its weights, SiLU, and transformers' "eager" choice."""
    cls = _class(rule)
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    g = torch.Generator().manual_seed(0)
    module.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * inner, hidden, generator=g) / hidden**0.5)
    module.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, inner, generator=g) / inner**0.5)
    module.num_experts, module.hidden_dim, module.intermediate_dim = experts, hidden, inner
    module.act_fn = ACT2FN["silu"]
    module.config = types.SimpleNamespace(_experts_implementation="eager")
    return module


@pytest.mark.model_tables
def test_every_listed_experts_class_is_swapped_and_matches_its_own_forward(npu_kernels):
    failures = []
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, 16, generator=g)
    index = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(11)])
    weights = torch.rand(11, 2, generator=g)
    for rule in proof.proven_rules(MOE_RULES):
        before = len(failures)
        experts = _bare_experts(rule, 6, 16, 12)
        with torch.no_grad():
            try:
                expected = experts(x, index, weights)
            except Exception as error:  # the class needs more than the layer reads
                failures.append(f"{rule.path}: its forward needs more: {error!r}")
                proof.verdict(rule.path, False)
                continue
            holder = kernelize(torch.nn.Sequential(experts).to("npu"), mode=Mode.INFERENCE, device="npu")
            with emulation.count_op_calls() as calls:
                got = holder[0](*(t.to("npu") for t in (x, index, weights))).cpu()
        swaps = swapped_modules(holder)
        if [s.layer for s in swaps] != [rule.layer] or calls["npu_grouped_matmul"] != 2:
            failures.append(f"{rule.path}: swapped as {[s.layer for s in swaps]}, fused calls {calls}")
        elif not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
            failures.append(f"{rule.path}: max diff {(got - expected).abs().max().item()}")
        proof.verdict(rule.path, len(failures) == before)
    assert failures == []
