"""Run NPU code paths on a CPU-only machine: an emulated `torch_npu` and "npu" device.

`install()` makes this process look like an Ascend host to torch, transformers and the `kernels`
loader: torch's PrivateUse1 backend is named "npu" (tensors can live on it), `import torch_npu`
returns an emulation whose fused ops compute what the real ones compute (fp32 inside, real return
tuples and dtypes), and `torch_npu.utils.collect_env.get_cann_version()` reports a CANN version,
so `kernels` resolves the `torch<XY>-cxx11-cann<XY>-<arch>-linux` build variants.

    from npu_hub_kernels.testing import emulation
    emulation.install(cann_version="9.1.0")
    with emulation.count_op_calls() as calls:
        model(inputs)
    assert calls["npu_rms_norm"] == expected

The emulated ops follow the contracts in docs/torch-npu-ops.md (one section per op, with sources).
What lives where: `device.py` (the "npu" device: tensors, factories, module conversions),
`streams.py` (streams, events, allocator statistics: what DDP, FSDP2 and DeepSpeed ask),
`distributed.py` (the "hccl" process-group backend over gloo on host memory), `ledger.py` (the documented limits
of every op, which each op enforces: its rules live beside it, as `LEDGER`), `checks.py` (the call counter),
`backward.py` (autograd that keeps for backward what the op keeps), and one file
per card, named after its package: `ops/<card>.py` emulates the torch_npu ops that card calls (its `__all__`;
an op two cards call, such as npu_swiglu, lives with one of them) and lists their rules (its `LEDGER`).

Never use it on a real Ascend host: `install()` refuses when a real torch_npu is installed.
The install is for the life of the process (torch allows one PrivateUse1 rename).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

from ...cards import CARDS, Card, card_piece
from ...selftest import cases
from .checks import OP_CALLS
from .device import HOST_SYNCS, NpuTensor, install_device, register_aten_kernel
from .distributed import install_hccl
from .ledger import DeviceRefusal, Rule

TESTED_TORCH = "2.13"
"""The torch minor release the emulation is written and tested against: it relies on private torch hooks."""
DEFAULT_CANN_VERSION = "9.1.0"
"""CANN that Ascend's CI pairs with torch 2.13 (Ascend/pytorch .ci/docker/common/install_cann.sh)."""


def emulated_ops_of(card: Card) -> dict[str, Callable[..., Any]]:
    """The torch_npu ops that `ops/<card package>.py` emulates (its `__all__`), by name; {} without that file."""
    module = card_piece(f"{__name__}.ops", card)
    if module is None:
        return {}
    return {name: getattr(module, name) for name in module.__all__}


def ledger_of(card: Card) -> tuple[Rule, ...]:
    """The constraint-ledger rules of the ops `ops/<card package>.py` emulates (its `LEDGER`); () without that file."""
    module = card_piece(f"{__name__}.ops", card)
    return () if module is None else tuple(module.LEDGER)


def device_kernels_of(card: Card) -> dict[str, Callable[..., Any]]:
    """The aten ops `ops/<card package>.py` gives the device a kernel of its own for (its `DEVICE_KERNELS`).

    Keyed by overload ("addmm.dtype_out"); {} without them."""
    module = card_piece(f"{__name__}.ops", card)
    return {} if module is None else dict(getattr(module, "DEVICE_KERNELS", {}))


EMULATED_OPS: dict[str, Callable[..., Any]] = {
    name: op for card in CARDS.values() for name, op in emulated_ops_of(card).items()
}
"""Every emulated torch_npu op, by name, gathered from the cards' `ops/<card>.py` files."""
DEVICE_KERNELS: dict[str, Callable[..., Any]] = {
    name: kernel for card in CARDS.values() for name, kernel in device_kernels_of(card).items()
}
"""Every aten op the emulated device runs with a kernel of its own (as torch_npu registers one), by overload."""
LEDGER: tuple[Rule, ...] = tuple(rule for card in CARDS.values() for rule in ledger_of(card))
"""Every documented limit the emulated ops enforce (`ledger.py`), gathered from the cards' `ops/<card>.py` files."""
_state = {"cann_version": DEFAULT_CANN_VERSION}

__all__ = [
    "DEFAULT_CANN_VERSION",
    "DEVICE_KERNELS",
    "LEDGER",
    "DeviceRefusal",
    "NpuTensor",
    "count_host_syncs",
    "count_op_calls",
    "install",
    "is_installed",
    "real_npu",
    "set_cann_version",
]


def is_installed() -> bool:
    module = sys.modules.get("torch_npu")
    return module is not None and getattr(module, "__emulated__", False)


def real_npu() -> bool:
    """An Ascend host: a real torch_npu (not this emulation) with a device. Decide with it whether to `install()`.

    Imports torch_npu only when a real one is installed (never on a host where the emulation runs).
    """
    if is_installed() or importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401

    return torch.npu.is_available()


def install(cann_version: str = DEFAULT_CANN_VERSION) -> ModuleType:
    """Make this process an emulated Ascend host with the given CANN version; returns `torch_npu`."""
    if is_installed():
        set_cann_version(cann_version)
        return sys.modules["torch_npu"]
    if "torch_npu" in sys.modules or importlib.util.find_spec("torch_npu") is not None:
        raise RuntimeError(
            "A real torch_npu is installed: run on the real device, not the emulation. "
            "(The emulation is for machines without an NPU, where torch_npu must not be installed.)"
        )
    torch_release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if torch_release != TESTED_TORCH:
        raise RuntimeError(
            f"The npu emulation is tested with torch {TESTED_TORCH} only (it uses private torch hooks) and torch "
            f"{torch.__version__} is installed: install torch=={TESTED_TORCH}.0 (the project's requirements-dev.txt) "
            "to run the tests, the demo or the bench."
        )
    set_cann_version(cann_version)
    install_device()
    for overload, kernel in DEVICE_KERNELS.items():
        register_aten_kernel(overload, kernel)
    install_hccl()
    torch.version.cann = cann_version  # type: ignore[attr-defined]
    module = _build_torch_npu_module()
    sys.modules.update({m.__name__: m for m in (module, module.utils, module.utils.collect_env)})
    for name, op in _backward_ops().items():  # torch_npu keeps them under torch.ops.npu only
        setattr(torch.ops.npu, name, op)
    cases.set_cann_switch(set_cann_version)  # the shared cases may run on another CANN here
    return module


def _backward_ops() -> dict[str, Callable[..., Any]]:
    """The backward ops the ledger names that an `ops/<card>.py` defines as a function (outside its `__all__`).

    The others run only inside their forward op's autograd node.
    """
    names = {rule.op for rule in LEDGER} - set(EMULATED_OPS)
    modules = [module for card in CARDS.values() if (module := card_piece(f"{__name__}.ops", card)) is not None]
    return {name: getattr(module, name) for module in modules for name in names if hasattr(module, name)}


def set_cann_version(cann_version: str) -> None:
    """Change the CANN version the emulated host reports (e.g. "8.5.0", "8.3.RC1")."""
    parts = cann_version.split(".")
    if len(parts) < 3 or not (parts[0].isdigit() and parts[1].isdigit()):
        raise ValueError(f"CANN versions look like '9.1.0' or '8.3.RC1'; got {cann_version!r}")
    _state["cann_version"] = cann_version
    if hasattr(torch.version, "cann"):
        torch.version.cann = cann_version  # type: ignore[attr-defined]


@contextmanager
def count_op_calls() -> Iterator[Counter[str]]:
    """Yield a Counter that holds the emulated op calls made inside the block."""
    before = Counter(OP_CALLS)
    calls: Counter[str] = Counter()
    try:
        yield calls
    finally:
        calls.update(OP_CALLS - before)


@contextmanager
def count_host_syncs() -> Iterator[Counter[str]]:
    """Yield a Counter of the reads of npu data on the host made inside the block, by kind (`device.HOST_SYNCS`)."""
    before = Counter(HOST_SYNCS)
    syncs: Counter[str] = Counter()
    try:
        yield syncs
    finally:
        syncs.update(HOST_SYNCS - before)


def _new_module(name: str) -> ModuleType:
    module = ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    module.__path__ = []  # type: ignore[attr-defined]
    return module


def _build_torch_npu_module() -> ModuleType:
    torch_npu = _new_module("torch_npu")
    torch_npu.__emulated__ = True  # type: ignore[attr-defined]
    torch_npu.__file__ = __file__  # where it lives (DeepSpeed's NPU op builders look for its folder)
    torch_npu.__version__ = torch.__version__.split("+")[0]  # type: ignore[attr-defined]
    torch_npu.npu = torch.npu  # type: ignore[attr-defined]
    for name, op in EMULATED_OPS.items():
        setattr(torch_npu, name, op)
    torch_npu.utils = _new_module("torch_npu.utils")  # type: ignore[attr-defined]
    collect_env = _new_module("torch_npu.utils.collect_env")
    collect_env.get_cann_version = lambda: _state["cann_version"]  # type: ignore[attr-defined]
    torch_npu.utils.collect_env = collect_env  # type: ignore[attr-defined]
    return torch_npu
