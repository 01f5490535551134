"""The constraint ledger: each rule accepts one call and refuses another by name, and the docs show every rule.

The ledger (`npu_hub_kernels.testing.emulation.ledger`, each op's rules beside it in `ops/<card>.py`) is what makes
the emulation refuse what the device refuses. These tests hold every rule to a call it accepts and one it refuses
(`npu_hub_kernels/selftest/cases/<card>.py`, which the selftest runs on a device too), every emulated op to having
rules, and docs/torch-npu-ops.md to the ledger.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from npu_hub_kernels.cards import CARDS
from npu_hub_kernels.selftest.cases import cases_of
from npu_hub_kernels.testing.emulation import (
    DEVICE_KERNELS,
    EMULATED_OPS,
    LEDGER,
    DeviceRefusal,
    device_kernels_of,
    emulated_ops_of,
    ledger_of,
)

ROOT = Path(__file__).resolve().parent.parent
REPOSITORIES = "Ascend/op-plugin@517f2e7|hicann/ops-nn@e5c3fa9|hicann/ops-transformer@c29bc10"
SOURCE = re.compile(rf"^({REPOSITORIES}):[\w./（）&-]+:\d+")


CARDS_WITH_OPS = [card for card in CARDS.values() if emulated_ops_of(card) or device_kernels_of(card)]


def _case_module(card):
    """`npu_hub_kernels/selftest/cases/<card package>.py`, or None when the card has none yet."""
    return cases_of(card)


def _cases() -> dict[str, tuple]:
    cases: dict[str, tuple] = {}
    for card in CARDS_WITH_OPS:
        module = _case_module(card)
        cases.update(module.CASES if module is not None else {})
    return cases


CASES = _cases()
RULES = {rule.id: rule for rule in LEDGER}


def test_rule_ids_are_unique_and_every_rule_has_a_source_and_cases():
    assert len(RULES) == len(LEDGER), "two rules share an id"
    assert sorted(RULES) == sorted(CASES), "a rule without cases, or cases of no rule (npu_hub_kernels/selftest/cases/)"
    for rule in LEDGER:
        assert SOURCE.match(rule.source), f"{rule.id}: source {rule.source!r} is not repository@commit:path:line"
        assert rule.text and rule.name.replace("-", "").replace("_", "").isalnum(), rule.id


@pytest.mark.parametrize("card", CARDS_WITH_OPS, ids=lambda c: c.repo_name)
def test_every_emulated_op_has_rules(card):
    assert _case_module(card) is not None, f"{card.repo_name}: add npu_hub_kernels/selftest/cases/{card.python_name}.py"
    ops_with_rules = {rule.op for rule in ledger_of(card)}
    missing = sorted({*emulated_ops_of(card), *device_kernels_of(card)} - ops_with_rules)
    assert not missing, f"{card.repo_name}: emulated ops without a ledger rule: {missing}"


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_accepts_one_call_and_refuses_another_by_name(rule_id):
    accepted, refused = CASES[rule_id]
    accepted()
    with pytest.raises(DeviceRefusal) as refusal:
        refused()
    assert refusal.value.rule.id == rule_id, f"refused by {refusal.value.rule.id}, not {rule_id}: {refusal.value}"
    assert rule_id in str(refusal.value) and RULES[rule_id].source in str(refusal.value)


def test_docs_ledger_section_is_rendered_from_the_ledger():
    sys.path.insert(0, str(ROOT / "scripts"))
    import write_ledger_docs

    assert write_ledger_docs.main(["--check"]) == 0, "docs/torch-npu-ops.md's ledger section is stale: `make ledger`"


def test_every_op_the_ledger_names_is_emulated_or_a_backward_of_one():
    """A rule's op is an emulated op, an aten op the emulated device has a kernel of, or the backward op one of them
    calls in its autograd node."""
    backward_ops = {rule.op for rule in LEDGER} - set(EMULATED_OPS) - set(DEVICE_KERNELS)
    assert all(op.endswith(("_backward", "_grad", "_grad_v2")) for op in backward_ops), sorted(backward_ops)
