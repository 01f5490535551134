"""make build: one Hub tree per card, every variant of the matrix, valid for the kernels loader, deterministic."""

from __future__ import annotations

import filecmp
import json
import shutil
import subprocess
import sys
from pathlib import Path

import build_cards
import pytest
from conftest import ROOT, run_python
from kernels import Metadata

from npu_hub_kernels import CARDS
from npu_hub_kernels._kernels_compat import Digest, DigestAlgorithm


def test_same_sources_give_byte_identical_trees(built_cards, tmp_path):
    build_cards.main(["--out", str(tmp_path)])
    comparison = filecmp.dircmp(built_cards, tmp_path)

    def differences(cmp) -> list[str]:
        found = cmp.left_only + cmp.right_only + cmp.diff_files + cmp.funny_files
        for sub in cmp.subdirs.values():
            found += differences(sub)
        return found

    assert differences(comparison) == []
    for left in built_cards.rglob("*"):
        if left.is_file():
            assert left.read_bytes() == (tmp_path / left.relative_to(built_cards)).read_bytes(), left


def test_every_card_has_every_variant_with_valid_metadata(built_cards):
    expected = {v.name for v in build_cards.variant_matrix()}
    assert {"torch-universal", "torch-npu", "torch213-cxx11-cann91-aarch64-linux"} <= expected
    ids = set()
    for card in build_cards.load_cards():
        tree = built_cards / card.name
        assert (tree / "README.md").read_text().startswith("---\nlibrary_name: kernels\n")
        assert {p.name for p in (tree / "build").iterdir()} == expected
        for variant_dir in (tree / "build").iterdir():
            metadata = Metadata.read_from_file(variant_dir / "metadata.json")
            raw = json.loads((variant_dir / "metadata.json").read_text())
            assert str(metadata.name) == card.name and metadata.version == card.version
            assert metadata.id.isidentifier() and metadata.id not in ids
            ids.add(metadata.id)
            backend = "cpu" if variant_dir.name == "torch-universal" else "cann"
            assert raw["backend"] == {"type": backend}
            metadata.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, variant_dir))
            shared = {p.name for p in (variant_dir / card.python_name).glob("_*.py")} - {"__init__.py", "_build.py"}
            assert shared == set(card.shared)  # only the shared modules the package imports


def test_the_mapping_reads_the_card_configs():
    cards = {card.kernel_id: card for card in build_cards.load_cards()}
    assert set(cards) == set(CARDS)
    for kernel_id, card in cards.items():
        assert CARDS[kernel_id].repo_name == card.name
        assert CARDS[kernel_id].layers == card.layers


def test_each_layers_module_defines_exactly_the_layers_of_its_card_toml(built_cards):
    from kernels import get_local_kernel
    from torch import nn

    for card in CARDS.values():
        package = get_local_kernel(built_cards / card.repo_name)
        if not card.layers:  # an attention card (npu-fused-attention) is a function, with no layers module
            assert not hasattr(package, "layers"), card.repo_name
            continue
        layers = package.layers
        defined = [
            name
            for name, obj in vars(layers).items()
            if isinstance(obj, type) and issubclass(obj, nn.Module) and obj.__module__ == layers.__name__
        ]
        assert sorted(defined) == sorted(card.layers), card.repo_name


def test_a_card_toml_that_does_not_list_the_shared_modules_its_package_imports_is_refused(tmp_path, monkeypatch):
    source = build_cards.CARDS_DIR / "npu-swiglu"
    copy = tmp_path / "npu-swiglu"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
    config = copy / "card.toml"
    config.write_text(config.read_text().replace('shared = ["_activations.py", ', "shared = ["))
    listed = "'_double_backward.py', '_fallbacks.py', '_float32_out.py', '_internals.py', '_npu.py'"
    imported = f"'_activations.py', {listed}"
    with pytest.raises(ValueError, match=rf"imports \[{imported}\].*shared = \[{listed}\]"):
        build_cards.load_card(copy)


def test_an_interrupted_build_leaves_the_previous_tree_intact(built_cards, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(built_cards, out)  # the previous build (building it again would only take longer)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    calls = []

    def failing_write(card, variant, variant_dir):
        calls.append(variant.name)
        if len(calls) == 3:
            raise OSError("disk full")
        return real_write(card, variant, variant_dir)

    real_write = build_cards.write_variant
    monkeypatch.setattr(build_cards, "write_variant", failing_write)
    with pytest.raises(OSError, match="disk full"):
        build_cards.main(["--out", str(out)])
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_unknown_card_is_refused_with_the_list(tmp_path):
    with pytest.raises(SystemExit, match=r"unknown card.*npu-rms-norm"):
        build_cards.main(["--out", str(tmp_path), "--cards", "npu-nope"])


def test_kernels_info_lists_the_backends(built_cards):
    out = subprocess.run(
        [str(Path(sys.executable).parent / "kernels"), "info", str(built_cards / "npu-rms-norm")],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    assert "Name: npu-rms-norm" in out and "Version: 1" in out
    assert "Backends: cann, npu, universal" in out


def test_universal_build_imports_and_runs_without_torch_npu(built_cards):
    out = run_python(
        "import importlib.util, torch\n"
        "from pathlib import Path\nfrom kernels import get_local_kernel\n"
        "assert importlib.util.find_spec('torch_npu') is None\n"
        f"card = get_local_kernel(Path({str(built_cards / 'npu-rms-norm')!r}))\n"
        "x, w = torch.randn(3, 8), torch.randn(8)\n"
        "assert torch.equal(card.rms_norm(x, w, 1e-6), card.rms_norm_eager(x, w, 1e-6))\n"
        "print(card.VARIANT, card.rms_norm_unavailable_reason(x, w))\n"
    )
    assert out.startswith("torch-universal torch_npu is not installed")
