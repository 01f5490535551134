"""Layers that `kernels.kernelize` swaps into transformers' norm modules (forward only, no state).

Each reads the parameters of the module it replaces: `weight` and `variance_epsilon` or `eps`, and calls `rms_norm`
for them (at decode size, a call like one the check let fuse runs the op at once: `layer_forward`). Each forward is
marked as computing its norm class's forward (`computes_the_norm_forward`): npu-add-rms-norm, which reads the weight
of a decoder layer's post-attention norm instead of calling it, still fuses when kernelize bound this forward on the
norm.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ._fallbacks import _LAST_EAGER
from ._internals import _peek_interpreter_stack, norm_weight_and_epsilon
from ._npu import torch_npu
from ._rms_norm_forms import Scaling, computes_the_norm_forward
from .rms_norm import _FUSING_INPUTS, _grad_enabled, rms_norm


def layer_forward(scaling: Scaling) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """The forward of this card's layer for the norms that scale as `scaling`: `rms_norm` of the module's weight.

    The layer reads the weight and epsilon the norm holds (`norm_weight_and_epsilon`) and calls `rms_norm` for them,
    recorded for the norm, except in the one case a decode step is made of: autograd off, no torch.func transform, the
    norm's last call not eager, x contiguous, a "plain" or "float32_scale" norm (npu_rms_norm takes such a weight
    itself, where a zero-centred one needs `1 + weight` or the other op), and inputs that read as those of a call the
    check let fuse (`_FUSING_INPUTS`, the tuple `rms_norm` builds, built the same way here). That call runs here the
    npu_rms_norm `rms_norm` would run, without its nested call: at decode size the card's Python is held to a bare
    module call's cost (docs/bench.md). `rms_norm`'s own skip of the check is this one's twin: a condition added there
    belongs here too."""
    weight_as_is = scaling != "zero_centered"

    @computes_the_norm_forward
    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        x, (weight, eps) = hidden_states, norm_weight_and_epsilon(self)
        ran_eager_last = bool(_LAST_EAGER) and id(self) in _LAST_EAGER  # the set is empty unless a call ran eager
        if weight_as_is and not _grad_enabled() and _peek_interpreter_stack() is None and not ran_eager_last:
            inputs = (
                scaling,
                type(x),
                x.get_device(),
                x.dtype,
                x.shape,
                type(weight),
                weight.device,
                weight.dtype,
                weight.shape,
            )
            try:
                remembered = inputs in _FUSING_INPUTS
            except TypeError:  # unhashable (SymInt): `rms_norm` checks it
                remembered = False
            if remembered and x.is_contiguous():
                return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]
        return rms_norm(x, weight, eps, scaling, module=self)

    return forward


class RMSNorm(nn.Module):
    """`weight * normalize(x).to(dtype)`: Llama, Mistral, Qwen2/3 (and their q/k norms), DeepseekV3, Phi3, Glm4, ..."""

    has_backward = True
    # torch.compile of the fused path is not verified on Ascend hardware yet.
    can_torch_compile = False

    forward = layer_forward("plain")


class RMSNormZeroCentered(nn.Module):
    """`(normalize(x) * (1 + weight)).to(dtype)` in float32: Gemma, Gemma2, Gemma3, Qwen3-Next, Qwen3.5, ..."""

    has_backward = True
    can_torch_compile = False

    forward = layer_forward("zero_centered")


class RMSNormFloat32Scale(nn.Module):
    """`(weight.float() * normalize(x)).to(dtype)`: Olmo2, Olmo3, GptOss, DeepseekV4, NemotronH, ..."""

    has_backward = True
    can_torch_compile = False

    forward = layer_forward("float32_scale")
