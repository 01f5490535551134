"""DeepSpeed Ulysses sequence parallelism with the attention card: naming the card where accelerate will not.

DeepSpeed 0.19's `UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation=name, ...)`, which
accelerate's `Accelerator.prepare` calls for `ParallelismConfig(sp_backend="deepspeed", sp_size=N)`, refuses a model
whose `config._attn_implementation` is not `name`, takes `ALL_ATTENTION_FUNCTIONS[name]` (for the card: the
registered `CardFunction`, which calls the card's `fused_attention`), wraps it with its all-to-all over the SP group
(the wrapper drops the mask and passes the gathered `position_ids`) and installs the wrapper under the same name, on
transformers' shared `ALL_ATTENTION_FUNCTIONS` (an instance entry, over the class-wide registration).

accelerate 1.15 names `name` in `DeepSpeedSequenceParallelConfig.sp_attn_implementation`, whose constructor accepts
only "flash_attention_2", "flash_attention_3", "sdpa" or a Hub flash-attn kernel ("org/flash-attn..."), also when it
comes from `accelerate launch` (PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION); left unset, it passes None, which
DeepSpeed refuses as a mismatch. The field is a plain dataclass field, checked only at construction:
`set_sequence_parallel_attention` sets it on the configuration object the run will use, never on accelerate's
classes. `sequence_parallel_mismatch` says what to do when the names differ (the doctor shows it).
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

from torch import nn

from .cards import CARDS

T = TypeVar("T")

CARD_ATTENTION = next(card.kernel_id for card in CARDS.values() if not card.layers)
"""The attention card's kernel id (npu_fused_attention): what `set_sequence_parallel_attention` names by default."""
REFUSED = ("eager", "paged|eager", "flex_attention")
"""Attentions accelerate or DeepSpeed refuse under Ulysses: eager needs the dense mask Ulysses drops, and accelerate
1.15 refuses flex_attention."""
ENVIRONMENT = (
    "PARALLELISM_CONFIG_SP_SIZE",
    "PARALLELISM_CONFIG_SP_BACKEND",
    "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION",
)
"""What `accelerate launch` passes each process (with ACCELERATE_USE_PARALLELISM_CONFIG=true); a ParallelismConfig
made without arguments reads them."""


def set_sequence_parallel_attention(target: T, attention: str | nn.Module = CARD_ATTENTION) -> T:
    """Name `attention` as the attention DeepSpeed's Ulysses sequence parallelism wraps in `target`; return `target`.

    Args:
        target: where the run's sequence-parallel configuration lives: `TrainingArguments` (its
            `parallelism_config`), a `Trainer` or an `Accelerator` (the accelerator's, before `train()` /
            `prepare`), accelerate's `ParallelismConfig`, or its `DeepSpeedSequenceParallelConfig` itself.
        attention: an attention name registered in transformers' `ALL_ATTENTION_FUNCTIONS`, or a model, whose
            `config._attn_implementation` it takes (what DeepSpeed compares against); the card's kernel id by
            default (`register_npu_kernels()` or `apply_npu_kernels` registers it).

    Raises:
        ValueError: `target` configures no DeepSpeed sequence parallelism (sp_size 1, another backend), or
            `attention` is not registered or is one Ulysses refuses (eager, flex_attention).
        TypeError: `target` is none of the objects above.
    """
    name = _attention_name(attention)
    _refuse(name)
    handler = _sp_handler(target, create=True)
    if handler is None:
        raise ValueError(
            f"{type(target).__name__} configures no DeepSpeed sequence parallelism (ParallelismConfig("
            'sp_backend="deepspeed", sp_size=N>1)): there is no sp_attn_implementation to set'
        )
    handler.sp_attn_implementation = name
    return target


def sequence_parallel_mismatch(model: nn.Module, target: Any = None) -> str | None:
    """What to do when sequence parallelism names another attention than `model`'s, or None when they agree.

    `target` as `set_sequence_parallel_attention` takes it; None reads what `accelerate launch` passes (ENVIRONMENT),
    when it configures DeepSpeed sequence parallelism. None too when nothing configures it."""
    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if target is None:
        configured = from_environment()
        if configured is None:
            return None
        sp_size, named = configured
        where = "accelerate launch (PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION)"
    else:
        handler = _sp_handler(target)
        if handler is None:
            return None
        sp_size, named = _sp_size(target), handler.sp_attn_implementation
        where = type(target).__name__
    if current is None or named == current:
        return None
    said = f'"{named}"' if named else "unset"
    fix = (
        f"call npu_hub_kernels.set_sequence_parallel_attention(<your TrainingArguments, Trainer or ParallelismConfig>, "
        f'model) before training: it sets sp_attn_implementation="{current}" on that object'
    )
    if current == CARD_ATTENTION:
        fix += (
            f' (accelerate\'s DeepSpeedSequenceParallelConfig refuses "{current}" in its constructor and from '
            "accelerate launch: leave it unset there)"
        )
    keep = f'; or, to run "{named}" instead, model.set_attn_implementation("{named}")' if named else ""
    return (
        f"DeepSpeed sequence parallelism (sp_size {sp_size}, {where}) wraps attention {said}, but the model's "
        f'attention is "{current}": DeepSpeed refuses the mismatch at accelerator.prepare. To use the model\'s, {fix}'
        f"{keep}."
    )


def _attention_name(attention: str | nn.Module) -> str:
    if isinstance(attention, str):
        name = attention
    else:
        name = getattr(getattr(attention, "config", None), "_attn_implementation", None)
        if not isinstance(name, str):
            raise ValueError(f"{type(attention).__name__} has no config._attn_implementation to take")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name not in REFUSED and name not in ALL_ATTENTION_FUNCTIONS:
        hint = " (npu_hub_kernels.register_npu_kernels() registers it)" if name == CARD_ATTENTION else ""
        raise ValueError(f'attention "{name}" is not registered in transformers\' ALL_ATTENTION_FUNCTIONS{hint}')
    return name


def _refuse(name: str) -> None:
    if name in REFUSED:
        raise ValueError(
            f'DeepSpeed\'s Ulysses sequence parallelism cannot wrap attention "{name}": it drops the dense mask eager '
            f'needs, and accelerate refuses flex_attention. Use "{CARD_ATTENTION}" or "sdpa"'
        )


def _parallelism_config(target: Any) -> Any:
    """The ParallelismConfig `target` holds (itself for one), None when it holds none."""
    if hasattr(target, "sp_handler"):
        return target
    if hasattr(target, "accelerator") and hasattr(target.accelerator, "parallelism_config"):  # a Trainer
        return target.accelerator.parallelism_config
    if hasattr(target, "parallelism_config"):  # TrainingArguments, an Accelerator
        return target.parallelism_config
    raise TypeError(
        f"{type(target).__name__} holds no sequence-parallel configuration: pass TrainingArguments, a Trainer, an "
        "Accelerator, a ParallelismConfig or a DeepSpeedSequenceParallelConfig"
    )


def _sp_handler(target: Any, create: bool = False) -> Any:
    """The DeepSpeedSequenceParallelConfig of `target`, None when it configures no DeepSpeed sequence parallelism.

    With `create`, a ParallelismConfig given sp_size after its construction gets the handler it would have made."""
    if hasattr(target, "sp_attn_implementation"):
        return target
    config = _parallelism_config(target)
    if config is None or getattr(config, "sp_backend", None) != "deepspeed" or (config.sp_size or 1) <= 1:
        return None
    if config.sp_handler is None and create:
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        config.sp_handler = DeepSpeedSequenceParallelConfig()
    return config.sp_handler


def _sp_size(target: Any) -> int | str:
    if hasattr(target, "sp_attn_implementation"):
        return "as configured"
    return _parallelism_config(target).sp_size


def from_environment() -> tuple[int, str | None] | None:
    """(sp_size, attention) from what `accelerate launch` passes, None when it configures no DeepSpeed SP."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return None
    size_name, backend_name, attention_name = ENVIRONMENT
    sp_size = int(os.environ.get(size_name, "1"))
    if sp_size <= 1 or os.environ.get(backend_name, "deepspeed") != "deepspeed":
        return None
    return sp_size, os.environ.get(attention_name) or None
