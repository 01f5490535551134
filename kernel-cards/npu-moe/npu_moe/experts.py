"""Dropless top-k SiLU-gated experts on torch_npu's routing ops and grouped matmul.

transformers v5 keeps the experts of an MoE layer in one module: `gate_up_proj [E, 2I, H]` (gate
rows first), `down_proj [E, H, I]`, and computes, for token t and its k routed experts e = top_k_index[t, j],
`out[t] = sum_j top_k_weights[t, j] * down_proj[e] @ (silu(gate[e] @ x_t) * (up[e] @ x_t))`.

On the NPU: count tokens per expert (one `bincount`), permute the tokens into expert order
(`npu_moe_token_permute`), one `npu_grouped_matmul` for gate_up over all experts, `npu_swiglu`, one
grouped matmul for down, and `npu_moe_token_unpermute` to weight and sum each token's k rows: 6
device ops whatever the number of experts. The counts take an op of their own because no torch_npu
routing op both returns them and has a backward (`npu_moe_init_routing_v2` returns them, but is
inference-only and needs int32 expert ids, which costs the same op as a cast): see the project's
docs/torch-npu-ops.md, "MoE routing ops and per-expert counts". `npu_grouped_matmul` has no
autograd, so `_GroupedLinear` supplies it: dx through the same grouped matmul on the untransposed
weights, dW through the K-split form (group_type 2).

Elsewhere (torch-universal, CPU tensors, or inputs outside the ops' limits) `swiglu_experts_eager` runs the
same math efficiently: sort the token copies by expert once, then one matmul per non-empty expert or
torch's grouped matmul (see its docstring).

The grouped path computes what the module's child `act_fn` computes without calling it, so it runs only when
nothing watches that call: a hook of the user's own on act_fn, a forward replaced on its instance, or module hooks
registered for every module (`register_module_forward_hook`) make the layer run the module's own forward, which
calls act_fn as eager does (`swiglu_experts_unavailable_reason` says why). DeepSpeed's and FSDP2's own hooks on
act_fn (which gather and release parameters, and act_fn holds none) do not. In a backward that autograd records
(`create_graph=True`), the output is differentiated as `swiglu_experts_eager`'s math (none of the device ops'
backwards has a derivative of its own, and npu_grouped_matmul has no autograd at all), so second-order gradients
are eager's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ._activations import is_silu
from ._double_backward import with_eager_double_backward
from ._fallbacks import ran_eager
from ._internals import engine_hook, functorch_transform, global_module_hooks, instance_forward, module_hooks
from ._npu import FUSED_DTYPES, keepable, npu_unavailable_reason, torch_npu
from ._tracing import graph_tracer

MAX_GROUPS = 1024
"""npu_grouped_matmul takes at most 1024 groups with a single 3-D weight."""
MAX_INNER_DIM = 65536
"""npu_grouped_matmul's inner-axis limit: the stored last dims (hidden, 2 * intermediate) stay below it."""
MAX_TOP_K = 512
MAX_TOKEN_COPIES = 16777215
"""npu_moe_token_permute sorts fewer than this many token copies (top_k_index.numel())."""
INDEX_DTYPES = (torch.int32, torch.int64)
GROUPED_MM_ROWS_PER_EXPERT = 128
"""Below this many token copies per expert on average, the host fallback uses torch's grouped matmul
rather than a loop over experts (measured on CPU: see `make bench`)."""


class _ModuleForwardIsEager(str):
    """A reason for which the module's own forward is the eager path (the layer runs it where the class has one)."""


class _ActFnWatched(_ModuleForwardIsEager):
    """A reason that is about act_fn's call being watched: the module's own forward calls act_fn as eager does."""


def _act_fn_call_unavailable_reason(act_fn) -> _ActFnWatched | None:
    """Why the experts must call their `act_fn` module as eager does rather than compute its SiLU themselves, or None.

    The reasons: hooks of the user's own on it (DeepSpeed's and FSDP2's aside), a forward replaced on its instance
    (as accelerate's hooks replace it), or module hooks registered for every module.
    """
    forward = instance_forward(act_fn) if isinstance(act_fn, nn.Module) else None
    if forward is not None and getattr(forward, "__func__", None) is not type(act_fn).forward:
        return _ActFnWatched("act_fn's forward is replaced on its instance: the experts call it, as eager does")
    hooks = [hook for hook in module_hooks(act_fn) if not engine_hook(hook)]
    if hooks:
        names = ", ".join(getattr(hook, "__qualname__", type(hook).__qualname__) for hook in hooks)
        return _ActFnWatched(
            f"act_fn has hooks of its own ({names}): the experts call it, as eager does, for them to see it"
        )
    if global_module_hooks():
        return _ActFnWatched(
            "module hooks are registered for every module (register_module_forward_hook, ...): the experts call "
            "act_fn as eager does, for the hooks to see each call"
        )
    return None


def swiglu_experts_unavailable_reason(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act_fn,
    top_k_weights: torch.Tensor | None = None,
) -> str | None:
    """Why the grouped-matmul path will not run for these inputs, or None when it will.

    `top_k_weights`, when given, is checked too: npu_moe_token_unpermute takes it as its probs. One condition only
    the fused path's own per-expert counts show: a placeholder id E in top_k_index (expert parallelism) runs eager,
    saying so (`PLACEHOLDER_IDS`).
    """
    tracer = graph_tracer()
    if tracer is not None:  # swiglu_experts_eager reads the per-expert counts on the host too: the module's own runs
        return _ModuleForwardIsEager(
            f"{tracer} traces the call: the grouped path reads the per-expert token counts on the host (a "
            "data-dependent size), which a graph cannot hold; the experts run the module's own forward"
        )
    watched = _act_fn_call_unavailable_reason(act_fn)
    if not is_silu(act_fn):
        reason = f"activation {act_fn!r} is not SiLU"
        return reason if watched is None else _ActFnWatched(reason)
    if watched is not None:
        return watched
    transform = functorch_transform()
    if transform is not None:  # swiglu_experts_eager reads the per-expert counts on the host: vmap refuses that
        return _ModuleForwardIsEager(
            f"torch.func's {transform} transform is active: the experts run the module's own forward, which "
            "torch.func transforms"
        )
    reason = npu_unavailable_reason(hidden_states, top_k_index, gate_up_proj, down_proj)
    if reason is not None:
        return reason
    if hidden_states.dtype not in FUSED_DTYPES:
        return f"dtype {hidden_states.dtype} is not supported (float16, bfloat16, float32)"
    if gate_up_proj.dtype != hidden_states.dtype or down_proj.dtype != hidden_states.dtype:
        return f"expert weights in {gate_up_proj.dtype}, hidden states in {hidden_states.dtype}"
    if hidden_states.dim() != 2 or top_k_index.dim() != 2 or gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        return "hidden_states must be [tokens, hidden], top_k_index [tokens, k] and the expert weights 3-D"
    if top_k_index.dtype not in INDEX_DTYPES:
        return f"top_k_index in {top_k_index.dtype}: npu_moe_token_permute takes int32 or int64 expert ids"
    if top_k_index.shape[0] != hidden_states.shape[0]:
        return f"{top_k_index.shape[0]} rows of top_k_index for {hidden_states.shape[0]} tokens"
    if hidden_states.shape[0] == 0:
        return "no tokens"
    if top_k_weights is not None:
        if top_k_weights.dtype not in FUSED_DTYPES:
            return f"routing weights in {top_k_weights.dtype}: npu_moe_token_unpermute takes float16/32, bfloat16"
        if top_k_weights.shape != top_k_index.shape:
            return f"routing weights {tuple(top_k_weights.shape)} for top_k_index {tuple(top_k_index.shape)}"
    experts, double_inner, hidden = gate_up_proj.shape
    if double_inner % 2 or tuple(down_proj.shape) != (experts, hidden, double_inner // 2):
        return f"gate_up_proj {tuple(gate_up_proj.shape)} and down_proj {tuple(down_proj.shape)} do not pair"
    if min(hidden, double_inner) == 0:
        return f"hidden size {hidden}, intermediate size {double_inner // 2}: the MoE backward ops refuse empty sizes"
    if experts > MAX_GROUPS:
        return f"{experts} experts: npu_grouped_matmul takes at most {MAX_GROUPS} groups"
    if max(hidden, double_inner) >= MAX_INNER_DIM:
        return f"inner dims {hidden}, {double_inner} must be below {MAX_INNER_DIM}"
    if top_k_index.shape[1] == 0:
        return "top-k 0: no token copies (npu_moe_token_unpermute takes top-k 1 to 512)"
    if top_k_index.shape[1] > MAX_TOP_K:
        return f"top-k {top_k_index.shape[1]} above {MAX_TOP_K}"
    if top_k_index.numel() >= MAX_TOKEN_COPIES:
        return f"{top_k_index.numel()} token copies: npu_moe_token_permute sorts fewer than {MAX_TOKEN_COPIES}"
    return None


class _GroupedLinear(torch.autograd.Function):
    """`y[rows of e] = x[rows of e] @ weight[e].T` for groups of consecutive rows, with a backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, counts)
        return _grouped_matmul(x, weight.transpose(1, 2), counts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, counts = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = _grouped_matmul(grad, weight, counts) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:  # dW[e] = grad[rows of e].T @ x[rows of e]: the K-split grouped matmul
            grad_weight = torch_npu.npu_grouped_matmul(
                [grad.t()], [x], group_list=counts, group_type=2, group_list_type=_list_type(counts), split_item=2
            )[0]
        return grad_x, grad_weight, None


def _grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return torch_npu.npu_grouped_matmul(
        [x], [weight], group_list=counts, group_type=0, group_list_type=_list_type(counts), split_item=2
    )[0]


def _list_type(counts: torch.Tensor) -> int:
    """group_list_type for the per-expert counts: 1 (counts), or 0 (cumsum) for a single expert.

    A single expert's one count is its cumsum: npu_grouped_matmul refuses a counts list of length 1.
    """
    return 1 if counts.numel() > 1 else 0


def swiglu_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act_fn: Callable,
) -> torch.Tensor:
    """transformers' Experts forward, as grouped matmuls on the NPU where they apply.

    It runs `swiglu_experts_eager` where `swiglu_experts_unavailable_reason` says they do not apply.
    """
    reason = swiglu_experts_unavailable_reason(
        hidden_states, top_k_index, gate_up_proj, down_proj, act_fn, top_k_weights=top_k_weights
    )
    return _following(reason, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, act_fn)


PLACEHOLDER_IDS = "top_k_index holds the placeholder id E (expert parallelism): skipped as eager skips it"


def _following(
    reason: str | None,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act_fn: Callable,
    module: nn.Module | None = None,
) -> torch.Tensor:
    """The experts' output as `reason` (`swiglu_experts_unavailable_reason`'s) decides, recorded for `module`."""
    experts = gate_up_proj.shape[0]
    counts = _expert_counts(top_k_index, experts) if reason is None else None
    if counts is not None and counts.numel() > experts:  # id E: expert-parallel placeholders, skipped as eager does
        reason = PLACEHOLDER_IDS
    if ran_eager(module, reason):
        return swiglu_experts_eager(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, act_fn)
    permuted, sorted_indices = torch_npu.npu_moe_token_permute(hidden_states, top_k_index)
    gate_up = _GroupedLinear.apply(permuted, gate_up_proj, counts)
    expert_out = _GroupedLinear.apply(torch_npu.npu_swiglu(gate_up), down_proj, counts)
    if torch.is_grad_enabled():  # the op keeps its probs for backward
        top_k_weights = keepable(top_k_weights)
    out = torch_npu.npu_moe_token_unpermute(expert_out, sorted_indices, probs=top_k_weights)
    # A recorded backward differentiates the eager math (act_fn is SiLU: checked above): the device ops' backwards
    # have no derivative. The router computed top_k_weights from hidden_states: the eager math is handed an alias of
    # hidden_states made after that, so that its gradient there is the experts' own, not also the router's path.
    if torch.is_grad_enabled():
        hidden_states = hidden_states.view_as(hidden_states)
    eager = partial(swiglu_experts_eager, act_fn=F.silu)
    return with_eager_double_backward(out, eager, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)


def _expert_counts(top_k_index: torch.Tensor, experts: int) -> torch.Tensor:
    """Token copies per expert id, [E] (or [E + 1] when the placeholder id E occurs).

    Raises:
        ValueError: for ids above E, as transformers' eager experts raise (`one_hot` with E + 1 classes): a router
            bug must not become a silently wrong output. bincount itself rejects negative ids.
    """
    counts = torch.bincount(top_k_index.flatten(), minlength=experts)
    if counts.numel() > experts + 1:
        raise ValueError(
            f"top_k_index holds expert id {counts.numel() - 1}, above {experts}: ids must lie in [0, {experts - 1}], "
            f"or be {experts} for a token copy routed to no local expert (expert parallelism). Check the router."
        )
    return counts


def swiglu_experts_eager(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act_fn: Callable,
) -> torch.Tensor:
    """The same experts math without NPU ops.

    The token copies are sorted by expert once, then one matmul runs per non-empty expert, or, for many experts with
    few rows each (where a Python loop of small matmuls costs more than the math), torch's grouped matmul per
    projection; the results are weighted and summed back per token.
    """
    experts = gate_up_proj.shape[0]
    top_k = top_k_index.shape[1]
    flat = top_k_index.flatten()
    order = flat.argsort(stable=True)
    counts = _expert_counts(top_k_index, experts)[:experts]
    kept = order[: int(counts.sum())]  # id E (expert-parallel placeholders) sorts last: dropped
    rows = kept // top_k
    sorted_states = hidden_states[rows]
    few_rows_per_expert = sorted_states.shape[0] < GROUPED_MM_ROWS_PER_EXPERT * experts
    if few_rows_per_expert and _grouped_mm_takes(sorted_states, gate_up_proj, down_proj):
        offsets = counts.cumsum(0).to(torch.int32)
        gate, up = F.grouped_mm(sorted_states, gate_up_proj.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        expert_out = F.grouped_mm(act_fn(gate) * up, down_proj.transpose(1, 2), offs=offsets)
    else:
        pieces = []
        for expert, piece in enumerate(sorted_states.split(counts.tolist())):
            if piece.shape[0]:
                gate, up = F.linear(piece, gate_up_proj[expert]).chunk(2, dim=-1)
                pieces.append(F.linear(act_fn(gate) * up, down_proj[expert]))
        expert_out = torch.cat(pieces) if pieces else sorted_states
    weighted = expert_out * top_k_weights.flatten()[kept, None]
    return torch.zeros_like(hidden_states).index_add_(0, rows, weighted.to(hidden_states.dtype))


def _grouped_mm_takes(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> bool:
    """Whether torch's F.grouped_mm (torch >= 2.9) accepts these: float32/16 or bfloat16, 16-byte aligned rows."""
    if not hasattr(F, "grouped_mm") or x.dtype not in FUSED_DTYPES or 0 in (*x.shape, *gate_up_proj.shape[1:]):
        return False
    if gate_up_proj.dtype != x.dtype or down_proj.dtype != x.dtype:
        return False
    return all(size * x.element_size() % 16 == 0 for size in (gate_up_proj.shape[2], down_proj.shape[2]))
