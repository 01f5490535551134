"""npu-fused-attention's cases: its ops' rules (`CASES`), the card at and just past each limit (`LIMITS`), its forms.

The grad's refusals are calls of the grad op itself (`npu_fusion_attention_grad`, what the autograd node calls), with
the forward's results but for the argument each case breaks; its accepted calls go through the op's autograd node.
The CANN gates run under the CANN release just below the gate and put the reported release back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..forms import Form, Widths, randn
from . import made_at_first_use, npu, on_cann, torch_npu

BF16, F16, F64 = torch.bfloat16, torch.float16, torch.float64


def _attention(q, k, v, head_num, layout, backward=False, **options):
    """npu_fusion_attention, then its backward through the op's autograd node when asked."""
    out = torch_npu.npu_fusion_attention(q, k, v, head_num, layout, **options)
    if backward:
        out[0].float().sum().backward()
    return out


def _bnsd(b=1, n=2, nkv=1, sq=4, skv=4, d=8, dv=None, dtype=torch.float32, grad=False):
    """query [b, n, sq, d], key [b, nkv, skv, d] and value [b, nkv, skv, dv] on the npu."""
    return (
        npu(b, n, sq, d, dtype=dtype, grad=grad),
        npu(b, nkv, skv, d, dtype=dtype, grad=grad),
        npu(b, nkv, skv, dv or d, dtype=dtype, grad=grad),
    )


def _tnd(tq=4, tkv=4, n=2, nkv=1, d=8, grad=False):
    """query [tq, n, d], key and value [tkv, nkv, d] on the npu."""
    return npu(tq, n, d, grad=grad), npu(tkv, nkv, d, grad=grad), npu(tkv, nkv, d, grad=grad)


def _run(shapes=None, head_num=2, layout="BNSD", backward=False, **options):
    q, k, v = shapes if shapes is not None else _bnsd(grad=backward)
    return _attention(q, k, v, head_num, layout, backward=backward, **options)


def _varlen(q_ends, kv_ends, tq=4, tkv=4, **options):
    return _run(_tnd(tq, tkv), layout="TND", actual_seq_qlen=q_ends, actual_seq_kvlen=kv_ends, **options)


def _compressed(transposed: bool = False) -> torch.Tensor:
    """The compressed 2048 x 2048 mask of sparse modes 2-4 (masked above the diagonal), or its transpose."""
    upper = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    return (upper.t() if transposed else upper).to("npu")


def _mask(*shape: int, masked_row: int | None = None) -> torch.Tensor:
    """A bool mask masking above the diagonal (each row keeps key 0), with every key of `masked_row` masked."""
    mask = torch.ones(shape[-2:], dtype=torch.bool).triu(1).expand(shape).clone()
    if masked_row is not None:
        mask[..., masked_row, :] = True
    return mask.to("npu")


def _under_cann(version: str, call: Callable[[], object]) -> None:
    """`call()` on a host reporting CANN `version` (`on_cann`)."""
    with on_cann(version):
        call()


def _grad(**overrides) -> None:
    """npu_fusion_attention_grad on a BNSD call's results, with `overrides` in place of what the node would hand it."""
    q, k, v = _bnsd(dtype=F16)
    out, softmax_max, softmax_sum, softmax_out, seed, offset, numels = _run((q, k, v), scale=0.3)
    arguments = dict(
        query=q, key=k, value=v, dy=torch.ones_like(out), head_num=2, input_layout="BNSD", softmax_max=softmax_max,
        softmax_sum=softmax_sum, softmax_in=softmax_out, attention_in=out, scale_value=0.3, seed=seed, offset=offset,
        numels=numels,
    )  # fmt: skip
    arguments.update(overrides)
    torch_npu.npu_fusion_attention_grad(**arguments)


CASES = {
    "npu_fusion_attention/actual-seq-ints": (
        lambda: _varlen([2, 4], [1, 4]),
        lambda: _varlen(torch.tensor([2, 4]), [1, 4]),
    ),
    "npu_fusion_attention/head-num": (
        lambda: _run(_bnsd(n=1), head_num=1),
        lambda: _run(_bnsd(n=1), head_num=0),
    ),
    "npu_fusion_attention/rank": (
        lambda: _run((npu(1, 4, 16), npu(1, 4, 8), npu(1, 4, 8)), layout="BSH"),
        lambda: _run((npu(1, 1, 2, 4, 8), npu(1, 1, 4, 8), npu(1, 1, 4, 8))),
    ),
    "npu_fusion_attention/keep-prob": (
        lambda: _run(keep_prob=1.0, backward=True),
        lambda: _run(keep_prob=0.0),
    ),
    "npu_fusion_attention/layout": (
        lambda: _run((npu(4, 1, 16), npu(4, 1, 8), npu(4, 1, 8)), layout="SBH"),
        lambda: _run(layout="bnsd"),
    ),
    "npu_fusion_attention/softmax-layout": (
        lambda: _varlen([2, 4], [1, 4], softmax_layout="TND"),
        lambda: _run(softmax_layout="TND"),
    ),
    "npu_fusion_attention/sparse-mode": (
        lambda: _run(atten_mask=_compressed(), sparse_mode=4, pre_tockens=1, next_tockens=0),
        lambda: _run(atten_mask=_compressed(), sparse_mode=7),
    ),
    "npu_fusion_attention/actual-seq-tnd": (
        lambda: _varlen([4], [4]),
        lambda: _varlen([2, 4], [4]),
    ),
    "npu_fusion_attention/actual-seq-tnd-only": (
        lambda: _run(actual_seq_qlen=None, actual_seq_kvlen=None),
        lambda: _run(actual_seq_qlen=[4], actual_seq_kvlen=[4]),
    ),
    "npu_fusion_attention/dtype": (
        lambda: _run(_bnsd(dtype=BF16)),
        lambda: _run(_bnsd(dtype=F64)),
    ),
    "npu_fusion_attention/same-dtype": (
        lambda: _run(_bnsd(dtype=F16)),
        lambda: _run((npu(1, 2, 4, 8, dtype=F16), npu(1, 1, 4, 8, dtype=BF16), npu(1, 1, 4, 8, dtype=F16))),
    ),
    "npu_fusion_attention/layout-rank": (
        lambda: _run((npu(1, 4, 2, 8), npu(1, 4, 1, 8), npu(1, 4, 1, 8)), layout="BSND"),
        lambda: _run((npu(1, 4, 16), npu(1, 4, 8), npu(1, 4, 8)), layout="BSND"),
    ),
    "npu_fusion_attention/hidden-split": (
        lambda: _run((npu(1, 4, 16), npu(1, 4, 8), npu(1, 4, 4)), layout="BSH"),
        lambda: _run((npu(1, 4, 16), npu(1, 4, 8), npu(1, 4, 8)), head_num=3, layout="BSH"),
    ),
    "npu_fusion_attention/head-num-matches": (
        lambda: _run(_bnsd(n=4), head_num=4),
        lambda: _run(_bnsd(n=2), head_num=4),
    ),
    "npu_fusion_attention/batch": (
        lambda: _run(_bnsd(b=2)),
        lambda: _run((npu(1, 2, 4, 8), npu(2, 1, 4, 8), npu(2, 1, 4, 8))),
    ),
    "npu_fusion_attention/kv-shape": (
        lambda: _run(_bnsd(dv=4, grad=True), backward=True),
        lambda: _run((npu(1, 2, 4, 8), npu(1, 1, 4, 8), npu(1, 1, 5, 8))),
    ),
    "npu_fusion_attention/head-dim": (
        lambda: _run(_bnsd(n=1, sq=1, skv=1, d=768), head_num=1),
        lambda: _run(_bnsd(n=1, sq=1, skv=1, d=769), head_num=1),
    ),
    "npu_fusion_attention/heads": (
        lambda: _run(_bnsd(n=6, nkv=2), head_num=6),
        lambda: _run(_bnsd(n=3, nkv=2), head_num=3),
    ),
    "npu_fusion_attention/batch-limit": (
        lambda: _run(_bnsd(b=1)),
        lambda: _run(_bnsd(b=0)),
    ),
    "npu_fusion_attention/seq-limit": (
        lambda: _run(_bnsd(sq=1, skv=1)),
        lambda: _run(_bnsd(sq=0)),
    ),
    "npu_fusion_attention/tokens-limit": (
        lambda: _varlen([1], [1], tq=1, tkv=1),
        lambda: _varlen([0], [0], tq=0, tkv=0),
    ),
    "npu_fusion_attention/actual-seq-count": (
        lambda: _varlen([4] + [0] * 1023, [4] + [0] * 1023),  # 1024 entries, the trailing zeros skipping batches
        lambda: _varlen([4] + [0] * 1024, [4] + [0] * 1024),
    ),
    "npu_fusion_attention/actual-seq-cumulative": (
        lambda: _varlen([2, 2, 4], [1, 3, 4]),  # a zero-length query segment
        lambda: _varlen([2, 2], [2, 2]),  # lengths, not cumulative ends
    ),
    "npu_fusion_attention/atten-mask-dtype": (
        lambda: _run(atten_mask=_mask(4, 4).to(torch.uint8)),
        lambda: _run(atten_mask=_mask(4, 4).half()),
    ),
    "npu_fusion_attention/atten-mask-compressed": (
        lambda: _run(atten_mask=_compressed(), sparse_mode=3, backward=True),
        lambda: _run(atten_mask=_mask(4, 4), sparse_mode=3),
    ),
    "npu_fusion_attention/atten-mask-triu": (
        lambda: _run(atten_mask=_compressed(), sparse_mode=2),
        lambda: _run(atten_mask=_compressed(transposed=True), sparse_mode=2),
    ),
    "npu_fusion_attention/atten-mask-shape": (
        lambda: _run(atten_mask=_mask(1, 1, 4, 4), backward=True),
        lambda: _run(atten_mask=_mask(4, 5)),
    ),
    "npu_fusion_attention/causal-rows": (
        lambda: _run(_bnsd(sq=4, skv=4), atten_mask=_compressed(), sparse_mode=3),
        lambda: _run(_bnsd(sq=5, skv=4), atten_mask=_compressed(), sparse_mode=3),
    ),
    "npu_fusion_attention/band": (
        lambda: _run(atten_mask=_compressed(), sparse_mode=4, pre_tockens=0, next_tockens=0),
        lambda: _run(atten_mask=_compressed(), sparse_mode=4, pre_tockens=-1, next_tockens=0),
    ),
    "npu_fusion_attention/varlen-rows": (
        lambda: _varlen([2, 4], [2, 4], atten_mask=_mask(2, 2)),
        lambda: _varlen([2, 4], [2, 4], atten_mask=_mask(2, 2, masked_row=1)),
    ),
    "npu_fusion_attention/padding-mask": (
        lambda: _run(padding_mask=None),
        lambda: _run(padding_mask=_mask(4, 4)),
    ),
    "npu_fusion_attention/pse-modes": (
        lambda: _varlen([4], [4], atten_mask=_compressed(), sparse_mode=3),
        lambda: _varlen([4], [4], atten_mask=_compressed(), sparse_mode=7, pse=npu(1, 2, 4, 4)),
    ),
    "npu_fusion_attention/prefix-batch": (
        lambda: _run(_bnsd(b=32)),
        lambda: _run(_bnsd(b=33), sparse_mode=6, prefix=[4] * 33),
    ),
    "npu_fusion_attention/sink": (
        lambda: _run(_bnsd(grad=True), sink=npu(2, grad=True), backward=True),
        lambda: _run(sink=npu(2, dtype=BF16)),
    ),
    "npu_fusion_attention/sink-cann": (
        lambda: _under_cann("8.5.0", lambda: _run(sink=npu(2))),
        lambda: _under_cann("8.3.RC1", lambda: _run(sink=npu(2))),
    ),
    "npu_fusion_attention/softmax-layout-cann": (
        lambda: _under_cann("8.3.RC1", lambda: _varlen([4], [4], softmax_layout="TND")),
        lambda: _under_cann("8.2.RC1", lambda: _varlen([4], [4], softmax_layout="TND")),
    ),
    "npu_fusion_attention_grad/rank": (
        lambda: _grad(),
        lambda: _grad(dy=npu(8, 16, dtype=F16)),
    ),
    "npu_fusion_attention_grad/keep-prob": (
        lambda: _grad(keep_prob=1.0),
        lambda: _grad(keep_prob=1.5),
    ),
    "npu_fusion_attention_grad/sparse-mode": (
        lambda: _grad(sparse_mode=0),
        lambda: _grad(sparse_mode=7),
    ),
    "npu_fusion_attention_grad/layout": (
        lambda: _grad(input_layout="BNSD"),
        lambda: _grad(input_layout="NBSD"),
    ),
    "npu_fusion_attention_grad/dy": (
        lambda: _grad(dy=npu(1, 2, 4, 8, dtype=F16)),
        lambda: _grad(dy=npu(1, 2, 4, 8)),
    ),
    "npu_fusion_attention_grad/softmax-stats": (
        lambda: _grad(softmax_max=npu(1, 2, 4, 8)),
        lambda: _grad(softmax_max=npu(1, 2, 4, 1)),
    ),
}


def _card_case(
    heads=4, kv_heads=2, q_len=8, kv_len=None, head_dim=16, value_dim=None, dtype=torch.float32, mask=None, **options
):
    """The card's `fused_attention` forward and backward (and its reason) for a Llama attention module of these heads.

    query is [2, heads, q_len, head_dim], key/value [2, kv_heads, kv_len, head_dim or value_dim]. `mask`: a function
    of the key length giving a padding mask, which goes through the card's mask function as transformers hands it
    (causal, with the window of `sliding_window` if given)."""

    def make(card):
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaAttention

        # The attention function reads the module's head counts and settings, never its weights or head_dim.
        config = LlamaConfig(hidden_size=2 * heads, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=2)
        with torch.device("meta"):
            module = LlamaAttention(config, layer_idx=0)
        keys = kv_len or q_len
        batch = 1 if "cu_seq_lens_q" in options else 2
        q = npu(batch, heads, q_len, head_dim, dtype=dtype, grad=True)
        k = npu(batch, kv_heads, keys, head_dim, dtype=dtype, grad=True)
        v = npu(batch, kv_heads, keys, value_dim or head_dim, dtype=dtype, grad=True)
        attention_mask = None if mask is None else _card_mask(card, mask(keys), q_len, options.get("sliding_window"))

        def run():
            out, _ = card.fused_attention(module, q, k, v, attention_mask, scaling=head_dim**-0.5, **options)
            out.float().sum().backward()

        return run, lambda: card.fused_attention_unavailable_reason(module, q, k, v, attention_mask, **options)

    return make


def _card_mask(card, padding: torch.Tensor, q_len: int, window: int | None) -> torch.Tensor:
    """What the card's mask function returns for a causal self-attention (the queries the last keys) with padding."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    keys = padding.shape[1]
    return card.fused_attention_mask(
        batch_size=padding.shape[0],
        q_length=q_len,
        kv_length=keys,
        q_offset=keys - q_len,
        mask_function=causal_mask_function if window is None else sliding_window_causal_mask_function(window),
        attention_mask=padding,
        device=padding.device,
    )


def _left_padding(keys: int) -> torch.Tensor:
    """A (2, keys) padding mask: row 0 has three pad tokens on the left, row 1 none."""
    mask = torch.ones(2, keys, dtype=torch.bool)
    mask[0, :3] = False
    return mask.to("npu")


def _packed(sequences: int) -> dict[str, object]:
    """cu_seq_lens of `sequences` packed sequences of one token each (one row)."""
    ends = torch.arange(sequences + 1, dtype=torch.int32).to("npu")
    return {"cu_seq_lens_q": ends, "cu_seq_lens_k": ends, "max_length_q": 1, "max_length_k": 1}


def _limits() -> dict:
    """`LIMITS`, made at first use (`made_at_first_use`): the packed cases hold npu tensors made once."""
    return {
        "causal prefill (BSND, sparse_mode 3)": _card_case(),
        "decode: one query over eight keys (bottom-right causal)": _card_case(q_len=1, kv_len=8),
        "more queries than keys (mode 3 takes Sq <= Skv)": _card_case(q_len=8, kv_len=4),
        "head dim 768 (the op's largest)": _card_case(heads=1, kv_heads=1, q_len=2, head_dim=768),
        "head dim 769 (one more)": _card_case(heads=1, kv_heads=1, q_len=2, head_dim=769),
        "value head dim above the key's (Dv > Dk)": _card_case(head_dim=8, value_dim=16),
        "256 query heads over one key head (the most, MQA)": _card_case(heads=256, kv_heads=1, q_len=2, head_dim=2),
        "257 query heads (one more)": _card_case(heads=257, kv_heads=1, q_len=2, head_dim=2),
        "float64 (not a dtype of the op)": _card_case(dtype=torch.float64),
        "left padding (TND, actual_seq lists)": _card_case(mask=_left_padding),
        "a sliding window of 4 (sparse_mode 4)": _card_case(sliding_window=4),
        "a sliding window of 4 with padding (TND, mode 4)": _card_case(mask=_left_padding, sliding_window=4),
        "1024 packed sequences (varlen's most)": _card_case(
            heads=1, kv_heads=1, q_len=1024, head_dim=2, **_packed(1024)
        ),
        "1025 packed sequences (one more)": _card_case(heads=1, kv_heads=1, q_len=1025, head_dim=2, **_packed(1025)),
    }


__getattr__ = made_at_first_use(globals(), LIMITS=_limits)


def _attention_module(widths: Widths) -> torch.nn.Module:
    """A Llama attention module of the model's widths on the meta device, without weights.

    The attention function reads only is_causal, num_key_value_groups, training and its modeling file's eager
    function of it."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    config = LlamaConfig(
        hidden_size=widths.heads * widths.head_dim, num_attention_heads=widths.heads,
        num_key_value_heads=widths.kv_heads, head_dim=widths.head_dim,
    )  # fmt: skip
    with torch.device("meta"):
        return LlamaAttention(config, layer_idx=0).train()


def _attention_form(sliding_window: int | None = None) -> Form:
    """Causal self-attention of one sequence (q [1, Nq, S, D], k and v [1, Nkv, S, D]), with a window if given."""

    def make(widths, generator):
        shape = (1, widths.tokens, widths.head_dim)
        return {
            "query": randn(shape[0], widths.heads, *shape[1:], generator=generator),
            "key": randn(shape[0], widths.kv_heads, *shape[1:], generator=generator),
            "value": randn(shape[0], widths.kv_heads, *shape[1:], generator=generator),
            "module": _attention_module(widths),
        }

    def call(function):
        def run(card, t):
            scaling = t["query"].shape[-1] ** -0.5
            out, _ = getattr(card, function)(
                t["module"], t["query"], t["key"], t["value"], None, scaling=scaling, sliding_window=sliding_window
            )
            return out

        return run

    return Form(
        layers=(),
        make=make,
        fused=call("fused_attention"),
        eager=call("fused_attention_eager"),
        reason=lambda card, t: card.fused_attention_unavailable_reason(
            t["module"], t["query"], t["key"], t["value"], None, sliding_window=sliding_window
        ),
        grads=("query", "key", "value"),
        flops=lambda w: 8.0 * w.heads * w.tokens * w.tokens * w.head_dim,
    )


FORMS = {"causal prefill": _attention_form(), "causal, sliding window of 16": _attention_form(sliding_window=16)}
