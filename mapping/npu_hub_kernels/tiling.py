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

The tiled backward gives the MLP's parameters a gradient per tile. ZeRO-3 takes the last (TiledMLP marks them ready
there), FSDP2 on a decoder layer or the MLP as one unit reduces after the whole call; DDP takes one gradient per
parameter per backward, so under DDP the tiles' gradients are summed and handed to autograd once
(`_backward_parameter_gradients_once`). FSDP2 units below the tiled module (fully_shard on the MLP's Linears or LoRA
leaves) would reduce the first tile's only, silently: the wrapper refuses them (`refuse_fsdp2_units_inside`).
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
            in tiles), or one of them is tiled already, or has an FSDP2 unit (fully_shard) below it (raised at the tiled
            forward's call as well: fully_shard may come after tile_mlp).
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
    tiled = [TiledForward(name, module, forward, shards) for name, module, forward in found]
    for tiled_forward in tiled:
        tiled_forward.refuse_fsdp2_units_inside()
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

    `__wrapped__` is the wrapped forward (`swapped_modules` and kernelize follow it). `under_ddp`: called inside a
    DistributedDataParallel's forward once (kept: a reentrant checkpoint recomputes it in backward, outside that
    forward); from then on its backward hands autograd the parameters' gradients once, summed over the tiles."""

    def __init__(self, name: str, module: nn.Module, layer_forward: Callable, shards: int | None):
        self.__wrapped__, self.shards, self.name = layer_forward, shards, name
        self.under_ddp = False
        self._parameters = module.parameters  # TiledMLP's compute_params, read per call (ZeRO-3 may swap them)
        self._named_modules = module.named_modules  # read per call: fully_shard may come after tile_mlp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.distributed.is_available() and torch.distributed.is_initialized():  # no engine without a group
            self.refuse_fsdp2_units_inside()
            self.under_ddp = self.under_ddp or DistributedDataParallel._active_ddp_module is not None
        params = [p for p in self._parameters() if p.requires_grad]
        tiles = _tiles(x, self.shards, agreed=torch.is_grad_enabled())
        return _tiled_function().apply(_run_layer, self, x, tiles, params, *params)

    def refuse_fsdp2_units_inside(self) -> None:
        """Raise if an FSDP2 unit (fully_shard) is below the module: it would reduce the first tile's gradients only.

        FSDP2 units below the tiled module (fully_shard on its Linears or LoRA leaves, as LLaMA-Factory v1 shards
        every trainable leaf): each tile calls them, and FSDP2 runs their pre- and post-backward and reduce-scatter
        for the first tile of the backward only; the later tiles' gradients pile up on the unsharded parameters and
        are never reduced (the MLP's gradients 0.4-0.9x eager's, no error). FSDP2 on the module itself or a unit above
        it (a decoder layer) gathers and reduces around the whole tiled call, and is right. A walk of the module's few
        submodules per call, under a started process group only (no engine without one), and only once FSDP2 is
        imported (no module is an FSDPModule before; importing it here would cost 0.6 s).
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
    would run in the weights' float32. Under DDP its backward's per-tile gradients would each fire DDP's reducer
    ("marked as ready twice"): there the backward is `_backward_parameter_gradients_once`.
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
            ctx.gradients_once = module.under_ddp
            return TiledMLP.forward(ctx, fn, module, x, shards, compute_params)

        @staticmethod
        def backward(ctx, *grads):
            with contextlib.ExitStack() as stack:
                for device, enabled, dtype in ctx.autocast:
                    stack.enter_context(
                        torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=ctx.autocast_cache)
                    )
                if ctx.gradients_once:
                    return _backward_parameter_gradients_once(ctx, grads[0])
                grads = TiledMLP.backward(ctx, *grads)
            return (*grads, *[None] * ctx.parameter_count)  # TiledMLP's backward accumulated theirs

    return CardTiledMLP


def _backward_parameter_gradients_once(ctx, grad: torch.Tensor) -> tuple:
    """The tiled backward under DDP: x's gradient, and each parameter's summed over the tiles, returned to autograd.

    Each tile is recomputed with autograd, as TiledMLP's backward does (the rows of [batch x sequence] in `ctx.shards`
    chunks), but its gradients are taken with torch.autograd.grad, which runs no parameter's AccumulateGrad (DDP's
    reducer hooks there). The sums go back as the gradients of the CardTiledMLP inputs the parameters are, so autograd
    accumulates each once and DDP's reducer sees each parameter ready once.
    """
    (x,) = ctx.saved_tensors
    params, needs_x = ctx.compute_params, x.requires_grad
    rows, grad_rows = x.detach().reshape(-1, x.shape[-1]), grad.reshape(-1, x.shape[-1])
    x_grads, param_grads = [], [None] * len(params)
    for tile, grad_tile in zip(torch.chunk(rows, ctx.shards), torch.chunk(grad_rows, ctx.shards), strict=True):
        tile = tile.detach().requires_grad_(needs_x)
        with torch.enable_grad():
            output = ctx.fn(ctx.self, tile)
        got = torch.autograd.grad(output, [tile, *params] if needs_x else params, grad_tile, allow_unused=True)
        if needs_x:
            x_grads.append(got[0])
        for index, tile_grad in enumerate(got[needs_x:]):
            if tile_grad is not None:
                param_grads[index] = tile_grad if param_grads[index] is None else param_grads[index].add_(tile_grad)
    x_grad = torch.cat(x_grads).view(x.shape) if needs_x else None
    return (None, None, x_grad, None, None, *param_grads)
