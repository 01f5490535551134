"""transformers' causal-LM loss (`lm_head`, then `ForCausalLMLoss`) chunked over the tokens, without the full logits.

Eager holds the logits `[T, V]` in the model dtype, a float32 copy, their log-softmax for backward and, in
backward, two float32 gradients of that size: at 8 x 4096 tokens and a 152k vocabulary, 20 GB each. This module
computes the same loss in one of two forms, chosen per call (`chunked_form_pays`), both never above eager in bytes
moved and in peak memory:
- few tokens (fewer than 2 x the hidden size, or no gradient wanted): **the log-probability form**. Per chunk of at
  most 200,000 tokens (npu_cross_entropy_loss's row limit): `logits = h_c @ W^T (+ b)` in the model dtype, then
  float32 (eager's two roundings, row for row), `npu_cross_entropy_loss(logits, targets, reduction="none")`, the
  counted tokens' losses summed; autograd does the rest (the op's own backward from the float32 log-probabilities
  its node keeps, as eager keeps its log-softmax). Eager's memory, in fewer bytes: one op where eager runs
  log_softmax and nll_loss each way.
- many tokens: **the chunked form**, `_ChunkedLinearCrossEntropy`. The tokens go in chunks of `chunk_tokens`; per
  chunk, in forward, the logits as above, `npu_cross_entropy_loss` (per-token losses and float32 log-probabilities)
  and, when a gradient is needed, `npu_cross_entropy_loss_backward(mask, log_prob, ...)` with the mask in
  log_prob's dtype (float32: the op takes grad_loss in log_prob's dtype), giving `softmax - onehot` of the counted
  rows in float32, which two matmuls turn into this chunk's `dL/dh_c` (kept in the model dtype, as its matmul
  rounds it) and its share of `dL/dW` (summed in float32). Backward then only scales them by the incoming gradient
  (the loss's over `1 / n`, n: the counted tokens or `num_items_in_batch`), each rounded once to its dtype: never
  recomputing the logits nor holding them whole, at the price of keeping dL/dW (float32, [V, H]) and dL/dh from
  forward to backward, which pays only when the tokens are many.
The op ignores no row itself (with a gradient, its 'mean' mode takes no ignore_index and a negative ignore_index
ignores nothing), so ignored rows get target 0 and count nothing: their losses are not summed (`torch.where`, so a
batch with no counted token gives eager's NaN loss and zero gradients, never NaN gradients). A backward that
autograd records (create_graph=True) differentiates eager's ops on the same tensors (`_counted_loss_eager`), the
device's loss backward having no derivative: second-order gradients are eager's. Labels may be on the host: they are
moved to the hidden states' device, as eager's loss moves them to the logits'.
Under autocast (on the npu, in float16 or bfloat16: accelerate's and Trainer's bf16/fp16) the chunks compute in
autocast's dtype as eager's autocast lm_head does: hidden states, weight and bias cast to it once (autocast off
inside, so nothing is cast twice), the gradients cast back to their dtypes by autograd, as the casts' backward.
Whatever the op cannot compute runs `linear_cross_entropy_eager`: the lm_head and transformers' loss, op for op.

The fused loss is computed as lm_head's call (`_call_with_forward`): `lm_head(hidden)` with this computation standing
in for its forward, so every hook lm_head carries runs around it as around the logits. That is how the engines that
own lm_head's parameters work unchanged: DeepSpeed ZeRO-3's pre-forward hook gathers the weight (and hooks the
hidden states to release it after backward), its post-forward hook releases it and hooks the loss to gather it again
before backward, so the Function's dL/dW has the full weight's shape where DeepSpeed reduces and partitions it; an
FSDP2 unit of its own (`fully_shard(model.lm_head)`) unshards, reshards, casts the inputs and reduce-scatters the same
way. The parameters are judged inside that call, where those hooks have made them whole. The alternative,
`deepspeed.zero.register_external_parameter(model, lm_head.weight)`, serves ZeRO-3 only, and holds the weight
gathered through the whole model's forward and backward (the model's hooks gather it); DeepSpeed (0.19.8) does the
same by itself when a forward inside its engine reads a partitioned parameter outside its owner's call
(`ZeROOrderedDict.__getitem__` registers it as an external parameter of the running module and gathers it), so this
module never reads a parameter through the module's attribute outside lm_head's call (`_internals.parameter`).
Hooks that see or change what the Linear computes (the model's own, accelerate's `_hf_hook`, backward hooks, global
module hooks) keep the eager path, with the reason.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F
from torch import nn

from ._double_backward import with_eager_double_backward
from ._fallbacks import ran_eager
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

MAX_ROWS = 200_000
"""npu_cross_entropy_loss takes at most 200,000 rows (its 约束说明: N in (0, 200000]): no chunk is larger."""
CHUNKED_FORM_TOKENS_PER_HIDDEN = 2
"""The chunked form runs from this many tokens per unit of hidden size H: there the float32 dL/dW [V, H] it keeps
(4 V H bytes) is at most half the float32 log-probabilities [T, V] the log-probability form keeps."""
CHUNK_TOKENS_PER_HIDDEN = 1.15
"""The chunked form's chunks: equal, of at most this many tokens per unit of hidden size. Counted per chunk of C
tokens (bfloat16): about 36 bytes per logit where eager moves 51, plus about 12 per element of W (read by two
matmuls, dL/dW read and written); its peak about 8 bytes per logit of one chunk plus dL/dW. So bytes <= eager needs
C of about H or more, and the peak shrinks with C: at 1.15 H (4682 tokens for H = 4096) both issue 26's targets
hold at 8 x 4096 tokens for Llama-3-8B and Qwen3-8B with a few percent to spare
(scripts/bench/cards/npu_linear_cross_entropy.py counts it, with the trade for other chunks)."""
DEFAULT_LOSS = ("transformers.loss.loss_utils", "ForCausalLMLoss")


def default_chunk_tokens(tokens: int, hidden_size: int) -> int:
    """Tokens per chunk of the chunked form: the fewest equal chunks of at most CHUNK_TOKENS_PER_HIDDEN x hidden_size
    tokens and at most MAX_ROWS."""
    largest = min(MAX_ROWS, max(1, int(CHUNK_TOKENS_PER_HIDDEN * hidden_size)))
    return max(1, math.ceil(tokens / math.ceil(tokens / largest)))


def chunked_form_pays(tokens: int, hidden_size: int, needs_grad: bool) -> bool:
    """Whether the chunked form (gradients made in forward) moves fewer bytes and holds less than the
    log-probability form for this call: a gradient wanted and at least CHUNKED_FORM_TOKENS_PER_HIDDEN tokens per
    unit of hidden size (see the module's docstring)."""
    return needs_grad and tokens >= CHUNKED_FORM_TOKENS_PER_HIDDEN * hidden_size


def is_default_causal_lm_loss(loss_function: object) -> bool:
    """Whether a model's `loss_function` is transformers' `ForCausalLMLoss` (recognised without importing it)."""
    return (getattr(loss_function, "__module__", None), getattr(loss_function, "__name__", None)) == DEFAULT_LOSS


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
    """Why the chunked fused loss will not run for this call, or None when it will: the one decision of the card.

    `training_step`: whether the model runs a training step (train() and grad enabled; the layers pass it: evaluation
    and generation keep the class's forward and its logits). The layers judge the call's part
    (`_call_unavailable_reason`) before the base model runs, and the tensors' part inside lm_head's call, where an
    engine's hooks (DeepSpeed ZeRO-3, an FSDP2 unit of its own) have gathered the weight: called outside that call,
    such an lm_head gets the reason its partitioned or sharded weight gives."""
    return _call_unavailable_reason(
        lm_head, labels, loss_function, logits_to_keep, training_step
    ) or _tensors_unavailable_reason(hidden_states, lm_head, labels, vocab_size)


def _call_unavailable_reason(
    lm_head: nn.Module,
    labels: torch.Tensor | None,
    loss_function: object,
    logits_to_keep: int | torch.Tensor,
    training_step: bool = True,
) -> str | None:
    """Why the loss cannot be lm_head's call, whatever its tensors: the call's arguments, lm_head's class and hooks."""
    if labels is None:
        return "no labels (inference or generation): the logits are computed and returned as eager computes them"
    if not training_step:
        return "not a training step (the model in eval(), or gradients off): evaluation keeps the class's forward"
    if loss_function is not None and not is_default_causal_lm_loss(loss_function):
        name = getattr(loss_function, "__qualname__", type(loss_function).__name__)
        return f"the model's loss_function is {name}, not transformers' ForCausalLMLoss"
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        return "logits_to_keep is set: the loss of a slice of the positions keeps the eager path"
    if fsdp2_original_class(lm_head) is not nn.Linear:
        return f"lm_head is a {type(lm_head).__qualname__}, not a plain nn.Linear (LoRA, quantised, wrapped)"
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


def _tensors_unavailable_reason(
    hidden_states: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, vocab_size: int
) -> str | None:
    """Why the fused op cannot take these hidden states, labels and lm_head's parameters as they are now."""
    weight, bias = parameter(lm_head, "weight"), parameter(lm_head, "bias")
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
    """(loss, logits) of `lm_head` then transformers' causal-LM loss: chunked npu_cross_entropy_loss with logits None,
    or `linear_cross_entropy_eager`'s, as `linear_cross_entropy_unavailable_reason` decides. loss_kwargs: what the
    model's forward passes its loss_function (num_items_in_batch, ignore_index, shift_labels, and others it ignores)."""
    if ran_eager(None, _call_unavailable_reason(lm_head, labels, loss_function, logits_to_keep)):
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
    """(loss, logits) for a call whose own part of the decision passed: computed as lm_head's call (see the module's
    docstring), whose forward decides on the tensors as its hooks made them (recorded for `module`, the layer's): the
    fused loss, or the Linear's logits, which eager's loss then takes."""
    fused = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if ran_eager(module, _tensors_unavailable_reason(hidden, lm_head, labels, vocab_size)):
            return _LINEAR_FORWARD(lm_head, hidden)
        fused.append(True)
        return _fused_loss(hidden, lm_head, labels, chunk_tokens, loss_kwargs)

    output = _call_with_forward(lm_head, forward, hidden_states)
    if fused:
        return output, None
    return _loss_of_logits(output, labels, vocab_size, loss_function, loss_kwargs), output


def _fused_loss(
    hidden_states: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, chunk_tokens: int | None, loss_kwargs: dict
) -> torch.Tensor:
    """The fused loss of lm_head's (whole) parameters on these hidden states, in the form `chunked_form_pays` picks
    (or the chunked form at `chunk_tokens` when it is given)."""
    ignore_index = loss_kwargs.get("ignore_index", -100)
    shift_labels = loss_kwargs.get("shift_labels")
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden_states.device)
    counted = targets != ignore_index
    divisor = loss_kwargs.get("num_items_in_batch")
    if divisor is None:
        divisor = counted.sum()
    elif not torch.is_tensor(divisor):
        divisor = torch.tensor(divisor, device=hidden_states.device)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    weight, bias = parameter(lm_head, "weight"), parameter(lm_head, "bias")
    if not torch.is_grad_enabled():  # the Function would see requires_grad and make gradients no one asked for
        hidden, weight, bias = (None if t is None else t.detach() for t in (hidden, weight, bias))
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # as autocast's linear: operands cast once, gradients cast back
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight, bias = (None if t is None else t.to(dtype) for t in (hidden, weight, bias))
    targets, divisor = torch.where(counted, targets, 0), divisor.to(hidden.device, torch.float32)
    needs_grad = any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    with torch.autocast(device_type, enabled=False):  # the chunks' matmuls in that dtype, nothing cast again
        if chunk_tokens is None and not chunked_form_pays(hidden.shape[0], hidden.shape[1], needs_grad):
            total = _loss_keeping_log_probs(hidden, weight, bias, targets, counted)
        else:
            chunk = min(chunk_tokens or default_chunk_tokens(*hidden.shape), MAX_ROWS)
            total = _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, counted, chunk)
    # the division last: the loss is a tensor of its own, which a trainer may scale in place
    return with_eager_double_backward(total, _counted_loss_eager, hidden, weight, bias, targets, counted) / divisor


def _counted_loss_eager(hidden, weight, bias, targets, counted) -> torch.Tensor:
    """The counted tokens' summed loss in eager's ops (float32 logits, cross-entropy): what a recorded backward
    (create_graph) differentiates, the device's loss backward having no derivative."""
    per_token = F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, reduction="none")
    return torch.where(counted, per_token, 0.0).sum()


def _loss_keeping_log_probs(hidden, weight, bias, targets, counted) -> torch.Tensor:
    """The log-probability form: the counted tokens' summed loss, chunks of at most MAX_ROWS tokens, autograd through
    the op (which keeps each chunk's float32 log-probabilities, as eager keeps its log-softmax)."""
    total = None
    for start in range(0, hidden.shape[0], MAX_ROWS):
        rows = slice(start, start + MAX_ROWS)
        logits = F.linear(hidden[rows], weight, bias).float()
        per_token = torch_npu.npu_cross_entropy_loss(logits, targets[rows], reduction="none")[0]
        chunk_sum = torch.where(counted[rows], per_token, 0.0).sum()
        total = chunk_sum if total is None else total + chunk_sum
    return total


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
    """The transformers forward's lm_head and loss lines: `logits = lm_head(hidden[:, slice])`, then, with labels,
    the model's loss_function (ForCausalLMLoss's math when none is given) on them."""
    positions = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    logits = lm_head(hidden_states[:, positions, :])
    if labels is None:
        return None, logits
    return _loss_of_logits(logits, labels, vocab_size, loss_function, loss_kwargs), logits


def _loss_of_logits(logits, labels, vocab_size: int, loss_function: object, loss_kwargs: dict) -> torch.Tensor:
    """The model's loss_function (ForCausalLMLoss's math when none is given) on the logits, as the forward calls it."""
    loss_function = loss_function or causal_lm_loss_eager
    return loss_function(logits=logits, labels=labels, vocab_size=vocab_size, **loss_kwargs)


_LINEAR_FORWARD = nn.Linear.forward


class _StandInForward:
    """lm_head's forward while `_call_with_forward` calls are under way: runs, in a thread that set one, the forward
    given for its call (once); in every other thread, and in that one afterwards, nn.Linear's forward."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.calls = 0
        self.pending = threading.local()

    def __call__(self, *args, **kwargs):
        forward = getattr(self.pending, "forward", None)
        if forward is None:
            return _LINEAR_FORWARD(self.module, *args, **kwargs)
        self.pending.forward = None
        return forward(*args, **kwargs)


_STAND_IN_LOCK = threading.Lock()


def _call_with_forward(module: nn.Module, forward, *args):
    """`module(*args)` with `forward` in place of its forward for this call only: its hooks run around `forward` as
    around its own. The module's own forward is nn.Linear's and held by no instance attribute
    (`_call_unavailable_reason`): the stand-in is an instance attribute while calls are under way, then removed;
    calls of other threads in the meantime run nn.Linear's forward."""
    with _STAND_IN_LOCK:
        stand_in = instance_forward(module)
        if stand_in is None:
            stand_in = module.forward = _StandInForward(module)
        stand_in.calls += 1
    stand_in.pending.forward = forward
    try:
        return module(*args)
    finally:
        stand_in.pending.forward = None
        with _STAND_IN_LOCK:
            stand_in.calls -= 1
            if stand_in.calls == 0:
                del module.forward


def causal_lm_loss_eager(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers 5.22.2's ForCausalLMLoss, op for op: float32 logits, shifted labels, cross-entropy 'mean', or
    'sum' divided by num_items_in_batch; other keywords ignored, as it ignores them."""
    logits = logits.float()
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
    logits = logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1).to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The sum over counted tokens of CE(h W^T + b); the gradients made in forward, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, counted, chunk: int):
        needs_grad = ctx.needs_input_grad[:3]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # dL/dh in the model dtype: each chunk's matmul rounds it to that dtype anyway (as eager's does)
        grad_hidden = torch.empty_like(hidden) if needs_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_grad[1] else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if needs_grad[2] else None
        grads = (grad_hidden, grad_weight, grad_bias)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            total += _chunk(hidden[rows], weight, bias, targets[rows], counted[rows], rows, grads)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias, counted.any())
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight, grad_bias, any_counted = ctx.saved_tensors
        # no counted token: every gradient is 0, as eager's, whatever the incoming one (1 / 0 when its loss is 0 / 0)
        scale = torch.where(any_counted, grad_total.float(), 0.0)
        # new tensors (the saved ones stay as they are for a second backward), each rounded once to its dtype
        return (
            None if grad_hidden is None else grad_hidden * scale,
            None if grad_weight is None else (grad_weight * scale).to(ctx.weight_dtype),
            None if grad_bias is None else (grad_bias * scale).to(ctx.weight_dtype),
            None,
            None,
            None,
        )


def _chunk(h, weight, bias, target, mask, rows: slice, grads: tuple) -> torch.Tensor:
    """One chunk: its summed loss over the counted rows; adds its share into the gradients that are not None.
    (A function, so that every [chunk, V] buffer is freed when it returns.)"""
    grad_hidden, grad_weight, grad_bias = grads
    logits = F.linear(h, weight, bias).float()
    per_token, log_prob, _, _ = torch_npu.npu_cross_entropy_loss(logits, target, reduction="none")
    del logits
    chunk_loss = torch.where(mask, per_token, 0.0).sum()
    if all(grad is None for grad in grads):
        return chunk_loss
    # softmax - onehot of the counted rows, 0 elsewhere, in float32: grad_loss in log_prob's dtype (1/divisor last)
    grad_logits = torch_npu.npu_cross_entropy_loss_backward(mask.to(log_prob.dtype), log_prob, target, reduction="none")
    del log_prob
    if grad_weight is not None:  # float32 operands, summed in place: no product buffer of W's size
        grad_weight.addmm_(grad_logits.t(), h.float())
    if grad_bias is not None:
        grad_bias += grad_logits.sum(dim=0)
    if grad_hidden is not None:
        grad_hidden[rows] = grad_logits.to(weight.dtype) @ weight
    return chunk_loss
