"""npu-rope's bench spec (the contract: scripts/bench/cards/__init__.py).

Floor: 1 op reading q, k, cos, sin, writing q', k'. Backward: 1 op reading dq', dk', cos, sin, writing dq, dk.
Kept for backward: nothing beyond the region's inputs: the backward rotates the gradients by cos and sin.
(npu_rotary_mul keeps q and k as well, inputs of the region, so not counted here either.)

Documented minimum (`documented_minimum`, what the targets hold the card to): in inference, one
npu_apply_rotary_pos_emb for q and k (the floor) where that op's ledger rules accept the call (head dim 64 or 128
on Atlas A2/A3, q's and k's heads in its on-chip memory, ...: `APPLY_ROTARY_POS_EMB`), else one npu_rotary_mul for q
and one for k, each reading cos and sin; with grad, npu_apply_rotary_pos_emb has no backward, so npu_rotary_mul for q
and for k each way (its backward reads the gradient, cos and sin: the rotary embedding's cos and sin need no
gradient). See `OUT_OF_DOCUMENTED_REACH`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from npu_hub_kernels.testing.emulation.ledger import DeviceRefusal, enforce
from npu_hub_kernels.testing.emulation.ops.npu_rope import APPLY_ROTARY_POS_EMB

from ..accounting import FusedOp, empty_of, tensor_bytes
from ..configs import PHASES
from ..floors import Floor, dense_bytes
from . import CountedTarget, DocumentedMinimum, HostTiming

OUT_OF_DOCUMENTED_REACH = (
    "RoPE: the floor rotates q and k in one op each way. With grad no documented op does: npu_apply_rotary_pos_emb "
    "has no backward (Ascend/op-plugin@517f2e7:op_plugin/ops/opapi/AutogradErrorFallback.cpp:15), so npu_rotary_mul "
    "rotates q and k one call each, forward and backward (4 ops against 2, cos and sin read once per call). In "
    "inference npu_apply_rotary_pos_emb is the floor's op where its rules accept the call, and takes head dims 64 "
    "and 128 only on Atlas A2/A3 (ledger rule npu_apply_rotary_pos_emb/head-dim, "
    "Ascend/op-plugin@517f2e7:codegen/templates/_op_plugin_docs.py:15790): Gemma-3-4B's 256 is rotated by 2 "
    "npu_rotary_mul calls, 1.077 x the floor's bytes."
)


def documented_minimum(
    module: nn.Module, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *_
) -> DocumentedMinimum:
    """RoPE as the fewest documented calls, forward without autograd and forward+backward (see the module doc).

    In inference 1 npu_apply_rotary_pos_emb where its ledger rules accept q and k, else 2 npu_rotary_mul; with grad
    2 npu_rotary_mul each way."""
    (_, forward), (_, backward) = floor(module, q, k, cos, sin)
    angles = tensor_bytes(cos) + tensor_bytes(sin)  # read once more by the second call of a direction
    in_one_call = _one_call_rotates(q, k, cos, sin)
    inference = (1, forward) if in_one_call else (2, forward + angles)
    return inference, (4, forward + angles + backward + angles)


def _one_call_rotates(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether npu_apply_rotary_pos_emb's ledger rules accept q and k in inference.

    q and k are BNSD (as the attention calls the region), handed to the op as the card does: BSND views, cos and sin
    with one head."""
    query, key = (t.detach().transpose(1, 2) for t in (q, k))
    angles = {name: t.detach().to(q.dtype).unsqueeze(2) for name, t in (("cos", cos), ("sin", sin))}
    try:
        enforce(APPLY_ROTARY_POS_EMB, query=query, key=key, **angles, layout="BSND", rotary_mode="half")
    except DeviceRefusal:
        return False
    return True


def floor(module: nn.Module, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *_) -> Floor:
    """One op rotating q and k (reads q, k, cos, sin, writes q', k'); backward likewise on the gradients."""
    angles, qk = tensor_bytes(cos) + tensor_bytes(sin), dense_bytes(q) + dense_bytes(k)
    return (1, tensor_bytes(q) + tensor_bytes(k) + angles + qk), (1, qk + angles + qk)


def floor_saved(module: nn.Module, *_) -> int:
    """Nothing kept beyond the inputs: the backward reads only cos and sin besides the gradients."""
    return 0


COUNTED_TARGETS = (
    # = floor where npu_apply_rotary_pos_emb takes the call (inference), else 2 npu_rotary_mul (was: = floor in
    # inference, <= 2 x floor with grad)
    CountedTarget("ops", PHASES, 1, against="documented"),
    # exactly the documented calls' bytes (was: <= 1.05 x floor; with grad 1.024 to 1.030 x it on the head dims 128)
    CountedTarget("bytes", PHASES, 1, against="documented"),
)

FUSED_OPS = {
    # The backward kernel reads x only when r1/r2 need gradients, but the autograd node keeps x, r1 and r2 always
    # (docs/torch-npu-ops.md, npu_rotary_mul).
    "npu_rotary_mul": FusedOp(
        lambda a: empty_of(a["x"]),
        ("x", "r1", "r2"),
        lambda a, out: [a["r1"], a["r2"]] + ([a["x"]] if a["r1"].requires_grad or a["r2"].requires_grad else []),
        keeps=lambda a, out: [a["x"], a["r1"], a["r2"]],
    ),
    # In place: writes q and k, returns them; no autograd.
    "npu_apply_rotary_pos_emb": FusedOp(lambda a: (a["query"], a["key"])),
}


def _inputs(config: Any, batch: int, seq: int, device: str) -> tuple[torch.Tensor, ...]:
    """q, k (BNSD, as the attention calls it), cos, sin."""
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q, k = (
        torch.randn(batch, heads, seq, head_dim, device=device),
        torch.randn(batch, kv_heads, seq, head_dim, device=device),
    )
    return q, k, torch.randn(batch, seq, head_dim, device=device), torch.randn(batch, seq, head_dim, device=device)


def _direct_call(card: ModuleType, rope: Any) -> Callable[..., Any]:
    apply_rotary_pos_emb = card.apply_rotary_pos_emb
    return lambda q, k, cos, sin: apply_rotary_pos_emb(q, k, cos, sin, 1, "llama")


HOST_TIMING = HostTiming(
    # The rotary function-module: the modeling file's global the attention calls.
    region=lambda layer: sys.modules[type(layer).__module__].apply_rotary_pos_emb,
    inputs=_inputs,
    direct_call=_direct_call,
    shapes=lambda rope, inputs: f"q {tuple(inputs[0].shape)}, k {tuple(inputs[1].shape)}",
)
