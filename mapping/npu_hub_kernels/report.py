"""What runs where: the modules of a model whose forward is a card's layer, and those that run none, with why.

The modules whose forward is a card's layer are checked against what the code calls (with why each last ran eager,
as the card recorded it). The modules of swapped classes that keep a forward another library set on them run no
card's layer (`kept_forwards`), nor do the modules of classes a card's model table leaves out (`left_out_modules`).
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from types import CodeType, MethodType, ModuleType

from torch import nn

from . import _kernels_compat as compat
from .cards import CARDS
from .models import BY_KERNEL_ID, MODEL_CLASSES, fingerprints

_MISSING = object()

ROOT_MODULE = "<root>"
"""How `swapped_modules` names the model it is given when that module itself runs a card's layer."""


@dataclass(frozen=True)
class Swap:
    """A module of a model whose forward is a card's layer, with why its calls ran eager.

    `eager_reason`: why its last call ran eager (None when that call fused, or it has not run), `eager_calls`: every
    reason its calls ran eager for, with how many, as the card's layer recorded them (its `_fallbacks`). `variant`
    None: a module of a class the card lists that runs eager on this transformers release (its code is not code the
    tests proved, `models.fingerprints`), or whose layer failed this host's selftest and stands down
    (`selftest.results`); `eager_reason` says which.
    """

    module: str
    module_class: str
    card: str
    layer: str
    variant: str | None
    eager_reason: str | None = None
    eager_calls: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class KeptForward:
    """A module of a class a card swaps that runs no card's layer, because kernelize keeps another library's forward.

    Another library set its forward, which kernelize keeps (`forward`, that forward's qualified name; `reason`, the
    sentence saying so).
    """

    module: str
    module_class: str
    card: str
    forward: str
    reason: str


def swapped_modules(model: nn.Module, card: str | None = None) -> list[Swap]:
    """Which modules of `model` run an npu-hub-kernels layer, from which card and build variant.

    Only those of `card` (e.g. "npu-rope") are listed when it is given.

    Function-modules that a module calls (transformers attaches `apply_rotary_pos_emb` to each
    attention module under `_kernel_funcs`) are listed under the calling module's name and the name
    its code calls them by, e.g. `model.layers.0.self_attn.apply_rotary_pos_emb`, and only when that
    call reaches a card's layer: an attached function-module that the code does not call (another
    library replaced the global, or the entry is a deep copy of the global) is not listed, the global
    it does call is. A module whose forward another library wrapped around a card's layer (accelerate's
    autocast wrapper, `functools.wraps` style) runs that layer and is listed; one whose forward another
    library replaced is not: `kept_forwards` lists it, with why. Each swap says why the module's last call ran eager,
    if it did (`Swap.eager_reason`), and every reason its calls ran eager for (`Swap.eager_calls`). A module of a class
    a card lists but leaves eager on this transformers release is listed with `variant` None and that reason.
    """
    swaps = []
    left_eager = _left_eager_rules()
    for qualified, candidate in _candidates(model):
        build, layer = card_layer_of(candidate) or (None, None)
        unproven = left_eager.get(_listed_path(candidate)) if build is None else None
        if unproven is not None and card in (None, unproven[0]):
            repo_name, layer, reason = unproven
            swaps.append(Swap(qualified, type(candidate).__name__, repo_name, layer, None, reason))
        if build is not None and card in (None, build.CARD):
            record = _eager_record(build, candidate)
            swaps.append(
                Swap(
                    module=qualified,
                    module_class=type(candidate).__name__,
                    card=build.CARD,
                    layer=layer,
                    variant=build.VARIANT,
                    eager_reason=None if record is None else record.last,
                    eager_calls=() if record is None else tuple(record.counts.items()),
                )
            )
    return swaps


def _class_path(cls: type) -> str:
    """A class's path as the model tables write it (relative to transformers.models)."""
    return f"{cls.__module__.removeprefix('transformers.models.')}.{cls.__qualname__}"


def _listed_path(candidate: nn.Module) -> str:
    """A module's path as the model tables write it: its class's, or, for a function-module, its function's."""
    function = compat.function_module_function(candidate)
    if function is None:
        return _class_path(type(candidate))
    return f"{function.__module__.removeprefix('transformers.models.')}.{function.__qualname__}"


def _left_eager_rules() -> dict[str, tuple[str, str, str]]:
    """Class path -> (card, layer, why) for each listed class the registry left eager in this process."""
    left_eager = fingerprints.left_eager()
    if not left_eager:
        return {}
    return {
        rule.path: (CARDS[kernel_id].repo_name, rule.layer, left_eager[rule.path])
        for kernel_id, rules in MODEL_CLASSES.items()
        for rule in rules
        if rule.path in left_eager
    }


def _eager_record(build: ModuleType, module: nn.Module) -> object | None:
    """What the card of `build` recorded of `module`'s eager calls (`_fallbacks.EagerRecord`), None if nothing."""
    fallbacks = sys.modules.get(build.__name__.rpartition(".")[0] + "._fallbacks")
    return None if fallbacks is None else fallbacks.eager_record(module)


def kept_forwards(model: nn.Module, card: str | None = None) -> list[KeptForward]:
    """The modules of `model` whose class a card swaps but which run another library's forward, not a card's layer.

    Only `card`'s are listed, when given. Another library set their forward (`foreign_forward`): TRL's fused LM head
    on a `*ForCausalLM`, accelerate's autocast wrapper of a class's own forward, ... kernelize keeps such a forward
    (npu-hub-kernels never replaces a forward it did not install), so the module is not fused. Modules are named as
    `swapped_modules` names them.
    """
    kept = []
    for qualified, candidate in _candidates(model):
        swapped_by = retagged_card(type(candidate))
        forward = foreign_forward(candidate)
        if swapped_by is None or forward is None or card not in (None, swapped_by) or card_layer_of(candidate):
            continue
        outer, *inner = _foreign_chain(candidate, forward)
        wrapping = f" (wrapping {', '.join(inner)})" if inner else ""
        kept.append(
            KeptForward(
                module=qualified,
                module_class=type(candidate).__name__,
                card=swapped_by,
                forward=outer,
                reason=(
                    f"not fused: another library set its forward to {outer}{wrapping}, which kernelize keeps "
                    f"(npu-hub-kernels never replaces a forward it did not install), so "
                    f"{type(candidate).kernel_layer_name} does not run"
                ),
            )
        )
    return kept


@dataclass(frozen=True)
class LeftOut:
    """A module of a class (or a called function-module of a function) a card's model table leaves out: it runs eager.

    `reason`: the table's sentence saying why no layer of the card reproduces it (its `LEFT_OUT`)."""

    module: str
    module_class: str
    card: str
    reason: str


def left_out_modules(model: nn.Module, card: str | None = None) -> list[LeftOut]:
    """The modules of `model` whose class a card's model table leaves out, each with the table's reason.

    Only `card`'s are listed, when given. Function-modules its code calls are listed as `swapped_modules` lists them,
    when the function they call is left out. Each card decides the classes of its own region, so a module is listed
    once per card that leaves its class out.
    """
    left_out = _left_out_paths()
    found = []
    for qualified, candidate in _candidates(model):
        function = compat.function_module_function(candidate)
        path = _class_path(type(candidate)) if function is None else _function_path(function)
        for repo_name, reason in left_out.get(path, ()):
            if card in (None, repo_name):
                found.append(LeftOut(qualified, type(candidate).__name__, repo_name, reason))
    return found


def _function_path(function: object) -> str:
    """A function's path as the model tables write it (relative to transformers.models)."""
    return f"{function.__module__.removeprefix('transformers.models.')}.{function.__qualname__}"


def _left_out_paths() -> dict[str, list[tuple[str, str]]]:
    """Class or function path -> (card, why) for each card whose table leaves it out."""
    left_out: dict[str, list[tuple[str, str]]] = {}
    for kernel_id, tables in BY_KERNEL_ID.items():
        for path, reason in tables.LEFT_OUT.items():
            left_out.setdefault(path, []).append((CARDS[kernel_id].repo_name, reason))
    return left_out


def _foreign_chain(module: nn.Module, forward: object) -> list[str]:
    """The qualified names of `forward` and of what it wraps, down to (not including) the class's own forward."""
    own = getattr(type(module), "forward", None)
    chain = []
    for function in _wrapped_functions(forward):
        if function is own:
            break
        chain.append(qualified_name(function))
    return chain


def _candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) for every module of `model` and every function-module its code calls (`swapped_modules`)."""
    candidates = []
    lookups: dict[tuple[type, object], list[tuple[str, dict]]] = {}
    for name, module in model.named_modules():
        candidates.append((name or ROOT_MODULE, module))
        candidates += [(f"{name}.{fname}", fn) for fname, fn in _called_function_modules(module, lookups)]
    return candidates


def retagged_card(cls: type) -> str | None:
    """The card whose layer name npu-hub-kernels tagged `cls` with, or None.

    The layer name is `cls`'s own `kernel_layer_name`, e.g. "npu-rms-norm:RMSNorm". None for a class it did not retag
    (its subclasses included).
    """
    tag = cls.__dict__.get("kernel_layer_name")
    card, _, layer = tag.partition(":") if isinstance(tag, str) else ("", "", "")
    return card if any(c.repo_name == card and layer in c.layers for c in CARDS.values()) else None


def foreign_forward(module: nn.Module) -> object | None:
    """The forward another library set on `module` itself (TRL's fused LM head, accelerate's autocast wrapper, ...).

    None where none is set, or the one set is one kernelize binds: a kernels layer's forward (from any repository)
    or the class's own.
    """
    forward = compat.instance_forward(module)
    if isinstance(forward, MethodType) and (
        forward.__func__ is getattr(type(module), "forward", None) or compat.is_layer_forward(forward.__func__)
    ):
        return None
    return forward


def qualified_name(function: object) -> str:
    """`module.qualname` of a function (bound or not) by its code; a callable object's class otherwise.

    The name is its code's, which `functools.wraps` does not rename (TRL's head takes the name of the class's
    forward): "trl.trainer.utils.add_fused_lm_head.<locals>._fused_forward".
    """
    function = getattr(function, "__func__", function)
    code = getattr(function, "__code__", None)
    if code is None:
        return f"{type(function).__module__}.{type(function).__qualname__}"
    return f"{function.__globals__.get('__name__', '?')}.{code.co_qualname}"


def _wrapped_functions(forward: object) -> list[object]:
    """`forward` (a bound method as its function), then what it wraps, and so on.

    This is the chain of `__wrapped__` that `functools.wraps` and accelerate's autocast wrapper set.
    """
    chain: list[object] = []
    while forward is not None and all(forward is not seen for seen in chain):
        forward = getattr(forward, "__func__", forward)
        chain.append(forward)
        forward = getattr(forward, "__wrapped__", None)
    return chain


def _called_function_modules(module: nn.Module, cache: dict) -> list[tuple[str, nn.Module]]:
    """(global name, function-module) for each function-module of `module._kernel_funcs` the module's code calls.

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
    """(name, globals) of every global name looked up by the methods of `cls`.

    The methods of nn.Module are left aside; `forward`, when given, stands in place of the class's forward.
    """
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
    """(the card's generated `_build` module, the layer name) when kernelize gave `module` a card layer's forward.

    That forward counts also when it runs inside a wrapper another library put around it since. None otherwise.
    """
    for function in _wrapped_functions(compat.instance_forward(module)):
        build = _card_build_of(function) if inspect.isfunction(function) else None
        layer = None if build is None else _layer_name_of(function)
        if layer is not None:
            return build, layer
    return None


def card_package(module: nn.Module) -> ModuleType | None:
    """The card package (e.g. the loaded `npu_swiglu`) whose layer kernelize gave `module`, or None.

    `module` may also be a function-module, such as a swapped `apply_rotary_pos_emb`. The package is for calling the
    card's functions directly; None when `module` runs no card layer.
    """
    build, _ = card_layer_of(module) or (None, None)
    return None if build is None else sys.modules[build.__name__.rpartition(".")[0]]


def _layer_name_of(function) -> str | None:
    """The name of the card layer whose forward `function` is (looked up in the card's layers module); None if none."""
    layers = vars(sys.modules[function.__module__])
    return next(
        (name for name, obj in layers.items() if isinstance(obj, type) and obj.__dict__.get("forward") is function),
        None,
    )


def _card_build_of(function) -> ModuleType | None:
    """The generated `_build` module of the card a layer's forward comes from; None for other functions.

    Read from sys.modules: the package attribute is not set again when kernels re-imports a build
    under an id it has seen before.
    """
    build = sys.modules.get(function.__module__.rpartition(".")[0] + "._build")
    return build if getattr(build, "CARD", None) else None
