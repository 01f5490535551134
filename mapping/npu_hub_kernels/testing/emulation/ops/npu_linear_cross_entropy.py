"""Emulated `torch_npu.npu_cross_entropy_loss` and its backward, as docs/torch-npu-ops.md states them.

The contract is in docs/torch-npu-ops.md, section "npu_cross_entropy_loss".

Per row n of `input [N, C]`, in float32: `log_prob = x - logsumexp(x)`, `l_n = -w[y_n] * log_prob[n, y_n]` and,
with label smoothing ls, `(1 - ls) * l_n + ls / C * (-sum_c w[c] * log_prob[n, c])`; rows whose target is
`ignore_index` count 0, only when `ignore_index >= 0` (a negative one ignores nothing, and every target must lie in
[0, C)). 'mean' divides the sum by `sum_n w[y_n]` over the rows not ignored, 'sum' sums, 'none' keeps `[N]`.
loss and log_prob are cast once to the input's dtype; zloss and lse_for_zloss are empty (not supported by the op).
Only loss is differentiable; the autograd node keeps log_prob (and target, weight), as op-plugin's derivatives.yaml
says, and its backward is `npu_cross_entropy_loss_backward`, whose gradient takes grad_loss's dtype and which takes no
label smoothing yet.
"""

from __future__ import annotations

import torch

from ..backward import device_backward
from ..checks import FLOAT_DTYPES, require_npu
from ..ledger import OPS_NN, enforce, functions_yaml, op_doc, rules

__all__ = ["npu_cross_entropy_loss", "npu_cross_entropy_loss_backward"]

REDUCTIONS = ("mean", "sum", "none")
MAX_ROWS = 200_000
_GRAD_DOC = f"{OPS_NN}:loss/cross_entropy_loss_grad/docs/aclnnCrossEntropyLossGrad.md"


def _targets_in_range(c, x) -> bool:
    """Every target in [0, C), or equal to ignore_index >= 0 (a negative ignore_index ignores nothing)."""
    counted = c.target if c.ignore_index < 0 else c.target[c.target != c.ignore_index]
    return not counted.numel() or (int(counted.min()) >= 0 and int(counted.max()) < x.shape[1])


def _weight_ok(c, x) -> bool:
    return c.weight is None or (c.weight.dtype == torch.float32 and tuple(c.weight.shape) == (x.shape[1],))


def _recording(c) -> bool:
    return torch.is_grad_enabled() and c.input.requires_grad


FORWARD_RULES = rules(
    "npu_cross_entropy_loss",
    ("input-rank", "input is 2-D [N, C]", op_doc(12045), lambda c: c.input.dim() == 2),
    ("input-dtype", "input is float16, bfloat16 or float32", op_doc(12045), lambda c: c.input.dtype in FLOAT_DTYPES),
    ("classes", "C > 0", op_doc(12045), lambda c: c.input.shape[1] > 0),
    ("rows", f"0 < N <= {MAX_ROWS}", op_doc(12061), lambda c: 0 < c.input.shape[0] <= MAX_ROWS),
    ("target", "target is int64 [N]", op_doc(12046),
     lambda c: c.target.dtype == torch.int64 and tuple(c.target.shape) == (c.input.shape[0],)),
    ("weight", "weight is float32 [C]", op_doc(12047), lambda c: _weight_ok(c, c.input)),
    ("weight-range", "every class weight lies in (0, 1]", op_doc(12047),
     lambda c: c.weight is None or bool(((c.weight > 0) & (c.weight <= 1)).all())),
    ("reduction", f"reduction is one of {REDUCTIONS}", op_doc(12048), lambda c: c.reduction in REDUCTIONS),
    ("ignore-index", "ignore_index < C", op_doc(12049), lambda c: c.ignore_index < c.input.shape[1]),
    ("label-smoothing", "label_smoothing lies in [0, 1)", op_doc(12050), lambda c: 0.0 <= c.label_smoothing < 1.0),
    ("zloss", "no z-loss: lse_square_scale_for_zloss 0 and return_zloss False (not supported yet)", op_doc(12051),
     lambda c: c.lse_square_scale_for_zloss == 0.0 and not c.return_zloss),
    ("target-range", "every target lies in [0, C) (or equals ignore_index >= 0: the grad's doc, the golden); the "
     "device reads outside the row otherwise", op_doc(12046), lambda c: _targets_in_range(c, c.input),
     f"also {_GRAD_DOC}:201"),
    ("grad-mean-defaults", "with input.requires_grad, 'mean' takes only the defaults of weight, ignore_index and "
     "label_smoothing", op_doc(12062),
     lambda c: not (_recording(c) and c.reduction == "mean"
                    and (c.weight is not None or c.ignore_index != -100 or c.label_smoothing != 0.0))),
    ("grad-label-smoothing", "with input.requires_grad, 'sum' and 'none' take only label_smoothing 0", op_doc(12062),
     lambda c: not (_recording(c) and c.label_smoothing != 0.0)),
)  # fmt: skip
BACKWARD_RULES = rules(
    "npu_cross_entropy_loss_backward",
    ("log-prob", "log_prob is 2-D [N, C > 0], float16, bfloat16 or float32", f"{_GRAD_DOC}:188",
     lambda c: c.log_prob.dim() == 2 and c.log_prob.shape[1] > 0 and c.log_prob.dtype in FLOAT_DTYPES),
    ("grad-loss-dtype", "grad_loss has log_prob's dtype (the gradient takes grad_loss's)", f"{_GRAD_DOC}:391",
     lambda c: c.grad_loss.dtype == c.log_prob.dtype, f"the output's dtype: {functions_yaml(7197)}"),
    ("grad-loss-shape", "grad_loss is [N] for 'none', one element otherwise", f"{_GRAD_DOC}:181",
     lambda c: tuple(c.grad_loss.shape) in (((c.log_prob.shape[0],),) if c.reduction == "none" else ((1,), ())),
     "the aclnn doc says 0-D for mean/sum; torch_npu's loss is [1] and its autograd passes that gradient"),
    ("target", "target is int64 [N]", f"{_GRAD_DOC}:201",
     lambda c: c.target.dtype == torch.int64 and tuple(c.target.shape) == (c.log_prob.shape[0],)),
    ("target-range", "every target lies in [0, C), or equals ignore_index >= 0", f"{_GRAD_DOC}:201",
     lambda c: _targets_in_range(c, c.log_prob)),
    ("weight", "weight is float32 [C]", f"{_GRAD_DOC}:212", lambda c: _weight_ok(c, c.log_prob)),
    ("reduction", f"reduction is one of {REDUCTIONS}", f"{_GRAD_DOC}:241", lambda c: c.reduction in REDUCTIONS),
    ("label-smoothing", "label_smoothing is 0 (the only value it takes yet: 当前仅支持输入0.0)", f"{_GRAD_DOC}:261",
     lambda c: c.label_smoothing == 0.0),
    ("zloss", "no z-loss inputs: grad_zloss empty or None, lse_square_scale_for_zloss 0 (not supported yet)",
     f"{_GRAD_DOC}:392",
     lambda c: (c.grad_zloss is None or not c.grad_zloss.numel()) and c.lse_square_scale_for_zloss == 0.0),
)  # fmt: skip
LEDGER = FORWARD_RULES + BACKWARD_RULES
"""The documented limits of the loss op and its backward (ledger.py)."""


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
    enforce(
        FORWARD_RULES, input=input, target=target, weight=weight, reduction=reduction, ignore_index=ignore_index,
        label_smoothing=label_smoothing, lse_square_scale_for_zloss=lse_square_scale_for_zloss,
        return_zloss=return_zloss,
    )  # fmt: skip
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
    zloss = {"grad_zloss": grad_zloss, "lse_square_scale_for_zloss": lse_square_scale_for_zloss}
    return _backward(grad_loss, log_prob, target, weight, reduction, ignore_index, label_smoothing, **zloss)


def _row_weights(target, weight, ignore_index, classes: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(w of all classes, w[y_n] masked by the ignored rows), float32."""
    w = torch.ones(classes, device=device) if weight is None else weight
    kept = torch.ones_like(target, dtype=torch.bool) if ignore_index < 0 else target != ignore_index
    safe = torch.where(kept, target, 0)
    return w, w.gather(0, safe) * kept


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, settings: tuple):
        ctx.set_materialize_grads(False)  # an unused output: no gradient, no backward op run
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
    @device_backward("npu_cross_entropy_loss_backward")
    def backward(ctx, grad_loss: torch.Tensor, _grad_log_prob):
        # derivatives.yaml: npu_cross_entropy_loss_backward(grads[0], result1, target, weight, grads[1], ...)
        log_prob, target, weight = ctx.saved_tensors
        return _backward(grad_loss, log_prob, target, weight, *ctx.settings), None, None, None


def _backward(
    grad_loss, log_prob, target, weight, reduction, ignore_index, label_smoothing, grad_zloss=None,
    lse_square_scale_for_zloss=0.0,
) -> torch.Tensor:  # fmt: skip
    """npu_cross_entropy_loss_backward within its rules: d loss / d input from the kept log_prob.

    It computes in float32 inside and returns grad_loss's dtype.
    """
    enforce(
        BACKWARD_RULES, grad_loss=grad_loss, log_prob=log_prob, target=target, weight=weight, reduction=reduction,
        ignore_index=ignore_index, label_smoothing=label_smoothing, grad_zloss=grad_zloss,
        lse_square_scale_for_zloss=lse_square_scale_for_zloss,
    )  # fmt: skip
    _, w_target = _row_weights(target, weight, ignore_index, log_prob.shape[1], log_prob.device)
    prob = log_prob.float().exp()
    one_hot = torch.zeros_like(prob).scatter_(1, torch.where(w_target != 0, target, 0).unsqueeze(1), 1.0)
    grad = (prob - one_hot) * w_target.unsqueeze(1)
    scale = grad_loss.float().reshape(-1, 1) if reduction == "none" else grad_loss.float().reshape(1, 1)
    if reduction == "mean":
        scale = scale / w_target.sum()
    return (grad * scale).to(grad_loss.dtype)
