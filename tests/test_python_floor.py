"""The Python floor pyproject.toml states is true: every module of the package, the cards and the scripts
parses and imports on it (no syntax, and no standard-library module, newer than the floor)."""

from __future__ import annotations

import ast
import re
import tomllib

import pytest
from conftest import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SOURCES = sorted(
    path
    for folder in ("mapping", "kernel-cards", "scripts")
    for path in (ROOT / folder).rglob("*.py")
    if "__pycache__" not in path.parts
)
STDLIB_ADDED = {"graphlib": (3, 9), "zoneinfo": (3, 9), "tomllib": (3, 11), "wsgiref.types": (3, 11)}
"""Standard-library modules newer than Python 3.8, with the release that added them."""


def stated_floor() -> tuple[int, int]:
    """(major, minor) of pyproject's `requires-python = ">=X.Y"`."""
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)", PYPROJECT["project"]["requires-python"].strip())
    assert match, "requires-python must state a floor, '>=X.Y'"
    return int(match[1]), int(match[2])


def imported_modules(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_lint_targets_the_stated_floor():
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py{}{}".format(*stated_floor())


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_module_parses_and_imports_on_the_stated_floor(path):
    floor = stated_floor()
    tree = ast.parse(path.read_text(), filename=str(path), feature_version=floor)
    too_new = {name: added for name in imported_modules(tree) if (added := STDLIB_ADDED.get(name, floor)) > floor}
    assert not too_new, f"{path.name} imports {too_new} (added in those Python releases), above the floor {floor}"
