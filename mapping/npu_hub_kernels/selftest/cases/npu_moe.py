"""npu-moe's cases: its ops' rules (`CASES`), the card at and just past each limit (`LIMITS`), its forms (`FORMS`).

The ops are npu_grouped_matmul, npu_moe_token_permute / npu_moe_token_unpermute and their backward ops.

The backward ops' accepted calls run the forward op's autograd (what derivatives.yaml hands them); their refused
calls call the backward op itself, as torch_npu exposes it (`torch.ops.npu`), with one argument changed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..forms import Form, Widths, randn
from . import made_at_first_use, npu, npu_int, torch_npu

gmm = torch_npu.npu_grouped_matmul
permute = torch_npu.npu_moe_token_permute
unpermute = torch_npu.npu_moe_token_unpermute


def _counts(*sizes: int) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64).to("npu")


def _gmm(rows: int = 6, k: int = 4, n: int = 5, dtype=torch.float32, **change):
    """group_type 0 as the card calls it: x [6, K] in 3 groups of 1, 2, 3 rows over weight [3, K, N], counts."""

    def call():
        args = {"x": [npu(rows, k, dtype=dtype)], "weight": [npu(3, k, n, dtype=dtype)], "group_list": _counts(1, 2, 3),
                "group_type": 0, "group_list_type": 1, "split_item": 2} | change  # fmt: skip
        return gmm(args.pop("x"), args.pop("weight"), **args)

    return call


def _k_gmm(dtype=torch.float32, **change):
    """group_type 2 as the card's weight gradient calls it.

    x = grad.t() ([5, 6], grad [6, 5] contiguous), weight [6, 4], the 6 rows split 1, 2, 3; y [3, 5, 4].
    """

    def call():
        args = {"x": [npu(6, 5, dtype=dtype).t()], "weight": [npu(6, 4, dtype=dtype)], "group_list": _counts(1, 2, 3),
                "group_type": 2, "group_list_type": 1, "split_item": 2} | change  # fmt: skip
        return gmm(args.pop("x"), args.pop("weight"), **args)

    return call


def _groups(count: int):
    """count groups of one row each: x [count, 4], weight [count, 4, 2]."""
    return _gmm(rows=count, weight=[npu(count, 4, 2)], group_list=_counts(*[1] * count))


def _inner(size: int):
    """x [6, size] over weight [3, size, 5]: x's stored last dim is `size`."""
    return _gmm(k=size, x=[npu(6, size, dtype=torch.bfloat16)], weight=[npu(3, size, 5, dtype=torch.bfloat16)])


def _permute(tokens=None, indices=None, **kwargs):
    def call():
        return permute(npu(4, 3) if tokens is None else tokens(), npu_int(5, 4, 2) if indices is None else indices(),
                       **kwargs)  # fmt: skip

    return call


def _permuted_grad(dtype=torch.float32, top_k: int = 2):
    """permute with autograd, then backward: npu_moe_token_permute_grad_v2 as derivatives.yaml calls it."""

    def call():
        tokens = npu(4, 3, dtype=dtype, grad=True)
        permuted, _ = permute(tokens, npu_int(5, 4, top_k))
        permuted.backward(torch.ones_like(permuted))

    return call


def _permute_grad(**change):
    """npu_moe_token_permute_grad_v2 called directly: T = 4 tokens, K = 2, hidden 3, with `change`."""

    def call():
        args = {"grad_permuted_tokens": npu(8, 3), "sorted_indices": torch.randperm(8).int().to("npu"),
                "tokens_size_0": 4, "tokens_dtype": torch.float32, "num_topK": 2} | change  # fmt: skip
        return torch_npu.npu_moe_token_permute_grad_v2(**args)

    return call


def _sorted(count: int, dtype=torch.int32) -> torch.Tensor:
    return torch.randperm(count).to(dtype).to("npu")


def _unpermute(tokens: int = 4, top_k: int = 2, hidden: int = 3, **change):
    """unpermute of T * K permuted rows with probs [T, K] (no probs when change says probs=None)."""

    def call():
        args = {"permuted_tokens": npu(tokens * top_k, hidden), "sorted_indices": _sorted(tokens * top_k),
                "probs": npu(tokens, top_k)} | change  # fmt: skip
        return unpermute(**args)

    return call


def _unpermuted_grad(with_probs: bool = True, dtype=torch.float32, probs_dtype=torch.float32):
    """unpermute with autograd, then backward: npu_moe_token_unpermute_grad_v2 as derivatives.yaml calls it."""

    def call():
        top_k = 2 if with_probs else 1
        permuted = npu(4 * top_k, 3, dtype=dtype, grad=True)
        probs = npu(4, top_k, dtype=probs_dtype, grad=True) if with_probs else None
        out = unpermute(permuted, _sorted(4 * top_k), probs=probs)
        out.backward(torch.ones_like(out))

    return call


def _unpermute_grad(**change):
    """npu_moe_token_unpermute_grad_v2 called directly: T = 4, K = 2, hidden 3, with probs, with `change`."""

    def call():
        args = {"grad_unpermuted_tokens": npu(4, 3), "sorted_indices": _sorted(8), "permuted_tokens_size_0": 8,
                "permuted_tokens_dtype": torch.float32, "probs": npu(4, 2), "padded_mode": False,
                "restore_shape": None, "permuted_tokens": npu(8, 3)} | change  # fmt: skip
        return torch_npu.npu_moe_token_unpermute_grad_v2(**args)

    return call


def _top_k_grad(top_k: int):
    """npu_moe_token_unpermute_grad_v2 for one token routed to `top_k` rows."""
    rows = {"permuted_tokens_size_0": top_k, "permuted_tokens": npu(top_k, 3), "sorted_indices": _sorted(top_k)}
    return _unpermute_grad(grad_unpermuted_tokens=npu(1, 3), probs=npu(1, top_k), **rows)


GMM = "npu_grouped_matmul"
PERMUTE = "npu_moe_token_permute"
PERMUTE_GRAD = "npu_moe_token_permute_grad_v2"
UNPERMUTE = "npu_moe_token_unpermute"
UNPERMUTE_GRAD = "npu_moe_token_unpermute_grad_v2"
HALF = torch.float16


def _cases() -> dict:
    """`CASES`, made at first use (`made_at_first_use`): some of its calls take npu tensors made once."""
    return {
        # npu_grouped_matmul, any call
        f"{GMM}/group-type-given": (_gmm(), _gmm(group_type=None)),
        f"{GMM}/group-type": (_k_gmm(), _gmm(group_type=1)),
        f"{GMM}/split-item": (_gmm(split_item=3), _gmm(split_item=4)),
        f"{GMM}/lists-given": (_gmm(), _gmm(x=[])),
        f"{GMM}/list-length": (_gmm(), _gmm(dtype=HALF, x=[npu(6, 4, dtype=HALF)] * 129)),
        f"{GMM}/group-list-dtype": (_gmm(), _gmm(group_list=_counts(1, 2, 3).int())),
        f"{GMM}/group-list-type": (_gmm(group_list_type=0, group_list=_counts(1, 3, 6)), _gmm(group_list_type=3)),
        f"{GMM}/group-list-type-pairs": (_gmm(), _gmm(group_list_type=2)),
        f"{GMM}/act-type": (_gmm(act_type=0), _gmm(act_type=3)),
        f"{GMM}/act-type-quantised": (_gmm(), _gmm(act_type=5)),
        f"{GMM}/k-split-plain": (_k_gmm(), _k_gmm(bias=[npu(4)])),
        f"{GMM}/float32-single": (_gmm(), _gmm(split_item=0)),
        f"{GMM}/output-dtype": (_gmm(output_dtype=torch.float32), _gmm(output_dtype=HALF)),
        f"{GMM}/tuning-config": (_gmm(), _gmm(tuning_config=[4])),
        # npu_grouped_matmul, the emulated forms (one x, one weight, group_type 0 or 2)
        f"{GMM}/dtypes": (_gmm(dtype=torch.bfloat16), _gmm(weight=[npu(3, 4, 5, dtype=HALF)])),
        f"{GMM}/group-list-given": (_gmm(), _gmm(group_list=None)),
        f"{GMM}/split-item-single": (_gmm(dtype=HALF, split_item=3), _gmm(dtype=HALF, split_item=0)),
        f"{GMM}/ranks": (_gmm(), _gmm(weight=[npu(4, 5)])),
        f"{GMM}/group-list-rank": (_gmm(), _gmm(group_list=_counts(1, 2, 3).reshape(1, 3))),
        f"{GMM}/groups": (_groups(1024), _groups(1025)),
        f"{GMM}/group-list-length": (
            _gmm(weight=[npu(1, 4, 5)], group_list=_counts(6), group_list_type=0),
            _gmm(weight=[npu(1, 4, 5)], group_list=_counts(6)),
        ),
        f"{GMM}/group-count": (_gmm(), _gmm(weight=[npu(4, 4, 5)])),
        f"{GMM}/shapes": (_k_gmm(), _gmm(x=[npu(6, 3)])),
        f"{GMM}/inner-limit": (_inner(65535), _inner(65536)),
        f"{GMM}/x-layout": (_gmm(x=[npu(6, 4)]), _gmm(x=[npu(4, 6).t()])),
        f"{GMM}/weight-layout": (_k_gmm(weight=[npu(6, 4)]), _k_gmm(weight=[npu(4, 6).t()])),
        f"{GMM}/group-list-values": (
            _gmm(group_list=_counts(0, 3, 3)),
            _gmm(group_list=_counts(3, 1, 6), group_list_type=0),  # a cumsum that decreases
        ),
        f"{GMM}/group-list-total": (_k_gmm(group_list=_counts(1, 2, 2)), _gmm(group_list=_counts(1, 2, 2))),
        # npu_moe_token_permute
        f"{PERMUTE}/tokens-rank": (_permute(), _permute(tokens=lambda: npu(4, 1, 3))),
        f"{PERMUTE}/indices-rank": (
            _permute(indices=lambda: npu_int(5, 4)),
            _permute(indices=lambda: npu_int(5, 4, 2, 1)),
        ),
        f"{PERMUTE}/tokens-dtype": (
            _permute(tokens=lambda: npu(4, 3, dtype=HALF)),
            _permute(tokens=lambda: npu_int(5, 4, 3)),
        ),
        f"{PERMUTE}/indices-dtype": (
            _permute(indices=lambda: npu_int(5, 4, 2, dtype=torch.int32)),
            _permute(indices=lambda: npu_int(5, 4, 2, dtype=torch.int16)),
        ),
        f"{PERMUTE}/rows": (_permute(), _permute(tokens=lambda: npu(5, 3))),
        f"{PERMUTE}/top-k": (
            _permute(indices=lambda: npu_int(5, 4, 512)),
            _permute(indices=lambda: npu_int(5, 4, 513)),
        ),
        f"{PERMUTE}/indices-count": (
            _permute(tokens=lambda: npu(2, 1, dtype=torch.bfloat16), indices=lambda: npu_int(5, 2, dtype=torch.int32)),
            _permute(
                tokens=lambda: npu(16777215, 1, dtype=torch.bfloat16),
                indices=lambda: npu_int(5, 16777215, dtype=torch.int32),
            ),
        ),
        f"{PERMUTE}/indices-values": (
            _permute(indices=lambda: torch.tensor([[0, 16777214]] * 4).to("npu")),
            _permute(indices=lambda: torch.tensor([[0, 16777215]] * 4).to("npu")),
        ),
        f"{PERMUTE}/padded-mode": (_permute(padded_mode=False), _permute(padded_mode=True)),
        # npu_moe_token_permute_grad_v2
        f"{PERMUTE_GRAD}/grad-rank": (_permuted_grad(), _permute_grad(grad_permuted_tokens=npu(8, 3, 1))),
        f"{PERMUTE_GRAD}/sorted-indices-rank": (
            _permuted_grad(),
            _permute_grad(sorted_indices=_sorted(8).reshape(2, 2, 2)),
        ),
        f"{PERMUTE_GRAD}/grad-dtype": (
            _permuted_grad(dtype=torch.bfloat16),
            _permute_grad(grad_permuted_tokens=npu(8, 3, dtype=torch.float64), tokens_dtype=torch.float64),
        ),
        f"{PERMUTE_GRAD}/sorted-indices-dtype": (
            _permuted_grad(),
            _permute_grad(sorted_indices=_sorted(8, torch.int64)),
        ),
        f"{PERMUTE_GRAD}/tokens-dtype": (_permuted_grad(dtype=HALF), _permute_grad(tokens_dtype=torch.bfloat16)),
        f"{PERMUTE_GRAD}/top-k": (
            _permute_grad(grad_permuted_tokens=npu(512, 3), sorted_indices=_sorted(512), tokens_size_0=1, num_topK=512),
            _permute_grad(grad_permuted_tokens=npu(513, 3), sorted_indices=_sorted(513), tokens_size_0=1, num_topK=513),
        ),
        f"{PERMUTE_GRAD}/shape": (_permuted_grad(top_k=1), _permute_grad(tokens_size_0=3)),
        # npu_moe_token_unpermute
        f"{UNPERMUTE}/permuted-tokens-rank": (_unpermute(), _unpermute(permuted_tokens=npu(8, 3, 1))),
        f"{UNPERMUTE}/sorted-indices-rank": (_unpermute(), _unpermute(sorted_indices=_sorted(8).reshape(4, 2))),
        f"{UNPERMUTE}/probs-rank": (_unpermute(probs=None, top_k=1), _unpermute(probs=npu(8))),
        f"{UNPERMUTE}/permuted-tokens-dtype": (
            _unpermute(permuted_tokens=npu(8, 3, dtype=HALF)),
            _unpermute(permuted_tokens=npu(8, 3, dtype=torch.float64)),
        ),
        f"{UNPERMUTE}/sorted-indices-dtype": (_unpermute(), _unpermute(sorted_indices=_sorted(8, torch.int64))),
        f"{UNPERMUTE}/probs-dtype": (
            _unpermute(permuted_tokens=npu(8, 3, dtype=torch.bfloat16)),
            _unpermute(probs=npu(4, 2, dtype=torch.float64)),
        ),
        f"{UNPERMUTE}/top-k": (_unpermute(tokens=1, top_k=512), _unpermute(tokens=1, top_k=513)),
        f"{UNPERMUTE}/shape": (_unpermute(), _unpermute(probs=npu(3, 2))),
        f"{UNPERMUTE}/rows": (_unpermute(), _unpermute(permuted_tokens=npu(7, 3))),
        f"{UNPERMUTE}/indices-values": (_unpermute(), _unpermute(sorted_indices=torch.arange(1, 9).int().to("npu"))),
        f"{UNPERMUTE}/padded-mode": (_unpermute(padded_mode=False), _unpermute(padded_mode=True)),
        f"{UNPERMUTE}/restore-shape": (_unpermute(restore_shape=None), _unpermute(restore_shape=[4, 3])),
        # npu_moe_token_unpermute_grad_v2
        f"{UNPERMUTE_GRAD}/grad-rank": (_unpermuted_grad(), _unpermute_grad(grad_unpermuted_tokens=npu(4, 3, 1))),
        f"{UNPERMUTE_GRAD}/sorted-indices-rank": (
            _unpermuted_grad(with_probs=False),
            _unpermute_grad(sorted_indices=_sorted(8).reshape(4, 2)),
        ),
        f"{UNPERMUTE_GRAD}/probs-rank": (_unpermuted_grad(), _unpermute_grad(probs=npu(8))),
        f"{UNPERMUTE_GRAD}/grad-dtype": (
            _unpermuted_grad(dtype=torch.bfloat16),
            _unpermute_grad(grad_unpermuted_tokens=npu(4, 3, dtype=torch.float64), permuted_tokens_dtype=torch.float64),
        ),
        f"{UNPERMUTE_GRAD}/tokens-dtype": (
            _unpermuted_grad(dtype=HALF, probs_dtype=torch.float32),
            _unpermute_grad(permuted_tokens=npu(8, 3, dtype=HALF)),
        ),
        f"{UNPERMUTE_GRAD}/sorted-indices-dtype": (
            _unpermuted_grad(),
            _unpermute_grad(sorted_indices=_sorted(8, torch.int64)),
        ),
        f"{UNPERMUTE_GRAD}/probs-dtype": (
            _unpermuted_grad(probs_dtype=torch.bfloat16),
            _unpermute_grad(probs=npu(4, 2, dtype=torch.float64)),
        ),
        f"{UNPERMUTE_GRAD}/permuted-tokens-given": (
            _unpermute_grad(probs=None, sorted_indices=_sorted(4), permuted_tokens_size_0=4, permuted_tokens=None),
            _unpermute_grad(permuted_tokens=None),
        ),
        f"{UNPERMUTE_GRAD}/top-k": (
            _top_k_grad(512),
            _top_k_grad(513),
        ),
        f"{UNPERMUTE_GRAD}/nonempty": (
            _unpermuted_grad(),
            _unpermute_grad(grad_unpermuted_tokens=npu(4, 0), permuted_tokens=npu(8, 0)),
        ),
        f"{UNPERMUTE_GRAD}/shape": (
            _unpermuted_grad(),
            _unpermute_grad(permuted_tokens_size_0=7, permuted_tokens=npu(7, 3)),
        ),
        f"{UNPERMUTE_GRAD}/padded-mode": (_unpermute_grad(padded_mode=False), _unpermute_grad(padded_mode=True)),
        f"{UNPERMUTE_GRAD}/restore-shape": (_unpermute_grad(restore_shape=None), _unpermute_grad(restore_shape=[4, 3])),
    }


__getattr__ = made_at_first_use(globals(), CASES=_cases)


def _experts(
    tokens: int = 6,
    experts: int = 4,
    top_k: int = 2,
    hidden: int = 8,
    inner: int = 4,
    dtype=torch.float32,
    weights_dtype=None,
    grad: bool = False,
):
    """A LIMITS case: the card's experts on `tokens` tokens routed to `top_k` of `experts` experts.

    Expert ids cycle, so every expert gets rows; forward, and backward too with `grad`.
    """

    def make(card):
        index = (torch.arange(tokens * top_k) % max(experts, 1)).reshape(tokens, top_k).to("npu")
        weights = torch.rand(tokens, top_k).to(weights_dtype or dtype).to("npu")
        x = npu(tokens, hidden, dtype=dtype, grad=grad)
        gate_up = npu(experts, 2 * inner, hidden, dtype=dtype, grad=grad)
        down = npu(experts, hidden, inner, dtype=dtype, grad=grad)

        def run():
            out = card.swiglu_experts(x, index, weights, gate_up, down, F.silu)
            if grad:
                out.float().pow(2).sum().backward()

        def reason():
            return card.swiglu_experts_unavailable_reason(x, index, gate_up, down, F.silu, top_k_weights=weights)

        return run, reason

    return make


LIMITS = {
    "1 token (at the limit)": _experts(tokens=1, grad=True),
    "no tokens (past it)": _experts(tokens=0, grad=True),
    "1 expert: a counts list of length 1, sent as its cumsum": _experts(experts=1, grad=True),
    "2 experts: counts": _experts(experts=2, grad=True),
    "1024 experts (at the limit)": _experts(tokens=8, experts=1024, hidden=2, inner=1),
    "1025 experts (past it)": _experts(tokens=8, experts=1025, hidden=2, inner=1),
    "hidden 65535 (at the inner limit)": _experts(tokens=2, experts=2, hidden=65535, inner=1, dtype=torch.bfloat16),
    "hidden 65536 (past it)": _experts(tokens=2, experts=2, hidden=65536, inner=1, dtype=torch.bfloat16),
    "2 * intermediate 65534 (at the inner limit: dx's grad)": _experts(
        tokens=2, experts=2, hidden=1, inner=32767, grad=True
    ),
    "2 * intermediate 65536 (past it)": _experts(tokens=2, experts=2, hidden=1, inner=32768, grad=True),
    "hidden 1 with grad": _experts(hidden=1, grad=True),
    "hidden 0 (the backward ops refuse empty sizes)": _experts(hidden=0, grad=True),
    "top-k 1 (at the lower limit)": _experts(top_k=1, grad=True),
    "top-k 0 (past it)": _experts(top_k=0, grad=True),
    "top-k 512 (at the limit)": _experts(tokens=2, experts=512, top_k=512, hidden=2, inner=1),
    "top-k 513 (past it)": _experts(tokens=2, experts=513, top_k=513, hidden=2, inner=1),
    "16777214 token copies (at the sort limit)": _experts(
        tokens=16777214, experts=2, top_k=1, hidden=1, inner=1, dtype=torch.bfloat16
    ),
    "16777215 token copies (past it)": _experts(
        tokens=16777215, experts=2, top_k=1, hidden=1, inner=1, dtype=torch.bfloat16
    ),
    "float32 routing weights with bfloat16 tokens": _experts(
        dtype=torch.bfloat16, weights_dtype=torch.float32, grad=True
    ),
    "float64 routing weights (unpermute's probs refuse them)": _experts(weights_dtype=torch.float64, grad=True),
    "float64 tokens": _experts(dtype=torch.float64),
}


MAX_FORM_EXPERTS = 16
"""The experts a form runs at most: enough for grouped rows of every size, and a float64 reference of a few GB at
most at real widths (the op's math is per expert: more experts add calls of the same shapes)."""


def _experts_tensors(widths: Widths, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Tokens routed to `top_k` distinct experts each, softmax weights, and the experts' weights."""
    experts = min(widths.experts, MAX_FORM_EXPERTS)
    top_k = min(widths.top_k, experts)
    hidden, inner, tokens = widths.hidden, widths.moe_intermediate or widths.intermediate, widths.tokens
    index = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    return {
        "hidden_states": randn(tokens, hidden, generator=generator),
        "top_k_index": index,
        "top_k_weights": randn(tokens, top_k, generator=generator).softmax(-1),
        "gate_up_proj": randn(experts, 2 * inner, hidden, generator=generator, scale=hidden**-0.5),
        "down_proj": randn(experts, hidden, inner, generator=generator, scale=inner**-0.5),
    }


def _experts_call(function: str):
    def call(card, t):
        return getattr(card, function)(
            t["hidden_states"], t["top_k_index"], t["top_k_weights"], t["gate_up_proj"], t["down_proj"], F.silu
        )

    return call


FORMS = {
    "SwiGLU experts (permute, grouped matmuls, unpermute)": Form(
        layers=("SwiGLUExperts",),
        make=_experts_tensors,
        fused=_experts_call("swiglu_experts"),
        eager=_experts_call("swiglu_experts_eager"),
        reason=lambda card, t: card.swiglu_experts_unavailable_reason(
            t["hidden_states"], t["top_k_index"], t["gate_up_proj"], t["down_proj"], F.silu, t["top_k_weights"]
        ),
        grads=("hidden_states", "top_k_weights", "gate_up_proj", "down_proj"),
        applies=lambda widths: widths.experts > 0,
        flops=lambda widths: 6.0 * widths.tokens * widths.top_k * 3 * widths.hidden * widths.moe_intermediate,
    )
}
