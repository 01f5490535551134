"""The loopback Hub (tests/hub_server.py) against the real clients: HfApi, snapshot_download, kernels.get_kernel.

In-process calls go through HfApi(endpoint=hub.url) with conftest's offline switch turned off for the
test. End-to-end downloads and loads run in a fresh interpreter that knows the Hub only through its
environment (HF_ENDPOINT, HF_TOKEN, an empty HF_HUB_CACHE), as a user's process would.
"""

from __future__ import annotations

import functools
import http.client
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hub_server import INITIAL_GITATTRIBUTES, LoopbackHub, client_env
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, constants
from huggingface_hub.errors import HfHubHTTPError, RemoteEntryNotFoundError, RepositoryNotFoundError
from huggingface_hub.hf_api import CommitInfo, RepoFile, RepoFolder
from huggingface_hub.utils.sha import git_hash

ORG = "npu-hub-kernels-test"
UNAPPROVED_ORG = "not-approved-for-kernels"
PUBLISHER = "publisher"
TOKEN = "hf_loopback_publisher"
KERNEL = f"{ORG}/npu-rope"
CARD_VARIANTS = ("torch-universal", "torch-npu")


@pytest.fixture(autouse=True)
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    """conftest keeps huggingface_hub offline; these tests talk to the loopback Hub, so go online for each."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def hub() -> Iterator[LoopbackHub]:
    """A Hub with an org approved for kernels, one that is not, and a user writing to both."""
    with LoopbackHub(idle_timeout=60) as hub:
        hub.add_org(ORG, kernels_approved=True)
        hub.add_org(UNAPPROVED_ORG)
        hub.add_user(PUBLISHER, orgs=[ORG, UNAPPROVED_ORG], token=TOKEN)
        yield hub
        assert hub.unrouted == [], "the clients called endpoints the loopback Hub does not implement"
        assert hub.errors == []


@pytest.fixture
def api(hub: LoopbackHub) -> HfApi:
    return HfApi(endpoint=hub.url, token=TOKEN)


@pytest.fixture
def kernel_repo(api: HfApi) -> str:
    """KERNEL created as a kernel repo, with branch v1 (what kernels' version=1 resolves to)."""
    api.create_repo(KERNEL, repo_type="kernel")
    api.create_branch(KERNEL, branch="v1", repo_type="kernel")
    return KERNEL


def add(path: str, content: bytes) -> CommitOperationAdd:
    return CommitOperationAdd(path_in_repo=path, path_or_fileobj=content)


def commit_to_v1(api: HfApi, operations: list[CommitOperationAdd | CommitOperationDelete], **kwargs: str) -> CommitInfo:
    return api.create_commit(
        KERNEL, operations, commit_message="test commit", repo_type="kernel", revision="v1", **kwargs
    )


def publish_card(api: HfApi, card: Path) -> dict[str, bytes]:
    """Upload README.md and the noarch build variants of a built card to v1 in one commit; returns what was sent."""
    files = [
        card / "README.md",
        *(f for v in CARD_VARIANTS for f in sorted((card / "build" / v).rglob("*")) if f.is_file()),
    ]
    uploaded = {f.relative_to(card).as_posix(): f.read_bytes() for f in files}
    commit_to_v1(api, [add(path, content) for path, content in uploaded.items()])
    return uploaded


def run_client(code: str, hub: LoopbackHub, home: Path) -> dict:
    """Run code in a fresh interpreter pointed at the Hub by its environment; returns the JSON of its last line."""
    env = client_env(hub.url, home, TOKEN)
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=home, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, f"client failed:\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout.splitlines()[-1])


def http_status(call: Callable[[], object]) -> int:
    """The HTTP status a client call fails with."""
    with pytest.raises(HfHubHTTPError) as error:
        call()
    return error.value.response.status_code


def connect(hub: LoopbackHub) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(hub.url.rsplit(":", 1)[1])), timeout=1)


def raw(hub: LoopbackHub, method: str, path: str) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One request by hand, for the tests whose point is the server's raw answer."""
    host, port = hub.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request(method, path)
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def test_kernel_repos_live_under_the_kernels_prefix(hub, api):
    url = api.create_repo(KERNEL, repo_type="kernel")
    assert (url, url.repo_type, url.repo_id) == (f"{hub.url}/kernels/{KERNEL}", "kernel", KERNEL)
    assert api.repo_info(KERNEL, repo_type="kernel").sha == hub.head(KERNEL)
    assert api.create_repo(KERNEL, repo_type="kernel", exist_ok=True) == url
    assert http_status(lambda: api.create_repo(KERNEL, repo_type="kernel")) == 409
    with pytest.raises(RepositoryNotFoundError):
        api.repo_info(KERNEL)  # the model repo of that name does not exist


def test_kernel_repos_need_an_approved_org(hub, api):
    with pytest.raises(HfHubHTTPError) as error:
        api.create_repo(f"{UNAPPROVED_ORG}/npu-rope", repo_type="kernel")
    assert error.value.response.status_code == 403
    assert "not approved to publish kernels" in error.value.response.json()["error"]
    assert not api.repo_exists(f"{UNAPPROVED_ORG}/npu-rope", repo_type="kernel")
    api.create_repo(f"{UNAPPROVED_ORG}/npu-rope")  # a model repo needs no approval
    assert api.repo_exists(f"{UNAPPROVED_ORG}/npu-rope")


def test_tokens_and_namespace_rights_are_checked(hub, api):
    assert api.whoami()["name"] == PUBLISHER
    assert {org["name"] for org in api.whoami()["orgs"]} == {ORG, UNAPPROVED_ORG}
    bad = HfApi(endpoint=hub.url, token="hf_not_a_token")
    assert http_status(bad.whoami) == 401
    for client in (bad, HfApi(endpoint=hub.url, token=False)):
        assert http_status(functools.partial(client.create_repo, KERNEL, repo_type="kernel")) == 401
    outsider = HfApi(endpoint=hub.url, token=hub.add_user("outsider"))
    assert http_status(lambda: outsider.create_repo(KERNEL, repo_type="kernel")) == 403
    assert hub.request_count("create_repo") == 3
    assert not api.repo_exists(KERNEL, repo_type="kernel")


def test_org_overview_says_whether_kernels_trusts_the_publisher(hub, api):
    hub.add_org("trusted-publisher", trusted_kernel_publisher=True)
    assert api.get_organization_overview("trusted-publisher").trustedKernelPublisher is True
    assert api.get_organization_overview(ORG).trustedKernelPublisher is False
    assert http_status(lambda: api.get_organization_overview("no-such-org")) == 404


def test_one_commit_adds_and_deletes_on_branch_v1(hub, api, kernel_repo):
    first = commit_to_v1(api, [add("build/torch-universal/old.py", b"old"), add("keep.txt", b"keep")])
    second = commit_to_v1(
        api,
        [
            add("build/torch-universal/new.py", b"new"),
            add("keep.txt", b"changed"),
            CommitOperationDelete("build/torch-universal/old.py"),
        ],
        parent_commit=first.oid,
    )
    assert hub.commit_count(KERNEL, "v1") == 2
    assert second.oid == hub.head(KERNEL, "v1") != first.oid
    assert (hub.commit(KERNEL, "v1").parent, hub.commit(KERNEL, "v1").title) == (first.oid, "test commit")
    assert hub.commit(KERNEL, "v1").files == {
        ".gitattributes": INITIAL_GITATTRIBUTES,
        "build/torch-universal/new.py": b"new",
        "keep.txt": b"changed",
    }
    assert hub.commit(KERNEL, first.oid).files["build/torch-universal/old.py"] == b"old"  # history is immutable
    assert hub.commit(KERNEL, "main").files == {".gitattributes": INITIAL_GITATTRIBUTES}
    assert hub.commit_count(KERNEL, "main") == 0


def test_a_commit_applies_all_its_operations_or_none(hub, api, kernel_repo):
    base = commit_to_v1(api, [add("a.txt", b"a")])
    with pytest.raises(RemoteEntryNotFoundError):
        commit_to_v1(api, [add("b.txt", b"b"), CommitOperationDelete("missing.txt")])
    assert http_status(lambda: commit_to_v1(api, [add("c.txt", b"c")], parent_commit=hub.head(KERNEL, "main"))) == 412
    assert hub.head(KERNEL, "v1") == base.oid
    assert set(hub.commit(KERNEL, "v1").files) == {".gitattributes", "a.txt"}
    assert hub.commit_count(KERNEL, "v1") == 1


def test_injected_commit_failure_changes_nothing_and_a_retry_succeeds(hub, api, kernel_repo):
    head = hub.head(KERNEL, "v1")
    hub.fail_next("commit", status=500)
    assert http_status(lambda: commit_to_v1(api, [add("build/torch-universal/metadata.json", b"{}")])) == 500
    assert hub.head(KERNEL, "v1") == head
    assert hub.commit_count(KERNEL, "v1") == 0
    assert hub.request_count("commit", KERNEL) == 1

    retry = commit_to_v1(api, [add("build/torch-universal/metadata.json", b"{}")])  # operations are single-use
    assert retry.oid == hub.head(KERNEL, "v1") != head
    assert hub.commit_count(KERNEL, "v1") == 1
    assert hub.request_count("commit", KERNEL) == 2
    with pytest.raises(ValueError, match="unknown endpoint"):
        hub.fail_next("comit")


def test_refs_list_branches(hub, api, kernel_repo):
    commit_to_v1(api, [add("a.txt", b"a")])
    api.create_branch(KERNEL, branch="v1", repo_type="kernel", exist_ok=True)
    refs = api.list_repo_refs(KERNEL, repo_type="kernel")
    assert {(b.name, b.ref, b.target_commit) for b in refs.branches} == {
        ("main", "refs/heads/main", hub.head(KERNEL, "main")),
        ("v1", "refs/heads/v1", hub.head(KERNEL, "v1")),
    }


def test_tree_reports_git_blob_ids(hub, api, kernel_repo):
    files = {
        "README.md": b"# card\n",
        "build/torch-universal/metadata.json": b'{"version": 1}\n',
        "build/torch-universal/npu_rope/__init__.py": b"VARIANT = 'torch-universal'\n",
        "build/torch-npu/metadata.json": b"{}\n",
    }
    commit_to_v1(api, [add(path, content) for path, content in files.items()])
    files[".gitattributes"] = INITIAL_GITATTRIBUTES

    tree = list(api.list_repo_tree(KERNEL, recursive=True, revision="v1", repo_type="kernel"))
    listed = {entry.path: (entry.blob_id, entry.size) for entry in tree if isinstance(entry, RepoFile)}
    assert listed == {path: (git_hash(content), len(content)) for path, content in files.items()}
    folders = {entry.path: entry.tree_id for entry in tree if isinstance(entry, RepoFolder)}
    assert set(folders) == {"build", "build/torch-npu", "build/torch-universal", "build/torch-universal/npu_rope"}

    variants = list(api.list_repo_tree(KERNEL, "build", revision="v1", repo_type="kernel"))  # what kernels lists
    assert sorted(entry.path for entry in variants) == ["build/torch-npu", "build/torch-universal"]
    with pytest.raises(RemoteEntryNotFoundError):
        list(api.list_repo_tree(KERNEL, "no-such-folder", revision="v1", repo_type="kernel"))


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_folder_ids_are_the_git_tree_ids(api, kernel_repo, tmp_path):
    files = {"build/torch-universal/a.py": b"a", "build/torch-universal-b/b.py": b"b", "build/torch-npu/c": b""}
    commit_to_v1(api, [add(path, content) for path, content in files.items()])
    for path, content in {**files, ".gitattributes": INITIAL_GITATTRIBUTES}.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(content)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    git("add", "-A")
    root = git("write-tree").strip()
    tree = api.list_repo_tree(KERNEL, recursive=True, revision="v1", repo_type="kernel")
    folders = {entry.path: entry.tree_id for entry in tree if isinstance(entry, RepoFolder)}
    assert folders == {path: git("rev-parse", f"{root}:{path}").strip() for path in folders}


def test_resolve_answers_with_the_headers_hf_hub_download_checks(hub, api, kernel_repo, tmp_path):
    content = b'{"name": "npu-rope"}\n'
    commit_to_v1(api, [add("build/torch-universal/metadata.json", content)])
    head = hub.head(KERNEL, "v1")
    url = f"/kernels/{KERNEL}/resolve/v1/build/torch-universal/metadata.json"

    status, headers, body = raw(hub, "HEAD", url)
    assert (status, body) == (200, b"")
    assert headers["X-Repo-Commit"] == head
    assert headers["ETag"] == f'"{git_hash(content)}"'
    assert int(headers["Content-Length"]) == len(content)
    assert raw(hub, "GET", url)[2] == content

    status, headers, _ = raw(hub, "GET", f"/kernels/{KERNEL}/resolve/v1/missing.json")
    assert (status, headers["X-Error-Code"], headers["X-Repo-Commit"]) == (404, "EntryNotFound", head)
    assert raw(hub, "HEAD", f"/kernels/{KERNEL}/resolve/v9/a")[1]["X-Error-Code"] == "RevisionNotFound"
    assert raw(hub, "HEAD", f"/{KERNEL}/resolve/v1/a")[1]["X-Error-Code"] == "RepoNotFound"  # not a model repo

    path = api.hf_hub_download(
        KERNEL, "build/torch-universal/metadata.json", repo_type="kernel", revision="v1", cache_dir=tmp_path
    )
    assert Path(path).read_bytes() == content
    with pytest.raises(RemoteEntryNotFoundError):
        api.hf_hub_download(KERNEL, "missing.json", repo_type="kernel", revision="v1", cache_dir=tmp_path)


def test_snapshot_download_of_v1_into_a_fresh_cache(hub, api, kernel_repo, built_cards, tmp_path):
    uploaded = publish_card(api, built_cards / "npu-rope")
    assert hub.commit_count(KERNEL, "v1") == 1
    code = f"""
import json, pathlib
from huggingface_hub import snapshot_download
folder = pathlib.Path(snapshot_download({KERNEL!r}, repo_type="kernel", revision="v1",
                                       allow_patterns=["build/torch-universal/*"]))
files = {{p.relative_to(folder).as_posix(): p.read_text() for p in folder.rglob("*") if p.is_file()}}
print(json.dumps({{"commit": folder.name, "files": files}}))
"""
    snapshot = run_client(code, hub, tmp_path)
    assert snapshot["commit"] == hub.head(KERNEL, "v1")
    assert snapshot["files"] == {
        path: content.decode() for path, content in uploaded.items() if path.startswith("build/torch-universal/")
    }
    ref = tmp_path / "hub-cache" / f"kernels--{ORG}--npu-rope" / "refs" / "v1"
    assert ref.read_text() == hub.head(KERNEL, "v1")


@pytest.mark.slow
def test_get_kernel_loads_the_card_from_the_hub(hub, api, kernel_repo, built_cards, tmp_path):
    publish_card(api, built_cards / "npu-rope")
    code = f"""
import json, pathlib
from kernels import get_kernel
try:
    get_kernel({KERNEL!r}, version=1)
    refused = None
except ValueError as error:
    refused = str(error)
kernel = get_kernel({KERNEL!r}, version=1, trust_remote_code=True)
build = pathlib.Path(kernel.__file__).parents[2]
print(json.dumps({{"refused": refused, "variant": kernel.VARIANT, "rope": hasattr(kernel, "apply_rotary_pos_emb"),
                  "downloaded": sorted(p.name for p in build.iterdir()), "commit": build.parent.name}}))
"""
    loaded = run_client(code, hub, tmp_path)
    assert "not from a trusted publisher" in loaded["refused"]  # ORG is not a trusted kernel publisher
    assert loaded["variant"] == "torch-universal"  # a CPU host: the npu variant is rejected
    assert loaded["rope"] is True
    assert loaded["downloaded"] == ["torch-universal"]
    assert loaded["commit"] == hub.head(KERNEL, "v1")
    assert hub.request_count("org_overview") == 1
    assert hub.request_count("list_refs", KERNEL) == 1


@pytest.mark.parametrize(("limits", "reason"), [({"idle_timeout": 0.2}, "idle"), ({"lifetime": 0.2}, "lifetime")])
def test_the_hub_stops_by_itself(limits, reason):
    hub = LoopbackHub(**limits).start()
    deadline = time.monotonic() + 10
    while hub.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hub.stop_reason == reason
    with pytest.raises(ConnectionRefusedError):
        connect(hub)


def test_leaving_the_context_closes_the_port():
    with LoopbackHub() as hub:
        connect(hub).close()
    assert (hub.running, hub.stop_reason) == (False, "stopped")
    with pytest.raises(ConnectionRefusedError):
        connect(hub)
