"""What runs where: the modules of a model whose forward is a card's layer, checked against what the code calls."""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from types import CodeType, MethodType, ModuleType

from torch import nn

from . import _kernels_compat as compat

_MISSING = object()

ROOT_MODULE = "<root>"
"""How `swapped_modules` names the model it is given when that module itself runs a card's layer."""


@dataclass(frozen=True)
class Swap:
    """A module of a model whose forward is a card's layer."""

    module: str
    module_class: str
    card: str
    layer: str
    variant: str


def swapped_modules(model: nn.Module, card: str | None = None) -> list[Swap]:
    """Which modules of `model` run an npu-hub-kernels layer, from which card and build variant
    (only those of `card`, e.g. "npu-rope", when given).

    Function-modules that a module calls (transformers attaches `apply_rotary_pos_emb` to each
    attention module under `_kernel_funcs`) are listed under the calling module's name and the name
    its code calls them by, e.g. `model.layers.0.self_attn.apply_rotary_pos_emb`, and only when that
    call reaches a card's layer: an attached function-module that the code does not call (another
    library replaced the global, or the entry is a deep copy of the global) is not listed, the global
    it does call is.
    """
    swaps = []
    lookups: dict[tuple[type, object], list[tuple[str, dict]]] = {}
    for name, module in model.named_modules():
        candidates = [(name, module)]
        candidates += [(f"{name}.{fname}", fn) for fname, fn in _called_function_modules(module, lookups)]
        for qualified, candidate in candidates:
            build, layer = card_layer_of(candidate) or (None, None)
            if build is not None and card in (None, build.CARD):
                swaps.append(
                    Swap(
                        module=qualified or ROOT_MODULE,
                        module_class=type(candidate).__name__,
                        card=build.CARD,
                        layer=layer,
                        variant=build.VARIANT,
                    )
                )
    return swaps


def _called_function_modules(module: nn.Module, cache: dict) -> list[tuple[str, nn.Module]]:
    """(global name, function-module) for each function-module of `module._kernel_funcs` that the
    module's code calls.

    The code calls a module global, not its `_kernel_funcs` entry: an entry counts while that global
    is the entry itself or another instance of its class (the shared original of a deep copy made
    before registering, or of any copy when transformers made the function-module). A module with
    no code of its own (a bare nn.Module holding function-modules) is taken to call each one by its
    function's name in the file that defines it.
    """
    entries = [entry for entry in compat.kernel_funcs(module).values() if isinstance(entry, nn.Module)]
    if not entries:
        return []
    own_forward = compat.instance_forward(module)
    key = (type(module), getattr(own_forward, "__func__", own_forward))
    if key not in cache:
        cache[key] = _global_lookups(type(module), key[1])
    lookups = cache[key] or [
        (function.__name__, vars(sys.modules[function.__module__]))
        for function in map(compat.function_module_function, entries)
        if function is not None and function.__module__ in sys.modules
    ]
    called = {}
    for global_name, namespace in lookups:
        target = namespace.get(global_name, _MISSING)
        if any(target is entry or type(target) is type(entry) for entry in entries):
            called[global_name] = target
    return sorted(called.items())


def _global_lookups(cls: type, forward=None) -> list[tuple[str, dict]]:
    """(name, globals) of every global name looked up by the methods of `cls` (those of nn.Module
    aside; `forward`, when given, in place of the class's forward)."""
    methods = {}
    for klass in reversed(cls.__mro__):
        if klass not in nn.Module.__mro__:
            methods.update((name, f) for name, f in vars(klass).items() if inspect.isfunction(f))
    if inspect.isfunction(forward):
        methods["forward"] = forward
    lookups = {}
    for method in methods.values():
        method = inspect.unwrap(method)
        for name in global_names(method.__code__):
            lookups[(name, id(method.__globals__))] = (name, method.__globals__)
    return list(lookups.values())


def global_names(code: CodeType) -> set[str]:
    """The global (and attribute) names a code object and the code nested in it look up."""
    nested = (global_names(const) for const in code.co_consts if isinstance(const, CodeType))
    return set(code.co_names).union(*nested)


def card_layer_of(module: nn.Module) -> tuple[ModuleType, str] | None:
    """(the card's generated `_build` module, the layer name) when kernelize gave `module` a card
    layer's forward; None otherwise."""
    forward = compat.instance_forward(module)
    build = _card_build_of(forward.__func__) if isinstance(forward, MethodType) else None
    return None if build is None else (build, _layer_name_of(forward.__func__))


def card_package(module: nn.Module) -> ModuleType | None:
    """The card package (e.g. the loaded `npu_swiglu`) whose layer kernelize gave `module` (or a function-module
    such as a swapped `apply_rotary_pos_emb`), for calling the card's functions directly; None when `module`
    runs no card layer."""
    build, _ = card_layer_of(module) or (None, None)
    return None if build is None else sys.modules[build.__name__.rpartition(".")[0]]


def _layer_name_of(function) -> str:
    """The name of the card layer whose forward `function` is (looked up in the card's layers module)."""
    layers = vars(sys.modules[function.__module__])
    return next(
        name for name, obj in layers.items() if isinstance(obj, type) and obj.__dict__.get("forward") is function
    )


def _card_build_of(function) -> ModuleType | None:
    """The generated `_build` module of the card a layer's forward comes from; None for other functions.

    Read from sys.modules: the package attribute is not set again when kernels re-imports a build
    under an id it has seen before.
    """
    build = sys.modules.get(function.__module__.rpartition(".")[0] + "._build")
    return build if getattr(build, "CARD", None) else None
