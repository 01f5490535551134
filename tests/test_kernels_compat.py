"""Every private `kernels` API is used in one place, mapping/npu_hub_kernels/_kernels_compat.py, which refuses a
kernels release outside the range it is used with, saying what to install.

Held here, for every other file of mapping/, scripts/ and tests/: no import of a private kernels name (a line
pattern); no private attribute of a name imported from kernels (`kernels.layer.layer._CACHED_LAYER`,
`LayerRepository._resolve_revision`); no private attribute kernels defines on its objects or on others', on
anything but the file's own classes (`repo._repo_id`, `module._kernel_funcs`, `getattr(m, "_kernel_funcs")`),
found by reading kernels' own source; no look into the closures of generated code (`getclosurevars`,
`__closure__`).

The cards (kernel-cards/, shipped frozen per version to the Hub) have a register of their own,
kernel-cards/shared/_internals.py: every private internal of torch, DeepSpeed, accelerate, FSDP2, transformers or
kernels a card reads goes through one of its functions, each with its entry (what it reads, why, the public
alternative) and the releases it was checked against. Held here for every other file of kernel-cards/: no private
attribute the cards do not define themselves, no DeepSpeed `ds_*` attribute, `__globals__` or `__dict__`, no private
name as a string, no `vars()`, and none of kernels' private attributes.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import inspect
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import MethodType, ModuleType

import kernels
import pytest
from conftest import ROOT
from kernels import Mode, get_local_kernel, kernelize, use_kernel_forward_from_hub, use_kernel_mapping
from packaging.version import Version
from torch import nn

from npu_hub_kernels import CARDS
from npu_hub_kernels import _kernels_compat as compat

CARDS_BY_NAME = {card.repo_name: card for card in CARDS.values()}

PRIVATE_IMPORT = re.compile(
    r"^\s*(from kernels(\.\w+)*\._\w+ import|from kernels\._\w+|import kernels\.(\w+\.)*_\w+"
    r"|from kernels(\.\w+)* import (\([^)]*|[^\n#(]*)\b_(?!_)\w+)",
    re.MULTILINE,
)


def test_the_installed_kernels_is_in_the_supported_range():
    assert kernels.__version__ in compat.SUPPORTED and kernels.__version__ == compat.TESTED


@pytest.mark.parametrize("version", ["0.17.1", "0.18.0", "0.19.0"])
def test_a_kernels_release_outside_the_range_is_refused_with_what_to_install(version):
    """0.18.0 too: transformers 5.22.2 refuses it (is_kernels_available: >=0.17.2, <0.18.0), so use_kernels raises."""
    with pytest.raises(ImportError, match=rf"kernels>=0\.17\.2,<0\.18.*kernels {re.escape(version)} is installed"):
        compat.check_version(version)


@pytest.mark.parametrize("version", ["0.17.2", "0.17.9"])
def test_the_releases_transformers_accepts_pass_the_check(version):
    compat.check_version(version)


CLOSURE_READS = frozenset({"getclosurevars", "__closure__", "co_freevars", "cell_contents"})
"""How code reads the closure of a function: kernels' function-modules keep their function only there."""


def project_files() -> list[Path]:
    """The files held to the rule: every Python file of mapping/, scripts/ and tests/ but the compat module and
    this file (whose strings are the rule's examples)."""
    files = [*ROOT.glob("mapping/**/*.py"), *ROOT.glob("scripts/**/*.py"), *ROOT.glob("tests/*.py")]
    return sorted(path for path in files if path.name != "_kernels_compat.py" and path != Path(__file__))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and len(name) > 1


def kernels_private_attributes(source: Path = Path(kernels.__file__).parent) -> frozenset[str]:
    """The private attribute names kernels defines on objects, read from its source: those it assigns
    (`self._repo_id = ...`, `setattr(x, "_name", ...)`, `self.__dict__.setdefault("_kernel_funcs", {})`), its
    classes' private methods (`_resolve_revision`) and its modules' private functions (`_replace_forward`, an
    attribute of `kernels.layer.layer` however that module is reached). Names it only reads are another library's
    (`torch._C`)."""
    names = set()
    for path in source.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        names.update(item.name for item in tree.body if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                names.update(
                    item.name for item in node.body if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                )
            elif isinstance(node, ast.Call):
                names.update(_attribute_set_by_name(node))
    return frozenset(filter(_is_private, names))


def _attribute_set_by_name(call: ast.Call) -> list[str]:
    """The attribute name a call sets from a string: setattr(x, "name", v), x.__dict__.setdefault("name", v)."""
    function = call.func
    if isinstance(function, ast.Name) and function.id == "setattr" and len(call.args) > 1:
        key = call.args[1]
    elif (
        isinstance(function, ast.Attribute)
        and function.attr == "setdefault"
        and isinstance(function.value, ast.Attribute)
        and function.value.attr == "__dict__"
        and call.args
    ):
        key = call.args[0]
    else:
        return []
    return [key.value] if isinstance(key, ast.Constant) and isinstance(key.value, str) else []


KERNELS_PRIVATE_ATTRIBUTES = kernels_private_attributes()


def private_kernels_uses(source: str) -> Iterator[tuple[int, str]]:
    """(line, what) for each private kernels attribute or closure read in `source`, the text of one file."""
    tree = ast.parse(source)
    from_kernels = _names_bound_to_kernels(tree)
    own = _own_attribute_nodes(tree, from_kernels)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            root, chain = _attribute_chain(node)
            if root in from_kernels and any(_is_private(name) for name in chain):
                yield node.lineno, f"`{ast.unparse(node)}`"
            elif (node.attr in KERNELS_PRIVATE_ATTRIBUTES and id(node) not in own) or node.attr in CLOSURE_READS:
                yield node.lineno, f"`.{node.attr}`"
        elif isinstance(node, ast.Name) and node.id in CLOSURE_READS:
            yield node.lineno, f"`{node.id}`"
        elif isinstance(node, ast.ImportFrom) and any(alias.name in CLOSURE_READS for alias in node.names):
            yield node.lineno, f"`from {node.module} import ...`"
        elif isinstance(node, ast.Constant) and node.value in KERNELS_PRIVATE_ATTRIBUTES | CLOSURE_READS:
            yield node.lineno, f"`{node.value!r}`"


def _names_bound_to_kernels(tree: ast.Module) -> set[str]:
    """The names a file binds to kernels or to something imported from it (`import kernels.layer`, `from
    kernels.layer import layer as kl`, `from kernels import LayerRepository`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.asname or "kernels" for alias in node.names if alias.name.split(".")[0] == "kernels")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "kernels":
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _attribute_chain(node: ast.expr) -> tuple[str | None, list[str]]:
    """`a.b._c` -> ("a", ["b", "_c"]); the root is None when the chain does not start at a name."""
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), chain[::-1]


def _own_attribute_nodes(tree: ast.Module, from_kernels: set[str]) -> set[int]:
    """The ids of the `self.<name>`/`cls.<name>` nodes of the file's own classes (no base from kernels) whose
    name the class assigns itself: that private attribute is the file's own, whatever kernels names its own."""
    own = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef) or any(_attribute_chain(base)[0] in from_kernels for base in node.bases):
            continue
        on_self = [
            inner
            for inner in ast.walk(node)
            if isinstance(inner, ast.Attribute)
            and isinstance(inner.value, ast.Name)
            and inner.value.id in {"self", "cls"}
        ]
        assigned = {inner.attr for inner in on_self if isinstance(inner.ctx, ast.Store)}
        own.update(id(inner) for inner in on_self if inner.attr in assigned)
    return own


def test_kernels_defines_the_private_attributes_the_check_looks_for():
    """The names read from kernels' source include those the compat module reaches for (else the check is blind)."""
    assert {
        "_repo_id",
        "_resolve_revision",
        "_trust_remote_code",
        "_user_agent",
        "_repo_path",
        "_kernel_funcs",
        "_replace_forward",
    } <= KERNELS_PRIVATE_ATTRIBUTES


def test_no_other_file_uses_a_private_kernels_attribute_or_reads_generated_code():
    """Each use found is to go through a function of _kernels_compat (with its purpose and public alternative)."""
    found = {
        f"{path.relative_to(ROOT)}: {what}": line
        for path in project_files()
        for line, what in private_kernels_uses(path.read_text())
    }
    assert found == {}


@pytest.mark.parametrize(
    "source",
    [
        "from kernels.layer import layer\nlayer._CACHED_LAYER.clear()",
        "import kernels.layer.layer\nkernels.layer.layer._CACHED_LAYER",
        "import kernels as k\nk._versions",
        "from kernels import LayerRepository\nLayerRepository._resolve_revision",
        "def revision(repo):\n    return repo._resolve_revision()",
        "repo_id = repository._repo_id",
        "from kernels import LayerRepository\nclass Mine(LayerRepository):\n    def f(self):\n"
        "        self._repo_id = 'x'\n        return self._repo_id",
        "import kernels\nclass Mine(kernels.LayerRepository):\n    def f(self):\n        return self._user_agent",
        "from torch import nn\nclass Mine(nn.Module):\n    def f(self):\n        return self._kernel_funcs",
        "funcs = module._kernel_funcs",
        "cls._kernel_funcs = {}",
        "funcs = getattr(module, '_kernel_funcs', {})",
        "holder.__dict__['_kernel_funcs'] = {}",
        "for attr in ('kernel_layer_name', '_kernel_funcs'):\n    pass",
        "import inspect\ninspect.getclosurevars(forward).nonlocals['func']",
        "from inspect import getclosurevars",
        "cell = forward.__closure__[0].cell_contents",
        "cells = getattr(init, '__closure__', None)",
        "from kernels.layer import layer\nlayer._replace_forward = mine",
        "import importlib\nimportlib.import_module('kernels.layer.layer')._replace_forward = mine",
        "import sys\nsetattr(sys.modules['kernels.layer.layer'], '_replace_forward', mine)",
    ],
)
def test_the_check_catches_each_form_of_private_use(source):
    assert list(private_kernels_uses(source)), source


@pytest.mark.parametrize(
    "source",
    [
        "import kernels\nkernels.__version__",
        "from kernels import Mode, kernelize\nkernelize(model, mode=Mode.INFERENCE)",
        "class Loader:\n    def __init__(self, loader):\n        self._repo_id, self._version = loader, 1\n"
        "    def f(self):\n        return self._repo_id, self._version",
        "from npu_hub_kernels import _kernels_compat as compat\ncompat.kernel_funcs(module)",
        "import torch\ntorch._C._get_privateuse1_backend_name()",
        "x = obj._my_own_attribute",
        "text = 'see `_kernel_funcs` in kernels'",
    ],
)
def test_the_check_passes_public_use_and_the_projects_own_private_names(source):
    assert list(private_kernels_uses(source)) == [], source


def test_no_other_file_imports_a_private_kernels_name():
    offenders = []
    for path in project_files():
        for match in PRIVATE_IMPORT.finditer(path.read_text()):
            offenders.append(f"{path.relative_to(ROOT)}: {match.group(0).strip()}")
    assert offenders == []


def test_the_pattern_catches_each_form_of_private_import():
    for line in (
        "from kernels._rust import Digest",
        "from kernels.layer.layer import _validate_layer",
        "import kernels._versions",
        "    from kernels.backends import CANN, _backend",
        "from kernels.load import (\n    get_kernel,\n    _parse_local_kernel_overrides,\n)",
    ):
        assert PRIVATE_IMPORT.search(line), line
    assert not PRIVATE_IMPORT.search("from kernels import Mode, kernelize")
    assert not PRIVATE_IMPORT.search("from kernels import __version__")
    assert not PRIVATE_IMPORT.search("from kernels import (\n    Mode,\n    kernelize,\n)")


# --- The private function wrapped: layer._replace_forward ------------------------------------------------------


@use_kernel_forward_from_hub("npu-hub-kernels-test:Identity")
class Identity(nn.Module):
    """A tagged layer no mapping names: kernelize binds its class's forward on every instance."""

    def forward(self, x):
        return x


def other_forward(self, x):
    """Another library's forward for `Identity`."""
    return x + 1


def test_keep_forwards_leaves_what_the_keeper_keeps_and_kernelize_binds_the_rest():
    """kernelize sets every forward through `layer._replace_forward`: with a keeper installed, the modules it keeps
    keep their forward, the others are bound as kernels binds them; stopping gives kernels' binding back to all."""
    kept, bound = Identity(), Identity()
    for module in (kept, bound):
        module.forward = MethodType(other_forward, module)
    compat.keep_forwards(lambda module, layer: module is kept)
    try:
        with use_kernel_mapping({}, inherit_mapping=False):
            kernelize(nn.Sequential(kept, bound), mode=Mode.INFERENCE, device="cpu")
    finally:
        compat.stop_keeping_forwards()
    assert compat.instance_forward(kept).__func__ is other_forward
    assert compat.instance_forward(bound).__func__ is Identity.forward
    with use_kernel_mapping({}, inherit_mapping=False):
        kernelize(kept, mode=Mode.INFERENCE, device="cpu")
    assert compat.instance_forward(kept).__func__ is Identity.forward


def test_keep_forwards_binds_on_the_original_what_it_binds_on_a_stale_copy_unless_kept():
    """With `original_of`, kernelize binding a forward on a copy binds it on the original its code calls too; an
    original the keeper keeps keeps its forward, and a module that is no copy is bound alone."""
    original, copied, alone = Identity(), Identity(), Identity()
    for kept in (False, True):
        for module in (original, copied, alone):
            module.__dict__.pop("forward", None)
        original.forward = MethodType(other_forward, original)
        compat.keep_forwards(lambda module, layer, kept=kept: kept and module is original, {copied: original}.get)
        try:
            with use_kernel_mapping({}, inherit_mapping=False):
                kernelize(nn.Sequential(copied, alone), mode=Mode.INFERENCE, device="cpu")
        finally:
            compat.stop_keeping_forwards()
        assert compat.instance_forward(copied).__func__ is Identity.forward
        assert compat.instance_forward(alone).__func__ is Identity.forward
        assert compat.instance_forward(original).__func__ is (other_forward if kept else Identity.forward)


def test_is_layer_forward_knows_the_layers_of_every_loaded_kernel_and_kernels_function_modules(built_cards):
    """A layer class's forward of a kernel kernels loaded, and the forward kernels gives a function-module, are what
    kernelize binds; a class's own forward and any other function are not."""
    layers = get_local_kernel(built_cards / "npu-rms-norm").layers
    assert all(compat.is_layer_forward(getattr(layers, name).forward) for name in CARDS_BY_NAME["npu-rms-norm"].layers)
    function_module = use_kernel_forward_from_hub("npu-hub-kernels-test:function")(lambda x: 2 * x)
    assert compat.is_layer_forward(type(function_module).forward)
    assert not compat.is_layer_forward(Identity.forward) and not compat.is_layer_forward(other_forward)


# --- The cards: every private internal of another library through kernel-cards/shared/_internals.py -------------

CARD_INTERNALS = ROOT / "kernel-cards" / "shared" / "_internals.py"
INTERNAL_ATTRIBUTES = frozenset({"ds_status", "ds_id", "ds_shape", "__globals__", "__dict__"})
"""Internals read under public-looking names: DeepSpeed ZeRO-3's parameter attributes, a function's module globals,
an object's instance dict."""


def card_files() -> list[Path]:
    """The files of kernel-cards/ held to the internals register: every Python file but the register itself."""
    return sorted(path for path in ROOT.glob("kernel-cards/**/*.py") if path != CARD_INTERNALS)


def cards_own_names(paths: list[Path]) -> frozenset[str]:
    """The private names the cards define themselves: their modules, their module-level functions, classes and
    names, the attributes they assign and the strings they bind to a module-level name (an attribute they set)."""
    names = {path.stem for path in (*paths, CARD_INTERNALS)} | {"_build"}
    for path in paths:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                names.add(str(node.value.value))
    return frozenset(filter(_is_private, names))


def private_internal_uses(source: str, own: frozenset[str]) -> Iterator[tuple[int, str]]:
    """(line, what) for each read of another library's internals in `source`, the text of one card file: a private
    attribute the cards do not define, one of INTERNAL_ATTRIBUTES, a private name as a string, a `vars()` call."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and (
            (_is_private(node.attr) and node.attr not in own) or node.attr in INTERNAL_ATTRIBUTES
        ):
            yield node.lineno, f"`.{node.attr}`"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"_\w+", node.value) and _is_private(node.value) and node.value not in own:
                yield node.lineno, f"`{node.value!r}`"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars":
            yield node.lineno, "`vars(...)`"


def test_no_card_file_reads_another_librarys_internals_but_through_the_internals_register():
    """Each read found is to go through a function of kernel-cards/shared/_internals.py, with its register entry."""
    files = card_files()
    own = cards_own_names(files)
    found = {
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in files
        for source in [path.read_text()]
        for line, what in (*private_internal_uses(source, own), *private_kernels_uses(source))
    }
    assert found == set()


@pytest.mark.parametrize(
    "source",
    [
        "def f(module):\n    return module._forward_hooks",
        "def f(lm_head):\n    return hasattr(lm_head, '_hf_hook')",
        "def f(weight):\n    return weight.ds_status",
        "def f(module):\n    return vars(module).get('forward')",
        "def f(kind):\n    return getattr(torch_module, f'_global_{kind}_hooks')",
        "def f(cls):\n    return cls.forward.__globals__['load_balancing_loss_func']",
    ],
)
def test_the_card_check_catches_each_form_of_internal_use(source):
    assert list(private_internal_uses(source, frozenset())), source


def test_the_card_check_passes_the_cards_own_private_names():
    own = cards_own_names(card_files())
    assert {"_npu", "_fallbacks", "_internals", "_StandInForward", "_npu_hub_kernels_computes_the_norm_forward"} <= own
    assert list(private_internal_uses("from ._npu import torch_npu\nx = _chunk(h)", own)) == []


def _internals_register() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_card_internals", CARD_INTERNALS)
    register = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = register  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(register)
    return register


def test_the_internals_register_has_one_complete_entry_per_function_and_names_the_installed_releases():
    register = _internals_register()
    functions = {
        name
        for name, obj in vars(register).items()
        if inspect.isfunction(obj) and obj.__module__ == register.__name__ and not name.startswith("_")
    }
    assert set(register.INTERNALS) == functions
    assert all(entry.reads and entry.purpose and entry.public for entry in register.INTERNALS.values())
    for package in ("torch", "deepspeed", "accelerate", "transformers", "kernels"):
        installed = Version(importlib.metadata.version(package)).base_version
        assert f"{package} {installed}" in register.CHECKED, (package, installed)
