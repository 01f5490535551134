"""The layers that `kernels.kernelize` swaps into transformers' `*ForCausalLM` classes (their forward, no state).

Each reproduces one group of identical forwards of transformers 5.22.2 (the base model, the lm_head on the last
hidden states, `self.loss_function` with the labels, a `CausalLMOutputWithPast`-like output; which base model, head,
inputs and vocabulary size: the group's `Wiring`) and computes the lm_head and loss with `linear_cross_entropy`, in
a training step (the module in train() and grad enabled) with labels. Any other call (evaluation, generation, no
labels, another loss function, `logits_to_keep`) runs the class's own forward, exactly eager. The MoE layers whose
classes add the router's auxiliary loss add it to the fused loss as the class's lines do (`AuxLoss`). When the loss is
fused, the output's `logits` is None: the full logits are what the card never makes. Where a later kernelize
replaced accelerate's mixed-precision wrapper of the model's forward (`from_pretrained(..., use_kernels=True)`
kernelizes again at every train()/eval() switch), the layer runs the call as that wrapper does.
"""

from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass

import torch
from torch import nn

from .loss import is_default_causal_lm_loss, linear_cross_entropy


class CausalLM(nn.Module):
    """Llama-style `*ForCausalLM` (CausalLMOutputWithPast): the loss through `linear_cross_entropy`."""

    has_backward = True
    # torch.compile of the fused path is not verified on Ascend hardware yet.
    can_torch_compile = False

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        return _causal_lm_forward(self, locals(), kwargs, "CausalLMOutputWithPast", ())


class MoeCausalLM(nn.Module):
    """MoE `*ForCausalLM` that add no auxiliary loss (MoeCausalLMOutputWithPast with router_logits)."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        return _causal_lm_forward(self, locals(), kwargs, "MoeCausalLMOutputWithPast", ("router_logits",))


_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "past_key_values", "inputs_embeds", "use_cache")


@dataclass(frozen=True)
class Wiring:
    """How a group of forwards reaches its base model, lm_head and vocabulary size (Llama's by default)."""

    base_model: str = "model"  # attribute path of the base model on the *ForCausalLM
    model_inputs: tuple[str, ...] = _MODEL_INPUTS  # the forward's arguments it passes the base model, by name
    kwargs_to_model: bool = True  # whether the forward passes its **kwargs to the base model too (else: loss only)
    lm_head: str = "lm_head"
    vocab_size: str = "config.vocab_size"  # attribute path of the vocabulary size the loss is given


LLAMA = Wiring()

# The groups whose forwards differ from Llama's only in how they reach the base model and the lm_head, and in what
# they take and return: each layer's signature is its group's (the kernels loader requires it).
_OLD_STYLE = ("use_cache", "output_attentions", "output_hidden_states")  # and return_dict, asked for True here
_GPTJ_INPUTS = ("input_ids", "past_key_values", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")
_BLOOM_INPUTS = ("input_ids", "past_key_values", "attention_mask", "inputs_embeds", *_OLD_STYLE)
_NEOX_INPUTS = ("input_ids", "attention_mask", "position_ids", "inputs_embeds", "past_key_values")
GPT_NEOX = Wiring("gpt_neox", (*_NEOX_INPUTS, "use_cache"))
NEMOTRON = Wiring(vocab_size="vocab_size")
BLOOM = Wiring("transformer", _BLOOM_INPUTS, kwargs_to_model=False)
FALCON = Wiring("transformer", (*_BLOOM_INPUTS, "position_ids"), kwargs_to_model=False)
GPTJ = Wiring("transformer", (*_GPTJ_INPUTS, *_OLD_STYLE), kwargs_to_model=False)
GPT_NEO = Wiring("transformer", (*_GPTJ_INPUTS, *_OLD_STYLE))
GPT_BIGCODE = Wiring("transformer", (*_GPTJ_INPUTS, "encoder_hidden_states", "encoder_attention_mask", "use_cache"))
OPT = Wiring("model.decoder")
BIOGPT = Wiring("biogpt", lm_head="output_projection")
GPT_NEOX_JAPANESE = Wiring(
    "gpt_neox_japanese", (*_NEOX_INPUTS, *_OLD_STYLE), kwargs_to_model=False, lm_head="embed_out"
)
_CROSS = "CausalLMOutputWithCrossAttentions"


@dataclass(frozen=True)
class AuxLoss:
    """How a MoE group's forward adds the router's auxiliary loss to its loss: `<coefficient> *
    load_balancing_loss_func(outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)`,
    moved to the loss's device, when `output_router_logits` is on (the argument, else `config.output_router_logits`;
    and the config attribute `router_logits_only_if`, if named), and `aux_loss` in the output. The function is the one
    the class's forward calls, from its own modeling module; with `num_keys`, `floor(sqrt(self.num_experts))` goes
    before the top-k."""

    coefficient: str  # attribute path of the coefficient on the *ForCausalLM
    router_logits_only_if: str | None = None
    num_keys: bool = False


_AUX_INPUTS = (*_MODEL_INPUTS, "output_router_logits")
MIXTRAL = Wiring(model_inputs=_AUX_INPUTS, vocab_size="vocab_size")
JETMOE = Wiring(model_inputs=_AUX_INPUTS)
DBRX = Wiring("transformer", _AUX_INPUTS, vocab_size="vocab_size")
ROUTER_AUX_LOSS = AuxLoss("router_aux_loss_coef")
JETMOE_AUX_LOSS = AuxLoss("aux_loss_coef")
DOGE_AUX_LOSS = AuxLoss("router_aux_loss_coef", router_logits_only_if="is_moe", num_keys=True)


class MoeCausalLMWithAuxLoss(nn.Module):
    """MoE `*ForCausalLM` that add `router_aux_loss_coef` times the router's load-balancing loss (Mixtral, Qwen2-MoE,
    Qwen3-MoE, OLMoE, GPT-OSS, ...): MoeCausalLMOutputWithPast with aux_loss and router_logits."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_router_logits=None,
        logits_to_keep=0,
        **kwargs,
    ):
        return _causal_lm_forward(
            self, locals(), kwargs, "MoeCausalLMOutputWithPast", ("router_logits",), MIXTRAL, aux=ROUTER_AUX_LOSS
        )


class DbrxCausalLM(nn.Module):
    """DBRX's `*ForCausalLM`: MoeCausalLMWithAuxLoss's forward on the base model `self.transformer`."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_router_logits=None,
        logits_to_keep=0,
        **kwargs,
    ):
        return _causal_lm_forward(
            self, locals(), kwargs, "MoeCausalLMOutputWithPast", ("router_logits",), DBRX, aux=ROUTER_AUX_LOSS
        )


class JetMoeCausalLM(nn.Module):
    """JetMoe's `*ForCausalLM`: `aux_loss_coef` times the router's load-balancing loss, the loss over
    `config.vocab_size`, `logits_to_keep` before `output_router_logits`."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        output_router_logits=None,
        **kwargs,
    ):
        return _causal_lm_forward(
            self,
            locals(),
            kwargs,
            "MoeCausalLMOutputWithPast",
            ("router_logits",),
            JETMOE,
            aux=JETMOE_AUX_LOSS,
        )


class DogeCausalLM(nn.Module):
    """Doge's `*ForCausalLM`: router logits only with `config.is_moe`, its load-balancing loss given
    `floor(sqrt(num_experts))` keys, `logits_to_keep` before `output_router_logits`."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        output_router_logits=None,
        **kwargs,
    ):
        return _causal_lm_forward(
            self, locals(), kwargs, "MoeCausalLMOutputWithPast", ("router_logits",), MIXTRAL, aux=DOGE_AUX_LOSS
        )


class GPTNeoXCausalLM(nn.Module):
    """GPT-NeoX (`self.gpt_neox`; its own argument order): the loss through `linear_cross_entropy`."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        inputs_embeds=None,
        past_key_values=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        return _causal_lm_forward(self, locals(), kwargs, "CausalLMOutputWithPast", (), GPT_NEOX)


class NemotronCausalLM(nn.Module):
    """Llama's form, the loss given the model's own `self.vocab_size` (Nemotron, Zamba, Zamba2)."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        return _causal_lm_forward(self, locals(), kwargs, "CausalLMOutputWithPast", (), NEMOTRON)


class BloomCausalLM(nn.Module):
    """`self.transformer` with return_dict, no **kwargs to it (Bloom, MPT): CausalLMOutputWithCrossAttentions."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        input_ids=None,
        past_key_values=None,
        attention_mask=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        logits_to_keep=0,
        **kwargs,
    ):
        return _causal_lm_forward(self, locals(), kwargs, _CROSS, (), BLOOM)


class FalconCausalLM(nn.Module):
    """Bloom's form with position_ids (Falcon)."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        input_ids=None,
        past_key_values=None,
        attention_mask=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        logits_to_keep=0,
        **kwargs,
    ):
        return _causal_lm_forward(self, locals(), kwargs, _CROSS, (), FALCON)


class GPTJCausalLM(nn.Module):
    """`self.transformer` with token_type_ids and return_dict, no **kwargs to it (GPT-J, CodeGen)."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        input_ids=None,
        past_key_values=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        logits_to_keep=0,
        **kwargs,
    ):
        return _causal_lm_forward(self, locals(), kwargs, "CausalLMOutputWithPast", (), GPTJ)


class GPTNeoCausalLM(nn.Module):
    """GPT-J's form that also passes its **kwargs to `self.transformer` (GPT-Neo)."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        input_ids=None,
        past_key_values=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        logits_to_keep=0,
        **kwargs,
    ):
        return _causal_lm_forward(self, locals(), kwargs, "CausalLMOutputWithPast", (), GPT_NEO)


class GPTBigCodeCausalLM(nn.Module):
    """`self.transformer` with encoder states (GPTBigCode): CausalLMOutputWithCrossAttentions, cross_attentions."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        input_ids=None,
        past_key_values=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        return _causal_lm_forward(self, locals(), kwargs, _CROSS, ("cross_attentions",), GPT_BIGCODE)


class OPTCausalLM(nn.Module):
    """`self.model.decoder` (OPT): the loss through `linear_cross_entropy`."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        position_ids=None,
        logits_to_keep=0,
        **kwargs,
    ):
        return _causal_lm_forward(self, locals(), kwargs, "CausalLMOutputWithPast", (), OPT)


class BioGptCausalLM(nn.Module):
    """`self.biogpt` and its `output_projection` head (BioGPT): CausalLMOutputWithCrossAttentions."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        inputs_embeds=None,
        past_key_values=None,
        labels=None,
        use_cache=None,
        position_ids=None,
        logits_to_keep=0,
        **kwargs,
    ):
        return _causal_lm_forward(self, locals(), kwargs, _CROSS, ("cross_attentions",), BIOGPT)


class GPTNeoXJapaneseCausalLM(nn.Module):
    """`self.gpt_neox_japanese` with return_dict and its `embed_out` head (GPT-NeoX-Japanese)."""

    has_backward = True
    can_torch_compile = False

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        inputs_embeds=None,
        past_key_values=None,
        labels=None,
        use_cache=None,
        output_attentions=None,
        output_hidden_states=None,
        return_dict=None,
        logits_to_keep=0,
        **kwargs,
    ):
        return _causal_lm_forward(self, locals(), kwargs, "CausalLMOutputWithPast", (), GPT_NEOX_JAPANESE)


def _output_router_logits(module: nn.Module, aux: AuxLoss, argument: bool | None) -> bool:
    """The `output_router_logits` the class's forward passes its base model."""
    requested = argument if argument is not None else module.config.output_router_logits
    if aux.router_logits_only_if is not None:
        requested = requested and getattr(module.config, aux.router_logits_only_if)
    return requested


def _with_aux_loss(module: nn.Module, loss: torch.Tensor, aux: AuxLoss, router_logits, attention_mask):
    """(loss + coefficient x the class's load-balancing loss, that auxiliary loss), as the class's lines add it."""
    # the name the class's forward resolves in its own module's globals (under the decorators that wrap it)
    load_balancing_loss = inspect.unwrap(type(module).forward).__globals__["load_balancing_loss_func"]
    experts = (module.num_experts,)
    if aux.num_keys:
        experts += (math.floor(math.sqrt(module.num_experts)),)
    aux_loss = load_balancing_loss(router_logits, *experts, module.num_experts_per_tok, attention_mask)
    loss += operator.attrgetter(aux.coefficient)(module) * aux_loss.to(loss.device)
    return loss, aux_loss


def _causal_lm_forward(
    module: nn.Module,
    arguments: dict,
    kwargs: dict,
    output_class: str,
    extra: tuple[str, ...],
    wiring: Wiring = LLAMA,
    aux: AuxLoss | None = None,
):
    """The class's forward with its lm_head + loss lines fused, inside accelerate's mixed-precision wrapper where a
    later kernelize replaced that wrapper; its own forward where the loss cannot be fused. `arguments`: the layer
    forward's `locals()`, taken before any other name is bound (its parameters, passed on as they are)."""
    args = (module, arguments, kwargs, output_class, extra, wiring, aux)
    if _accelerates_autocast_wrapper_dropped(module):
        return _as_accelerates_autocast_wrapper(_fused_where_possible, *args)
    return _fused_where_possible(*args)


def _fused_where_possible(
    module: nn.Module,
    arguments: dict,
    kwargs: dict,
    output_class: str,
    extra: tuple[str, ...],
    wiring: Wiring = LLAMA,
    aux: AuxLoss | None = None,
):
    """The class's forward with its lm_head + loss lines fused (the router's auxiliary loss added where `aux` says
    the class adds one); its own forward where the loss cannot be."""
    labels, logits_to_keep = arguments["labels"], arguments["logits_to_keep"]
    named = {name: value for name, value in arguments.items() if name not in ("self", "kwargs")}
    # a training step only: evaluation (eval() or no grad) and generation keep the class's forward and its logits
    training_step = module.training and torch.is_grad_enabled()
    plain_call = labels is None or not training_step or not (isinstance(logits_to_keep, int) and logits_to_keep == 0)
    if plain_call or not is_default_causal_lm_loss(module.loss_function):
        return type(module).forward(module, **named, **kwargs)
    # a forward with a return_dict argument passes it to its base model: asked for True here, to read its fields
    own_return_dict = "return_dict" in arguments
    return_dict = arguments["return_dict"] if own_return_dict else kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(module.config, "return_dict", True)
    model_inputs = {name: arguments[name] for name in wiring.model_inputs}
    if own_return_dict:
        model_inputs["return_dict"] = True
    if aux is not None:
        model_inputs["output_router_logits"] = _output_router_logits(module, aux, arguments["output_router_logits"])
    base_model = operator.attrgetter(wiring.base_model)(module)
    outputs = base_model(**model_inputs, **(kwargs if wiring.kwargs_to_model else {}))
    loss, logits = linear_cross_entropy(
        outputs.last_hidden_state, operator.attrgetter(wiring.lm_head)(module), labels,
        operator.attrgetter(wiring.vocab_size)(module), loss_function=module.loss_function, **kwargs,
    )  # fmt: skip
    fields = {name: getattr(outputs, name) for name in extra}
    if aux is not None and model_inputs["output_router_logits"]:
        loss, fields["aux_loss"] = _with_aux_loss(module, loss, aux, outputs.router_logits, arguments["attention_mask"])
    # transformers is there whenever one of its models runs; the card imports it only then
    from transformers import modeling_outputs

    output = getattr(modeling_outputs, output_class)(
        loss=loss,
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        **fields,
    )
    return output if return_dict else _as_tuple(output)


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


def _accelerates_autocast_wrapper_dropped(module: nn.Module) -> bool:
    """True when accelerate wrapped the model's forward in autocast (it keeps the forward it wrapped as
    `_original_forward`) and that wrapper is no longer around this call: this layer was swapped in after it."""
    if "_original_forward" not in vars(module):
        return False
    return not torch.is_autocast_enabled(next(module.parameters()).device.type)


def _as_accelerates_autocast_wrapper(forward, *args):
    """`forward(*args)` as accelerate's mixed-precision wrapper runs the model's forward (native AMP): inside
    accelerate's own autocast context, outputs converted to float32 by accelerate's own converter.

    The `AutocastKwargs` handler the Accelerator was given is not kept on the model: the context is built without one,
    as accelerate builds it when none is given (transformers' Trainer gives none). Raises `DROPPED_AUTOCAST` where
    accelerate's state does not say the wrapper's autocast: not initialized, or mixed precision other than bf16/fp16
    (fp8 backends wrap the forward in more than autocast)."""
    # accelerate is installed whenever it wrapped the model; the card imports it only then
    from accelerate.state import AcceleratorState, is_initialized
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    mixed_precision = AcceleratorState().mixed_precision if is_initialized() else None
    if mixed_precision not in ("bf16", "fp16"):
        state = f"mixed_precision={mixed_precision!r}" if is_initialized() else "not initialized"
        raise RuntimeError(DROPPED_AUTOCAST.format(state=state))
    autocast = get_mixed_precision_context_manager(native_amp=True, autocast_kwargs=None)
    return convert_outputs_to_fp32(autocast(forward))(*args)
