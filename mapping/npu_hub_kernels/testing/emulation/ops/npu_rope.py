"""Emulated torch_npu rotary ops: the contracts in docs/torch-npu-ops.md, sections "npu_rotary_mul" and
"npu_apply_rotary_pos_emb".

`npu_rotary_mul`: `out = x * r1 + rotate(x) * r2`, r1/r2 first cast to x's dtype, then everything in
float32 and one cast back. 'half' rotates like transformers' `rotate_half` (`cat(-x2, x1)`);
'interleave' turns each pair (x[2i], x[2i+1]) into (-x[2i+1], x[2i]). The layout (BNSD, BSND, SBND,
or TND for 3-D x) is read from which axes of r1 are 1, as the kernel does; r1 must be one of the
layout's broadcast forms, and the batch/heads limits apply to that layout's axes. A shape that is a
form of several layouts is taken when it is within the limits of one of them (the math is the same). The output is a new
tensor of x's shape, in x's layout (row-major), whatever x's strides. Backward for x, r1 and r2, keeping
x, r1 and r2 for it, as the op does (op-plugin derivatives.yaml: `npu_rotary_mul_backward(grad, self, r1, r2)`).

`npu_apply_rotary_pos_emb`: 'half' RoPE of q and k with one cos/sin, written into q and k in place
(BSND or TND, head dim 64 or 128, one dtype for all four tensors, cos/sin without broadcast over the
batch); returns q and k. No autograd.
"""

from __future__ import annotations

import functools

import torch

from ..backward import keeping_inputs
from ..checks import FLOAT_DTYPES, require_npu

__all__ = ["npu_apply_rotary_pos_emb", "npu_rotary_mul"]

_LAYOUT_FORMS = {
    # layout: (the batch axis, the heads axis, the r1 forms as "which x axes r1 keeps" (others are 1))
    "BNSD": (0, 1, ((2, 3), (0, 2, 3), (0, 1, 2, 3))),
    "BSND": (0, 2, ((1, 3), (0, 1, 3), (0, 1, 2, 3))),
    "SBND": (1, 2, ((0, 3), (0, 1, 3), (0, 1, 2, 3))),
}
"""The 4-D layouts npu_rotary_mul takes; the first r1 form of each is the only one 'interleave' mode takes."""


def npu_rotary_mul(
    x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half", rotate=None
) -> torch.Tensor:
    """torch_npu's signature; `rotate` (a custom rotation matrix) is accepted and, as in the cards, unused."""
    require_npu("npu_rotary_mul", x=x, r1=r1, r2=r2)
    _check(x, r1, r2, rotary_mode)
    return keeping_inputs(functools.partial(_rotated_row_major, mode=rotary_mode), x, r1, r2)


def npu_apply_rotary_pos_emb(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layout: str = "BSND",
    rotary_mode: str = "half",
) -> tuple[torch.Tensor, torch.Tensor]:
    require_npu("npu_apply_rotary_pos_emb", query=query, key=key, cos=cos, sin=sin)
    op = "npu_apply_rotary_pos_emb"
    if layout not in ("BSND", "TND") or rotary_mode != "half":
        raise RuntimeError(
            f"{op}: layout 'BSND' or 'TND', rotary_mode 'half' on A2/A3; got {layout!r}, {rotary_mode!r}"
        )
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, cos, sin)):
        raise RuntimeError(f"{op}: the op has no backward (inference only), but an input requires grad")
    rank = 4 if layout == "BSND" else 3
    tensors = {"query": query, "key": key, "cos": cos, "sin": sin}
    if any(t.dim() != rank for t in tensors.values()) or any(t.numel() == 0 for t in tensors.values()):
        raise RuntimeError(f"{op}: {layout} takes {rank}-D, non-empty tensors; got {_shapes(tensors)}")
    if len({t.dtype for t in tensors.values()}) != 1 or query.dtype not in FLOAT_DTYPES:
        raise RuntimeError(
            f"{op}: one float dtype for all four tensors, got {[str(t.dtype) for t in tensors.values()]}"
        )
    head_dim = query.shape[-1]
    if head_dim not in (64, 128) or any(t.shape[-1] != head_dim for t in tensors.values()):
        raise RuntimeError(f"{op}: head dim 64 or 128, the same in all four tensors; got {_shapes(tensors)}")
    angles_shape = (*query.shape[:-2], 1, head_dim)
    if cos.shape != angles_shape or sin.shape != angles_shape or key.shape[:-2] != query.shape[:-2]:
        raise RuntimeError(
            f"{op}: cos/sin must be {angles_shape} (no broadcast), k must match q's leading dims: {_shapes(tensors)}"
        )
    with torch.no_grad():
        for t in (query, key):
            t.copy_(_rotated(t, cos, sin, "half"))
    return query, key


def _shapes(tensors: dict[str, torch.Tensor]) -> str:
    return ", ".join(f"{name} {tuple(t.shape)}" for name, t in tensors.items())


def _rotated_row_major(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, mode: str) -> torch.Tensor:
    return _rotated(x, r1, r2, mode).contiguous()


def _rotated(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, mode: str) -> torch.Tensor:
    x32 = x.float()
    r1_32 = r1.to(x.dtype).float()
    r2_32 = r2.to(x.dtype).float()
    if mode == "half":
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
    if head_dim % 2 or head_dim >= 896 or r1.shape[-1] != head_dim:
        raise RuntimeError(f"npu_rotary_mul: the last dim must be even and < 896 and equal in x and r1, got {head_dim}")
    if x.dim() == 3:  # TND: r1 [T, 1, D] (or [T, N, D] in 'half' mode)
        forms = [(x.shape[0], 1, head_dim)] + ([tuple(x.shape)] if mode == "half" else [])
        if tuple(r1.shape) not in forms:
            raise RuntimeError(f"npu_rotary_mul: TND x {tuple(x.shape)} takes r1 of {forms}, got {tuple(r1.shape)}")
        return
    reasons = [_limits_reason(x, r1, r2, mode, layout) for layout in _layouts(x, r1, mode)]
    if None not in reasons:  # a shape several layouts read is taken when it is within the limits of one of them
        raise RuntimeError(reasons[0])


def _limits_reason(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, mode: str, layout: str) -> str | None:
    """Why x is outside `layout`'s batch/heads limits in `mode`, or None."""
    batch_axis, heads_axis, _ = _LAYOUT_FORMS[layout]
    batch, heads = x.shape[batch_axis], x.shape[heads_axis]
    if mode == "half" and (batch >= 1000 or heads >= 1000):
        return f"npu_rotary_mul: 'half' needs B and N < 1000 ({layout}), got B={batch}, N={heads}"
    if mode == "interleave" and batch * heads >= 1000:
        return f"npu_rotary_mul: 'interleave' needs B*N < 1000 ({layout}), got B={batch}, N={heads}"
    if (r1.requires_grad or r2.requires_grad) and torch.is_grad_enabled() and batch * heads > 1024:
        return f"npu_rotary_mul: B*N must be <= 1024 when r1/r2 require grad ({layout}), got {batch * heads}"
    return None


def _layouts(x: torch.Tensor, r1: torch.Tensor, mode: str) -> list[str]:
    """The layouts of which r1's shape is an r1 form (the axes of x it keeps, 1 on the others): one or several
    (x [2048, 4, 32, 64] with r1 [2048, 4, 1, 64] is BSND with B=2048 and SBND with S=2048)."""
    layouts = [
        layout
        for layout, (_, _, forms) in _LAYOUT_FORMS.items()
        for kept in (forms[:1] if mode == "interleave" else forms)
        if tuple(r1.shape) == tuple(x.shape[axis] if axis in kept else 1 for axis in range(4))
    ]
    if layouts:
        return list(dict.fromkeys(layouts))
    allowed = "the first form" if mode == "interleave" else "one of the forms"
    raise RuntimeError(
        f"npu_rotary_mul: r1 {tuple(r1.shape)} is not {allowed} of a layout for x {tuple(x.shape)} in {mode!r} mode "
        "(BNSD: 11SD, B1SD, BNSD; BSND: 1S1D, BS1D, BSND; SBND: S11D, SB1D, SBND; 'interleave' without a batch dim)"
    )
