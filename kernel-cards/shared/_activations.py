"""Activation checks for the npu-hub-kernels cards that fuse SiLU (copied into the cards whose card.toml lists it)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch.nn.functional as F
from torch import nn

from ._internals import instance_forward


def is_silu(act_fn: Callable | None) -> bool:
    """Return whether an activation is exactly SiLU.

    That is, `F.silu`, `nn.SiLU` (ACT2FN["swish"]) or transformers' `SiLUActivation` (ACT2FN["silu"]), not a subclass,
    its forward not swapped for another."""
    if act_fn is F.silu:
        return True
    activations = sys.modules.get("transformers.activations")
    silu_types = (nn.SiLU, getattr(activations, "SiLUActivation", nn.SiLU))
    if type(act_fn) not in silu_types:
        return False
    forward = instance_forward(act_fn)  # kernelize may bind a forward per instance (its own, or another)
    return forward is None or getattr(forward, "__func__", None) is type(act_fn).forward
