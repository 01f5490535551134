"""DeepSpeed Ulysses sequence parallelism with the cards, through Trainer and accelerate, against one process of eager.

Each run starts sp_size processes of the emulated host (tests/distributed.py, 127.0.0.1, one torch thread each), each
a one-NPU host (LOCAL_RANK=0) running DeepSpeed's NPU accelerator, and trains one step per case with transformers'
Trainer: `TrainingArguments(deepspeed=<ZeRO-3>, parallelism_config=ParallelismConfig(sp_backend="deepspeed",
sp_size=N))`, with `sp_attn_implementation` the model's attention (the card's "npu_fused_attention"; sdpa for the run
without kernels). The Trainer registers DeepSpeed's `UlyssesSPAttentionHF` over that attention, wraps the data loader
in `UlyssesSPDataLoaderAdapter` (each rank gets its slice of every sequence, and `shift_labels`) and computes the loss
with `deepspeed_sp_compute_loss` (each rank's loss weighted by its tokens, over the SP group). One case runs a loop of
its own on accelerate instead (`Accelerator(parallelism_config=..., deepspeed_plugin=...)`, whose `prepare` does the
registering and wrapping). The order is the one docs/long-context.md gives: load, apply the cards
(`apply_npu_kernels`), name the card for SP, then let the Trainer (or `prepare`) register SP and wrap. Several cases
share one launch: after each, `_release_sequence_parallelism` undoes what a run leaves process-wide.

Each process starts a plain "hccl" group, as on a device. The Trainer cases make TrainingArguments first and then
load the model (`from_pretrained` of a tiny model rank 0 saved), which ZeRO-3's config makes transformers load under
`zero.Init`, partitioned; the accelerate case loads it first. accelerate's `DeepSpeedSequenceParallelConfig` refuses
"npu_fused_attention" by name: `set_sequence_parallel_attention` sets it (what docs/long-context.md tells users).

What each case must show, on every rank:

- numbers: the step's loss and the full gradient of every parameter (ZeRO-3's, gathered with `safe_get_full_grad`
  before the optimizer step; ZeRO-3 averages the SP ranks' gradients, which `deepspeed_sp_compute_loss` scaled by
  the SP size, so that is the global sequence's gradient) equal one process of eager attention on the whole
  sequences the ranks' slices make up: float32 to rounding; bfloat16 within twice eager bfloat16's error against
  float64 (tests/numerics.py). The slices put together are a row of the data set: what the ranks trained on is
  the data, in order.
- fusion: each card that swapped a module of the family ran one of its fused ops in the step, or says why not (op
  counters; the loss card with each rank's shift_labels), the attention op on the gathered sequence with each
  rank's share of the heads (its query shape), packed sequences as layout TND with every row's documents' ends; the
  run without kernels calls no fused op (the negative control). A dense model's MLP card: one fused call per layer
  and forward; with `tile_mlp` (the recipe's order: after the cards, before SP's name), one per tile, layer and
  direction (TiledMLP's forward and its backward's recompute), its untiled twin the control.
- what cannot fuse says why and runs eager, exactly: more packed sequences in one gathered call than the op's
  varlen form takes (1024). bfloat16's loss, one scalar, gets the floor tests/test_distributed_training.py gives.
"""

from __future__ import annotations

import datetime
import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from numerics import assert_within_twice_eagers_error, relative_error

pytest.importorskip("deepspeed")

SEQ = 16
"""Tokens per sequence: divisible by every SP size tested."""
LAYERS = 2
FP32_LOSS_TOLERANCE = 1e-5
FP32_GRAD_TOLERANCE = 1e-5
"""Relative L2 error of a parameter's gradient against eager's: float32 rounding of a tiny model is about 1e-7."""
BF16_LOSS_FLOOR = 1e-3
TIMEOUT = 600
ALL_CASES = os.environ.get("NPU_HUB_KERNELS_ALL_SP") == "1"
"""`make test-long-context`: every case at SP 2 and 4 (`make test` runs the sample of SAMPLE)."""


@dataclass(frozen=True)
class Case:
    """One SP training step: a tiny family and its config overrides, the data's packing, dtype, kernels or not."""

    family: str
    overrides: dict = field(default_factory=dict)
    packed: tuple[tuple[int, ...], ...] | None = None
    """Each row's packed document lengths (cycled over the data set's rows; () draws 1 to 4 documents per row at
    random); None: one sequence per row."""
    rows: int = 1
    """Rows per micro-batch."""
    seq: int = SEQ
    kernels: bool = True
    dtype: torch.dtype = torch.float32
    checkpointing: bool = False
    """Gradient checkpointing (the Trainer's): each layer's forward runs again in backward, its attention included."""
    loop: str = "trainer"
    """Whose training loop: transformers' Trainer, or "accelerate" (accelerate's prepare and a loop of one's own)."""
    eager_reason: str | None = None
    """What the attention card says where it cannot fuse (None: every attention call fuses)."""
    tiles: int | None = None
    """`tile_mlp(model, shards=tiles)` after the cards, in the recipe's order (None: the MLPs untiled)."""


CASES = {
    "llama": Case("llama"),
    "llama, no kernels": Case("llama", kernels=False),
    "qwen3, 1 KV head": Case("qwen3", {"num_key_value_heads": 1}),
    "mistral, window 8": Case("mistral", {"sliding_window": 8}),
    "gemma3": Case("gemma3_text"),
    "llama, packed": Case("llama", packed=((5, 7, 4), (3, 13))),
    "mistral, packed, window 4": Case("mistral", {"sliding_window": 4}, packed=((9, 7), (2, 6, 8))),
    "llama, 2 packed rows": Case("llama", packed=(), rows=2),
    "qwen3_moe": Case("qwen3_moe"),
    "mixtral": Case("mixtral"),
    "llama, packed, accelerate": Case("llama", packed=(), loop="accelerate"),
    "llama, bfloat16": Case("llama", dtype=torch.bfloat16),
    "mistral, packed, window 4, checkpointing": Case(
        "mistral", {"sliding_window": 4}, packed=((9, 7), (2, 6, 8)), checkpointing=True
    ),
    "llama, tiled MLP": Case("llama", tiles=4),
    "mistral, packed, window 4, tiled MLP": Case("mistral", {"sliding_window": 4}, packed=((9, 7), (2, 6, 8)), tiles=4),
    "mistral, packed, window 4, checkpointing, tiled MLP": Case(
        "mistral", {"sliding_window": 4}, packed=((9, 7), (2, 6, 8)), checkpointing=True, tiles=4
    ),
    "llama, 1026 packed documents": Case(
        "llama",
        packed=((1,) * 1025 + (3,),),
        seq=1028,
        eager_reason="1026 sequences in one call: the op's varlen form takes at most 1024",
    ),
}
SAMPLE = ("llama, 2 packed rows", "llama, no kernels")
"""The cases `make test` runs (SP 2): two packed rows per micro-batch, and the control."""
TILED = tuple(name for name, case in CASES.items() if case.tiles)
"""The sequence-tiled MLP cases (`make test-long-context`, a launch of their own: `pytest -k tiled` runs them alone);
their untiled twins ("llama", "mistral, packed, window 4" with and without checkpointing) are the control, in the
other cases' launch."""


def _data(case: Case, count: int) -> list[dict]:
    """`count` rows of token ids, labels and position ids (restarting at each packed document, whose first label is
    -100, as a packing collator gives them)."""
    generator = torch.Generator().manual_seed(7)
    rows = []
    for index in range(count):
        ids = torch.randint(3, 96, (case.seq,), generator=generator)
        labels = ids.clone()
        if case.packed is None:
            positions = torch.arange(case.seq)
        else:
            lengths = case.packed[index % len(case.packed)] if case.packed else _random_lengths(case.seq, generator)
            positions = torch.cat([torch.arange(length) for length in lengths])
            if len(lengths) <= 4:  # documents long enough to learn from: no label across a document boundary
                labels[positions == 0] = -100
        rows.append({"input_ids": ids, "labels": labels, "position_ids": positions})
    return rows


def _random_lengths(seq: int, generator: torch.Generator) -> tuple[int, ...]:
    """1 to 4 document lengths that sum to `seq`, drawn with `generator`."""
    cuts = torch.randperm(seq - 1, generator=generator)[: int(torch.randint(0, 4, (1,), generator=generator))] + 1
    bounds = [0, *sorted(cuts.tolist()), seq]
    return tuple(end - start for start, end in itertools.pairwise(bounds))


def _rank_main(built_cards: str, sp_size: int, names: list[str], output_dir: str) -> dict:
    """One rank: each case's step in turn (the process group and DeepSpeed's comm set up once)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="hccl", timeout=datetime.timedelta(seconds=120))
    return {name: _train(CASES[name], built_cards, sp_size, output_dir) for name in names}


def _train(case: Case, built_cards: str, sp_size: int, output_dir: str) -> dict:
    """One step of `case` under Ulysses SP and ZeRO-3 (Trainer's, or a loop of accelerate's): the loss, the full
    gradients, what each rank's forward got, the fused op calls, the attention op's inputs, what the cards say."""
    import torch_npu
    from accelerate.parallelism_config import ParallelismConfig
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import safe_get_full_grad
    from kernels import Mode
    from transformers import AutoModelForCausalLM

    from npu_hub_kernels import (
        apply_npu_kernels,
        attention_modules,
        set_sequence_parallel_attention,
        swapped_modules,
        tile_mlp,
        unregister_npu_kernels,
    )
    from npu_hub_kernels.testing import emulation
    from npu_hub_kernels.testing.tiny_models import tiny_causal_lm

    source = Path(output_dir) / case.family / "-".join(f"{k}={v}" for k, v in case.overrides.items())
    tiny_causal_lm(case.family, **case.overrides).save_pretrained(source)  # rank 0 writes, as Trainer saves
    torch.distributed.barrier()
    parallelism = ParallelismConfig(sp_backend="deepspeed", sp_size=sp_size)
    # Trainer: TrainingArguments first, so that from_pretrained loads the model under ZeRO-3's zero.Init
    args = _training_arguments(case, parallelism, output_dir) if case.loop == "trainer" else None
    model = AutoModelForCausalLM.from_pretrained(source).train()  # the Trainer cases: under zero.Init
    partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
    if case.loop != "trainer":
        model.to("npu")
    if case.kernels:
        apply_npu_kernels(model, mode=Mode.TRAINING, local_dir=built_cards)
    if case.tiles:
        tile_mlp(model, shards=case.tiles)  # after the cards, before SP's name and the Trainer: the recipe's order
    set_sequence_parallel_attention(parallelism, model)  # the card's name, which accelerate's constructor refuses
    attention = model.config._attn_implementation
    seen, grads, losses, op_inputs = [], [], [], []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append({k: kwargs[k].cpu() for k in ("input_ids", "position_ids")}),
        with_kwargs=True,
    )
    original_step, original_op = DeepSpeedEngine.step, torch_npu.npu_fusion_attention

    def step_after_reading_gradients(engine, *args, **kwargs):
        grads.append({name: safe_get_full_grad(p).cpu() for name, p in engine.module.named_parameters()})
        return original_step(engine, *args, **kwargs)

    def recording_op(query, key, value, heads, layout, **kwargs):
        op_inputs.append((layout, tuple(query.shape), heads, kwargs.get("actual_seq_qlen")))
        return original_op(query, key, value, heads, layout, **kwargs)

    DeepSpeedEngine.step, torch_npu.npu_fusion_attention = step_after_reading_gradients, recording_op
    data = _data(case, 2 * sp_size * case.rows)
    try:
        with emulation.count_op_calls() as calls:
            if args is not None:
                engine = _trainer_step(model, args, data, losses)
            else:
                engine = _accelerate_step(model, case, parallelism, data, losses)
        runs = [(run.module, run.form, run.eager_reason) for run in attention_modules(model)]
        swaps = [(swap.card, swap.module, swap.eager_reason) for swap in swapped_modules(model)]
    finally:
        DeepSpeedEngine.step, torch_npu.npu_fusion_attention = original_step, original_op
        _release_sequence_parallelism(attention)
    engine.destroy()
    if case.kernels:
        unregister_npu_kernels()
    return {
        "losses": losses,
        "grads": grads,
        "seen": seen,
        "calls": dict(calls),
        "op_inputs": op_inputs,
        "runs": runs,
        "swaps": swaps,
        "partitioned": partitioned,
    }


def _zero3_config(case: Case, auto: bool) -> dict:
    """ZeRO-3 partitioning every parameter; the batch sizes and bf16 "auto" (the Trainer's) or the case's."""
    return {
        "train_micro_batch_size_per_gpu": "auto" if auto else case.rows,
        "gradient_accumulation_steps": "auto" if auto else 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": "auto" if auto else case.dtype == torch.bfloat16},
        "zero_allow_untested_optimizer": True,
    }


def _training_arguments(case: Case, parallelism, output_dir: str):
    """One step of the case's micro-batch, ZeRO-3 (the batch sizes and bf16 "auto": the Trainer's), SP."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=case.rows, max_steps=1, learning_rate=1e-3,
        bf16=case.dtype == torch.bfloat16, deepspeed=_zero3_config(case, auto=True), parallelism_config=parallelism,
        gradient_checkpointing=case.checkpointing, report_to=[], disable_tqdm=True, save_strategy="no", seed=0,
    )  # fmt: skip


def _trainer_step(model, args, data: list[dict], losses: list):
    """One step of transformers' Trainer (it registers Ulysses and wraps its loader); the DeepSpeed engine."""
    from transformers import Trainer

    class LossRecordingTrainer(Trainer):
        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            losses.append(loss.item())
            return loss

    trainer = LossRecordingTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return trainer.model_wrapped


def _accelerate_step(model, case: Case, parallelism, data: list[dict], losses: list):
    """One step of a loop of accelerate's: `prepare` registers Ulysses and wraps the loader; the loss is each rank's
    weighted by its tokens over the SP group (transformers' `deepspeed_sp_compute_loss`, as Trainer computes it)."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from torch.utils.data import DataLoader
    from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

    plugin = DeepSpeedPlugin(hf_ds_config=_zero3_config(case, auto=False))
    accelerator = Accelerator(parallelism_config=parallelism, deepspeed_plugin=plugin)
    loader = DataLoader(data, batch_size=case.rows)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # the adapter hands each rank its slice on the host (DeepSpeed keeps the prefill buffer there): to the device
    batch = {key: value.to(accelerator.device) for key, value in next(iter(loader)).items()}
    loss = deepspeed_sp_compute_loss(accelerator, engine, batch, False, accelerator.parallelism_config)
    accelerator.backward(loss)
    losses.append(loss.item())
    return engine


def _release_sequence_parallelism(attention: str) -> None:
    """Undo what one SP run left process-wide, so the next case starts as a fresh process would: DeepSpeed's wrapper
    in ALL_ATTENTION_FUNCTIONS, its SP groups, accelerate's state and transformers' ZeRO-3 config (which would make
    the next tiny model build under zero.Init)."""
    from accelerate.state import AcceleratorState
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS._local_mapping.pop(attention)  # DeepSpeed's wrapper, over the registered function
    parallel_state_sp._release_sequence_parallel_groups()
    AcceleratorState._reset_state()
    unset_hf_deepspeed_config()


def _run(built_cards: Path, sp_size: int, names: tuple[str, ...], scratch: Path) -> list[dict]:
    """Each rank's results of `names` at `sp_size` (one launch of sp_size processes)."""
    env = {"DS_ACCELERATOR": "npu", "ASCEND_HOME_PATH": str(scratch), "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
    args = (str(built_cards), sp_size, list(names), str(scratch))
    return run_distributed(_rank_main, *args, world_size=sp_size, timeout=TIMEOUT, env=env)


def _global_inputs(ranks: list[dict], name: str) -> dict[str, torch.Tensor]:
    """The step's whole sequences: each rank's slice, put together in rank order."""
    return {
        key: torch.cat([rank[name]["seen"][0][key] for rank in ranks], dim=1) for key in ("input_ids", "position_ids")
    }


def _eager_step(case: Case, inputs: dict, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process, eager attention, the whole sequences: the loss and every parameter's gradient (in `dtype`, the
    weights the case's dtype rounded). The model shifts the labels itself, as the SP data-loader adapter does."""
    from npu_hub_kernels.testing.tiny_models import tiny_causal_lm

    model = tiny_causal_lm(case.family, **case.overrides).to(case.dtype).to(dtype).train()
    model.set_attn_implementation("eager")
    keys = ("input_ids", "position_ids", "labels")
    # no cache: with one, transformers' masks read no packing from the position ids (training needs none)
    loss = model(**{key: inputs[key] for key in keys}, use_cache=False).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _labels_of(case: Case, sp_size: int, inputs: dict) -> torch.Tensor:
    """The labels of the data set's rows the step's sequences are (asserting they are rows of it, in order)."""
    data = _data(case, 2 * sp_size * case.rows)
    index = {tuple(row["input_ids"].tolist()): row for row in data}
    rows = [index.get(tuple(ids.tolist())) for ids in inputs["input_ids"]]
    assert None not in rows, "the ranks' slices do not make up rows of the data set"
    for row, positions in zip(rows, inputs["position_ids"], strict=True):
        assert torch.equal(row["position_ids"], positions)
    return torch.stack([row["labels"] for row in rows])


def check_case(ranks: list[dict], name: str, sp_size: int) -> None:
    """What docs/long-context.md promises for one case (see the module docstring), on every rank."""
    case = CASES[name]
    inputs = _global_inputs(ranks, name)
    inputs["labels"] = _labels_of(case, sp_size, inputs)
    eager_loss, eager_grads = _eager_step(case, inputs, case.dtype)
    reference = None if case.dtype == torch.float32 else _eager_step(case, inputs, torch.float64)
    for rank, results in enumerate(ranks):
        result = results[name]
        where = f"{name}, SP {sp_size}, rank {rank}"
        assert len(result["losses"]) == len(result["grads"]) == 1, where
        assert result["partitioned"] == (case.loop == "trainer"), f"{where}: zero.Init is the Trainer cases' order"
        loss, grads = torch.tensor(result["losses"][0]), result["grads"][0]
        assert grads.keys() == eager_grads.keys(), where
        if reference is None:
            assert abs(loss - eager_loss).item() <= FP32_LOSS_TOLERANCE, (where, loss, eager_loss)
            for param, eager_grad in eager_grads.items():
                error = relative_error(grads[param], eager_grad)
                assert error <= FP32_GRAD_TOLERANCE, f"{where}: {param}'s gradient is {error:.3g} off eager's"
        else:
            reference_loss, reference_grads = reference
            # one scalar is one rounding draw: the floor, as tests/test_distributed_training.py's, is 1/30 of a
            # bfloat16 ulp at the loss's size
            loss_error, eager_error = (abs(value.double() - reference_loss).item() for value in (loss, eager_loss))
            assert loss_error <= 2 * eager_error + BF16_LOSS_FLOOR, (where, loss_error, eager_error)
            for param, eager_grad in eager_grads.items():
                assert_within_twice_eagers_error(
                    grads[param], eager_grad, reference_grads[param], (where, param), error=relative_error
                )
        _check_fusion(case, result, sp_size, inputs, where)


def _check_fusion(case: Case, result: dict, sp_size: int, inputs: dict, where: str) -> None:
    """The fused ops of the step: each card that swapped a module of the model ran one of its ops, or says why not
    (none without kernels); the attention op's inputs; the loss card's with shift_labels."""
    from npu_hub_kernels.cards import CARDS

    calls, runs, swaps = result["calls"], result["runs"], result["swaps"]
    if not case.kernels:
        assert calls == {} and runs == [] and swaps == [], (where, calls, runs, swaps)
        return
    fused_ops = {card.repo_name: card.fused_ops for card in CARDS.values()}
    for card in {card for card, _, _ in swaps}:
        reasons = [reason for name, _, reason in swaps if name == card]
        ran = any(calls.get(op) for op in fused_ops[card])
        assert ran or all(reasons), f"{where}: {card} ran none of {fused_ops[card]} and says no reason: {swaps}"
    assert {"npu-rms-norm", "npu-rope"} <= {card for card, _, _ in swaps}, (where, swaps)
    if case.family != "gemma3_text":  # Gemma3's forward (soft-capping between lm_head and loss) keeps the loss eager
        assert calls.get("npu_cross_entropy_loss"), (where, calls)  # each rank's shift_labels, through the loss card
    assert len(runs) == LAYERS, (where, runs)
    if case.eager_reason is not None:
        assert "npu_fusion_attention" not in calls, (where, calls)
        assert [reason for _, _, reason in runs] == [case.eager_reason] * LAYERS, (where, runs)
        return
    forwards = 2 if case.checkpointing else 1  # checkpointing runs each layer's forward again in backward
    assert calls.get("npu_fusion_attention") == forwards * LAYERS, (where, calls)
    _check_mlp_calls(case, calls, swaps, forwards, where)
    assert [reason for _, _, reason in runs] == [None] * LAYERS, (where, runs)
    heads = 4 // sp_size
    rows, seq = inputs["input_ids"].shape
    for layout, query_shape, op_heads, query_ends in result["op_inputs"]:
        assert op_heads == heads, (where, op_heads)  # each rank its share of the heads, over the whole sequence
        if case.packed is None:
            assert (layout, query_shape) == ("BSND", (rows, seq, heads, 16)), (where, layout, query_shape)
        else:
            starts = torch.ones_like(inputs["position_ids"], dtype=torch.bool)
            starts[:, 1:] = inputs["position_ids"][:, 1:] != inputs["position_ids"][:, :-1] + 1
            ends = [*starts.reshape(-1).nonzero().squeeze(1)[1:].tolist(), rows * seq]
            assert (layout, query_shape, query_ends) == ("TND", (rows * seq, heads, 16), ends), (where, query_ends)


def _check_mlp_calls(case: Case, calls: dict, swaps: list, forwards: int, where: str) -> None:
    """A dense model's MLP card: its fused op once per layer and forward untiled (the control); tiled, once per tile
    in TiledMLP's forward (no autograd) and again in its backward's recompute, per layer (and per forward)."""
    cards = {card for card, _, _ in swaps}
    if "npu-swiglu" not in cards or "npu-moe" in cards:  # the experts card calls npu_swiglu too
        assert not case.tiles, (where, swaps)
        return
    assert [reason for card, _, reason in swaps if card == "npu-swiglu"] == [None] * LAYERS, (where, swaps)
    # the tiles a rank runs: `tiles` of its SEQ / sp_size tokens (4 of 8 at SP 2, 4 of 4 at SP 4)
    per_layer = case.tiles * (forwards + 1) if case.tiles else forwards
    mlp_calls = calls.get("npu_swiglu", 0) + calls.get("npu_geglu", 0)
    assert mlp_calls == per_layer * LAYERS, (where, mlp_calls, per_layer * LAYERS)


@pytest.mark.slow
def test_ulysses_sp_2_trains_as_one_process_of_eager(built_cards, tmp_path):
    """SP 2, ZeRO-3, Trainer, one launch: two packed rows per micro-batch (no mask: the card packs each row by its
    restarting position ids), and the run without kernels; see the module docstring."""
    ranks = _run(built_cards, 2, SAMPLE, tmp_path)
    for name in SAMPLE:
        check_case(ranks, name, 2)


@pytest.mark.slow
@pytest.mark.skipif(not ALL_CASES, reason="every case at SP 2 and 4: make test-long-context")
@pytest.mark.parametrize("sp_size", [2, 4])
def test_ulysses_sp_every_case_trains_as_one_process_of_eager(built_cards, tmp_path, sp_size):
    """Every case of CASES but TILED at SP 2 and 4 (4 processes on the machine's cores): see the module docstring."""
    names = tuple(name for name in CASES if name not in TILED)
    ranks = _run(built_cards, sp_size, names, tmp_path)
    for name in names:
        check_case(ranks, name, sp_size)


@pytest.mark.slow
@pytest.mark.skipif(not ALL_CASES, reason="every case at SP 2 and 4: make test-long-context")
@pytest.mark.parametrize("sp_size", [2, 4])
def test_ulysses_sp_with_tiled_mlp_trains_as_one_process_of_eager(built_cards, tmp_path, sp_size):
    """The recipe with the sequence-tiled MLP (load, cards, tile_mlp, SP's name, Trainer) at SP 2 and 4, ZeRO-3: eager's
    loss and gradients, the fused SwiGLU once per tile, layer and direction (its untiled twins are the control)."""
    ranks = _run(built_cards, sp_size, TILED, tmp_path)
    for name in TILED:
        check_case(ranks, name, sp_size)
