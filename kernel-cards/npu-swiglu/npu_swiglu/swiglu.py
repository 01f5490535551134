"""SiLU-gated MLPs on torch_npu.npu_swiglu, with the module's own eager math wherever the op does not apply.

transformers writes the gated MLP in two shapes:
- split: `down_proj(act_fn(gate_proj(x)) * up_proj(x))` (Llama, Mistral, Qwen2/3, DeepseekV3, ...);
- fused: `gate, up = gate_up_proj(x).chunk(2, -1)`, `down_proj(up * act_fn(gate))` (Phi3, Glm4, ...).

npu_swiglu gates the FIRST half of its input: `silu(a) * b` for `a, b = chunk(x, 2, -1)`, which is
what the fused shape's `gate_up_proj(x)` holds. For the split shape, concatenating `gate_proj(x)`
and `up_proj(x)` would cost a copy that moves more bytes than eager's silu and mul, so the split
shape is fused only when its two weights lie side by side in one buffer (`pack_gate_up`): then one
matmul against that buffer yields `[gate | up]` directly, with no per-call weight copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ._activations import is_silu
from ._npu import FUSED_DTYPES, npu_unavailable_reason, torch_npu


def activation_of(mlp: nn.Module) -> Callable | None:
    """An MLP's activation: `act_fn` in most of transformers, `activation_fn` in Phi3, Glm4 and Llama4."""
    return getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)


def is_plain_linear(module: nn.Module) -> bool:
    """An `nn.Linear` whose forward is `F.linear(x, weight, bias)`: not a subclass, LoRA wrapper or hooked module."""
    return type(module) is nn.Linear and not module._forward_hooks and not module._forward_pre_hooks


def swiglu_unavailable_reason(x: torch.Tensor, act_fn: Callable | None) -> str | None:
    """Why npu_swiglu will not compute `silu(gate) * up` for input x and this activation, or None."""
    if not is_silu(act_fn):
        return f"activation {act_fn!r} is not SiLU"
    reason = npu_unavailable_reason(x)
    if reason is not None:
        return reason
    if x.dtype not in FUSED_DTYPES:
        return f"dtype {x.dtype} is not supported by npu_swiglu (float16, bfloat16, float32)"
    if x.numel() == 0:
        return "empty input"
    return None


def packed_gate_up_weight(gate_proj: nn.Module, up_proj: nn.Module) -> torch.Tensor | None:
    """`[gate_proj.weight; up_proj.weight]` as one [2I, H] view of their shared buffer, without a copy,
    or None when they are not two plain Linears packed side by side (see `pack_gate_up`)."""
    if not (is_plain_linear(gate_proj) and is_plain_linear(up_proj)):
        return None
    gate, up = gate_proj.weight, up_proj.weight
    if gate.shape != up.shape or gate.dtype != up.dtype:
        return None
    if not (gate.is_contiguous() and up.is_contiguous()) or gate.device != up.device:
        return None
    if gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr():
        return None
    if up.storage_offset() != gate.storage_offset() + gate.numel():
        return None
    rows, cols = gate.shape
    return gate.detach().as_strided((2 * rows, cols), (cols, 1), gate.storage_offset())


def pack_gate_up(gate_proj: nn.Linear, up_proj: nn.Linear) -> None:
    """Lay gate_proj.weight and up_proj.weight out side by side in one new buffer, in place.

    The Parameter objects stay the same (optimizers holding them keep working) and stay separate
    entries of the state dict; only their storage becomes the two halves of one [2I, H] buffer.
    A later `.to(...)` or `load` that reallocates them undoes the packing (the layers then take
    the eager path) until this is called again.
    """
    gate, up = gate_proj.weight, up_proj.weight
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(
            f"gate_proj and up_proj weights differ ({tuple(gate.shape)} {gate.dtype} {gate.device} vs "
            f"{tuple(up.shape)} {up.dtype} {up.device}): they cannot share one buffer"
        )
    with torch.no_grad():
        buffer = torch.cat((gate, up))
    rows = gate.shape[0]
    for param, half in ((gate, buffer[:rows]), (up, buffer[rows:])):
        # swap_tensors re-points the existing Parameter object at its half of the buffer.
        torch.utils.swap_tensors(param, nn.Parameter(half, requires_grad=param.requires_grad))


class _PackedGateUp(torch.autograd.Function):
    """`[gate(x) | up(x)]` from one matmul against the packed weight; gradients go to both Parameters."""

    @staticmethod
    def forward(ctx, x, gate_weight, up_weight, gate_bias, up_bias, packed):
        # gate_weight/up_weight are inputs so that autograd routes their gradients; packed is their data.
        ctx.save_for_backward(x, packed)
        ctx.has_bias = gate_bias is not None
        bias = torch.cat((gate_bias, up_bias)) if ctx.has_bias else None
        return F.linear(x, packed, bias)

    @staticmethod
    def backward(ctx, grad):
        x, packed = ctx.saved_tensors
        rows = packed.shape[0] // 2
        grad_x = grad @ packed if ctx.needs_input_grad[0] else None
        grad_gate = grad_up = grad_gate_bias = grad_up_bias = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
            grad_gate, grad_up = grad_weight[:rows], grad_weight[rows:]
        if ctx.has_bias and (ctx.needs_input_grad[3] or ctx.needs_input_grad[4]):
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
            grad_gate_bias, grad_up_bias = grad_bias[:rows], grad_bias[rows:]
        return grad_x, grad_gate, grad_up, grad_gate_bias, grad_up_bias, None


def split_mlp(x: torch.Tensor, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, act_fn) -> torch.Tensor:
    """`down_proj(act_fn(gate_proj(x)) * up_proj(x))`, fused when gate/up are packed (see module doc)."""
    reason, packed = _split_plan(x, gate_proj, up_proj, act_fn)
    if reason is not None:
        return down_proj(act_fn(gate_proj(x)) * up_proj(x))
    gate_up = _PackedGateUp.apply(x, gate_proj.weight, up_proj.weight, gate_proj.bias, up_proj.bias, packed)
    return down_proj(torch_npu.npu_swiglu(gate_up.contiguous()))


def split_unavailable_reason(x: torch.Tensor, gate_proj: nn.Module, up_proj: nn.Module, act_fn) -> str | None:
    """Why `split_mlp` takes the eager path for this input and module, or None when it fuses."""
    return _split_plan(x, gate_proj, up_proj, act_fn)[0]


def _split_plan(
    x: torch.Tensor, gate_proj: nn.Module, up_proj: nn.Module, act_fn
) -> tuple[str | None, torch.Tensor | None]:
    """(why the eager path runs, or None; the packed [2I, H] weight view when it does not)."""
    reason = swiglu_unavailable_reason(x, act_fn)
    if reason is not None:
        return reason, None
    packed = packed_gate_up_weight(gate_proj, up_proj)
    if packed is None:
        return (
            "gate_proj/up_proj are not two plain Linears packed in one buffer (call pack_gate_up, e.g. through "
            "npu_hub_kernels.pack_gate_up(model)); unpacked, a concatenation would move more bytes than eager"
        ), None
    if (gate_proj.bias is None) != (up_proj.bias is None):
        return "only one of gate_proj/up_proj has a bias", None
    if packed.dtype != x.dtype:
        return f"weight dtype {packed.dtype} differs from input dtype {x.dtype}", None
    return None, packed


def fused_mlp(x: torch.Tensor, gate_up_proj: nn.Module, down_proj: nn.Module, act_fn) -> torch.Tensor:
    """`gate, up = gate_up_proj(x).chunk(2, -1)`; `down_proj(up * act_fn(gate))`, fused: gate rows come first."""
    gate_up = gate_up_proj(x)
    if swiglu_unavailable_reason(gate_up, act_fn) is None and gate_up.shape[-1] % 2 == 0:
        return down_proj(torch_npu.npu_swiglu(gate_up.contiguous()))
    gate, up = gate_up.chunk(2, dim=-1)
    return down_proj(up * act_fn(gate))
