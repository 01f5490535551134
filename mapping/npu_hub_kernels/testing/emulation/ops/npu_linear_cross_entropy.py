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

Also the device's `torch.addmm(self, mat1, mat2, out_dtype=torch.float32, out=out)` (aten `addmm.dtype_out`, which
torch_npu registers for the npu from 2.11 on: section "addmm.dtype_out" of docs/torch-npu-ops.md), which the card's
weight gradient sums into with 16-bit operands: `DEVICE_KERNELS`, run by the emulated device on its host data.
"""

from __future__ import annotations

import torch

from ..backward import device_backward
from ..checks import FLOAT_DTYPES, OP_CALLS, require_npu
from ..ledger import OP_PLUGIN, OPS_NN, enforce, functions_yaml, op_doc, rules

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

ADDMM_DTYPE_OUT = "addmm.dtype_out"
_ADDMM_DOC = f"{OPS_NN}:matmul/mat_mul_v3/docs/aclnnAddmm&aclnnInplaceAddmm.md"
_MATMUL_UTIL = f"{OPS_NN}:matmul/common/op_host/op_api/matmul_util.cpp"
_ADDMM_CPP = f"{OPS_NN}:matmul/mat_mul_v3/op_host/op_api/aclnn_addmm.cpp"
_HALF_DTYPES = (torch.float16, torch.bfloat16)
FLOAT32_OUT_CANN = (9, 1)
"""The first CANN whose aclnnAddmm takes float16/bfloat16 mat1 and mat2 into a float32 out ("16in32out": hicann/ops-nn
3f4fac5e9 and its fixes, in its branch 9.1.0, not in 9.0.0 nor in the 9.1.0 betas)."""


def cann_at_least(version: tuple[int, int], cann: str) -> bool:
    """Whether the CANN version text `cann` ("9.1.0", "8.3.RC1", "9.1.0-beta.3") is `version` or later, a release.

    A pre-release (beta, alpha) of `version` itself is before it."""
    parts = cann.split(".")
    try:
        found = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return False
    return found > version or (found == version and not any(tag in cann.lower() for tag in ("alpha", "beta")))


def _product_shape(c) -> tuple[int, int]:
    """[m, n]: the shape of mat1 @ mat2."""
    return (c.mat1.shape[0], c.mat2.shape[1])


def _broadcasts(shape, to: tuple[int, int]) -> bool:
    """Whether a tensor of `shape` broadcasts to `to` (sizes equal or 1, from the last)."""
    return len(shape) <= len(to) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(to), strict=False))


ADDMM_RULES = rules(
    ADDMM_DTYPE_OUT,
    ("mats", "mat1 [m, k] and mat2 [k, n] are 2-D with the same k", f"{_ADDMM_DOC}:130",
     lambda c: c.mat1.dim() == 2 and c.mat2.dim() == 2 and c.mat1.shape[1] == c.mat2.shape[0]),
    ("self-shape", "self broadcasts to [m, n] (1-D or 2-D)", f"{_ADDMM_DOC}:119",
     lambda c: 1 <= c.self.dim() <= 2 and _broadcasts(c.self.shape, _product_shape(c))),
    ("mats-dtype", "mat1 and mat2 share one dtype of float16, bfloat16 and float32 (a float32 out from 16-bit inputs "
     "needs both float16 or both bfloat16)", f"{_MATMUL_UTIL}:854", lambda c: c.mat1.dtype == c.mat2.dtype
     and c.mat1.dtype in FLOAT_DTYPES, f"the doc's dtypes: {_ADDMM_DOC}:128"),
    ("out-dtype", "out_dtype is float32 or the mats' dtype (out's dtype is the one self and mat2 deduce, or FLOAT32 "
     "from float16/bfloat16 inputs)", f"{_MATMUL_UTIL}:859",
     lambda c: c.out_dtype in (torch.float32, c.mat1.dtype), f"{_ADDMM_DOC}:175"),
    ("out", "out is [m, n] of dtype out_dtype (torch_npu's check_tensor on out)",
     f"{OP_PLUGIN}:op_plugin/ops/opapi/AddmmKernelNpuOpApi.cpp:113",
     lambda c: c.out.dtype == c.out_dtype and tuple(c.out.shape) == _product_shape(c)),
    ("self-dtype", "self is float32 or the mats' dtype", f"{_ADDMM_CPP}:527",
     lambda c: c.self.dtype in (torch.float32, c.mat1.dtype)),
    ("cann", "a float32 out from float16/bfloat16 mat1 and mat2 needs CANN 9.1 or later (a release, not a 9.1.0 beta)",
     f"{_MATMUL_UTIL}:847", lambda c: c.mat1.dtype not in _HALF_DTYPES or c.out_dtype != torch.float32
     or cann_at_least(FLOAT32_OUT_CANN, str(torch.version.cann)),  # type: ignore[attr-defined]
     "NeedEnableFp32Output, added by ops-nn 3f4fac5e9 (2026-06-02) with fixes to 2026-07 (2bb8909f4, f7292c698, "
     "d96abd874), all in ops-nn branch 9.1.0 and none in 9.0.0 or the 9.1.0 betas; the in-place GemmV3 route of "
     "8.5.0 is documented for no float32 out"),
)  # fmt: skip
LEDGER = FORWARD_RULES + BACKWARD_RULES + ADDMM_RULES
"""The documented limits of the loss op and its backward, and of the weight gradient's addmm (ledger.py)."""


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


def addmm_dtype_out(self, mat1, mat2, out_dtype, *, beta=1, alpha=1, out):
    """aten `addmm.dtype_out` on the device: `out = beta * self + alpha * mat1 @ mat2` in float32, written as out_dtype.

    16-bit mat1 and mat2 into a float32 out: the products summed in float32 (aclnnAddmm's MatMul with FLOAT32
    accumulation), self added in float32, one write. The same-dtype forms (plain addmm with its own out_dtype) are no
    card's: not emulated. Called with the npu tensors' host data by the emulated device."""
    OP_CALLS[ADDMM_DTYPE_OUT] += 1
    enforce(ADDMM_RULES, self=self, mat1=mat1, mat2=mat2, out_dtype=out_dtype, beta=beta, alpha=alpha, out=out)
    if mat1.dtype not in _HALF_DTYPES or out_dtype != torch.float32:
        raise NotImplementedError(
            f"the emulated addmm.dtype_out takes float16/bfloat16 mat1 and mat2 into a float32 out only (the card's "
            f"form); {mat1.dtype} into {out_dtype} is not emulated"
        )
    result = torch.addmm(self.float(), mat1.float(), mat2.float(), beta=beta, alpha=alpha)
    return out.copy_(result)


DEVICE_KERNELS = {ADDMM_DTYPE_OUT: addmm_dtype_out}
"""The aten ops the emulated device runs with a kernel of this module (on the npu tensors' host data), by overload."""
