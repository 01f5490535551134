"""npu-linear-cross-entropy's bench spec (the contract: scripts/bench/cards/__init__.py).

The region is the model's lm_head and loss, after the last decoder layer: `logits = h @ W^T` [T, V], then
transformers' ForCausalLMLoss (float32 logits, shifted labels, cross-entropy). It is not a region of a decoder
layer, so the spec brings its own rows (`REGION_ROWS`: counted like a layer's regions, for Llama-3-8B and Qwen3-8B
at batch 8 x 4096, forward+backward) and its own table (`STUDY_TABLE`: the peak of live bytes, and the chunk size
traded against re-reading W).

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
bytes fall as chunks grow (W re-read less often) while the peak of live bytes rises (the chunk's [C, V] buffers):
`STUDY_TABLE` shows that trade for the default chunk (1.15 x the hidden size) and others at 8 x 4096.

Under TRL's trainers the region is TRL's own fused LM head, which the card cannot replace (docs/models.md, TRL's LM
head on the npu): with trl installed, `REGION_ROWS` also counts that head at each model and shape (`measure_trl`,
`bench.trl_head`; studies TRL_STUDIES, its figures in the rows' `trl` field beside eager's and the card's), and
`STUDY_TABLE` shows them after the chunk table.

The targets (issue 26): bytes and peak live bytes at most eager's at every measured size (batch 1 x 512, 1 x 2048
and 8 x 4096), and the peak at most 1/8 of eager's at 8 x 4096.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from torch import nn

from .. import trl_head
from ..accounting import FusedOp, empty_of, tensor_bytes
from ..floors import Floor, dense_bytes
from ..rows import Row, log
from ..targets import CountedTarget

PEAK_SHARE = 1 / 8
"""Issue 19: the loss region's peak of live bytes at most 1/8 of eager's, batch 8 x 4096, forward+backward."""
SHAPE = (8, 4096)
SHAPES = ((1, 512), (1, 2048), SHAPE)
"""The measured (batch, sequence): micro-batches people fine-tune with, and issue 19's large batch."""
MODELS = {"llama-3-8b": 128_256, "qwen3-8b": 151_936}
"""The measured models (scripts/bench/configs.py CONFIGS keys) and their vocabulary (`vocab_size` of
meta-llama/Meta-Llama-3-8B's and Qwen/Qwen3-8B's config.json)."""
UNITS = ("ops", "bytes", "saved bytes", "peak bytes")
CHUNK_STUDY = "loss chunks"
CHUNK_SWEEP = (1024, 2048, 4096, 8192)
"""Tokens per chunk of the trade table, besides the default (`default_chunk_tokens` of the card)."""
TRL_STUDIES = {"TRL head": trl_head.SFT_OUTPUTS, "TRL head, log-probs only": trl_head.LOSS_ONLY_OUTPUTS}
"""The studies of TRL's fused LM head on the region (`trl_head`), by the per-token outputs it computes: as SFTTrainer
sets it (log-probabilities, entropy, top-1), and with the log-probabilities alone (the loss and no more)."""
TRL_COMPUTES = {"TRL head": "log-probs, entropy, top-1 (SFTTrainer's)", "TRL head, log-probs only": "log-probs only"}


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
"""Not timed on the host: the region is a whole model's head, not a module of the Llama decoder layer the per-call
overhead and fallback rows time."""


@functools.cache
def _kernelized(model_key: str, vocab: int) -> tuple[Any, nn.Module]:
    """(the card package, the model's lm_head on the meta device) from the model kernelized for npu: built once per
    model for every measure of it (eager, the default chunk, the sweep), each of which fakes a copy of the lm_head."""
    from kernels import Mode, kernelize

    from npu_hub_kernels.report import card_package

    from ..configs import CONFIGS
    from ..counted import build_model

    spec = CONFIGS[model_key]
    model = build_model(type(spec)(spec.name, spec.model_type, dict(spec.config, vocab_size=vocab)))
    kernelize(model, mode=Mode.TRAINING, device="npu")
    package = card_package(model)
    if package is None:
        raise RuntimeError(f"{spec.name}'s CausalLM runs no card layer: is npu-linear-cross-entropy registered?")
    return package, model.lm_head


def measure(model_key: str, vocab: int, chunk_tokens: int | None, batch: int, seq: int) -> dict[str, Any]:
    """Ops, bytes and peak live bytes of the loss region, forward+backward, eager (`None` chunk: the eager path)
    or the card at `chunk_tokens` (0: its default), on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .. import memory
    from ..accounting import count_device_ops, fake_module

    fake_mode = FakeTensorMode()
    package, meta_lm_head = _kernelized(model_key, vocab)
    lm_head = fake_module(copy.deepcopy(meta_lm_head), fake_mode, "npu")  # fake_module fakes it in place
    with fake_mode:
        hidden = torch.empty(batch, seq, lm_head.in_features, dtype=lm_head.weight.dtype, device="npu")
        hidden.requires_grad_()
        labels = torch.empty(batch, seq, dtype=torch.int64, device="npu")
        asked = chunk_tokens or None  # None: the form and chunks the card picks
        if chunk_tokens is None:
            run = lambda: package.linear_cross_entropy_eager(hidden, lm_head, labels, vocab)  # noqa: E731
        else:
            run = lambda: package.linear_cross_entropy(hidden, lm_head, labels, vocab, chunk_tokens=asked)  # noqa: E731
        with memory.tracking_memory() as tracker, count_device_ops() as tally:
            loss, logits = run()  # eager's logits stay referenced (the model's output) until the step ends
            torch.autograd.grad(loss, [hidden, lm_head.weight], torch.empty_like(loss))
            del loss, logits
        floors = floor(lm_head, hidden, labels), floor_saved(lm_head, hidden, labels)
    kept = tracker.memory
    measured = {"ops": tally.ops, "bytes": tally.bytes, "saved bytes": kept.saved_bytes, "peak bytes": kept.peak_bytes}
    chunk = "eager" if chunk_tokens is None else (asked or _default_chunk(package, hidden))
    return {**measured, "floor": floors, "memory": kept, "chunk": chunk}


def _default_chunk(package: Any, hidden: torch.Tensor) -> int:
    """The tokens per chunk the card picks by default: all of them in the log-probability form (one chunk at most
    200,000 tokens), else its default chunk."""
    tokens, hidden_size = hidden.numel() // hidden.shape[-1], hidden.shape[-1]
    if not package.chunked_form_pays(tokens, hidden_size, True):
        return min(tokens, 200_000)
    return package.default_chunk_tokens(tokens, hidden_size)


@functools.cache
def _meta_model(model_key: str, vocab: int) -> nn.Module:
    """The model (one decoder layer, on the meta device, not kernelized) TRL's head is set on: a copy per measure."""
    from ..configs import CONFIGS
    from ..counted import build_model

    spec = CONFIGS[model_key]
    return build_model(type(spec)(spec.name, spec.model_type, dict(spec.config, vocab_size=vocab)))


def measure_trl(model_key: str, vocab: int, outputs: tuple[str, ...], batch: int, seq: int) -> dict[str, Any]:
    """Ops, bytes, saved and peak live bytes of TRL's fused LM head computing `outputs` (`trl_head`), forward+backward
    of the loss TRL's SFTTrainer trains on, on fake tensors on the emulated npu (where it runs its torch fallback),
    from the same hidden states, lm_head and labels as `measure`; "by op": its device ops by name."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .. import memory
    from ..accounting import count_device_ops, fake_module

    fake_mode = FakeTensorMode()
    model = copy.deepcopy(_meta_model(model_key, vocab))
    lm_head = fake_module(model.lm_head, fake_mode, "npu")  # in place: the head reads model.lm_head
    with fake_mode:
        hidden = torch.empty(batch, seq, lm_head.in_features, dtype=lm_head.weight.dtype, device="npu")
        hidden.requires_grad_()
        labels = torch.empty(batch, seq, dtype=torch.int64, device="npu")
        trl_head.install_head(model, hidden, outputs)
        with memory.tracking_memory() as tracker, count_device_ops() as tally:
            loss = trl_head.head_loss(model, labels)
            torch.autograd.grad(loss, [hidden, lm_head.weight], torch.empty_like(loss))
            del loss
    kept = tracker.memory
    measured = {"ops": tally.ops, "bytes": tally.bytes, "saved bytes": kept.saved_bytes, "peak bytes": kept.peak_bytes}
    return {**measured, "by op": tally.by_op()}


def region_rows(specs: list, quick: bool) -> list[Row]:
    """The loss region's counted rows for the measured models of MODELS, forward+backward at each of SHAPES (1 x 512
    alone with --quick): eager against the card's default (study "layer", kind the card's region, so the counted
    table and the targets take them) and, at SHAPE without --quick, at each chunk of CHUNK_SWEEP (study
    "loss chunks"); ops, bytes, peak live bytes. With trl installed, the same eager and default figures beside TRL's
    fused LM head (`trl` column) at each shape, one study per entry of TRL_STUDIES; without it, the log says so."""
    from ..cards import card_named
    from ..configs import CONFIGS
    from ..floors import floor_peak

    kind = card_named("npu-linear-cross-entropy").region
    trl_absent = trl_head.trl_absent()
    if trl_absent:
        log(f"  TRL's fused LM head: not counted ({trl_absent})")
    rows = []
    for key, vocab in MODELS.items():
        name = CONFIGS[key].name
        if CONFIGS[key] not in specs:
            continue
        for batch, seq in SHAPES[:1] if quick else SHAPES:
            eager = measure(key, vocab, None, batch, seq)
            ((fwd_ops, fwd_bytes), (bwd_ops, bwd_bytes)), saved = eager["floor"]
            default = measure(key, vocab, 0, batch, seq)
            peak = floor_peak(saved, [eager["memory"], default["memory"]])
            floors = {
                "ops": fwd_ops + bwd_ops,
                "bytes": fwd_bytes + bwd_bytes,
                "saved bytes": saved,
                "peak bytes": peak,
            }
            sweep = CHUNK_SWEEP if (batch, seq) == SHAPE and not quick else ()
            swept = [measure(key, vocab, chunk, batch, seq) for chunk in sweep]
            for fused in [default, *(m for m in swept if m["chunk"] != default["chunk"])]:
                for unit in UNITS:
                    rows.append(
                        Row("counted", name, kind, "fwd+bwd", batch, seq, eager=eager[unit], kernelized=fused[unit],
                            floor=floors[unit], unit=unit, study="layer" if fused is default else CHUNK_STUDY,
                            kind=kind, model=name, path=str(fused["chunk"]))
                    )  # fmt: skip
            for study, outputs in {} if trl_absent else TRL_STUDIES.items():
                head = measure_trl(key, vocab, outputs, batch, seq)
                for unit in UNITS:
                    rows.append(
                        Row("counted", name, kind, "fwd+bwd", batch, seq, eager=eager[unit], kernelized=default[unit],
                            floor=floors[unit], trl=head[unit], unit=unit, study=study, kind=kind, model=name,
                            path=str(default["chunk"]))
                    )  # fmt: skip
            log(f"  counted {name} lm_head + loss, batch {batch}, seq {seq}")
    return rows


REGION_ROWS = region_rows


def study_table(rows: list[Row]) -> list[str]:
    """The loss region per model: eager against the card at its default chunk and at each swept chunk, forward+
    backward: ops, bytes and peak live bytes, and whether the targets are met."""
    from ..cards import card_named
    from ..report import human_bytes, number, table

    kind = card_named("npu-linear-cross-entropy").region
    chosen = [r for r in rows if r.kind == kind and r.study in ("layer", CHUNK_STUDY) and r.unit in UNITS]
    largest = max(((r.batch, r.seq) for r in chosen), key=lambda shape: shape[0] * shape[1], default=None)
    chosen = [r for r in chosen if (r.batch, r.seq) == largest]
    body = []
    for model in dict.fromkeys(r.model for r in chosen):
        for chunk in sorted({r.path for r in chosen if r.model == model}, key=int):
            by_unit = {r.unit: r for r in chosen if (r.model, r.path) == (model, chunk)}
            ops, size, peak = (by_unit[unit] for unit in ("ops", "bytes", "peak bytes"))
            default = " (default)" if ops.study == "layer" else ""
            met = size.kernelized <= size.eager and peak.kernelized <= PEAK_SHARE * peak.eager
            body.append([
                model, f"{chunk}{default}", f"{number(ops.eager, 'ops')} / {number(ops.kernelized, 'ops')}",
                f"{human_bytes(size.eager)} / {human_bytes(size.kernelized)}", f"{size.kernelized / size.eager:.2f}",
                f"{human_bytes(peak.eager)} / {human_bytes(peak.kernelized)}", f"{peak.kernelized / peak.eager:.3f}",
                "yes" if met else "no",
            ])  # fmt: skip
    if not body:
        return []
    batch, seq = chosen[0].batch, chosen[0].seq
    header = ["model", "tokens per chunk", "ops eager / card", "bytes eager / card", "ratio"]
    header += ["peak live eager / card", "ratio", f"bytes <= eager, peak <= {PEAK_SHARE:g} x eager"]
    title = (
        f"Counted, the lm_head + loss region (npu-linear-cross-entropy), forward+backward, batch {batch}, sequence "
        f"{seq}, bfloat16; peak live: the most bytes allocated at once (inputs and weights not counted). Larger "
        "chunks re-read W less often but hold larger [chunk, vocabulary] buffers:"
    )
    return ["", title, "", *table(header, body)]


def trl_table(rows: list[Row]) -> list[str]:
    """The loss region per model and shape, forward+backward: transformers' eager loss, the card's loss and TRL's
    fused LM head (each of TRL_STUDIES): ops, bytes, saved and peak live bytes; or why TRL's head was not counted."""
    from ..report import human_bytes, number, table

    chosen = [r for r in rows if r.study in TRL_STUDIES and r.unit in UNITS]
    if not chosen:
        absent = trl_head.trl_absent()
        loss_rows = any(r.study == "layer" and r.kind == _kind() for r in rows)
        return ["", f"TRL's fused LM head: not counted here ({absent})."] if absent and loss_rows else []
    body = []
    for model, batch, seq, study in dict.fromkeys((r.model, r.batch, r.seq, r.study) for r in chosen):
        by_unit = {r.unit: r for r in chosen if (r.model, r.batch, r.seq, r.study) == (model, batch, seq, study)}
        cells = [model, f"{batch} x {seq}", TRL_COMPUTES[study]]
        for unit, r in ((unit, by_unit[unit]) for unit in UNITS):
            figures = (r.eager, r.kernelized, r.trl)
            cells.append(" / ".join(number(v, "ops") if unit == "ops" else human_bytes(v) for v in figures))
        cells.append(f"{by_unit['bytes'].trl / by_unit['bytes'].kernelized:.1f}")
        body.append(cells)
    header = ["model", "batch x seq", "TRL's head computes", "ops eager / card / TRL", "bytes eager / card / TRL"]
    header += ["saved eager / card / TRL", "peak live eager / card / TRL", "TRL bytes / card bytes"]
    title = (
        f"Counted, the lm_head + loss region under TRL (trl {trl_head.trl_version()}), forward+backward, bfloat16: "
        "transformers' eager loss (the logits, then ForCausalLMLoss), the card's (npu-linear-cross-entropy), and TRL's "
        "fused LM head, which TRL's trainers set as the model's forward (`add_fused_lm_head`): under TRL it is the "
        "head that runs, and the card does not (`kept_forwards` names it). On the npu TRL's head runs its torch "
        "fallback (its Triton fold is for cuda and xpu only) and computes more than the loss: per-token "
        "log-probabilities and, as SFTTrainer sets it, the entropy and whether each label is the top-1 token. No "
        "public hook gives TRL's head another implementation (docs/models.md, section TRL's LM head on the npu):"
    )
    return ["", title, "", *table(header, body)]


def _kind() -> str:
    """The card's region kind."""
    from ..cards import card_named

    return card_named("npu-linear-cross-entropy").region


def study_tables(rows: list[Row]) -> list[str]:
    """The card's tables in the report: the chunk trade (`study_table`), then TRL's head beside it (`trl_table`)."""
    return study_table(rows) + trl_table(rows)


STUDY_TABLE = study_tables
