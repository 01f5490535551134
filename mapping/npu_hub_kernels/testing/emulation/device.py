"""An emulated "npu" device: torch's PrivateUse1 backend, renamed to "npu", backed by CPU memory.

Tensors on it are `NpuTensor` wrappers that report `device.type == "npu"` and run every aten op on
an inner CPU tensor. That is enough for `.to("npu")`, factories with `device="npu"`, autograd, and
for transformers and kernels to believe the model lives on an Ascend device. Mixing npu tensors
with non-scalar CPU tensors raises, as on real hardware, so device bugs are not hidden.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import operator
import os
import sys
import threading
import weakref
from collections import Counter, OrderedDict

import torch
from torch._library.utils import is_builtin
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from .autocast import install_autocast
from .streams import EmulatedNpuStreams, record_stream

# Ops that legitimately take tensors from two devices (copies between host and device).
_CROSS_DEVICE_OPS = {
    torch.ops.aten.copy_.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._copy_from.default,
    torch.ops.aten._copy_from_and_resize.default,
    # `Tensor.to` itself reaches the device, not decomposed, where autograd is off (inference mode)
    torch.ops.aten.to.device,
    torch.ops.aten.to.other,
    torch.ops.aten.to.dtype_layout,
    torch.ops.aten.to.prim_Device,
}

# Advanced indexing, whose index tensors may be on the host: torch_npu moves each one to the indexed tensor's device
# before the kernel runs (Ascend/op-plugin@0a873ce op_plugin/utils/AdvancedIndex.cpp, `npu_expand_tensors` and
# `make_info`, which op_plugin/ops/opapi/IndexKernelNpuOpApi.cpp and IndexPutKernelNpuOpApi.cpp call), as CUDA does.
# transformers' Qwen2.5-VL vision tower indexes its hidden states with a window index it builds on the host.
_HOST_INDICES_OPS = {
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
    torch.ops.aten._index_put_impl_.default,
}


def _histc(x, bins=100, min=0, max=0):
    """histc of any dtype, counted in float64 and returned in `x`'s dtype.

    Accelerators count integer tensors too (transformers' MoE routing does); the CPU kernel takes floating point
    only. Counts of small integers are exact in float64.
    """
    return torch.histc(x.double(), bins=bins, min=min, max=max).to(x.dtype)


HOST_SYNCS: Counter[str] = Counter()
"""The reads that make the host wait for the device, by kind, in this process: "to host" (a copy of npu data to the
host: `.cpu()`, `.tolist()`, `copy_` into a host tensor) and "item" (a scalar read: `.item()`, `bool(t)`, `int(t)`)."""

_DEVICE_KERNELS = {torch.ops.aten.histc.default: _histc, torch.ops.aten.record_stream.default: record_stream}
"""Ops whose npu kernel differs from the host's: run these instead on the host data (the npu tensors' `_cpu`)."""


def register_device_kernel(op: torch._ops.OpOverload, kernel) -> None:
    """Run `kernel` instead of `op` on the host data when `op` gets npu tensors (e.g. collectives on the hccl group)."""
    _DEVICE_KERNELS[op] = kernel


def register_aten_kernel(overload: str, kernel) -> None:
    """Give the device a kernel of its own for the aten op `overload` ("addmm.dtype_out"), as torch_npu registers one.

    npu tensors reach `kernel` with their host data (`register_device_kernel`), and the dispatcher lists it for the
    device (PrivateUse1: what `torch._C._dispatch_has_kernel_for_dispatch_key` answers, as on an Ascend host). Once the
    device is installed."""
    name, _, overload_name = overload.partition(".")
    register_device_kernel(getattr(getattr(torch.ops.aten, name), overload_name or "default"), kernel)
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{overload}", "PrivateUse1"):
        _LIBRARY.impl(overload, kernel, "PrivateUse1")


class NpuTensor(torch.Tensor):
    """A tensor on the emulated npu device; `_cpu` holds its data."""

    _cpu: torch.Tensor

    @staticmethod
    def __new__(cls, cpu: torch.Tensor, requires_grad: bool | None = None) -> NpuTensor:
        if requires_grad is not None:
            # `type(param)(value, requires_grad=...)`, how accelerate's set_module_tensor_to_device remakes a
            # parameter of its class: on a device that class is Parameter's.
            return torch.nn.Parameter(cpu, requires_grad)
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            cpu.shape,
            strides=cpu.stride(),
            storage_offset=cpu.storage_offset(),
            dtype=cpu.dtype,
            device="npu:0",
            requires_grad=False,
        )
        wrapper._cpu = cpu
        _track_storage(cpu)
        return wrapper

    def __repr__(self) -> str:  # type: ignore[override]
        return f"NpuTensor({self._cpu!r}, device='npu:0')"

    # A device tensor has a storage and an address: views of one buffer share them, as on hardware.
    def untyped_storage(self) -> torch.UntypedStorage:  # type: ignore[override]
        return self._cpu.untyped_storage()

    def data_ptr(self) -> int:  # type: ignore[override]
        return self._cpu.data_ptr()

    def __deepcopy__(self, memo):
        """A copy in new device memory, with the same values, layout and what the tensor carries.

        The copy has the same values, sizes, strides and storage offset, and what the tensor carries (requires_grad,
        grad, Parameter flag, attributes). Tensors that shared a buffer share the copy's buffer, as torch's deepcopy
        keeps views of one storage together (the inner host tensors are deep-copied with the same memo). torch's own
        `Tensor.__deepcopy__` would restore the storage onto a 0-d wrapper and leave it 0-d.
        """
        if not self.is_leaf:
            return super().__deepcopy__(memo)  # raises torch's error for non-leaf tensors
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = NpuTensor(copy.deepcopy(self._cpu, memo))
            if self.requires_grad:
                new.requires_grad_()
            if self.grad is not None:
                new.grad = copy.deepcopy(self.grad, memo)
            new.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "_cpu"}, memo))
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, proto):
        """Pickle (torch.save) as a device tensor, not as this Python class.

        Its values are pickled as a host tensor rebuilt on the device at load
        (`torch._utils._rebuild_device_tensor_from_cpu_tensor`, which follows `map_location`), which
        `torch.load(weights_only=True)` accepts, as it accepts a real npu tensor (optimizer states in a Trainer
        checkpoint). A Parameter stays a Parameter.
        """
        if isinstance(self, torch.nn.Parameter):
            return (torch._utils._rebuild_parameter, (self.detach(), self.requires_grad, OrderedDict()))
        args = (self._cpu, self.dtype, str(self.device), self.requires_grad)
        return (torch._utils._rebuild_device_tensor_from_cpu_tensor, args)

    def tolist(self):  # type: ignore[override]
        """A device-to-host read, as `.tolist()` of a device tensor is (tensor subclasses lack it)."""
        _count_host_sync(torch.ops.aten._to_copy.default, (self,), "cpu")
        return self._cpu.tolist()

    @property
    def data(self) -> torch.Tensor:  # type: ignore[override]
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        """`param.data = other` (how nn.Module casts a parameter in place), with the host values following.

        torch copies the tensor's metadata; the values live in `_cpu`, which has to follow.
        """
        torch._C.TensorBase.data.__set__(self, new)  # refuses a host tensor: incompatible tensor type
        self._cpu = new._cpu

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _runs_device_generic_kernel(func):
            # what a device's dispatcher runs for an op with no kernel of its own: the op's device-generic kernel,
            # on the npu tensors themselves (DeepSpeed's Ulysses all-to-all calls its collective from there).
            return func._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args, **kwargs)
        if _has_host_kernel_only(func):
            raise NotImplementedError(
                f"Could not run '{func.name()}' with arguments from the 'PrivateUse1' backend (emulated npu): the "
                "operator has a kernel for the host and none for the npu, so a device's dispatcher refuses it"
            )
        if func in _HOST_INDICES_OPS:  # the indices (args[1]) may be host tensors; the rest is checked
            _check_same_device(func, (args[0], *args[2:]), kwargs)
        elif func not in _CROSS_DEVICE_OPS:
            _check_same_device(func, args, kwargs)
        target = _target_device(func, args, kwargs)
        _count_host_sync(func, args, target)
        cpu_args = tree_map(_to_inner, args)
        cpu_kwargs = tree_map(_to_inner, kwargs)
        out = _DEVICE_KERNELS.get(func, func)(*cpu_args, **cpu_kwargs)
        _follow_written_host_tensors(func, args, kwargs)
        if target is not None and torch.device(target).type != "npu":
            # a move to the host is a copy: `Tensor.to` hands back its input when nothing changes, which here is the
            # device tensor's own host data (an inference tensor's `.cpu()` reaches `to` undecomposed)
            return out.clone() if out is cpu_args[0] else out
        view_of = _view_base_kind(func, args, out)
        if torch.is_inference_mode_enabled() and view_of == "normal":
            # A view of a normal tensor stays a normal tensor in inference mode (it shares the base's
            # version counter); only a wrapper made outside inference mode can.
            with torch.inference_mode(False):
                return tree_map(_wrap, out)
        if not torch.is_inference_mode_enabled() and view_of == "inference":
            # A view of an inference tensor is an inference tensor, in or out of inference mode; only a wrapper made
            # inside inference mode is.
            with torch.inference_mode():
                return tree_map(_wrap, out)
        return tree_map(_wrap, out)


def _target_device(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    """The device a copy or `Tensor.to` call writes to (its `device` argument, or `other`'s), or None for none given."""
    if func in (torch.ops.aten.to.device, torch.ops.aten.to.prim_Device):
        return args[1] if len(args) > 1 else kwargs.get("device")
    if func is torch.ops.aten.to.other:
        return args[1].device
    return kwargs.get("device")


def _runs_device_generic_kernel(func: torch._ops.OpOverload) -> bool:
    """Whether npu tensors run `func`'s device-generic kernel rather than its host kernel.

    A library's own operator (`torch.library.custom_op` with no device type, as DeepSpeed's
    `deepspeed::dim_zero_all_to_all`) has one kernel for every device, CompositeExplicitAutograd, which a device's
    dispatcher runs on the device's tensors: its body then sees npu tensors, and the collectives it calls go to the
    group's npu backend ("hccl"), as on an Ascend host. torch's own operators (aten, prims) and those the emulation
    gives the npu a kernel for (`register_device_kernel`) keep running on the host data.
    """
    if not isinstance(func, torch._ops.OpOverload) or func in _DEVICE_KERNELS or is_builtin(func):
        return False
    return _has_only_device_generic_kernel(func.name())


def _has_host_kernel_only(func: torch._ops.OpOverload) -> bool:
    """Whether `func` is a library's operator with a host (CPU) kernel and none an npu tensor can run."""
    if not isinstance(func, torch._ops.OpOverload) or func in _DEVICE_KERNELS or is_builtin(func):
        return False
    return _has_cpu_kernel_only(func.name())


@functools.cache
def _has_cpu_kernel_only(name: str) -> bool:
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    return has_kernel(name, "CPU") and not any(
        has_kernel(name, key) for key in ("PrivateUse1", "CompositeExplicitAutograd", "CompositeImplicitAutograd")
    )


@functools.cache
def _has_only_device_generic_kernel(name: str) -> bool:
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    return has_kernel(name, "CompositeExplicitAutograd") and not has_kernel(name, "PrivateUse1")


_EMULATED_OPS_DIR = os.path.join(os.path.dirname(__file__), "ops") + os.sep


def _count_host_sync(func: torch._ops.OpOverload, args: tuple, target: object) -> None:
    """Count the call in HOST_SYNCS when it reads npu data on the host, outside the emulated ops.

    An emulated op computes on the host what the device computes on itself: its reads are no sync."""
    if func is torch.ops.aten._local_scalar_dense.default:
        kind = "item"
    elif func in _CROSS_DEVICE_OPS:
        to_host = torch.device(target).type != "npu" if target is not None else not isinstance(args[0], NpuTensor)
        if not to_host:
            return
        kind = "to host"
    else:
        return
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_EMULATED_OPS_DIR):
            return
        frame = frame.f_back
    HOST_SYNCS[kind] += 1


@functools.cache
def _written_arguments(func: torch._ops.OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument `func` writes (`Tensor(a!)` in its schema: `out=`, an in-place op's self)."""
    arguments = func._schema.arguments
    return tuple((i, arg.name) for i, arg in enumerate(arguments) if arg.alias_info and arg.alias_info.is_write)


def _follow_written_host_tensors(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
    """Give each npu tensor `func` wrote the sizes its host data now has.

    An op may resize what it writes (an `out=` tensor of the wrong size, as `torch.arange(n, device=...)` passes an
    empty one; `resize_`, `unsqueeze_`), and it did so on the host tensor only.
    """
    for position, name in _written_arguments(func):
        written = args[position] if position < len(args) else kwargs.get(name)
        for tensor in written if isinstance(written, (list, tuple)) else (written,):
            if isinstance(tensor, NpuTensor):
                _follow_host_metadata(tensor)


def _follow_host_metadata(wrapper: NpuTensor) -> None:
    """Set the wrapper's sizes, strides and storage offset to its host tensor's, as a device's resize sets its own.

    The wrapper's storage holds no data (its metadata lives on the meta device): torch's meta kernel of `set_` resets
    the metadata, with no dispatch to this class.
    """
    cpu = wrapper._cpu
    if (wrapper.shape, wrapper.stride(), wrapper.storage_offset()) == (cpu.shape, cpu.stride(), cpu.storage_offset()):
        return
    _track_storage(cpu)  # `set_` may have given it another buffer
    meta_included = torch._C._meta_in_tls_dispatch_include()
    with no_dispatch():
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            storage = torch._C.TensorBase.untyped_storage(wrapper)
            torch.ops.aten.set_.source_Storage_storage_offset(
                wrapper, storage, cpu.storage_offset(), cpu.shape, cpu.stride()
            )
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_included)


def _view_base_kind(func, args, out) -> str | None:
    """The kind of tensor an op's views view ("inference" or "normal"), or None for an op that returned no views.

    Its outputs (`out`, on the host data) are views when the schema says they may alias the first argument (`Tensor(a)`)
    and each shares that argument's memory: `contiguous()` or `reshape` of a strided tensor copies instead."""
    returns = func._schema.returns
    may_alias = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    if not may_alias or not args or not isinstance(args[0], NpuTensor):
        return None
    base = args[0]._cpu.untyped_storage().data_ptr()
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    if not all(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() == base for o in outputs):
        return None
    return "inference" if args[0].is_inference() else "normal"


def _to_inner(value):
    if isinstance(value, NpuTensor):
        return value._cpu
    if isinstance(value, torch.device) and value.type == "npu":
        return torch.device("cpu")
    return value


def _wrap(value):
    if isinstance(value, torch.Tensor) and not isinstance(value, NpuTensor):
        return NpuTensor(value)
    return value


def _check_same_device(func, args, kwargs) -> None:
    tensors, _ = tree_flatten((args, kwargs))
    for t in tensors:
        if isinstance(t, torch.Tensor) and not isinstance(t, NpuTensor) and t.dim() > 0:
            if t.device.type == "npu":  # a tensor subclass around npu tensors, e.g. a DTensor
                raise RuntimeError(
                    f"{func}: got a {type(t).__name__} (on {t.device}) next to plain npu tensors; a tensor subclass "
                    "cannot be mixed with plain tensors here (a DTensor: read it inside its own module's forward, "
                    "or call full_tensor())"
                )
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, "
                f"npu:0 and {t.device}! (emulated npu, op {func})"
            )


class _EmulatedNpuRandom:
    """`torch.npu.random`: the state of the generator npu random numbers come from.

    The emulated device draws its random numbers from the host's default generator (the ops run on the
    host data), so its state is that generator's state: what transformers' Trainer saves in a checkpoint
    (`rng_state.pth`, key "npu") and sets back on resume, as it does with torch_npu.
    """

    @staticmethod
    def get_rng_state(device="npu") -> torch.Tensor:
        return torch.random.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device="npu") -> None:
        torch.random.set_rng_state(new_state)

    @staticmethod
    def get_rng_state_all() -> list[torch.Tensor]:
        return [torch.random.get_rng_state()]

    @staticmethod
    def set_rng_state_all(new_states) -> None:
        for state in new_states:
            torch.random.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        """Random numbers for npu tensors come from the CPU generator, which torch.manual_seed seeds."""

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        """As manual_seed (torch.manual_seed calls this for the custom device)."""

    @staticmethod
    def initial_seed() -> int:
        return torch.random.initial_seed()


_LIVE_STORAGES: weakref.WeakValueDictionary[int, torch.UntypedStorage] = weakref.WeakValueDictionary()
"""Each live host storage an npu tensor has been made on, by StorageImpl address. A storage's Python object lives
as long as the storage does (torch preserves it), so an entry goes when its storage is freed."""
_STORAGES_LOCK = threading.Lock()
"""Guards _LIVE_STORAGES: threads create npu tensors concurrently (two models trained at once)."""


def _track_storage(cpu: torch.Tensor) -> None:
    storage = cpu.untyped_storage()
    with _STORAGES_LOCK:
        _LIVE_STORAGES.setdefault(storage._cdata, storage)


def npu_memory_allocated() -> int:
    """Bytes of npu memory in use: the distinct host storages behind live npu tensors, each at its current size.

    Views of one buffer count once; a buffer freed by `untyped_storage().resize_(0)` (what FSDP2 does to its
    unsharded parameters after a forward) counts 0 while it is empty. Unlike an allocator's count, there is no
    rounding to blocks and no cache: this is what the tensors alive at the call hold.
    """
    with _STORAGES_LOCK:
        storages = list(_LIVE_STORAGES.values())
    return sum(storage.nbytes() for storage in storages)


DEVICE_NAME = "Ascend910B3"
"""What `torch.npu.get_device_name()` answers: torch_npu returns CANN's SoC name (`aclrtGetSocName`), "Ascend910B3"
on an Atlas 800T A2 training server (as LLaMA-Factory's `llamafactory-cli env` prints it: "NPU type: Ascend910B3").
The emulation stands for the Atlas A2 training series (docs/torch-npu-ops.md), the series its ops' contracts take."""


@dataclasses.dataclass(frozen=True)
class NpuDeviceProperties:
    """What `torch.npu.get_device_properties()` answers on an Atlas A2 training server.

    torch_npu's `_NPUDeviceProperties`, field for field (Ascend/pytorch@9e73e708ab9350d203475609f36f8a43f6a0c2ab:
    torch_npu/csrc/npu/Module.cpp, `RegisterNPUDeviceProperties` and `initDeviceProperty`), but `uuid`.

    The values are an Ascend910B3's (DEVICE_NAME): 64 GiB of HBM and 20 AI cores (Project-HAMi/HAMi@
    75cf53b26c2c95f4ef47721cc8037b43ea36a1ad:charts/hami/templates/scheduler/device-configmap.yaml, chip 910B3:
    memoryCapacity 65536 MB, aiCore 20), each one cube core with two vector cores (the A2's split cores:
    cannmirror/asc-devkit@0a2e47c191a0733c90577d6aa6b594db668251e4:docs/api/context/c_api/sys_var/
    asc_get_sub_block_num.md, KERNEL_TYPE_MIX_AIC_1_2), and the 910B's 192 MiB L2 (docs/step-model.md).
    torch_npu sets `multi_processor_count` to the vector core count and leaves the other CUDA-style fields unset
    (None). A device reports as `total_memory` what the runtime gives it (`aclrtGetMemInfo`), somewhat less than the
    64 GiB of HBM (62420 MiB on a 64 GiB Ascend910B2C); the emulation reports the documented capacity.
    """

    name: str = DEVICE_NAME
    total_memory: int = 64 * 2**30
    cube_core_num: int = 20
    vector_core_num: int = 40
    L2_cache_size: int = 192 * 2**20
    major: int | None = None
    minor: int | None = None
    is_multi_gpu_board: int | None = None
    is_integrated: int | None = None
    multi_processor_count: int | None = 40
    max_threads_per_multi_processor: int | None = None
    warp_size: int | None = None
    regs_per_multiprocessor: int | None = None
    gcnArchName: str | None = None


def _device_index(device) -> int:
    """The index of `device` (an index, "npu:<i>", a torch.device or None: the current device), which must be 0.

    One that is not the emulated host's one device raises AssertionError("Invalid device id"), as torch_npu's check
    does."""
    index = device if isinstance(device, int) else torch.device(device or "npu").index or 0
    if index != 0:
        raise AssertionError("Invalid device id")
    return index


class EmulatedNpuModule(EmulatedNpuStreams):
    """What `torch.npu` offers that transformers, accelerate, kernels, DDP, FSDP2 and DeepSpeed ask of it.

    That includes streams, events and allocator statistics (`streams.EmulatedNpuStreams`).
    """

    @staticmethod
    def memory_allocated(device=None) -> int:
        """`npu_memory_allocated()`: bytes held by the live npu tensors' buffers."""
        return npu_memory_allocated()

    random = _EmulatedNpuRandom()
    get_rng_state = staticmethod(_EmulatedNpuRandom.get_rng_state)
    set_rng_state = staticmethod(_EmulatedNpuRandom.set_rng_state)
    get_rng_state_all = staticmethod(_EmulatedNpuRandom.get_rng_state_all)
    set_rng_state_all = staticmethod(_EmulatedNpuRandom.set_rng_state_all)
    manual_seed = staticmethod(_EmulatedNpuRandom.manual_seed)
    manual_seed_all = staticmethod(_EmulatedNpuRandom.manual_seed_all)
    initial_seed = staticmethod(_EmulatedNpuRandom.initial_seed)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device) -> None:
        if torch.device(device).index not in (None, 0):
            raise RuntimeError(f"emulated npu has one device; got {device}")

    @staticmethod
    def get_device_name(device=None) -> str:
        """torch_npu's answer: the SoC name CANN reports for the device (`aclrtGetSocName`), here DEVICE_NAME.

        `device` as `_device_index` takes it. TRL's trainers ask it at construction (the telemetry's "gpu")."""
        _device_index(device)
        return DEVICE_NAME

    @staticmethod
    def get_device_properties(device=None) -> NpuDeviceProperties:
        """torch_npu's answer for an Atlas A2 training device (`NpuDeviceProperties`).

        `device` as `_device_index` takes it. DeepSpeed's ZeRO-1/2 optimizer reads `total_memory` at
        `deepspeed.initialize`."""
        _device_index(device)
        return NpuDeviceProperties()

    @staticmethod
    def synchronize(device=None) -> None:
        """The emulated device runs synchronously on the host."""

    @staticmethod
    def is_bf16_supported() -> bool:
        """Atlas A2/A3 compute in bfloat16 (transformers asks before `TrainingArguments(bf16=True)`)."""
        return True

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        """What torch.autocast asks a custom device (and gradient checkpointing, which saves autocast state)."""
        return [torch.float16, torch.bfloat16]

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def empty_cache() -> None:
        """Host memory: nothing to release."""


def _register_factories(lib: torch.library.Library) -> None:
    """Register the PrivateUse1 kernels that tensor creation with device="npu" and host-to-device copies reach.

    They reach these kernels because no npu tensor input carries the Python key; the rest dispatches through
    `NpuTensor.__torch_dispatch__`. The host buffers behind npu tensors name their device: a library may route
    `torch.empty` without a device to the accelerator (DeepSpeed's `zero.Init` does), which would come back here.
    """

    def empty_memory_format(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        cpu = torch.empty(size, dtype=dtype, memory_format=memory_format or torch.contiguous_format, device="cpu")
        return NpuTensor(cpu)

    def empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
        return NpuTensor(torch.empty_strided(size, stride, dtype=dtype, device="cpu"))

    def copy_from(src, dst, non_blocking=False):
        dst._cpu.copy_(_to_inner(src))
        return dst

    def copy_from_and_resize(src, dst):
        dst._cpu.resize_(src.shape).copy_(_to_inner(src))
        return dst

    lib.impl("_copy_from", copy_from, "PrivateUse1")
    lib.impl("_copy_from_and_resize", copy_from_and_resize, "PrivateUse1")
    lib.impl("empty.memory_format", empty_memory_format, "PrivateUse1")
    lib.impl("empty_strided", empty_strided, "PrivateUse1")


_PINNED: dict[int, StorageWeakRef] = {}
"""Address of each live host buffer `pin_memory` made -> a weak reference to its storage."""


def _register_pinned_host_memory(lib: torch.library.Library) -> None:
    """Register `Tensor.pin_memory()` and `is_pinned()` for a host whose accelerator is the npu.

    A DataLoader with `pin_memory=True` (the Trainer's default) calls them: torch_npu gives pinned (page-locked)
    host buffers; a Python backend cannot register the pinned allocator, so these CPU kernels stand in for it.
    `pin_memory` copies into a new host buffer of the same sizes and strides (what `_pin_memory` does with the
    pinned allocator), and `is_pinned` is True exactly for the buffers it made, while they live.
    """

    def pin_memory(self, device=None):
        _check_pinning_device(device)
        pinned = torch.empty_strided(self.size(), self.stride(), dtype=self.dtype, device="cpu")
        pinned.copy_(self)
        for address in [a for a, ref in _PINNED.items() if ref.expired()]:  # forget freed buffers
            del _PINNED[address]
        storage = pinned.untyped_storage()
        _PINNED[storage.data_ptr()] = StorageWeakRef(storage)
        return pinned

    def is_pinned(self, device=None):
        _check_pinning_device(device)
        ref = _PINNED.get(self.untyped_storage().data_ptr())
        return ref is not None and not ref.expired()  # a freed buffer's address may be reused by another

    lib.impl("_pin_memory", pin_memory, "CPU")
    lib.impl("is_pinned", is_pinned, "CPU")


def _check_pinning_device(device) -> None:
    if device is not None and torch.device(device).type != "npu":
        raise RuntimeError(f"emulated npu host: host memory is pinned for the npu, not for {device}")


_MODULE_CONVERSIONS = {
    "to": lambda *args, **kwargs: torch._C._nn._parse_to(*args, **kwargs)[0],
    "cpu": lambda *args, **kwargs: "cpu",
    "npu": lambda *args, **kwargs: "npu",
    "to_empty": lambda *, device, recurse=True: device,
}
"""nn.Module methods that can move a module between devices -> the device they move it to (None: stays)."""


def _swap_module_params_between_host_and_npu() -> None:
    """Make nn.Module conversions between the host and the npu swap the parameters, and only those.

    On a device, `module.to(...)` keeps each Parameter object (`param.data = converted`), so tied
    weights stay tied. A host tensor cannot take an NpuTensor's data that way: torch then gives each
    module a new Parameter, which unties tied weights. Swapping the tensors
    (`torch.__future__.set_swap_module_params_on_conversion`) keeps the objects, but it refuses a
    parameter that an autograd graph still holds, which a device does not. So the swap is switched on
    only for the duration of a conversion that crosses between the npu and another device; casts on
    the npu take the device's path (`NpuTensor.data`), and torch's flag otherwise reads as the user set it.
    """
    for name, target_of in _MODULE_CONVERSIONS.items():
        setattr(torch.nn.Module, name, _swapping_across_npu(getattr(torch.nn.Module, name), target_of))


def _swapping_across_npu(method, target_of):
    @functools.wraps(method)
    def convert(module, *args, **kwargs):
        future = torch.__future__
        if future.get_swap_module_params_on_conversion() or not _crosses_npu(module, target_of, args, kwargs):
            return method(module, *args, **kwargs)
        future.set_swap_module_params_on_conversion(True)
        try:
            return method(module, *args, **kwargs)
        finally:
            future.set_swap_module_params_on_conversion(False)

    return convert


def _crosses_npu(module: torch.nn.Module, target_of, args, kwargs) -> bool:
    """Whether the conversion moves a tensor of `module` onto the npu or off it."""
    try:
        target = target_of(*args, **kwargs)
    except TypeError:  # arguments the method itself refuses: let it say so
        return False
    if target is None:
        return False
    to_npu = torch.device(target).type == "npu"
    tensors = itertools.chain(module.parameters(), module.buffers())
    return any((tensor.device.type == "npu") != to_npu for tensor in tensors)


class _NpuDeviceGuard(torch._C._acc.DeviceGuard):
    """The device guard torch calls for npu tensors: it answers its one question without running Python bytecode.

    torch asks a guard registered from Python through `type_`, taking the GIL for it, and asks it under locks of its
    own: building a leaf tensor's gradient accumulator holds the tensor's autograd mutex while it asks the guard for
    the device's stream. A Python `type_` (torch's default guard has one) may hand the GIL to another thread at any
    bytecode; a thread that then reaches the same tensor's accumulator from `Function.apply` waits for the mutex
    holding the GIL, and both wait forever. Two threads running 300 training forwards of one model each deadlocked
    so in 2 runs of 2, and in none of 11 with this guard (tests/test_load_and_threads.py). Here `type_` is a C
    callable (a partial of itemgetter), which the interpreter runs without giving up the GIL.

    What no Python guard can avoid: a thread that reaches the accumulator from a plain op has released the GIL (torch's
    bindings do) and must take it back for the guard while holding the mutex. If another thread is in
    `Function.apply` on the same leaf at that moment, they deadlock. Probes that hammer one leaf from both kinds of
    call do; the models' forms, whose leaves each go through one kind, did not in the runs tried. A real device's
    guard is C++ and takes no GIL; tests/stuck_tests.py ends a test stuck so."""

    type_ = functools.partial(operator.itemgetter(0), (torch._C._autograd.DeviceType.PrivateUse1,))


_LIBRARY: torch.library.Library | None = None


def install_device() -> None:
    """Name PrivateUse1 "npu" and back it with host memory. Once per process (torch allows one rename)."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    current = torch._C._get_privateuse1_backend_name()
    if current != "privateuseone":
        raise RuntimeError(
            f"torch's PrivateUse1 backend is already named {current!r}: a real or another emulated device owns it. "
            "The npu emulation must be installed before anything else registers a device."
        )
    _setup_privateuseone_for_python_backend(
        rename="npu", backend_module=EmulatedNpuModule(), device_guard=_NpuDeviceGuard()
    )
    _swap_module_params_between_host_and_npu()
    # The emulated device computes on the host: backward runs on the calling thread. With autograd's
    # worker thread for the PrivateUse1 device, processes intermittently abort at exit ("terminate
    # called without an active exception").
    torch.autograd.set_multithreading_enabled(False)
    _LIBRARY = torch.library.Library("aten", "IMPL")
    _register_factories(_LIBRARY)
    _register_pinned_host_memory(_LIBRARY)
    install_autocast()
