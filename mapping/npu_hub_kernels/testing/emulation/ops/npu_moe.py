"""Emulated torch_npu MoE routing and grouped matmul: the contracts in docs/torch-npu-ops.md, sections
"npu_grouped_matmul" and "npu_moe_token_permute / npu_moe_token_unpermute".

- `npu_moe_token_permute`: tokens gathered in stable expert order; `sorted_indices` is the INVERSE
  permutation (int32): `permuted[sorted_indices[i]] == tokens[i // K]`. Backward for tokens: each token's
  K gradient rows summed in float32, one cast. It keeps `sorted_indices` for backward, as the op does.
- `npu_moe_token_unpermute`: `out[t] = sum_k probs[t, k] * permuted[sorted_indices[t*K + k]]`, float32
  inside, one cast to the tokens' dtype. Backward for permuted_tokens (in their dtype) and probs (in
  theirs). It keeps for backward what the op keeps: sorted_indices, probs, and permuted_tokens only with
  probs (or on CANN before 9.1), never a float32 copy.
- `npu_grouped_matmul`: `y_g = x_g @ w_g` per group, group sizes from `group_list` (cumsum or counts),
  rows split (group_type 0) or the K axis split (group_type 2, for weight gradients). Float32
  accumulation, output in x's dtype. No autograd, as on the device (no derivative there: torch_npu's
  fallback lets no gradient through); here the outputs are simply detached.
"""

from __future__ import annotations

import torch

from ..checks import require_npu

__all__ = ["npu_grouped_matmul", "npu_moe_token_permute", "npu_moe_token_unpermute"]

_MAX_GROUPS = 1024
_MAX_INNER = 65536


def npu_moe_token_permute(
    tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: int | None = None, padded_mode: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    require_npu("npu_moe_token_permute", tokens=tokens, indices=indices)
    if padded_mode or num_out_tokens not in (None, 0):
        raise NotImplementedError("npu_moe_token_permute: padded_mode and num_out_tokens are not emulated")
    if indices.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"npu_moe_token_permute: indices must be int32 or int64, got {indices.dtype}")
    top_k = indices.shape[1] if indices.dim() == 2 else 1
    if top_k > 512:
        raise RuntimeError(f"npu_moe_token_permute: top-k {top_k} above 512")
    return _Permute.apply(tokens, indices, top_k)


class _Permute(torch.autograd.Function):
    """npu_moe_token_permute with the op's autograd (op-plugin derivatives.yaml: `npu_moe_token_permute_grad_v2`
    from `sorted_indices` and the tokens' row count and dtype; the tokens themselves are not kept)."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, indices: torch.Tensor, top_k: int):
        order = indices.flatten().argsort(stable=True)
        permuted = tokens[order // top_k]
        sorted_indices = order.argsort().to(torch.int32)
        ctx.save_for_backward(sorted_indices)
        ctx.top_k, ctx.tokens_dtype = top_k, tokens.dtype
        ctx.mark_non_differentiable(sorted_indices)
        return permuted, sorted_indices

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_permuted: torch.Tensor, _grad_sorted_indices):
        (sorted_indices,) = ctx.saved_tensors
        copies = grad_permuted[sorted_indices.long()].float().unflatten(0, (-1, ctx.top_k))  # [T, K, H]
        return copies.sum(dim=1).to(ctx.tokens_dtype), None, None


def npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: torch.Size | None = None,
) -> torch.Tensor:
    tensors = {"permuted_tokens": permuted_tokens, "sorted_indices": sorted_indices}
    require_npu("npu_moe_token_unpermute", **tensors, **({"probs": probs} if probs is not None else {}))
    if padded_mode:
        raise NotImplementedError("npu_moe_token_unpermute: padded_mode is not emulated")
    if sorted_indices.dtype != torch.int32:
        raise RuntimeError(f"npu_moe_token_unpermute: sorted_indices must be int32, got {sorted_indices.dtype}")
    return _Unpermute.apply(permuted_tokens, sorted_indices, probs)


class _Unpermute(torch.autograd.Function):
    """npu_moe_token_unpermute with the op's autograd (op-plugin derivatives.yaml, `_npu_moe_token_unpermute`:
    `npu_moe_token_unpermute_grad_v2` from sorted_indices, probs, the row count and dtype of permuted_tokens, and
    permuted_tokens themselves only when the adapter keeps them: with probs, or on CANN before 9.1)."""

    @staticmethod
    def forward(ctx, permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor | None):
        keeps_tokens = probs is not None or _cann_version() < (9, 1)
        ctx.save_for_backward(sorted_indices, probs, permuted_tokens if keeps_tokens else None)
        ctx.rows, ctx.tokens_dtype = permuted_tokens.shape[0], permuted_tokens.dtype
        gathered = _gathered(permuted_tokens, sorted_indices, probs)
        if probs is not None:
            gathered = gathered * probs.float().unsqueeze(-1)
        return gathered.sum(dim=1).to(permuted_tokens.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        sorted_indices, probs, permuted_tokens = ctx.saved_tensors
        grad32 = grad.float().unsqueeze(1)  # [T, 1, H]
        grad_tokens = grad_probs = None
        if ctx.needs_input_grad[0]:
            rows = grad32 * probs.float().unsqueeze(-1) if probs is not None else grad32  # [T, K, H]
            grad_tokens = grad.new_zeros(ctx.rows, grad.shape[-1], dtype=ctx.tokens_dtype)
            grad_tokens[sorted_indices.long()] = rows.flatten(0, 1).to(ctx.tokens_dtype)
        if probs is not None and ctx.needs_input_grad[2]:
            grad_probs = (_gathered(permuted_tokens, sorted_indices, probs) * grad32).sum(dim=-1).to(probs.dtype)
        return grad_tokens, None, grad_probs


def _gathered(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """Each token's K rows of permuted_tokens, in float32: [T, K, H]."""
    top_k = probs.shape[1] if probs is not None else 1
    return permuted_tokens[sorted_indices.long()].float().unflatten(0, (-1, top_k))


def _cann_version() -> tuple[int, int]:
    """(major, minor) of the CANN the emulated host reports ("9.1.0", "8.3.RC1")."""
    major, minor = torch.version.cann.split(".")[:2]  # type: ignore[attr-defined]
    return int(major), int(minor)


def npu_grouped_matmul(
    x: list[torch.Tensor],
    weight: list[torch.Tensor],
    *,
    bias=None,
    group_list: torch.Tensor | None = None,
    split_item: int = 0,
    group_type: int | None = None,
    group_list_type: int = 0,
    act_type: int = 0,
    output_dtype: torch.dtype | None = None,
    tuning_config: list[int] | None = None,
    **quantisation,
) -> list[torch.Tensor]:
    """The single-tensor forms the cards use: group_type 0 (x [M, K] rows split, weight [E, K, N] -> y [M, N])
    and group_type 2 (x [K, M] with M split, weight [M, N] -> y [E, K, N]). `tuning_config` is a performance hint
    of the device; other forms (lists, bias, activation, quantisation, group_type -1) raise NotImplementedError."""
    if group_type is None:  # the adapter's first checks, with its messages
        raise RuntimeError("npu_grouped_matmul: Requires manual passing group_type, current is None.")
    if group_type not in (-1, 0, 2):
        raise RuntimeError(f"npu_grouped_matmul: The group type must be -1, 0 or 2, but now is [{group_type}]")
    if len(x) != 1 or len(weight) != 1 or bias is not None or act_type != 0:
        raise NotImplementedError("npu_grouped_matmul: only one x and one weight, no bias/activation, are emulated")
    if any(value is not None for value in quantisation.values()) or group_list_type not in (0, 1):
        given = sorted(name for name, value in quantisation.items() if value is not None)
        raise NotImplementedError(
            f"npu_grouped_matmul: quantised forms are not emulated (no card uses them): got {given}, "
            f"group_list_type {group_list_type} (0: cumsum and 1: counts are)"
        )
    (a_npu,), (w_npu,) = x, weight
    require_npu("npu_grouped_matmul", x=a_npu, weight=w_npu, group_list=group_list)
    a, w = a_npu.detach().cpu(), w_npu.detach().cpu()  # the device computes on its own memory
    if group_list is None or group_list.dtype != torch.int64:
        raise RuntimeError("npu_grouped_matmul: group_list must be an int64 tensor")
    groups = group_list.numel()
    if groups > _MAX_GROUPS:
        raise RuntimeError(f"npu_grouped_matmul: at most {_MAX_GROUPS} groups, got {groups}")
    if max(a.shape[-1], w.shape[-1]) >= _MAX_INNER:
        raise RuntimeError(f"npu_grouped_matmul: inner dims must be < {_MAX_INNER}")
    group_list = group_list.cpu()
    sizes = (group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))).tolist()
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    with torch.no_grad():  # no autograd on the device op
        if group_type == 0:
            if w.dim() != 3 or w.shape[0] != groups or bounds[-1] != a.shape[0]:
                raise RuntimeError(
                    f"npu_grouped_matmul: group_type 0 takes x [M, K] and weight [E, K, N] with E groups summing "
                    f"to M; got x {tuple(a.shape)}, weight {tuple(w.shape)}, group sizes {sizes}"
                )
            out = torch.empty(a.shape[0], w.shape[2], dtype=torch.float32)
            for g in range(groups):
                out[bounds[g] : bounds[g + 1]] = a[bounds[g] : bounds[g + 1]].float() @ w[g].float()
        elif group_type == 2:
            if w.dim() != 2 or bounds[-1] != a.shape[1] or a.shape[1] != w.shape[0]:
                raise RuntimeError(
                    f"npu_grouped_matmul: group_type 2 takes x [K, M] and weight [M, N] with groups summing to M; "
                    f"got x {tuple(a.shape)}, weight {tuple(w.shape)}, group sizes {sizes}"
                )
            out = torch.stack(
                [a[:, bounds[g] : bounds[g + 1]].float() @ w[bounds[g] : bounds[g + 1]].float() for g in range(groups)]
            )
        else:
            raise NotImplementedError("npu_grouped_matmul: group_type -1 (no split) is not emulated: no card uses it")
    out = out.to(output_dtype or a.dtype).to(a_npu.device)
    if split_item in (2, 3):
        return [out]
    return list(out.split(sizes)) if group_type == 0 else list(out.unbind(0))
