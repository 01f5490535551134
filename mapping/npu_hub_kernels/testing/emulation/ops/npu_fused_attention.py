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

Limits: `LEDGER` (npu_fusion_attention's rules, then npu_fusion_attention_grad's). Forms no card calls raise
NotImplementedError naming the form: pse, prefix (modes 5 and 6), modes 7 and 8, an external dropout_mask, and
outside TND a row whose every key is masked (the docs do not state that output).
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..backward import device_backward
from ..checks import FLOAT_DTYPES, cann_at_least, require_npu
from ..ledger import OP_PLUGIN, OPS_TRANSFORMER, enforce, functions_yaml, op_doc, rules

__all__ = ["npu_fusion_attention"]

_CPP = f"{OP_PLUGIN}:op_plugin/ops/opapi/FlashAttentionKernelNpuOpApi.cpp"
_API_DOC = f"{OP_PLUGIN}:docs/zh/custom_APIs/torch_npu/torch_npu-npu_fusion_attention.md"
_SCORE_DOC = f"{OPS_TRANSFORMER}:attention/flash_attention_score/docs/aclnnFlashAttentionScore.md"
_VARLEN_DOC = f"{OPS_TRANSFORMER}:attention/flash_attention_score/docs/aclnnFlashAttentionVarLenScore.md"

LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
"""The input layouts (_op_plugin_docs.py:1607); TND is the varlen one."""
_RANK = {"BSH": 3, "SBH": 3, "BSND": 4, "BNSD": 4, "TND": 3}
COMPRESSED_MASK_SIZE = 2048
"""Modes 2, 3 and 4 take a 2048 x 2048 mask, masked above the diagonal (_op_plugin_docs.py:1643-1645)."""
NO_LIMIT = 2147483647
"""pre_tockens' and next_tockens' default: no band."""
_MASK_DTYPES = (torch.bool, torch.uint8)
_COMPRESSED_MODES = (2, 3, 4, 7, 8)
_BANDED_MODES = (0, 4)
_M = 1024 * 1024
_MAX_ACTUAL_SEQ = 1024
_EPSILON = 1e-9
"""The adapter's tolerance on keep_prob: within it of 1 nothing is dropped, of 0 everything (cpp:34, 66-75)."""


def _cpp(line: int | str) -> str:
    return f"{_CPP}:{line}"


def _shapes(c: Any) -> tuple[tuple[int | None, int, int, int], ...]:
    """(B, N, S, D) of query, key and value as the adapter reads them (cpp:1411-1453); B is None for TND.

    BSH and SBH split H into heads of D = Hq / head_num: key has Hk / D heads, value's D is Hv over those.
    """
    layout, q, k, v = c.input_layout, c.query, c.key, c.value
    if layout in ("BSH", "SBH"):
        b, s = (0, 1) if layout == "BSH" else (1, 0)
        d = q.shape[2] // c.head_num
        kv_heads = k.shape[2] // d if d else 0
        return (
            (q.shape[b], c.head_num, q.shape[s], d),
            (k.shape[b], kv_heads, k.shape[s], d),
            (v.shape[b], kv_heads, v.shape[s], v.shape[2] // kv_heads if kv_heads else 0),
        )
    if layout == "TND":
        return tuple((None, t.shape[1], t.shape[0], t.shape[2]) for t in (q, k, v))
    s, n = (1, 2) if layout == "BSND" else (2, 1)
    return tuple((t.shape[0], t.shape[n], t.shape[s], t.shape[3]) for t in (q, k, v))


def _hidden_splits(c: Any) -> bool:
    """BSH/SBH: Hq splits into head_num heads, Hk into heads of that D, Hv over key's heads."""
    if c.input_layout not in ("BSH", "SBH"):
        return True
    hq, hk, hv = c.query.shape[2], c.key.shape[2], c.value.shape[2]
    d = hq // c.head_num
    return hq % c.head_num == 0 and d > 0 and hk % d == 0 and hk > 0 and hv % (hk // d) == 0


def _is_int_list(values: Any) -> bool:
    return isinstance(values, list | tuple) and all(isinstance(x, int) and not isinstance(x, bool) for x in values)


def _effective(ends: list[int] | tuple[int, ...]) -> list[int]:
    """The cumulative ends without the trailing zeros that skip batches (_op_plugin_docs.py:1695)."""
    ends = list(ends)
    while len(ends) > 1 and ends[-1] == 0:
        ends.pop()
    return ends


def _cumulative_to(ends: list[int] | tuple[int, ...], total: int) -> bool:
    """Non-negative, non-decreasing cumulative ends (trailing zeros allowed) whose last one is `total`."""
    kept = _effective(ends)
    return all(x >= 0 for x in kept) and all(a <= b for a, b in itertools.pairwise(kept)) and kept[-1] == total


def _lengths(ends: list[int]) -> list[int]:
    return [end - start for start, end in zip([0, *ends[:-1]], ends, strict=True)]


def _segment_lengths(c: Any) -> list[tuple[int, int]]:
    """(Sq, Skv) of each batch: B times (Sq, Skv) for a dense layout, each actual_seq segment for TND."""
    q, k, _ = _shapes(c)
    if c.input_layout != "TND":
        return [(q[2], k[2])] * q[0]
    q_ends, kv_ends = _effective(c.actual_seq_qlen), _effective(c.actual_seq_kvlen)
    count = max(len(q_ends), len(kv_ends))
    q_ends += [q_ends[-1]] * (count - len(q_ends))
    kv_ends += [kv_ends[-1]] * (count - len(kv_ends))
    return list(zip(_lengths(q_ends), _lengths(kv_ends), strict=True))


def _mask_shape_fits(c: Any) -> bool:
    """Modes 0 and 1: BNSS, B1SS, 11SS or SS; varlen SS only, as maxSq x maxSkv (_op_plugin_docs.py:1610)."""
    shape = tuple(c.atten_mask.shape)
    if c.input_layout == "TND":
        lengths = _segment_lengths(c)
        return shape == (max(sq for sq, _ in lengths), max(skv for _, skv in lengths))
    (b, n, sq, _), (_, _, skv, _), _ = _shapes(c)
    return shape in ((b, n, sq, skv), (b, 1, sq, skv), (1, 1, sq, skv), (sq, skv))


def _is_compressed_triu(mask: torch.Tensor) -> bool:
    upper = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=mask.device).triu(1)
    return bool(torch.equal(mask.bool(), upper))


def _band_intersects(c: Any) -> bool:
    """pre/next leave a band: pre + next >= 0, a negative next above -Skv, a negative pre above -Sq."""
    if c.atten_mask is None or c.sparse_mode not in _BANDED_MODES:
        return True
    pre, nxt = c.pre_tockens, c.next_tockens
    lengths = _segment_lengths(c)
    max_sq, max_skv = max(sq for sq, _ in lengths), max(skv for _, skv in lengths)
    return pre + nxt >= 0 and (nxt >= 0 or -nxt < max_skv) and (pre >= 0 or -pre < max_sq)


def _varlen_rows_attend(c: Any) -> bool:
    """TND: every query row of every segment keeps at least one key (no all-masked row, no empty key segment)."""
    if c.input_layout != "TND":
        return True
    host = copy.copy(c)
    host.atten_mask = None if c.atten_mask is None else c.atten_mask.cpu()
    for index, (sq, skv) in enumerate(_segment_lengths(c)):
        if sq == 0:
            continue
        if skv == 0:
            return False
        masked = _segment_mask(host, index, sq, skv)
        if masked is not None and bool(masked.all(-1).any()):
            return False
    return True


def _sink_fits(c: Any) -> bool:
    return c.sink is None or (c.sink.dtype == torch.float32 and tuple(c.sink.shape) == (c.head_num,))


NPU_FUSION_ATTENTION = rules(
    "npu_fusion_attention",
    (
        "actual-seq-ints",
        "actual_seq_qlen and actual_seq_kvlen are lists of host ints (int[]), not tensors",
        functions_yaml(6249),
        lambda c: all(x is None or _is_int_list(x) for x in (c.actual_seq_qlen, c.actual_seq_kvlen)),
        "the graph-mode npu_fusion_attention_v3 takes tensors, and requires them on the host too (cpp:180)",
    ),
    ("head-num", "head_num > 0", _cpp(1348), lambda c: c.head_num > 0),
    (
        "rank",
        "query, key and value have 3 or 4 dims",
        _cpp("1349-1357"),
        lambda c: all(t.dim() in (3, 4) for t in (c.query, c.key, c.value)),
    ),
    ("keep-prob", "keep_prob lies in (0, 1]", _cpp(1358), lambda c: 0 < c.keep_prob <= 1),
    (
        "layout",
        "input_layout is BSH, SBH, BSND, BNSD or TND",
        _cpp("1396-1399"),
        lambda c: c.input_layout in LAYOUTS,
        "the adapter upper-cases the layout only after its TND checks (cpp:1376, 1393-1395), so a lower-case 'tnd' "
        "skips them: the ledger takes the documented upper-case names (_op_plugin_docs.py:1607)",
    ),
    (
        "softmax-layout",
        "softmax_layout is '' or 'TND', and 'TND' only with input_layout TND",
        _cpp("1365-1374"),
        lambda c: c.softmax_layout == "" or (c.softmax_layout == "TND" and c.input_layout == "TND"),
    ),
    (
        "sparse-mode",
        "sparse_mode lies in [0, 5) or (5, 8] for TND, in [0, 6] otherwise",
        _cpp("1376-1391"),
        lambda c: (
            (0 <= c.sparse_mode <= 8 and c.sparse_mode != 5) if c.input_layout == "TND" else 0 <= c.sparse_mode <= 6
        ),
    ),
    (
        "actual-seq-tnd",
        "TND takes actual_seq_qlen and actual_seq_kvlen, non-empty and of equal length",
        _cpp("1384-1386"),
        lambda c: (
            c.input_layout != "TND"
            or (
                bool(c.actual_seq_qlen)
                and bool(c.actual_seq_kvlen)
                and len(c.actual_seq_qlen) == len(c.actual_seq_kvlen)
            )
        ),
    ),
    (
        "actual-seq-tnd-only",
        "only TND takes actual_seq_qlen and actual_seq_kvlen",
        op_doc(1607),
        lambda c: c.input_layout == "TND" or (not c.actual_seq_qlen and not c.actual_seq_kvlen),
        "inferred: with another layout the lists route the call to the VarLen kernel (cpp:1541), which takes TND only "
        f"({_VARLEN_DOC.split(':', 1)[1]}:411)",
    ),
    ("dtype", "query is float16, bfloat16 or float32", op_doc(1603), lambda c: c.query.dtype in FLOAT_DTYPES),
    (
        "same-dtype",
        "query, key and value have one dtype",
        op_doc(1676),
        lambda c: c.key.dtype == c.query.dtype and c.value.dtype == c.query.dtype,
    ),
    (
        "layout-rank",
        "query, key and value have the layout's dims: 3 for BSH, SBH and TND, 4 for BSND and BNSD",
        op_doc(1607),
        lambda c: all(t.dim() == _RANK[c.input_layout] for t in (c.query, c.key, c.value)),
    ),
    (
        "hidden-split",
        "BSH/SBH: query's H splits into head_num heads of D, key's H into whole heads of that D, value's H over key's "
        "heads",
        _cpp("1411-1430"),
        _hidden_splits,
        "inferred from how the adapter reads D = H / head_num, Nkv = Hk / D and Dv = Hv / Nkv",
    ),
    (
        "head-num-matches",
        "head_num is query's N",
        op_doc(1606),
        lambda c: _shapes(c)[0][1] == c.head_num,
        "inferred: the adapter sizes the output from query's N and softmax_max/softmax_sum from head_num "
        "(cpp:1431-1452, 1490-1498)",
    ),
    (
        "batch",
        "query, key and value have one B",
        op_doc(1680),
        lambda c: len({shape[0] for shape in _shapes(c)}) == 1,
    ),
    (
        "kv-shape",
        "key and value have one shape but for D",
        f"{_SCORE_DOC}:385",
        lambda c: _shapes(c)[1][:3] == _shapes(c)[2][:3],
        "_op_plugin_docs.py:1679 says one shape, D included, which Dk >= Dv (line 1681) contradicts: the ledger takes "
        "aclnnFlashAttentionScore's 'but for D'",
    ),
    (
        "head-dim",
        "Dq = Dk >= Dv, each 1 to 768",
        op_doc(1681),
        lambda c: (lambda q, k, v: q[3] == k[3] >= v[3] >= 1 and q[3] <= 768)(*_shapes(c)),
    ),
    (
        "heads",
        "Nq is 1 to 256 and a whole multiple of Nkv (GQA/MQA)",
        op_doc(1686),
        lambda c: (lambda q, k, v: 1 <= q[1] <= 256 and k[1] >= 1 and q[1] % k[1] == 0)(*_shapes(c)),
    ),
    (
        "batch-limit",
        "B is 1 to 2M (dense layouts)",
        op_doc(1680),
        lambda c: c.input_layout == "TND" or 1 <= _shapes(c)[0][0] <= 2 * _M,
    ),
    (
        "seq-limit",
        "Sq and Skv are 1 to 1M (dense layouts)",
        op_doc(1682),
        lambda c: c.input_layout == "TND" or all(1 <= shape[2] <= _M for shape in _shapes(c)),
    ),
    (
        "tokens-limit",
        "TND: query's and key's T are 1 to 1M",
        op_doc(1684),
        lambda c: c.input_layout != "TND" or all(1 <= shape[2] <= _M for shape in _shapes(c)),
    ),
    (
        "actual-seq-count",
        "TND: actual_seq_qlen has at most 1K entries (varlen)",
        op_doc(1694),
        lambda c: c.input_layout != "TND" or len(c.actual_seq_qlen) <= _MAX_ACTUAL_SEQ,
        f"'1 to 2K, varlen at most 1K'; aclnnFlashAttentionVarLenScore ({_VARLEN_DOC.split(':', 1)[1]}:422) says "
        "2K, 1K with prefix: the stricter 1K holds (B varlen 1 to 2K, _op_plugin_docs.py:1680, is then implied)",
    ),
    (
        "actual-seq-cumulative",
        "TND: each actual_seq list holds cumulative ends with no leading 0 (non-decreasing, trailing zeros skip "
        "batches) and its last non-zero end is the tensor's T",
        op_doc("1619-1622"),
        lambda c: (
            c.input_layout != "TND"
            or (
                _cumulative_to(c.actual_seq_qlen, c.query.shape[0])
                and _cumulative_to(c.actual_seq_kvlen, c.key.shape[0])
            )
        ),
        "zero-length batches and trailing zeros: _op_plugin_docs.py:1694-1695",
    ),
    (
        "atten-mask-dtype",
        "atten_mask is bool or uint8 (1 = masked)",
        op_doc(1610),
        lambda c: c.atten_mask is None or c.atten_mask.dtype in _MASK_DTYPES,
    ),
    (
        "atten-mask-compressed",
        "sparse_mode 2, 3, 4, 7 and 8 take the compressed 2048 x 2048 mask",
        op_doc("1643-1645"),
        lambda c: (
            c.atten_mask is None
            or c.sparse_mode not in _COMPRESSED_MODES
            or tuple(c.atten_mask.shape) == (COMPRESSED_MASK_SIZE,) * 2
        ),
        "modes 7 and 8: lines 1649 and 1655",
    ),
    (
        "atten-mask-triu",
        "the compressed mask is masked exactly above its diagonal (triu(ones(2048, 2048), 1))",
        op_doc(1689),
        lambda c: c.atten_mask is None or c.sparse_mode not in _COMPRESSED_MODES or _is_compressed_triu(c.atten_mask),
        "the docs: another mask gives wrong results, silently; the emulation refuses it",
    ),
    (
        "atten-mask-shape",
        "sparse_mode 0 and 1: atten_mask is BNSS, B1SS, 11SS or SS; for TND SS only, as maxSq x maxSkv",
        op_doc(1610),
        lambda c: c.atten_mask is None or c.sparse_mode not in (0, 1) or _mask_shape_fits(c),
    ),
    (
        "causal-rows",
        "sparse_mode 3 (with a mask): each batch has Sq <= Skv",
        f"{_VARLEN_DOC}:421",
        lambda c: c.atten_mask is None or c.sparse_mode != 3 or all(sq <= skv for sq, skv in _segment_lengths(c)),
        "_op_plugin_docs.py:1617 instead says the op handles the invalid rows of mode 3 with Sq > Skv itself: the "
        "stricter rule holds, for every layout",
    ),
    (
        "band",
        "sparse_mode 0 and 4 (with a mask): pre_tockens and next_tockens leave a band (pre + next >= 0; a negative "
        "next above -Skv, a negative pre above -Sq)",
        op_doc("1640-1645"),
        _band_intersects,
        "aclnnFlashAttentionScore: 'band场景，preTokens和nextTokens之间必须要有交集' "
        f"({_SCORE_DOC.split(':', 1)[1]}:398)",
    ),
    (
        "varlen-rows",
        "TND: no query row has every key masked (nor an empty key segment)",
        op_doc(1685),
        _varlen_rows_attend,
        f"also {_VARLEN_DOC.split(':', 1)[1]}:420; the empty key segment (every key of its rows missing) is inferred",
    ),
    ("padding-mask", "padding_mask is None (not supported)", op_doc(1609), lambda c: c.padding_mask is None),
    (
        "pse-modes",
        "sparse_mode 7 and 8 take no pse",
        op_doc(1692),
        lambda c: c.pse is None or c.sparse_mode not in (7, 8),
    ),
    (
        "prefix-batch",
        "prefix (sparse_mode 5, 6): B is at most 32",
        op_doc(1693),
        lambda c: c.prefix is None or c.input_layout == "TND" or _shapes(c)[0][0] <= 32,
    ),
    ("sink", "sink is float32 [head_num]", f"{_API_DOC}:137", _sink_fits),
    (
        "sink-cann",
        "sink needs CANN 8.5 or later",
        f"{_API_DOC}:137",
        lambda c: c.sink is None or cann_at_least((8, 5)),
        "and torch_npu 7.3.0 or later: the emulated torch_npu is the 2.13.0 wheel, whose schema has sink; the "
        "adapter raises when CANN lacks aclnnFlashAttentionScoreV3 / VarLenScoreV5 (cpp:1513-1533)",
    ),
    (
        "softmax-layout-cann",
        "softmax_layout 'TND' needs CANN 8.3 or later",
        f"{_API_DOC}:136",
        lambda c: c.softmax_layout != "TND" or cann_at_least((8, 3)),
        "and torch_npu 7.2.0 or later, which the emulated 2.13.0 wheel is",
    ),
)
"""npu_fusion_attention's limits on Atlas A2 training (_op_plugin_docs.py:1706-1707). Documented but not checkable
here: training only, no graph mode or aclgraph (lines 1674-1675)."""

NPU_FUSION_ATTENTION_GRAD = rules(
    "npu_fusion_attention_grad",
    (
        "rank",
        "query, key, value and dy have 3 or 4 dims",
        _cpp("1268-1279"),
        lambda c: all(t.dim() in (3, 4) for t in (c.query, c.key, c.value, c.dy)),
    ),
    ("keep-prob", "keep_prob lies in (0, 1]", _cpp(1280), lambda c: 0 < c.keep_prob <= 1),
    (
        "sparse-mode",
        "sparse_mode lies in [0, 5) or (5, 8] for TND, in [0, 6] otherwise",
        _cpp("1286-1298"),
        lambda c: (
            (0 <= c.sparse_mode <= 8 and c.sparse_mode != 5) if c.input_layout == "TND" else 0 <= c.sparse_mode <= 6
        ),
    ),
    ("layout", "input_layout is BSH, SBH, BSND, BNSD or TND", _cpp("1302-1305"), lambda c: c.input_layout in LAYOUTS),
    (
        "dy",
        "dy has attention_in's shape and dtype (the forward's attention_out and its gradient)",
        f"{OP_PLUGIN}:op_plugin/config/derivatives.yaml:149",
        lambda c: (
            c.attention_in is not None
            and c.dy.shape == c.attention_in.shape
            and c.dy.dtype == c.attention_in.dtype == c.query.dtype
        ),
        "inferred: the node hands the grad result0 and its gradient",
    ),
    (
        "softmax-stats",
        "softmax_max and softmax_sum are the forward's float32 [B, N, Sq, 8] (TND: [T, N, 8])",
        _cpp("1489-1499"),
        lambda c: all(
            s is not None and s.dtype == torch.float32 and tuple(s.shape) == _softmax_shape(c)
            for s in (c.softmax_max, c.softmax_sum)
        ),
        "inferred: the node hands the grad result1 and result2 (derivatives.yaml:149)",
    ),
)
"""npu_fusion_attention_grad's limits: the adapter's checks (cpp:1268-1305) and what the autograd node hands it."""

LEDGER = NPU_FUSION_ATTENTION + NPU_FUSION_ATTENTION_GRAD


def _softmax_shape(c: Any) -> tuple[int, ...]:
    q, _, _ = _shapes(c)
    if c.input_layout == "TND":
        return (q[2], c.head_num, 8)
    return (q[0], c.head_num, q[2], 8)


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


def _segment_mask(c: Any, index: int, sq: int, skv: int) -> torch.Tensor | None:
    """The masked positions (True) of batch `index`'s [1 or N, Sq, Skv] scores, or None when nothing is masked.

    Without atten_mask nothing is (every mode computes full attention then: _op_plugin_docs.py:1689). On the host:
    `c.atten_mask` is a host tensor.
    """
    if c.atten_mask is None:
        return None
    rows = torch.arange(sq).unsqueeze(-1)
    cols = torch.arange(skv)
    if c.sparse_mode in (2, 3, 4):
        shift = 0 if c.sparse_mode == 2 else skv - sq
        if c.sparse_mode == 4:  # the band, its origin at the bottom-right
            masked = (cols > rows + shift + c.next_tockens) | (cols < rows + shift - c.pre_tockens)
        else:
            masked = cols > rows + shift
        return masked.unsqueeze(0)
    mask = c.atten_mask.bool()
    # An SS mask is read from its top-left corner (for TND each segment's Sq x Skv of maxSq x maxSkv: inferred).
    mask = mask[:sq, :skv].unsqueeze(0) if mask.dim() == 2 else mask[index if mask.shape[0] > 1 else 0]
    if c.sparse_mode == 0:  # and the band of pre/next, from the top-left (the golden's triu/tril, lines 1749-1750)
        mask = mask | (cols > rows + c.next_tockens) | (cols < rows - c.pre_tockens)
    return mask


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
