"""The layers that `kernels.kernelize` swaps into transformers' `*ForCausalLM` classes (their forward, no state).

Each reproduces one group of identical forwards (`mapping/npu_hub_kernels/models/npu_linear_cross_entropy.py` lists
them); its row of `LAYERS` says how its group differs from the others, and `_fused_or_own` runs every row's forward
(the card README's "How it works").
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from inspect import Parameter, Signature

import torch
from torch import nn

from ._fallbacks import ran_eager
from ._internals import accelerate_wrapped_forward, modeling_global
from .loss import call_unavailable_reason, loss_in_lm_head_call


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
    output: str = "CausalLMOutputWithPast"  # the output class, in transformers.modeling_outputs
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


# fmt: off
LAYERS: dict[str, Layer] = {
    "CausalLM": Layer(
        parameters=("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "labels",
                    "use_cache", "logits_to_keep"),
    ),
    "MoeCausalLM": Layer(
        parameters=("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "labels",
                    "use_cache", "logits_to_keep"),
        output="MoeCausalLMOutputWithPast",
        extra=("router_logits",),
    ),
    "MoeCausalLMWithAuxLoss": Layer(
        parameters=("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "labels",
                    "use_cache", "output_router_logits", "logits_to_keep"),
        output="MoeCausalLMOutputWithPast",
        extra=("router_logits",),
        vocab_size="vocab_size",
        aux=AuxLoss(coefficient="router_aux_loss_coef"),
    ),
    "DbrxCausalLM": Layer(
        parameters=("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "labels",
                    "use_cache", "output_router_logits", "logits_to_keep"),
        output="MoeCausalLMOutputWithPast",
        extra=("router_logits",),
        base_model="transformer",
        vocab_size="vocab_size",
        aux=AuxLoss(coefficient="router_aux_loss_coef"),
    ),
    "JetMoeCausalLM": Layer(
        parameters=("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "labels",
                    "use_cache", "logits_to_keep", "output_router_logits"),
        output="MoeCausalLMOutputWithPast",
        extra=("router_logits",),
        aux=AuxLoss(coefficient="aux_loss_coef"),
    ),
    "DogeCausalLM": Layer(
        parameters=("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "labels",
                    "use_cache", "logits_to_keep", "output_router_logits"),
        output="MoeCausalLMOutputWithPast",
        extra=("router_logits",),
        vocab_size="vocab_size",
        aux=AuxLoss(coefficient="router_aux_loss_coef", only_if="is_moe", num_keys=True),
    ),
    "GPTNeoXCausalLM": Layer(
        parameters=("input_ids", "attention_mask", "position_ids", "inputs_embeds", "past_key_values", "labels",
                    "use_cache", "logits_to_keep"),
        base_model="gpt_neox",
    ),
    "NemotronCausalLM": Layer(
        parameters=("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "labels",
                    "use_cache", "logits_to_keep"),
        vocab_size="vocab_size",
    ),
    "BloomCausalLM": Layer(
        parameters=("input_ids", "past_key_values", "attention_mask", "inputs_embeds", "labels", "use_cache",
                    "output_attentions", "output_hidden_states", "return_dict", "logits_to_keep"),
        output="CausalLMOutputWithCrossAttentions",
        base_model="transformer",
        kwargs_to_model=False,
    ),
    "FalconCausalLM": Layer(
        parameters=("input_ids", "past_key_values", "attention_mask", "position_ids", "inputs_embeds", "labels",
                    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "logits_to_keep"),
        output="CausalLMOutputWithCrossAttentions",
        base_model="transformer",
        kwargs_to_model=False,
    ),
    "GPTJCausalLM": Layer(
        parameters=("input_ids", "past_key_values", "attention_mask", "token_type_ids", "position_ids",
                    "inputs_embeds", "labels", "use_cache", "output_attentions", "output_hidden_states",
                    "return_dict", "logits_to_keep"),
        base_model="transformer",
        kwargs_to_model=False,
    ),
    "GPTNeoCausalLM": Layer(
        parameters=("input_ids", "past_key_values", "attention_mask", "token_type_ids", "position_ids",
                    "inputs_embeds", "labels", "use_cache", "output_attentions", "output_hidden_states",
                    "return_dict", "logits_to_keep"),
        base_model="transformer",
    ),
    "GPTBigCodeCausalLM": Layer(
        parameters=("input_ids", "past_key_values", "attention_mask", "token_type_ids", "position_ids",
                    "inputs_embeds", "encoder_hidden_states", "encoder_attention_mask", "labels", "use_cache",
                    "logits_to_keep"),
        output="CausalLMOutputWithCrossAttentions",
        extra=("cross_attentions",),
        base_model="transformer",
    ),
    "OPTCausalLM": Layer(
        parameters=("input_ids", "attention_mask", "past_key_values", "inputs_embeds", "labels", "use_cache",
                    "position_ids", "logits_to_keep"),
        base_model="model.decoder",
    ),
    "BioGptCausalLM": Layer(
        parameters=("input_ids", "attention_mask", "inputs_embeds", "past_key_values", "labels", "use_cache",
                    "position_ids", "logits_to_keep"),
        output="CausalLMOutputWithCrossAttentions",
        extra=("cross_attentions",),
        base_model="biogpt",
        lm_head="output_projection",
    ),
    "GPTNeoXJapaneseCausalLM": Layer(
        parameters=("input_ids", "attention_mask", "position_ids", "inputs_embeds", "past_key_values", "labels",
                    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "logits_to_keep"),
        base_model="gpt_neox_japanese",
        kwargs_to_model=False,
        lm_head="embed_out",
    ),
}
"""Layer -> its row: what its forward takes, what it returns and how it reaches the base model and the lm_head."""
# fmt: on


def _forward(name: str) -> Callable[..., object]:
    """The forward of the layer `name`: it takes its row's parameters, then **kwargs, and runs `_fused_or_own`.

    Its `__signature__` is the row's (kernels' loader compares it with the class's). The arguments are bound by hand,
    as `Signature.bind` binds them (which takes 7 us, paid at every generation step), raising Python's errors."""
    row = LAYERS[name]
    keyword = Parameter.POSITIONAL_OR_KEYWORD
    parameters = [Parameter(p, keyword, default=0 if p == "logits_to_keep" else None) for p in row.parameters]
    signature = Signature([Parameter("self", keyword), *parameters, Parameter("kwargs", Parameter.VAR_KEYWORD)])
    names, defaults = row.parameters, {p.name: p.default for p in parameters}

    def forward(self, *args, **kwargs):
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
    return forward


# The layers, one per row of LAYERS. torch.compile of the fused path is not verified on Ascend hardware yet.


class CausalLM(nn.Module):
    """The Llama-style forward: Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3, OLMo-2, ..."""

    forward = _forward("CausalLM")
    has_backward = True
    can_torch_compile = False


class MoeCausalLM(nn.Module):
    """The forward of MoE classes that add no auxiliary loss: DeepSeek-V3, GLM-4-MoE, Llama 4, ..."""

    forward = _forward("MoeCausalLM")
    has_backward = True
    can_torch_compile = False


class MoeCausalLMWithAuxLoss(nn.Module):
    """The forward of MoE classes that add the router's auxiliary loss: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ..."""

    forward = _forward("MoeCausalLMWithAuxLoss")
    has_backward = True
    can_torch_compile = False


class DbrxCausalLM(nn.Module):
    """DBRX's forward: MoeCausalLMWithAuxLoss's on its base model `transformer`."""

    forward = _forward("DbrxCausalLM")
    has_backward = True
    can_torch_compile = False


class JetMoeCausalLM(nn.Module):
    """JetMoe's forward: MoeCausalLMWithAuxLoss's with its coefficient `aux_loss_coef`."""

    forward = _forward("JetMoeCausalLM")
    has_backward = True
    can_torch_compile = False


class DogeCausalLM(nn.Module):
    """Doge's forward: router logits only with `config.is_moe`, `floor(sqrt(num_experts))` keys in its aux loss."""

    forward = _forward("DogeCausalLM")
    has_backward = True
    can_torch_compile = False


class GPTNeoXCausalLM(nn.Module):
    """GPT-NeoX's (Pythia) forward."""

    forward = _forward("GPTNeoXCausalLM")
    has_backward = True
    can_torch_compile = False


class NemotronCausalLM(nn.Module):
    """The forward of Nemotron, Zamba and Zamba2: the loss given the model's own `vocab_size`."""

    forward = _forward("NemotronCausalLM")
    has_backward = True
    can_torch_compile = False


class BloomCausalLM(nn.Module):
    """The forward of Bloom and MPT."""

    forward = _forward("BloomCausalLM")
    has_backward = True
    can_torch_compile = False


class FalconCausalLM(nn.Module):
    """Falcon's forward."""

    forward = _forward("FalconCausalLM")
    has_backward = True
    can_torch_compile = False


class GPTJCausalLM(nn.Module):
    """The forward of GPT-J and CodeGen."""

    forward = _forward("GPTJCausalLM")
    has_backward = True
    can_torch_compile = False


class GPTNeoCausalLM(nn.Module):
    """GPT-Neo's forward: GPT-J's, its **kwargs passed to the base model too."""

    forward = _forward("GPTNeoCausalLM")
    has_backward = True
    can_torch_compile = False


class GPTBigCodeCausalLM(nn.Module):
    """GPTBigCode's (StarCoder, SantaCoder) forward."""

    forward = _forward("GPTBigCodeCausalLM")
    has_backward = True
    can_torch_compile = False


class OPTCausalLM(nn.Module):
    """OPT's forward."""

    forward = _forward("OPTCausalLM")
    has_backward = True
    can_torch_compile = False


class BioGptCausalLM(nn.Module):
    """BioGPT's forward (its `output_projection` head)."""

    forward = _forward("BioGptCausalLM")
    has_backward = True
    can_torch_compile = False


class GPTNeoXJapaneseCausalLM(nn.Module):
    """GPT-NeoX-Japanese's forward (its `embed_out` head)."""

    forward = _forward("GPTNeoXJapaneseCausalLM")
    has_backward = True
    can_torch_compile = False


def _fused_or_own(module: nn.Module, row: Layer, arguments: dict):
    """Return the class's forward with its lm_head + loss lines fused, or its own forward.

    Fused where `call_unavailable_reason` passes (then `loss_in_lm_head_call` asks `tensors_unavailable_reason` inside
    lm_head's call), the router's auxiliary loss added as `row.aux` says; else the class's own forward, eager's."""
    kwargs = arguments.pop("kwargs")
    labels, lm_head, loss_function = arguments["labels"], operator.attrgetter(row.lm_head)(module), module.loss_function
    training_step = module.training and torch.is_grad_enabled()
    logits_to_keep = arguments["logits_to_keep"]
    reason = call_unavailable_reason(
        lm_head, labels, loss_function=loss_function, logits_to_keep=logits_to_keep, training_step=training_step
    )
    if ran_eager(module, reason):
        return type(module).forward(module, **arguments, **kwargs)
    return_dict = arguments["return_dict"] if "return_dict" in arguments else kwargs.pop("return_dict", None)
    model_inputs = {name: arguments[name] for name in row.model_inputs}
    if "return_dict" in arguments:  # a forward with a return_dict argument passes it on: True, to read the fields
        model_inputs["return_dict"] = True
    aux, config = row.aux, module.config
    if aux is not None:  # the argument, else the config's; and the config's `only_if`
        asked = arguments["output_router_logits"]
        asked = config.output_router_logits if asked is None else asked
        model_inputs["output_router_logits"] = asked and (aux.only_if is None or getattr(config, aux.only_if))
    outputs = operator.attrgetter(row.base_model)(module)(**model_inputs, **(kwargs if row.kwargs_to_model else {}))
    vocab_size = operator.attrgetter(row.vocab_size)(module)
    loss, logits = loss_in_lm_head_call(
        outputs.last_hidden_state, lm_head, labels, vocab_size, loss_function, None, kwargs, module
    )
    fields = {name: getattr(outputs, name) for name in row.extra}
    if aux is not None and model_inputs["output_router_logits"]:  # the class's lines: its modeling module's function
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
