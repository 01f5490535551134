"""The runtime package never imports its test-only helpers (`npu_hub_kernels.testing`): an Ascend install
neither loads the emulation nor needs it."""

from __future__ import annotations

import ast
import subprocess
import sys

from conftest import ROOT

PACKAGE = ROOT / "mapping" / "npu_hub_kernels"


def _runtime_modules() -> list[str]:
    """Every module of the installed package outside `testing/`, by dotted name."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        if "testing" in relative.parts or path.name == "__main__.py":
            continue
        parts = relative.parts[:-1] if path.name == "__init__.py" else relative.parts
        names.append(".".join(parts))
    return names


def _imports_testing(path, module: str) -> list[str]:
    """The import statements of a module that reach `npu_hub_kernels.testing`."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            origin = ".".join([*base, node.module or ""]).strip(".")
            targets = [origin] + [f"{origin}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [t for t in targets if t == "npu_hub_kernels.testing" or t.startswith("npu_hub_kernels.testing.")]
    return found


def test_no_runtime_module_imports_the_testing_package():
    offenders = {}
    for module in _runtime_modules():
        path = PACKAGE.parent.joinpath(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if found := _imports_testing(path, module):
            offenders[module] = found
    assert offenders == {}


def test_the_scan_sees_relative_and_absolute_imports_of_testing(tmp_path):
    source = tmp_path / "registry.py"
    source.write_text(
        "from .testing import emulation\nimport npu_hub_kernels.testing.tiny_models\nfrom . import cards\n"
    )
    assert _imports_testing(source, "npu_hub_kernels.registry") == [
        "npu_hub_kernels.testing",
        "npu_hub_kernels.testing.emulation",
        "npu_hub_kernels.testing.tiny_models",
    ]


def test_importing_every_runtime_module_loads_nothing_of_testing():
    code = (
        "import importlib, sys\n"
        f"for name in {_runtime_modules()!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('npu_hub_kernels.testing')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"
