"""Rotary position embedding on torch_npu.npu_rotary_mul, with the eager math wherever the op does not apply."""

from __future__ import annotations

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


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb: q/k [B, H, S, D] (unsqueeze_dim=1) or [B, S, H, D] (2)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return rotate(q, cos, sin, unsqueeze_dim), rotate(k, cos, sin, unsqueeze_dim)


def apply_rotary_pos_emb_eager(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """LlamaModel's apply_rotary_pos_emb, operation for operation (the reference for the fused path)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
