"""Ledger cases of npu_rotary_mul, its backward and npu_apply_rotary_pos_emb, and the npu-rope card's limits."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch_npu

from . import npu
from . import reporting_cann as _cann

rotary_mul = torch_npu.npu_rotary_mul
apply_rotary = torch_npu.npu_apply_rotary_pos_emb

OLD_CANN = "8.5.0"
"""A CANN before 9.0: no TND npu_rotary_mul, and npu_apply_rotary_pos_emb with D = 128 and BSND only."""


def _mul(x_shape, r_shape, mode="half", *, dtype=torch.float32, r2_shape=None, cann=None, grad=False, **kwargs):
    """npu_rotary_mul of random x and r1/r2 of these shapes (r2 of `r2_shape` when given)."""

    def call():
        x = npu(*x_shape, dtype=dtype, grad=grad)
        r1, r2 = npu(*r_shape), npu(*(r2_shape or r_shape))
        with _cann(cann):
            return rotary_mul(x, r1, r2, mode, **kwargs)

    return call


def _trained(x_shape, r_shape, mode="half", *, r1_grad=True, forward_cann=None, backward_cann=None):
    """npu_rotary_mul's forward, then backward through it (what derivatives.yaml hands npu_rotary_mul_backward)."""

    def call():
        x = npu(*x_shape, grad=True)
        r1, r2 = npu(*r_shape, grad=r1_grad), npu(*r_shape)
        with _cann(forward_cann):
            out = rotary_mul(x, r1, r2, mode)
        with _cann(backward_cann):
            out.sum().backward()

    return call


def _apply(q_heads=8, k_heads=2, d=64, *, dtype=torch.float32, layout="BSND", cann=None, grad=False, **change):
    """npu_apply_rotary_pos_emb of q [2, 5, q_heads, d], k [2, 5, k_heads, d], cos/sin [2, 5, 1, d] (TND: without
    the batch), each replaced by `change` when given."""

    def call():
        lead = (2, 5) if layout == "BSND" else (10,)
        tensors = {
            "query": npu(*lead, q_heads, d, dtype=dtype, grad=grad),
            "key": npu(*lead, k_heads, d, dtype=dtype),
            "cos": npu(*lead, 1, d, dtype=dtype),
            "sin": npu(*lead, 1, d, dtype=dtype),
        } | change
        with _cann(cann):
            return apply_rotary(**tensors, layout=layout)

    return call


def _apply_mode(mode):
    def call():
        q, k, cos = npu(2, 5, 8, 64), npu(2, 5, 2, 64), npu(2, 5, 1, 64)
        return apply_rotary(q, k, cos, cos, layout="BSND", rotary_mode=mode)

    return call


X, R = (2, 5, 4, 8), (1, 5, 1, 8)
"""BSND x and its 1S1D r1/r2."""
TND = (10, 8, 64), (10, 2, 64), (10, 1, 64)
"""q, k and cos/sin shapes of TND npu_apply_rotary_pos_emb."""
CASES = {
    "npu_rotary_mul/rotary-mode": (_mul(X, R, "interleave"), _mul(X, R, "quarter")),
    "npu_rotary_mul/dtype": (_mul(X, R, dtype=torch.bfloat16), _mul(X, R, dtype=torch.float64)),
    "npu_rotary_mul/rank": (_mul((4, 2, 8), (4, 1, 8)), _mul((5, 8), (5, 8))),
    "npu_rotary_mul/tnd-cann": (_mul((4, 2, 8), (4, 1, 8), cann="9.0.0"), _mul((4, 2, 8), (4, 1, 8), cann=OLD_CANN)),
    "npu_rotary_mul/same-shape": (_mul(X, R), _mul(X, R, r2_shape=(2, 5, 1, 8))),
    "npu_rotary_mul/head-dim": (_mul((1, 2, 3, 894), (1, 1, 3, 894)), _mul((1, 2, 3, 896), (1, 1, 3, 896))),
    "npu_rotary_mul/half-forms": (_mul(X, (2, 5, 1, 8)), _mul(X, (1, 5, 4, 8))),
    "npu_rotary_mul/interleave-forms": (
        _mul((2, 4, 3, 8), (1, 1, 3, 8), "interleave"), _mul((2, 4, 3, 8), (2, 1, 3, 8), "interleave"),
    ),
    # [1000, 4, 2, 8] with r1 [1000, 4, 1, 8] is BSND with B = 1000 and SBND with B = 4: taken as SBND
    "npu_rotary_mul/half-limits": (_mul((1000, 4, 2, 8), (1000, 4, 1, 8)), _mul((1000, 2, 3, 8), (1, 1, 3, 8))),
    "npu_rotary_mul/interleave-limits": (
        _mul((10, 99, 3, 8), (1, 1, 3, 8), "interleave"), _mul((10, 100, 3, 8), (1, 1, 3, 8), "interleave"),
    ),
    "npu_rotary_mul/rotate": (_mul(X, R), _mul(X, R, rotate=npu(8, 8, 1))),
    "npu_rotary_mul/rotate-no-grad": (_mul(X, R, grad=True), _mul(X, R, grad=True, rotate=npu(8, 8))),
    "npu_rotary_mul_backward/rank": (
        _trained((4, 2, 8), (4, 1, 8)), _trained((4, 2, 8), (4, 1, 8), backward_cann=OLD_CANN),
    ),
    "npu_rotary_mul_backward/grad-limits": (
        _trained((2, 3, 512, 8), (1, 3, 1, 8)), _trained((2, 3, 513, 8), (1, 3, 1, 8)),
    ),
    "npu_apply_rotary_pos_emb/layout": (_apply(layout="TND"), _apply(layout="BNSD")),
    "npu_apply_rotary_pos_emb/rotary-mode": (_apply_mode("half"), _apply_mode("interleave")),
    "npu_apply_rotary_pos_emb/no-autograd": (_apply(), _apply(grad=True)),
    "npu_apply_rotary_pos_emb/tnd-cann": (_apply(layout="TND"), _apply(layout="TND", cann=OLD_CANN)),
    "npu_apply_rotary_pos_emb/rank": (
        _apply(), _apply(query=npu(*TND[0]), key=npu(*TND[1]), cos=npu(*TND[2]), sin=npu(*TND[2])),
    ),
    "npu_apply_rotary_pos_emb/non-empty": (_apply(), _apply(query=npu(2, 5, 0, 64))),
    "npu_apply_rotary_pos_emb/dtype": (_apply(dtype=torch.bfloat16), _apply(dtype=torch.float64)),
    "npu_apply_rotary_pos_emb/same-dtype": (_apply(), _apply(cos=npu(2, 5, 1, 64, dtype=torch.float16))),
    "npu_apply_rotary_pos_emb/head-dim": (_apply(d=128), _apply(d=80)),
    "npu_apply_rotary_pos_emb/head-dim-cann": (_apply(d=128, cann=OLD_CANN), _apply(d=64, cann=OLD_CANN)),
    "npu_apply_rotary_pos_emb/same-head-dim": (_apply(), _apply(d=128, cos=npu(2, 5, 1, 64), sin=npu(2, 5, 1, 64))),
    "npu_apply_rotary_pos_emb/leading-dims": (_apply(), _apply(cos=npu(1, 5, 1, 64))),
    "npu_apply_rotary_pos_emb/cos-heads": (_apply(), _apply(sin=npu(2, 5, 2, 64))),
    # 76 q and k heads in all fill the 192 KiB of on-chip memory in float32 and bfloat16 exactly; 152 in float16
    "npu_apply_rotary_pos_emb/ub": (_apply(64, 12, dtype=torch.bfloat16), _apply(64, 13, dtype=torch.float32)),
}  # fmt: skip


def _rope(
    batch: int,
    heads: int,
    seq: int,
    head_dim: int,
    *,
    style: str = "llama",
    cos_batch: int | None = None,
    kv_heads: int | None = None,
    dtype: torch.dtype = torch.float32,
    grad: str = "",
    sin_batch: int | None = None,
    inference: bool = False,
    cann: str | None = None,
):
    """A LIMITS case: the card's rotation of q [B, H, S, D] (BSND memory in inference, where the in-place op may
    run), k with `kv_heads`, cos/sin [B or cos_batch, S, D]; `grad` names the tensors that require grad ("qkcs":
    q, k, cos, sin), and the run goes through backward then."""

    def make(card):
        mode = torch.inference_mode() if inference else nullcontext()
        with mode:
            if inference:  # the projections' layout: [B, H, S, D] transposes of BSND memory
                q = npu(batch, seq, heads, head_dim, dtype=dtype).transpose(1, 2)
                k = npu(batch, seq, kv_heads or heads, head_dim, dtype=dtype).transpose(1, 2)
            else:
                q = npu(batch, heads, seq, head_dim, dtype=dtype)
                k = npu(batch, kv_heads or heads, seq, head_dim, dtype=dtype)
            cos = npu(cos_batch or batch, seq, head_dim, dtype=dtype)
            sin = npu(sin_batch or cos_batch or batch, seq, head_dim, dtype=dtype)
        tensors = [t.requires_grad_() if name in grad else t for name, t in zip("qkcs", (q, k, cos, sin), strict=True)]

        def run():
            with mode, _cann(cann):
                out = card.apply_rotary_pos_emb(*tensors, 1, style)
                if grad:
                    sum(t.sum() for t in out).backward()

        def reason():
            with mode, _cann(cann):
                return card.apply_rotary_pos_emb_unavailable_reason(*tensors, 1, style)

        return run, reason

    return make


def _three_dim(card):
    """q/k [B, S, D] with cos/sin [B, S, D] unsqueezed at 0: transformers' math broadcasts them to 4-D; the card
    sends npu_rotary_mul no 3-D x (the op's TND layout), which runs eager."""
    q, k, cos, sin = npu(2, 5, 64), npu(2, 5, 64), npu(2, 5, 64), npu(2, 5, 64)
    return (
        lambda: card.apply_rotary_pos_emb(q, k, cos, sin, 0),
        lambda: card.apply_rotary_pos_emb_unavailable_reason(q, k, cos, sin, 0),
    )


LIMITS = {
    "head dim 894 (even, below 896)": _rope(1, 2, 3, 894),
    "head dim 896": _rope(1, 2, 3, 896),
    "batch 999, cos shared by the batch (B of BNSD and BSND)": _rope(999, 1, 1, 8, cos_batch=1),
    "batch 1000, cos shared by the batch": _rope(1000, 1, 1, 8, cos_batch=1),
    "heads 999": _rope(1, 999, 1, 8),
    "heads 1000": _rope(1, 1000, 1, 8),
    "interleave: batch x heads 999": _rope(1, 999, 1, 8, style="pairs", cos_batch=1),
    "interleave: batch x heads 1000": _rope(1, 1000, 1, 8, style="pairs", cos_batch=1),
    "interleave: cos without a batch dim": _rope(2, 4, 3, 8, style="pairs", cos_batch=1),
    "interleave: per-batch cos": _rope(2, 4, 3, 8, style="pairs"),
    "cos/sin requiring grad, batch x heads 1024 (the backward's limit)": _rope(2, 512, 1, 8, cos_batch=1, grad="qkcs"),
    "cos/sin requiring grad, batch x heads 1025": _rope(5, 205, 1, 8, cos_batch=1, grad="qkcs"),
    "sin alone requiring grad, batch x heads 1024": _rope(2, 512, 1, 8, cos_batch=1, grad="s"),
    "sin alone requiring grad, batch x heads 1025": _rope(5, 205, 1, 8, cos_batch=1, grad="s"),
    "q alone requiring grad, batch x heads 1025 (no limit then)": _rope(5, 205, 1, 8, cos_batch=1, grad="q"),
    "sin shaped as cos": _rope(2, 4, 3, 8, cos_batch=1, sin_batch=1),
    "sin shaped unlike cos": _rope(2, 4, 3, 8, cos_batch=1, sin_batch=2),
    "3-D q/k (TND is not sent)": _three_dim,
    # npu_apply_rotary_pos_emb in inference; where it is not used, npu_rotary_mul runs (the reason is None either
    # way: tests/test_npu_rope.py checks the in-place reasons)
    "in place, head dim 64 on CANN 9.1": _rope(2, 8, 5, 64, kv_heads=2, inference=True),
    "in place, head dim 64 on CANN 8.5 (128 only)": _rope(2, 8, 5, 64, kv_heads=2, inference=True, cann=OLD_CANN),
    "in place, head dim 128 on CANN 8.5": _rope(2, 8, 5, 128, kv_heads=2, inference=True, cann=OLD_CANN),
    "in place, 76 float32 heads (the on-chip memory's limit)": _rope(1, 64, 2, 128, kv_heads=12, inference=True),
    "in place, 77 float32 heads": _rope(1, 64, 2, 128, kv_heads=13, inference=True),
    "in place, 152 float16 heads": _rope(1, 128, 2, 128, kv_heads=24, inference=True, dtype=torch.float16),
    "in place, 153 float16 heads": _rope(1, 128, 2, 128, kv_heads=25, inference=True, dtype=torch.float16),
}  # fmt: skip
