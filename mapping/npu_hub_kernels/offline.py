"""Put built cards into a Hugging Face Hub cache, so `get_kernel(..., version=N)` loads them offline.

For air-gapped Ascend hosts (copy `build/` over, seed the cache, set HF_HUB_OFFLINE=1), and for the
demo and tests, which have no Hub to reach. The layout is the one the `kernels` loader reads in
offline mode: `<cache>/kernels--<org>--<card>/refs/v<version>` holding a commit id and
`snapshots/<commit>/` holding the repository files (`README.md`, `build/<variant>/...`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import constants
from huggingface_hub.file_download import repo_folder_name


def default_cache_dir() -> Path:
    """Where `kernels` looks: $KERNELS_CACHE if set, else the Hub cache ($HF_HUB_CACHE)."""
    return Path(os.environ.get("KERNELS_CACHE") or constants.HF_HUB_CACHE)


def card_version(card_dir: Path) -> int:
    """The card API version recorded in the built variants (they all agree; the build writes one)."""
    versions = {json.loads(p.read_text())["version"] for p in sorted(card_dir.glob("build/*/metadata.json"))}
    if len(versions) != 1:
        raise ValueError(f"{card_dir}: expected one version across the build variants, found {sorted(versions)}")
    return versions.pop()


def tree_commit(card_dir: Path) -> str:
    """A commit id (40 hex digits) determined by the card tree's paths and contents."""
    digest = hashlib.sha1()
    for path in sorted(p for p in card_dir.rglob("*") if p.is_file()):
        digest.update(path.relative_to(card_dir).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def seed_offline_cache(build_dir: str | Path, org: str, cache_dir: str | Path | None = None) -> dict[str, Path]:
    """Copy every built card of `build_dir` into the cache as `<org>/<card>`; returns repo id -> snapshot.

    A snapshot is copied to a temporary folder and renamed into place before the ref points at it,
    so a reader never sees a half-written snapshot.
    """
    build_dir = Path(build_dir)
    cards = sorted(p for p in build_dir.iterdir() if (p / "build").is_dir()) if build_dir.is_dir() else []
    if not cards:
        raise FileNotFoundError(f"No built cards in {build_dir}: run `make build` first.")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    seeded = {}
    for card_dir in cards:
        repo_id = f"{org}/{card_dir.name}"
        repo_cache = cache / repo_folder_name(repo_id=repo_id, repo_type="kernel")
        commit = tree_commit(card_dir)
        snapshot = repo_cache / "snapshots" / commit
        if not snapshot.is_dir():
            snapshot.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".seed-", dir=snapshot.parent))
            shutil.copytree(card_dir, staging / "tree", ignore=shutil.ignore_patterns("__pycache__"))
            (staging / "tree").rename(snapshot)
            staging.rmdir()
        refs = repo_cache / "refs"
        refs.mkdir(exist_ok=True)
        (refs / f"v{card_version(card_dir)}").write_text(commit)
        seeded[repo_id] = snapshot
    return seeded
