"""GELU-tanh gated MLPs (Gemma's) on torch_npu.npu_geglu, with the module's own eager math where the op does not apply.

Gemma, Gemma 2, Gemma 3 and their kin write `down_proj(act_fn(gate_proj(x)) * up_proj(x))` with
`act_fn = ACT2FN["gelu_pytorch_tanh"]`, torch's `F.gelu(x, approximate="tanh")`: the split SwiGLU MLP with another
activation. npu_geglu with `approximate=1` computes that tanh GELU, and with `activate_left=True` it activates the
FIRST half of its input (its default, False, activates the second: docs/torch-npu-ops.md, "npu_geglu"). So the
GeGLU MLP runs exactly as the split SwiGLU MLP does (`swiglu.fused_split_mlp`: the same gate/up matmuls into the
same buffers, the weights read where the model keeps them), with npu_geglu in place of npu_swiglu, and falls back
for the same reasons (`swiglu.split_unavailable_reason`), or when act_fn is not exactly that tanh GELU.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ._activations import is_gelu_tanh
from ._fallbacks import ran_eager
from ._npu import torch_npu
from .swiglu import GatedOp, fused_split_mlp, split_unavailable_reason


def _npu_geglu_first_half(h: torch.Tensor, dim: int) -> torch.Tensor:
    """`gelu_tanh(first half) * second half` of h along dim: npu_geglu's first output."""
    out, _gelu = torch_npu.npu_geglu(h, dim=dim, approximate=1, activate_left=True)
    return out


GEGLU = GatedOp(
    "npu_geglu", "GELU-tanh", is_gelu_tanh, _npu_geglu_first_half, functools.partial(F.gelu, approximate="tanh")
)
"""npu_geglu(approximate=1, activate_left=True): `gelu_tanh(first half) * second half`."""


def geglu_mlp(
    x: torch.Tensor,
    gate_proj: nn.Module,
    up_proj: nn.Module,
    down_proj: nn.Module,
    act_fn,
    *,
    module: nn.Module | None = None,
) -> torch.Tensor:
    """`down_proj(act_fn(gate_proj(x)) * up_proj(x))` for a GELU-tanh act_fn, fused with npu_geglu when it can be.

    It is fused as `geglu_mlp_unavailable_reason` decides, recorded for `module` (the MLP, when its layer calls it).
    """
    if ran_eager(module, geglu_mlp_unavailable_reason(x, gate_proj, up_proj, act_fn)):
        return geglu_mlp_eager(x, gate_proj, up_proj, down_proj, act_fn)
    return fused_split_mlp(x, gate_proj, up_proj, down_proj, GEGLU)


def geglu_mlp_eager(
    x: torch.Tensor, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, act_fn
) -> torch.Tensor:
    """The GeGLU MLP's own forward (Gemma3MLP's): what `geglu_mlp` falls back to."""
    return down_proj(act_fn(gate_proj(x)) * up_proj(x))


def geglu_mlp_unavailable_reason(x: torch.Tensor, gate_proj: nn.Module, up_proj: nn.Module, act_fn) -> str | None:
    """Why `geglu_mlp` takes the eager path for this input and these projections, or None when it fuses."""
    return split_unavailable_reason(x, gate_proj, up_proj, act_fn, GEGLU)
