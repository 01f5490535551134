"""transformers' causal-LM loss (`lm_head`, then `ForCausalLMLoss`) chunked over the tokens.

It runs without the full logits (its two forms, ignored rows, autocast, the engines' hooks and why: the card README's
"How it works")."""

from __future__ import annotations

import functools
import math
import sys
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ._double_backward import with_eager_double_backward
from ._fallbacks import class_name, ran_eager
from ._float32_out import add_float32_product, float32_out_unavailable_reason, float32_product
from ._internals import (
    accelerate_hook,
    engine_hook,
    fsdp2_original_class,
    fsdp2_output_dtype,
    global_module_hooks,
    instance_forward,
    module_hooks,
    parameter,
    zero3_partitioned,
)
from ._npu import FUSED_DTYPES, npu_unavailable_reason, torch_npu
from ._tracing import graph_tracer

MAX_ROWS = 200_000  # npu_cross_entropy_loss takes at most 200,000 rows (its 约束说明: N in (0, 200000])
CHUNKED_FORM_TOKENS_PER_HIDDEN = 2  # the chunked form's threshold, tokens per unit of hidden size (README)
CHUNK_TOKENS_PER_HIDDEN = 1.15  # the chunked form's largest chunk, tokens per unit of hidden size (README)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def default_chunk_tokens(tokens: int, hidden_size: int) -> int:
    """Tokens per chunk: the fewest equal chunks of at most CHUNK_TOKENS_PER_HIDDEN x hidden_size and MAX_ROWS."""
    largest = min(MAX_ROWS, max(1, int(CHUNK_TOKENS_PER_HIDDEN * hidden_size)))
    return max(1, math.ceil(tokens / math.ceil(tokens / largest)))


def chunked_form_pays(tokens: int, hidden_size: int, needs_grad: bool) -> bool:
    """Return whether the chunked form moves and holds less than the log-probability form (README: why)."""
    return needs_grad and tokens >= CHUNKED_FORM_TOKENS_PER_HIDDEN * hidden_size


def linear_cross_entropy_unavailable_reason(
    hidden_states: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor | None,
    vocab_size: int,
    *,
    loss_function: object = None,
    logits_to_keep: int | torch.Tensor = 0,
    training_step: bool = True,
) -> str | None:
    """Return why the chunked fused loss will not run for this call, or None when it will.

    The decision's two halves at once, for a caller outside lm_head's call (the selftest, a user asking):
    `call_unavailable_reason`, then `tensors_unavailable_reason`. The layers and `linear_cross_entropy` ask the first
    before the base model or lm_head runs, the second inside lm_head's call: an lm_head whose engine gathers its weight
    in its own call (ZeRO-3, an FSDP2 unit) gets its partitioned weight's reason here, not there. `training_step`:
    train() and grad enabled."""
    reason = call_unavailable_reason(
        lm_head, labels, loss_function=loss_function, logits_to_keep=logits_to_keep, training_step=training_step
    )
    return reason or tensors_unavailable_reason(hidden_states, lm_head, labels, vocab_size)


def call_unavailable_reason(
    lm_head: nn.Module,
    labels: torch.Tensor | None,
    *,
    loss_function: object = None,
    logits_to_keep: int | torch.Tensor = 0,
    training_step: bool = True,
) -> str | None:
    """Return why the loss cannot be lm_head's fused call, whatever its tensors, or None when it can.

    The decision's first half, asked before the base model runs: a graph tracer, the call's arguments, lm_head's class
    and hooks."""
    tracer = graph_tracer()  # first: the checks below read torch's hook dicts, no graph a tracer can take either
    if tracer is not None:
        return (
            f"{tracer} traces the call: the fused loss reads the labels' range on the host and sets lm_head's forward "
            "for its call, which a graph cannot hold; the class's own forward runs, logits included"
        )
    if labels is None:
        return "no labels (inference or generation): the logits are computed and returned as eager computes them"
    if not isinstance(labels, torch.Tensor) or labels.dtype is not torch.int64:
        given = f"in {labels.dtype}" if isinstance(labels, torch.Tensor) else f"a {type(labels).__name__}"
        return f"labels are {given}, not an int64 tensor: transformers' loss takes them (or refuses them) itself"
    if not training_step:
        return "not a training step (the model in eval(), or gradients off): evaluation keeps the class's forward"
    if loss_function is not None and not _is_transformers_causal_lm_loss(loss_function):
        name = getattr(loss_function, "__qualname__", type(loss_function).__name__)
        return f"the model's loss_function is {name}, not transformers' ForCausalLMLoss"
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        return "logits_to_keep is set: the loss of a slice of the positions keeps the eager path"
    if fsdp2_original_class(lm_head) is not nn.Linear:
        return f"lm_head is a {class_name(lm_head)}, not a plain nn.Linear (LoRA, quantised, wrapped)"
    if accelerate_hook(lm_head):
        return "lm_head carries accelerate's hook (_hf_hook: offload, device placement), which replaces its forward"
    forward = instance_forward(lm_head)
    if forward is not None and not isinstance(forward, _StandInForward):
        return "lm_head's forward is replaced on the module: it must run itself"
    if module_hooks(lm_head, ("backward_pre", "backward")):
        return "lm_head has backward hooks: they would see the loss's gradient, not the logits'"
    own = [hook for hook in module_hooks(lm_head, ("forward_pre", "forward")) if not engine_hook(hook)]
    if own:
        names = ", ".join(getattr(hook, "__qualname__", type(hook).__qualname__) for hook in own)
        return f"lm_head has forward hooks of its own ({names}): they would see the loss, not the logits"
    if global_module_hooks():
        return "module hooks are registered for every module (register_module_forward_hook): they would see the loss"
    output_dtype = fsdp2_output_dtype(lm_head)
    if output_dtype is not None:
        return f"lm_head is an FSDP2 unit whose MixedPrecisionPolicy casts its output (the logits) to {output_dtype}"
    return None


def _is_transformers_causal_lm_loss(loss_function: object) -> bool:
    """Whether `loss_function` is transformers' ForCausalLMLoss itself, found without importing transformers.

    Identity, not names: a wrapper made with functools.wraps (a z-loss, label smoothing, logging) copies its
    `__module__` and `__name__`, and must run. A process that never imported transformers' loss module holds no
    ForCausalLMLoss."""
    loss_utils = sys.modules.get("transformers.loss.loss_utils")
    return loss_utils is not None and loss_function is getattr(loss_utils, "ForCausalLMLoss", None)


def tensors_unavailable_reason(
    hidden_states: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, vocab_size: int
) -> str | None:
    """Return why the fused op cannot take these hidden states, labels and lm_head's parameters now, or None.

    The decision's second half, asked inside lm_head's call (where an engine's hooks have gathered its parameters), on
    a call whose first half (`call_unavailable_reason`) passed."""
    weight, bias = parameter(lm_head, "weight"), parameter(lm_head, "bias")
    if weight is None or (bias is None and getattr(lm_head, "bias", None) is not None):
        return "lm_head holds its weight or bias as a buffer, not a parameter: nn.Linear's forward runs on it"
    if zero3_partitioned(weight):
        return "lm_head.weight is a DeepSpeed ZeRO-3 parameter, partitioned here: gathered in lm_head's own call"
    if weight.dim() != 2 or weight.shape[0] != vocab_size:
        return f"lm_head.weight {tuple(weight.shape)} for a vocabulary of {vocab_size}: eager's view decides"
    params = (weight,) if bias is None else (weight, bias)
    reason = npu_unavailable_reason(hidden_states, *params)  # labels anywhere: moved as eager's loss moves them
    if reason is not None:
        return reason
    if torch.is_autocast_enabled(hidden_states.device.type):
        # autocast (float16 or bfloat16 on the npu) casts the lm_head's operands, float64 excepted
        if any(t.dtype not in FUSED_DTYPES for t in (hidden_states, *params)):
            return f"autocast is on with dtypes {hidden_states.dtype} and {weight.dtype}: it casts no float64"
    elif hidden_states.dtype not in FUSED_DTYPES or any(p.dtype != hidden_states.dtype for p in params):
        return f"dtypes {hidden_states.dtype} and {weight.dtype}: one of float16, bfloat16, float32 for both needed"
    if hidden_states.numel() == 0 or labels.numel() != hidden_states[..., 0].numel():
        return f"hidden states {tuple(hidden_states.shape)} and labels {tuple(labels.shape)}: one label per token"
    return None


def linear_cross_entropy(
    hidden_states: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor | None,
    vocab_size: int,
    *,
    loss_function: object = None,
    logits_to_keep: int | torch.Tensor = 0,
    chunk_tokens: int | None = None,
    **loss_kwargs,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Return (loss, logits) of `lm_head` then transformers' causal-LM loss, fused when it can be.

    `call_unavailable_reason` decides first (else `linear_cross_entropy_eager`'s), then, inside lm_head's call,
    `tensors_unavailable_reason` (chunked npu_cross_entropy_loss with logits None, or the loss on the Linear's
    logits). loss_kwargs: what the model's forward passes its loss_function (num_items_in_batch, ignore_index,
    shift_labels, and others it ignores)."""
    reason = call_unavailable_reason(lm_head, labels, loss_function=loss_function, logits_to_keep=logits_to_keep)
    if ran_eager(None, reason):
        return linear_cross_entropy_eager(
            hidden_states, lm_head, labels, vocab_size, loss_function=loss_function, logits_to_keep=logits_to_keep,
            **loss_kwargs,
        )  # fmt: skip
    return loss_in_lm_head_call(hidden_states, lm_head, labels, vocab_size, loss_function, chunk_tokens, loss_kwargs)


def loss_in_lm_head_call(
    hidden_states: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor,
    vocab_size: int,
    loss_function: object,
    chunk_tokens: int | None,
    loss_kwargs: dict,
    module: nn.Module | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Return (loss, logits) of a call whose `call_unavailable_reason` passed; `tensors_unavailable_reason` in the call.

    The fused loss, or the loss of the Linear's logits, recorded for `module` (the layer's; None for a direct call)."""
    fused = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if ran_eager(module, tensors_unavailable_reason(hidden, lm_head, labels, vocab_size)):
            return _LINEAR_FORWARD(lm_head, hidden)
        fused.append(True)
        return _fused_loss(hidden, lm_head, labels, chunk_tokens, loss_kwargs, module)

    output = _StandInForward.call(lm_head, forward, hidden_states)
    if fused:
        return output, None
    return _loss_of_logits(output, labels, vocab_size, loss_function, loss_kwargs), output


def _fused_loss(
    hidden_states: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor,
    chunk_tokens: int | None,
    loss_kwargs: dict,
    module: nn.Module | None = None,
) -> torch.Tensor:
    """The fused loss of lm_head's (whole) parameters, in the form `chunked_form_pays` picks (or chunked, if given).

    `module`: the layer's, for which a weight gradient summed from float32 products says why (`ran_eager`)."""
    ignore_index = loss_kwargs.get("ignore_index", -100)
    shift_labels = loss_kwargs.get("shift_labels")
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden_states.device)
    counted = targets != ignore_index
    divisor = loss_kwargs.get("num_items_in_batch")
    divisor = torch.as_tensor(counted.sum() if divisor is None else divisor).to(hidden_states.device, torch.float32)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    weight, bias = parameter(lm_head, "weight"), parameter(lm_head, "bias")
    if not torch.is_grad_enabled():  # the Function would see requires_grad and make gradients no one asked for
        hidden, weight, bias = (None if t is None else t.detach() for t in (hidden, weight, bias))
    device_type = hidden.device.type
    # autocast's linear casts the operands to its dtype: once per call here, and the chunks' matmuls run in it
    autocast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    targets = torch.where(counted, targets, 0)
    _check_targets(targets, weight.shape[0], ignore_index)
    needs_grad = any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    with torch.autocast(device_type, enabled=False):  # nothing cast again
        if chunk_tokens is None and not chunked_form_pays(hidden.shape[0], hidden.shape[1], needs_grad):
            # the log-probability form: autograd through the casts (which cast the gradients back) and the op,
            # which keeps its log-probabilities
            operands = _cast((hidden, weight, bias), autocast)
            total = None
            for start in range(0, hidden.shape[0], MAX_ROWS):
                part = _chunk(*operands, targets, counted, slice(start, start + MAX_ROWS), (None,) * 3)
                total = part if total is None else total + part
            loss = total / divisor
        else:
            chunk = min(chunk_tokens or default_chunk_tokens(*hidden.shape), MAX_ROWS)
            float32_out = _float32_out_products(autocast or hidden.dtype, hidden, weight, module)
            loss = _ChunkedLinearCrossEntropy.apply(
                hidden, weight, bias, targets, counted, divisor, chunk, float32_out, autocast
            )
    eager = functools.partial(_counted_loss_eager, autocast=autocast)
    return with_eager_double_backward(loss, eager, hidden, weight, bias, targets, counted, divisor)


def _cast(tensors: tuple, dtype: torch.dtype | None) -> tuple:
    """The tensors (None kept) cast to `dtype`, as autocast casts a linear's operands; as they are when None."""
    return tensors if dtype is None else tuple(None if t is None else t.to(dtype) for t in tensors)


def _float32_out_products(
    dtype: torch.dtype, hidden: torch.Tensor, weight: torch.Tensor, module: nn.Module | None
) -> bool:
    """Whether the chunks sum their gradients' 16-bit products in float32 (`half_weight_grad_unavailable_reason`).

    `dtype`: the chunks' (autocast's, else the model's). Said (`ran_eager`) where 16-bit products want them and they
    cannot run."""
    if dtype not in HALF_DTYPES or not (weight.requires_grad or hidden.requires_grad):
        return False  # float32 operands are the model's own (eager's product too), or no gradient
    return not ran_eager(module, half_weight_grad_unavailable_reason())


def half_weight_grad_unavailable_reason() -> str | None:
    """Why the chunks' gradients cannot sum float16/bfloat16 products in float32 here, or None when they can.

    They can with `torch.addmm(sum, a, b, out_dtype=torch.float32, out=sum)` (aclnnAddmm's 16-bit inputs with a
    float32 out: torch_npu 2.11 or later, CANN 9.1 or later; README "How it works"): lm_head's weight gradient, and
    each chunk's dL/dh before its one rounding. Without it the loss still fuses, its weight gradient from float32
    products at about a quarter of the cube's bfloat16 rate, and dL/dh rounded by its 16-bit matmul, then scaled."""
    reason = float32_out_unavailable_reason()
    if reason is None:
        return None
    return (
        "the loss fused; lm_head's weight gradient sums float32 products (a quarter of the bfloat16 cube rate) and "
        f"dL/dh is rounded twice (by its 16-bit matmul, then scaled): {reason}"
    )


def _check_targets(targets: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Raise eager's IndexError, naming the label, when a counted target (ignored ones are 0) is outside [0, vocab).

    npu_cross_entropy_loss would read outside the row. The check costs one reduction and one host sync per call
    (two integers read back): the sync is the price of raising, since the device op raises nothing."""
    low, high = torch.stack(targets.aminmax()).tolist()
    if low < 0 or high >= vocab_size:
        raise IndexError(
            f"Target {low if low < 0 else high} is out of bounds. Labels must lie in [0, {vocab_size}) or equal "
            f"ignore_index ({ignore_index}): check the labels (padding with -1 instead of -100, an id past the "
            "vocabulary)."
        )


def _counted_loss_eager(hidden, weight, bias, targets, counted, divisor, autocast=None) -> torch.Tensor:
    """The counted tokens' loss over `divisor` in eager's ops: what a recorded backward (create_graph) derives.

    `autocast`: the dtype autocast cast the operands to in forward (None: none)."""
    hidden, weight, bias = _cast((hidden, weight, bias), autocast)
    per_token = F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, reduction="none")
    return torch.where(counted, per_token, 0.0).sum() / divisor


def linear_cross_entropy_eager(
    hidden_states: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor | None,
    vocab_size: int,
    *,
    loss_function: object = None,
    logits_to_keep: int | torch.Tensor = 0,
    **loss_kwargs,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Run the transformers forward's lm_head and loss lines.

    They are `logits = lm_head(hidden[:, slice])`, then, with labels, the model's loss_function on them (transformers'
    ForCausalLMLoss when none is given: imported only then)."""
    positions = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    logits = lm_head(hidden_states[:, positions, :])
    if labels is None:
        return None, logits
    return _loss_of_logits(logits, labels, vocab_size, loss_function, loss_kwargs), logits


def _loss_of_logits(logits, labels, vocab_size: int, loss_function: object, loss_kwargs: dict) -> torch.Tensor:
    """The model's loss_function on the logits, as the forward calls it (transformers' ForCausalLMLoss if None)."""
    if loss_function is None:  # a direct call's; transformers is imported only then
        from transformers.loss.loss_utils import ForCausalLMLoss as loss_function
    return loss_function(logits=logits, labels=labels, vocab_size=vocab_size, **loss_kwargs)


_LINEAR_FORWARD = nn.Linear.forward


class _StandInForward:
    """lm_head's forward while the fused loss is computed as lm_head's call (`_StandInForward.call`).

    Set as lm_head's instance attribute `forward` while such calls are under way, then removed, so that every hook
    lm_head carries runs around the loss as around the logits. It runs, in a thread that set one, the forward given for
    its call (once); in every other thread, and in that one afterwards, nn.Linear's forward."""

    _installing = threading.Lock()  # held to set, count and remove the stand-in

    @classmethod
    def call(cls, module: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor], *args: torch.Tensor) -> object:
        """Return `module(*args)` with `forward` in place of its forward (nn.Linear's), for this call only."""
        with cls._installing:
            stand_in = instance_forward(module)
            if stand_in is None:
                stand_in = module.forward = cls(module)
            stand_in.calls += 1
        stand_in.pending.forward = forward
        try:
            return module(*args)
        finally:
            stand_in.pending.forward = None
            with cls._installing:
                stand_in.calls -= 1
                if stand_in.calls == 0:
                    del module.forward

    def __init__(self, module: nn.Module):
        self.module, self.calls, self.pending = module, 0, threading.local()

    def __call__(self, *args, **kwargs):
        forward = getattr(self.pending, "forward", None)
        if forward is None:
            return _LINEAR_FORWARD(self.module, *args, **kwargs)
        self.pending.forward = None
        return forward(*args, **kwargs)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The sum over counted tokens of CE(h W^T + b) over `divisor`; the gradients made in forward, chunk by chunk.

    dL/dW and dL/db are float32 sums of the tokens' softmax - onehot products, scaled in backward (by the incoming
    gradient over `divisor`) and rounded once to the parameters' dtypes. dL/dh is kept in the hidden states' dtype,
    each chunk's product rounded once (`_chunk`): in bfloat16, and in float32 from float32 operands, already over
    `divisor`, so that a backward of 1 (`loss.backward()`) or of a power of two leaves it as it is; in float16
    (`_divides_without_underflow`), and in float32 from 16-bit products (autocast), not over it, scaled by the incoming
    gradient over `divisor` in backward, which leaves float16's as it is where that scale is a power of two and rounds
    float32's once. Another scale rounds it again. `autocast`: the dtype the chunks compute in,
    the operands cast to it once here (autocast's linear casts them per call), their gradients made in their own
    dtypes (float32 weights' dL/dW never rounded to 16 bits)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, counted, divisor, chunk: int, float32_out: bool, autocast):
        needs_grad = ctx.needs_input_grad[:3]
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (hidden, weight, bias))
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if needs_grad[0] else None
        hidden, weight, bias = _cast((hidden, weight, bias), autocast)
        # written whole by the first chunk's product (zeros only when there is no chunk)
        make = torch.empty if hidden.shape[0] else torch.zeros
        grad_weight = make(weight.shape, dtype=torch.float32, device=weight.device) if needs_grad[1] else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if needs_grad[2] else None
        grads = (grad_hidden, grad_weight, grad_bias)
        # a counted token's share of the loss; 0 with no counted token (every gradient 0 then, as eager's)
        any_counted = counted.any()
        share = torch.where(any_counted, 1 / divisor, 0.0)
        # float32 dL/dh from float32 outs is each chunk's product itself, scaled in backward (one pass, not two)
        ctx.hidden_over_divisor = (
            grad_hidden is not None
            and _divides_without_underflow(grad_hidden.dtype)
            and not (float32_out and grad_hidden.dtype == torch.float32)
        )
        hidden_share = share if ctx.hidden_over_divisor else None
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            total += _chunk(hidden, weight, bias, targets, counted, rows, grads, float32_out, hidden_share, start == 0)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias, share, any_counted)
        return total / divisor

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, grad_bias, share, any_counted = ctx.saved_tensors
        # no counted token: every gradient is 0, as eager's, whatever the incoming one (1 / 0 when its loss is 0 / 0)
        scale = torch.where(any_counted, grad_loss.float(), 0.0)
        sum_scale = scale * share
        # new tensors (the saved ones stay for a second backward), rounded to the parameters' dtype: once for the
        # float32 sums, not again for dL/dh when its scale is a power of two
        hidden_scale = scale if ctx.hidden_over_divisor else sum_scale
        hidden_grad = None if grad_hidden is None else grad_hidden * hidden_scale
        sums = [None if grad is None else (grad * sum_scale).to(dtype) for grad, dtype in zip(
            (grad_weight, grad_bias), ctx.dtypes[1:], strict=True)]  # fmt: skip
        return hidden_grad, *sums, None, None, None, None, None, None


def _chunk(
    hidden,
    weight,
    bias,
    targets,
    counted,
    rows: slice,
    grads: tuple,
    float32_out: bool = False,
    share: torch.Tensor | None = None,
    first: bool = False,
) -> torch.Tensor:
    """Return the chunk `rows`' summed loss over its counted rows; add its share into the gradients that are not None.

    dL/dW and dL/db get the chunk's float32 sums; dL/dh its rows, times `share` (a counted token's share of the loss)
    unless it is None (float16's and float32's from float32 outs, scaled in backward; float32's written by the product
    itself). `first`: the first chunk, whose dL/dW product is written into dL/dW (not added to it). `float32_out`: the
    logits' products from the 16-bit h and W, and the gradients' from the 16-bit grad_logits (the model's dtype, as
    eager's) and hidden states or weight, summed in float32 (`half_weight_grad_unavailable_reason`): the logits never
    rounded to 16 bits, dL/dh's rounded once (scaled or not); else eager's logits, the weight gradient's products from
    float32 operands and dL/dh's rounded by their matmul (then scaled: rounded again). (A function, so that every
    [chunk, V] buffer is freed when it returns.)"""
    h, target, mask, (grad_hidden, grad_weight, grad_bias) = hidden[rows], targets[rows], counted[rows], grads
    # eager's logits are rounded to the model dtype, then cast; the float32 out skips that rounding and the cast
    logits = float32_product(h, weight.t(), bias) if float32_out else F.linear(h, weight, bias).float()
    per_token, log_prob, _, _ = torch_npu.npu_cross_entropy_loss(logits, target, reduction="none")
    del logits
    chunk_loss = torch.where(mask, per_token, 0.0).sum()
    if all(grad is None for grad in grads):
        return chunk_loss
    # softmax - onehot of the counted rows, 0 elsewhere, in float32: grad_loss in log_prob's dtype (1/divisor last)
    grad_logits = torch_npu.npu_cross_entropy_loss_backward(mask.to(log_prob.dtype), log_prob, target, reduction="none")
    del log_prob
    # rounded once to the model's dtype, as eager's logits gradient is (no op in float32)
    low = grad_logits.to(weight.dtype) if grad_hidden is not None or float32_out else None
    if grad_weight is not None and float32_out:  # 16-bit operands summed in float32, in place: the cube's rate
        if first:
            float32_product(low.t(), h, out=grad_weight)
        else:
            add_float32_product(grad_weight, low.t(), h)
    elif grad_weight is not None:  # float32 operands, summed in place: no product buffer of W's size
        if first:
            torch.mm(grad_logits.t(), h.float(), out=grad_weight)
        else:
            grad_weight.addmm_(grad_logits.t(), h.float())
    if grad_bias is not None:
        grad_bias += grad_logits.sum(dim=0)
    if grad_hidden is None:
        return chunk_loss
    if float32_out and share is None and grad_hidden.dtype == torch.float32:  # the product is dL/dh's rows
        float32_product(low, weight, out=grad_hidden[rows])
        return chunk_loss
    # float32_out: the same into the chunk's float32 [chunk, H], rounded once (scaled); else in the model dtype,
    # rounded by the matmul (then again scaled; float32: exact)
    product = float32_product(low, weight) if float32_out else low @ weight
    if share is None:
        grad_hidden[rows] = product
    else:
        torch.mul(product, share, out=grad_hidden[rows])
    return chunk_loss


def _divides_without_underflow(dtype: torch.dtype) -> bool:
    """Whether dL/dh in `dtype` can be kept over the counted tokens: float32's exponent range (bfloat16, float32).

    float16's smallest normal is 6.1e-5: a product of about 1e-2 over 2^18 items underflows there before fp16's loss
    scale (2^16, DeepSpeed's and AMP's) brings it back in backward (README "Numerics")."""
    return torch.finfo(dtype).tiny <= torch.finfo(torch.float32).tiny
