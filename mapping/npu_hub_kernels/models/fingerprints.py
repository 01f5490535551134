"""Which installed transformers classes the cards swap: only those whose code is code a release was proven on.

A card layer reproduces what a class computed when its table was proven; a transformers release may change the class.
So each listed class (or rotary function) carries a fingerprint: a digest of the normalised source (comments,
docstrings and formatting dropped) of its `forward` and `__init__` (a function: itself), and of what those call that
transformers defines: the functions and classes they name as globals (a class with its `forward` and `__init__`) and
the methods they call on `self`, followed two calls deep from `forward`, one from `__init__`. The proven fingerprints,
with the releases each was proven on, are data, one file per card: `models/proven/<card package>.json`, written by
`scripts/model_tables.py` from the parity tests' verdicts on each release (`make prove-transformers`). The registry
retags a listed class only when its installed fingerprint is proven; any other stays eager, and `unproven_reason`
says why.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.resources
import inspect
import json
import sys
import textwrap
from collections.abc import Callable
from types import CodeType, FunctionType

from .. import _kernels_compat as compat
from ..cards import Card

_DEPTH = 2
"""How many calls deep the fingerprint follows what a forward calls."""

Proven = dict[str, dict[str, list[str]]]
"""Class path -> fingerprint -> the transformers releases it was proven on."""


_left_eager: dict[str, str] = {}
"""Class path -> why the registry left that listed class eager in this process (`left_eager`)."""


def leave_eager(path: str, reason: str) -> bool:
    """Record that the registry leaves the listed class at `path` eager, and why; True when that is news."""
    news = _left_eager.get(path) != reason
    _left_eager[path] = reason
    return news


def left_eager() -> dict[str, str]:
    """Class (or rotary function) path -> why the registered cards leave it eager although their tables list it.

    The reason is that its installed code is not code the parity tests proved, or that this transformers lacks it.
    Emptied by `forget_eager`.
    """
    return dict(_left_eager)


def forget_eager(path: str | None = None) -> None:
    """Forget what `leave_eager` recorded for `path`, or for every path (the registry's restore)."""
    if path is None:
        _left_eager.clear()
    else:
        _left_eager.pop(path, None)


@functools.cache
def proven_of(card: Card) -> Proven:
    """The fingerprints proven for `card`'s listed classes (empty when its file is missing)."""
    resource = importlib.resources.files(__package__).joinpath("proven", f"{card.python_name}.json")
    return json.loads(resource.read_text()) if resource.is_file() else {}


def fingerprint(obj: object) -> str:
    """The digest of `obj`'s code as this module defines it (a class or a function)."""
    parts: dict[str, str] = {}
    _collect(obj, _DEPTH, parts, {})
    digest = hashlib.sha256()
    for key in sorted(parts):
        digest.update(f"{key}\n{parts[key]}\n".encode())
    return digest.hexdigest()[:16]


def code_of(obj: object) -> object:
    """What a listed object's fingerprint is taken of.

    That is a class or function itself, or the function a kernels function-module stands for.
    """
    if isinstance(obj, type | FunctionType):
        return obj
    return compat.function_module_function(obj) or obj


def unproven_reason(card: Card, path: str, obj: object) -> str | None:
    """Why `card` must leave the installed `obj` (listed at `path`) eager, or None when its fingerprint is proven."""
    import transformers

    proven = proven_of(card).get(path)
    if not proven:
        return f"{path} was never proven: it is listed for a release the fingerprint file does not cover"
    if fingerprint(obj) in proven:
        return None
    patch = _patched_forward(obj)
    if patch is not None:
        return (
            f"{path}'s forward is {patch} (another library's or the user's patch), not transformers' code: that code "
            "runs, not the card"
        )
    releases = sorted({release for found in proven.values() for release in found}, key=release_key)
    return (
        f"the code of {path} in transformers {transformers.__version__} differs from the code proven on "
        f"{', '.join(releases)}: it runs eager (prove it: make prove-transformers)"
    )


def _patched_forward(obj: object) -> str | None:
    """The qualified name of the code `obj.forward` runs when that code is not transformers', else None."""
    forward = getattr(obj, "forward", None) if isinstance(obj, type) else None
    code = _past_library_decorators(forward) if callable(forward) else None
    if code is None or _defined_in(code, ("transformers.",)):
        return None
    module = getattr(code, "__globals__", {}).get("__name__", "?")
    return f"{module}.{getattr(code, '__qualname__', type(code).__qualname__)}"


def release_key(release: str) -> tuple[int, ...]:
    return tuple(int(part) if part.isdigit() else 0 for part in release.split("."))


def _collect(obj: object, depth: int, parts: dict[str, str], reached: dict[str, int]) -> None:
    """Add `obj`'s own code (and, `depth` calls deep, what it calls) to `parts`, keyed by qualified name.

    A class's `__init__` is followed one call deep only: the classes it builds count by their own code, not by what
    that code calls (a decoder layer does not depend on which rotary function its attention module calls, which
    another library may have replaced)."""
    if isinstance(obj, type):
        functions = [(_resolved(obj, "forward"), depth), (_resolved_init(obj), min(depth, 1))]
        owner: type | None = obj
    else:
        functions, owner = [(obj, depth)], None
    for function, reach in functions:
        function = _past_library_decorators(function) if callable(function) else None
        if not isinstance(function, FunctionType):
            continue
        key = f"{function.__module__}.{function.__qualname__}"
        parts[key] = _normalised(function)
        foreign = _foreign_globals(function) if reach > 0 else ""  # followed as deep as what it calls
        if foreign:
            parts[f"{key} calls"] = foreign
        if reached.get(key, -1) >= reach:
            continue
        reached[key] = reach
        for called in _called(function, owner) if reach > 0 else ():
            _collect(called, reach - 1, parts, reached)


_LIBRARY_DECORATORS = ("transformers.", "torch.")
"""The packages whose decorators a fingerprint looks past (transformers' `can_return_tuple`, torch's `no_grad`)."""


def _past_library_decorators(function: Callable) -> Callable:
    """The function of transformers' code that `function` runs, past the decorators transformers and torch put on it.

    A wrapper is told by the module its code was defined in (its `__globals__`), which `functools.wraps` does not
    copy: another library's or a user's `functools.wraps` patch of transformers' code is fingerprinted as its own
    code. What a transformers function wraps of another library (`PreTrainedModel.to` wraps torch's) is unwrapped
    whole, whoever wrapped that.
    """
    original = inspect.unwrap(function)
    if not _defined_in(original, ("transformers.",)):
        return original
    while function is not original and _defined_in(function, _LIBRARY_DECORATORS):
        function = function.__wrapped__
    return function


def _defined_in(function: Callable, packages: tuple[str, ...]) -> bool:
    """Whether `function`'s code was defined in a module of one of `packages` (its globals', not its `__module__`)."""
    return getattr(function, "__globals__", {}).get("__name__", "").startswith(packages)


def _resolved(cls: type, name: str) -> Callable | None:
    """`cls.<name>` as attribute lookup finds it (a base class's when not its own), None when only torch's."""
    for base in cls.__mro__:
        if name in base.__dict__:
            return base.__dict__[name] if _is_transformers(base) else None
    return None


def _resolved_init(cls: type) -> Callable | None:
    """`cls.__init__` as `_resolved` finds it, past kernels' `use_kernelized_func` wrapper to the class's own code.

    transformers 5.22.2 decorates 125 classes with it, most of them attention modules; a fingerprint of the wrapper
    alone would not change when a release changes only the class's own `__init__` (its `is_causal`, its `scaling`)."""
    init = _resolved(cls, "__init__")
    definer = next((base for base in cls.__mro__ if base.__dict__.get("__init__") is init), None)
    return (compat.decorated_init(definer) if definer is not None else None) or init


def _called(function: FunctionType, owner: type | None) -> list[object]:
    """What `function` names that transformers defines: its globals and, for a method, what it looks up on self.

    Its globals are functions and classes (for a function-module, the function it stands for, so that making it
    kernelizable changes no fingerprint); for a method, the methods of `owner` it looks up on self count too.
    """
    found = []
    for name in sorted(_names(function.__code__)):
        value = function.__globals__.get(name)
        if value is not None and not isinstance(value, type):  # a function-module (kernels' or the registry's)
            value = code_of(value)
        if isinstance(value, type | FunctionType) and _is_transformers(value):
            found.append(value)
        elif owner is not None and isinstance(_resolved(owner, name), FunctionType) and name not in ("forward",):
            found.append(_resolved(owner, name))
    return found


def _foreign_globals(function: FunctionType) -> str:
    """The Python functions of other code than transformers' that `function` calls by a global name, or "".

    A modeling file's global (its `rotate_half`) that another library or the user replaced with their own function
    counts so: the code that calls it is not the code proven."""
    found = []
    for name in sorted(_names(function.__code__)):
        value = function.__globals__.get(name)
        if value is not None and not isinstance(value, type):
            value = code_of(value)
        defined_in = getattr(value, "__globals__", {}).get("__name__", "") if isinstance(value, FunctionType) else ""
        if defined_in and not defined_in.startswith(_LIBRARY_DECORATORS) and not _standard_library(defined_in):
            found.append(f"{name} = {defined_in}.{value.__qualname__}")
    return "\n".join(found)


def _standard_library(module: str) -> bool:
    return module.partition(".")[0] in sys.stdlib_module_names


def _names(code: CodeType) -> set[str]:
    nested = (_names(const) for const in code.co_consts if isinstance(const, CodeType))
    return set(code.co_names).union(*nested)


def _is_transformers(obj: object) -> bool:
    return getattr(obj, "__module__", "").startswith("transformers.")


class _WithoutDocstrings(ast.NodeTransformer):
    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        first = node.body[0] if node.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            node.body = node.body[1:] or [ast.Pass()]
        self.generic_visit(node)
        return node


@functools.cache
def _normalised(function: FunctionType) -> str:
    """`function`'s source without comments, docstrings, decorators or formatting.

    A generated function, such as a dataclass's `__init__`, has none: its argument and global names stand for it.
    """
    try:
        source = inspect.getsource(function.__code__)  # the code object's: getsource(function) follows __wrapped__
    except OSError:
        return f"<generated: {function.__code__.co_varnames} {sorted(_names(function.__code__))}>"
    tree = ast.parse(textwrap.dedent(source))
    definition = tree.body[0]
    if isinstance(definition, ast.FunctionDef | ast.AsyncFunctionDef):
        definition.decorator_list = []
    return ast.unparse(_WithoutDocstrings().visit(tree))
