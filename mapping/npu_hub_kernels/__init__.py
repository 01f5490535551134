"""npu-hub-kernels: fused Ascend NPU kernels from the Hugging Face Hub, swapped into transformers models.

    from npu_hub_kernels import register_npu_kernels
    register_npu_kernels()                       # the cards of the default org, version 1
    model = AutoModelForCausalLM.from_pretrained(path, device_map="npu", use_kernels=True)

or `apply_npu_kernels(model)` on a model already built; `swapped_modules(model)` reports what runs
where; `pack_gate_up(model)` packs split gated MLPs ahead of time (before DDP wraps the model).
`npu_hub_kernels.emulation` runs the NPU path on a CPU-only machine.
"""

from .cards import CARDS, DEFAULT_ORG, ORG_ENV
from .registry import (
    Swap,
    apply_npu_kernels,
    available_kernels,
    pack_gate_up,
    register_npu_kernels,
    select_kernels,
    swapped_modules,
    unregister_npu_kernels,
)

__all__ = [
    "CARDS",
    "DEFAULT_ORG",
    "ORG_ENV",
    "Swap",
    "apply_npu_kernels",
    "available_kernels",
    "pack_gate_up",
    "register_npu_kernels",
    "select_kernels",
    "swapped_modules",
    "unregister_npu_kernels",
]
