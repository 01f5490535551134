"""The "hccl" process-group backend of the emulated npu: collectives on npu tensors, carried by gloo on the host.

On an Ascend host torch_npu registers "hccl" for the "npu" device (`Backend.register_backend("hccl", ...,
extended_api=True, devices=["npu"])`), and accelerate, transformers' Trainer and LLaMA-Factory call
`torch.distributed.init_process_group("hccl")`. `install_hccl()` registers the same name for the same device, so
that call, DDP, FSDP2, DTensor and functional collectives run unchanged in each process of an emulated host:

- npu tensors: every c10d op (`torch.ops.c10d.*`, what `torch.distributed`'s collectives and DDP's reducer call)
  and every functional collective (`torch.ops._c10d_functional.*`, what DTensor and `full_tensor()` call) on npu
  tensors reaches `NpuTensor.__torch_dispatch__`, which runs it on the host tensors behind them through the gloo
  backend that "hccl" created for the group. The values are what the collective computes (gloo's sums are fp32
  sums in rank order; HCCL's reduction order on a real Ascend cluster may round differently).
- a library's own operator with no device type (DeepSpeed's `deepspeed::dim_zero_all_to_all`, Ulysses sequence
  parallelism's exchange) runs its body on the npu tensors (`device._runs_device_generic_kernel`), so the collectives
  it calls reach "hccl" as on a device.
- host tensors: refused, as ProcessGroupHCCL refuses them. A group made with "hccl" alone has no backend for
  "cpu" ("No backend type associated with device type cpu"); pass "cpu:gloo,npu:hccl" to carry both, as on Ascend.
- one machine only: the backend binds gloo to 127.0.0.1 and refuses a rendezvous store on any other host.
- bounded in time: a collective that a rank never joins fails after the group's timeout
  (`init_process_group(..., timeout=...)`), with gloo's error.

The group the c10d ops see ("hccl" on the npu device) is the one torch made; the host side is a twin process
group registered under the name `<group name>/npu-on-host`, whose "cpu" backend is that same gloo backend.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # registers _c10d_functional::_wrap_tensor_autograd)
from torch._C._distributed_c10d import (
    PrefixStore,
    ProcessGroup,
    ProcessGroupGloo,
    TCPStore,
    _register_process_group,
)

from .device import register_device_kernel

BACKEND = "hccl"
HOST_TWIN_SUFFIX = "/npu-on-host"
_HOST_TWINS: dict[str, ProcessGroup] = {}
"""Name of each live hccl process group -> its twin whose "cpu" backend is the group's gloo backend."""


def install_hccl() -> None:
    """Register the "hccl" backend for the npu device and route npu collectives to it. Idempotent."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create_backend, extended_api=True, devices=["npu"])
    for op in _collective_ops():
        register_device_kernel(op, _on_host_twin(op))
    # funcol wraps a collective's output in an AsyncCollectiveTensor that waits on first use; the emulated device
    # is synchronous, so on the npu the wrap waits at once and returns the tensor (an ACT around an npu tensor's
    # host data would leak the host tensor's type into the npu tensor).
    register_device_kernel(torch.ops._c10d_functional._wrap_tensor_autograd.default, _wait_now)


def _wait_now(tensor: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(tensor)


def _create_backend(options, backend_options=None) -> ProcessGroupGloo:
    """Called by `init_process_group`/`new_group` for the npu device of a group: a gloo backend on 127.0.0.1."""
    _require_loopback_store(options.store)
    timeout: datetime.timedelta = options.timeout
    gloo_options = ProcessGroupGloo._Options()
    gloo_options._timeout = timeout
    gloo_options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    gloo_options.global_ranks_in_group = options.global_ranks_in_group
    gloo_options.group_name = options.group_id
    gloo = ProcessGroupGloo(options.store, options.group_rank, options.group_size, gloo_options)
    twin = ProcessGroup(options.store, options.group_rank, options.group_size)
    twin._set_default_backend(ProcessGroup.BackendType.GLOO)
    twin._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
    twin_name = options.group_id + HOST_TWIN_SUFFIX
    twin._set_group_name(twin_name)
    _register_process_group(twin_name, twin)
    _HOST_TWINS[options.group_id] = twin
    return gloo


def _require_loopback_store(store) -> None:
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    if isinstance(store, TCPStore) and not _is_loopback(store.host):
        raise RuntimeError(
            f"emulated hccl: the rendezvous store is on {store.host!r}; the emulated npu host runs its processes "
            "on this machine only. Set MASTER_ADDR=127.0.0.1 (or init_method='tcp://127.0.0.1:<port>')."
        )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _collective_ops() -> list[torch._ops.OpOverload]:
    """Every overload of the c10d and functional-collective namespaces that names a process group."""
    ops = []
    for name in torch._C._dispatch_get_all_op_names():
        namespace, _, op_name = name.partition("::")
        if namespace not in ("c10d", "_c10d_functional"):
            continue
        op_name, _, overload = op_name.partition(".")
        op = getattr(getattr(getattr(torch.ops, namespace), op_name), overload or "default")
        if any(a.name in ("process_group", "group_name") for a in op._schema.arguments):
            ops.append(op)
    return ops


def _on_host_twin(op: torch._ops.OpOverload):
    """The op's kernel for npu tensors: the same op on their host tensors, with the group's host twin."""
    position = next(i for i, a in enumerate(op._schema.arguments) if a.name in ("process_group", "group_name"))
    name = op._schema.arguments[position].name

    def run_on_host(*args, **kwargs):
        args = list(args)
        _refuse_premul_sum(op, args, kwargs)
        if name in kwargs:
            kwargs[name] = _host_twin(op, kwargs[name])
        elif position < len(args):
            args[position] = _host_twin(op, args[position])
        return op(*args, **kwargs)

    return run_on_host


def _refuse_premul_sum(op, args, kwargs) -> None:
    """HCCL scales the inputs and sums; gloo has no PREMUL_SUM, and a boxed ReduceOp does not tell its factor."""
    position = next((i for i, a in enumerate(op._schema.arguments) if a.name == "reduce_op"), None)
    if position is None:
        return
    reduce_op = kwargs.get("reduce_op", args[position] if position < len(args) else None)
    if isinstance(reduce_op, torch.ScriptObject) and reduce_op.op() == int(dist.ReduceOp.PREMUL_SUM):
        raise NotImplementedError(
            f"{op}: ReduceOp.PREMUL_SUM is not emulated (the emulated hccl reduces with gloo, which has no "
            "PREMUL_SUM). Scale the tensor and use ReduceOp.SUM, or leave FSDP2's gradient divide factor unset."
        )


def _host_twin(op, group):
    """The twin of an hccl group, as the op takes it: a group name, or a boxed ProcessGroup (a ScriptObject)."""
    group_name = group if isinstance(group, str) else ProcessGroup.unbox(group).group_name
    twin = _HOST_TWINS.get(group_name)
    if twin is None:
        backend = _backend_name(group)
        raise RuntimeError(
            f"{op}: npu tensors need a process group with the 'hccl' backend for the npu device; group "
            f"{group_name!r} uses {backend!r}. Use init_process_group('hccl') or 'cpu:gloo,npu:hccl' "
            "(emulated npu host)."
        )
    return twin_name(group_name) if isinstance(group, str) else twin.boxed()


def twin_name(group_name: str) -> str:
    return group_name + HOST_TWIN_SUFFIX


def _backend_name(group) -> str:
    try:
        pg = (
            dist.distributed_c10d._resolve_process_group(group) if isinstance(group, str) else ProcessGroup.unbox(group)
        )
        return pg._get_backend_name()
    except Exception:  # a name no live group has
        return "unknown"
