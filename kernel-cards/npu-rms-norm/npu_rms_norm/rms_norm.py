"""RMSNorm on torch_npu.npu_rms_norm (and npu_gemma_rms_norm), with transformers' eager math where they do not apply.

transformers' RMSNorm classes scale the normalised input in one of three ways; `npu_rms_norm`
(float32 inside, one cast at the end) serves all three:

- "plain" (LlamaRMSNorm): `weight * normalize(x).to(dtype)`; the fused result is exact in float32
  and within one rounding step in float16/bfloat16 (transformers rounds before the multiply).
- "zero_centered" (Gemma3RMSNorm): `(normalize(x) * (1 + weight.float())).to(dtype)`; exact.
- "float32_scale" (Olmo2RMSNorm): `(weight.float() * normalize(x)).to(dtype)`; exact.

Where autograd records nothing (inference, no_grad, weights and x without grad), a zero-centred norm whose weight has
x's dtype runs as one `npu_gemma_rms_norm(x, weight)` instead, which adds 1 to the weight in float32 itself: no
`1 + weight` kernel before it. That op has no backward, so with grad the npu_rms_norm form runs, on
`1 + weight.float()` computed as one call: a float16 or bfloat16 weight plus a float32 [1] tensor of 1 kept per device
(`device_constant`, no parameter or buffer of the module), which torch_npu runs as one aclnnAdd, one mixed-dtype Add
kernel without a Cast (docs/torch-npu-ops.md, npu_rms_norm). The sum is float32 [H], exactly eager's `1 + w` (a
float16 or bfloat16 value is exact in float32), and autograd casts its float32 gradient to the weight's dtype once:
fwd+bwd the add, npu_rms_norm, npu_rms_norm_backward and that cast, where eager's `1 + weight.float()` is a cast and
an add. A float32 weight is added to 1 as eager adds it (one add); any other dtype is cast to float32 first, as eager
casts it.
`rms_norm_unavailable_reason(..., one_kernel=True)` says why a call does not take the one-kernel form.

x is handed to the ops in the order of its dims its memory has (a [B, H, S, D] transpose of [B, S, H, D] memory, as
Gemma3's q/k norms get it, as its [B, S, H, D] view), and the result goes back through the same permutation: no copy
of x, and the output has the layout eager's has. Any other layout is copied to a contiguous x first.

Backward: npu_rms_norm's own autograd node (npu_rms_norm_backward). That op has no derivative, so in a backward that
autograd records (create_graph: a gradient penalty, a Hessian-vector product) the fused output's gradient is that of
eager's math on the same x and weight instead (`with_eager_double_backward`): the second-order gradients are eager's.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch import nn

from ._device_constants import device_constant
from ._double_backward import with_eager_double_backward
from ._fallbacks import _LAST_EAGER, ran_eager
from ._internals import _peek_interpreter_stack
from ._npu import (
    FUSED_DTYPES,
    MIXED_ADD_DTYPES,
    atlas_a2_a3_unavailable_reason,
    keepable,
    npu_unavailable_reason,
    torch_npu,
)
from ._rms_norm_forms import SCALINGS, Scaling, check_scaling, rms_norm_math


def rms_norm_unavailable_reason(
    x: torch.Tensor, weight: torch.Tensor, scaling: Scaling = "plain", *, one_kernel: bool = False
) -> str | None:
    """Why `npu_rms_norm` will not run for these inputs (the eager math runs instead), or None.

    With `one_kernel=True`: why the norm does not run as one `npu_gemma_rms_norm` call (the npu_rms_norm form may still
    run), or None when it does.
    """
    reason = _fused_unavailable_reason(x, weight, scaling)
    if not one_kernel or reason is not None:
        return reason
    return _one_kernel_unavailable_reason(x, weight, scaling)


def _fused_unavailable_reason(x: torch.Tensor, weight: torch.Tensor, scaling: Scaling) -> str | None:
    """Why `npu_rms_norm` will not run for these inputs, or None.

    Called on every norm call: each tensor attribute is read once, and the checks that pass cost no call (at decode size
    the card's Python is held to a bare module call's cost, docs/bench.md)."""
    if scaling not in SCALINGS:
        check_scaling(scaling)  # raises, naming the accepted values
    reason = npu_unavailable_reason(x, weight)
    if reason is not None:
        return reason
    if x.device != weight.device:
        return f"x on {x.device} and the weight on {weight.device}: eager's math refuses tensors on two devices"
    dtype, weight_dtype = x.dtype, weight.dtype
    if dtype not in FUSED_DTYPES:
        return f"dtype {dtype} is not supported by npu_rms_norm (float16, bfloat16, float32)"
    if weight_dtype is not dtype:  # a dtype is a singleton
        if scaling == "plain":
            return f"weight dtype {weight_dtype} differs from input dtype {dtype}: eager promotes the output dtype"
        if scaling == "float32_scale" and weight_dtype is not torch.float32:
            return f"npu_rms_norm takes a weight in the input dtype or float32, not {weight_dtype} with {dtype}"
    shape = x.shape
    if not 2 <= len(shape) <= 8:
        return f"npu_rms_norm takes 2 to 8 dims, got {len(shape)}"
    if 0 in shape:
        return "empty input"
    weight_shape = weight.shape
    if len(weight_shape) != 1 or weight_shape[0] != shape[-1]:
        return f"weight shape {tuple(weight_shape)} does not match the last dim of the input {tuple(shape)}"
    return None


def _one_kernel_unavailable_reason(x: torch.Tensor, weight: torch.Tensor, scaling: Scaling) -> str | None:
    """Why inputs npu_rms_norm takes do not run as one `npu_gemma_rms_norm`, or None when they do."""
    if scaling != "zero_centered":
        return f"scaling {scaling!r}: npu_gemma_rms_norm scales by 1 + weight (zero_centered) only"
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return "autograd records this call: npu_gemma_rms_norm has no backward"
    if not hasattr(torch_npu, "npu_gemma_rms_norm"):
        return "this torch_npu has no npu_gemma_rms_norm (op-plugin's release branches 7.0.0 and later have it)"
    reason = atlas_a2_a3_unavailable_reason("npu_gemma_rms_norm", x.device)
    if reason is not None:
        return reason
    if weight.dtype is not x.dtype:
        return f"weight dtype {weight.dtype} differs from x's {x.dtype}: npu_gemma_rms_norm takes gamma in x's dtype"
    if not (x.is_contiguous() or _dense_order(x) is not None) or not weight.is_contiguous():
        return (
            "x is not contiguous in any order of its leading dims, or the weight is not: npu_gemma_rms_norm takes "
            "contiguous tensors only"
        )
    return None


def _as_dense(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """x as the ops are given it, and the order of its dims that takes (None: x's own order).

    x itself when contiguous; else its dims permuted to the order its memory has (`_dense_order`), when there is one;
    else a contiguous copy.
    """
    if x.is_contiguous():
        return x, None
    order = _dense_order(x)
    return (x.contiguous(), None) if order is None else (x.permute(order), order)


def _dense_order(x: torch.Tensor) -> tuple[int, ...] | None:
    """The order of x's dims (the last one last) in which x's memory is contiguous, or None when there is none.

    Leading dims by decreasing stride: a [B, H, S, D] transpose of [B, S, H, D] memory gives (0, 2, 1, 3).
    """
    last = x.dim() - 1
    order = (*sorted(range(last), key=lambda dim: -x.stride(dim)), last)
    return order if x.permute(order).is_contiguous() else None


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation that undoes `order`."""
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return tuple(inverse)


_FUSING_INPUTS: set[tuple] = set()
"""What `_fused_unavailable_reason` read of the calls it let fuse: the scaling, then x's and the weight's class, device,
dtype and shape (`rms_norm`'s `inputs`). x's device is read as its index (`get_device()`: the npu's index on an npu, -1
on the host and on meta), which tells a plain npu tensor from every other a torch_npu process holds (no other
accelerator runs beside torch_npu) for less than a torch.device costs to make, hash and compare; the weight's as its
torch.device, so that a tensor subclass reporting an index-less device (-1 on an npu as on the host) is checked afresh
on the host, and refused. `rms_norm` skips the check for a call whose inputs read the same (the torch.func state,
which the check reads too, is read on every call), and so does the layer (layers.layer_forward): at decode size the
check is most of the card's host cost (docs/bench.md). Inputs that differ in any of those are checked afresh, and
refused with the check's reason: a weight changed in place (`weight.data = ...`, `module.to(dtype)`) reads another
dtype, device or shape. One set, filled and emptied in place: the layers hold it by name."""

_FUSING_INPUTS_LIMIT = 1024
"""At most this many entries in `_FUSING_INPUTS`, emptied when full: x's shape varies with the sequence length."""


def _remember_fusing(inputs: tuple) -> None:
    """Add what the check read of a call it let fuse to `_FUSING_INPUTS` (emptied first when it is full)."""
    if len(_FUSING_INPUTS) >= _FUSING_INPUTS_LIMIT:
        _FUSING_INPUTS.clear()
    with contextlib.suppress(TypeError):  # a symbolic size (SymInt) under tracing is unhashable: not remembered
        _FUSING_INPUTS.add(inputs)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, scaling: Scaling = "plain", *, module: nn.Module | None = None
) -> torch.Tensor:
    """RMSNorm of the last dim of x, scaled by weight the way `scaling` says.

    Fused on npu tensors (second-order gradients: eager's, see the module's docstring) as `rms_norm_unavailable_reason`
    decides, recorded for `module` (the layer's own, when a layer calls it).
    """
    inputs = (
        scaling,
        type(x),
        x.get_device(),
        x.dtype,
        x.shape,
        type(weight),
        weight.device,
        weight.dtype,
        weight.shape,
    )
    try:
        remembered = inputs in _FUSING_INPUTS
    except TypeError:  # a symbolic size (SymInt) under tracing is unhashable: checked every time
        remembered = False
    # the skip of the check; layers.layer_forward has its twin for a layer's no-grad calls
    if remembered and _peek_interpreter_stack() is None:  # no torch.func transform (`functorch_transform`)
        if _LAST_EAGER:  # else no module's last call ran eager: `ran_eager(module, None)` would find nothing to clear
            ran_eager(module, None)
    elif ran_eager(module, _fused_unavailable_reason(x, weight, scaling)):
        return rms_norm_eager(x, weight, eps, scaling)
    else:
        _remember_fusing(inputs)
    if x.is_contiguous():
        x_op, order = x, None
    else:
        x_op, order = _as_dense(x)
    grad = _grad_enabled()
    if grad and weight.requires_grad:  # npu_rms_norm keeps x for backward
        x_op = keepable(x_op)
    gamma = weight
    if scaling == "zero_centered":
        if _one_kernel_unavailable_reason(x, weight, scaling) is None:
            fused = torch_npu.npu_gemma_rms_norm(x_op, weight, epsilon=eps)[0]
            return fused if order is None else fused.permute(_inverse(order))
        gamma = _one_plus(weight)
    fused = torch_npu.npu_rms_norm(x_op, gamma, epsilon=eps)[0]
    if grad:  # else autograd records nothing: with_eager_double_backward would return fused
        eager = partial(rms_norm_math, eps=eps, scaling=scaling)
        fused = with_eager_double_backward(fused, eager, x_op, weight)
    return fused if order is None else fused.permute(_inverse(order))


_grad_enabled = torch.is_grad_enabled
"""`torch.is_grad_enabled`, bound once: read on every norm call."""


def _one_plus(weight: torch.Tensor) -> torch.Tensor:
    """`1 + weight.float()` (eager's value, float32), in one call: a 16-bit weight plus a float32 1 kept per device."""
    if weight.dtype in MIXED_ADD_DTYPES:
        return weight + device_constant("float32 one", weight, _float32_one)
    return 1.0 + weight.float()


def _float32_one(device: torch.device) -> torch.Tensor:
    """A float32 [1] tensor of 1 on `device`: one dim, so that a [H] weight plus it is float32 [H].

    `.float()` after the factory: DeepSpeed's `zero.Init` wraps torch.ones to cast what it makes to the training dtype
    in place (bfloat16, float16), and a 1 kept in that dtype would round every later 1 + weight to it; 1 is exact in
    each, and `.float()` of a float32 tensor is that tensor (no kernel)."""
    return torch.ones(1, dtype=torch.float32, device=device).float()


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float, scaling: Scaling = "plain") -> torch.Tensor:
    """The forward of transformers' LlamaRMSNorm, Gemma3RMSNorm or Olmo2RMSNorm, operation for operation."""
    return rms_norm_math(x, weight, eps, scaling)
