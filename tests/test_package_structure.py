"""The npu_hub_kernels package's modules log under their own names, import one another without a circle (so do the
bench's, scripts/bench, and the LLaMA-Factory shim with the package) and name no card outside each card's own modules;
no script is over 700 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGE = ROOT / "mapping" / "npu_hub_kernels"
SHIM = ROOT / "mapping" / "_npu_hub_kernels_llamafactory.py"
BENCH = ROOT / "scripts" / "bench"
MAX_LINES = 700
"""The longest a script may be (CONTRIBUTING's "Code")."""


def package_modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (subpackages included)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def misnamed_loggers(source: str) -> list[str]:
    """The `getLogger(...)` calls of `source` that do not name the module itself (`getLogger(__name__)`)."""
    calls = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "getLogger"
    ]
    return [
        ast.unparse(call)
        for call in calls
        if not (len(call.args) == 1 and isinstance(call.args[0], ast.Name) and call.args[0].id == "__name__")
    ]


def imports_of(name: str, source: str, modules: dict[str, Path], *, is_package: bool = False) -> set[str]:
    """The modules of `modules` that module `name` (of text `source`) imports, anywhere in it: at the top, inside a
    function (a deferred import still makes a circle) or under `if TYPE_CHECKING:` (the type checker and the reader
    follow it: two modules that need each other's names are one module split in two)."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from . import x` imports the submodule x when there is one, else a name of the package.
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
            found |= submodules or ({base} & modules.keys())
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names} & modules.keys()
    return found - {name}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle of imports in `graph` (module -> the modules it imports), each once, from its smallest name."""
    circles = set()

    def walk(path: list[str]) -> None:
        for target in sorted(graph.get(path[-1], ())):
            if target == path[0]:
                circles.add(tuple(path))
            elif target not in path and target > path[0]:
                walk([*path, target])

    for start in sorted(graph):
        walk([start])
    return [list(circle) for circle in sorted(circles)]


def test_every_module_logs_under_its_own_name():
    offenders = {
        str(path.relative_to(ROOT)): calls
        for path in package_modules().values()
        if (calls := misnamed_loggers(path.read_text()))
    }
    assert offenders == {}


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ('logger = logging.getLogger("npu_hub_kernels.registry")', ["logging.getLogger('npu_hub_kernels.registry')"]),
        ("from logging import getLogger\nlog = getLogger()", ["getLogger()"]),
        ("logger = logging.getLogger(__name__)", []),
    ],
)
def test_the_logger_check_catches_another_name(source, found):
    assert misnamed_loggers(source) == found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of `modules` it imports (`imports_of`)."""
    return {
        name: imports_of(name, path.read_text(), modules, is_package=path.name == "__init__.py")
        for name, path in modules.items()
    }


def test_the_mapping_modules_import_one_another_without_a_circle():
    """Every module of mapping/: the package (its `__init__` too) and the LLaMA-Factory startup shim beside it, which
    registers the package's plugin objects; the package's plugin module imports nothing of the shim."""
    modules = {"_npu_hub_kernels_llamafactory": SHIM, **package_modules()}
    graph = import_graph(modules)
    assert "npu_hub_kernels.report" in graph["npu_hub_kernels.retag"]  # the check sees the imports
    assert "npu_hub_kernels.llamafactory" in graph["_npu_hub_kernels_llamafactory"]  # and the shim's deferred one
    assert import_circles(graph) == []


def test_the_bench_modules_import_one_another_without_a_circle():
    """The bench's renderers share their markdown helpers (`bench.markdown`) instead of importing one another, and the
    targets' types are declarations of `bench.cards`, which the targets read."""
    graph = import_graph(package_modules(BENCH))
    assert "bench.markdown" in graph["bench.step_report"]  # the check sees the imports
    assert "bench.accounting" in graph["bench.memory"]
    assert import_circles(graph) == []


def test_the_circle_check_finds_a_circle_through_a_deferred_import():
    modules = {"pkg.report": Path(), "pkg.retag": Path()}
    retag = imports_of("pkg.retag", "def restore():\n    from .report import card_layer_of\n", modules)
    report = imports_of("pkg.report", "from . import retag\n", modules)
    assert import_circles({"pkg.retag": retag, "pkg.report": report}) == [["pkg.report", "pkg.retag"]]
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_circle_check_finds_a_circle_through_a_type_checking_import():
    modules = {"pkg.accounting": Path(), "pkg.memory": Path()}
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .memory import Memory\n"
    accounting = imports_of("pkg.accounting", typed, modules)
    memory = imports_of("pkg.memory", "from .accounting import count_device_ops\n", modules)
    assert import_circles({"pkg.accounting": accounting, "pkg.memory": memory}) == [["pkg.accounting", "pkg.memory"]]


def long_files(files: list[Path], limit: int = MAX_LINES) -> dict[str, int]:
    """The files of `files` over `limit` lines, with their line counts."""
    counts = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in files}
    return {name: lines for name, lines in counts.items() if lines > limit}


def test_no_script_is_over_700_lines():
    """The bench's modules and the other scripts (CONTRIBUTING's "Code": a file over 700 lines is split)."""
    scripts = sorted((ROOT / "scripts").rglob("*.py"))
    assert BENCH / "step.py" in scripts
    assert long_files(scripts) == {}


def test_the_line_limit_finds_a_long_file(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    assert long_files(sorted(tmp_path.glob("*.py"))) == {"long.py": MAX_LINES + 1}


def test_the_runtime_and_emulation_name_no_card_outside_each_cards_own_modules():
    """CONTRIBUTING's "no list in the product or the emulation is keyed by card": outside a card's own modules (those
    named after its package: its model table, its selftest cases, its emulated ops and their rules), no module of the
    runtime package or of the emulation spells a card's repo name or region in a string (docstrings aside). The tiny
    models' helpers (`testing/tiny_models.py`) are test code and may. The bench's modules have their own test."""
    from test_bench import card_literals

    from npu_hub_kernels import CARDS

    own = {card.python_name for card in CARDS.values()} | {f"_{card.python_name}_rules" for card in CARDS.values()}
    generic = [p for p in package_modules().values() if p.stem not in own and p.name != "tiny_models.py"]
    assert {"registry.py", "doctor.py", "report.py", "device.py"} <= {p.name for p in generic}
    found = {str(p.relative_to(PACKAGE)): card_literals(p.read_text()) for p in generic}
    assert {name: literals for name, literals in found.items() if literals} == {}
    tiny_models = PACKAGE / "testing" / "tiny_models.py"
    assert card_literals(tiny_models.read_text())  # negative control: a module that names a card is found
