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
(a TRL reference model) keeps calling them, so kernelizing the copy fuses it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import logging
import sys
from types import CodeType, ModuleType

from kernels import replace_kernel_forward_from_hub, use_kernel_forward_from_hub
from torch import nn

from .models import ClassRule

logger = logging.getLogger("npu_hub_kernels.registry")

_MISSING = object()
_original_tags: dict[type, tuple[object, object]] = {}
"""Class -> its own (`kernel_layer_name`, `kernel_condition`) before it was retagged."""
_original_globals: dict[tuple[ModuleType, str], tuple[object, nn.Module]] = {}
"""(module, name) -> (the plain function replaced, the function-module put there)."""
_function_modules: dict[tuple[ModuleType, str], nn.Module] = {}
"""(module, name) -> the function-module made kernelizable for that global (its own or transformers')."""
_original_function_module_attrs: dict[nn.Module, tuple[object, object]] = {}
"""Function-module -> (its own `__name__`, its class's own `__deepcopy__`) before they were set."""
_left_alone: dict[tuple[ModuleType, str], object] = {}
"""(module, name) -> another library's replacement left alone (logged once per replacement)."""
_original_kernel_funcs: dict[type, object] = {}
"""Class -> its own `_kernel_funcs` attribute before functions were attached to it."""
_pending: dict[str, list[tuple[ClassRule, str]]] = {}
"""Module name -> (rule, mapping name) for the rules whose module is not imported yet."""


def tag_when_imported(rule: ClassRule, mapping_name: str) -> None:
    """Retag the rule's class (or wrap and attach its function) now, or when its module is imported."""
    module = sys.modules.get(rule.module)
    if module is not None:
        _swap_in(module, rule, mapping_name)
        return
    entries = _pending.setdefault(rule.module, [])
    if (rule, mapping_name) not in entries:
        entries.append((rule, mapping_name))
    if not any(isinstance(finder, _RetagOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RetagOnImport())


def restore() -> None:
    """Undo the retagging, wrapping and attaching: every class, global and function-module as it was."""
    from .report import card_layer_of  # report reads this module's names: imported here, not at the top

    for cls, (name, condition) in _original_tags.items():
        _restore(cls, "kernel_layer_name", name)
        _restore(cls, "kernel_condition", condition)
    for cls, kernel_funcs in _original_kernel_funcs.items():
        _restore(cls, "_kernel_funcs", kernel_funcs)
    for (module, name), (function, function_module) in _original_globals.items():
        if getattr(module, name, None) is function_module:  # not if another library replaced it since
            setattr(module, name, function)
    for function_module, (name, deepcopy) in _original_function_module_attrs.items():
        _restore(function_module, "__name__", name)
        _restore(type(function_module), "__deepcopy__", deepcopy)
    for function_module in _function_modules.values():
        # kernelize bound a card layer's forward on this function-module, which every model of the family calls
        # (a module global): back to the function itself, or the card keeps running for models never kernelized.
        if card_layer_of(function_module) is not None:
            del function_module.forward
    _original_tags.clear()
    _original_kernel_funcs.clear()
    _original_globals.clear()
    _function_modules.clear()
    _original_function_module_attrs.clear()
    _left_alone.clear()
    _pending.clear()


def _restore(owner: object, attr: str, value: object) -> None:
    if value is _MISSING:
        delattr(owner, attr)
    else:
        setattr(owner, attr, value)


def _swap_in(module: ModuleType, rule: ClassRule, mapping_name: str) -> None:
    """Make the rule's class (or function) of an imported module kernelizable under `mapping_name`."""
    name = rule.class_name
    obj = getattr(module, name)
    if isinstance(obj, type):
        _retag(obj, mapping_name)
        return
    replacement = _replacement(module, name, obj)
    if replacement is not None:
        _leave_alone(module, name, obj, replacement, card=mapping_name.partition(":")[0])
        return
    if inspect.isfunction(obj):  # a rotary function transformers left plain: make it a function-module
        function, obj = obj, use_kernel_forward_from_hub(mapping_name)(obj)
        _original_globals[(module, name)] = (function, obj)
        setattr(module, name, obj)
    _retag(type(obj), mapping_name)
    _share(obj, name)
    _function_modules[(module, name)] = obj
    for cls in _callers(module, name):
        if cls not in _original_kernel_funcs:
            _original_kernel_funcs[cls] = cls.__dict__.get("_kernel_funcs", _MISSING)
        cls._kernel_funcs = {**getattr(cls, "_kernel_funcs", {}), name: obj}


def _share(function_module: nn.Module, name: str) -> None:
    """Make a rotary function-module behave like the function it stands for: named after it (transformers
    attaches it to models under that name) and shared by deep copies, which call the module global."""
    if function_module not in _original_function_module_attrs:
        _original_function_module_attrs[function_module] = (
            function_module.__dict__.get("__name__", _MISSING),
            type(function_module).__dict__.get("__deepcopy__", _MISSING),
        )
    function_module.__name__ = name
    type(function_module).__deepcopy__ = _same_object


def _same_object(self, memo):
    """`__deepcopy__` of a function-module: itself, as `copy.deepcopy` of a function is the function."""
    return self


def _replacement(module: ModuleType, name: str, obj: object) -> str | None:
    """What another library replaced transformers' function `name` of `module` with (for the log), or
    None when `obj` is still that function: as shipped, or a function-module made of it (by transformers
    or the registry) whose class forward is still the one kernels gives it.

    A forward set on the function-module instance is not a replacement: kernelize owns it (it binds the
    card's forward there, or the class forward when the function-module is not mapped)."""
    if inspect.isfunction(obj):
        return None if _is_shipped(module, name, obj) else f"replaced it with {_qualified(obj)}"
    function = wrapped_function(obj)
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


def wrapped_function(function_module: object):
    """The plain function a kernels function-module (`use_kernel_forward_from_hub` on a function)
    calls; None for anything else, including a function-module whose class forward was replaced."""
    forward = type(function_module).__dict__.get("forward")
    if not inspect.isfunction(forward) or forward.__code__ is not _FUNCTION_MODULE_FORWARD:
        return None
    return inspect.getclosurevars(forward).nonlocals.get("func")


def _probe():
    """Made a function-module of below, to recognise the forward kernels gives every function-module."""


_FUNCTION_MODULE_FORWARD = type(use_kernel_forward_from_hub("npu-hub-kernels:probe")(_probe)).forward.__code__


def _qualified(obj: object) -> str:
    function = getattr(obj, "__func__", obj)
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


def _leave_alone(module: ModuleType, name: str, obj: object, replacement: str, *, card: str) -> None:
    """Keep another library's rotary function: log it once, and undo what an earlier registration did
    for this global (the function-module it attached or retagged, which nothing calls any more)."""
    if _left_alone.get((module, name)) is not obj:
        _left_alone[(module, name)] = obj
        logger.warning(
            "%s leaves %s.%s alone: another library %s, which keeps running (the card reproduces only "
            "transformers' own function).",
            card,
            module.__name__,
            name,
            replacement,
        )
    function_module = _function_modules.pop((module, name), None)
    if function_module is None:
        return
    for cls in _callers(module, name):
        if cls.__dict__.get("_kernel_funcs", {}).get(name) is function_module:
            cls._kernel_funcs = {key: fn for key, fn in cls._kernel_funcs.items() if key != name}
    if type(function_module) in _original_tags:
        tag, condition = _original_tags.pop(type(function_module))
        _restore(type(function_module), "kernel_layer_name", tag)
        _restore(type(function_module), "kernel_condition", condition)
    if function_module in _original_function_module_attrs:
        own_name, deepcopy = _original_function_module_attrs.pop(function_module)
        _restore(function_module, "__name__", own_name)
        _restore(type(function_module), "__deepcopy__", deepcopy)


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


def global_names(code: CodeType) -> set[str]:
    """The global (and attribute) names a code object and the code nested in it look up."""
    nested = (global_names(const) for const in code.co_consts if isinstance(const, CodeType))
    return set(code.co_names).union(*nested)


def _retag(cls: type, mapping_name: str) -> None:
    if cls not in _original_tags:
        _original_tags[cls] = (
            cls.__dict__.get("kernel_layer_name", _MISSING),
            cls.__dict__.get("kernel_condition", _MISSING),
        )
    # Only instances of exactly this class: a subclass may compute something else.
    replace_kernel_forward_from_hub(cls, mapping_name, condition=lambda module: type(module) is cls)


class _RetagOnImport(importlib.abc.MetaPathFinder):
    """Retags the listed classes of a transformers modeling module right after it is imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending:
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
        for rule, mapping_name in _pending.pop(self._fullname, []):
            _swap_in(module, rule, mapping_name)
