"""The limits of the emulated npu_fusion_attention and its grad (`npu_fused_attention.py`), as Huawei documents them.

`LEDGER` lists npu_fusion_attention's rules, then npu_fusion_attention_grad's. `npu_fused_attention.py` enforces each
set on its op's calls and exports `LEDGER` as its own; the constraint ledger's conventions are `ledger.py`'s.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch

from ..checks import FLOAT_DTYPES, cann_at_least
from ..ledger import OP_PLUGIN, OPS_TRANSFORMER, functions_yaml, op_doc, rules

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


def _softmax_shape(c: Any) -> tuple[int, ...]:
    q, _, _ = _shapes(c)
    if c.input_layout == "TND":
        return (q[2], c.head_num, 8)
    return (q[0], c.head_num, q[2], 8)


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
