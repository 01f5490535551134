"""Coexisting with other libraries' rotary patches.

Another library may have replaced transformers' rotary functions before npu-hub-kernels is registered:
LLaMA-Factory's NPU kernels (`apply_default_kernels(model, "auto")`) and Liger's
`apply_liger_kernel_to_*(rope=True)` set each modeling file's `apply_rotary_pos_emb` to their own
function. The registry leaves such a function alone (logged, naming the global and its replacement),
swaps the rest, and the load goes on.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch
from kernels import Mode, kernelize
from test_mapping import EXPECTED, expected_calls, forward, layer_count

from npu_hub_kernels import (
    emulation,
    pack_gate_up,
    register_npu_kernels,
    swapped_modules,
    unregister_npu_kernels,
)
from npu_hub_kernels.tiny_models import tiny_causal_lm as tiny_model
from npu_hub_kernels.tiny_models import token_ids

FAMILIES = ["llama", "phi3", "deepseek_v3", "qwen3"]
"""transformers attaches Llama's and Qwen3's rotary function-module; the registry attaches Phi3's
(plain function) and DeepseekV3's (decorated, never attached)."""
ROTARY = "apply_rotary_pos_emb"
LLAMAFACTORY_KERNELS = "llamafactory.v1.plugins.model_plugins.kernels.interface"
ROPE_OPS_PER_CALL = 2  # npu_rotary_mul on q, then on k


def modeling(model_type: str):
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def llamafactory_kernels():
    """LLaMA-Factory's kernel plugins, imported under the NPU emulation (installed without dependencies)."""
    return pytest.importorskip(
        LLAMAFACTORY_KERNELS,
        reason="llamafactory is not installed: `make setup` installs it without its dependencies "
        "(pip install --no-deps llamafactory==0.9.5, pinned in requirements-dev.txt)",
    )


@pytest.fixture
def fresh_rotary():
    """The families' rotary globals as in a fresh process (no forward bound by an earlier kernelize), and
    as they were after the test, whatever another library (or the registry) set them to meanwhile."""
    saved = []
    for model_type in FAMILIES:
        module = modeling(model_type)
        for name in (ROTARY, f"{ROTARY}_interleave"):
            obj = getattr(module, name, None)
            if isinstance(obj, torch.nn.Module):
                saved.append((module, name, obj, obj.__dict__.pop("forward", None)))
            elif obj is not None:
                saved.append((module, name, obj, None))
    yield
    for module, name, obj, bound in saved:
        setattr(module, name, obj)
        if isinstance(obj, torch.nn.Module):
            obj.__dict__.pop("forward", None)
            if bound is not None:
                obj.__dict__["forward"] = bound


@pytest.fixture
def register(fresh_rotary, built_cards):
    """Registers the cards when called (after another library's patch); unregisters after the test."""
    yield lambda: register_npu_kernels(local_dir=built_cards)
    unregister_npu_kernels()


def foreign_rotary(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Another library's rotary function (Liger's and LLaMA-Factory's signature): the eager math, counted."""
    foreign_rotary.calls += 1
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rotary = cos.shape[-1]

    def rotate(x):
        x1, x2 = x[..., : rotary // 2], x[..., rotary // 2 : rotary]
        return torch.cat((x[..., :rotary] * cos + torch.cat((-x2, x1), dim=-1) * sin, x[..., rotary:]), dim=-1)

    return rotate(q), rotate(k)


foreign_rotary.calls = 0


def foreign_forward(self, q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    return foreign_rotary(q, k, cos, sin, position_ids, unsqueeze_dim)


def other_calls(model_type: str, model) -> dict[str, int]:
    """The fused op calls of the other cards (norms, MLPs, experts) in one forward."""
    return {op: n for op, n in expected_calls(model_type, model).items() if op != "npu_rotary_mul"}


def rope_layers_left(model_type: str) -> list[str]:
    """The npu-rope layers still swapped when `apply_rotary_pos_emb` is another library's: DeepseekV3's
    `apply_rotary_pos_emb_interleave` (the one its tiny config calls) stays."""
    return [layer for layer in EXPECTED[model_type].rope if layer != "RotaryPosEmb"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_llamafactory_npu_kernels_applied_first_are_left_alone(register, caplog, model_type):
    """LLaMA-Factory's rotary function takes an extra position_ids: swapping it crashed kernelize (a
    forward signature mismatch). It keeps running; every other card fuses; the output is eager's."""
    interface = llamafactory_kernels()
    ids = token_ids()
    eager = forward(tiny_model(model_type), ids)
    model = tiny_model(model_type).to("npu")
    interface.apply_default_kernels(model, "auto")
    module = modeling(model_type)
    theirs = getattr(module, ROTARY)
    assert theirs.__module__.startswith("llamafactory.")  # LLaMA-Factory did replace the global
    with caplog.at_level(logging.WARNING, logger="npu_hub_kernels.registry"):
        register()
        kernelize(model, mode=Mode.INFERENCE, device="npu")
    pack_gate_up(model)
    assert getattr(module, ROTARY) is theirs
    assert f"{module.__name__}.{ROTARY} alone" in caplog.text
    assert f"{theirs.__module__}.{theirs.__qualname__}" in caplog.text
    with emulation.count_op_calls() as calls:
        out = forward(model, ids)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    rope_swaps = swapped_modules(model, card="npu-rope")
    assert [s.layer for s in rope_swaps] == rope_layers_left(model_type) * layer_count(model)
    assert {op: calls[op] for op in other_calls(model_type, model)} == other_calls(model_type, model)
    # theirs fuses too (npu_rotary_mul on q and k), or for DeepseekV3 the card's interleaved function runs
    assert calls["npu_rotary_mul"] == ROPE_OPS_PER_CALL * layer_count(model)


def test_llamafactory_kernels_module_imports_under_the_emulation():
    interface = llamafactory_kernels()
    assert {"npu_fused_rope", "npu_fused_rmsnorm", "npu_fused_swiglu"} <= set(interface.get_default_kernels())


def patch(how: str, module, monkeypatch) -> str:
    """Replace `module.apply_rotary_pos_emb` the way another library would; returns the replacement's name."""
    obj = getattr(module, ROTARY)
    if how == "global":  # Liger, LLaMA-Factory
        monkeypatch.setattr(module, ROTARY, foreign_rotary)
        return f"{__name__}.foreign_rotary"
    assert isinstance(obj, torch.nn.Module), "transformers made it a function-module"
    monkeypatch.setattr(type(obj), "forward", foreign_forward)  # the forward of transformers' function-module
    return f"{__name__}.foreign_forward"


@pytest.mark.parametrize(
    ("model_type", "how"),
    [(t, "global") for t in FAMILIES] + [(t, "function-module forward") for t in ("llama", "deepseek_v3")],
)
def test_a_rotary_function_another_library_replaced_is_left_alone(register, monkeypatch, caplog, model_type, how):
    """A stand-in for Liger (a plain function as the module global), and for a library that patches the
    forward of transformers' function-module: left alone and logged; the model loads and matches eager."""
    ids = token_ids()
    eager = forward(tiny_model(model_type), ids)
    module = modeling(model_type)
    replacement = patch(how, module, monkeypatch)
    foreign_rotary.calls = 0
    with caplog.at_level(logging.WARNING, logger="npu_hub_kernels.registry"):
        register()
        model = kernelize(tiny_model(model_type).to("npu"), mode=Mode.INFERENCE, device="npu")
    pack_gate_up(model)
    assert f"{module.__name__}.{ROTARY} alone" in caplog.text and replacement in caplog.text
    with emulation.count_op_calls() as calls:
        out = forward(model, ids)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    rope_swaps = swapped_modules(model, card="npu-rope")
    assert [s.layer for s in rope_swaps] == rope_layers_left(model_type) * layer_count(model)
    assert calls["npu_rotary_mul"] == ROPE_OPS_PER_CALL * len(rope_swaps)
    assert foreign_rotary.calls == (0 if rope_swaps else layer_count(model))
    assert {op: calls[op] for op in other_calls(model_type, model)} == other_calls(model_type, model)
