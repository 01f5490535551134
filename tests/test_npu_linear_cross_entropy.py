"""npu-linear-cross-entropy: the chunked lm_head + loss against transformers' eager one, the table of classes, and
every fallback.

Op level (the built card's `linear_cross_entropy` on the emulated npu, several chunks): float32 loss and gradients
match eager's closely; in bfloat16, and under autocast on float32 weights, the error against a float64 reference is
at most twice eager's (flash-attention's idiom). Model level (kernelize on the tiny families): the loss and every
parameter's gradient match eager, the fused ops are counted with a negative control, generate() and calls without
labels are eager's, and a few training steps follow eager's losses; the MoE classes that add the router's auxiliary
loss get it added as eager adds it (float32 equal, bfloat16 within the idiom, with and without router logits).
"""

from __future__ import annotations

import ast
import collections
import contextlib
import dataclasses
import enum
import functools
import importlib
import inspect
from pathlib import Path
from types import MethodType, ModuleType

import proof
import pytest
import torch
import transformers
from kernels import Mode, kernelize
from numerics import assert_within_twice_eagers_error, relative_error
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

from npu_hub_kernels import CARDS, apply_npu_kernels, swapped_modules
from npu_hub_kernels import _kernels_compat as compat
from npu_hub_kernels.models import MODEL_CLASSES
from npu_hub_kernels.models import npu_linear_cross_entropy as table
from npu_hub_kernels.report import ROOT_MODULE, card_layer_of, card_package, qualified_name
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import TINY_CONFIGS, VOCAB, tiny_causal_lm, tiny_config_values, token_ids

KERNEL_ID = "npu_fused_linear_cross_entropy"
RULES = MODEL_CLASSES[KERNEL_ID]
OPS = ("npu_cross_entropy_loss", "npu_cross_entropy_loss_backward")
LOG_PROB_FORM = [1, 0]
"""A tiny model's training step: the log-probability form, one op call, whose own autograd node runs its backward
(the chunked form calls the backward op itself, once per chunk)."""
GROUP_OF = {
    "CausalLM": "llama.modeling_llama.LlamaForCausalLM",
    "MoeCausalLM": "deepseek_v3.modeling_deepseek_v3.DeepseekV3ForCausalLM",
    "MoeCausalLMWithAuxLoss": "mixtral.modeling_mixtral.MixtralForCausalLM",
    **{
        layer: paths[0]
        for layer, paths in table.SWAPPED.items()
        if layer not in ("CausalLM", "MoeCausalLM", "MoeCausalLMWithAuxLoss")
    },
}
"""A class of each layer's group: every class the layer replaces has this class's forward."""


# --- the table ------------------------------------------------------------------------------------------------


@functools.cache
def _parsed(file: Path) -> ast.Module:
    return ast.parse(file.read_text())


def _class_node(path: str) -> ast.ClassDef:
    module, _, name = path.rpartition(".")
    file = Path(transformers.models.__file__).parent.joinpath(*module.split(".")).with_suffix(".py")
    return next(n for n in _parsed(file).body if isinstance(n, ast.ClassDef) and n.name == name)


def _method(path: str, name: str) -> ast.FunctionDef | None:
    return next((n for n in _class_node(path).body if isinstance(n, ast.FunctionDef) and n.name == name), None)


class _SameMeaning(ast.NodeTransformer):
    """Rewrites what reads the same two ways: the loss_function's positional arguments named as ForCausalLMLoss
    names them (logits, labels, vocab_size: the only loss the layers fuse), a local's annotation dropped, and a base
    model output's `[0]` read as its `last_hidden_state` (its first field, always set)."""

    def visit_Call(self, node: ast.Call) -> ast.Call:
        self.generic_visit(node)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "loss_function" and len(node.args) <= 3:
            named = [
                ast.keyword(arg=n, value=a) for n, a in zip(("logits", "labels", "vocab_size"), node.args, strict=False)
            ]
            node.args, node.keywords = [], [*named, *node.keywords]
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.Assign:
        self.generic_visit(node)
        return ast.Assign(targets=[node.target], value=node.value, lineno=node.lineno)

    def visit_Subscript(self, node: ast.Subscript) -> ast.expr:
        self.generic_visit(node)
        outputs = isinstance(node.value, ast.Name) and node.value.id.endswith("outputs")
        if outputs and isinstance(node.slice, ast.Constant) and node.slice.value == 0:
            return ast.Attribute(value=node.value, attr="last_hidden_state", ctx=ast.Load())
        return node


@functools.cache
def _forward_source(path: str) -> str | None:
    """The forward of a class as source, docstring and annotations dropped, read by `_SameMeaning` (what makes two
    forwards identical)."""
    forward = _method(path, "forward")
    if forward is None:
        return None
    body = forward.body[1:] if isinstance(forward.body[0], ast.Expr) else forward.body
    forward.body, forward.returns = body, None
    for arg in (*forward.args.args, *forward.args.kwonlyargs, forward.args.kwarg):
        if arg is not None:
            arg.annotation = None
    return ast.unparse(_SameMeaning().visit(forward))


def _form(path: str, source: str | None = None) -> str:
    """A class's forward as `_forward_source` gives it (or `source`, in its place), without the keywords `name=None`
    of the output it returns where None is that output field's default: an explicit default reads as an omitted one."""
    forward = ast.parse(source or _forward_source(path)).body[0]
    for node in ast.walk(forward):
        if not (isinstance(node, ast.Return) and isinstance(node.value, ast.Call)):
            continue
        nones = [k for k in node.value.keywords if isinstance(k.value, ast.Constant) and k.value.value is None]
        if nones:  # the output class from the class's modeling module (imported only then)
            modeling = importlib.import_module("transformers.models." + path.rpartition(".")[0])
            fields = {f.name: f.default for f in dataclasses.fields(getattr(modeling, node.value.func.id))}
            node.value.keywords = [k for k in node.value.keywords if not (k in nones and fields[k.arg] is None)]
    return ast.unparse(forward)


@pytest.mark.model_tables
def test_every_listed_class_has_its_layers_forward_and_the_layer_its_signature(npu_kernels, card):
    """Identical forwards, but for an output field given its default (so the layer reproduces each); the kernels
    loader's signature rule holds for each; and the layer's group, run as a tiny model of a family of the layer, gives
    eager's loss and gradients on this release (so a group whose forward changed is not proven by its form alone)."""
    failures, references = [], {}
    for rule in proof.proven_rules(RULES):
        if rule.layer not in references:
            family = _reference_family(rule.layer)
            reference = None if family is None else next(r for r in RULES if r.path == _class_path(family))
            check = functools.partial(_fused_model_equals_eager, family)
            references[rule.layer] = proof.reference_holds(reference, check)
        ours = inspect.signature(getattr(card.layers, rule.layer).forward).parameters.values()
        theirs = inspect.signature(rule.installed().forward).parameters.values()
        group = GROUP_OF[rule.layer]
        relative = proof.comparable_with(next(r for r in RULES if r.path == group))
        problems = [
            *(["its forward is not its group's"] if relative and _form(rule.path) != _form(group) else []),
            *(["another wiring"] if relative and _wiring_of_the_layer(card.layers, rule.layer)
              != _wiring_of_the_forward(group) else []),
            *(["another signature"] if [(p.name, p.kind, p.default) for p in ours] != [
                (p.name, p.kind, p.default) for p in theirs] else []),
            *([] if references[rule.layer] else ["its group's family does not give eager's result here"]),
        ]  # fmt: skip
        failures.extend(f"{rule.path}: {problem}" for problem in problems)
        proof.verdict(rule.path, not problems)
    assert failures == []


def test_each_layer_binds_its_arguments_as_its_signature_does(card, monkeypatch):
    """The forward binds by hand (Signature.bind is too slow for every generation step): positional, keyword, default
    and extra arguments land where `inspect.Signature.bind` puts them, and a call the signature refuses raises its
    TypeError."""
    seen = []
    monkeypatch.setattr(card.layers, "_fused_or_own", lambda module, row, arguments: seen.append(arguments))
    for name, row in card.layers.LAYERS.items():
        layer = getattr(card.layers, name)()
        signature = inspect.signature(type(layer).forward)
        n = len(row.parameters)
        calls = [((), {}), (tuple(range(n)), {}), ((1, 2), {"extra": 3, row.parameters[-1]: 4}), ((), {"labels": 5})]
        for args, kwargs in calls:
            seen.clear()
            layer(*args, **kwargs)
            bound = signature.bind(layer, *args, **kwargs)
            bound.apply_defaults()
            assert seen == [{k: v for k, v in bound.arguments.items() if k != "self"}], (name, args, kwargs)
        for args, kwargs in ((tuple(range(n + 1)), {}), ((1,), {row.parameters[0]: 1})):
            with pytest.raises(TypeError):
                signature.bind(layer, *args, **kwargs)
            with pytest.raises(TypeError):
                layer(*args, **kwargs)


def _class_path(model_type: str) -> str:
    cls = type(_tiny(model_type))
    return f"{cls.__module__.removeprefix('transformers.models.')}.{cls.__name__}"


@functools.cache
def _reference_family(layer: str) -> str | None:
    """A tiny family whose `*ForCausalLM` class is one of `layer`'s (None when no tiny family has one)."""
    families = (*FUSED_FAMILIES, *OTHER_FORMS.values(), *AUX_LOSS_FAMILIES)
    return next((f for f in families if _class_path(f) in table.SWAPPED[layer]), None)


def test_every_layer_has_a_tiny_family_that_proves_it():
    """Each layer's group is proven numerically on a release through one of its families."""
    assert [layer for layer in table.SWAPPED if _reference_family(layer) is None] == []


_STANDARD_FIELDS = {"loss", "aux_loss", "logits", "past_key_values", "hidden_states", "attentions"}
"""The fields the shared forward sets itself (aux_loss: where the layer's AuxLoss says the class adds it)."""


def _wiring_of_the_forward(path: str) -> dict:
    """What a class's forward calls and returns around its lm_head + loss lines, read from its (normalised) source:
    the wiring fields of a row of layers.LAYERS, the output class and its extra fields."""
    forward = ast.parse(_forward_source(path)).body[0]
    calls = [n for n in forward.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)]
    base = next(n.value for n in calls if ast.unparse(n.value.func).startswith("self."))
    passed = [a.id for a in base.args] + [k.arg for k in base.keywords if k.arg not in (None, "return_dict")]
    assert all(ast.unparse(k.value) == k.arg for k in base.keywords if k.arg not in (None, "return_dict")), path
    loss = next(n for n in ast.walk(forward) if isinstance(n, ast.Call) and ast.unparse(n.func) == "self.loss_function")
    output = forward.body[-1].value
    fields = {k.arg: ast.unparse(k.value) for k in output.keywords} if isinstance(output, ast.Call) else {}
    extra = tuple(name for name in fields if name not in _STANDARD_FIELDS)
    assert all(fields[name].endswith(f"outputs.{name}") for name in extra), path
    return {
        "base_model": ast.unparse(base.func).removeprefix("self."),
        "model_inputs": set(passed),
        "kwargs_to_model": any(k.arg is None for k in base.keywords),
        "lm_head": ".".join(_head_calls(path)),
        "vocab_size": next(ast.unparse(k.value) for k in loss.keywords if k.arg == "vocab_size").removeprefix("self."),
        "output": ast.unparse(output.func) if isinstance(output, ast.Call) else None,
        "extra": extra,
    }


def _wiring_of_the_layer(layers: ModuleType, layer: str) -> dict:
    """The same, read from the layer's row of the card's table."""
    row = layers.LAYERS[layer]
    wiring = ("base_model", "kwargs_to_model", "lm_head", "vocab_size")
    return {
        **{name: getattr(row, name) for name in wiring},
        "model_inputs": set(row.model_inputs),
        "output": row.output,
        "extra": row.extra,
    }


def test_each_layer_calls_what_its_group_calls_and_returns_what_it_returns(card):
    """The wiring, output class and extra fields of the layer's row are its group's forward's, read from the source."""
    for layer, path in GROUP_OF.items():
        assert _wiring_of_the_layer(card.layers, layer) == _wiring_of_the_forward(path), layer


def test_no_left_out_class_has_a_swapped_forward():
    swapped = {_form(path) for path in GROUP_OF.values()}
    assert [path for path in table.LEFT_OUT if _form(path) in swapped] == []


def test_an_explicit_default_output_is_the_only_difference_dropped():
    """HYV3's forward differs from MoeCausalLM's group form by its `aux_loss=None` alone; a real difference stays."""
    hy_v3_path, group_path = "hy_v3.modeling_hy_v3.HYV3ForCausalLM", GROUP_OF["MoeCausalLM"]
    hy_v3, group = _forward_source(hy_v3_path), _forward_source(group_path)
    assert hy_v3 != group and hy_v3.replace("aux_loss=None, ", "") == group and _form(hy_v3_path) == group
    no_router_logits = group.replace("router_logits=outputs.router_logits", "router_logits=None")
    assert _form(group_path, no_router_logits) != group


def test_the_card_readme_table_mirrors_the_layers_table(card):
    """One row per layer, in the same order, with the output class (and `aux_loss` where the row adds it); the layers
    are the model table's."""
    readme = (Path(__file__).parent.parent / "kernel-cards" / "npu-linear-cross-entropy" / "README.md").read_text()
    rows = [line.split(" | ") for line in readme.splitlines() if line.startswith("| `")]
    stated = [(cells[0].strip("| `"), cells[2]) for cells in rows]
    expected = [
        (name, f"`{row.output}`" + (" with `aux_loss`" if row.aux else "")) for name, row in card.layers.LAYERS.items()
    ]
    assert stated == expected
    assert list(card.layers.LAYERS) == list(CARDS[KERNEL_ID].layers)
    assert set(table.SWAPPED) == set(CARDS[KERNEL_ID].layers)


def _head_calls(path: str) -> list[str]:
    """The `self.<attribute>` modules the forward calls to make its logits (its first `logits = ...` line)."""
    assign = (n for n in ast.walk(_method(path, "forward")) if isinstance(n, ast.Assign))
    line = next(n for n in assign if ast.unparse(n.targets[0]) in ("logits", "lm_logits"))
    calls = (n.func for n in ast.walk(line.value) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute))
    return [f.attr for f in calls if isinstance(f.value, ast.Name) and f.value.id == "self"]


def _built_in_init(path: str, attribute: str) -> str:
    """What the class's __init__ assigns to `self.<attribute>`, as source."""
    for node in ast.walk(_method(path, "__init__")):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == f"self.{attribute}":
            return ast.unparse(node.value)
    raise AssertionError(f"{path}.__init__ assigns no self.{attribute}")


def _linear_head(path: str) -> bool:
    """The logits are made by nn.Linear modules only (the class's __init__ builds each as one)."""
    return all(_built_in_init(path, head).startswith("nn.Linear(") for head in _head_calls(path))


def _default_loss_lines(path: str) -> bool:
    """A Linear lm_head on the hidden states, then the model's loss_function on those logits and the labels, with
    nothing between (no soft-capping, no scaling)."""
    source = _forward_source(path)
    loss_line = "self.loss_function(logits=logits, labels=labels, vocab_size=" in source
    return loss_line and _linear_head(path) and not any(word in source for word in ("tanh", "soft_cap", " * ", " / "))


_REASON_FACTS = {
    table._HEAD_TRANSFORM: lambda path: not _linear_head(path),
    table._Z_LOSS: lambda path: "z_loss" in _forward_source(path),
    table._CODEBOOK_HEADS: lambda path: "codebooks_head" in _forward_source(path),
    table._IMAGE_TOKENS_DROPPED: lambda path: "num_image_tokens" in _forward_source(path),
    table._CAPTURED_OUTPUTS: lambda path: "@capture_outputs" in _forward_source(path) and _default_loss_lines(path),
    table._STATE_SPACE: lambda path: (
        {"cache_params", "state"} & {a.arg for a in _method(path, "forward").args.args} and _default_loss_lines(path)
    ),
    table._SOFTCAP: lambda path: any(word in _forward_source(path) for word in ("tanh", "soft_cap")),
    table._SCALED: lambda path: any(word in _forward_source(path) for word in (" * ", " / ")),
    table._OWN_LOSS: lambda path: "self.loss_function(" not in _forward_source(path),
    table._OWN_FORM: _default_loss_lines,
}
"""Reason -> what the class's source must show for it (so that a reason is not picked by mistake)."""


def test_each_reason_a_class_is_left_out_for_shows_in_its_source():
    """Every reason but the auxiliary loss (its own survey) is checked on the forward (and __init__) it names."""
    checked = {reason.split("{")[0]: facts for reason, facts in _REASON_FACTS.items()}
    wrong, unchecked = [], set()
    for path, reason in table.LEFT_OUT.items():
        facts = next((facts for prefix, facts in checked.items() if reason.startswith(prefix)), None)
        if facts is None:
            unchecked.add(reason)
        elif not facts(path):
            wrong.append(f"{path}: {reason}")
    assert wrong == []
    assert unchecked == set()


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


def _copy(lm_head: nn.Linear, device: str | torch.device, cls: type[nn.Linear] = nn.Linear) -> nn.Linear:
    """A `cls` with lm_head's weights and dtype, on device."""
    head = cls(lm_head.in_features, lm_head.out_features, bias=lm_head.bias is not None)
    head = head.to(lm_head.weight.dtype).to(device)
    head.load_state_dict(lm_head.state_dict())
    return head


def _run(fn, lm_head, h, labels, device, *, autocast: torch.dtype | None = None, **kwargs):
    """(loss, dL/dh, dL/dW, dL/db or None) of fn on device copies; its forward under torch.autocast(device, autocast)
    when one is given."""
    head, leaf = _copy(lm_head, device), h.clone().to(device).requires_grad_()
    with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
        loss, _ = fn(leaf, head, labels.to(device), lm_head.out_features, **kwargs)
    loss.backward()
    bias_grad = None if head.bias is None else head.bias.grad.cpu()
    return loss.detach().cpu(), leaf.grad.cpu(), head.weight.grad.cpu(), bias_grad


def _idiom_runs(card, lm_head, h, labels, dtype: torch.dtype, **kwargs):
    """`_run`'s results of the fused loss in dtype on the npu, of eager in dtype and of eager in float64 on the host
    (of the same values in dtype: the model's own weights and hidden states), and the ops the fused run counted."""
    low = (lm_head.to(dtype), h.to(dtype), labels)
    reference = _run(card.linear_cross_entropy_eager, _copy(low[0], "cpu").double(), low[1].double(), labels, "cpu")
    eager = _run(card.linear_cross_entropy_eager, *low, "cpu")
    with emulation.count_op_calls() as calls:
        fused = _run(card.linear_cross_entropy, *low, "npu", **kwargs)
    return fused, eager, reference, calls


def _assert_within_twice_eagers_error(fused, eager, reference, names=("loss", "dh", "dW", "db")) -> None:
    """flash-attention's idiom on each result the reference has: fused's error against it at most twice eager's."""
    for name, f, e, r in zip(names, fused, eager, reference, strict=True):
        if r is not None:
            assert_within_twice_eagers_error(f, e, r, name, error=relative_error)


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
    problem = _problem(tokens=256, hidden=64, vocab=1000, seed=seed)
    _assert_within_twice_eagers_error(*_idiom_runs(card, *problem, torch.bfloat16, chunk_tokens=64)[:3])


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


def test_default_chunks_are_equal_and_within_the_rows_and_the_hidden_budget(card):
    """Equal chunks of at most 1.15 x the hidden size and 200,000 tokens (npu_cross_entropy_loss's row limit)."""
    assert card.default_chunk_tokens(1, 4096) == 1
    for tokens, hidden in ((32768, 4096), (7, 96), (5000, 16), (10**6, 10**6)):
        chunk = card.default_chunk_tokens(tokens, hidden)
        chunks = -(-tokens // chunk)
        assert chunk <= min(200_000, 1.15 * hidden) and chunks == -(-tokens // min(200_000, int(1.15 * hidden)))
    assert card.default_chunk_tokens(32768, 4096) == 4682  # 7 chunks: issue 26's targets at 8 x 4096
    assert card.default_chunk_tokens(10**6, 10**6) == 200_000


def test_the_form_is_chosen_by_tokens_per_hidden_size(card):
    """The chunked form from 2 tokens per unit of hidden size with a gradient; the log-probability form below it or
    without a gradient (its memory is eager's, its bytes fewer)."""
    assert card.chunked_form_pays(8192, 4096, True) and not card.chunked_form_pays(8191, 4096, True)
    assert not card.chunked_form_pays(10**6, 4096, False)


@pytest.mark.parametrize("chunk", [None, 64], ids=["log-probability form", "chunked form"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_forms_within_twice_eagers_error(card, dtype, chunk):
    """Both forms in bf16/fp16 (the chunked one hands the backward op grad_loss in log_prob's float32, the only dtype
    it takes): loss and gradients within twice eager's error against float64."""
    problem = _problem(tokens=256, hidden=160, vocab=1000, seed=3)  # 256 < 2 x 160: the log-prob form
    *results, calls = _idiom_runs(card, *problem, dtype, chunk_tokens=chunk)
    assert [calls[op] for op in OPS] == (LOG_PROB_FORM if chunk is None else [4, 4])
    _assert_within_twice_eagers_error(*results)


FLOAT32_OUT_ADDMM = "addmm.dtype_out"
"""The float32-out call, as counted: three per chunk (its logits `h @ W^T`, its dL/dW sum
`torch.addmm(sum, grad_logits.t(), h, out_dtype=torch.float32, out=sum)` and its dL/dh product)."""


def _eager_logits_grad(lm_head: nn.Linear, h: torch.Tensor, labels: torch.Tensor):
    """(eager's gradient of the logits [T, V], the hidden states [T, H]), in the model's dtype."""
    hidden = h.reshape(-1, h.shape[-1])
    logits = nn.functional.linear(hidden, lm_head.weight).detach().requires_grad_()
    loss = ForCausalLMLoss(logits=logits.view(*labels.shape, -1), labels=labels, vocab_size=lm_head.out_features)
    loss.backward()
    return logits.grad, hidden


@pytest.mark.parametrize("chunks", [1, 2, 4, 16])
def test_bfloat16_weight_gradient_sums_bfloat16_products_in_float32_within_twice_eagers_error(card, chunks):
    """dW from bfloat16 operands, one float32 sum over the chunks (addmm out_dtype, counted: the logits', dW's and
    dL/dh's per chunk): its error against float64 at most twice eager's (one bfloat16 GEMM of the whole logits
    gradient) at every chunk count, and below the negative control's: each chunk's product rounded to bfloat16, then
    summed in float32 (from eager's own logits gradient)."""
    tokens, chunk = 512, 512 // chunks
    lm_head, h, labels = _problem(tokens=tokens, hidden=64, vocab=2000, seed=chunks)
    *results, calls = _idiom_runs(card, lm_head, h, labels, torch.bfloat16, chunk_tokens=chunk)
    fused, eager, reference = (result[2] for result in results)
    assert calls[FLOAT32_OUT_ADDMM] == 3 * chunks
    grad_logits, hidden = _eager_logits_grad(lm_head.to(torch.bfloat16), h.to(torch.bfloat16), labels)
    products = (grad_logits[r : r + chunk].t() @ hidden[r : r + chunk] for r in range(0, tokens, chunk))
    rounded_per_chunk = sum(p.float() for p in products).to(torch.bfloat16)
    fused_error, eager_error, rounded_error = (relative_error(t, reference) for t in (fused, eager, rounded_per_chunk))
    assert fused_error <= 2 * eager_error, (fused_error, eager_error)
    assert fused_error < rounded_error, (fused_error, rounded_error)


def _twice_rounded_hidden_grad(lm_head: nn.Linear, h: torch.Tensor, labels: torch.Tensor):
    """The negative control of dL/dh: each token's softmax - onehot in bfloat16 times W rounded to bfloat16 by its
    matmul, then divided by the counted tokens and rounded again (issue 46: the card before its fix)."""
    weight, hidden = lm_head.weight.to(torch.bfloat16), h.to(torch.bfloat16).reshape(-1, h.shape[-1])
    targets = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    counted = targets != -100
    logits = nn.functional.linear(hidden, weight).float()
    one_hot = nn.functional.one_hot(torch.where(counted, targets, 0), logits.shape[-1])
    grad_logits = ((logits.softmax(-1) - one_hot) * counted.unsqueeze(1)).to(torch.bfloat16)
    return ((grad_logits @ weight) / counted.sum()).to(torch.bfloat16).reshape(h.shape)


@pytest.mark.parametrize("scale", [1.0, 1 / 3], ids=["loss.backward()", "loss over 3 accumulation steps"])
@pytest.mark.parametrize(
    ("tokens", "hidden", "vocab"),
    [(512, 256, 8000), pytest.param(2048, 1024, 32000, marks=pytest.mark.slow, id="medium")],
)
def test_bfloat16_hidden_gradient_rounded_once_and_both_at_most_eagers_error(card, tokens, hidden, vocab, scale):
    """Issue 46: dL/dh's chunk products summed in float32 (addmm out_dtype, counted: per chunk the logits', dW's and
    dL/dh's) and rounded once, already over the counted tokens; dL/dW a float32 sum rounded once after the backward's
    scale. Both within twice eager's error against float64 (the suite's rule) at any incoming gradient. For
    `loss.backward()` (Trainer's, whose loss is over num_items_in_batch), each at most eager's error, and dL/dh below
    the negative control's: rounded by its bfloat16 matmul, then again when scaled (the card before the fix). A loss
    divided by 3 rounds dL/dh a second time (README), within the rule."""
    lm_head, h, labels = _problem(tokens=tokens, hidden=hidden, vocab=vocab, seed=4)

    def gradients(fn, dtype, device, **kwargs):
        head, leaf = _copy(lm_head.to(dtype), device), h.to(dtype).to(device).requires_grad_()
        loss, _ = fn(leaf, head, labels.to(device), vocab, **kwargs)
        (loss * scale).backward()
        return leaf.grad.cpu(), head.weight.grad.cpu()

    reference = gradients(card.linear_cross_entropy_eager, torch.float64, "cpu")
    eager = gradients(card.linear_cross_entropy_eager, torch.bfloat16, "cpu")
    with emulation.count_op_calls() as calls:
        fused = gradients(card.linear_cross_entropy, torch.bfloat16, "npu", chunk_tokens=tokens // 4)
    assert calls[FLOAT32_OUT_ADDMM] == 3 * 4
    errors = {}
    for name, f, e, r in zip(("dh", "dW"), fused, eager, reference, strict=True):
        assert_within_twice_eagers_error(f, e, r, name, error=relative_error)
        errors[name] = (relative_error(f, r), relative_error(e, r))
    if scale == 1.0:
        assert all(f <= e for f, e in errors.values()), errors
        twice_rounded = _twice_rounded_hidden_grad(lm_head, h, labels)
        assert errors["dh"][0] < relative_error(twice_rounded, reference[0]), errors


@pytest.mark.parametrize("cann", [None, "9.0.0"], ids=["addmm out_dtype", "CANN 9.0: no addmm out_dtype"])
@pytest.mark.parametrize("items", [None, 2**17, 2**18], ids=["counted tokens", "2^17 items", "2^18 items"])
@pytest.mark.parametrize("scale", [1.0, 2.0**16, 1 / 3], ids=["loss", "loss x 2^16", "loss / 3"])
def test_float16_gradients_within_twice_eagers_error_at_any_loss_scale(card, cann_version, scale, items, cann):
    """float16 with fp16's loss scale (DeepSpeed's and AMP's 2^16) over many items (num_items_in_batch of a large
    accumulated batch): dL/dh kept over the items in float16 would underflow (a counted token's share, ~3e-7 here,
    below float16's smallest normal 6.1e-5) before the scale brings it back. Every gradient within twice eager's error
    against float64, at every scale and item count, with and without the float32 out of addmm."""
    if cann is not None:
        cann_version(cann)
    lm_head, h, labels = _problem(tokens=256, hidden=160, vocab=1000, seed=3)
    kwargs = {} if items is None else {"num_items_in_batch": torch.tensor(items)}

    def gradients(fn, dtype, device, **chunking):
        head, leaf = _copy(lm_head.to(dtype), device), h.to(dtype).to(device).requires_grad_()
        loss, _ = fn(leaf, head, labels.to(device), lm_head.out_features, **kwargs, **chunking)
        (loss * scale).backward()
        return leaf.grad.cpu(), head.weight.grad.cpu()

    reference = gradients(card.linear_cross_entropy_eager, torch.float64, "cpu")
    eager = gradients(card.linear_cross_entropy_eager, torch.float16, "cpu")
    with emulation.count_op_calls() as calls:
        fused = gradients(card.linear_cross_entropy, torch.float16, "npu", chunk_tokens=64)
    assert calls[OPS[1]] == 4 and calls[FLOAT32_OUT_ADDMM] == (0 if cann else 3 * 4)
    for name, f, e, r in zip(("dh", "dW"), fused, eager, reference, strict=True):
        assert_within_twice_eagers_error(f, e, r, name, error=relative_error)


@pytest.mark.parametrize("cann", ["9.0.0", "9.1.0-beta.3"])
def test_without_the_float32_out_addmm_the_model_sums_float32_products_and_says_why(npu_kernels, cann_version, cann):
    """Before CANN 9.1 the weight gradient sums float32 products (no addmm out_dtype call; the loss still fuses),
    swapped_modules says why, and the gradient is within eager's idiom; from 9.1 (negative control) it calls it."""
    ids = _TWO_CHUNKS_OF_IDS
    reference = _tiny("llama").double().train()
    reference(input_ids=ids, labels=_labels(ids)).loss.backward()
    eager = _tiny("llama").to(torch.bfloat16).train()
    eager(input_ids=ids, labels=_labels(ids)).loss.backward()
    grads = {}
    for version in (emulation.DEFAULT_CANN_VERSION, cann):
        model = kernelize(_tiny("llama").to(torch.bfloat16).train().to("npu"), mode=Mode.TRAINING, device="npu")
        cann_version(version)  # after kernelize; conftest's fixture restores the default
        calls, said = _counted_step_and_reason(model, ids)
        grads[version] = model.lm_head.weight.grad.cpu()
        assert calls[OPS[1]] == 2 and calls[FLOAT32_OUT_ADDMM] == (0 if version == cann else 6)  # 2 chunks of 64
        assert (said is None) == (version != cann) and (version != cann or f"CANN {cann}" in said), said
    want = reference.lm_head.weight.grad
    eager_error = relative_error(eager.lm_head.weight.grad, want)
    assert all(relative_error(grad, want) <= 2 * eager_error for grad in grads.values())


_TWO_CHUNKS_OF_IDS = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
"""128 tokens: a tiny Llama's loss takes the chunked form, in 2 chunks of 64."""


def _counted_step_and_reason(model, ids: torch.Tensor):
    """The ops a training step of the kernelized `model` on `ids` counted, and why this card's layer ran eager."""
    with emulation.count_op_calls() as calls:
        model(input_ids=ids.to("npu"), labels=_labels(ids).to("npu")).loss.backward()
    (swap,) = swapped_modules(model, card="npu-linear-cross-entropy")
    return calls, swap.eager_reason


def test_float32_weights_keep_float32_products_and_no_reason(npu_kernels):
    """float32 weights: the model's own dtype, no 16-bit product to make, nothing to say (negative control)."""
    model = kernelize(_tiny("llama").train().to("npu"), mode=Mode.TRAINING, device="npu")
    calls, said = _counted_step_and_reason(model, _TWO_CHUNKS_OF_IDS)
    assert calls[OPS[1]] == 2 and calls[FLOAT32_OUT_ADDMM] == 0 and said is None


def test_more_tokens_than_the_op_takes_rows_go_in_chunks_of_200000(card):
    """npu_cross_entropy_loss takes at most 200,000 rows: 200,001 tokens make two op calls, each form, eager's loss."""
    lm_head = nn.Linear(2, 3, bias=False)
    h, labels = torch.randn(1, 200_001, 2), torch.randint(0, 3, (1, 200_001))
    want = card.linear_cross_entropy_eager(h, lm_head, labels, 3)[0]
    lm_head_npu = _copy(lm_head, "npu")
    for chunk in (None, 10**6):  # the log-probability form (no grad), the chunked form asked for larger chunks
        with torch.set_grad_enabled(chunk is not None), emulation.count_op_calls() as calls:
            got, _ = card.linear_cross_entropy(h.to("npu"), lm_head_npu, labels.to("npu"), 3, chunk_tokens=chunk)
            if chunk is not None:
                got.backward()
        assert calls[OPS[0]] == 2
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)


class _Subclassed(nn.Linear):
    pass


def _fallbacks():
    """(name, change to the problem, words the reason must hold): each input the fused path leaves to eager."""
    return [
        ("no labels", lambda p: {**p, "labels": None}, "no labels"),
        ("custom loss", lambda p: {**p, "loss_function": _custom_loss}, "_custom_loss"),
        ("logits_to_keep", lambda p: {**p, "logits_to_keep": 3, "labels": p["labels"][:, -3:]}, "logits_to_keep"),
        ("wrapped lm_head", lambda p: {**p, "lm_head": _retyped(p["lm_head"])}, "plain nn.Linear"),
        (
            "lm_head of a class named Linear (peft's LoRA layer)",
            lambda p: {**p, "lm_head": _retyped(p["lm_head"], Linear)},
            f"{__name__}.Linear, not a plain nn.Linear",
        ),
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


class Linear(nn.Linear):
    """A subclass with nn.Linear's own name, as peft's LoRA layer (peft.tuners.lora.layer.Linear) is."""


def _retyped(head: nn.Linear, cls: type[nn.Linear] = _Subclassed) -> nn.Linear:
    return _copy(head, head.weight.device, cls)


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
    problem = {"hidden": h.to("npu"), "lm_head": lm_head.to("npu"), "labels": labels.to("npu")}
    problem = change({**problem, "vocab_size": lm_head.out_features})
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
    its chunks' matmuls on operands in dtype as eager's autocast lm_head does (their logits summed in float32, not
    rounded to dtype as eager's are), and returns float32 gradients, within eager's idiom."""
    lm_head, h, labels = _problem(tokens=256, hidden=64, vocab=1000, bias=bias)
    eager = _run(card.linear_cross_entropy_eager, lm_head, h, labels, "npu", autocast=dtype)
    with emulation.count_op_calls() as calls:
        fused = _run(card.linear_cross_entropy, lm_head, h, labels, "npu", autocast=dtype, chunk_tokens=64)
    # the loss against float64's of the operands autocast gives (a single number: against the float32 weights' loss,
    # which of the two runs lands nearer is a draw of the casts' errors); the gradients against the float32 weights'
    cast = _run(
        card.linear_cross_entropy_eager, _copy(lm_head, "cpu").to(dtype).double(), h.to(dtype).double(), labels, "cpu"
    )
    reference = _run(card.linear_cross_entropy_eager, lm_head.double(), h.double(), labels, "cpu")  # double() in place
    assert [calls[op] for op in OPS] == [4, 4]  # 256 tokens in chunks of 64
    assert relative_error(eager[2], reference[2]) > 1e-4  # eager's lm_head did run in dtype
    assert all(f.dtype == e.dtype == torch.float32 for f, e in zip(fused, eager, strict=True) if f is not None)
    _assert_within_twice_eagers_error(fused, eager, (cast[0], *reference[1:]))


@pytest.mark.parametrize("bias", [False, True])
def test_16bit_chunks_take_their_logits_unrounded_from_the_float32_out(card, bias):
    """With the float32 out (CANN 9.1), a chunk's logits are its 16-bit operands' products summed in float32 and never
    rounded to 16 bits (the addmm counted three times a chunk: logits, dW, dL/dh): the loss is float64's loss of those
    same operands to float32's precision, where eager's (logits rounded to bfloat16, its negative control) is not."""
    lm_head, h, labels = _problem(tokens=256, hidden=64, vocab=1000, bias=bias, dtype=torch.bfloat16)
    with emulation.count_op_calls() as calls:
        fused = _run(card.linear_cross_entropy, lm_head, h, labels, "npu", chunk_tokens=64)
    eager = _run(card.linear_cross_entropy_eager, lm_head, h, labels, "cpu")
    same_operands = _run(card.linear_cross_entropy_eager, lm_head.double(), h.double(), labels, "cpu")
    assert calls[FLOAT32_OUT_ADDMM] == 3 * 4
    fused_error, eager_error = (relative_error(run[0], same_operands[0]) for run in (fused, eager))
    assert fused_error < 1e-6 < eager_error, (fused_error, eager_error)


class _WeightCasts(TorchDispatchMode):
    """Counts the dtype casts (aten `_to_copy` to another dtype) of tensors of a given shape, by (from, to) dtype."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.shape, self.casts = shape, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cast = func is torch.ops.aten._to_copy.default and kwargs.get("dtype", args[0].dtype) != args[0].dtype
        if cast and tuple(args[0].shape) == self.shape:
            self.casts[(args[0].dtype, kwargs["dtype"])] += 1
        return func(*args, **kwargs)


def test_autocast_casts_the_weight_once_per_step_and_keeps_float32_gradients_float32(card):
    """Issue 46: under autocast on float32 weights the chunked form casts lm_head's weight to bfloat16 once per forward
    (4 chunks) and nothing of its size in backward, where dL/dW comes back from the float32 sum in float32 (eager's
    autocast rounds it to bfloat16, then casts it back: its negative control, two casts more). So its error against
    float64 is below eager's, as dL/dh's (kept in float32, the hidden states' dtype)."""
    lm_head, h, labels = _problem(tokens=256, hidden=64, vocab=1000)
    weight_shape = tuple(lm_head.weight.shape)
    runs = {}
    for name, fn, kwargs in (("eager", card.linear_cross_entropy_eager, {}), ("fused", card.linear_cross_entropy,
                             {"chunk_tokens": 64})):  # fmt: skip
        with _WeightCasts(weight_shape) as counted:
            runs[name] = _run(fn, lm_head, h, labels, "npu", autocast=torch.bfloat16, **kwargs)
        runs[name + " casts"] = counted.casts
    reference = _run(card.linear_cross_entropy_eager, lm_head.double(), h.double(), labels, "cpu")
    assert runs["fused casts"] == {(torch.float32, torch.bfloat16): 1}, runs["fused casts"]
    assert runs["eager casts"] == {(torch.float32, torch.bfloat16): 1, (torch.bfloat16, torch.float32): 1}
    for index in (1, 2):  # dL/dh, dL/dW
        fused, eager = (relative_error(runs[name][index], reference[index]) for name in ("fused", "eager"))
        assert fused < eager, (index, fused, eager)


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
OTHER_FORMS = {
    "CausalLM": "persimmon",  # the loss's arguments positional
    "MoeCausalLM": "llama4_text",  # the base model's output read as outputs[0]
    "GPTNeoXCausalLM": "gpt_neox",
    "NemotronCausalLM": "nemotron",
    "BloomCausalLM": "bloom",
    "FalconCausalLM": "falcon",
    "GPTJCausalLM": "gptj",
    "GPTNeoCausalLM": "gpt_neo",
    "GPTBigCodeCausalLM": "gpt_bigcode",
    "OPTCausalLM": "opt",
    "BioGptCausalLM": "biogpt",
    "GPTNeoXJapaneseCausalLM": "gpt_neox_japanese",
}
"""Layer -> a family of a form other than Llama's and DeepSeek-V3's that the layer replaces (each layer has one)."""
_OTHER_FORM_CONFIGS = {
    "llama4_text": {"num_local_experts": 4, "num_experts_per_tok": 1, "intermediate_size_mlp": 96},
    "falcon": {"head_dim": None},  # derived from the widths: not a value FalconConfig takes
    "gptj": {"rotary_dim": 8},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 8},
    "gpt_bigcode": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "opt": {"ffn_dim": 96, "word_embed_proj_dim": 64, "dropout": 0.0},
    "biogpt": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    "gpt_neox_japanese": {"attention_dropout": 0.0},
}
"""Config values of the other forms' tiny families beyond the shared tiny ones, dropout off (TINY_CONFIGS, which the
demo and the bench run through, holds the Llama-form families)."""


_EAGER_ON_NPU = {"llama4_text"}
"""Families whose eager reference runs on the emulated npu too: Llama4's attention gradients there differ from the
host's already without any card (its complex-valued rotary), so the host is not its reference."""


def _pair(model_type: str, **overrides):
    eager = _tiny(model_type, **overrides).train().to("npu" if model_type in _EAGER_ON_NPU else "cpu")
    fused = _tiny(model_type, **overrides).train().to("npu")
    return eager, kernelize(fused, mode=Mode.TRAINING, device="npu")


ONLY_HERE = {
    "dbrx": dict(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=64,
        # DbrxAttention reads rope_theta from attn_config and clamps with clip_qkv: 5.22.2's defaults build no model
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    ),
    "jetmoe": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, kv_channels=16,
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    ),
    "doge": dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, keep_window_size=64, is_moe=True, num_experts=16, num_experts_per_tok=4,
    ),
}  # fmt: skip
"""Tiny configs of the single-class layers' families, which only this card's tests build."""


def _tiny(model_type: str, **overrides):
    """The tiny model of a family, random weights: npu_hub_kernels.testing's, one of ONLY_HERE, or the shared tiny
    Llama values with the family's _OTHER_FORM_CONFIGS."""
    if model_type in ONLY_HERE:
        values = {"vocab_size": VOCAB, **ONLY_HERE[model_type], **overrides}
    elif model_type in TINY_CONFIGS:
        return tiny_causal_lm(model_type, **overrides)
    else:
        values = {**tiny_config_values("llama"), **_OTHER_FORM_CONFIGS.get(model_type, {}), **overrides}
        values = {name: value for name, value in values.items() if value is not None}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **values)).eval()


def _labels(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[:, :3] = -100
    return labels


@pytest.mark.parametrize("model_type", (*FUSED_FAMILIES, *OTHER_FORMS.values()))
def test_model_loss_and_every_gradient_match_eager_with_the_fused_ops_counted(npu_kernels, model_type):
    _fused_model_equals_eager(model_type)


def _fused_model_equals_eager(model_type: str) -> None:
    """A tiny `model_type` kernelized gives eager's loss, hidden states (asked for), output class and gradients, with
    the fused ops counted."""
    eager, fused = _pair(model_type)
    assert [s.module for s in swapped_modules(fused) if s.card == "npu-linear-cross-entropy"] == [ROOT_MODULE]
    ids, device = token_ids(), eager.device
    with emulation.count_op_calls() as calls:
        want = eager(input_ids=ids.to(device), labels=_labels(ids).to(device), output_hidden_states=True)
        want.loss.backward()
    assert calls[OPS[0]] == 0
    with emulation.count_op_calls() as calls:
        got = fused(input_ids=ids.to("npu"), labels=_labels(ids).to("npu"), output_hidden_states=True)
        got.loss.backward()
    assert [calls[op] for op in OPS] == LOG_PROB_FORM and got.logits is None and type(got) is type(want)
    torch.testing.assert_close(got.loss.cpu(), want.loss.cpu(), rtol=1e-5, atol=1e-6)
    assert len(got.hidden_states) == len(want.hidden_states) == eager.config.num_hidden_layers + 1
    for g, w in zip(got.hidden_states, want.hidden_states, strict=True):
        torch.testing.assert_close(g.detach().cpu(), w.detach().cpu(), rtol=1e-5, atol=1e-5)
    _assert_same_gradients(eager, fused)


def _assert_same_gradients(eager, fused) -> None:
    """Every parameter's gradient is eager's; one no token reaches (an MoE's unrouted expert, Doge's A and dt_proj
    here) has none in either."""
    for (name, p), q in zip(eager.named_parameters(), fused.parameters(), strict=True):
        assert (q.grad is None) == (p.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad.cpu(), p.grad.cpu(), rtol=1e-4, atol=1e-6, msg=name)


AUX_LOSS_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "dbrx", "jetmoe", "doge")
"""Tiny families of the layers that add the router's auxiliary loss (MoeCausalLMWithAuxLoss, DbrxCausalLM,
JetMoeCausalLM, DogeCausalLM)."""
ROUTER_LOGITS = {
    "off": ({}, {}),  # the configs' default: output_router_logits=False, no auxiliary loss
    "argument": ({}, {"output_router_logits": True}),
    "config": ({"output_router_logits": True}, {}),
}
"""How the forward is asked for the router logits: (config overrides, call arguments)."""
COEFFICIENT = {"dbrx": "router_aux_loss_coef", "jetmoe": "aux_loss_coef"}
"""The module attribute of the auxiliary loss's coefficient the class's forward reads (else router_aux_loss_coef)."""


def _aux_loss_step(model, ids: torch.Tensor, **call):
    """A training step with labels and a padding mask (the auxiliary loss reads it): the output, after backward, and
    the keywords the base model got (`_base_model_keywords`)."""
    device = next(model.parameters()).device
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    with _base_model_keywords(model) as keywords:
        outputs = model(
            input_ids=ids.to(device), attention_mask=mask.to(device), labels=_labels(ids).to(device), **call
        )
    outputs.loss.backward()
    return outputs, keywords


@contextlib.contextmanager
def _base_model_keywords(model):
    """Yields a dict filled, on the model's call, with the keywords its base model got (tensors as "tensor"): the
    layer must pass it what the class's forward passes, nothing more."""
    keywords = {}

    def record(module, args, kwargs):
        keywords.update({name: "tensor" if torch.is_tensor(v) else v for name, v in kwargs.items()})

    handle = model.base_model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield keywords
    finally:
        handle.remove()


@pytest.mark.parametrize("asked", ROUTER_LOGITS)
@pytest.mark.parametrize("model_type", AUX_LOSS_FAMILIES)
def test_moe_auxiliary_loss_added_as_eager_adds_it_to_the_fused_loss(npu_kernels, model_type, asked):
    """The loss (LM loss + coefficient x load-balancing loss), the output's aux_loss and every parameter's gradient
    (the routers' too, through the auxiliary loss) are eager's, with the fused ops counted."""
    config, call = ROUTER_LOGITS[asked]
    eager, fused = _pair(model_type, **config)
    assert [s.module for s in swapped_modules(fused) if s.card == "npu-linear-cross-entropy"] == [ROOT_MODULE]
    for model in (eager, fused):  # a coefficient the auxiliary loss weighs in with (the configs' are 0.01 or less)
        setattr(model, COEFFICIENT.get(model_type, "router_aux_loss_coef"), 0.5)
    ids = token_ids()
    want, want_keywords = _aux_loss_step(eager, ids, **call)
    with emulation.count_op_calls() as calls:
        got, keywords = _aux_loss_step(fused, ids, **call)
    assert [calls[op] for op in OPS] == LOG_PROB_FORM and got.logits is None
    assert keywords == want_keywords and keywords["output_router_logits"] == (asked != "off")
    assert (got.aux_loss is None) == (want.aux_loss is None) == (asked == "off")
    if asked != "off":
        torch.testing.assert_close(got.aux_loss.cpu(), want.aux_loss, rtol=1e-5, atol=1e-6)
        assert len(got.router_logits) == len(want.router_logits) > 0
    torch.testing.assert_close(got.loss.cpu(), want.loss, rtol=1e-5, atol=1e-6)
    _assert_same_gradients(eager, fused)


@pytest.mark.parametrize("model_type", AUX_LOSS_FAMILIES)
def test_moe_auxiliary_loss_in_evaluation_keeps_the_class_forward(npu_kernels, model_type):
    """Negative control: in evaluation the class's forward runs (no fused op) with the layer's arguments, its logits
    and auxiliary loss eager's."""
    eager, fused = _pair(model_type)
    eager.eval(), fused.eval()
    ids = token_ids()
    with torch.no_grad(), emulation.count_op_calls() as calls, _base_model_keywords(fused) as keywords:
        got = fused(input_ids=ids.to("npu"), labels=ids.to("npu"), output_router_logits=True)
    with torch.no_grad(), _base_model_keywords(eager) as want_keywords:
        want = eager(input_ids=ids, labels=ids, output_router_logits=True)
    assert calls[OPS[0]] == 0 and got.logits is not None and keywords == want_keywords
    for name in ("loss", "aux_loss", "logits"):
        torch.testing.assert_close(getattr(got, name).cpu(), getattr(want, name), rtol=1e-5, atol=1e-5, msg=name)


def test_doge_without_moe_asks_no_router_logits_as_its_class(npu_kernels):
    """Doge's forward asks its base model for router logits only with config.is_moe: a dense Doge asked for them
    gets none and adds no auxiliary loss, in the fused step as in eager's."""
    eager, fused = _pair("doge", is_moe=False)
    ids = token_ids()
    want, want_keywords = _aux_loss_step(eager, ids, output_router_logits=True)
    with emulation.count_op_calls() as calls:
        got, keywords = _aux_loss_step(fused, ids, output_router_logits=True)
    assert calls[OPS[0]] == 1 and keywords == want_keywords and keywords["output_router_logits"] is False
    assert got.aux_loss is None and want.aux_loss is None
    torch.testing.assert_close(got.loss.cpu(), want.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_moe_auxiliary_loss_bfloat16_error_at_most_twice_eagers_against_float64(npu_kernels, model_type):
    """bfloat16 training step with the auxiliary loss, this card alone applied: the loss and the lm_head's, the
    embedding's and the routers' gradients are within twice eager's error against a float64 eager reference."""
    ids = token_ids()
    weights = tiny_causal_lm(model_type, output_router_logits=True).to(torch.bfloat16).state_dict()

    def step(dtype, device, kernelized):
        model = tiny_causal_lm(model_type, output_router_logits=True).train()
        model.load_state_dict(weights)  # the same bfloat16 weights, exactly, in every run
        model = model.to(dtype).to(device)
        if dtype == torch.float64:  # the default grouped matmul of the experts takes no float64
            model.set_experts_implementation("eager")
        if kernelized:
            model = apply_npu_kernels(model, kernels=KERNEL_ID, local_dir=npu_kernels)
        outputs, _ = _aux_loss_step(model, ids)
        grads = {name: p.grad.cpu().double() for name, p in model.named_parameters() if _compared(name)}
        return {"loss": outputs.loss.detach().cpu().double(), **grads}

    reference = step(torch.float64, "cpu", False)
    eager = step(torch.bfloat16, "cpu", False)
    with emulation.count_op_calls() as calls:
        fused = step(torch.bfloat16, "npu", True)
    assert calls[OPS[0]] == 1 and len(reference) > 3
    names = list(reference)
    _assert_within_twice_eagers_error(*([run[n] for n in names] for run in (fused, eager, reference)), names=names)
    assert relative_error(eager["lm_head.weight"], reference["lm_head.weight"]) > 1e-4  # eager did run in bfloat16


def _compared(name: str) -> bool:
    """The parameters the bfloat16 test compares: the lm_head, the embedding and the routers (`gate` modules)."""
    return name.startswith(("lm_head", "model.embed_tokens")) or name.endswith("mlp.gate.weight")


def test_a_left_out_class_keeps_its_forward(npu_kernels):
    """Negative control: Gemma2 soft-caps its logits before the loss, so its class is left out: no fused op runs."""
    eager, fused = _pair("gemma2")
    ids = token_ids()
    with emulation.count_op_calls() as calls:
        got = fused(input_ids=ids.to("npu"), labels=ids.to("npu"))
    assert [calls[op] for op in OPS] == [0, 0]
    torch.testing.assert_close(got.loss.cpu(), eager(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type", OTHER_FORMS.values())
def test_other_forms_are_eager_without_a_training_step_and_fuse_as_tuples(npu_kernels, model_type):
    """Each other form's fallbacks: evaluation with labels and a training step without them run the class's forward,
    logits included (no fused op); return_dict=False fuses and returns eager's tuple without the logits, with
    Trainer's num_items_in_batch keyword going where the class sends its **kwargs (the loss, or the base model too)."""
    eager, fused = _pair(model_type)
    ids = token_ids()
    npu, ids = ids.to("npu"), ids.to(eager.device)
    with emulation.count_op_calls() as calls:
        no_labels = fused(input_ids=npu)
        fused.eval(), eager.eval()
        evaluation = fused(input_ids=npu, labels=npu)
    assert calls[OPS[0]] == 0
    want = eager(input_ids=ids, labels=ids)
    torch.testing.assert_close(evaluation.loss.cpu(), want.loss.cpu(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(evaluation.logits.cpu(), want.logits.cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(no_labels.logits.detach().cpu(), want.logits.cpu(), rtol=1e-5, atol=1e-5)
    fused.train(), eager.train()
    with emulation.count_op_calls() as calls:
        got = fused(input_ids=npu, labels=npu, return_dict=False, num_items_in_batch=torch.tensor(20))
    want = eager(input_ids=ids, labels=ids, return_dict=False, num_items_in_batch=torch.tensor(20))
    assert calls[OPS[0]] == 1 and isinstance(got, tuple) and len(got) == len(want) and got[1] is None
    torch.testing.assert_close(got[0].cpu(), want[0].cpu(), rtol=1e-5, atol=1e-6)


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


def _traced_training_step(model, trace: str | None, ids: torch.Tensor, labels: torch.Tensor):
    """A training step of `model` (on the npu) on `ids` and `labels` as `trace` runs it: None (untraced), torch.compile
    with the backend "eager" or "aot_eager", or "export" (torch.export's program of the forward, then its backward)."""
    if trace == "export":

        class Loss(nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, ids, labels):
                outputs = self.model(input_ids=ids, labels=labels, use_cache=False)
                return outputs.loss, outputs.logits

        forward = torch.export.export(Loss().train(), (ids, labels)).module()
    else:

        def forward(ids, labels):
            outputs = model(input_ids=ids, labels=labels, use_cache=False)
            return outputs.loss, outputs.logits

        if trace is not None:
            torch._dynamo.reset()
            forward = torch.compile(forward, backend=trace)
    loss, logits = forward(ids, labels)
    loss.backward()
    return loss, logits


def _traced_step_is_eagers(built: Path, trace: str, dtype: torch.dtype) -> None:
    """A one-layer tiny Llama with this card applied, its training step with labels traced by `trace`, runs the class's
    own forward: the loss, logits and gradients of the model without the card traced the same way, no fused op, the
    tracer named as the layer's last reason; the same model's next untraced step fuses (the control)."""
    eager, fused = (tiny_causal_lm("llama", dtype=dtype, num_hidden_layers=1).train().to("npu") for _ in range(2))
    apply_npu_kernels(fused, kernels=KERNEL_ID, local_dir=built)
    ids = token_ids().to("npu")
    labels = _labels(ids.cpu()).to("npu")
    want_loss, want_logits = _traced_training_step(eager, trace, ids, labels)
    with emulation.count_op_calls() as calls:
        loss, logits = _traced_training_step(fused, trace, ids, labels)
    assert calls[OPS[0]] == 0 and logits is not None
    (swap,) = swapped_modules(fused, card="npu-linear-cross-entropy")
    tracer = "torch.export" if trace == "export" else "torch.compile or torch.export"
    assert swap.eager_reason.startswith(f"{tracer} traces the call: the fused loss reads the labels' range")
    torch.testing.assert_close(loss.cpu(), want_loss.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(logits.cpu(), want_logits.cpu(), rtol=0, atol=0)
    _assert_same_gradients(eager, fused)
    with emulation.count_op_calls() as calls:
        _traced_training_step(fused, None, ids, labels)
    assert calls[OPS[0]] == 1 and swapped_modules(fused, card="npu-linear-cross-entropy")[0].eager_reason is None


def test_an_exported_training_step_runs_the_class_forward_saying_why(npu_kernels):
    """torch.export of a training step with labels: the fused loss reads the labels' range on the host (a
    data-dependent guard export refuses) and sets lm_head's forward for the call, so under a tracer the layer runs the
    class's own forward, logits included, saying why."""
    _traced_step_is_eagers(npu_kernels, "export", torch.float32)


SLOW_TRACES = [(trace, dtype) for trace in ("eager", "aot_eager") for dtype in ("float32", "bfloat16")]
"""The slow tracer forms: torch.compile's backends in both dtypes (and torch.export in bfloat16, added below)."""


@pytest.mark.slow
@pytest.mark.parametrize(("trace", "dtype"), [*SLOW_TRACES, ("export", "bfloat16")])
def test_traced_training_steps_run_the_class_forward_saying_why(npu_kernels, trace, dtype):
    """torch.compile (backends eager and aot_eager; the attack's repro_compile_loss_card: a RecursionError inside
    dynamo) and torch.export, float32 and bfloat16: the class's own forward, as the model without the card gives."""
    _traced_step_is_eagers(npu_kernels, trace, getattr(torch, dtype))


@pytest.mark.parametrize(("model_type", "call"), [("qwen3", {}), ("qwen3_moe", {"output_router_logits": True})])
def test_return_dict_false_in_a_training_step(npu_kernels, model_type, call):
    """The tuple holds what eager's does, the logits' slot None, so every field keeps eager's position: (loss, logits,
    past_key_values), and the MoE's (loss, aux_loss, logits, ...) with the router logits."""
    eager, fused = _pair(model_type)
    ids = token_ids()
    with emulation.count_op_calls() as calls:
        got = fused(input_ids=ids.to("npu"), labels=ids.to("npu"), return_dict=False, **call)
    assert [calls[op] for op in OPS] == LOG_PROB_FORM
    want = eager(input_ids=ids, labels=ids, return_dict=False, **call)
    logits = 2 if call else 1
    assert isinstance(got, tuple) and len(got) == len(want) and got[logits] is None
    assert [type(g) for g in got[logits + 1 :]] == [type(w) for w in want[logits + 1 :]]
    for g, w in zip(got[:logits], want[:logits], strict=True):  # the loss (and the auxiliary loss)
        torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-6)


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


def _z_loss_wrapper():
    """A user's wrapper of transformers' ForCausalLMLoss (a z-loss added), made with functools.wraps."""

    @functools.wraps(ForCausalLMLoss)
    def with_z_loss(logits, labels, vocab_size, **kwargs):
        return ForCausalLMLoss(logits, labels, vocab_size, **kwargs) + 1e-2 * logits.float().logsumexp(-1).pow(2).mean()

    return with_z_loss


@pytest.mark.parametrize("where", ["custom loss", "model.loss_function", "LOSS_MAPPING"])
def test_a_custom_or_wrapped_loss_function_keeps_the_class_forward(npu_kernels, monkeypatch, where):
    """A loss of one's own, or ForCausalLMLoss wrapped with functools.wraps (which copies its __module__ and
    __name__: only the function itself is transformers'), runs in the class's forward, eager's loss."""
    from transformers.loss import loss_utils

    eager, fused = _pair("llama")
    wrapper = _custom_loss if where == "custom loss" else _z_loss_wrapper()
    if where != "custom loss":
        assert (wrapper.__module__, wrapper.__name__) == ("transformers.loss.loss_utils", "ForCausalLMLoss")
    if where == "LOSS_MAPPING":
        monkeypatch.setitem(loss_utils.LOSS_MAPPING, "ForCausalLM", wrapper)
    else:
        fused.loss_function = eager.loss_function = wrapper
    assert fused.loss_function is wrapper
    ids = token_ids()
    with emulation.count_op_calls() as calls:
        got = fused(input_ids=ids.to("npu"), labels=ids.to("npu"))
    assert calls[OPS[0]] == 0 and got.logits is not None
    torch.testing.assert_close(got.loss.cpu(), eager(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-6)
    monkeypatch.undo()  # transformers' own loss again: the card fuses (the negative control)
    with emulation.count_op_calls() as calls:
        fused.loss_function = loss_utils.ForCausalLMLoss
        fused(input_ids=ids.to("npu"), labels=ids.to("npu"))
    assert calls[OPS[0]] > 0


def _bad_labels(kind: str, ids: torch.Tensor):
    """Labels as a data pipeline may get them wrong: -1 padding, an id past the vocabulary, another type."""
    if kind == "-1 padding":
        return ids.masked_fill(torch.arange(ids.shape[1]) >= ids.shape[1] - 2, -1)
    if kind == "past the vocabulary":
        return ids.masked_fill(torch.arange(ids.shape[1]) == 3, 10_000)
    if kind == "list":
        return ids.tolist()
    return ids.to({"int32": torch.int32, "uint8": torch.uint8, "float": torch.float32}[kind])


def _outcome(call) -> tuple:
    """(loss,) of `call()`, or (type, message) of the exception it raised."""
    try:
        return (call().loss.detach().cpu(),)
    except Exception as error:  # compared with eager's outcome
        return type(error), str(error)


@pytest.mark.parametrize("kind", ["-1 padding", "past the vocabulary", "int32", "uint8", "float", "list"])
def test_bad_labels_get_eagers_answer_and_the_device_never_reads_outside_a_row(npu_kernels, kind):
    """A label outside [0, vocab) that is not ignore_index raises eager's IndexError naming it, before any device op
    reads its row; labels of another dtype or type raise eager's exception."""
    eager, fused = _pair("llama")
    ids = token_ids()
    labels = _bad_labels(kind, ids)
    on_npu = labels if isinstance(labels, list) else labels.to("npu")
    with emulation.count_op_calls() as calls:
        got = _outcome(lambda: fused(input_ids=ids.to("npu"), labels=on_npu))
    want = _outcome(lambda: eager(input_ids=ids, labels=labels))
    assert len(want) == 2, f"eager took {kind} labels"
    assert got[0] is want[0], got
    if want[0] is IndexError:  # eager's "Target -1 is out of bounds.", the bad label named
        assert want[1].rstrip(".") in got[1], got[1]
    assert calls[OPS[0]] == 0


# --- the counted targets (issue 19) ---------------------------------------------------------------------------


def _spec():
    """This card's bench spec (scripts/bench/cards/npu_linear_cross_entropy.py)."""
    from bench.cards import npu_linear_cross_entropy

    return npu_linear_cross_entropy


def _loss_region(model: str, shape: tuple[int, int], chunk: int) -> tuple:
    """The bench's tallies of the loss region (scripts/bench/outside.py, as the spec declares it), forward+backward at
    `shape` on fake tensors: eager, the card's default, the card at `chunk` tokens per chunk."""
    from bench import outside
    from bench.cards import card_named

    card, region = card_named("npu-linear-cross-entropy"), _spec().OUTSIDE_REGION
    runs = (("eager", None), ("kernelized", None), ("kernelized", chunk))
    return tuple(outside.measure(card, region, model, column, *shape, chunk=c).tally for column, c in runs)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-3-8b", "qwen3-8b"])
def test_counted_targets_met_at_batch_8_x_4096(npu_kernels, model):
    """Forward+backward, bfloat16, on fake tensors: the card's default moves no more bytes than eager and its peak of
    live bytes is at most 1/8 of eager's; a chunk of 8192 tokens (the negative control) breaks the peak."""
    pytest.importorskip("bench.memory", reason="the memory measure, scripts/bench/memory.py (branch memory)")
    eager, fused, large = _loss_region(model, _spec().SHAPE, 8192)
    assert fused.bytes <= eager.bytes and fused.memory.peak_bytes <= _spec().PEAK_SHARE * eager.memory.peak_bytes
    assert large.memory.peak_bytes > _spec().PEAK_SHARE * eager.memory.peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize(("model", "shape"), [("llama-3-8b", (1, 512)), ("qwen3-8b", (1, 2048))], ids=str)
def test_micro_batches_never_above_eager_in_bytes_or_peak(npu_kernels, model, shape):
    """Issue 26: at micro-batch sizes the card's default (the log-probability form) moves fewer bytes than eager and
    holds no more; the chunked form there (the negative control) holds more than eager (its float32 dL/dW)."""
    pytest.importorskip("bench.memory", reason="the memory measure, scripts/bench/memory.py")
    eager, fused, chunked = _loss_region(model, shape, 512)
    assert fused.bytes <= eager.bytes and fused.memory.peak_bytes <= eager.memory.peak_bytes
    assert chunked.bytes > eager.bytes or chunked.memory.peak_bytes > eager.memory.peak_bytes


@pytest.fixture
def accelerated(npu_kernels, tmp_path):
    """(accelerator, model): a tiny Llama loaded with use_kernels=True, prepared by accelerate for bf16 (its forward,
    this card's layer, wrapped in autocast), then switched to train(), whose kernelize keeps that wrapper
    (npu-hub-kernels never replaces a forward another library set). accelerate's process-wide state is cleared before
    and after, as TrainingArguments clears it."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    tiny_causal_lm("llama").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="npu", use_kernels=True)
    accelerator = Accelerator(mixed_precision="bf16")
    model = accelerator.prepare(model)
    model.train()
    assert "_original_forward" in vars(model)
    assert qualified_name(compat.instance_forward(model)) == ACCELERATES_WRAPPER
    assert [swap.module for swap in swapped_modules(model, card="npu-linear-cross-entropy")] == [ROOT_MODULE]
    yield accelerator, model
    AcceleratorState._reset_state(reset_partial_state=True)


ACCELERATES_WRAPPER = "accelerate.utils.operations.convert_outputs_to_fp32.<locals>.forward"
"""The forward accelerate's mixed precision sets on a prepared model (native AMP), by its qualified name."""


def _kernelized_again(model):
    """This card's layer bound over accelerate's wrapper as kernels' kernelize binds it on a class npu-hub-kernels did
    not retag (the card loaded through a mapping of one's own): the wrapper is dropped, and the layer is to run the
    call as the wrapper did."""
    _, layer = card_layer_of(model)
    model.forward = MethodType(getattr(card_package(model).layers, layer).forward, model)
    assert "_original_forward" in vars(model) and qualified_name(compat.instance_forward(model)) != ACCELERATES_WRAPPER
    return model


def test_use_kernels_keeps_accelerates_bf16_wrapper_and_the_loss_fuses_inside_it(accelerated):
    """The wrapper kept through train()'s kernelize runs the card's layer under accelerate's own autocast."""
    _assert_runs_under_accelerates_autocast(*accelerated, token_ids(batch=2, seq=8).to("npu"))


def _assert_runs_under_accelerates_autocast(accelerator, model, ids: torch.Tensor) -> None:
    """With a hook on the lm_head (which keeps its own forward: eager's loss), the lm_head computes in bfloat16 and
    the outputs are float32, exactly eager's forward under the accelerator's autocast; without it the loss fuses
    under that autocast."""
    with emulation.count_op_calls() as calls:
        dtypes, outputs = _lm_head_dtype_and_outputs(model, ids)
    assert dtypes == [torch.bfloat16] and calls[OPS[0]] == 0
    assert outputs.loss.dtype == outputs.logits.dtype == torch.float32
    with accelerator.autocast():
        expected = type(model).forward(model, ids, labels=ids)
    assert torch.equal(outputs.loss, expected.loss.float()) and torch.equal(outputs.logits, expected.logits.float())
    with emulation.count_op_calls() as calls:
        fused = model(ids, labels=ids)
    assert calls[OPS[0]] == 1 and fused.logits is None and fused.loss.dtype == torch.float32
    torch.testing.assert_close(fused.loss, outputs.loss, rtol=1e-3, atol=1e-3)


def _lm_head_dtype_and_outputs(model, ids: torch.Tensor):
    """A training step's forward with labels: the dtype the lm_head computed in, and the outputs."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    try:
        outputs = model(ids, labels=ids)
    finally:
        hook.remove()
    return seen, outputs


def test_a_kernelize_dropping_accelerates_bf16_wrapper_runs_as_that_wrapper(accelerated):
    """The layer bound over the wrapper runs the call as the wrapper does; without the wrapper's marker (negative
    control) it runs float32."""
    accelerator, model = accelerated
    model = _kernelized_again(model)
    ids = token_ids(batch=2, seq=8).to("npu")
    assert not torch.is_autocast_enabled("npu")
    _assert_runs_under_accelerates_autocast(accelerator, model, ids)

    del model._original_forward
    dtypes, outputs = _lm_head_dtype_and_outputs(model, ids)
    assert dtypes == [torch.float32] and outputs.loss.dtype == torch.float32


def test_a_dropped_wrapper_whose_autocast_accelerate_cannot_say_raises_what_to_do(accelerated):
    """The wrapper dropped, and accelerate's state cleared afterwards: which autocast it ran is unknown, so the layer
    raises, saying what to do, rather than run the model without it."""
    from accelerate.state import AcceleratorState

    model = _kernelized_again(accelerated[1])
    AcceleratorState._reset_state(reset_partial_state=True)
    ids = token_ids(batch=2, seq=8).to("npu")
    with pytest.raises(RuntimeError, match=r"accelerate's state \(not initialized\).*apply_npu_kernels"):
        model(ids, labels=ids)


# --- eager's answer in every autograd and output form (issue 30) -----------------------------------------------


def test_a_batch_with_no_counted_label_gives_eagers_nan_loss_and_zero_gradients(npu_kernels):
    """A truncated SFT prompt (every label -100): eager's loss is NaN (0 / 0) and every gradient 0; never a NaN
    gradient (one optimizer step would write NaN into every weight)."""
    eager, fused = _pair("llama")
    ids = token_ids()
    labels = torch.full_like(ids, -100)
    losses = []
    for model in (eager, fused):
        loss = model(input_ids=ids.to(model.device), labels=labels.to(model.device)).loss
        loss.backward()
        losses.append(loss.detach().cpu())
    assert torch.isnan(losses[0]) and torch.isnan(losses[1])
    for p in fused.parameters():
        assert p.grad is None or torch.isfinite(p.grad.cpu()).all()
    assert not fused.lm_head.weight.grad.cpu().any()


@pytest.mark.parametrize(("kwargs", "chunk"), [({"num_items_in_batch": 0}, None), ({}, 20)], ids=["items=0", "chunks"])
def test_the_loss_of_no_counted_label_is_eagers_nan_and_zero_gradients(card, kwargs, chunk):
    """The same at the op: num_items_in_batch=0 (log-probability form), or several chunks."""
    lm_head, h, _ = _problem(tokens=96)
    labels = torch.full((1, 96), -100)
    want = _run(card.linear_cross_entropy_eager, lm_head, h, labels, "cpu", **kwargs)
    with emulation.count_op_calls() as calls:
        got = _run(card.linear_cross_entropy, lm_head, h, labels, "npu", chunk_tokens=chunk, **kwargs)
    assert calls[OPS[0]] >= 1 and torch.isnan(got[0]) and torch.isnan(want[0])
    for g, w in zip(got[1:3], want[1:3], strict=True):
        assert torch.equal(g, w) and not g.any()


@pytest.mark.parametrize("chunk", [None, 20], ids=["log-probability form", "chunked form"])
def test_a_second_backward_and_a_double_backward_give_eagers_gradients(card, chunk):
    """retain_graph=True twice adds the same gradients again (the chunked form's saved gradients are not scaled in
    place); create_graph=True differentiates eager's ops (the device's loss backward has no derivative)."""
    lm_head, h, labels = _problem(tokens=96)
    results = []
    for fn, device in ((card.linear_cross_entropy_eager, "cpu"), (card.linear_cross_entropy, "npu")):
        head, leaf = _copy(lm_head, device), h.clone().to(device).requires_grad_()
        kwargs = {} if fn is card.linear_cross_entropy_eager else {"chunk_tokens": chunk}
        loss, _ = fn(leaf, head, labels.to(device), lm_head.out_features, **kwargs)
        loss.backward(retain_graph=True)
        loss.backward(retain_graph=True)
        twice = (leaf.grad.cpu().clone(), head.weight.grad.cpu().clone())
        leaf.grad = head.weight.grad = None
        grad_h, grad_w = torch.autograd.grad(loss, (leaf, head.weight), create_graph=True)
        (grad_h.pow(2).sum() + grad_w.pow(2).sum()).backward()
        results.append((*twice, leaf.grad.cpu(), head.weight.grad.cpu()))
    for got, want, name in zip(*results, ("2 x dh", "2 x dW", "d|g|^2/dh", "d|g|^2/dW"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=name)


def test_labels_on_the_host_are_moved_as_eagers_loss_moves_them(npu_kernels):
    """Labels left on the host: eager's loss moves them to the logits' device; the fused loss moves them to the
    hidden states' and still fuses (the memory saving is kept)."""
    eager, fused = _pair("llama")
    ids = token_ids()
    want = eager(input_ids=ids.to(eager.device), labels=_labels(ids)).loss
    with emulation.count_op_calls() as calls:
        got = fused(input_ids=ids.to("npu"), labels=_labels(ids)).loss
    assert calls[OPS[0]] == 1
    torch.testing.assert_close(got.detach().cpu(), want.detach().cpu(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("held", ["weight", "bias"])
def test_an_lm_head_holding_a_buffer_gives_eagers_loss(npu_kernels, held):
    """An lm_head whose weight, or bias, is a buffer (a frozen head): eager's loss, the bias never dropped."""
    eager, fused = _pair("llama")
    for model in (eager, fused):
        head = model.lm_head
        if held == "weight":
            weight = head.weight.detach().clone()
            del head.weight
            head.register_buffer("weight", weight)
        else:
            del head.bias
            head.register_buffer("bias", torch.linspace(-1, 1, head.out_features, device=head.weight.device))
    ids = token_ids()
    got = fused(input_ids=ids.to("npu"), labels=ids.to("npu")).loss
    torch.testing.assert_close(got.cpu(), eager(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-6)
