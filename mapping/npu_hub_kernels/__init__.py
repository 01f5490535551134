"""npu-hub-kernels: fused Ascend NPU kernels from the Hugging Face Hub, swapped into transformers models.

    from npu_hub_kernels import register_npu_kernels
    register_npu_kernels(local_dir="build")      # the cards `make build` wrote; or org="<org>" for the Hub
    model = AutoModelForCausalLM.from_pretrained(path, device_map="npu", use_kernels=True)

or `apply_npu_kernels(model)` on a model already built; `swapped_modules(model)` reports what runs
where. No card ever copies, re-points or re-lays out a parameter: DDP, FSDP2, DeepSpeed, accelerate and
safetensors see the model's own weights.

What lives where:
- `cards`: the cards by kernel id, read from each card's card.toml;
- `models/`: which transformers classes each card's layers replace (one module per card);
- `registry`: selecting, registering and unregistering cards, `apply_npu_kernels`;
- `retag`: how classes and rotary functions are made kernelizable under the cards' names;
- `report`: `swapped_modules`, what runs where; `kept_forwards`, the modules that keep a forward another
  library set on them (not fused, and why); `left_out_modules`, those of classes a card leaves out, and why;
- `zero3`: split MLPs as DeepSpeed ZeRO-3 leaf modules, so that they fuse under ZeRO-3;
- `sequence_parallel`: DeepSpeed Ulysses sequence parallelism with the attention card:
  `set_sequence_parallel_attention` names the card where accelerate's constructor will not;
- `tiling`: `tile_mlp`, DeepSpeed's sequence-tiled MLP (TiledMLP) around the MLP card's layer, fused per tile;
- `integrity`: the digest check of a build variant before it is imported (loader and doctor);
- `_kernels_compat`: every private `kernels` API the project uses, in one place;
- `doctor`, `offline`: `python -m npu_hub_kernels doctor`, the offline Hub cache;
- `selftest/`: `python -m npu_hub_kernels selftest` (every card against its eager math on the device, and the card
  forms that stand down where they failed) and the cases of every card it shares with the tests (`selftest/cases`);
- `testing/`: test-only helpers, never imported here: the CPU emulation of torch_npu and the "npu"
  device (docs/torch-npu-ops.md) and tiny models for tests, the demo and the bench;
- `llamafactory`: the `npu_hub` kernel plugin of LLaMA-Factory v1, registered by the top-level
  `_npu_hub_kernels_llamafactory` when LLaMA-Factory's kernel interface is imported (at once if it is).
"""

import _npu_hub_kernels_llamafactory

from .attention import AttentionRun, attention_modules
from .cards import CARDS, DEFAULT_ORG, ORG_ENV
from .registry import (
    apply_npu_kernels,
    available_kernels,
    register_npu_kernels,
    registration,
    select_kernels,
    unregister_npu_kernels,
)
from .report import KeptForward, LeftOut, Swap, kept_forwards, left_out_modules, swapped_modules
from .sequence_parallel import set_sequence_parallel_attention
from .tiling import tile_mlp

_npu_hub_kernels_llamafactory.install()

__all__ = [
    "CARDS",
    "DEFAULT_ORG",
    "ORG_ENV",
    "AttentionRun",
    "KeptForward",
    "LeftOut",
    "Swap",
    "apply_npu_kernels",
    "attention_modules",
    "available_kernels",
    "kept_forwards",
    "left_out_modules",
    "register_npu_kernels",
    "registration",
    "select_kernels",
    "set_sequence_parallel_attention",
    "swapped_modules",
    "tile_mlp",
    "unregister_npu_kernels",
]
