"""A card's fused forms held to its eager math on a device: the parity idiom of the test suite, as data and a judge.

Each card's cases module (`cases/<card package>.py`) lists its fused forms in `FORMS`: a name -> `Form`. A form makes
its tensors at a model's widths (`Widths`) in float64 on the host, and says how the card's fused function and its
eager math call them. `judge` runs one form in one dtype on a device, forward and backward:

- the fused function and the eager math on the device, in the dtype (tensors a form keeps in a dtype of their own,
  such as a float32 weight, stay in it);
- the eager math on the host in float64, the reference;
- the verdict of flash-attention's idiom, which the test suite uses: for every output and every gradient, the fused
  error against the reference is at most `ERROR_MULTIPLE` times eager's own error (plus `ERROR_FLOOR` of the
  reference's largest magnitude, for outputs eager computes exactly).

A form whose card says it will not fuse these tensors here (its `<op>_unavailable_reason`) is not judged: the card
runs eager, which is exactly eager's result. `time_form` times the region fused and eager on the device.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import nn

ERROR_MULTIPLE = 2.0
"""The fused error may be at most this multiple of eager's own error against float64 (the suite's bound)."""
ERROR_FLOOR = 1e-6
"""Plus this fraction of the reference's largest magnitude: where eager is exact, fused may round once."""
HALF_DTYPES = (torch.bfloat16, torch.float16)
ALL_LAYERS = ("*",)
"""`Form.layers` of a form every layer of the card runs."""
NARROWED = ("hidden", "intermediate", "moe_intermediate", "vocab")
"""The widths `Widths.narrowed` divides."""
MIN_NARROWED = 16
"""The narrowest a width gets in `Widths.narrowed`."""

Tensors = dict[str, Any]
"""A form's inputs by name: tensors, and settings (ints, ...) that pass through as they are."""


@dataclass(frozen=True)
class Widths:
    """The widths of a model's decoder layer that the forms are made at, and the tokens per call."""

    model: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    tokens: int = 64
    eps: float = 1e-6

    def with_tokens(self, tokens: int) -> Widths:
        """These widths, at `tokens` tokens per call."""
        return Widths(**{**self.__dict__, "tokens": tokens})

    def narrowed(self, divisor: int) -> Widths:
        """These widths with hidden, intermediate, the experts' intermediate and the vocabulary divided by `divisor`.

        None gets narrower than `MIN_NARROWED` (nor wider than it was); the heads, head dim, experts and top-k are
        kept, so that every form still applies as it does at the model's own widths.
        """
        narrower = {name: max(getattr(self, name) // divisor, min(getattr(self, name), MIN_NARROWED))
                    for name in NARROWED}  # fmt: skip
        return Widths(**{**self.__dict__, **narrower})


@dataclass(frozen=True)
class Form:
    """One fused form of a card: its tensors at a model's widths, the fused call and the eager one.

    `make(widths, generator)`: the tensors, float64 (floats) on the host, and any settings; `grads`: those that get
    gradients; `kept`: tensors kept in a dtype of their own (a float32 weight beside bfloat16 activations);
    `fused(card, t)`, `eager(card, t)`: the card's fused function and its eager math on those tensors, returning a
    tensor or a tuple; `reason(card, t)`: the card's `<op>_unavailable_reason` on them. `layers`: the card's layers
    that run this form, which stand down on a host where it fails (`register_npu_kernels`). `inference`: the form
    runs under `torch.inference_mode` (no backward). `applies(widths)`: whether the model has the region (experts,
    say). `tokens(widths)`: the token count the form needs, when the selftest's would not do (the chunked loss
    chunks from 2 x hidden tokens on). `flops(widths)`: the float64 reference's floating-point operations, forward
    and backward, where matmuls make them many (the selftest's time estimate).
    """

    layers: tuple[str, ...]
    make: Callable[[Widths, torch.Generator], Tensors]
    fused: Callable[[ModuleType, Tensors], Any]
    eager: Callable[[ModuleType, Tensors], Any]
    reason: Callable[[ModuleType, Tensors], str | None]
    grads: tuple[str, ...] = ()
    kept: dict[str, torch.dtype] = field(default_factory=dict)
    dtypes: tuple[torch.dtype, ...] = HALF_DTYPES
    inference: bool = False
    applies: Callable[[Widths], bool] = lambda widths: True
    tokens: Callable[[Widths], int] | None = None
    flops: Callable[[Widths], float] = lambda widths: 0.0

    def at(self, widths: Widths) -> Widths:
        """The widths this form runs at: `widths`, at the form's own token count when it has one."""
        return widths if self.tokens is None else widths.with_tokens(self.tokens(widths))


@dataclass
class Judged:
    """One form judged in one dtype at one shape.

    `status`: "pass", "fail", "eager" (the card does not fuse it here) or "error" (the fused call raised).
    `errors`: per output and gradient, (fused error, eager error, allowed) against the float64 reference. `reason`:
    the card's reason (eager) or the error (error). `worst`: the output or gradient furthest past its bound.
    """

    status: str
    errors: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    reason: str | None = None

    @property
    def worst(self) -> str | None:
        """The output or gradient whose fused error is the largest multiple of its bound, with its numbers."""
        if not self.errors:
            return None
        name, (fused, eager, allowed) = max(self.errors.items(), key=lambda item: item[1][0] / max(item[1][2], 1e-30))
        return f"{name}: fused error {fused:.3g}, eager error {eager:.3g}, allowed {allowed:.3g}"


def judge(card: ModuleType, form: Form, widths: Widths, dtype: torch.dtype, device: str, seed: int = 0) -> Judged:
    """Run `form` fused and eager in `dtype` on `device` and against float64 eager on the host: the verdict."""
    made = form.make(form.at(widths), torch.Generator().manual_seed(seed))
    on_device = _prepare(made, form, dtype, device)
    with torch.inference_mode(form.inference):
        reason = form.reason(card, on_device)
    if reason is not None:
        return Judged("eager", reason=reason)
    cotangent_seed = seed + 1
    try:
        fused = _run(lambda t: form.fused(card, t), on_device, form, cotangent_seed)
    except Exception as error:  # the device refused or failed a call the card made: a finding, reported
        return Judged("error", reason=f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}")
    eager = _run(lambda t: form.eager(card, t), _prepare(made, form, dtype, device), form, cotangent_seed)
    reference = _run(lambda t: form.eager(card, t), _prepare(made, form, torch.float64, "cpu"), form, cotangent_seed)
    errors = {}
    for name, expected in reference.items():
        scale = expected.abs().max().item() if expected.numel() else 0.0
        fused_error = _max_error(fused[name], expected)
        eager_error = _max_error(eager[name], expected)
        errors[name] = (fused_error, eager_error, ERROR_MULTIPLE * eager_error + ERROR_FLOOR * max(scale, 1.0))
    passed = all(fused_error <= allowed for fused_error, _, allowed in errors.values())
    return Judged("pass" if passed else "fail", errors)


def time_form(
    card: ModuleType, form: Form, widths: Widths, dtype: torch.dtype, device: str, repeats: int
) -> tuple[float, float]:
    """The median milliseconds of one fused and one eager call of the region (forward and backward), synchronised."""
    made = form.make(form.at(widths), torch.Generator().manual_seed(0))
    medians = []
    for call in (form.fused, form.eager):
        times = []
        for _ in range(repeats + 1):  # the first call warms up (allocations, kernel compilation)
            tensors = _prepare(made, form, dtype, device)
            _synchronize(device)
            start = time.perf_counter()
            _run(lambda t, call=call: call(card, t), tensors, form, 1, keep=False)
            _synchronize(device)
            times.append(time.perf_counter() - start)
        medians.append(1000 * statistics.median(times[1:]))
    return medians[0], medians[1]


def linear(weight: torch.Tensor) -> nn.Linear:
    """An nn.Linear (no bias) whose weight is `weight` itself, so that its gradient is the form's."""
    layer = nn.Linear(1, 1, bias=False, device="meta")
    layer.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
    return layer


def randn(*shape: int, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Float64 normal values on the host, times `scale`."""
    return torch.randn(shape, generator=generator, dtype=torch.float64) * scale


def _prepare(made: Tensors, form: Form, dtype: torch.dtype, device: str) -> Tensors:
    """The form's tensors in `dtype` (float64: every float) on `device`; those of `grads` as fresh leaves.

    An inference form's tensors are made in inference mode, as a model's are there.
    """
    if form.inference:
        with torch.inference_mode():
            return _prepare(made, Form(**{**form.__dict__, "inference": False, "grads": ()}), dtype, device)
    prepared = {}
    for name, tensor in made.items():
        if not isinstance(tensor, torch.Tensor):
            prepared[name] = tensor
            continue
        if tensor.is_floating_point():
            tensor = tensor.to(torch.float64 if dtype == torch.float64 else form.kept.get(name, dtype))
        tensor = tensor.to(device)
        prepared[name] = nn.Parameter(tensor) if name in form.grads and not form.inference else tensor
    return prepared


def _run(call: Callable[[Tensors], Any], tensors: Tensors, form: Form, seed: int, keep: bool = True) -> Tensors:
    """The call's floating outputs and the gradients of `grads` (from seeded random cotangents), on the host."""
    if form.inference:
        with torch.inference_mode():
            outputs = _floating(call(tensors))
        return {name: out.detach().to("cpu", torch.float64) for name, out in outputs.items()} if keep else {}
    outputs = _floating(call(tensors))
    results = {name: out.detach().to("cpu", torch.float64) for name, out in outputs.items()} if keep else {}
    leaves = [tensors[name] for name in form.grads]
    differentiable = {name: out for name, out in outputs.items() if out.requires_grad}
    if leaves and differentiable:
        generator = torch.Generator().manual_seed(seed)
        cotangents = [
            torch.randn(out.shape, generator=generator, dtype=torch.float64) for out in differentiable.values()
        ]
        grads = torch.autograd.grad(
            list(differentiable.values()),
            leaves,
            [c.to(out.dtype).to(out.device) for c, out in zip(cotangents, differentiable.values(), strict=True)],
            allow_unused=True,
        )
        if keep:
            results |= {
                f"grad {name}": grad.to("cpu", torch.float64)
                for name, grad in zip(form.grads, grads, strict=True)
                if grad is not None
            }
    return results


def _floating(outputs: Any) -> dict[str, torch.Tensor]:
    """The floating-point tensors of a call's result, named "out" or "out[i]"."""
    items: Iterable[tuple[str, Any]]
    items = (
        [("out", outputs)] if isinstance(outputs, torch.Tensor) else [(f"out[{i}]", o) for i, o in enumerate(outputs)]
    )
    return {name: out for name, out in items if isinstance(out, torch.Tensor) and out.is_floating_point()}


def _max_error(got: torch.Tensor | None, expected: torch.Tensor) -> float:
    if got is None or got.shape != expected.shape:
        return float("inf")
    return (got - expected).abs().max().item() if expected.numel() else 0.0


def _synchronize(device: str) -> None:
    """Wait for the device's queued work (torch.npu.synchronize); nothing on the host."""
    if device != "cpu":
        getattr(torch, device).synchronize()
