"""Make transformers' classes and rotary functions kernelizable under the cards' own mapping names.

How a transformers class gets a card's layer: `kernels.kernelize` replaces the forward of every
module whose class has `kernel_layer_name` set and mapped for the device. transformers tags its
norm classes "RMSNorm", and re-registers its own "RMSNorm" -> npu -> liger entry at every
`use_kernels=True` load and every train()/eval() switch, so a mapping under that name does not
last. Instead, each class listed in `npu_hub_kernels.models` (and only those: the classes whose
math the card reproduces) is retagged with the card's own mapping name, e.g. "npu-rms-norm:RMSNorm",
through `kernels.replace_kernel_forward_from_hub`. kernels' kernelize stays in charge;
transformers' re-registration cannot touch these names. Classes of modules that are not imported
yet are retagged by an import hook when they are.

Rotary functions are module-level functions, not classes. transformers turns most of them into
function-modules (`@use_kernel_forward_from_hub`) and attaches them to the attention modules
(`@use_kernelized_func`), which is how kernelize reaches them. For those it leaves as plain
functions or never attaches, this module does the same with kernels' own decorators: it replaces
the module global with a function-module and lists it in the `_kernel_funcs` of every class of that
modeling file that calls it (a class attribute, so models built earlier are reached too).
`restore()` undoes all of it.

Another library may have replaced a rotary function already (LLaMA-Factory's NPU kernels and Liger's
`apply_liger_kernel_to_*(rope=True)` set the module global to their own function; others patch the
forward of transformers' function-module). The card reproduces only transformers' function, so such
a function is left alone and what replaced it is logged: the other library's function keeps
running. The function-modules are shared like the functions they stand for: a deep copy of a model
(a TRL reference model) keeps calling them, so kernelizing the copy fuses it. A copy made while they were
not shared (before the process's first registration, or after `restore()`) holds copies of transformers'
function-modules in its attention modules' `_kernel_funcs`, which its code never calls (it calls the
global): what kernelize binds on such a copy it binds on the global too (`shared_original`), so the copy
runs what kernelize gave it.

Likewise a forward another library set on a module instance of a retagged class (TRL's trainers set their fused
LM head as the forward of the `*ForCausalLM` model, accelerate wraps a model's forward in its autocast) is never
replaced: kernels' kernelize binds a forward on every tagged module, at every call (transformers calls it again at
every train()/eval() of a `use_kernels=True` model), so while any class is retagged, kernelize leaves in place the
forward of a module of a retagged class that is neither a kernels layer's nor the class's own (`keeps_forward`,
through `_kernels_compat.keep_forwards`). `report.kept_forwards` lists such modules, with the forward kept.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import logging
import sys
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType

from kernels import replace_kernel_forward_from_hub, use_kernel_forward_from_hub
from torch import nn

from . import _kernels_compat as compat
from .cards import CARDS
from .models import ClassRule, fingerprints
from .report import card_layer_of, foreign_forward, global_names, qualified_name, retagged_card
from .selftest.results import stood_down

logger = logging.getLogger(__name__)

_MISSING = object()


@dataclass
class _Retagging:
    """What this module changed in the process, how to undo each change, and what it has still to do.

    Every change is recorded with how to undo it, once, under what it changed: `(cls, "tag")`, `(cls,
    "kernel_funcs")`, `(function_module, "shared")`, `(module, name)` for a global. `restore()` undoes
    them all; `_leave_alone` undoes those of one function-module.
    """

    undo: dict[Hashable, Callable[[], None]] = field(default_factory=dict)
    """What changed -> how to put it back as it was before this module changed it."""
    function_modules: dict[tuple[ModuleType, str], nn.Module] = field(default_factory=dict)
    """(module, name) -> the function-module made kernelizable for that global (its own or transformers')."""
    left_alone: dict[tuple[ModuleType, str], object] = field(default_factory=dict)
    """(module, name) -> another library's replacement left alone (logged once per replacement)."""
    pending: dict[str, list[tuple[ClassRule, str]]] = field(default_factory=dict)
    """Module name -> (rule, mapping name) for the rules whose module is not imported yet."""

    def record(self, change: Hashable, undo: Callable[[], None], *, replace: bool = False) -> None:
        """Remember how to undo `change`, the first time it is made, or every time with `replace`.

        The first time keeps the state before this module touched it.
        """
        if replace or change not in self.undo:
            self.undo[change] = undo

    def revert(self, change: Hashable) -> None:
        """Undo `change` now, if it was made."""
        undo = self.undo.pop(change, None)
        if undo is not None:
            undo()

    def revert_all(self) -> None:
        """Undo every change, release the card forwards of the function-modules, forget everything."""
        for undo in self.undo.values():
            undo()
        for function_module in self.function_modules.values():
            # kernelize bound a card layer's forward on this function-module, which every model of the family calls
            # (a module global): back to the function itself, or the card keeps running for models never kernelized.
            # A forward another library set there stays.
            if card_layer_of(function_module) is not None and foreign_forward(function_module) is None:
                compat.release_instance_forward(function_module)
        self.undo.clear()
        self.function_modules.clear()
        self.left_alone.clear()
        self.pending.clear()
        fingerprints.forget_eager()


_state = _Retagging()
"""The process's retagging: only this module reads or changes it."""


def tag_when_imported(rule: ClassRule, mapping_name: str) -> None:
    """Retag the rule's class (or wrap and attach its function) now, or when its module is imported."""
    module = sys.modules.get(rule.module)
    if module is not None:
        _swap_in(module, rule, mapping_name)
        return
    entries = _state.pending.setdefault(rule.module, [])
    if (rule, mapping_name) not in entries:
        entries.append((rule, mapping_name))
    if not any(isinstance(finder, _RetagOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RetagOnImport())


def restore() -> None:
    """Undo the retagging, wrapping and attaching: every class, global and function-module as it was."""
    _state.revert_all()


def _own(owner: object, attr: str) -> object:
    """The value `owner` itself holds for `attr` (not inherited); _MISSING when it holds none."""
    return owner.__dict__.get(attr, _MISSING)


def _put_back(owner: object, attr: str, value: object) -> None:
    if value is _MISSING:
        delattr(owner, attr)
    else:
        setattr(owner, attr, value)


def _put_back_global(module: ModuleType, name: str, function: object, function_module: nn.Module) -> None:
    if getattr(module, name, None) is function_module:  # not if another library replaced it since
        setattr(module, name, function)


def _swap_in(module: ModuleType, rule: ClassRule, mapping_name: str) -> None:
    """Make the rule's class (or function) of an imported module kernelizable under `mapping_name`, when proven.

    It is proven when its installed code is code the tests proved (`models.fingerprints`).
    """
    name = rule.class_name
    obj = getattr(module, name, _MISSING)
    if obj is _MISSING:
        _stays_eager(rule, f"{module.__name__} defines no {name} in this transformers release")
        return
    if isinstance(obj, type):
        if _proven(rule, obj):
            _retag(obj, mapping_name, rule)
        else:
            _keep_eager(obj)
        return
    replacement = _replacement(module, name, obj)
    if replacement is not None:
        _leave_alone(module, name, obj, replacement, card=mapping_name.partition(":")[0])
        return
    if not _proven(rule, fingerprints.code_of(obj)):
        return
    if inspect.isfunction(obj):  # a rotary function transformers left plain: make it a function-module
        function, obj = obj, use_kernel_forward_from_hub(mapping_name)(obj)
        _state.record((module, name), partial(_put_back_global, module, name, function, obj), replace=True)
        setattr(module, name, obj)
    _retag(type(obj), mapping_name)
    _share(obj, name)
    _state.function_modules[(module, name)] = obj
    for cls in _callers(module, name):
        _state.record((cls, "kernel_funcs"), partial(compat.set_own_kernel_funcs, cls, compat.own_kernel_funcs(cls)))
        compat.set_own_kernel_funcs(cls, {**compat.kernel_funcs(cls), name: obj})


def _proven(rule: ClassRule, code: object) -> bool:
    """Whether `code` (the installed class or function of `rule`) is proven; if not, it stays eager, with why.

    A layer that failed this host's selftest (`selftest.results`) stays eager too, saying so.
    """
    card = CARDS[rule.kernel_id]
    reason = stood_down(card.repo_name, rule.layer) or fingerprints.unproven_reason(card, rule.path, code)
    if reason is not None:
        _stays_eager(rule, reason)
    return reason is None


def _keep_eager(cls: type) -> None:
    """Have kernelize skip the modules of exactly `cls`, so that a listed class left unproven runs its own forward.

    transformers may have tagged `cls` itself (its "RMSNorm" entry maps npu to another hub kernel): while the cards
    are registered, a listed class left unproven runs its own forward, as it says. Undone by `restore()`.
    """
    if getattr(cls, "kernel_layer_name", None) is None:
        return
    _state.record((cls, "tag"), partial(_untag, cls, _own(cls, "kernel_layer_name"), _own(cls, "kernel_condition")))
    cls.kernel_condition = partial(_not_exactly, cls)


def _not_exactly(cls: type, module: nn.Module) -> bool:
    """A `kernel_condition` that no module of exactly `cls` meets (its subclasses keep their own tags' entries)."""
    return type(module) is not cls


def _stays_eager(rule: ClassRule, reason: str) -> None:
    if fingerprints.leave_eager(rule.path, reason):
        logger.debug("%s leaves %s eager: %s", CARDS[rule.kernel_id].repo_name, rule.path, reason)


def _share(function_module: nn.Module, name: str) -> None:
    """Make a rotary function-module behave like the function it stands for.

    It is named after that function (transformers attaches it to models under that name) and shared by deep copies,
    which call the module global.
    """
    _state.record(
        (function_module, "shared"),
        partial(
            _unshare, function_module, _own(function_module, "__name__"), _own(type(function_module), "__deepcopy__")
        ),
    )
    function_module.__name__ = name
    type(function_module).__deepcopy__ = _same_object


def _unshare(function_module: nn.Module, own_name: object, own_deepcopy: object) -> None:
    _put_back(function_module, "__name__", own_name)
    _put_back(type(function_module), "__deepcopy__", own_deepcopy)


def _same_object(self, memo):
    """`__deepcopy__` of a function-module: itself, as `copy.deepcopy` of a function is the function."""
    return self


def shared_original(module: nn.Module) -> nn.Module | None:
    """The shared function-module (a module global) that `module` is a stale deep copy of; None for any other module.

    Such a copy was made before `_share` (a model deep-copied before registering): its class is the original's, one
    class per function (`use_kernel_forward_from_hub`), and the code that holds it in `_kernel_funcs` calls the
    global. kernelize binds what it binds on the copy on the original too (`_kernels_compat.keep_forwards`), unless
    another library set the original's forward (`keeps_forward`).
    """
    cls = type(module)
    return next(
        (shared for shared in _state.function_modules.values() if type(shared) is cls and shared is not module), None
    )


def _replacement(module: ModuleType, name: str, obj: object) -> str | None:
    """What another library replaced transformers' function `name` of `module` with (for the log), or None.

    None when `obj` is still that function: as shipped, or a function-module made of it (by transformers or the
    registry) whose class forward is still the one kernels gives it.

    A forward set on the function-module instance is not a replacement: kernelize owns it (it binds the
    card's forward there, or the class forward when the function-module is not mapped).
    """
    if inspect.isfunction(obj):
        return None if _is_shipped(module, name, obj) else f"replaced it with {_qualified(obj)}"
    function = compat.function_module_function(obj)
    if function is None:
        forward = getattr(type(obj), "forward", None)
        return f"replaced it with a {_qualified(type(obj))} whose forward is {_qualified(forward)}"
    if _is_shipped(module, name, function):
        return None
    return f"replaced it with a function-module of {_qualified(function)}"


def _is_shipped(module: ModuleType, name: str, function) -> bool:
    """Whether `function` is the function `name` that `module`'s own source defines."""
    code = function.__code__
    return (
        function.__module__ == module.__name__
        and function.__qualname__ == name
        and code.co_name == name
        and code.co_filename == getattr(module, "__file__", None)
    )


def _qualified(obj: object) -> str:
    function = getattr(obj, "__func__", obj)
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


def _leave_alone(module: ModuleType, name: str, obj: object, replacement: str, *, card: str) -> None:
    """Keep another library's rotary function: log it once, and undo what an earlier registration did for this global.

    What it did is the function-module it attached or retagged, which nothing calls any more.
    """
    if _state.left_alone.get((module, name)) is not obj:
        _state.left_alone[(module, name)] = obj
        logger.warning(
            "%s leaves %s.%s alone: another library %s, which keeps running (the card reproduces only "
            "transformers' own function).",
            card,
            module.__name__,
            name,
            replacement,
        )
    function_module = _state.function_modules.pop((module, name), None)
    if function_module is None:
        return
    for cls in _callers(module, name):
        own = compat.own_kernel_funcs(cls) or {}
        if own.get(name) is function_module:
            compat.set_own_kernel_funcs(cls, {key: fn for key, fn in own.items() if key != name})
    _state.revert((type(function_module), "tag"))
    _state.revert((function_module, "shared"))


def _callers(module: ModuleType, name: str) -> list[type]:
    """The nn.Module classes defined in `module` whose methods (undecorated) look up the global `name`."""
    return [
        cls
        for cls in vars(module).values()
        if isinstance(cls, type)
        and issubclass(cls, nn.Module)
        and cls.__module__ == module.__name__
        and any(inspect.isfunction(f) and name in global_names(inspect.unwrap(f).__code__) for f in vars(cls).values())
    ]


_KEPT_FORWARDS = "kernelize keeps other libraries' forwards"
"""The change `_retag` records for `_kernels_compat.keep_forwards`, undone by `restore()`."""


ACCELERATE_AUTOCAST_MARK = "_npu_hub_kernels_runs_inside_accelerates_autocast"
"""The attribute a card layer's forward carries when it runs itself inside accelerate's mixed-precision autocast where
accelerate had wrapped the module's forward (npu-linear-cross-entropy's layers): a name, the card holds no import."""


def keeps_forward(module: nn.Module, layer: type) -> bool:
    """Whether kernelize is to leave `module`'s forward as it is rather than bind `layer`'s.

    It is to when its class is one this module retagged, and another library set its forward (neither a kernels
    layer's nor the class's own: `report.foreign_forward`), unless that forward is accelerate's autocast wrapper of
    the class's own forward, and `layer` runs itself inside that autocast (`ACCELERATE_AUTOCAST_MARK`):
    a model loaded with use_kernels=True on the host, moved to the npu and prepared by accelerate (Trainer(bf16=True)).
    """
    if retagged_card(type(module)) is None:
        return False
    forward = foreign_forward(module)
    return forward is not None and not (
        getattr(getattr(layer, "forward", None), ACCELERATE_AUTOCAST_MARK, False)
        and _accelerates_autocast_wrapper(module, forward)
    )


def _accelerates_autocast_wrapper(module: nn.Module, forward: object) -> bool:
    """Whether `forward`, set on `module`, is accelerate's mixed-precision wrapper of its class's own forward.

    accelerate's prepare_model keeps the forward it wrapped as `_original_forward` and wraps it (functools.wraps:
    `__wrapped__`) in its autocast and its fp32 output conversion, both defined in accelerate. (Its wrapper of a card
    layer's forward is kept: the card runs inside it.)"""
    if "_original_forward" not in vars(module) or not qualified_name(forward).startswith("accelerate."):
        return False
    return inspect.unwrap(getattr(forward, "__func__", forward)) is inspect.unwrap(type(module).forward)


def _retag(cls: type, mapping_name: str, rule: ClassRule | None = None) -> None:
    """Tag `cls` (a listed class, of `rule`, or a function-module's class) with a card's mapping name."""
    _state.record((cls, "tag"), partial(_untag, cls, _own(cls, "kernel_layer_name"), _own(cls, "kernel_condition")))
    # Only instances of exactly this class (a subclass may compute something else), and, for a listed class, only
    # while its code is still the proven code: kernelize asks at every call.
    replace_kernel_forward_from_hub(cls, mapping_name, condition=partial(_exactly_and_still_proven, cls, rule))
    # While a class is retagged, kernelize keeps the forward another library set on one of its modules, and binds
    # what it binds on a stale copy of a shared function-module on the shared one too.
    _state.record(_KEPT_FORWARDS, compat.stop_keeping_forwards)
    compat.keep_forwards(keeps_forward, shared_original)


def _exactly_and_still_proven(cls: type, rule: ClassRule | None, module: nn.Module) -> bool:
    """The `kernel_condition` of a retagged class: `module` is of exactly `cls`, and `cls`'s code is still proven.

    The code is checked as kernelize runs (registration checked it once): a class another library or the user patched
    since (Liger-Kernel's `apply_liger_kernel_to_*`, a `functools.wraps` wrapper) keeps running that code, and
    `swapped_modules` says why. kernelize skips such a module before it loads or validates the card's layer, so a
    patch with another signature raises nothing either; a layer an earlier kernelize bound on it is released."""
    if type(module) is not cls:
        return False
    if rule is None:
        return True
    reason = fingerprints.unproven_reason(CARDS[rule.kernel_id], rule.path, cls)
    if reason is None:
        fingerprints.forget_eager(rule.path)
        return True
    _stays_eager(rule, reason)
    bound = compat.instance_forward(module)
    if bound is not None and compat.is_layer_forward(getattr(bound, "__func__", None)):  # an earlier kernelize's
        compat.release_instance_forward(module)
    return False


def _untag(cls: type, own_tag: object, own_condition: object) -> None:
    _put_back(cls, "kernel_layer_name", own_tag)
    _put_back(cls, "kernel_condition", own_condition)


class _RetagOnImport(importlib.abc.MetaPathFinder):
    """Retags the listed classes of a transformers modeling module right after it is imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _state.pending:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _RetaggingLoader(spec.loader, fullname)
        return spec


class _RetaggingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, fullname: str) -> None:
        self._loader = loader
        self._fullname = fullname

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for rule, mapping_name in _state.pending.pop(self._fullname, []):
            _swap_in(module, rule, mapping_name)
