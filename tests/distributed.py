"""Run a test function in N processes of one emulated Ascend host, as `torchrun --nproc-per-node N` would.

    results = run_distributed(train_rank, str(built_cards), world_size=2)  # one result per rank

`train_rank(*args)` must be a module-level function of an importable module (a test file). Each process is
spawned fresh: it gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT, the offline
Hub environment of the tests (tests/hub_env.py) and the npu emulation, then imports the function's module and
calls it; the function calls `torch.distributed.init_process_group(...)` itself (its backend is part of what it
tests). Return values come back pickled through files. A rank that raises fails the run with every rank's
traceback and output; a run that takes longer than `timeout` seconds is killed, and fails with the output.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

DEFAULT_TIMEOUT = 180.0
"""Seconds a whole run may take before its processes are killed (tests/test_distributed_training.py: < 60 s each)."""
GRACE_AFTER_FAILURE = 10.0
"""Seconds the other ranks get to finish after one failed (they are usually blocked in a collective)."""


class DistributedRunError(AssertionError):
    """A rank failed, or the run did not finish in time; the message holds every rank's traceback and output."""


def run_distributed(
    function: Callable,
    *args,
    world_size: int = 2,
    timeout: float = DEFAULT_TIMEOUT,
    cpu_threads: int = 1,
    env: dict[str, str] | None = None,
) -> list:
    """Call `function(*args)` in `world_size` fresh processes; return each rank's return value, by rank.

    Args:
        function: a module-level function (found again by module and name in each process).
        args: picklable arguments, the same for every rank (a rank reads its own from RANK).
        world_size: the number of processes.
        timeout: seconds before every process is killed and the run fails.
        cpu_threads: torch's intra-op threads per process (the ranks share the machine's cores).
        env: environment variables set in every process after the launcher's own (which they may override).
    """
    if "." in function.__qualname__:
        raise ValueError(f"{function.__qualname__} is not a module-level function: each process imports it by name")
    target = (function.__module__, function.__qualname__)
    hub_cache = os.environ.get("HF_HUB_CACHE") or tempfile.mkdtemp(prefix="npu-hub-kernels-test-hub-")
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="npu-hub-kernels-distributed-") as folder:
        run_dir = Path(folder)
        port = _free_loopback_port()
        processes = [
            context.Process(
                target=_rank_main,
                args=(target, args, rank, world_size, port, str(run_dir), hub_cache, cpu_threads, env or {}),
                name=f"rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        try:
            finished = _wait(processes, timeout)
        finally:
            for process in processes:  # only the processes this run started
                if process.is_alive():
                    process.kill()
                process.join(5)
        failed = [p for p in processes if p.exitcode != 0]
        if not finished or failed:
            problem = f"did not finish in {timeout:.0f} s" if not finished else f"{len(failed)} rank(s) failed"
            raise DistributedRunError(f"{function.__qualname__} on {world_size} ranks {problem}:\n" + _report(run_dir))
        return [pickle.loads((run_dir / f"rank{rank}.result").read_bytes()) for rank in range(world_size)]


def _free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait(processes, timeout: float) -> bool:
    """Wait for every process; once one fails, give the others a grace period. Whether all ended in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p.exitcode is not None for p in processes):
            return True
        if any(p.exitcode not in (None, 0) for p in processes):
            deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE)
        time.sleep(0.05)
    return all(p.exitcode is not None for p in processes)


def _report(run_dir: Path) -> str:
    parts = []
    for log in sorted(run_dir.glob("rank*.log")):
        rank = log.stem
        error = run_dir / f"{rank}.error"
        body = error.read_text() if error.exists() else "(no Python exception recorded)\n"
        parts.append(f"===== {rank}: exception =====\n{body}===== {rank}: output =====\n{_tail(log)}")
    return "\n".join(parts)


def _tail(log: Path, limit: int = 20000) -> str:
    text = log.read_text(errors="replace")
    return text if len(text) <= limit else "...\n" + text[-limit:]


def _rank_main(target, args, rank, world_size, port, run_dir, hub_cache, cpu_threads, env) -> None:
    """The process of one rank: environment, emulation, then the function; its result or traceback to run_dir."""
    run_dir = Path(run_dir)
    log = open(run_dir / f"rank{rank}.log", "w")  # noqa: SIM115 (the process's stdout and stderr until exit)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    exit_code = 1
    try:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        os.environ.update(env)
        tests_dir = str(Path(__file__).resolve().parent)
        if tests_dir not in sys.path:
            sys.path.insert(0, tests_dir)
        from hub_env import use_offline_hub

        use_offline_hub(hub_cache)
        import torch

        from npu_hub_kernels.testing import emulation

        emulation.install()
        torch.set_num_threads(cpu_threads)
        module_name, name = target
        result = getattr(importlib.import_module(module_name), name)(*args)
        (run_dir / f"rank{rank}.result").write_bytes(pickle.dumps(result))
        exit_code = 0
    except BaseException:
        (run_dir / f"rank{rank}.error").write_text(traceback.format_exc())
    finally:
        with contextlib.suppress(Exception):
            _destroy_process_group()
        log.flush()
        os._exit(exit_code)  # no interpreter teardown: a failed rank's peers may still hold sockets and threads


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
