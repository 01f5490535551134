"""npu-linear-cross-entropy: transformers' causal-LM lm_head + loss on Huawei Ascend NPUs, chunked.

It is chunked over the tokens (torch_npu.npu_cross_entropy_loss), never holding the full logits."""

from . import layers
from ._build import VARIANT
from .loss import (
    chunked_form_pays,
    default_chunk_tokens,
    linear_cross_entropy,
    linear_cross_entropy_eager,
    linear_cross_entropy_unavailable_reason,
)

__all__ = [
    "VARIANT",
    "chunked_form_pays",
    "default_chunk_tokens",
    "layers",
    "linear_cross_entropy",
    "linear_cross_entropy_eager",
    "linear_cross_entropy_unavailable_reason",
]
