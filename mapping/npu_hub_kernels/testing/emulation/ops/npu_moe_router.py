"""Emulated `torch_npu.npu_moe_gating_top_k` and its backward, and `npu_moe_gating_top_k_softmax_v2`.

The contracts are in docs/torch-npu-ops.md, sections "npu_moe_gating_top_k" and "npu_moe_gating_top_k_softmax_v2";
the limits of all three are in `LEDGER`.

Per row, in float32: `norm = softmax(x)` or `sigmoid(x)`; experts are chosen on `norm + bias`, after
masking to -inf all but the `k_group` best of `group_count` groups (scored by their maximum or the sum
of their two largest values); ties go to the lower index (the golden's stable sort). `y = norm[idx]`,
divided by `sum + eps` in sigmoid mode only, times `routed_scaling_factor`, cast once to x's dtype.
norm_out is written only with `out_flag=True` (NaN here otherwise: unwritten on the device). The
backward is the op's `npu_moe_gating_top_k_backward` from the norm_out and expert_idx it keeps, with what
derivatives.yaml passes it (the forward's renorm and norm_type): it takes the sigmoid mode only, so a softmax
forward that autograd recorded raises at backward, as on the device.

npu_moe_gating_top_k_softmax_v2, per row of the last dim: with renorm 0, `softmax(x)` in float32, then its top k;
with renorm 1, the top k of x, then their softmax in float32. Ties go to the lower index (op-plugin's golden: a stable
argsort); y is cast once to x's dtype, the ids are int32, and rows that `finished` marks get the id `experts`. The
float32 softmax is the third output only with renorm 0 and output_softmax (an empty [0] tensor otherwise, as the
adapter allocates it). It has no derivative: torch_npu's generic autograd fallback.
"""

from __future__ import annotations

import torch

from ..backward import device_backward, without_derivative
from ..checks import FLOAT_DTYPES, require_npu
from ..ledger import OP_PLUGIN, derivatives, enforce, op_doc, rules

__all__ = ["npu_moe_gating_top_k", "npu_moe_gating_top_k_backward", "npu_moe_gating_top_k_softmax_v2"]

MAX_EXPERTS = 2048
SOFTMAX, SIGMOID = 0, 1


def _experts(c) -> int:
    return c.x.shape[-1]


def _ceil32(n: int) -> int:
    return -(-n // 32) * 32


FORWARD_RULES = rules(
    "npu_moe_gating_top_k",
    ("x-rank", "x is 2-D [tokens, experts]", op_doc(10823), lambda c: c.x.dim() == 2),
    ("x-dtype", "x is float16, bfloat16 or float32", op_doc(10823), lambda c: c.x.dtype in FLOAT_DTYPES),
    ("experts-max", f"at most {MAX_EXPERTS} experts (x's last dim)", op_doc(10823),
     lambda c: _experts(c) <= MAX_EXPERTS),
    ("bias-shape", "bias is 1-D, of x's last dim", op_doc(10829),
     lambda c: c.bias is None or tuple(c.bias.shape) == (_experts(c),)),
    ("bias-dtype", "bias has x's dtype", op_doc(10829), lambda c: c.bias is None or c.bias.dtype == c.x.dtype),
    ("group-count", "group_count > 0 divides the experts", op_doc(10837),
     lambda c: c.group_count > 0 and _experts(c) % c.group_count == 0),
    ("experts-per-group", "more than 2 experts per group (experts / group_count > 2), with one group too",
     op_doc(10837), lambda c: _experts(c) // c.group_count > 2),
    ("groups-aligned", f"group_count * (experts per group rounded up to 32) <= {MAX_EXPERTS}", op_doc(10837),
     lambda c: c.group_count * _ceil32(_experts(c) // c.group_count) <= MAX_EXPERTS),
    ("k-group", "1 <= k_group <= group_count", op_doc(10835), lambda c: 1 <= c.k_group <= c.group_count),
    ("k-range", "1 <= k <= experts / group_count * k_group", op_doc(10825),
     lambda c: 1 <= c.k <= _experts(c) // c.group_count * c.k_group),
    ("group-select-mode", "group_select_mode is 0 (a group's max) or 1 (the sum of its top 2)", op_doc(10839),
     lambda c: c.group_select_mode in (0, 1)),
    ("renorm", "renorm is 0 (norm, then top-k): the only mode supported", op_doc(10841), lambda c: c.renorm == 0),
    ("norm-type", "norm_type is 0 (softmax) or 1 (sigmoid)", op_doc(10842),
     lambda c: c.norm_type in (SOFTMAX, SIGMOID)),
)  # fmt: skip
BACKWARD_RULES = rules(
    "npu_moe_gating_top_k_backward",
    ("norm-type", "norm_type is 1: only the sigmoid mode has a backward (the forward's norm_type, which "
     f"derivatives.yaml passes it: {derivatives(375)})", op_doc(10940), lambda c: c.norm_type == SIGMOID),
    ("renorm", "renorm is 0 (a reserved flag; the forward takes only 0)", op_doc(10938), lambda c: c.renorm == 0),
    ("x-norm-rank", "x_norm (the forward's norm_out) is 2-D [M, N]", op_doc(10932), lambda c: c.x_norm.dim() == 2),
    ("x-norm-dtype", "x_norm is float32", op_doc(10932), lambda c: c.x_norm.dtype == torch.float32),
    ("experts-range", f"2 <= N <= {MAX_EXPERTS} experts", op_doc(10932),
     lambda c: 2 <= c.x_norm.shape[1] <= MAX_EXPERTS),
    ("grad-y-shape", "grad_y is 2-D [M, K], with x_norm's M", op_doc(10934),
     lambda c: c.grad_y.dim() == 2 and c.grad_y.shape[0] == c.x_norm.shape[0]),
    ("grad-y-dtype", "grad_y is float16, bfloat16 or float32", op_doc(10934),
     lambda c: c.grad_y.dtype in FLOAT_DTYPES),
    ("grad-y-contiguous", "grad_y is contiguous", op_doc(10934), lambda c: c.grad_y.is_contiguous()),
    ("k-range", "1 <= K <= N", op_doc(10934), lambda c: 1 <= c.grad_y.shape[1] <= c.x_norm.shape[1]),
    ("expert-idx", "expert_idx is int32, contiguous, of grad_y's shape", op_doc(10936),
     lambda c: c.expert_idx.dtype == torch.int32 and c.expert_idx.shape == c.grad_y.shape
     and c.expert_idx.is_contiguous()),
)  # fmt: skip
SOFTMAX_V2_MAX_K = 1024
_SOFTMAX_V2_ADAPTER = f"{OP_PLUGIN}:op_plugin/ops/opapi/MoeGatingTopKSoftmaxV2KernelNpuOpApi.cpp"
SOFTMAX_V2_RULES = rules(
    "npu_moe_gating_top_k_softmax_v2",
    ("x-rank", "x is 2-D or 3-D, experts last", op_doc(10766), lambda c: c.x.dim() in (2, 3)),
    ("x-dtype", "x is float16, bfloat16 or float32", op_doc(10766), lambda c: c.x.dtype in FLOAT_DTYPES),
    ("k-range", f"1 <= k <= experts (x's last dim) and k <= {SOFTMAX_V2_MAX_K}", op_doc(10768),
     lambda c: 1 <= c.k <= min(_experts(c), SOFTMAX_V2_MAX_K),
     "the adapter (line 43) takes k = 0 and returns without running the kernel; the docstring's 0 < k holds"),
    ("renorm", "renorm is 0 (softmax, then top-k) or 1 (top-k, then softmax)", f"{_SOFTMAX_V2_ADAPTER}:52",
     lambda c: c.renorm in (0, 1)),
    ("finished", "finished is None or bool, of x's shape but its last dim", op_doc(10767),
     lambda c: c.finished is None or (c.finished.dtype == torch.bool and c.finished.shape == c.x.shape[:-1])),
)  # fmt: skip
LEDGER = FORWARD_RULES + BACKWARD_RULES + SOFTMAX_V2_RULES
"""The documented limits of the gating ops and the backward (ledger.py). Hash routing (input_ids, tid2eid) is
documented but not emulated: it raises NotImplementedError."""


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
    if input_ids is not None or tid2eid is not None:
        raise NotImplementedError("npu_moe_gating_top_k: hash routing (input_ids, tid2eid) is not emulated")
    enforce(
        FORWARD_RULES, x=x, k=k, bias=bias, k_group=k_group, group_count=group_count,
        group_select_mode=group_select_mode, renorm=renorm, norm_type=norm_type,
    )  # fmt: skip
    settings = (k, k_group, group_count, group_select_mode, renorm, norm_type, out_flag, routed_scaling_factor, eps)
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
    return _gating_backward(x_norm, grad_y, expert_idx, renorm, norm_type, routed_scaling_factor, eps)


def npu_moe_gating_top_k_softmax_v2(
    x: torch.Tensor,
    *,
    k: int = 1,
    finished: torch.Tensor | None = None,
    renorm: int = 0,
    output_softmax: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    require_npu("npu_moe_gating_top_k_softmax_v2", x=x, **({} if finished is None else {"finished": finished}))
    enforce(SOFTMAX_V2_RULES, x=x, k=k, finished=finished, renorm=renorm)
    experts = x.shape[-1]
    with torch.no_grad():
        rows = x.reshape(-1, experts)
        if renorm == 1:
            idx = _stable_top(rows, k)
            y = torch.softmax(rows.gather(1, idx).float(), dim=-1)
        else:
            probs = torch.softmax(rows.float(), dim=-1)
            idx = _stable_top(probs, k)
            y = probs.gather(1, idx)
        if finished is not None:
            idx = idx.masked_fill(finished.reshape(-1, 1), experts)
        y = y.to(x.dtype).reshape(*x.shape[:-1], k)
        expert_idx = idx.to(torch.int32).reshape(*x.shape[:-1], k)
        written = renorm == 0 and output_softmax
        softmax = probs.reshape(x.shape) if written else x.new_empty((0,), dtype=torch.float32)
    return tuple(without_derivative("npu_moe_gating_top_k_softmax_v2", t, x) for t in (y, expert_idx, softmax))


class _GatingTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, settings: tuple):
        ctx.set_materialize_grads(False)  # an unused output: no gradient, no backward op run
        k, k_group, group_count, group_select_mode, renorm, norm_type, out_flag, scale, eps = settings
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
        # the device writes new contiguous outputs whatever x's strides (a transposed x makes strided ones here)
        y = (y * scale).to(x.dtype).contiguous()
        norm_out = (
            norm.contiguous()
            if out_flag
            else torch.full_like(norm, float("nan"), memory_format=torch.contiguous_format)
        )
        expert_idx = idx.to(torch.int32).contiguous()
        ctx.settings = (renorm, norm_type, scale, eps)
        ctx.save_for_backward(norm_out, expert_idx)
        ctx.mark_non_differentiable(expert_idx, norm_out)
        return y, expert_idx, norm_out

    @staticmethod
    @device_backward("npu_moe_gating_top_k_backward")
    def backward(ctx, grad_y: torch.Tensor, _grad_idx, _grad_norm):
        # derivatives.yaml: npu_moe_gating_top_k_backward(result2, grad, result1, renorm, norm_type, scale, eps)
        norm_out, expert_idx = ctx.saved_tensors
        return _gating_backward(norm_out, grad_y, expert_idx, *ctx.settings), None, None


def _stable_top(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest per row, largest first, ties to the lower index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


def _gating_backward(
    norm: torch.Tensor, grad_y: torch.Tensor, expert_idx: torch.Tensor, renorm: int, norm_type: int, scale: float,
    eps: float,
) -> torch.Tensor:  # fmt: skip
    """npu_moe_gating_top_k_backward within its rules (sigmoid mode): d/dx of `y = scale * norm[idx] / (sum + eps)`.

    Here `norm = sigmoid(x)`; it computes in float32 inside and returns grad_y's dtype.
    """
    enforce(BACKWARD_RULES, x_norm=norm, grad_y=grad_y, expert_idx=expert_idx, renorm=renorm, norm_type=norm_type)
    idx = expert_idx.long()
    grad = grad_y.float() * scale
    chosen = norm.gather(1, idx)
    total = chosen.sum(dim=-1, keepdim=True) + eps
    grad = grad / total - (grad * chosen).sum(dim=-1, keepdim=True) / total.square()
    grad_norm = torch.zeros_like(norm).scatter_add_(1, idx, grad)
    return (grad_norm * norm * (1 - norm)).to(grad_y.dtype)
