"""npu-add-rms-norm's bench spec (the contract: scripts/bench/cards/__init__.py).

The card swaps the decoder layer itself; its region is the mid residual add and `post_attention_layernorm`
(`layer_region`), measured at that norm's call, with the residual and the attention output as its two inputs and
both the normalised output and the sum as its outputs (the sum also feeds the layer's final add, so its gradient
reaches the region: the add that accumulates the sum's two gradients belongs to the region, eager or fused).

Floor: forward 1 op reading residual, update and the weight, writing the normalised output and the sum. Backward
1 op reading the output's gradient, the sum's gradient, the sum and the weight, writing the one input gradient
(the add's two inputs share it) and the weight's. torch_npu has no such backward kernel: the card runs
npu_rms_norm_backward, casts dgamma (float32) to the weight's dtype and adds the sum's gradient, 3 ops and two
activation-sized tensors more than the floor, so the card is held to the floor forward and to eager forward and
backward.

Mixed precision (the step's mixed row: a float32 residual, a bfloat16 attention output): the card adds the two as
eager does (one mixed-dtype add) and runs npu_rms_norm on the float32 sum, its backward npu_rms_norm's own node, which
npu-rms-norm's spec accounts (`FUSED_OPS` holds only the ops of this card's emulation module).

Kept for backward: the sum (an output the backward reads; the backward recomputes rstd from it). The card's function
keeps the sum, the weight and its float32 rstd, one value per row, as npu_rms_norm's node does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from npu_hub_kernels.report import card_layer_of, card_package

from ..accounting import FusedOp, empty_of, tensor_bytes
from ..configs import PHASES
from ..floors import Floor, dense_bytes
from . import BYTES_TOLERANCE, BeforeCardTarget, CountedTarget, LayerRegion


def floor(module: nn.Module, residual: torch.Tensor, update: torch.Tensor, *_) -> Floor:
    """Return the add + RMSNorm region at its floor: one op forward, one op backward.

    Forward: the op reads residual, update and the weight, writing output and sum. Backward: the op reads dy, dsum,
    the sum and the weight, writing the input gradient and dweight."""
    w_b, x_b = tensor_bytes(module.weight), dense_bytes(residual)
    forward = tensor_bytes(residual) + tensor_bytes(update) + w_b + 2 * x_b
    backward = 3 * x_b + w_b + x_b + w_b
    return (1, forward), (1, backward)


def floor_saved(module: nn.Module, residual: torch.Tensor, *_) -> int:
    """The sum, which the forward writes and the backward reads."""
    return dense_bytes(residual)


COUNTED_TARGETS = (
    CountedTarget("ops", ("fwd",), 1),
    CountedTarget("bytes", ("fwd",), BYTES_TOLERANCE),
    CountedTarget("bytes", PHASES, 1, against="eager"),
)
BEFORE_CARD_TARGET = BeforeCardTarget(
    fewer_ops=1,
    fewer_activations=1,
    models=("Llama-3-8B", "Qwen3-8B"),
    why=(
        "npu-add-rms-norm's decoder layer is held to the layer without the card, counted, less 1 op and 1 activation "
        "of bytes, forward+backward. It replaces issue 19's 'floor without it - 2 ops, <= 0.97 x its bytes': the "
        "layer's floor with the card is the floor without it less 2 ops, so that target asks every region of the layer "
        "at its floor, which torch_npu's documented ops reach in no region with a backward: RoPE runs npu_rotary_mul "
        "for q and for k each way (npu_apply_rotary_pos_emb has no backward: "
        "Ascend/op-plugin@517f2e7:op_plugin/ops/opapi/AutogradErrorFallback.cpp:15), each npu_rms_norm_backward writes "
        "dgamma in float32, which autograd casts, and npu_add_rms_norm has no backward (AutogradErrorFallback.cpp), so "
        "this region's is npu_rms_norm_backward, that cast and the add of the sum's two gradients. The card saves the "
        "norm's separate add and the sum's read-back: one op and one activation (batch x seq x hidden x 2 bytes)."
    ),
)
"""What the whole decoder layer with this card is held to, forward+backward at batch 8 x 4096 (see `why`).

Counted: Llama-3-8B 42 ops against 43 without the card (the floor with it 37: + 2 RoPE, + 1 input_layernorm's dgamma
cast, + 2 this region's backward), Qwen3-8B 48 against 49; bytes exactly one activation less (Llama-3-8B 36.54 against
36.81 GB, 0.994 x the floor without it, where issue 19 asked 0.97)."""


def _add_rms_norm_outputs(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x1, gamma = a["x1"], a["gamma"]
    rstd_shape = (*x1.shape[: x1.dim() - gamma.dim()], *([1] * gamma.dim()))
    return empty_of(x1, x1.shape), empty_of(x1, rstd_shape, torch.float32), empty_of(x1, x1.shape)


def _rms_norm_backward_outputs(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return empty_of(a["x"], a["x"].shape), empty_of(a["gamma"], a["gamma"].shape, torch.float32)


FUSED_OPS = {
    # forward only: neither op has a derivative (the card's autograd function calls the second in its backward)
    "npu_add_rms_norm": FusedOp(_add_rms_norm_outputs),
    "npu_rms_norm_backward": FusedOp(_rms_norm_backward_outputs),
}

# Not timed on the host: its layer is a whole decoder layer, whose host time is its submodules' (the other cards')
# plus one function call in place of an add and a norm module's call.
HOST_TIMING = None

_SCALINGS = {
    "DecoderLayer": "plain",
    "DecoderLayerZeroCentered": "zero_centered",
    "DecoderLayerFloat32Scale": "float32_scale",
}
"""The weight form each of the card's layers passes to add_rms_norm."""


def layer_region(layer: nn.Module) -> LayerRegion:
    """`residual + attn_out` and `post_attention_layernorm` of the sum, at the norm's call."""
    return LayerRegion("post_attention_layernorm", lambda args, kwargs: ((args[0], args[0]), {}), _run)


def _run(layer: nn.Module, variant: str) -> Callable[..., Any]:
    norm = layer.post_attention_layernorm
    if variant == "eager":
        return lambda residual, update: _eager(residual + update, norm)
    _, layer_name = card_layer_of(layer)
    package = card_package(layer)
    scaling = _SCALINGS[layer_name]
    add_rms_norm, family = package.add_rms_norm, package.layers.family(layer)
    return lambda residual, update: add_rms_norm(residual, update, norm, scaling, family)


def _eager(summed: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return norm(summed), summed
