"""The limits of the emulated MoE ops (`npu_moe.py`): each op's `Rule`s, as Huawei's documentation states them.

`LEDGER` lists them all, in the order of the ops: npu_grouped_matmul (the call, then its single-tensor form),
npu_moe_token_permute and its backward, npu_moe_token_unpermute and its backward. `npu_moe.py` enforces each set on
its op's calls and exports `LEDGER` as its own; the constraint ledger's conventions are `ledger.py`'s.
"""

from __future__ import annotations

import torch

from ..ledger import OP_PLUGIN, OPS_TRANSFORMER, op_doc, rules

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
QUANTISED_DTYPES = (torch.int8, torch.int32, torch.int16, torch.quint4x2)
"""x or weight dtypes of the quantised grouped-matmul forms (int4 travels as int32): documented, not emulated."""
_SORT_LIMIT = 16777215
_MAX_TOP_K = 512
_MAX_GROUPS = 1024
_MAX_LIST = 128
_INNER_LIMIT = 65536

_GMM_API_DOC = f"{OP_PLUGIN}:docs/zh/custom_APIs/torch_npu/torch_npu-npu_grouped_matmul.md"
_GMM_ADAPTER = f"{OP_PLUGIN}:op_plugin/ops/opapi/GroupedMatmulKernelNpuOpApi.cpp"
_GMM_README = f"{OPS_TRANSFORMER}:gmm/grouped_matmul/README.md"
_OUTPUT_SIZE = f"{OP_PLUGIN}:op_plugin/utils/KernelNpuOutputSize.cpp"
_PERMUTE_README = f"{OPS_TRANSFORMER}:moe/moe_token_permute/README.md"
_PERMUTE_TILING = f"{OPS_TRANSFORMER}:moe/moe_token_permute/op_host/moe_token_permute_tiling.cpp"
_PERMUTE_GRAD_README = f"{OPS_TRANSFORMER}:moe/moe_token_permute_grad/README.md"
_PERMUTE_GRAD_DEF = f"{OPS_TRANSFORMER}:moe/moe_token_permute_grad/op_host/moe_token_permute_grad_def.cpp"
_UNPERMUTE_README = f"{OPS_TRANSFORMER}:moe/moe_token_unpermute/README.md"
_UNPERMUTE_ADAPTER = f"{OP_PLUGIN}:op_plugin/ops/opapi/MoeTokenUnpermuteKernelNpuOpApi.cpp"
_UNPERMUTE_GRAD_README = f"{OPS_TRANSFORMER}:moe/moe_token_unpermute_grad/README.md"
_UNPERMUTE_GRAD_DEF = f"{OPS_TRANSFORMER}:moe/moe_token_unpermute_grad/op_host/moe_token_unpermute_grad_def.cpp"
_UNPERMUTE_GRAD_TILING = f"{OPS_TRANSFORMER}:moe/moe_token_unpermute_grad/op_host/moe_token_unpermute_grad_tiling.cpp"

_STALE_MOE_DOCSTRING = (
    "narrower than everything else Huawei publishes on the op: CANN's kernel definition and README, and "
    "op-plugin's later API pages (torch_npu-npu_moe_token_permute.md at e159ef6, torch_npu-npu_moe_token_"
    "unpermute.md at 09fca6f) list float16, bfloat16 and float32 on Atlas A2/A3, as op-plugin's tests "
    "(test_unpermute_grad_mixed_dtype: float32 probs) run them: the ledger takes CANN's list"
)


def _transposed(t: torch.Tensor) -> bool:
    """Whether `t` is stored with its last two dims swapped, as op-plugin's adapter tells.

    The adapter's test is `is_weight_trans`: stride(-2) == 1 and stride(-1) == size(-2); a contiguous tensor also
    counts when that holds (a dim of size 1 leaves it open).
    """
    return t.dim() >= 2 and t.stride(-2) == 1 and t.stride(-1) == t.shape[-2]


def _strictly_transposed(t: torch.Tensor) -> bool:
    """Whether `t` is transposed and not contiguous.

    That is a layout nothing but a transpose gives (the doc: 'transposed means not contiguous').
    """
    return _transposed(t) and not t.is_contiguous()


def _innermost(t: torch.Tensor) -> int:
    """The size of the stored last dim: the doc's 'last dim' (K or N, or M or K when transposed)."""
    return t.shape[-2] if _transposed(t) else t.shape[-1]


def group_sizes(group_list: torch.Tensor, group_list_type: int) -> list[int]:
    values = group_list.detach().cpu()
    return (values if group_list_type == 1 else torch.diff(values, prepend=values.new_zeros(1))).tolist()


def _group_total(group_list: torch.Tensor, group_list_type: int) -> int:
    """The size of the grouped axis group_list covers: its last value (cumsum) or its sum (counts)."""
    values = group_list.detach().cpu()
    return int(values.sum()) if group_list_type == 1 else (int(values[-1]) if values.numel() else 0)


def _group_list_valid(group_list: torch.Tensor, group_list_type: int) -> bool:
    values = group_list.detach().cpu()
    if bool((values < 0).any()):
        return False
    return group_list_type == 1 or bool((values[1:] >= values[:-1]).all())


def _k_split(c) -> bool:
    return c.group_type == 2


GMM_CALL = rules(
    "npu_grouped_matmul",
    (
        "group-type-given",
        "group_type is given (the adapter: 'Requires manual passing group_type')",
        f"{_GMM_ADAPTER}:129",
        lambda c: c.group_type is not None,
    ),
    (
        "group-type",
        "group_type is -1 (no split), 0 (M axis split) or 2 (K axis split)",
        f"{_GMM_API_DOC}:151",
        lambda c: c.group_type in (-1, 0, 2),
        "the docstring (_op_plugin_docs.py:5885) lists -1 and 0 for Atlas A2; the API page of the same commit, "
        "CANN's README (gmm/grouped_matmul/README.md:299) and the adapter (GroupedMatmulKernelNpuOpApi.cpp:132) "
        "take 2 as well: the ledger takes the newer page",
    ),
    (
        "split-item",
        "split_item is 0, 1, 2 or 3",
        f"{_GMM_ADAPTER}:35",
        lambda c: (c.split_item or 0) in (0, 1, 2, 3),
    ),
    (
        "lists-given",
        "x and weight each hold a tensor",
        f"{_GMM_ADAPTER}:33",
        lambda c: len(c.x) > 0 and len(c.weight) > 0,
    ),
    (
        "list-length",
        "x and weight each hold at most 128 tensors",
        f"{_GMM_API_DOC}:70",
        lambda c: len(c.x) <= _MAX_LIST and len(c.weight) <= _MAX_LIST,
        "weight's limit: torch_npu-npu_grouped_matmul.md:81",
    ),
    (
        "group-list-dtype",
        "a tensor group_list is int64",
        f"{_GMM_API_DOC}:130",
        lambda c: not isinstance(c.group_list, torch.Tensor) or c.group_list.dtype == torch.int64,
    ),
    (
        "group-list-type",
        "group_list_type is 0 (cumsum), 1 (counts) or 2 ([E, 2] pairs)",
        f"{_GMM_API_DOC}:157",
        lambda c: (c.group_list_type or 0) in (0, 1, 2),
    ),
    (
        "group-list-type-pairs",
        "group_list_type 2 only with int8 x and weight and group_type 0",
        f"{_GMM_API_DOC}:161",
        lambda c: (
            (c.group_list_type or 0) != 2
            or (c.group_type == 0 and c.x[0].dtype == torch.int8 and c.weight[0].dtype == torch.int8)
        ),
    ),
    (
        "act-type",
        "act_type is 0 (none), 1 (relu), 2 (gelu_tanh), 4 (fast_gelu) or 5 (silu)",
        f"{_GMM_API_DOC}:167",
        lambda c: (c.act_type or 0) in (0, 1, 2, 4, 5),
        "the page's range is 0-5 (line 168) with 3 'not supported yet' (line 167)",
    ),
    (
        "act-type-quantised",
        "an activation (act_type other than 0) only in the per-token quantised form (per_token_scale given)",
        f"{_GMM_API_DOC}:265",
        lambda c: (c.act_type or 0) == 0 or "per_token_scale" in c.quantisation,
        "CANN's README (gmm/grouped_matmul/README.md:286) adds the dequantising form; the stricter page holds",
    ),
    (
        "k-split-plain",
        "group_type 2 takes no bias and no quantisation arguments",
        f"{_GMM_README}:299",
        lambda c: not _k_split(c) or (c.bias is None and not c.quantisation),
        "quantised and pseudo-quantised forms only with group_type -1 and 0: torch_npu-npu_grouped_matmul.md:264",
    ),
    (
        "float32-single",
        "float32 x only with one x, one weight and one y (split_item 2 or 3)",
        f"{_GMM_API_DOC}:226",
        lambda c: (
            c.x[0].dtype != torch.float32 or (len(c.x) == 1 and len(c.weight) == 1 and (c.split_item or 0) in (2, 3))
        ),
    ),
    (
        "output-dtype",
        "output_dtype is None or x's dtype when x is float16, bfloat16 or float32 (no quantisation)",
        f"{_GMM_API_DOC}:224",
        lambda c: c.x[0].dtype not in _FLOATS or c.output_dtype in (None, c.x[0].dtype),
        "the non-quantised rows of the dtype table (lines 224-226)",
    ),
    (
        "tuning-config",
        "tuning_config only in the quantised int8 forms",
        f"{_GMM_API_DOC}:194",
        lambda c: c.tuning_config is None or c.x[0].dtype == torch.int8,
        "the page restricts its use to quantised int8 x with one tensor each; the emulation enforces that restriction",
    ),
)
"""npu_grouped_matmul's limits on any call (checked before the forms that are not emulated are turned away)."""

GMM_SINGLE = rules(
    "npu_grouped_matmul",
    (
        "dtypes",
        "x is float16, bfloat16 or float32, and weight has x's dtype",
        f"{_GMM_API_DOC}:224",
        lambda c: c.x.dtype in _FLOATS and c.weight.dtype == c.x.dtype,
        "the non-quantised rows of the dtype table (lines 224-226; CANN README gmm/grouped_matmul/README.md:234)",
    ),
    (
        "group-list-given",
        "group_list is given (group_type 0 and 2, one x, one weight)",
        f"{_GMM_API_DOC}:270",
        lambda c: c.group_list is not None,
        "group_type 2: CANN README gmm/grouped_matmul/README.md:299",
    ),
    (
        "split-item-single",
        "split_item is 2 or 3 (one y) with one x and one weight",
        f"{_GMM_API_DOC}:270",
        lambda c: (c.split_item or 0) in (2, 3),
        "group_type 2: CANN README gmm/grouped_matmul/README.md:299",
    ),
    (
        "ranks",
        "x is 2-D; weight is 3-D [E, K, N] with group_type 0, 2-D [K, N] with group_type 2",
        f"{_GMM_API_DOC}:270",
        lambda c: c.x.dim() == 2 and c.weight.dim() == (2 if _k_split(c) else 3),
        "group_type 2: CANN README gmm/grouped_matmul/README.md:299",
    ),
    (
        "group-list-rank",
        "group_list is 1-D",
        f"{_GMM_API_DOC}:132",
        lambda c: c.group_list.dim() == 1,
    ),
    (
        "groups",
        "at most 1024 groups",
        f"{_GMM_API_DOC}:270",
        lambda c: c.group_list.numel() <= _MAX_GROUPS,
        "group_type 2: CANN README gmm/grouped_matmul/README.md:299",
    ),
    (
        "group-list-length",
        "a counts group_list (group_list_type 1) does not have length 1",
        f"{_GMM_API_DOC}:137",
        lambda c: (c.group_list_type or 0) != 1 or c.group_list.numel() != 1,
        "also the docstring, _op_plugin_docs.py:5875",
    ),
    (
        "group-count",
        "with group_type 0, group_list has one entry per expert of the 3-D weight ([E, K, N]: E entries)",
        f"{_GMM_API_DOC}:132",
        lambda c: _k_split(c) or c.group_list.numel() == c.weight.shape[0],
        "the adapter counts a 3-D weight's E as the weight list's length (GroupedMatmulKernelNpuOpApi.cpp:184)",
    ),
    (
        "shapes",
        "x's and weight's shared axis agree: x [M, K] and weight [E, K, N] (group_type 0), x [M, K] and weight "
        "[K, N] with K split (group_type 2)",
        f"{_GMM_API_DOC}:14",
        lambda c: c.x.shape[1] == c.weight.shape[0 if _k_split(c) else 1],
    ),
    (
        "inner-limit",
        "the stored last dim of x and of weight is below 65536 (K or N; M or K when transposed)",
        f"{_GMM_API_DOC}:190",
        lambda c: max(_innermost(c.x), _innermost(c.weight)) < _INNER_LIMIT,
        "CANN README gmm/grouped_matmul/README.md:251",
    ),
    (
        "x-layout",
        "x is not transposed (group_type 0); x is transposed, a [K, M] tensor seen as [M, K] (group_type 2)",
        f"{_GMM_README}:299",
        lambda c: _transposed(c.x) if _k_split(c) else not _strictly_transposed(c.x),
        "group_type 0: torch_npu-npu_grouped_matmul.md:270",
    ),
    (
        "weight-layout",
        "with group_type 2, weight is not transposed",
        f"{_GMM_README}:299",
        lambda c: not _k_split(c) or not _strictly_transposed(c.weight),
    ),
    (
        "group-list-values",
        "group_list is non-negative, and non-decreasing as a cumsum (group_list_type 0)",
        f"{_GMM_API_DOC}:136",
        lambda c: _group_list_valid(c.group_list, c.group_list_type or 0),
        "counts: line 137",
    ),
    (
        "group-list-total",
        "the groups cover the split axis: the cumsum's last value or the counts' sum equals x's rows (group_type "
        "0), and is at most x's second dim (group_type 2)",
        f"{_GMM_API_DOC}:270",
        lambda c: (
            _group_total(c.group_list, c.group_list_type or 0) <= c.x.shape[1]
            if _k_split(c)
            else _group_total(c.group_list, c.group_list_type or 0) == c.x.shape[0]
        ),
        "CANN's README (gmm/grouped_matmul/README.md:296) lets group_type 0 cover fewer rows than x has; the "
        "stricter API page holds. group_type 2 has only the README (line 299): at most",
    ),
)
"""npu_grouped_matmul's limits on the emulated forms: one x, one weight, group_type 0 or 2, not quantised."""

PERMUTE = rules(
    "npu_moe_token_permute",
    (
        "tokens-rank",
        "tokens is 2-D [T, H]",
        op_doc(14295),
        lambda c: c.tokens.dim() == 2,
        "also the adapter's output size (KernelNpuOutputSize.cpp:2275)",
    ),
    (
        "indices-rank",
        "indices is 2-D [T, K], or 1-D [T] (K = 1)",
        f"{_OUTPUT_SIZE}:2280",
        lambda c: c.indices.dim() in (1, 2),
        "the docstring (_op_plugin_docs.py:14296) says 2-D; the adapter, the kernel's tiling and derivatives.yaml "
        "(line 333: indices.dim() == 1) take 1-D as K = 1, and op-plugin's later API page says so",
    ),
    (
        "tokens-dtype",
        "tokens is float16, bfloat16 or float32",
        f"{_PERMUTE_README}:60",
        lambda c: c.tokens.dtype in _FLOATS,
        "the docstring (_op_plugin_docs.py:14295) says bfloat16 only; " + _STALE_MOE_DOCSTRING + ". CANN's int8 "
        "is left out: the docstring never had it and the later API page gives it to Ascend 950 only",
    ),
    (
        "indices-dtype",
        "indices is int32 or int64",
        f"{_PERMUTE_README}:67",
        lambda c: c.indices.dtype in (torch.int32, torch.int64),
        "the docstring (_op_plugin_docs.py:14296) says int64 only; the kernel definition "
        "(moe_token_permute_def.cpp:32) and the later API page take int32 too",
    ),
    (
        "rows",
        "tokens and indices have the same number of rows (tokens)",
        f"{_PERMUTE_TILING}:314",
        lambda c: c.tokens.shape[0] == c.indices.shape[0],
    ),
    (
        "top-k",
        "top-k (indices' last dim) is at most 512",
        op_doc(14306),
        lambda c: (c.indices.shape[1] if c.indices.dim() == 2 else 1) <= _MAX_TOP_K,
        "also CANN README moe/moe_token_permute/README.md:105",
    ),
    (
        "indices-count",
        "indices has fewer than 16777215 elements",
        op_doc(14305),
        lambda c: c.indices.numel() < _SORT_LIMIT,
        "the kernel's tiling refuses it (moe_token_permute_tiling.cpp:339)",
    ),
    (
        "indices-values",
        "indices' values lie in [0, 16777215) (or are the int32/int64 minimum or maximum)",
        op_doc(14305),
        lambda c: _indices_in_range(c.indices),
        "outside that range the docstring says the sort is wrong rather than refused: the ledger refuses it",
    ),
    (
        "padded-mode",
        "padded_mode is False",
        op_doc(14298),
        lambda c: not c.padded_mode,
        "the kernel's tiling refuses True (moe_token_permute_tiling.cpp:296)",
    ),
)
"""npu_moe_token_permute's limits on Atlas A2/A3."""

PERMUTE_GRAD = rules(
    "npu_moe_token_permute_grad_v2",
    (
        "grad-rank",
        "grad_permuted_tokens is 2-D",
        f"{_OUTPUT_SIZE}:2332",
        lambda c: c.grad_permuted_tokens.dim() == 2,
    ),
    (
        "sorted-indices-rank",
        "sorted_indices is 1-D or 2-D",
        f"{_OUTPUT_SIZE}:2337",
        lambda c: c.sorted_indices.dim() in (1, 2),
    ),
    (
        "grad-dtype",
        "grad_permuted_tokens is bfloat16, float16 or float32",
        f"{_PERMUTE_GRAD_README}:46",
        lambda c: c.grad_permuted_tokens.dtype in _FLOATS,
    ),
    (
        "sorted-indices-dtype",
        "sorted_indices is int32",
        f"{_PERMUTE_GRAD_README}:53",
        lambda c: c.sorted_indices.dtype == torch.int32,
    ),
    (
        "tokens-dtype",
        "tokens_dtype (the gradient's dtype) is grad_permuted_tokens' dtype",
        f"{_PERMUTE_GRAD_DEF}:42",
        lambda c: c.tokens_dtype == c.grad_permuted_tokens.dtype,
        "the kernel pairs each input dtype with the same output dtype (lines 26 and 42)",
    ),
    ("top-k", "num_topK is 1 to 512", f"{_PERMUTE_GRAD_README}:83", lambda c: 1 <= c.num_topK <= _MAX_TOP_K),
    (
        "shape",
        "sorted_indices has tokens_size_0 * num_topK entries, each a row of grad_permuted_tokens",
        f"{_PERMUTE_GRAD_README}:16",
        lambda c: (
            c.sorted_indices.numel() == c.tokens_size_0 * c.num_topK
            and _indices_below(c.sorted_indices, c.grad_permuted_tokens.shape[0])
        ),
        "the formula: indexSelect(0, sortedIndices), then reshape(-1, numTopk, hiddenSize) (lines 16-20)",
    ),
)
"""npu_moe_token_permute_grad_v2's limits, on what derivatives.yaml hands it: `npu_moe_token_permute_grad_v2(grad,
result1, tokens.sym_size(0), tokens.scalar_type(), K, padded_mode)` (derivatives.yaml:333). The README's A3 line
"单卡通信量取值范围[2MB，100MB]" (a single card's communication volume) is a collective's limit copied into a local
op's page: not a rule."""

UNPERMUTE = rules(
    "npu_moe_token_unpermute",
    (
        "permuted-tokens-rank",
        "permuted_tokens is 2-D",
        op_doc(14342),
        lambda c: c.permuted_tokens.dim() == 2,
        "also the adapter's output size (KernelNpuOutputSize.cpp:2306)",
    ),
    (
        "sorted-indices-rank",
        "sorted_indices is 1-D",
        op_doc(14343),
        lambda c: c.sorted_indices.dim() == 1,
        "also KernelNpuOutputSize.cpp:2311",
    ),
    (
        "probs-rank",
        "probs, when given, is 2-D [T, K]",
        op_doc(14344),
        lambda c: c.probs is None or c.probs.dim() == 2,
        "also KernelNpuOutputSize.cpp:2300",
    ),
    (
        "permuted-tokens-dtype",
        "permuted_tokens is float16, bfloat16 or float32",
        f"{_UNPERMUTE_README}:65",
        lambda c: c.permuted_tokens.dtype in _FLOATS,
        "the docstring (_op_plugin_docs.py:14342) says bfloat16 only; " + _STALE_MOE_DOCSTRING,
    ),
    (
        "sorted-indices-dtype",
        "sorted_indices is int32",
        f"{_UNPERMUTE_README}:72",
        lambda c: c.sorted_indices.dtype == torch.int32,
        "the docstring (_op_plugin_docs.py:14343) says int64, which its own example (line 14375), npu_moe_token_"
        "permute's output and the kernel definition (moe_token_unpermute_def.cpp:38) contradict: no dtype meets "
        "both, the ledger takes int32",
    ),
    (
        "probs-dtype",
        "probs, when given, is float16, bfloat16 or float32 (whatever permuted_tokens' dtype)",
        f"{_UNPERMUTE_README}:79",
        lambda c: c.probs is None or c.probs.dtype in _FLOATS,
        "the docstring (_op_plugin_docs.py:14344) says bfloat16 only; " + _STALE_MOE_DOCSTRING,
    ),
    (
        "top-k",
        "top-k (probs' last dim, or 1 without probs) is 1 to 512",
        f"{_UNPERMUTE_README}:107",
        lambda c: 1 <= (c.probs.shape[1] if c.probs is not None else 1) <= _MAX_TOP_K,
        "at least 1: KernelNpuOutputSize.cpp:2318",
    ),
    (
        "shape",
        "sorted_indices has one entry per (token, k) of probs: T * K",
        op_doc(14343),
        lambda c: c.probs is None or c.sorted_indices.numel() == c.probs.numel(),
        "shapes (num_tokens*topK) and (num_tokens, topK): lines 14343-14344",
    ),
    (
        "rows",
        "permuted_tokens has one row per entry of sorted_indices (T * K rows)",
        op_doc(14342),
        lambda c: c.permuted_tokens.shape[0] == c.sorted_indices.numel(),
        "CANN's tiling reads the count from sorted_indices and would take fewer rows (num_out_tokens): the "
        "docstring's shape (num_tokens*topK, hidden_size) is stricter and holds",
    ),
    (
        "indices-values",
        "sorted_indices' values are rows of permuted_tokens",
        f"{_UNPERMUTE_README}:18",
        lambda c: _indices_below(c.sorted_indices, c.permuted_tokens.shape[0]),
        "the formula T[k] = T[S[k]]",
    ),
    (
        "padded-mode",
        "padded_mode is False",
        op_doc(14352),
        lambda c: not c.padded_mode,
        "also CANN README moe/moe_token_unpermute/README.md:85",
    ),
    (
        "restore-shape",
        "restore_shape is None",
        f"{_UNPERMUTE_README}:92",
        lambda c: c.restore_shape is None,
    ),
)
"""npu_moe_token_unpermute's limits on Atlas A2/A3."""

UNPERMUTE_GRAD = rules(
    "npu_moe_token_unpermute_grad_v2",
    (
        "grad-rank",
        "grad_unpermuted_tokens is 2-D",
        f"{_OUTPUT_SIZE}:2425",
        lambda c: c.grad_unpermuted_tokens.dim() == 2,
    ),
    (
        "sorted-indices-rank",
        "sorted_indices is 1-D",
        f"{_OUTPUT_SIZE}:2430",
        lambda c: c.sorted_indices.dim() == 1,
    ),
    (
        "probs-rank",
        "probs, when given, is 2-D",
        f"{_OUTPUT_SIZE}:2443",
        lambda c: c.probs is None or c.probs.dim() == 2,
    ),
    (
        "grad-dtype",
        "grad_unpermuted_tokens is float16, bfloat16 or float32",
        f"{_UNPERMUTE_GRAD_README}:67",
        lambda c: c.grad_unpermuted_tokens.dtype in _FLOATS,
    ),
    (
        "tokens-dtype",
        "permuted_tokens_dtype, and permuted_tokens when given, are grad_unpermuted_tokens' dtype",
        f"{_UNPERMUTE_GRAD_DEF}:38",
        lambda c: (
            c.permuted_tokens_dtype == c.grad_unpermuted_tokens.dtype
            and (c.permuted_tokens is None or c.permuted_tokens.dtype == c.grad_unpermuted_tokens.dtype)
        ),
        "the kernel pairs permuted_tokens (line 26), the gradient (line 38) and permuted_tokens' gradient (line 74) "
        "in one dtype",
    ),
    (
        "sorted-indices-dtype",
        "sorted_indices is int32",
        f"{_UNPERMUTE_GRAD_README}:74",
        lambda c: c.sorted_indices.dtype == torch.int32,
    ),
    (
        "probs-dtype",
        "probs, when given, is float16, bfloat16 or float32",
        f"{_UNPERMUTE_GRAD_README}:81",
        lambda c: c.probs is None or c.probs.dtype in _FLOATS,
    ),
    (
        "permuted-tokens-given",
        "permuted_tokens is given, unless probs is None on CANN 9.1 or later",
        f"{_UNPERMUTE_ADAPTER}:58",
        lambda c: c.permuted_tokens is not None or (c.probs is None and cann_version() >= (9, 1)),
        "probs' gradient reads permuted_tokens (moe/moe_token_unpermute_grad/README.md:18); the adapter keeps them "
        "for the backward exactly then",
    ),
    (
        "top-k",
        "top-k (probs' last dim, or 1) is at most 512",
        f"{_UNPERMUTE_GRAD_README}:116",
        lambda c: (c.probs.shape[1] if c.probs is not None else 1) <= _MAX_TOP_K,
        "the tiling refuses more (moe_token_unpermute_grad_tiling.cpp:319)",
    ),
    (
        "nonempty",
        "no size is 0: tokens (grad_unpermuted_tokens' rows), top-k, hidden size, permuted_tokens_size_0",
        f"{_UNPERMUTE_GRAD_TILING}:315",
        lambda c: (
            c.grad_unpermuted_tokens.shape[0] > 0
            and c.grad_unpermuted_tokens.shape[1] > 0
            and (c.probs is None or c.probs.shape[1] > 0)
            and c.permuted_tokens_size_0 > 0
        ),
    ),
    (
        "shape",
        "sorted_indices has one entry per (token, k): grad_unpermuted_tokens' rows times top-k, each below "
        "permuted_tokens_size_0",
        f"{_UNPERMUTE_GRAD_README}:22",
        lambda c: (
            c.sorted_indices.numel()
            == c.grad_unpermuted_tokens.shape[0] * (c.probs.shape[1] if c.probs is not None else 1)
            and _indices_below(c.sorted_indices, c.permuted_tokens_size_0)
            and (c.permuted_tokens is None or c.permuted_tokens.shape[0] == c.permuted_tokens_size_0)
        ),
        "the formula's reshape(-1, topK_num, hiddenSize) and permutedTokensGrad[sortedIndices[i]] (lines 22, 34)",
    ),
    (
        "padded-mode",
        "padded_mode is False",
        f"{_UNPERMUTE_GRAD_README}:87",
        lambda c: not c.padded_mode,
    ),
    (
        "restore-shape",
        "restore_shape is None",
        f"{_UNPERMUTE_GRAD_README}:94",
        lambda c: c.restore_shape is None,
    ),
)
"""npu_moe_token_unpermute_grad_v2's limits, on what derivatives.yaml hands it (line 338): `(grad, sorted_indices,
permuted_tokens.sym_size(0), permuted_tokens.scalar_type(), probs, padded_mode, restore_shape,
permuted_tokens_for_backward)`."""

LEDGER = GMM_CALL + GMM_SINGLE + PERMUTE + PERMUTE_GRAD + UNPERMUTE + UNPERMUTE_GRAD


def _indices_in_range(indices: torch.Tensor) -> bool:
    values = indices.detach().cpu()
    info = torch.iinfo(values.dtype)
    ok = ((values >= 0) & (values < _SORT_LIMIT)) | (values == info.min) | (values == info.max)
    return bool(ok.all())


def _indices_below(indices: torch.Tensor, rows: int) -> bool:
    values = indices.detach().cpu()
    return values.numel() == 0 or bool(((values >= 0) & (values < rows)).all())


def cann_version() -> tuple[int, int]:
    """(major, minor) of the CANN the emulated host reports ("9.1.0", "8.3.RC1")."""
    major, minor = torch.version.cann.split(".")[:2]  # type: ignore[attr-defined]
    return int(major), int(minor)
