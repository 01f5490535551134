"""A build variant is imported only when its files match the digest in its metadata.json.

kernels 0.17.2 reads the `digest` of a variant's metadata.json but never checks it: a variant whose
files were changed, lost or added after the build loads silently. `check_variant_files` is the one
check, used both by the doctor (which reports it) and by the repositories `register_npu_kernels`
registers (which refuse to import such a variant), so that the doctor's answer is the loader's.

`CheckedLayerRepository` and `CheckedLocalLayerRepository` load as kernels' `LayerRepository` and
`LocalLayerRepository` do (`get_kernel` and `get_local_kernel`: the same resolvers, the same metadata
validators, so the same build variant), with one step added between installing the variant (a
download, when online) and importing it: its files are checked against its digest. The loader itself is
`_kernels_compat.load_layer_checked`, beside the other private kernels APIs it needs.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from kernels import LayerRepository, LocalLayerRepository, Metadata
from torch import nn

from . import _kernels_compat as compat
from .cards import DEFAULT_ORG, ORG_ENV
from .offline import default_cache_dir

SHOWN_PER_KIND = 5
"""File names listed per kind of difference; more are counted."""


class VariantFilesError(RuntimeError):
    """The files of a build variant do not match the digest in its metadata.json: it is not imported."""

    def __init__(self, variant_dir: Path, violations: list[compat.DigestViolation], name: str) -> None:
        self.variant_dir = Path(variant_dir)
        self.name = name
        self.changed = sorted(v.path for v in violations if isinstance(v, compat.DigestViolation.HashMismatch))
        self.missing = sorted(v.path for v in violations if isinstance(v, compat.DigestViolation.MissingFile))
        self.unexpected = sorted(v.path for v in violations if isinstance(v, compat.DigestViolation.UnknownFile))
        self.other = [
            str(v)
            for v in violations
            if not isinstance(
                v,
                (
                    compat.DigestViolation.HashMismatch,
                    compat.DigestViolation.MissingFile,
                    compat.DigestViolation.UnknownFile,
                ),
            )
        ]
        super().__init__(
            f"{name}: build/{self.variant_dir.name} ({self.variant_dir}) does not match the digest in its "
            f"metadata.json: {self.summary}. It was not imported. {remedy(self.variant_dir)}"
        )

    @property
    def summary(self) -> str:
        """What differs, by kind: "changed: a.py; missing: b.py; not in the digest: c.txt"."""
        kinds = [("changed", self.changed), ("missing", self.missing), ("not in the digest", self.unexpected)]
        parts = [f"{kind}: {_listed(paths)}" for kind, paths in kinds if paths]
        return "; ".join(parts + self.other)


def _listed(paths: list[str]) -> str:
    more = len(paths) - SHOWN_PER_KIND
    return ", ".join(paths[:SHOWN_PER_KIND]) + (f" and {more} more" if more > 0 else "")


def remedy(variant_dir: Path) -> str:
    """What to do about a damaged copy of a variant: download it again (Hub cache) or rebuild it (a folder)."""
    cache = default_cache_dir().resolve()
    resolved = Path(variant_dir).resolve()
    if resolved.is_relative_to(cache):
        snapshot = resolved.parent.parent  # <cache>/kernels--org--card/snapshots/<commit>/build/<variant>
        return (
            f"The Hub cache copy is damaged or partial: delete {snapshot} and download the card again "
            "(the full snapshot of its version branch; for a cache seeded from a source checkout, run `make build` "
            "and seed_offline_cache again)."
        )
    return (
        f"Replace {resolved.parent.parent}: rebuild the cards with `make build` (and copy build/ again), or download "
        "the card again."
    )


def check_variant_files(variant_dir: Path, metadata: Metadata) -> int | None:
    """Check the files of `variant_dir` against the digest of its `metadata`.

    Returns how many files the digest lists, None when the metadata has no digest (nothing to check).
    Raises VariantFilesError naming the changed, missing and unexpected files.
    """
    if metadata.digest is None:
        return None
    try:
        metadata.digest.validate(compat.Digest.hash_variant(metadata.digest.algorithm, variant_dir))
    except compat.DigestValidationError as error:
        raise VariantFilesError(variant_dir, error.violations, name=str(metadata.name)) from None
    return len(metadata.digest.files)


LOAD_ELSEWHERE = (
    'Load cards you built instead: `make build`, then `register_npu_kernels(local_dir="build")` (or '
    '`apply_npu_kernels(model, local_dir="build")`); or publish them to your own organisation with `make publish '
    f'ORG=<org>` and load them with `register_npu_kernels(org="<org>")` or {ORG_ENV}=<org>. See docs/loading.md.'
)
"""What to do when the cards are not on the Hub organisation asked (the doctor's hint, and `not_on_the_hub`'s)."""


def not_on_the_hub(repo_id: str) -> str:
    """What to do when a card's repository is not on the Hub: load built cards, or publish them to one's own org."""
    org = repo_id.partition("/")[0]
    unpublished = f" (nothing is published under {DEFAULT_ORG} yet)" if org == DEFAULT_ORG else ""
    return f"The card {repo_id} is not on the Hub{unpublished}, or your token cannot see it. {LOAD_ELSEWHERE}"


class CheckedLayerRepository(compat.HintedLayerRepository):
    """kernels' LayerRepository (a Hub repository at a version), refusing a variant whose files fail its digest.

    A repository the Hub does not have fails (RepositoryNotFoundError) saying how to load the cards anyway."""

    hint = staticmethod(not_on_the_hub)

    def load(self) -> type[nn.Module]:
        """As LayerRepository.load (get_kernel at the resolved revision), with the files checked."""
        return compat.load_layer_checked(self, check_variant_files)


class CheckedLocalLayerRepository(LocalLayerRepository):
    """kernels' LocalLayerRepository (a folder of one built card), refusing a variant whose files fail its digest."""

    def load(self) -> type[nn.Module]:
        """As LocalLayerRepository.load (get_local_kernel of the folder), with the files checked."""
        return compat.load_layer_checked(self, check_variant_files)


def load_checked_kernel(repository: LayerRepository | LocalLayerRepository) -> ModuleType:
    """The card package `repository` names (its `layer_name` aside), imported once its files pass the digest check.

    For the cards that are no kernelized layer (npu-fused-attention: an attention function), loaded as the layer
    cards' repositories load.
    """
    return compat.load_kernel_checked(repository, check_variant_files)
