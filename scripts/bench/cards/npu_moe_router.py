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

Documented minimum (`documented_minimum`, what the targets hold the card to; see `OUT_OF_DOCUMENTED_REACH`), per
softmax router family, after the logits matmul (and, with grad, before its dx and dW and the add of the logits' own
gradient, which the floor has too):
- inference, weights in the logits' dtype: one gating op where its ledger rules take the call
  (npu_moe_gating_top_k_softmax_v2 renorm 1 for renormalised routers, npu_moe_gating_top_k softmax mode or v2 renorm 0
  for the others), writing int32 ids, and the widening of the ids to int64: 3 ops;
- inference, Mixtral's float32 weights: the gating ops write the logits' dtype, so aten's top-k of the logits (int64
  ids) and the float32 softmax of the k (`softmax(dtype=float32)` is a cast and `_softmax`): 4 ops;
- with grad, no gating op has a softmax backward, so aten's differentiable path, each call's backward as autograd runs
  its derivative: renormalised routers top-k of the logits, the float32 softmax of the k (a cast and `_softmax`), the
  cast to the logits' dtype (none for float32 weights); backward the casts back, `_softmax_backward_data` and top-k's
  derivative (zeros [T, E] and a scatter): 13 ops (11 for float32 weights); the others the float32 softmax of the
  logits (a cast and `_softmax` [T, E]), its top-k, the cast of the k; backward the cast back, top-k's zeros and
  scatter, `_softmax_backward_data` [T, E] and its cast: 13 ops. A hand-written backward (the scatter and the logits'
  gradient add as one scatter_add) is no op's documented derivative and is not counted.
aten calls move what the bench's accounting counts for them (`bench.accounting`: every tensor argument read, every
output written).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from npu_hub_kernels.models.npu_moe_router import SWAPPED
from npu_hub_kernels.testing.emulation.ledger import DeviceRefusal, enforce
from npu_hub_kernels.testing.emulation.ops.npu_moe_router import FORWARD_RULES, SOFTMAX_V2_RULES

from ..accounting import FusedOp, empty_of, tensor_bytes
from ..configs import PHASES
from ..floors import Floor, dense_bytes
from . import CountedTarget, DocumentedMinimum, HostTiming

OUT_OF_DOCUMENTED_REACH = (
    "MoE router: the floor routes in one op writing the weights and int64 ids. Both gating ops write int32 ids "
    "(expert_idx int32: docs/torch-npu-ops.md, the Outputs of npu_moe_gating_top_k and "
    "npu_moe_gating_top_k_softmax_v2), which transformers' experts index as int64, so inference widens them: 3 ops "
    "against 2 (Qwen-MoE routers). npu_moe_gating_top_k_softmax_v2 writes the weights in the logits' dtype, so "
    "Mixtral's float32 weights take aten's top-k and float32 softmax, which is a cast and _softmax off CUDA "
    "(pytorch/pytorch:aten/src/ATen/native/SoftMax.cpp, softmax with dtype): 4 ops. With grad no gating op "
    "differentiates a softmax router (npu_moe_gating_top_k_backward takes norm_type 1 only: "
    "Ascend/op-plugin@517f2e7:codegen/templates/_op_plugin_docs.py:10940; v2 has no derivatives.yaml entry), so "
    "aten's top-k and float32 softmax run with autograd's derivatives (top-k's: zeros [T, E] and a scatter, "
    "pytorch/pytorch:tools/autograd/derivatives.yaml, topk): 13 ops against 6 (11 for Mixtral's float32 weights), "
    "and up to 1.19 x the floor's bytes where the softmax spans every expert (not renormalised: Qwen1.5-MoE). The "
    "minimum counts autograd's derivatives, and the sum of the logits' two gradients as its own op, as the floor "
    "does; a hand-written backward folding top-k's zeros and scatter and that sum into one scatter_add (2 ops fewer "
    "where the router's logits get a gradient of their own) is no op's derivative and is not counted."
)


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
    # = documented minimum: 3 or 4 ops in inference, 11 or 13 with grad (was: = floor, 2 and 6)
    CountedTarget("ops", PHASES, 1, against="documented"),
    # exactly the documented calls' bytes (was: <= 1.01 x floor; 1.19 x it with grad for Qwen1.5-MoE)
    CountedTarget("bytes", PHASES, 1, against="documented"),
)

Step = tuple[int, int]
"""(ops, bytes) of a documented call, or of none: (0, 0)."""


def documented_minimum(module: nn.Module, hidden_states: torch.Tensor, *_) -> DocumentedMinimum:
    """The router as the fewest documented calls, forward without autograd and forward+backward (see the module doc).

    In inference the logits matmul, one gating op where its ledger rules take the call and the widening of its int32
    ids (weights in the logits' dtype), else aten's top-k and float32 softmax; with grad aten's top-k and float32
    softmax with autograd's derivatives, the matmul's dx and dW and the add of the logits' own gradient."""
    experts, hidden = module.weight.shape
    tokens = hidden_states.numel() // hidden
    size, picked, logits = hidden_states.element_size(), tokens * module.top_k, tokens * experts
    renormalised, weight_size = _family(module, size)
    x_b, w_b = tensor_bytes(hidden_states), tensor_bytes(module.weight)
    matmul = (1, x_b + w_b + logits * size)
    backward = [
        (1, 3 * logits * size),  # the add of the logits' own gradient and the routing's
        (1, logits * size + w_b + dense_bytes(hidden_states)),  # dx
        (1, logits * size + x_b + dense_bytes(module.weight)),  # dW
    ]
    top_of_logits = (1, logits * size + picked * size + picked * 8)  # aten topk: values and int64 ids
    if renormalised:  # the float32 softmax of the k logits, cast to the weights' dtype
        aten = [top_of_logits, _cast(picked, size, 4), _softmax(picked), _cast(picked, 4, weight_size)]
        # backward: the casts back, the softmax's and top-k's derivatives (zeros [T, E] read the gradient they are
        # called on, as the bench counts new_zeros; the scatter reads the zeros, the ids and the k gradients)
        backward += [_cast(picked, weight_size, 4), (1, 3 * picked * 4), _cast(picked, 4, size)]
        backward += [(1, picked * size + logits * size), (1, 2 * logits * size + picked * 8 + picked * size)]
    else:  # the float32 softmax of every expert, its top-k, cast to the logits' dtype
        aten = [_cast(logits, size, 4), _softmax(logits), (1, logits * 4 + picked * 4 + picked * 8)]
        aten += [_cast(picked, 4, size)]
        backward += [_cast(picked, size, 4), (1, picked * 4 + logits * 4), (1, 2 * logits * 4 + picked * 12)]
        backward += [(1, 3 * logits * 4), _cast(logits, 4, size)]
    gating = weight_size == size and _gating_op_takes(tokens, experts, module.top_k, hidden_states.dtype, renormalised)
    widened = [(1, logits * size + picked * size + picked * 4), (1, picked * 4 + picked * 8)]  # op, then int64 ids
    inference = _total([matmul, *(widened if gating else aten)])
    return inference, _total([matmul, *aten, *backward])


def _cast(elements: int, source: int, target: int) -> Step:
    """A cast of `elements` from one element size to another: none where they are the same dtype's."""
    return (1, elements * (source + target)) if source != target else (0, 0)


def _softmax(elements: int) -> Step:
    """aten `_softmax` of float32 `elements`: reads and writes them."""
    return 1, 2 * elements * 4


def _total(steps: list[Step]) -> Step:
    return sum(ops for ops, _ in steps), sum(moved for _, moved in steps)


def _family(module: nn.Module, size: int) -> tuple[bool, int]:
    """(renormalised, the weights' element size) of a softmax router, by the card's layer for its class (`SWAPPED`).

    A ValueError for a router no documented minimum is stated for (sigmoid routers: no bench model has one)."""
    cls = type(module)
    path = f"{cls.__module__.removeprefix('transformers.models.')}.{cls.__name__}"
    layer = next((layer for layer, classes in SWAPPED.items() if path in classes), None)
    if layer == "SoftmaxTopKRouter":
        return bool(module.norm_topk_prob), size
    if layer == "RenormalisedSoftmaxTopKRouter":
        return True, size
    if layer == "RenormalisedFloat32SoftmaxTopKRouter":
        return True, 4
    raise ValueError(f"npu-moe-router's bench spec states no documented minimum for {path} (layer {layer})")


def _gating_op_takes(tokens: int, experts: int, top_k: int, dtype: torch.dtype, renormalised: bool) -> bool:
    """Whether a gating op's ledger rules take the logits [T, E] in inference.

    Renormalised: npu_moe_gating_top_k_softmax_v2 (renorm 1); else npu_moe_gating_top_k (softmax mode, one group) or
    v2 (renorm 0)."""
    x = torch.empty(tokens, experts, dtype=dtype, device="meta")
    calls = [(SOFTMAX_V2_RULES, dict(x=x, k=top_k, finished=None, renorm=int(renormalised)))]
    if not renormalised:
        one_group = dict(bias=None, k_group=1, group_count=1, group_select_mode=1, renorm=0, norm_type=0)
        calls.insert(0, (FORWARD_RULES, dict(x=x, k=top_k, **one_group)))
    for rules, arguments in calls:
        try:
            enforce(rules, **arguments)
        except DeviceRefusal:
            continue
        return True
    return False


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
