"""SiLU-gated MLPs on torch_npu.npu_swiglu, with the module's own eager math wherever the op does not apply.

transformers writes the gated MLP in two shapes:
- split: `down_proj(act_fn(gate_proj(x)) * up_proj(x))` (Llama, Mistral, Qwen2/3, DeepseekV3, ...);
- fused: `gate, up = gate_up_proj(x).chunk(2, -1)`, `down_proj(up * act_fn(gate))` (Phi3, Glm4, ...).

npu_swiglu gates the FIRST half of its input: `silu(a) * b` for `a, b = chunk(x, 2, -1)`, which is
what the fused shape's `gate_up_proj(x)` holds. For the split shape, concatenating `gate_proj(x)`
and `up_proj(x)` per call would move more bytes than eager's silu and mul. Instead, the first fused
call lays the two weights (and biases) out side by side in one buffer (`pack_gate_up`), once: the
Parameter objects stay the same objects and the same state-dict entries, only their storage becomes
the two halves of one [2I, H] buffer. Every call then gets `[gate | up]` from one matmul against
that buffer and feeds npu_swiglu directly. Anything that reallocates the weights (`.to()`, a cast,
`load_state_dict(assign=True)`) undoes the layout; the next fused call packs again. Parameters
another system owns (DTensor/FSDP, DeepSpeed ZeRO-3, views into a flat buffer, hooked or wrapped
Linears such as LoRA's, tensors a live autograd graph or a weak reference holds) are never
rewritten: those MLPs run the eager math, and `swiglu_mlp_unavailable_reason` says why.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ._activations import is_silu
from ._npu import FUSED_DTYPES, npu_unavailable_reason, torch_npu

_PACKING = threading.Lock()
"""Held while a pair of weights is packed or read for a call, so two threads never pack the same MLP twice and
never read a pair another thread is packing."""


def activation_of(mlp: nn.Module) -> Callable | None:
    """An MLP's activation: `act_fn` in most of transformers, `activation_fn` in Phi3, Glm4 and Llama4."""
    return getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)


def is_plain_linear(module: nn.Module) -> bool:
    """An `nn.Linear` whose forward is `F.linear(x, weight, bias)`: not a subclass, LoRA wrapper or hooked module."""
    return (
        type(module) is nn.Linear
        and "forward" not in vars(module)
        and not module._forward_hooks
        and not module._forward_pre_hooks
    )


def _npu_swiglu_unavailable_reason(x: torch.Tensor, act_fn: Callable | None) -> str | None:
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


def _side_by_side(first: torch.Tensor | None, second: torch.Tensor | None) -> torch.Tensor | None:
    """`cat((first, second))` as a view of the buffer they share, without a copy; None unless they are
    two contiguous tensors of one shape laid out one right after the other in one storage."""
    if first is None or second is None or first.shape != second.shape or first.dtype != second.dtype:
        return None
    if not (first.is_contiguous() and second.is_contiguous()) or first.device != second.device:
        return None
    if first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr():
        return None
    if second.storage_offset() != first.storage_offset() + first.numel():
        return None
    # Contiguous halves: the doubled tensor has the strides of one half.
    return first.detach().as_strided((2 * first.shape[0], *first.shape[1:]), first.stride(), first.storage_offset())


def packed_gate_up_weight(gate_proj: nn.Module, up_proj: nn.Module) -> torch.Tensor | None:
    """`[gate_proj.weight; up_proj.weight]` as one [2I, H] view of their shared buffer, without a copy,
    or None when they are not two plain Linears packed side by side (see `pack_gate_up`)."""
    if not (is_plain_linear(gate_proj) and is_plain_linear(up_proj)):
        return None
    return _side_by_side(gate_proj.weight, up_proj.weight)


def pack_gate_up_unavailable_reason(gate_proj: nn.Module, up_proj: nn.Module) -> str | None:
    """Why `pack_gate_up` must leave these projections as they are, or None when it may pack them."""
    if not (is_plain_linear(gate_proj) and is_plain_linear(up_proj)):
        return (
            f"gate_proj/up_proj are {type(gate_proj).__name__}/{type(up_proj).__name__}, not two plain nn.Linear "
            "(an adapter such as LoRA, a subclass or a hook computes something else): their weights stay as they are"
        )
    gate, up = gate_proj.weight, up_proj.weight
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        return f"gate_proj and up_proj weights differ in shape, dtype or device ({gate.dtype}/{up.dtype})"
    if (gate_proj.bias is None) != (up_proj.bias is None):
        return "only one of gate_proj/up_proj has a bias"
    for name, param in _named_params(gate_proj, up_proj):
        reason = _owned_elsewhere_reason(param)
        if reason is not None:
            return f"{name}: {reason}"
    return None


def _named_params(gate_proj: nn.Module, up_proj: nn.Module) -> list[tuple[str, torch.Tensor]]:
    named = [("gate_proj.weight", gate_proj.weight), ("up_proj.weight", up_proj.weight)]
    if gate_proj.bias is not None:
        named += [("gate_proj.bias", gate_proj.bias), ("up_proj.bias", up_proj.bias)]
    return named


def _owned_elsewhere_reason(param: torch.Tensor) -> str | None:
    """Why this parameter belongs to a system that lays it out itself (packing would break it), or None."""
    if type(param).__name__ == "DTensor" or hasattr(param, "_local_tensor"):
        return "a DTensor (FSDP2 / tensor parallel) shards it"
    if hasattr(param, "ds_id") or hasattr(param, "ds_status"):
        return "DeepSpeed ZeRO-3 partitions it"
    if getattr(param, "_is_flat_param", False) or type(param).__name__ == "FlatParameter":
        return "it is an FSDP flat parameter"
    if param.is_meta or param.numel() == 0:
        return "it holds no data here (meta or empty: offloaded or partitioned)"
    own_bytes = param.numel() * param.element_size()
    if param.untyped_storage().nbytes() not in (own_bytes, 2 * own_bytes):  # its own, or a gate/up pair's buffer
        return "it is a view into a larger buffer another system owns (FSDP flat parameter, offloading)"
    if not param.is_leaf:
        return "it is not a leaf tensor"
    if weakref.getweakrefs(param):
        return "something holds a weak reference to it (torch.compile, a fake-tensor cache)"
    if param._use_count() > 1:
        return "it is held by a live autograd graph or another reference (e.g. DDP's reducer); call pack_gate_up first"
    if param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None):
        return "it has gradient hooks registered"
    return None


def pack_gate_up(gate_proj: nn.Linear, up_proj: nn.Linear) -> bool:
    """Lay gate_proj's and up_proj's weights (and biases) out side by side in one new buffer, in place.

    The Parameter objects stay the same objects (optimizers holding them keep working), their
    gradients stay, and they stay separate state-dict entries; only their storage becomes the two
    halves of one buffer. The transient memory is one copy of the two weights. Split MLPs do this on
    their first fused call; call it yourself only before something takes hold of the parameters that
    would stop it (e.g. wrapping the model in DistributedDataParallel).

    Args:
        gate_proj: the MLP's gate projection.
        up_proj: the MLP's up projection.

    Returns:
        True when the two are now packed (or already were); False when `pack_gate_up_unavailable_reason` forbids it.
    """
    with _PACKING:
        return _pack_locked(gate_proj, up_proj)


def _pack_locked(gate_proj: nn.Module, up_proj: nn.Module) -> bool:
    """pack_gate_up, with `_PACKING` held by the caller."""
    if _packed_views(gate_proj, up_proj) is not None:
        return True
    if pack_gate_up_unavailable_reason(gate_proj, up_proj) is not None:
        return False
    if not _pack_pair(gate_proj.weight, up_proj.weight):
        return False
    return gate_proj.bias is None or _pack_pair(gate_proj.bias, up_proj.bias)


def _packed_views(gate_proj: nn.Module, up_proj: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(the packed [2I, H] weight view, the packed [2I] bias view or None) when gate/up are packed, else None."""
    weight = packed_gate_up_weight(gate_proj, up_proj)
    if weight is None:
        return None
    if gate_proj.bias is None and up_proj.bias is None:
        return weight, None
    bias = _side_by_side(gate_proj.bias, up_proj.bias)
    return None if bias is None else (weight, bias)


def _pack_pair(gate: nn.Parameter, up: nn.Parameter) -> bool:
    """Re-point gate and up at the two halves of one new buffer; False when swap_tensors refuses one of them
    because something else holds it at that moment (an op of another thread in flight). The values are the same
    either way: a refused pair (or a pair with only gate moved) is just not packed, and packs on a later call."""
    # Plain tensors even inside inference_mode: an inference tensor could never be trained again.
    with torch.inference_mode(False), torch.no_grad():
        buffer = torch.cat((gate, up))
        rows = gate.shape[0]
        for param, half in ((gate, buffer[:rows]), (up, buffer[rows:])):
            replacement = nn.Parameter(half, requires_grad=param.requires_grad)
            replacement.grad = param.grad  # gradients live with the tensor swap_tensors replaces: keep them
            # swap_tensors re-points the existing Parameter object at its half of the buffer.
            try:
                torch.utils.swap_tensors(param, replacement)
            except RuntimeError as error:
                if "use_count" not in str(error):
                    raise
                return False
    return True


class _PackedGateUp(torch.autograd.Function):
    """`[gate(x) | up(x)]` from one matmul against the packed weight; gradients go to both Parameters.

    Under `torch.autocast("npu")` the matmul runs in the autocast dtype, as `gate_proj(x)` does; the
    backward runs under the same autocast state (custom_fwd/custom_bwd), so its matmuls take the
    low-precision gradient with the float32 weight and input as eager's linear backward does."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="npu")
    def forward(ctx, x, gate_weight, up_weight, gate_bias, up_bias, packed, packed_bias):
        # The four parameters are inputs so that autograd routes their gradients; packed* are their data.
        ctx.save_for_backward(x, packed)
        ctx.has_bias = packed_bias is not None
        return F.linear(x, packed, packed_bias)

    @staticmethod
    @torch.amp.custom_bwd(device_type="npu")
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
        return grad_x, grad_gate, grad_up, grad_gate_bias, grad_up_bias, None, None


def swiglu_mlp(x: torch.Tensor, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, act_fn) -> torch.Tensor:
    """`down_proj(act_fn(gate_proj(x)) * up_proj(x))`, fused on the NPU (packing gate/up once, see module doc)."""
    reason, packed = _split_plan(x, gate_proj, up_proj, act_fn)
    if reason is not None:
        return swiglu_mlp_eager(x, gate_proj, up_proj, down_proj, act_fn)
    gate_up = _PackedGateUp.apply(x, gate_proj.weight, up_proj.weight, gate_proj.bias, up_proj.bias, *packed)
    return down_proj(torch_npu.npu_swiglu(gate_up))


def swiglu_mlp_eager(
    x: torch.Tensor, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, act_fn
) -> torch.Tensor:
    """The split MLP's own forward (LlamaMLP's): what `swiglu_mlp` falls back to."""
    return down_proj(act_fn(gate_proj(x)) * up_proj(x))


def swiglu_mlp_unavailable_reason(x: torch.Tensor, gate_proj: nn.Module, up_proj: nn.Module, act_fn) -> str | None:
    """Why `swiglu_mlp` takes the eager path for this input and module, or None when it fuses (packing
    the weights on the way if they are not packed yet)."""
    return _split_plan(x, gate_proj, up_proj, act_fn, pack=False)[0]


def _split_plan(
    x: torch.Tensor, gate_proj: nn.Module, up_proj: nn.Module, act_fn, pack: bool = True
) -> tuple[str | None, tuple[torch.Tensor, torch.Tensor | None] | None]:
    """(why the eager path runs, or None; the packed weight and bias views when it does not). With
    `pack`, weights that are not packed yet are packed here (once: the layout lasts)."""
    reason = _npu_swiglu_unavailable_reason(x, act_fn)
    if reason is not None:
        return reason, None
    # Under the lock: another thread calling this MLP never reads the weights while they are being swapped (its
    # reference would make swap_tensors refuse), and waits for the packing instead of running eager.
    with _PACKING:
        packed = _packed_views(gate_proj, up_proj)
        if packed is None:
            reason = pack_gate_up_unavailable_reason(gate_proj, up_proj)
            if reason is not None or not pack:
                return reason, None
            _pack_locked(gate_proj, up_proj)
            packed = _packed_views(gate_proj, up_proj)
            if packed is None:  # something else held the weights at the swap: eager this time, packed later
                return pack_gate_up_unavailable_reason(gate_proj, up_proj) or "the weights could not be packed", None
    if packed[0].dtype != x.dtype:
        return f"weight dtype {packed[0].dtype} differs from input dtype {x.dtype}", None
    return None, packed


def swiglu_gate_up_mlp(x: torch.Tensor, gate_up_proj: nn.Module, down_proj: nn.Module, act_fn) -> torch.Tensor:
    """`gate, up = gate_up_proj(x).chunk(2, -1)`; `down_proj(up * act_fn(gate))`, fused: gate rows come first."""
    if swiglu_gate_up_mlp_unavailable_reason(x, gate_up_proj, act_fn) is not None:
        return swiglu_gate_up_mlp_eager(x, gate_up_proj, down_proj, act_fn)
    return down_proj(torch_npu.npu_swiglu(gate_up_proj(x).contiguous()))


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
    return _npu_swiglu_unavailable_reason(x, act_fn)
