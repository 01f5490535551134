"""SiLU-gated MLPs on torch_npu.npu_swiglu, with the module's own eager math wherever the op does not apply.

transformers writes the gated MLP in two shapes:
- split: `down_proj(act_fn(gate_proj(x)) * up_proj(x))` (Llama, Mistral, Qwen2/3, DeepseekV3, ...);
- fused: `gate, up = gate_up_proj(x).chunk(2, -1)`, `down_proj(up * act_fn(gate))` (Phi3, Glm4, ...).

npu_swiglu gates the FIRST half of its input along the axis `dim` names: `silu(a) * b` for
`a, b = chunk(x, 2, dim)`. The fused shape's `gate_up_proj(x)` is that input with `dim=-1`. For the
split shape, the two projections write their outputs straight into the two halves of one `[2, T, I]`
buffer (two matmuls with `out=`), which npu_swiglu gates with `dim=0`: no concatenation copy, and the
weights are read where the model keeps them. With many tokens per weight row (3T > 8I with backward, T > 4I
forward only) one matmul against `cat(W_gate, W_up)`, made for the call, would move fewer bytes, reading x
once instead of twice, but it is never faster: each gate/up matmul of such a size is bound by the cube, not by
HBM (about THI / (TH + HI + TI) FLOPs per byte, far above the ~260 of an Atlas A2's bfloat16 cube over its HBM
for hidden and intermediate sizes above a few hundred), so the second read of x costs no time, while the
concatenation is a copy of both weights (and again in backward for dx) that costs its bytes in full
(`make bench`'s time estimate, scripts/bench/device_model.py). No parameter is ever re-pointed or re-laid out:
FSDP2, DeepSpeed, DDP, accelerate and safetensors own or read that storage (docs/torch-npu-ops.md, "npu_swiglu").
Projections the card cannot read directly (LoRA or other wrapped or hooked Linears, DeepSpeed ZeRO-3
partitions, DTensors) run the eager math, and `swiglu_mlp_unavailable_reason` says why.
The split path is written once for any op that gates the first half of its input (`GatedOp`): `fused_split_mlp`
and `split_unavailable_reason` serve npu_swiglu here and npu_geglu for Gemma's GELU-tanh MLPs (geglu.py).

The fused path computes what the MLP's children gate_proj, up_proj (split MLP) and act_fn (both shapes) compute
without calling them (down_proj too under autocast on its float32 weight, when it is a plain nn.Linear:
`_DownProjection`), so it runs only when nothing watches those calls: a hook of the user's own on one of them, a
forward replaced on its instance, or module hooks registered for every module (`register_module_forward_hook`)
send the MLP to its eager math, which calls them as transformers does. DeepSpeed's and FSDP2's own hooks on act_fn
(which only gather and release parameters, and act_fn holds none) do not. In a backward that autograd records
(`create_graph=True`), the gated product is differentiated as eager's `silu(gate) * up` (npu_swiglu_backward has
no derivative of its own), so second-order gradients are eager's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._activations import is_silu
from ._double_backward import with_eager_double_backward
from ._fallbacks import class_name, ran_eager
from ._float32_out import add_float32_product, float32_out_unavailable_reason, float32_product
from ._internals import engine_hook, global_module_hooks, instance_forward, module_hooks, zero3_gathered
from ._npu import FUSED_DTYPES, is_dtensor, npu_unavailable_reason, torch_npu


def activation_of(mlp: nn.Module) -> Callable | None:
    """An MLP's activation: `act_fn` in most of transformers, `activation_fn` in Phi3, Glm4 and Llama4."""
    return getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)


def is_plain_linear(module: nn.Module) -> bool:
    """An `nn.Linear` whose forward is `F.linear(x, weight, bias)`: not a subclass, LoRA wrapper or hooked module."""
    return type(module) is nn.Linear and instance_forward(module) is None and not module_hooks(module)


@dataclass(frozen=True)
class GatedOp:
    """A torch_npu op that computes `activation(gate) * up` from gate and up as the two halves of one tensor.

    `fuse(h, dim)` gates the FIRST half of h along dim; `activation` is the math it fuses, for eager's second order;
    `is_activation(act_fn)` says whether an MLP's act_fn computes exactly that."""

    op: str
    activation_name: str
    is_activation: Callable[[object], bool]
    fuse: Callable[[torch.Tensor, int], torch.Tensor]
    activation: Callable[[torch.Tensor], torch.Tensor]


SWIGLU = GatedOp("npu_swiglu", "SiLU", is_silu, lambda h, dim: torch_npu.npu_swiglu(h, dim=dim), F.silu)
"""npu_swiglu: `silu(first half) * second half` (docs/torch-npu-ops.md, "npu_swiglu")."""


def _fused_op_unavailable_reason(x: torch.Tensor, act_fn: Callable | None, gated: GatedOp) -> str | None:
    """Why `gated.op` will not compute `act_fn(gate) * up` for input x and this activation, or None."""
    if not gated.is_activation(act_fn):
        return f"activation {act_fn!r} is not {gated.activation_name}"
    hooks = [hook for hook in module_hooks(act_fn) if not engine_hook(hook)]
    if hooks:
        names = ", ".join(getattr(hook, "__qualname__", type(hook).__qualname__) for hook in hooks)
        return f"act_fn has hooks of its own ({names}): the MLP calls it, as eager does, for them to see its call"
    if global_module_hooks():
        return (
            "module hooks are registered for every module (register_module_forward_hook, ...): the MLP calls its "
            "children as eager does, for the hooks to see each call"
        )
    reason = npu_unavailable_reason(x)
    if reason is not None:
        return reason
    if x.dtype not in FUSED_DTYPES:
        return f"dtype {x.dtype} is not supported by {gated.op} (float16, bfloat16, float32)"
    if x.numel() == 0:
        return "empty input"
    return None


def _projection_unavailable_reason(name: str, proj: nn.Module) -> str | None:
    """Why the card cannot read this projection's weight and bias directly, or None."""
    weight = getattr(proj, "weight", None)
    gathered = None if weight is None else zero3_gathered(weight)  # None: not DeepSpeed ZeRO-3's
    if gathered is not None and not (gathered and is_plain_linear(proj)):
        return (
            f"{name} is partitioned by DeepSpeed ZeRO-3 and gathered only when {name} itself is called: the MLP "
            "runs its eager math (npu_hub_kernels.zero3.mark_zero3_leaf_mlps(model) before deepspeed.initialize "
            "makes the MLP gather its projections itself, and fuse)"
        )
    if not is_plain_linear(proj):
        return (
            f"{name} is {class_name(proj)}{' with hooks' if type(proj) is nn.Linear else ''}, not a plain "
            "nn.Linear (an adapter such as LoRA, a subclass or a hook computes something else): eager math"
        )
    for tensor in (weight, proj.bias):  # weight: proj.weight, read above
        if tensor is None:
            continue
        if is_dtensor(tensor):
            return f"{name} holds a DTensor (tensor parallel, or FSDP2 outside its forward): eager math"
        if tensor.is_meta or tensor.numel() == 0:
            return f"{name} holds no data here (meta or empty: offloaded or partitioned): eager math"
    return None


def split_unavailable_reason(
    x: torch.Tensor, gate_proj: nn.Module, up_proj: nn.Module, act_fn, gated: GatedOp
) -> str | None:
    """Why a split MLP (gate_proj, up_proj) does not fuse with `gated.op` for this input, or None when it does."""
    reason = _fused_op_unavailable_reason(x, act_fn, gated)
    if reason is not None:
        return reason
    for name, proj in (("gate_proj", gate_proj), ("up_proj", up_proj)):
        reason = _projection_unavailable_reason(name, proj)
        if reason is not None:
            return reason
    gate, up = gate_proj.weight, up_proj.weight
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != x.device or up.device != x.device:
        return (
            f"gate_proj and up_proj weights differ in shape, dtype or device ({tuple(gate.shape)} {gate.dtype} "
            f"{gate.device}, {tuple(up.shape)} {up.dtype} {up.device}; input on {x.device})"
        )
    if (gate_proj.bias is None) != (up_proj.bias is None):
        return "only one of gate_proj/up_proj has a bias"
    if torch.is_autocast_enabled(x.device.type):  # autocast casts x and the weights to its dtype, as for a linear
        if gate.dtype not in FUSED_DTYPES:
            return f"weight dtype {gate.dtype} is not cast by autocast (float16, bfloat16, float32 are)"
    elif gate.dtype != x.dtype:
        return f"weight dtype {gate.dtype} differs from input dtype {x.dtype}"
    return None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype `gate_proj(x)` computes in: the autocast dtype under `torch.autocast("npu")`, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _autocast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """What autocast hands a linear: the tensor in the compute dtype (a tracked cast, as autocast's own)."""
    return tensor if tensor is None or tensor.dtype == dtype else tensor.to(dtype)


class _GateUpHalves(torch.autograd.Function):
    """`[gate_proj(x); up_proj(x)]` as the two halves of one `[2, T, I]` buffer, each written by its own matmul.

    Reads the weights where they are (no copy, no new layout) and keeps them (the Parameters themselves, or autocast's
    casts of them) and x as [T, H] rows for backward: dx from one mm and one addmm, each weight's and bias's gradient a
    tensor of its own. `float32`: the float32 x and weights that autocast cast to x, gate_weight and up_weight, given
    where `_float32_gradients` says so: their gradients are then summed in float32 from the 16-bit operands and
    returned to them directly (never rounded to 16 bits, no cast back), and none to the casts."""

    @staticmethod
    def forward(ctx, x, gate_weight, up_weight, gate_bias, up_bias, *float32):
        rows = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(rows, gate_weight, up_weight)
        ctx.input_shape, ctx.float32 = x.shape, bool(float32)
        halves = rows.new_empty((2, rows.shape[0], gate_weight.shape[0]))
        for half, weight, bias in ((halves[0], gate_weight, gate_bias), (halves[1], up_weight, up_bias)):
            if bias is None:
                torch.mm(rows, weight.t(), out=half)
            else:
                torch.addmm(bias, rows, weight.t(), out=half)
        return halves

    @staticmethod
    def backward(ctx, grad_halves):
        if torch.is_grad_enabled():  # recorded: eager's math gives every gradient, this node a zero one
            return (None,) * (5 + (3 if ctx.float32 else 0))
        grad_gate, grad_up = grad_halves[0], grad_halves[1]
        rows, gate_weight, up_weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        biases = (grad_gate.sum(0) if needs[3] else None, grad_up.sum(0) if needs[4] else None)
        if ctx.float32:  # to the float32 tensors themselves, none to their casts
            grad_x = None
            if needs[5]:
                grad_x = add_float32_product(float32_product(grad_up, up_weight), grad_gate, gate_weight)
            return (
                None, None, None, *biases,
                None if grad_x is None else grad_x.reshape(ctx.input_shape),
                float32_product(grad_gate.t(), rows) if needs[6] else None,
                float32_product(grad_up.t(), rows) if needs[7] else None,
            )  # fmt: skip
        return (
            grad_up.mm(up_weight).addmm_(grad_gate, gate_weight).reshape(ctx.input_shape) if needs[0] else None,
            grad_gate.t().mm(rows) if needs[1] else None,
            grad_up.t().mm(rows) if needs[2] else None,
            *biases,
        )


def swiglu_mlp(
    x: torch.Tensor,
    gate_proj: nn.Module,
    up_proj: nn.Module,
    down_proj: nn.Module,
    act_fn,
    *,
    module: nn.Module | None = None,
) -> torch.Tensor:
    """`down_proj(act_fn(gate_proj(x)) * up_proj(x))`, fused on the NPU as `swiglu_mlp_unavailable_reason` decides.

    The fused path writes gate and up with two matmuls into one buffer (module doc). The path taken is recorded for
    `module` (the MLP, when its layer calls it).
    """
    if ran_eager(module, swiglu_mlp_unavailable_reason(x, gate_proj, up_proj, act_fn)):
        return swiglu_mlp_eager(x, gate_proj, up_proj, down_proj, act_fn)
    return fused_split_mlp(x, gate_proj, up_proj, down_proj, SWIGLU)


def fused_split_mlp(
    x: torch.Tensor, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, gated: GatedOp
) -> torch.Tensor:
    """`down_proj(gated.activation(gate_proj(x)) * up_proj(x))` with `gated.op`, where the reason said it fuses.

    Gate and up are the two halves of the op's input, each written by its own matmul (module doc)."""
    dtype = _compute_dtype(x)
    tensors = (x, gate_proj.weight, up_proj.weight, gate_proj.bias, up_proj.bias)
    inputs = [_autocast(t, dtype) for t in tensors]
    float32 = tensors[:3] if _float32_gradients(dtype, *tensors[:3]) else ()
    gated_out = gated.fuse(_GateUpHalves.apply(*inputs, *float32), 0)  # [1, T, I]
    # a recorded backward differentiates eager's math from x and the weights: the fused op's backward has no
    # derivative, and the gate/up functions' backward keeps x as rows made without autograd (no second order
    # through dW). The identity goes around the op's own output and the view comes after it: a view passed through
    # it would be marked dirty, whose backward copies the gradient
    eager = functools.partial(_gated_eager, gated.activation, gated_out.shape)
    gated_rows = with_eager_double_backward(gated_out, eager, *inputs)
    rows = gated_rows.reshape(*x.shape[:-1], inputs[1].shape[0])  # gate_proj.weight, as autocast gives it
    if _down_float32_gradient(dtype, rows, down_proj):
        return _down_projection(rows, down_proj, dtype)
    return down_proj(rows)


def _float32_gradients(dtype: torch.dtype, x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor) -> bool:
    """Whether the gate/up matmuls give x and the weights their gradients summed in float32 from 16-bit operands.

    They do under autocast to float16/bfloat16 (`dtype`) on float32 x and weights (Trainer's bf16/fp16) where autograd
    records the call and the host sums 16-bit operands into a float32 out (`float32_out_unavailable_reason`): eager's
    autocast rounds each gradient to 16 bits, then casts it back (a cast of x's and of each weight's size)."""
    if dtype is torch.float32 or x.dtype is not torch.float32 or not torch.is_grad_enabled():
        return False  # first what a bfloat16 model's call reads: no autocast, x not float32
    tensors = (x, gate_weight, up_weight)
    return (
        all(t.dtype is torch.float32 for t in tensors)
        and any(t.requires_grad for t in tensors)
        and float32_out_unavailable_reason() is None
    )


def _down_float32_gradient(dtype: torch.dtype, rows: torch.Tensor, down_proj: nn.Module) -> bool:
    """Whether down_proj's float32 weight gets its gradient summed in float32 from 16-bit operands (`_DownProjection`).

    It does under autocast to float16/bfloat16 (`dtype`) on a float32 weight (and bias, if any) on the rows' device,
    where autograd records the call, down_proj is a plain nn.Linear the card may read directly
    (`_projection_unavailable_reason`: else it is called, hooks and adapters included) and the host sums 16-bit
    operands into a float32 out: eager's autocast rounds that gradient to 16 bits, then casts it back (a cast of the
    weight's size)."""
    if dtype is torch.float32 or not torch.is_grad_enabled() or not torch.is_autocast_enabled(rows.device.type):
        return False  # no autocast: down_proj's call promotes nothing, or refuses mixed dtypes, as eager's does
    if _projection_unavailable_reason("down_proj", down_proj) is not None:
        return False  # it is called: its hooks, adapter or engine run
    weight, bias = down_proj.weight, down_proj.bias  # a plain nn.Linear's
    return (
        weight.dtype is torch.float32
        and weight.requires_grad
        and weight.device == rows.device
        and (bias is None or (bias.dtype is torch.float32 and bias.device == rows.device))
        and float32_out_unavailable_reason() is None
    )


def _down_projection(rows: torch.Tensor, down_proj: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """`down_proj(rows)` under autocast to `dtype`, its float32 weight's gradient summed in float32 (`_DownProjection`).

    Where `_down_float32_gradient` says so. The forward is autocast's linear (the same casts and matmul); a recorded
    backward differentiates that linear (`with_eager_double_backward`)."""
    flat = rows.reshape(-1, rows.shape[-1])
    weight, bias = down_proj.weight, down_proj.bias
    weight16, bias16 = _autocast(weight, dtype), _autocast(bias, dtype)
    out = with_eager_double_backward(
        _DownProjection.apply(flat, weight16, bias16, weight), F.linear, flat, weight16, bias16
    )
    return out.reshape(*rows.shape[:-1], weight.shape[0])


class _DownProjection(torch.autograd.Function):
    """`F.linear(rows, weight, bias)` of 16-bit [T, I] rows, weight and bias; the weight's gradient to a float32 one.

    The forward is the linear's own matmul. Backward: d rows from one mm (16-bit, as eager's), the bias's gradient a
    16-bit sum to the bias given (autocast's cast, which casts it back), and the weight's the 16-bit operands' products
    summed in float32 (`float32_product`), returned to `float32_weight` (the parameter autocast cast to `weight`)
    directly: never rounded to 16 bits, no cast back, none to the cast."""

    @staticmethod
    def forward(ctx, rows, weight, bias, float32_weight):
        ctx.save_for_backward(rows, weight)
        return torch.mm(rows, weight.t()) if bias is None else torch.addmm(bias, rows, weight.t())

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # recorded: eager's linear gives every gradient, this node a zero one
            return None, None, None, None
        rows, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        return (
            grad_out.mm(weight) if needs[0] else None,
            None,
            grad_out.sum(0) if needs[2] else None,
            float32_product(grad_out.t(), rows) if needs[3] else None,
        )


def _gated_eager(activation, shape, x, gate_weight, up_weight, gate_bias, up_bias) -> torch.Tensor:
    """`activation(gate_proj(x)) * up_proj(x)` on the tensors the fused path reads, in the fused op's output `shape`.

    Those tensors are the ones autocast's casts made. This is what a recorded backward differentiates in place of the
    fused gate/up matmuls and the fused op.
    """
    return (activation(F.linear(x, gate_weight, gate_bias)) * F.linear(x, up_weight, up_bias)).reshape(shape)


def swiglu_mlp_eager(
    x: torch.Tensor, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, act_fn
) -> torch.Tensor:
    """The split MLP's own forward (LlamaMLP's): what `swiglu_mlp` falls back to."""
    return down_proj(act_fn(gate_proj(x)) * up_proj(x))


def swiglu_mlp_unavailable_reason(x: torch.Tensor, gate_proj: nn.Module, up_proj: nn.Module, act_fn) -> str | None:
    """Why `swiglu_mlp` takes the eager path for this input and these projections, or None when it fuses."""
    return split_unavailable_reason(x, gate_proj, up_proj, act_fn, SWIGLU)


def swiglu_gate_up_mlp(
    x: torch.Tensor, gate_up_proj: nn.Module, down_proj: nn.Module, act_fn, *, module: nn.Module | None = None
) -> torch.Tensor:
    """`down_proj(up * act_fn(gate))` for `gate, up = gate_up_proj(x).chunk(2, -1)`, fused on the NPU when it can be.

    It is fused (gate rows come first) as `swiglu_gate_up_mlp_unavailable_reason` decides, recorded for `module`
    (the MLP, when its layer calls it).
    """
    if ran_eager(module, swiglu_gate_up_mlp_unavailable_reason(x, gate_up_proj, act_fn)):
        return swiglu_gate_up_mlp_eager(x, gate_up_proj, down_proj, act_fn)
    gate_up = gate_up_proj(x).contiguous()
    return down_proj(with_eager_double_backward(torch_npu.npu_swiglu(gate_up), _gate_up_gated_eager, gate_up))


def _gate_up_gated_eager(gate_up: torch.Tensor) -> torch.Tensor:
    """`up * act_fn(gate)` for `gate, up = gate_up.chunk(2, -1)` and a SiLU act_fn (Phi3MLP's).

    This is what a recorded backward differentiates in place of npu_swiglu.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return up * F.silu(gate)


def swiglu_gate_up_mlp_eager(x: torch.Tensor, gate_up_proj: nn.Module, down_proj: nn.Module, act_fn) -> torch.Tensor:
    """The gate_up MLP's own forward (Phi3MLP's): what `swiglu_gate_up_mlp` falls back to."""
    gate, up = gate_up_proj(x).chunk(2, dim=-1)
    return down_proj(up * act_fn(gate))


def swiglu_gate_up_mlp_unavailable_reason(x: torch.Tensor, gate_up_proj: nn.Module, act_fn) -> str | None:
    """Why `swiglu_gate_up_mlp` takes the eager path for this input and module, or None when it fuses."""
    weight = getattr(gate_up_proj, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return f"gate_up_proj is {type(gate_up_proj).__name__}, without a 2-D weight"
    if weight.shape[0] % 2:
        return f"gate_up_proj gives {weight.shape[0]} features: npu_swiglu halves an even size"
    if weight.dtype != x.dtype:
        return f"weight dtype {weight.dtype} differs from input dtype {x.dtype}"
    if not 1 <= x.dim() <= 8:  # gate_up_proj(x), which npu_swiglu takes, has x's dims
        return f"npu_swiglu takes 1 to 8 dims, got {x.dim()}"
    return _fused_op_unavailable_reason(x, act_fn, SWIGLU)
