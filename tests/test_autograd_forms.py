"""Every card gives eager's answer in every autograd and output form a training loop may use (issue 30).

Each card alone (`apply_npu_kernels(model, kernels=<its id>)`) on a tiny family where it fuses, in a training step
with labels, against the same model without the cards, float32:
- a second backward through a retained graph (`retain_graph=True`) adds eager's gradients again;
- a double backward (`create_graph=True`: a gradient penalty) gives eager's second-order gradients (the device's
  backward ops have no derivative: the cards differentiate eager's math when autograd records a backward);
- `return_dict=False` gives eager's tuple, position for position;
- a forward hook that edits the output of the swapped module or of any of its children, and a forward replaced on
  such a module's instance (as accelerate's `add_hook_to_module` does), change the loss as they change eager's;
- a global forward hook (`register_module_forward_hook`) sees the modules eager runs, as often.
A new card gets these by adding its family to FAMILIES.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.modules import module as torch_module

from npu_hub_kernels import apply_npu_kernels, swapped_modules, unregister_npu_kernels
from npu_hub_kernels.cards import CARDS
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm, token_ids

FAMILIES = {
    "npu_fused_rmsnorm": "llama",
    "npu_fused_rope": "llama",
    "npu_fused_swiglu": "llama",
    "npu_fused_add_rmsnorm": "llama",
    "npu_fused_moe": "qwen3_moe",
    "npu_fused_moe_router": "deepseek_v3",
    "npu_fused_linear_cross_entropy": "llama",
}
"""Card (kernel id) -> a tiny family where its layers fuse in a training step."""
CARD_IDS = sorted(FAMILIES)


def test_every_card_has_a_family():
    """Every card with layers: an attention card (npu-fused-attention) swaps no module, its forms are its own tests'."""
    assert sorted(card.kernel_id for card in CARDS.values() if card.layers) == CARD_IDS


@pytest.fixture
def pair(request, built_cards):
    """(eager model, the same weights kernelized with the card alone, on the npu, both in train mode)."""
    kernel_id = request.param
    eager = tiny_causal_lm(FAMILIES[kernel_id]).to("npu").train()
    fused = tiny_causal_lm(FAMILIES[kernel_id]).to("npu").train()
    fused = apply_npu_kernels(fused, kernels=kernel_id, local_dir=built_cards)
    card = next(card for card in CARDS.values() if card.kernel_id == kernel_id)
    assert swapped_modules(fused, card=card.repo_name), f"{kernel_id} swaps nothing in {FAMILIES[kernel_id]}"
    yield eager, fused, card
    unregister_npu_kernels()


def _loss(model, **kwargs):
    ids = token_ids().to("npu")
    return model(ids, labels=ids, **kwargs).loss


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().cpu().clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_close(got: dict, want: dict, what: str, tol: float = 2e-5) -> None:
    assert sorted(got) == sorted(want), what
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=tol, atol=tol, msg=lambda m, n=name: f"{what}, {n}: {m}")


@pytest.mark.parametrize("pair", CARD_IDS, indirect=True)
def test_a_second_backward_through_a_retained_graph_adds_eagers_gradients(pair):
    eager, fused, _ = pair
    for model in (eager, fused):
        loss = _loss(model)
        loss.backward(retain_graph=True)
        loss.backward()
    _assert_close(_grads(fused), _grads(eager), "two backwards")


@pytest.mark.parametrize("pair", CARD_IDS, indirect=True)
def test_a_double_backward_gives_eagers_second_order_gradients(pair):
    """A gradient penalty: the squared norm of the first-order gradients, differentiated."""
    eager, fused, _ = pair
    for model in (eager, fused):
        params = [p for p in model.parameters() if p.requires_grad]
        first = torch.autograd.grad(_loss(model), params, create_graph=True, allow_unused=True)
        sum(g.pow(2).sum() for g in first if g is not None).backward()
    _assert_close(_grads(fused), _grads(eager), "second order", tol=1e-4)


@pytest.mark.parametrize("pair", CARD_IDS, indirect=True)
def test_return_dict_false_gives_eagers_tuple(pair):
    eager, fused, _ = pair
    ids = token_ids().to("npu")
    want, got = (model(ids, labels=ids, return_dict=False) for model in (eager, fused))
    assert len(got) == len(want)
    torch.testing.assert_close(got[0], want[0], rtol=2e-5, atol=2e-5)
    for position, (g, w) in enumerate(zip(got[1:], want[1:], strict=True), start=1):
        # the fused loss computes no logits: their slot holds None, so every later field keeps its position
        assert g is None or type(g) is type(w), (position, type(g), type(w))


def _hooked_modules(model, card) -> list[str]:
    """The modules a card's layers replace and their children (which a layer may bypass): one of each name pattern."""
    names = []
    modules = dict(model.named_modules())
    for swap in swapped_modules(model, card=card.repo_name):
        owner = "" if swap.module == "<root>" else swap.module
        if owner not in modules:  # a function-module under its caller's name
            continue
        names += [owner, *(f"{owner}.{child}".lstrip(".") for child, _ in modules[owner].named_children())]
    return list(dict.fromkeys(names))[:16]


def _edit(output):
    if isinstance(output, torch.Tensor) and output.is_floating_point():
        return output * 1.25
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (output[0] * 1.25, *output[1:])
    return output


@pytest.mark.parametrize("kind", ["forward hook", "instance forward"])
@pytest.mark.parametrize("pair", CARD_IDS, indirect=True)
def test_hooks_on_the_modules_a_layer_replaces_or_bypasses_change_the_loss_as_eagers(pair, kind):
    eager, fused, card = pair
    for name in _hooked_modules(fused, card):
        losses = []
        for model in (eager, fused):
            module = model.get_submodule(name)
            bound = vars(module).get("forward")  # what kernelize bound on the instance, put back afterwards
            if kind == "forward hook":
                handle = module.register_forward_hook(lambda m, args, out: _edit(out))
            else:
                module.forward = lambda *a, _f=module.forward, **k: _edit(_f(*a, **k))
            try:
                losses.append(_loss(model).detach())  # with grad: a training step (the loss card fuses only there)
            finally:
                if kind == "forward hook":
                    handle.remove()
                elif bound is None:
                    del module.forward
                else:
                    module.forward = bound
        torch.testing.assert_close(losses[1], losses[0], rtol=2e-5, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("pair", CARD_IDS, indirect=True)
def test_a_global_forward_hook_sees_the_modules_eager_runs(pair):
    eager, fused, _ = pair
    seen = {}
    for label, model in (("eager", eager), ("fused", fused)):
        names = {module: name for name, module in model.named_modules()}
        calls: list[str] = []

        def record(module, args, output, names=names, calls=calls):
            calls.append(names.get(module, "?"))

        handle = torch_module.register_module_forward_hook(record)
        try:
            _loss(model).backward()
        finally:
            handle.remove()
        seen[label] = sorted(name for name in calls if name != "?")
    assert seen["fused"] == seen["eager"]
