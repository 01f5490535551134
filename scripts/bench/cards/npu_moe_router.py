"""npu-moe-router's bench spec (the contract: scripts/bench/cards/__init__.py).

The region is a router module's forward: logits = x @ W^T [T, E], then the routing (scores, top-k, weights).
Floor: 2 ops forward: the logits matmul (reads x and W, writes the logits) and one routing op reading the logits
(and the correction bias, for sigmoid routers) and writing the top-k weights [T, k] in the logits' dtype and the
expert ids [T, k] as int64, the dtype transformers' experts index with. Backward: 4 ops: the routing's backward
(reads dweights, the logits and the ids, writes dlogits; scores can be recomputed from the logits, so nothing else
needs keeping), the sum of that and the logits' own gradient (the router returns its logits for the auxiliary
loss, which gets a gradient too), and the matmul's dx and dW. Kept for backward: the logits and the ids (the
routing's backward reads them); x and W are the region's input and parameter.

What the card runs beyond it, and why no documented op reaches the floor:
- ids: both gating ops write int32 ids (npu_moe_gating_top_k, npu_moe_gating_top_k_softmax_v2: expert_idx "INT32"
  only, docs/torch-npu-ops.md), and transformers' experts index with int64, so the card widens them: one op more
  forward than the floor, whatever the router (3 against 2 where an op routes in inference);
- softmax routers with autograd recording: npu_moe_gating_top_k_backward takes the sigmoid mode only (norm_type 1)
  and npu_moe_gating_top_k_softmax_v2 has no backward, so no op routes them in training: Qwen2-MoE style routers
  (not renormalised) run transformers' softmax and top-k, renormalised ones (Qwen3-MoE, Mixtral) the softmax of
  their top-k logits (`top_logits_softmax`), each with autograd's backward;
- in inference, renormalised softmax routers run npu_moe_gating_top_k_softmax_v2 (renorm 1) where the weights are
  wanted in the logits' dtype; Mixtral's float32 weights of bf16 logits run the top-k logits' softmax (the op writes
  the logits' dtype);
- with autograd recording, the sigmoid op writes its float32 scores `norm_out` [T, E], which its backward reads
  (docs/torch-npu-ops.md, "npu_moe_gating_top_k").
Routers whose logits are float32 from bf16 inputs (DeepSeek-V3) run two casts before the matmul, in eager and
kernelized alike.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..accounting import FusedOp, empty_of, tensor_bytes
from ..configs import PHASES
from ..floors import Floor, dense_bytes
from . import CountedTarget, HostTiming

BYTES_TOLERANCE = 1.01
"""Kernelized bytes of the router within 1% of the floor (issue 19)."""


def floor(module: nn.Module, hidden_states: torch.Tensor, *_) -> Floor:
    """Logits matmul and one routing op; backward: routing, gradient sum, dx and dW (see the module doc)."""
    experts, hidden = module.weight.shape
    tokens = hidden_states.numel() // hidden
    size = hidden_states.element_size()
    x_b, w_b = tensor_bytes(hidden_states), tensor_bytes(module.weight)
    logits = tokens * experts * size
    picked = tokens * module.top_k
    bias = getattr(module, "e_score_correction_bias", None)
    bias_b = tensor_bytes(bias) if isinstance(bias, torch.Tensor) else 0
    fwd = (x_b + w_b + logits) + (logits + bias_b + picked * size + picked * 8)
    bwd = (picked * size + logits + picked * 8 + logits) + (3 * logits) + (logits + w_b + dense_bytes(hidden_states))
    bwd += logits + x_b + dense_bytes(module.weight)
    return (2, fwd), (4, bwd)


def floor_saved(module: nn.Module, hidden_states: torch.Tensor, *_) -> int:
    """The logits [T, E] and the int64 ids [T, k], which the routing's backward reads."""
    experts, hidden = module.weight.shape
    tokens = hidden_states.numel() // hidden
    return tokens * experts * hidden_states.element_size() + tokens * module.top_k * 8


COUNTED_TARGETS = (
    CountedTarget("ops", PHASES, 1),
    CountedTarget("bytes", PHASES, BYTES_TOLERANCE),
)


def _gating_outputs(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, k = a["x"], a["k"]
    scores_shape = x.shape if a["out_flag"] else (0,)  # norm_out is written only with out_flag
    return (
        empty_of(x, (x.shape[0], k)),
        empty_of(x, (x.shape[0], k), torch.int32),
        empty_of(x, scores_shape, torch.float32),
    )


def _softmax_v2_outputs(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, k = a["x"], a["k"]
    picked = (*x.shape[:-1], k)
    softmax_shape = x.shape if a["renorm"] == 0 and a["output_softmax"] else (0,)  # written only then
    return empty_of(x, picked), empty_of(x, picked, torch.int32), empty_of(x, softmax_shape, torch.float32)


FUSED_OPS = {
    "npu_moe_gating_top_k": FusedOp(_gating_outputs, ("x",), lambda a, out: [out[2], out[1]]),
    "npu_moe_gating_top_k_backward": FusedOp(lambda a: empty_of(a["x_norm"], dtype=a["grad_y"].dtype)),
    # No backward (an inference op): the card calls it only where autograd records nothing.
    "npu_moe_gating_top_k_softmax_v2": FusedOp(_softmax_v2_outputs),
}

# Host cost only, on a Qwen3-MoE layer: the per-call overhead and fallback rows time the dense Llama layer's cards.
HOST_TIMING = HostTiming(
    region=lambda layer: layer.mlp.gate,
    inputs=lambda config, batch, seq, device: (torch.randn(batch * seq, config.hidden_size, device=device),),
    model="qwen3_moe",
)


def is_region(module: nn.Module) -> bool:
    """A transformers top-k router (swapped or not): an [experts, hidden] weight and a top_k."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("Router")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and isinstance(getattr(module, "top_k", None), int)
    )
