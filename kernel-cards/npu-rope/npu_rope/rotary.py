"""Rotary position embedding on torch_npu.npu_rotary_mul, with the eager math wherever the op does not apply."""

from __future__ import annotations

from typing import Literal

import torch

from ._npu import npu_unavailable_reason, torch_npu

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rotary_unavailable_reason(x: torch.Tensor, cos: torch.Tensor, heads_axis: int) -> str | None:
    """Why `npu_rotary_mul` will not rotate x (4-D, heads on `heads_axis`) by cos/sin, or None."""
    reason = npu_unavailable_reason(x, cos)
    if reason is not None:
        return reason
    if x.dtype not in FUSED_DTYPES:
        return f"dtype {x.dtype} is not supported by npu_rotary_mul (float16, bfloat16, float32)"
    if cos.dtype != x.dtype:
        return f"cos/sin dtype {cos.dtype} differs from {x.dtype}: eager promotes the output dtype"
    if x.dim() != 4 or cos.dim() != 4:
        return f"npu_rotary_mul takes 4-D q/k and cos/sin here, got {x.dim()}-D and {cos.dim()}-D"
    if x.numel() == 0:
        return "empty input"
    head_dim = x.shape[-1]
    if head_dim % 2 or head_dim >= 896:
        return f"head dim {head_dim} must be even and below 896"
    if torch.broadcast_shapes(x.shape, cos.shape) != x.shape:
        return f"cos {tuple(cos.shape)} does not broadcast to {tuple(x.shape)}"
    batch, heads = x.shape[0], x.shape[heads_axis]
    if batch >= 1000 or heads >= 1000:
        return f"batch {batch} and heads {heads} must both be below 1000"
    if cos.requires_grad and batch * heads > 1024:
        return f"batch x heads = {batch * heads} above 1024 with cos/sin requiring gradients"
    return None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: (x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_axis: int) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin`, fused on npu tensors; cos/sin already broadcastable to x."""
    if rotary_unavailable_reason(x, cos, heads_axis) is None:
        return torch_npu.npu_rotary_mul(x.contiguous(), cos.contiguous(), sin.contiguous())
    return (x * cos) + (rotate_half(x) * sin)


Style = Literal["llama", "cast_back", "float32", "half_angles"]
"""How a transformers family writes apply_rotary_pos_emb (all in the rotate_half convention):

- "llama": `q * cos + rotate_half(q) * sin` in the input dtypes (LlamaModel and 83 more).
- "cast_back": the same, then `.to(q.dtype)` (Olmo, Olmo2/3, FlexOlmo): differs when cos is float32.
- "float32": `q.float()` inside, cast back once (ESM, ModernBERT, Evolla, HunYuan-VL).
- "half_angles": cos/sin cover half the head dim, `first * cos - second * sin, second * cos + first * sin`
  over the two halves (GPT-OSS): the same rotation with cos/sin repeated over both halves.
"""


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
    style: Style = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb, written the way `style` says; q/k [B, H, S, D] or [B, S, H, D]."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    if style == "half_angles":
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return _apply(q, cos, sin, unsqueeze_dim, style), _apply(k, cos, sin, unsqueeze_dim, style)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads_axis: int, style: Style) -> torch.Tensor:
    if style == "float32":
        return rotate(x.float(), cos.float(), sin.float(), heads_axis).to(x.dtype)
    if style == "cast_back":
        compute = torch.promote_types(x.dtype, cos.dtype)
        return rotate(x.to(compute), cos.to(compute), sin.to(compute), heads_axis).to(x.dtype)
    return rotate(x, cos, sin, heads_axis)


def apply_rotary_pos_emb_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
    style: Style = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformers function of each style, operation for operation (the reference for the fused path)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    if style == "half_angles":

        def rotated(x):
            first, second = torch.chunk(x, 2, dim=-1)
            return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

        return rotated(q), rotated(k)
    if style == "float32":
        return tuple(((x.float() * cos) + (rotate_half(x.float()) * sin)).to(x.dtype) for x in (q, k))
    embedded = tuple((x * cos) + (rotate_half(x) * sin) for x in (q, k))
    if style == "cast_back":
        return embedded[0].to(q.dtype), embedded[1].to(k.dtype)
    return embedded
