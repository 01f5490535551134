"""Ledger cases of npu_moe_gating_top_k, its backward and npu_moe_gating_top_k_softmax_v2, and the card's limits."""

from __future__ import annotations

import torch

from ..forms import Form, Widths, randn
from . import made_at_first_use, npu, npu_int, torch_npu

gating = torch_npu.npu_moe_gating_top_k
backward = torch_npu.npu_moe_gating_top_k_backward
softmax_v2 = torch_npu.npu_moe_gating_top_k_softmax_v2


def _gate(experts: int = 8, k: int = 2, dtype=torch.float32, rows: int = 4, **kwargs):
    return lambda: gating(npu(rows, experts, dtype=dtype), k, **kwargs)


def _v2(shape: tuple[int, ...] = (4, 8), k: int = 2, dtype=torch.float32, **kwargs):
    return lambda: softmax_v2(npu(*shape, dtype=dtype), k=k, **kwargs)


def _sigmoid_backward(norm_type: int = 1, renorm: int = 0, experts: int = 8, k: int = 2, **change):
    """The backward's call from a sigmoid forward of [4, experts] (what derivatives.yaml passes), with `change`."""

    def call():
        args = {"x_norm": torch.rand(4, experts).to("npu"), "grad_y": npu(4, k),
                "expert_idx": npu_int(experts, 4, k, dtype=torch.int32)} | change  # fmt: skip
        return backward(**args, renorm=renorm, norm_type=norm_type)

    return call


def _trained(norm_type: int):
    """Forward with autograd recording (out_flag on, as the card passes it), then backward through the op."""

    def call():
        x = npu(4, 8, grad=True)
        y, _, _ = gating(x, 2, norm_type=norm_type, out_flag=True)
        y.backward(torch.ones_like(y))  # a contiguous gradient (a sum's is strided: grad-y-contiguous)

    return call


def _cases() -> dict:
    """`CASES`, made at first use (`made_at_first_use`): some of its calls take npu tensors made once."""
    return {
        "npu_moe_gating_top_k/x-rank": (_gate(), lambda: gating(npu(2, 4, 8), 2)),
        "npu_moe_gating_top_k/x-dtype": (_gate(dtype=torch.bfloat16), _gate(dtype=torch.float64)),
        "npu_moe_gating_top_k/experts-max": (_gate(experts=2048), _gate(experts=2049)),
        "npu_moe_gating_top_k/bias-shape": (_gate(bias=npu(8)), _gate(bias=npu(1, 8))),
        "npu_moe_gating_top_k/bias-dtype": (_gate(bias=npu(8)), _gate(bias=npu(8, dtype=torch.bfloat16))),
        "npu_moe_gating_top_k/group-count": (_gate(experts=12, group_count=4), _gate(experts=12, group_count=5)),
        "npu_moe_gating_top_k/experts-per-group": (_gate(experts=3, k=1), _gate(experts=2, k=1)),
        "npu_moe_gating_top_k/groups-aligned": (
            _gate(experts=2048, group_count=64, k_group=2), _gate(experts=1089, group_count=33, k_group=2),
        ),
        "npu_moe_gating_top_k/k-group": (
            _gate(experts=16, group_count=4, k_group=4), _gate(experts=16, group_count=4, k_group=5),
        ),
        "npu_moe_gating_top_k/k-range": (
            _gate(experts=16, k=8, group_count=4, k_group=2), _gate(experts=16, k=9, group_count=4, k_group=2),
        ),
        "npu_moe_gating_top_k/group-select-mode": (_gate(group_select_mode=1), _gate(group_select_mode=2)),
        "npu_moe_gating_top_k/renorm": (_gate(renorm=0), _gate(renorm=1)),
        "npu_moe_gating_top_k/norm-type": (_gate(norm_type=1), _gate(norm_type=2)),
        "npu_moe_gating_top_k_backward/norm-type": (_trained(norm_type=1), _trained(norm_type=0)),
        "npu_moe_gating_top_k_backward/renorm": (_sigmoid_backward(), _sigmoid_backward(renorm=1)),
        "npu_moe_gating_top_k_backward/x-norm-rank": (
            _sigmoid_backward(), _sigmoid_backward(x_norm=torch.rand(4, 8, 1).to("npu")),
        ),
        "npu_moe_gating_top_k_backward/x-norm-dtype": (
            _sigmoid_backward(), _sigmoid_backward(x_norm=torch.rand(4, 8).bfloat16().to("npu")),
        ),
        "npu_moe_gating_top_k_backward/experts-range": (
            _sigmoid_backward(experts=2, k=1), _sigmoid_backward(experts=1, k=1),
        ),
        "npu_moe_gating_top_k_backward/grad-y-shape": (_sigmoid_backward(), _sigmoid_backward(grad_y=npu(3, 2))),
        "npu_moe_gating_top_k_backward/grad-y-dtype": (
            _sigmoid_backward(grad_y=npu(4, 2, dtype=torch.bfloat16)), _sigmoid_backward(grad_y=npu(4, 2).double()),
        ),
        "npu_moe_gating_top_k_backward/grad-y-contiguous": (
            _sigmoid_backward(), _sigmoid_backward(grad_y=npu(2, 4).t()),
        ),
        "npu_moe_gating_top_k_backward/k-range": (
            _sigmoid_backward(k=8), _sigmoid_backward(k=9, expert_idx=npu_int(8, 4, 9, dtype=torch.int32)),
        ),
        "npu_moe_gating_top_k_backward/expert-idx": (
            _sigmoid_backward(), _sigmoid_backward(expert_idx=npu_int(8, 4, 2)),
        ),
        "npu_moe_gating_top_k_softmax_v2/x-rank": (_v2((2, 4, 8), renorm=1), _v2((2, 2, 4, 8))),
        "npu_moe_gating_top_k_softmax_v2/x-dtype": (_v2(dtype=torch.bfloat16), _v2(dtype=torch.float64)),
        "npu_moe_gating_top_k_softmax_v2/k-range": (
            _v2((2, 1024), k=1024, renorm=1), _v2((2, 1100), k=1025, renorm=1),
        ),
        "npu_moe_gating_top_k_softmax_v2/renorm": (_v2(renorm=1), _v2(renorm=2)),
        "npu_moe_gating_top_k_softmax_v2/finished": (
            _v2(finished=npu(4).gt(0)), _v2(finished=npu(4, 1).gt(0)),
        ),
    }  # fmt: skip


__getattr__ = made_at_first_use(globals(), CASES=_cases)


def _route(experts: int, top_k: int, *, scoring: str, renormalize: bool, grad: bool = False, **groups):
    """A LIMITS case: the card's routing of 6 tokens over `experts`, backward too with `grad`."""

    def make(card):
        logits = npu(6, experts, grad=grad)
        settings = {"scoring": scoring, "renormalize": renormalize, **groups}
        if scoring == "sigmoid":
            settings["bias"] = npu(experts)

        def run():
            weights, _ = card.moe_router_top_k(logits, top_k, eps=1e-20 if scoring == "sigmoid" else 0.0, **settings)
            if grad:
                weights.sum().backward()

        return run, lambda: card.moe_router_top_k_unavailable_reason(logits, top_k, **settings)

    return make


SOFTMAX = {"scoring": "softmax", "renormalize": False}
SIGMOID = {"scoring": "sigmoid", "renormalize": True}
RENORMALISED = {"scoring": "softmax", "renormalize": True}
LIMITS = {
    "softmax, 3 experts (more than 2 per group: at the limit)": _route(3, 1, **SOFTMAX),
    "softmax, 2 experts (past it)": _route(2, 1, **SOFTMAX),
    "softmax, 2048 experts": _route(2048, 4, **SOFTMAX),
    "softmax, 2049 experts": _route(2049, 4, **SOFTMAX),
    "softmax without grad (the op)": _route(16, 4, **SOFTMAX),
    "softmax with grad (its backward takes sigmoid only)": _route(16, 4, **SOFTMAX, grad=True),
    "renormalised softmax without grad (npu_moe_gating_top_k_softmax_v2)": _route(16, 4, **RENORMALISED),
    "renormalised softmax, top-k 1024 (at the limit)": _route(1100, 1024, **RENORMALISED),
    "renormalised softmax, top-k 1025 (past it)": _route(1100, 1025, **RENORMALISED),
    "renormalised softmax with grad": _route(16, 4, **RENORMALISED, grad=True),
    "sigmoid with grad": _route(16, 4, **SIGMOID, grad=True),
    "sigmoid, 4 groups of 3 (at the limit)": _route(12, 2, **SIGMOID, num_groups=4, topk_groups=2),
    "sigmoid, 4 groups of 2 (past it)": _route(8, 2, **SIGMOID, num_groups=4, topk_groups=2),
    "sigmoid, groups aligned to 2048": _route(2048, 2, **SIGMOID, num_groups=64, topk_groups=2),
    "sigmoid, groups aligned past 2048": _route(1089, 2, **SIGMOID, num_groups=33, topk_groups=2),
    "top-k at experts / groups * kept": _route(16, 8, **SIGMOID, num_groups=4, topk_groups=2),
    "top-k past it": _route(16, 9, **SIGMOID, num_groups=4, topk_groups=2),
}


def _logits(widths: Widths, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Router logits of `tokens` tokens over the experts, each row a shuffle of evenly spaced values.

    The values are distinct in every dtype (0.05 apart within [-3, 3]; bfloat16 is 1/64 apart there), so that the
    fused and the eager top-k choose the same experts: a tie would make their weights incomparable, not wrong.
    """
    spaced = torch.linspace(-3.0, 3.0, widths.experts, dtype=torch.float64) * (widths.experts - 1) * 0.05 / 6.0
    rows = [spaced[torch.randperm(widths.experts, generator=generator)] for _ in range(widths.tokens)]
    return {"router_logits": torch.stack(rows), "bias": randn(widths.experts, generator=generator, scale=0.01)}


def _groups(widths: Widths) -> dict[str, int]:
    """DeepSeek-V3's grouping (8 groups, 4 kept) where the experts allow it, else 4 groups of 2 kept, else none."""
    for groups, kept in ((8, 4), (4, 2)):
        if (
            widths.experts % groups == 0
            and widths.experts // groups > 2
            and widths.top_k <= widths.experts // groups * kept
        ):
            return {"num_groups": groups, "topk_groups": kept}
    return {}


def _route_form(scoring: str, renormalize: bool, layers: tuple[str, ...], inference: bool = False) -> Form:
    settings = {"scoring": scoring, "renormalize": renormalize}

    def call(function: str):
        def run(card, t):
            extra = {"bias": t["bias"], "eps": 1e-20, **t["groups"]} if scoring == "sigmoid" else {}
            return getattr(card, function)(t["router_logits"], t["top_k"], **settings, **extra)

        return run

    def reason(card, t):
        extra = {"bias": t["bias"], **t["groups"]} if scoring == "sigmoid" else {}
        return card.moe_router_top_k_unavailable_reason(t["router_logits"], t["top_k"], **settings, **extra)

    def make(widths, generator):
        return {**_logits(widths, generator), "top_k": widths.top_k, "groups": _groups(widths)}

    return Form(
        layers=layers,
        make=make,
        fused=call("moe_router_top_k"),
        eager=call("moe_router_top_k_eager"),
        reason=reason,
        grads=("router_logits",),
        inference=inference,
        applies=lambda widths: widths.experts > 0 and widths.top_k > 0,
    )


SOFTMAX_LAYERS = ("SoftmaxTopKRouter", "RenormalisedSoftmaxTopKRouter", "RenormalisedFloat32SoftmaxTopKRouter")
FORMS = {
    # the op's backward takes the sigmoid mode only: softmax routing fuses where autograd does not record
    "softmax top-k (inference)": _route_form("softmax", False, SOFTMAX_LAYERS[:1], inference=True),
    "softmax top-k, renormalised (inference)": _route_form("softmax", True, SOFTMAX_LAYERS[1:], inference=True),
    "sigmoid group top-k (DeepSeek-V3)": _route_form("sigmoid", True, ("SigmoidGroupTopKRouter",)),
}
