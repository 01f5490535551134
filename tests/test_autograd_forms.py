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
- a forward hook that edits a swapped module's output in place, and transformers' own in-place edits of a fused
  output (Mixtral's router jitter, OLMoE's clip_qkv), give eager's loss and gradients (issue 39).
A new card gets these by adding its family to FAMILIES.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.modules import module as torch_module

from npu_hub_kernels import apply_npu_kernels, swapped_modules, unregister_npu_kernels
from npu_hub_kernels._kernels_compat import kernel_funcs
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


def _floating_outputs(output) -> list[torch.Tensor]:
    """The floating-point tensors a module's output holds (a tensor, a tuple or a ModelOutput)."""
    values = output.to_tuple() if hasattr(output, "to_tuple") else output
    values = values if isinstance(values, tuple) else (values,)
    return [t for t in values if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _swapped_module(model, name: str) -> torch.nn.Module:
    """The module `swapped_modules` names `name`: a submodule, the model, or a function-module its caller holds."""
    if name == "<root>":
        return model
    modules = dict(model.named_modules())
    if name in modules:
        return modules[name]
    owner, called = name.rsplit(".", 1)  # a function-module: transformers keeps it in its caller's kernel_funcs
    (function_module,) = (f for key, f in kernel_funcs(modules[owner]).items() if called.endswith(key))
    return function_module


@contextlib.contextmanager
def _function_modules_eager(model):
    """`model` with its function-modules' own forwards, not the ones kernelize bound on them.

    transformers holds one function-module per function (`rotary_pos_emb`) for every model: kernelizing one model
    swaps it in every other, the eager model of `pair` included."""
    function_modules = {id(f): f for m in model.modules() for f in kernel_funcs(m).values() if "forward" in vars(f)}
    bound = {key: vars(f).pop("forward") for key, f in function_modules.items()}
    try:
        yield
    finally:
        for key, forward in bound.items():
            function_modules[key].forward = forward


def _step_outcome(model, step) -> tuple:
    """(loss, gradients) of `step(model)`'s loss and backward, or the type of the exception it raised."""
    model.zero_grad(set_to_none=True)
    try:
        loss = step(model)
        loss.backward()
    except Exception as error:  # compared with eager's outcome
        return (type(error),)
    return loss.detach().cpu(), _grads(model)


def _assert_same_outcome(got: tuple, want: tuple, what: str) -> None:
    assert len(want) == 2, f"{what}: eager raised {want[0]}"
    assert len(got) == 2, f"{what}: eager ran, the kernelized model raised {got[0]}"
    torch.testing.assert_close(got[0], want[0], rtol=2e-5, atol=2e-5, msg=lambda m: f"{what}, loss: {m}")
    _assert_close(got[1], want[1], what)


@pytest.mark.parametrize("pair", CARD_IDS, indirect=True)
def test_a_forward_hook_editing_a_swapped_modules_output_in_place_gives_eagers_gradients(pair):
    """Activation steering: a hook scales the output of each module a card swaps in place (issue 39)."""
    eager, fused, card = pair

    def scale_in_place(module, args, output):
        for tensor in _floating_outputs(output):
            tensor.mul_(1.25)

    names = list(dict.fromkeys(swap.module for swap in swapped_modules(fused, card=card.repo_name)))[:4]
    for name in names:
        outcomes = []
        for model in (eager, fused):
            handle = _swapped_module(model, name).register_forward_hook(scale_in_place)
            try:
                with _function_modules_eager(model) if model is eager else contextlib.nullcontext():
                    outcomes.append(_step_outcome(model, _loss))
            finally:
                handle.remove()
        _assert_same_outcome(outcomes[1], outcomes[0], f"{name} edited in place")


@pytest.mark.parametrize(
    ("family", "kernel_ids", "config"),
    [
        ("mixtral", ["npu_fused_rmsnorm", "npu_fused_moe"], {"router_jitter_noise": 0.1}),
        ("olmoe", ["npu_fused_rmsnorm", "npu_fused_moe"], {"clip_qkv": 0.05}),
    ],
)
def test_transformers_in_place_edits_of_fused_outputs_give_eagers_gradients(built_cards, family, kernel_ids, config):
    """Mixtral's router jitter (`hidden_states *= noise` on the norm's output) and OLMoE's clip_qkv (`clamp_` on the
    q/k norms' outputs), in a training step."""
    eager = tiny_causal_lm(family, **config).to("npu").train()
    fused = tiny_causal_lm(family, **config).to("npu").train()
    fused = apply_npu_kernels(fused, kernels=kernel_ids, local_dir=built_cards)
    try:
        for kernel_id in kernel_ids:
            card = next(card for card in CARDS.values() if card.kernel_id == kernel_id)
            assert swapped_modules(fused, card=card.repo_name), f"{kernel_id} swaps nothing in {family}"

        def seeded_loss(model):
            torch.manual_seed(0)  # the same jitter noise for both models
            return _loss(model)

        _assert_same_outcome(_step_outcome(fused, seeded_loss), _step_outcome(eager, seeded_loss), family)
    finally:
        unregister_npu_kernels()


@pytest.mark.parametrize("pair", CARD_IDS, indirect=True)
def test_torch_func_grad_and_vmap_over_functional_call_give_eagers_gradients(pair):
    """torch.func.grad of the loss over functional_call, and per-sample gradients (vmap of grad), as eager's: the
    cards run eager's math under a torch.func transform (issue 39)."""
    eager, fused, card = pair
    ids = token_ids().to("npu")
    results = []
    for model in (eager, fused):

        def loss(params, sample, model=model):
            return torch.func.functional_call(model, params, (sample[None],), {"labels": sample[None]}).loss

        params = {name: p.detach() for name, p in model.named_parameters()}
        with _function_modules_eager(model) if model is eager else contextlib.nullcontext():
            whole = torch.func.grad(loss)(params, ids[0])
            per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, ids)
        results.append((whole, per_sample))
    (want_whole, want_per_sample), (got_whole, got_per_sample) = results
    _assert_close(got_whole, want_whole, "torch.func.grad")
    _assert_close(got_per_sample, want_per_sample, "vmap of torch.func.grad")
    reasons = [swap.eager_reason or "" for swap in swapped_modules(fused, card=card.repo_name)]
    assert any("torch.func" in reason for reason in reasons), reasons
