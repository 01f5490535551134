"""A loopback Hugging Face Hub for tests, driven by the real clients (huggingface_hub 2.4, kernels 0.17.2).

Why: publishing kernel cards and loading them back must be tested end to end, with the very HTTP
calls HfApi, hf_hub_download/snapshot_download and kernels.get_kernel make, on a machine with no
network. Every repo lives in memory: a branch points at a chain of immutable commits, each holding
the complete file tree, with git's blob and tree ids so a client compares hashes as against the Hub.

    with LoopbackHub() as hub:
        hub.add_org("my-org", kernels_approved=True)
        token = hub.add_user("alice", orgs=["my-org"])
        api = HfApi(endpoint=hub.url, token=token)

It serves model and kernel repos (kernel repos are a type of their own in huggingface_hub 2.4:
`/api/kernels/...`, `/kernels/<repo>`) and only what these clients call: `LoopbackHub._route` lists
the endpoints, each with its client call, and the answers hold the fields the clients read. Nothing
here needs LFS or Xet (preupload answers "regular", so contents travel base64 in the commit), folder
deletion, tags, pull requests, datasets, Spaces, private repos, pagination or Range requests.

Auth: writes need the Bearer token of a user with rights on the namespace (its own or one of its
orgs); an unknown token gets 401 everywhere, reads included. Kernel repos may only be created in an
org approved for them (`add_org(..., kernels_approved=True)`), otherwise 403 with the reason.

For tests: `fail_next(endpoint)` fails the next request to an endpoint without touching any state,
`drop_answer_next(endpoint)` runs it and closes the connection unanswered; `request_count`,
`commit_count`, `head` and `commit` tell what happened; `unrouted` lists requests no endpoint matched
and `errors` the tracebacks of requests answered 500. Standard library only; it stops by itself after
`idle_timeout` seconds without a request or `lifetime` seconds in all, so a crashed test cannot leave
it running.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

# The names `fail_next`, `drop_answer_next` and `request_count` take; `LoopbackHub._route` maps requests to them.
ENDPOINTS = frozenset(
    {
        "whoami",
        "create_repo",
        "validate_yaml",
        "agent_harnesses",
        "org_overview",
        "repo_info",
        "list_refs",
        "list_tree",
        "preupload",
        "commit",
        "create_branch",
        "resolve",
    }
)
REPO_TYPES = {"models": "model", "kernels": "kernel"}
URL_PREFIXES = {"model": "", "kernel": "kernels/"}
DEFAULT_BRANCH = "main"
INVALID_TOKEN = "Invalid credentials in Authorization header"  # huggingface_hub tells a bad token by this message
AUTH_REQUIRED = "Authentication required: send 'Authorization: Bearer <token>'"

# What the Hub's initial commit holds, so listings and deletions meet the file they meet on the Hub.
INITIAL_GITATTRIBUTES = (
    b"*.bin filter=lfs diff=lfs merge=lfs -text\n*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
)


def client_env(hub_url: str, home: Path, token: str | None = None, cache: Path | None = None) -> dict[str, str]:
    """The environment of a user process pointed at a Hub: online, nothing cached, no progress bars.

    Telemetry stays on: with HF_HUB_DISABLE_TELEMETRY=1, kernels 0.17.2 builds a user agent ending in "; ",
    which httpx refuses to send, so get_kernel could not reach any Hub.
    """
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "HF_HOME": str(home / "hf-home"),
        "HF_HUB_CACHE": str(cache or home / "hub-cache"),
        "HF_ENDPOINT": hub_url,
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    if "OMP_NUM_THREADS" in os.environ:  # the machine's share, not the user's state (tests/conftest.py sets it)
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    return env if token is None else {**env, "HF_TOKEN": token}


def git_blob_id(content: bytes) -> str:
    """The git blob sha1 of `content`: the oid the Hub reports for a regular (non-LFS) file."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def _git_tree_ids(blob_ids: Mapping[str, str]) -> dict[str, str]:
    """The git tree sha1 of every folder of a file tree ("" is the root), as git would compute them."""
    tree_ids: dict[str, str] = {}

    def tree(folder: str, relative_paths: list[str]) -> bytes:
        entries: list[tuple[bytes, bytes]] = []  # (git sort key, encoded entry)
        subfolders: dict[str, list[str]] = {}
        for relative in relative_paths:
            name, slash, rest = relative.partition("/")
            if slash:
                subfolders.setdefault(name, []).append(rest)
            else:
                oid = bytes.fromhex(blob_ids[f"{folder}/{name}" if folder else name])
                entries.append((name.encode(), b"100644 " + name.encode() + b"\0" + oid))
        for name, rests in subfolders.items():
            oid = tree(f"{folder}/{name}" if folder else name, rests)
            entries.append(((name + "/").encode(), b"40000 " + name.encode() + b"\0" + oid))
        body = b"".join(entry for _, entry in sorted(entries))
        digest = hashlib.sha1(b"tree %d\0" % len(body) + body)
        tree_ids[folder] = digest.hexdigest()
        return digest.digest()

    tree("", list(blob_ids))
    return tree_ids


@dataclass(frozen=True)
class Commit:
    """One immutable state of a repo: the complete file tree, its git ids and the commit before it."""

    oid: str
    parent: str | None
    title: str
    files: Mapping[str, bytes]
    blob_ids: Mapping[str, str]
    tree_ids: Mapping[str, str]

    @classmethod
    def create(cls, files: Mapping[str, bytes], *, parent: str | None, title: str) -> Commit:
        """Build the commit: git's ids for files and folders, 40 random hex digits for its own (no client checks it)."""
        blob_ids = {path: git_blob_id(content) for path, content in files.items()}
        return cls(
            oid=secrets.token_hex(20),
            parent=parent,
            title=title,
            files=MappingProxyType(dict(files)),
            blob_ids=MappingProxyType(blob_ids),
            tree_ids=MappingProxyType(_git_tree_ids(blob_ids)),
        )

    def entry(self, path: str) -> dict[str, Any] | None:
        """The tree-listing JSON entry of a file or folder, None if the path is neither."""
        if path in self.files:
            return {"type": "file", "oid": self.blob_ids[path], "size": len(self.files[path]), "path": path}
        if path and path in self.tree_ids:
            return {"type": "directory", "oid": self.tree_ids[path], "size": 0, "path": path}
        return None


@dataclass
class _Repo:
    repo_type: str
    repo_id: str
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    commit_counts: Counter[str] = field(default_factory=Counter)  # per branch, commits made through the API

    def resolve(self, revision: str) -> Commit:
        """The commit a branch or full commit id names; 404 RevisionNotFound otherwise."""
        oid = self.branches.get(revision, revision)
        if oid not in self.commits:
            raise HubError(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
        return self.commits[oid]


@dataclass
class _Org:
    kernels_approved: bool
    trusted_kernel_publisher: bool


@dataclass
class _Request:
    method: str
    segments: list[str]
    query: dict[str, list[str]]
    authorization: str | None
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body or b"{}")


@dataclass
class _Response:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    dropped: bool = False  # close the connection without answering (the request's effect stays)


def _json(data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> _Response:
    return _Response(status, json.dumps(data).encode(), {"Content-Type": "application/json", **(headers or {})})


class HubError(Exception):
    """An error answered the way the Hub answers it: JSON {"error": ...} plus X-Error-Code/X-Error-Message."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})

    def response(self) -> _Response:
        headers = {"X-Error-Message": self.message.encode("ascii", "backslashreplace").decode(), **self.headers}
        if self.code:
            headers["X-Error-Code"] = self.code
        return _json({"error": self.message, **self.extra}, self.status, headers)


Action = Callable[[_Request, str | None], _Response]


def _check_endpoint(endpoint: str) -> None:
    if endpoint not in ENDPOINTS:
        raise ValueError(f"unknown endpoint {endpoint!r}; one of {sorted(ENDPOINTS)}")


class LoopbackHub:
    """The in-memory Hub on a free port of 127.0.0.1, from `with LoopbackHub() as hub:` (or start()/stop()).

    `url` is the endpoint for HfApi(endpoint=...) or HF_ENDPOINT; `stop_reason` says why it stopped:
    "stopped", "idle" (`idle_timeout` seconds without a request) or "lifetime" (`lifetime` seconds in all).
    """

    def __init__(self, *, idle_timeout: float = 120.0, lifetime: float = 900.0) -> None:
        self.idle_timeout = idle_timeout
        self.lifetime = lifetime
        self.stop_reason: str | None = None
        self.unrouted: list[str] = []
        self.errors: list[str] = []
        self.url = ""  # the endpoint once started, e.g. "http://127.0.0.1:40123"
        self._lock = threading.RLock()  # every request runs under it: commits are atomic, reads consistent
        self._lifecycle = threading.Lock()
        self._stopped = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        self._last_activity = self._started_at = time.monotonic()
        self._repos: dict[tuple[str, str], _Repo] = {}
        self._tokens: dict[str, str] = {}
        self._memberships: dict[str, set[str]] = {}
        self._orgs: dict[str, _Org] = {}
        self._requests: Counter[tuple[str, str | None]] = Counter()
        self._failures: dict[str, deque[int]] = {}
        self._dropped_answers: Counter[str] = Counter()

    # Lifecycle

    @property
    def running(self) -> bool:
        """Whether the server still accepts requests."""
        return self._server is not None

    def start(self) -> LoopbackHub:
        """Listen on a free port of 127.0.0.1 and serve from a daemon thread; returns self. A hub starts once."""
        server = self._server = _Server(("127.0.0.1", 0), _Handler)
        server.hub = self
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        self._last_activity = self._started_at = time.monotonic()
        self._threads = [
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True),
            threading.Thread(target=self._watchdog, daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, reason: str = "stopped") -> None:
        """Stop serving and close the port (idempotent); `reason` goes to `stop_reason`."""
        with self._lifecycle:  # held until the port is closed, so `running` is False only then
            if self._server is None:
                return
            self.stop_reason = reason
            self._stopped.set()
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)

    def __enter__(self) -> LoopbackHub:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _watchdog(self) -> None:
        while not self._stopped.wait(0.05):
            now = time.monotonic()
            if now - self._started_at > self.lifetime:
                self.stop("lifetime")
            elif now - self._last_activity > self.idle_timeout:
                self.stop("idle")

    # Setup and inspection for tests

    def add_org(self, name: str, *, kernels_approved: bool = False, trusted_kernel_publisher: bool = False) -> None:
        """Create an org; only orgs approved for kernels may create kernel repos (as on the Hub)."""
        with self._lock:
            self._orgs[name] = _Org(kernels_approved, trusted_kernel_publisher)

    def add_user(self, name: str, *, orgs: Iterable[str] = (), token: str | None = None) -> str:
        """Create a user with write rights on its own namespace and on `orgs`; returns its token."""
        token = token or f"hf_loopback_{secrets.token_hex(12)}"
        with self._lock:
            self._tokens[token] = name
            self._memberships[name] = set(orgs)
        return token

    def fail_next(self, endpoint: str, status: int = 500) -> None:
        """Answer the next request to `endpoint` with `status`, changing nothing on the Hub.

        huggingface_hub retries 5xx with backoff on preupload, tree listings and downloads, so one
        failure there only delays the call; commit, create_repo and create_branch are not retried.
        """
        _check_endpoint(endpoint)
        with self._lock:
            self._failures.setdefault(endpoint, deque()).append(status)

    def drop_answer_next(self, endpoint: str) -> None:
        """Run the next request to `endpoint`, then close the connection unanswered (its effect stays)."""
        _check_endpoint(endpoint)
        with self._lock:
            self._dropped_answers[endpoint] += 1

    def request_count(self, endpoint: str, repo_id: str | None = None) -> int:
        """How many requests reached `endpoint` (for `repo_id` only, if given), failed ones included."""
        _check_endpoint(endpoint)
        with self._lock:
            return sum(n for (name, repo), n in self._requests.items() if name == endpoint and repo_id in (None, repo))

    def commit_count(self, repo_id: str, branch: str = DEFAULT_BRANCH) -> int:
        """How many commits the commit endpoint made on `branch` of kernel repo `repo_id` (not the initial one)."""
        with self._lock:
            return self._repo("kernel", repo_id).commit_counts[branch]

    def head(self, repo_id: str, branch: str = DEFAULT_BRANCH) -> str:
        """The commit id `branch` of kernel repo `repo_id` points at."""
        with self._lock:
            return self._repo("kernel", repo_id).resolve(branch).oid

    def commit(self, repo_id: str, revision: str = DEFAULT_BRANCH) -> Commit:
        """The commit `revision` (branch or commit id) of kernel repo `repo_id` names: files, parent, title, git ids."""
        with self._lock:
            return self._repo("kernel", repo_id).resolve(revision)

    # Request handling

    def handle(self, request: _Request) -> _Response:
        """Answer one request: route it, count it, apply an injected failure or run the endpoint."""
        self._last_activity = time.monotonic()
        try:
            routed = self._route(request)
            if routed is None:
                with self._lock:
                    self.unrouted.append(f"{request.method} /{'/'.join(request.segments)}")
                return HubError(404, "Sorry, we can't find the page you are looking for.").response()
            endpoint, repo_id, action = routed
            with self._lock:
                self._requests[endpoint, repo_id] += 1
                failures = self._failures.get(endpoint)
                if failures:
                    return HubError(failures.popleft(), f"Injected failure of {endpoint}").response()
                response = action(request, self._authenticate(request.authorization))
                if self._dropped_answers[endpoint]:
                    self._dropped_answers[endpoint] -= 1
                    response.dropped = True
                return response
        except HubError as error:
            return error.response()
        except Exception as error:  # a bug here or a payload no client here sends: 500, the traceback kept for the test
            with self._lock:
                self.errors.append(traceback.format_exc())
            return HubError(500, f"Loopback Hub failed: {error!r}").response()
        finally:
            self._last_activity = time.monotonic()

    def _route(self, request: _Request) -> tuple[str, str | None, Action] | None:
        method, segments = request.method, request.segments
        match method, segments:
            case "GET", ["api", "whoami-v2"]:  # HfApi.whoami
                return "whoami", None, self._whoami
            case "POST", ["api", "repos", "create"]:  # HfApi.create_repo
                return "create_repo", None, self._create_repo
            case "POST", ["api", "validate-yaml"]:  # create_commit, when README.md is added
                return "validate_yaml", None, self._validate_yaml
            case "GET", ["api", "agent-harnesses"]:  # the user agent of any call, unless telemetry is off
                return "agent_harnesses", None, self._agent_harnesses
            case "GET", ["api", "organizations", org, "overview"]:  # get_organization_overview (kernels' trust)
                return "org_overview", None, lambda _request, _user: self._org_overview(org)
            case _, ["api", plural, namespace, name, *tail] if plural in REPO_TYPES:
                return self._route_repo_api(method, REPO_TYPES[plural], f"{namespace}/{name}", tail)
            # hf_hub_download and snapshot_download: /kernels/{repo}/resolve/..., /{repo}/resolve/... for a model
            case "GET" | "HEAD", [plural, namespace, name, "resolve", revision, *path] if plural in REPO_TYPES and path:
                return self._route_resolve(REPO_TYPES[plural], f"{namespace}/{name}", revision, "/".join(path))
            case "GET" | "HEAD", [namespace, name, "resolve", revision, *path] if path:
                return self._route_resolve("model", f"{namespace}/{name}", revision, "/".join(path))
        return None

    def _route_repo_api(
        self, method: str, repo_type: str, repo_id: str, tail: list[str]
    ) -> tuple[str, str | None, Action] | None:
        def on_repo(endpoint: str, action: Callable[..., _Response], *args: str) -> tuple[str, str, Action]:
            return endpoint, repo_id, lambda request, user: action(request, user, self._repo(repo_type, repo_id), *args)

        match method, tail:
            case "GET", []:  # repo_info, repo_exists
                return on_repo("repo_info", self._repo_info, DEFAULT_BRANCH)
            case "GET", ["revision", revision]:  # repo_info, snapshot_download
                return on_repo("repo_info", self._repo_info, revision)
            case "GET", ["refs"]:  # list_repo_refs (kernels: version -> branch)
                return on_repo("list_refs", self._list_refs)
            case "GET", ["tree", revision, *path]:  # list_repo_tree, snapshot_download, kernels
                return on_repo("list_tree", self._list_tree, revision, "/".join(path).strip("/"))
            case "POST", ["preupload", revision]:  # create_commit (upload mode, remote oids)
                return on_repo("preupload", self._preupload, revision)
            case "POST", ["commit", revision]:  # create_commit (NDJSON), upload_folder
                return on_repo("commit", self._commit, revision)
            case "POST", ["branch", branch]:  # create_branch
                return on_repo("create_branch", self._create_branch, branch)
        return None

    def _route_resolve(self, repo_type: str, repo_id: str, revision: str, path: str) -> tuple[str, str, Action]:
        return "resolve", repo_id, lambda _request, _user: self._resolve(self._repo(repo_type, repo_id), revision, path)

    # Auth

    def _authenticate(self, authorization: str | None) -> str | None:
        """The user a request's token names, None without a token; 401 for any unknown token."""
        if authorization is None:
            return None
        scheme, _, token = authorization.partition(" ")
        user = self._tokens.get(token) if scheme.lower() == "bearer" else None
        if user is None:
            raise HubError(401, INVALID_TOKEN)
        return user

    def _require_write(self, user: str | None, namespace: str) -> None:
        if user is None:
            raise HubError(401, AUTH_REQUIRED)
        if namespace != user and namespace not in self._memberships[user]:
            raise HubError(403, f"You don't have the rights to write to the namespace '{namespace}'")

    def _repo(self, repo_type: str, repo_id: str) -> _Repo:
        repo = self._repos.get((repo_type, repo_id))
        if repo is None:
            raise HubError(404, f"Repository not found: {repo_type} {repo_id}", code="RepoNotFound")
        return repo

    def _repo_url(self, repo: _Repo) -> str:
        return f"{self.url}/{URL_PREFIXES[repo.repo_type]}{repo.repo_id}"

    # Endpoints

    def _whoami(self, _request: _Request, user: str | None) -> _Response:
        if user is None:
            raise HubError(401, AUTH_REQUIRED)
        return _json({"type": "user", "name": user, "orgs": [{"name": org} for org in sorted(self._memberships[user])]})

    def _create_repo(self, request: _Request, user: str | None) -> _Response:
        payload = request.json()
        repo_type = payload.get("type") or "model"
        if repo_type not in URL_PREFIXES:
            raise HubError(400, f"Invalid repo type: {repo_type!r}")
        namespace = payload.get("organization") or user or ""
        self._require_write(user, namespace)
        if repo_type == "kernel" and not (namespace in self._orgs and self._orgs[namespace].kernels_approved):
            raise HubError(
                403,
                f"The namespace '{namespace}' is not approved to publish kernels: "
                "kernel repositories can only be created in organizations approved for kernels",
            )
        repo = _Repo(repo_type, f"{namespace}/{payload['name']}")
        if (repo_type, repo.repo_id) in self._repos:
            raise HubError(409, f"You already created this {repo_type} repo", extra={"url": self._repo_url(repo)})
        initial = Commit.create({".gitattributes": INITIAL_GITATTRIBUTES}, parent=None, title="initial commit")
        repo.commits[initial.oid] = initial
        repo.branches[DEFAULT_BRANCH] = initial.oid
        self._repos[repo_type, repo.repo_id] = repo
        return _json({"url": self._repo_url(repo)})

    def _validate_yaml(self, _request: _Request, _user: str | None) -> _Response:
        """Accept any card metadata: validating YAML is the real Hub's business, not what these tests check."""
        return _json({"errors": [], "warnings": []})

    def _agent_harnesses(self, _request: _Request, _user: str | None) -> _Response:
        """No AI-agent harnesses: huggingface_hub asks for them to build its user agent when telemetry is on."""
        return _json({"standardEnvVars": [], "harnesses": {}})

    def _org_overview(self, name: str) -> _Response:
        if name not in self._orgs:
            raise HubError(404, f"Organization not found: {name}")
        return _json({"name": name, "trustedKernelPublisher": self._orgs[name].trusted_kernel_publisher})

    def _repo_info(self, _request: _Request, _user: str | None, repo: _Repo, revision: str) -> _Response:
        """The commit a revision names; snapshot_download reads `sha`, repo_info needs `id`."""
        return _json({"id": repo.repo_id, "sha": repo.resolve(revision).oid})

    def _list_refs(self, _request: _Request, _user: str | None, repo: _Repo) -> _Response:
        branches = [
            {"name": name, "ref": f"refs/heads/{name}", "targetCommit": oid}
            for name, oid in sorted(repo.branches.items())
        ]
        return _json({"branches": branches, "tags": [], "converts": []})

    def _list_tree(self, request: _Request, _user: str | None, repo: _Repo, revision: str, folder: str) -> _Response:
        commit = repo.resolve(revision)
        if folder not in commit.tree_ids:
            raise HubError(404, f"Entry not found: no folder {folder!r} at {revision}", code="EntryNotFound")
        recursive = request.query.get("recursive", ["false"])[0].lower() in ("true", "1")
        prefix = f"{folder}/" if folder else ""
        listed = []
        for path in sorted({*commit.files, *commit.tree_ids} - {""}):
            relative = path.removeprefix(prefix)
            if path.startswith(prefix) and (recursive or "/" not in relative):
                listed.append(commit.entry(path))
        return _json(listed)

    def _preupload(self, request: _Request, user: str | None, repo: _Repo, revision: str) -> _Response:
        """Every file is "regular" (sent base64 in the commit); `oid` lets the client skip unchanged files."""
        self._require_write(user, repo.repo_id.split("/")[0])
        commit = repo.resolve(revision)
        files = [
            {
                "path": file["path"],
                "uploadMode": "regular",
                "shouldIgnore": False,
                "oid": commit.blob_ids.get(file["path"]),
            }
            for file in request.json().get("files", [])
        ]
        return _json({"files": files, "commitOid": commit.oid})

    def _commit(self, request: _Request, user: str | None, repo: _Repo, branch: str) -> _Response:
        """Apply an NDJSON commit (a header line, then operations) atomically: on a copy, then the branch moves."""
        self._require_write(user, repo.repo_id.split("/")[0])
        if branch not in repo.branches:
            raise HubError(404, f"Invalid rev id: {branch} is not a branch", code="RevisionNotFound")
        head = repo.commits[repo.branches[branch]]
        header, *operations = [json.loads(line) for line in request.body.splitlines() if line.strip()]
        if header["value"].get("parentCommit") not in (None, head.oid):
            raise HubError(412, "A commit has happened since. Please refresh and try again.")
        files = dict(head.files)
        for operation in operations:
            path = operation["value"]["path"]
            if operation["key"] == "file":
                files[path] = base64.b64decode(operation["value"]["content"], validate=True)
            elif operation["key"] != "deletedFile":  # no lfsFile (preupload answers "regular"), no deletedFolder
                raise HubError(400, f"Unsupported commit operation {operation['key']!r}")
            elif files.pop(path, None) is None:
                raise HubError(404, f"A file with this name doesn't exist: {path}", code="EntryNotFound")
        commit = Commit.create(files, parent=head.oid, title=header["value"].get("summary", ""))
        repo.commits[commit.oid] = commit
        repo.branches[branch] = commit.oid
        repo.commit_counts[branch] += 1
        return _json({"commitOid": commit.oid, "commitUrl": f"{self._repo_url(repo)}/commit/{commit.oid}"})

    def _create_branch(self, request: _Request, user: str | None, repo: _Repo, branch: str) -> _Response:
        self._require_write(user, repo.repo_id.split("/")[0])
        start = repo.resolve(request.json().get("startingPoint") or DEFAULT_BRANCH)
        if branch in repo.branches:
            raise HubError(409, f"Reference already exists: refs/heads/{branch}")
        repo.branches[branch] = start.oid
        return _json({})

    def _resolve(self, repo: _Repo, revision: str, path: str) -> _Response:
        """A file with the headers hf_hub_download checks: X-Repo-Commit, ETag (git blob id), Content-Length."""
        commit = repo.resolve(revision)
        if path not in commit.files:
            raise HubError(404, f"Entry not found: {path}", code="EntryNotFound", headers={"X-Repo-Commit": commit.oid})
        headers = {
            "Content-Type": "application/octet-stream",
            "ETag": f'"{commit.blob_ids[path]}"',
            "X-Repo-Commit": commit.oid,
        }
        return _Response(200, commit.files[path], headers)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64  # snapshot_download opens several connections at once
    hub: LoopbackHub


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = 30  # a stalled client cannot hold its thread forever

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        split = urlsplit(self.path)
        request = _Request(
            method=self.command,
            segments=[unquote(segment) for segment in split.path.split("/")[1:]],
            query=parse_qs(split.query),
            authorization=self.headers.get("Authorization"),
            body=self.rfile.read(length) if length else b"",
        )
        response = self.server.hub.handle(request)
        if response.dropped:
            self.close_connection = True
            return
        self.send_response(response.status)
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)

    # Every method goes through routing, so a call this server lacks lands in `unrouted` instead of a bare 501.
    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

    def log_message(self, format: str, *args: Any) -> None:
        """Stay quiet: `LoopbackHub.request_count` is the record."""
