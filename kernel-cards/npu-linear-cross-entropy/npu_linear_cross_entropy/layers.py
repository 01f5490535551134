"""The layers that `kernels.kernelize` swaps into transformers' `*ForCausalLM` classes.

There is one per row of `LAYERS` (their forward, no state): what a row says and how its forward runs, in the card
README's "How it works"."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from inspect import Parameter, Signature

import torch
from torch import nn

from ._fallbacks import ran_eager
from ._internals import accelerate_wrapped_forward, modeling_global
from .loss import _call_unavailable_reason, loss_in_lm_head_call


@dataclass(frozen=True)
class AuxLoss:
    """How a MoE row adds the router's auxiliary loss: `<coefficient> * load_balancing_loss_func(...)`."""

    coefficient: str  # attribute path of the coefficient on the *ForCausalLM
    only_if: str | None = None  # a config attribute that must be true too for output_router_logits
    num_keys: bool = False  # whether floor(sqrt(num_experts)) keys follow num_experts


@dataclass(frozen=True)
class Layer:
    """One layer: its forward's parameters, what it returns, its wiring and the auxiliary loss its classes add."""

    parameters: tuple[str, ...]  # then **kwargs; each None by default, logits_to_keep 0
    output: str = "CausalLMOutputWithPast"
    extra: tuple[str, ...] = ()  # the base model's output fields it returns too
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
    """The layer class of a row: its forward takes the row's parameters and runs `_fused_or_own`."""
    keyword = Parameter.POSITIONAL_OR_KEYWORD
    parameters = [Parameter(p, keyword, default=0 if p == _KEEP else None) for p in row.parameters]
    signature = Signature([Parameter("self", keyword), *parameters, Parameter("kwargs", Parameter.VAR_KEYWORD)])
    names, defaults = row.parameters, {p.name: p.default for p in parameters}

    def forward(self, *args, **kwargs):
        # bound by hand: Signature.bind takes 7 us, paid at every generation step; it raises Python's errors
        if len(args) > len(names) or any(name in kwargs for name in names[: len(args)]):
            signature.bind(self, *args, **kwargs)
        arguments = dict(zip(names, args, strict=False))  # args: at most as many as names
        arguments.update((name, kwargs.pop(name, defaults[name])) for name in names[len(args) :])
        arguments["kwargs"] = kwargs
        # inside accelerate's mixed-precision wrapper where a later kernelize replaced that wrapper
        if accelerate_wrapped_forward(self) and not torch.is_autocast_enabled(next(self.parameters()).device.type):
            return _as_accelerates_autocast_wrapper(_fused_or_own, self, row, arguments)
        return _fused_or_own(self, row, arguments)

    forward.__signature__, forward.__qualname__ = signature, f"{name}.forward"
    # it runs itself inside accelerate's autocast where accelerate wrapped the model's forward: the registry lets
    # kernelize replace that wrapper with it (npu_hub_kernels.retag.ACCELERATE_AUTOCAST_MARK)
    forward._npu_hub_kernels_runs_inside_accelerates_autocast = True
    # torch.compile of the fused path is not verified on Ascend hardware yet.
    namespace = {"forward": forward, "has_backward": True, "can_torch_compile": False}
    return type(name, (nn.Module,), {**namespace, "__module__": __name__, "__doc__": f"{name}: see LAYERS."})


globals().update((name, _layer(name, row)) for name, row in LAYERS.items())


def _fused_or_own(module: nn.Module, row: Layer, arguments: dict):
    """Return the class's forward with its lm_head + loss lines fused, or its own forward.

    It is fused (the router's auxiliary loss added as `row.aux` says), or, where
    `linear_cross_entropy_unavailable_reason` says the call cannot be fused, the class's own forward."""
    kwargs = arguments.pop("kwargs")
    labels, lm_head, loss_function = arguments["labels"], operator.attrgetter(row.lm_head)(module), module.loss_function
    training_step = module.training and torch.is_grad_enabled()
    reason = _call_unavailable_reason(lm_head, labels, loss_function, arguments["logits_to_keep"], training_step)
    if ran_eager(module, reason):
        return type(module).forward(module, **arguments, **kwargs)
    return_dict = arguments["return_dict"] if "return_dict" in arguments else kwargs.pop("return_dict", None)
    model_inputs = {name: arguments[name] for name in row.model_inputs}
    if "return_dict" in arguments:  # a forward with a return_dict argument passes it on: True, to read the fields
        model_inputs["return_dict"] = True
    aux, config = row.aux, module.config
    if aux is not None:  # the argument, else the config's; and the config's `only_if`
        asked = arguments[_ROUTER] if arguments[_ROUTER] is not None else config.output_router_logits
        model_inputs[_ROUTER] = asked and (aux.only_if is None or getattr(config, aux.only_if))
    outputs = operator.attrgetter(row.base_model)(module)(**model_inputs, **(kwargs if row.kwargs_to_model else {}))
    vocab_size = operator.attrgetter(row.vocab_size)(module)
    loss, logits = loss_in_lm_head_call(
        outputs.last_hidden_state, lm_head, labels, vocab_size, loss_function, None, kwargs, module
    )
    fields = {name: getattr(outputs, name) for name in row.extra}
    if aux is not None and model_inputs[_ROUTER]:  # the class's lines: its modeling module's function
        experts = (module.num_experts,) + ((math.floor(math.sqrt(module.num_experts)),) if aux.num_keys else ())
        balance = modeling_global(type(module), "load_balancing_loss_func")
        aux_loss = balance(outputs.router_logits, *experts, module.num_experts_per_tok, arguments["attention_mask"])
        loss += operator.attrgetter(aux.coefficient)(module) * aux_loss.to(loss.device)
        fields["aux_loss"] = aux_loss
    # transformers is there whenever one of its models runs; the card imports it only then
    from transformers import modeling_outputs

    output = getattr(modeling_outputs, row.output)(
        loss=loss, logits=logits, past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states,
        attentions=outputs.attentions, **fields,
    )  # fmt: skip
    if return_dict or (return_dict is None and getattr(config, "return_dict", True)):
        return output
    # `output.to_tuple()` with the logits' slot kept (None where the fused loss made none): eager's tuple has its
    # logits there, so every later field keeps its position (`out[1]` is never the cache)
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
    """Run `forward(*args)` as accelerate's mixed-precision wrapper runs the model's forward.

    It runs it (native AMP; README "How it works"), or `DROPPED_AUTOCAST` raised where accelerate's state does not say
    the wrapper's autocast."""
    # accelerate is installed whenever it wrapped the model; the card imports it only then
    from accelerate.state import AcceleratorState, is_initialized
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    mixed_precision = AcceleratorState().mixed_precision if is_initialized() else None
    if mixed_precision not in ("bf16", "fp16"):
        state = f"mixed_precision={mixed_precision!r}" if is_initialized() else "not initialized"
        raise RuntimeError(DROPPED_AUTOCAST.format(state=state))
    autocast = get_mixed_precision_context_manager(native_amp=True, autocast_kwargs=None)
    return convert_outputs_to_fp32(autocast(forward))(*args)
