"""The weight forms in which transformers' RMSNorm classes scale the normalised input (the build copies this file
into each card that fuses an RMSNorm: npu-rms-norm, npu-add-rms-norm).

- "plain" (LlamaRMSNorm): `weight * normalize(x).to(dtype)`;
- "zero_centered" (GemmaRMSNorm): `(normalize(x) * (1 + weight.float())).to(dtype)`;
- "float32_scale" (Olmo2RMSNorm, HeliumRMSNorm): `(weight.float() * normalize(x)).to(dtype)`.
"""

from __future__ import annotations

from typing import Literal, get_args

from torch import nn

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
    """An RMSNorm's epsilon: transformers names it `variance_epsilon` (Llama family) or `eps` (Gemma family); None
    when the module has neither."""
    eps = getattr(norm, "variance_epsilon", None)
    return getattr(norm, "eps", None) if eps is None else eps
