"""Why a card's layer ran eager, said without being asked (the build copies this file into every card).

Each layer decides fused-or-eager in one function, its op's `<op>_unavailable_reason` (None: fused; else the
sentence), and its forward follows that decision through `ran_eager`, which says it: once per (module class,
reason) at DEBUG on the logger `npu_hub_kernels.<card>` (so `logging.getLogger("npu_hub_kernels").setLevel("DEBUG")`
shows every card's), and as the module's last reason, which `npu_hub_kernels.swapped_modules` and the doctor read
(`eager_record`). A fused call clears the module's last reason; the record holds no reference to the module.
"""

from __future__ import annotations

import logging
import weakref

from torch import nn

from ._build import CARD

logger = logging.getLogger(f"npu_hub_kernels.{CARD}")


class EagerRecord:
    """What a module's layer ran eager for.

    It holds its last call's reason (None when that call fused), and how many calls each reason sent to eager."""

    __slots__ = ("counts", "last")

    def __init__(self) -> None:
        self.last: str | None = None
        self.counts: dict[str, int] = {}


_RECORDS: weakref.WeakKeyDictionary[nn.Module, EagerRecord] = weakref.WeakKeyDictionary()
_LAST_EAGER: set[int] = set()
"""The ids of the modules whose last call ran eager: all a fused call looks at (an id, not a weak reference, to keep
the fused call's cost at a set lookup; an id a dead module left behind only costs a lookup in `_RECORDS`)."""
_SAID: set[tuple[type | None, str]] = set()


def class_name(module: nn.Module) -> str:
    """The module's class as a reason names it: qualified by its module, except torch's own nn.Linear.

    peft's LoRA layer is a class named Linear too: "gate_proj is Linear, not a plain nn.Linear" would name neither."""
    cls = type(module)
    return "nn.Linear" if cls is nn.Linear else f"{cls.__module__}.{cls.__qualname__}"


def ran_eager(module: nn.Module | None, reason: str | None) -> bool:
    """Return whether this call runs eager, recording it for `module` and logging it once.

    It does when `reason` is not None; it is recorded for `module` (the module whose layer runs, None for a direct call
    of the op) and said once per (module class, reason) at DEBUG."""
    if reason is None:
        if id(module) in _LAST_EAGER:
            _LAST_EAGER.discard(id(module))
            record = _RECORDS.get(module)
            if record is not None:
                record.last = None
        return False
    said = (None if module is None else type(module), reason)
    if said not in _SAID:
        _SAID.add(said)
        who = "a direct call" if module is None else type(module).__name__
        logger.debug("%s: %s runs eager: %s (said once per class and reason)", CARD, who, reason)
    if module is not None:
        record = _RECORDS.get(module)
        if record is None:
            record = _RECORDS[module] = EagerRecord()
        record.last = reason
        record.counts[reason] = record.counts.get(reason, 0) + 1
        _LAST_EAGER.add(id(module))
    return True


def eager_record(module: nn.Module) -> EagerRecord | None:
    """What `module`'s layer of this card ran eager for, or None when it never did."""
    return _RECORDS.get(module)
