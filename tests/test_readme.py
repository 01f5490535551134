"""The numbers README.md and docs/ state by hand are the code's: each one is computed here and compared.

Counts of layers and swapped classes come from the cards (`CARDS`) and their model tables
(`npu_hub_kernels.models`); fused ops from the card packages' source; versions from requirements-dev.txt and the
Makefile. The bench's figures need no test: only `make bench` writes them.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from npu_hub_kernels import CARDS
from npu_hub_kernels.models import BY_KERNEL_ID, MODEL_CLASSES

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MODELS_DOC = ROOT / "docs" / "models.md"
_LINK = re.compile(r"\[([^\]]+)\]\([^)]*\)")


def markdown_tables(text: str) -> list[list[dict[str, str]]]:
    """Every table of a markdown text, as rows of header -> cell (links reduced to their text, backticks dropped)."""
    tables, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if block:
            header, *rows = (_cells(row) for row in block if not set(row) <= set("|-: "))
            tables.append([dict(zip(header, row, strict=True)) for row in rows])
        block = []
    return tables


def _cells(row: str) -> list[str]:
    return [_LINK.sub(r"\1", cell).replace("`", "").strip() for cell in row.strip().strip("|").split("|")]


def _sections(text: str) -> dict[str, str]:
    """Level-2 heading -> the text under it."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_the_readme_card_table_states_each_cards_layers_swapped_classes_and_fused_ops():
    (table,) = [t for t in markdown_tables(README.read_text()) if t and "transformers classes swapped" in t[0]]
    rows = {row["card"]: row for row in table}
    assert set(rows) == {card.repo_name for card in CARDS.values()}, "one row per card"
    for card in CARDS.values():
        row = rows[card.repo_name]
        assert row["kernel id"] == card.kernel_id
        assert int(row["layers"]) == len(card.layers), card.repo_name
        assert int(row["transformers classes swapped"]) == len(MODEL_CLASSES[card.kernel_id]), card.repo_name
        stated = {op.strip() for op in row["fused torch_npu ops"].split(",")}
        assert stated == set(card.fused_ops), card.repo_name  # tests/test_card_pieces.py checks them


def test_docs_models_has_a_table_per_card_with_each_layers_count_and_the_left_out_count():
    sections = _sections(MODELS_DOC.read_text())
    for card in CARDS.values():
        assert card.repo_name in sections, f"docs/models.md has no '## {card.repo_name}' section"
        (table,) = [t for t in markdown_tables(sections[card.repo_name]) if t and "swapped" in t[0]]
        stated = {row["layer"]: int(row["swapped"]) for row in table}
        swapped = Counter(rule.layer for rule in MODEL_CLASSES[card.kernel_id])
        table = BY_KERNEL_ID[card.kernel_id]
        fused = {"fused_attention": len(table.FUSED)} if hasattr(table, "FUSED") else {}  # an attention card's classes
        expected = {**swapped, **fused, "left out": len(table.LEFT_OUT)}
        assert set(card.layers) == set(swapped), f"{card.repo_name}: a layer swaps nothing"
        assert stated == expected, card.repo_name


def _pins() -> dict[str, str]:
    lines = (ROOT / "requirements-dev.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))


def _admitted_transformers() -> set[str]:
    """The transformers releases the docs may name besides the pin: the lowest the package admits (pyproject.toml)
    and those `make test-transformers` proves the model tables on (the Makefile's TRANSFORMERS_RELEASES)."""
    lowest = re.search(r'"transformers>=([\d.]+),', (ROOT / "pyproject.toml").read_text()).group(1)
    tested = re.search(r"^TRANSFORMERS_RELEASES := (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE).group(1)
    return {lowest, *tested.split()}


@pytest.mark.parametrize("doc", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda path: path.name)
def test_versions_named_in_the_docs_are_the_pinned_ones(doc):
    """A pinned package named with a version ("torch 2.13.0", "peft 0.21") names the pin or a prefix of it (or, for
    transformers, a release the package admits and tests)."""
    text = doc.read_text()
    wrong = [
        f"{name} {stated} (pinned {pinned})"
        for name, pinned in _pins().items()
        for stated in re.findall(rf"(?<![\w-]){re.escape(name)} (\d+(?:\.\d+)+)", text)
        if not f"{pinned}.".startswith(f"{stated}.")
        and not (name == "transformers" and stated in _admitted_transformers())
    ]
    assert wrong == []


def _makefile_python() -> str:
    """The Python version `make setup` builds the venv with (the Makefile's default PYTHON)."""
    return re.search(r"^PYTHON \?= python(\d+\.\d+)$", (ROOT / "Makefile").read_text(), re.MULTILINE).group(1)


def test_the_readme_names_the_python_the_makefile_uses():
    python = _makefile_python()
    assert f"Python {python}" in README.read_text() and f"python{python}" in README.read_text()


def test_every_number_of_the_readme_outside_the_bench_section_is_one_of_these_tests():
    """Other hand-kept numbers go stale: the README's prose states none but the pinned versions (or their release
    lines), the transformers releases the package admits and tests, and Python's (the counts are in the card table,
    checked above). State a new number in a table a test checks, or leave it out."""
    text = README.read_text()
    prose = text[: text.index("<!-- bench:begin -->")]
    prose = re.sub(r"```.*?```", "", prose, flags=re.DOTALL)  # code samples
    prose = "\n".join(line for line in prose.splitlines() if not line.startswith("|"))  # tables, checked above
    prose = re.sub(r"`[^`]*`|\([^)]*\.md[^)]*\)|https?://\S+", "", prose)  # identifiers, links
    numbers = set(re.findall(r"(?<![\w.-])\d+(?:\.\d+)*", prose))
    pins = {prefix for pin in _pins().values() for prefix in _prefixes(pin)}
    assert numbers - pins - _admitted_transformers() - {_makefile_python()} == set()


def _prefixes(version: str) -> set[str]:
    """ "5.22.2" -> {"5.22", "5.22.2"}: a pin named by its release line, or in full."""
    parts = version.split(".")
    return {".".join(parts[:n]) for n in range(2, len(parts) + 1)}


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_of_the_docs_reaches_a_file_and_heading():
    broken = []
    for doc in [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            linked = (doc.parent / path).resolve() if path else doc
            if not linked.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.MULTILINE)
                if anchor not in {_anchor(heading) for heading in headings}:
                    broken.append(f"{doc.name}: {target} (no such heading)")
    assert broken == []
