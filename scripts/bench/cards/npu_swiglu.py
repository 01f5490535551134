"""npu-swiglu's bench spec (the contract: scripts/bench/cards/__init__.py).

Floor, with the weights as the model stores them (gate_proj and up_proj: two tensors, never one buffer; each
parameter's gradient a tensor of its own, as DDP's buckets and FSDP2's reduce-scatter take them). Its matmuls
stay matmuls (no torch_npu op fuses a matmul with the activation): 4 ops forward, 7 backward:
two matmuls writing h [2, T, I] (each reads x), a = swiglu(h) along axis 0 [T, I], y = a @ Wd; backward
da = dy @ Wd, dWd = dy^T a, dh = swiglu_backward(da, h), dx = dh_gate @ Wg then + dh_up @ Wu (the second
reads the first's result), dWg = dh_gate^T x, dWu = dh_up^T x.
The two weights concatenated for the call (one matmul writing h [T, 2I], reading x once) would move fewer bytes
when 3T > 8I (T > 4I forward only), but not in less time: the copy of both weights (and again for dx) is
memory-bound, while the second read of x is inside gate/up matmuls bound by the cube at such sizes (the card's
module doc). The floor is the fastest form, which is also the card's.
Kept for backward: h [T, 2I] (swiglu's backward reads it) and a [T, I] (dWd reads it); x and the
weights are the region's input and parameters.

A GELU-tanh gated MLP (Gemma's, the card's GeGLUMLP) has the same floor with npu_geglu in place of swiglu, plus
what that op's only form adds: it writes the gate's GELU [T, I] beside its output, its backward reads it, and its
autograd node keeps it (docs/torch-npu-ops.md, "npu_geglu"; no torch_npu op gates with GELU-tanh without it).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn
from transformers.activations import GELUTanh

from ..accounting import FusedOp, empty_of, tensor_bytes
from ..configs import PHASES
from ..floors import Floor, dense_bytes
from . import CountedTarget, HostTiming

BYTES_TOLERANCE = 1.03
"""Kernelized bytes of the SwiGLU MLP within 3% of its floor for split weights as the model stores them."""


def _gelu_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """The bytes of the gate's GELU [T, I] npu_geglu writes and keeps: 0 for a SiLU gate (npu_swiglu)."""
    if type(getattr(module, "act_fn", None)) is not GELUTanh:
        return 0
    return x.numel() // x.shape[-1] * module.down_proj.weight.shape[1] * x.element_size()


def floor(module: nn.Module, x: torch.Tensor, *_) -> Floor:
    """Two gate/up matmuls, the gating op, matmul down; backward 7 ops (see the module doc)."""
    hidden, inner = module.down_proj.weight.shape
    tokens, size = x.numel() // x.shape[-1], x.element_size()
    w_d = sum(tensor_bytes(p) for p in module.down_proj.parameters())
    w_gu = sum(tensor_bytes(p) for p in module.parameters()) - w_d
    h, a, y = tokens * 2 * inner * size, tokens * inner * size, tokens * hidden * size
    x_b, dx, gelu = tensor_bytes(x), dense_bytes(x), _gelu_bytes(module, x)
    # gate/up (each matmul reads x), swiglu (or geglu, writing the GELU too), down matmul
    fwd = (2 * x_b + w_gu + h) + (h + a + gelu) + (a + w_d + y)
    # da, dWd, dh (geglu's reads the GELU), dx (an mm, then an addmm reading its result), dWg and dWu
    bwd = (y + w_d + a) + (y + a + w_d) + (a + h + gelu + h) + (h + w_gu + 3 * dx) + (h + 2 * x_b + w_gu)
    return (4, fwd), (7, bwd)


def floor_saved(module: nn.Module, x: torch.Tensor, *_) -> int:
    """h [T, 2I] and a [T, I], which the swiglu backward and dWd read; and geglu's GELU [T, I] for a GeGLU MLP."""
    inner = module.down_proj.weight.shape[1]
    return x.numel() // x.shape[-1] * 3 * inner * x.element_size() + _gelu_bytes(module, x)


COUNTED_TARGETS = (
    CountedTarget("ops", PHASES, 1),
    CountedTarget("bytes", PHASES, BYTES_TOLERANCE),
    CountedTarget("bytes", PHASES, 1, against="eager"),
)


def _halved_output(a: dict[str, Any]) -> torch.Tensor:
    x, dim = a["x"], a["dim"]
    shape = list(x.shape)
    shape[dim] //= 2
    return empty_of(x, shape)


FUSED_OPS = {
    "npu_swiglu": FusedOp(_halved_output, ("x",), lambda a, out: [a["x"]]),
    # (out, gelu), both [.., I]; the backward reads and the node keeps x and that gelu (derivatives.yaml)
    "npu_geglu": FusedOp(lambda a: (_halved_output(a), _halved_output(a)), ("x",), lambda a, out: [a["x"], out[1]]),
}


def _direct_call(card: ModuleType, mlp: nn.Module) -> Callable[..., Any]:
    swiglu_mlp = card.swiglu_mlp
    return lambda x: swiglu_mlp(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn)


HOST_TIMING = HostTiming(
    region=lambda layer: layer.mlp,
    inputs=lambda config, batch, seq, device: (torch.randn(batch, seq, config.hidden_size, device=device),),
    direct_call=_direct_call,
    shapes=lambda mlp, inputs: f"x {tuple(inputs[0].shape)}, intermediate {mlp.down_proj.in_features}",
)

PREFILL_DECODE_TABLE = True
