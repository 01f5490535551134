"""Coexisting with other libraries' rotary patches, deep copies of models, and a report that tells the truth.

Another library may have replaced transformers' rotary functions before npu-hub-kernels is registered:
LLaMA-Factory's NPU kernels (`apply_default_kernels(model, "auto")`) and Liger's
`apply_liger_kernel_to_*(rope=True)` set each modeling file's `apply_rotary_pos_emb` to their own
function. The registry leaves such a function alone (logged, naming the global and its replacement),
swaps the rest, and the load goes on. Likewise a forward another library bound on a module instance (LLaMA-Factory's
norm and MLP kernels, TRL's LM head, accelerate's autocast wrapper) is never replaced: kernelize keeps it and
`kept_forwards` says so. `swapped_modules` lists only what runs: each listed swap is proven by the fused op counts of
its caller, and a swap that cannot run is not listed.
"""

from __future__ import annotations

import copy
import functools
import importlib
import logging
from collections import Counter
from types import MethodType

import pytest
import torch
from kernels import Mode, kernelize, use_kernel_forward_from_hub, use_kernel_mapping
from test_mapping import EXPECTED, expected_calls, forward, layer_count
from transformers import AutoModelForCausalLM

from npu_hub_kernels import (
    CARDS,
    apply_npu_kernels,
    kept_forwards,
    register_npu_kernels,
    swapped_modules,
    unregister_npu_kernels,
)
from npu_hub_kernels import _kernels_compat as compat
from npu_hub_kernels.report import ROOT_MODULE
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm as tiny_model
from npu_hub_kernels.testing.tiny_models import token_ids

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
    return [layer for layer in EXPECTED[model_type].rope if layer == "RotaryPosEmbDeinterleave"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_llamafactory_npu_kernels_applied_first_are_left_alone(register, caplog, model_type):
    """LLaMA-Factory's rotary function takes an extra position_ids: swapping it crashed kernelize (a
    forward signature mismatch). It keeps running, and so do the forwards LLaMA-Factory bound on norms and MLPs:
    kernelize keeps them (`kept_forwards` names each), the cards fuse the rest, and the output is eager's."""
    interface = llamafactory_kernels()
    ids = token_ids()
    eager = forward(tiny_model(model_type), ids)
    model = tiny_model(model_type).to("npu")
    interface.apply_default_kernels(model, "auto")
    theirs_bound = llamafactory_forwards(model)
    module = modeling(model_type)
    theirs = getattr(module, ROTARY)
    assert theirs.__module__.startswith("llamafactory.")  # LLaMA-Factory did replace the global
    with caplog.at_level(logging.WARNING, logger="npu_hub_kernels.retag"):
        register()
        kernelize(model, mode=Mode.INFERENCE, device="npu")
    assert getattr(module, ROTARY) is theirs
    assert f"{module.__name__}.{ROTARY} alone" in caplog.text
    assert f"{theirs.__module__}.{theirs.__qualname__}" in caplog.text
    kept = kept_forwards(model)
    assert llamafactory_forwards(model) == theirs_bound == [k.module for k in kept]
    assert {k.card for k in kept} == {"npu-rms-norm", "npu-swiglu"}
    assert all(k.forward.startswith("llamafactory.") for k in kept)
    with emulation.count_op_calls() as calls:
        out = forward(model, ids)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    rope_swaps = swapped_modules(model, card="npu-rope")
    assert [s.layer for s in rope_swaps] == rope_layers_left(model_type) * layer_count(model)
    # LLaMA-Factory's norm kernel runs on every norm, the post-attention ones too (npu-add-rms-norm's decoder layer
    # calls that norm as the class does: its forward is not the class's); its MLP kernel runs as npu-swiglu would
    expected = other_calls(model_type, model)
    expected["npu_rms_norm"] += expected.pop("npu_add_rms_norm", 0)
    assert {op: calls[op] for op in expected} == expected and calls["npu_add_rms_norm"] == 0
    # theirs fuses too (npu_rotary_mul on q and k), or for DeepseekV3 the card's interleaved function runs
    assert calls["npu_rotary_mul"] == ROPE_OPS_PER_CALL * layer_count(model)


def llamafactory_forwards(model) -> list[str]:
    """The modules whose forward LLaMA-Factory's kernels bound on the instance."""
    return [
        name
        for name, module in model.named_modules()
        if getattr(compat.instance_forward(module), "__module__", "").startswith("llamafactory.")
    ]


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
    with caplog.at_level(logging.WARNING, logger="npu_hub_kernels.retag"):
        register()
        model = kernelize(tiny_model(model_type).to("npu"), mode=Mode.INFERENCE, device="npu")
    assert f"{module.__name__}.{ROTARY} alone" in caplog.text and replacement in caplog.text
    with emulation.count_op_calls() as calls:
        out = forward(model, ids)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    rope_swaps = swapped_modules(model, card="npu-rope")
    assert [s.layer for s in rope_swaps] == rope_layers_left(model_type) * layer_count(model)
    assert calls["npu_rotary_mul"] == ROPE_OPS_PER_CALL * len(rope_swaps)
    assert foreign_rotary.calls == (0 if rope_swaps else layer_count(model))
    assert {op: calls[op] for op in other_calls(model_type, model)} == other_calls(model_type, model)


@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_a_function_replaced_after_registration_is_released_at_the_next(
    register, monkeypatch, caplog, built_cards, model_type
):
    """Registered first, replaced by another library, then kernelized: the swap nothing calls is not
    listed. `apply_npu_kernels` registers again: it logs the replacement and no longer swaps the
    function-module it had attached."""
    register()
    model = kernelize(tiny_model(model_type).to("npu"), mode=Mode.INFERENCE, device="npu")
    assert len(swapped_modules(model, card="npu-rope")) == layer_count(model)
    module = modeling(model_type)
    ours = getattr(module, ROTARY)
    monkeypatch.setattr(module, ROTARY, foreign_rotary)
    with emulation.count_op_calls() as calls:
        forward(model, token_ids())
    assert calls["npu_rotary_mul"] == 0 and swapped_modules(model, card="npu-rope") == []
    with caplog.at_level(logging.WARNING, logger="npu_hub_kernels.retag"):
        apply_npu_kernels(model, local_dir=built_cards)
    assert f"{module.__name__}.{ROTARY} alone" in caplog.text
    classes = [cls for cls in vars(module).values() if isinstance(cls, type)]
    assert not any(ours in (compat.own_kernel_funcs(cls) or {}).values() for cls in classes)  # the registry's
    assert model_type != "llama" or type(ours).kernel_layer_name == "rotary_pos_emb"  # transformers' own tag
    assert getattr(module, ROTARY) is foreign_rotary


CARD_OPS = {card.repo_name: card.fused_ops[0] for card in CARDS.values()}
"""The fused op each card's layer calls first (card.toml `fused_ops`): once per call, npu_rotary_mul twice (q, then
k)."""


def ops_inside(model, names: set[str]) -> dict[str, Counter]:
    """The fused op calls made inside the forward of each named module (its submodules' included), in one
    forward. Only those are hooked: a split MLP whose projections carry hooks runs its eager math."""
    ops: dict[str, Counter] = {}
    hooks = []
    for name, module in model.named_modules():
        if name not in names:
            continue

        def before(module, args, name=name):
            ops.setdefault(name, Counter()).subtract(emulation.OP_CALLS)

        def after(module, args, output, name=name):
            ops[name].update(emulation.OP_CALLS)

        hooks += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        forward(model, token_ids())
    finally:
        for hook in hooks:
            hook.remove()
    return {name: +counts for name, counts in ops.items()}


def assert_each_listed_swap_runs(model_type: str, model) -> None:
    """Every swap listed ran, and nothing fused that is not listed: each listed module
    made its card's fused op call; each caller of rotary function-modules made ops per call times the functions listed
    under it (DeepseekV3's attention calls one of its two, by config), and one with none listed made none."""
    # a decoder layer npu-add-rms-norm swaps fuses its post_attention_layernorm without calling it (a hooked norm
    # is called instead: left unhooked here); a swapped model forward (npu-linear-cross-entropy) fuses only its loss,
    # in a call with labels, which this one is not: it is left out here, and the last check holds it to no fused call
    fused_norms = {f"{s.module}.post_attention_layernorm" for s in swapped_modules(model, card="npu-add-rms-norm")}
    swaps = [s for s in swapped_modules(model) if s.module not in fused_norms and s.module != ROOT_MODULE]
    modules = dict(model.named_modules())
    rope_callers: dict[str, list[str]] = {name: [] for name, m in modules.items() if compat.kernel_funcs(m)}
    ops = ops_inside(model, {"", *rope_callers, *(s.module for s in swaps)})
    for swap in swaps:
        if swap.module in modules:
            assert ops[swap.module][CARD_OPS[swap.card]] == 1, (swap, ops[swap.module])
        else:
            caller, _, function = swap.module.rpartition(".")
            rope_callers[caller].append(function)
    assert rope_callers, "no caller of a rotary function-module"
    fused = Counter(CARD_OPS[s.card] for s in swaps if s.module in modules)
    fused["npu_swiglu"] += fused["npu_moe_token_permute"]  # the experts' activation
    for caller, functions in rope_callers.items():
        taken = [f for f in functions if model_type != "deepseek_v3" or f.endswith("_interleave")]
        assert ops[caller]["npu_rotary_mul"] == ROPE_OPS_PER_CALL * len(taken), (caller, functions, ops[caller])
        fused["npu_rotary_mul"] += ROPE_OPS_PER_CALL * len(taken)
    assert {op: ops[""][op] for op in CARD_OPS.values()} == {op: fused[op] for op in CARD_OPS.values()}


def rope_names(model_type: str, model) -> list[str]:
    functions = [ROTARY] if model_type != "deepseek_v3" else [ROTARY, f"{ROTARY}_interleave"]
    return [f"model.layers.{i}.self_attn.{f}" for i in range(layer_count(model)) for f in functions]


DEEPCOPY_CASES = ["kernelize a copy of the base model", "copy a kernelized model", "copy, then kernelize again"]


@pytest.mark.parametrize("case", DEEPCOPY_CASES)
@pytest.mark.parametrize("model_type", ["llama", "phi3", "deepseek_v3"])
def test_a_deep_copy_fuses_as_the_original_does(register, model_type, case):
    """TRL-style reference models are deep copies. transformers keeps the rotary function-module in each
    attention module's `_kernel_funcs`, and deepcopy used to copy it: kernelize then swapped the copy,
    while the code calls the module global. The function-modules are shared like the functions they are."""
    register()
    ids = token_ids()
    eager = forward(tiny_model(model_type), ids)
    base = tiny_model(model_type)  # copied on the host (test_training_stacks.py copies npu models)
    if case != DEEPCOPY_CASES[0]:
        kernelize(base, mode=Mode.INFERENCE, device="npu")
    model = copy.deepcopy(base).to("npu")
    if case != DEEPCOPY_CASES[1]:
        kernelize(model, mode=Mode.INFERENCE, device="npu")
    with emulation.count_op_calls() as calls:
        out = forward(model, ids)
    assert dict(calls) == expected_calls(model_type, model)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    assert [s.module for s in swapped_modules(model, card="npu-rope")] == rope_names(model_type, model)
    assert_each_listed_swap_runs(model_type, model)


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3"])
def test_a_copy_made_before_registering_fuses_its_rotary_embedding(register, model_type):
    """A deep copy made before registering holds its own copies of the function-modules transformers
    attaches (Llama), which its code does not call: kernelizing the copy binds the card on the global its
    code calls too, so it fuses and lists what runs (issue 43). Functions the registry attaches (DeepseekV3)
    are class attributes, never copied: they fuse as well."""
    ids = token_ids()
    eager = forward(tiny_model(model_type), ids)
    base = tiny_model(model_type)
    model = copy.deepcopy(base).to("npu")
    register()
    kernelize(model, mode=Mode.INFERENCE, device="npu")
    with emulation.count_op_calls() as calls:
        out = forward(model, ids)
    assert dict(calls) == expected_calls(model_type, model)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    assert [s.module for s in swapped_modules(model, card="npu-rope")] == rope_names(model_type, model)
    assert_each_listed_swap_runs(model_type, model)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_rotary_swaps_are_named_by_function_before_and_after_registering(register, model_type):
    before = tiny_model(model_type).to("npu")
    register()
    after = tiny_model(model_type).to("npu")
    for model in (before, after):
        kernelize(model, mode=Mode.INFERENCE, device="npu")
        assert [s.module for s in swapped_modules(model, card="npu-rope")] == rope_names(model_type, model)
        assert_each_listed_swap_runs(model_type, model)


# --- A forward another library set on a module is never replaced ------------------------------------------------


def own_head(self, input_ids=None, **kwargs):
    """Another library's forward for a causal LM (as TRL's fused LM head): the backbone, then its own head."""
    return {"own_head": self.lm_head(self.model(input_ids).last_hidden_state)}


def own_norm(self, hidden_states):
    """Another library's forward for a norm (as LLaMA-Factory's kernels bind one)."""
    return hidden_states * 2


@pytest.mark.parametrize("load", ["kernelize", "use_kernels=True"])
def test_forwards_another_library_set_are_kept_across_every_kernelize(register, tmp_path, load):
    """A forward set on a module of a swapped class (the model's own, a norm's) stays through every kernelize in
    either mode, and through the train()/eval() switches that kernelize a use_kernels=True model again: it runs,
    `kept_forwards` names it and says why, `swapped_modules` leaves it out, and every other module still fuses."""
    register()
    tiny_model("llama").save_pretrained(tmp_path / "source")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "source", device_map="npu", use_kernels=load != "kernelize")
    if load == "kernelize":
        kernelize(model, mode=Mode.INFERENCE, device="npu")
    norm = model.model.layers[0].input_layernorm
    model.forward = MethodType(own_head, model)
    norm.forward = MethodType(own_norm, norm)
    for switch in (
        lambda: kernelize(model, mode=Mode.TRAINING, device="npu"),
        lambda: kernelize(model, mode=Mode.INFERENCE, device="npu"),
        model.train,
        model.eval,
    ):
        switch()
        assert compat.instance_forward(model).__func__ is own_head
        assert compat.instance_forward(norm).__func__ is own_norm
    kept = {k.module: k for k in kept_forwards(model)}
    assert sorted(kept) == [ROOT_MODULE, "model.layers.0.input_layernorm"]
    assert (kept[ROOT_MODULE].card, kept[ROOT_MODULE].forward) == ("npu-linear-cross-entropy", f"{__name__}.own_head")
    assert kept["model.layers.0.input_layernorm"].forward == f"{__name__}.own_norm"
    assert kept[ROOT_MODULE].reason.startswith(f"not fused: another library set its forward to {__name__}.own_head")
    assert {s.module for s in swapped_modules(model)}.isdisjoint(kept)
    with emulation.count_op_calls() as calls, torch.no_grad():
        out = model(token_ids().to("npu"))
    assert set(out) == {"own_head"}
    expected = expected_calls("llama", model)
    expected["npu_rms_norm"] -= 1  # the kept norm
    assert dict(calls) == expected


def test_a_wrapper_around_a_card_layer_is_kept_and_the_card_runs_inside_it(register):
    """accelerate's way: a wrapper (`functools.wraps`, `__wrapped__`) around the forward kernelize bound. kernelize
    keeps it; the card's layer still runs inside, so `swapped_modules` lists the module and `kept_forwards` does not."""
    register()
    model = kernelize(tiny_model("llama").to("npu"), mode=Mode.INFERENCE, device="npu")
    norm = model.model.norm
    bound = compat.instance_forward(norm)
    wrapped = []

    @functools.wraps(bound.__func__)
    def wrapper(self, *args, **kwargs):
        wrapped.append(True)
        return bound.__func__(self, *args, **kwargs)

    norm.forward = MethodType(wrapper, norm)
    kernelize(model, mode=Mode.TRAINING, device="npu")
    assert compat.instance_forward(norm).__func__ is wrapper
    assert "model.norm" in {s.module for s in swapped_modules(model, card="npu-rms-norm")}
    assert "model.norm" not in {k.module for k in kept_forwards(model)}
    with emulation.count_op_calls() as calls, torch.no_grad():
        forward(model, token_ids())
    assert wrapped and dict(calls) == expected_calls("llama", model)


@use_kernel_forward_from_hub("npu-hub-kernels-test:Doubling")
class Doubling(torch.nn.Module):
    """Another library's tagged layer (npu-hub-kernels never retags it)."""

    def forward(self, x):
        return 2 * x


def test_other_librarys_tagged_classes_are_kernelized_as_kernels_does(register):
    """Only the classes npu-hub-kernels retagged keep another library's forward: for any other tagged class kernelize
    binds as kernels binds (here its class's forward, nothing being mapped), with the cards registered or not."""
    for registered in (True, False):
        if registered:
            register()
        else:
            unregister_npu_kernels()
        layer = Doubling()
        layer.forward = MethodType(own_norm, layer)
        kernelize(layer, mode=Mode.INFERENCE, device="npu")
        assert compat.instance_forward(layer).__func__ is Doubling.forward, registered
        assert kept_forwards(layer) == []


def test_unregistering_gives_kernelize_back_its_own_binding(register):
    """After unregister_npu_kernels, a class that was retagged is transformers' again: a kept forward is still
    there (unregistering removes nothing another library set) but the next kernelize binds as kernels does."""
    register()
    model = tiny_model("llama").to("npu")
    norm = model.model.norm
    norm.forward = MethodType(own_norm, norm)
    kernelize(model, mode=Mode.INFERENCE, device="npu")
    assert compat.instance_forward(norm).__func__ is own_norm
    unregister_npu_kernels()
    assert compat.instance_forward(norm).__func__ is own_norm and kept_forwards(model) == []
    with use_kernel_mapping({}, inherit_mapping=False):  # no layer mapped: kernelize binds each class's forward
        kernelize(model, mode=Mode.INFERENCE, device="npu")
    assert compat.instance_forward(norm).__func__ is type(norm).forward


def _patched_norm_forward(how: str, original):
    """A patch of LlamaRMSNorm.forward that computes something else (as Liger's or a user's would)."""
    if how == "another signature":

        def forward(self, hidden_states, scale=1.41):
            return original(self, hidden_states) * scale

        return forward

    def forward(self, hidden_states):
        return original(self, hidden_states) * 1.41

    return functools.wraps(original)(forward) if how == "functools.wraps" else forward


@pytest.mark.parametrize(
    ("when", "how", "load"),
    [
        ("before registering", "functools.wraps", "kernelize"),
        ("after registering", "plain", "kernelize"),
        ("after registering", "functools.wraps", "use_kernels=True"),
        ("after registering", "another signature", "use_kernels=True"),
        ("after registering", "functools.wraps", "apply_npu_kernels"),
        ("after registering", "a subclass", "kernelize"),
    ],
)
def test_a_norm_class_patched_by_another_library_runs_its_patch(
    register, built_cards, monkeypatch, tmp_path, when, how, load
):
    """A class whose code is not the proven code when a card would take it over (Liger's apply_liger_kernel_to_*, a
    user's functools.wraps patch, a subclass put in its place) runs that code, and swapped_modules says why."""
    llama = modeling("llama")
    original = llama.LlamaRMSNorm

    def patch():
        if how == "a subclass":
            patched = type("PatchedRMSNorm", (original,), {"forward": _patched_norm_forward("plain", original.forward)})
            monkeypatch.setattr(llama, "LlamaRMSNorm", patched)
        else:
            monkeypatch.setattr(original, "forward", _patched_norm_forward(how, original.forward))

    if when == "before registering":
        patch()
    register()
    if when == "after registering":
        patch()
    tiny_model("llama").save_pretrained(tmp_path / "source")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "source", device_map="npu")
    ids = token_ids().to("npu")
    with torch.no_grad():
        want = model(ids).logits
    if load == "use_kernels=True":
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "source", device_map="npu", use_kernels=True)
    elif load == "apply_npu_kernels":
        model = apply_npu_kernels(model, kernels="auto", local_dir=built_cards)
    else:
        kernelize(model, mode=Mode.INFERENCE, device="npu")
    with emulation.count_op_calls() as calls, torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls["npu_rms_norm"] == 0 and calls["npu_add_rms_norm"] == 0
    assert calls["npu_swiglu"] > 0  # the other cards fuse
    if how != "a subclass":  # the class listed in the table is left eager, and says why
        reasons = {s.eager_reason for s in swapped_modules(model, card="npu-rms-norm")}
        assert reasons and all("patch" in (reason or "") for reason in reasons), reasons


def test_a_class_patched_after_kernelize_runs_the_card_until_the_next_kernelize(register, monkeypatch):
    """kernels' rule for any Hub layer: a class patch does not reach the forward kernelize bound on an instance; the
    next kernelize releases the card's forward, and the patch runs."""
    register()
    model = tiny_model("llama").to("npu")
    kernelize(model, mode=Mode.INFERENCE, device="npu")
    original = modeling("llama").LlamaRMSNorm
    monkeypatch.setattr(original, "forward", _patched_norm_forward("functools.wraps", original.forward))
    ids = token_ids().to("npu")
    for kernelized_again, fused in ((False, True), (True, False)):
        if kernelized_again:
            kernelize(model, mode=Mode.INFERENCE, device="npu")
        with emulation.count_op_calls() as calls, torch.no_grad():
            model(ids)
        assert (calls["npu_rms_norm"] > 0) is fused, (kernelized_again, dict(calls))


@pytest.mark.parametrize("how", ["plain", "functools.wraps"])
def test_a_replaced_rotate_half_leaves_rope_eager_and_swapped_modules_says_so(register, monkeypatch, how):
    """The gate's fingerprint of the rotary function counts the rotate_half it calls: replaced (a plain function or a
    functools.wraps wrapper, computing something else), the rotary function runs eager with it, and swapped_modules
    lists the rotary function-modules with that reason (issue 39)."""
    llama = modeling("llama")
    original = llama.rotate_half

    def rotate_half(x):
        return original(x) * 0.5

    monkeypatch.setattr(llama, "rotate_half", functools.wraps(original)(rotate_half) if how != "plain" else rotate_half)
    register()
    model = tiny_model("llama").to("npu")
    ids = token_ids().to("npu")
    with torch.no_grad():
        want = model(ids).logits
    kernelize(model, mode=Mode.INFERENCE, device="npu")
    with emulation.count_op_calls() as calls, torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls["npu_rotary_mul"] == 0 and calls["npu_rms_norm"] > 0
    rope = swapped_modules(model, card="npu-rope")
    assert rope and all(s.variant is None and "differs from the code proven" in s.eager_reason for s in rope), rope
