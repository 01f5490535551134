"""Register the cards with the `kernels` mapping for the "npu" device, and swap them into models.

`register_npu_kernels` maps each selected card's layers for "npu" under the card's own namespaced
names (e.g. "npu-rms-norm:RMSNorm") and has `npu_hub_kernels.retag` tag the transformers classes
and rotary functions of `npu_hub_kernels.models` with them; `kernels.kernelize` (or transformers'
`use_kernels=True`) then swaps the layers in. Each build variant is digest-checked before import
(`npu_hub_kernels.integrity`).

Trade-off, documented in docs/models.md: a retagged class looks up only the npu-hub-kernels entry, so
on other devices (cuda, rocm, ...) it keeps its original forward. Call `unregister_npu_kernels()`
to restore the classes.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kernels import Mode, kernelize, register_kernel_mapping, use_kernel_mapping
from torch import nn

from . import retag
from .attention import (
    ATTENTION_FUNCTION,
    flash_attention_drops,
    is_attention_card,
    register_attention,
    use_fused_attention,
)
from .cards import CARDS, Card, resolve_org, version_problem
from .integrity import CheckedLayerRepository, CheckedLocalLayerRepository
from .models import MODEL_CLASSES
from .selftest import results as selftest_results
from .zero3 import mark_zero3_leaf_mlps

logger = logging.getLogger(__name__)

KernelSelection = str | bool | Iterable[str] | None

_registration: dict[str, Any] | None = None
"""Where the process's last `register_npu_kernels` call loads the cards from (None: no cards registered)."""


def available_kernels() -> list[str]:
    """The kernel ids npu-hub-kernels provides, e.g. ["npu_fused_rmsnorm"]."""
    return list(CARDS)


def select_kernels(kernels: KernelSelection) -> list[Card]:
    """Parse a kernel selection: "auto"/True (all), None/False (none), ids as a list or "a,b"."""
    if kernels is None or kernels is False:
        return []
    if kernels is True or kernels == "auto":
        return list(CARDS.values())
    if isinstance(kernels, str):
        ids = [k.strip() for k in kernels.split(",")]
    elif isinstance(kernels, Iterable) and not isinstance(kernels, bytes | bytearray):
        ids = list(kernels)
        if not all(isinstance(k, str) for k in ids):
            raise TypeError(_selection_error(kernels))
    else:
        raise TypeError(_selection_error(kernels))
    ids = [k for k in ids if k]
    unknown = [k for k in ids if k not in CARDS]
    if unknown:
        raise ValueError(
            f"Unknown kernel id(s) {', '.join(map(repr, unknown))}. Available: {', '.join(CARDS)}; "
            'or pass "auto" for all of them, None to turn kernels off.'
        )
    return [CARDS[k] for k in dict.fromkeys(ids)]


def _selection_error(kernels: object) -> str:
    return (
        f'kernels={kernels!r} is not a kernel selection. Pass "auto" or True for all cards, None or False for '
        f"none, or kernel ids as a list of strings or one comma-separated string, from: {', '.join(CARDS)}."
    )


def register_npu_kernels(
    org: str | None = None,
    *,
    version: int = 1,
    local_dir: str | Path | None = None,
    kernels: KernelSelection = "auto",
    trust_remote_code: bool | list[str] | None = None,
    use_selftest: bool | None = None,
) -> list[str]:
    """Map the selected cards' layers for the "npu" device (inference and training), retag the classes.

    An attention card (no layers: npu-fused-attention) is registered as a transformers attention implementation
    under its kernel id instead (`npu_hub_kernels.attention`).

    Args:
        org: Hub organisation of the cards; default $NPU_HUB_KERNELS_ORG, else "npu-hub-kernels".
        version: card API version, the Hub branch `v<version>`.
        local_dir: load from this folder of built cards (`make build`'s build/) instead of the Hub.
        kernels: "auto" for all cards, a list or comma-separated string of kernel ids, None for none.
        trust_remote_code: passed to the `kernels` loader. None trusts exactly the selected card
            repositories (you asked for them by calling this function), nothing else.
        use_selftest: stand down the card forms that failed this host's last `python -m npu_hub_kernels selftest`
            (their layers run eager, saying why; docs/selftest.md). None: unless $NPU_HUB_KERNELS_USE_SELFTEST=0.

    Returns:
        The kernel ids registered.

    Raises:
        ValueError: a malformed `org` (an empty one included) or `version`, with the doctor's rules.
    """
    global _registration
    cards = select_kernels(kernels)
    org = resolve_org(org)
    problem = version_problem(version)
    if problem:
        raise ValueError(f"version={problem}")
    trust = [card.repo_id(org) for card in cards] if trust_remote_code is None else trust_remote_code
    mapping = {}
    for card in cards:
        if is_attention_card(card):
            source = dict(org=org, version=version, local_dir=local_dir, trust=trust)
            register_attention(card, _repository(card, ATTENTION_FUNCTION, **source))
        for layer in card.layers:
            repo = _repository(card, layer, org=org, version=version, local_dir=local_dir, trust=trust)
            mapping[card.mapping_name(layer)] = {"npu": {Mode.INFERENCE: repo, Mode.TRAINING: repo}}
    register_kernel_mapping(mapping)
    selftest_results.stand_down(cards, org=org, version=version, local_dir=local_dir, use=use_selftest)
    for card in cards:
        for rule in MODEL_CLASSES[card.kernel_id]:
            retag.tag_when_imported(rule, card.mapping_name(rule.layer))
    if cards:
        _registration = dict(org=org, version=version, local_dir=local_dir, trust_remote_code=trust_remote_code)
    return [card.kernel_id for card in cards]


def registration() -> dict[str, Any] | None:
    """The source arguments of the process's last `register_npu_kernels` call that registered cards, or None.

    The arguments are org, version, local_dir and trust_remote_code. None if no call registered cards, or since
    `unregister_npu_kernels()`.

    Pass them to `register_npu_kernels` or `apply_npu_kernels` to load more cards from the same place.
    """
    return None if _registration is None else dict(_registration)


def unregister_npu_kernels() -> None:
    """Undo the retagging, wrapping and attaching, and release the card forward bound on shared rotary functions.

    That forward is the one kernelize bound on the rotary function-modules a family's models share. The mapping
    entries stay, unused.
    """
    global _registration
    _registration = None
    retag.restore()
    selftest_results.forget()


def apply_npu_kernels(
    model: nn.Module,
    kernels: KernelSelection = "auto",
    mode: Mode | None = None,
    **register_kwargs,
) -> nn.Module:
    """Register the selected cards and kernelize `model` for "npu" with those cards only.

    It is the counterpart of LLaMA-Factory's `apply_default_kernels`.

    The selection applies to `model` whatever was registered before: the layers of cards registered
    earlier but not selected now keep (or get back) their original forward in `model`. The rotary
    function-modules are shared by every model of a family (docs/models.md), so for those the last call wins.
    `mode` defaults to TRAINING or INFERENCE after `model.training`. Other keyword arguments go to
    `register_npu_kernels`. With kernels=None or False the model is returned untouched. When deepspeed is
    imported (a ZeRO-3 run is likely), the split MLPs the cards swapped become ZeRO-3 leaf modules so that they
    fuse under ZeRO-3 too (`zero3.mark_zero3_leaf_mlps`); that changes nothing outside ZeRO-3.

    An attention card selected (npu_fused_attention, in "auto") becomes the model's attention where its attention is
    transformers' default "sdpa" and its table fuses every attention class of the model; any other attention the model
    was given is kept, and so is sdpa when the selection leaves the card out or its choice is visible (DeepSpeed's
    Ulysses wrapper installed over it, `accelerate launch` naming it: `attention.use_fused_attention`). A
    model on the npu left on transformers' flash_attention_2, which drops sliding windows and sinks there, is warned.
    """
    selected = register_npu_kernels(kernels=kernels, **register_kwargs)
    if not selected:
        return model
    first = next(model.parameters(), None)
    if first is not None and first.device.type != "npu":
        logger.warning(
            "apply_npu_kernels: the model is on %s; the fused NPU ops run only on npu tensors "
            "(the layers take the eager path elsewhere). Move the model with .to('npu') first.",
            first.device.type,
        )
    if mode is None:
        mode = Mode.TRAINING if model.training else Mode.INFERENCE
    # For this call only, the cards not selected have no "npu" entry: kernelize gives their layers the original
    # forward. Every other entry (the selected cards', other libraries') stays as registered.
    unselected = {
        card.mapping_name(layer): {"npu": {}}
        for card in CARDS.values()
        if card.kernel_id not in selected
        for layer in card.layers
    }
    with use_kernel_mapping(unselected):
        kernelize(model, mode=mode, device="npu")
    if "deepspeed" in sys.modules:
        mark_zero3_leaf_mlps(model)
    for card in CARDS.values():
        if is_attention_card(card) and card.kernel_id in selected:
            use_fused_attention(model, card)
    warning = next((flash_attention_drops(model, c.kernel_id) for c in CARDS.values() if is_attention_card(c)), None)
    if warning is not None:
        logger.warning("apply_npu_kernels: %s", warning)
    return model


def _repository(card: Card, layer: str, *, org: str, version: int, local_dir, trust):
    """kernels' repository of one layer of `card`, which checks each build variant's files before importing it.

    It refuses to import a build variant whose files fail the digest in its metadata.json
    (npu_hub_kernels.integrity).
    """
    if local_dir is None:
        return CheckedLayerRepository(card.repo_id(org), layer_name=layer, version=version, trust_remote_code=trust)
    card_dir = Path(local_dir) / card.repo_name
    if not (card_dir / "build").is_dir():
        raise FileNotFoundError(
            f"{card_dir} holds no built card (no build/ folder). Build the cards first (`make build`), "
            f"and pass the folder that contains {card.repo_name}/."
        )
    return CheckedLocalLayerRepository(repo_path=card_dir.resolve(), layer_name=layer)
