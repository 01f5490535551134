"""The weight forms in which transformers' RMSNorm classes scale the normalised input.

The build copies this file into each card that fuses an RMSNorm: npu-rms-norm, npu-add-rms-norm.

- "plain" (LlamaRMSNorm): `weight * normalize(x).to(dtype)`;
- "zero_centered" (GemmaRMSNorm): `(normalize(x) * (1 + weight.float())).to(dtype)`;
- "float32_scale" (Olmo2RMSNorm, HeliumRMSNorm): `(weight.float() * normalize(x)).to(dtype)`.

`rms_norm_math` is that math. A card layer that computes its norm class's forward marks its forward with
`computes_the_norm_forward`, so that a card which reads a norm's weight instead of calling the norm (npu-add-rms-norm)
can tell the forward kernelize binds on the norm's instance from one a user put there (`norm_forward_replaced`).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import nn

from ._internals import instance_forward, norm_weight_and_epsilon

Scaling = Literal["plain", "zero_centered", "float32_scale"]
SCALINGS: tuple[str, ...] = get_args(Scaling)
"""The accepted values of `scaling`."""


def check_scaling(scaling: object) -> None:
    """Raise ValueError naming the accepted values unless `scaling` is one of SCALINGS."""
    if scaling not in SCALINGS:
        raise ValueError(
            f"scaling={scaling!r} is not a way transformers scales an RMSNorm; pass one of "
            f"{', '.join(map(repr, SCALINGS))} (Llama's weight * x, Gemma's (1 + weight) * x, Olmo2's float32 weight)"
        )


def epsilon_of(norm: nn.Module) -> float | None:
    """An RMSNorm's epsilon, or None when the module has neither of the names transformers gives it.

    transformers names it `variance_epsilon` (Llama family) or `eps` (Gemma family): `norm_weight_and_epsilon` reads it.
    """
    return norm_weight_and_epsilon(norm)[1]


def rms_norm_math(x: torch.Tensor, weight: torch.Tensor, eps: float, scaling: Scaling = "plain") -> torch.Tensor:
    """The forward of transformers' LlamaRMSNorm, Gemma3RMSNorm or Olmo2RMSNorm, operation for operation.

    Which of the three is chosen by `scaling`.
    """
    check_scaling(scaling)
    input_dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if scaling == "plain":
        return weight * h.to(input_dtype)
    if scaling == "zero_centered":
        return (h * (1.0 + weight.float())).type_as(x)
    return (weight * h).to(input_dtype)


NORM_FORWARD_MARK = "_npu_hub_kernels_computes_the_norm_forward"
"""The attribute `computes_the_norm_forward` sets on a layer's forward (a name, not an object: each card package
holds its own copy of this file)."""


def computes_the_norm_forward(forward):
    """Mark a card layer's forward as computing what the forward of the norm class it replaces computes.

    The layers so marked are npu-rms-norm's.
    """
    setattr(forward, NORM_FORWARD_MARK, True)
    return forward


def norm_forward_replaced(norm: nn.Module) -> bool:
    """Whether calling `norm` runs a forward set on its instance that may compute something else than its class's.

    Such a forward is anything but the binding kernelize makes there (`MethodType(layer.forward, norm)`) of the class's
    own forward or of a layer marked by `computes_the_norm_forward`. accelerate's add_hook_to_module, a user's wrapper,
    another library's kernel are replacements.
    """
    forward = instance_forward(norm)
    if forward is None:
        return False
    function = getattr(forward, "__func__", None)
    if getattr(forward, "__self__", None) is not norm or function is None:
        return True
    return function is not getattr(type(norm), "forward", None) and not getattr(function, NORM_FORWARD_MARK, False)
