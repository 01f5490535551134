"""What the installed transformers defines, read from its modeling files' source (nothing is imported).

This is the ground each model table's `candidates()` surveys.

Paths are relative to `transformers.models`, as in the tables: `<model>.<modeling file>.<name>`.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Definition:
    """A class or module-level name a modeling file defines: its syntax tree and its file's source."""

    path: str
    node: ast.AST
    source: str

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]

    def method(self, name: str) -> ast.FunctionDef | None:
        """The class's own method `name` (None when it inherits it)."""
        body = getattr(self.node, "body", [])
        return next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == name), None)

    def method_source(self, name: str) -> str:
        """The source of the class's own method `name` ("" when it inherits it)."""
        method = self.method(name)
        if method is None:
            return ""
        return ast.get_source_segment(self.source, method) or ""


def _modeling_files() -> list[Path]:
    import transformers.models

    return sorted(Path(transformers.models.__file__).parent.glob("*/modeling_*.py"))


@functools.cache
def _parsed() -> tuple[tuple[str, ast.Module, str], ...]:
    """(module path relative to transformers.models, syntax tree, source) of every modeling file."""
    found = []
    for file in _modeling_files():
        source = file.read_text()
        found.append((f"{file.parent.name}.{file.stem}", ast.parse(source), source))
    return tuple(found)


def _module_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of a module's body, those under its top-level `if` and `try` blocks included.

    A class defined only when an optional dependency is missing is defined at module level all the same.
    """
    found = []
    for node in body:
        found.append(node)
        if isinstance(node, ast.If | ast.Try):
            nested = [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
            nested += [n for handler in getattr(node, "handlers", []) for n in handler.body]
            found.extend(_module_level(nested))
    return found


@functools.cache
def classes() -> tuple[Definition, ...]:
    """Every class a modeling file defines at module level."""
    return tuple(
        Definition(f"{module}.{node.name}", node, source)
        for module, tree, source in _parsed()
        for node in _module_level(tree.body)
        if isinstance(node, ast.ClassDef)
    )


def module_names(names: tuple[str, ...]) -> list[str]:
    """The paths of the module-level `names` each modeling file binds: defined, assigned or imported."""
    found = []
    for module, tree, _ in _parsed():
        bound = set()
        for node in _module_level(tree.body):
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                bound.add(node.name)
            elif isinstance(node, ast.Assign):
                bound.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.ImportFrom | ast.Import):
                bound.update(alias.asname or alias.name for alias in node.names)
        found.extend(f"{module}.{name}" for name in names if name in bound)
    return found
