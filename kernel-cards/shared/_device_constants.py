"""Constant tensors a card keeps per device (the build copies this file into the cards that list it).

npu-fused-attention keeps the op's compressed causal mask, npu-rms-norm a float32 1 for its one-call `1 + weight`.
Such a constant belongs to no module: it is no parameter and no buffer (a kernel never changes where a module's
memory lives, nor what its state dict holds), and it is made once per device, not at each call (each making is a
kernel on the device).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

_CONSTANTS: dict[tuple[str, torch.device], torch.Tensor] = {}


def device_constant(name: str, like: torch.Tensor, make: Callable[[torch.device], torch.Tensor]) -> torch.Tensor:
    """The constant `name` on like's device: `make(device)`, made once per device and kind of tensor, then kept.

    Made outside inference mode, even when the first call is inside it (generate): an inference tensor could not be
    saved for a later training call's backward. A kept constant of another tensor type than like's (a tracing mode's
    tensors, which cannot mix with the device's), or a fake tensor of another fake mode, is made anew. For a fake
    `like` it is made in like's fake mode, also where that mode is not entered: PyTorch runs a fake tensor's ops in
    its own mode outside `with mode:` too, where a plain constant beside it would be refused."""
    key = (name, like.device)
    constant = _CONSTANTS.get(key)
    mode = _fake_mode(like)
    if constant is None or type(constant) is not type(like) or _fake_mode(constant) is not mode:
        with torch.inference_mode(False), contextlib.nullcontext() if mode is None else mode:
            constant = _CONSTANTS[key] = make(like.device)
    return constant


def _fake_mode(tensor: torch.Tensor) -> object | None:
    """The fake mode a fake tensor belongs to (`FakeTensor.fake_mode`), None for any other tensor."""
    return getattr(tensor, "fake_mode", None)
