"""Pack the split SwiGLU MLPs of a model ahead of time (npu-swiglu's `pack_gate_up`, model-wide)."""

from __future__ import annotations

from torch import nn

from .report import card_layer_of, card_package


def pack_gate_up(model: nn.Module) -> int:
    """Pack gate_proj/up_proj of every MLP running npu-swiglu's SwiGLUMLP now; returns how many are packed.

    Not needed on the usual paths: each such MLP packs its two weights into one buffer on its first
    fused call, and again after a move or cast. Call it (after `.to("npu")` and kernelize) before
    handing the model to something that takes hold of its parameters and so stops the layer from
    packing them later, such as `DistributedDataParallel`. Projections the layer must not rewrite
    (LoRA-wrapped, DTensor, ZeRO-3, ...) are left as they are and not counted.
    """
    packed = 0
    for module in model.modules():
        build, layer = card_layer_of(module) or (None, None)
        if build is not None and (build.CARD, layer) == ("npu-swiglu", "SwiGLUMLP"):
            packed += card_package(module).pack_gate_up(module.gate_proj, module.up_proj)
    return packed
