"""Emulated `torch_npu.npu_swiglu`: the contract in docs/torch-npu-ops.md, section "npu_swiglu".

`a, b = chunk(x, 2, dim)`; `out = silu(a) * b` with the FIRST half gated, in float32 with one cast
back. The input must be contiguous and even along `dim`. Backward as the op's (`npu_swiglu_backward`:
float32 inside, the gradient cast to x's dtype), keeping x alone for it, as the op does.
"""

from __future__ import annotations

import functools

import torch

from ..backward import keeping_inputs
from ..checks import FLOAT_DTYPES, require_npu

__all__ = ["npu_swiglu"]


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    require_npu("npu_swiglu", x=x)
    if x.dtype not in FLOAT_DTYPES:
        raise RuntimeError(f"npu_swiglu: dtype {x.dtype} is not supported (fp16, bf16, fp32)")
    if not x.is_contiguous():
        raise RuntimeError("npu_swiglu: the input must be contiguous")
    if x.dim() == 0 or x.shape[dim] % 2:
        raise RuntimeError(f"npu_swiglu: size {x.shape[dim] if x.dim() else 0} along dim {dim} must be even")
    return keeping_inputs(functools.partial(_swiglu, dim=dim), x)


def _swiglu(x: torch.Tensor, dim: int) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
