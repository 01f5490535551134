"""Rotary position embedding on torch_npu's rotary ops, with the eager math wherever the ops do not apply.

transformers writes its rotary function in a dozen ways. Each is a `RotaryStyle` in `STYLES`; all
reduce to `x * cos + rotation(x) * sin` over the leading `cos.shape[-1]` dims of x, which is exactly
what `npu_rotary_mul` computes ('half' or 'interleave' rotation), once cos/sin are laid out as the
op wants them.

No copies of q/k: transformers' q/k are `[B, H, S, D]` transposes of `[B, S, H, D]` projections, and
npu_rotary_mul takes BSND as well as BNSD, so the op runs on the layout the memory already has (with
cos/sin as `[B or 1, S, 1, D]`) and its output is handed back through the same transpose. In
inference mode, Llama-style full rotation of BSND q/k with head dim 64 or 128 runs as one
`npu_apply_rotary_pos_emb` call, which rotates q and k in place (no backward, so never in training).
The contracts relied on are in the project's docs/torch-npu-ops.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Literal

import torch
from torch import nn

from ._double_backward import with_eager_double_backward
from ._fallbacks import ran_eager
from ._internals import storage_holders
from ._npu import FUSED_DTYPES, npu_unavailable_reason, torch_npu

Rotation = Literal["half", "interleave"]
"""npu_rotary_mul's rotary_mode: 'half' pairs x[i] with x[i + D/2], 'interleave' pairs x[2i] with x[2i + 1]."""


@dataclass(frozen=True)
class RotaryStyle:
    """One way transformers writes apply_rotary_pos_emb.

    rotation: which elements are paired ('half': transformers' rotate_half; 'interleave': GPT-J pairs).
    angles: how the cos/sin transformers passes become the per-element cos/sin the op takes:
        "as_is"; "doubled" (they cover half the dims: cat(cos, cos)); "first_half_doubled" (use the
        first half, doubled); "first_half_interleaved" (the first half, each value repeated twice);
        "interleaved" (each value repeated twice).
    compute: "input" (the q/k dtype), "float32" (upcast, cast back once) or "cast_back" (the
        promoted q/cos dtype, cast back to q's dtype).
    deinterleave: rotate (x[0::2], x[1::2]) as two halves and return them in that order (DeepSeek).
    partial: cos/sin narrower than q/k rotate the leading dims and pass the rest through (Phi3's
        function); otherwise, as in Llama's, the whole of q/k meets cos/sin, and shapes that do not
        broadcast fail exactly as they fail there.
    """

    rotation: Rotation = "half"
    angles: Literal["as_is", "doubled", "first_half_doubled", "first_half_interleaved", "interleaved"] = "as_is"
    compute: Literal["input", "float32", "cast_back"] = "input"
    deinterleave: bool = False
    partial: bool = False


STYLES: dict[str, RotaryStyle] = {
    "llama": RotaryStyle(),  # q * cos + rotate_half(q) * sin (LlamaModel and most others)
    "llama_partial": RotaryStyle(partial=True),  # the same; narrower cos/sin rotate the leading dims (Phi3)
    "cast_back": RotaryStyle(compute="cast_back"),  # then .to(q.dtype) (the Olmo family)
    "float32": RotaryStyle(compute="float32"),  # q.float() inside (ESM, ModernBERT, ...)
    "half_angles": RotaryStyle(angles="doubled"),  # first * cos - second * sin, ... (GPT-OSS)
    "pairs": RotaryStyle(rotation="interleave"),  # rotate_half on (x[0::2], x[1::2]) pairs (BLT)
    "pairs_partial": RotaryStyle(rotation="interleave", partial=True),  # (Glm4v)
    "pairs_float32": RotaryStyle(rotation="interleave", compute="float32"),  # (Cohere)
    "pairs_half_angles": RotaryStyle(rotation="interleave", angles="interleaved"),  # (OpenAI privacy filter)
    "glm": RotaryStyle(rotation="interleave", angles="first_half_interleaved"),  # (Helium)
    "glm_partial": RotaryStyle(rotation="interleave", angles="first_half_interleaved", partial=True),  # (GLM, Glm4)
    "glm_float32": RotaryStyle(rotation="interleave", angles="first_half_interleaved", compute="float32"),  # (Ernie)
    "deinterleave": RotaryStyle(angles="first_half_doubled", deinterleave=True),  # (DeepSeek-V3 `_interleave`)
}
Style = str
"""A key of STYLES."""


def _rotary_mul_unavailable_reason(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotation: Rotation = "half", on_npu: bool = False
) -> str | None:
    """Why `npu_rotary_mul` will not rotate 4-D x by cos/sin, or None.

    `on_npu`: x, cos and sin derive from tensors `npu_unavailable_reason` passed (views of them and ops on them give
    npu tensors, no DTensor), so that check, which they pass too, is not made again.
    """
    if not on_npu:
        reason = npu_unavailable_reason(x, cos, sin)
        if reason is not None:
            return reason
    dtype = x.dtype
    if dtype not in FUSED_DTYPES:
        return f"dtype {dtype} is not supported by npu_rotary_mul (float16, bfloat16, float32)"
    if cos.dtype != dtype or sin.dtype != dtype:
        return f"cos/sin dtype {cos.dtype}/{sin.dtype} differs from {dtype}: eager promotes the output dtype"
    if x.dim() != 4 or cos.dim() != 4:
        return f"npu_rotary_mul takes 4-D q/k and cos/sin here, got {x.dim()}-D and {cos.dim()}-D"
    cos_shape = cos.shape
    if sin.shape != cos_shape:
        return f"sin {tuple(sin.shape)} and cos {tuple(cos_shape)} differ in shape (npu_rotary_mul takes one shape)"
    if x.numel() == 0:
        return "empty input"
    needs_grad = torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)
    return _shapes_reason(x.shape, cos_shape, _swapped(x), rotation, needs_grad)


@lru_cache(maxsize=1024)
def _shapes_reason(
    x_shape: tuple[int, ...], cos_shape: tuple[int, ...], swapped: bool, rotation: Rotation, needs_grad: bool
) -> str | None:
    """The rest of `_rotary_mul_unavailable_reason` for non-empty 4-D x and cos/sin of these shapes.

    The op is given x's BNSD <-> BSND transpose when `swapped` (`_operands`), cos/sin need gradients when `needs_grad`.
    A function of its arguments alone, so cached (a decode step asks the same question every layer).
    """
    head_dim = x_shape[3]
    if head_dim % 2 or head_dim >= 896:
        return f"rotated dim {head_dim} must be even and below 896"
    if swapped:
        layouts = _layouts(_transposed(x_shape), _transposed(cos_shape), rotation)
    else:
        layouts = _layouts(x_shape, cos_shape, rotation)
    if not layouts:
        # cos fitting a layout broadcasts to x: each of its sizes is x's or 1; so only a cos that fits none may not
        if any(c != n and c != 1 for c, n in zip(cos_shape, x_shape, strict=True)):  # (x: no size 0)
            return f"cos {tuple(cos_shape)} does not broadcast to {tuple(x_shape)}"
        return (
            f"cos {tuple(cos_shape)} is not a form npu_rotary_mul takes for x {tuple(x_shape)} in {rotation!r} mode "
            "(cos keeps the sequence and last axes, the batch axis too or all four; interleave mode takes cos/sin "
            "without a batch dim)"
        )
    reasons = [_limits_reason(batch, heads, rotation, needs_grad) for batch, heads in layouts]
    return None if None in reasons else reasons[0]


def _transposed(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """A 4-D shape with axes 1 and 2 swapped (that of `.transpose(1, 2)`)."""
    return shape[0], shape[2], shape[1], shape[3]


_LAYOUT_AXES = ((0, 1, 2), (0, 2, 1), (1, 2, 0))
"""(batch, heads, sequence) axes of the layouts npu_rotary_mul reads 4-D x as: BNSD, BSND, SBND (D is axis 3)."""


def _layouts(x_shape: tuple[int, ...], cos_shape: tuple[int, ...], rotation: Rotation) -> list[tuple[int, int]]:
    """The (batch, heads) sizes of each layout (BNSD, BSND, SBND) npu_rotary_mul can read 4-D x and cos as.

    It can when cos keeps the sequence and last axes, the batch axis too, or all four, and is 1 on the others
    ('interleave' takes the first form only). A shape can fit several: x [2048, 4, 32, 64] with cos [2048, 4, 1, 64]
    is BSND and SBND.
    """
    found = []
    for batch_axis, heads_axis, seq_axis in _LAYOUT_AXES:
        if cos_shape[seq_axis] != x_shape[seq_axis] or cos_shape[3] != x_shape[3]:
            continue
        batch, heads = x_shape[batch_axis], x_shape[heads_axis]
        cos_batch, cos_heads = cos_shape[batch_axis], cos_shape[heads_axis]
        # the sequence and last axes only; or the batch axis too; or all four ('half' mode takes all three forms)
        if (cos_batch == 1 and cos_heads == 1) or (
            rotation != "interleave" and cos_batch == batch and cos_heads in (1, heads)
        ):
            found.append((batch, heads))
    return found


def _limits_reason(batch: int, heads: int, rotation: Rotation, needs_grad: bool) -> str | None:
    """Why npu_rotary_mul refuses x read with these batch and heads sizes, or None.

    When cos/sin need gradients, the refusal may be its backward's (npu_rotary_mul_backward).
    """
    if rotation == "interleave" and batch * heads >= 1000:
        return f"batch x heads = {batch * heads} must be below 1000 in interleave mode"
    if rotation == "half" and (batch >= 1000 or heads >= 1000):
        return f"batch {batch} and heads {heads} must both be below 1000"
    if needs_grad and batch * heads > 1024:
        return f"batch x heads = {batch * heads} above 1024 with cos/sin requiring gradients (npu_rotary_mul_backward)"
    return None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: (x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """The GPT-J rotation: each pair (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _rotate_eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """`x * cos + rotation(x) * sin` in eager's ops."""
    return (x * cos) + ((rotate_half(x) if rotation == "half" else rotate_pairs(x)) * sin)


def _rotary_mul(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """npu_rotary_mul on the layout x's memory has (see `_operands`).

    Its backward, npu_rotary_mul_backward, has no derivative: where autograd records a backward (gradient penalties,
    Hessian-vector products) the gradient is eager's math on the operands the op keeps (no other tensor is kept),
    so second-order gradients are eager's; a plain backward is the op's."""
    x_op, cos_op, sin_op, swapped = _operands(x, cos, sin)
    out = torch_npu.npu_rotary_mul(x_op, cos_op, sin_op, rotary_mode=rotation)
    if torch.is_grad_enabled():  # else autograd records nothing, and with_eager_double_backward returns out as it is
        out = with_eager_double_backward(out, partial(_rotate_eager, rotation=rotation), x_op, cos_op, sin_op)
    return out.transpose(1, 2) if swapped else out


def _operands(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """What npu_rotary_mul is given, contiguous: (x, cos, sin, whether x is transposed).

    x itself when contiguous, else its BNSD <-> BSND transpose when that is contiguous (True: the output goes back
    through the same transpose; cos/sin follow, their size-1 axes copy nothing), else a contiguous copy of x; cos/sin
    made contiguous.
    """
    if x.is_contiguous():
        return x, cos.contiguous(), sin.contiguous(), False
    if _transpose_contiguous(x):
        x_op, cos_op, sin_op = x.transpose(1, 2), cos.transpose(1, 2), sin.transpose(1, 2)
        return x_op, cos_op.contiguous(), sin_op.contiguous(), True
    return x.contiguous(), cos.contiguous(), sin.contiguous(), False


def _swapped(x: torch.Tensor) -> bool:
    """Whether npu_rotary_mul is given 4-D x's BNSD <-> BSND transpose: x is not contiguous and its transpose is."""
    return not x.is_contiguous() and _transpose_contiguous(x)


def _transpose_contiguous(x: torch.Tensor) -> bool:
    """Whether `x.transpose(1, 2)` (x 4-D) is contiguous as torch judges it, without making the view.

    Contiguous means no elements, or, sizes of 1 aside, each stride the product of the sizes after it; this is read
    from x's sizes and strides.
    """
    sizes, strides = x.shape, x.stride()
    if 0 in sizes:
        return True
    expected = 1
    for axis in (3, 1, 2, 0):  # the transpose's axes, last first
        size = sizes[axis]
        if size != 1:
            if strides[axis] != expected:
                return False
            expected *= size
    return True


def _cann_version() -> tuple[int, int] | None:
    """(major, minor) of the CANN torch_npu reports as `torch.version.cann` ("9.1.0", "8.3.RC1"), or None."""
    try:
        major, minor = _cann_text().split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def _cann_text() -> str:
    return str(getattr(torch.version, "cann", None))


_IN_PLACE_HEAD_DIMS = (64, 128)
"""The head dims npu_apply_rotary_pos_emb rotates (all of them)."""

_UB_BYTES = 192 * 1024
"""The on-chip unified buffer of an Atlas A2/A3 AI core, which npu_apply_rotary_pos_emb's q and k heads must fit."""


def _in_place_ub_bytes(heads: int, q: torch.Tensor) -> int:
    """The on-chip memory npu_apply_rotary_pos_emb needs for q's and k's `heads` in all, in q's dtype.

    This is aclnnApplyRotaryPosEmbV2's `ub_required`, with its head dim of 128 whatever the head dim.
    """
    cast = int(q.dtype == torch.bfloat16)
    dtype_size = q.element_size()
    cast_size = 4 if cast else dtype_size
    return heads * 128 * cast_size * 5 + 128 * dtype_size * 4 + cast * 128 * 4 * 2


def _in_place_unavailable_reason(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int,
    style: Style,
    devices_reason: str | None,
) -> str | None:
    """Why q and k are not rotated by one in-place `npu_apply_rotary_pos_emb` call, or None when they are.

    cos/sin are as transformers passes them, [B or 1, S, D]; `devices_reason` is `npu_unavailable_reason(q, k, cos,
    sin)`, which the caller has.
    """
    if not torch.is_inference_mode_enabled():
        return "not in inference mode (npu_apply_rotary_pos_emb has no backward and writes q/k in place)"
    if style != "llama":
        return f"style {style!r}: npu_apply_rotary_pos_emb computes Llama's 'half' rotation only"
    if devices_reason is not None:
        return devices_reason
    if not hasattr(torch_npu, "npu_apply_rotary_pos_emb"):
        return "this torch_npu has no npu_apply_rotary_pos_emb (torch_npu >= 2.7 has it)"
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or unsqueeze_dim not in (1, 2):
        return "q/k must be 4-D and cos/sin [B, S, D]"
    cos_shape = cos.shape
    if sin.shape != cos_shape:
        return f"sin {tuple(sin.shape)} and cos {tuple(cos_shape)} differ in shape"
    dtype = q.dtype
    if dtype not in FUSED_DTYPES or k.dtype != dtype or cos.dtype != dtype or sin.dtype != dtype:
        return f"q, k and cos/sin must share one of {FUSED_DTYPES}, got {q.dtype}, {k.dtype}, {cos.dtype}, {sin.dtype}"
    q_shape, k_shape = q.shape, k.shape
    head_dim = q_shape[-1]
    if head_dim not in _IN_PLACE_HEAD_DIMS or cos_shape[-1] != head_dim or k_shape[-1] != head_dim:
        return f"head dim {head_dim} (rotary dim {cos_shape[-1]}): the op rotates all of a 64 or 128 head dim"
    cann = _cann_version()
    if head_dim == 64 and (cann is None or cann < (9, 1)):
        return f"head dim 64 needs CANN 9.1 or later in npu_apply_rotary_pos_emb (CANN {_cann_text()})"
    # q/k as the op reads them (BSND), judged from their sizes and strides without making the transposes
    if unsqueeze_dim == 1:
        bsnd = _transpose_contiguous(q) and _transpose_contiguous(k)
        q_shape, k_shape = _transposed(q_shape), _transposed(k_shape)
    else:
        bsnd = q.is_contiguous() and k.is_contiguous()
    if not bsnd:
        return "q/k are not BSND in memory (the op would need a copy)"
    if 0 in q_shape or 0 in k_shape:  # no elements
        return "empty input"
    if cos_shape[:2] != q_shape[:2] or k_shape[:2] != q_shape[:2]:
        return f"cos {tuple(cos_shape)} must give every batch row its own angles (no broadcast over the batch)"
    heads = q_shape[2] + k_shape[2]
    if _in_place_ub_bytes(heads, q) > _UB_BYTES:
        return f"{heads} q and k heads in all do not fit npu_apply_rotary_pos_emb's on-chip memory in {q.dtype}"
    if _share_memory(q, k):  # as their transposes would: a transpose keeps the storage, offset and size
        return "q and k share memory (the in-place op would rotate it twice)"
    shared = q.untyped_storage() is k.untyped_storage()  # side by side in one buffer: each holds it
    if storage_holders(q) > 1 + shared or storage_holders(k) > 1 + shared:
        return (
            "another tensor holds q's or k's memory (a forward hook that kept a projection's output, a fused qkv "
            "buffer): the in-place op would change what it sees"
        )
    return None


def _share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors have bytes in common (the same tensor, or overlapping views of one storage).

    Storages are compared as objects (torch keeps one Python object per storage) and positions by storage offset,
    not by address: shape-only tensors (the bench's fake tensors) all report one address."""
    if a.untyped_storage() is not b.untyped_storage():
        return False
    a_start, b_start = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    a_end, b_end = a_start + a.numel() * a.element_size(), b_start + b.numel() * b.element_size()
    return a_start < b_end and b_start < a_end


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
    style: Style = "llama",
    fused: bool = True,
    *,
    module: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary function in `style`; q/k [B, H, S, D] or [B, S, H, D], cos/sin [B or 1, S, rotary dim].

    Args:
        q, k: the queries and keys, heads on axis `unsqueeze_dim`.
        cos, sin: the angles as transformers passes them.
        unsqueeze_dim: where cos/sin get their heads axis (1: q/k are [B, H, S, D]).
        style: a key of STYLES (which way the function rotates).
        fused: False runs the same math without the NPU ops (the eager path).
        module: the function-module whose layer calls this, for the record of why it ran eager (`_fallbacks`): the
            reason `apply_rotary_pos_emb_unavailable_reason` gives, judged here as the ops are chosen.

    Returns:
        The rotated q and k. In inference mode, where the one-call op applies (see
        `apply_rotary_pos_emb_unavailable_reason(..., in_place=True)`), these are q and k, rotated in place.
    """
    on_npu = False
    if fused:
        devices_reason = npu_unavailable_reason(q, k, cos, sin)
        # q's head dim first (none for a 0-D q): the in-place op takes no other, and is dearer to ask about in full
        head_dim = q.shape[-1:]
        if (
            head_dim
            and head_dim[0] in _IN_PLACE_HEAD_DIMS
            and _in_place_unavailable_reason(q, k, cos, sin, unsqueeze_dim, style, devices_reason) is None
        ):
            ran_eager(module, None)
            q_bsnd, k_bsnd = (t.transpose(1, 2) if unsqueeze_dim == 1 else t for t in (q, k))
            torch_npu.npu_apply_rotary_pos_emb(q_bsnd, k_bsnd, cos.unsqueeze(2), sin.unsqueeze(2), layout="BSND")
            return q, k
        on_npu = devices_reason is None
    rotary_style = STYLES[style]
    try:
        cos, sin = (_angles(t.unsqueeze(unsqueeze_dim), rotary_style) for t in (cos, sin))
        q_out, q_reason = _apply(q, cos, sin, rotary_style, fused, on_npu)
        k_out, k_reason = _apply(k, cos, sin, rotary_style, fused, on_npu)
    except Exception as error:
        if fused:  # the module's last reason is this call's, never the previous call's
            ran_eager(module, f"the call raised {type(error).__name__}: {error}")
        raise
    if fused:
        ran_eager(module, f"q: {q_reason}" if q_reason else f"k: {k_reason}" if k_reason else None)
    return q_out, k_out


def apply_rotary_pos_emb_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
    style: Style = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager math of `style` (what the fused path falls back to)."""
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, style, fused=False)


def apply_rotary_pos_emb_unavailable_reason(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
    style: Style = "llama",
    *,
    in_place: bool = False,
) -> str | None:
    """Why `apply_rotary_pos_emb` runs the eager math for these inputs, or None when a fused op runs.

    With `in_place=True`: why the one-call in-place `npu_apply_rotary_pos_emb` is not used (the
    two-call `npu_rotary_mul` path may still be), or None when it is.
    """
    devices_reason = npu_unavailable_reason(q, k, cos, sin)
    reason = _in_place_unavailable_reason(q, k, cos, sin, unsqueeze_dim, style, devices_reason)
    if in_place or reason is None:
        return reason
    rotary_style = STYLES[style]
    cos, sin = (_angles(t.unsqueeze(unsqueeze_dim), rotary_style) for t in (cos, sin))
    for name, x in (("q", q), ("k", k)):
        x_rot, cos_rot, sin_rot, _ = _prepared(x, cos, sin, rotary_style)
        _, reason = _fused_operand(x_rot, cos_rot, sin_rot, rotary_style.rotation, on_npu=devices_reason is None)
        if reason is not None:
            return f"{name}: {reason}"
    return None


def _angles(t: torch.Tensor, style: RotaryStyle) -> torch.Tensor:
    """The per-element cos or sin the op takes, from `t` as transformers passes it (see `RotaryStyle.angles`)."""
    angles = style.angles
    if angles == "as_is":
        return t
    if angles == "doubled":
        return torch.cat((t, t), dim=-1)
    if angles == "interleaved":
        return t.repeat_interleave(2, dim=-1)
    first_half = t[..., : t.shape[-1] // 2]
    if angles == "first_half_doubled":
        return torch.cat((first_half, first_half), dim=-1)
    return first_half.repeat_interleave(2, dim=-1)  # "first_half_interleaved"


def _prepared(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: RotaryStyle
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype | None]:
    """(the part of x to rotate, in the order and dtype the style rotates it; cos; sin; that dtype or None)."""
    if style.compute == "float32":
        compute = torch.float32
    elif style.compute == "cast_back":
        compute = torch.promote_types(x.dtype, cos.dtype)
    else:
        compute = None
    x_rot = x[..., : cos.shape[-1]] if style.partial else x  # not partial: all of x meets cos/sin
    if style.deinterleave:
        x_rot = torch.cat((x_rot[..., 0::2], x_rot[..., 1::2]), dim=-1)
    if compute is not None:
        x_rot, cos, sin = x_rot.to(compute), cos.to(compute), sin.to(compute)
    return x_rot, cos, sin, compute


def _fused_operand(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotation: Rotation, on_npu: bool
) -> tuple[torch.Tensor, str | None]:
    """(x as npu_rotary_mul is to rotate it, None), or (x, why the op cannot rotate it).

    x narrower than cos and sin (bfloat16 q/k of a linear under autocast, float32 cos/sin) is rotated cast to their
    dtype: eager's `x * cos + rotate(x) * sin` promotes each product to it, and the cast, exact, commutes with the
    rotation, so the op on the cast x computes what eager computes, in eager's output dtype."""
    reason = _rotary_mul_unavailable_reason(x, cos, sin, rotation, on_npu)
    wider = cos.dtype
    if reason is None or x.dtype == wider or sin.dtype != wider or torch.promote_types(x.dtype, wider) != wider:
        return x, reason
    promoted = x.to(wider)
    return (
        (promoted, None)
        if _rotary_mul_unavailable_reason(promoted, cos, sin, rotation, on_npu) is None
        else (x, reason)
    )


def _apply(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: RotaryStyle, fused: bool, on_npu: bool
) -> tuple[torch.Tensor, str | None]:
    """Rotate x in `style`, returning (x rotated, why npu_rotary_mul did not rotate it or None).

    The op rotates where it applies and `fused` (`on_npu`: see `_rotary_mul_unavailable_reason`).
    """
    x_rot, cos, sin, compute = _prepared(x, cos, sin, style)
    if fused:
        x_op, reason = _fused_operand(x_rot, cos, sin, style.rotation, on_npu)
    else:
        x_op, reason = x_rot, "fused=False"
    if reason is None:
        rotated = _rotary_mul(x_op, cos, sin, style.rotation)
    else:
        rotated = _rotate_eager(x_rot, cos, sin, style.rotation)
    if compute is not None:
        rotated = rotated.to(x.dtype)
    if not style.partial:  # x_rot has all of x's last dim
        return rotated, reason
    rotary_dim = x_rot.shape[-1]
    return (rotated if rotary_dim == x.shape[-1] else torch.cat((rotated, x[..., rotary_dim:]), dim=-1)), reason
