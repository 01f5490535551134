"""Register the cards with the `kernels` mapping for the "npu" device, and swap them into models.

How a transformers class gets a card's layer: `kernels.kernelize` replaces the forward of every
module whose class has `kernel_layer_name` set and mapped for the device. transformers tags its
norm classes "RMSNorm", and re-registers its own "RMSNorm" -> npu -> liger entry at every
`use_kernels=True` load and every train()/eval() switch, so a mapping under that name does not
last. Instead, `register_npu_kernels` retags each class listed in `models.py` (and only those: the
classes whose math the card reproduces) with the card's own mapping name, e.g.
"npu-rms-norm:RMSNorm", through `kernels.replace_kernel_forward_from_hub`. kernels' kernelize stays
in charge; transformers' re-registration cannot touch these names. Classes of modules that are not
imported yet are retagged by an import hook when they are.

Rotary functions are module-level functions, not classes. transformers turns most of them into
function-modules (`@use_kernel_forward_from_hub`) and attaches them to the attention modules
(`@use_kernelized_func`), which is how kernelize reaches them. For those it leaves as plain
functions or never attaches, the registry does the same with kernels' own decorators: it replaces
the module global with a function-module and lists it in the `_kernel_funcs` of every class of that
modeling file that calls it (a class attribute, so models built earlier are reached too).
`unregister_npu_kernels` undoes both.

Another library may have replaced a rotary function already (LLaMA-Factory's NPU kernels and Liger's
`apply_liger_kernel_to_*(rope=True)` set the module global to their own function; others patch the
forward of transformers' function-module). The card reproduces only transformers' function, so the
registry leaves such a function alone and logs what replaced it: the other library's function keeps
running. The registry's function-modules are shared like the functions they stand for: a deep copy
of a model (a TRL reference model) keeps calling them, so kernelizing the copy fuses it.

Trade-off, documented in the README: a retagged class looks up only the npu-hub-kernels entry, so
on other devices (cuda, rocm, ...) it keeps its original forward. Call `unregister_npu_kernels()`
to restore the classes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import logging
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, MethodType, ModuleType

from kernels import (
    Mode,
    kernelize,
    register_kernel_mapping,
    replace_kernel_forward_from_hub,
    use_kernel_forward_from_hub,
)
from torch import nn

from .cards import CARDS, Card, resolve_org
from .integrity import CheckedLayerRepository, CheckedLocalLayerRepository
from .models import MODEL_CLASSES, ClassRule

logger = logging.getLogger(__name__)

KernelSelection = str | bool | Iterable[str] | None

_MISSING = object()
_original_tags: dict[type, tuple[object, object]] = {}
_original_globals: dict[tuple[ModuleType, str], tuple[object, nn.Module]] = {}
"""(module, name) -> (the plain function the registry replaced, the function-module it put there)."""
_function_modules: dict[tuple[ModuleType, str], nn.Module] = {}
"""(module, name) -> the function-module the registry made kernelizable for that global (its own or transformers')."""
_original_function_module_attrs: dict[nn.Module, tuple[object, object]] = {}
"""Function-module -> (its own `__name__`, its class's own `__deepcopy__`) before the registry set them."""
_left_alone: dict[tuple[ModuleType, str], object] = {}
"""(module, name) -> another library's replacement the registry left alone (logged once per replacement)."""
_original_kernel_funcs: dict[type, object] = {}
"""Class -> its own `_kernel_funcs` attribute before the registry attached functions to it."""
_pending: dict[str, list[tuple[ClassRule, str]]] = {}
"""Module name -> (rule, mapping name) for the rules whose module is not imported yet."""


def available_kernels() -> list[str]:
    """The kernel ids npu-hub-kernels provides, e.g. ["npu_fused_rmsnorm"]."""
    return list(CARDS)


def select_kernels(kernels: KernelSelection) -> list[Card]:
    """Parse a kernel selection: "auto"/True (all), None/False (none), ids as a list or "a,b"."""
    if kernels is None or kernels is False:
        return []
    if kernels is True or kernels == "auto":
        return list(CARDS.values())
    if isinstance(kernels, str):
        ids = [k.strip() for k in kernels.split(",")]
    elif isinstance(kernels, Iterable) and not isinstance(kernels, bytes | bytearray):
        ids = list(kernels)
        if not all(isinstance(k, str) for k in ids):
            raise TypeError(_selection_error(kernels))
    else:
        raise TypeError(_selection_error(kernels))
    ids = [k for k in ids if k]
    unknown = [k for k in ids if k not in CARDS]
    if unknown:
        raise ValueError(
            f"Unknown kernel id(s) {', '.join(map(repr, unknown))}. Available: {', '.join(CARDS)}; "
            'or pass "auto" for all of them, None to turn kernels off.'
        )
    return [CARDS[k] for k in dict.fromkeys(ids)]


def _selection_error(kernels: object) -> str:
    return (
        f'kernels={kernels!r} is not a kernel selection. Pass "auto" or True for all cards, None or False for '
        f"none, or kernel ids as a list of strings or one comma-separated string, from: {', '.join(CARDS)}."
    )


def register_npu_kernels(
    org: str | None = None,
    *,
    version: int = 1,
    local_dir: str | Path | None = None,
    kernels: KernelSelection = "auto",
    trust_remote_code: bool | list[str] | None = None,
) -> list[str]:
    """Map the selected cards' layers for the "npu" device (inference and training), retag the classes.

    Args:
        org: Hub organisation of the cards; default $NPU_HUB_KERNELS_ORG, else "npu-hub-kernels".
        version: card API version, the Hub branch `v<version>`.
        local_dir: load from this folder of built cards (`make build`'s build/) instead of the Hub.
        kernels: "auto" for all cards, a list or comma-separated string of kernel ids, None for none.
        trust_remote_code: passed to the `kernels` loader. None trusts exactly the selected card
            repositories (you asked for them by calling this function), nothing else.

    Returns:
        The kernel ids registered.
    """
    cards = select_kernels(kernels)
    org = resolve_org(org)
    if trust_remote_code is None:
        trust_remote_code = [card.repo_id(org) for card in cards]
    mapping = {}
    for card in cards:
        for layer in card.layers:
            repo = _repository(card, layer, org=org, version=version, local_dir=local_dir, trust=trust_remote_code)
            mapping[card.mapping_name(layer)] = {"npu": {Mode.INFERENCE: repo, Mode.TRAINING: repo}}
    register_kernel_mapping(mapping)
    for card in cards:
        for rule in MODEL_CLASSES[card.kernel_id]:
            _tag_when_imported(rule, card.mapping_name(rule.layer))
    return [card.kernel_id for card in cards]


def unregister_npu_kernels() -> None:
    """Undo the retagging, wrapping and attaching, and release the card forward kernelize bound on the rotary
    function-modules a family's models share (the mapping entries stay, unused)."""
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
        if _card_layer_of(function_module) is not None:
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


def apply_npu_kernels(
    model: nn.Module,
    kernels: KernelSelection = "auto",
    mode: Mode | None = None,
    **register_kwargs,
) -> nn.Module:
    """Register the selected cards and kernelize `model` for "npu" (LLaMA-Factory's `apply_default_kernels`).

    `mode` defaults to TRAINING or INFERENCE after `model.training`. Other keyword arguments go to
    `register_npu_kernels`. With kernels=None or False the model is returned untouched.
    """
    if not register_npu_kernels(kernels=kernels, **register_kwargs):
        return model
    first = next(model.parameters(), None)
    if first is not None and first.device.type != "npu":
        logger.warning(
            "apply_npu_kernels: the model is on %s; the fused NPU ops run only on npu tensors "
            "(the layers take the eager path elsewhere). Move the model with .to('npu') first.",
            first.device.type,
        )
    if mode is None:
        mode = Mode.TRAINING if model.training else Mode.INFERENCE
    return kernelize(model, mode=mode, device="npu")


def pack_gate_up(model: nn.Module) -> int:
    """Pack gate_proj/up_proj of every MLP running npu-swiglu's SwiGLUMLP now; returns how many are packed.

    Not needed on the usual paths: each such MLP packs its two weights into one buffer on its first
    fused call, and again after a move or cast. Call it (after `.to("npu")` and kernelize) before
    handing the model to something that takes hold of its parameters and so stops the layer from
    packing them later, such as `DistributedDataParallel`. Projections the layer must not rewrite
    (LoRA-wrapped, DTensor, ZeRO-3, ...) are left as they are and not counted.
    """
    packed = 0
    for module in model.modules():
        build, layer = _card_layer_of(module) or (None, None)
        if build is not None and (build.CARD, layer) == ("npu-swiglu", "SwiGLUMLP"):
            card = sys.modules[build.__name__.rpartition(".")[0]]
            packed += card.pack_gate_up(module.gate_proj, module.up_proj)
    return packed


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
            build, layer = _card_layer_of(candidate) or (None, None)
            if build is not None and card in (None, build.CARD):
                swaps.append(
                    Swap(
                        module=qualified or "<root>",
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
    entries = [entry for entry in getattr(module, "_kernel_funcs", {}).values() if isinstance(entry, nn.Module)]
    if not entries:
        return []
    own_forward = module.__dict__.get("forward")
    key = (type(module), getattr(own_forward, "__func__", own_forward))
    if key not in cache:
        cache[key] = _global_lookups(type(module), key[1])
    lookups = cache[key] or [
        (function.__name__, vars(sys.modules[function.__module__]))
        for function in map(_wrapped_function, entries)
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
        for name in _global_names(method.__code__):
            lookups[(name, id(method.__globals__))] = (name, method.__globals__)
    return list(lookups.values())


def _global_names(code: CodeType) -> set[str]:
    """The global (and attribute) names a code object and the code nested in it look up."""
    nested = (_global_names(const) for const in code.co_consts if isinstance(const, CodeType))
    return set(code.co_names).union(*nested)


def _card_layer_of(module: nn.Module) -> tuple[ModuleType, str] | None:
    """(the card's generated `_build` module, the layer name) when kernelize gave `module` a card
    layer's forward; None otherwise."""
    forward = module.__dict__.get("forward")
    build = _card_build_of(forward.__func__) if isinstance(forward, MethodType) else None
    return None if build is None else (build, _layer_name_of(forward.__func__))


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


def _repository(card: Card, layer: str, *, org: str, version: int, local_dir, trust):
    """kernels' repository of one layer of `card`; it refuses to import a build variant whose files fail the
    digest in its metadata.json (npu_hub_kernels.integrity)."""
    if local_dir is None:
        return CheckedLayerRepository(card.repo_id(org), layer_name=layer, version=version, trust_remote_code=trust)
    card_dir = Path(local_dir) / card.repo_name
    if not (card_dir / "build").is_dir():
        raise FileNotFoundError(
            f"{card_dir} holds no built card (no build/ folder). Build the cards first (`make build`), "
            f"and pass the folder that contains {card.repo_name}/."
        )
    return CheckedLocalLayerRepository(repo_path=card_dir.resolve(), layer_name=layer)


def _tag_when_imported(rule: ClassRule, mapping_name: str) -> None:
    module = sys.modules.get(rule.module)
    if module is not None:
        _swap_in(module, rule, mapping_name)
        return
    entries = _pending.setdefault(rule.module, [])
    if (rule, mapping_name) not in entries:
        entries.append((rule, mapping_name))
    if not any(isinstance(finder, _RetagOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RetagOnImport())


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
    function = _wrapped_function(obj)
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


def _wrapped_function(function_module: object):
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
        and any(inspect.isfunction(f) and name in _global_names(inspect.unwrap(f).__code__) for f in vars(cls).values())
    ]


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
