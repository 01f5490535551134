"""The parity tests' verdicts per listed class, and which listed classes they check on the installed transformers.

The model-table parity tests (marker `model_tables`) prove each listed class on the installed transformers. In normal
runs they check the classes the registry swaps: those whose installed code is proven
(`npu_hub_kernels.models.fingerprints`); tests/test_model_tables.py checks that the others stay eager, with why.
Under `scripts/model_tables.py prove` (environment variable `NPU_HUB_KERNELS_PROOF` set to a file), every listed
class is swapped whatever its fingerprint, and each test appends one verdict line per class it checked
("<path> pass" or "<path> fail") to that file; the script records the classes that passed every check.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from npu_hub_kernels.cards import CARDS
from npu_hub_kernels.models import ClassRule, fingerprints

PROOF_FILE = os.environ.get("NPU_HUB_KERNELS_PROOF")
"""Where the verdicts go while proving; None in normal runs."""


def proving() -> bool:
    """Whether this run proves fingerprints (every listed class swapped, verdicts recorded)."""
    return PROOF_FILE is not None


def proven_rules(rules: list[ClassRule]) -> list[ClassRule]:
    """The rules whose class the installed transformers defines with code proven for it (every installed one while
    proving): the classes the registry swaps, which the parity tests check."""
    return [rule for rule in rules if (obj := rule.installed()) is not None and (proving() or _proven(rule, obj))]


def _proven(rule: ClassRule, obj: object) -> bool:
    card = CARDS[rule.kernel_id]
    return fingerprints.unproven_reason(card, rule.path, fingerprints.code_of(obj)) is None


def comparable_with(reference: ClassRule) -> bool:
    """Whether a listed class may be checked against the installed code of a reference class (its group's, Llama's):
    while proving, or where that code is proven. Otherwise the reference changed on this release and the class, whose
    own code is proven (identical to code proven on another release), has nothing to be compared with."""
    return proving() or reference in proven_rules([reference])


def reference_holds(rule: ClassRule | None, check: Callable[[], None]) -> bool:
    """Whether the reference class a card reproduces (Llama's decoder layer, a loss layer's group) still computes what
    the card does on this release: `check()` (a numeric comparison) passes. A reference whose code is not proven here
    is not swapped, so there is nothing to run: while proving that fails the classes proven through it; otherwise they
    are proven by their code alone (identical to code proven on another release)."""
    if rule is None or rule not in proven_rules([rule]):
        return not proving()
    try:
        check()
    except Exception:
        return False
    return True


def verdict(path: str, ok: bool) -> None:
    """Record whether the class at `path` passed a parity check (only while proving)."""
    if PROOF_FILE is not None:
        with open(PROOF_FILE, "a") as verdicts:
            verdicts.write(f"{path} {'pass' if ok else 'fail'}\n")


@contextmanager
def checking(path: str) -> Iterator[None]:
    """Record the verdict of the block: pass when it ends normally, fail when it raises (and re-raise)."""
    try:
        yield
    except BaseException:
        verdict(path, False)
        raise
    verdict(path, True)
