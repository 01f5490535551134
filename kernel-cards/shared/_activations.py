"""Activation checks for the cards that fuse SiLU or GELU-tanh (copied into the cards whose card.toml lists it)."""

from __future__ import annotations

import functools
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


def is_gelu_tanh(act_fn: Callable | None) -> bool:
    """Return whether an activation is exactly torch's tanh-approximated GELU, `F.gelu(x, approximate="tanh")`.

    That is, transformers' `GELUTanh` (ACT2FN["gelu_pytorch_tanh"]; not its Python-formula variant
    "gelu_python_tanh", nor "gelu_new"/"gelu_fast", which round differently) or `nn.GELU(approximate="tanh")`, not a
    subclass, its forward not swapped for another."""
    activations = sys.modules.get("transformers.activations")
    gelu_tanh = getattr(activations, "GELUTanh", None)
    if type(act_fn) is nn.GELU:
        exact = act_fn.approximate == "tanh"
    elif gelu_tanh is not None and type(act_fn) is gelu_tanh:
        act = getattr(act_fn, "act", None)
        exact = (
            isinstance(act, functools.partial)
            and act.func is F.gelu
            and not act.args
            and act.keywords == {"approximate": "tanh"}
        )
    else:
        return False
    forward = instance_forward(act_fn)
    return exact and (forward is None or getattr(forward, "__func__", None) is type(act_fn).forward)
