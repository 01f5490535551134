"""npu-rms-norm's bench spec (the contract: scripts/bench/cards/__init__.py).

Floor: 1 op reading x and weight, writing y. Backward: 1 op reading dy, x, weight, writing dx, dweight.
The card's backward is npu_rms_norm's node: npu_rms_norm_backward writes dweight in float32 (docs/torch-npu-ops.md),
which autograd casts to the weight's dtype, one op more where the weight is not float32 (the measured models'
bfloat16 weights). So the card is held to the floor's op count forward, and to the floor's 2 ops plus that cast in
fwd+bwd (3 = 1.5 x floor); and to the floor's bytes within tolerance in both phases (per weight element,
2 bytes more written by the backward and the cast's 4 read and 2 written: small next to the activations from a few
tokens on; at one token with the backward, the weight's bytes are the activations' size, and a plain norm moves
1.5 x the floor's bytes there).

Zero-centred norms (Gemma's `(1 + weight.float()) * normalize(x)`): forward without autograd, one
npu_gemma_rms_norm (the floor's op). With grad, that op has no backward, and no documented backward takes the
zero-centred weight: the card runs npu_rms_norm on `1 + weight.float()`, two kernels of H elements (a cast and an
add) before the norm, then npu_rms_norm_backward and the cast of dweight: 5 ops against the floor's 2, so the
fwd+bwd op count target is out of reach for such norms with documented ops (at least 4 with a one-kernel float32
`1 + weight`, still above 1.5 x 2); the bytes of those small ops are the weight's size (at one token: 2.4 x the
floor's bytes for Gemma-3-4B's six norms).

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
from . import BYTES_TOLERANCE, CountedTarget, HostTiming


def floor(module: nn.Module, x: torch.Tensor, *_) -> Floor:
    """One op reading x and the weight, writing y; backward one op reading dy, x, weight, writing dx, dweight."""
    x_b, w_b = tensor_bytes(x), tensor_bytes(module.weight)
    return (1, x_b + w_b + dense_bytes(x)), (1, dense_bytes(x) + x_b + w_b + dense_bytes(x) + w_b)


def floor_saved(module: nn.Module, x: torch.Tensor, *_) -> int:
    """Nothing kept beyond the input and the weight: the backward recomputes rstd from x."""
    return 0


COUNTED_TARGETS = (
    CountedTarget("ops", ("fwd",), 1),
    CountedTarget("ops", ("fwd+bwd",), 1.5),  # the floor's 2, and autograd's cast of the float32 dweight
    CountedTarget("bytes", PHASES, BYTES_TOLERANCE),
)


def _rms_norm_outputs(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    x, gamma = a["x"], a["gamma"]
    rstd_shape = (*x.shape[: x.dim() - gamma.dim()], *([1] * gamma.dim()))
    return empty_of(x, x.shape), empty_of(x, rstd_shape, torch.float32)


FUSED_OPS = {
    "npu_rms_norm": FusedOp(
        _rms_norm_outputs, ("x", "gamma"), lambda a, out: [a["x"], a["gamma"], out[1]], float32_grads=("gamma",)
    ),
    # No backward (no derivatives.yaml entry): the card calls it only where autograd records nothing.
    "npu_gemma_rms_norm": FusedOp(_rms_norm_outputs),
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
