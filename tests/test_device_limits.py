"""Every card stays inside the ledger: at and just past each documented limit, it calls the op as the device accepts
it or runs eager with its reason, never a call the device refuses.

Cards run standalone from the Hub and cannot import the emulation's ledger, so this test is what keeps their
`<op>_unavailable_reason` in step with it. Each card's cases are `LIMITS` in `npu_hub_kernels/selftest/cases/<card
package>.py`: a name and a function of the loaded card returning `(run, reason)`: `run()` calls the card's fused
function on inputs at or just past a limit, `reason()` its `<op>_unavailable_reason` on the same inputs. The
emulated ops raise `DeviceRefusal` (naming the rule) for a call outside the ledger, so a card that sends one fails
here.
"""

from __future__ import annotations

import pytest
from kernels import get_local_kernel
from test_ledger import CARDS_WITH_OPS, _case_module

from npu_hub_kernels.cards import CARDS
from npu_hub_kernels.testing import emulation

LIMIT_CASES = [
    (card, name, make)
    for card in CARDS_WITH_OPS
    if _case_module(card) is not None
    for name, make in _case_module(card).LIMITS.items()
]


@pytest.fixture(scope="module")
def loaded_cards(built_cards):
    return {card.repo_name: get_local_kernel(built_cards / card.repo_name) for card in CARDS.values()}


@pytest.mark.parametrize(("card", "name", "make"), LIMIT_CASES, ids=[f"{c.repo_name}: {n}" for c, n, _ in LIMIT_CASES])
def test_card_calls_within_the_ledger_or_runs_eager_with_its_reason(loaded_cards, card, name, make):
    run, reason = make(loaded_cards[card.repo_name])
    with emulation.count_op_calls() as calls:
        run()  # a DeviceRefusal here names the ledger rule the card broke
    fused = sum(calls[op] for op in card.fused_ops) > 0
    why = reason()
    assert fused == (why is None), f"{name}: fused ops {dict(calls)}, reason {why!r}"
