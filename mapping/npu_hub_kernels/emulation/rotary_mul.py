"""Emulated `torch_npu.npu_rotary_mul`: the contract in docs/torch-npu-ops.md, section "npu_rotary_mul".

`out = x * r1 + rotate(x) * r2`, r1/r2 first cast to x's dtype, then everything in float32 and one
cast back. 'half' rotates like transformers' `rotate_half` (`cat(-x2, x1)`); 'interleave' turns
each pair (x[2i], x[2i+1]) into (-x[2i+1], x[2i]). The real op's layout limits are checked as the
cards lay out q/k (BNSD, BSND); the doc's "Known gaps in the emulation" lists where SBND differs.
"""

from __future__ import annotations

import torch

from .checks import FLOAT_DTYPES, require_npu


def npu_rotary_mul(
    x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half", rotate=None
) -> torch.Tensor:
    """torch_npu's signature; `rotate` (a custom rotation matrix) is accepted and, as in the cards, unused."""
    require_npu("npu_rotary_mul", x=x, r1=r1, r2=r2)
    _check(x, r1, r2, rotary_mode)
    x32 = x.float()
    r1_32 = r1.to(x.dtype).float()
    r2_32 = r2.to(x.dtype).float()
    if rotary_mode == "half":
        x1, x2 = x32.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        pairs = x32.unflatten(-1, (-1, 2))
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return (x32 * r1_32 + rotated * r2_32).to(x.dtype)


def _check(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, mode: str) -> None:
    if mode not in ("half", "interleave"):
        raise RuntimeError(f"npu_rotary_mul: rotary_mode must be 'half' or 'interleave', got {mode!r}")
    if x.dtype not in FLOAT_DTYPES:
        raise RuntimeError(f"npu_rotary_mul: dtype {x.dtype} is not supported (fp16, bf16, fp32)")
    if x.dim() not in (3, 4) or r1.dim() != x.dim() or r1.shape != r2.shape:
        raise RuntimeError(
            f"npu_rotary_mul: x must be 3-D or 4-D with r1/r2 of the same rank and shape, "
            f"got x {tuple(x.shape)}, r1 {tuple(r1.shape)}, r2 {tuple(r2.shape)}"
        )
    head_dim = x.shape[-1]
    if head_dim % 2 or head_dim >= 896:
        raise RuntimeError(f"npu_rotary_mul: the last dim must be even and < 896, got {head_dim}")
    if torch.broadcast_shapes(x.shape, r1.shape) != x.shape:
        raise RuntimeError(f"npu_rotary_mul: r1 {tuple(r1.shape)} does not broadcast to x {tuple(x.shape)}")
    if x.dim() == 4:
        batch, heads = x.shape[0], x.shape[_heads_axis(x, r1)]
        if mode == "half" and (batch >= 1000 or heads >= 1000):
            raise RuntimeError(f"npu_rotary_mul: 'half' needs B and N < 1000, got B={batch}, N={heads}")
        if mode == "interleave" and (batch * heads >= 1000 or r1.shape[0] != 1):
            raise RuntimeError("npu_rotary_mul: 'interleave' needs B*N < 1000 and r1 without a batch dim")


def _heads_axis(x: torch.Tensor, r1: torch.Tensor) -> int:
    """The heads axis of a 4-D x: where r1 broadcasts (size 1) and x does not; BNSD by default."""
    for axis in (1, 2):
        if r1.shape[axis] == 1 and x.shape[axis] != 1:
            return axis
    return 1
