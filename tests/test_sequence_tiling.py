"""Sequence-tiled MLP with the cards (issue 44): `npu_hub_kernels.tile_mlp` puts DeepSpeed's TiledMLP around the MLP
card's layer, so that every tile runs the fused op, forward and backward.

Each run is a training step of a tiny family on the emulated npu, its loss and every gradient against the same step of
the untiled model without cards on the host (float32: rtol 1e-4 / atol 1e-5), the fused MLP op counted: one per layer
untiled (the negative control), layers x tiles x 2 tiled (TiledMLP runs each tile without autograd in forward, then
again with it in backward). The orders a user applies things in (load, the cards, tiling, LoRA, the cards again) each
fuse per tile or raise naming what to do; none runs eager silently. The loss card is the tiled loss: tiling leaves it
as it is (its chunks counted).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
from distributed import run_distributed
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode

from npu_hub_kernels import apply_npu_kernels, swapped_modules
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm, token_ids
from npu_hub_kernels.tiling import TiledForward, tile_mlp

TILES = 4
LAYERS = 2  # tiny_causal_lm's
MLP_OP = {"llama": "npu_swiglu", "gemma2": "npu_geglu", "phi3": "npu_swiglu"}
"""The fused op of each family's MLP: split SwiGLU, GeGLU, and SwiGLU of one gate_up projection."""
LOSS_CHUNKS = 2  # 128 tokens of a tiny model: the loss card's chunked form, 2 chunks of 64
IDS = token_ids(2, 64)


def _lora(model):
    torch.manual_seed(0)  # the same adapters for the runs compared
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(model, config)


def _step(model, device: str):
    """The loss and every trainable parameter's gradient (host, float32) of one training step on IDS."""
    ids = IDS.to(device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.cpu() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach().cpu(), grads


def _assert_eagers(got, want) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    assert got[1].keys() == want[1].keys()
    for name, grad in got[1].items():
        torch.testing.assert_close(grad, want[1][name], rtol=1e-4, atol=1e-5, msg=name)


def _cards(model, built_cards, **kwargs):
    return apply_npu_kernels(model, local_dir=built_cards, **kwargs)


def _counted_step(model):
    with emulation.count_op_calls() as calls:
        result = _step(model, "npu")
    return result, calls


@pytest.mark.parametrize("family", sorted(MLP_OP))
def test_each_tile_runs_the_fused_mlp_op_with_eagers_loss_and_gradients(built_cards, family):
    want = _step(tiny_causal_lm(family).train(), "cpu")
    untiled = _cards(tiny_causal_lm(family).train().to("npu"), built_cards)
    got, untiled_calls = _counted_step(untiled)
    _assert_eagers(got, want)
    assert untiled_calls[MLP_OP[family]] == LAYERS  # the negative control: one fused call per layer
    tiled = tile_mlp(_cards(tiny_causal_lm(family).train().to("npu"), built_cards), shards=TILES)
    got, calls = _counted_step(tiled)
    _assert_eagers(got, want)
    assert calls[MLP_OP[family]] == LAYERS * TILES * 2
    # the loss as untiled: its card's chunks (Gemma 2's soft-capped logits: its class's loss), no second tiling
    assert calls["npu_cross_entropy_loss"] == untiled_calls["npu_cross_entropy_loss"]
    swaps = swapped_modules(tiled, card="npu-swiglu")
    assert len(swaps) == LAYERS and all(s.eager_reason is None for s in swaps), swaps


def _cards_tiling(model, built_cards):
    return tile_mlp(_cards(model, built_cards), shards=TILES)


def _cards_tiling_cards_again(model, built_cards):
    return _cards(_cards_tiling(model, built_cards), built_cards)  # as transformers' use_kernels at train()/eval()


def _cards_lora_tiling(model, built_cards):
    return tile_mlp(_lora(_cards(model, built_cards)), shards=TILES)


def _cards_tiling_lora(model, built_cards):
    return _lora(_cards_tiling(model, built_cards))


def _lora_cards_tiling(model, built_cards):
    return tile_mlp(_cards(_lora(model), built_cards), shards=TILES)


FUSING_ORDERS = {
    "cards, tiling": (_cards_tiling, False),
    "cards, tiling, cards again": (_cards_tiling_cards_again, False),
    "cards, LoRA, tiling": (_cards_lora_tiling, True),
    "cards, tiling, LoRA": (_cards_tiling_lora, True),
    "LoRA, cards, tiling": (_lora_cards_tiling, True),
}
"""Orders that fuse per tile: (how the model is made from the loaded one, whether it has LoRA adapters)."""


@pytest.mark.parametrize("order", list(FUSING_ORDERS))
def test_every_order_with_the_cards_before_tiling_fuses_per_tile(built_cards, order):
    make, lora = FUSING_ORDERS[order]
    reference = tiny_causal_lm("llama").train()
    want = _step(_lora(reference) if lora else reference, "cpu")
    model = make(tiny_causal_lm("llama").train().to("npu"), built_cards)
    got, calls = _counted_step(model)
    _assert_eagers(got, want)
    assert calls["npu_swiglu"] == LAYERS * TILES * 2, order
    assert calls["npu_cross_entropy_loss"] == LOSS_CHUNKS, order
    tiled = [m for m in model.modules() if isinstance(m.__dict__.get("forward"), TiledForward)]
    assert len(tiled) == LAYERS


@pytest.mark.parametrize(
    ("order", "words"),
    [
        ("tiling before the cards", "no card is applied .* apply the cards first"),
        ("tiling without the MLP card", "the cards are applied .* or the MLP card was not selected"),
        ("tiling twice", "tiled already"),
    ],
)
def test_an_order_that_cannot_tile_a_fused_mlp_raises_what_to_do(built_cards, order, words):
    model = tiny_causal_lm("llama").train().to("npu")
    if order == "tiling without the MLP card":
        _cards(model, built_cards, kernels=["npu_fused_rmsnorm"])
    elif order == "tiling twice":
        _cards_tiling(model, built_cards)
    with pytest.raises(RuntimeError, match=words):
        tile_mlp(model, shards=TILES)


def test_shards_must_be_a_positive_integer(built_cards):
    model = _cards(tiny_causal_lm("llama").train().to("npu"), built_cards)
    for shards in (0, 2.0):
        with pytest.raises(ValueError, match="positive integer"):
            tile_mlp(model, shards=shards)


def test_default_tiles_are_sequence_over_hidden_size(built_cards):
    """No shards given: ceil(sequence / hidden size) per call, DeepSpeed's recipe (64 tokens of a hidden size of 64:
    one tile; 130: three)."""
    model = tile_mlp(_cards(tiny_causal_lm("llama").train().to("npu"), built_cards))
    for seq, tiles in ((64, 1), (130, 3)):
        ids = token_ids(1, seq).to("npu")
        with emulation.count_op_calls() as calls:
            model(input_ids=ids, labels=ids).loss.backward()
        assert calls["npu_swiglu"] == LAYERS * tiles * 2, seq


def _deepspeed_recipe_forward(self, x):
    """TiledMLP's own example (its docstring): the class's forward patched with the MLP's math, tiled."""

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
    return TiledMLP.apply(mlp_forward, self, x, TILES, params)


@pytest.mark.parametrize("when", ["before the cards", "after the cards"])
def test_deepspeeds_class_patch_is_eager_and_said_or_fused_untiled(built_cards, monkeypatch, when):
    """DeepSpeed's recipe patches the MLP class's forward with the MLP's own math. Patched before the cards, that math
    runs (eager in every tile) and swapped_modules says why; patched after, the card's layer kernelize bound on each
    module runs instead (fused, in one piece: the class's forward is never called). Neither is a silent eager;
    `tile_mlp` is what tiles the fused layer."""
    from transformers.models.llama import modeling_llama

    want = _step(tiny_causal_lm("llama").train(), "cpu")
    if when == "before the cards":
        monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", _deepspeed_recipe_forward)
    model = _cards(tiny_causal_lm("llama").train().to("npu"), built_cards)
    if when == "after the cards":
        monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", _deepspeed_recipe_forward)
    got, calls = _counted_step(model)
    _assert_eagers(got, want)
    reasons = [swap.eager_reason for swap in swapped_modules(model, card="npu-swiglu")]
    if when == "before the cards":
        assert calls["npu_swiglu"] == 0 and all("_deepspeed_recipe_forward" in r for r in reasons), reasons
    else:
        assert calls["npu_swiglu"] == LAYERS and reasons == [None] * LAYERS


def _mlps_only(model):
    """Only the MLPs and the final norm trained: the MLP's input needs no gradient, its weights do."""
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".mlp." in name or name == "model.norm.weight")
    return model


def _lora_mlp_only(model):
    torch.manual_seed(0)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], modules_to_save=["lm_head"],
        init_lora_weights=False,
    )  # fmt: skip
    return get_peft_model(model, config)


@pytest.mark.parametrize(("trained", "fused_calls"), [("MLPs only", LAYERS * TILES * 2), ("LoRA on the MLP only", 0)])
def test_mlp_weights_get_eagers_gradients_when_its_input_needs_none(built_cards, trained, fused_calls):
    """Nothing before the MLP trains: the tiled output needs a gradient through the MLP's weights alone (TiledMLP
    takes them in a list, which autograd does not see). Every trainable parameter gets eager's gradient; LoRA on
    gate_proj/up_proj runs the MLP's eager math in each tile, as untiled (the card reads those weights itself)."""
    make = _mlps_only if trained == "MLPs only" else _lora_mlp_only
    want = _step(make(tiny_causal_lm("llama").train()), "cpu")
    model = tile_mlp(_cards(make(tiny_causal_lm("llama").train().to("npu")), built_cards), shards=TILES)
    got, calls = _counted_step(model)
    assert any(".mlp." in name for name in want[1])
    _assert_eagers(got, want)
    assert calls["npu_swiglu"] == fused_calls


class _MatmulDtypes(TorchDispatchMode):
    """Counts the matrix products dispatched inside it by their operands' dtype."""

    def __init__(self):
        super().__init__()
        self.dtypes: Counter[torch.dtype] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):  # mat2: mm's args[1], addmm's args[2]
            self.dtypes[args[1 if func.overloadpacket is torch.ops.aten.mm else 2].dtype] += 1
        return func(*args, **(kwargs or {}))


def test_the_backwards_recompute_runs_under_the_forwards_autocast(built_cards):
    """Under bf16 autocast on float32 weights each tile's recompute in backward multiplies in bfloat16, as the untiled
    model's backward does, not in the weights' float32 (TiledMLP's backward runs where the autocast is off). The
    control: without autocast the counter sees the recompute's float32 products."""
    ids = IDS.to("npu")
    for autocast, dtypes in ((True, {torch.bfloat16}), (False, {torch.float32})):
        for tiled in (False, True):
            model = _cards(tiny_causal_lm("llama").train().to("npu"), built_cards)
            if tiled:
                tile_mlp(model, shards=TILES)
            with torch.autocast("npu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=ids).loss
            with emulation.count_op_calls() as calls, _MatmulDtypes() as products:
                loss.backward()
            assert set(products.dtypes) == dtypes, (autocast, tiled, products.dtypes)
            assert calls["npu_swiglu"] == (LAYERS * TILES if tiled else 0)  # the recompute: one fused call per tile


def test_tiles_are_never_more_than_the_sequence_makes(built_cards):
    """torch.chunk makes 3 tiles of 6 tokens asked for 4: 3 tiles run (TiledMLP marks the gradients ready for ZeRO-3
    at tile number `shards` only); 7 tokens make 4."""
    model = tile_mlp(_cards(tiny_causal_lm("llama").train().to("npu"), built_cards), shards=4)
    for tokens, tiles in ((6, 3), (7, 4), (2, 2)):
        ids = token_ids(2, tokens).to("npu")
        with emulation.count_op_calls() as calls:
            model(input_ids=ids, labels=ids).loss.backward()
        assert calls["npu_swiglu"] == LAYERS * tiles * 2, tokens


def test_only_training_calls_make_the_ranks_agree_on_the_tiles(built_cards, monkeypatch):
    """Under a process group the ranks agree on the tiles in grad mode: one all_gather per MLP call. Without grad (eval,
    generate: ranks stop at different lengths) each tiles its own sequence, with no collective."""
    collectives = []

    def all_gather(outputs, tensor):
        collectives.append(tensor.tolist())
        outputs[0].copy_(tensor)

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)
    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *args, **kwargs: collectives.append("all_reduce"))
    model = tile_mlp(_cards(tiny_causal_lm("llama").train().to("npu"), built_cards))
    ids = token_ids(1, 130).to("npu")
    with torch.no_grad(), emulation.count_op_calls() as calls:
        logits = model(input_ids=ids).logits
    assert calls["npu_swiglu"] == LAYERS * 3 and collectives == []
    with emulation.count_op_calls() as calls:
        tiled_logits = model(input_ids=ids).logits
    assert calls["npu_swiglu"] == LAYERS * 3 and collectives == [[3, 130]] * LAYERS
    torch.testing.assert_close(tiled_logits.detach(), logits)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_model_without_a_dense_mlp_says_so(built_cards, family):
    model = _cards(tiny_causal_lm(family).train().to("npu"), built_cards)
    with pytest.raises(RuntimeError, match=r"the cards are applied .* no dense MLP the MLP card swapped"):
        tile_mlp(model, shards=TILES)


ZERO3 = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
}
"""ZeRO-3, every weight partitioned and gathered by hooks."""
ZERO3_TOKENS = {"eager": (6, 8), "tiled": (6, 8), "tiles unclamped": (6, 6)}
"""Each run's tokens on ranks 0 and 1: 4 tiles asked make 3 of 6 tokens, 4 of 8 (3 agreed); the control with 6 on both
ranks (unequal tile counts would leave the ranks waiting on each other's gathers)."""


def _zero3_rank(built_cards: str) -> dict:
    """One rank: one ZeRO-3 SGD step per run of ZERO3_TOKENS; each run's update of every parameter, npu_swiglu calls."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    from npu_hub_kernels import tiling

    deepspeed.init_distributed(dist_backend="hccl")
    rank = torch.distributed.get_rank()
    results = {}
    for run, tokens in ZERO3_TOKENS.items():
        torch.manual_seed(0)
        model = tiny_causal_lm("llama").train().to("npu")
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        if run != "eager":
            tile_mlp(_cards(model, built_cards), shards=TILES)
        asked_for = tiling._chunks
        if run == "tiles unclamped":  # as TiledMLP is handed `shards` unchecked
            tiling._chunks = lambda tokens, chunks: chunks
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=ZERO3
        )
        ids = token_ids(1, tokens[rank], seed=rank).to("npu")
        with emulation.count_op_calls() as calls:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        tiling._chunks = asked_for
        updates = {name: safe_get_full_fp32_param(p).cpu() - before[name].cpu() for name, p in model.named_parameters()}
        results[run] = {"updates": updates, "npu_swiglu": calls["npu_swiglu"]}
        engine.destroy()
    return results


@pytest.mark.slow
def test_zero3_updates_the_tiled_mlp_with_fewer_tokens_than_tiles(built_cards, tmp_path):
    """ZeRO-3 on 2 ranks, 4 tiles asked of 6 and 8 tokens: 3 tiles on each rank, every update as eager's. The control:
    4 tiles handed to TiledMLP on 6 tokens (torch.chunk makes 3) never mark the MLP's gradients ready, and ZeRO-3 never
    reduces them: the MLP is not updated."""
    env = {"DS_ACCELERATOR": "npu", "ASCEND_HOME_PATH": str(tmp_path), "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
    for rank, result in enumerate(run_distributed(_zero3_rank, str(built_cards), world_size=2, timeout=300, env=env)):
        eager, tiled, control = result["eager"], result["tiled"], result["tiles unclamped"]
        mlp = [name for name in eager["updates"] if ".mlp." in name]
        assert mlp and all(eager["updates"][name].abs().max() > 0 for name in mlp)
        for name, update in tiled["updates"].items():
            torch.testing.assert_close(update, eager["updates"][name], rtol=1e-4, atol=1e-6, msg=f"rank {rank} {name}")
        assert tiled["npu_swiglu"] == LAYERS * 3 * 2, rank
        assert all(control["updates"][name].abs().max() == 0 for name in mlp), rank
        assert control["npu_swiglu"] == LAYERS * 3 * 2, rank


def _shard_leaves(model) -> None:
    """LLaMA-Factory v1's FSDP2Engine.prepare_model: every leaf with trainable parameters a unit of its own."""
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if next(module.children(), None) is None and any(p.requires_grad for p in module.parameters(False)):
            fully_shard(module)


def _shard_layers(model, mlp_units: bool = False) -> None:
    """FSDP2 per decoder layer (each MLP a unit of its own first, if `mlp_units`), then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        if mlp_units:
            fully_shard(layer.mlp)
        fully_shard(layer)
    fully_shard(model)


def _error_of(call) -> str | None:
    try:
        call()
    except RuntimeError as error:
        return str(error)
    return None


DDP_FORMS = {
    "full fine-tuning, tile_mlp then DDP": (False, False, "before"),
    "full fine-tuning, DDP then tile_mlp": (False, False, "after"),
    "full fine-tuning, reentrant checkpointing": (False, True, "before"),
    "LoRA on q/v (the MLP frozen), tile_mlp then DDP": (True, False, "before"),
}
"""DDP forms, each trained tiled and untiled: (LoRA on q_proj/v_proj, reentrant gradient checkpointing (the tiles
recomputed in backward, outside DDP's forward), tile_mlp before or after wrapping)."""


def _ddp_run(built_cards: str, lora: bool, checkpointing: bool, tiling: str | None) -> dict:
    """2 AdamW steps of the kernelized model under DDP, tiled before or after wrapping (`tiling`) or not: the losses,
    npu_swiglu calls per step and final trainable parameters."""
    from torch.nn.parallel import DistributedDataParallel

    model = _cards(tiny_causal_lm("llama").train().to("npu"), built_cards)
    model = _lora(model) if lora else model
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if tiling == "before":
        tile_mlp(model, shards=TILES)
    ddp = DistributedDataParallel(model)
    if tiling == "after":
        tile_mlp(ddp, shards=TILES)
    run = _two_steps(ddp, [p for p in model.parameters() if p.requires_grad])
    run["final"] = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    return run


def _two_steps(model, params) -> dict:
    """Two AdamW steps of `model` on this rank's own batches: each step's loss and npu_swiglu calls."""
    import torch.distributed as dist

    optimizer = torch.optim.AdamW(params, lr=1e-3)
    run = {"losses": [], "npu_swiglu": []}
    for step in range(2):
        ids = token_ids(2, 12, seed=100 * dist.get_rank() + step).to("npu")
        with emulation.count_op_calls() as calls:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        run["losses"].append(loss.item())
        run["npu_swiglu"].append(calls["npu_swiglu"])
    return run


def _engines_rank(built_cards: str) -> dict:
    """One rank: the error of FSDP2 units inside a tiled MLP, sharded after or before tile_mlp (where it is raised),
    and each DDP form of DDP_FORMS trained untiled and tiled."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("hccl", timeout=datetime.timedelta(seconds=60))
    ids = token_ids(2, 12, seed=dist.get_rank()).to("npu")
    errors = {}
    model = tile_mlp(_cards(tiny_causal_lm("llama").train().to("npu"), built_cards), shards=TILES)
    _shard_leaves(model)
    _shard_layers(model)
    errors["FSDP2 leaves, after tile_mlp"] = _error_of(lambda: model(input_ids=ids, labels=ids))
    model = _cards(tiny_causal_lm("llama").train().to("npu"), built_cards)
    _shard_leaves(model)
    errors["FSDP2 leaves, before tile_mlp"] = _error_of(lambda: tile_mlp(model, shards=TILES))
    untiled = {kind: _ddp_run(built_cards, *kind, None) for kind in dict.fromkeys(f[:2] for f in DDP_FORMS.values())}
    ddp = {name: (untiled[form[:2]], _ddp_run(built_cards, *form)) for name, form in DDP_FORMS.items()}
    return {"errors": errors, "DDP": ddp}


def test_fsdp2_inside_the_mlp_raises_and_ddp_trains_tiled_as_untiled(built_cards):
    """2 ranks. FSDP2 units inside the tiled MLP (LLaMA-Factory v1's leaf-wise sharding) would reduce the first tile's
    gradients only, silently: they raise, naming tile_mlp and what to do, at the first forward if sharded after
    tile_mlp, at tile_mlp if before. DDP, whose reducer takes one gradient per parameter per backward (the tiled
    backward gave one per tile: "marked as ready twice"), trains tiled as untiled: 2 AdamW steps, the losses and final
    parameters, with the MLP trained or frozen (LoRA on q/v), tiled before or after wrapping, under reentrant
    checkpointing; fused per tile (once per layer and forward untiled, the control)."""
    for rank, result in enumerate(run_distributed(_engines_rank, str(built_cards), timeout=150)):
        errors = result["errors"]
        for form in ("FSDP2 leaves, after tile_mlp", "FSDP2 leaves, before tile_mlp"):
            assert errors[form] is not None, (rank, form)
            assert "tile_mlp: model.layers.0.mlp." in errors[form] and "FSDP2 unit" in errors[form], errors[form]
            assert "whole decoder layers, or to the MLP as one unit" in errors[form], errors[form]
        for form, (untiled, tiled) in result["DDP"].items():
            per_layer = (2, TILES * 3) if "checkpointing" in form else (1, TILES * 2)  # the checkpoint's recompute
            assert untiled["npu_swiglu"] == [LAYERS * per_layer[0]] * 2, (form, untiled["npu_swiglu"])
            assert tiled["npu_swiglu"] == [LAYERS * per_layer[1]] * 2, (form, tiled["npu_swiglu"])
            torch.testing.assert_close(tiled["losses"], untiled["losses"], rtol=1e-5, atol=1e-6)
            assert tiled["final"].keys() == untiled["final"].keys()
            assert any(".mlp." in name for name in tiled["final"]) != ("LoRA" in form), form
            for name, value in tiled["final"].items():
                error = (value - untiled["final"][name]).abs().max().item()
                assert torch.allclose(value, untiled["final"][name], rtol=1e-5, atol=1e-5), (rank, form, name, error)


FSDP2_FORMS = {
    "decoder layers, tile_mlp first": (False, False),
    "decoder layers, fully_shard first": (False, True),
    "MLP units, tile_mlp first": (True, False),
    "MLP units, fully_shard first": (True, True),
}
"""FSDP2 forms that tile: (each MLP a unit of its own, fully_shard before tile_mlp)."""


def _fsdp2_rank(built_cards: str) -> dict:
    """One rank: 2 AdamW steps of the kernelized model per FSDP2 form, untiled then tiled (full fine-tuning); each
    run's losses, npu_swiglu calls per step and final whole parameters."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    dist.init_process_group("hccl", timeout=datetime.timedelta(seconds=60))
    results = {}
    for form, (mlp_units, shard_first) in FSDP2_FORMS.items():
        for tiled in (False, True):
            model = _cards(tiny_causal_lm("llama").train().to("npu"), built_cards)
            if tiled and not shard_first:
                tile_mlp(model, shards=TILES)
            _shard_layers(model, mlp_units)
            if tiled and shard_first:
                tile_mlp(model, shards=TILES)
            run = _two_steps(model, model.parameters())
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            run["final"] = {name: value.detach().cpu() for name, value in state.items()}
            results[form, tiled] = run
    return results


@pytest.mark.slow
def test_fsdp2_on_decoder_layers_or_mlp_units_trains_tiled_as_untiled(built_cards):
    """2 ranks, FSDP2 on whole decoder layers or on each MLP as one unit, fully_shard before or after tile_mlp: no
    error, 2 training steps with the untiled run's losses and final parameters, fused per tile (once per layer
    untiled, the control)."""
    for rank, results in enumerate(run_distributed(_fsdp2_rank, str(built_cards), timeout=300)):
        for form in FSDP2_FORMS:
            untiled, tiled = results[form, False], results[form, True]
            assert untiled["npu_swiglu"] == [LAYERS] * 2 and tiled["npu_swiglu"] == [LAYERS * TILES * 2] * 2
            torch.testing.assert_close(tiled["losses"], untiled["losses"], rtol=1e-5, atol=1e-6)
            mlp = [name for name in untiled["final"] if ".mlp." in name]
            assert mlp and tiled["final"].keys() == untiled["final"].keys()
            for name, value in tiled["final"].items():
                error = (value - untiled["final"][name]).abs().max().item()
                assert torch.allclose(value, untiled["final"][name], rtol=1e-5, atol=1e-5), (rank, form, name, error)
