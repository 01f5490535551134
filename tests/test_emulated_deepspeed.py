"""What DeepSpeed asks of an Ascend host, on the emulated npu: a plain "hccl" group carries the collectives of
Ulysses sequence parallelism, ZeRO-1/2 start (`get_device_properties`), and models build under `zero.Init`.

The in-process tests state each behaviour on its own; the 2-process run (real DeepSpeed, DeepSpeed's NPU
accelerator, `init_distributed(dist_backend="hccl")`: the group a device has, no "cpu" backend, gloo underneath on
127.0.0.1, bounded in time) shows them where DeepSpeed needs them. Every expected number is computed here, in the
test process, from the ranks' inputs or by single-process eager training.

Gradient reductions compared (DeepSpeed's own behaviour on a plain CPU too): with data parallelism alone, as here,
ZeRO-1, 2 and 3 average each gradient over the ranks, which equals eager's gradient of the global batch's mean loss
when each rank holds as many tokens. (Under sequence parallelism ZeRO-1/2 sum the SP ranks' gradients where ZeRO-3
averages them: tests/test_ulysses_sp_smoke.py compares ZeRO-3.)
"""

from __future__ import annotations

import datetime
import math

import pytest
import torch
from distributed import run_distributed

from npu_hub_kernels.testing.emulation.device import NpuDeviceProperties

pytest.importorskip("deepspeed")

WORLD = 2
TIMEOUT = 300
STEPS = 2
LR = 0.1
ZERO = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at 1.0 unless told; eager here does not clip
    "zero_allow_untested_optimizer": True,  # torch's SGD: DeepSpeed's own optimizers need compiled ops
}
TORCH_NPU_DEVICE_PROPERTIES = (
    "name", "total_memory", "cube_core_num", "vector_core_num", "L2_cache_size", "major", "minor",
    "is_multi_gpu_board", "is_integrated", "multi_processor_count", "max_threads_per_multi_processor", "warp_size",
    "regs_per_multiprocessor", "gcnArchName",
)  # fmt: skip
"""torch_npu's `_NPUDeviceProperties` fields (Ascend/pytorch@9e73e708ab9350d203475609f36f8a43f6a0c2ab:
torch_npu/csrc/npu/Module.cpp, `RegisterNPUDeviceProperties`), but `uuid` (aclrtDeviceGetUuid, not emulated)."""


def rank_values(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Rank `rank`'s own float32 values (host), the same in the rank and in the test process."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + rank))


def rank_batch(rank: int, step: int) -> torch.Tensor:
    """Rank `rank`'s token ids at `step` (2 rows of 8), the same in the rank and in the test process."""
    return torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(1000 * step + rank))


# ---------------------------------------------------------------------------------------------------------------------
# in-process: each behaviour on its own


def test_a_librarys_device_generic_op_runs_on_the_npu_tensors():
    """A `torch.library.custom_op` with no device type runs its body on the npu tensors themselves, as a device's
    dispatcher runs its CompositeExplicitAutograd kernel (DeepSpeed's all-to-all calls its collective there); the
    control: an op with a host kernel only is refused on them, as a device's dispatcher has no kernel to run, and runs
    on host tensors."""
    seen = {}

    @torch.library.custom_op("npu_hub_kernels_test::device_generic", mutates_args=())
    def device_generic(x: torch.Tensor) -> torch.Tensor:
        seen["generic"] = (type(x).__name__, x.device.type)
        return x * 2

    @torch.library.custom_op("npu_hub_kernels_test::host_only", mutates_args=(), device_types="cpu")
    def host_only(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    x = torch.arange(3.0).to("npu")
    doubled = device_generic(x)
    assert seen["generic"] == ("NpuTensor", "npu"), seen
    assert doubled.device.type == "npu" and doubled.cpu().tolist() == [0.0, 2.0, 4.0]
    with pytest.raises(NotImplementedError, match="host_only' with arguments from the 'PrivateUse1' backend"):
        host_only(x)
    assert host_only(x.cpu()).tolist() == [1.0, 2.0, 3.0]


def test_get_device_properties_answers_as_torch_npu_on_an_atlas_a2():
    """torch_npu's fields, an Ascend910B3's values; a device that is not the one raises as torch_npu does."""
    properties = torch.npu.get_device_properties()
    assert tuple(field for field in NpuDeviceProperties.__dataclass_fields__) == TORCH_NPU_DEVICE_PROPERTIES
    assert properties == torch.npu.get_device_properties(0) == torch.npu.get_device_properties("npu:0")
    assert properties.name == torch.npu.get_device_name() == "Ascend910B3"
    assert properties.total_memory == 64 * 2**30 and properties.L2_cache_size == 192 * 2**20
    assert (properties.cube_core_num, properties.vector_core_num, properties.multi_processor_count) == (20, 40, 40)
    assert properties.major is None and properties.warp_size is None  # unset by torch_npu
    with pytest.raises(AssertionError, match="Invalid device id"):
        torch.npu.get_device_properties(1)


def test_host_buffers_ignore_a_library_routing_torch_empty_to_the_npu(monkeypatch):
    """DeepSpeed's `zero.Init` makes `torch.empty` (and the other factories) default to the accelerator; the
    emulated device's own allocations name the host, so an npu tensor is made once, not recursively."""
    original = torch.empty

    def empty_on_the_npu(*args, **kwargs):  # what zero.Init installs for torch.empty
        if kwargs.get("device") is None:
            kwargs["device"] = "npu"
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty_on_the_npu)
    made = torch.empty(4, 3)
    assert made.device.type == "npu" and made._cpu.device.type == "cpu" and made.shape == (4, 3)
    assert torch.nn.Linear(3, 2).weight.device.type == "npu"


# ---------------------------------------------------------------------------------------------------------------------
# 2 processes: DeepSpeed on a plain "hccl" group


def _rank_main(output_dir: str) -> dict:
    """One rank: a plain "hccl" group as DeepSpeed starts it, then the collectives, ZeRO-1/2 and `zero.Init`."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="hccl", timeout=datetime.timedelta(seconds=60))
    results = {"collectives": _sp_collectives()}
    for stage in (1, 2):
        results[f"zero{stage}"] = _train_zero(stage)
    results["zero3_init"] = _train_built_under_zero_init(output_dir)
    return results


def _sp_collectives() -> dict:
    """The collectives DeepSpeed's Ulysses SP runs, on npu tensors of the plain "hccl" group, as host tensors."""
    import deepspeed.comm as ds_dist
    import torch.distributed as dist
    from deepspeed.sequence.layer import _dim_zero_all_to_all, register_all_to_all_group

    rank, group = dist.get_rank(), dist.group.WORLD
    mine = rank_values(rank, (WORLD, 3, 4)).to("npu")
    results = {"group backend": dist.get_backend(group)}
    # UlyssesSPAttentionHF's exchange: DeepSpeed's custom op, forward and backward
    register_all_to_all_group(group)
    source = mine.clone().requires_grad_()
    exchanged = _dim_zero_all_to_all(group, source)
    (exchanged * exchanged.detach()).sum().backward()  # d/dx of sum(y * y_detached) sent back: y's values
    results["dim_zero_all_to_all"], results["dim_zero_all_to_all grad"] = exchanged.detach(), source.grad
    # uneven_heads_all2all: all_to_all_single with split sizes
    rows = 1 + rank  # rank 0 sends 1 row to each, rank 1 sends 2
    uneven = rank_values(rank, (WORLD * rows, 4)).to("npu")
    received = torch.empty(sum(1 + r for r in range(WORLD)), 4, device="npu")
    ds_dist.all_to_all_single(received, uneven, output_split_sizes=[1, 2], input_split_sizes=[rows, rows])
    results["all_to_all_single uneven"] = received
    # the position_ids gather of UlyssesSPAttentionHF and UlyssesSPDataLoaderAdapter
    pieces = [torch.empty_like(mine) for _ in range(WORLD)]
    ds_dist.all_gather(pieces, mine)
    results["all_gather"] = torch.stack(pieces)
    objects = [None] * WORLD
    dist.all_gather_object(objects, {"rank": rank})
    results["all_gather_object"] = objects
    # ZeRO-3's parameter gathers and gradient reductions
    gathered = torch.empty(WORLD * WORLD, 3, 4, device="npu")
    ds_dist.all_gather_into_tensor(gathered, mine)
    results["all_gather_into_tensor"] = gathered
    scattered = torch.empty(1, 3, 4, device="npu")
    ds_dist.reduce_scatter_tensor(scattered, mine)
    results["reduce_scatter_tensor"] = scattered
    summed, sent = mine.clone(), mine.clone()
    ds_dist.all_reduce(summed)
    ds_dist.broadcast(sent, src=1)
    results["all_reduce"], results["broadcast"] = summed, sent
    results["devices"] = sorted({t.device.type for t in results.values() if isinstance(t, torch.Tensor)})
    try:  # the control: host tensors stay refused, as ProcessGroupHCCL refuses them
        dist.all_to_all_single(torch.empty(WORLD), torch.ones(WORLD))
        results["host tensors"] = "accepted"
    except RuntimeError as error:
        results["host tensors"] = str(error)
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in results.items()}


def _train_zero(stage: int) -> dict:
    """STEPS SGD steps of a tiny Llama under ZeRO-`stage` on this rank's batches; losses and final parameters."""
    import deepspeed

    from npu_hub_kernels.testing.tiny_models import tiny_causal_lm

    model = tiny_causal_lm("llama").to("npu").train()
    config = {**ZERO, "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config)
    losses = _train_steps(engine)
    params = {name: p.detach().cpu().clone() for name, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params}


def _train_steps(engine) -> list[float]:
    """STEPS DeepSpeed steps on this rank's batches; the loss of each."""
    import torch.distributed as dist

    losses = []
    for step in range(STEPS):
        ids = rank_batch(dist.get_rank(), step).to("npu")
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _train_built_under_zero_init(output_dir: str) -> dict:
    """TrainingArguments with ZeRO-3 first (the usual order), then the model: transformers builds it under
    `zero.Init`, which partitions each parameter as it is made. The eager weights are loaded into it (gathered,
    written by rank 0), then STEPS ZeRO-3 SGD steps."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param
    from transformers import TrainingArguments
    from transformers.integrations import is_deepspeed_zero3_enabled

    from npu_hub_kernels.testing.tiny_models import tiny_causal_lm

    reference = tiny_causal_lm("llama").state_dict()  # before the arguments: built as eager builds it
    zero3 = {**ZERO, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    arguments = TrainingArguments(output_dir=output_dir, deepspeed=zero3, report_to=[])
    model = tiny_causal_lm("llama")
    partitioned = {name: (tuple(p.ds_shape), p.ds_tensor.numel(), p.numel()) for name, p in model.named_parameters()}
    devices = sorted({p.ds_tensor.device.type for p in model.parameters()})
    built = {"zero3 enabled": is_deepspeed_zero3_enabled(), "partitioned": partitioned, "devices": devices}
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if dist.get_rank() == 0:
            model.load_state_dict(reference)
    model.train()
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=arguments.hf_deepspeed_config.config
    )
    losses = _train_steps(engine)
    params = {name: safe_get_full_fp32_param(p).cpu() for name, p in engine.module.named_parameters()}
    engine.destroy()
    return {**built, "losses": losses, "params": params}


def _eager_training() -> dict:
    """Single-process eager: the global batch of both ranks each step (the mean over ranks of each rank's mean loss,
    each holding as many tokens), STEPS SGD steps; each rank's losses and the final parameters."""
    from npu_hub_kernels.testing.tiny_models import tiny_causal_lm

    model = tiny_causal_lm("llama").train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = [[] for _ in range(WORLD)]
    for step in range(STEPS):
        optimizer.zero_grad()
        total = 0
        for rank in range(WORLD):
            ids = rank_batch(rank, step)
            loss = model(input_ids=ids, labels=ids).loss
            losses[rank].append(loss.item())
            total = total + loss / WORLD
        total.backward()
        optimizer.step()
    return {"losses": losses, "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def deepspeed_ranks(tmp_path_factory) -> list[dict]:
    """Each rank's results (one 2-process launch for the module's slow tests)."""
    scratch = tmp_path_factory.mktemp("emulated-deepspeed")
    env = {"DS_ACCELERATOR": "npu", "ASCEND_HOME_PATH": str(scratch), "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
    return run_distributed(_rank_main, str(scratch), world_size=WORLD, timeout=TIMEOUT, env=env)


@pytest.fixture(scope="module")
def eager() -> dict:
    return _eager_training()


@pytest.mark.slow
def test_a_plain_hccl_group_carries_ulysses_collectives(deepspeed_ranks):
    """On the group `init_distributed(dist_backend="hccl")` makes, DeepSpeed's all-to-all op (forward and backward),
    all_to_all_single with splits, all_gather (tensors and objects), all_gather_into_tensor, reduce_scatter_tensor,
    all_reduce and broadcast give the collective's numbers on npu tensors; host tensors are refused, as on a device."""
    inputs = [rank_values(rank, (WORLD, 3, 4)) for rank in range(WORLD)]
    uneven = [rank_values(rank, (WORLD * (1 + rank), 4)) for rank in range(WORLD)]
    for rank, results in enumerate(deepspeed_ranks):
        got = results["collectives"]
        assert got["group backend"] == "hccl", got["group backend"]
        exchanged = torch.stack([inputs[source][rank] for source in range(WORLD)])  # row `rank` of every rank
        expected = {
            "dim_zero_all_to_all": exchanged,
            "dim_zero_all_to_all grad": inputs[rank],  # the exchange sent back undoes it: d sum(y*y')/dx = x
            "all_to_all_single uneven": torch.cat([uneven[source].chunk(WORLD)[rank] for source in range(WORLD)]),
            "all_gather": torch.stack(inputs),
            "all_gather_into_tensor": torch.cat(inputs),
            "reduce_scatter_tensor": (inputs[0] + inputs[1])[rank : rank + 1],
            "all_reduce": inputs[0] + inputs[1],
            "broadcast": inputs[1],
        }
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=f"rank {rank}: {name}")
        assert got["all_gather_object"] == [{"rank": 0}, {"rank": 1}]
        assert got["devices"] == ["npu"], got["devices"]
        assert "No backend type associated with device type cpu" in got["host tensors"], got["host tensors"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_and_2_start_and_train_as_eager(deepspeed_ranks, eager, stage):
    """ZeRO-1/2 start on the emulated npu (their optimizer reads `get_device_properties().total_memory`) and train
    as eager: each rank's losses, and the parameters of the gradient averaged over both ranks (float32, 1e-6)."""
    for rank, results in enumerate(deepspeed_ranks):
        run = results[f"zero{stage}"]
        torch.testing.assert_close(run["losses"], eager["losses"][rank], rtol=0, atol=1e-6)
        for name, value in eager["params"].items():
            torch.testing.assert_close(run["params"][name], value, rtol=0, atol=1e-6, msg=f"rank {rank}: {name}")


@pytest.mark.slow
def test_a_model_built_under_zero_init_is_partitioned_and_trains_as_eager(deepspeed_ranks, eager):
    """TrainingArguments with ZeRO-3 first, then the model: each parameter is partitioned as it is made (none
    resident, each rank half of it, on the npu), and ZeRO-3 trains it as eager (losses and parameters, 1e-6)."""
    for rank, results in enumerate(deepspeed_ranks):
        run = results["zero3_init"]
        assert run["zero3 enabled"] and run["devices"] == ["npu"], (run["zero3 enabled"], run["devices"])
        for name, (shape, local, resident) in run["partitioned"].items():
            assert resident == 0 and local == math.ceil(math.prod(shape) / WORLD), (rank, name, shape, local)
        torch.testing.assert_close(run["losses"], eager["losses"][rank], rtol=0, atol=1e-6)
        for name, value in eager["params"].items():
            torch.testing.assert_close(run["params"][name], value, rtol=0, atol=1e-6, msg=f"rank {rank}: {name}")


def test_the_rank_inputs_differ():
    """The collectives and reductions above are tested on ranks with different values and batches."""
    assert not torch.equal(rank_values(0, (2, 3)), rank_values(1, (2, 3)))
    assert not torch.equal(rank_batch(0, 0), rank_batch(1, 0))
