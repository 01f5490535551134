"""Every card survives a deep copy of the model and torch.func's transforms (issue 43).

Copies: a TRL reference model is `copy.deepcopy(model)`, made at any point of a run: before the process registers the
cards, after, or of a model already kernelized. The copy fuses as a model kernelized directly does (the op counter
says so, and the loss is eager's), and a copy kernelized without the card runs none of its ops (the negative
control). transformers attaches its rotary function-modules to each attention module as it is built
(`_kernel_funcs`), while the code calls the module global: a copy made before registering holds copies of them that
nothing calls, so kernelize binds what it gives those on the global too.

Transforms: `torch.func.grad`, `torch.func.vmap` (per-sample gradients) and `torch.func.functional_call` of a
kernelized model give eager's gradients, on host tensors and on the emulated npu, each card alone; under a transform
the cards run eager's math, saying why (the layers' reasons, in `swapped_modules`), and the shared Function of their
fused paths (`with_eager_double_backward`) gives eager's gradients under a transform instead of raising.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from functools import partial

import pytest
import torch
from conftest import run_python
from kernels import get_local_kernel
from test_autograd_forms import FAMILIES

from npu_hub_kernels import (
    apply_npu_kernels,
    register_npu_kernels,
    swapped_modules,
    unregister_npu_kernels,
)
from npu_hub_kernels.cards import CARDS
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm, token_ids

CARD_IDS = sorted(FAMILIES)
"""The cards with layers, each with a tiny family where it fuses in a training step (test_autograd_forms.py)."""
ATTENTION = "npu_fused_attention"
"""The attention card: no layer, it is the attention of the models it is selected for (their config says so)."""
ATTENTION_FAMILY = "llama"


def card_of(kernel_id: str):
    return CARDS[kernel_id]


def own_ops(kernel_id: str) -> set[str]:
    """The fused ops of the card that no other card with layers calls (npu-moe shares npu_swiglu with npu-swiglu)."""
    others = {op for other in CARD_IDS if other != kernel_id for op in card_of(other).fused_ops}
    return set(card_of(kernel_id).fused_ops) - others


@pytest.fixture(autouse=True)
def nothing_registered():
    """Each test starts and ends as a process that never registered the cards: no class retagged, nothing shared."""
    unregister_npu_kernels()
    yield
    unregister_npu_kernels()


def training_loss(model, device: str = "npu") -> tuple[torch.Tensor, dict[str, int]]:
    """The loss of one training forward with labels (no backward), and the emulated op calls it made."""
    ids = token_ids().to(device)
    with emulation.count_op_calls() as calls:
        loss = model(ids, labels=ids).loss
    return loss.detach().cpu(), dict(calls)


def card_calls(calls: dict[str, int], kernel_id: str) -> dict[str, int]:
    return {op: calls.get(op, 0) for op in card_of(kernel_id).fused_ops}


def swap_names(model, kernel_id: str) -> list[str]:
    return [swap.module for swap in swapped_modules(model, card=card_of(kernel_id).repo_name)]


# --- Copies ---------------------------------------------------------------------------------------------------------


def copied_before_registering(base, kernelize: Callable, register: Callable):
    model = copy.deepcopy(base)
    kernelize(model)
    return model


def copied_after_registering(base, kernelize: Callable, register: Callable):
    register()
    model = copy.deepcopy(base)
    kernelize(model)
    return model


def copied_once_kernelized(base, kernelize: Callable, register: Callable):
    kernelize(base)
    return copy.deepcopy(base)


def copied_after_unregistering(base, kernelize: Callable, register: Callable):
    """The cards registered and the base kernelized, then unregistered (nothing shared), copied, kernelized again."""
    kernelize(base)
    unregister_npu_kernels()
    model = copy.deepcopy(base)
    kernelize(model)
    return model


COPIES = {
    f.__name__.replace("_", " "): f
    for f in (copied_before_registering, copied_after_registering, copied_once_kernelized, copied_after_unregistering)
}


@pytest.mark.parametrize("case", COPIES)
@pytest.mark.parametrize("kernel_id", CARD_IDS)
def test_a_deep_copy_fuses_as_a_model_kernelized_directly(built_cards, kernel_id, case):
    family = FAMILIES[kernel_id]
    want, _ = training_loss(tiny_causal_lm(family).to("npu").train())  # before anything is registered: eager
    kernelize = partial(apply_npu_kernels, kernels=kernel_id, local_dir=built_cards)
    register = partial(register_npu_kernels, kernels=kernel_id, local_dir=built_cards)

    model = COPIES[case](tiny_causal_lm(family).to("npu").train(), kernelize, register)
    got, calls = training_loss(model)

    direct = kernelize(tiny_causal_lm(family).to("npu").train())
    _, direct_calls = training_loss(direct)
    assert sum(card_calls(direct_calls, kernel_id).values()) > 0, f"{kernel_id} fuses nothing in {family}"
    assert card_calls(calls, kernel_id) == card_calls(direct_calls, kernel_id)
    assert swap_names(model, kernel_id) == swap_names(direct, kernel_id)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)

    # negative control: the copy kernelized with every other card, not this one, runs none of its ops
    apply_npu_kernels(model, kernels=[k for k in CARD_IDS if k != kernel_id], local_dir=built_cards)
    _, without = training_loss(model)
    assert {op: without.get(op, 0) for op in own_ops(kernel_id)} == dict.fromkeys(own_ops(kernel_id), 0)
    assert swap_names(model, kernel_id) == []


@pytest.mark.parametrize("case", COPIES)
def test_a_deep_copy_runs_the_attention_card_as_a_model_given_it_directly(built_cards, case):
    """The attention card is selected per model, in its config, which a deep copy copies: the copy fuses every
    attention layer, and a model the card was never selected for (the negative control) runs none."""
    want, _ = training_loss(tiny_causal_lm(ATTENTION_FAMILY).to("npu").train())
    kernelize = partial(apply_npu_kernels, kernels=ATTENTION, local_dir=built_cards)
    register = partial(register_npu_kernels, kernels=ATTENTION, local_dir=built_cards)

    model = COPIES[case](tiny_causal_lm(ATTENTION_FAMILY).to("npu").train(), kernelize, register)
    got, calls = training_loss(model)
    assert card_calls(calls, ATTENTION) == {"npu_fusion_attention": model.config.num_hidden_layers}
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)

    _, without = training_loss(tiny_causal_lm(ATTENTION_FAMILY).to("npu").train())
    assert card_calls(without, ATTENTION) == {"npu_fusion_attention": 0}


@pytest.mark.slow  # a fresh interpreter: about 10 s
def test_a_copy_made_before_the_processs_first_registration_fuses_the_rotary_embedding(built_cards):
    """Issue 43's report, as written: a fresh process, `m = copy.deepcopy(model); apply_npu_kernels(m)`."""
    out = run_python(
        f"""
import copy
from npu_hub_kernels import apply_npu_kernels, swapped_modules
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm, token_ids
model = tiny_causal_lm("llama").to("npu")
m = copy.deepcopy(model)
apply_npu_kernels(m, kernels="npu_fused_rope", local_dir={str(built_cards)!r})
with emulation.count_op_calls() as calls:
    m(token_ids().to("npu"))
print(calls["npu_rotary_mul"], [s.module for s in swapped_modules(m, card="npu-rope")])
""",
        emulate=True,
    )
    calls, names = out.strip().split(" ", 1)
    assert int(calls) == 2 * 2  # q and k in each of the 2 layers
    assert names == str([f"model.layers.{i}.self_attn.apply_rotary_pos_emb" for i in range(2)])


# --- Transforms -----------------------------------------------------------------------------------------------------

DEVICES = ["cpu", "npu"]


def loss_of(model: torch.nn.Module) -> Callable:
    """The loss of `model` on one sample, as a function of its parameters (for torch.func)."""

    def loss(params: dict[str, torch.Tensor], sample: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (sample[None],), {"labels": sample[None]}).loss

    return loss


def transformed_gradients(model: torch.nn.Module, device: str) -> dict[str, dict[str, torch.Tensor]]:
    """Each form's gradients of the loss over `model`'s parameters: torch.func.grad, vmap of it, functional_call."""
    ids = token_ids().to(device)
    params = {name: p.detach() for name, p in model.named_parameters()}
    loss = loss_of(model)
    leaves = {name: p.clone().requires_grad_() for name, p in params.items()}
    plain = torch.autograd.grad(loss(leaves, ids[0]), list(leaves.values()), allow_unused=True)
    forms = {
        "torch.func.grad": torch.func.grad(loss)(params, ids[0]),
        "vmap of torch.func.grad": torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, ids),
        "functional_call": {name: g for name, g in zip(leaves, plain, strict=True) if g is not None},
    }
    return {form: {name: g.detach().cpu() for name, g in grads.items()} for form, grads in forms.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel_id", [*CARD_IDS, ATTENTION])
def test_torch_func_transforms_of_a_kernelized_model_give_eagers_gradients(built_cards, kernel_id, device):
    """Each card alone. The layers' eager reasons are read where `swapped_modules` lists them (the attention card's
    are its own tests')."""
    family = FAMILIES.get(kernel_id, ATTENTION_FAMILY)
    want = transformed_gradients(tiny_causal_lm(family).to(device).train(), device)  # before anything is registered
    model = tiny_causal_lm(family).to(device).train()
    apply_npu_kernels(model, kernels=kernel_id, local_dir=built_cards)
    layers = bool(card_of(kernel_id).layers)
    assert swap_names(model, kernel_id) or not layers, f"{kernel_id} swaps nothing in {family}"

    with emulation.count_op_calls() as calls:
        got = transformed_gradients(model, device)
    for form in want:
        assert sorted(got[form]) == sorted(want[form]), form
        for name, grad in want[form].items():
            torch.testing.assert_close(got[form][name], grad, rtol=2e-5, atol=2e-5, msg=lambda m, f=form: f"{f}: {m}")

    # functional_call outside a transform fuses on the npu; the transforms and host tensors run eager, saying why
    fused = sum(card_calls(calls, kernel_id).values())
    assert fused > 0 if device == "npu" else fused == 0
    with emulation.count_op_calls() as calls:
        torch.func.grad(loss_of(model))({n: p.detach() for n, p in model.named_parameters()}, token_ids().to(device)[0])
    assert sum(card_calls(calls, kernel_id).values()) == 0
    reasons = [swap.eager_reason or "" for swap in swapped_modules(model, card=card_of(kernel_id).repo_name)]
    assert any("torch.func's grad transform is active" in reason for reason in reasons) or not layers, reasons


CARDS_WITH_DOUBLE_BACKWARD = sorted(card.repo_name for card in CARDS.values() if "_double_backward.py" in card.shared)


def stand_in_op(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused op's math with two outputs, in eager's ops (the Function's contract ties the fused output to it)."""
    return x.sin() * weight, (x * weight).tanh()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("repo_name", CARDS_WITH_DOUBLE_BACKWARD)
def test_the_cards_double_backward_function_gives_eagers_gradients_under_torch_func(built_cards, repo_name, device):
    """`with_eager_double_backward` under grad, vmap and a second-order grad: eager's answers, not an exception."""
    card = get_local_kernel(built_cards / repo_name)
    with_eager_double_backward = importlib.import_module(f"{card.__name__}._double_backward").with_eager_double_backward
    generator = torch.Generator().manual_seed(0)
    x, weight = (torch.randn(*shape, generator=generator).to(device) for shape in ((3, 8), (8,)))

    def through_card(x, weight):
        first, second = with_eager_double_backward(stand_in_op(x, weight), stand_in_op, x, weight)
        return (first * second).sum()

    def eager(x, weight):
        first, second = stand_in_op(x, weight)
        return (first * second).sum()

    def second_order(loss):
        return torch.func.grad(lambda x, weight: torch.func.grad(loss, argnums=1)(x, weight).pow(2).sum())

    for form, transform in {
        "grad": lambda loss: torch.func.grad(loss, argnums=(0, 1)),
        "vmap of grad": lambda loss: torch.func.vmap(torch.func.grad(loss, argnums=1), in_dims=(0, None)),
        "grad of grad": second_order,
    }.items():
        got, want = (transform(loss)(x, weight) for loss in (through_card, eager))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m, f=form: f"{f}: {m}")
