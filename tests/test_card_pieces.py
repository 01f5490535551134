"""Every card has every piece, each found by the card's name (CONTRIBUTING.md, "Adding a card").

A half-added card fails here with one message per missing piece, naming the file to add or the fact to fix.
Each check is shown to fail on a card that lacks its piece (the last tests).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from bench import cards as bench_specs
from conftest import ROOT

from npu_hub_kernels import CARDS
from npu_hub_kernels.cards import Card
from npu_hub_kernels.testing import emulation

CARD_DIRS = ROOT / "kernel-cards"
MODELS_DIR = ROOT / "mapping" / "npu_hub_kernels" / "models"
OPS_DOC = ROOT / "docs" / "torch-npu-ops.md"
CALLED_OP = re.compile(r"\btorch_npu\.(npu_\w+)")


def _top_level_names(path: Path) -> dict[str, ast.expr | None]:
    """The names a module binds at top level, with the value assigned (None for defs and imports)."""
    names: dict[str, ast.expr | None] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update({t.id: node.value for t in targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names[node.name] = None
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update({(a.asname or a.name).split(".")[0]: None for a in node.names})
    return names


def _documented_ops() -> set[str]:
    """The ops named by a `## ` heading of docs/torch-npu-ops.md (`## a / b` documents a and b)."""
    headings = [line[3:] for line in OPS_DOC.read_text().splitlines() if line.startswith("## ")]
    return {name.strip() for heading in headings for name in heading.split("/")}


def package_problems(card: Card, card_dir: Path) -> list[str]:
    """What the card's folder lacks: README, package, its `<op>` / `<op>_eager` / `<op>_unavailable_reason`
    triples, and a `fused_ops` list that agrees with the torch_npu ops its source calls."""
    problems = []
    if not (card_dir / "README.md").is_file():
        problems.append(f"no card text: add kernel-cards/{card.repo_name}/README.md")
    package = card_dir / card.python_name
    init = package / "__init__.py"
    if not init.is_file():
        return [*problems, f"no package: add kernel-cards/{card.repo_name}/{card.python_name}/__init__.py"]
    exported = _top_level_names(init).get("__all__")
    names = set(ast.literal_eval(exported)) if exported is not None else set()
    if card.layers and "layers" not in names:
        problems.append(f"{card.python_name}/__init__.py does not export `layers` (the kernels layer module)")
    ops = {name.removesuffix("_unavailable_reason") for name in names if name.endswith("_unavailable_reason")}
    if not ops:
        problems.append(f"{card.python_name}/__init__.py exports no `<op>_unavailable_reason` (with <op>, <op>_eager)")
    for op in sorted(ops):
        missing = [name for name in (op, f"{op}_eager") if name not in names]
        problems += [f"{card.python_name} exports {op}_unavailable_reason but not {name}" for name in missing]
    called = {op for source in package.rglob("*.py") for op in CALLED_OP.findall(source.read_text())}
    if called != set(card.fused_ops):
        problems.append(
            f"card.toml fused_ops {sorted(card.fused_ops)} differs from the torch_npu ops "
            f"{card.python_name}/ calls, {sorted(called)}: make fused_ops list what the source calls"
        )
    return problems


def model_table_problems(card: Card, models_dir: Path = MODELS_DIR) -> list[str]:
    """What the card's model table lacks: the module, SWAPPED with every layer of card.toml, LEFT_OUT, candidates()
    (the survey tests/test_model_tables.py holds the table to)."""
    path = models_dir / f"{card.python_name}.py"
    if not path.is_file():
        return [
            f"no model table: add mapping/npu_hub_kernels/models/{card.python_name}.py (SWAPPED, LEFT_OUT, candidates)"
        ]
    names = _top_level_names(path)
    pieces = ("SWAPPED", "LEFT_OUT", "candidates")
    problems = [f"models/{card.python_name}.py defines no {n}" for n in pieces if n not in names]
    if not problems:
        from npu_hub_kernels.models import BY_KERNEL_ID

        swapped = BY_KERNEL_ID[card.kernel_id].SWAPPED if card.kernel_id in BY_KERNEL_ID else {}
        if set(swapped) != set(card.layers):
            problems.append(
                f"models/{card.python_name}.py SWAPPED has layers {sorted(swapped)}, card.toml {sorted(card.layers)}"
            )
    return problems


def op_problems(card: Card, emulated: set[str], documented: set[str]) -> list[str]:
    """Each fused op of the card emulated and documented."""
    problems = []
    for op in card.fused_ops:
        if op not in emulated:
            problems.append(
                f"{op} is not emulated: add it to mapping/npu_hub_kernels/testing/emulation/ops/"
                f"{card.python_name}.py (its __all__), or to the ops module of another card that calls it"
            )
        if op not in documented:
            problems.append(f"{op} has no contract: add a `## {op}` section, with sources, to docs/torch-npu-ops.md")
    return problems


def kernel_test_problems(card: Card, tests_dir: Path = ROOT / "tests") -> list[str]:
    """The card's kernel tests, tests/test_<card package>.py."""
    if not (tests_dir / f"test_{card.python_name}.py").is_file():
        return [f"no kernel tests: add tests/test_{card.python_name}.py"]
    return []


def missing_pieces(card: Card) -> list[str]:
    """Every piece the card lacks, one message each (empty when it is complete)."""
    return [
        *package_problems(card, CARD_DIRS / card.repo_name),
        *model_table_problems(card),
        *op_problems(card, set(emulation.EMULATED_OPS), _documented_ops()),
        *kernel_test_problems(card),
        *bench_specs.missing_pieces(card),
    ]


@pytest.mark.parametrize("card", CARDS.values(), ids=lambda card: card.repo_name)
def test_every_card_has_every_piece(card):
    assert missing_pieces(card) == []


def test_every_emulated_op_belongs_to_a_card_that_calls_it():
    """An emulated op is one a card calls, or the exposed backward of one (torch_npu exposes some, e.g.
    npu_moe_gating_top_k_backward, and op-plugin's tests call them)."""
    for card in CARDS.values():
        called = set(card.fused_ops) | {f"{op}_backward" for op in card.fused_ops}
        brought = set(emulation.emulated_ops_of(card))
        assert brought <= called, f"ops/{card.python_name}.py emulates ops its card does not call"


def test_every_card_folder_is_a_card():
    folders = {path.parent.name for path in CARD_DIRS.glob("*/card.toml")}
    assert folders == {card.repo_name for card in CARDS.values()}


HALF_ADDED = {
    "name": "npu-half-added",
    "kernel_id": "npu_fused_half_added",
    "version": 1,
    "license": "Apache-2.0",
    "description": "a card with only its card.toml",
    "layers": ["HalfAdded"],
    "region": "Half added",
    "fused_ops": ["npu_half_added"],
    "tags": [],
}


def test_a_card_with_only_its_card_toml_is_told_each_piece_to_add():
    problems = "\n".join(missing_pieces(Card.from_config(HALF_ADDED)))
    for expected in (
        "add kernel-cards/npu-half-added/README.md",
        "add kernel-cards/npu-half-added/npu_half_added/__init__.py",
        "add mapping/npu_hub_kernels/models/npu_half_added.py",
        "npu_half_added is not emulated: add it to mapping/npu_hub_kernels/testing/emulation/ops/npu_half_added.py",
        "add a `## npu_half_added` section",
        "add tests/test_npu_half_added.py",
        "scripts/bench/cards/npu_half_added.py",
    ):
        assert expected in problems


def test_a_package_missing_its_eager_twin_or_calling_an_unlisted_op_is_named(tmp_path):
    card = Card.from_config({**HALF_ADDED, "fused_ops": ["npu_rms_norm"]})
    package = tmp_path / card.python_name
    package.mkdir()
    (tmp_path / "README.md").write_text("card text")
    (package / "__init__.py").write_text(
        "from .ops import half_added, half_added_unavailable_reason\n"
        '__all__ = ["half_added", "half_added_unavailable_reason", "layers"]\n'
    )
    (package / "ops.py").write_text("def half_added(x):\n    return torch_npu.npu_swiglu(x)\n")
    problems = package_problems(card, tmp_path)
    assert problems == [
        "npu_half_added exports half_added_unavailable_reason but not half_added_eager",
        "card.toml fused_ops ['npu_rms_norm'] differs from the torch_npu ops npu_half_added/ calls, ['npu_swiglu']: "
        "make fused_ops list what the source calls",
    ]


def test_a_model_table_without_every_layer_is_named(tmp_path):
    card = Card.from_config({**HALF_ADDED, "name": "npu-rms-norm", "kernel_id": "npu_fused_rmsnorm"})
    layers = sorted(CARDS["npu_fused_rmsnorm"].layers)
    expected = f"models/npu_rms_norm.py SWAPPED has layers {layers}, card.toml ['HalfAdded']"
    assert model_table_problems(card) == [expected]
    (tmp_path / "npu_rms_norm.py").write_text("SWAPPED = {}\n")
    assert model_table_problems(card, tmp_path) == [
        "models/npu_rms_norm.py defines no LEFT_OUT",
        "models/npu_rms_norm.py defines no candidates",
    ]
