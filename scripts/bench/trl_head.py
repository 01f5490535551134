"""TRL's fused LM head, installed as TRL installs it, for counting on the emulated npu.

TRL's trainers do not let the model compute its loss: each sets its own LM head as the model's forward
(`trl.trainer.add_fused_lm_head`; at trl 1.16.0, trl/trainer/utils.py:1548, set on the instance at :1698; called by
SFTTrainer at trl/trainer/sft_trainer.py:1144 and DPOTrainer at trl/trainer/dpo_trainer.py:960, and by KTO, GRPO and
RLOO). The head runs the backbone, reads `lm_head.weight` (`get_output_embeddings()`, utils.py:1623) without calling
the lm_head, and scores the next-token labels with TRL's own `ChunkedLogProbFunction` (imported by name at
utils.py:60, called at :1644) in tiles of 4,096 tokens by 32,768 words. Its fused fold of a tile (Triton) runs only
where `_use_triton` is true (trl/kernels/chunked_logprob.py:48-49: Triton installed and the device cuda or xpu). On any
other device, the npu included, each tile is folded by torch ops, and the backward sums its gradients with float32
`addmm_` on float32 copies of the tiles' operands (`_addmm_fp32`, chunked_logprob.py:52-62). trl 1.16.0 has no option,
hook or registry that gives this head another implementation, and loads no loss kernel from the Hub (its one
`get_kernel` call, trl/experimental/async_grpo/packing.py:161-165, loads attention kernels): docs/models.md ("TRL's LM
head on the npu") gathers the evidence.

So the bench counts TRL's own head, not a copy of it: `install_head` sets it on a model built like the bench's
others, with the backbone replaced by a stand-in that returns the region's hidden states, so that what runs and is
counted is TRL's head alone, from the last hidden state to the loss, as TRL's trainers run it (labels shifted inside,
the loss TRL's SFTTrainer trains on: minus the sum of the log-probabilities over the labelled tokens, divided by their
number).
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch
from torch import nn

SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")
"""The per-token outputs SFTTrainer asks of the head (trl 1.16.0: trl/trainer/sft_trainer.py:1144-1147): the
log-probabilities (its loss), the entropy and whether the label is the most likely token (its logged metrics)."""
LOSS_ONLY_OUTPUTS = ("log_probs",)
"""`add_fused_lm_head`'s default outputs: the log-probabilities alone, from which the loss is made."""


def trl_absent() -> str | None:
    """None when TRL's fused LM head can be installed here, else a sentence saying why not."""
    try:
        from trl.trainer.utils import add_fused_lm_head  # noqa: F401
    except ImportError as error:
        return f"trl is not installed ({error})"
    return None


def trl_version() -> str:
    """The installed trl's version ("" without trl)."""
    try:
        return importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        return ""


class _Backbone(nn.Module):
    """Stands in for a model's base model: returns the given last hidden state, whatever it is called with; keeps the
    input embeddings, which transformers' `get_output_embeddings` looks up before it returns the lm_head."""

    def __init__(self, hidden_states: torch.Tensor, embeddings: nn.Module) -> None:
        super().__init__()
        self.hidden_states = hidden_states
        self.embed_tokens = embeddings

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=self.hidden_states)


def install_head(model: nn.Module, hidden_states: torch.Tensor, outputs: tuple[str, ...]) -> None:
    """Set TRL's fused LM head as `model`'s forward, as TRL's trainers do, computing `outputs`, over a base model that
    returns `hidden_states` [batch, seq, hidden] (the model's own base model is replaced, in place)."""
    from trl.trainer.utils import add_fused_lm_head

    base = getattr(model, model.base_model_prefix)
    setattr(model, model.base_model_prefix, _Backbone(hidden_states, base.get_input_embeddings()))
    add_fused_lm_head(model, outputs=outputs)


def head_loss(model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """The loss of TRL's head installed on `model` (`install_head`) for `labels` [batch, seq], called as TRL's trainers
    call it (`fused_lm_head=True`): the model's labels, shifted by the head."""
    return model(labels=labels, fused_lm_head=True).loss
