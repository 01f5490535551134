"""Emulated `torch_npu.npu_fusion_attention` and its grad: docs/torch-npu-ops.md's "npu_fusion_attention" contract.

`softmax(mask(scale * q @ k^T))`, dropped out with `keep_prob`, times v, in float32 with one cast at the end, per
batch (per `actual_seq` segment for TND), with grouped-query attention native (query head h reads key/value head
`h // (Nq / Nkv)`). The mask is the one `sparse_mode` names: 0 the passed `atten_mask` (True = masked) and the band
`i - pre_tockens <= j <= i + next_tockens`; 1 the passed mask alone; 2 causal from the top-left (`j <= i`); 3 causal
from the bottom-right (`j <= i + Skv - Sq`); 4 the band shifted to the bottom-right
(`i + Skv - Sq - pre_tockens <= j <= i + Skv - Sq + next_tockens`). Modes 2, 3 and 4 take the compressed 2048 x 2048
upper-triangle mask; with `atten_mask=None` every mode computes full attention, as the device does. A `sink` (float32,
one logit per query head) joins each row's softmax and is dropped before v. Returns the op's 7-tuple:
`attention_out` (in q's dtype, Dv wide), `softmax_max` and `softmax_sum` (float32 `[B, N, Sq, 8]`, or for TND
`[T, N, 8]` holding N-major data unless `softmax_layout="TND"`), an empty `softmax_out`, and seed, offset, numels.

Dropout: the keep mask is `numels` draws from a generator seeded by (seed, offset), in the order op-plugin's golden
indexes it (`[B, N, Sq, Skv]`, or for TND each segment's `[N, Sq_b, Skv_b]` in turn); seed and offset come from the
emulated device's generator (the host's default one: its initial seed, and an offset drawn from it), and the grad
regenerates the same mask from them, as the device's does.

Backward: torch_npu's autograd node (op-plugin derivatives.yaml:149) keeps query, key, value, atten_mask, sink and
the results attention_out, softmax_max, softmax_sum and softmax_out, and calls `npu_fusion_attention_grad` with them
(here the function of that name, which recomputes the probabilities from softmax_max and softmax_sum); it returns
dq, dk, dv (dk and dv summed over each group of query heads), an empty dpse and dsink (float32, or empty).

Limits: `LEDGER` (in `_npu_fused_attention_rules.py`: npu_fusion_attention's rules, then the grad's). Forms no
card calls raise NotImplementedError naming the form: pse, prefix (modes 5 and 6), modes 7 and 8, an external
dropout_mask, and outside TND a row whose every key is masked (the docs do not state that output).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..backward import device_backward
from ..checks import require_npu
from ..ledger import enforce
from ._npu_fused_attention_rules import (
    _EPSILON,
    NO_LIMIT,
    NPU_FUSION_ATTENTION,
    NPU_FUSION_ATTENTION_GRAD,
    _effective,
    _lengths,
    _segment_lengths,
    _segment_mask,
    _shapes,
)
from ._npu_fused_attention_rules import LEDGER as LEDGER  # the card's rules, where `emulation.ledger_of` reads them

__all__ = ["npu_fusion_attention"]


@dataclass(frozen=True)
class _Call:
    """The non-tensor arguments of a call, as the autograd node keeps them for the grad."""

    head_num: int
    input_layout: str
    scale: float
    keep_prob: float
    pre_tockens: int
    next_tockens: int
    inner_precise: int
    actual_seq_qlen: tuple[int, ...] | None
    actual_seq_kvlen: tuple[int, ...] | None
    sparse_mode: int
    gen_mask_parallel: bool
    sync: bool
    softmax_layout: str
    seed: int
    offset: int
    numels: int


def npu_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = NO_LIMIT,
    next_tockens: int = NO_LIMIT,
    inner_precise: int = 0,
    prefix: list[int] | None = None,
    actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """Fused attention as torch_npu computes it, returning the op's 7-tuple.

    (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels): see the module's docstring.
    """
    optional = {"pse": pse, "padding_mask": padding_mask, "atten_mask": atten_mask, "sink": sink}
    given = {name: t for name, t in optional.items() if t is not None}
    require_npu("npu_fusion_attention", query=query, key=key, value=value, **given)
    arguments = dict(
        query=query, key=key, value=value, head_num=head_num, input_layout=input_layout, pse=pse,
        padding_mask=padding_mask, atten_mask=atten_mask, scale=scale, keep_prob=keep_prob, pre_tockens=pre_tockens,
        next_tockens=next_tockens, inner_precise=inner_precise, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, softmax_layout=softmax_layout, sink=sink,
    )  # fmt: skip
    enforce(NPU_FUSION_ATTENTION, **arguments)
    _refuse_unemulated_forms(pse=pse, prefix=prefix, sparse_mode=sparse_mode, dropout_mask=dropout_mask)
    numels = _numels(query, key, head_num, input_layout, actual_seq_qlen, actual_seq_kvlen)
    if _drops_some(keep_prob) and keep_prob >= _EPSILON:  # the device draws seed and offset (cpp:491-495)
        seed, offset = torch.initial_seed(), int(torch.randint(0, 2**62, ()).item())
    call = _Call(
        head_num, input_layout, float(scale), float(keep_prob), pre_tockens, next_tockens, inner_precise,
        _tuple_or_none(actual_seq_qlen), _tuple_or_none(actual_seq_kvlen), sparse_mode, gen_mask_parallel, sync,
        softmax_layout, seed, offset, numels,
    )  # fmt: skip
    out, softmax_max, softmax_sum, softmax_out = _FusionAttention.apply(query, key, value, atten_mask, sink, call)
    return out, softmax_max, softmax_sum, softmax_out, seed, offset, numels


def npu_fusion_attention_grad(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dy: torch.Tensor,
    head_num: int,
    input_layout: str,
    *,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    softmax_max: torch.Tensor | None = None,
    softmax_sum: torch.Tensor | None = None,
    softmax_in: torch.Tensor | None = None,
    attention_in: torch.Tensor | None = None,
    scale_value: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = NO_LIMIT,
    next_tockens: int = NO_LIMIT,
    inner_precise: int = 0,
    seed: int = 0,
    offset: int = 0,
    numels: int = 0,
    prefix: list[int] | None = None,
    actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op npu_fusion_attention's autograd node calls: (dq, dk, dv, dpse (empty), dsink (float32, or empty)).

    The probabilities are recomputed from softmax_max and softmax_sum, the dropout mask from (seed, offset, numels),
    and the softmax gradient's row term from attention_in, as the device's kernel does; float32 inside.
    """
    enforce(
        NPU_FUSION_ATTENTION_GRAD, query=query, key=key, value=value, dy=dy, head_num=head_num,
        input_layout=input_layout, attention_in=attention_in, softmax_max=softmax_max, softmax_sum=softmax_sum,
        keep_prob=keep_prob, sparse_mode=sparse_mode, actual_seq_qlen=actual_seq_qlen,
    )  # fmt: skip
    _refuse_unemulated_forms(pse=pse, prefix=prefix, sparse_mode=sparse_mode, dropout_mask=None)
    call = _Call(
        head_num, input_layout, float(scale_value), float(keep_prob), pre_tockens, next_tockens, inner_precise,
        _tuple_or_none(actual_seq_qlen), _tuple_or_none(actual_seq_kvlen), sparse_mode, gen_mask_parallel, sync,
        softmax_layout, seed, offset, numels,
    )  # fmt: skip
    return _backward(query, key, value, dy, atten_mask, softmax_max, softmax_sum, attention_in, sink, call)


class _FusionAttention(torch.autograd.Function):
    """npu_fusion_attention, keeping what its autograd node keeps (derivatives.yaml:149).

    That is query, key, value, atten_mask, sink and the results attention_out, softmax_max, softmax_sum and softmax_out.
    """

    @staticmethod
    def forward(
        ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, atten_mask: torch.Tensor | None,
        sink: torch.Tensor | None, call: _Call,
    ):  # fmt: skip
        ctx.set_materialize_grads(False)  # an unused output: no gradient, no backward op run
        out, softmax_max, softmax_sum, softmax_out = _forward(query, key, value, atten_mask, sink, call)
        ctx.call = call
        ctx.save_for_backward(query, key, value, atten_mask, sink, out, softmax_max, softmax_sum, softmax_out)
        return out, softmax_max, softmax_sum, softmax_out

    @staticmethod
    @device_backward("npu_fusion_attention_grad")
    def backward(ctx, grad_out, _grad_max, _grad_sum, _grad_softmax_out):
        if grad_out is None:  # the formula reads the gradient of attention_out alone
            return (None,) * 6
        query, key, value, atten_mask, sink, out, softmax_max, softmax_sum, softmax_out = ctx.saved_tensors
        call = ctx.call
        dq, dk, dv, _dpse, dsink = npu_fusion_attention_grad(
            query, key, value, grad_out, call.head_num, call.input_layout, atten_mask=atten_mask,
            softmax_max=softmax_max, softmax_sum=softmax_sum, softmax_in=softmax_out, attention_in=out,
            scale_value=call.scale, keep_prob=call.keep_prob, pre_tockens=call.pre_tockens,
            next_tockens=call.next_tockens, inner_precise=call.inner_precise, seed=call.seed, offset=call.offset,
            numels=call.numels, actual_seq_qlen=call.actual_seq_qlen, actual_seq_kvlen=call.actual_seq_kvlen,
            sparse_mode=call.sparse_mode, gen_mask_parallel=call.gen_mask_parallel, sync=call.sync,
            softmax_layout=call.softmax_layout, sink=sink,
        )  # fmt: skip
        return dq, dk, dv, None, dsink if sink is not None else None, None


def _refuse_unemulated_forms(pse: Any, prefix: Any, sparse_mode: int, dropout_mask: Any) -> None:
    forms = {
        "pse (a positional encoding)": pse is not None,
        "prefix (sparse_mode 5 or 6)": prefix is not None or sparse_mode in (5, 6),
        f"sparse_mode {sparse_mode} (varlen context-parallel splits)": sparse_mode in (7, 8),
        "an external dropout_mask": dropout_mask is not None,
    }
    for form, used in forms.items():
        if used:
            raise NotImplementedError(
                f"npu_fusion_attention: the emulation does not compute {form}: no card calls it (see "
                "docs/torch-npu-ops.md, section npu_fusion_attention). Run this on an Ascend host."
            )


def _tuple_or_none(values: Any) -> tuple[int, ...] | None:
    return None if values is None else tuple(values)


def _drops_some(keep_prob: float) -> bool:
    return abs(keep_prob - 1.0) >= _EPSILON


def _numels(query, key, head_num, layout, actual_seq_qlen, actual_seq_kvlen) -> int:
    """The dropout mask's length as the adapter computes it: B*N*Sq*Skv, or N * the sum of Sq_b*Skv_b for TND."""
    if layout == "TND":  # cpp:1468-1475, differences of the lists as given
        q_lengths, kv_lengths = _lengths(list(actual_seq_qlen)), _lengths(list(actual_seq_kvlen))
        return query.shape[1] * sum(a * b for a, b in zip(q_lengths, kv_lengths, strict=True))
    c = _ShapeArguments(query, key, key, head_num, layout)  # cpp:480-488
    q, k, _ = _shapes(c)
    return q[0] * q[1] * q[2] * k[2]


@dataclass
class _ShapeArguments:
    """The arguments `_shapes` reads, outside a ledger call."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    head_num: int
    input_layout: str
    actual_seq_qlen: tuple[int, ...] | None = None
    actual_seq_kvlen: tuple[int, ...] | None = None
    atten_mask: torch.Tensor | None = None
    sparse_mode: int = 0
    pre_tockens: int = NO_LIMIT
    next_tockens: int = NO_LIMIT
    softmax_layout: str = ""


def _arguments(query, key, value, atten_mask, call: _Call) -> _ShapeArguments:
    return _ShapeArguments(
        query, key, value, call.head_num, call.input_layout, call.actual_seq_qlen, call.actual_seq_kvlen, atten_mask,
        call.sparse_mode, call.pre_tockens, call.next_tockens, call.softmax_layout,
    )  # fmt: skip


def _segments(t: torch.Tensor, c: Any, which: int) -> list[torch.Tensor]:
    """`t` (query, key or value: `which` 0, 1 or 2) in float32 as one [N, S, D] tensor per batch or segment."""
    layout = c.input_layout
    shape = _shapes(c)[which]
    t = t.float()
    if layout == "TND":
        ends = _effective(c.actual_seq_qlen if which == 0 else c.actual_seq_kvlen)
        heads = t.transpose(0, 1)
        count = len(_segment_lengths(c))
        ends += [ends[-1]] * (count - len(ends))
        return [heads[:, start:end] for start, end in zip([0, *ends[:-1]], ends, strict=True)]
    if layout in ("BSH", "SBH"):
        t = t.unflatten(2, (shape[1], shape[3]))
        t = t.transpose(1, 2) if layout == "BSH" else t.permute(1, 2, 0, 3)
    elif layout == "BSND":
        t = t.transpose(1, 2)
    return list(t.unbind(0))


def _joined(parts: list[torch.Tensor], layout: str) -> torch.Tensor:
    """The per-batch [N, S, D] results as one contiguous tensor in `layout`: the inverse of `_segments`."""
    if layout == "TND":
        return torch.cat(parts, dim=1).transpose(0, 1).contiguous()
    t = torch.stack(parts)
    if layout == "BSH":
        return t.transpose(1, 2).flatten(2)
    if layout == "SBH":
        return t.permute(2, 0, 1, 3).flatten(2)
    return t.transpose(1, 2).contiguous() if layout == "BSND" else t


def _stats_out(rows: list[torch.Tensor], c: Any) -> torch.Tensor:
    """softmax_max or softmax_sum from per-batch [N, Sq] rows: each value 8 times, [B, N, Sq, 8] or [T, N, 8].

    For TND the [T, N, 8] tensor holds N-major data (the default 'NTD' arrangement, _op_plugin_docs.py:1624;
    inferred) or, with softmax_layout 'TND', token-major data.
    """
    if c.input_layout != "TND":
        return torch.stack(rows).unsqueeze(-1).expand(-1, -1, -1, 8).contiguous()
    per_head = torch.cat(rows, dim=1).unsqueeze(-1).expand(-1, -1, 8)  # [N, T, 8]
    if c.softmax_layout == "TND":
        return per_head.transpose(0, 1).contiguous()
    return per_head.contiguous().view(per_head.shape[1], per_head.shape[0], 8)


def _stats_in(stats: torch.Tensor, c: Any) -> list[torch.Tensor]:
    """The per-row values of softmax_max or softmax_sum, per batch as [N, Sq]: the inverse of `_stats_out`."""
    if c.input_layout != "TND":
        return list(stats[..., 0].unbind(0))
    tokens, heads = stats.shape[0], stats.shape[1]
    per_head = stats.transpose(0, 1) if c.softmax_layout == "TND" else stats.reshape(heads, tokens, 8)
    lengths = [sq for sq, _ in _segment_lengths(c)]
    return list(per_head[..., 0].split(lengths, dim=1))


def _dropout_keeps(c: Any, call: _Call) -> list[torch.Tensor | None]:
    """Each batch's [N, Sq, Skv] keep mask (True = kept), or None per batch when keep_prob keeps everything.

    The mask is `numels` uniform draws from a generator seeded by (seed, offset), below keep_prob; batch b's part
    follows the parts before it (op-plugin's golden indexing: test_npu_flash_attention.py:120-149).
    """
    lengths = _segment_lengths(c)
    if not _drops_some(call.keep_prob):
        return [None] * len(lengths)
    generator = torch.Generator().manual_seed((call.seed * 0x9E3779B97F4A7C15 + call.offset) % 2**63)
    draws = torch.rand(call.numels, generator=generator)
    keeps = (draws < call.keep_prob) if call.keep_prob >= _EPSILON else torch.zeros_like(draws, dtype=torch.bool)
    heads = _shapes(c)[0][1]
    parts, start = [], 0
    for sq, skv in lengths:
        size = heads * sq * skv
        parts.append(keeps[start : start + size].view(heads, sq, skv))
        start += size
    return parts


def _expanded(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Key or value [Nkv, S, D] read by `heads` query heads: head h reads kv head h // (heads / Nkv)."""
    return kv.repeat_interleave(heads // kv.shape[0], dim=0)


def _group_sum(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient over query heads [N, S, D] summed over each group, as key's or value's [Nkv, S, D]."""
    return grad.unflatten(0, (kv_heads, grad.shape[0] // kv_heads)).sum(1)


def _scores(q: torch.Tensor, k: torch.Tensor, masked: torch.Tensor | None, scale: float) -> torch.Tensor:
    scores = scale * (q @ _expanded(k, q.shape[0]).transpose(1, 2))
    return scores if masked is None else scores.masked_fill(masked, -math.inf)


def _host(t: torch.Tensor | None) -> torch.Tensor | None:
    """The data of an npu tensor on the host: the emulated kernel's work happens there (one copy in, one out)."""
    return None if t is None else t.detach().cpu()


def _forward(query, key, value, atten_mask, sink, call: _Call):
    device = query.device
    query, key, value, atten_mask, sink = map(_host, (query, key, value, atten_mask, sink))
    c = _arguments(query, key, value, atten_mask, call)
    qs, ks, vs = (_segments(t, c, which) for which, t in enumerate((query, key, value)))
    keeps = _dropout_keeps(c, call)
    sink32 = None if sink is None else sink.float().unsqueeze(-1)  # [N, 1]
    outs, maxima, sums = [], [], []
    for index, (q, k, v) in enumerate(zip(qs, ks, vs, strict=True)):
        masked = _segment_mask(c, index, q.shape[1], k.shape[1])
        if masked is not None and q.shape[1] and bool(masked.all(-1).any()):
            raise NotImplementedError(
                "npu_fusion_attention: a query row with every key masked outside TND: the docs do not state what the "
                "device computes for it (inner_precise=2 'invalid rows', _op_plugin_docs.py:1616); the emulation "
                "does not guess. Leave every row at least one key."
            )
        if q.shape[1] == 0:  # an empty query segment of TND
            outs.append(q.new_zeros(q.shape[0], 0, v.shape[2]))
            maxima.append(q.new_zeros(q.shape[0], 0))
            sums.append(q.new_zeros(q.shape[0], 0))
            continue
        scores = _scores(q, k, masked, call.scale)
        row_max = scores.amax(-1)
        if sink32 is not None:
            row_max = torch.maximum(row_max, sink32)
        probs = torch.exp(scores - row_max.unsqueeze(-1))
        row_sum = probs.sum(-1) + (0 if sink32 is None else torch.exp(sink32 - row_max))
        probs = probs / row_sum.unsqueeze(-1)
        if keeps[index] is not None:
            probs = probs * keeps[index] / call.keep_prob
        outs.append(probs @ _expanded(v, q.shape[0]))
        maxima.append(row_max)
        sums.append(row_sum)
    out = _joined(outs, c.input_layout).to(query.dtype)
    results = (out, _stats_out(maxima, c), _stats_out(sums, c), query.new_empty(0))
    return tuple(t.to(device) for t in results)


def _backward(query, key, value, dy, atten_mask, softmax_max, softmax_sum, attention_in, sink, call: _Call):
    device = query.device
    tensors = (query, key, value, dy, atten_mask, softmax_max, softmax_sum, attention_in, sink)
    query, key, value, dy, atten_mask, softmax_max, softmax_sum, attention_in, sink = map(_host, tensors)
    c = _arguments(query, key, value, atten_mask, call)
    qs, ks, vs = (_segments(t, c, which) for which, t in enumerate((query, key, value)))
    dys, outs = _segments(dy, _with_value_shape(c, dy), 0), _segments(attention_in, _with_value_shape(c, dy), 0)
    maxima, sums = _stats_in(softmax_max, c), _stats_in(softmax_sum, c)
    keeps = _dropout_keeps(c, call)
    sink32 = None if sink is None else sink.float().unsqueeze(-1)
    dqs, dks, dvs = [], [], []
    dsink = None if sink is None else torch.zeros_like(sink, dtype=torch.float32)
    for index, (q, k, v) in enumerate(zip(qs, ks, vs, strict=True)):
        heads, kv_heads = q.shape[0], k.shape[0]
        if q.shape[1] == 0:
            dqs.append(torch.zeros_like(q))
            dks.append(torch.zeros_like(k))
            dvs.append(torch.zeros_like(v))
            continue
        masked = _segment_mask(c, index, q.shape[1], k.shape[1])
        row_max, row_sum = maxima[index].unsqueeze(-1), sums[index].unsqueeze(-1)
        probs = torch.exp(_scores(q, k, masked, call.scale) - row_max) / row_sum
        dropped = probs if keeps[index] is None else probs * keeps[index] / call.keep_prob
        grad_out = dys[index]
        grad_probs = grad_out @ _expanded(v, heads).transpose(1, 2)
        if keeps[index] is not None:
            grad_probs = grad_probs * keeps[index] / call.keep_prob
        row_term = (grad_out * outs[index]).sum(-1, keepdim=True)  # sum_j p_ij dp_ij, from attention_in
        grad_scores = probs * (grad_probs - row_term) * call.scale
        dqs.append(grad_scores @ _expanded(k, heads))
        dks.append(_group_sum(grad_scores.transpose(1, 2) @ q, kv_heads))
        dvs.append(_group_sum(dropped.transpose(1, 2) @ grad_out, kv_heads))
        if sink32 is not None:
            sink_probs = torch.exp(sink32 - row_max.squeeze(-1)) / row_sum.squeeze(-1)
            dsink = dsink - (sink_probs * row_term.squeeze(-1)).sum(-1)
    dq = _joined(dqs, c.input_layout).to(query.dtype)
    dk = _joined(dks, c.input_layout).to(key.dtype)
    dv = _joined(dvs, c.input_layout).to(value.dtype)
    dpse = query.new_empty(0)
    dsink = dsink if dsink is not None else key.new_empty(0, dtype=torch.float32)
    return tuple(t.to(device) for t in (dq, dk, dv, dpse, dsink))


def _with_value_shape(c: _ShapeArguments, dy: torch.Tensor) -> _ShapeArguments:
    """The call's arguments with dy (query's rows, value's D) read as the query: to split dy and attention_in."""
    return _ShapeArguments(
        dy, c.key, c.value, c.head_num, c.input_layout, c.actual_seq_qlen, c.actual_seq_qlen, c.atten_mask,
        c.sparse_mode, c.pre_tockens, c.next_tockens, c.softmax_layout,
    )  # fmt: skip
