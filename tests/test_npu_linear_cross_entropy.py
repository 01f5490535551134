"""npu-linear-cross-entropy: the chunked lm_head + loss against transformers' eager one, the table of classes, and
every fallback.

Op level (the built card's `linear_cross_entropy` on the emulated npu, several chunks): float32 loss and gradients
match eager's closely; in bfloat16, and under autocast on float32 weights, the error against a float64 reference is
at most twice eager's (flash-attention's idiom). Model level (kernelize on the tiny families): the loss and every
parameter's gradient match eager, the fused ops are counted with a negative control, generate() and calls without
labels are eager's, and a few training steps follow eager's losses.
"""

from __future__ import annotations

import ast
import enum
import functools
import importlib
import inspect
from pathlib import Path

import pytest
import torch
import transformers
from kernels import Mode, get_local_kernel, kernelize
from numerics import relative_error, train_steps
from torch import nn

from npu_hub_kernels import swapped_modules
from npu_hub_kernels.models import MODEL_CLASSES
from npu_hub_kernels.models import npu_linear_cross_entropy as table
from npu_hub_kernels.report import ROOT_MODULE
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import VOCAB, tiny_causal_lm, token_ids

RULES = MODEL_CLASSES["npu_fused_linear_cross_entropy"]
OPS = ("npu_cross_entropy_loss", "npu_cross_entropy_loss_backward")
GROUP_OF = {"CausalLM": "llama.modeling_llama.LlamaForCausalLM", "MoeCausalLM": RULES[-1].path}
"""A class of each layer's group: every class the layer replaces has this class's forward."""


@pytest.fixture(scope="module")
def card(built_cards):
    return get_local_kernel(built_cards / "npu-linear-cross-entropy")


# --- the table ------------------------------------------------------------------------------------------------


@functools.cache
def _parsed(file: Path) -> ast.Module:
    return ast.parse(file.read_text())


def _forward_source(path: str) -> str | None:
    """The forward of a class as source, docstring and annotations dropped (what makes two forwards identical)."""
    module, _, name = path.rpartition(".")
    file = Path(transformers.models.__file__).parent.joinpath(*module.split(".")).with_suffix(".py")
    node = next(n for n in _parsed(file).body if isinstance(n, ast.ClassDef) and n.name == name)
    forward = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "forward"), None)
    if forward is None:
        return None
    body = forward.body[1:] if isinstance(forward.body[0], ast.Expr) else forward.body
    forward.body, forward.returns = body, None
    for arg in (*forward.args.args, *forward.args.kwonlyargs, forward.args.kwarg):
        if arg is not None:
            arg.annotation = None
    return ast.unparse(forward)


@functools.cache
def _causal_lm_classes() -> frozenset[str]:
    """Every `*ForCausalLM` class a transformers modeling file defines with a forward of its own."""
    root = Path(transformers.models.__file__).parent
    found = set()
    for file in root.glob("*/modeling_*.py"):
        if "ForCausalLM(" not in file.read_text():  # no such class defined: not worth parsing
            continue
        for node in _parsed(file).body:
            own_forward = isinstance(node, ast.ClassDef) and any(
                isinstance(n, ast.FunctionDef) and n.name == "forward" for n in node.body
            )
            if own_forward and node.name.endswith("ForCausalLM"):
                found.add(f"{file.parent.name}.{file.stem}.{node.name}")
    return frozenset(found)


@pytest.mark.slow
def test_every_causal_lm_class_of_transformers_is_decided():
    listed = {rule.path for rule in RULES}
    assert len(listed) == len(RULES) and not listed & set(table.LEFT_OUT)
    assert _causal_lm_classes() - listed - set(table.LEFT_OUT) == set()
    assert (listed | set(table.LEFT_OUT)) - _causal_lm_classes() == set(), "listed classes missing from transformers"
    assert all(table.LEFT_OUT.values())
    assert (len(table.SWAPPED["CausalLM"]), len(table.SWAPPED["MoeCausalLM"]), len(table.LEFT_OUT)) == (32, 20, 117)


def test_every_listed_class_has_its_layers_forward_and_the_layer_its_signature(card):
    """Identical forwards (so the layer reproduces each); the kernels loader's signature rule holds for each."""
    for rule in RULES:
        assert _forward_source(rule.path) == _forward_source(GROUP_OF[rule.layer]), rule.path
        cls = getattr(importlib.import_module(rule.module), rule.class_name)
        ours = inspect.signature(getattr(card.layers, rule.layer).forward).parameters.values()
        theirs = inspect.signature(cls.forward).parameters.values()
        assert [(p.name, p.kind, p.default) for p in ours] == [(p.name, p.kind, p.default) for p in theirs]


def test_no_left_out_class_has_a_swapped_forward():
    swapped = {_forward_source(path) for path in GROUP_OF.values()}
    assert [path for path in table.LEFT_OUT if _forward_source(path) in swapped] == []


# --- op level -------------------------------------------------------------------------------------------------


def _problem(tokens=96, hidden=32, vocab=200, dtype=torch.float32, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    lm_head = nn.Linear(hidden, vocab, bias=bias)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(vocab, hidden, generator=g) / hidden**0.5)
        if bias:
            lm_head.bias.copy_(torch.randn(vocab, generator=g))
    h = torch.randn(2, tokens // 2, hidden, generator=g) * 2
    labels = torch.randint(0, vocab, (2, tokens // 2), generator=g)
    labels[0, :5] = -100  # a prompt not trained on
    return lm_head.to(dtype), h.to(dtype), labels


def _run(fn, lm_head, h, labels, device, *, autocast: torch.dtype | None = None, **kwargs):
    """(loss, dL/dh, dL/dW, dL/db or None) of fn on device copies; its forward under torch.autocast(device, autocast)
    when one is given."""
    head = nn.Linear(lm_head.in_features, lm_head.out_features, bias=lm_head.bias is not None)
    head = head.to(lm_head.weight.dtype).to(device)
    head.load_state_dict(lm_head.state_dict())
    leaf = h.clone().to(device).requires_grad_()
    with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
        loss, _ = fn(leaf, head, labels.to(device), lm_head.out_features, **kwargs)
    loss.backward()
    bias_grad = None if head.bias is None else head.bias.grad.cpu()
    return loss.detach().cpu(), leaf.grad.cpu(), head.weight.grad.cpu(), bias_grad


@pytest.mark.parametrize("bias", [False, True])
def test_float32_loss_and_gradients_match_eager_over_several_chunks(card, bias):
    lm_head, h, labels = _problem(bias=bias)
    want = _run(card.linear_cross_entropy_eager, lm_head, h, labels, "cpu")
    with emulation.count_op_calls() as calls:
        got = _run(card.linear_cross_entropy, lm_head, h, labels, "npu", chunk_tokens=20)
    assert [calls[op] for op in OPS] == [5, 5]  # 96 tokens in chunks of 20
    for g, w in zip(got, want, strict=True):
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bfloat16_error_at_most_twice_eagers_against_float64(card, seed):
    lm_head, h, labels = _problem(tokens=256, hidden=64, vocab=1000, seed=seed)
    reference = _run(card.linear_cross_entropy_eager, lm_head.double(), h.double(), labels, "cpu")
    bf16 = (lm_head.to(torch.bfloat16), h.to(torch.bfloat16), labels)
    eager = _run(card.linear_cross_entropy_eager, *bf16, "cpu")
    fused = _run(card.linear_cross_entropy, *bf16, "npu", chunk_tokens=64)
    for name, f, e, r in zip(("loss", "dh", "dW"), fused, eager, reference, strict=False):
        fused_error, eager_error = relative_error(f, r), relative_error(e, r)
        assert fused_error <= 2 * eager_error + 1e-6, (name, fused_error, eager_error)


def test_num_items_in_batch_shift_labels_and_another_ignore_index_are_eagers(card):
    lm_head, h, labels = _problem()
    minus_one = labels.masked_fill(labels == -100, -1)
    shifted = torch.nn.functional.pad(minus_one, (0, 1), value=-1)[..., 1:].clone()
    cases = [
        (labels, {"num_items_in_batch": torch.tensor(300)}),  # gradient accumulation: this batch's sum / all items
        (labels, {"num_items_in_batch": 300}),
        (minus_one, {"ignore_index": -1}),
        (minus_one, {"ignore_index": -1, "shift_labels": shifted}),
    ]
    for labels, kwargs in cases:
        want = _run(card.linear_cross_entropy_eager, lm_head, h, labels, "cpu", **kwargs)
        with emulation.count_op_calls() as calls:
            got = _run(card.linear_cross_entropy, lm_head, h, labels, "npu", chunk_tokens=32, **kwargs)
        assert calls[OPS[0]] == 3
        for g, w in zip(got[:3], want[:3], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_default_chunks_are_equal_and_within_the_element_budget(card):
    budget = 1 << 29
    assert card.default_chunk_tokens(1, 10**9) == 1
    for tokens, vocab in ((32768, 128_256), (32768, 151_936), (7, 96), (5000, 10**6)):
        chunk = card.default_chunk_tokens(tokens, vocab)
        chunks = -(-tokens // chunk)
        assert chunk * vocab <= budget
        assert chunks == max(1, -(-tokens * vocab // budget))
    assert card.default_chunk_tokens(32768, 128_256) == 4096


class _Subclassed(nn.Linear):
    pass


def _fallbacks():
    """(name, change to the problem, words the reason must hold): each input the fused path leaves to eager."""
    return [
        ("no labels", lambda p: {**p, "labels": None}, "no labels"),
        ("custom loss", lambda p: {**p, "loss_function": _custom_loss}, "_custom_loss"),
        ("logits_to_keep", lambda p: {**p, "logits_to_keep": 3, "labels": p["labels"][:, -3:]}, "logits_to_keep"),
        ("wrapped lm_head", lambda p: {**p, "lm_head": _retyped(p["lm_head"])}, "plain nn.Linear"),
        ("hooked lm_head", lambda p: {**p, "lm_head": _hooked(p["lm_head"])}, "forward hooks of its own"),
        ("backward hook", lambda p: {**p, "lm_head": _backward_hooked(p["lm_head"])}, "backward hooks"),
        ("accelerate hook", lambda p: {**p, "lm_head": _accelerate_hooked(p["lm_head"])}, "_hf_hook"),
        ("replaced forward", lambda p: {**p, "lm_head": _forward_replaced(p["lm_head"])}, "forward is replaced"),
        ("partitioned ZeRO-3 weight", lambda p: {**p, "lm_head": _partitioned(p["lm_head"])}, "partitioned"),
        ("host tensors", lambda p: {k: _to_cpu(v) for k, v in p.items()}, "not on an npu"),
        ("float64", lambda p: {**p, "hidden": p["hidden"].double(), "lm_head": p["lm_head"].double()}, "dtypes"),
        ("vocabulary", lambda p: {**p, "vocab_size": 7}, "vocabulary"),
    ]


def _custom_loss(logits, labels, vocab_size, **kwargs):
    return logits.float().logsumexp(-1).mean()


def _retyped(head: nn.Linear) -> nn.Linear:
    new = _Subclassed(head.in_features, head.out_features, bias=False).to(head.weight.device)
    new.load_state_dict(head.state_dict())
    return new


def _hooked(head: nn.Linear) -> nn.Linear:
    head.register_forward_pre_hook(lambda module, args: None)
    return head


def _backward_hooked(head: nn.Linear) -> nn.Linear:
    head.register_full_backward_hook(lambda module, grad_input, grad_output: None)
    return head


def _accelerate_hooked(head: nn.Linear) -> nn.Linear:
    from accelerate.hooks import ModelHook, add_hook_to_module

    return add_hook_to_module(head, ModelHook())  # what device placement and offload put on a module


def _forward_replaced(head: nn.Linear) -> nn.Linear:
    head.forward = functools.partial(nn.Linear.forward, head)
    return head


_ZeroParamStatus = enum.Enum("ZeroParamStatus", "AVAILABLE NOT_AVAILABLE INFLIGHT")
"""DeepSpeed's (deepspeed.runtime.zero.partition_parameters), by name: the card reads a parameter's `ds_status.name`."""


def _partitioned(head: nn.Linear) -> nn.Linear:
    """A weight marked as DeepSpeed ZeRO-3 marks one that is partitioned (its data kept, so eager can run)."""
    head.weight.ds_id, head.weight.ds_status = 0, _ZeroParamStatus.NOT_AVAILABLE
    return head


def _to_cpu(value):
    return value.to("cpu") if isinstance(value, torch.Tensor | nn.Module) else value


@pytest.mark.parametrize(("name", "change", "words"), _fallbacks(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_fallback_says_why_and_is_exactly_eager(card, name, change, words):
    lm_head, h, labels = _problem()
    problem = {"hidden": h.to("npu"), "lm_head": lm_head.to("npu"), "labels": labels.to("npu"), "vocab_size": VOCAB}
    problem["vocab_size"] = lm_head.out_features
    problem = change(problem)
    hidden, head, lab, vocab = (problem.pop(k) for k in ("hidden", "lm_head", "labels", "vocab_size"))
    reason = card.linear_cross_entropy_unavailable_reason(hidden, head, lab, vocab, **problem)
    assert reason is not None and words in reason, reason
    if name == "vocabulary":  # eager's own view refuses it: so does the card, in the same words
        with pytest.raises(RuntimeError):
            card.linear_cross_entropy(hidden, head, lab, vocab, **problem)
        return
    with emulation.count_op_calls() as calls:
        got = card.linear_cross_entropy(hidden, head, lab, vocab, **problem)
    want = card.linear_cross_entropy_eager(hidden, head, lab, vocab, **problem)
    assert calls[OPS[0]] == 0
    for g, w in zip(got, want, strict=True):
        assert (g is None and w is None) or torch.equal(g, w)


def test_module_hooks_for_every_module_keep_the_eager_path(card):
    """A hook registered for every module's call (torch's global module hooks) would see lm_head's call return the
    loss: the eager path, with the reason, exactly eager's numbers."""
    lm_head, h, labels = _problem()
    lm_head, h, labels, vocab = lm_head.to("npu"), h.to("npu"), labels.to("npu"), lm_head.out_features
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        reason = card.linear_cross_entropy_unavailable_reason(h, lm_head, labels, vocab)
        with emulation.count_op_calls() as calls:
            got = card.linear_cross_entropy(h, lm_head, labels, vocab)
        want = card.linear_cross_entropy_eager(h, lm_head, labels, vocab)
    finally:
        handle.remove()
    assert "every module" in reason and calls[OPS[0]] == 0
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert card.linear_cross_entropy_unavailable_reason(h, lm_head, labels, vocab) is None  # the control


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_on_float32_weights_error_at_most_twice_eagers_against_float64(card, dtype, bias):
    """Trainer's bf16/fp16: float32 lm_head and hidden states under torch.autocast("npu", dtype). The fused loss runs
    its chunks in dtype as eager's autocast lm_head does, and returns float32 gradients, within eager's idiom."""
    lm_head, h, labels = _problem(tokens=256, hidden=64, vocab=1000, bias=bias)
    eager = _run(card.linear_cross_entropy_eager, lm_head, h, labels, "npu", autocast=dtype)
    with emulation.count_op_calls() as calls:
        fused = _run(card.linear_cross_entropy, lm_head, h, labels, "npu", autocast=dtype, chunk_tokens=64)
    reference = _run(card.linear_cross_entropy_eager, lm_head.double(), h.double(), labels, "cpu")  # double() in place
    assert [calls[op] for op in OPS] == [4, 4]  # 256 tokens in chunks of 64
    assert relative_error(eager[2], reference[2]) > 1e-4  # eager's lm_head did run in dtype
    torch.testing.assert_close(fused[0], eager[0], rtol=1e-5, atol=0)  # the same logits, in dtype, as eager's
    for name, f, e, r in zip(("loss", "dh", "dW", "db"), fused, eager, reference, strict=True):
        if r is None:
            continue
        assert f.dtype == e.dtype == torch.float32, (name, f.dtype, e.dtype)
        fused_error, eager_error = relative_error(f, r), relative_error(e, r)
        assert fused_error <= 2 * eager_error + 1e-6, (name, fused_error, eager_error)


def test_autocast_elsewhere_or_on_float64_keeps_the_eager_path(card):
    """Negative controls: autocast on the host (the op runs only on the npu) is eager's exactly, no op counted; on the
    npu, float64 hidden states are not cast by autocast, so the fused loss says why it does not run."""
    lm_head, h, labels = _problem()
    want = _run(card.linear_cross_entropy_eager, lm_head, h, labels, "cpu", autocast=torch.bfloat16)
    with emulation.count_op_calls() as calls:
        got = _run(card.linear_cross_entropy, lm_head, h, labels, "cpu", autocast=torch.bfloat16)
    assert calls[OPS[0]] == 0
    assert all(torch.equal(g, w) for g, w in zip(got[:3], want[:3], strict=True))
    with torch.autocast("npu", dtype=torch.bfloat16):
        head, hidden = lm_head.to("npu"), h.double().to("npu")
        reason = card.linear_cross_entropy_unavailable_reason(hidden, head, labels.to("npu"), 200)
    assert "autocast" in reason and "float64" in reason


# --- model level ----------------------------------------------------------------------------------------------

FUSED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "glm4", "deepseek_v3")


def _pair(model_type: str, **overrides):
    eager = tiny_causal_lm(model_type, **overrides).train()
    fused = tiny_causal_lm(model_type, **overrides).train().to("npu")
    return eager, kernelize(fused, mode=Mode.TRAINING, device="npu")


def _labels(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[:, :3] = -100
    return labels


@pytest.mark.parametrize("model_type", FUSED_FAMILIES)
def test_model_loss_and_every_gradient_match_eager_with_the_fused_ops_counted(npu_kernels, model_type):
    eager, fused = _pair(model_type)
    assert [s.module for s in swapped_modules(fused) if s.card == "npu-linear-cross-entropy"] == [ROOT_MODULE]
    ids = token_ids()
    want = eager(input_ids=ids, labels=_labels(ids))
    want.loss.backward()
    with emulation.count_op_calls() as calls:
        got = fused(input_ids=ids.to("npu"), labels=_labels(ids).to("npu"))
        got.loss.backward()
    assert [calls[op] for op in OPS] == [1, 1] and got.logits is None
    torch.testing.assert_close(got.loss.cpu(), want.loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_left_out_class_keeps_its_forward(npu_kernels):
    """Negative control: Qwen3-MoE adds the router's auxiliary loss, so its class is left out: no fused op runs."""
    eager, fused = _pair("qwen3_moe")
    ids = token_ids()
    with emulation.count_op_calls() as calls:
        got = fused(input_ids=ids.to("npu"), labels=ids.to("npu"))
    assert [calls[op] for op in OPS] == [0, 0]
    torch.testing.assert_close(got.loss.cpu(), eager(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-6)


def test_tied_embeddings_get_both_gradients(npu_kernels):
    eager, fused = _pair("llama", tie_word_embeddings=True)
    assert fused.lm_head.weight is fused.model.embed_tokens.weight
    ids = token_ids()
    eager(input_ids=ids, labels=ids).loss.backward()
    with emulation.count_op_calls() as calls:
        fused(input_ids=ids.to("npu"), labels=ids.to("npu")).loss.backward()
    assert calls[OPS[0]] == 1
    torch.testing.assert_close(fused.lm_head.weight.grad.cpu(), eager.lm_head.weight.grad, rtol=1e-4, atol=1e-6)


def test_without_labels_and_in_generate_the_model_is_eager(npu_kernels):
    eager, fused = _pair("llama")
    eager.eval(), fused.eval()
    ids = token_ids()
    with torch.no_grad(), emulation.count_op_calls() as calls:
        got = fused(input_ids=ids.to("npu"))
        tokens = fused.generate(ids.to("npu"), max_new_tokens=4, do_sample=False)
    assert calls[OPS[0]] == 0
    with torch.no_grad():
        torch.testing.assert_close(got.logits.cpu(), eager(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(tokens.cpu(), eager.generate(ids, max_new_tokens=4, do_sample=False))


def test_return_dict_false_in_a_training_step(npu_kernels):
    eager, fused = _pair("qwen3")
    ids = token_ids()
    with emulation.count_op_calls() as calls:
        got = fused(input_ids=ids.to("npu"), labels=ids.to("npu"), return_dict=False)
    assert [calls[op] for op in OPS] == [1, 1]
    want = eager(input_ids=ids, labels=ids, return_dict=False)
    assert isinstance(got, tuple) and len(got) == len(want) - 1  # the logits (None) are left out, as to_tuple does
    torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("evaluation", ["eval()", "no_grad"])
def test_evaluation_with_labels_is_eager_with_its_logits(npu_kernels, evaluation):
    """Evaluation loops (Trainer.evaluate) read the logits: only a training step fuses."""
    eager, fused = _pair("llama")
    if evaluation == "eval()":
        eager.eval(), fused.eval()
    ids = token_ids()
    with torch.no_grad() if evaluation == "no_grad" else torch.enable_grad(), emulation.count_op_calls() as calls:
        got = fused(input_ids=ids.to("npu"), labels=ids.to("npu"))
        want = eager(input_ids=ids, labels=ids)
    assert calls[OPS[0]] == 0 and got.logits is not None
    torch.testing.assert_close(got.loss.cpu(), want.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.logits.cpu(), want.logits, rtol=1e-5, atol=1e-5)


def test_a_custom_loss_function_keeps_the_class_forward(npu_kernels):
    eager, fused = _pair("llama")
    fused.loss_function = _custom_loss
    eager.loss_function = _custom_loss
    ids = token_ids()
    with emulation.count_op_calls() as calls:
        got = fused(input_ids=ids.to("npu"), labels=ids.to("npu"))
    assert calls[OPS[0]] == 0 and got.logits is not None
    torch.testing.assert_close(got.loss.cpu(), eager(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_training_converges_like_eager(npu_kernels):
    """The convergence idiom: AdamW steps give eager's losses, and every parameter moves as eager moves it, within
    0.1% (relative L2 of its whole update)."""
    eager, fused = _pair("llama")
    batches = [token_ids()] * 5  # one batch again and again: the loss must fall
    adam = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
    want, want_updates = train_steps(eager, batches, adam)
    with emulation.count_op_calls() as calls:
        got, got_updates = train_steps(fused, batches, adam)
    assert calls[OPS[0]] == len(batches) and want[-1] < want[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    moved = {name: relative_error(update, want_updates[name]) for name, update in got_updates.items()}
    assert max(moved.values()) <= 1e-3, max(moved.items(), key=lambda item: item[1])


# --- the counted targets (issue 19) ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-3-8b", "qwen3-8b"])
def test_counted_targets_met_at_batch_8_x_4096(npu_kernels, model):
    """Forward+backward, bfloat16, on fake tensors: the card at its default chunks moves no more bytes than eager and
    its peak of live bytes is at most 1/8 of eager's; a chunk of 8192 tokens (the negative control) breaks the
    peak."""
    pytest.importorskip("bench.memory", reason="the memory measure, scripts/bench/memory.py (branch memory)")
    from bench.cards import npu_linear_cross_entropy as spec

    vocab = spec.MODELS[model]
    eager = spec.measure(model, vocab, None, *spec.SHAPE)
    fused = spec.measure(model, vocab, 0, *spec.SHAPE)
    assert fused["bytes"] <= eager["bytes"] and fused["peak bytes"] <= spec.PEAK_SHARE * eager["peak bytes"]
    large = spec.measure(model, vocab, 8192, *spec.SHAPE)
    assert large["peak bytes"] > spec.PEAK_SHARE * eager["peak bytes"]


@pytest.fixture
def fresh_accelerate_state():
    """accelerate's process-wide state cleared before and after (as TrainingArguments clears it)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _wrapped_then_kernelized_again(source: Path):
    """A tiny Llama loaded with use_kernels=True, prepared by accelerate for bf16 (its forward wrapped in autocast),
    then switched to train(): kernelize runs again and replaces that wrapper with this card's layer."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    tiny_causal_lm("llama").save_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, device_map="npu", use_kernels=True)
    accelerator = Accelerator(mixed_precision="bf16")
    model = accelerator.prepare(model)
    model.train()
    assert "_original_forward" in vars(model)
    assert [swap.module for swap in swapped_modules(model, card="npu-linear-cross-entropy")] == [ROOT_MODULE]
    return accelerator, model


def _lm_head_dtype_and_outputs(model, ids: torch.Tensor):
    """A training step's forward with labels: the dtype the lm_head computed in, and the outputs."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    try:
        outputs = model(ids, labels=ids)
    finally:
        hook.remove()
    return seen, outputs


def test_use_kernels_dropping_accelerates_bf16_wrapper_runs_as_that_wrapper(
    npu_kernels, fresh_accelerate_state, tmp_path
):
    """use_kernels=True kernelizes again at train(), replacing accelerate's bf16 wrapper of the model's forward: the
    layer runs the call as the wrapper does, the lm_head in bfloat16 and the outputs in float32, exactly eager's
    forward under the accelerator's autocast (a hook on the lm_head keeps its own forward), and without the hook the
    loss fuses under that autocast. Without the wrapper's marker (negative control) it runs float32."""
    accelerator, model = _wrapped_then_kernelized_again(tmp_path / "source")
    ids = token_ids(batch=2, seq=8).to("npu")
    assert not torch.is_autocast_enabled("npu")
    with emulation.count_op_calls() as calls:
        dtypes, outputs = _lm_head_dtype_and_outputs(model, ids)
    assert dtypes == [torch.bfloat16] and calls[OPS[0]] == 0  # the hooked lm_head runs itself: eager's loss
    assert outputs.loss.dtype == outputs.logits.dtype == torch.float32
    with accelerator.autocast():
        expected = type(model).forward(model, ids, labels=ids)
    assert torch.equal(outputs.loss, expected.loss.float()) and torch.equal(outputs.logits, expected.logits.float())
    with emulation.count_op_calls() as calls:
        fused = model(ids, labels=ids)
    assert calls[OPS[0]] == 1 and fused.logits is None and fused.loss.dtype == torch.float32
    torch.testing.assert_close(fused.loss, outputs.loss, rtol=1e-3, atol=1e-3)

    del model._original_forward
    dtypes, outputs = _lm_head_dtype_and_outputs(model, ids)
    assert dtypes == [torch.float32] and outputs.loss.dtype == torch.float32


def test_a_dropped_wrapper_whose_autocast_accelerate_cannot_say_raises_what_to_do(
    npu_kernels, fresh_accelerate_state, tmp_path
):
    """The wrapper dropped, and accelerate's state cleared afterwards: which autocast it ran is unknown, so the layer
    raises, saying what to do, rather than run the model without it."""
    from accelerate.state import AcceleratorState

    _, model = _wrapped_then_kernelized_again(tmp_path / "source")
    AcceleratorState._reset_state(reset_partial_state=True)
    ids = token_ids(batch=2, seq=8).to("npu")
    with pytest.raises(RuntimeError, match=r"accelerate's state \(not initialized\).*apply_npu_kernels"):
        model(ids, labels=ids)
