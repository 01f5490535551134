"""npu-rms-norm's bench spec (the contract: scripts/bench/cards/__init__.py).

Floor: 1 op reading x and weight, writing y. Backward: 1 op reading dy, x, weight, writing dx, dweight.
Kept for backward: nothing beyond x and the weight (the region's input and parameter): the backward recomputes
the row's rstd from x. (npu_rms_norm keeps its float32 rstd, one value per row, as well.)
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ..accounting import FusedOp, empty_of, tensor_bytes
from ..configs import PHASES
from ..floors import Floor, dense_bytes
from ..targets import BYTES_TOLERANCE, CountedTarget
from . import HostTiming


def floor(module: nn.Module, x: torch.Tensor, *_) -> Floor:
    """One op reading x and the weight, writing y; backward one op reading dy, x, weight, writing dx, dweight."""
    x_b, w_b = tensor_bytes(x), tensor_bytes(module.weight)
    return (1, x_b + w_b + dense_bytes(x)), (1, dense_bytes(x) + x_b + w_b + dense_bytes(x) + w_b)


def floor_saved(module: nn.Module, x: torch.Tensor, *_) -> int:
    """Nothing kept beyond the input and the weight: the backward recomputes rstd from x."""
    return 0


COUNTED_TARGETS = (
    CountedTarget("ops", PHASES, 1),
    CountedTarget("bytes", PHASES, BYTES_TOLERANCE),
)


def _rms_norm_outputs(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    x, gamma = a["x"], a["gamma"]
    rstd_shape = (*x.shape[: x.dim() - gamma.dim()], *([1] * gamma.dim()))
    return empty_of(x, x.shape), empty_of(x, rstd_shape, torch.float32)


FUSED_OPS = {
    "npu_rms_norm": FusedOp(_rms_norm_outputs, ("x", "gamma"), lambda a, out: [a["x"], a["gamma"], out[1]]),
}


def _direct_call(card: ModuleType, norm: nn.Module) -> Callable[..., Any]:
    rms_norm = card.rms_norm
    return lambda x: rms_norm(x, norm.weight, norm.variance_epsilon, "plain")


HOST_TIMING = HostTiming(
    region=lambda layer: layer.input_layernorm,
    inputs=lambda config, batch, seq, device: (torch.randn(batch, seq, config.hidden_size, device=device),),
    direct_call=_direct_call,
    shapes=lambda norm, inputs: f"x {tuple(inputs[0].shape)}",
)
