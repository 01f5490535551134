"""npu-moe's bench spec (the contract: scripts/bench/cards/__init__.py).

Floor (P = tokens x top_k token copies): 6 ops: the tokens per expert (reads top_k_index, writes E int64
counts), permute (reads x and top_k_index, writes the P copies and their int32 order), grouped matmul with
every expert's [Wg; Wu], swiglu, grouped matmul with Wd, unpermute (weights and sums each token's copies).
Backward: 7 ops (unpermute, swiglu, permute, and dX and dW of each grouped matmul). Why the counts take an op
of their own: the grouped matmuls need the tokens per expert, and no torch_npu routing op both returns them and
has a backward. The ops that return counts (`npu_moe_init_routing_v2`, `npu_moe_compute_expert_tokens`,
`npu_moe_re_routing`) are documented for inference and have no derivative, while `npu_moe_token_permute`, which
has one, returns no counts; a training step computes them with a separate op beside it
(docs/torch-npu-ops.md, "MoE routing ops and per-expert counts").

Kept for backward (what the backward kernels read that the forward wrote): the counts (both grouped matmuls'
backwards), the order (unpermute's and permute's), the permuted tokens [P, H] (dW of [Wg; Wu]), h [P, 2I] (swiglu's
backward), a [P, I] (dW of Wd) and the down matmul's output [P, H] (unpermute's backward, for the weights'
gradient). x, top_k_index, top_k_weights and the weights are the region's inputs and parameters.

The card's swiglu is npu-swiglu's op (its accounting rule lives in npu_swiglu.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..accounting import FusedOp, empty_of, tensor_bytes
from ..configs import PHASES
from ..floors import Floor, dense_bytes
from . import CountedTarget, ExpertsSweep, HostTiming

BYTES_TOLERANCE = 1.01
"""Kernelized bytes of the MoE experts within 1% of the floor."""


def floor(module: nn.Module, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Floor:
    """Counts, permute, grouped matmul, swiglu, grouped matmul, unpermute; backward 7 ops (see the module doc).

    The counts op (top_k_index -> E int64 tokens per expert) is part of the floor: the grouped matmuls need the
    counts, and no torch_npu routing op both returns them and has a backward, so a training step computes them
    beside npu_moe_token_permute (docs/torch-npu-ops.md, "MoE routing ops and per-expert counts")."""
    experts, double_inner, hidden = module.gate_up_proj.shape
    copies, size = top_k_index.numel(), x.element_size()
    w_gu, w_d = tensor_bytes(module.gate_up_proj), tensor_bytes(module.down_proj)
    xp, h, a = copies * hidden * size, copies * double_inner * size, copies * double_inner // 2 * size
    order, counts = copies * 4, experts * 8  # int32 order of the copies, int64 tokens per expert
    idx, probs, y, x_b = tensor_bytes(top_k_index), tensor_bytes(top_k_weights), dense_bytes(x), tensor_bytes(x)
    fwd = (idx + counts) + (x_b + idx + xp + order) + (xp + w_gu + counts + h) + (h + a) + (a + w_d + counts + xp)
    fwd += xp + order + probs + y
    bwd = (y + order + xp + probs + xp + probs) + (xp + w_d + counts + a) + (xp + a + counts + w_d) + (a + h + h)
    bwd += (h + w_gu + counts + xp) + (h + xp + counts + w_gu) + (xp + order + dense_bytes(x))
    return (6, fwd), (7, bwd)


def floor_saved(module: nn.Module, x: torch.Tensor, top_k_index: torch.Tensor, *_) -> int:
    """Counts, order, permuted tokens, h, a and the down matmul's output (see the module doc)."""
    experts, double_inner, hidden = module.gate_up_proj.shape
    copies, size = top_k_index.numel(), x.element_size()
    return experts * 8 + copies * 4 + copies * (2 * hidden + double_inner + double_inner // 2) * size


COUNTED_TARGETS = (
    CountedTarget("ops", PHASES, 1),
    CountedTarget("bytes", PHASES, BYTES_TOLERANCE),
)


def _permute_outputs(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, indices = a["tokens"], a["indices"]
    return empty_of(tokens, (indices.numel(), tokens.shape[-1])), empty_of(indices, (indices.numel(),), torch.int32)


def _unpermute_outputs(a: dict[str, Any]) -> torch.Tensor:
    permuted, probs = a["permuted_tokens"], a["probs"]
    top_k = probs.shape[1] if probs is not None else 1
    return empty_of(permuted, (a["sorted_indices"].numel() // top_k, permuted.shape[-1]))


def _grouped_matmul_outputs(a: dict[str, Any]) -> list[torch.Tensor]:
    (x,), (w,) = a["x"], a["weight"]
    dtype = a["output_dtype"] or x.dtype
    if a["group_type"] == 2:  # x [K, M] split along M into groups, weight [M, N] -> [groups, K, N]
        out = empty_of(x, (a["group_list"].numel(), x.shape[0], w.shape[1]), dtype)
        return [out] if a["split_item"] in (2, 3) else list(out.unbind(0))
    if a["split_item"] not in (2, 3):
        raise NotImplementedError("accounting: npu_grouped_matmul split by group sizes depends on data")
    return [empty_of(x, (x.shape[0], w.shape[2]), dtype)]  # x [M, K], weight [E, K, N] -> [M, N]


def _grouped_matmul_flops(a: dict[str, Any], out: Any) -> int:
    """Return the FLOPs of a grouped matmul: 2 x its multiply-adds.

    That is each of the M rows of x [M, K] times its expert's [K, N] (2 M K N); with group_type 2 (x [K, M] split along
    M, weight [M, N]) each of the M columns once (2 K M N)."""
    (x,), (w,) = a["x"], a["weight"]
    return 2 * x.shape[0] * x.shape[1] * w.shape[-1]


FUSED_OPS = {
    "npu_moe_token_permute": FusedOp(_permute_outputs, ("tokens",), lambda a, out: [out[1]]),
    "npu_moe_token_unpermute": FusedOp(
        _unpermute_outputs,
        ("permuted_tokens", "probs"),
        lambda a, out: [a["permuted_tokens"], a["sorted_indices"], a["probs"]],
    ),
    "npu_grouped_matmul": FusedOp(_grouped_matmul_outputs, flops=_grouped_matmul_flops),
}


def _routed_tokens(config: Any, batch: int, seq: int, device: str) -> tuple[torch.Tensor, ...]:
    """Tokens [T, H], each routed to top_k distinct experts, with their weights: the experts module's call."""
    tokens, top_k = batch * seq, config.num_experts_per_tok
    top_k_index = torch.rand(tokens, config.num_experts).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k).softmax(dim=-1)
    return tuple(t.to(device) for t in (torch.randn(tokens, config.hidden_size), top_k_index, weights))


# Host cost only, on a Qwen3-MoE layer: the per-call overhead and fallback rows time the dense Llama layer's cards.
HOST_TIMING = HostTiming(region=lambda layer: layer.mlp.experts, inputs=_routed_tokens, model="qwen3_moe")


def is_region(module: nn.Module) -> bool:
    """A transformers Experts module (swapped or not): its experts' gate and up weights in one 3-d tensor."""
    weight = getattr(module, "gate_up_proj", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 3


EXPERTS_SWEEP = ExpertsSweep("qwen3-30b-a3b", experts=(8, 16, 32, 64, 128), quick=(8, 128))
"""Qwen3-30B-A3B's MoE layer with these numbers of experts (top-8, batch 1, seq 512)."""
