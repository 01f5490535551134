"""Emulated `torch_npu.npu_moe_gating_top_k` and its backward: the contract in docs/torch-npu-ops.md,
section "npu_moe_gating_top_k".

Per row, in float32: `norm = softmax(x)` or `sigmoid(x)`; experts are chosen on `norm + bias`, after
masking to -inf all but the `k_group` best of `group_count` groups (scored by their maximum or the sum
of their two largest values); ties go to the lower index (the golden's stable sort). `y = norm[idx]`,
divided by `sum + eps` in sigmoid mode only, times `routed_scaling_factor`, cast once to x's dtype.
norm_out is written only with `out_flag=True` (NaN here otherwise: unwritten on the device). The
backward is the op's `npu_moe_gating_top_k_backward` from the norm_out and expert_idx it keeps.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from ..checks import FLOAT_DTYPES, require_npu

__all__ = ["npu_moe_gating_top_k", "npu_moe_gating_top_k_backward"]

MAX_EXPERTS = 2048
SOFTMAX, SIGMOID = 0, 1


def npu_moe_gating_top_k(
    x: torch.Tensor,
    k: int,
    *,
    bias: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    k_group: int = 1,
    group_count: int = 1,
    group_select_mode: int = 0,
    renorm: int = 0,
    norm_type: int = 0,
    out_flag: bool = False,
    routed_scaling_factor: float = 1.0,
    eps: float = 1e-20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    require_npu("npu_moe_gating_top_k", x=x, **({} if bias is None else {"bias": bias}))
    _check(x, k, bias, k_group, group_count, group_select_mode, renorm, norm_type)
    if input_ids is not None or tid2eid is not None:
        raise NotImplementedError("npu_moe_gating_top_k: hash routing (input_ids, tid2eid) is not emulated")
    settings = (k, k_group, group_count, group_select_mode, norm_type, out_flag, routed_scaling_factor, eps)
    return _GatingTopK.apply(x, bias, settings)


def npu_moe_gating_top_k_backward(
    x_norm: torch.Tensor,
    grad_y: torch.Tensor,
    expert_idx: torch.Tensor,
    *,
    renorm: int = 0,
    norm_type: int = 0,
    routed_scaling_factor: float = 1.0,
    eps: float = 1e-20,
) -> torch.Tensor:
    require_npu("npu_moe_gating_top_k_backward", x_norm=x_norm, grad_y=grad_y, expert_idx=expert_idx)
    if renorm != 0 or norm_type not in (SOFTMAX, SIGMOID):
        raise RuntimeError(f"npu_moe_gating_top_k_backward: renorm {renorm} must be 0, norm_type 0 or 1")
    return _gating_backward(x_norm, grad_y, expert_idx, norm_type, routed_scaling_factor, eps)


def _check(x, k, bias, k_group, group_count, group_select_mode, renorm, norm_type) -> None:
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise RuntimeError(f"npu_moe_gating_top_k: x must be 2-D fp16/bf16/fp32, got {x.dim()}-D {x.dtype}")
    experts = x.shape[1]
    if experts > MAX_EXPERTS:
        raise RuntimeError(f"npu_moe_gating_top_k: {experts} experts, at most {MAX_EXPERTS}")
    if bias is not None and (bias.dtype != x.dtype or tuple(bias.shape) != (experts,)):
        raise RuntimeError(
            f"npu_moe_gating_top_k: bias must be [{experts}] in {x.dtype}, got {bias.dtype} {bias.shape}"
        )
    if renorm != 0 or norm_type not in (SOFTMAX, SIGMOID) or group_select_mode not in (0, 1):
        raise RuntimeError("npu_moe_gating_top_k: renorm must be 0, norm_type and group_select_mode 0 or 1")
    if group_count < 1 or experts % group_count or not 1 <= k_group <= group_count:
        raise RuntimeError(f"npu_moe_gating_top_k: group_count {group_count}, k_group {k_group} for {experts} experts")
    per_group = experts // group_count
    if group_count > 1 and per_group <= 2:
        raise RuntimeError(f"npu_moe_gating_top_k: {per_group} experts per group, more than 2 needed")
    if group_count > 1 and group_count * math.ceil(per_group / 32) * 32 > MAX_EXPERTS:
        raise RuntimeError(f"npu_moe_gating_top_k: groups aligned to 32 experts exceed {MAX_EXPERTS}")
    if not 1 <= k <= per_group * k_group:
        raise RuntimeError(f"npu_moe_gating_top_k: k {k} must lie in [1, {per_group * k_group}]")


class _GatingTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, settings: tuple):
        k, k_group, group_count, group_select_mode, norm_type, out_flag, scale, eps = settings
        x32 = x.float()
        norm = torch.softmax(x32, dim=-1) if norm_type == SOFTMAX else torch.sigmoid(x32)
        choice = norm if bias is None else norm + bias.float()
        if group_count > 1:
            grouped = choice.view(choice.shape[0], group_count, -1)
            if group_select_mode == 0:
                group_scores = grouped.amax(dim=-1)
            else:
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            kept = _stable_top(group_scores, k_group)
            dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, kept, False)
            choice = grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view_as(norm)
        idx = _stable_top(choice, k)
        y = norm.gather(1, idx)
        if norm_type == SIGMOID:
            y = y / (y.sum(dim=-1, keepdim=True) + eps)
        y = (y * scale).to(x.dtype)
        norm_out = norm if out_flag else torch.full_like(norm, float("nan"))
        expert_idx = idx.to(torch.int32)
        ctx.settings = (norm_type, scale, eps)
        ctx.save_for_backward(norm_out, expert_idx)
        ctx.mark_non_differentiable(expert_idx, norm_out)
        return y, expert_idx, norm_out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: torch.Tensor, _grad_idx, _grad_norm):
        norm_out, expert_idx = ctx.saved_tensors
        return _gating_backward(norm_out, grad_y, expert_idx, *ctx.settings), None, None


def _stable_top(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest per row, largest first, ties to the lower index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


def _gating_backward(
    norm: torch.Tensor, grad_y: torch.Tensor, expert_idx: torch.Tensor, norm_type: int, scale: float, eps: float
) -> torch.Tensor:
    """d/dx of `y = scale * norm[idx] (/ (sum + eps) in sigmoid mode)`, `norm = softmax or sigmoid(x)`; float32."""
    idx = expert_idx.long()
    grad = grad_y.float() * scale
    if norm_type == SIGMOID:
        chosen = norm.gather(1, idx)
        total = chosen.sum(dim=-1, keepdim=True) + eps
        grad = grad / total - (grad * chosen).sum(dim=-1, keepdim=True) / total.square()
    grad_norm = torch.zeros_like(norm).scatter_add_(1, idx, grad)
    if norm_type == SIGMOID:
        grad_x = grad_norm * norm * (1 - norm)
    else:
        grad_x = norm * (grad_norm - (grad_norm * norm).sum(dim=-1, keepdim=True))
    return grad_x.to(grad_y.dtype)
