"""The suite's watchdog (tests/stuck_tests.py) ends a test stuck holding the GIL, names it and shows its stack."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

STUCK = """
import ctypes


def test_holds_the_gil_while_it_waits():
    ctypes.PyDLL(None).sleep(120)  # a C call that keeps the GIL: no signal handler or Python thread can run


def test_after_it():
    pass
"""


def _run_stuck(tmp_path: Path, *pytest_args: str) -> subprocess.CompletedProcess:
    """Run STUCK's two tests with the suite's watchdog at 3 s, as a run of its own."""
    (tmp_path / "conftest.py").write_text(
        "from stuck_tests import pytest_configure, pytest_runtest_protocol, pytest_terminal_summary  # noqa: F401\n"
    )
    (tmp_path / "test_stuck.py").write_text(STUCK)
    env = {**os.environ, "PYTHONPATH": str(TESTS), "NPU_HUB_KERNELS_STUCK_TEST_SECONDS": "3"}
    env.pop("NPU_HUB_KERNELS_STUCK_TEST_DUMPS", None)  # this run's own folder, as a run of its own makes
    command = [sys.executable, "-m", "pytest", *pytest_args, "-p", "no:cacheprovider", str(tmp_path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=90, cwd=tmp_path, env=env)


STUCK_LINE = 'test_stuck.py", line 6 in test_holds_the_gil_while_it_waits'


@pytest.mark.slow
def test_a_test_stuck_holding_the_gil_fails_by_name_with_its_stack_and_the_run_goes_on(tmp_path):
    """Under xdist, as `make test` runs: the stuck test is reported as its worker's crash, the controller prints the
    stack from the watchdog's file, the other test passes, and the run ends long before the stuck call would."""
    run = _run_stuck(tmp_path, "-n", "2")
    out = run.stdout
    assert run.returncode == 1, out + run.stderr
    assert "crashed while running 'test_stuck.py::test_holds_the_gil_while_it_waits'" in out, out
    assert "test_stuck.py::test_holds_the_gil_while_it_waits still ran after 3 s" in out, out
    assert STUCK_LINE in out, out
    assert "1 failed, 1 passed" in out, out


def test_without_xdist_a_stuck_test_ends_the_run_with_its_stack_on_the_terminal(tmp_path):
    """A run of its own (as `make test-long-context` runs): pytest captures stderr during the test, so the watchdog
    writes to the stderr the run started with, and the run ends with the stack rather than hanging."""
    run = _run_stuck(tmp_path)
    assert run.returncode != 0
    assert "Timeout (0:00:03)!" in run.stderr and STUCK_LINE in run.stderr, run.stdout + run.stderr
