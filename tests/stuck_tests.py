"""A stuck test ends its process with every thread's stack, whatever it is stuck on (hooks that conftest.py imports).

A test may hang where no Python code can run: a thread that waits for a lock while holding the GIL (torch's autograd
takes a tensor's mutex and then the GIL in the emulated device's guard, tests/test_load_and_threads.py) keeps every
other thread, a signal handler or a timer thread included, from running. faulthandler's watchdog is a C thread that
needs no GIL: after STUCK_TEST_SECONDS it writes every thread's Python stack and ends the process. Under xdist the
worker's end is reported as that test's failure ("worker 'gw0' crashed while running ...") and a fresh
worker takes the rest of the run; the controller prints the stacks in its summary. Without this, a stuck worker held
`make test` until CI's own limit, which reports nothing (with work stealing the other worker waits for its queue).
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import shutil
import tempfile
from pathlib import Path

import pytest

STUCK_TEST_SECONDS = float(os.environ.get("NPU_HUB_KERNELS_STUCK_TEST_SECONDS", 900))
"""A test still running after 15 minutes is stuck: the slowest take under a minute on 2 busy cores, and the
distributed ones end their ranks within 10 (tests/distributed.py, tests/test_ulysses_sp.py). The variable is for the
watchdog's own test."""

_DUMPS_VARIABLE = "NPU_HUB_KERNELS_STUCK_TEST_DUMPS"
"""The folder of one xdist run's stack files, made by the run's controller and inherited by its workers."""

_OWNED_DUMPS = pytest.StashKey[str]()
_dump_file = None
_terminal = None
"""A process of its own writes the stacks to the stderr it started with, duplicated at configure time: during a test
pytest captures descriptor 2, and what the watchdog wrote there would go with the process."""


def pytest_configure(config: pytest.Config) -> None:
    """Make the run's stack folder (an xdist controller), or keep the terminal's stderr (a process of its own)."""
    global _terminal
    if config.getoption("numprocesses", None) and _DUMPS_VARIABLE not in os.environ:
        config.stash[_OWNED_DUMPS] = os.environ[_DUMPS_VARIABLE] = tempfile.mkdtemp(prefix="npu-hub-kernels-stuck-")
    if not hasattr(config, "workerinput"):
        _terminal = open(os.dup(2), "w")  # noqa: SIM115 (open for the process's life)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Arm the watchdog for the test and disarm it when the test ends. An xdist worker writes the stacks to its file,
    under the test's id, for the controller to print; a process of its own writes them to its terminal."""
    worker = hasattr(item.config, "workerinput") and _DUMPS_VARIABLE in os.environ
    dump = _stack_file() if worker else _terminal
    if worker:
        dump.write(f"{item.nodeid} still ran after {STUCK_TEST_SECONDS:g} s; the stacks of its process's threads:\n")
        dump.flush()
    faulthandler.dump_traceback_later(STUCK_TEST_SECONDS, exit=True, file=dump)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        if worker:
            dump.seek(0)
            dump.truncate()


def _stack_file():
    """This worker's stack file (opened once and kept open: the watchdog writes to its descriptor); removed at a
    normal exit, kept when the watchdog ends the process."""
    global _dump_file
    if _dump_file is None:
        path = Path(os.environ[_DUMPS_VARIABLE]) / f"{os.getpid()}.txt"
        _dump_file = open(path, "w")  # noqa: SIM115 (open for the process's life)
        atexit.register(path.unlink, missing_ok=True)
    return _dump_file


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """The xdist run's controller prints each stuck test's stacks, then removes the folder it made."""
    folder = config.stash.get(_OWNED_DUMPS, None)
    if folder is None:
        return
    for dump in sorted(Path(folder).glob("*.txt")):
        text = dump.read_text(errors="replace").strip()
        if text:
            terminalreporter.section("stuck test", sep="=", red=True)
            terminalreporter.write_line(text)
    shutil.rmtree(folder, ignore_errors=True)
