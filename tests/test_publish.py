"""`scripts/publish_cards.py` end to end against the loopback Hub (tests/hub_server.py).

The script runs as `make publish` runs it, in a fresh interpreter that knows the Hub only through its
environment (HF_ENDPOINT, HF_TOKEN, an empty cache). Tests that change a card work on a copy of the
scripts and of the cards the mapping package knows (`workspace`), so that the copied build_cards.py
rebuilds from the changed sources: the publish script's "build must be current" check then holds
without any test-only switch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import publish_cards
import pytest
from conftest import ROOT
from hub_server import LoopbackHub, client_env

from npu_hub_kernels.cards import CARDS

ORG = "npu-hub-kernels-publish"
UNAPPROVED_ORG = "not-approved-for-kernels"
TOKEN = "hf_loopback_publisher"
CARD_NAMES = sorted(card.repo_name for card in CARDS.values())
ARCH_VARIANT = f"torch213-cxx11-cann91-{platform.machine()}-linux"


@pytest.fixture
def hub() -> Iterator[LoopbackHub]:
    """A Hub with an org approved for kernels, one that is not, and a user writing to both."""
    with LoopbackHub(idle_timeout=120) as hub:
        hub.add_org(ORG, kernels_approved=True)
        hub.add_org(UNAPPROVED_ORG)
        hub.add_user("publisher", orgs=[ORG, UNAPPROVED_ORG], token=TOKEN)
        yield hub
        assert hub.unrouted == [], "the clients called endpoints the loopback Hub does not implement"
        assert hub.errors == []


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A copy of scripts/ (build and publish) and of kernel-cards/ with the cards the mapping registers."""
    return copy_workspace(tmp_path / "repo", CARD_NAMES)


def copy_workspace(root: Path, card_names: list[str]) -> Path:
    """Copy scripts/ (build and publish) and kernel-cards/ with only `card_names` to `root`: its cards are those."""
    (root / "scripts").mkdir(parents=True)
    for script in ("build_cards.py", "publish_cards.py"):
        shutil.copy2(ROOT / "scripts" / script, root / "scripts" / script)
    for folder in ("shared", *card_names):
        shutil.copytree(
            ROOT / "kernel-cards" / folder,
            root / "kernel-cards" / folder,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    shutil.copy2(ROOT / "kernel-cards" / "variants.toml", root / "kernel-cards" / "variants.toml")
    return root


def hub_env(hub: LoopbackHub, home: Path, token: str | None = TOKEN) -> dict[str, str]:
    """A user's environment pointed at the loopback Hub (online, telemetry on, nothing cached)."""
    return client_env(hub.url, home, token)


def publish(hub: LoopbackHub, home: Path, *args: str, root: Path = ROOT, token: str | None = TOKEN):
    """Run `root`'s scripts/publish_cards.py with `args`; returns the completed process."""
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "publish_cards.py"), *args],
        env=hub_env(hub, home, token),
        cwd=home,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def build(root: Path, *cards: str) -> Path:
    """Build the workspace's cards (all, or the named ones) into root/build with its own build_cards.py.

    The copy runs in this process (a fresh module, so its ROOT is the workspace): a child interpreter would
    spend seconds importing torch again to do the same.
    """
    out = root / "build"
    name = "workspace_build_cards"
    spec = importlib.util.spec_from_file_location(name, root / "scripts" / "build_cards.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the module runs
    try:
        spec.loader.exec_module(module)
        with contextlib.redirect_stdout(io.StringIO()):
            assert module.main(["--out", str(out), *(["--cards", ",".join(cards)] if cards else [])]) == 0
    finally:
        del sys.modules[name]
    return out


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path} no longer contains {old!r}: update the test"
    path.write_text(text.replace(old, new))


def heads(hub: LoopbackHub, names: list[str] = CARD_NAMES) -> dict[tuple[str, str], str]:
    return {(name, branch): hub.head(f"{ORG}/{name}", branch) for name in names for branch in ("main", "v1")}


def card_layers(name: str) -> tuple[str, ...]:
    return next(card.layers for card in CARDS.values() if card.repo_name == name)


@pytest.mark.slow
def test_publish_then_load_from_the_hub_then_nothing_to_republish(hub, built_cards, tmp_path):
    cards = ",".join(CARD_NAMES)
    result = publish(hub, tmp_path, "--org", ORG, "--build", str(built_cards), "--cards", cards)
    assert result.returncode == 0, result.stderr
    for name in CARD_NAMES:
        repo = f"{ORG}/{name}"
        assert (hub.commit_count(repo, "v1"), hub.commit_count(repo, "main")) == (1, 1)
        files = dict(hub.commit(repo, "v1").files)
        api = json.loads(files.pop("api.json"))
        assert files.pop(".gitattributes")  # the repository's initial file, left alone
        assert files == publish_cards.tree_files(built_cards / name)
        assert (api["card"], api["version"], sorted(api["layers"])) == (name, 1, sorted(card_layers(name)))
        assert hub.commit(repo, "main").files["README.md"] == files["README.md"]
        assert f"{name} -> {repo} (new kernel repository)" in result.stdout

    code = f"""
import json
from npu_hub_kernels.testing import emulation
emulation.install()
from kernels import Mode, get_kernel, kernelize
from npu_hub_kernels import register_npu_kernels, swapped_modules
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm, token_ids
rope = get_kernel("{ORG}/npu-rope", version=1, trust_remote_code=True)
register_npu_kernels(org="{ORG}")
model = tiny_causal_lm("qwen3").to("npu")
kernelize(model, mode=Mode.INFERENCE, device="npu")
with emulation.count_op_calls() as calls:
    model(token_ids().to("npu"))
swaps = sorted({{f"{{s.card}} {{s.variant}}" for s in swapped_modules(model)}})
print(json.dumps({{"rope": rope.VARIANT, "calls": dict(calls), "swaps": swaps}}))
"""
    client = subprocess.run(
        [sys.executable, "-c", code], env=hub_env(hub, tmp_path / "client"), capture_output=True, text=True, timeout=180
    )
    assert client.returncode == 0, client.stderr
    loaded = json.loads(client.stdout.splitlines()[-1])
    assert loaded["rope"] == ARCH_VARIANT
    assert loaded["calls"]["npu_rms_norm"] > 0 and loaded["calls"]["npu_rotary_mul"] > 0
    assert {swap.split()[1] for swap in loaded["swaps"]} == {ARCH_VARIANT}  # the Ascend host's own build
    assert {"npu-rms-norm", "npu-rope", "npu-swiglu"} <= {swap.split()[0] for swap in loaded["swaps"]}
    assert hub.request_count("resolve", f"{ORG}/npu-rope") > 0  # downloaded from the Hub, not found in a cache

    before = heads(hub)
    again = publish(hub, tmp_path, "--org", ORG, "--build", str(built_cards), "--cards", cards)
    assert again.returncode == 0, again.stderr
    assert heads(hub) == before
    assert hub.request_count("commit") == 2 * len(CARD_NAMES)
    assert again.stdout.count(": no change (") == 2 * len(CARD_NAMES)
    assert f"done: 0 card(s) published, {len(CARD_NAMES)} already up to date" in again.stdout


@pytest.mark.slow
def test_dry_run_lists_every_file_and_writes_nothing(hub, built_cards, tmp_path):
    result = publish(hub, tmp_path, "--org", ORG, "--build", str(built_cards), "--cards", "npu-rope", "--dry-run")
    assert result.returncode == 0, result.stderr
    listed = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("    add ")]
    tree = publish_cards.tree_files(built_cards / "npu-rope")
    assert sorted(listed) == sorted([*tree, "api.json", "README.md"])  # v1, then README.md again for main
    assert f"npu-rope -> {ORG}/npu-rope (new kernel repository)" in result.stdout
    assert f"v1 (new branch): {len(tree) + 1} to add, 0 to replace, 0 to delete" in result.stdout
    assert "dry run: nothing was written to the Hub" in result.stdout
    for endpoint in ("create_repo", "create_branch", "preupload", "commit"):
        assert hub.request_count(endpoint) == 0, endpoint


@pytest.mark.slow
def test_only_the_changed_card_is_committed_and_a_failed_commit_changes_nothing(hub, tmp_path):
    """Two cards, one changed: the other stands for every card left alone (each card is its own repository and
    plan; the first test republishes every card and commits nothing). Publishing without --cards takes the
    workspace's cards, both of them."""
    names = ["npu-rms-norm", "npu-swiglu"]
    workspace = copy_workspace(tmp_path / "repo", names)
    package = workspace / "kernel-cards" / "npu-swiglu" / "npu_swiglu"
    (package / "notes.py").write_text('"""A module the next build no longer has."""\n')
    build_dir = build(workspace)
    first = publish(hub, tmp_path, "--org", ORG, "--build", str(build_dir), root=workspace)
    assert first.returncode == 0, first.stderr

    (package / "notes.py").unlink()
    with (package / "swiglu.py").open("a") as source:
        source.write("# edited: the API stays as it is\n")
    build(workspace, "npu-swiglu")
    before = heads(hub, names)
    counts = {(name, branch): hub.commit_count(f"{ORG}/{name}", branch) for name, branch in before}

    plan = publish(hub, tmp_path, "--org", ORG, "--build", str(build_dir), "--dry-run", root=workspace)
    assert plan.returncode == 0, plan.stderr
    variants = sorted(p.name for p in (build_dir / "npu-swiglu" / "build").iterdir())
    listed = {tuple(line.split()) for line in plan.stdout.splitlines() if line.startswith("    ")}
    assert listed == {
        (action, f"build/{variant}/{path}")
        for variant in variants
        for action, path in (
            ("delete", "npu_swiglu/notes.py"),
            ("replace", "npu_swiglu/swiglu.py"),
            ("replace", "metadata.json"),  # its digest covers swiglu.py
        )
    }
    assert plan.stdout.count(": no change (") == 2 * len(names) - 1  # all but npu-swiglu's v1

    hub.fail_next("commit", 500)
    failed = publish(hub, tmp_path, "--org", ORG, "--build", str(build_dir), root=workspace)
    assert failed.returncode == 1
    assert "The commit was not applied: branch v1 is as it was" in failed.stderr
    assert "Run the same command again" in failed.stderr
    assert "Traceback" not in failed.stderr
    assert heads(hub, names) == before

    rerun = publish(hub, tmp_path, "--org", ORG, "--build", str(build_dir), root=workspace)
    assert rerun.returncode == 0, rerun.stderr
    after = {(name, branch): hub.commit_count(f"{ORG}/{name}", branch) for name, branch in before}
    assert after == {**counts, ("npu-swiglu", "v1"): counts["npu-swiglu", "v1"] + 1}
    files = dict(hub.commit(f"{ORG}/npu-swiglu", "v1").files)
    del files["api.json"], files[".gitattributes"]
    assert files == publish_cards.tree_files(build_dir / "npu-swiglu")


@pytest.mark.slow
def test_an_api_change_needs_a_version_bump(hub, workspace, tmp_path):
    card = workspace / "kernel-cards" / "npu-rms-norm"
    build_dir = build(workspace, "npu-rms-norm")
    args = ("--org", ORG, "--build", str(build_dir), "--cards", "npu-rms-norm")
    assert publish(hub, tmp_path, *args, root=workspace).returncode == 0
    repo = f"{ORG}/npu-rms-norm"
    v1 = hub.head(repo, "v1")

    edit(card / "npu_rms_norm" / "layers.py", "hidden_states", "x")
    stale = publish(hub, tmp_path, *args, root=workspace)
    assert stale.returncode == 1
    assert "run `make build`" in stale.stderr

    build(workspace, "npu-rms-norm")
    refused = publish(hub, tmp_path, *args, root=workspace)
    assert refused.returncode == 1
    assert "layer RMSNorm: (self, hidden_states) -> (self, x)" in refused.stderr
    assert "bump `version` in kernel-cards/npu-rms-norm/card.toml (to 2)" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert (hub.head(repo, "v1"), hub.commit_count(repo, "v1")) == (v1, 1)

    edit(card / "card.toml", "version = 1", "version = 2")
    build(workspace, "npu-rms-norm")
    bumped = publish(hub, tmp_path, *args, root=workspace)
    assert bumped.returncode == 0, bumped.stderr
    assert "v2 (new branch)" in bumped.stdout
    assert hub.head(repo, "v1") == v1
    api = json.loads(hub.commit(repo, "v2").files["api.json"])
    assert (api["version"], api["layers"]["RMSNorm"]) == (2, "(self, x)")


@pytest.mark.slow
def test_an_org_not_approved_for_kernels_gets_told_how_to_ask(hub, built_cards, tmp_path):
    result = publish(hub, tmp_path, "--org", UNAPPROVED_ORG, "--build", str(built_cards), "--cards", "npu-rope")
    assert result.returncode == 1
    assert "403" in result.stderr and "not approved to publish kernels" in result.stderr  # the Hub's reason
    assert "Request Kernels Creation" in result.stderr and "Hugging Face Hub team" in result.stderr
    assert "Traceback" not in result.stderr
    assert (hub.request_count("create_repo"), hub.request_count("commit")) == (1, 0)


@pytest.mark.parametrize(
    ("token", "message"),
    [(None, "no Hugging Face token: log in with `hf auth login`"), ("hf_not_a_token", "rejected the token")],
)
def test_token_problems_are_explained_before_any_work(hub, built_cards, tmp_path, token, message):
    result = publish(hub, tmp_path, "--org", ORG, "--build", str(built_cards), "--cards", "npu-rope", token=token)
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert "checking" not in result.stdout  # refused before checking the build


@pytest.mark.slow
def test_a_failed_dry_run_does_not_promise_to_publish(hub, built_cards, tmp_path):
    hub.fail_next("list_refs", 500)
    result = publish(hub, tmp_path, "--org", ORG, "--build", str(built_cards), "--cards", "npu-rope", "--dry-run")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"reading {ORG}/npu-rope failed (500" in result.stderr
    assert "publishes" not in result.stderr and "Nothing was written: this is a dry run" in result.stderr
    assert "Run the same command again to see the plan" in result.stderr
    for endpoint in ("create_repo", "create_branch", "preupload", "commit"):
        assert hub.request_count(endpoint) == 0, endpoint


@pytest.mark.parametrize("org", ["bad org", "a/b", "../x", "", "my-org ", "x" * 97, "orgé", "x--y"])
def test_a_malformed_org_is_refused_up_front_with_exit_2(built_cards, org, capsys):
    """As the doctor refuses it: before the build is checked or the Hub is asked."""
    with pytest.raises(SystemExit) as exit_:
        publish_cards.main(["--org", org, "--build", str(built_cards), "--cards", "npu-rope"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert f"argument --org: {org!r} is not a Hub organisation name" in captured.err and captured.out == ""


@pytest.mark.slow
def test_an_answer_lost_after_the_commit_applied_says_the_outcome_is_unknown(hub, built_cards, tmp_path):
    """The connection drops after the Hub applied the commit: publish does not claim it was not applied, and the
    rerun it asks for finds the branch complete and commits nothing."""
    hub.drop_answer_next("commit")
    lost = publish(hub, tmp_path, "--org", ORG, "--build", str(built_cards), "--cards", "npu-rope")
    assert lost.returncode == 1 and "Traceback" not in lost.stderr
    assert "no answer from the Hub" in lost.stderr
    assert "Whether the Hub applied the commit to branch v1 is unknown" in lost.stderr
    assert "not applied" not in lost.stderr and "Run the same command again" in lost.stderr
    assert hub.commit_count(f"{ORG}/npu-rope", "v1") == 1  # it was applied
    rerun = publish(hub, tmp_path, "--org", ORG, "--build", str(built_cards), "--cards", "npu-rope")
    assert rerun.returncode == 0, rerun.stderr
    assert hub.commit_count(f"{ORG}/npu-rope", "v1") == 1 and hub.commit_count(f"{ORG}/npu-rope", "main") == 1
