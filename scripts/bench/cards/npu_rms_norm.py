"""npu-rms-norm's bench spec (the contract: scripts/bench/cards/__init__.py).

Floor: 1 op reading x and weight, writing y. Backward: 1 op reading dy, x, weight, writing dx, dweight.
The card's backward is npu_rms_norm's node: npu_rms_norm_backward writes dweight in float32 (docs/torch-npu-ops.md),
which autograd casts to the weight's dtype, one op more where the weight is not float32 (the measured models'
bfloat16 weights): a plain norm's documented minimum is the floor's op forward and 3 ops fwd+bwd (1.5 x floor).

Zero-centred norms (Gemma's `(1 + weight.float()) * normalize(x)`): forward without autograd, one
npu_gemma_rms_norm (the floor's op). With grad, that op has no backward, and no documented backward takes the
zero-centred weight: the card runs npu_rms_norm on `1 + weight.float()` computed as one call, `weight + one` with
`one` a float32 [1] tensor the card keeps on the device. torch_npu's add of two npu tensors, bfloat16 and float32, is
one aclnnAdd, which runs one mixed-dtype Add kernel without a Cast
(Ascend/op-plugin@0a873ce:op_plugin/ops/opapi/AddKernelNpuOpApi.cpp, `add`: result dtype float32, aclnnAdd on the
tensors as given; hicann/ops-math@3b62132:math/add/op_host/op_api/aclnn_add.cpp, `isAddMixDtypeSupport`). Then
npu_rms_norm_backward and the cast of dweight (the add's backward passes the float32 gradient on): 4 ops against the
floor's 2, the documented minimum (`documented_minimum`), above 1.5 x floor. So the op count is held to the
documented minimum, forward and fwd+bwd, for every norm (see `OUT_OF_DOCUMENTED_REACH`): for a plain norm that is
the old targets' count (= floor forward, 1.5 x floor fwd+bwd) or less (a float32 weight: no cast, 2).

Bytes: held to the documented minimum (`documented_minimum`, see `OUT_OF_DOCUMENTED_REACH`): the documented ops
write rstd (float32, one value per row) and, with grad, dweight in float32 and its cast; at one token those
weight-sized bytes are the activations' size (1.5 x the floor's bytes for a plain norm), so the floor's bytes are out
of reach there for every model, while at the training sizes the documented minimum is within 1.01 x the floor.

Kept for backward: nothing beyond x and the weight (the region's input and parameter): the backward recomputes
the row's rstd from x. (npu_rms_norm keeps its float32 rstd, one value per row, as well.)
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from npu_hub_kernels.models.npu_rms_norm import SWAPPED
from npu_hub_kernels.testing.emulation.ledger import DeviceRefusal, enforce
from npu_hub_kernels.testing.emulation.ops.npu_rms_norm import NPU_GEMMA_RMS_NORM

from ..accounting import FusedOp, empty_of, tensor_bytes
from ..configs import PHASES
from ..floors import Floor, dense_bytes
from . import CountedTarget, DocumentedMinimum, HostTiming

OUT_OF_DOCUMENTED_REACH = (
    "RMSNorm bytes: the floor's backward writes dweight in the weight's dtype. The documented backward, "
    "npu_rms_norm_backward, writes it in float32 (its meta registration; docs/torch-npu-ops.md), which autograd "
    "casts to the weight's bfloat16, and npu_rms_norm writes its float32 rstd: 8 bytes more per weight element. At "
    "one token that is the activations' size (1.5 x the floor's bytes with grad for every model's plain norm), so "
    "the floor's bytes are out of documented reach there; held to the documented calls' bytes instead, at every size. "
    "For zero-centred (Gemma) norms with grad npu_gemma_rms_norm has no backward (no derivatives.yaml entry), so "
    "npu_rms_norm runs on a float32 1 + weight, at least one mixed-dtype add (aclnnAdd runs bfloat16 + float32 as one "
    "kernel: hicann/ops-math@3b62132:math/add/op_host/op_api/aclnn_add.cpp, isAddMixDtypeSupport). "
    "RMSNorm ops: the op count target was = floor forward and <= 1.5 x floor forward+backward (the floor's 2 ops and "
    "autograd's cast of the float32 dweight). A zero-centred norm with grad takes 4 documented ops (that add, "
    "npu_rms_norm, npu_rms_norm_backward, the cast): 2 x the floor, out of documented reach. Replaced by op count = "
    "documented minimum forward and forward+backward for every norm, which is stricter everywhere: equal to the old "
    "bound for plain bfloat16 norms (1 and 3), below it for a float32 weight (2, no cast)."
)

_ONE_BYTES = 4
"""The float32 [1] tensor `one` that the one-call `1 + weight` reads (see the module doc)."""


def documented_minimum(module: nn.Module, x: torch.Tensor, *_) -> DocumentedMinimum:
    """The norm as the fewest documented calls, forward without autograd and forward+backward (see the module doc).

    In inference npu_rms_norm, or npu_gemma_rms_norm where its ledger rules take the weight (else the float32
    `1 + weight` add before npu_rms_norm); with grad npu_rms_norm (after that add for a zero-centred norm),
    npu_rms_norm_backward and the cast of its float32 dweight to the weight's dtype (none for a float32 weight). Each
    reads and writes what its contract says: rstd float32, one value per row."""
    weight = module.weight
    zero_centred = _form(module) == "RMSNormZeroCentered"
    rows = x.numel() // weight.numel()
    x_b, w_b, rstd = tensor_bytes(x), tensor_bytes(weight), rows * 4
    gamma_f32 = weight.numel() * 4  # float32 gamma (1 + weight) or float32 dweight
    one_plus_weight = (1, w_b + (_ONE_BYTES if weight.dtype != torch.float32 else 0) + gamma_f32)
    norm_gamma = gamma_f32 if zero_centred else w_b  # what npu_rms_norm and its backward read as gamma
    norm = (1, x_b + norm_gamma + dense_bytes(x) + rstd)
    if not zero_centred:
        inference = norm
    elif _gemma_op_takes(x, weight):
        inference = (1, x_b + w_b + dense_bytes(x) + rstd)
    else:
        inference = (one_plus_weight[0] + 1, one_plus_weight[1] + norm[1])
    backward = (1, dense_bytes(x) + x_b + norm_gamma + rstd + dense_bytes(x) + gamma_f32)
    cast = (0, 0) if weight.dtype == torch.float32 else (1, gamma_f32 + dense_bytes(weight))
    steps = [*([one_plus_weight] if zero_centred else []), norm, backward, cast]
    return inference, (sum(ops for ops, _ in steps), sum(moved for _, moved in steps))


def _form(module: nn.Module) -> str:
    """The card's layer for the module's class (`SWAPPED`): "RMSNorm" or "RMSNormZeroCentered".

    A ValueError for a form no documented minimum is stated for (float32-scale norms: no bench model has one)."""
    cls = type(module)
    path = f"{cls.__module__.removeprefix('transformers.models.')}.{cls.__name__}"
    form = next((layer for layer, classes in SWAPPED.items() if path in classes), None)
    if form not in ("RMSNorm", "RMSNormZeroCentered"):
        raise ValueError(f"npu-rms-norm's bench spec states no documented minimum for {path} (layer {form})")
    return form


def _gemma_op_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether npu_gemma_rms_norm's ledger rules take x (contiguous, as the card hands it over) and the weight."""
    try:
        enforce(NPU_GEMMA_RMS_NORM, x=x.detach().new_empty(x.shape), gamma=weight.detach(), epsilon=1e-6)
    except DeviceRefusal:
        return False
    return True


def floor(module: nn.Module, x: torch.Tensor, *_) -> Floor:
    """One op reading x and the weight, writing y; backward one op reading dy, x, weight, writing dx, dweight."""
    x_b, w_b = tensor_bytes(x), tensor_bytes(module.weight)
    return (1, x_b + w_b + dense_bytes(x)), (1, dense_bytes(x) + x_b + w_b + dense_bytes(x) + w_b)


def floor_saved(module: nn.Module, x: torch.Tensor, *_) -> int:
    """Nothing kept beyond the input and the weight: the backward recomputes rstd from x."""
    return 0


COUNTED_TARGETS = (
    # exactly the documented calls (was: ops = floor forward and <= 1.5 x floor fwd+bwd, out of documented reach for
    # zero-centred norms with grad; bytes <= 1.05 x floor, out of documented reach at one token with grad)
    CountedTarget("ops", PHASES, 1, against="documented"),
    CountedTarget("bytes", PHASES, 1, against="documented"),
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
