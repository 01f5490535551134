"""The test process is an emulated Ascend host (CANN 9.1.0) with no Hub to reach.

(On a real Ascend host, NPU_HUB_KERNELS_REAL_NPU=1 leaves the emulation out and runs tests/test_hardware.py.)

Order matters: the Hub environment is fixed before huggingface_hub is imported, and the npu
emulation is installed before anything touches devices. Tests that need a plain CPU host run a
subprocess (see `run_python`).
"""

from __future__ import annotations

import atexit
import importlib
import os
import pkgutil
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

# One torch thread per process, children included (they inherit the variable): `make test` runs two xdist
# workers on two cores, and torch's default of one thread per core oversubscribes them. Tiny-model ops then spend
# their time in the thread pool's hand-offs: measured on 2 busy cores, 8 tiny-model cycles of
# test_load_and_threads took 21 s with 2 threads per process against 5 to 9 s with 1. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from hub_env import use_offline_hub
from stuck_tests import pytest_configure, pytest_runtest_protocol, pytest_terminal_summary  # noqa: F401 (hooks)

_HUB_CACHE = tempfile.mkdtemp(prefix="npu-hub-kernels-test-hub-")
use_offline_hub(_HUB_CACHE)
# The process's own Hub cache (up to 28 MB: cards seeded for offline loading) goes with it: every test process
# (each xdist worker, each pytest run a test starts) left its folder in /tmp, and 1,286 of them had built up here.
atexit.register(shutil.rmtree, _HUB_CACHE, ignore_errors=True)

import pytest  # noqa: E402

from npu_hub_kernels.testing import emulation  # noqa: E402

if os.environ.get("NPU_HUB_KERNELS_REAL_NPU") != "1":  # on an Ascend host, test the real device
    emulation.install()

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import build_cards  # noqa: E402
import proof  # noqa: E402

from npu_hub_kernels import register_npu_kernels, unregister_npu_kernels  # noqa: E402
from npu_hub_kernels.models import fingerprints  # noqa: E402
from npu_hub_kernels.offline import seed_offline_cache  # noqa: E402

TEST_ORG = "npu-hub-kernels-test"

if proof.proving():  # scripts/model_tables.py prove: every listed class swapped, whatever its installed code
    fingerprints.unproven_reason = lambda card, path, code: None


@pytest.fixture(scope="session")
def built_cards(tmp_path_factory) -> Path:
    """All cards built into a fresh folder (what `make build` writes to build/)."""
    out = tmp_path_factory.mktemp("build")
    build_cards.main(["--out", str(out)])
    return out


@pytest.fixture(scope="module")
def card(request: pytest.FixtureRequest, built_cards: Path) -> ModuleType:
    """The built card a card's test file tests (tests/test_<card package>.py), loaded with `get_local_kernel`.

    On the emulated host (CANN 9.1.0) that is the card's arch build for this torch and CANN."""
    from kernels import get_local_kernel

    from npu_hub_kernels import CARDS

    package = request.module.__name__.rpartition(".")[2].removeprefix("test_")
    (tested,) = [c for c in CARDS.values() if c.python_name == package]
    module = get_local_kernel(built_cards / tested.repo_name)
    if emulation.is_installed():
        assert f"torch213-cxx11-cann91-{platform.machine()}-linux" == module.VARIANT
    return module


@pytest.fixture(scope="session")
def offline_hub(built_cards) -> str:
    """The built cards in the offline Hub cache as TEST_ORG/<card>; returns the org."""
    seed_offline_cache(built_cards, TEST_ORG, _HUB_CACHE)
    return TEST_ORG


@pytest.fixture(autouse=True)
def kernels_mapping_restored():
    """Every test sees kernels' process-wide layer mapping as it was before it.

    transformers' use_kernels adds its own entries to it (liger-kernels' for "RMSNorm", ...), which a later kernelize
    in the same worker, offline, could not load: which test then fails would depend on xdist's scheduling. Each test
    runs on a copy of the mapping (kernels' `use_kernel_mapping`, inheriting), dropped afterwards."""
    from kernels import use_kernel_mapping

    with use_kernel_mapping({}, inherit_mapping=True):
        yield


@pytest.fixture
def cann_version():
    """Set the CANN version the emulated host reports for one test, then restore it."""
    import torch

    before = torch.version.cann
    yield emulation.set_cann_version
    emulation.set_cann_version(before)


def imported_modeling_modules() -> list[ModuleType]:
    """Every transformers modeling module that imports here (one with a missing optional dependency is skipped)."""
    import transformers.models

    modules = []
    for model in pkgutil.iter_modules(transformers.models.__path__):
        if not model.ispkg:
            continue
        package = importlib.import_module(f"transformers.models.{model.name}")
        for file in pkgutil.iter_modules(package.__path__):
            if file.name.startswith("modeling_"):
                try:
                    modules.append(importlib.import_module(f"{package.__name__}.{file.name}"))
                except ImportError:  # optional dependency missing (e.g. torchaudio)
                    continue
    return modules


@pytest.fixture
def npu_kernels(built_cards):
    """The cards registered for "npu" from the local build; the classes are restored afterwards."""
    register_npu_kernels(local_dir=built_cards)
    yield built_cards
    unregister_npu_kernels()


def run_python(code: str, *, emulate: bool = False, env: dict[str, str] | None = None, timeout: int = 300) -> str:
    """Run code in a fresh interpreter (a plain CPU host unless `emulate`); return its stdout."""
    prelude = "from npu_hub_kernels.testing import emulation; emulation.install()\n" if emulate else ""
    result = subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )
    if result.returncode != 0:
        raise AssertionError(f"subprocess failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout
