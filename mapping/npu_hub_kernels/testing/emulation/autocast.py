"""`torch.autocast("npu")` on the emulated device: torch_npu's autocast policy for aten ops.

torch_npu registers kernels for torch's `AutocastPrivateUse1` dispatch key: a fallthrough for every
op, and a cast policy for a list of aten ops (the same policies torch gives CUDA); docs/torch-npu-ops.md,
section "Autocast, pinned memory, RNG state", lists them with the source. Without these, every op on
an npu tensor inside `torch.autocast("npu")` fails ("Could not run ... with arguments from the
'Autocastnpu' backend").
The same policies are registered here for the emulated device:

- lower precision: matmuls, linear, convolutions, attention: floating-point npu inputs (not float64)
  cast to the autocast dtype;
- float32: pointwise ops that lose range (exp, log, pow, rsqrt, ...), norms, losses: cast to float32;
- float32 output dtype: softmax, log_softmax, sum, prod, cumsum, cumprod, vector/matrix norms get
  `dtype=float32` unless the caller gave one, when their first input is an npu float tensor;
- norm with a p: called with `dtype=float32`;
- promote: ops mixing several inputs (addcmul, addcdiv, atan2, dot, index_put, scatter_add, ...) run
  in the widest floating dtype among their npu inputs;
- binary_cross_entropy raises, as on the device and on CUDA.

Everything else, the torch_npu ops included (npu_rms_norm, npu_swiglu, npu_grouped_matmul, ...), runs
in the dtypes it is given. One difference from torch: torch caches the low-precision copy of an fp32
leaf weight for the rest of the autocast region; here every use casts again (the same values).
`autocast_arguments` gives the arguments an op's kernel gets under autocast, for code that stands in for
an op above the dispatcher (the bench's counted stand-ins).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map

_KEY = "AutocastPrivateUse1"
_EXCLUDED = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

LOWER_PRECISION = (
    "_convolution.deprecated",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d.input",
    "conv_transpose3d.input",
    "convolution",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "linalg_multi_dot",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
)
FLOAT32 = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "pow.Scalar",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "group_norm",
    "frobenius_norm.dim",
    "nuclear_norm",
    "nuclear_norm.dim",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
)
FLOAT32_OUTPUT_DTYPE = (
    "prod",
    "prod.dim_int",
    "softmax.int",
    "log_softmax.int",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "linalg_matrix_norm.str_ord",
    "sum",
    "sum.dim_IntList",
)
FLOAT32_APPENDED_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
"""norm overloads -> the overload with a dtype argument they are called as."""
PROMOTE = (
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
)


def _overload(name: str):
    op_name, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, op_name, None)
    return None if packet is None else getattr(packet, overload or "default", None)


def _eligible(value) -> bool:
    """What torch's autocast casts: floating-point tensors on the autocast device, float64 excepted."""
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.device.type == "npu"
        and value.dtype != torch.float64
    )


def _cast(dtype: torch.dtype, args, kwargs):
    def cast(value):
        return value.to(dtype) if _eligible(value) and value.dtype != dtype else value

    return tree_map(cast, args), tree_map(cast, kwargs)


def _first_tensor_eligible(args) -> bool:
    first = next((v for v in tree_flatten(args)[0] if isinstance(v, torch.Tensor)), None)
    return _eligible(first)


def autocast_arguments(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments aten op `name` runs with under the current `torch.autocast("npu")`: cast as its policy casts them.

    For code that stands in for an op above the dispatcher, which autocast never reaches (the bench's counted
    stand-ins for fused ops): it casts what the device's autocast would cast before the kernel, each cast an op of
    its own. Outside autocast, and for an op autocast passes through (every torch_npu op), the arguments are returned
    as they are. An op of a policy that is not a plain cast (float32 output dtype, promote) raises: no stand-in has one.
    """
    if not torch.is_autocast_enabled("npu"):
        return args, kwargs
    if name in LOWER_PRECISION:
        return _cast(torch.get_autocast_dtype("npu"), args, kwargs)
    if name in FLOAT32:
        return _cast(torch.float32, args, kwargs)
    if name in (*FLOAT32_OUTPUT_DTYPE, *FLOAT32_APPENDED_DTYPE, *PROMOTE, "binary_cross_entropy"):
        raise NotImplementedError(f"autocast_arguments: {name}'s autocast policy is not a plain cast")
    return args, kwargs


def _lower_precision(op):
    def kernel(*args, **kwargs):
        args, kwargs = _cast(torch.get_autocast_dtype("npu"), args, kwargs)
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDED):
            return op(*args, **kwargs)

    return kernel


def _float32(op):
    def kernel(*args, **kwargs):
        args, kwargs = _cast(torch.float32, args, kwargs)
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDED):
            return op(*args, **kwargs)

    return kernel


def _float32_output_dtype(op):
    dtype_index = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dtype")

    def kernel(*args, **kwargs):
        given = args[dtype_index] if len(args) > dtype_index else kwargs.get("dtype")
        if given is None and _first_tensor_eligible(args):
            if len(args) > dtype_index:
                args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1 :])
            else:
                kwargs = {**kwargs, "dtype": torch.float32}
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDED):
            return op(*args, **kwargs)

    return kernel


def _float32_appended_dtype(op, with_dtype):
    def kernel(*args, **kwargs):
        dtype = torch.float32 if _eligible(args[0]) else args[0].dtype
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDED):
            return with_dtype(*args, **kwargs, dtype=dtype)

    return kernel


def _promote(op):
    def kernel(*args, **kwargs):
        widest = torch.get_autocast_dtype("npu")
        for value in tree_flatten((args, kwargs))[0]:
            if _eligible(value):
                widest = torch.promote_types(widest, value.dtype)
        args, kwargs = _cast(widest, args, kwargs)
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDED):
            return op(*args, **kwargs)

    return kernel


def _binary_cross_entropy_banned(*args, **kwargs):
    raise RuntimeError(
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast. Combine the "
        "sigmoid and the loss with torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss, "
        "which are safe to autocast."
    )


_LIBRARIES: list[torch.library.Library] = []


def install_autocast() -> None:
    """Register the npu autocast policy (once per process)."""
    if _LIBRARIES:
        return
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, _KEY)
    aten = torch.library.Library("aten", "IMPL")
    policies = [(LOWER_PRECISION, _lower_precision), (FLOAT32, _float32), (FLOAT32_OUTPUT_DTYPE, _float32_output_dtype)]
    policies += [(PROMOTE, _promote)]
    for names, policy in policies:
        for name in names:
            op = _overload(name)
            if op is not None:  # ops this torch build lacks (e.g. cudnn ones) have nothing to cast
                aten.impl(name, policy(op), _KEY)
    for name, with_dtype in FLOAT32_APPENDED_DTYPE.items():
        aten.impl(name, _float32_appended_dtype(_overload(name), _overload(with_dtype)), _KEY)
    aten.impl("binary_cross_entropy", _binary_cross_entropy_banned, _KEY)
    _LIBRARIES.extend((fallthrough, aten))
