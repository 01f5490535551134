"""The fused regions of a decoder layer, found and run the same way by the counted and the device-timed modes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from npu_hub_kernels._kernels_compat import instance_forward, kernel_funcs, release_instance_forward
from npu_hub_kernels.report import ROOT_MODULE

from .cards import LayerRegion, card_named, spec, with_piece
from .configs import DTYPE, ModelSpec


@dataclass
class Region:
    """A fused region of a decoder layer: a module (or function-module) a card swaps, and its call."""

    kind: str
    name: str
    card: str | None  # None: no card swaps it (yet)
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    layer_region: LayerRegion | None = None  # a card that swaps the layer itself: its region inside it


WITHOUT_LAYER_CARD = "kernelized, the layer's own forward"
"""The variant of a layer as it runs without the card that swaps the decoder layer itself: every other card's layer,
and the decoder layer class's own forward (what the default path was before such a card)."""


def set_variant(layer: nn.Module, variant: str) -> None:
    """Give the layer the forwards of a variant.

    The forwards are the classes' own ("eager"), the cards' layers for npu ("kernelized": kernelize only, the default
    path), or those but the layer's own (`WITHOUT_LAYER_CARD`). Called before every run: the rotary function-modules are
    shared by the process."""
    from kernels import Mode, kernelize

    kernelize(layer, mode=Mode.TRAINING, device="cpu" if variant == "eager" else "npu")
    if variant == WITHOUT_LAYER_CARD and instance_forward(layer) is not None:
        release_instance_forward(layer)


def find_regions(layer: nn.Module, variant: str = "kernelized") -> list[Region]:
    """Find the layer's fused regions in a kernelized variant.

    They are what the cards swap in, plus the modules no card swaps that a card's spec recognises as its region
    (`is_region`). A card that swaps the layer itself brings the region its spec's `layer_region` names, in place of any
    other at its anchor."""
    from npu_hub_kernels import swapped_modules

    set_variant(layer, variant)
    swaps = swapped_modules(layer)
    regions = {
        swap.module: Region(card_named(swap.card).region, swap.module, swap.card)
        for swap in swaps
        if swap.module != ROOT_MODULE
    }
    for swap in (swap for swap in swaps if swap.module == ROOT_MODULE):
        card = card_named(swap.card)
        inner = spec(card).layer_region(layer)
        regions[inner.anchor] = Region(card.region, inner.anchor, swap.card, layer_region=inner)
    recognisers = with_piece("is_region")
    for name, module in layer.named_modules():
        card = next((card for card, is_region in recognisers if is_region(module)), None)
        if card is not None and name not in regions:
            regions[name] = Region(card.region, name, None)
    return list(regions.values())


def resolve(layer: nn.Module, name: str) -> nn.Module:
    """A module of the layer by qualified name; function-modules are found among their caller's kernel functions."""
    try:
        return layer.get_submodule(name)
    except AttributeError:
        parent, _, function = name.rpartition(".")
        return kernel_funcs(layer.get_submodule(parent))[function]


def capture(
    layer: nn.Module, regions: list[Region], args: tuple, kwargs: dict, context: contextlib.AbstractContextManager
) -> None:
    """Keep each region's call (its arguments) from one forward of the layer run inside `context`."""
    captured: dict[str, tuple] = {}
    hooks = []
    for region in regions:

        def hook(module, call_args, call_kwargs, name=region.name):
            captured.setdefault(name, (call_args, call_kwargs))

        hooks.append(resolve(layer, region.name).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with context:
            layer(*args, **kwargs)
    finally:
        for handle in hooks:
            handle.remove()
    for region in regions:
        region.args, region.kwargs = captured[region.name]
        if region.layer_region is not None:
            region.args, region.kwargs = region.layer_region.arguments(region.args, region.kwargs)


def region_call(layer: nn.Module, region: Region, variant: str) -> tuple[Callable, Iterable[nn.Parameter]]:
    """Return what runs the region in the layer's variant and the parameters it reads.

    What runs it is its module, or, for a region inside a swapped layer, what its `layer_region` runs."""
    module = resolve(layer, region.name)
    if region.layer_region is None:
        return module, module.parameters()
    return region.layer_region.run(layer, variant), module.parameters()


def layer_inputs(spec: ModelSpec, batch: int, seq: int, make: Callable) -> tuple[tuple, dict]:
    """A decoder layer's inputs as the model passes them: hidden states, cos/sin, no mask (causal sdpa)."""
    hidden = make(batch, seq, spec.config["hidden_size"], dtype=DTYPE, device="npu").requires_grad_()
    cos, sin = (make(batch, seq, spec.config["head_dim"], dtype=DTYPE, device="npu") for _ in range(2))
    return (hidden,), {"attention_mask": None, "position_embeddings": (cos, sin)}


def _differentiable(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def forward_backward(fn: Callable, args: tuple, kwargs: dict, params: Iterable, phase: str, make_grad) -> None:
    """Run fn forward in inference mode, or forward and backward, as `phase` says.

    "fwd" runs it in inference mode (it stands for inference); "fwd+bwd" runs it forward and takes the gradients w.r.t.
    its tensor inputs and parameters."""
    if phase == "fwd":
        with torch.inference_mode():
            fn(*args, **kwargs)
        return
    outs = [t for t in tree_leaves(fn(*args, **kwargs)) if _differentiable(t)]
    wrt = [t for t in tree_leaves((args, kwargs)) if _differentiable(t)] + [p for p in params if p.requires_grad]
    torch.autograd.grad(outs, wrt, [make_grad(t) for t in outs], allow_unused=True)
