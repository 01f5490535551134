"""The cases of every card, shared by the ledger tests, the hardware tests and `python -m npu_hub_kernels selftest`.

One module per card, named after the card's package (`cases/<card package>.py`), holds:

- `CASES`: a rule id of the constraint ledger (`<op>/<name>`) -> `(accepted, refused)`, two functions with no
  arguments that call the op (or run its autograd backward). `refused` breaks that rule and no rule before it, so the
  emulated op raises `DeviceRefusal` naming it; `accepted` raises nothing (tests/test_ledger.py). On a device they
  are the selftest's refusal probes: one call just inside each documented limit and one just past it;
- `LIMITS`: a name -> a function of the loaded card returning `(run, reason)`: the card at and just past a limit,
  which must call the op as the device accepts it or run eager with its reason (tests/test_device_limits.py);
- `FORMS`: a name -> `Form`, each fused form the card uses, at a model's widths, which the selftest (and the
  hardware tests) hold to the eager math (`npu_hub_kernels.selftest.forms`).

The modules are part of the runtime package, so that an installed package (no tests/ folder) can run them: they
never import the emulation, and import torch_npu only when a case runs (`torch_npu` here), so that they import on
any host. A case that needs another CANN than the host's runs under `on_cann`, which only a host that can switch
(the emulation) grants.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

from ...cards import Card, card_piece

__all__ = [
    "NeedsOtherCann",
    "cases_of",
    "made_at_first_use",
    "npu",
    "npu_int",
    "on_cann",
    "set_cann_switch",
    "torch_npu",
]


def cases_of(card: Card) -> ModuleType | None:
    """The card's cases module (`cases/<card package>.py`), or None when it has none yet."""
    return card_piece(__name__, card)


class _DeviceOps:
    """torch_npu's ops by name, looked up at each call: `torch_npu.<op>`, else `torch.ops.npu.<op>`.

    Backward ops such as npu_swiglu_backward exist only under `torch.ops.npu`. Looking up at the call (not at import)
    lets the cases import on a host without torch_npu, and always call what the host's torch_npu holds now.
    """

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if not name.startswith("npu_"):  # torch_npu's ops all are npu_*; anything else is not an op to look up
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            module = importlib.import_module("torch_npu")
            op = getattr(module, name, None) or getattr(torch.ops.npu, name, None)
            if op is None:
                raise NotRunHere(f"this torch_npu has no op {name} (neither torch_npu.{name} nor torch.ops.npu.{name})")
            return op(*args, **kwargs)

        call.__name__ = name
        return call


torch_npu = _DeviceOps()
"""The host's torch_npu ops, by name, resolved when called."""

_cann_switch: list[Callable[[str], None]] = []


class NotRunHere(RuntimeError):
    """A case this host cannot run (an op its torch_npu lacks, another CANN): not run, which says nothing of limits."""


class NeedsOtherCann(NotRunHere):
    """A case needs the host to report another CANN, which this host cannot do: it is not run here."""


def set_cann_switch(switch: Callable[[str], None] | None) -> None:
    """Let cases that need another CANN run: `switch(version)` makes the host report it (the emulation's only)."""
    _cann_switch[:] = [] if switch is None else [switch]


def host_cann() -> str | None:
    """The CANN version the host reports (`torch.version.cann`, which torch_npu sets), None when unknown."""
    return getattr(torch.version, "cann", None)


@contextmanager
def on_cann(version: str | None) -> Iterator[None]:
    """Run the block with the host reporting CANN `version` (None: as it is); `NeedsOtherCann` where it cannot."""
    before = host_cann()
    if version is None or version == before:
        yield
        return
    if not _cann_switch:
        raise NeedsOtherCann(f"the case needs CANN {version}; this host has {before} and cannot switch")
    _cann_switch[0](version)
    try:
        yield
    finally:
        _cann_switch[0](before)


def made_at_first_use(namespace: dict[str, Any], **makers: Callable[[], Any]) -> Callable[[str], Any]:
    """A module `__getattr__` that makes each name of `makers` at its first use and keeps it in `namespace`.

    A cases module whose `CASES` hold npu tensors made once then imports on a host without the npu device.
    """

    def __getattr__(name: str) -> Any:
        if name not in makers:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        namespace[name] = value = makers[name]()
        return value

    return __getattr__


def npu(*shape: int, dtype: torch.dtype = torch.float32, grad: bool = False) -> torch.Tensor:
    """A random tensor on the npu device (requiring grad when asked)."""
    t = torch.randn(shape, dtype=torch.float32).to(dtype).to("npu")
    return t.requires_grad_() if grad else t


def npu_int(high: int, *shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Random integers in [0, high) on the npu device."""
    return torch.randint(0, high, shape, dtype=dtype).to("npu")
