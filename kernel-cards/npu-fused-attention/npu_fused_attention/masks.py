"""The mask transformers builds for the card, registered in its AttentionMaskInterface beside `fused_attention`.

transformers calls a model's mask function once per mask kind (full, sliding) and forward, and hands what it
returns to every attention layer of that kind. `fused_attention_mask` returns what npu_fusion_attention can take,
with no host sync: it records the padding and sequence-number tensors it returns (`host_reads.expect_host_read`), and
the attention function reads those of every mask kind in one copy, once per forward, for all layers:

- None: neither padding nor packing (the op's causal and band modes do the rest);
- a (B, L) bool tensor: transformers' 2-D padding mask, True for tokens, sliced to the keys as its own
  `flash_attention_mask` slices it (which also drops an all-True mask, at the cost of one sync: the card finds that
  out at the one sync it makes anyway);
- a (B, S) int32 tensor: packed sequences, which transformers finds in restarting `position_ids` and composes into
  the mask function: each token's sequence number in its row (from 1), read off the mask function (a token that
  cannot see the token before it starts a sequence), or -1 where the mask function lets a token see the token after
  it (a bidirectional block overlay, which the op cannot express: the attention then runs eager);
- a (B, 1, Q, K) float tensor: eager's own mask, for models that overlay other patterns on the causal mask
  (`or_mask_function` / `and_mask_function`: image tokens, prefix-LM) and for chunked attention (Llama4): the attention
  function runs eager with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .host_reads import expect_host_read

MASK_FUNCTION_ATTRIBUTE = "npu_fused_attention_mask_function"
"""The attribute of a segments tensor holding (mask function, q offset, kv offset), for eager's mask if it must."""


def fused_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask `fused_attention` takes for one mask kind of a forward: None, padding, packed sequences or eager's."""
    if kwargs.get("use_vmap") or _chunked(kwargs):  # overlays (or/and_mask_function), or chunked attention
        from transformers.masking_utils import eager_mask  # only transformers calls this function

        return eager_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            **kwargs,
        )
    if attention_mask is not None:
        padding = attention_mask[:, -kv_length:]
        expect_host_read(padding)
        return padding
    packed = "allow_is_bidirectional_skip" not in kwargs and not kwargs.get("allow_is_causal_skip", True)
    if not packed or mask_function is None or q_length != kv_length:
        return None
    numbers = _sequence_numbers(mask_function, batch_size, q_length, q_offset, kv_offset, kwargs.get("device", "cpu"))
    expect_host_read(numbers)
    return numbers


def _chunked(kwargs: dict) -> bool:
    """Whether transformers builds a chunked-attention mask, which the op has no mode for.

    create_chunked_causal_mask passes `local_size`, the config's `attention_chunk_size` (not its sliding window)."""
    config, local_size = kwargs.get("config"), kwargs.get("local_size")
    chunk = getattr(config, "attention_chunk_size", None)
    return local_size is not None and local_size == chunk and local_size != getattr(config, "sliding_window", None)


def _sequence_numbers(
    mask_function: Callable, batch_size: int, length: int, q_offset: int, kv_offset: int, device: torch.device | str
) -> torch.Tensor:
    """Each token's sequence number in its row (from 1), or -1 where it sees the token after it (see the module)."""
    rows = torch.arange(batch_size, device=device)[:, None]
    heads = torch.zeros((), dtype=torch.long, device=device)
    q = torch.arange(1, length, device=device)[None, :]
    sees_previous = mask_function(rows, heads, q + q_offset, q - 1 + kv_offset).expand(batch_size, length - 1)
    q = torch.arange(length - 1, device=device)[None, :]
    sees_next = mask_function(rows, heads, q + q_offset, q + 1 + kv_offset).expand(batch_size, length - 1)
    starts = torch.cat([torch.ones(batch_size, 1, dtype=torch.bool, device=device), ~sees_previous], dim=1)
    numbers = starts.to(torch.int32).cumsum(1, dtype=torch.int32)
    overlaid = torch.cat([sees_next, torch.zeros(batch_size, 1, dtype=torch.bool, device=device)], dim=1)
    numbers = torch.where(overlaid, torch.full_like(numbers, -1), numbers)
    setattr(numbers, MASK_FUNCTION_ATTRIBUTE, (mask_function, q_offset, kv_offset))
    return numbers
