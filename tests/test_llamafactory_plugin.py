"""The `npu_hub` kernel plugin, run by LLaMA-Factory v1's own code (llamafactory 0.9.5, installed by `make setup`
without its dependencies but omegaconf, which its ModelEngine imports).

ModelEngine calls `KernelPlugin(kernel_config.name)(model=model, include_kernels=kernel_config.get(
"include_kernels"))` after loading the model; `model_engine_call` makes exactly that call with LLaMA-Factory's own
config parsing. The newer class registry of LLaMA-Factory (`BaseKernel` with `check_device`/`_apply`) is not
released: small stand-ins of it stand in here.

A selection applies to the model it is given, whatever the process registered before (in process, below); the
Hub path (no registration yet, `$NPU_HUB_KERNELS_ORG`) is tested in a fresh process.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import shutil
import sys
import textwrap
import zipfile
from abc import ABC, abstractmethod
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import _npu_hub_kernels_llamafactory as hook
import pytest
import torch
from _npu_hub_kernels_llamafactory import PLUGIN_NAME
from conftest import ROOT, run_python
from kernels import get_local_kernel
from test_coexistence import ROTARY, fresh_rotary, llamafactory_kernels, modeling, register  # noqa: F401 (fixtures)
from test_mapping import _gradients, expected_calls, forward, gated_mlp_count, layer_count
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from npu_hub_kernels import CARDS, ORG_ENV, registration, swapped_modules, unregister_npu_kernels
from npu_hub_kernels.llamafactory import apply_npu_hub_kernels, kernel_class
from npu_hub_kernels.report import card_layer_of
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import VOCAB, norm_module_count, token_ids
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm as tiny_model

PTH = ROOT / "mapping" / "npu_hub_kernels_llamafactory.pth"


def model_engine_call(model, kernel_config: dict):
    """What LLaMA-Factory 0.9.5's ModelEngine does with `kernel_config` (parsed as its arguments parse it)."""
    kernel_plugin = llamafactory_kernels().KernelPlugin
    from llamafactory.v1.config.arg_utils import get_plugin_config

    config = get_plugin_config(kernel_config)
    return kernel_plugin(config.name)(model=model, include_kernels=config.get("include_kernels"))


ENGINE_CALL_FAMILIES = ["llama", "qwen3_moe"]
"""The plugin has no per-family logic (it parses the config and calls `apply_npu_kernels`, which kernelizes as
every test_mapping case does), so one family per kind of card it must apply: Llama (norms, RoPE, split SwiGLU MLPs)
and Qwen3-MoE (experts too). Every family's fused forward is test_mapping's
test_kernelized_fp32_forward_matches_eager_and_every_fused_op_ran, with the same `expected_calls`."""


@pytest.mark.parametrize("model_type", ENGINE_CALL_FAMILIES)
def test_the_model_engine_call_fuses_what_the_cards_fuse_and_matches_eager(npu_kernels, model_type):
    ids = token_ids()
    eager = forward(tiny_model(model_type), ids)
    model = tiny_model(model_type).to("npu")
    assert model_engine_call(model, {"name": PLUGIN_NAME, "include_kernels": "auto"}) is model
    with emulation.count_op_calls() as calls:
        out = forward(model, ids)
    assert dict(calls) == expected_calls(model_type, model)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)


def test_the_plugin_loads_the_cards_from_where_the_process_registered_them(npu_kernels):
    """The fixture registered the local build: the plugin loads from it (the offline Hub cache holds no card of
    the default organisation, so registering from the Hub instead would fail)."""
    model = tiny_model("llama").to("npu")
    model_engine_call(model, {"name": PLUGIN_NAME, "include_kernels": "auto"})
    assert registration()["local_dir"] == npu_kernels
    swapped = [module for module in model.modules() if card_layer_of(module) is not None]
    # + the decoder layers (npu-add-rms-norm) + the model itself (its loss head, npu-linear-cross-entropy)
    assert len(swapped) == norm_module_count(model) + gated_mlp_count(model) + layer_count(model) + 1
    # the registered build's packages (kernels imports a variant once per content: a test that loaded the same build
    # from the offline Hub cache earlier in this process shares its modules, under the same names)
    local = {card.repo_name: get_local_kernel(npu_kernels / card.repo_name).__name__ for card in CARDS.values()}
    for module in swapped:
        build = card_layer_of(module)[0]
        assert build.__name__.partition(".")[0] == local[build.CARD]


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_training_runs_the_fused_backward_whichever_mode_the_model_was_kernelized_in(npu_kernels, mode):
    """ModelEngine applies kernels to the model as loaded (eval mode) and the trainer switches it to train:
    the cards' layers are the same in both modes, so the backward fuses either way."""
    embeds = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(3))
    reference = _gradients(tiny_model("llama"), embeds)
    model = getattr(tiny_model("llama").to("npu"), mode)()
    model_engine_call(model, {"name": PLUGIN_NAME, "include_kernels": "auto"})
    with emulation.count_op_calls() as calls:
        grads = _gradients(model, embeds)
    assert dict(calls) == expected_calls("llama", model, backward=True)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-4, atol=1e-5, msg=name)


def test_no_kernel_named_leaves_the_model_as_it_is_and_an_unknown_id_raises(npu_kernels, caplog):
    model = tiny_model("llama").to("npu")
    with caplog.at_level(logging.INFO, logger="npu_hub_kernels.llamafactory"):
        assert model_engine_call(model, {"name": PLUGIN_NAME}) is model
    assert "include_kernels=None names no kernel" in caplog.text
    with emulation.count_op_calls() as calls:
        forward(model, token_ids())
    assert calls == {} and swapped_modules(model) == []
    with pytest.raises(ValueError, match=r"Unknown kernel id.*'npu_fused_nope'"):
        model_engine_call(model, {"name": PLUGIN_NAME, "include_kernels": "npu_fused_rmsnorm,npu_fused_nope"})


def save_checkpoint(model_type: str, folder: Path):
    """A tiny model and a word-level tokenizer saved as a Hub checkpoint (what ModelEngine loads); the model."""
    model = tiny_model(model_type)
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0"))).save_pretrained(folder)
    return model


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_model_engine_loads_a_checkpoint_on_the_npu_and_kernelizes_it(npu_kernels, tmp_path, model_type):
    """LLaMA-Factory's own argument parsing and ModelEngine (from_pretrained on its current device, then the
    kernel plugin) with `kernel_config: {name: npu_hub, include_kernels: auto}`."""
    llamafactory_kernels()
    from llamafactory.v1.config.arg_parser import get_args
    from llamafactory.v1.core.model_engine import ModelEngine

    eager = forward(save_checkpoint(model_type, tmp_path), token_ids())
    model_args = get_args({"model": str(tmp_path), "kernel_config": {"name": "npu_hub", "include_kernels": "auto"}})[0]
    model = ModelEngine(model_args, is_train=False).model
    assert next(model.parameters()).device.type == "npu"
    with emulation.count_op_calls() as calls:
        out = forward(model, token_ids())
    assert dict(calls) == expected_calls(model_type, model)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)


def test_a_selection_fuses_only_what_it_names_after_an_auto_registration(npu_kernels):
    """After every card was registered ("auto"), the plugin asked for the norms alone fuses the norms alone in the
    model it is given: no MLP, no rotary call (the family's shared rotary function gets its own forward back)."""
    ids = token_ids()
    eager = forward(tiny_model("qwen3"), ids)
    model_engine_call(tiny_model("qwen3").to("npu"), {"name": PLUGIN_NAME, "include_kernels": "auto"})
    model = tiny_model("qwen3").to("npu")
    model_engine_call(model, {"name": PLUGIN_NAME, "include_kernels": "npu_fused_rmsnorm"})
    with emulation.count_op_calls() as calls:
        out = forward(model, ids)
    assert dict(calls) == {"npu_rms_norm": norm_module_count(model)}
    assert {s.card for s in swapped_modules(model)} == {"npu-rms-norm"}
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_selection_fuses_only_what_it_names_loading_from_the_hub_org_of_the_environment(offline_hub):
    """A fresh process that registered nothing: the plugin registers from the Hub ($NPU_HUB_KERNELS_ORG, here the
    offline cache) and fuses the norms and MLPs it names, not the rotary functions."""
    code = textwrap.dedent(
        """
        import json
        import torch
        from llamafactory.v1.plugins.model_plugins.kernels.interface import KernelPlugin
        from npu_hub_kernels import registration
        from npu_hub_kernels.testing import emulation
        from npu_hub_kernels.testing.tiny_models import tiny_causal_lm, token_ids

        eager = tiny_causal_lm("qwen3")(token_ids()).logits
        model = tiny_causal_lm("qwen3").to("npu")
        KernelPlugin("npu_hub")(model=model, include_kernels="npu_fused_rmsnorm,npu_fused_swiglu")
        with emulation.count_op_calls() as calls, torch.no_grad():
            out = model(token_ids().to("npu")).logits.cpu()
        print(json.dumps({"calls": calls, "org": registration()["org"], "error": (out - eager).abs().max().item()}))
        """
    )
    result = json.loads(run_python(code, emulate=True, env={ORG_ENV: offline_hub}).splitlines()[-1])
    model = tiny_model("qwen3")
    named = {"npu_rms_norm": norm_module_count(model), "npu_swiglu": expected_calls("qwen3", model)["npu_swiglu"]}
    assert result["calls"] == named and named["npu_rms_norm"] > 0 and named["npu_swiglu"] > 0
    assert result["org"] == offline_hub
    assert result["error"] <= 1e-5


@pytest.mark.slow
def test_a_host_without_an_npu_gets_the_model_back_as_it_is_with_a_log_line(tmp_path):
    """A plain CPU process activated by the package's .pth file alone: importing LLaMA-Factory's kernel interface
    registers the plugin, which leaves the model as it is and says why."""
    shutil.copy(PTH, tmp_path)
    code = textwrap.dedent(
        f"""
        import site, sys
        site.addsitedir({str(tmp_path)!r})
        assert "npu_hub_kernels" not in sys.modules and "torch" not in sys.modules  # the .pth line is cheap
        import logging
        logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(name)s: %(message)s")
        logging.getLogger("llamafactory").addHandler(logging.StreamHandler(sys.stdout))
        from llamafactory.v1.plugins.model_plugins.kernels.interface import KernelPlugin
        import torch
        from npu_hub_kernels import registration, swapped_modules
        from npu_hub_kernels.testing.tiny_models import tiny_causal_lm, token_ids

        model = tiny_causal_lm("llama")
        state = {{name: tensor.clone() for name, tensor in model.state_dict().items()}}
        assert KernelPlugin("npu_hub")(model=model, include_kernels="auto") is model
        assert swapped_modules(model) == [] and registration() is None
        assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())
        assert not any("forward" in vars(module) for module in model.modules())
        print("unchanged")
        """
    )
    out = run_python(code)
    assert "npu_hub_kernels.llamafactory: npu_hub: no NPU on this host (torch_npu does not import" in out
    assert "the model is left as it is" in out and out.rstrip().endswith("unchanged")
    assert "already registered" not in out  # registered once, though registering imports npu_hub_kernels


@pytest.mark.slow
def test_importing_the_package_registers_the_plugin_in_an_interface_imported_before():
    """Without the .pth file (an editable install) the plugin is missing until npu_hub_kernels is imported."""
    code = textwrap.dedent(
        """
        from llamafactory.v1.plugins.model_plugins.kernels.interface import KernelPlugin
        try:
            KernelPlugin("npu_hub")["__call__"]
        except ValueError as error:
            print("before:", error)
        import npu_hub_kernels
        from npu_hub_kernels.llamafactory import apply_npu_hub_kernels
        print("after:", KernelPlugin("npu_hub")["__call__"] is apply_npu_hub_kernels)
        """
    )
    out = run_python(code)
    assert "before: Method __call__ of plugin npu_hub is not registered." in out
    assert "after: True" in out


@pytest.mark.slow
def test_importing_the_package_never_fails_when_llamafactory_is_broken(tmp_path):
    """A LLaMA-Factory whose kernel interface raises on import: npu_hub_kernels imports, and the interface's own
    error reaches its importer unchanged."""
    package = tmp_path / "llamafactory" / "v1" / "plugins" / "model_plugins" / "kernels"
    package.mkdir(parents=True)
    for folder in [tmp_path / "llamafactory", *(tmp_path / "llamafactory").rglob("*")]:
        (folder / "__init__.py").touch()
    (package / "interface.py").write_text("raise RuntimeError('a broken LLaMA-Factory')\n")
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import npu_hub_kernels
        try:
            import llamafactory.v1.plugins.model_plugins.kernels.interface
        except RuntimeError as error:
            print("interface:", error)
        """
    )
    assert "interface: a broken LLaMA-Factory" in run_python(code)


def test_an_interface_without_a_plugin_registry_is_logged_not_raised(caplog):
    interface = ModuleType("an_unknown_llamafactory_interface")
    with caplog.at_level(logging.WARNING, logger="npu_hub_kernels.llamafactory"):
        hook.register(interface)
    assert "could not register its LLaMA-Factory kernel plugin 'npu_hub' (AttributeError" in caplog.text


# Stand-ins of newer LLaMA-Factory's class registry: a plugin family owns its registry of named objects, and a
# kernel class checks the device, then applies itself, called as `KernelPlugin(name).apply(model=..., config=...)`.
class NewerPlugin:
    _registry: ClassVar[dict[str, object]] = {}

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls._registry = {}

    def __init__(self, name: str) -> None:
        self.name = name

    def register(self):
        def decorator(obj):
            type(self)._registry[self.name] = obj
            return obj

        return decorator

    def __getattr__(self, attr: str):
        return getattr(type(self)._registry[self.name], attr)


class NewerKernelPlugin(NewerPlugin):
    pass


class NewerBaseKernel(ABC):
    @staticmethod
    @abstractmethod
    def check_device() -> None: ...

    @classmethod
    def apply(cls, **kwargs):
        cls.check_device()
        return cls._apply(**kwargs)

    @staticmethod
    @abstractmethod
    def _apply(**kwargs): ...


@pytest.fixture
def newer_interface(monkeypatch) -> ModuleType:
    """A kernel interface module of the newer kind: `KernelPlugin` next to a `BaseKernel` with `check_device`."""
    base = ModuleType("newer_llamafactory_kernels_base")
    plugin = type("KernelPlugin", (NewerKernelPlugin,), {"__module__": base.__name__})
    base.KernelPlugin, base.BaseKernel = plugin, NewerBaseKernel
    monkeypatch.setitem(sys.modules, base.__name__, base)
    interface = ModuleType("newer_llamafactory_kernels_interface")
    interface.KernelPlugin = plugin
    return interface


def test_the_newer_class_registry_gets_a_kernel_class_that_fuses_and_matches_eager(npu_kernels, newer_interface):
    hook.register_plugin(newer_interface, apply_npu_hub_kernels, kernel_class)
    kernel = newer_interface.KernelPlugin._registry[PLUGIN_NAME]
    assert issubclass(kernel, NewerBaseKernel) and not kernel.__abstractmethods__
    ids = token_ids()
    eager = forward(tiny_model("qwen3_moe"), ids)
    model = tiny_model("qwen3_moe").to("npu")
    assert newer_interface.KernelPlugin(PLUGIN_NAME).apply(model=model, config={"name": PLUGIN_NAME}) is model
    with emulation.count_op_calls() as calls:
        out = forward(model, ids)
    assert dict(calls) == expected_calls("qwen3_moe", model)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    untouched = tiny_model("mistral").to("npu")  # another family: qwen3_moe's rotary function is switched
    newer_interface.KernelPlugin(PLUGIN_NAME).apply(model=untouched, config={"include_kernels": None})
    with emulation.count_op_calls() as calls:
        forward(untouched, ids)
    assert calls == {} and swapped_modules(untouched) == []


def test_the_released_registry_gets_the_function(npu_kernels):
    interface = llamafactory_kernels()
    assert interface.KernelPlugin(PLUGIN_NAME)["__call__"] is apply_npu_hub_kernels


def test_the_switch_in_the_environment_turns_the_registration_off(monkeypatch, newer_interface):
    monkeypatch.setitem(sys.modules, hook.INTERFACE_MODULE, newer_interface)
    monkeypatch.setenv(hook.DISABLE_ENV, "0")
    hook.install()
    assert PLUGIN_NAME not in newer_interface.KernelPlugin._registry
    monkeypatch.delenv(hook.DISABLE_ENV)
    hook.install()
    assert PLUGIN_NAME in newer_interface.KernelPlugin._registry


def llamafactory_forwards(model) -> list[str]:
    """The modules whose forward LLaMA-Factory's kernels bound on the instance."""
    return [
        name
        for name, module in model.named_modules()
        if getattr(vars(module).get("forward"), "__module__", "").startswith("llamafactory.")
    ]


@pytest.mark.parametrize("ours_first", [False, True], ids=["llamafactory-auto-first", "npu-hub-first"])
def test_llamafactory_auto_and_npu_hub_in_one_process_do_not_undo_each_other(register, ours_first):  # noqa: F811
    """Two Llamas in one process, one through LLaMA-Factory's "auto" plugin, one through ours, in either order:
    each keeps its own norms and MLPs, the other's plugin changes nothing of them, and both give eager's logits.
    LLaMA-Factory's rotary kernel replaces the family's module global, so both run its rotary function: ours
    leaves it alone (logged) and does not list it; unregistering ours leaves theirs in place."""
    llamafactory_kernels()
    ids = token_ids()
    eager = forward(tiny_model("llama"), ids)
    theirs, ours = tiny_model("llama").to("npu"), tiny_model("llama").to("npu")

    def apply_ours():
        register()
        model_engine_call(ours, {"name": PLUGIN_NAME, "include_kernels": "auto"})

    if ours_first:
        apply_ours()
    model_engine_call(theirs, {"name": "auto", "include_kernels": "auto"})
    if not ours_first:
        apply_ours()
    their_modules = llamafactory_forwards(theirs)
    assert len(their_modules) == norm_module_count(theirs) + gated_mlp_count(theirs)
    assert llamafactory_forwards(ours) == [] and swapped_modules(theirs) == []
    cards = [swap.card for swap in swapped_modules(ours)]
    expected_cards = (
        ["npu-add-rms-norm"] * layer_count(ours)
        + ["npu-rms-norm"] * norm_module_count(ours)
        + ["npu-swiglu"] * gated_mlp_count(ours)
    )
    assert sorted(cards) == sorted([*expected_cards, "npu-linear-cross-entropy"])  # the model's own forward too
    rotary = getattr(modeling("llama"), ROTARY)
    assert rotary.__module__.startswith("llamafactory.")
    theirs_calls = {**expected_calls("llama", theirs), "npu_rms_norm": norm_module_count(theirs)}
    theirs_calls.pop("npu_add_rms_norm")  # LLaMA-Factory fuses every norm alone, the post-attention ones too
    for model, expected in ((theirs, theirs_calls), (ours, expected_calls("llama", ours))):
        with emulation.count_op_calls() as calls:
            out = forward(model, ids)
        assert dict(calls) == expected  # their rotary function: npu_rotary_mul on q and k
        torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    unregister_npu_kernels()
    assert llamafactory_forwards(theirs) == their_modules and getattr(modeling("llama"), ROTARY) is rotary


@pytest.mark.slow
def test_the_wheel_installs_the_pth_file_at_the_root_of_site_packages(tmp_path):
    """`pip install .` puts the .pth file and the module it imports at the root of site-packages."""
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", ".cache", "*.egg-info"))
    run_python(
        "import subprocess, sys; subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--quiet', '--no-deps', "
        f"'--no-build-isolation', '--wheel-dir', {str(tmp_path)!r}, {str(source)!r}], check=True)"
    )
    (wheel,) = tmp_path.glob("npu_hub_kernels-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert PTH.name in names and "_npu_hub_kernels_llamafactory.py" in names
    assert zipfile.ZipFile(wheel).read(PTH.name) == PTH.read_bytes()


def test_an_environment_outside_the_pins_gets_one_clear_refusal_in_either_registry(monkeypatch, newer_interface):
    """LLaMA-Factory 0.9.5 resolves transformers<=5.6.0, which cannot import next to kernels 0.17: the plugin then
    registered refuses with one message that says what is installed, what is needed and how to get a working pair,
    instead of a deep import error (or no plugin at all)."""
    installed = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "5.6.0" if name == "transformers" else installed(name)
    )
    problem = hook.environment_problem()
    assert "transformers 5.6.0 is installed, npu-hub-kernels needs transformers" in problem
    assert "pip install --no-deps llamafactory==0.9.5" in problem and "DISABLE_VERSION_CHECK=1" in problem
    functions = ModuleType("llamafactory_0_9_5_kernels_interface")
    functions.KernelPlugin = type("KernelPlugin", (NewerPlugin,), {"__module__": functions.__name__})
    monkeypatch.setitem(sys.modules, functions.__name__, functions)
    for interface in (functions, newer_interface):
        hook.register(interface)
        registered = interface.KernelPlugin._registry[PLUGIN_NAME]
        call = registered if interface is functions else registered.apply
        with pytest.raises(RuntimeError, match=r"cannot run here: transformers 5\.6\.0 is installed"):
            call(model=torch.nn.Linear(2, 2), include_kernels="auto")
    monkeypatch.setattr(importlib.metadata, "version", installed)
    assert hook.environment_problem() is None  # the pinned stack of this test environment
