"""Emulated `torch_npu.npu_cross_entropy_loss` and its backward: the contract in docs/torch-npu-ops.md, section
"npu_cross_entropy_loss".

Per row n of `input [N, C]`, in float32: `log_prob = x - logsumexp(x)`, `l_n = -w[y_n] * log_prob[n, y_n]` and,
with label smoothing ls, `(1 - ls) * l_n + ls / C * (-sum_c w[c] * log_prob[n, c])`; rows whose target is
`ignore_index` count 0, only when `ignore_index >= 0` (a negative one ignores nothing, and every target must lie in
[0, C)). 'mean' divides the sum by `sum_n w[y_n]` over the rows not ignored, 'sum' sums, 'none' keeps `[N]`.
loss and log_prob are cast once to the input's dtype; zloss and lse_for_zloss are empty (not supported by the op).
Only loss is differentiable; the autograd node keeps log_prob (and target, weight), as op-plugin's derivatives.yaml
says, and its backward is `npu_cross_entropy_loss_backward`, whose gradient takes grad_loss's dtype.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..checks import FLOAT_DTYPES, require_npu

__all__ = ["npu_cross_entropy_loss", "npu_cross_entropy_loss_backward"]

REDUCTIONS = ("mean", "sum", "none")
MAX_ROWS = 200_000


def npu_cross_entropy_loss(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale_for_zloss: float = 0.0,
    return_zloss: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    require_npu("npu_cross_entropy_loss", input=input, target=target, **({} if weight is None else {"weight": weight}))
    if lse_square_scale_for_zloss != 0.0 or return_zloss:
        raise NotImplementedError("npu_cross_entropy_loss: z-loss is not supported by the op (its docs: not yet)")
    _check(input, target, weight, reduction, ignore_index, label_smoothing)
    if torch.is_grad_enabled() and input.requires_grad:
        defaults = weight is None and ignore_index == -100 and label_smoothing == 0.0
        if (reduction == "mean" and not defaults) or label_smoothing != 0.0:
            raise RuntimeError(
                "npu_cross_entropy_loss: with input.requires_grad, 'mean' takes only the default weight, "
                "ignore_index and label_smoothing, 'sum' and 'none' only label_smoothing 0"
            )
    settings = (reduction, ignore_index, label_smoothing)
    loss, log_prob = _CrossEntropy.apply(input, target, weight, settings)
    empty = input.new_empty(0)
    return loss, log_prob, empty, empty.clone()


def npu_cross_entropy_loss_backward(
    grad_loss: torch.Tensor,
    log_prob: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    grad_zloss: torch.Tensor | None = None,
    lse_for_zloss: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    lse_square_scale_for_zloss: float = 0.0,
) -> torch.Tensor:
    require_npu("npu_cross_entropy_loss_backward", grad_loss=grad_loss, log_prob=log_prob, target=target)
    if lse_square_scale_for_zloss != 0.0 or (grad_zloss is not None and grad_zloss.numel()):
        raise NotImplementedError("npu_cross_entropy_loss_backward: z-loss is not supported by the op")
    _check(log_prob, target, weight, reduction, ignore_index, label_smoothing)
    expected = (log_prob.shape[0],) if reduction == "none" else (1,)
    if grad_loss.dtype not in FLOAT_DTYPES or tuple(grad_loss.shape) not in (expected, ()):
        raise RuntimeError(f"npu_cross_entropy_loss_backward: grad_loss must be {expected}, got {grad_loss.shape}")
    return _backward(grad_loss, log_prob, target, weight, reduction, ignore_index, label_smoothing)


def _check(x, target, weight, reduction, ignore_index, label_smoothing) -> None:
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES or not 0 < x.shape[0] <= MAX_ROWS or x.shape[1] == 0:
        raise RuntimeError(f"npu_cross_entropy_loss: input must be [N in (0, 200000], C > 0] fp16/bf16/fp32, got "
                           f"{tuple(x.shape)} {x.dtype}")  # fmt: skip
    classes = x.shape[1]
    if target.dtype != torch.int64 or tuple(target.shape) != (x.shape[0],):
        raise RuntimeError(f"npu_cross_entropy_loss: target must be int64 [{x.shape[0]}], got {target.dtype}")
    if weight is not None and (weight.dtype != torch.float32 or tuple(weight.shape) != (classes,)):
        raise RuntimeError(f"npu_cross_entropy_loss: weight must be float32 [{classes}]")
    if reduction not in REDUCTIONS or ignore_index >= classes or not 0.0 <= label_smoothing < 1.0:
        raise RuntimeError(
            f"npu_cross_entropy_loss: reduction {reduction!r} not in {REDUCTIONS}, ignore_index {ignore_index} not "
            f"below {classes}, or label_smoothing {label_smoothing} outside [0, 1)"
        )
    counted = target if ignore_index < 0 else target[target != ignore_index]
    if counted.numel() and not (int(counted.min()) >= 0 and int(counted.max()) < classes):
        # the op reads out of bounds there; the emulation refuses what the device would compute wrongly
        raise RuntimeError(f"npu_cross_entropy_loss: targets must lie in [0, {classes}) or equal ignore_index >= 0")


def _row_weights(target, weight, ignore_index, classes: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(w of all classes, w[y_n] masked by the ignored rows), float32."""
    w = torch.ones(classes, device=device) if weight is None else weight
    kept = torch.ones_like(target, dtype=torch.bool) if ignore_index < 0 else target != ignore_index
    safe = torch.where(kept, target, 0)
    return w, w.gather(0, safe) * kept


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, settings: tuple):
        reduction, ignore_index, label_smoothing = settings
        log_prob = torch.log_softmax(x.float(), dim=-1)
        w, w_target = _row_weights(target, weight, ignore_index, x.shape[1], x.device)
        safe = torch.where(w_target != 0, target, 0).unsqueeze(1)
        per_row = -log_prob.gather(1, safe).squeeze(1) * w_target
        if label_smoothing:
            smooth = -(log_prob * w).sum(dim=-1) * (w_target != 0)
            per_row = (1 - label_smoothing) * per_row + label_smoothing / x.shape[1] * smooth
        if reduction == "mean":
            loss = (per_row.sum() / w_target.sum()).reshape(1)
        elif reduction == "sum":
            loss = per_row.sum().reshape(1)
        else:
            loss = per_row
        log_prob = log_prob.to(x.dtype)
        ctx.settings = settings
        ctx.save_for_backward(log_prob, target, weight)
        ctx.mark_non_differentiable(log_prob)
        return loss.to(x.dtype), log_prob

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor, _grad_log_prob):
        log_prob, target, weight = ctx.saved_tensors
        grad = _backward(grad_loss, log_prob, target, weight, *ctx.settings)
        return grad.to(log_prob.dtype), None, None, None


def _backward(grad_loss, log_prob, target, weight, reduction, ignore_index, label_smoothing) -> torch.Tensor:
    """d loss / d input from the kept log_prob, float32 inside, in grad_loss's dtype."""
    classes = log_prob.shape[1]
    w, w_target = _row_weights(target, weight, ignore_index, classes, log_prob.device)
    prob = log_prob.float().exp()
    one_hot = torch.zeros_like(prob).scatter_(1, torch.where(w_target != 0, target, 0).unsqueeze(1), 1.0)
    grad = (prob - one_hot) * w_target.unsqueeze(1)
    if label_smoothing:
        smooth = (prob * w.sum() - w) * (w_target != 0).unsqueeze(1)
        grad = (1 - label_smoothing) * grad + label_smoothing / classes * smooth
    scale = grad_loss.float().reshape(-1, 1) if reduction == "none" else grad_loss.float().reshape(1, 1)
    if reduction == "mean":
        scale = scale / w_target.sum()
    return (grad * scale).to(grad_loss.dtype)
