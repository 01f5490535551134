"""npu-rope's bench spec (the contract: scripts/bench/cards/__init__.py).

Floor: 1 op reading q, k, cos, sin, writing q', k'. Backward: 1 op reading dq', dk', cos, sin, writing dq, dk.
(npu_apply_rotary_pos_emb is that op in inference; with grad, npu_rotary_mul runs once for q and once for k,
which the targets allow: at most `OPS_PER_DIRECTION` ops each way.)
On Atlas A2/A3 npu_apply_rotary_pos_emb takes head dims 64 and 128 only (op-plugin@517f2e7
docs/zh/custom_APIs/torch_npu/torch_npu-apply_rotary_pos_emb.md:25; Ascend 950 takes up to 1024): a model of
another head dim (Gemma-3-4B's 256) rotates q and k with one npu_rotary_mul each in inference too, 2 ops against
the floor's 1, each reading cos and sin: (2 (Nq + Nk) + 4) / (2 (Nq + Nk) + 2) x the floor's bytes, 1.077 for
Gemma-3-4B's 8 + 4 heads. No op the device documents rotates q and k of such a head dim in one call there.
Kept for backward: nothing beyond the region's inputs: the backward rotates the gradients by cos and sin.
(npu_rotary_mul keeps q and k as well, inputs of the region, so not counted here either.)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ..accounting import FusedOp, empty_of, tensor_bytes
from ..configs import PHASES
from ..floors import Floor, dense_bytes
from . import BYTES_TOLERANCE, CountedTarget, HostTiming

OPS_PER_DIRECTION = 2
"""RoPE with grad runs at most 2 ops each way (npu_rotary_mul for q and for k); in inference, the floor's 1."""


def floor(module: nn.Module, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *_) -> Floor:
    """One op rotating q and k (reads q, k, cos, sin, writes q', k'); backward likewise on the gradients."""
    angles, qk = tensor_bytes(cos) + tensor_bytes(sin), dense_bytes(q) + dense_bytes(k)
    return (1, tensor_bytes(q) + tensor_bytes(k) + angles + qk), (1, qk + angles + qk)


def floor_saved(module: nn.Module, *_) -> int:
    """Nothing kept beyond the inputs: the backward reads only cos and sin besides the gradients."""
    return 0


COUNTED_TARGETS = (
    CountedTarget("ops", ("fwd",), 1),  # in inference: one npu_apply_rotary_pos_emb for q and k
    CountedTarget("ops", ("fwd+bwd",), OPS_PER_DIRECTION),
    CountedTarget("bytes", PHASES, BYTES_TOLERANCE),
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
