"""The emulated "hccl" backend in 2 processes: the collectives on npu tensors give the numbers the collective
defines (each expected value computed here, in the test process, from the ranks' inputs), host tensors are
refused as on Ascend, a rank that never joins fails in bounded time, and a failing rank's traceback reaches
the test report (the harness of tests/distributed.py)."""

from __future__ import annotations

import datetime
import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from distributed import DistributedRunError, run_distributed

WORLD = 2
SHAPE = (4, 3)


def rank_input(rank: int, shape=SHAPE) -> torch.Tensor:
    """Rank `rank`'s own float32 values (host), the same in the rank and in the test process."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + rank))


def init_hccl(seconds: float = 30) -> int:
    dist.init_process_group("hccl", timeout=datetime.timedelta(seconds=seconds))
    return dist.get_rank()


def collectives_rank() -> dict:
    """Each collective on npu tensors; the results as host tensors, with the device they came back on."""
    rank = init_hccl()
    mine = rank_input(rank).to("npu")
    results = {}

    reduced = mine.clone()
    dist.all_reduce(reduced)
    results["all_reduce"] = reduced

    averaged = mine.clone()
    dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
    results["all_reduce_avg"] = averaged

    largest = mine.clone()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    results["all_reduce_max"] = largest

    gathered = torch.empty((WORLD * SHAPE[0], SHAPE[1]), device="npu")
    dist.all_gather_into_tensor(gathered, mine)
    results["all_gather_into_tensor"] = gathered

    scattered = torch.empty((SHAPE[0] // WORLD, SHAPE[1]), device="npu")
    dist.reduce_scatter_tensor(scattered, mine)
    results["reduce_scatter_tensor"] = scattered

    scattered_avg = torch.empty((SHAPE[0] // WORLD, SHAPE[1]), device="npu")
    work = dist.reduce_scatter_tensor(scattered_avg, mine, op=dist.ReduceOp.AVG, async_op=True)
    work.wait()
    results["reduce_scatter_tensor_avg"] = scattered_avg

    sent = mine.clone()
    dist.broadcast(sent, src=1)
    results["broadcast"] = sent

    pieces = [torch.empty(SHAPE, device="npu") for _ in range(WORLD)]
    dist.all_gather(pieces, mine)
    results["all_gather"] = torch.stack(pieces)

    # functional collectives (what DTensor and FSDP2's full_tensor() run)
    results["funcol_all_gather"] = funcol.all_gather_tensor(mine, 0, dist.group.WORLD)
    results["funcol_all_reduce"] = funcol.all_reduce(mine, "sum", dist.group.WORLD)

    objects = [None] * WORLD
    dist.all_gather_object(objects, {"rank": rank})
    results["devices"] = {name: t.device.type for name, t in results.items()}
    results["objects"] = objects
    return {name: t.cpu() if isinstance(t, torch.Tensor) else t for name, t in results.items()}


def barrier_rank(marker_dir: str) -> bool:
    """Rank 1 writes its marker late, before the barrier; rank 0 looks for it right after the barrier."""
    marker = Path(marker_dir) / "rank1-was-here"
    if dist.get_rank() == 1:
        time.sleep(1.0)
        marker.write_text("1")
    dist.barrier()
    return marker.exists()


def host_tensors_rank() -> str:
    """A host tensor on an "hccl" group is refused (ProcessGroupHCCL carries npu tensors only); on
    "cpu:gloo,npu:hccl" the host tensor goes to gloo and the npu tensor to hccl, as on Ascend."""
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(2))
    both = dist.new_group(backend="cpu:gloo,npu:hccl")
    host, device = torch.ones(2), torch.ones(2, device="npu")
    dist.all_reduce(host, group=both)
    dist.all_reduce(device, group=both)
    gloo_only = dist.new_group(backend="gloo")
    with pytest.raises(RuntimeError, match="npu tensors need a process group with the 'hccl' backend"):
        dist.all_reduce(torch.ones(2, device="npu"), group=gloo_only)
    with pytest.raises(NotImplementedError, match="PREMUL_SUM is not emulated"):
        dist.all_reduce(torch.ones(2, device="npu"), op=dist._make_nccl_premul_sum(0.5))
    return f"{host.tolist()} {device.tolist()} {device.device.type}"


def backend_rank(marker_dir: str) -> dict:
    """One process group, everything on it (each spawn costs seconds on a busy machine)."""
    results = collectives_rank()
    results["barrier_waited"] = barrier_rank(marker_dir)
    results["host_tensors"] = host_tensors_rank()
    return results


@pytest.mark.slow
def test_collectives_on_npu_tensors_give_the_collectives_numbers(tmp_path):
    ranks = run_distributed(backend_rank, str(tmp_path), world_size=WORLD)
    inputs = [rank_input(rank) for rank in range(WORLD)]
    total = inputs[0] + inputs[1]
    expected_everywhere = {
        "all_reduce": total,
        "all_reduce_avg": total / WORLD,
        "all_reduce_max": torch.maximum(inputs[0], inputs[1]),
        "all_gather_into_tensor": torch.cat(inputs),
        "broadcast": inputs[1],
        "all_gather": torch.stack(inputs),
        "funcol_all_gather": torch.cat(inputs),
        "funcol_all_reduce": total,
    }
    for rank, results in enumerate(ranks):
        for name, expected in expected_everywhere.items():
            torch.testing.assert_close(results[name], expected, rtol=0, atol=0, msg=f"{name}, rank {rank}")
        shard = total.chunk(WORLD)[rank]
        torch.testing.assert_close(results["reduce_scatter_tensor"], shard, rtol=0, atol=0)
        torch.testing.assert_close(results["reduce_scatter_tensor_avg"], shard / WORLD, rtol=0, atol=0)
        assert set(results["devices"].values()) == {"npu"}, results["devices"]
        assert results["objects"] == [{"rank": 0}, {"rank": 1}]
        assert results["barrier_waited"], f"rank {rank} passed the barrier before rank 1 reached it"
        assert results["host_tensors"] == "[2.0, 2.0] [2.0, 2.0] npu"


def failing_ranks() -> None:
    """Rank 1 lives on without joining rank 0's all_reduce, then raises: rank 0's collective must fail after the
    group's timeout (3 s), and the run must fail with both ranks' reasons."""
    rank = init_hccl(seconds=3)
    if rank == 1:
        time.sleep(6)
        raise ValueError(f"rank {rank} refuses, pid {os.getpid()}")
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(2, device="npu"))
    except RuntimeError as error:
        raise AssertionError(f"rank 0 gave up after {time.monotonic() - started:.1f} s: {error}") from error


@pytest.mark.slow
def test_a_failing_run_says_why_in_bounded_time():
    started = time.monotonic()
    with pytest.raises(DistributedRunError, match=r"2 rank\(s\) failed") as failure:
        run_distributed(failing_ranks, world_size=WORLD, timeout=60)
    assert time.monotonic() - started < 60, "the harness timeout, not the collective's, ended the run"
    report = str(failure.value)
    assert re.search(r"rank 0 gave up after [3-5]\.\d s", report), report  # the group's timeout
    assert "ValueError: rank 1 refuses" in report
    assert "in failing_ranks" in report  # the child's traceback, with its frames


def sleeping_rank() -> None:
    time.sleep(600)


def test_the_harness_kills_a_run_that_outlives_its_timeout():
    started = time.monotonic()
    with pytest.raises(DistributedRunError, match="did not finish in 3 s"):
        run_distributed(sleeping_rank, world_size=WORLD, timeout=3)
    assert time.monotonic() - started < 30
