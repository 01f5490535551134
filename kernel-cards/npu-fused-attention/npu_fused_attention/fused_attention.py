"""transformers attention on torch_npu.npu_fusion_attention, the model's own eager attention where the op cannot run.

`fused_attention` has transformers' AttentionInterface signature. It gets query [B, Nq, Sq, D], key and value
[B, Nkv, Skv, D] (grouped-query heads not repeated: the op takes Nq a multiple of Nkv), and the mask
`masks.fused_attention_mask` built, and returns the output [B, Sq, Nq, Dv] and no weights. The forms it fuses:

- no padding, no packing: layout BSND, causal as `sparse_mode=3` (bottom-right aligned, so a query shorter than its
  keys, decode with a KV cache, sees what eager's mask lets it see), a sliding window W as the band
  `sparse_mode=4, pre_tockens=W-1, next_tockens=0` (transformers keeps key j for query i when j > i - W), both with
  the op's compressed 2048 x 2048 mask, never a dense one; a non-causal model with no mask: `sparse_mode=0`, no mask;
- attention sinks (`s_aux`, gpt-oss): the op's `sink`, one float32 logit per query head joining each row's softmax,
  from CANN 8.5 on (not on an Ascend 950, whose kernel torch_npu does not pass it);
- padding (a 2-D mask) or packed sequences (`cu_seq_lens_q/k`, or restarting `position_ids`): layout TND, the
  tokens gathered by host-computed indices and the sequences given as cumulative host lists; the output of a
  padding query is 0 (eager's is a value no later layer reads, as with transformers' flash attention).

The host lists cost one device-to-host copy per forward, which every layer shares: the masks of every layer type
(full and sliding) are read together (`host_reads`), or the `cu_seq_lens` tensors in one copy, and each mask's plan is
kept on the mask tensor itself (`PLAN_ATTRIBUTE`), so it lives exactly as long as the mask of this forward.
Unpadded, unpacked batches make no host sync at all.

Dropout is the op's `keep_prob` (its own random mask, so a training step's numbers differ from eager's as any two
dropout draws do); the explicit `scale` is the module's (the op's default is 1). The backward is torch_npu's own
autograd of the op (npu_fusion_attention_grad).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._fallbacks import ran_eager
from ._internals import modeling_global
from ._npu import FUSED_DTYPES, npu_unavailable_reason, soc_name, torch_npu
from .host_reads import host_copy
from .masks import MASK_FUNCTION_ATTRIBUTE

PLAN_ATTRIBUTE = "npu_fused_attention_plans"
"""The attribute of a mask (or cu_seq_lens) tensor holding its host plans, by (query length, key length)."""
COMPRESSED_MASK_SIZE = 2048
"""Sparse modes 2 to 4 take this compressed triu(1) mask (True: masked), whatever the sequence length."""
MAX_HEAD_DIM = 768
MAX_HEADS = 256
MAX_SEQUENCES = 1024
"""The most sequences one varlen (TND) call takes: "varlen max 1K" (torch_npu's npu_fusion_attention docs)."""
MAX_TOKENS = 1024 * 1024
"""S and T at most 1M (torch_npu's npu_fusion_attention docs)."""

_COMPRESSED_MASKS: dict[torch.device, torch.Tensor] = {}


def _compressed_causal_mask(query: torch.Tensor) -> torch.Tensor:
    """The op's compressed causal mask on query's device, made once per device and kind of tensor.

    Made outside inference mode, even when the first call is inside it (generate): an inference tensor could not be
    saved for a later training call's backward. A cached mask of another tensor type than the query's (a tracing
    mode's tensors, which cannot mix with the device's) is made anew."""
    mask = _COMPRESSED_MASKS.get(query.device)
    if mask is None or type(mask) is not type(query):
        with torch.inference_mode(False):
            square = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=query.device)
            mask = _COMPRESSED_MASKS[query.device] = square.triu(1)
    return mask


@dataclass(frozen=True)
class VarlenPlan:
    """How a padded or packed batch goes to the op as TND: the tokens kept, and the sequences' cumulative ends.

    `query_index` / `key_index`: the positions kept of the flattened [B * Sq] queries / [B * Skv] keys (None: all of
    them, in order); `query_ends` / `key_ends`: the cumulative lengths, no leading 0 (the op's actual_seq lists).
    `holes`: some row's tokens are not contiguous (a window would then measure distances the compacted tokens do not
    have); `overlaid`: the mask lets a token see a later one; `dense`: a padding mask with no padding (the dense form
    runs).
    """

    query_index: torch.Tensor | None
    key_index: torch.Tensor | None
    query_ends: tuple[int, ...]
    key_ends: tuple[int, ...]
    holes: bool = False
    overlaid: bool = False
    dense: bool = False


def _plan_of_padding(mask: torch.Tensor, q_len: int, device: torch.device) -> VarlenPlan:
    """The plan of a (B, Skv) bool padding mask, from its host copy (`host_reads`: one sync per forward)."""
    kept = host_copy(mask)
    kv_len = kept.shape[1]
    kept_queries = kept[:, kv_len - q_len :]
    key_counts, query_counts = kept.sum(1), kept_queries.sum(1)
    positions = torch.arange(kv_len)
    first = torch.where(kept, positions, kv_len).amin(1)
    last = torch.where(kept, positions, -1).amax(1)
    holes = bool(((key_counts > 0) & (last - first + 1 != key_counts)).any())
    dense = bool(kept.all())
    return VarlenPlan(
        query_index=None if dense else kept_queries.reshape(-1).nonzero().squeeze(1).to(device),
        key_index=None if dense else kept.reshape(-1).nonzero().squeeze(1).to(device),
        query_ends=tuple(query_counts.cumsum(0).tolist()),
        key_ends=tuple(key_counts.cumsum(0).tolist()),
        holes=holes,
        dense=dense,
    )


def _plan_of_sequence_numbers(numbers: torch.Tensor) -> VarlenPlan:
    """The plan of a (B, S) int32 tensor of sequence numbers (masks.fused_attention_mask), from its host copy."""
    host = host_copy(numbers)
    overlaid = bool((host < 0).any())
    flat = host.reshape(-1)
    # A sequence ends where the number changes, and at each row's end.
    changes = torch.ones_like(flat, dtype=torch.bool)
    changes[:-1] = flat[1:] != flat[:-1]
    changes[host.shape[1] - 1 :: host.shape[1]] = True
    ends = tuple((changes.nonzero().squeeze(1) + 1).tolist())
    return VarlenPlan(None, None, ends, ends, overlaid=overlaid)


def _plan_of_cu_seq_lens(cu_q: torch.Tensor, cu_k: torch.Tensor) -> VarlenPlan:
    """The plan of packed sequences given as cu_seq_lens (leading 0), read to the host in one copy."""
    both = torch.cat([cu_q.reshape(-1), cu_k.reshape(-1)]).cpu().tolist() if cu_k is not cu_q else None
    q_list = both[: cu_q.numel()] if both is not None else cu_q.reshape(-1).cpu().tolist()
    k_list = both[cu_q.numel() :] if both is not None else q_list
    return VarlenPlan(None, None, tuple(q_list[1:]), tuple(k_list[1:]))


def _cached_plan(holder: torch.Tensor, key: tuple, build) -> VarlenPlan:
    """The plan kept on `holder` (a mask of this forward) under `key`, built once (see the module docstring)."""
    plans = getattr(holder, PLAN_ATTRIBUTE, None)
    if plans is None:
        plans = {}
        setattr(holder, PLAN_ATTRIBUTE, plans)
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = build()
    return plan


def varlen_plan(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any
) -> VarlenPlan | None:
    """The TND plan of this call (padding or packing), or None for a dense batch; at most one host sync per mask."""
    plan = _varlen_plan(query, key, attention_mask, **kwargs)
    return None if plan is None or plan.dense else plan


def _varlen_plan(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any
) -> VarlenPlan | None:
    q_len, kv_len = query.shape[2], key.shape[2]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None and query.shape[0] == 1:
        return _cached_plan(cu_q, ("cu", id(cu_k)), lambda: _plan_of_cu_seq_lens(cu_q, cu_k))
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    if attention_mask.dtype == torch.bool:
        return _cached_plan(
            attention_mask, (q_len, kv_len), lambda: _plan_of_padding(attention_mask, q_len, query.device)
        )
    return _cached_plan(attention_mask, (q_len, kv_len), lambda: _plan_of_sequence_numbers(attention_mask))


SINK_CANN = (8, 5)
"""npu_fusion_attention takes `sink` from CANN 8.5 (and torch_npu 7.3.0) on: torch_npu's npu_fusion_attention docs."""


def _cann_version() -> tuple[int, int] | None:
    """The host's CANN (major, minor), from torch_npu's `get_cann_version()`; None when it does not say."""
    try:
        from torch_npu.utils.collect_env import get_cann_version
    except ImportError:
        return None
    parts = str(get_cann_version()).split(".")
    return (int(parts[0]), int(parts[1])) if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit() else None


def sink_unavailable_reason(query: torch.Tensor, sinks: torch.Tensor) -> str | None:
    """Why the op cannot take these attention sinks (one logit per query head) here, or None."""
    if tuple(sinks.shape) != (query.shape[1],):
        return f"attention sinks of shape {tuple(sinks.shape)}: the op takes one per query head, [{query.shape[1]}]"
    cann = _cann_version()
    if cann is None or cann < SINK_CANN:
        return f"attention sinks need CANN 8.5 or later for npu_fusion_attention's sink, this host has {cann}"
    if "950" in soc_name(query.device):
        return "attention sinks on an Ascend 950: torch_npu does not pass the sink to that chip's kernel"
    return None


def _autocast_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.dtype | None:
    """The dtype sdpa's operands take under the autocast active for their device (bfloat16 or float16), or None.

    Under Trainer's `bf16=True` q and k arrive in float32 (eager's rotary promotes them with float32 cos/sin) and v
    in bfloat16: autocast casts all three of sdpa's to its dtype, and the card casts them as it does. Autocast casts
    no float64, so with one the operands stay as they are (and their dtypes decide)."""
    device_type = query.device.type
    if not torch.is_autocast_enabled(device_type) or torch.float64 in (query.dtype, key.dtype, value.dtype):
        return None
    return torch.get_autocast_dtype(device_type)


def _is_causal(module: nn.Module, kwargs: dict) -> bool:
    is_causal = kwargs.get("is_causal")
    return getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)


def fused_attention_unavailable_reason(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> str | None:
    """Why `npu_fusion_attention` will not run for this attention call (the model's eager math runs instead), or None.

    For a padded or packed batch it reads the sequence lengths to the host, once per mask (see the module).
    """
    reason = npu_unavailable_reason(query, key, value)
    if reason is not None:
        return reason
    if _autocast_dtype(query, key, value) is None and (
        query.dtype not in FUSED_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype
    ):
        dtypes = f"{query.dtype}/{key.dtype}/{value.dtype}"
        return f"dtypes {dtypes}: npu_fusion_attention takes one of float16, bfloat16, float32 for all three"
    if softcap is not None:
        return f"logit soft-capping (softcap={softcap}): npu_fusion_attention has none"
    if kwargs.get("output_attentions"):
        return "output_attentions: npu_fusion_attention returns no attention weights"
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        reason = sink_unavailable_reason(query, sinks)
        if reason is not None:
            return reason
    if torch.compiler.is_compiling():
        return "torch.compile: the op's sequence lists are host integers read from the batch"
    if attention_mask is not None and attention_mask.dim() != 2:
        return (
            f"a {attention_mask.dim()}-D attention mask (the model overlays a pattern on the causal mask, e.g. image "
            "tokens or a prefix, or a custom mask was passed): npu_fusion_attention's modes cannot express it"
        )
    _, heads, q_len, head_dim = query.shape
    kv_heads, kv_len, value_dim = key.shape[1], key.shape[2], value.shape[3]
    if key.shape[3] != head_dim or not 1 <= value_dim <= head_dim <= MAX_HEAD_DIM:
        return f"head dims q {head_dim}, k {key.shape[3]}, v {value_dim}: the op takes Dq = Dk >= Dv, at most 768"
    if heads > MAX_HEADS or heads % kv_heads or value.shape[1] != kv_heads:
        return f"{heads} query heads, {kv_heads} key heads: the op takes at most 256, a multiple of the key heads"
    if q_len > kv_len:
        return f"{q_len} queries against {kv_len} keys: the op's causal modes take no more queries than keys"
    if max(q_len, kv_len) > MAX_TOKENS:
        return f"sequence length {max(q_len, kv_len)} exceeds the op's 1M"
    is_causal = _is_causal(module, kwargs)
    if sliding_window is not None and not is_causal:
        return "a bidirectional sliding window: the op's band mode is bottom-right causal here"
    if not 0.0 <= dropout < 1.0:
        return f"dropout {dropout}: the op's keep_prob takes (0, 1]"
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] != kv_len:
        return f"a mask of {attention_mask.shape[1]} keys for {kv_len} keys (a static cache)"
    plan = varlen_plan(query, key, attention_mask, **kwargs)
    if plan is None:
        return None
    if plan.query_index is None and plan.query_ends and plan.query_ends[-1] != query.shape[0] * q_len:
        return f"the sequence lengths cover {plan.query_ends[-1]} of the {query.shape[0] * q_len} query tokens"
    if plan.overlaid:
        return "the mask lets tokens see later tokens (a bidirectional block overlay): the op cannot express it"
    if len(plan.query_ends) > MAX_SEQUENCES:
        return f"{len(plan.query_ends)} sequences in one call: the op's varlen form takes at most {MAX_SEQUENCES}"
    if plan.holes and sliding_window is not None:
        return "a padding mask with holes inside a row and a sliding window: the band would measure wrong distances"
    if plan.query_ends != plan.key_ends and q_len == kv_len:
        return "packed query and key sequences of different lengths"
    return None


def fused_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of query [B, Nq, Sq, D] over key/value [B, Nkv, Skv, D] as transformers' AttentionInterface calls it.

    Returns (output [B, Sq, Nq, Dv], None). Fused as `fused_attention_unavailable_reason` decides, else the module's
    eager math (`fused_attention_eager`), recorded for `module`. Under autocast the op gets q, k and v in autocast's
    dtype, as sdpa does (`_autocast_dtype`).
    """
    reason = fused_attention_unavailable_reason(
        module, query, key, value, attention_mask, dropout, sliding_window, softcap, **kwargs
    )
    if ran_eager(module, reason):
        return fused_attention_eager(
            module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, **kwargs
        )
    autocast_dtype = _autocast_dtype(query, key, value)
    if autocast_dtype is not None:
        query, key, value = (t.to(autocast_dtype) for t in (query, key, value))
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    keep_prob = 1.0 - (dropout if module.training else 0.0)
    if _is_causal(module, kwargs):
        band = {"sparse_mode": 3} if sliding_window is None else {"sparse_mode": 4, "pre_tockens": sliding_window - 1}
        band = {**band, "next_tockens": 0, "atten_mask": _compressed_causal_mask(query)}
    else:
        band = {"sparse_mode": 0}
    common = dict(scale=scale, keep_prob=keep_prob, **band)
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        common["sink"] = sinks.float()
    heads = query.shape[1]
    plan = varlen_plan(query, key, attention_mask, **kwargs)
    if plan is None:
        output = torch_npu.npu_fusion_attention(
            query.transpose(1, 2).contiguous(),
            key.transpose(1, 2).contiguous(),
            value.transpose(1, 2).contiguous(),
            heads,
            "BSND",
            **common,
        )[0]
        return output, None
    batch, _, q_len, _ = query.shape
    tokens = _tokens(query, plan.query_index)
    output = torch_npu.npu_fusion_attention(
        tokens,
        _tokens(key, plan.key_index),
        _tokens(value, plan.key_index),
        heads,
        "TND",
        actual_seq_qlen=list(plan.query_ends),
        actual_seq_kvlen=list(plan.key_ends),
        **common,
    )[0]
    if plan.query_index is not None:
        output = output.new_zeros(batch * q_len, *output.shape[1:]).index_copy(0, plan.query_index, output)
    return output.view(batch, q_len, *output.shape[1:]), None


def _tokens(states: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """[B, N, S, D] as the op's TND tokens [T, N, D]: every token, or those `index` keeps."""
    flat = states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[3])
    return flat.contiguous() if index is None else flat.index_select(0, index)


def fused_attention_eager(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' eager attention of the module's own modeling file, with the 4-D mask eager builds for the call.

    The model's eager function (its modeling file's `eager_attention_forward`, the default its attention forward
    names) is called rather than one copy of it: models differ there (soft-capping, sinks, float32 softmax, dropout
    placement), and only their own function gives their exact result.
    """
    eager = modeling_global(type(module), "eager_attention_forward")
    mask = eager_mask(module, query, key, attention_mask, sliding_window, **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    extra = {name: value for name, value in (("sliding_window", sliding_window), ("softcap", softcap)) if value}
    return eager(module, query, key, value, mask, dropout=dropout, scaling=scale, **extra, **kwargs)


def eager_mask(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The additive 4-D mask transformers' eager mask function builds for this call (0 kept, dtype minimum masked).

    Built from what the card's mask says (padding, sequence numbers, cu_seq_lens, or eager's own 4-D mask, returned
    as it is), the causal and window rules (bottom-right aligned, as eager's cache offsets align them), on the device.
    Raises ValueError for a mask of another length than the keys (a static cache): use sdpa or eager there.
    """
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    batch, q_len, kv_len, device = query.shape[0], query.shape[2], key.shape[2], query.device
    if attention_mask is not None and attention_mask.shape[-1] != kv_len:
        raise ValueError(
            f"npu_fused_attention: a mask of {attention_mask.shape[-1]} keys for {kv_len} keys (a static cache) is not "
            'supported: load the model with attn_implementation="sdpa" (or "eager") for static caches'
        )
    is_causal = _is_causal(module, kwargs)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    kv_pos = torch.arange(kv_len, device=device)[None, :]
    kept = torch.ones(1, 1, q_len, kv_len, dtype=torch.bool, device=device)
    if is_causal:
        kept = kept & (kv_pos <= q_pos)
    if sliding_window is not None:
        kept = (
            kept & (kv_pos > q_pos - sliding_window) if is_causal else kept & ((kv_pos - q_pos).abs() <= sliding_window)
        )
    numbers = _sequence_numbers_of(attention_mask, kwargs, batch, kv_len, device)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        kept = kept & attention_mask[:, None, None, :]
    elif (
        numbers is not None
        and getattr(attention_mask, MASK_FUNCTION_ATTRIBUTE, None) is not None
        and bool((attention_mask < 0).any())
    ):
        mask_function, q_offset, kv_offset = getattr(attention_mask, MASK_FUNCTION_ATTRIBUTE)
        rows = torch.arange(batch, device=device)[:, None, None, None]
        heads = torch.zeros((), dtype=torch.long, device=device)
        kept = mask_function(
            rows, heads, q_pos[None, None] - (kv_len - q_len) + q_offset, kv_pos[None, None] + kv_offset
        )
    elif numbers is not None:
        kept = kept & (numbers[:, None, :, None] == numbers[:, None, None, :])
    if not is_causal and sliding_window is None and attention_mask is None and numbers is None:
        return None
    kept = kept.expand(batch, 1, q_len, kv_len)
    zero = torch.zeros((), dtype=query.dtype, device=device)
    return torch.where(kept, zero, torch.finfo(query.dtype).min)


def _sequence_numbers_of(
    attention_mask: torch.Tensor | None, kwargs: dict, batch: int, length: int, device: torch.device
) -> torch.Tensor | None:
    """The (B, S) sequence numbers of packed tokens: the card's mask's, or those cu_seq_lens_q gives; None unpacked."""
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        return attention_mask
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or batch != 1:
        return None
    positions = torch.arange(length, device=device)
    return torch.searchsorted(cu[1:].to(device=device, dtype=torch.long), positions, right=True)[None, :]
