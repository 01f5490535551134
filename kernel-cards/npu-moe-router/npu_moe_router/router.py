"""MoE routing (scores, top-k experts, weights) in one torch_npu gating op call.

transformers' routers compute, from the router logits `[T, E]`, the k experts of each token and their
weights in about ten small ops. Two torch_npu ops do the same in one call for three styles:
- softmax (`npu_moe_gating_top_k`): `probs = softmax(logits in float32)`, top-k of probs, weights cast to the
  logits' dtype, NOT renormalised (the op's softmax mode never divides by the top-k sum: docs/torch-npu-ops.md). Its
  backward takes the sigmoid mode only (`npu_moe_gating_top_k_backward`: norm_type 1), so the op runs a softmax
  router only where autograd does not record (inference, evaluation);
- renormalised softmax (`npu_moe_gating_top_k_softmax_v2`, renorm 1): softmax is monotone, so the top-k of the
  probabilities is the top-k of the logits, and the probabilities renormalised over the k are the softmax of the k
  logits: the op takes the top k of the logits, then their float32 softmax, cast to the logits' dtype. It has no
  backward (an inference op, its docstring says), so it runs where autograd does not record and the weights are
  wanted in the logits' dtype (Qwen3-MoE's routers, not Mixtral's float32 weights). Elsewhere `top_logits_softmax`
  computes the same in two ops (topk, softmax) where eager runs five, with autograd's own backward. Where eager's
  float32 probabilities of two experts tie while their logits differ (logits a few float32 ulps apart), both pick the
  expert of the larger logit, eager whichever torch.topk returns; the weights are the same;
- sigmoid (`npu_moe_gating_top_k`): `scores = sigmoid(logits)`, experts chosen on `scores + bias` within the
  `topk_groups` best of `num_groups` groups (scored by the sum of their two best), weights `scores[idx] / (sum + eps)`
  times `routed_scaling_factor` (the op's sigmoid mode always renormalises), with its backward (which has no
  derivative: a backward autograd records differentiates the eager weights of the op's experts instead).
Both ops give int32 ids; transformers' experts index with int64 (`one_hot`), so the ids are widened.
Anything else, or inputs outside the ops' limits, runs `moe_router_top_k_eager`: transformers' math.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from ._double_backward import with_eager_double_backward
from ._fallbacks import ran_eager
from ._npu import FUSED_DTYPES, atlas_a2_a3_unavailable_reason, npu_unavailable_reason, torch_npu

MAX_EXPERTS = 2048
MAX_TOP_K_RENORMALISED = 1024
"""npu_moe_gating_top_k_softmax_v2's largest k (its docstring: k <= 1024)."""
SCORINGS = ("softmax", "sigmoid")


def moe_router_top_k_unavailable_reason(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str,
    renormalize: bool,
    bias: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    eps: float = 0.0,
    routed_scaling_factor: float = 1.0,
    cast_weights: bool = True,
) -> str | None:
    """Why no torch_npu gating op will compute this routing, or None when one will (the module's docstring)."""
    if scoring not in SCORINGS:
        return f"scoring {scoring!r} is not one of {SCORINGS}"
    if scoring == "softmax" and renormalize:
        return _renormalised_softmax_unavailable_reason(
            router_logits, top_k, bias=bias, num_groups=num_groups, eps=eps,
            routed_scaling_factor=routed_scaling_factor, cast_weights=cast_weights,
        )  # fmt: skip
    if scoring == "softmax" and torch.is_grad_enabled() and router_logits.requires_grad:
        return (
            "softmax routing while autograd records: npu_moe_gating_top_k_backward takes the sigmoid mode only "
            "(norm_type 1), so training runs the eager softmax and top-k"
        )
    if scoring == "sigmoid" and not renormalize:
        return "sigmoid weights without renormalisation: npu_moe_gating_top_k's sigmoid mode always renormalises"
    reason = _logits_unavailable_reason("npu_moe_gating_top_k", router_logits, bias)
    if reason is not None:
        return reason
    experts = router_logits.shape[1]
    if experts > MAX_EXPERTS:
        return f"{experts} experts: npu_moe_gating_top_k takes at most {MAX_EXPERTS}"
    if num_groups < 1 or experts % num_groups or not 1 <= topk_groups <= num_groups:
        return f"{num_groups} groups, {topk_groups} kept, for {experts} experts"
    per_group = experts // num_groups
    if per_group <= 2 or num_groups * math.ceil(per_group / 32) * 32 > MAX_EXPERTS:
        return (
            f"{num_groups} group(s) of {per_group} experts: the op wants more than 2 per group (one group too), "
            f"at most {MAX_EXPERTS} with each group rounded up to 32"
        )
    if not 1 <= top_k <= per_group * topk_groups:
        return f"top-k {top_k} outside [1, {per_group * topk_groups}]"
    return None


def _logits_unavailable_reason(op: str, router_logits: torch.Tensor, *others: torch.Tensor | None) -> str | None:
    """Why the gating op `op` cannot take these router logits (and other inputs) on this device, or None."""
    reason = npu_unavailable_reason(router_logits, *(t for t in others if t is not None))
    reason = reason or atlas_a2_a3_unavailable_reason(op, router_logits.device)
    if reason is not None:
        return reason
    if router_logits.dtype not in FUSED_DTYPES:
        return f"dtype {router_logits.dtype} is not supported (float16, bfloat16, float32)"
    if router_logits.dim() != 2 or router_logits.shape[0] == 0:
        return f"router logits of shape {tuple(router_logits.shape)}: [tokens > 0, experts] needed"
    return None


def _renormalised_softmax_unavailable_reason(
    router_logits: torch.Tensor, top_k: int, *, bias: torch.Tensor | None, num_groups: int, eps: float,
    routed_scaling_factor: float, cast_weights: bool,
) -> str | None:  # fmt: skip
    """Why npu_moe_gating_top_k_softmax_v2 (renorm 1) will not compute this renormalised softmax routing, or None."""
    if bias is not None or num_groups != 1 or eps or routed_scaling_factor != 1.0:
        return "renormalised softmax with a correction bias, groups, an eps or a scaling factor: no op computes it"
    if torch.is_grad_enabled() and router_logits.requires_grad:
        return (
            "renormalised softmax routing while autograd records: npu_moe_gating_top_k_softmax_v2 has no backward "
            "(top_logits_softmax runs: the softmax of the top-k logits)"
        )
    if not cast_weights and router_logits.dtype is not torch.float32:
        return (
            f"float32 weights from {router_logits.dtype} logits: npu_moe_gating_top_k_softmax_v2 writes them in the "
            "logits' dtype (top_logits_softmax runs: the softmax of the top-k logits)"
        )
    reason = _logits_unavailable_reason("npu_moe_gating_top_k_softmax_v2", router_logits)
    if reason is not None:
        return reason
    if not 1 <= top_k <= min(router_logits.shape[1], MAX_TOP_K_RENORMALISED):
        return f"top-k {top_k} outside [1, min(experts, {MAX_TOP_K_RENORMALISED})]"
    return None


def moe_router_top_k(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str,
    renormalize: bool,
    eps: float = 0.0,
    bias: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    routed_scaling_factor: float = 1.0,
    cast_weights: bool = True,
    module: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], int64 expert ids [T, k]) of transformers' router math, fused on the NPU when it can be.

    It runs one npu_moe_gating_top_k, one npu_moe_gating_top_k_softmax_v2 or `top_logits_softmax` (renormalised
    softmax), or eager, as `moe_router_top_k_unavailable_reason` decides, recorded for `module` (the router, when its
    layer calls it). Weights in the logits' dtype, or float32 with `cast_weights=False` (Mixtral's routers return the
    float32 softmax).
    """
    groups = {"num_groups": num_groups, "topk_groups": topk_groups}
    reason = moe_router_top_k_unavailable_reason(
        router_logits, top_k, scoring=scoring, renormalize=renormalize, bias=bias, eps=eps,
        routed_scaling_factor=routed_scaling_factor, cast_weights=cast_weights, **groups,
    )  # fmt: skip
    if ran_eager(module, reason):
        plain_groups = bias is None and num_groups == 1 and not eps and routed_scaling_factor == 1.0
        if scoring == "softmax" and renormalize and plain_groups:
            weights, ids = top_logits_softmax(router_logits, top_k)
            return (weights.to(router_logits.dtype) if cast_weights else weights), ids
        return moe_router_top_k_eager(
            router_logits, top_k, scoring=scoring, renormalize=renormalize, eps=eps, bias=bias,
            routed_scaling_factor=routed_scaling_factor, cast_weights=cast_weights, **groups,
        )  # fmt: skip
    if scoring == "softmax" and renormalize:
        weights, ids, _ = torch_npu.npu_moe_gating_top_k_softmax_v2(router_logits, k=top_k, renorm=1)
        return weights, ids.long()
    weights, ids, _ = torch_npu.npu_moe_gating_top_k(
        router_logits,
        top_k,
        bias=None if bias is None else bias.to(router_logits.dtype),
        k_group=topk_groups,
        group_count=num_groups,
        group_select_mode=1,  # a group's score: the sum of its two best (transformers' DeepSeek-V3 routers)
        renorm=0,
        norm_type=SCORINGS.index(scoring),
        out_flag=torch.is_grad_enabled() and router_logits.requires_grad,  # the backward reads norm_out
        routed_scaling_factor=routed_scaling_factor,
        eps=eps,
    )
    ids = ids.long()
    if weights.requires_grad:
        weights = _ContiguousGradient.apply(weights)
        # npu_moe_gating_top_k_backward has no derivative: a backward autograd records differentiates eager's weights
        # of the op's experts instead (the choice of experts is piecewise constant: no gradient flows through it).
        eager = partial(
            _chosen_weights, ids=ids, scoring=scoring, renormalize=renormalize, eps=eps,
            routed_scaling_factor=routed_scaling_factor,
        )  # fmt: skip
        weights = with_eager_double_backward(weights, eager, router_logits)
    return weights, ids


def _chosen_weights(
    router_logits: torch.Tensor, *, ids: torch.Tensor, scoring: str, renormalize: bool, eps: float,
    routed_scaling_factor: float,
) -> torch.Tensor:  # fmt: skip
    """The weights `moe_router_top_k_eager` gives experts `ids`, in the logits' dtype: its math after the choice."""
    if scoring == "sigmoid":
        probs = router_logits.sigmoid()
    else:
        probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    weights = probs.gather(1, ids)
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + eps if eps else total)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights.to(router_logits.dtype)


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward hands on its gradient contiguous.

    npu_moe_gating_top_k_backward takes no other grad_y (its doc: 不支持非连续 Tensor), and autograd may give a
    strided one (a sum's expanded gradient). It returns the weights themselves, marked dirty, not a view made inside
    the Function, which PyTorch would refuse to let the user edit in place.
    """

    @staticmethod
    def forward(ctx, weights: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(weights)
        return weights

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def top_logits_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights, int64 ids) of a renormalised softmax router in two ops.

    The ops: the top-k logits, then their float32 softmax (equal to `softmax(logits)[top-k] / sum`; see the module's
    docstring for ties).
    """
    top = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(top.values, dim=-1, dtype=torch.float32), top.indices


def moe_router_top_k_eager(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str,
    renormalize: bool,
    eps: float = 0.0,
    bias: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    routed_scaling_factor: float = 1.0,
    cast_weights: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same routing with transformers' ops, op for op (Qwen2-MoE's, Mixtral's and DeepSeek-V3's routers).

    The weights are in the logits' dtype, or float32 with `cast_weights=False` (Mixtral).
    """
    if scoring == "softmax":
        probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    elif scoring == "sigmoid":
        probs = router_logits.sigmoid()
    else:
        raise ValueError(f"scoring {scoring!r} is not one of {SCORINGS}")
    choice = probs if bias is None else probs + bias
    if num_groups > 1:
        grouped = choice.view(-1, num_groups, choice.shape[-1] // num_groups)
        group_idx = torch.topk(grouped.topk(2, dim=-1)[0].sum(dim=-1), k=topk_groups, dim=-1, sorted=False)[1]
        kept = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=choice.device).scatter_(1, group_idx, True)
        choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view_as(choice)
    # Qwen2-MoE sorts its top-k, DeepSeek-V3 does not: the order of the ids is part of what each returns.
    top = torch.topk(choice, top_k, dim=-1, sorted=scoring == "softmax")
    ids = top.indices
    # Chosen on the weights themselves (Qwen2-MoE), top-k gives them; else they are gathered (DeepSeek-V3).
    weights = top.values if choice is probs else probs.gather(1, ids)
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + eps if eps else total)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return (weights.to(router_logits.dtype) if cast_weights else weights), ids
