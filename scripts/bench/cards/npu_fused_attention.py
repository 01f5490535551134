"""npu-fused-attention's bench spec (the contract: scripts/bench/cards/__init__.py).

The region is one attention call, `(module, query [B, Nq, Sq, D], key [B, Nkv, Skv, D], value [B, Nkv, Skv, Dv],
attention_mask, ...)` as transformers' AttentionInterface makes it; the card has no layer, so the bench finds the
region at the attention function, not at a module (issue 37's bench item: the lead's, not yet wired).

Floor: 1 op reading q, k, v and writing the output; backward 1 op reading dO, q, k, v, the output and the row
statistics, writing dq, dk, dv. Kept for backward by that floor: the output and one float32 log-sum-exp per query row
and head (flash attention's statistic); q, k and v are the region's inputs, kept regardless. npu_fusion_attention
keeps more: softmax_max and softmax_sum, float32 [.., 8] each (docs/torch-npu-ops.md).

Targets: never above eager in ops or bytes (the bench's attention study will add the floor targets with its shapes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..accounting import FusedOp, empty_of, tensor_bytes
from ..configs import PHASES
from ..floors import Floor, dense_bytes
from ..targets import CountedTarget


def _output_bytes(query: torch.Tensor, value: torch.Tensor) -> int:
    return query.numel() // query.shape[-1] * value.shape[-1] * query.element_size()


def floor(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_) -> Floor:
    """One op reading q, k, v, writing the output; backward one op reading dO, q, k, v, O, stats, writing dq, dk, dv."""
    inputs = tensor_bytes(query) + tensor_bytes(key) + tensor_bytes(value)
    output = _output_bytes(query, value)
    stats = floor_saved(module, query, key, value) - output
    gradients = dense_bytes(query) + dense_bytes(key) + dense_bytes(value)
    return (1, inputs + output), (1, output + inputs + output + stats + gradients)


def floor_saved(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_) -> int:
    """The output and one float32 log-sum-exp per query row and head."""
    rows = query.numel() // query.shape[-1]
    return _output_bytes(query, value) + rows * 4


COUNTED_TARGETS = (
    CountedTarget("ops", PHASES, 1, against="eager"),
    CountedTarget("bytes", PHASES, 1, against="eager"),
)


def _token_shape(a: dict[str, Any]) -> tuple[int, ...]:
    """The query's leading dims up to the head dim in the op's layout: (B, Sq, N) BSND, (B, N, Sq) BNSD, (T, N) TND."""
    return tuple(a["query"].shape[:-1])


def _statistics_shape(a: dict[str, Any]) -> tuple[int, ...]:
    q, layout, heads = a["query"], a["input_layout"], a["head_num"]
    if layout == "TND":
        return (q.shape[0], heads, 8)
    sq = q.shape[1] if layout == "BSND" else q.shape[2]
    return (q.shape[0], heads, sq, 8)


def _outputs(a: dict[str, Any]) -> tuple:
    q = a["query"]
    statistics = _statistics_shape(a)
    return (
        empty_of(q, (*_token_shape(a), a["value"].shape[-1])),
        empty_of(q, statistics, torch.float32),
        empty_of(q, statistics, torch.float32),
        empty_of(q, (0,)),
        0,
        0,
        0,
    )


def _score_elements(a: dict[str, Any]) -> int:
    """Query-key pairs per head summed over the batch (TND: over the sequences), the full rectangles."""
    q, k, layout = a["query"], a["key"], a["input_layout"]
    if layout == "TND":
        q_ends, k_ends = [0, *a["actual_seq_qlen"]], [0, *a["actual_seq_kvlen"]]
        pairs = [(q_ends[i + 1] - q_ends[i]) * (k_ends[i + 1] - k_ends[i]) for i in range(len(q_ends) - 1)]
        return sum(pairs) * a["head_num"]
    sq, skv = (q.shape[1], k.shape[1]) if layout == "BSND" else (q.shape[2], k.shape[2])
    return q.shape[0] * a["head_num"] * sq * skv


FUSED_OPS = {
    "npu_fusion_attention": FusedOp(
        _outputs,
        ("query", "key", "value"),
        lambda a, out: [a["query"], a["key"], a["value"], a["atten_mask"], out[0], out[1], out[2]],
        # QK^T and PV forward; backward recomputes QK^T and computes dV, dP, dQ and dK (2 FLOPs per multiply-add).
        flops=lambda a, out: 2 * _score_elements(a) * (a["query"].shape[-1] + a["value"].shape[-1]),
        backward_flops=lambda a, out: 2 * _score_elements(a) * (3 * a["query"].shape[-1] + 2 * a["value"].shape[-1]),
    ),
}

HOST_TIMING = None  # the card is an attention function, not a decoder-layer module: the host-cost rows time modules
