"""The attention cards (a card with no layers, npu-fused-attention): a transformers attention implementation.

transformers 5 calls a model's attention function `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]` in every
attention layer, and builds its masks with `ALL_MASK_ATTENTION_FUNCTIONS[...]` under the same name.
`register_attention` registers the card's `fused_attention` and `fused_attention_mask` there under the card's kernel
id (a name with neither "flash", which transformers routes to its own flash-attention code, nor "/", which it takes
for a Hub repository), each loaded from the card's repository, digest-checked, at its first call. Users then pick it
with `from_pretrained(..., attn_implementation="npu_fused_attention")` or
`model.set_attn_implementation("npu_fused_attention")`.

`use_fused_attention` is what `apply_npu_kernels` does with the card: it selects it for a model whose attention is
transformers' default ("sdpa") and whose attention classes are all in the card's `FUSED` table, with installed code
the parity tests proved on some transformers release (`models.fingerprints`, as for every card); it keeps any other
choice (an explicit "eager", "flash_attention_2", another registered function) and says so. To keep sdpa, leave the
card out of the selection (`kernels=[...]` without "npu_fused_attention").

An explicit `attn_implementation="sdpa"` cannot be told from the default on transformers 5.22.2: the model's
`__init__` writes the resolved default, "sdpa", into `config._attn_implementation_internal`, the value an explicit
"sdpa" leaves there, nothing else records the request, and the config does not serialize the field. So the rule
keeps "sdpa" where a choice of it is visible, and otherwise selects the card (the same math, fused):
- another library installed its own function under "sdpa" in transformers' `ALL_ATTENTION_FUNCTIONS` (DeepSpeed's
  Ulysses sequence parallelism does, registered with "sdpa"): the card would bypass it (no all-to-all: each rank
  would attend over its own shard only), so sdpa is kept;
- `accelerate launch` configures DeepSpeed sequence parallelism naming another attention
  (PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION, `sequence_parallel.from_environment`): kept, as DeepSpeed would
  refuse the card there.
A sequence-parallel configuration made in Python is not visible here: when it names "sdpa", DeepSpeed refuses the
card at `accelerator.prepare` (a loud error); the doctor says what to do
(`sequence_parallel.sequence_parallel_mismatch`) and `set_sequence_parallel_attention` names the card in it.

`attention_modules` says, per attention module of a model that selected the card, the form its last call fused or
why it ran eager (the doctor shows it).

`flash_attention_drops` says when a model on the npu runs transformers' built-in `flash_attention_2`, which on an npu
host drops sliding windows and attention sinks without a word (docs/models.md#npu-fused-attention).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kernels import LayerRepository, LocalLayerRepository
from torch import nn

from .cards import CARDS, Card
from .integrity import load_checked_kernel
from .models import ATTENTION_FUNCTION, fingerprints, table_of
from .sequence_parallel import from_environment

logger = logging.getLogger(__name__)

MASK_FUNCTION = "fused_attention_mask"
DEFAULT_IMPLEMENTATION = "sdpa"
"""The attention transformers gives a model nobody chose one for: the only one `use_fused_attention` replaces."""


def is_attention_card(card: Card) -> bool:
    """Whether the card is an attention implementation (it has no kernelized layers)."""
    return not card.layers


class CardFunction:
    """A function of a card package, imported from the card's repository (digest-checked) at its first call."""

    def __init__(self, repository: LayerRepository | LocalLayerRepository, name: str) -> None:
        self.repository = repository
        self.name = name
        self.function: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.function is None:
            self.function = getattr(load_checked_kernel(self.repository), self.name)
        return self.function(*args, **kwargs)


def register_attention(card: Card, repository: LayerRepository | LocalLayerRepository) -> None:
    """Register the card's attention and mask functions in transformers under the card's kernel id."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(card.kernel_id, CardFunction(repository, ATTENTION_FUNCTION))
    AttentionMaskInterface.register(card.kernel_id, CardFunction(repository, MASK_FUNCTION))


def class_path(cls: type) -> str | None:
    """A class's path relative to `transformers.models` (as the tables name classes), None for another package's."""
    prefix = "transformers.models."
    return f"{cls.__module__.removeprefix(prefix)}.{cls.__qualname__}" if cls.__module__.startswith(prefix) else None


def attention_kept_reason(model: nn.Module, card: Card) -> str | None:
    """Why `apply_npu_kernels` keeps `model`'s attention instead of the card's, or None when it selects the card."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current is None or not hasattr(model, "set_attn_implementation"):
        return "not a transformers model with an attention implementation"
    if current == card.kernel_id:
        return None
    if current != DEFAULT_IMPLEMENTATION:
        return (
            f'its attn_implementation is "{current}", not transformers\' default "{DEFAULT_IMPLEMENTATION}": kept as '
            f'chosen (set attn_implementation="{card.kernel_id}" to use the card)'
        )
    chosen = _sdpa_chosen_reason(card)
    if chosen is not None:
        return chosen
    table = table_of(card)
    classes = {class_path(type(module)): type(module) for module in model.modules()}
    classes.pop(None, None)
    left_out = sorted(set(classes) & set(table.LEFT_OUT))
    if left_out:
        return f"{left_out[0]} is left out of the card's table: {table.LEFT_OUT[left_out[0]]}"
    fused = sorted(set(classes) & set(table.FUSED))
    if not fused:
        return "no attention class of the card's table"
    for path in fused:
        reason = fingerprints.unproven_reason(card, path, classes[path])
        if reason is not None:
            return reason
    return None


def _sdpa_chosen_reason(card: Card) -> str | None:
    """Why "sdpa" is visibly someone's choice (see the module docstring), or None."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    installed = ALL_ATTENTION_FUNCTIONS[DEFAULT_IMPLEMENTATION]
    if installed is not sdpa_attention_forward:
        return (
            f'"{DEFAULT_IMPLEMENTATION}" runs {getattr(installed, "__module__", "?")}.'
            f"{getattr(installed, '__qualname__', type(installed).__name__)}, which another library installed over "
            "transformers' (DeepSpeed's Ulysses sequence parallelism wraps the attention it was registered with): "
            f'kept, the card would bypass it. To use the card, register sequence parallelism with "{card.kernel_id}" '
            "(npu_hub_kernels.set_sequence_parallel_attention) after apply_npu_kernels"
        )
    configured = from_environment()
    if configured is not None and configured[1] not in (None, card.kernel_id):
        return (
            f'accelerate launch configures DeepSpeed sequence parallelism with "{configured[1]}" '
            f"(PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION), which DeepSpeed requires of the model's attention: kept. To "
            f"use the card, leave that setting unset and call npu_hub_kernels.set_sequence_parallel_attention"
        )
    return None


def use_fused_attention(model: nn.Module, card: Card) -> bool:
    """Select the card's attention for `model` where `attention_kept_reason` says so; return whether it did."""
    reason = attention_kept_reason(model, card)
    if reason is not None:
        logger.info("%s keeps its attention: %s", type(model).__name__, reason)
        return False
    if model.config._attn_implementation != card.kernel_id:
        model.set_attn_implementation(card.kernel_id)
    return True


def flash_attention_drops(model: nn.Module, kernel_id: str) -> str | None:
    """The warning for a model on the npu whose transformers flash_attention_2 drops its windows or sinks, or None."""
    current = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
    first = next(model.parameters(), None)
    if "flash" not in current or first is None or first.device.type != "npu":
        return None
    dropped = []
    if any(_has_sliding_layers(config) for config in _configs(model.config)):
        dropped.append("sliding windows")
    if any(hasattr(module, "sinks") for module in model.modules()):
        dropped.append("attention sinks")
    if not dropped:
        return None
    return (
        f'{type(model).__name__} uses attn_implementation="{current}" on the npu, where transformers\' built-in NPU '
        f"flash attention drops {' and '.join(dropped)} without a word (plain causal attention, different results): "
        f'use attn_implementation="{kernel_id}" (npu_hub_kernels.register_npu_kernels() registers it)'
    )


def _configs(config: object) -> list[object]:
    """A model config and its sub-configs (text_config, ...), depth first."""
    subs = [getattr(config, name, None) for name in getattr(config, "sub_configs", {})]
    return [config, *(nested for sub in subs if sub is not None for nested in _configs(sub))]


def _has_sliding_layers(config: object) -> bool:
    """Whether a config gives some attention layer a sliding window (its layer_types say which, where it has them)."""
    if not getattr(config, "sliding_window", None):
        return False
    layer_types = getattr(config, "layer_types", None)
    return layer_types is None or "sliding_attention" in layer_types


@dataclass(frozen=True)
class AttentionRun:
    """An attention module of a model that selected the attention card, with what its last call ran.

    `form`: the form its last fused call computed ("causal, window 4, TND of 3 sequences"), None when none fused;
    `eager_reason`: why its last call ran the model's eager attention (None when it fused, or has not run);
    `eager_calls`: every reason its calls ran eager for, with how many."""

    module: str
    module_class: str
    form: str | None
    eager_reason: str | None
    eager_calls: tuple[tuple[str, int], ...] = ()


def attention_modules(model: nn.Module) -> list[AttentionRun]:
    """What the attention card ran in each attention module of `model`, and why eager where it did.

    The modules listed: those the card recorded a call of, and those of the classes its table decides (`FUSED`,
    `LEFT_OUT`), named as `named_modules` names them. Empty when the model's attention is not an attention card's."""
    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    cards = [card for card in CARDS.values() if is_attention_card(card) and card.kernel_id == current]
    if not cards:
        return []
    package = _loaded_package(cards[0])
    forms, fallbacks = (None, None) if package is None else (sys.modules[f"{package}.{part}"] for part in _RECORDS)
    table = table_of(cards[0])
    decided = set(table.FUSED) | set(table.LEFT_OUT)
    runs = []
    for name, module in model.named_modules():
        form = None if forms is None else forms.last_form(module)
        record = None if fallbacks is None else fallbacks.eager_record(module)
        if form is None and record is None and class_path(type(module)) not in decided:
            continue
        runs.append(
            AttentionRun(
                module=name or "<root>",
                module_class=type(module).__name__,
                form=None if record is not None and record.last is not None else form,
                eager_reason=None if record is None else record.last,
                eager_calls=() if record is None else tuple(record.counts.items()),
            )
        )
    return runs


_RECORDS = ("fused_attention", "_fallbacks")
"""The modules of an attention card's build that record each module's last form and its eager calls."""


def _loaded_package(card: Card) -> str | None:
    """The name of the card's build package registered in transformers, imported by a first call; None before."""
    from transformers import AttentionInterface

    function = AttentionInterface._global_mapping.get(card.kernel_id)
    loaded = getattr(function, "function", None)
    return None if loaded is None else loaded.__module__.rpartition(".")[0]
