"""Every card's model table against the installed transformers: the survey (each table's `candidates()` are exactly
the classes it decides), and which listed classes the registry swaps (their installed code is proven,
`npu_hub_kernels.models.fingerprints`) or leaves eager, saying why."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
import transformers
from conftest import ROOT
from kernels import LayerRepository, Mode, kernelize, use_kernel_mapping

from npu_hub_kernels import _kernels_compat as compat
from npu_hub_kernels import register_npu_kernels, swapped_modules, unregister_npu_kernels
from npu_hub_kernels.cards import CARDS, Card
from npu_hub_kernels.doctor import diagnose, format_report
from npu_hub_kernels.models import MODEL_CLASSES, PROVEN_CLASSES, SURVEYED_RELEASE, fingerprints, table_of
from npu_hub_kernels.report import retagged_card
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm, token_ids

ON_THE_SURVEYED_RELEASE = pytest.mark.skipif(
    transformers.__version__ != SURVEYED_RELEASE,
    reason=f"the tables are surveyed against transformers {SURVEYED_RELEASE}; on another release a class they do "
    "not list is never swapped, and the listed ones are held to their proven code",
)
BY_NAME = pytest.mark.parametrize("card", list(CARDS.values()), ids=lambda card: card.repo_name)


def _listed(card: Card) -> set[str]:
    """The paths a table decides for its card: the classes its layers swap, or an attention card's FUSED classes."""
    table = table_of(card)
    return {path for paths in table.SWAPPED.values() for path in paths} | set(getattr(table, "FUSED", ()))


@ON_THE_SURVEYED_RELEASE
@BY_NAME
def test_every_candidate_is_decided_and_every_decided_path_is_a_candidate(card):
    """Nothing undecided, nothing listed that transformers lacks or that does not look like the region, nothing both
    swapped and left out, every reason said."""
    table = table_of(card)
    listed, left_out = _listed(card), set(table.LEFT_OUT)
    candidates = table.candidates()
    assert listed & left_out == set(), "both swapped and left out"
    assert [path for path, reason in table.LEFT_OUT.items() if not reason.strip()] == [], "left out without a reason"
    assert sorted(candidates - listed - left_out) == [], "candidates the table does not decide"
    assert sorted((listed | left_out) - candidates) == [], "decided paths that are not candidates (or not defined)"


@ON_THE_SURVEYED_RELEASE
@BY_NAME
def test_every_listed_class_is_proven_on_the_surveyed_release(card):
    """A table edit that is not proven (scripts/model_tables.py prove) fails here, before any release runs it eager."""
    unproven = {}
    for rule in PROVEN_CLASSES[card.kernel_id]:
        reason = fingerprints.unproven_reason(card, rule.path, fingerprints.code_of(rule.installed()))
        if reason is not None:
            unproven[rule.path] = reason
    assert unproven == {}


@BY_NAME
def test_the_proven_fingerprints_are_of_listed_classes_only(card):
    stale = set(fingerprints.proven_of(card)) - _listed(card)
    assert stale == set(), "fingerprints of classes the table no longer lists: rerun scripts/model_tables.py prove"


def test_a_fingerprint_reads_the_own_init_behind_kernels_decorator(monkeypatch):
    """Starcoder2Attention's `__init__` is kernels' `use_kernelized_func` wrapper; its fingerprint holds the class's
    own `__init__` behind it, so a release changing only that code is not proven by an older one. Negative control:
    the same class seen with another own `__init__` fingerprints differently."""
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.starcoder2.modeling_starcoder2 import Starcoder2Attention

    own = compat.decorated_init(Starcoder2Attention)
    assert own is not None and Starcoder2Attention.__init__ is not own
    assert fingerprints._resolved_init(Starcoder2Attention) is own
    real = fingerprints.fingerprint(Starcoder2Attention)
    monkeypatch.setattr(compat, "decorated_init", lambda cls: LlamaAttention.__init__)
    assert fingerprints.fingerprint(Starcoder2Attention) != real


@pytest.mark.model_tables
def test_every_installed_class_whose_code_is_not_proven_stays_eager_with_why(npu_kernels):
    """On this release: each listed class (or rotary function) with unproven code is not retagged, and the registry
    says why (on the surveyed release there is none; the next test is the negative control)."""
    failures, unproven = [], 0
    for kernel_id, rules in MODEL_CLASSES.items():
        card = CARDS[kernel_id]
        for rule in rules:
            obj = rule.installed()
            code = fingerprints.code_of(obj) if obj is not None else None
            reason = None if obj is None else fingerprints.unproven_reason(card, rule.path, code)
            if reason is None:
                continue
            unproven += 1
            if retagged_card(obj if isinstance(obj, type) else type(obj)) is not None:
                failures.append(f"{rule.path}: retagged although its code is not proven")
            if fingerprints.left_eager().get(rule.path) != reason:
                failures.append(f"{rule.path}: the registry does not say why it stays eager")
    if not unproven:
        pytest.skip("every listed class's code is proven on this release: none stays eager to check")
    assert failures == []


NORM = "llama.modeling_llama.LlamaRMSNorm"


def test_a_class_whose_code_was_never_proven_runs_eager_and_says_why(built_cards, offline_hub, monkeypatch):
    """Negative control: LlamaRMSNorm with its proven fingerprint replaced stays eager in a kernelized Llama, the
    registry names the releases proven, and the other cards still swap; with the real file it is swapped."""
    norm_card = next(card for card in CARDS.values() if NORM in _listed(card))
    real_proven_of = fingerprints.proven_of
    altered = {**real_proven_of(norm_card), NORM: {"0" * 16: ["5.22.2"]}}
    monkeypatch.setattr(fingerprints, "proven_of", lambda card: altered if card is norm_card else real_proven_of(card))
    importlib.import_module("transformers.models.llama.modeling_llama")
    register_npu_kernels(local_dir=built_cards)
    # transformers tags LlamaRMSNorm "RMSNorm" and maps that name to another hub kernel for npu at use_kernels=True
    # loads: a class left eager is skipped all the same (that kernel, unreachable offline, would raise here).
    liger_like = {
        "RMSNorm": {"npu": LayerRepository(repo_id="kernels-community/liger-kernels", layer_name="x", version=3)}
    }
    try:
        with use_kernel_mapping(liger_like, inherit_mapping=True):
            model = kernelize(tiny_causal_lm("llama").to("npu"), mode=Mode.INFERENCE, device="npu")
        with torch.no_grad():
            model(token_ids().to("npu"))
        swaps = swapped_modules(model)
        reason = fingerprints.left_eager().get(NORM, "")
        report = diagnose(offline_hub, model=model)
    finally:
        unregister_npu_kernels()
    assert "differs from the code proven on 5.22.2" in reason and transformers.__version__ in reason
    norms = [swap for swap in swaps if swap.module_class == "LlamaRMSNorm"]
    assert norms and all(swap.variant is None and swap.eager_reason == reason for swap in norms)
    assert "LlamaMLP" in {swap.module_class for swap in swaps if swap.variant is not None}
    assert "npu-rms-norm" not in report.model.fused and len(report.model.not_proven) == len(norms)
    assert f"not proven  model.norm (LlamaRMSNorm, npu-rms-norm:RMSNorm): {reason}" in format_report(report)

    monkeypatch.undo()
    register_npu_kernels(local_dir=built_cards)
    try:
        model = kernelize(tiny_causal_lm("llama").to("npu"), mode=Mode.INFERENCE, device="npu")
        assert "LlamaRMSNorm" in {swap.module_class for swap in swapped_modules(model)}
        assert NORM not in fingerprints.left_eager()
    finally:
        unregister_npu_kernels()


def test_the_docs_table_of_proven_classes_is_the_proven_files():
    """docs/models.md's table is rendered from the proven files (scripts/model_tables.py docs)."""
    import model_tables as script

    assert f"{script.BEGIN}\n{script.proven_table()}\n{script.END}" in script.DOCS.read_text()


def test_the_model_table_runs_find_their_test_files_by_the_marker(tmp_path):
    """`make test-transformers` and `prove` run the files that mark a test `model_tables`, found with no list kept by
    hand: a file that uses the marker is found, one that only names it is not."""
    import model_tables as script

    assert "tests/test_model_table_parity.py" in script.model_table_tests()
    (tmp_path / "test_marked.py").write_text("import pytest\n\n\n@pytest.mark.model_tables\ndef test_a():\n    pass\n")
    (tmp_path / "test_named.py").write_text('"""Not a parity test: pytest.mark.model_tables is named here only."""\n')
    (tmp_path / "test_module_mark.py").write_text("from pytest import mark\n\npytestmark = mark.model_tables\n")
    found = script.model_table_tests(tmp_path)
    assert [Path(path).name for path in found] == ["test_marked.py", "test_module_mark.py"]


def test_the_tables_are_surveyed_on_the_release_the_dev_stack_pins():
    """Otherwise the survey tests above would skip in `make test` without a word: bump both, and survey again."""
    lines = (ROOT / "requirements-dev.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))
    assert pins["transformers"] == SURVEYED_RELEASE
