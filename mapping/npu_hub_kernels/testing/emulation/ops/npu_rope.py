"""Emulated torch_npu rotary ops, as docs/torch-npu-ops.md states them.

The contracts are in docs/torch-npu-ops.md, sections "npu_rotary_mul" and "npu_apply_rotary_pos_emb".

`npu_rotary_mul`: `out = x * r1 + rotate(x) * r2`, r1/r2 first cast to x's dtype, then everything in
float32 and one cast back. 'half' rotates like transformers' `rotate_half` (`cat(-x2, x1)`);
'interleave' turns each pair (x[2i], x[2i+1]) into (-x[2i+1], x[2i]). The layout (BNSD, BSND, SBND,
or TND for 3-D x) is read from which axes of r1 are 1, as the kernel does; r1 must be one of the
layout's broadcast forms, and the batch/heads limits apply to that layout's axes. A shape that is a
form of several layouts is taken when it is within the limits of one of them (the math is the same). The output is a
new tensor of x's shape, in x's layout (row-major), whatever x's strides. Backward for x, r1 and r2, keeping
x, r1 and r2 for it, as the op does (op-plugin derivatives.yaml: `npu_rotary_mul_backward(grad, self, r1, r2,
rotary_mode)`), whose own limits the autograd node checks first. The `rotate` matrix is documented but not emulated.

`npu_apply_rotary_pos_emb`: 'half' RoPE of q and k with one cos/sin, written into q and k in place
(BSND or TND, head dim 64 or 128, one dtype and head dim for all four tensors, cos/sin without broadcast over
the batch, q and k heads within the kernel's on-chip memory); returns q and k. No autograd.

Limits: `LEDGER`, the rules of npu_rotary_mul, of npu_rotary_mul_backward (checked in npu_rotary_mul's backward)
and of npu_apply_rotary_pos_emb, in the order each op checks them. Some depend on the emulated CANN version
(`torch.version.cann`): 3-D (TND) npu_rotary_mul needs CANN 9.0 or later; TND and head dim 64 in
npu_apply_rotary_pos_emb need CANN 9.1 or later (inferred from when op-plugin's docs list them).
"""

from __future__ import annotations

import functools

import torch

from ..backward import keeping_inputs
from ..checks import FLOAT_DTYPES, require_npu
from ..ledger import OP_PLUGIN, OPS_TRANSFORMER, enforce, op_doc, rules

__all__ = ["npu_apply_rotary_pos_emb", "npu_rotary_mul"]

_ROTARY_MUL_API = f"{OP_PLUGIN}:docs/zh/custom_APIs/torch_npu/torch_npu-npu_rotary_mul.md"
_RPE_DOC = f"{OPS_TRANSFORMER}:posembedding/rotary_position_embedding/docs/aclnnRotaryPositionEmbedding.md"
_RPE_GRAD_DOC = (
    f"{OPS_TRANSFORMER}:posembedding/rotary_position_embedding_grad/docs/aclnnRotaryPositionEmbeddingGrad.md"
)
_APPLY_DOC = f"{OPS_TRANSFORMER}:posembedding/apply_rotary_pos_emb/docs/aclnnApplyRotaryPosEmbV2.md"

_TND_ROTARY_MUL_CANN = (9, 0)
"""The first CANN whose npu_rotary_mul takes 3-D (TND) x (inferred): op-plugin's API doc lists TND from branch
26.0.0 on (torch_npu 26.0.0, which pairs with CANN 9.0); the November 2025 CANN kernel doc takes 4-D x only."""
_APPLY_ROTARY_NEWER_CANN = (9, 1)
"""The first CANN whose npu_apply_rotary_pos_emb takes TND and a head dim of 64 on A2/A3 (inferred): op-plugin
documents both from branch 26.1.0 on (torch_npu 26.1.0, CANN 9.1); the November 2025 CANN kernel docs take BSND
(or SBND/BNSD on other products) and D = 128 only."""
_UB_BYTES = 192 * 1024
"""The on-chip unified buffer (UB) of an Atlas A2/A3 AI core (hicann/ops-transformer@c29bc10:
attention/mla_prolog/op_kernel/mla_prolog_comm.h:72, `MAX_UB_SIZE = 192 * 1024`)."""

_LAYOUT_FORMS = {
    # layout: (the batch axis, the heads axis, the r1 forms as "which x axes r1 keeps" (others are 1))
    "BNSD": (0, 1, ((2, 3), (0, 2, 3), (0, 1, 2, 3))),
    "BSND": (0, 2, ((1, 3), (0, 1, 3), (0, 1, 2, 3))),
    "SBND": (1, 2, ((0, 3), (0, 1, 3), (0, 1, 2, 3))),
}
"""The 4-D layouts npu_rotary_mul takes; the first r1 form of each is the only one 'interleave' mode takes."""


def _cann_at_least(version: tuple[int, int]) -> bool:
    """Whether the CANN the emulated host reports ("9.1.0", "8.3.RC1") is `version` (major, minor) or later."""
    major, minor = torch.version.cann.split(".")[:2]  # type: ignore[attr-defined]
    return (int(major), int(minor)) >= version


def _readings(x: torch.Tensor, r1: torch.Tensor, mode: str) -> list[tuple[int, int]]:
    """(batch, heads) of each layout npu_rotary_mul can read x in, in `mode`, given r1's shape.

    Those are the layouts of which r1's shape is an r1 form (the axes of x it keeps, 1 on the others). None, one or
    several: x [2048, 4, 32, 64] with r1 [2048, 4, 1, 64] is BSND with B=2048 and SBND with B=4. TND x [T, N, D]
    reads as batch 1, N heads.
    """
    shape = tuple(r1.shape)
    if x.dim() == 3:
        forms = [(x.shape[0], 1, x.shape[2])] + ([tuple(x.shape)] if mode == "half" else [])
        return [(1, x.shape[1])] if shape in forms else []
    return [
        (x.shape[batch_axis], x.shape[heads_axis])
        for batch_axis, heads_axis, forms in _LAYOUT_FORMS.values()
        for kept in (forms[:1] if mode == "interleave" else forms)
        if shape == tuple(x.shape[axis] if axis in kept else 1 for axis in range(4))
    ]


def _within_mode_limits(mode: str, batch: int, heads: int) -> bool:
    """'half': B and N below 1000; 'interleave': B*N below 1000."""
    return batch < 1000 and heads < 1000 if mode == "half" else batch * heads < 1000


def _limits_hold(x: torch.Tensor, r1: torch.Tensor, mode: str, grad_limit: bool = False) -> bool:
    """Whether one layout x can be read in (see `_readings`) is within `mode`'s limits.

    With `grad_limit`, B*N <= 1024 too. A shape several layouts read is taken when one of them is within all the
    limits.
    """
    return any(
        _within_mode_limits(mode, batch, heads) and (not grad_limit or batch * heads <= 1024)
        for batch, heads in _readings(x, r1, mode)
    )


ROTARY_MUL = rules(
    "npu_rotary_mul",
    (
        "rotary-mode",
        "rotary_mode is 'half' or 'interleave'",
        op_doc(3545),
        lambda c: c.rotary_mode in ("half", "interleave"),
        "the adapter also takes 'quarter' and 'interleave-half', on Ascend 950 only (RotaryMulKernelNpuOpApi.cpp:41)",
    ),
    (
        "dtype",
        "x, r1 and r2 are float16, bfloat16 or float32 (r1/r2 may differ from x: the adapter casts them to x's)",
        op_doc(3542),
        lambda c: all(t.dtype in FLOAT_DTYPES for t in (c.x, c.r1, c.r2)),
    ),
    (
        "rank",
        "x has 3 (TND) or 4 dims, and r1 and r2 as many",
        f"{_ROTARY_MUL_API}:74",
        lambda c: c.x.dim() in (3, 4) and c.r1.dim() == c.x.dim() and c.r2.dim() == c.x.dim(),
        "the docstring (_op_plugin_docs.py:3542) still says 4-D; 3-D x is the rule tnd-cann's",
    ),
    (
        "tnd-cann",
        "3-D (TND) x needs CANN 9.0 or later",
        f"{_RPE_DOC}:308",
        lambda c: c.x.dim() == 4 or _cann_at_least(_TND_ROTARY_MUL_CANN),
        "inferred: the November 2025 CANN kernel doc takes BNSD, BSND and SBND x only, and op-plugin's 3-D tests "
        "are skipped as unsupported by its CI; op-plugin's API doc lists TND from branch 26.0.0 on (torch_npu "
        "26.0.0, paired with CANN 9.0)",
    ),
    (
        "same-shape",
        "r1 and r2 have the same shape",
        f"{_RPE_DOC}:311",
        lambda c: c.r1.shape == c.r2.shape,
    ),
    (
        "head-dim",
        "x, r1 and r2 have the same last dim D, even and below 896",
        f"{_RPE_DOC}:309",
        lambda c: c.x.shape[-1] % 2 == 0 and c.x.shape[-1] < 896 and c.r1.shape[-1] == c.x.shape[-1],
        "the general section (line 297) allows D <= 1024; A2/A3's D < 896 holds, as in the API doc (_op_plugin_docs.py"
        ":3550)",
    ),
    (
        "half-forms",
        "'half': r1/r2 are a broadcast form of x's layout: 11SD, B1SD or BNSD for BNSD x; 1S1D, BS1D or BSND for "
        "BSND x; S11D, SB1D or SBND for SBND x; T1D or TND for TND x",
        op_doc(3552),
        lambda c: c.rotary_mode != "half" or bool(_readings(c.x, c.r1, "half")),
        "the TND forms are the API doc's (torch_npu-npu_rotary_mul.md:98)",
    ),
    (
        "interleave-forms",
        "'interleave': r1/r2 are 11SD for BNSD x, 1S1D for BSND x, S11D for SBND x or T1D for TND x (no batch dim)",
        op_doc(3560),
        lambda c: c.rotary_mode != "interleave" or bool(_readings(c.x, c.r1, "interleave")),
        "the TND form is the API doc's (torch_npu-npu_rotary_mul.md:112)",
    ),
    (
        "half-limits",
        "'half': B < 1000 and N < 1000, B and N the batch and heads sizes of the layout read from r1's shape (a "
        "shape that is a form of several layouts is taken when one of them is within the limits)",
        op_doc(3550),
        lambda c: c.rotary_mode != "half" or _limits_hold(c.x, c.r1, "half"),
        "TND x is read as B = 1 (inferred); the B*N <= 1024 limit when cos/sin need gradients is the backward's "
        "(npu_rotary_mul_backward/grad-limits)",
    ),
    (
        "interleave-limits",
        "'interleave': B*N < 1000, B and N the batch and heads sizes of the layout read from r1's shape",
        op_doc(3558),
        lambda c: c.rotary_mode != "interleave" or _limits_hold(c.x, c.r1, "interleave"),
        "TND x is read as B = 1 (inferred)",
    ),
    (
        "rotate",
        "rotate is None or a 2-D float16, bfloat16 or float32 tensor",
        op_doc(3546),
        lambda c: c.rotate is None or (c.rotate.dim() == 2 and c.rotate.dtype in FLOAT_DTYPES),
    ),
    (
        "rotate-no-grad",
        "with rotate, no input requires grad (rotate has no backward)",
        f"{_ROTARY_MUL_API}:70",
        lambda c: (
            c.rotate is None
            or not torch.is_grad_enabled()
            or not any(t.requires_grad for t in (c.x, c.r1, c.r2, c.rotate))
        ),
        "the device's backward would ignore rotate (derivatives.yaml:234 does not pass it); the ledger refuses the "
        "forward",
    ),
)
"""npu_rotary_mul's limits on Atlas A2/A3 (jit_compile=False, aclnnRotaryPositionEmbedding)."""

ROTARY_MUL_BACKWARD = rules(
    "npu_rotary_mul_backward",
    (
        "rank",
        "grad has 4 dims, or 3 (TND) on CANN 9.0 or later",
        f"{_RPE_GRAD_DOC}:190",
        lambda c: c.grad.dim() == 4 or (c.grad.dim() == 3 and _cann_at_least(_TND_ROTARY_MUL_CANN)),
        "inferred as npu_rotary_mul/tnd-cann: the November 2025 grad kernel doc takes 4-D dy only, and op-plugin's "
        "3-D backward test is skipped as unsupported by its CI",
    ),
    (
        "grad-limits",
        "when r1 or r2 requires grad (the adapter then passes x, and the kernel computes dcos and dsin), B*N <= 1024 "
        "in a layout read from r1's shape that is within the forward's limits",
        f"{_RPE_GRAD_DOC}:389",
        lambda c: (
            not (c.r1.requires_grad or c.r2.requires_grad) or _limits_hold(c.self, c.r1, c.rotary_mode, grad_limit=True)
        ),
        "the API doc states it among the forward's limits (_op_plugin_docs.py:3550); the grad kernel checks it, in "
        "backward (RotaryMulBackwardKernelNpuOpApi.cpp:59 passes x when r1 or r2 requires grad). 'interleave's "
        "B*N < 1000 already holds",
    ),
)
"""npu_rotary_mul_backward's limits on Atlas A2/A3 (aclnnRotaryPositionEmbeddingGrad), checked in npu_rotary_mul's
backward on what derivatives.yaml:234 hands it: `npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode)`. The
grad kernel's other limits (modes, dtypes, layouts and forms, D, B and N) are the forward's, on the same tensors."""


def _ub_bytes(query: torch.Tensor, key: torch.Tensor) -> int:
    """aclnnApplyRotaryPosEmb(V2)'s `ub_required`, with its D of 128, for q and k's heads and dtype."""
    heads = query.shape[-2] + key.shape[-2]
    cast = int(query.dtype == torch.bfloat16)
    dtype_size = query.element_size()
    cast_size = 4 if cast else dtype_size
    return (
        heads * 128 * cast_size * 2
        + 128 * dtype_size * 4
        + heads * 128 * cast_size
        + heads * 128 * cast_size * 2
        + cast * (128 * 4 * 2)
    )


def _apply_tensors(c) -> tuple[torch.Tensor, ...]:
    return c.query, c.key, c.cos, c.sin


APPLY_ROTARY_POS_EMB = rules(
    "npu_apply_rotary_pos_emb",
    (
        "layout",
        "layout is 'BSND' or 'TND'",
        op_doc(15806),
        lambda c: c.layout in ("BSND", "TND"),
        "'SBND' and 'BNSD' are Ascend 950's; the adapter reads a layout string it does not know as BSND "
        "(ApplyRotaryPosEmbNpuOpApi.cpp:46): the ledger refuses it",
    ),
    ("rotary-mode", "rotary_mode is 'half'", op_doc(15810), lambda c: c.rotary_mode == "half"),
    (
        "no-autograd",
        "no input requires grad (the op has no backward)",
        f"{OP_PLUGIN}:op_plugin/ops/opapi/AutogradErrorFallback.cpp:15",
        lambda c: not torch.is_grad_enabled() or not any(t.requires_grad for t in _apply_tensors(c)),
        "the device runs the forward and raises on backward through its outputs: the ledger refuses the forward",
    ),
    (
        "tnd-cann",
        "layout 'TND' needs CANN 9.1 or later",
        f"{_APPLY_DOC}:259",
        lambda c: c.layout != "TND" or _cann_at_least(_APPLY_ROTARY_NEWER_CANN),
        "inferred: the November 2025 CANN kernel doc has no TND, and op-plugin's TND test is skipped until CANN "
        "supports it; op-plugin documents TND from branch 26.1.0 on (torch_npu 26.1.0, CANN 9.1)",
    ),
    (
        "rank",
        "query, key, cos and sin have 4 dims (BSND), or 3 (TND)",
        op_doc(15789),
        lambda c: all(t.dim() == (4 if c.layout == "BSND" else 3) for t in _apply_tensors(c)),
    ),
    (
        "non-empty",
        "query, key, cos and sin are not empty",
        op_doc(15790),
        lambda c: all(t.numel() > 0 for t in _apply_tensors(c)),
    ),
    (
        "dtype",
        "query, key, cos and sin are bfloat16, float16 or float32",
        op_doc(15789),
        lambda c: all(t.dtype in FLOAT_DTYPES for t in _apply_tensors(c)),
    ),
    (
        "same-dtype",
        "query, key, cos and sin have one dtype",
        op_doc(15821),
        lambda c: len({t.dtype for t in _apply_tensors(c)}) == 1,
    ),
    (
        "head-dim",
        "the last dim D of query, key, cos and sin is 64 or 128",
        op_doc(15790),
        lambda c: all(t.shape[-1] in (64, 128) for t in _apply_tensors(c)),
    ),
    (
        "head-dim-cann",
        "D = 64 needs CANN 9.1 or later (128 before)",
        f"{_APPLY_DOC}:189",
        lambda c: all(t.shape[-1] == 128 for t in _apply_tensors(c)) or _cann_at_least(_APPLY_ROTARY_NEWER_CANN),
        "the November 2025 CANN kernel docs and tiling take D = 128 only, op-plugin's API doc 64 or 128 from branch "
        "26.1.0 on (CANN 9.1, inferred): the stricter before 9.1",
    ),
    (
        "same-head-dim",
        "query, key, cos and sin have the same D",
        f"{_APPLY_DOC}:373",
        lambda c: len({t.shape[-1] for t in _apply_tensors(c)}) == 1,
        "the API doc (_op_plugin_docs.py:15820) asks it of query and key, and of cos and sin; the kernel doc of all "
        "four: the stricter holds (the emulation does not rotate part of D)",
    ),
    (
        "leading-dims",
        "query, key, cos and sin have the same B and S (BSND) or T (TND): cos/sin do not broadcast",
        op_doc(15819),
        lambda c: len({tuple(t.shape[:-2]) for t in _apply_tensors(c)}) == 1,
    ),
    (
        "cos-heads",
        "cos and sin have one head (N = 1)",
        op_doc(15798),
        lambda c: c.cos.shape[-2] == 1 and c.sin.shape[-2] == 1,
    ),
    (
        "ub",
        "the kernel's on-chip memory holds q's and k's heads: ub_required = (q_n + k_n) * 128 * castSize * 5 + 128 "
        "* DtypeSize * 4 + cast * 1024 <= 192 KiB (cast 1 and castSize 4 for bfloat16; else 0 and the dtype's size)",
        f"{_APPLY_DOC}:380",
        lambda c: _ub_bytes(c.query, c.key) <= _UB_BYTES,
        "the doc's formula, with its D of 128 for D = 64 too (the stricter); A2/A3's UB is 192 KiB "
        "(ops-transformer attention/mla_prolog/op_kernel/mla_prolog_comm.h:72). At most 76 heads in all in "
        "float32 and bfloat16, 152 in float16",
    ),
)
"""npu_apply_rotary_pos_emb's limits on Atlas A2/A3."""

LEDGER = ROTARY_MUL + ROTARY_MUL_BACKWARD + APPLY_ROTARY_POS_EMB


def npu_rotary_mul(
    x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half", rotate=None
) -> torch.Tensor:
    """torch_npu's signature; a `rotate` matrix is documented but not emulated (NotImplementedError)."""
    require_npu("npu_rotary_mul", x=x, r1=r1, r2=r2)
    enforce(ROTARY_MUL, x=x, r1=r1, r2=r2, rotary_mode=rotary_mode, rotate=rotate)
    if rotate is not None:
        raise NotImplementedError("npu_rotary_mul: the rotate matrix (aclnnRotaryPositionEmbeddingV2) is not emulated")
    return keeping_inputs(
        functools.partial(_rotated_row_major, mode=rotary_mode),
        x,
        r1,
        r2,
        backward_op="npu_rotary_mul_backward",
        check_backward=functools.partial(_check_backward, rotary_mode=rotary_mode),
    )


def _check_backward(grad: torch.Tensor, x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str):
    """derivatives.yaml:234: `npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode)`."""
    enforce(ROTARY_MUL_BACKWARD, grad=grad, self=x, r1=r1, r2=r2, rotary_mode=rotary_mode)


def npu_apply_rotary_pos_emb(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layout: str = "BSND",
    rotary_mode: str = "half",
) -> tuple[torch.Tensor, torch.Tensor]:
    require_npu("npu_apply_rotary_pos_emb", query=query, key=key, cos=cos, sin=sin)
    enforce(APPLY_ROTARY_POS_EMB, query=query, key=key, cos=cos, sin=sin, layout=layout, rotary_mode=rotary_mode)
    with torch.no_grad():
        for t in (query, key):
            t.copy_(_rotated(t, cos, sin, "half"))
    return query, key


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
