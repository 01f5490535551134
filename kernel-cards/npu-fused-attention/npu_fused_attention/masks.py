"""The mask transformers builds for the card, registered in its AttentionMaskInterface beside `fused_attention`.

transformers composes a mask kind (full, sliding, bidirectional, cross) of a forward from its primitives
(`masking_utils`: causal, bidirectional, sliding-window overlay, packed sequences, chunks, block and token-type
overlays, a user's or/and function), sizes it from the cache (`kv_length`, `kv_offset`, `q_offset`: dynamic, static,
sliding-window, offloaded and hybrid caches differ there) and hands `fused_attention_mask` the composed function, the
sizes and the 2-D padding mask; every attention layer of that kind then gets what it returns. The card decides
from that whole description, never from the attention call's keyword arguments or the module's `is_causal`:

- `mask_terms` reads the composed function back into its primitives (by their code objects: an `and_masks` of
  `causal_mask_function`, `bidirectional_mask_function`, `sliding_window_overlay(W)`, `packed_sequence_mask_function`
  and `padding_mask_function` terms). Any other term (an or-overlay, chunks, a block or token-type overlay, a
  bidirectional window, a user's function) is a form the op cannot be proven to compute: the mask function then
  returns the 4-D mask transformers' own eager mask function builds, with the reason (`EAGER_REASON_ATTRIBUTE`),
  and the attention runs the model's eager attention with it.
- A described form is returned as a carrier holding the `MaskDescription` (`DESCRIPTION_ATTRIBUTE`): the 2-D
  padding mask of every position, [B, kv_offset + kv_length] (all 1 without padding), int8 (which sdpa refuses,
  should a module whose config still says "sdpa" get it: transformers' stale sub-configs), contiguous, so that a
  caller who hands it on (generate prepares a static cache's masks ahead and calls `.contiguous()` on them) hands on
  this very tensor, and one who hands it back as a model's `attention_mask` gets the same mask again.
- Where the op needs host lists (padding, packed sequences, or a cache whose keys are not aligned with the queries'
  ends: a static cache's empty slots), the description holds a [B, kv_length] int8 tensor of per-key codes computed
  on the device (`KEPT`, `QUERY`) or the packed sequence ids, recorded for the one host read of the forward
  (`host_reads`). Its plans and eager mask are kept on the description, so they live exactly as long as this
  forward's mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ._internals import closure_values
from ._tracing import graph_tracer
from .host_reads import expect_host_read

DESCRIPTION_ATTRIBUTE = "npu_fused_attention_description"
"""The attribute of the carrier tensor the mask function returns, holding its `MaskDescription`."""
EAGER_REASON_ATTRIBUTE = "npu_fused_attention_eager_reason"
"""The attribute of a 4-D mask the mask function returns, holding why the op cannot compute that form."""
KEPT = 1
"""Code bit of a key slot some query may see: not padding and, under a causal mask, not after the last query."""
QUERY = 2
"""Code bit of a key slot that is also a query's position (self-attention: the queries are the last tokens seen)."""


@dataclass(eq=False)
class MaskDescription:
    """One mask kind of one forward as transformers composed it, in the terms the op can take.

    `causal`: keys at most the query's position; `window`: keys after the query's position minus W (causal only);
    `sequence_ids`: packed sequences, (B, S) ids that change where a sequence starts; `codes`: the (B, kv_length)
    int8 codes of the key slots (`KEPT`, `QUERY`) when padding or the cache's layout needs them, None when every key
    slot is kept and the queries are the last ones (the op's dense form, no host read). `arguments`: what
    transformers passed, for its own eager mask. `plans` and `eager`: this forward's host plans and eager mask.
    """

    batch: int
    q_length: int
    kv_length: int
    causal: bool
    window: int | None
    sequence_ids: torch.Tensor | None
    codes: torch.Tensor | None
    arguments: dict[str, Any]
    plans: dict[Any, Any] = field(default_factory=dict)
    eager: list[torch.Tensor | None] = field(default_factory=list)

    def eager_mask(self) -> torch.Tensor | None:
        """The 4-D mask transformers' eager attention gets for this mask kind, built once per forward."""
        if not self.eager:
            self.eager.append(transformers_eager_mask(self.arguments))
        return self.eager[0]


def transformers_eager_mask(arguments: dict[str, Any]) -> torch.Tensor | None:
    """transformers' own eager mask (float, 0 kept, dtype minimum masked) for the arguments it gave a mask function."""
    from transformers.masking_utils import eager_mask  # only transformers calls the mask function

    return eager_mask(**{name: value for name, value in arguments.items() if name != "allow_is_causal_skip"})


def tracing_reason() -> str | None:
    """Why a graph being traced cannot take the fused form (`graph_tracer`), or None when no tracer records the call."""
    tracer = graph_tracer()
    if tracer is None:
        return None
    return (
        f"{tracer} traces the call: the op's sequence lists are host integers read from the batch, which a traced "
        "graph would keep as the traced batch's"
    )


def description_of(mask: torch.Tensor | None) -> MaskDescription | None:
    """The description a carrier returned by `fused_attention_mask` holds, or None for any other mask."""
    return None if mask is None else getattr(mask, DESCRIPTION_ATTRIBUTE, None)


def fused_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask `fused_attention` takes for one mask kind of a forward: a described form, or eager's own 4-D mask."""
    arguments = dict(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        **kwargs,
    )
    reason = tracing_reason()  # first: reading the mask function's closure is itself no graph a tracer can take
    terms = None if reason is not None else mask_terms(mask_function)
    if isinstance(terms, str):
        reason = terms
    description = reason or _describe(terms, arguments, kwargs.get("device", "cpu"))
    if isinstance(description, str):
        mask = transformers_eager_mask({**arguments, "allow_is_bidirectional_skip": False})
        setattr(mask, EAGER_REASON_ATTRIBUTE, description)
        return mask
    carrier = _padding(attention_mask, terms.padding, kv_length, kv_offset)
    if carrier is None:
        carrier = torch.ones(batch_size, kv_offset + kv_length, dtype=torch.int8, device=kwargs.get("device", "cpu"))
    # int8, which sdpa refuses, should a module with another attention get it; contiguous, as generate makes a mask
    carrier = carrier.to(torch.int8).contiguous()
    setattr(carrier, DESCRIPTION_ATTRIBUTE, description)
    return carrier


@dataclass(frozen=True)
class MaskTerms:
    """The primitives of an `and_masks` composition the op can take (see the module)."""

    causal: bool = False
    window: int | None = None
    sequence_ids: torch.Tensor | None = None
    padding: torch.Tensor | None = None


def _primitive_codes() -> dict[Any, str]:
    """The code objects of transformers' mask primitives the op can take, by name."""
    from transformers import masking_utils as mu

    probe = torch.zeros(1, 1, dtype=torch.long)
    return {
        mu.and_masks(mu.causal_mask_function).__code__: "and",
        mu.causal_mask_function.__code__: "causal",
        mu.bidirectional_mask_function.__code__: "bidirectional",
        mu.sliding_window_overlay(1).__code__: "window",
        mu.packed_sequence_mask_function(probe).__code__: "packed",
        mu.padding_mask_function(probe).__code__: "padding",
    }


_PRIMITIVES: dict[Any, str] = {}


def mask_terms(mask_function: Callable | None) -> MaskTerms | str:
    """The primitives `mask_function` is the intersection of, or why it is not one the op can take."""
    if not _PRIMITIVES:
        _PRIMITIVES.update(_primitive_codes())
    if mask_function is None:
        return MaskTerms(causal=True)
    found: dict[str, Any] = {}
    pending = [mask_function]
    while pending:
        function = pending.pop()
        code = getattr(function, "__code__", None)
        kind = _PRIMITIVES.get(code)
        if kind is None:
            name = getattr(function, "__qualname__", type(function).__name__)
            return (
                f"the mask composes {name} (an overlay on the causal or bidirectional pattern, chunks, or a custom "
                "mask function): npu_fusion_attention's modes cannot be proven to compute it"
            )
        closure = closure_values(function)
        if kind == "and":
            pending.extend(closure["mask_functions"])
        elif kind == "window":
            window = closure["sliding_window"]
            found["window"] = window if found.get("window") is None else min(found["window"], window)
        elif kind == "packed":
            if "sequence_ids" in found:
                return "two packed-sequence terms in one mask"
            found["sequence_ids"] = closure["packed_sequence_mask"]
        elif kind == "padding":
            if "padding" in found:
                return "two padding terms in one mask"
            found["padding"] = closure["padding_mask"]
        elif kind == "causal":
            found["causal"] = True
    if found.get("window") is not None and not found.get("causal"):
        return "a sliding window without the causal term: the op's band here is the causal one"
    return MaskTerms(**found)


def _describe(terms: MaskTerms, arguments: dict[str, Any], device: torch.device | str) -> MaskDescription | str:
    """The description of a mask of these terms, or why the op cannot take it.

    It holds the codes or sequence ids the op's host lists need, recorded for the forward's one host read."""
    batch, q_length, kv_length = arguments["batch_size"], arguments["q_length"], arguments["kv_length"]
    q_offset, kv_offset = arguments["q_offset"], arguments["kv_offset"]
    padding = _padding(arguments["attention_mask"], terms.padding, kv_length, kv_offset)
    padding = None if padding is None else padding[:, kv_offset : kv_offset + kv_length]
    window = terms.window
    if window is not None and isinstance(q_offset, int) and window > q_offset + q_length - 1 - kv_offset:
        window = None  # wider than the farthest key from the last query: it masks nothing
    common = dict(
        batch=batch,
        q_length=q_length,
        kv_length=kv_length,
        causal=terms.causal,
        window=window,
        arguments=arguments,
    )
    sequence_ids = terms.sequence_ids
    if sequence_ids is not None:
        if padding is not None or kv_offset != 0 or not isinstance(q_offset, int) or q_offset != 0:
            return "packed sequences with padding or a cache: the op's varlen form takes one or the other"
        sequence_ids = sequence_ids.expand(batch, -1)[:, :kv_length]
        expect_host_read(sequence_ids)
        return MaskDescription(sequence_ids=sequence_ids, codes=None, **common)
    aligned = not terms.causal or (isinstance(q_offset, int) and q_offset + q_length == kv_offset + kv_length)
    if padding is None and aligned:
        return MaskDescription(sequence_ids=None, codes=None, **common)
    positions = torch.arange(kv_length, device=device) + kv_offset
    kept = torch.ones(batch, kv_length, dtype=torch.bool, device=device) if padding is None else padding
    if terms.causal:
        kept = kept & (positions <= q_offset + q_length - 1)
    query = (positions >= q_offset) & (positions < q_offset + q_length)
    codes = kept.to(torch.int8) * KEPT + query.to(torch.int8).expand(batch, -1) * QUERY
    expect_host_read(codes)
    return MaskDescription(sequence_ids=None, codes=codes, **common)


def _padding(
    attention_mask: torch.Tensor | None, composed: torch.Tensor | None, kv_length: int, kv_offset: int
) -> torch.Tensor | None:
    """The (B, kv_offset + kv_length) bool padding of every position, or None without padding.

    Indexed as transformers indexes it: absolute positions, False past the mask's end (a static cache's empty
    slots)."""
    padding = None
    for mask in (attention_mask, composed):
        if mask is None:
            continue
        missing = kv_offset + kv_length - mask.shape[-1]
        mask = torch.nn.functional.pad(mask.bool(), (0, missing)) if missing > 0 else mask.bool()
        mask = mask[:, : kv_offset + kv_length]
        padding = mask if padding is None else padding & mask
    return padding
