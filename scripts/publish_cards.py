"""Publish the built kernel cards (`make build`'s build/) to the Hugging Face Hub as kernel repositories.

    python scripts/publish_cards.py --org ORG [--cards npu-rope,...] [--dry-run] [--build build]

The token comes from huggingface_hub's usual sources: $HF_TOKEN, else the stored `hf auth login`.
Each card becomes the repository `<org>/<card>` of type "kernel" (created if missing) with:

- branch `v<version>`, `version` from kernel-cards/<card>/card.toml (created if missing): what
  `kernels.get_kernel(repo, version=N)` loads. One commit brings it to the build: every file of
  every built variant (`build/<variant>/...`) added or replaced, the files of those variant folders
  that the build no longer has deleted, and at the root `README.md` (the card text and variant table
  of exactly this build, for whoever browses or downloads the branch) and `api.json` (the API
  fingerprint, below). The loader only reads `build/<variant>/`; nothing else on the branch is touched.
- branch `main`: `README.md`, the repository's page on the Hub.

Files are compared by content id, the git blob sha1 the Hub reports for each file against that of
the local bytes (sha256 for LFS files), never by date: a branch that already holds the build gets no
commit, so publishing again is safe and a rerun after a failure completes the publish. A commit
applies whole or not at all, and names the commit its plan was made against, so a branch is never
half-published, nor overwritten when someone else published in between.

A malformed `--org` is refused before anything else with exit status 2, as the doctor refuses it.
Refused before anything is written (exit 1, the reason on stderr, never a traceback):
- a stale build: each card is built again into a temporary folder and must be byte-identical to
  `--build` (bytecode caches aside);
- a variant whose metadata.json the kernels parser rejects, or whose files do not match its digest;
- a variant that does not load through the kernels loader. A CPU-only process (torch_npu hidden)
  runs `kernels.get_local_kernel(<card>)`, which must pick `torch-universal`. An Ascend host (the
  npu_hub_kernels emulation, or the real torch_npu where installed) runs it on the card, which must
  pick an NPU variant, and on every NPU variant folder: the resolver only ever takes the one variant
  matching the running torch and CANN, and given a variant folder the loader imports that build.
  Every loaded build must say which variant it is and offer each layer of card.toml as a layer
  `kernelize` accepts (kernels' own layer rules);
- an API change without a version bump.

API rule. A kernel has only a major version: within one its API must not change, and dropping
support (a build variant) also needs a new one (kernels documentation, "Migrating from older
versions"; version 0 is exempt). The API fingerprint `api.json` lists each layer of card.toml with
the parameters of its `forward`, and each name of the package's `__all__` with the parameters of a
function or the type of anything else (parameters are names, kinds and defaults; annotations are
documentation and left out). It is computed from the loaded builds, which must all agree. When
branch `v<version>` already holds an `api.json` that differs, or build variants this build does not
have, publishing is refused: bump `version` in kernel-cards/<card>/card.toml, which publishes to a
new branch and leaves the old one to its users.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import build_cards
import httpx2
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils.sha import git_hash
from kernels import Metadata

from npu_hub_kernels._kernels_compat import validate_layer
from npu_hub_kernels.doctor import org_argument
from npu_hub_kernels.integrity import VariantFilesError, check_variant_files

SCRIPTS_DIR = Path(__file__).resolve().parent
REPO_TYPE = "kernel"
MAIN = "main"
README = "README.md"
API_FILE = "api.json"
UNIVERSAL = "torch-universal"
BYTECODE_CACHE = "__pycache__"  # loading a build writes one; it is neither built nor published


class PublishError(Exception):
    """An expected refusal or failure: its message goes to stderr and the exit code is 1."""


# Local checks


def tree_files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` by relative POSIX path, bytecode caches left out."""
    files = {}
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if path.is_file() and BYTECODE_CACHE not in relative.parts:
            files[relative.as_posix()] = path.read_bytes()
    return files


def check_current(card: build_cards.Card, card_dir: Path) -> None:
    """Refuse a build that differs from what the card's sources build now."""
    with tempfile.TemporaryDirectory(prefix=f"publish-{card.name}-") as tmp:
        fresh = tree_files(build_cards.build_card(card, build_cards.variant_matrix(), Path(tmp)))
    built = tree_files(card_dir)
    differing = sorted(path for path in fresh.keys() | built.keys() if fresh.get(path) != built.get(path))
    if differing:
        shown = ", ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
        raise PublishError(
            f"{card_dir} is not what the sources of {card.name} build now (differs: {shown}): "
            "run `make build` (or scripts/build_cards.py --out for another folder), then publish."
        )


def check_metadata(card: build_cards.Card, card_dir: Path) -> None:
    """Each variant's metadata.json must parse with the kernels loader's parser and match its files."""
    for variant_dir in sorted((card_dir / "build").iterdir()):
        try:
            metadata = Metadata.read_from_file(variant_dir / "metadata.json")
            if check_variant_files(variant_dir, metadata) is None:  # the loader's own check; a build has a digest
                raise ValueError("no digest")
        except (OSError, ValueError, VariantFilesError) as error:
            raise PublishError(f"{card.name}: build/{variant_dir.name}/metadata.json: {error}") from None
        if (str(metadata.name), metadata.version) != (card.name, card.version):
            raise PublishError(
                f"{card.name}: build/{variant_dir.name}/metadata.json names {metadata.name} v{metadata.version}, "
                f"card.toml {card.name} v{card.version}: run `make build`."
            )


def check_loads(card_dirs: dict[str, Path], cards: dict[str, build_cards.Card]) -> dict[str, dict]:
    """Load every variant of every card through the kernels loader; returns each card's API fingerprint.

    Two child processes, run side by side: a CPU-only host and an Ascend host (see the module docstring).
    """
    request = json.dumps(
        {name: {"dir": str(path), "layers": list(cards[name].layers)} for name, path in card_dirs.items()}
    )
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1"}
    hide_torch_npu = "sys.modules['torch_npu'] = None; "  # `import torch_npu` then fails: a host without an NPU
    entry = f"sys.path.insert(0, {str(SCRIPTS_DIR)!r}); import publish_cards; publish_cards.report_loads"
    children = {
        "CPU-only host": subprocess.Popen(
            [sys.executable, "-c", f"import sys; {hide_torch_npu}{entry}('cpu', sys.argv[1])", request],
            env={**env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ),
        "Ascend host": subprocess.Popen(
            [sys.executable, "-c", f"import sys; {entry}('npu', sys.argv[1])", request],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        ),
    }
    reports = {}
    for host, child in children.items():
        stdout, stderr = child.communicate()
        if child.returncode != 0:
            raise PublishError(f"loading the builds as a {host} failed:\n{stderr.strip()}")
        reports[host] = json.loads(stdout.splitlines()[-1])
    fingerprints = {}
    for name in card_dirs:
        errors = [f"{host}: {error}" for host, report in reports.items() for error in report[name]["errors"]]
        apis = {json.dumps(api, sort_keys=True) for report in reports.values() for api in report[name]["apis"].values()}
        if not errors and len(apis) != 1:
            errors.append("the variants do not offer the same API")
        if errors:
            more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
            raise PublishError(f"{name} would not load as built:\n  " + "\n  ".join(errors[:10]) + more)
        fingerprints[name] = json.loads(apis.pop())
    return fingerprints


def report_loads(host: str, request: str) -> None:
    """Child process of `check_loads`: load as a "cpu" or "npu" host would; print one JSON line.

    The line maps each card to {"errors": [...], "apis": {variant: API fingerprint}}.
    """
    if host == "npu" and importlib.util.find_spec("torch_npu") is None:
        from npu_hub_kernels.testing import emulation

        emulation.install()
    from kernels import get_local_kernel

    report = {}
    for name, card in json.loads(request).items():
        card_dir = Path(card["dir"])
        targets = [card_dir]
        if host == "npu":
            targets += sorted(p for p in (card_dir / "build").iterdir() if p.name != UNIVERSAL)
        errors, apis = [], {}
        for target in targets:
            label = "the card" if target == card_dir else target.name
            try:
                kernel = get_local_kernel(target)
                variant = Path(kernel.__file__).parents[1].name  # build/<variant>/<package>/__init__.py
                built_as = kernel.VARIANT
                if built_as != variant:
                    raise ValueError(f"loaded build/{variant}, which says it is {built_as!r}")
                if target == card_dir and (variant == UNIVERSAL) != (host == "cpu"):
                    raise ValueError(f"the loader chose build/{variant}")
                apis[variant] = api_fingerprint(kernel, card["layers"])
            except Exception as error:  # any failure to load is the finding, reported with its type
                errors.append(f"{label}: {type(error).__name__}: {error}")
        report[name] = {"errors": errors, "apis": apis}
    print(json.dumps(report))


def api_fingerprint(kernel: ModuleType, layers: list[str]) -> dict:
    """The API a card's build offers (the module docstring's rule), checking each layer as kernelize would."""
    fingerprint = {"layers": {}, "exports": {}}
    for name in sorted(layers):
        layer = getattr(kernel.layers, name, None)
        if layer is None:
            raise ValueError(f"no layer {name} in {kernel.__name__}.layers, which card.toml lists")
        validate_layer(check_cls=layer, cls=layer, repo=f"layer {name}")
        fingerprint["layers"][name] = _parameters(layer.forward)
    if not hasattr(kernel, "__all__"):
        raise ValueError("the package has no __all__: its public names are its API")
    for name in sorted(kernel.__all__):
        value = getattr(kernel, name)
        fingerprint["exports"][name] = _parameters(value) if inspect.isfunction(value) else type(value).__name__
    return fingerprint


def _parameters(function: object) -> str:
    """The call signature without annotations, e.g. "(self, hidden_states)"."""
    signature = inspect.signature(function)
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
    return str(signature.replace(parameters=bare, return_annotation=inspect.Signature.empty))


def api_json(card: build_cards.Card, fingerprint: dict) -> bytes:
    return (
        json.dumps({"card": card.name, "version": card.version, **fingerprint}, indent=2, sort_keys=True) + "\n"
    ).encode()


def api_differences(published: dict, local: dict) -> list[str]:
    """What changed between two API fingerprints, one line per layer or export."""
    lines = []
    for section, kind in (("layers", "layer"), ("exports", "export")):
        before, after = published.get(section, {}), local.get(section, {})
        for name in sorted(before.keys() | after.keys()):
            if name not in after:
                lines.append(f"{kind} {name} removed (was {before[name]})")
            elif name not in before:
                lines.append(f"{kind} {name} added: {after[name]}")
            elif before[name] != after[name]:
                lines.append(f"{kind} {name}: {before[name]} -> {after[name]}")
    return lines


# Plans


@dataclass
class BranchPlan:
    """What one commit does to one branch: paths added, replaced (with contents) and deleted."""

    branch: str
    base: str | None
    """The commit compared against, and the commit's parent; None in a repository still to be created."""
    exists: bool
    added: dict[str, bytes] = field(default_factory=dict)
    replaced: dict[str, bytes] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)
    unchanged: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.added or self.replaced or self.deleted)


@dataclass
class CardPlan:
    card: build_cards.Card
    repo_id: str
    repo_exists: bool
    branches: list[BranchPlan]

    @property
    def changed(self) -> bool:
        return any(branch.changed for branch in self.branches)


def _same_content(remote: RepoFile, content: bytes) -> bool:
    if remote.lfs is not None:
        return remote.lfs.sha256 == hashlib.sha256(content).hexdigest()
    return remote.blob_id == git_hash(content)


def plan_branch(
    branch: str,
    base: str | None,
    exists: bool,
    remote: dict[str, RepoFile],
    local: dict[str, bytes],
    owned: tuple[str, ...],
) -> BranchPlan:
    """Bring `branch` to `local`: add and replace its files, delete remote files under the `owned` folders it lacks."""
    plan = BranchPlan(branch, base, exists)
    for path, content in local.items():
        if path not in remote:
            plan.added[path] = content
        elif not _same_content(remote[path], content):
            plan.replaced[path] = content
        else:
            plan.unchanged += 1
    plan.deleted = sorted(path for path in remote if path.startswith(owned) and path not in local)
    return plan


def plan_card(
    api: HfApi, card: build_cards.Card, card_dir: Path, fingerprint: dict, org: str, *, dry_run: bool = False
) -> CardPlan:
    """Read the repository's branches and files, refuse an unbumped API change, plan one commit per branch."""
    repo_id = f"{org}/{card.name}"
    version_branch = f"v{card.version}"
    built = tree_files(card_dir)
    variants = sorted({path.split("/")[1] for path in built if path.startswith("build/")})
    version_files = {README: built[README], API_FILE: api_json(card, fingerprint)}
    version_files.update({path: content for path, content in built.items() if path.startswith("build/")})
    owned = tuple(f"build/{variant}/" for variant in variants)

    with hub_errors(f"reading {repo_id}", org, dry_run=dry_run):
        try:
            refs = api.list_repo_refs(repo_id, repo_type=REPO_TYPE)
        except RepositoryNotFoundError:
            refs = None
        heads = {ref.name: ref.target_commit for ref in refs.branches} if refs else {}
        main_head = heads.get(MAIN)
        version_base = heads.get(version_branch, main_head)  # a new branch starts from main
        remote = _remote_files(api, repo_id, version_base) if version_base else {}
        main_remote = remote if version_base == main_head else _remote_files(api, repo_id, main_head)
        published_api = None
        if version_branch in heads and API_FILE in remote:
            path = api.hf_hub_download(repo_id, API_FILE, repo_type=REPO_TYPE, revision=version_base)
            published_api = json.loads(Path(path).read_text())

    if version_branch in heads and card.version != 0:
        _refuse_breaking_change(card, repo_id, version_branch, remote, variants, published_api, fingerprint)
    return CardPlan(
        card,
        repo_id,
        repo_exists=refs is not None,
        branches=[
            plan_branch(version_branch, version_base, version_branch in heads, remote, version_files, owned),
            plan_branch(MAIN, main_head, True, main_remote, {README: built[README]}, ()),
        ],
    )


def _remote_files(api: HfApi, repo_id: str, commit: str) -> dict[str, RepoFile]:
    tree = api.list_repo_tree(repo_id, recursive=True, revision=commit, repo_type=REPO_TYPE)
    return {entry.path: entry for entry in tree if isinstance(entry, RepoFile)}


def _refuse_breaking_change(
    card: build_cards.Card,
    repo_id: str,
    branch: str,
    remote: dict[str, RepoFile],
    variants: list[str],
    published_api: dict | None,
    fingerprint: dict,
) -> None:
    reasons = []
    published_variants = {path.split("/")[1] for path in remote if path.startswith("build/") and path.count("/") >= 2}
    for dropped in sorted(published_variants - set(variants)):
        reasons.append(f"build variant {dropped} would no longer be supported")
    if published_api is not None:
        reasons += api_differences(published_api, fingerprint)
    if reasons:
        raise PublishError(
            f"{card.name}: {repo_id}@{branch} is published with another API or more build variants than this "
            f"build has:\n  " + "\n  ".join(reasons) + f"\nUsers of version {card.version} rely on it staying as it "
            f"is: bump `version` in kernel-cards/{card.name}/card.toml (to {card.version + 1}), run `make build`, "
            "and publish again to a new branch."
        )


def print_plan(plan: CardPlan, *, list_files: bool) -> None:
    print(f"{plan.card.name} -> {plan.repo_id}" + ("" if plan.repo_exists else " (new kernel repository)"))
    for branch in plan.branches:
        label = branch.branch + ("" if branch.exists else " (new branch)")
        if not branch.changed:
            print(f"  {label}: no change ({branch.unchanged} file(s) already on the Hub)")
            continue
        counts = f"{len(branch.added)} to add, {len(branch.replaced)} to replace, {len(branch.deleted)} to delete"
        print(f"  {label}: {counts}, {branch.unchanged} unchanged")
        if list_files:
            for action, paths in (("add", branch.added), ("replace", branch.replaced), ("delete", branch.deleted)):
                for path in sorted(paths):
                    print(f"    {action:<8}{path}")


# Writing


@contextmanager
def hub_errors(action: str, org: str, *, commit: str | None = None, dry_run: bool = False) -> Iterator[None]:
    """Turn the Hub's and the network's errors during `action` into a PublishError that says what to do.

    `commit` names the branch of a commit in progress: the Hub applies a commit whole or not at all.
    `dry_run`: the step belongs to a dry run, which writes nothing and whose rerun only plans again.
    """
    if dry_run:
        outcome = lost = "Nothing was written: this is a dry run."
        rerun = "Run the same command again to see the plan."
    else:
        outcome = (
            f"The commit was not applied: {commit} is as it was (a commit applies whole or not at all)."
            if commit
            else "Nothing was written by this step."
        )
        # No answer came back: the Hub may have done the work before the connection was lost.
        lost = (
            f"Whether the Hub applied the commit to {commit} is unknown: the answer was lost (a commit applies whole "
            "or not at all, so it is either all there or not at all)."
            if commit
            else "Whether this step wrote anything on the Hub is unknown: the answer was lost."
        )
        rerun = "Run the same command again: it publishes what is missing and skips what is already on the Hub."
    try:
        yield
    except OfflineModeIsEnabled:
        raise PublishError("HF_HUB_OFFLINE is set: unset it to reach the Hub and publish.") from None
    except HfHubHTTPError as error:
        status = error.response.status_code
        detail = error.server_message or str(error).splitlines()[0]
        if status == 401:
            raise PublishError(
                f"the Hub rejected the token while {action} (401: {detail}): it is invalid or expired. "
                "Log in again with `hf auth login`, or fix HF_TOKEN (when set, it is used instead of the stored login)."
            ) from None
        if status == 403:
            raise PublishError(
                f"the Hub refused {action} (403: {detail}).\n"
                "Kernel repositories need the Hub's approval of their organisation (or user) for kernels, which the "
                "kernels documentation calls kernel-creation access: request it from your Hub account settings "
                "(huggingface.co/settings/account, 'Request Kernels Creation'), or contact the Hugging Face Hub team. "
                f"If the organisation is approved already, check that your token can write to {org}."
            ) from None
        if status == 412:
            raise PublishError(
                f"{action}: the branch moved since this publish read it (someone else published). {outcome} {rerun}"
            ) from None
        raise PublishError(f"{action} failed ({status}: {detail}). {outcome} {rerun}") from None
    except httpx2.TransportError as error:
        raise PublishError(f"{action} failed: no answer from the Hub ({error}). {lost} {rerun}") from None


def authenticate(api: HfApi, org: str) -> str:
    """The user the token belongs to; refuses early without a token or with one the Hub rejects."""
    if get_token() is None:
        raise PublishError(
            f"no Hugging Face token: log in with `hf auth login` (it stores one) or set HF_TOKEN to a token "
            f"with write access to {org}."
        )
    with hub_errors("checking the token", org):
        return api.whoami()["name"]


def execute(api: HfApi, plan: CardPlan, org: str) -> None:
    """Create what is missing, then one commit per branch that changes (the version branch first)."""
    if not plan.repo_exists:
        with hub_errors(f"creating the kernel repository {plan.repo_id}", org):
            api.create_repo(plan.repo_id, repo_type=REPO_TYPE, exist_ok=True)
        print(f"  created kernel repository {plan.repo_id}")
    for branch in plan.branches:
        if not branch.changed:
            print(f"  {branch.branch}: no change")
            continue
        if not branch.exists:
            with hub_errors(f"creating branch {branch.branch} of {plan.repo_id}", org):
                api.create_branch(plan.repo_id, branch=branch.branch, revision=branch.base, repo_type=REPO_TYPE)
        operations = [
            CommitOperationAdd(path_in_repo=path, path_or_fileobj=content)
            for path, content in sorted({**branch.added, **branch.replaced}.items())
        ]
        operations += [CommitOperationDelete(path_in_repo=path) for path in branch.deleted]
        summary = f"{len(branch.added)} added, {len(branch.replaced)} replaced, {len(branch.deleted)} deleted"
        with hub_errors(f"committing to {plan.repo_id}@{branch.branch}", org, commit=f"branch {branch.branch}"):
            info = api.create_commit(
                plan.repo_id,
                operations,
                commit_message=f"Publish {plan.card.name} v{plan.card.version}",
                commit_description=f"scripts/publish_cards.py: {summary}.",
                repo_type=REPO_TYPE,
                revision=branch.branch,
                parent_commit=branch.base,
            )
        print(f"  {branch.branch}: committed {info.oid[:12]} ({summary})")


def publish(org: str, card_names: list[str] | None, build_dir: Path, dry_run: bool) -> None:
    """Check every selected card, plan every repository, then write (unless `dry_run`)."""
    cards = {card.name: card for card in build_cards.load_cards(card_names)}
    api = HfApi()
    if not dry_run:
        print(f"publishing to {org} as {authenticate(api, org)}")
    card_dirs = {}
    for index, card in enumerate(cards.values(), 1):
        card_dir = build_dir / card.name
        print(f"[{index}/{len(cards)}] {card.name} v{card.version}: checking {card_dir} ...", flush=True)
        if not (card_dir / "build").is_dir():
            raise PublishError(f"{card_dir} holds no built card: run `make build` first.")
        check_current(card, card_dir)
        check_metadata(card, card_dir)
        card_dirs[card.name] = card_dir
    print("loading every build variant through kernels, as a CPU-only host and as an Ascend host ...", flush=True)
    fingerprints = check_loads(card_dirs, cards)
    plans = [
        plan_card(api, card, card_dirs[name], fingerprints[name], org, dry_run=dry_run) for name, card in cards.items()
    ]
    for plan in plans:
        print_plan(plan, list_files=dry_run)
    if dry_run:
        print("dry run: nothing was written to the Hub")
        return
    changed = [plan for plan in plans if plan.changed]
    for plan in changed:
        print(f"publishing {plan.repo_id} ...", flush=True)
        execute(api, plan, org)
    print(f"done: {len(changed)} card(s) published, {len(plans) - len(changed)} already up to date on the Hub")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--org",
        required=True,
        type=org_argument,
        help="Hub organisation (or user) that holds the kernel repositories",
    )
    parser.add_argument("--cards", default="", help="comma-separated card names (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, file by file, and write nothing")
    parser.add_argument("--build", type=Path, default=build_cards.ROOT / "build", help="built cards (default: build/)")
    args = parser.parse_args(argv)
    try:
        publish(args.org, [c for c in args.cards.split(",") if c] or None, args.build, args.dry_run)
    except PublishError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
