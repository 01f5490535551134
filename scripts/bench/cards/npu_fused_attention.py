"""npu-fused-attention's bench spec (the contract: scripts/bench/cards/__init__.py).

The region is the attention core: the call of the attention function inside a model's attention module
(transformers' `ALL_ATTENTION_FUNCTIONS[...](module, query, key, value, attention_mask, ...)`), after the
projections and the rotary embedding, before the output projection. query is [B, Nq, S, Dqk], key [B, Nkv, S, Dqk],
value [B, Nkv, S, Dv]; the output is [B, S, Nq, Dv]. The card is an attention function, not a kernelized layer: the
bench counts the region with the call's arguments as transformers builds them for each implementation
(`bench.attention`), not in the decoder-layer study.

Floor: 1 op forward, reading query, key and value once and writing the output and one float32 log-sum-exp per query
row and head (flash attention's statistic); 1 op backward, reading query, key, value, the output, its gradient and
the log-sum-exps, writing dq, dk and dv. No mask is read: causal and banded attention need none (the op's own band
takes a small compressed mask, below). No repeated key/value heads: grouped-query attention reads each key/value
head once.

Kept for backward by the floor: the output and the log-sum-exps (query, key and value are the region's inputs, kept
regardless). npu_fusion_attention writes and keeps more: softmax_max and softmax_sum, float32 [B, N, Sq, 8] each,
64 bytes per row and head where the floor has 4 (at head dim 128, about 10% of the op's forward bytes): why its
bytes are held to 1.15 x the floor's, not 1.05.

The accounting rule of npu_fusion_attention (FUSED_OPS), from its contract (docs/torch-npu-ops.md):

- outputs: attention_out (query's shape with the head dim Dv; BSH/SBH: H = head_num x Dv), softmax_max and
  softmax_sum (float32 [B, N, Sq, 8], or [T, N, 8] for TND), an empty softmax_out, and the ints seed, offset and
  numels (0 here: the stand-in draws nothing);
- gradients for query, key, value, pse and sink; the backward kernel reads (and the autograd node keeps) query,
  key, value, pse, padding_mask, atten_mask, sink and the four tensor outputs;
- FLOPs: head_num x pairs x (2 Dqk + 2 Dv) forward, (6 Dqk + 4 Dv) backward (S recomputed), where pairs are the
  (query, key) pairs each segment (each batch row, or each TND sequence) keeps: all of them without a mask or in
  mode 1; top-left causal in modes 2 and 8, bottom-right causal in modes 3 and 7; otherwise the band
  i - pre_tockens <= j <= i + next_tockens, shifted by Skv - Sq in mode 4 (mode 0 with the defaults: every pair).

The compressed mask (modes 2 to 4, 7, 8: a 2048 x 2048 bool triu, 4 MB) is counted whole as a read of every call,
forward and backward, as any tensor argument is. The device reads only the mask tiles its diagonal blocks need,
which repeat over batches and heads and stay in the 192 MB L2 (inferred: the docs do not say), so its HBM traffic
per call is at most those 4 MB: counting it whole is an upper bound that never favours the card. At batch 8 x 4096
it is under 1% of the op's bytes; at one decode token it is most of them (the decode step is host-bound anyway).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..accounting import FusedOp, empty_of, tensor_bytes
from ..configs import PHASES
from ..floors import Floor, dense_bytes
from . import CountedTarget

ATTENTION_IMPLEMENTATION = "npu_fused_attention"
"""The name the card's function is registered under in transformers' AttentionInterface (and its mask under in
AttentionMaskInterface): what `attn_implementation` selects it by."""

TARGET_SHAPE = (8, 4096)
STATISTICS_TOLERANCE = 1.15
STATS_WIDTH = 8
"""softmax_max and softmax_sum hold each row's statistic 8 times (npu_fusion_attention's float32 [.., 8])."""


def _output_bytes(query: torch.Tensor, value: torch.Tensor) -> int:
    return query.numel() // query.shape[-1] * value.shape[-1] * query.element_size()


def floor(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_) -> Floor:
    """One op each way: q, k, v to out and a log-sum-exp per row; those and dout to dq, dk, dv (module doc)."""
    inputs = tensor_bytes(query) + tensor_bytes(key) + tensor_bytes(value)
    out = _output_bytes(query, value)
    statistics = floor_saved(module, query, key, value) - out
    grads = dense_bytes(query) + dense_bytes(key) + dense_bytes(value)
    return (1, inputs + out + statistics), (1, inputs + out + out + statistics + grads)


def floor_saved(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_) -> int:
    """The output and one float32 log-sum-exp per query row and head."""
    return _output_bytes(query, value) + query.numel() // query.shape[-1] * 4


COUNTED_TARGETS = (
    CountedTarget("ops", PHASES, 1),
    CountedTarget("bytes", ("fwd+bwd",), STATISTICS_TOLERANCE, TARGET_SHAPE),
    CountedTarget("bytes", PHASES, 1, TARGET_SHAPE, against="eager"),
)
"""The floor's ops at every size. At batch 8 x 4096: the floor's bytes within 15% forward+backward (the op's 8-wide
statistics, module doc), and no more bytes than transformers' sdpa. Bytes are held at that size only: the compressed
mask, counted whole (4 MB a call, see the module doc), is under 1% there, but at 1 x 512 it puts the card at 1.05 x
sdpa's bytes forward+backward."""


def _heads(a: dict[str, Any]) -> tuple[tuple[int, int, int], tuple[int, int, int], tuple[int, int, int], int | None]:
    """((N, S, D) of query, key and value), B (None for TND), as the op reads its layout."""
    layout, q, k, v, heads = a["input_layout"], a["query"], a["key"], a["value"], a["head_num"]
    if layout in ("BSH", "SBH"):
        b, s = (0, 1) if layout == "BSH" else (1, 0)
        d = q.shape[2] // heads
        kv_heads = k.shape[2] // d
        value = (kv_heads, v.shape[s], v.shape[2] // kv_heads)
        return (heads, q.shape[s], d), (kv_heads, k.shape[s], d), value, q.shape[b]
    if layout == "TND":
        return (*((t.shape[1], t.shape[0], t.shape[2]) for t in (q, k, v)), None)
    s, n = (1, 2) if layout == "BSND" else (2, 1)
    return (*((t.shape[n], t.shape[s], t.shape[3]) for t in (q, k, v)), q.shape[0])


def _outputs(a: dict[str, Any]) -> tuple:
    q = a["query"]
    (heads, q_len, _), _, (_, _, d_v), batch = _heads(a)
    hidden = a["input_layout"] in ("BSH", "SBH")
    out_shape = (q.shape[0], q.shape[1], heads * d_v) if hidden else (*q.shape[:-1], d_v)
    stats = (q.shape[0], heads, STATS_WIDTH) if batch is None else (batch, heads, q_len, STATS_WIDTH)
    return (
        empty_of(q, out_shape),
        empty_of(q, stats, torch.float32),
        empty_of(q, stats, torch.float32),
        empty_of(q, (0,)),
        0,
        0,
        0,
    )


def _clamped_sum(offset: int, count: int, cap: int) -> int:
    """Sum over i < count of min(max(i + offset, 0), cap)."""
    start = min(max(-offset, 0), count)
    stop = min(max(cap - offset, start), count)
    return (stop - start) * offset + (start + stop - 1) * (stop - start) // 2 + (count - stop) * cap


def band_pairs(q_len: int, kv_len: int, pre: int, next_: int, shift: int = 0) -> int:
    """The (i, j) pairs with 0 <= i < q_len, 0 <= j < kv_len and i - pre <= j - shift <= i + next_."""
    return _clamped_sum(shift + next_ + 1, q_len, kv_len) - _clamped_sum(shift - pre, q_len, kv_len)


def _segments(a: dict[str, Any]) -> list[tuple[int, int]]:
    """(Sq, Skv) of each batch row, or of each TND sequence."""
    (_, q_len, _), (_, kv_len, _), _, batch = _heads(a)
    if batch is not None:
        return [(q_len, kv_len)] * batch
    q_ends, kv_ends = list(a["actual_seq_qlen"]), list(a["actual_seq_kvlen"])
    starts = zip([0, *q_ends[:-1]], q_ends, [0, *kv_ends[:-1]], kv_ends, strict=True)
    return [(q_end - q_start, kv_end - kv_start) for q_start, q_end, kv_start, kv_end in starts]


def kept_pairs(a: dict[str, Any]) -> int:
    """The (query, key) pairs the op computes per head, over every segment (see the module doc)."""
    mode, mask = a["sparse_mode"], a["atten_mask"]
    pre, next_ = a["pre_tockens"], a["next_tockens"]
    total = 0
    for q_len, kv_len in _segments(a):
        if mask is None or mode == 1 or mode in (5, 6):
            total += q_len * kv_len
        elif mode in (2, 8):
            total += band_pairs(q_len, kv_len, q_len + kv_len, 0)
        elif mode in (3, 7):
            total += band_pairs(q_len, kv_len, q_len + kv_len, 0, kv_len - q_len)
        else:
            total += band_pairs(q_len, kv_len, pre, next_, kv_len - q_len if mode == 4 else 0)
    return total


def _flops(a: dict[str, Any], backward: bool) -> int:
    (heads, _, d_qk), _, (_, _, d_v), _ = _heads(a)
    per_pair = (6 * d_qk + 4 * d_v) if backward else (2 * d_qk + 2 * d_v)
    return heads * kept_pairs(a) * per_pair


def _backward_reads(a: dict[str, Any], out: tuple) -> list:
    names = ("query", "key", "value", "pse", "padding_mask", "atten_mask", "sink")
    return [a[n] for n in names if a[n] is not None] + list(out[:4])


FUSED_OPS = {
    "npu_fusion_attention": FusedOp(
        _outputs,
        ("query", "key", "value", "pse", "sink"),
        _backward_reads,
        flops=lambda a, out: _flops(a, False),
        backward_flops=lambda a, out: _flops(a, True),
    ),
}

# Not timed on the host: the card is an attention function transformers' own attention module calls, not a module a
# kernelized layer swaps in, so there is no module call to set against a bare one (`timed.host_cost_rows`).
HOST_TIMING = None
