"""16-bit matmul operands summed into a float32 result (the build copies this file into the cards that list it).

`torch.addmm(self, a, b, out_dtype=torch.float32, out=...)` with float16 or bfloat16 `a` and `b` (aten
`addmm.dtype_out`) runs at the cube's 16-bit rate and sums the products in float32: aclnnAddmm's "16 in, 32 out"
(npu-hub-kernels' docs/torch-npu-ops.md, section "addmm.dtype_out", has the sources). A float32 parameter's gradient
under autocast, or the float32 operand of the next op, comes out of the matmul itself: never rounded to 16 bits, and
no cast after it. It needs a torch_npu that registers the call for the npu (torch_npu 2.11 or later) and CANN 9.1 or
later; `float32_out_unavailable_reason` says which is missing.
"""

from __future__ import annotations

import functools

import torch

from ._internals import device_has_kernel

FLOAT32_OUT_ADDMM = "addmm.dtype_out"  # torch.addmm(..., out_dtype=, out=): torch_npu 2.11 or later registers it
FLOAT32_OUT_CANN = (9, 1)  # the first CANN whose aclnnAddmm takes 16-bit mat1 and mat2 into a float32 out


def float32_out_unavailable_reason() -> str | None:
    """Why this host cannot sum 16-bit matmul operands into a float32 out, or None when it can."""
    return _unavailable_reason(device_has_kernel(FLOAT32_OUT_ADDMM), str(getattr(torch.version, "cann", None)))


@functools.cache
def _unavailable_reason(has_kernel: bool, cann: str) -> str | None:
    """`float32_out_unavailable_reason` for what it read (cached: the cards ask on every call under autocast)."""
    if not has_kernel:
        return "this torch_npu has no torch.addmm with out_dtype (torch_npu 2.11 or later registers it)"
    if not cann_release_at_least(FLOAT32_OUT_CANN, cann):
        return f"CANN {cann}: 16-bit operands into a float32 addmm out need CANN 9.1 or later"
    return None


def cann_release_at_least(version: tuple[int, int], cann: str) -> bool:
    """Whether the CANN version text ("9.1.0", "8.3.RC1", "9.1.0-beta.3") is `version` or later (its betas: earlier)."""
    parts = cann.split(".")
    try:
        found = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return False
    return found > version or (found == version and not any(tag in cann.lower() for tag in ("alpha", "beta")))


def float32_product(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`a @ b (+ bias)` of 16-bit a and b, its products summed in float32 and written once as float32 (into `out`).

    One `torch.addmm(bias or 0, a, b, out_dtype=torch.float32, out=out)`: the bias (in the operands' dtype or float32)
    or a float32 zero row, a 1-D self that aclnnAddmm folds into the matmul as its bias, so no [m, n] buffer is read
    before the write; `out` a float32 [m, n] tensor, or a new one. Where `float32_out_unavailable_reason` is None
    only."""
    base = torch.zeros(b.shape[1], dtype=torch.float32, device=a.device) if bias is None else bias
    if out is None:
        out = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    return torch.addmm(base, a, b, out_dtype=torch.float32, out=out)


def add_float32_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`total += a @ b` in place, for float32 `total` and 16-bit a and b, the products summed in float32.

    aclnnAddmm's in-place GemmV3 form (alpha = beta = 1, out the storage of self). Where
    `float32_out_unavailable_reason` is None only."""
    return torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
