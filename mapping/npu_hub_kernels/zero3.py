"""DeepSpeed ZeRO-3 for split SwiGLU MLPs: each MLP that npu-swiglu runs becomes a ZeRO-3 leaf module.

Under ZeRO-3 every module gets DeepSpeed's hooks, and a parameter is gathered by the pre-forward (and pre-backward)
hook of the module that owns it. npu-swiglu's split-MLP layer reads `gate_proj.weight` and `up_proj.weight` without
calling gate_proj/up_proj. Inside the engine's forward DeepSpeed (0.19.8) gathers such a read on the spot and registers
the weight as an external parameter of the MLP (`ZeROOrderedDict.__getitem__`, deepspeed/runtime/zero/
parameter_offload.py), so the numbers would be right; but gate_proj/up_proj still carry ZeRO-3 hooks, and a layer
cannot tell those from hooks that change what a Linear computes (LoRA, quantization), so it takes the eager path.
DeepSpeed's public answer for a module that reads its children's parameters is a leaf module
(`deepspeed.utils.set_z3_leaf_modules_by_name`): the MLP's own hooks gather every parameter below it (gate, up and
down) before its forward and before its backward and release them after, and its children get no hooks at all, so
gate_proj/up_proj are plain hook-free nn.Linear holding their full weights for the whole MLP forward and backward.
The cost: the three projections of one MLP are resident together while it runs, instead of one after the other.
"""

from __future__ import annotations

import importlib.util

from torch import nn

from .cards import CARDS
from .report import card_layer_of

LEAF_LAYERS = frozenset((card.repo_name, layer) for card in CARDS.values() for layer in card.zero3_leaf_layers)
"""(card, layer) of the forwards that read their children's parameters directly (card.toml `zero3_leaf_layers`)."""


def mark_zero3_leaf_mlps(model: nn.Module) -> list[str]:
    """Make every split MLP of `model` that runs npu-swiglu's SwiGLUMLP a ZeRO-3 leaf module; return their names.

    Call it after kernelize (or `apply_npu_kernels`) and before `deepspeed.initialize` (or the Trainer / accelerate
    call that makes the DeepSpeed engine): DeepSpeed puts its hooks on the modules when the engine is made, and a leaf
    flag set later changes nothing. Without deepspeed installed there is nothing to mark: returns [].

    Raises:
        RuntimeError: a DeepSpeed engine already holds the model and these MLPs are not leaves (their projections
            carry ZeRO-3 hooks). Marking again MLPs that are leaves already is harmless.
    """
    names = [name for name, module in model.named_modules() if _runs_split_mlp(module)]
    if not names or importlib.util.find_spec("deepspeed") is None:
        return []
    from deepspeed.utils import set_z3_leaf_modules_by_name, z3_leaf_module

    modules = dict(model.named_modules())
    hooked = [name for name in names if hasattr(modules[name], "ds_id") and not z3_leaf_module(modules[name])]
    if hooked:
        raise RuntimeError(
            f"mark_zero3_leaf_mlps: a DeepSpeed ZeRO-3 engine already put its hooks on {hooked[0]} and its projections "
            f"({len(hooked)} MLPs); call it before deepspeed.initialize (or before the Trainer/accelerate prepares "
            "the model), right after kernelize."
        )
    set_z3_leaf_modules_by_name(model, names)
    return names


def _runs_split_mlp(module: nn.Module) -> bool:
    build, layer = card_layer_of(module) or (None, None)
    return build is not None and (build.CARD, layer) in LEAF_LAYERS
