"""npu-linear-cross-entropy's bench spec (the contract: scripts/bench/cards/__init__.py).

The region is the model's lm_head and loss, after the last decoder layer: `logits = h @ W^T` [T, V], then
transformers' ForCausalLMLoss (float32 logits, shifted labels, cross-entropy). It is not a region of a decoder
layer, so the spec declares it (`OUTSIDE_REGION`, counted by `bench.outside` like a layer's regions, for Llama-3-8B
and Qwen3-8B at batch 1 x 512, 1 x 2048 and 8 x 4096, forward+backward), with the chunk sizes of its chunk table (the
chunk size traded against re-reading W) and TRL's fused LM head as an extra column.

Floor: 1 op forward, one fused kernel reading h, W and the labels once and writing the loss and the
log-sum-exp of each token (float32 [T], what a backward needs not to keep the logits). Backward: 1 op reading h, W,
the labels, the log-sum-exps and the loss gradient, recomputing the logits on chip, and writing dL/dh and dL/dW.

What the card runs beyond it (the module doc of the card's loss.py): below 2 tokens per unit of hidden size, the
log-probability form (per chunk of at most 200,000 tokens: the logits in the model dtype and in float32, then
npu_cross_entropy_loss keeping its float32 log-probabilities, as eager keeps its log-softmax, and the op's own
backward), which moves fewer bytes than eager and holds what eager holds. From there on, the chunked form, per chunk
of C tokens: the logits twice as above, npu_cross_entropy_loss writing float32 log-probabilities [C, V], its backward
writing the float32 gradient [C, V] (grad_loss in log_prob's dtype, as the op requires), cast once to the model dtype
for dL/dh, and two matmuls; W is read twice per chunk and the float32 dL/dW read and written once per chunk. So the
bytes fall as chunks grow (W re-read less often) while the peak of live bytes rises (the chunk's [C, V] buffers): the
chunk table shows that trade for the default chunk (1.15 x the hidden size) and CHUNK_SWEEP at 8 x 4096.

TRL's fused LM head. TRL's trainers do not let the model compute its loss: each sets its own LM head as the model's
forward (`trl.trainer.add_fused_lm_head`; at trl 1.16.0, trl/trainer/utils.py:1548, set on the instance at :1698;
called by SFTTrainer at trl/trainer/sft_trainer.py:1144 and DPOTrainer at trl/trainer/dpo_trainer.py:960, and by KTO,
GRPO and RLOO). The head runs the backbone, reads `lm_head.weight` (`get_output_embeddings()`, utils.py:1623) without
calling the lm_head, and scores the next-token labels with TRL's own `ChunkedLogProbFunction` (imported by name at
utils.py:60, called at :1644) in tiles of 4,096 tokens by 32,768 words. Its fused fold of a tile (Triton) runs only
where `_use_triton` is true (trl/kernels/chunked_logprob.py:48-49: Triton installed and the device cuda or xpu). On any
other device, the npu included, each tile is folded by torch ops, and the backward sums its gradients with float32
`addmm_` on float32 copies of the tiles' operands (`_addmm_fp32`, chunked_logprob.py:52-62). trl 1.16.0 has no option,
hook or registry that gives this head another implementation, and loads no loss kernel from the Hub (its one
`get_kernel` call, trl/experimental/async_grpo/packing.py:161-165, loads attention kernels): docs/models.md ("TRL's LM
head on the npu") gathers the evidence. So under TRL the region is TRL's head, which the card cannot replace.

The bench counts TRL's own head, not a copy of it (the extra column, `TRL_HEAD`): `install_head` sets it on the
model, with the backbone replaced by a stand-in that returns the region's hidden states, so that what runs and is
counted is TRL's head alone, from the last hidden state to the loss, as TRL's trainers run it (labels shifted inside,
the loss TRL's SFTTrainer trains on: minus the sum of the log-probabilities over the labelled tokens, divided by their
number), one study per entry of TRL_STUDIES.

The targets (issue 26): bytes and peak live bytes at most eager's at every measured size (batch 1 x 512, 1 x 2048
and 8 x 4096), and the peak at most 1/8 of eager's at 8 x 4096.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch
from torch import nn

from ..accounting import FusedOp, empty_of, tensor_bytes
from ..floors import Floor, dense_bytes
from . import CountedTarget, ExtraColumn, OutsideRegion, RegionCall, Run

PEAK_SHARE = 1 / 8
"""Issue 19: the loss region's peak of live bytes at most 1/8 of eager's, batch 8 x 4096, forward+backward."""
SHAPE = (8, 4096)
SHAPES = ((1, 512), (1, 2048), SHAPE)
"""The measured (batch, sequence): micro-batches people fine-tune with, and issue 19's large batch."""
MODELS = {"llama-3-8b": 128_256, "qwen3-8b": 151_936}
"""The measured models (scripts/bench/configs.py CONFIGS keys) and their vocabulary (`vocab_size` of
meta-llama/Meta-Llama-3-8B's and Qwen/Qwen3-8B's config.json)."""
CHUNK_SWEEP = (1024, 2048, 4096, 8192)
"""Tokens per chunk of the chunk table, besides the default (`default_chunk_tokens` of the card)."""
SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")
"""The per-token outputs SFTTrainer asks of TRL's head (trl 1.16.0: trl/trainer/sft_trainer.py:1144-1147): the
log-probabilities (its loss), the entropy and whether the label is the most likely token (its logged metrics)."""
LOSS_ONLY_OUTPUTS = ("log_probs",)
"""`add_fused_lm_head`'s default outputs: the log-probabilities alone, from which the loss is made."""
TRL_STUDIES = {"TRL head": SFT_OUTPUTS, "TRL head, log-probs only": LOSS_ONLY_OUTPUTS}
"""The studies of TRL's fused LM head on the region, by the per-token outputs it computes: as SFTTrainer sets it
(log-probabilities, entropy, top-1), and with the log-probabilities alone (the loss and no more)."""


def floor(lm_head: nn.Module, hidden_states: torch.Tensor, labels: torch.Tensor, *_) -> Floor:
    """One fused kernel each way (see the module doc)."""
    tokens = hidden_states.numel() // hidden_states.shape[-1]
    reads = tensor_bytes(hidden_states) + tensor_bytes(lm_head.weight) + tensor_bytes(labels)
    lse = tokens * 4
    fwd = reads + 4 + lse
    bwd = reads + lse + 4 + dense_bytes(hidden_states) + dense_bytes(lm_head.weight)
    return (1, fwd), (1, bwd)


def floor_saved(lm_head: nn.Module, hidden_states: torch.Tensor, labels: torch.Tensor, *_) -> int:
    """The floor keeps the log-sum-exp of each token (float32 [T]) for backward; h, W and the labels are inputs."""
    return hidden_states.numel() // hidden_states.shape[-1] * 4


COUNTED_TARGETS = (
    CountedTarget("bytes", ("fwd+bwd",), 1, against="eager"),
    CountedTarget("peak bytes", ("fwd+bwd",), 1, against="eager"),
    CountedTarget("peak bytes", ("fwd+bwd",), PEAK_SHARE, SHAPE, against="eager"),
)


def _loss_outputs(a: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    x = a["input"]
    loss_shape = (x.shape[0],) if a["reduction"] == "none" else (1,)
    return empty_of(x, loss_shape), empty_of(x), empty_of(x, (0,)), empty_of(x, (0,))


FUSED_OPS = {
    "npu_cross_entropy_loss": FusedOp(_loss_outputs, ("input",), lambda a, out: [out[1], a["target"]]),
    "npu_cross_entropy_loss_backward": FusedOp(lambda a: empty_of(a["log_prob"], dtype=a["grad_loss"].dtype)),
}

HOST_TIMING = None
"""Not timed on the host: its layer is the whole *ForCausalLM forward, which at decode (no labels) makes one decision
and runs the class's own forward; a bare replay of the model's ops would charge the card with transformers' Python."""


def _inputs(lm_head: nn.Module, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The region's inputs: the last hidden states [batch, seq, hidden] (differentiated) and the labels."""
    hidden = torch.empty(batch, seq, lm_head.in_features, dtype=lm_head.weight.dtype, device="npu")
    labels = torch.empty(batch, seq, dtype=torch.int64, device="npu")
    return hidden.requires_grad_(), labels


def _eager(call: RegionCall) -> Run:
    """Run transformers' path: the logits, then ForCausalLMLoss (the card package's eager form).

    The logits stay referenced (the model's output) until the step ends."""
    hidden, labels = call.inputs
    return lambda: call.package.linear_cross_entropy_eager(hidden, call.module, labels, call.module.out_features)


def _card(call: RegionCall) -> Run:
    """The card's loss at `call.chunk` tokens per chunk (None: the form and chunks it picks)."""
    hidden, labels = call.inputs
    vocab = call.module.out_features
    return lambda: call.package.linear_cross_entropy(hidden, call.module, labels, vocab, chunk_tokens=call.chunk)


def _default_chunk(call: RegionCall) -> int:
    """Return the tokens per chunk the card picks by default.

    That is all of them in the log-probability form (one chunk at most 200,000 tokens), else its default chunk."""
    hidden = call.inputs[0]
    tokens, hidden_size = hidden.numel() // hidden.shape[-1], hidden.shape[-1]
    if not call.package.chunked_form_pays(tokens, hidden_size, True):
        return min(tokens, 200_000)
    return call.package.default_chunk_tokens(tokens, hidden_size)


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
    """Stands in for a model's base model: returns the given last hidden state, whatever it is called with.

    It keeps the input embeddings, which transformers' `get_output_embeddings` looks up before it returns the
    lm_head."""

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
    """Set TRL's fused LM head as `model`'s forward, over a base model returning given hidden states.

    This is done as TRL's trainers do, computing `outputs`, over a base model that returns `hidden_states` [batch, seq,
    hidden] (the model's own base model is replaced, in place)."""
    from trl.trainer.utils import add_fused_lm_head

    base = getattr(model, model.base_model_prefix)
    setattr(model, model.base_model_prefix, _Backbone(hidden_states, base.get_input_embeddings()))
    add_fused_lm_head(model, outputs=outputs)


def head_loss(model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """Return the loss of TRL's head installed on `model` (`install_head`) for `labels` [batch, seq].

    It is called as TRL's trainers call it (`fused_lm_head=True`): the model's labels, shifted by the head."""
    return model(labels=labels, fused_lm_head=True).loss


def _trl(call: RegionCall, study: str) -> Run:
    """Run TRL's head on the call's model, computing the outputs of `study` (TRL_STUDIES).

    It computes them from the region's hidden states, lm_head and labels: the loss SFTTrainer trains on."""
    hidden, labels = call.inputs
    install_head(call.model, hidden, TRL_STUDIES[study])
    return lambda: (head_loss(call.model, labels),)


def _trl_title() -> str:
    """The title of the TRL column's table, with the installed trl's version."""
    return (
        f"Counted, the lm_head + loss region under TRL (trl {trl_version()}), forward+backward, bfloat16: "
        "transformers' eager loss (the logits, then ForCausalLMLoss), the card's (npu-linear-cross-entropy), and TRL's "
        "fused LM head, which TRL's trainers set as the model's forward (`add_fused_lm_head`): under TRL it is the "
        "head that runs, and the card does not (`kept_forwards` names it). On the npu TRL's head runs its torch "
        "fallback (its Triton fold is for cuda and xpu only) and computes more than the loss: per-token "
        "log-probabilities and, as SFTTrainer sets it, the entropy and whether each label is the top-1 token. No "
        "public hook gives TRL's head another implementation (docs/models.md, section TRL's LM head on the npu):"
    )


TRL_HEAD = ExtraColumn(
    name="TRL",
    label="TRL's fused LM head",
    studies={"TRL head": "log-probs, entropy, top-1 (SFTTrainer's)", "TRL head, log-probs only": "log-probs only"},
    header="TRL's head computes",
    run=_trl,
    absent=trl_absent,
    title=_trl_title,
)
"""TRL's fused LM head beside eager and the card, as it runs on the npu (its torch fallback), one study per entry of
TRL_STUDIES."""

OUTSIDE_REGION = OutsideRegion(
    models={key: {"vocab_size": vocab} for key, vocab in MODELS.items()},
    module="lm_head",
    inputs=_inputs,
    shapes=SHAPES,
    quick_shapes=SHAPES[:1],
    eager=_eager,
    kernelized=_card,
    default_chunk=_default_chunk,
    chunks=CHUNK_SWEEP,
    chunk_shape=SHAPE,
    chunk_note="Larger chunks re-read W less often but hold larger [chunk, vocabulary] buffers",
    extra=TRL_HEAD,
)
