"""`python -m npu_hub_kernels doctor`: which build of each card this machine would load, and why.

Run it on a new host before `register_npu_kernels()` and `kernelize`. It answers with the
functions the `kernels` loader (0.17.2) itself runs, so its answer is the loader's:

- the host: torch, torch_npu and CANN versions, and the backend kernels detects
  (`kernels.backends._backend`, imported through `_kernels_compat` like every private kernels name:
  torch's PrivateUse1 device "npu" gives `cann<XY>` from torch_npu's `get_cann_version()`, a
  CPU-only torch gives `cpu`);
- per card `<org>/<card>`, the steps of `LayerRepository.load`, which `register_npu_kernels` uses.
  First the version branch `v<N>` becomes a commit: the Hub's refs, or the cache's `refs/v<N>` when
  HF_HUB_OFFLINE=1. Then the build variants are listed: from the folder `LOCAL_KERNELS` maps the
  repo to, else from the Hub cache (offline) or the Hub. kernels' `resolve_variants` (for the Hub,
  the public `get_kernel_variants`) picks a variant and gives its reason for rejecting every other
  one. Offline, `resolve_hub_cache_kernel` must accept the cached snapshot. Last come the metadata
  checks get_kernel makes before importing (python-depends, minimum kernels version, device
  architecture);
- whether the cache holds that variant intact: its files checked against the digest of its
  metadata.json, the check register_npu_kernels' loader makes before importing it
  (`npu_hub_kernels.integrity`);
- trust: `register_npu_kernels` trusts exactly the card repos it registers. kernels' own publisher
  trust (the org's `trustedKernelPublisher` on the Hub) is needed by `get_kernel` without
  `trust_remote_code` and by `kernels lock`. Offline it cannot be known, and kernels skips it.

Given a model (`diagnose(model=...)`, from Python: after a trainer has set up its model, say), it also says what
runs in it: how many modules run each card's layer; each of those whose layer ran eager, with the reason of its last
call and every reason its calls ran eager for, with how many, as the cards recorded them (`report.swapped_modules`);
and each module of a swapped class that runs none because another library set its forward (TRL's fused LM head,
accelerate's autocast wrapper), which kernelize keeps: the forward kept, by its qualified name
(`report.kept_forwards`); and each module of a class a card's model table leaves out, with the table's reason
(`report.left_out_modules`). Its warnings say what to change, among them DeepSpeed Ulysses sequence parallelism
naming another attention than the model's (`diagnose(..., parallelism=...)`, `sequence_parallel_mismatch`).

The doctor never imports card code and never writes to the cache. Exit status: 0 when every card
resolves to a variant that loads, 1 otherwise, with a hint per problem; 2 for a version below 1 or a
malformed organisation name, refused before anything is looked up.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import re
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from huggingface_hub import constants, try_to_load_from_cache
from huggingface_hub.errors import GatedRepoError, IncompleteSnapshotError, RepositoryNotFoundError
from huggingface_hub.file_download import repo_folder_name
from kernels import Metadata, VariantAccepted, get_kernel_variants
from kernels import __version__ as KERNELS_VERSION
from packaging.version import Version
from torch import nn

from . import _kernels_compat as compat
from .attention import AttentionRun, attention_modules, flash_attention_drops, is_attention_card
from .cards import CARDS, ORG_ENV, Card, org_name_problem, resolve_org, version_problem
from .integrity import LOAD_ELSEWHERE, VariantFilesError, check_variant_files
from .offline import default_cache_dir
from .report import KeptForward, LeftOut, Swap, kept_forwards, left_out_modules, swapped_modules
from .selftest.results import REASON_PREFIX
from .selftest.results import summary as selftest_summary
from .sequence_parallel import sequence_parallel_mismatch

NOT_INSTALLED = "not installed"
NOT_CACHED_HINT = (
    "put the cards into the Hub cache: on a connected machine download each card's full v{version} snapshot "
    "(docs/loading.md, 'Offline and pinned use') and copy the cache over, or from a source checkout run "
    "`make build`, then seed the cache: "
    "python -c \"from npu_hub_kernels.offline import seed_offline_cache; seed_offline_cache('build', '{org}')\""
)
OTHER_VERSION_HINT = (
    "pass a version the cache holds ({cached}); offline, the doctor cannot tell whether version {version} exists on "
    "the Hub: run it without HF_HUB_OFFLINE=1 to ask the Hub, which lists the published versions"
)
LOCAL_KERNELS_NOTE = (
    " (LOCAL_KERNELS maps {repo_id} to a folder, but register_npu_kernels resolves v{version} to a commit first; "
    "for folders of built cards use register_npu_kernels(local_dir=...))"
)
INCOMPLETE_HINT = (
    "download the full v{version} snapshot of each card (snapshot_download without allow_patterns): offline, kernels "
    "loads only a snapshot that holds every file of the repository's cached file listing"
)
DIGEST_HINT = "the copy of build/{variant} is damaged or partial: replace {copy} (download or build it again)"
HUB_HINT = "the Hub could not be asked: check HF_ENDPOINT and the network, or set HF_HUB_OFFLINE=1 to use the cache"
TELEMETRY_HINT = (
    "unset HF_HUB_DISABLE_TELEMETRY: with it, kernels 0.17.2 sends a user agent ending in '; ', which the HTTP "
    "client refuses to send, so no Hub request of kernels succeeds"
)

_T = TypeVar("_T")


@dataclass
class HostReport:
    """What kernels sees of this machine when it picks a build variant."""

    python: str
    torch: str
    torch_npu: str
    cann: str
    kernels: str
    backend: str
    backend_reason: str
    platform: str
    hub: str
    cache_dir: str
    notes: list[str] = field(default_factory=list)
    selftest: str = ""
    """This host's last `python -m npu_hub_kernels selftest` result, or how to run it."""


@dataclass
class CardReport:
    """What `register_npu_kernels` would load for one card, and why; `problem` is None when it loads."""

    card: str
    kernel_id: str
    repo_id: str
    source: str | None = None
    revision: str | None = None
    variant: str | None = None
    fallbacks: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    cached: bool | None = None
    files: str | None = None
    problem: str | None = None
    hint: str | None = None


@dataclass
class ModelReport:
    """What runs in a model: which of its modules run a card's layer, which ran eager, and which run none.

    `fused`: how many of its modules run each card's layer, by card. `eager`: those whose layer ran eager, each with
    its last reason and every reason, counted. `not_proven`: the modules of classes a card lists that run eager on
    this transformers release because their code is not code the tests proved. `not_fused`: the modules of swapped
    classes that run none because kernelize keeps the forward another library set on them. `left_out`: the modules of
    classes a card's model table leaves out, with the table's reason. `attention`: the model's attention
    implementation; `attention_runs`: under an attention card, each attention module's last fused form or why it ran
    eager (`attention.attention_modules`); `warnings`: what the user should change (transformers'
    flash_attention_2 on the npu dropping sliding windows or sinks).
    """

    model_class: str
    fused: dict[str, int]
    eager: list[Swap]
    not_fused: list[KeptForward]
    not_proven: list[Swap] = field(default_factory=list)
    left_out: list[LeftOut] = field(default_factory=list)
    attention: str | None = None
    attention_runs: list[AttentionRun] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass
class Report:
    """The doctor's findings: the host, trust, one CardReport per card, and what runs in the model it was given."""

    org: str
    version: int
    host: HostReport
    registry_trust: str
    publisher_trusted: bool | None
    publisher_trust: str
    cards: list[CardReport]
    model: ModelReport | None = None
    local_dir: str | None = None
    """The folder of built cards diagnosed instead of the Hub's (`register_npu_kernels(local_dir=...)`)."""

    @property
    def ok(self) -> bool:
        """Every card resolves to a variant that loads."""
        return all(card.problem is None for card in self.cards)

    def hints(self) -> list[str]:
        """What to do, once per kind of problem."""
        return list(dict.fromkeys(card.hint for card in self.cards if card.hint))

    def as_dict(self) -> dict:
        """The report as plain data, for --json."""
        return {**asdict(self), "ok": self.ok, "hints": self.hints()}


class _Refusal(Exception):
    """Why a card would not load here, and what to do about it."""

    def __init__(self, problem: str, hint: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.hint = hint


def diagnose(
    org: str | None = None,
    version: int = 1,
    model: nn.Module | None = None,
    local_dir: str | Path | None = None,
    parallelism: object | None = None,
) -> Report:
    """Diagnose every card of `org` at API version `version`, and what runs in `model` when one is given.

    `org` defaults as register_npu_kernels'; what runs in `model` is its `model_report`, which checks the attention
    sequence parallelism names against the model's: that of `parallelism` (TrainingArguments, a Trainer, an
    Accelerator or a ParallelismConfig), else what `accelerate launch` configures. With `local_dir`, the built cards
    of that folder instead, as `register_npu_kernels(local_dir=...)` loads them.
    """
    org = resolve_org(org)
    cards = [_diagnose_card(card, org, version, local_dir) for card in CARDS.values()]
    host = host_report()
    note = _torch_npu_note(host, cards)
    if note:
        host.notes.append(note)
    if local_dir is None:
        publisher_trusted, publisher_trust = _publisher_trust(org)
        registry_trust = (
            f"yes for each card: register_npu_kernels(org={org!r}) passes "
            f"trust_remote_code={[card.repo_id for card in cards]}, exactly the repositories it registers"
        )
    else:
        publisher_trusted, publisher_trust = None, "not asked: built cards load from a folder, not from the Hub"
        registry_trust = f"not needed: register_npu_kernels(local_dir={str(local_dir)!r}) imports the folder's builds"
    return Report(
        org=org,
        version=version,
        host=host,
        registry_trust=registry_trust,
        publisher_trusted=publisher_trusted,
        publisher_trust=publisher_trust,
        cards=cards,
        model=None if model is None else model_report(model, parallelism),
        local_dir=None if local_dir is None else str(local_dir),
    )


def model_report(model: nn.Module, parallelism: object | None = None) -> ModelReport:
    """How many modules of `model` run each card's layer, which ran eager and why, and which run none and why.

    Those that run none are modules of swapped classes that keep another library's forward instead, and modules of
    classes a card leaves out. Read from `swapped_modules`, `kept_forwards` and `left_out_modules`. Its warnings say
    what to change: transformers' flash attention dropping windows on the npu, sequence parallelism naming another
    attention than the model's (`parallelism` as `diagnose` takes it; `sequence_parallel_mismatch`).
    """
    swaps = swapped_modules(model)
    warnings = [flash_attention_drops(model, card.kernel_id) for card in CARDS.values() if is_attention_card(card)]
    warnings.append(sequence_parallel_mismatch(model, parallelism))
    return ModelReport(
        model_class=type(model).__name__,
        fused=dict(sorted(Counter(swap.card for swap in swaps if swap.variant is not None).items())),
        eager=[swap for swap in swaps if swap.eager_calls],
        not_fused=kept_forwards(model),
        not_proven=[swap for swap in swaps if swap.variant is None],
        left_out=left_out_modules(model),
        attention=getattr(getattr(model, "config", None), "_attn_implementation", None),
        attention_runs=attention_modules(model),
        warnings=list(dict.fromkeys(warning for warning in warnings if warning)),
    )


def _attention_label(run: AttentionRun) -> str:
    return "ran eager" if run.eager_reason else "fused" if run.form else "not run"


def _attention_row(run: AttentionRun) -> str:
    """An attention module's row: its last fused form, or why it ran eager, with every reason counted."""
    said = run.eager_reason or run.form or "no call yet"
    counted = "; ".join(f"{reason} ({count} calls)" for reason, count in run.eager_calls)
    return f"{run.module} ({run.module_class}): {said}" + (f" [every eager reason: {counted}]" if counted else "")


def host_report() -> HostReport:
    """The versions and backend kernels resolves variants against."""
    torch_npu_version, cann = _torch_npu_and_cann()
    backend, backend_reason = _detected_backend()
    offline = constants.HF_HUB_OFFLINE
    hub = "offline (HF_HUB_OFFLINE=1): cards come from the cache only" if offline else f"online: {constants.ENDPOINT}"
    cache_source = "KERNELS_CACHE" if os.environ.get("KERNELS_CACHE") else "HF_HUB_CACHE"
    host = HostReport(
        python=platform.python_version(),
        torch=torch.__version__,
        torch_npu=torch_npu_version,
        cann=cann,
        kernels=KERNELS_VERSION,
        backend=backend,
        backend_reason=backend_reason,
        platform=f"{platform.machine()}-{platform.system().lower()}",
        hub=hub,
        cache_dir=f"{default_cache_dir()} ({cache_source})",
        selftest=selftest_summary(),
    )
    if not offline and constants.HF_HUB_DISABLE_TELEMETRY:
        host.notes.append(TELEMETRY_HINT)
    return host


def _torch_npu_and_cann() -> tuple[str, str]:
    """torch_npu's version and the CANN version it reports; never fails, never installs anything."""
    module = sys.modules.get("torch_npu")
    if module is None:
        if importlib.util.find_spec("torch_npu") is None:
            return NOT_INSTALLED, NOT_INSTALLED
        try:
            module = importlib.import_module("torch_npu")
        except Exception as error:  # a broken install is a finding, not a crash of the doctor
            return f"installed, but importing it fails: {_one_line(error)}", "unknown"
    version = str(getattr(module, "__version__", "unknown"))
    if getattr(module, "__emulated__", False):
        version += " (emulated by npu_hub_kernels.testing.emulation)"
    try:
        from torch_npu.utils.collect_env import get_cann_version

        return version, str(get_cann_version())
    except Exception as error:  # no CANN toolkit, or a torch_npu without collect_env
        return version, f"unknown: {_one_line(error)}"


def _detected_backend() -> tuple[str, str]:
    """The backend kernels selects (as in variant names, e.g. cann91) and why."""
    try:
        backend = compat.backend()
    except Exception as error:  # e.g. torch_npu present but CANN unreadable
        return "unknown", f"kernels could not detect it: {_one_line(error)}"
    if backend.name == "cann":
        reason = "torch's PrivateUse1 device is \"npu\"; CANN major.minor from torch_npu's get_cann_version()"
    elif backend.name == "cpu":
        reason = 'no CUDA, ROCm, XPU or MPS torch build, and no "npu" device (torch_npu is not loaded)'
    else:
        reason = f"this torch build targets {backend.name}"
    return backend.variant_str, reason


def _publisher_trust(org: str) -> tuple[bool | None, str]:
    """kernels' publisher trust: the org's trustedKernelPublisher flag on the Hub (unknowable offline)."""
    if constants.HF_HUB_OFFLINE:
        return None, "unknown (offline): kernels skips the publisher check offline and trusts what the cache holds"
    try:
        overview = compat.get_hf_api().get_organization_overview(org)
    except Exception as error:  # the Hub's answer, or why there was none, is the finding
        return None, f"unknown: the Hub did not say ({_one_line(error)})"
    if getattr(overview, "trustedKernelPublisher", False):
        return True, f"yes: the Hub marks {org} a trusted kernel publisher"
    return False, (
        f"no: the Hub does not mark {org} a trusted kernel publisher, so get_kernel needs trust_remote_code "
        "(True, or a list naming the repository) and `kernels lock` refuses these repositories"
    )


def _diagnose_card(card: Card, org: str, version: int, local_dir: str | Path | None) -> CardReport:
    """One card's report; a refusal at any step becomes its problem and hint."""
    report = CardReport(card=card.repo_name, kernel_id=card.kernel_id, repo_id=card.repo_id(org))
    try:
        if local_dir is None:
            _resolve(report, org, version)
        else:
            _resolve_built(report, Path(local_dir) / card.repo_name, version)
    except _Refusal as refusal:
        report.problem, report.hint = refusal.problem, refusal.hint
    return report


def _resolve(report: CardReport, org: str, version: int) -> None:
    """Fill `report` following LayerRepository.load; raise _Refusal at the first step that fails."""
    offline = constants.HF_HUB_OFFLINE
    local = _local_kernels_path(report.repo_id)
    report.revision = _version_commit(report.repo_id, org, version, offline, local)
    snapshot = _cache_snapshot(report.repo_id, report.revision)
    if local is not None:
        variant_dir = _from_local_folder(report, local, version, f"LOCAL_KERNELS: {local}")
    elif offline:
        variant_dir = _from_cache(report, snapshot, org, version)
    else:
        variant_dir = _from_hub(report)
        if variant_dir is None:
            return
    _check_and_validate(report, variant_dir, local if local is not None else snapshot)


def _resolve_built(report: CardReport, folder: Path, version: int) -> None:
    """Fill `report` for the built card in `folder`, as register_npu_kernels(local_dir=...) loads it."""
    if not (folder / "build").is_dir():
        raise _Refusal(
            f"{folder} holds no built card (no build/ folder)",
            f"build the cards (`make build`) and pass the folder that holds {report.card}/",
        )
    variant_dir = _from_local_folder(report, folder, version, f"built card: {folder}")
    _check_and_validate(report, variant_dir, folder)


def _check_and_validate(report: CardReport, variant_dir: Path, copy: Path) -> None:
    """Check the chosen variant's files against its digest, then run kernels' own checks of its metadata."""
    metadata = _check_files(report, variant_dir, copy)
    try:
        compat.AllValidator(compat.get_kernel_validators()).validate_metadata(metadata=metadata, variant=report.variant)
    except Exception as error:  # kernels' checks raise ValueError or RuntimeError with the fix in the message
        raise _Refusal(
            f"kernels refuses build/{report.variant}: {_one_line(error)}", "do what kernels' message says"
        ) from None


def _from_local_folder(report: CardReport, folder: Path, version: int, source: str) -> Path:
    """The variant kernels' RepoPathsResolver takes from a folder of one built card (LOCAL_KERNELS, local_dir)."""
    report.source = source
    location = _loader(lambda: compat.local_folder_variant(folder), version, report, folder)
    _record_decisions(report, compat.get_variants_local(location.variant_path.parent))
    return location.variant_path


def _from_cache(report: CardReport, snapshot: Path, org: str, version: int) -> Path:
    """The variant kernels' HubCacheResolver takes from the cached snapshot of the commit."""
    report.source = f"Hub cache: {snapshot}"
    if not snapshot.is_dir():
        raise _Refusal(
            f"not cached: the cache's refs/v{version} names {report.revision}, whose snapshot is missing",
            NOT_CACHED_HINT.format(version=version, org=org),
        )
    _record_decisions(report, compat.get_variants_local(snapshot / "build"))
    location = _loader(lambda: compat.cached_variant(report.repo_id, report.revision), version, report, snapshot)
    report.cached = True
    return location.variant_path


def _from_hub(report: CardReport) -> Path | None:
    """The variant kernels' HubResolver picks from the Hub's listing; its cached copy, None if not cached."""
    report.source = f"Hub: {constants.ENDPOINT}"
    decisions = _ask_hub(lambda: get_kernel_variants(report.repo_id, revision=report.revision))
    accepted = [decision.variant for decision in decisions if isinstance(decision, VariantAccepted)]
    _record_trace(report, accepted, decisions)
    cached = try_to_load_from_cache(
        report.repo_id,
        f"build/{report.variant}/metadata.json",
        cache_dir=default_cache_dir(),
        revision=report.revision,
        repo_type="kernel",
    )
    report.cached = isinstance(cached, str)
    if not report.cached:
        report.files = f"get_kernel downloads build/{report.variant}/ on first use"
        return None
    return Path(cached).parent


def _local_kernels_path(repo_id: str) -> Path | None:
    """The folder LOCAL_KERNELS maps `repo_id` to, parsed by kernels' own parser."""
    spec = os.environ.get("LOCAL_KERNELS")
    if spec is None:
        return None
    try:
        return compat.parse_local_kernel_overrides(spec).get(repo_id)
    except ValueError as error:
        raise _Refusal(f"LOCAL_KERNELS: {error}", "fix LOCAL_KERNELS or unset it") from None


def _version_commit(repo_id: str, org: str, version: int, offline: bool, local: Path | None) -> str:
    """The commit branch v<version> names: in the cache's refs/ when offline, on the Hub otherwise."""
    try:
        commit = compat.version_commit(repo_id, version, local_files_only=offline)
    except ValueError as error:
        cached = sorted(compat.get_available_versions(repo_id, local_files_only=True)) if offline else []
        if cached:  # the cache holds this card, at other versions: whether v<version> exists is unknowable offline
            raise _Refusal(
                f"version {version} of {repo_id} is not in the cache, which holds "
                + ", ".join(f"v{v}" for v in cached),
                OTHER_VERSION_HINT.format(version=version, cached=" or ".join(f"--version {v}" for v in cached)),
            ) from None
        if offline:
            note = LOCAL_KERNELS_NOTE.format(repo_id=repo_id, version=version) if local is not None else ""
            raise _Refusal(f"not cached: {error}", NOT_CACHED_HINT.format(version=version, org=org) + note) from None
        raise _Refusal(str(error), "pass one of the published versions with --version") from None
    except RepositoryNotFoundError as error:
        if isinstance(error, GatedRepoError):
            raise _hub_refusal(error) from None
        raise _Refusal(f"not on the Hub, or not visible to your token: {_one_line(error)}", LOAD_ELSEWHERE) from None
    except Exception as error:  # online: the Hub's error, or why it could not be reached
        raise _hub_refusal(error) from None
    if not re.fullmatch("[0-9a-f]{40}", commit or ""):  # a damaged cache: refs/v<N> emptied or overwritten
        raise _Refusal(
            f"the cache's refs/v{version} of {repo_id} holds {commit!r}, not a commit id",
            NOT_CACHED_HINT.format(version=version, org=org),
        )
    return commit


def _ask_hub(call: Callable[[], _T]) -> _T:
    try:
        return call()
    except Exception as error:  # the Hub's error, or why it could not be reached
        raise _hub_refusal(error) from None


def _hub_refusal(error: Exception) -> _Refusal:
    hint = TELEMETRY_HINT if constants.HF_HUB_DISABLE_TELEMETRY else HUB_HINT
    return _Refusal(f"the Hub did not answer: {_one_line(error)}", hint)


def _loader(call: Callable[[], _T], version: int, report: CardReport, copy: Path) -> _T:
    """Run one of kernels' resolvers; its refusal becomes ours, with the cause huggingface_hub gave.

    A variant whose metadata.json the resolver cannot read (missing, unparsable, an empty folder) is a damaged
    `copy`.
    """
    try:
        return call()
    except FileNotFoundError as error:  # kernels: no variant fits; huggingface_hub: an incomplete snapshot
        if isinstance(error.__cause__, IncompleteSnapshotError):
            raise _Refusal(
                f"kernels refuses the cached snapshot: {error.__cause__}", INCOMPLETE_HINT.format(version=version)
            ) from None
        raise _Refusal(str(error).splitlines()[0], "see the rejected variants") from None
    except (OSError, ValueError) as error:  # kernels could not open or parse the variant's metadata.json
        raise _damaged(report, copy, error) from None


def _damaged(report: CardReport, copy: Path, error: Exception) -> _Refusal:
    """The refusal for a variant folder whose files cannot be read: what is wrong, and to replace the copy."""
    variant = report.variant or "the chosen variant"
    variant_dir = copy / "build" / variant
    dangling = sorted(p.relative_to(variant_dir).as_posix() for p in variant_dir.rglob("*") if not p.exists())
    if dangling:  # Path.exists follows symlinks: these link to files (Hub cache blobs) that are gone
        problem = f"build/{variant} has links to missing files (blobs the cache no longer holds): {', '.join(dangling)}"
    elif report.variant and not (variant_dir / "metadata.json").is_file():
        problem = f"build/{variant}/ has no metadata.json (the folder is empty or partial)"
    elif isinstance(error, ValueError):
        problem = f"build/{variant}/metadata.json does not parse: {_one_line(error)}"
    else:
        problem = f"the files of build/{variant} cannot be read: {_one_line(error)}"
    return _Refusal(problem, DIGEST_HINT.format(variant=variant, copy=copy))


def _record_decisions(report: CardReport, variants: list[compat.Variant]) -> None:
    """kernels' decision over a local or cached repository's variants (see `_record_trace`)."""
    accepted, trace = compat.resolve_variants(variants)
    _record_trace(report, accepted, trace)


def _record_trace(report: CardReport, accepted: list, trace: list) -> None:
    """The preferred variant, the other acceptable ones, each rejected one with kernels' reason."""
    report.rejected = dict(
        sorted(
            (decision.variant.variant_str, decision.reason)
            for decision in trace
            if not isinstance(decision, VariantAccepted)
        )
    )
    if not accepted:
        raise _Refusal(
            f"no build variant of {report.card} fits this host ({len(trace)} found, all rejected)",
            "see the rejected variants: the card has no build for this torch, CANN and CPU",
        )
    report.variant = accepted[0].variant_str
    report.fallbacks = [variant.variant_str for variant in accepted[1:]]


def _cache_snapshot(repo_id: str, commit: str) -> Path:
    return default_cache_dir() / repo_folder_name(repo_id=repo_id, repo_type="kernel") / "snapshots" / commit


def _check_files(report: CardReport, variant_dir: Path, copy: Path) -> Metadata:
    """The variant's metadata, once its files match the digest in it.

    This is the check register_npu_kernels' loader makes before importing a variant (kernels itself does not make
    it).

    `copy` is what to replace when they do not: the cache snapshot, or the LOCAL_KERNELS folder.
    """
    try:
        metadata = Metadata.read_from_file(variant_dir / "metadata.json")
    except ValueError as error:
        raise _Refusal(
            f"build/{report.variant}/metadata.json does not parse: {_one_line(error)}",
            DIGEST_HINT.format(variant=report.variant, copy=copy),
        ) from None
    except OSError as error:
        raise _damaged(report, copy, error) from None
    try:
        checked = check_variant_files(variant_dir, metadata)
    except VariantFilesError as error:
        report.files = f"differ from the metadata.json digest: {error.summary}"
        raise _Refusal(
            f"the files of build/{report.variant} differ from its metadata.json digest: {error.summary}",
            DIGEST_HINT.format(variant=report.variant, copy=copy),
        ) from None
    except OSError as error:  # e.g. a symlink to a blob the cache no longer has
        report.files = f"cannot be read: {_one_line(error)}"
        raise _damaged(report, copy, error) from None
    if checked is None:
        report.files = "not checked: metadata.json has no digest"
        return metadata
    report.files = f"{checked} files match the metadata.json digest"
    return metadata


def _torch_npu_note(host: HostReport, cards: list[CardReport]) -> str | None:
    """On a host without torch_npu: what runs instead, and which torch_npu and CANN the cards are built for."""
    if host.torch_npu != NOT_INSTALLED:
        return None
    release = Version(torch.__version__).release
    torch_version = Version(f"{release[0]}.{release[1]}")
    canns = set()
    for card in cards:
        for name in card.rejected:
            variant = compat.parse_variant(name)
            if (
                isinstance(variant, compat.ArchVariant)
                and isinstance(variant.framework, compat.Torch)
                and isinstance(variant.arch.backend, compat.CANN)
                and variant.framework.version == torch_version
                and variant.arch.platform == platform.machine()
            ):
                canns.add(variant.arch.backend.version)
    if canns:
        built_for = f" (the cards are built for torch {torch_version} with CANN {', '.join(map(str, sorted(canns)))})"
    elif any(card.variant or card.rejected for card in cards):
        built_for = f" (no card has a build for torch {torch_version} on {platform.machine()}: torch-npu would run)"
    else:
        built_for = ""  # no card's variants are known here
    return (
        "torch_npu is not installed, so the cards run their torch-universal build (the eager torch math). For the "
        f"fused ops on an Ascend host, pip install the torch_npu release for torch {torch_version} matching your "
        f"CANN toolkit{built_for}; never install torch_npu on a machine without CANN"
    )


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def format_report(report: Report) -> str:
    """The report for people: aligned label columns, one block per card, the hints (one per kind) at the end."""
    host = report.host
    where = f"built cards of {report.local_dir}" if report.local_dir else f"org {report.org}, version {report.version}"
    lines = [f"npu-hub-kernels doctor: {where}", "", "host"]
    lines += _rows(
        [
            ("python", host.python),
            ("torch", host.torch),
            ("torch_npu", host.torch_npu),
            ("CANN", host.cann),
            ("kernels", host.kernels),
            ("backend", f"{host.backend}: {host.backend_reason}"),
            ("platform", host.platform),
            ("Hub", host.hub),
            ("cache", host.cache_dir),
            ("selftest", host.selftest),
            *(("note", note) for note in host.notes),
        ]
    )
    lines += ["", "trust"]
    lines += _rows([("registry", report.registry_trust), ("publisher", report.publisher_trust)])
    if report.model is not None:
        lines += ["", f"model {report.model.model_class}"]
        fused = ", ".join(f"{card} {count}" for card, count in report.model.fused.items())
        lines += _rows([("fused", f"{fused or 'nothing'} (modules running each card's layer)")])
        if report.model.attention is not None:
            lines += _rows([("attention", report.model.attention)])
        lines += _rows([(_attention_label(run), _attention_row(run)) for run in report.model.attention_runs])
        lines += _rows([("warning", warning) for warning in report.model.warnings])
        for swap in report.model.eager:
            lines += _eager_rows(swap)
        lines += _rows([("kept", f"{k.module} ({k.module_class}): {k.reason}") for k in report.model.not_fused])
        lines += _rows(
            [(_left_eager_label(u), f"{u.module} ({u.module_class}, {u.card}:{u.layer}): {u.eager_reason}")
             for u in report.model.not_proven]
        )  # fmt: skip
        left_out = report.model.left_out
        lines += _rows([("left out", f"{m.module} ({m.module_class}, {m.card}): {m.reason}") for m in left_out])
    shown_rejections: dict[str, str] = {}
    for card in report.cards:
        where = Path(report.local_dir, card.card) if report.local_dir else card.repo_id
        lines += ["", f"{card.card}  {where}  (kernel id {card.kernel_id})"]
        rows = []
        if card.variant:
            rows.append(("loads" if card.problem is None else "would load", card.variant))
        if card.revision:
            rows.append(("revision", f"v{report.version} = {card.revision}"))
        if card.source:
            rows.append(("source", card.source))
        if card.cached is not None:
            rows.append(("cached", ("yes" if card.cached else "no") + (f": {card.files}" if card.files else "")))
        elif card.files:
            rows.append(("files", card.files))
        if card.fallbacks:
            rows.append(("fallbacks", ", ".join(card.fallbacks)))
        if card.problem:
            rows.append(("problem", card.problem))
        lines += _rows(rows)
        lines += _rejections(card, shown_rejections)
    lines.append("")
    if report.ok:
        lines.append(f"OK: all {len(report.cards)} cards resolve to a build variant that loads on this host.")
    else:
        failing = sum(card.problem is not None for card in report.cards)
        lines.append(f"PROBLEM: {failing} of {len(report.cards)} cards would not load on this host. Hints:")
        lines += [f"  - {hint}" for hint in report.hints()]
    return "\n".join(lines)


def _left_eager_label(swap: Swap) -> str:
    """ "stood down" for a layer that failed this host's selftest, "not proven" for a class of unproven code."""
    return "stood down" if (swap.eager_reason or "").startswith(REASON_PREFIX) else "not proven"


def _eager_rows(swap: Swap) -> list[str]:
    """A module whose card layer ran eager: its last call's reason (or that it fused), then every reason, counted."""
    last = f"last call: {swap.eager_reason}" if swap.eager_reason else "last call fused"
    lines = _rows([("eager", f"{swap.module} ({swap.module_class}, {swap.card}:{swap.layer}): {last}")])
    for reason, calls in swap.eager_calls:
        lines.append(f"    {calls} call{'s' if calls > 1 else ''}: {reason}")
    return lines


def _rows(rows: list[tuple[str, str]]) -> list[str]:
    return [f"  {label:<11} {value}" for label, value in rows]


def _rejections(card: CardReport, shown: dict[str, str]) -> list[str]:
    """The rejected variants with kernels' reasons; a list another card already showed is named, not repeated."""
    if not card.rejected:
        return []
    key = json.dumps(card.rejected, sort_keys=True)
    if key in shown:
        return _rows([("rejected", f"{len(card.rejected)} variants, as for {shown[key]} (same reasons)")])
    shown[key] = card.card
    width = max(map(len, card.rejected))
    lines = _rows([("rejected", f"{len(card.rejected)} variants:")])
    lines += [f"    {variant:<{width}}  {reason}" for variant, reason in card.rejected.items()]
    return lines


def org_argument(text: str) -> str:
    """argparse type of an organisation option (the doctor's, publish's): the name, or the rule it breaks."""
    problem = org_name_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def _version_argument(text: str) -> int:
    try:
        version = int(text)
    except ValueError:
        version = text
    problem = version_problem(version)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return version


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The doctor's command-line options, for `python -m npu_hub_kernels doctor`."""
    parser.add_argument(
        "--org",
        type=org_argument,
        help="Hub organisation of the cards (default: $NPU_HUB_KERNELS_ORG, else npu-hub-kernels)",
    )
    parser.add_argument(
        "--version",
        type=_version_argument,
        default=1,
        help="card API version from 1, the branch v<version> (default: 1)",
    )
    parser.add_argument("--local-dir", type=Path, help="diagnose the built cards of this folder (make build's build/)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    """Print the report; exit status 0 when every card loads, 1 otherwise, 2 for an unusable $NPU_HUB_KERNELS_ORG."""
    if args.org is None and os.environ.get(ORG_ENV):
        problem = org_name_problem(os.environ[ORG_ENV])
        if problem:
            print(f"error: {ORG_ENV}={problem}", file=sys.stderr)
            return 2
    report = diagnose(args.org, args.version, local_dir=args.local_dir)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.ok else 1
