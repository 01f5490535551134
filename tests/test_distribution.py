"""Offline and pinned use of the cards, end to end against the loopback Hub (tests/hub_server.py).

Each user step runs in a fresh interpreter that knows the Hub and the cache only through its environment,
as a user's process would: a connected machine downloads or locks, then the Hub is stopped and an
air-gapped process (HF_HUB_OFFLINE=1, emulated Ascend host or plain CPU host) loads and kernelizes.

What kernels 0.17.2 with huggingface_hub 2.4.0 does, as these tests hold it:
- Offline, kernels reads `refs/v<N>` of the cache to find version N, and hands huggingface_hub's
  `snapshot_download(local_files_only=True)` the whole repository: no allow_patterns. That call refuses a
  snapshot whose cached file listing (`trees/<commit>.json`, written by every online snapshot_download)
  names files that are not there. So a download limited to some build variants (allow_patterns, and
  `kernels download` with or without --all-variants) cannot be loaded offline from the Hub cache. A full
  snapshot can. Variants for one target only go to plain folders, loaded with `local_dir=`.
- `LOCAL_KERNELS=<repo id>=<folder>:...` makes get_kernel load that folder (its best variant for the
  host), with neither the version nor the publisher checked. `register_npu_kernels` goes through
  `LayerRepository`, which resolves `v<N>` to a commit before get_kernel sees LOCAL_KERNELS.
- `kernels lock <project>` reads `[tool.kernels.dependencies]` of its pyproject.toml and writes
  kernels.lock (repo id, version, commit). It refuses a publisher the Hub does not mark trusted, with no
  override. `load_kernel(repo_id, lockfile=...)` never downloads: it loads the locked commit from the cache.

Telemetry stays on in these processes: with HF_HUB_DISABLE_TELEMETRY=1, kernels 0.17.2 builds a user agent
ending in "; ", which the HTTP client refuses to send (tests/test_doctor.py shows the doctor's hint).
"""

from __future__ import annotations

import json
import platform
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hub_server import LoopbackHub, client_env
from huggingface_hub import HfApi, constants
from kernels import Mode, get_kernel, kernelize
from test_loading import FUSED_CALL

from npu_hub_kernels import register_npu_kernels, unregister_npu_kernels
from npu_hub_kernels.cards import CARDS
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm

ORG = "npu-hub-kernels-dist"
UNTRUSTED_ORG = "npu-hub-kernels-untrusted"
TOKEN = "hf_loopback_distributor"
CARD_NAMES = sorted(card.repo_name for card in CARDS.values())
ARCH_VARIANT = f"torch213-cxx11-cann91-{platform.machine()}-linux"
TARGET_VARIANTS = sorted([ARCH_VARIANT, "torch-npu", "torch-universal"])
"""What an Ascend host like this one (torch 2.13, CANN 9.1) can load, best first in kernels' order aside."""

LOAD_AND_KERNELIZE = f"""
from npu_hub_kernels import register_npu_kernels, swapped_modules
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm, token_ids
from kernels import Mode, kernelize
register_npu_kernels(org="{ORG}", **register_kwargs)
model = tiny_causal_lm("qwen3").to("npu")
kernelize(model, mode=Mode.INFERENCE, device="npu")
with emulation.count_op_calls() as calls:
    model(token_ids().to("npu"))
result["variants"] = sorted({{swap.variant for swap in swapped_modules(model)}})
result["cards"] = sorted({{swap.card for swap in swapped_modules(model)}})
result["calls"] = dict(calls)
"""
"""Register the cards, kernelize a tiny Qwen3 for "npu" and run it; needs `register_kwargs` and `result`."""


def publish_built_cards(hub: LoopbackHub, built_cards: Path, org: str, token: str) -> None:
    """Publish every built card to branch v1 of `<org>/<card>` as `make publish` lays it out, with HfApi."""
    api = HfApi(endpoint=hub.url, token=token)
    for name in CARD_NAMES:
        repo_id = f"{org}/{name}"
        api.create_repo(repo_id, repo_type="kernel")
        api.create_branch(repo_id, branch="v1", repo_type="kernel")
        api.upload_folder(
            repo_id=repo_id,
            folder_path=built_cards / name,
            repo_type="kernel",
            revision="v1",
            ignore_patterns=["*__pycache__*"],  # loading a build in this session may have written some
            commit_message=f"Publish {name} v1",
        )


@pytest.fixture
def hub(built_cards: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LoopbackHub]:
    """A Hub holding every card in ORG (a trusted kernel publisher), and an untrusted org with nothing."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # conftest keeps this process offline
    with LoopbackHub(idle_timeout=120) as hub:
        hub.add_org(ORG, kernels_approved=True, trusted_kernel_publisher=True)
        hub.add_org(UNTRUSTED_ORG, kernels_approved=True)
        hub.add_user("distributor", orgs=[ORG, UNTRUSTED_ORG], token=TOKEN)
        publish_built_cards(hub, built_cards, ORG, TOKEN)
        yield hub
        assert hub.unrouted == [], "the clients called endpoints the loopback Hub does not implement"
        assert hub.errors == []


def user_env(hub_url: str, cache: Path, *, offline: bool = False) -> dict[str, str]:
    """A user's environment: the Hub (unreachable once stopped) and the cache, nothing else of this process."""
    env = client_env(hub_url, cache.parent, cache=cache)
    return {**env, "HF_HUB_OFFLINE": "1"} if offline else env


def run_user(code: str, env: dict[str, str], *, emulate: bool = False) -> dict:
    """Run `code` in a fresh interpreter (an Ascend host if `emulate`); it fills the dict `result`, returned."""
    prelude = "import json\nresult = {}\n"
    if emulate:
        prelude += "from npu_hub_kernels.testing import emulation\nemulation.install()\n"
    process = subprocess.run(
        [sys.executable, "-c", prelude + code + "\nprint(json.dumps(result))\n"],
        env=env,
        cwd=Path(env["HOME"]),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert process.returncode == 0, f"user process failed:\n{process.stdout}\n{process.stderr}"
    return json.loads(process.stdout.splitlines()[-1])


def kernels_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The `kernels` command line of this venv."""
    command = [str(Path(sys.executable).with_name("kernels")), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=180, check=False)


def stop_and_prove_gone(hub: LoopbackHub) -> str:
    """Stop the Hub and check that its port refuses connections; returns its (now dead) URL."""
    url = hub.url
    hub.stop()
    assert not hub.running
    host, port = url.removeprefix("http://").split(":")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=5).close()
    return url


@pytest.mark.slow
def test_air_gapped_host_loads_full_snapshots_with_the_hub_stopped(hub, built_cards, tmp_path):
    cache = tmp_path / "hub-cache"
    download = f"""
from pathlib import Path
from huggingface_hub import snapshot_download
for name in {CARD_NAMES!r}:
    snapshot = Path(snapshot_download("{ORG}/" + name, repo_type="kernel", revision="v1"))
    result[name] = sorted(p.name for p in (snapshot / "build").iterdir())
"""
    downloaded = run_user(download, user_env(hub.url, cache))
    assert downloaded == {name: sorted(p.name for p in (built_cards / name / "build").iterdir()) for name in CARD_NAMES}

    dead_url = stop_and_prove_gone(hub)
    air_gapped = user_env(dead_url, cache, offline=True)
    loaded = run_user(
        f"""
from kernels import get_kernel
from npu_hub_kernels.doctor import diagnose
result["rope"] = get_kernel("{ORG}/npu-rope", version=1).VARIANT
report = diagnose("{ORG}")
result["doctor"] = {{card.card: card.variant for card in report.cards}}
result["doctor_ok"] = report.ok
register_kwargs = {{}}
"""
        + LOAD_AND_KERNELIZE,
        air_gapped,
        emulate=True,
    )
    assert loaded["rope"] == ARCH_VARIANT
    assert loaded["doctor"] == dict.fromkeys(CARD_NAMES, ARCH_VARIANT) and loaded["doctor_ok"]
    assert loaded["variants"] == [ARCH_VARIANT]
    assert {"npu-rms-norm", "npu-rope", "npu-swiglu"} <= set(loaded["cards"])
    assert loaded["calls"]["npu_rms_norm"] > 0 and loaded["calls"]["npu_rotary_mul"] > 0

    cpu = run_user(
        f'from kernels import get_kernel\nresult["rope"] = get_kernel("{ORG}/npu-rope", version=1).VARIANT', air_gapped
    )
    assert cpu["rope"] == "torch-universal"


@pytest.mark.slow
def test_target_only_downloads_load_from_folders_not_from_the_hub_cache(hub, tmp_path):
    cache, folders = tmp_path / "hub-cache", tmp_path / "cards"
    download = f"""
from pathlib import Path
from huggingface_hub import snapshot_download
patterns = [f"build/{{variant}}/*" for variant in {TARGET_VARIANTS!r}]
for name in {CARD_NAMES!r}:
    snapshot_download("{ORG}/" + name, repo_type="kernel", revision="v1", allow_patterns=patterns)
    folder = Path(snapshot_download(
        "{ORG}/" + name, repo_type="kernel", revision="v1", allow_patterns=patterns, local_dir="{folders}/" + name
    ))
    result[name] = sorted(p.name for p in (folder / "build").iterdir())
"""
    downloaded = run_user(download, user_env(hub.url, cache))
    assert downloaded == dict.fromkeys(CARD_NAMES, TARGET_VARIANTS)

    air_gapped = user_env(stop_and_prove_gone(hub), cache, offline=True)
    loaded = run_user(
        f"""
from kernels import get_kernel
from npu_hub_kernels.doctor import diagnose
try:
    get_kernel("{ORG}/npu-rope", version=1)
except FileNotFoundError as error:
    result["refused"] = f"{{error}} <- {{type(error.__cause__).__name__}}: {{error.__cause__}}"
result["doctor"] = [card.problem for card in diagnose("{ORG}").cards]
register_kwargs = {{"local_dir": "{folders}"}}
"""
        + LOAD_AND_KERNELIZE,
        air_gapped,
        emulate=True,
    )
    assert "Cannot find a local snapshot" in loaded["refused"]
    assert "IncompleteSnapshotError" in loaded["refused"] and "is incomplete" in loaded["refused"]
    assert all(problem.startswith("kernels refuses the cached snapshot: ") for problem in loaded["doctor"])
    assert loaded["variants"] == [ARCH_VARIANT]  # the same builds, loaded from the folders
    assert loaded["calls"]["npu_rms_norm"] > 0 and loaded["calls"]["npu_rotary_mul"] > 0


def test_local_kernels_maps_a_repo_id_to_a_folder_for_get_kernel_only(built_cards, monkeypatch):
    repo_id = "in-no-cache/npu-rope"
    monkeypatch.setenv("LOCAL_KERNELS", f"other/card={built_cards / 'npu-swiglu'}:{repo_id}={built_cards / 'npu-rope'}")
    rope = get_kernel(repo_id, version=1)  # no trust_remote_code: a LOCAL_KERNELS folder is not checked
    assert Path(rope.__file__).is_relative_to(built_cards / "npu-rope" / "build" / ARCH_VARIANT)
    assert get_kernel(repo_id, version=7) is rope  # nor is the version

    register_npu_kernels(org="in-no-cache", kernels="npu_fused_rope")
    try:
        with pytest.raises(ValueError, match="Version 1 of 'in-no-cache/npu-rope' is not available in the local cache"):
            kernelize(tiny_causal_lm("qwen3").to("npu"), mode=Mode.INFERENCE, device="npu")
    finally:
        unregister_npu_kernels()


@pytest.mark.slow
def test_kernels_lock_pins_commits_that_load_kernel_loads_offline(hub, tmp_path):
    def project(name: str, org: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        dependencies = "".join(f'"{org}/{card}" = 1\n' for card in ("npu-rms-norm", "npu-rope"))
        (folder / "pyproject.toml").write_text(
            f'[project]\nname = "{name}"\nversion = "0.1.0"\n\n[tool.kernels.dependencies]\n{dependencies}'
        )
        return folder

    connected = user_env(hub.url, tmp_path / "hub-cache")
    refused = kernels_cli("lock", str(project("untrusted-app", UNTRUSTED_ORG)), env=connected)
    assert refused.returncode != 0
    assert f"Kernel repository '{UNTRUSTED_ORG}/npu-rms-norm' is not from a trusted publisher" in refused.stderr

    app = project("app", ORG)
    assert kernels_cli("lock", str(app), env=connected).returncode == 0
    locked = {e["dependency"]["repo-id"]: e["lock"]["commit"] for e in json.loads((app / "kernels.lock").read_text())}
    assert locked == {f"{ORG}/{card}": hub.head(f"{ORG}/{card}", "v1") for card in ("npu-rms-norm", "npu-rope")}
    assert {e["dependency"]["version"] for e in json.loads((app / "kernels.lock").read_text())} == {1}

    HfApi(endpoint=hub.url, token=TOKEN).upload_file(  # v1 moves on; the lock keeps naming its commit
        path_or_fileobj=b"# npu-rope\n\nA newer card text.\n",
        path_in_repo="README.md",
        repo_id=f"{ORG}/npu-rope",
        repo_type="kernel",
        revision="v1",
    )
    assert hub.head(f"{ORG}/npu-rope", "v1") != locked[f"{ORG}/npu-rope"]

    downloaded = kernels_cli("download", str(app), env=connected)  # this host's variant of each locked commit
    assert downloaded.returncode == 0, downloaded.stderr
    full_cache = tmp_path / "full-cache"
    run_user(
        f"from huggingface_hub import snapshot_download\nfor repo_id, commit in {locked!r}.items():\n"
        '    snapshot_download(repo_id, repo_type="kernel", revision=commit)',
        user_env(hub.url, full_cache),
    )

    dead_url = stop_and_prove_gone(hub)
    load = f'from pathlib import Path\nfrom kernels import load_kernel\nlockfile = Path("{app / "kernels.lock"}")\n'
    partial = run_user(
        load
        + f"""
try:
    load_kernel("{ORG}/npu-rope", lockfile=lockfile)
except FileNotFoundError as error:
    result["refused"] = f"{{error}} <- {{error.__cause__}}"
""",
        user_env(dead_url, tmp_path / "hub-cache", offline=True),
    )
    assert (
        f"Cannot find a local snapshot for {ORG}/npu-rope (revision: {locked[f'{ORG}/npu-rope']})" in partial["refused"]
    )
    assert "is incomplete" in partial["refused"]

    pinned = run_user(
        load
        + f"""
for card in ("npu-rope", "npu-rms-norm"):
    kernel = load_kernel("{ORG}/" + card, lockfile=lockfile)
    result[card] = [kernel.VARIANT, Path(kernel.__file__).parts[-5]]  # snapshots/<commit>/build/<variant>/<pkg>/
""",
        user_env(dead_url, full_cache, offline=True),
        emulate=True,
    )
    assert pinned == {card.split("/")[1]: [ARCH_VARIANT, commit] for card, commit in locked.items()}


@pytest.mark.slow
def test_a_variant_downloaded_with_files_that_fail_its_digest_is_not_imported(hub, built_cards, tmp_path):
    path = f"build/{ARCH_VARIANT}/npu_rms_norm/rms_norm.py"
    source = (built_cards / "npu-rms-norm" / path).read_text()
    assert FUSED_CALL in source  # the line changed below, so that the upload changes a file
    HfApi(endpoint=hub.url, token=TOKEN).upload_file(  # one line changed on the Hub, metadata.json left as built
        path_or_fileobj=source.replace(FUSED_CALL, FUSED_CALL + " * 1.5").encode(),
        path_in_repo=path,
        repo_id=f"{ORG}/npu-rms-norm",
        repo_type="kernel",
        revision="v1",
    )
    env = {**user_env(hub.url, tmp_path / "hub-cache"), "PYTHONPATH": str(Path(__file__).parents[1] / "mapping")}
    loaded = run_user(
        """
from npu_hub_kernels.integrity import VariantFilesError
try:
    register_kwargs = {"kernels": "npu_fused_rmsnorm"}
"""
        + "\n".join("    " + line for line in LOAD_AND_KERNELIZE.strip().splitlines())
        + """
except VariantFilesError as error:
    result["refused"] = str(error)
    result["changed"] = error.changed
""",
        env,
        emulate=True,
    )
    assert "variants" not in loaded and loaded["changed"] == ["npu_rms_norm/rms_norm.py"]
    assert f"npu-rms-norm: build/{ARCH_VARIANT} (" in loaded["refused"]
    assert "download the card again" in loaded["refused"]
