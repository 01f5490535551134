"""The selftest's last result for this host, kept in a per-user cache, and the card forms that stand down for it.

`python -m npu_hub_kernels selftest` records its result in `result_path()`: one file per host identity (`host_key`:
device name, CANN, torch_npu), under huggingface_hub's `HF_HOME` (`$HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else
`~/.cache/huggingface`) in `npu-hub-kernels/selftest/`, or under `$NPU_HUB_KERNELS_SELFTEST_DIR` when set. Nodes of
a cluster that share a home directory and a device, CANN and torch_npu share the result: each run merges the cards it
judged into the file under a lock and replaces it whole (`save_result`), so concurrent runs keep every card's latest
verdict and a reader never finds the file missing or half written.

`register_npu_kernels()` reads it (`stand_down`): each card form whose numbers failed there makes the card's layers
that run it stay eager, with the reason "failed the selftest on this host: ...", as long as the result is for this
device, CANN and torch_npu, and for the card version and build variant (its metadata.json digest) that would load
now. `register_npu_kernels(use_selftest=False)`, or `NPU_HUB_KERNELS_USE_SELFTEST=0`, turns this off.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import sys
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import constants
from huggingface_hub.file_download import repo_folder_name

from .. import _kernels_compat as compat
from ..cards import Card
from ..offline import default_cache_dir

logger = logging.getLogger(__name__)

DIR_ENV = "NPU_HUB_KERNELS_SELFTEST_DIR"
USE_ENV = "NPU_HUB_KERNELS_USE_SELFTEST"
REASON_PREFIX = "failed the selftest on this host: "
SCHEMA = 1
"""The version of the result's JSON schema (docs/selftest.md)."""
NOT_RUN = "not run"
VERDICTS = ("pass", "findings", NOT_RUN, "bugs", "fail", "not loaded")
"""Card verdicts from best to worst: findings (the device accepts calls the ledger refuses), not run (no form of the
card was judged: none applies at the run's widths, or the card runs each eager there), bugs (the device refuses calls
the ledger accepts, or a card's call at a limit raised), fail (a form's numbers failed, or its fused call raised: the
form stands down), not loaded (the loader found no build of the card for this host)."""

_stood_down: dict[tuple[str, str], str] = {}
"""(card, layer) -> why it stays eager, for the cards the last `register_npu_kernels` registered."""


def worst_verdict(verdicts: Iterable[str]) -> str:
    """The worst of card verdicts (`VERDICTS`), "pass" for none."""
    return max(verdicts, key=VERDICTS.index, default="pass")


def results_dir() -> Path:
    """Where the selftest keeps its results.

    $NPU_HUB_KERNELS_SELFTEST_DIR (`~` expanded, as HF_HOME's), else <HF_HOME>/npu-hub-kernels/selftest."""
    configured = os.environ.get(DIR_ENV)
    return Path(configured).expanduser() if configured else Path(constants.HF_HOME) / "npu-hub-kernels" / "selftest"


def host_key() -> dict[str, str] | None:
    """This host's identity for the results: device name, CANN and torch_npu; None without an npu device."""
    torch_npu = sys.modules.get("torch_npu")
    if torch_npu is None:
        if importlib.util.find_spec("torch_npu") is None:
            return None
        torch_npu = importlib.import_module("torch_npu")
    if not torch.npu.is_available():
        return None
    from torch_npu.utils.collect_env import get_cann_version

    return {
        "device": str(torch.npu.get_device_name(0)),
        "cann": str(get_cann_version()),
        "torch_npu": str(getattr(torch_npu, "__version__", "unknown")),
    }


def result_path(host: dict[str, str]) -> Path:
    """The file of the result for `host` (`host_key`)."""
    digest = hashlib.sha256(json.dumps(host, sort_keys=True).encode()).hexdigest()[:16]
    return results_dir() / f"result-{digest}.json"


def save_result(report: dict[str, Any]) -> Path:
    """Merge `report` (the selftest's JSON report) into the kept result of its host; returns the file.

    Under a lock on the `.lock` file beside it (`fcntl.flock`), the kept result is read, each card `report` judged
    replaces its entry (`merged`), and the whole is written to a temporary file of this writer's own in the same
    folder, then renamed over the result: concurrent runs each add their cards, and a reader sees the old result or
    the new one, never none or half of one. Raises OSError when the folder cannot be written (`results_dir_problem`
    says why, asked first).
    """
    path = result_path(report["host"])
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_suffix(".lock")):
        _write_atomically(path, json.dumps(merged(_read(path, report["host"]), report), indent=2))
    return path


def merged(kept: dict[str, Any] | None, report: dict[str, Any]) -> dict[str, Any]:
    """`report`, holding also the cards of `kept` it did not judge: each card's latest judged entry.

    An entry that judged no form (`not run`, `not loaded`, `bugs` with no form judged; or one kept by an older
    version without `judged_forms`) never replaces one that judged forms, whatever the timestamps or the order the
    runs saved in: the earlier verdict stands. Between two entries that both judged forms, or both none, the later
    `judged_at` wins (a concurrent run may finish a card after this one). The verdict is the worst of all the cards.
    """
    cards = dict(kept["cards"]) if kept else {}
    for name, entry in report["cards"].items():
        earlier = cards.get(name)
        later = earlier is None or str(earlier.get("judged_at", "")) <= str(entry.get("judged_at", ""))
        if earlier is None or (judged(entry), later) > (judged(earlier), False):
            cards[name] = entry
    return {**report, "cards": cards, "verdict": worst_verdict(entry["verdict"] for entry in cards.values())}


def judged(entry: dict[str, Any]) -> bool:
    """Whether a card's entry rests on judged forms.

    That is `judged_forms` above 0, or (kept by a version that did not count them) forms that failed. A `pass`
    without `judged_forms` is not trusted: its card is checked again."""
    count = entry.get("judged_forms")
    if isinstance(count, int) and not isinstance(count, bool):
        return count > 0
    return bool(entry.get("failed"))


def results_dir_problem(host: dict[str, str] | None = None) -> str | None:
    """Why a result could not be kept in `results_dir()`, or None if it can.

    Found by making the folder and a file in it, and for `host` by opening its lock file to append and taking and
    releasing the lock. The selftest asks before it runs a form, so that an unwritable folder, a lock or result path
    that is a folder, a lock file of another user or a file system without `flock` stops it at once, not after the work.
    """
    folder = results_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".writable-"):
            pass
        if host is None:
            return None
        path = result_path(host)
        for kept in (path, path.with_suffix(".lock")):
            if kept.is_dir():
                return f"{kept} is a folder; remove it"
        with path.with_suffix(".lock").open("a") as file:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another run holds it: locking works here, the save waits its turn
                return None
            fcntl.flock(file, fcntl.LOCK_UN)
    except OSError as error:
        return os_reason(error)
    return None


def os_reason(error: OSError) -> str:
    """An OSError in a few words: what the system said, and about which path."""
    if not error.strerror:
        return str(error)
    return f"{error.strerror} ({error.filename})" if error.filename else error.strerror


def load_result(host: dict[str, str]) -> dict[str, Any] | None:
    """The last result kept for `host`, None if there is none (or it cannot be read, or is of another schema)."""
    return _read(result_path(host), host)


def summary() -> str:
    """One line on this host's last selftest result, for the doctor: its verdict and file, or how to run it."""
    run = "python -m npu_hub_kernels selftest (docs/selftest.md)"
    try:
        host = host_key()
    except Exception:  # a broken torch_npu: the doctor reports it on its own line
        host = None
    if host is None:
        return f"no npu device: {run} runs on an Ascend host"
    result = load_result(host)
    if result is None:
        return f"not run on this host: {run}"
    failed = sorted(f"{card}: {form}" for card, entry in result["cards"].items() for form in entry["failed"])
    stands_down = f"; stands down {', '.join(failed)}" if failed else ""
    return f"{result['verdict']} on {result.get('started', '?')} ({result_path(host)}){stands_down}"


def variant_digest(variant_dir: Path) -> str:
    """The build variant's identity: the sha256 of its metadata.json (which holds the digest of its files)."""
    return hashlib.sha256((Path(variant_dir) / "metadata.json").read_bytes()).hexdigest()


def stand_down(cards: list[Card], *, org: str, version: int, local_dir: str | Path | None, use: bool | None) -> None:
    """Read the last result for this host and stand down the layers of the card forms that failed there.

    `use` None: as $NPU_HUB_KERNELS_USE_SELFTEST says (default on). Called by `register_npu_kernels`.
    """
    _stood_down.clear()
    if use is False or (use is None and os.environ.get(USE_ENV, "1") == "0"):
        return
    try:
        host = host_key()
    except Exception as error:  # a broken torch_npu is the doctor's finding, not a reason to fail registering
        logger.debug("no selftest result applies: this host's identity cannot be read (%s)", error)
        return
    result = None if host is None else load_result(host)
    if result is None:
        return
    for card in cards:
        recorded = result.get("cards", {}).get(card.repo_name)
        if not recorded or not recorded.get("failed") or recorded.get("version") != version:
            continue
        loads = _variant_that_loads(card, org=org, version=version, local_dir=local_dir)
        if loads != (recorded.get("variant"), recorded.get("digest")):
            logger.debug("the selftest result of %s is for another build (%s), ignored", card.repo_name, loads)
            continue
        for form, failure in recorded["failed"].items():
            layers = card.layers if failure["layers"] == ["*"] else failure["layers"]
            for layer in layers:
                _stood_down[(card.repo_name, layer)] = f"{REASON_PREFIX}{form}: {failure['why']}"


def stood_down(card: str, layer: str) -> str | None:
    """Why the card's layer stays eager on this host after its selftest, or None."""
    return _stood_down.get((card, layer))


def forget() -> None:
    """Stand nothing down (`unregister_npu_kernels`)."""
    _stood_down.clear()


def _read(path: Path, host: dict[str, str]) -> dict[str, Any] | None:
    """The result in `path` if it is one for `host` in this schema, else None.

    A file that is not a result (not JSON, or JSON of another shape) is no result: a warning says so once per file,
    and the next selftest replaces it. An entry kept by a version that did not count `judged_forms` and says `pass`
    is read as `not run` (`judged`): it is not trusted until the selftest checks the card again.
    """
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        result = json.loads(text)
    except ValueError as error:
        return _unreadable(path, f"not JSON ({error})")
    if not isinstance(result, dict):
        return _unreadable(path, f"JSON {type(result).__name__}, not a result")
    if result.get("schema") != SCHEMA or result.get("host") != host:
        return None
    if why := _not_a_result(result):
        return _unreadable(path, why)
    for name, entry in result["cards"].items():
        if entry["verdict"] == "pass" and not judged(entry):
            result["cards"][name] = {**entry, "verdict": NOT_RUN, "not_run": "kept without judged forms: run again"}
    return result


_warned: set[str] = set()
"""The unreadable result files a warning was given for (once each per process)."""


def _unreadable(path: Path, why: str) -> None:
    if str(path) not in _warned:
        _warned.add(str(path))
        logger.warning("the kept selftest result %s is unreadable (%s): ignored; the next selftest replaces it", path,
                       why)  # fmt: skip
    return None


def _not_a_result(result: dict[str, Any]) -> str | None:
    """Why `result` (a dict of this schema and host) is not a result the selftest wrote, or None."""
    if not isinstance(result.get("cards"), dict):
        return "its cards are not a mapping"
    if not isinstance(result.get("verdict"), str) or not isinstance(result.get("started", ""), str):
        return "no verdict"
    for name, entry in result["cards"].items():
        if not isinstance(entry, dict) or entry.get("verdict") not in VERDICTS:
            return f"the entry of {name} has no verdict"
        failed = entry.get("failed")
        if not isinstance(failed, dict) or not all(map(_is_failure, failed.values())):
            return f"the entry of {name} has no failed forms"
    return None


def _is_failure(failure: Any) -> bool:
    """Whether `failure` is a failed form's record: the layers that run it and why."""
    return isinstance(failure, dict) and isinstance(failure.get("layers"), list) and isinstance(failure.get("why"), str)


@contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """Hold an exclusive `fcntl.flock` on `lock` (made if missing, and kept: removing it would race) in the block."""
    with lock.open("a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def _write_atomically(path: Path, text: str) -> None:
    """Write `text` to a new file of a name no other writer uses beside `path`, flushed to disk, renamed over `path`."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    try:
        with temporary.open("x") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _variant_that_loads(card: Card, *, org: str, version: int, local_dir: str | Path | None) -> tuple[str, str] | None:
    """(variant, `variant_digest`) of the build the loader would take now, from the folder or the Hub cache.

    None when it cannot be known without the network (then no result applies: the selftest loads the cards, so a
    host that ran it has them in its cache).
    """
    try:
        if local_dir is not None:
            build = Path(local_dir) / card.repo_name / "build"
        else:
            commit = compat.version_commit(card.repo_id(org), version, local_files_only=True)
            folder = repo_folder_name(repo_id=card.repo_id(org), repo_type="kernel")
            build = default_cache_dir() / folder / "snapshots" / commit / "build"
        accepted, _ = compat.resolve_variants(compat.get_variants_local(build))
        variant = accepted[0].variant_str
        return variant, variant_digest(build / variant)
    except Exception as error:  # not cached, or not resolvable here: the result cannot be matched
        logger.debug("%s: the build that would load is unknown offline (%s)", card.repo_name, error)
        return None
