"""The peer column: LLaMA-Factory's in-tree NPU kernels, counted and checked against eager.

They are counted on the same layers as eager and kernelized, and checked against eager on the tiny model families.

LLaMA-Factory (`llamafactory.v1.plugins.model_plugins.kernels`, entry point
`interface.apply_default_kernels(model, "auto")`) registers four kernels, and only when the current
accelerator is an NPU at import (so it is imported after the emulation is installed):
- npu_fused_rmsnorm: binds a forward calling `torch_npu.npu_rms_norm` to every module whose class name
  contains "RMSNorm" (`1 + weight` only for the Qwen3.5 / Qwen3-Next classes), casting the weight to
  float32 and back to the input's dtype on every call;
- npu_fused_swiglu: binds `down_proj(npu_swiglu(cat(gate_proj(x), up_proj(x))))` to the MLP classes it lists
  (chunk then cat of `gate_up_proj(x)` for Phi3/Glm4);
- npu_fused_moe: binds a forward of npu_moe_token_permute, `histc` counts, npu_grouped_matmul (in an
  autograd.Function), npu_swiglu and npu_moe_token_unpermute to the Experts of the architectures it maps
  (Qwen3-MoE, Qwen3-VL-MoE, Qwen3.5-MoE), read from `model.config.architectures`;
- npu_fused_rope: replaces the module global `apply_rotary_pos_emb` (and `apply_multimodal_rotary_pos_emb`)
  of every modeling file with an Attention class in the model: npu_rotary_mul on q, then on k. A module
  global, so process-wide.
Every torch_npu op it calls is one the emulation has and the accounting has a rule for, so every region
runs here. Instance patches live and die with the model they were applied to (the bench applies them to
models of its own); module globals are put back right after applying and set only while the peer runs
(`Patches.active`), so the rest of the bench and the cards never see them.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import nn

from npu_hub_kernels import CARDS
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import TINY_CONFIGS, tiny_causal_lm, token_ids

from .regions import Region, resolve
from .rows import Row, log

INTERFACE = "llamafactory.v1.plugins.model_plugins.kernels.interface"
PARITY_TOLERANCE = 1e-4
"""Largest |logits - eager| (float32) for a peer kernel's output to count as matching eager's."""
OUTCOMES = ("matches", "differs", "patched, never called", "not patched", "raises")
"""What the parity check finds for a peer kernel on a model family."""
PARITY_STUDY = "peer parity"
"""The study of the peer's kernels checked against eager on the tiny model families (`ParityRow`)."""


@dataclass
class Patches:
    """What the peer did to one model.

    It records the module globals it replaced (put back already) and the modules it gave a forward of its own."""

    globals: dict[tuple[ModuleType, str], tuple[Any, Any]] = field(default_factory=dict)
    """(module, name) -> (the original value, the peer's)."""
    bound: set[str] = field(default_factory=set)
    """Qualified names of the modules the peer bound a forward to."""

    @contextmanager
    def active(self) -> Iterator[None]:
        """The peer's module globals in place, for the duration of the block."""
        for (module, name), (_, patched) in self.globals.items():
            setattr(module, name, patched)
        try:
            yield
        finally:
            for (module, name), (original, _) in self.globals.items():
                setattr(module, name, original)

    def region(self, layer: nn.Module, region: Region, prefix: str = "") -> tuple[Callable, Iterable, bool]:
        """Return what the peer runs for a region of `layer`, its parameters, and whether the peer patched it.

        A module runs its own forward (the peer's, if it bound one); a function-module (the rotary function) is replaced
        by the peer's module global where the peer replaced it. `prefix`: the layer's name in the model."""
        module = resolve(layer, region.name)
        if region.layer_region is not None:  # inside a swapped decoder layer: the peer runs its anchor's own forward
            bound = f"{prefix}{region.name}" in self.bound
            return region.layer_region.run(layer, "eager"), module.parameters(), bound
        try:
            layer.get_submodule(region.name)
        except AttributeError:  # a function-module, called through its modeling file's global
            caller = layer.get_submodule(region.name.rpartition(".")[0])
            file = sys.modules[type(caller).__module__]
            for (owner, _), (original, patched) in self.globals.items():
                if owner is file and original is module:
                    return patched, (), True
            return module, (), False
        return module, module.parameters(), f"{prefix}{region.name}" in self.bound


@dataclass
class Peer:
    """LLaMA-Factory's NPU kernels, loaded."""

    name: str
    interface: ModuleType

    @property
    def kernels(self) -> list[str]:
        return list(self.interface.get_default_kernels())

    def apply(self, model: nn.Module, kernel: str | None = None) -> Patches:
        """Apply the peer's default kernels, or one of them, to `model`; return what it patched.

        The kernels are applied as LLaMA-Factory does (`apply_default_kernels(model, "auto")`), and the module globals
        are already put back in what is returned.

        A model built from a config has no `config.architectures`, which LLaMA-Factory's MoE kernel reads; it
        is set to the model's class, as the checkpoint's config.json gives it when loaded from the Hub."""
        if not getattr(model.config, "architectures", None):
            model.config.architectures = [type(model).__name__]
        files = {sys.modules[type(m).__module__] for m in model.modules()}
        before = {(file, name): value for file in files for name, value in vars(file).items()}
        forwards = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
        try:
            if kernel is None:
                self.interface.apply_default_kernels(model, "auto")
            else:
                self.interface.apply_kernel(kernel, model=model)
        finally:
            patches = Patches()
            for (file, name), original in before.items():
                if vars(file).get(name) is not original:
                    patches.globals[(file, name)] = (original, vars(file)[name])
                    setattr(file, name, original)
        patches.bound = {name for name, m in model.named_modules() if m.__dict__.get("forward") is not forwards[name]}
        return patches


def load_peer() -> tuple[Peer | None, str]:
    """LLaMA-Factory's kernels, or None and why they cannot run here. Import after `emulation.install()`."""
    try:
        version = importlib.metadata.version("llamafactory")
    except importlib.metadata.PackageNotFoundError:
        return None, "llamafactory is not installed"
    os.environ.setdefault(
        "LLAMAFACTORY_VERBOSITY", "ERROR"
    )  # its scan warns that its CUDA (triton) kernels do not load
    try:
        interface = importlib.import_module(INTERFACE)
    except Exception as error:  # a broken install: say so, and leave the column out
        return None, f"importing {INTERFACE} failed: {error}"
    peer = Peer(f"LLaMA-Factory {version}", interface)
    if not peer.kernels:
        return None, "LLaMA-Factory registered no kernel: it registers its NPU kernels only on an NPU accelerator"
    return peer, ""


def kind_of(kernel: str) -> str:
    """The region kind of a peer kernel id (LLaMA-Factory's ids are the cards' kernel ids)."""
    card = CARDS.get(kernel)
    return card.region if card else ""


def kernel_of(kind: str) -> str:
    """The peer kernel id of a region kind (the inverse of `kind_of`)."""
    return next(kernel for kernel, card in CARDS.items() if card.region == kind)


@dataclass(frozen=True)
class ParityRow:
    """A peer kernel alone on a tiny model family: its logits against eager's, and what the check found."""

    family: str  # a `TINY_CONFIGS` family
    kernel: str  # the peer kernel id
    max_diff: float | None  # the largest |logits - eager|; None: the run raised
    outcome: str  # one of OUTCOMES
    note: str  # for people: the outcome, the torch_npu calls the run made, why it did not call them or what it raised

    def csv_row(self) -> Row:
        """Return its line of bench.csv: the largest difference in the peer column, eager's own (0) in the eager one."""
        return Row(
            "parity", self.family, f"{self.kernel} vs eager", "fwd", eager=0.0, peer=self.max_diff,
            unit="max |logits - eager|", target=f"<= {PARITY_TOLERANCE:g}", note=self.note, study=PARITY_STUDY,
            kind=kind_of(self.kernel), model=self.family, outcome=self.outcome,
            peer_patched=self.outcome not in ("not patched", "raises"),
        )  # fmt: skip

    @classmethod
    def of(cls, row: Row) -> ParityRow:
        """The parity row a line of bench.csv holds (what `csv_row` wrote)."""
        return cls(row.model, kernel_of(row.kind), row.peer, row.outcome, row.note)


def parity_rows(peer: Peer, families: Iterable[str] = TINY_CONFIGS) -> list[Row]:
    """Check each peer kernel alone on each tiny model family against eager.

    Each runs in float32, on the npu device, in eval: does the model's output match eager's? One row per (family,
    kernel): the largest |logits - eager| and the outcome (`OUTCOMES`): matches or differs, patched but never called,
    not patched (nothing it recognises), or raises."""
    ids = token_ids(seq=9)
    rows = []
    for family in families:
        for kernel in peer.kernels:
            model = tiny_causal_lm(family).to("npu")
            with torch.no_grad():
                eager = model(ids.to("npu")).logits.float().cpu()
            diff, calls, note = None, 0, ""
            try:
                patches = peer.apply(model, kernel)
                with patches.active(), emulation.count_op_calls() as counted, torch.no_grad():
                    out = model(ids.to("npu")).logits.float().cpu()
                calls, diff = sum(counted.values()), (out - eager).abs().max().item()
                if not (patches.bound or patches.globals):
                    outcome = "not patched"
                elif not calls:
                    outcome = "patched, never called"
                    note = "the model calls other functions than the ones patched"
                else:
                    outcome = "matches" if diff <= PARITY_TOLERANCE else "differs"
            except Exception as error:  # the peer's own failure on this family is a finding, not a bench error
                outcome, note = "raises", f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            note = f"{outcome}; {calls} torch_npu calls" + (f"; {note}" if note else "")
            rows.append(ParityRow(family, kernel, diff, outcome, note).csv_row())
    log(f"  peer parity: {len(rows)} checks")
    return rows
