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
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from functools import cache

import torch
from torch import nn

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
            in tiles), or one of them is tiled already.
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
            found.append((module, forward))
    if not found:
        raise RuntimeError(_nothing_to_tile(model))
    for module, forward in found:
        module.forward = TiledForward(module, forward, shards)
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

    def __init__(self, module: nn.Module, layer_forward: Callable, shards: int | None):
        self.__wrapped__, self.shards = layer_forward, shards
        self._parameters = module.parameters  # TiledMLP's compute_params, read per call (ZeRO-3 may swap them)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        params = [p for p in self._parameters() if p.requires_grad]
        tiles = _tiles(x, self.shards, agreed=torch.is_grad_enabled())
        return _tiled_function().apply(_run_layer, self, x, tiles, params, *params)


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
