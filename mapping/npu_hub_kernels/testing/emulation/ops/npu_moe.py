"""Emulated torch_npu MoE routing and grouped matmul, as docs/torch-npu-ops.md states them.

The contracts are in docs/torch-npu-ops.md, sections "npu_grouped_matmul" and
"npu_moe_token_permute / npu_moe_token_unpermute".

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

Limits: `LEDGER`, the rules of `_npu_moe_rules.py`. The autograd nodes of permute and unpermute call the backward ops
as op-plugin's derivatives.yaml calls them (`npu_moe_token_permute_grad_v2`, `npu_moe_token_unpermute_grad_v2`,
emulated here under those names), and those check their own rules on what they are handed.
"""

from __future__ import annotations

import torch

from ..backward import device_backward
from ..checks import require_npu
from ..ledger import enforce
from ._npu_moe_rules import (
    GMM_CALL,
    GMM_SINGLE,
    PERMUTE,
    PERMUTE_GRAD,
    QUANTISED_DTYPES,
    UNPERMUTE,
    UNPERMUTE_GRAD,
    cann_version,
    group_sizes,
)
from ._npu_moe_rules import LEDGER as LEDGER  # the card's rules, where `emulation.ledger_of` reads them

__all__ = ["npu_grouped_matmul", "npu_moe_token_permute", "npu_moe_token_unpermute"]


def npu_moe_token_permute(
    tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: int | None = None, padded_mode: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    require_npu("npu_moe_token_permute", tokens=tokens, indices=indices)
    enforce(PERMUTE, tokens=tokens, indices=indices, num_out_tokens=num_out_tokens, padded_mode=padded_mode)
    if num_out_tokens not in (None, 0):
        raise NotImplementedError("npu_moe_token_permute: num_out_tokens other than None or 0 is not emulated")
    top_k = indices.shape[1] if indices.dim() == 2 else 1
    return _Permute.apply(tokens, indices, top_k)


class _Permute(torch.autograd.Function):
    """npu_moe_token_permute with the op's autograd.

    As op-plugin's derivatives.yaml says, the backward is `npu_moe_token_permute_grad_v2` from `sorted_indices` and
    the tokens' row count and dtype; the tokens themselves are not kept.
    """

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, indices: torch.Tensor, top_k: int):
        ctx.set_materialize_grads(False)  # an unused output: no gradient, no backward op run
        order = indices.flatten().argsort(stable=True)
        permuted = tokens[order // top_k]
        sorted_indices = order.argsort().to(torch.int32)
        ctx.save_for_backward(sorted_indices)
        ctx.rows, ctx.top_k, ctx.tokens_dtype = tokens.shape[0], top_k, tokens.dtype
        ctx.mark_non_differentiable(sorted_indices)
        return permuted, sorted_indices

    @staticmethod
    @device_backward("npu_moe_token_permute_grad_v2")
    def backward(ctx, grad_permuted: torch.Tensor, _grad_sorted_indices):
        (sorted_indices,) = ctx.saved_tensors
        # derivatives.yaml:333: npu_moe_token_permute_grad_v2(grad, result1, tokens.sym_size(0), tokens.scalar_type(),
        # K, padded_mode)
        grad = npu_moe_token_permute_grad_v2(grad_permuted, sorted_indices, ctx.rows, ctx.tokens_dtype, ctx.top_k)
        return grad, None, None


def npu_moe_token_permute_grad_v2(
    grad_permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    tokens_size_0: int,
    tokens_dtype: torch.dtype,
    num_topK: int,  # torch_npu's name
    padded_mode: bool = False,
) -> torch.Tensor:
    """The backward op: each token's K gradient rows summed in float32, one cast to the tokens' dtype."""
    enforce(
        PERMUTE_GRAD,
        grad_permuted_tokens=grad_permuted_tokens,
        sorted_indices=sorted_indices,
        tokens_size_0=tokens_size_0,
        tokens_dtype=tokens_dtype,
        num_topK=num_topK,
        padded_mode=padded_mode,
    )
    copies = grad_permuted_tokens[sorted_indices.flatten().long()].float().unflatten(0, (-1, num_topK))  # [T, K, H]
    return copies.sum(dim=1).to(tokens_dtype)


def npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: torch.Size | None = None,
) -> torch.Tensor:
    tensors = {"permuted_tokens": permuted_tokens, "sorted_indices": sorted_indices}
    require_npu("npu_moe_token_unpermute", **tensors, **({"probs": probs} if probs is not None else {}))
    enforce(UNPERMUTE, **tensors, probs=probs, padded_mode=padded_mode, restore_shape=restore_shape)
    return _Unpermute.apply(permuted_tokens, sorted_indices, probs)


class _Unpermute(torch.autograd.Function):
    """npu_moe_token_unpermute with the op's autograd.

    As op-plugin's derivatives.yaml says (`_npu_moe_token_unpermute`), the backward is
    `npu_moe_token_unpermute_grad_v2` from sorted_indices, probs, the row count and dtype of permuted_tokens, and
    permuted_tokens themselves only when the adapter keeps them: with probs, or on CANN before 9.1.
    """

    @staticmethod
    def forward(ctx, permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor | None):
        ctx.set_materialize_grads(False)  # an unused output: no gradient, no backward op run
        keeps_tokens = probs is not None or cann_version() < (9, 1)
        ctx.save_for_backward(sorted_indices, probs, permuted_tokens if keeps_tokens else None)
        ctx.rows, ctx.tokens_dtype = permuted_tokens.shape[0], permuted_tokens.dtype
        gathered = _gathered(permuted_tokens, sorted_indices, probs)
        if probs is not None:
            gathered = gathered * probs.float().unsqueeze(-1)
        return gathered.sum(dim=1).to(permuted_tokens.dtype)

    @staticmethod
    @device_backward("npu_moe_token_unpermute_grad_v2")
    def backward(ctx, grad: torch.Tensor):
        sorted_indices, probs, permuted_tokens = ctx.saved_tensors
        # derivatives.yaml:338: npu_moe_token_unpermute_grad_v2(grad, sorted_indices, permuted_tokens.sym_size(0),
        # permuted_tokens.scalar_type(), probs, padded_mode, restore_shape, permuted_tokens_for_backward)
        grad_tokens, grad_probs = npu_moe_token_unpermute_grad_v2(
            grad, sorted_indices, ctx.rows, ctx.tokens_dtype, probs, False, None, permuted_tokens
        )
        return (
            grad_tokens if ctx.needs_input_grad[0] else None,
            None,
            grad_probs if ctx.needs_input_grad[2] else None,
        )


def npu_moe_token_unpermute_grad_v2(
    grad_unpermuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    permuted_tokens_size_0: int,
    permuted_tokens_dtype: torch.dtype,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: list[int] | None = None,
    permuted_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backward op: permuted_tokens' gradient (in their dtype) and probs' (in theirs; None without probs)."""
    enforce(
        UNPERMUTE_GRAD,
        grad_unpermuted_tokens=grad_unpermuted_tokens,
        sorted_indices=sorted_indices,
        permuted_tokens_size_0=permuted_tokens_size_0,
        permuted_tokens_dtype=permuted_tokens_dtype,
        probs=probs,
        padded_mode=padded_mode,
        restore_shape=restore_shape,
        permuted_tokens=permuted_tokens,
    )
    grad = grad_unpermuted_tokens
    grad32 = grad.float().unsqueeze(1)  # [T, 1, H]
    rows = grad32 * probs.float().unsqueeze(-1) if probs is not None else grad32  # [T, K, H]
    grad_tokens = grad.new_zeros(permuted_tokens_size_0, grad.shape[-1], dtype=permuted_tokens_dtype)
    grad_tokens[sorted_indices.long()] = rows.flatten(0, 1).to(permuted_tokens_dtype)
    grad_probs = None
    if probs is not None:
        grad_probs = (_gathered(permuted_tokens, sorted_indices, probs) * grad32).sum(dim=-1).to(probs.dtype)
    return grad_tokens, grad_probs


def _gathered(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """Each token's K rows of permuted_tokens, in float32: [T, K, H]."""
    top_k = probs.shape[1] if probs is not None else 1
    return permuted_tokens[sorted_indices.long()].float().unflatten(0, (-1, top_k))


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
    """Emulated `torch_npu.npu_grouped_matmul` in the single-tensor forms the cards use.

    The forms are group_type 0 (x [M, K] rows split, weight [E, K, N] -> y [M, N]) and group_type 2 (x [K, M] with M
    split, weight [M, N] -> y [E, K, N]). Other documented forms (lists, bias, activation, quantisation,
    group_type -1, a list group_list) raise NotImplementedError; calls outside the ledger raise DeviceRefusal.
    """
    quantised = sorted(name for name, value in quantisation.items() if value is not None)
    enforce(
        GMM_CALL,
        x=x,
        weight=weight,
        bias=bias,
        group_list=group_list,
        split_item=split_item,
        group_type=group_type,
        group_list_type=group_list_type,
        act_type=act_type,
        output_dtype=output_dtype,
        tuning_config=tuning_config,
        quantisation=quantised,
    )
    if group_list is not None and not isinstance(group_list, torch.Tensor):
        raise NotImplementedError("npu_grouped_matmul: the List[int] group_list overload is not emulated")
    if len(x) != 1 or len(weight) != 1 or bias is not None or act_type:
        raise NotImplementedError("npu_grouped_matmul: only one x and one weight, no bias/activation, are emulated")
    if quantised or group_list_type == 2 or any(t.dtype in QUANTISED_DTYPES for t in (*x, *weight)):
        raise NotImplementedError(
            f"npu_grouped_matmul: quantised forms are not emulated (no card uses them): got {quantised}, "
            f"x {x[0].dtype}, weight {weight[0].dtype}, group_list_type {group_list_type} (0: cumsum and 1: counts are)"
        )
    if group_type == -1:
        raise NotImplementedError("npu_grouped_matmul: group_type -1 (no split) is not emulated: no card uses it")
    (a_npu,), (w_npu,) = x, weight
    on_device = {"x": a_npu, "weight": w_npu, **({"group_list": group_list} if group_list is not None else {})}
    require_npu("npu_grouped_matmul", **on_device)
    enforce(
        GMM_SINGLE,
        x=a_npu,
        weight=w_npu,
        group_list=group_list,
        split_item=split_item,
        group_type=group_type,
        group_list_type=group_list_type,
    )
    a, w = a_npu.detach().cpu(), w_npu.detach().cpu()  # the device computes on its own memory
    groups = group_list.numel()
    sizes = group_sizes(group_list, group_list_type or 0)
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    with torch.no_grad():  # no autograd on the device op
        if group_type == 0:
            out = torch.empty(a.shape[0], w.shape[2], dtype=torch.float32)
            for g in range(groups):
                out[bounds[g] : bounds[g + 1]] = a[bounds[g] : bounds[g + 1]].float() @ w[g].float()
        else:
            out = torch.empty(groups, a.shape[0], w.shape[1], dtype=torch.float32)
            for g in range(groups):
                out[g] = a[:, bounds[g] : bounds[g + 1]].float() @ w[bounds[g] : bounds[g + 1]].float()
    return [out.to(output_dtype or a.dtype).to(a_npu.device)]
