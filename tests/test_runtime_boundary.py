"""The runtime package never imports its test-only helpers (`npu_hub_kernels.testing`): an Ascend install
neither loads the emulation nor needs it."""

from __future__ import annotations

import subprocess
import sys

from test_package_structure import imports_of, package_modules

TESTING = "npu_hub_kernels.testing"
MODULES = package_modules()


def _is_testing(module: str) -> bool:
    return module == TESTING or module.startswith(f"{TESTING}.")


def _runtime_modules() -> list[str]:
    """Every module of the installed package outside `testing/` (and not `__main__`, which runs the doctor)."""
    return [name for name in MODULES if not _is_testing(name) and not name.endswith(".__main__")]


def _imports_testing(name: str, source: str, *, is_package: bool = False) -> list[str]:
    """The modules of `npu_hub_kernels.testing` that module `name` (of text `source`) imports."""
    return sorted(module for module in imports_of(name, source, MODULES, is_package=is_package) if _is_testing(module))


def test_no_runtime_module_imports_the_testing_package():
    offenders = {}
    for name in _runtime_modules():
        path = MODULES[name]
        if found := _imports_testing(name, path.read_text(), is_package=path.name == "__init__.py"):
            offenders[name] = found
    assert offenders == {}


def test_the_scan_sees_relative_and_absolute_imports_of_testing():
    source = "from .testing import emulation\nimport npu_hub_kernels.testing.tiny_models\nfrom . import cards\n"
    assert _imports_testing("npu_hub_kernels.registry", source) == [
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
