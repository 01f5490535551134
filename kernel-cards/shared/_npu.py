"""torch_npu access for an npu-hub-kernels card (the build copies this file into every card).

The NPU builds (`torch-npu`, `torch<XY>-cxx11-cann<XY>-...`) are only chosen by the `kernels` loader
on an Ascend host, so there torch_npu must import and a failure is an error worth seeing. The
`torch-universal` build runs anywhere: without torch_npu it keeps to the eager math.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType

import torch

from ._build import REQUIRES_TORCH_NPU
from ._internals import functorch_transform


def _import_torch_npu() -> ModuleType | None:
    try:
        return importlib.import_module("torch_npu")
    except ImportError:
        if REQUIRES_TORCH_NPU:
            raise
        return None


torch_npu = _import_torch_npu()

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""The floating-point dtypes the fused torch_npu ops of the cards take."""

MIXED_ADD_DTYPES = (torch.float16, torch.bfloat16)
"""The dtypes torch_npu adds to a float32 tensor as one aclnnAdd, one mixed-dtype Add kernel without a Cast
(hicann/ops-math@3b62132:math/add/op_host/op_api/aclnn_add.cpp, `isAddMixDtypeSupport`; docs/torch-npu-ops.md)."""


def soc_name(device: torch.device | None = None) -> str:
    """The SoC name of an npu device (`torch.npu.get_device_name`: CANN's `aclrtGetSocName`, e.g. "Ascend910B3").

    Read once per device: a card that checks the product on every call (npu-rms-norm's one-kernel form) asks the
    driver once, not per norm."""
    return _soc_name_of(torch.npu.get_device_name, device)


@functools.cache
def _soc_name_of(reader: Callable[..., str], device: torch.device | None) -> str:
    """`reader(device)`, cached per reader too, so that another reader (a test's patched one) is asked afresh."""
    return reader(device)


ATLAS_A2_A3_SOCS = ("Ascend910B", "Ascend910_93")
"""The SoC name prefixes (`soc_name`) of Atlas A2 (Ascend910B*) and Atlas A3 (Ascend910_93*): the products the docs of
npu_gemma_rms_norm, npu_moe_gating_top_k and npu_moe_gating_top_k_softmax_v2 list (支持的型号 / 产品支持情况); the
Atlas training and inference series (Ascend910A/ProB, Ascend310P) and Ascend 950 are not listed."""


def atlas_a2_a3_unavailable_reason(op: str, device: torch.device) -> str | None:
    """Why `op`, documented on Atlas A2/A3 only, cannot run on this device's SoC, or None when it can."""
    soc = soc_name(device)
    if soc.startswith(ATLAS_A2_A3_SOCS):
        return None
    return f"{op} runs on Atlas A2/A3 only (SoC Ascend910B*, Ascend910_93*), this device is {soc}"


def keepable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a copy of it when it is an inference tensor, which autograd refuses to keep for backward.

    An input made under torch.inference_mode (inputs_embeds of a frozen encoder, a router run there) reaches a fused
    op that keeps its inputs for backward; eager keeps only tensors it made from it, and answers."""
    return tensor.clone() if tensor.is_inference() else tensor


_DTENSOR_MODULE = "torch.distributed.tensor"


def is_dtensor(t: torch.Tensor) -> bool:
    """A DTensor (tensor parallel, or FSDP2's sharded parameter outside its forward), without importing it."""
    return type(t).__module__.startswith(_DTENSOR_MODULE)


_PLAIN_ON_NPU: set[tuple[type, torch.device]] = set()
"""The (tensor class, device) pairs seen to be a plain tensor on an npu device: a set lookup per tensor on each call
(a class never becomes a DTensor, and a torch.device is a value)."""


def npu_unavailable_reason(*tensors: torch.Tensor) -> str | None:
    """Why the fused torch_npu op cannot run on these tensors, or None when it can."""
    if torch_npu is None:
        return "torch_npu is not installed (torch-universal build on a host without an NPU)"
    transform = functorch_transform()
    if transform is not None:
        return (
            f"torch.func's {transform} transform is active: the fused path's autograd Functions and device ops are "
            "not transformed by torch.func, so eager's math runs (which torch.func transforms as it does eager's)"
        )
    for t in tensors:
        seen = (type(t), t.device)
        if seen in _PLAIN_ON_NPU:
            continue
        if is_dtensor(t):
            return (
                f"a DTensor ({', '.join(map(str, t.placements))}): the fused op has no sharding rule, so the "
                "eager math runs on the DTensor (tensor parallel)"
            )
        if t.device.type != "npu":
            return f"tensor on {t.device.type}, not on an npu device"
        _PLAIN_ON_NPU.add(seen)
    return None
