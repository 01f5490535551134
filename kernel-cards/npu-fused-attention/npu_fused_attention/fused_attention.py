"""transformers attention on torch_npu.npu_fusion_attention, the model's own eager attention where the op cannot run.

`fused_attention` has transformers' AttentionInterface signature. It gets query [B, Nq, Sq, D], key and value
[B, Nkv, Skv, D] (grouped-query heads not repeated: the op takes Nq a multiple of Nkv), and the mask
`masks.fused_attention_mask` built, and returns the output [B, Sq, Nq, Dv] and no weights. It decides from what that
mask describes (`attention_form`): the terms transformers composed and the cache's sizes, never the call's keyword
arguments. The forms it fuses:

- every key slot kept and the queries the last ones (no padding, no packing, a cache aligned with the queries):
  layout BSND, causal as `sparse_mode=3` (bottom-right aligned: decode and chunked prefill see what eager's mask
  lets them see), a causal window W as the band `sparse_mode=4, pre_tockens=W-1, next_tockens=0` (transformers
  keeps key j for query i when j > i - W), both with the op's compressed 2048 x 2048 mask, never a dense one;
  bidirectional (an encoder, cross-attention): `sparse_mode=0`, no mask;
- attention sinks (`s_aux`, gpt-oss): the op's `sink`, one float32 logit per query head joining each row's softmax,
  from CANN 8.5 on (not on an Ascend 950, whose kernel torch_npu does not pass it);
- padding, packed sequences (restarting `position_ids`; `cu_seq_lens_q/k` only where no mask came) or a cache whose
  key slots run past the queries (a static cache's empty slots): layout TND, the tokens gathered by host-computed
  indices and the sequences given as cumulative host lists; the output of a causal padding query is 0 (eager's is a
  value no later layer reads, as with transformers' flash attention).

Any other form runs the model's eager attention with the mask transformers' eager would have built, and says why.
The host lists cost one device-to-host copy per forward, which every layer shares: the masks of every layer type
(full and sliding) are read together (`host_reads`), and each plan is kept on its mask's description, so it lives
exactly as long as this forward's mask. Under a mask, unpadded and unpacked batches make no host sync at all.
Where no mask came, the position ids (or `cu_seq_lens`, for one row) are read to the host at each call, never kept
on the tensors, which a collator may rewrite in place.

Dropout is the op's `keep_prob` (its own random mask, so a training step's numbers differ from eager's as any two
dropout draws do); the explicit `scale` is the module's (the op's default is 1). The backward is torch_npu's own
autograd of the op (npu_fusion_attention_grad).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._device_constants import device_constant
from ._fallbacks import ran_eager
from ._internals import modeling_global
from ._npu import FUSED_DTYPES, npu_unavailable_reason, soc_name, torch_npu
from .host_reads import host_copy
from .masks import EAGER_REASON_ATTRIBUTE, KEPT, QUERY, MaskDescription, description_of, tracing_reason

COMPRESSED_MASK_SIZE = 2048
"""Sparse modes 2 to 4 take this compressed triu(1) mask (True: masked), whatever the sequence length."""
MAX_HEAD_DIM = 768
MAX_HEADS = 256
MAX_SEQUENCES = 1024
"""The most sequences one varlen (TND) call takes: "varlen max 1K" (torch_npu's npu_fusion_attention docs)."""
MAX_TOKENS = 1024 * 1024
"""S and T at most 1M (torch_npu's npu_fusion_attention docs)."""

_FORMS: weakref.WeakKeyDictionary[nn.Module, AttentionForm] = weakref.WeakKeyDictionary()


def last_form(module: nn.Module) -> str | None:
    """The form `module`'s last fused call of the card ran ("causal, window 4, BSND", ...), None if none fused."""
    form = _FORMS.get(module)
    return None if form is None else form.summary()


def _compressed_causal_mask(query: torch.Tensor) -> torch.Tensor:
    """The op's compressed causal mask on query's device, made once per device (`device_constant`)."""
    return device_constant("compressed causal mask", query, _make_compressed_causal_mask)


def _make_compressed_causal_mask(device: torch.device) -> torch.Tensor:
    """The op's compressed causal mask (True: masked) on `device`."""
    square = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device)
    return square.triu(1)


@dataclass(frozen=True)
class VarlenPlan:
    """How a padded, packed or cache-offset batch goes to the op as TND: the tokens kept, the sequences' ends.

    `query_index` / `key_index`: the positions kept of the flattened [B * Sq] queries / [B * Skv] keys (None: all of
    them, in order); `query_ends` / `key_ends`: the cumulative lengths, no leading 0 (the op's actual_seq lists).
    `holes`: some row's kept keys are not contiguous (a window would then measure distances the compacted tokens do
    not have); `reason`: why the op cannot take this batch (None: it can). `padding_queries`: the flattened
    positions of the padding queries that see a key (a right-padded prompt's last position, which generate reads),
    `padding_rows` their batch rows and `padding_keys` [n, Skv] the keys each sees: computed apart (the op's TND form
    has no place for them), as eager and sdpa compute them.
    """

    query_index: torch.Tensor | None
    key_index: torch.Tensor | None
    query_ends: tuple[int, ...]
    key_ends: tuple[int, ...]
    holes: bool = False
    reason: str | None = None
    padding_queries: torch.Tensor | None = None
    padding_rows: torch.Tensor | None = None
    padding_keys: torch.Tensor | None = None


def _plan_of_codes(description: MaskDescription, device: torch.device) -> VarlenPlan | None:
    """The plan of a description's key codes (masks.KEPT, masks.QUERY), from its host copy; None for the dense form.

    Causal: the queries are the key slots marked QUERY, in order, and a query is kept where its slot is kept, so each
    row's kept queries are its last kept keys and the op's bottom-right alignment sees what the mask lets it see; a
    padding query that sees some kept key goes to `padding_queries`, one that sees none gets 0 (sdpa's value).
    Bidirectional (and cross-attention): every query is kept and sees its row's kept keys."""
    host = host_copy(description.codes).to(torch.int32)
    kept, is_query = (host & KEPT).bool(), (host & QUERY).bool()
    batch, kv_len = kept.shape
    q_len = description.q_length
    key_counts = kept.sum(1)
    if description.causal:
        if bool((is_query.sum(1) != q_len).any()):
            return VarlenPlan(None, None, (), (), reason="the queries' positions are not among the keys' positions")
        queries_kept = kept[is_query].view(batch, q_len)
        if bool(kept.all()) and bool(is_query[:, kv_len - q_len :].all()):
            return None
        query_index, query_counts = queries_kept.reshape(-1).nonzero().squeeze(1).to(device), queries_kept.sum(1)
        padding = _padding_queries(kept, is_query, description.window, device)
    else:
        padding = {}
        if bool(kept.all()):
            return None
        if q_len and bool((key_counts == 0).any()):
            return VarlenPlan(None, None, (), (), reason="a batch row with no key to attend to (all padding)")
        query_index, query_counts = None, torch.full((batch,), q_len)
    positions = torch.arange(kv_len)
    first = torch.where(kept, positions, kv_len).amin(1)
    last = torch.where(kept, positions, -1).amax(1)
    return VarlenPlan(
        query_index=query_index,
        key_index=kept.reshape(-1).nonzero().squeeze(1).to(device),
        query_ends=tuple(query_counts.cumsum(0).tolist()),
        key_ends=tuple(key_counts.cumsum(0).tolist()),
        holes=bool(((key_counts > 0) & (last - first + 1 != key_counts)).any()),
        **padding,
    )


def _padding_queries(
    kept: torch.Tensor, is_query: torch.Tensor, window: int | None, device: torch.device
) -> dict[str, torch.Tensor]:
    """The padding queries of a causal plan that see some kept key: `VarlenPlan`'s padding_* fields, or none."""
    positions = torch.arange(kept.shape[1])
    seen = kept.cumsum(1)  # kept keys at or before each position
    if window is not None:  # less those before the window
        seen = seen - torch.nn.functional.pad(seen, (window, 0))[:, : kept.shape[1]]
    stray = is_query & ~kept & (seen > 0)
    if not bool(stray.any()):
        return {}
    rows, slots = stray.nonzero(as_tuple=True)
    sees = kept[rows] & (positions[None, :] <= slots[:, None])
    if window is not None:
        sees = sees & (positions[None, :] > slots[:, None] - window)
    first_query = int(is_query[0].nonzero()[0])
    q_len = int(is_query[0].sum())
    return {
        "padding_queries": (rows * q_len + slots - first_query).to(device),
        "padding_rows": rows.to(device),
        "padding_keys": sees.to(device),
    }


def _attend_padding_queries(
    output: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: VarlenPlan, scale, sinks
) -> torch.Tensor:
    """`output` [B * Sq, Nq, Dv] with the plan's padding queries attended over the keys each sees (float32 inside).

    Row by row: each row's padding queries against that row's keys, grouped by key head (no key or value repeated
    per query or per query head), so the scores take what eager's take for those queries."""
    heads, q_len, head_dim = query.shape[1:]
    kv_heads, groups = key.shape[1], heads // key.shape[1]
    for row in plan.padding_rows.unique().tolist():
        chosen = (plan.padding_rows == row).nonzero().squeeze(1)
        count = len(chosen)
        # [Nkv, groups * m, D]: the row's padding queries of each key head's query heads, against [Nkv, D, Skv]
        q = query[row][:, plan.padding_queries[chosen] % q_len].float().reshape(kv_heads, groups * count, head_dim)
        scores = (q @ key[row].float().transpose(1, 2) * scale).view(heads, count, -1)
        scores = scores.masked_fill(~plan.padding_keys[chosen][None], float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.float()[:, None, None].expand(-1, count, 1)], dim=-1)
        probs = scores.softmax(-1)[..., : key.shape[2]].reshape(kv_heads, groups * count, -1)
        attended = (probs @ value[row].float()).view(heads, count, -1).transpose(0, 1)
        output = output.index_copy(0, plan.padding_queries[chosen], attended.to(output.dtype))
    return output


def _plan_of_sequence_ids(sequence_ids: torch.Tensor) -> VarlenPlan:
    """The plan of (B, S) packed sequence ids (a sequence ends where the id changes, and at each row's end)."""
    host = host_copy(sequence_ids)
    flat = host.reshape(-1)
    changes = torch.ones_like(flat, dtype=torch.bool)
    changes[:-1] = flat[1:] != flat[:-1]
    changes[host.shape[1] - 1 :: host.shape[1]] = True
    ends = tuple((changes.nonzero().squeeze(1) + 1).tolist())
    return VarlenPlan(None, None, ends, ends)


def _plan_of_cu_seq_lens(cu_q: torch.Tensor, cu_k: torch.Tensor) -> VarlenPlan:
    """The plan of packed sequences given as cu_seq_lens (leading 0), read to the host in one copy at each call.

    Read at every call, never kept on the tensors: a collator may rewrite its buffers in place between batches."""
    both = torch.cat([cu_q.reshape(-1), cu_k.reshape(-1)]).cpu().tolist()
    q_list, k_list = both[: cu_q.numel()], both[cu_q.numel() :]
    return VarlenPlan(None, None, tuple(q_list[1:]), tuple(k_list[1:]))


def _sequence_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] True where a packed sequence starts: at each row's first token and where the ids do not step by 1."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def _plan_of_position_ids(position_ids: torch.Tensor) -> VarlenPlan | None:
    """The plan of the rows' packed sequences from their [B, S] position ids, or None when no row's ids restart (dense).

    A sequence starts at each row's first token and where the ids do not step by 1. Read to the host at each call."""
    starts = _sequence_starts(position_ids.cpu())
    if not bool(starts[:, 1:].any()):
        return None
    ends = (*(starts.reshape(-1).nonzero().squeeze(1)[1:].tolist()), starts.numel())
    return VarlenPlan(None, None, ends, ends)


def _described_plan(description: MaskDescription, device: torch.device) -> VarlenPlan | None:
    """The plan of a described mask kind, made once per forward and kept on its description."""
    if description.sequence_ids is None and description.codes is None:
        return None
    if "plan" not in description.plans:
        description.plans["plan"] = (
            _plan_of_sequence_ids(description.sequence_ids)
            if description.sequence_ids is not None
            else _plan_of_codes(description, device)
        )
    return description.plans["plan"]


@dataclass(frozen=True)
class AttentionForm:
    """What the op computes for one call: causal (bottom-right) or not, the causal window, the TND plan if any."""

    causal: bool
    window: int | None
    plan: VarlenPlan | None

    def summary(self) -> str:
        """The form in a few words, as `attention_forms` reports it."""
        parts = ["causal" if self.causal else "bidirectional"]
        if self.window is not None:
            parts.append(f"window {self.window}")
        parts.append("BSND" if self.plan is None else f"TND of {len(self.plan.query_ends)} sequences")
        return ", ".join(parts)


def attention_form(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> AttentionForm | str:
    """The form the op computes for this call, or why it cannot: from the mask transformers composed (see masks).

    With a described mask, the description alone decides (the module's is_causal and the call's sliding_window and
    cu_seq_lens are what eager and sdpa ignore under a mask). With no mask (a model that builds none, or a wrapper
    that dropped it, as DeepSpeed's Ulysses wrapper does): causal when the module is, bottom-right (the queries are
    the last keys, as a cache aligns them; with one query every key), with the module's window, packed by
    cu_seq_lens when given for one row (cu_seq_lens describe one packed row; with more rows the position ids decide),
    else by position ids that restart (queries and keys alike, row by row). Any other mask is one the card did not
    build: eager, saying so."""
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    description = description_of(attention_mask)
    if description is not None:
        if (description.batch, description.q_length, description.kv_length) != (batch, q_len, kv_len):
            return (
                f"the model attends {q_len} queries to {kv_len} keys in batch {batch}, but its mask was built for "
                f"{description.q_length} queries, {description.kv_length} keys and batch {description.batch} (the "
                "model changed its queries or keys after building the mask, as RecurrentGemma does in decoding): "
                "the mask does not say which keys each query sees"
            )
        plan = _described_plan(description, query.device)
        return AttentionForm(description.causal, description.window, plan)
    if attention_mask is not None:
        reason = getattr(attention_mask, EAGER_REASON_ATTRIBUTE, None)
        if reason is not None:
            return reason
        if attention_mask.dim() == 4:
            return (
                "a 4-D attention mask (the model overlays a pattern on the causal mask, e.g. image tokens or a "
                "prefix, or a custom mask was passed): npu_fusion_attention's modes cannot express it"
            )
        return (
            f"a {attention_mask.dim()}-D attention mask the card's mask function did not build (the model made or "
            "changed it): its meaning cannot be proven"
        )
    if sliding_window is not None and not _is_causal(module, kwargs):
        return "a bidirectional sliding window: the op's band mode is bottom-right causal here"
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    positions = kwargs.get("position_ids")
    plan = None
    if cu_q is not None and cu_k is not None and batch == 1:
        plan = _plan_of_cu_seq_lens(cu_q, cu_k)
    elif q_len == kv_len > 1 and (rows := _row_positions(positions, batch, q_len)) is not None:
        plan = _plan_of_position_ids(rows)
    return AttentionForm(_is_causal(module, kwargs), sliding_window, plan)


def _row_positions(positions: Any, batch: int, q_len: int) -> torch.Tensor | None:
    """The call's position ids as [batch, q_len] (one row given for every row, as transformers expands it), or None."""
    if (
        not torch.is_tensor(positions)
        or positions.shape[-1:] != (q_len,)
        or positions.numel() not in (q_len, batch * q_len)
    ):
        return None
    return positions.reshape(-1, q_len).expand(batch, q_len)


_CALL_TENSORS: set[str] = set()


def call_tensors() -> set[str]:
    """The tensor keywords of an attention call the card reads or that do not change the math.

    They are what transformers passes every attention function (its TransformersKwargs: position ids, the packed
    sequences' cu_seq_lens, Trainer's num_items_in_batch, ...), sinks (s_aux), cache_position and shift_labels (the
    loss's targets, which DeepSpeed's Ulysses data-loader adapter puts in every batch and a causal LM's forward passes
    down with its other keywords). Any other (T5's position_bias, a sparse model's indices, a head mask) runs eager,
    which applies it."""
    if not _CALL_TENSORS:
        from transformers.utils import TransformersKwargs  # only transformers calls the attention function

        _CALL_TENSORS.update(TransformersKwargs.__annotations__, {"s_aux", "cache_position", "shift_labels"})
    return _CALL_TENSORS


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

    For a padded, packed or cache-offset batch it reads the sequence lengths to the host, once per forward (masks).
    """
    decided = _decide(module, query, key, value, attention_mask, dropout, sliding_window, softcap, kwargs)
    return decided if isinstance(decided, str) else None


def _decide(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    sliding_window: int | None,
    softcap: float | None,
    kwargs: dict,
) -> AttentionForm | str:
    """The form the op computes for this call, or why the model's eager attention runs instead."""
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
    unknown = sorted(name for name, value in kwargs.items() if torch.is_tensor(value) and name not in call_tensors())
    if unknown:
        return f"the call passes {', '.join(unknown)}, which npu_fusion_attention does not take"
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        reason = sink_unavailable_reason(query, sinks)
        if reason is not None:
            return reason
    reason = tracing_reason()
    if reason is not None:
        return reason
    _, heads, q_len, head_dim = query.shape
    kv_heads, kv_len, value_dim = key.shape[1], key.shape[2], value.shape[3]
    if key.shape[3] != head_dim or not 1 <= value_dim <= head_dim <= MAX_HEAD_DIM:
        return f"head dims q {head_dim}, k {key.shape[3]}, v {value_dim}: the op takes Dq = Dk >= Dv, at most 768"
    if heads > MAX_HEADS or heads % kv_heads or value.shape[1] != kv_heads:
        return f"{heads} query heads, {kv_heads} key heads: the op takes at most 256, a multiple of the key heads"
    if max(q_len, kv_len) > MAX_TOKENS:
        return f"sequence length {max(q_len, kv_len)} exceeds the op's 1M"
    if not 0.0 <= dropout < 1.0:
        return f"dropout {dropout}: the op's keep_prob takes (0, 1]"
    form = attention_form(module, query, key, attention_mask, sliding_window, **kwargs)
    if isinstance(form, str):
        return form
    plan = form.plan
    if plan is None:
        if form.causal and q_len > kv_len:
            return f"{q_len} queries against {kv_len} keys: the op's causal modes take no more queries than keys"
        return form
    if plan.reason is not None:
        return plan.reason
    if plan.query_index is None and plan.query_ends and plan.query_ends[-1] != query.shape[0] * q_len:
        return f"the sequence lengths cover {plan.query_ends[-1]} of the {query.shape[0] * q_len} query tokens"
    if plan.key_index is None and plan.key_ends and plan.key_ends[-1] != key.shape[0] * kv_len:
        return f"the sequence lengths cover {plan.key_ends[-1]} of the {key.shape[0] * kv_len} key tokens"
    tokens = max((*plan.query_ends[-1:], *plan.key_ends[-1:]), default=0)
    if tokens > MAX_TOKENS:
        return f"{tokens} tokens in one varlen (TND) call, every row's together: the op takes at most 1M"
    if len(plan.query_ends) > MAX_SEQUENCES:
        return f"{len(plan.query_ends)} sequences in one call: the op's varlen form takes at most {MAX_SEQUENCES}"
    if plan.holes and form.window is not None:
        return "a padding mask with holes inside a row and a sliding window: the band would measure wrong distances"
    if plan.query_index is None and plan.key_index is None and plan.query_ends != plan.key_ends:
        return "packed query and key sequences of different lengths"
    return form


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
    eager math (`fused_attention_eager`), recorded for `module` with the form each call ran (`last_form`). Under
    autocast the op gets q, k and v in autocast's dtype, as sdpa does (`_autocast_dtype`). A backward autograd records
    (create_graph) raises, saying what to do (`_FirstOrderOnly`).
    """
    form = _decide(module, query, key, value, attention_mask, dropout, sliding_window, softcap, kwargs)
    if ran_eager(module, form if isinstance(form, str) else None):
        return fused_attention_eager(
            module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, **kwargs
        )
    _FORMS[module] = form  # summarised only when asked (`last_form`): no string work per call
    autocast_dtype = _autocast_dtype(query, key, value)
    if autocast_dtype is not None:
        query, key, value = (t.to(autocast_dtype) for t in (query, key, value))
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        query, key, value = _FirstOrderOnly.apply(query, key, value)
    return _fused_output(module, form, query, key, value, dropout, scaling, kwargs.get("s_aux")), None


class _FirstOrderOnly(torch.autograd.Function):
    """The identity on the op's q, k and v (views of them), whose backward raises when autograd records it.

    npu_fusion_attention's backward (npu_fusion_attention_grad) has no derivative: torch_npu's autograd fallback passes
    none, so second-order gradients (gradient penalties, Hessian-vector products) would be silently wrong. The eager
    math's second order would need q, k and v kept beside the op's own copies (a decoder layer's q, k and v again), so a
    recorded backward (create_graph) raises, saying what to do; every plain backward is the op's."""

    @staticmethod
    def forward(ctx, query, key, value):
        return query.view_as(query), key.view_as(key), value.view_as(value)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "second-order gradients (a backward with create_graph=True) through npu_fused_attention: "
                "npu_fusion_attention's backward has no derivative. Run this model with attn_implementation='sdpa' "
                "for it (model.set_attn_implementation('sdpa')), or apply the cards without npu_fused_attention"
            )
        return grads


def _fused_output(
    module: nn.Module,
    form: AttentionForm,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The op's attention output [B, Sq, Nq, Dv] for a call `form` says it computes."""
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    keep_prob = 1.0 - (dropout if module.training else 0.0)
    if form.causal:
        band = {"sparse_mode": 3} if form.window is None else {"sparse_mode": 4, "pre_tockens": form.window - 1}
        band = {**band, "next_tockens": 0, "atten_mask": _compressed_causal_mask(query)}
    else:
        band = {"sparse_mode": 0}
    common = dict(scale=scale, keep_prob=keep_prob, **band)
    if sinks is not None:
        common["sink"] = sinks.float()
    heads = query.shape[1]
    plan = form.plan
    if plan is None:
        return torch_npu.npu_fusion_attention(
            query.transpose(1, 2).contiguous(),
            key.transpose(1, 2).contiguous(),
            value.transpose(1, 2).contiguous(),
            heads,
            "BSND",
            **common,
        )[0]
    batch, _, q_len, _ = query.shape
    if plan.query_ends[-1] == 0:  # no query kept: a padding query that sees no key gets 0, as sdpa's
        output = query.new_zeros(batch * q_len, heads, value.shape[3])
        if plan.padding_queries is None:
            # zeros that still depend on q, k and v, so that every projection gets its (zero) gradient, as under
            # sdpa (AdamW's decay, DDP's reduction)
            return output.view(batch, q_len, heads, -1) + 0 * (query.sum() + key.sum() + value.sum())
    else:
        output = torch_npu.npu_fusion_attention(
            _tokens(query, plan.query_index),
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
    if plan.padding_queries is not None:
        output = _attend_padding_queries(output, query, key, value, plan, scale, sinks)
    return output.view(batch, q_len, *output.shape[1:])


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
    """The additive 4-D mask the model's eager attention gets for this call (0 kept, dtype minimum masked), or None.

    For a mask the card's mask function described: transformers' own eager mask of that description (built once per
    forward); a 4-D mask is returned as it is. With no mask (a model that builds none, or a wrapper that dropped it):
    sdpa's rule as `attention_form` reads it (the module's causality, bottom-right, its window, cu_seq_lens). Raises
    ValueError for another mask, whose meaning the card cannot know."""
    description = description_of(attention_mask)
    if description is not None:
        return description.eager_mask()
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    if attention_mask is not None:
        raise ValueError(
            f"npu_fused_attention: a {attention_mask.dim()}-D attention mask of shape {tuple(attention_mask.shape)} "
            'that the card\'s mask function did not build: load the model with attn_implementation="sdpa" (or '
            '"eager"), or pass transformers\' 4-D mask'
        )
    batch, q_len, kv_len, device = query.shape[0], query.shape[2], key.shape[2], query.device
    is_causal = _is_causal(module, kwargs) and q_len > 1
    numbers = _packed_sequence_numbers(kwargs, batch, q_len, kv_len, device)
    if not is_causal and sliding_window is None and numbers is None:
        return None
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    kv_pos = torch.arange(kv_len, device=device)[None, :]
    kept = torch.ones(1, 1, q_len, kv_len, dtype=torch.bool, device=device)
    if is_causal:
        kept = kept & (kv_pos <= q_pos)
    if sliding_window is not None:
        kept = kept & (kv_pos > q_pos - sliding_window)
    if numbers is not None:
        kept = kept & (numbers[:, None, :, None] == numbers[:, None, None, :])
    kept = kept.expand(batch, 1, q_len, kv_len)
    zero = torch.zeros((), dtype=query.dtype, device=device)
    return torch.where(kept, zero, torch.finfo(query.dtype).min)


def _packed_sequence_numbers(
    kwargs: dict, batch: int, q_len: int, kv_len: int, device: torch.device
) -> torch.Tensor | None:
    """[B, Skv] each key's packed sequence number where no mask came (as `attention_form` reads them), or None."""
    cu, positions = kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids")
    if cu is not None and batch == 1:
        ends = cu[1:].to(device=device, dtype=torch.long)
        return torch.searchsorted(ends, torch.arange(kv_len, device=device), right=True)[None]
    rows = _row_positions(positions, batch, q_len) if q_len == kv_len > 1 else None
    if rows is None:
        return None
    starts = _sequence_starts(rows.to(device))
    starts[:, 0] = False
    return starts.long().cumsum(1)
