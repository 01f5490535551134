"""A residual add and the RMSNorm of the sum, fused for training in this module's autograd function.

The forward is `torch_npu.npu_add_rms_norm` (which has no backward of its own), the backward
`torch_npu.npu_rms_norm_backward`.

`add_rms_norm(residual, update, norm, scaling)` returns `(norm(residual + update), residual + update)`: what a
decoder layer computes between its attention and its MLP. The op adds in the inputs' dtype (the sum is rounded to
it, as transformers' `residual + hidden_states` is) and normalises that rounded sum in float32 with one final cast.
The norm's weight enters the op in the form its class scales by:

- "plain" (LlamaRMSNorm, `weight * normalize(h).to(dtype)`): gamma = weight. Exact in float32; in float16/bfloat16
  within one rounding step of eager (transformers rounds the normalised sum before multiplying by the weight), as
  npu-rms-norm's plain form.
- "zero_centered" (GemmaRMSNorm, `(normalize(h) * (1 + weight.float())).to(dtype)`): gamma = 1 + weight. The op takes
  gamma only in the inputs' dtype, so the form is fused in float32 only (exact there); rounding 1 + weight to
  float16/bfloat16 would change the result, so those run the eager math.
- "float32_scale" (HeliumRMSNorm, `(weight.float() * normalize(h)).to(dtype)`): gamma = weight, in the inputs' dtype
  (a float32 weight with float16/bfloat16 inputs runs the eager math). Exact.

Mixed dtypes (Trainer's bf16=True: float32 weights and residual stream, a bfloat16 attention output from o_proj
under autocast): npu_add_rms_norm takes x2 and gamma only in x1's dtype, so the update would have to be cast to
float32 first (one more kernel, reading 2 and writing 4 bytes per element) and the op would read two float32 inputs.
torch_npu adds a float16 or bfloat16 tensor and a float32 one as one aclnnAdd, a mixed-dtype Add kernel without a
Cast (Ascend/op-plugin@0a873ce:op_plugin/ops/opapi/AddKernelNpuOpApi.cpp; hicann/ops-math@3b62132:
math/add/op_host/op_api/aclnn_add.cpp, `isAddMixDtypeSupport`), so for such a pair the card adds them as eager does
(`residual + update`, float32: eager's sum exactly, and the update's gradient cast to its dtype once, by the add's
backward) and normalises the sum with `npu_rms_norm(sum, gamma)` (float32 x and gamma), whose own autograd node
(npu_rms_norm_backward) gives the norm's gradients; autograd adds the sum's two gradients, as in eager. The forms'
rules are those of the float32 sum: gamma = weight (plain, float32_scale) or 1 + weight (zero_centered), the weight
in float32. A bfloat16 and float16 pair (float32 sum) is no such pair (aclnnAdd casts both): the card casts both and
runs npu_add_rms_norm in float32.

Backward: `dh = npu_rms_norm_backward(dy, h, gamma, rstd).dx + d(sum)`: the gradient the sum receives from the rest
of the layer (the residual path to the final add) is added here, the one add eager's autograd makes when it
accumulates the two uses of the sum; residual and update both get dh (the add's backward copies nothing).
npu_rms_norm_backward has no derivative, so a backward that autograd records (create_graph: a gradient penalty, a
Hessian-vector product) differentiates the eager math of the norm's form on the kept sum and gamma instead: the
second-order gradients are eager's.

The norm is not called on the fused path, so whatever would run in its call must not be there: the fused path needs a
norm without hooks of its own, without a forward replaced on its instance (accelerate's add_hook_to_module; the
forward kernelize binds there, the class's own or npu-rms-norm's, computes the class's math and is no replacement)
and no module hooks registered for every module (register_module_forward_hook: a profiler, a tracer). Otherwise the
layer calls the norm as transformers does.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ._double_backward import with_eager_double_backward
from ._fallbacks import ran_eager
from ._internals import global_module_hooks, module_hooks
from ._npu import FUSED_DTYPES, MIXED_ADD_DTYPES, npu_unavailable_reason, torch_npu
from ._rms_norm_forms import Scaling, check_scaling, epsilon_of, norm_forward_replaced, rms_norm_math


def _norm_problem(norm: nn.Module, family: str | None) -> str | None:
    """Why `norm` is not an RMSNorm whose forward the op reproduces (its class and parameters), or None."""
    cls = type(norm)
    if not cls.__name__.endswith("RMSNorm") or (family is not None and cls.__module__ != family):
        where = f" of {family}" if family is not None else ""
        return f"the norm is a {cls.__module__}.{cls.__name__}, not the RMSNorm{where} the op reproduces"
    names = [name for name, _ in norm.named_parameters(recurse=True)]
    if names != ["weight"]:
        return f"the norm has the parameters {names}, not just a weight (a bias or other state the op has no input for)"
    forward = getattr(cls, "forward", None)
    defined_in = getattr(forward, "__globals__", {}).get("__name__", "?")
    if not defined_in.startswith("transformers."):  # code, not names: functools.wraps copies __module__, not globals
        return (
            f"the norm's class forward is {defined_in}.{getattr(forward, '__qualname__', forward)}, not transformers' "
            "(another library's or the user's patch): the norm is called, and that code runs"
        )
    eps = epsilon_of(norm)
    if not isinstance(eps, float):
        return "the norm has no float epsilon (variance_epsilon or eps)"
    if eps < 0:
        return f"the norm's epsilon {eps} is negative: npu_add_rms_norm takes an epsilon of at least 0"
    if module_hooks(norm):
        return "the norm has hooks (DeepSpeed ZeRO-3 gathers its weight in one): calling it keeps them"
    if norm_forward_replaced(norm):
        return "the norm's forward is replaced on its instance (accelerate's add_hook_to_module, a wrapper) must run"
    if global_module_hooks():
        return "module hooks are registered for every module (register_module_forward_hook): they must see the norm"
    return None


def add_rms_norm_unavailable_reason(
    residual: torch.Tensor, update: torch.Tensor, norm: nn.Module, scaling: Scaling = "plain", family: str | None = None
) -> str | None:
    """Why `npu_add_rms_norm` will not run for `norm(residual + update)` (the eager math runs instead), or None.

    family: the module (modeling file) the norm's class must come from, when the caller knows it.
    """
    check_scaling(scaling)
    problem = _norm_problem(norm, family)
    if problem is not None:
        return problem
    weight = norm.weight
    reason = npu_unavailable_reason(residual, update, weight)
    if reason is not None:
        return reason
    dtype = _sum_dtype(residual, update)  # eager's sum promotes: the op adds in that dtype, as eager does
    if dtype not in FUSED_DTYPES:
        return f"dtype {dtype} is not supported by npu_add_rms_norm (float16, bfloat16, float32)"
    if update.shape != residual.shape:
        return f"shapes {tuple(residual.shape)} and {tuple(update.shape)} differ: eager broadcasts the sum"
    if scaling == "plain" and weight.dtype != dtype:
        return f"weight dtype {weight.dtype} differs from input dtype {dtype}: eager promotes the output dtype"
    if scaling == "float32_scale" and weight.dtype != dtype:
        return f"npu_add_rms_norm takes gamma in the input dtype {dtype}, not {weight.dtype}"
    if scaling == "zero_centered" and (dtype != torch.float32 or weight.dtype != torch.float32):
        return (
            f"a (1 + weight) norm in {dtype} (weight {weight.dtype}): npu_add_rms_norm takes gamma in the "
            "input dtype, and rounding 1 + weight to it would change the result (fused in float32 only)"
        )
    if not 2 <= residual.dim() <= 8:
        return f"{residual.dim()} dims: npu_add_rms_norm takes 1 to 8, and npu_rms_norm_backward (the backward) 2 to 8"
    if residual.numel() == 0:
        return "empty input"
    if tuple(weight.shape) != tuple(residual.shape[-1:]):
        return f"weight shape {tuple(weight.shape)} does not match the last dim of the input {tuple(residual.shape)}"
    return None


def add_rms_norm(
    residual: torch.Tensor,
    update: torch.Tensor,
    norm: nn.Module,
    scaling: Scaling = "plain",
    family: str | None = None,
    *,
    module: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(norm(residual + update), residual + update)`, fused on npu tensors with a backward when it can be.

    Whether it is fused is as `add_rms_norm_unavailable_reason` decides, recorded for `module` (the decoder layer,
    when its layer calls it).
    """
    if ran_eager(module, add_rms_norm_unavailable_reason(residual, update, norm, scaling, family)):
        return add_rms_norm_eager(residual, update, norm)
    weight, eps = norm.weight, epsilon_of(norm)
    gamma = 1.0 + weight if scaling == "zero_centered" else weight
    if _one_mixed_add(residual, update):
        return _rms_norm_of_mixed_sum(residual, update, weight, gamma, eps, scaling)
    dtype = _sum_dtype(residual, update)  # a cast to the wider dtype is exact: the sum is eager's
    fused = _FusedOutputs()
    summed = _AddOfFusedCall.apply(residual.to(dtype), update.to(dtype), gamma, eps, fused)
    return _NormOfFusedSum.apply(summed, gamma, eps, scaling, fused), summed


def _sum_dtype(residual: torch.Tensor, update: torch.Tensor) -> torch.dtype:
    """The dtype of eager's `residual + update` (a bfloat16 update under autocast, a float32 residual: float32)."""
    return torch.promote_types(residual.dtype, update.dtype)


def _one_mixed_add(residual: torch.Tensor, update: torch.Tensor) -> bool:
    """Whether torch_npu adds the two as one mixed-dtype Add kernel: a float32 and a float16 or bfloat16 tensor."""
    return {residual.dtype, update.dtype} in ({torch.float32, dtype} for dtype in MIXED_ADD_DTYPES)


def _rms_norm_of_mixed_sum(
    residual: torch.Tensor,
    update: torch.Tensor,
    weight: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    scaling: Scaling,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(norm(residual + update), residual + update)` for a mixed pair: eager's add, then npu_rms_norm of the sum.

    The gradients are autograd's through the add and npu_rms_norm's node; a recorded backward differentiates the
    norm's eager math on the sum and the weight instead (npu_rms_norm_backward has no derivative)."""
    summed = residual + update
    normed = torch_npu.npu_rms_norm(summed, gamma, epsilon=eps)[0]
    if torch.is_grad_enabled():  # else autograd records nothing: with_eager_double_backward would return normed
        normed = with_eager_double_backward(normed, partial(rms_norm_math, eps=eps, scaling=scaling), summed, weight)
    return normed, summed


def add_rms_norm_eager(
    residual: torch.Tensor, update: torch.Tensor, norm: nn.Module
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' residual add and post-attention norm, the norm called as a module.

    That is `hidden_states = residual + hidden_states; residual = hidden_states;
    hidden_states = self.post_attention_layernorm(hidden_states)`, the norm called as a module (its own forward, or
    the one another card swapped in).
    """
    summed = residual + update
    return norm(summed), summed


class _FusedOutputs:
    """What one npu_add_rms_norm call wrote beside the sum: the normed output and rstd, handed to the norm's node."""

    normed: torch.Tensor
    rstd: torch.Tensor


class _AddOfFusedCall(torch.autograd.Function):
    """`residual + update` from one npu_add_rms_norm call, which also writes the norm of the sum into `fused`.

    A node of its own, so that the sum is the norm's input in the graph (`_NormOfFusedSum`): autograd then adds the
    norm's gradient to the sum's other uses' on the sum itself, as eager's graph does (a hook or retain_grad on the
    sum sees the whole gradient). Backward: the sum's gradient, to both addends."""

    @staticmethod
    def forward(ctx, residual, update, gamma, eps: float, fused: _FusedOutputs):
        fused.normed, fused.rstd, summed = torch_npu.npu_add_rms_norm(residual, update, gamma, eps)
        return summed

    @staticmethod
    def backward(ctx, grad_summed: torch.Tensor):
        return grad_summed, grad_summed, None, None, None


class _NormOfFusedSum(torch.autograd.Function):
    """The norm of the sum, which npu_add_rms_norm already wrote (`fused`); npu_rms_norm_backward backward.

    A recorded backward differentiates eager's math instead. Keeps the sum, gamma and rstd, as npu_rms_norm's autograd
    node keeps its input, gamma and rstd.
    """

    @staticmethod
    def forward(ctx, summed, gamma, eps: float, scaling: Scaling, fused: _FusedOutputs):
        ctx.save_for_backward(summed, gamma, fused.rstd)
        ctx.eps, ctx.scaling = eps, scaling
        return fused.normed

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        summed, gamma, rstd = ctx.saved_tensors
        wants_gamma = ctx.needs_input_grad[1]
        if torch.is_grad_enabled():  # recorded: eager's math, differentiable
            grad_x, grad_gamma = _eager_grads(summed, gamma, grad_y, ctx.eps, ctx.scaling, wants_gamma)
        else:
            grad_x, grad_gamma = torch_npu.npu_rms_norm_backward(grad_y.contiguous(), summed, gamma, rstd)
            grad_gamma = grad_gamma.to(gamma.dtype) if wants_gamma else None
        return grad_x, grad_gamma, None, None, None


def _eager_grads(
    summed: torch.Tensor, gamma: torch.Tensor, grad_y: torch.Tensor, eps: float, scaling: Scaling, wants_gamma: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradients of the norm's eager math at the kept sum and gamma, differentiable in both and in grad_y.

    What flows back into the sum reaches residual and update through `_AddOfFusedCall`'s node.
    """
    # In gamma's terms: a (1 + weight) norm is fused in float32 only, where (h * (1 + weight.float())).type_as(h) is
    # (gamma.float() * h).to(dtype), the float32-scale form.
    form = "plain" if scaling == "plain" else "float32_scale"
    with torch.enable_grad():
        x = summed if summed.requires_grad else summed.detach().requires_grad_()
        wrt = (x, gamma) if wants_gamma else (x,)
        grads = torch.autograd.grad(rms_norm_math(x, gamma, eps, form), wrt, grad_y, create_graph=True)
    return grads[0], grads[1] if wants_gamma else None
