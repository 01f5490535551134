"""Sequence tiling of the cards' MLPs: DeepSpeed's `TiledMLP` around the fused layer (`tile_mlp`).

At long sequences an MLP's intermediate activations ([tokens, intermediate] for gate, up and their product, in forward
and backward) are the largest of a decoder layer. DeepSpeed's `TiledMLP` (`deepspeed.runtime.sequence_parallel.
ulysses_sp`, the sequence-tiled MLP of Arctic Long Sequence Training) runs a function of the MLP on tiles of the
sequence without autograd, then in backward runs it again tile by tile with autograd, so that one tile's activations
are alive at a time. `tile_mlp` hands it the card's layer that kernelize bound on each MLP (the layers a card.toml
names in `sequence_tiled_layers`), so each tile runs the fused op, forward and backward; the MLP's parameters go in as
inputs autograd sees, and the backward's recompute runs under the forward's autocast (`_tiled_function`). The loss
card needs no tiling of its own: it already works in chunks of tokens.

The wrapper is set on each module as its forward, around the layer's (`__wrapped__`, as `functools.wraps` sets it):
`swapped_modules` still lists the module as running the card's layer, and kernelize (the cards registered by
npu_hub_kernels) keeps it, as it keeps any forward another library set on a module.

Two engines would take the tiles' gradients wrong, and the wrapper refuses them (`refuse_miscounting_engine`): FSDP2
units below the tiled module (fully_shard on the MLP's Linears or LoRA leaves: only the first tile's gradients would be
reduced, silently), and DDP with trainable MLP parameters (its reducer takes one gradient per parameter per backward,
the tiled backward gives one per tile). FSDP2 on whole decoder layers or on the MLP as one unit, and ZeRO-3, tile.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
from collections.abc import Callable
from functools import cache

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import _kernels_compat as compat
from .cards import CARDS
from .report import card_layer_of

TILED_LAYERS = frozenset((card.repo_name, layer) for card in CARDS.values() for layer in card.sequence_tiled_layers)
"""(card, layer) of the layers that work token by token on [..., sequence, hidden] (card.toml)."""


def tile_mlp(model: nn.Module, shards: int | None = None) -> nn.Module:
    """Run every module of `model` that runs a card's sequence-tiled layer in tiles of the sequence; return `model`.

    Apply it after the cards (`apply_npu_kernels` or kernelize), before or after PEFT, before the trainer wraps the
    model (docs/long-context.md, "Sequence-tiled MLP and loss").

    Args:
        model: a model the cards were applied to, PEFT-wrapped or not.
        shards: tiles asked per call; None: ceil(sequence / hidden size) per call (DeepSpeed's recipe). Cut per call
            to the tiles torch.chunk makes of the sequence; under a started process group the ranks agree on the
            count in grad mode (one all_gather and a host sync per MLP call, `_tiles`); without grad (eval, generate)
            each rank tiles its own sequence, with no collective.

    Raises:
        RuntimeError: no module of `model` runs such a layer (the cards are not applied yet, their MLP card is not
            selected, or the model has no dense MLP the card swapped, as a mixture of experts: nothing would run fused
            in tiles), or one of them is tiled already, or has an FSDP2 unit (fully_shard) below it, or `model` is
            wrapped in DDP and one of them has trainable parameters. The tiled forward raises the last two at its
            call as well (the engine may wrap the model after tile_mlp).
        ValueError: `shards` is not a positive integer.
    """
    if shards is not None and (not isinstance(shards, int) or shards < 1):
        raise ValueError(f"shards must be a positive integer or None, not {shards!r}")
    _tiled_function()  # DeepSpeed imported now: without it this call fails, not the first training step
    found = []
    for name, module in model.named_modules():
        forward = compat.instance_forward(module)
        if isinstance(forward, TiledForward):
            raise RuntimeError(f"{name} is tiled already: call tile_mlp once")
        build, layer = card_layer_of(module) or (None, None)
        if build is not None and (build.CARD, layer) in TILED_LAYERS:
            found.append((name, module, forward))
    if not found:
        raise RuntimeError(_nothing_to_tile(model))
    in_ddp = any(isinstance(module, DistributedDataParallel) for module in model.modules())
    tiled = [TiledForward(name, module, forward, shards) for name, module, forward in found]
    for tiled_forward in tiled:
        tiled_forward.refuse_miscounting_engine(in_ddp)
    for (_, module, _), tiled_forward in zip(found, tiled, strict=True):
        module.forward = tiled_forward
    return model


def _nothing_to_tile(model: nn.Module) -> str:
    """Why no module of `model` can be tiled: the cards are not applied, or none of them swapped a dense MLP."""
    tiled = ", ".join(sorted(f"{card}:{layer}" for card, layer in TILED_LAYERS))
    bound = sorted({f"{build.CARD}:{layer}" for build, layer in filter(None, map(card_layer_of, model.modules()))})
    what = type(model).__name__
    if not bound:
        return (
            f"no card is applied to this {what}: apply the cards first (apply_npu_kernels(model) or kernelize, with "
            f"the MLP card selected), then tile_mlp(model); tiling the class's own forward would run its eager math "
            "in every tile"
        )
    return (
        f"the cards are applied to this {what} ({', '.join(bound)}), but none of its modules runs a sequence-tiled "
        f"layer ({tiled}): it has no dense MLP the MLP card swapped (a mixture of experts such as Mixtral or "
        "Qwen3-MoE: tile_mlp does not tile experts), or the MLP card was not selected; nothing would run fused in tiles"
    )


class TiledForward:
    """A module's forward that runs the card layer's forward it wraps in tiles of the sequence (DeepSpeed's TiledMLP).

    `__wrapped__` is the wrapped forward (`swapped_modules` and kernelize follow it)."""

    def __init__(self, name: str, module: nn.Module, layer_forward: Callable, shards: int | None):
        self.__wrapped__, self.shards, self.name = layer_forward, shards, name
        self._parameters = module.parameters  # TiledMLP's compute_params, read per call (ZeRO-3 may swap them)
        self._named_modules = module.named_modules  # read per call: fully_shard may come after tile_mlp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.distributed.is_available() and torch.distributed.is_initialized():  # no engine without a group
            self.refuse_miscounting_engine(DistributedDataParallel._active_ddp_module is not None)
        params = [p for p in self._parameters() if p.requires_grad]
        tiles = _tiles(x, self.shards, agreed=torch.is_grad_enabled())
        return _tiled_function().apply(_run_layer, self, x, tiles, params, *params)

    def refuse_miscounting_engine(self, in_ddp: bool) -> None:
        """Raise if the engine around the module would take the tiles' gradients wrong: FSDP2 below it, or DDP.

        FSDP2 units below the tiled module (fully_shard on its Linears or LoRA leaves, as LLaMA-Factory v1 shards
        every trainable leaf): each tile calls them, and FSDP2 runs their pre- and post-backward and reduce-scatter
        for the first tile of the backward only; the later tiles' gradients pile up on the unsharded parameters and
        are never reduced (the MLP's gradients 0.4-0.9x eager's, no error). FSDP2 on the module itself or a unit above
        it (a decoder layer) gathers and reduces around the whole tiled call, and is right. DDP (`in_ddp`: inside its
        forward, or the model given to tile_mlp is wrapped) with trainable parameters here: its reducer takes one
        gradient per parameter per backward, the tiled backward gives one per tile, and DDP fails in backward with
        "marked as ready twice"; with the module frozen (LoRA on attention only) nothing here is reduced, and it tiles.
        A walk of the module's few submodules per call, under a started process group only (no engine without one),
        and only once FSDP2 is imported (no module is an FSDPModule before; importing it here would cost 0.6 s).
        """
        fsdp = sys.modules.get("torch.distributed.fsdp")
        below = itertools.islice(self._named_modules(), 1, None)
        sharded = next((name for name, module in below if isinstance(module, fsdp.FSDPModule)), None) if fsdp else None
        if sharded is not None:
            raise RuntimeError(
                f"tile_mlp: {self.name}.{sharded} is an FSDP2 unit of its own (fully_shard) inside the tiled "
                f"{self.name}: FSDP2 would reduce the gradients of the first tile only and leave the other tiles' "
                "gradients unreduced (silently wrong). Apply fully_shard to whole decoder layers, or to the MLP as one "
                "unit, not to its Linears or LoRA leaves (LLaMA-Factory v1's leaf-wise sharding), or do not tile_mlp"
            )
        if in_ddp and any(p.requires_grad for p in self._parameters()):
            raise RuntimeError(
                f"tile_mlp: {self.name} has trainable parameters and runs under DistributedDataParallel: DDP takes one "
                "gradient per parameter per backward, and the tiled backward gives the MLP's one per tile (DDP would "
                "fail with 'marked as ready twice'). Use FSDP2 (fully_shard per decoder layer) or DeepSpeed ZeRO-3 "
                "with tile_mlp, freeze the MLP (LoRA on the attention only tiles under DDP), or do not tile_mlp"
            )


def _run_layer(tiled: TiledForward, x: torch.Tensor) -> torch.Tensor:
    """One tile: the card layer's forward on `x` (TiledMLP calls it as fn(self, x))."""
    return tiled.__wrapped__(x)


def _tiles(x: torch.Tensor, shards: int | None, agreed: bool) -> int:
    """The tiles of this call for `x` [..., sequence, hidden]: `shards`, or ceil(sequence / hidden size) if None.

    Never more than torch.chunk makes of the sequence (6 tokens in 4 chunks make 3): TiledMLP's backward marks the
    MLP's gradients ready for ZeRO-3 at its tile number `shards` only, and `x`'s [batch x sequence] rows in as many
    chunks make as many tiles. `agreed` (grad mode: training) under a started process group: the ranks agree (ZeRO-3
    gathers the MLP's weights per tile and reduces its gradients after the last: every rank must run as many), one
    all_gather of two integers and a host sync per call, the largest count that tiles every rank's sequence exactly.
    Without grad (eval, generate: ranks may stop at different lengths) each rank tiles its own, with no collective.
    """
    tokens = x.shape[-2]
    wanted = shards or max(1, math.ceil(tokens / x.shape[-1]))
    every_tokens = [tokens]
    if agreed and torch.distributed.is_available() and torch.distributed.is_initialized():
        mine = torch.tensor([wanted, tokens], device=x.device)
        gathered = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(gathered, mine)
        ranks = torch.stack(gathered).tolist()
        wanted, every_tokens = max(rank_wanted for rank_wanted, _ in ranks), [rank_tokens for _, rank_tokens in ranks]
    return next(n for n in range(wanted, 0, -1) if all(_chunks(t, n) == n for t in every_tokens))


def _chunks(tokens: int, chunks: int) -> int:
    """How many pieces torch.chunk makes of `tokens` rows asked for `chunks` (pieces of ceil(tokens / chunks))."""
    return math.ceil(tokens / math.ceil(tokens / chunks)) if tokens else 1


@cache
def _tiled_function() -> type[torch.autograd.Function]:
    """DeepSpeed's TiledMLP with the parameters as inputs and the forward's autocast in the backward's recompute.

    TiledMLP takes the parameters in a list, which autograd does not see: its output would need a gradient only when
    `x` does, and an MLP whose input needs none (the MLPs trained alone, LoRA on the MLP only) would get no gradient.
    Its backward recomputes each tile where the forward's autocast is no longer on: under bf16 autocast the recompute
    would run in the weights' float32.
    """
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP  # imported only when asked for

    class CardTiledMLP(TiledMLP):
        """TiledMLP.apply(fn, self, x, shards, compute_params, *compute_params), the forward's autocast kept."""

        @staticmethod
        def forward(ctx, fn, module, x, shards, compute_params, *parameters):
            ctx.parameter_count = len(parameters)
            ctx.autocast = [
                (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                for device in dict.fromkeys((x.device.type, "cpu"))
            ]
            ctx.autocast_cache = torch.is_autocast_cache_enabled()
            return TiledMLP.forward(ctx, fn, module, x, shards, compute_params)

        @staticmethod
        def backward(ctx, *grads):
            with contextlib.ExitStack() as stack:
                for device, enabled, dtype in ctx.autocast:
                    stack.enter_context(
                        torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=ctx.autocast_cache)
                    )
                grads = TiledMLP.backward(ctx, *grads)
            return (*grads, *[None] * ctx.parameter_count)  # TiledMLP's backward accumulated theirs

    return CardTiledMLP
