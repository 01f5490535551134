"""Every private internal of another library a card reads, in one place.

The build copies this file into the cards that list it. For each: what it reads, why, the versions it was checked
against and the public alternative, if any.

A card ships frozen per version to the Hub, so a library release that changes one of these breaks published code:
this internals register is where to look first. tests/test_kernels_compat.py holds every other file of kernel-cards/
to reading them only through the functions below. `INTERNALS` is the register, one entry per function; each entry was
checked against torch 2.13.0, deepspeed 0.19.8, accelerate 1.15.0, transformers 5.22.2 and kernels 0.17.2 (`CHECKED`).
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as torch_module

CHECKED = "torch 2.13.0, deepspeed 0.19.8, accelerate 1.15.0, transformers 5.22.2, kernels 0.17.2"
"""The releases every entry of `INTERNALS` was checked against."""


@dataclass(frozen=True)
class Internal:
    """A register entry: what the function reads, why the cards read it, and the public alternative (or why none)."""

    reads: str
    purpose: str
    public: str


INTERNALS: dict[str, Internal] = {
    "module_hooks": Internal(
        "torch: nn.Module._forward_pre_hooks, _forward_hooks, _backward_pre_hooks, _backward_hooks",
        "a fused path that computes what a module (lm_head, act_fn, a norm) computes without calling it must know "
        "whether hooks would see that call",
        "none: torch registers hooks publicly but lists them only in these dicts",
    ),
    "engine_hook": Internal(
        "deepspeed, torch: the modules DeepSpeed ZeRO-3's and FSDP2's hooks are defined in (`deepspeed.`, "
        "`torch.distributed.fsdp._fully_shard.`), through the hook's __module__",
        "those hooks only gather and release parameters around a call: they may run around a fused call",
        "none",
    ),
    "global_module_hooks": Internal(
        "torch: torch.nn.modules.module._global_{forward_pre,forward,backward_pre,backward}_hooks",
        "hooks registered for every module (register_module_forward_hook: profilers, tracers) must see each call",
        "none: register_module_*_hook registers them, nothing lists them",
    ),
    "instance_forward": Internal(
        "torch, kernels, accelerate: the forward set on a module instance (vars(module)['forward']): kernels' "
        "kernelize binds a layer's forward there (layer._replace_forward), accelerate's add_hook_to_module and "
        "autocast wrapper replace it there",
        "a forward replaced on the instance computes what its replacer computes: the card must call it, not its math",
        "none: `module.forward` does not tell an instance's forward from the class's",
    ),
    "accelerate_hook": Internal(
        "accelerate: the `_hf_hook` attribute add_hook_to_module sets (offload, device placement)",
        "such a module's forward is accelerate's: lm_head must run itself",
        "none",
    ),
    "accelerate_wrapped_forward": Internal(
        "accelerate: the `_original_forward` attribute Accelerator.prepare_model sets when it wraps the model's "
        "forward in its mixed-precision autocast",
        "a kernelize after that replaces the wrapper: the loss card runs the call as the wrapper did",
        "none: accelerate keeps no public record of the wrapper",
    ),
    "norm_weight_and_epsilon": Internal(
        "torch: nn.Module._parameters, read with dict.get, as `parameter` reads it; the module's instance dict "
        "(`__dict__`) for transformers' `variance_epsilon` or `eps`",
        "an RMSNorm layer's weight and epsilon on every call, in one function (a norm's host cost at decode size is a "
        "few of these calls): a name a module lacks, read as an attribute, goes through nn.Module.__getattr__, which "
        "raises and is caught (about 1 us: each Gemma norm's `variance_epsilon`)",
        "`module.weight`, which triggers DeepSpeed's gathering under ZeRO-3 (see `parameter`); "
        "`getattr(module, name, None)`, read when the instance dict holds neither name",
    ),
    "parameter": Internal(
        "torch: nn.Module._parameters, read with dict.get, past DeepSpeed's ZeROOrderedDict.__getitem__",
        "DeepSpeed 0.19.8 gathers a partitioned parameter read through the module's attribute outside its call and "
        "keeps it resident (an external parameter): the loss card reads lm_head's weight without that; the RMSNorm "
        "layers read their weight this way too, past nn.Module.__getattr__ (Python: a third of their host cost)",
        "`module.weight`, which triggers that gathering under ZeRO-3",
    ),
    "zero3_partitioned": Internal(
        "deepspeed: a ZeRO-3 parameter's `ds_status` (ZeroParamStatus, by name)",
        "a partitioned weight holds no data here: the fused op cannot read it",
        "none: deepspeed.zero.GatheredParameters gathers, it does not say whether a gather is needed",
    ),
    "zero3_gathered": Internal(
        "deepspeed: a ZeRO-3 parameter's `ds_id` and `ds_shape`",
        "npu-swiglu reads its projections' weights: only when ZeRO-3 gathered them whole",
        "none",
    ),
    "fsdp2_original_class": Internal(
        "torch: the `_orig_cls_mro_index` fully_shard puts on the class it makes (FSDP<cls>)",
        "the class whose forward an FSDP2 unit runs (lm_head's nn.Linear)",
        "none: FSDPModule names no original class",
    ),
    "fsdp2_output_dtype": Internal(
        "torch: fully_shard.state(module)._mp_policy.output_dtype",
        "an FSDP2 unit whose MixedPrecisionPolicy casts its output would cast the loss, not the logits",
        "none: the policy given to fully_shard is not kept publicly",
    ),
    "modeling_global": Internal(
        "transformers: a global of a class's modeling module (load_balancing_loss_func), through its forward's "
        "__globals__ past its decorators",
        "the MoE loss layers add the router's auxiliary loss with the function the class's forward calls",
        "none: transformers does not export each modeling module's function under one name",
    ),
    "closure_values": Internal(
        "transformers: the closure variables of a mask function masking_utils composed (and_masks' mask_functions, "
        "sliding_window_overlay's sliding_window, packed_sequence_mask_function's packed_sequence_mask, "
        "padding_mask_function's padding_mask), through __code__.co_freevars and __closure__",
        "the attention card fuses only the compositions it can read back into the primitives the op computes; the "
        "window size and the packed or padding tensors live only in those closures",
        "none: masking_utils hands mask functions as closures and keeps no description of them",
    ),
    "device_has_kernel": Internal(
        "torch: torch._C._dispatch_has_kernel_for_dispatch_key(<aten op>, 'PrivateUse1'), the dispatcher's table",
        "whether this torch_npu registers an aten overload for the npu (addmm.dtype_out, from torch_npu 2.11): the "
        "loss card's weight gradient calls it only then, and says why not otherwise",
        "none: calling the op and catching its error would cost a failed device call, and torch_npu's version does "
        "not say which op-plugin overloads a build carries",
    ),
    "storage_holders": Internal(
        "torch: torch._C._storage_Use_Count(<storage>._cdata), the number of holders of a tensor's storage",
        "npu-rope rotates q and k in place in inference mode only when nothing else holds their memory: a forward hook "
        "that kept q_proj's output (activation capture, steering) would see it rotated",
        "none: torch has no public query of who shares a storage (in inference mode a view keeps no `_base`)",
    ),
    "functorch_transform": Internal(
        "torch: torch._C._functorch.peek_interpreter_stack() and its key(), the innermost active torch.func transform",
        "the fused paths are custom autograd Functions around device ops that torch.func does not transform: under "
        "grad, vmap or jvp the cards run eager's math, which torch.func transforms as it does eager's",
        "none: torch.func has no public query of the active transforms",
    ),
}

HOOK_KINDS = ("forward_pre", "forward", "backward_pre", "backward")
ENGINE_HOOK_PACKAGES = ("deepspeed.", "torch.distributed.fsdp._fully_shard.")
_HOOK_DICTS = {kind: f"_{kind}_hooks" for kind in HOOK_KINDS}
"""The attribute of each kind's hooks, named once: the hooks are looked at on every fused call of several cards."""
_GLOBAL_HOOK_DICTS = tuple(f"_global{name}" for name in _HOOK_DICTS.values())


def module_hooks(module: object, kinds: tuple[str, ...] = HOOK_KINDS) -> list:
    """The hooks registered on `module`'s own call, of the given kinds (none for a function)."""
    if not isinstance(module, nn.Module):
        return []
    return [hook for kind in kinds for hook in getattr(module, _HOOK_DICTS[kind]).values()]


def engine_hook(hook: object) -> bool:
    """Whether a hook is one DeepSpeed ZeRO-3 or FSDP2 puts on the modules it manages."""
    return (getattr(hook, "__module__", None) or "").startswith(ENGINE_HOOK_PACKAGES)


def global_module_hooks() -> bool:
    """Whether hooks for every module's call are registered (torch.nn.modules.module.register_module_*_hook)."""
    return any(getattr(torch_module, name) for name in _GLOBAL_HOOK_DICTS)


def instance_forward(module: object) -> object | None:
    """The forward set on `module` itself (kernelize's binding, or another library's replacement), or None."""
    return vars(module).get("forward") if hasattr(module, "__dict__") else None


def accelerate_hook(module: nn.Module) -> bool:
    """Whether accelerate's add_hook_to_module put its hook on `module`."""
    return hasattr(module, "_hf_hook")


def accelerate_wrapped_forward(module: nn.Module) -> bool:
    """Whether accelerate wrapped `module`'s forward in its mixed-precision autocast (keeping the one it wrapped)."""
    return "_original_forward" in vars(module)


def parameter(module: nn.Module, name: str) -> torch.Tensor | None:
    """`module`'s parameter `name` as the module holds it, without DeepSpeed's gathering read (see INTERNALS)."""
    return dict.get(module._parameters, name)


def norm_weight_and_epsilon(norm: nn.Module) -> tuple[torch.Tensor, float | None]:
    """An RMSNorm's weight and epsilon, as its layer reads them on every call (epsilon None when it has neither name).

    The weight is its parameter, read as `parameter` reads it, else its `weight` attribute (a buffer, as Gemma3n's
    without scale): through the attribute (`nn.Module.__getattr__`, Python) it is a third of a fused call's host cost
    at decode size. The epsilon is what transformers names `variance_epsilon` (Llama family) or `eps` (Gemma family),
    each norm one of the two, set on the instance in its __init__: the instance's own `variance_epsilon`, else its own
    `eps`; only when it holds neither, the attribute `variance_epsilon`, else `eps` (a class attribute, a property, a
    buffer). A module holding `eps` itself and `variance_epsilon` elsewhere gets its `eps` (no transformers norm does).
    """
    weight = dict.get(norm._parameters, "weight")
    attributes = norm.__dict__
    eps = attributes.get("variance_epsilon")
    if eps is None:
        eps = attributes.get("eps")
        if eps is None:  # a class attribute or property, or neither name
            eps = getattr(norm, "variance_epsilon", None)
            eps = getattr(norm, "eps", None) if eps is None else eps
    return (norm.weight if weight is None else weight), eps


def zero3_partitioned(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a DeepSpeed ZeRO-3 parameter that is not gathered here."""
    status = getattr(tensor, "ds_status", None)
    return status is not None and status.name != "AVAILABLE"


def zero3_gathered(tensor: torch.Tensor) -> bool | None:
    """None for a tensor DeepSpeed ZeRO-3 does not manage; else whether it is gathered whole here."""
    if not hasattr(tensor, "ds_id"):
        return None
    return tuple(tensor.shape) == tuple(getattr(tensor, "ds_shape", ()))


def fsdp2_original_class(module: nn.Module) -> type:
    """Return the class whose forward `module` runs, FSDP2's wrapping class aside.

    That is its own, or under FSDP2 (`fully_shard` makes its class a subclass `FSDP<cls>` of FSDPModule and cls, which
    adds no forward) that cls."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # imported wherever fully_shard ran
    if fsdp is not None and isinstance(module, fsdp.FSDPModule):
        return type(module).__mro__[type(module)._orig_cls_mro_index]
    return type(module)


def fsdp2_output_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype FSDP2 casts `module`'s output to (its MixedPrecisionPolicy's output_dtype) when it is a unit."""
    if fsdp2_original_class(module) is type(module):
        return None
    return sys.modules["torch.distributed.fsdp"].fully_shard.state(module)._mp_policy.output_dtype


def modeling_global(cls: type, name: str) -> object:
    """The global `name` as `cls.forward` resolves it, in its own modeling module (past the decorators that wrap it)."""
    return inspect.unwrap(cls.forward).__globals__[name]


def closure_values(function: object) -> dict[str, object]:
    """The closure variables of `function` by name (empty for a function with none), as it captured them."""
    code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None) or ()
    if code is None:
        return {}
    return dict(zip(code.co_freevars, (cell.cell_contents for cell in cells), strict=True))


def device_has_kernel(overload: str) -> bool:
    """Whether the npu device (torch's PrivateUse1) has a kernel of the aten op `overload` ("addmm.dtype_out")."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{overload}", "PrivateUse1")
    except RuntimeError:  # a torch without that overload
        return False


def storage_holders(tensor: torch.Tensor) -> int:
    """How many tensors (views included) and storage objects hold `tensor`'s storage: 1 when `tensor` alone does."""
    storage = tensor.untyped_storage()  # a holder while it lives: not counted
    return torch._C._storage_Use_Count(storage._cdata) - 1


_peek_interpreter_stack = torch._C._functorch.peek_interpreter_stack
"""Read on every fused call of most cards: bound once, not looked up through three modules per call."""


def functorch_transform() -> str | None:
    """The innermost active torch.func transform ("grad", "vmap", "jvp", "functionalize"), or None outside them."""
    interpreter = _peek_interpreter_stack()
    return None if interpreter is None else interpreter.key().name.lower()
