"""One device-to-host copy per forward for the masks of every layer type: how the card reads its masks on the host.

transformers calls the card's mask function once per mask kind and forward (a full and a sliding mask in Gemma3,
Cohere2 or gpt-oss), each kind with a tensor of its own, although both come from the same padding mask or the same
`position_ids`. The attention function needs a mask's sequence lengths on the host (the op's actual_seq lists are host
integers), and reading each kind's mask when its first layer runs would drain the device's queue once per kind.

So the mask function records each mask it returns (`expect_host_read`), and the first `host_copy` of a forward reads
every recorded mask of its thread and device in one copy, keeping each mask's host copy on the mask itself
(`HOST_COPY_ATTRIBUTE`): it lives exactly as long as the mask, and a layer of the other kind finds it there. A mask
the mask function did not make (a model that rebuilt it) is read on its own, once. Masks are recorded by weak
reference, so a mask nobody reads (a packed batch whose `cu_seq_lens` the attention reads instead) is dropped with its
forward.
"""

from __future__ import annotations

import threading
import weakref

import torch

HOST_COPY_ATTRIBUTE = "npu_fused_attention_host_copy"
"""The attribute of a mask tensor holding its host copy, once read."""

_recorded = threading.local()
"""`masks`: weak references to this thread's masks not yet read, in the order the mask function made them."""


def _live_recorded() -> list[torch.Tensor]:
    """This thread's recorded masks still alive and not yet read (dead references are dropped from the record)."""
    masks = [mask for mask in (ref() for ref in getattr(_recorded, "masks", ())) if mask is not None]
    masks = [mask for mask in masks if not hasattr(mask, HOST_COPY_ATTRIBUTE)]
    _recorded.masks = [weakref.ref(mask) for mask in masks]
    return masks


def expect_host_read(mask: torch.Tensor) -> None:
    """Record `mask` (made by the mask function for this forward) to be read with the forward's other masks."""
    _live_recorded()
    _recorded.masks.append(weakref.ref(mask))


def host_copy(mask: torch.Tensor) -> torch.Tensor:
    """`mask` on the host, read with every recorded mask of its device in one copy the first time (see the module).

    Only masks of the same tensor type join the copy: a tracing mode's tensors (the bench's fake ones) cannot mix
    with the device's."""
    copy = getattr(mask, HOST_COPY_ATTRIBUTE, None)
    if copy is not None:
        return copy
    recorded = _live_recorded()
    batch = [other for other in recorded if other.device == mask.device and type(other) is type(mask)]
    if not any(other is mask for other in batch):
        batch.append(mask)
    flat = torch.cat([other.reshape(-1).to(torch.int32) for other in batch]).cpu()
    for other, part in zip(batch, flat.split([other.numel() for other in batch]), strict=True):
        setattr(other, HOST_COPY_ATTRIBUTE, part.view(other.shape).to(other.dtype))
    _recorded.masks = [weakref.ref(other) for other in recorded if not hasattr(other, HOST_COPY_ATTRIBUTE)]
    return getattr(mask, HOST_COPY_ATTRIBUTE)
