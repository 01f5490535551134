"""The layers that `kernels.kernelize` swaps into transformers' `*ForCausalLM` classes (their forward, no state).

`LAYERS` is the card README's table of layers, one row per layer: each reproduces one group of identical forwards of
transformers 5.22.2 (the base model, the lm_head on the last hidden states, `self.loss_function` with the labels, an
output of the base model's fields), and a row says what differs between groups: the forward's parameters, the output
class and the base model's extra fields it returns, the wiring (which base model, with or without the **kwargs, which
head, which vocabulary size) and the router's auxiliary loss the MoE classes add. Each layer's forward has its row's
signature (the kernels loader compares it with the forward it replaces; built as kernels builds the forward of a
function-module) and runs `_forward` with its row.

`_forward` runs the lm_head and loss with the fused loss when `linear_cross_entropy_unavailable_reason` says it can
(a training step with labels: the call's part before the base model runs, the tensors' part inside lm_head's call),
and the class's own forward otherwise (evaluation, generation, no labels, another loss function, `logits_to_keep`, a
hooked or wrapped lm_head), exactly eager; either way the reason is recorded (`_fallbacks`). When the loss is fused,
the output's `logits` is None: the full logits are what the card never makes. Where a later kernelize replaced
accelerate's mixed-precision wrapper of the model's forward (`from_pretrained(..., use_kernels=True)` kernelizes again
at every train()/eval() switch), the layer runs the call as that wrapper does.
"""

from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass

import torch
from torch import nn

from ._fallbacks import ran_eager
from ._internals import accelerate_wrapped_forward, modeling_global
from .loss import _call_unavailable_reason, loss_in_lm_head_call


@dataclass(frozen=True)
class AuxLoss:
    """How a MoE group adds the router's auxiliary loss: `<coefficient> * load_balancing_loss_func(router_logits,
    self.num_experts, self.num_experts_per_tok, attention_mask)` (the function of the class's own modeling module;
    with `num_keys`, `floor(sqrt(self.num_experts))` before the top-k), moved to the loss's device, when
    `output_router_logits` is on (the argument, else the config's; and the config attribute `only_if`, if named)."""

    coefficient: str  # attribute path of the coefficient on the *ForCausalLM
    only_if: str | None = None
    num_keys: bool = False


@dataclass(frozen=True)
class Layer:
    """One layer: its forward's parameters (then **kwargs; each None by default, logits_to_keep 0), what it returns
    (the output class, the base model's fields it adds), its wiring and the auxiliary loss its classes add."""

    parameters: tuple[str, ...]
    output: str = "CausalLMOutputWithPast"
    extra: tuple[str, ...] = ()
    base_model: str = "model"  # attribute path of the base model
    kwargs_to_model: bool = True  # whether **kwargs go to the base model too (else: to the loss only)
    lm_head: str = "lm_head"
    vocab_size: str = "config.vocab_size"  # attribute path of the vocabulary size the loss is given
    aux: AuxLoss | None = None

    @property
    def model_inputs(self) -> tuple[str, ...]:
        """The parameters the forward passes its base model by name (return_dict: asked for True, to read fields)."""
        return tuple(name for name in self.parameters if name not in ("labels", "logits_to_keep", "return_dict"))


_LLAMA = ("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "labels", "use_cache")
_NEOX = ("input_ids", "attention_mask", "position_ids", "inputs_embeds", "past_key_values", "labels", "use_cache")
_GPTJ = ("input_ids", "past_key_values", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")
_OLD_STYLE = ("output_attentions", "output_hidden_states", "return_dict", "logits_to_keep")
_KEEP, _ROUTER = "logits_to_keep", "output_router_logits"
_MOE, _CROSS, _ROUTER_LOGITS = "MoeCausalLMOutputWithPast", "CausalLMOutputWithCrossAttentions", ("router_logits",)
_ROUTER_AUX_LOSS = AuxLoss("router_aux_loss_coef")

LAYERS: dict[str, Layer] = {
    "CausalLM": Layer((*_LLAMA, _KEEP)),
    "MoeCausalLM": Layer((*_LLAMA, _KEEP), _MOE, _ROUTER_LOGITS),
    "MoeCausalLMWithAuxLoss": Layer((*_LLAMA, _ROUTER, _KEEP), _MOE, _ROUTER_LOGITS, vocab_size="vocab_size",
                                    aux=_ROUTER_AUX_LOSS),
    "DbrxCausalLM": Layer((*_LLAMA, _ROUTER, _KEEP), _MOE, _ROUTER_LOGITS, "transformer", vocab_size="vocab_size",
                          aux=_ROUTER_AUX_LOSS),
    "JetMoeCausalLM": Layer((*_LLAMA, _KEEP, _ROUTER), _MOE, _ROUTER_LOGITS, aux=AuxLoss("aux_loss_coef")),
    "DogeCausalLM": Layer((*_LLAMA, _KEEP, _ROUTER), _MOE, _ROUTER_LOGITS, vocab_size="vocab_size",
                          aux=AuxLoss("router_aux_loss_coef", only_if="is_moe", num_keys=True)),
    "GPTNeoXCausalLM": Layer((*_NEOX, _KEEP), base_model="gpt_neox"),
    "NemotronCausalLM": Layer((*_LLAMA, _KEEP), vocab_size="vocab_size"),
    "BloomCausalLM": Layer(("input_ids", "past_key_values", "attention_mask", "inputs_embeds", "labels", "use_cache",
                            *_OLD_STYLE), _CROSS, (), "transformer", kwargs_to_model=False),
    "FalconCausalLM": Layer(("input_ids", "past_key_values", "attention_mask", "position_ids", "inputs_embeds",
                             "labels", "use_cache", *_OLD_STYLE), _CROSS, (), "transformer", kwargs_to_model=False),
    "GPTJCausalLM": Layer((*_GPTJ, "labels", "use_cache", *_OLD_STYLE), base_model="transformer",
                          kwargs_to_model=False),
    "GPTNeoCausalLM": Layer((*_GPTJ, "labels", "use_cache", *_OLD_STYLE), base_model="transformer"),
    "GPTBigCodeCausalLM": Layer((*_GPTJ, "encoder_hidden_states", "encoder_attention_mask", "labels", "use_cache",
                                 _KEEP), _CROSS, ("cross_attentions",), "transformer"),
    "OPTCausalLM": Layer(("input_ids", "attention_mask", "past_key_values", "inputs_embeds", "labels", "use_cache",
                          "position_ids", _KEEP), base_model="model.decoder"),
    "BioGptCausalLM": Layer(("input_ids", "attention_mask", "inputs_embeds", "past_key_values", "labels",
                             "use_cache", "position_ids", _KEEP), _CROSS, ("cross_attentions",), "biogpt",
                            lm_head="output_projection"),
    "GPTNeoXJapaneseCausalLM": Layer((*_NEOX, *_OLD_STYLE), base_model="gpt_neox_japanese", kwargs_to_model=False,
                                     lm_head="embed_out"),
}  # fmt: skip


def _layer(name: str, row: Layer) -> type[nn.Module]:
    """The layer class of a row: its forward takes the row's parameters and runs `_forward`."""
    keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD
    signature = inspect.Signature(
        [
            inspect.Parameter("self", keyword),
            *(inspect.Parameter(p, keyword, default=0 if p == _KEEP else None) for p in row.parameters),
            inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
        ]
    )

    def forward(self, *args, **kwargs):
        return _forward(self, row, signature.bind(self, *args, **kwargs))

    forward.__signature__, forward.__qualname__ = signature, f"{name}.forward"
    # torch.compile of the fused path is not verified on Ascend hardware yet.
    namespace = {"forward": forward, "has_backward": True, "can_torch_compile": False}
    return type(name, (nn.Module,), {**namespace, "__module__": __name__, "__doc__": f"{name}: see LAYERS."})


globals().update((name, _layer(name, row)) for name, row in LAYERS.items())


def _forward(module: nn.Module, row: Layer, bound: inspect.BoundArguments):
    """The class's forward with its lm_head + loss lines fused, inside accelerate's mixed-precision wrapper where a
    later kernelize replaced that wrapper."""
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    del arguments["self"]
    if accelerate_wrapped_forward(module) and not torch.is_autocast_enabled(next(module.parameters()).device.type):
        return _as_accelerates_autocast_wrapper(_fused_or_own, module, row, arguments)
    return _fused_or_own(module, row, arguments)


def _fused_or_own(module: nn.Module, row: Layer, arguments: dict):
    """The class's forward with its lm_head + loss lines fused (the router's auxiliary loss added as `row.aux` says),
    or, where `linear_cross_entropy_unavailable_reason` says the call cannot be fused, the class's own forward."""
    kwargs = arguments.pop("kwargs")
    labels, lm_head = arguments["labels"], operator.attrgetter(row.lm_head)(module)
    training_step = module.training and torch.is_grad_enabled()
    reason = _call_unavailable_reason(lm_head, labels, module.loss_function, arguments["logits_to_keep"], training_step)
    if ran_eager(module, reason):
        return type(module).forward(module, **arguments, **kwargs)
    return_dict = arguments["return_dict"] if "return_dict" in arguments else kwargs.pop("return_dict", None)
    model_inputs = {name: arguments[name] for name in row.model_inputs}
    if "return_dict" in arguments:  # a forward with a return_dict argument passes it on: True, to read the fields
        model_inputs["return_dict"] = True
    router_logits = row.aux is not None and _output_router_logits(module, row.aux, arguments[_ROUTER])
    if row.aux is not None:
        model_inputs[_ROUTER] = router_logits
    outputs = operator.attrgetter(row.base_model)(module)(**model_inputs, **(kwargs if row.kwargs_to_model else {}))
    vocab_size, loss_function = operator.attrgetter(row.vocab_size)(module), module.loss_function
    loss, logits = loss_in_lm_head_call(
        outputs.last_hidden_state, lm_head, labels, vocab_size, loss_function, None, kwargs, module
    )
    fields = {name: getattr(outputs, name) for name in row.extra}
    if router_logits:
        loss, fields["aux_loss"] = _with_aux_loss(module, loss, row.aux, outputs.router_logits, arguments)
    # transformers is there whenever one of its models runs; the card imports it only then
    from transformers import modeling_outputs

    output = getattr(modeling_outputs, row.output)(
        loss=loss, logits=logits, past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states,
        attentions=outputs.attentions, **fields,
    )  # fmt: skip
    if return_dict is None:
        return_dict = getattr(module.config, "return_dict", True)
    return output if return_dict else _as_tuple(output)


def _output_router_logits(module: nn.Module, aux: AuxLoss, argument: bool | None) -> bool:
    """The `output_router_logits` the class's forward passes its base model."""
    requested = argument if argument is not None else module.config.output_router_logits
    return requested and (aux.only_if is None or getattr(module.config, aux.only_if))


def _with_aux_loss(module: nn.Module, loss: torch.Tensor, aux: AuxLoss, router_logits, arguments: dict):
    """(loss + coefficient x the class's load-balancing loss, that auxiliary loss), as the class's lines add it."""
    experts = (module.num_experts,) + ((math.floor(math.sqrt(module.num_experts)),) if aux.num_keys else ())
    load_balancing_loss = modeling_global(type(module), "load_balancing_loss_func")
    aux_loss = load_balancing_loss(router_logits, *experts, module.num_experts_per_tok, arguments["attention_mask"])
    loss += operator.attrgetter(aux.coefficient)(module) * aux_loss.to(loss.device)
    return loss, aux_loss


def _as_tuple(output) -> tuple:
    """`output.to_tuple()` with the logits' slot kept (None where the fused loss made none): eager's tuple has its
    logits there, so every later field keeps its position (`out[1]` is never the cache)."""
    values = ((name, getattr(output, name)) for name in output.__dataclass_fields__)
    return tuple(value for name, value in values if value is not None or name == "logits")


DROPPED_AUTOCAST = (
    "npu-linear-cross-entropy: accelerate wrapped this model's forward in its mixed-precision autocast, and a later "
    "kernelize replaced that wrapper (from_pretrained(..., use_kernels=True) kernelizes again at every train()/eval() "
    "switch), but accelerate's state ({state}) does not say which autocast the wrapper ran (bf16 or fp16 only), so "
    "the model would run without it. Apply the cards with npu_hub_kernels.apply_npu_kernels(model) or "
    "kernels.kernelize instead of use_kernels=True, call the model inside accelerator.autocast(), or leave "
    "npu_fused_linear_cross_entropy out of the selection."
)


def _as_accelerates_autocast_wrapper(forward, *args):
    """`forward(*args)` as accelerate's mixed-precision wrapper runs the model's forward (native AMP): inside
    accelerate's own autocast context (built without the Accelerator's `AutocastKwargs`, which the model does not
    keep, as accelerate builds it when none is given), outputs converted to float32 by accelerate's own converter.
    Raises `DROPPED_AUTOCAST` where accelerate's state does not say the wrapper's autocast: not initialized, or mixed
    precision other than bf16/fp16 (fp8 backends wrap the forward in more than autocast)."""
    # accelerate is installed whenever it wrapped the model; the card imports it only then
    from accelerate.state import AcceleratorState, is_initialized
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    mixed_precision = AcceleratorState().mixed_precision if is_initialized() else None
    if mixed_precision not in ("bf16", "fp16"):
        state = f"mixed_precision={mixed_precision!r}" if is_initialized() else "not initialized"
        raise RuntimeError(DROPPED_AUTOCAST.format(state=state))
    autocast = get_mixed_precision_context_manager(native_amp=True, autocast_kwargs=None)
    return convert_outputs_to_fp32(autocast(forward))(*args)
