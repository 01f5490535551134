"""LLaMA-Factory v1's kernel plugin `npu_hub`: the cards, chosen where LLaMA-Factory users configure kernels.

    kernel_config:
      name: npu_hub
      include_kernels: auto   # or a comma-separated list of kernel ids: npu_fused_rmsnorm,npu_fused_rope

After loading a model (and after PEFT wraps it), LLaMA-Factory 0.9.5's ModelEngine calls
`KernelPlugin(kernel_config.name)(model=model, include_kernels=kernel_config.get("include_kernels"))`.
`_npu_hub_kernels_llamafactory` (a top-level module: run at interpreter startup by the package's `.pth` file, and
at `import npu_hub_kernels`) registers the plugin when LLaMA-Factory's kernel interface is imported: this module's
`apply_npu_hub_kernels` where the interface's registry takes functions (0.9.5), `kernel_class` where it takes classes.
This module does not import that one (the registration, the plugin's name and the registry kinds live there): the
import goes one way.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .registry import KernelSelection, apply_npu_kernels, registration, select_kernels
from .report import swapped_modules

logger = logging.getLogger(__name__)


def apply_npu_hub_kernels(model: nn.Module, include_kernels: KernelSelection = None) -> nn.Module:
    """Kernelize `model` for the npu with the cards `include_kernels` names; returns the model (kernelized in place).

    Args:
        model: the model LLaMA-Factory loaded (a PeftModel too).
        include_kernels: "auto" or True for every card, kernel ids as a list or one comma-separated string,
            None or False for none (as LLaMA-Factory's own "auto" plugin reads it). An unknown id raises.

    The cards load from where the process registered them (`register_npu_kernels(org=..., local_dir=...)`
    called before), else from the Hub ($NPU_HUB_KERNELS_ORG, else npu-hub-kernels; version 1). The mode
    (training or inference) follows `model.training`. Without an npu the model is left as it is, logged.
    """
    kernel_ids = [card.kernel_id for card in select_kernels(include_kernels)]
    if not kernel_ids:
        logger.info("npu_hub: include_kernels=%r names no kernel; the model is left as it is.", include_kernels)
        return model
    reason = npu_unavailable_reason()
    if reason is not None:
        logger.warning(
            "npu_hub: no NPU on this host (%s); the model is left as it is. The cards fuse only on Ascend NPUs.",
            reason,
        )
        return model
    model = apply_npu_kernels(model, kernels=kernel_ids, **(registration() or {}))
    logger.info(
        "npu_hub: %d modules of %s run the cards of %s.", len(swapped_modules(model)), type(model).__name__, kernel_ids
    )
    return model


def npu_unavailable_reason() -> str | None:
    """Why this host cannot run the fused NPU ops (no torch_npu, or no NPU device visible); None when it can."""
    try:
        import torch_npu  # noqa: F401
    except Exception as error:  # not installed, or installed without a working CANN
        return f"torch_npu does not import: {type(error).__name__}: {error}"
    if not torch.npu.is_available():
        return "torch.npu.is_available() is False"
    return None


def kernel_class(base_kernel: type) -> type:
    """The `npu_hub` plugin as a subclass of newer LLaMA-Factory's `BaseKernel`."""

    class NpuHubKernel(base_kernel):
        """The plugin `kernel_config: {name: npu_hub, include_kernels: ...}` names.

        Without include_kernels it applies every card (in this registry the name alone selects the plugin).
        """

        @staticmethod
        def check_device() -> None:
            """Never refuses: on a host without an npu, `_apply` leaves the model as it is and logs why."""

        @staticmethod
        def _apply(**kwargs) -> nn.Module:
            config = kwargs.get("config") or {}
            return apply_npu_hub_kernels(kwargs["model"], config.get("include_kernels", "auto"))

    return NpuHubKernel
