"""The constraint ledger: every documented limit of the torch_npu ops the cards call, as data the emulation enforces.

Each emulated op (and each backward its autograd node calls, with what op-plugin's `derivatives.yaml` passes it)
lists its `Rule`s beside its code, in `ops/<card>.py` (that module's `LEDGER`). A rule is one statement of Huawei's
documentation (the torch_npu docstring's 参数说明 / 约束说明 / 支持的型号, the CANN aclnn doc, derivatives.yaml), its
source as `repository@commit:path:line`, and a predicate over the call's arguments. `enforce` runs an op's rules in
order and raises `DeviceRefusal` (a RuntimeError, as torch_npu raises) naming the first rule the call breaks, so a
card that sends the device what it refuses fails its tests with the rule in the message:

    npu_rms_norm refuses this call: rule npu_rms_norm/x-rank: x has 2 to 8 dims
    [Ascend/op-plugin@517f2e7:codegen/templates/_op_plugin_docs.py:3447]; got x float32[8] npu, ...

Where two sources disagree the ledger enforces the stricter one and the rule's `note` says so. The ledger section
of docs/torch-npu-ops.md is rendered from it (`render_markdown`; `make ledger` rewrites it, a test checks it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

OP_PLUGIN = "Ascend/op-plugin@517f2e7"
"""Ascend/op-plugin at 517f2e7d0f202f38b76310706cb977ca2388ad21 (master, 2026-08-21): the torch_npu API docstrings,
schemas and derivatives compiled into torch_npu."""
OPS_NN = "hicann/ops-nn@e5c3fa9"
"""hicann/ops-nn at e5c3fa932: the CANN aclnn docs of the norm, activation and loss kernels."""
OPS_TRANSFORMER = "hicann/ops-transformer@c29bc10"
"""hicann/ops-transformer at c29bc1069d3252c641e2aa059ec88f392d3f05ac: the CANN aclnn docs of the MoE, RoPE and
grouped-matmul kernels."""


def op_doc(line: int) -> str:
    """The source of a statement of torch_npu's API docstrings (`_op_plugin_docs.py`) at `line`."""
    return f"{OP_PLUGIN}:codegen/templates/_op_plugin_docs.py:{line}"


def derivatives(line: int) -> str:
    """The source of a statement of op-plugin's `derivatives.yaml` at `line`."""
    return f"{OP_PLUGIN}:op_plugin/config/derivatives.yaml:{line}"


def functions_yaml(line: int) -> str:
    """The source of a schema in op-plugin's `op_plugin_functions.yaml` at `line`."""
    return f"{OP_PLUGIN}:op_plugin/config/op_plugin_functions.yaml:{line}"


@dataclass(frozen=True)
class Rule:
    """One limit the device puts on one op's calls: `holds(call)` is false exactly where the device refuses.

    `call` has the op's arguments as attributes, under the names the op's signature gives them; an op's rules run
    in order, so a rule may assume the ones before it hold (ranks before shapes).
    """

    op: str
    name: str
    text: str
    source: str
    holds: Callable[[Any], bool]
    note: str = ""

    @property
    def id(self) -> str:
        """`<op>/<name>`: how messages, tests and docs name the rule."""
        return f"{self.op}/{self.name}"


class DeviceRefusal(RuntimeError):
    """A call the device refuses, by the rule it breaks (`rule`)."""

    def __init__(self, rule: Rule, arguments: dict[str, Any]):
        self.rule = rule
        super().__init__(
            f"{rule.op} refuses this call: rule {rule.id}: {rule.text} [{rule.source}]; got {describe(arguments)}"
        )


def rules(op: str, *entries: tuple) -> tuple[Rule, ...]:
    """An op's rules from `(name, text, source, holds[, note])` tuples, in the order they are checked."""
    return tuple(Rule(op, *entry) for entry in entries)


def enforce(op_rules: Iterable[Rule], **arguments: Any) -> None:
    """Raise `DeviceRefusal` for the first of `op_rules` these arguments break; nothing when all hold."""
    call = SimpleNamespace(**arguments)
    for rule in op_rules:
        if not rule.holds(call):
            raise DeviceRefusal(rule, arguments)


def describe(arguments: dict[str, Any]) -> str:
    """The arguments as a message shows them: tensors by dtype, shape and device, the rest by repr."""
    return ", ".join(f"{name} {_describe_value(value)}" for name, value in arguments.items())


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{dtype}{list(value.shape)} {value.device.type}"
    if isinstance(value, list | tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        return "[" + ", ".join(_describe_value(v) for v in value) + "]"
    return repr(value)


def render_markdown(ledger: Iterable[Rule]) -> str:
    """The ledger as the tables of docs/torch-npu-ops.md's section "The constraint ledger": one per op."""
    by_op: dict[str, list[Rule]] = {}
    for rule in ledger:
        by_op.setdefault(rule.op, []).append(rule)
    parts = []
    for op, op_rules in by_op.items():
        lines = [f"### {op}", "", "| rule | the device refuses a call unless | source |", "| --- | --- | --- |"]
        for rule in op_rules:
            text = rule.text + (f" ({rule.note})" if rule.note else "")
            lines.append(f"| `{rule.name}` | {_cell(text)} | {_cell(rule.source)} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
