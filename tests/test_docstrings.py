"""Every multi-line docstring of the project's code opens with a one-line contract (CONTRIBUTING.md)."""

from __future__ import annotations

import ast

from conftest import ROOT

CODE = ("mapping", "kernel-cards", "scripts")
"""The folders of the project's code (tests, whose docstrings state what a test checks, are not held to it)."""


def docstrings_without_a_contract(source: str) -> list[str]:
    """The names of the modules, classes and functions of `source` whose multi-line docstring does not open with one
    sentence on one line ending in "." followed by a blank line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node, clean=True)
        if doc and "\n" in doc:
            first, second = doc.splitlines()[:2]
            if not (first.rstrip().endswith(".") and not second.strip()):
                found.append(getattr(node, "name", "<module>"))
    return found


def test_every_multi_line_docstring_opens_with_a_one_line_contract():
    missing = {
        f"{path.relative_to(ROOT)}: {name}"
        for folder in CODE
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in docstrings_without_a_contract(path.read_text())
    }
    assert sorted(missing) == []


def test_the_check_names_a_docstring_that_runs_on():
    source = '"""A module.\n\nMore."""\n\ndef f():\n    """Does a thing that the\n    next line ends.\n    """\n'
    assert docstrings_without_a_contract(source) == ["f"]
    assert docstrings_without_a_contract(source.replace("thing that the\n    next", "thing.\n\n    The next")) == []
