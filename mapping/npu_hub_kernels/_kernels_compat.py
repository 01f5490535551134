"""Every private `kernels` API npu-hub-kernels uses, in one place, with why and the public alternative.

kernels' public API (`get_kernel`, `LayerRepository`, `kernelize`, `get_kernel_variants`, ...) is
imported where it is used. What it does not offer is imported here and only here, so that a kernels
release that moves one of these names breaks one file, with a message that says what to do:

Each name below: where it lives in kernels, who uses it, for what, and the public alternative.
- Digest, DigestAlgorithm, DigestValidationError, DigestViolation (kernels._rust): build, integrity,
  publish; a variant's file digest as the loader writes and checks it. Public: none (`Metadata`
  exposes the recorded digest, not the hashing).
- KernelDependency, KernelVersion (kernels._rust), DepTreeNode, resolve_kernel_tree (kernels.deps),
  revision_or_version (kernels._versions): integrity; resolve a repository exactly as `get_kernel`
  does, then check the files before the import. Public: `get_kernel`, which imports with no check
  in between.
- HubCacheResolver, HubResolver, RepoPathsResolver, Resolver, SequentialResolver,
  resolve_hub_cache_kernel, resolve_local_kernel (kernels.resolver): integrity, doctor; which
  variant folder the loader takes, offline and local. Public: `get_kernel_variants`, online only.
- AllValidator, ArchValidator, MetadataValidator, default_metadata_validators (kernels.validate):
  integrity, doctor; the loader's metadata checks. Public: none.
- get_hf_api (kernels.hf_hub._get_hf_api): integrity, doctor; the Hub client as kernels configures
  it (its user agent). Public: `huggingface_hub.HfApi`, with another user agent.
- get_kernel_layer (kernels.layer.layer._get_kernel_layer): integrity; the layer class of an
  imported variant as kernelize takes it. Public: `getattr(module.layers, name)`, unvalidated.
- validate_layer (kernels.layer.layer._validate_layer): publish; kernelize's check that a layer
  may replace a forward. Public: none.
- get_local_kernel_overrides, parse_local_kernel_overrides (kernels.load): integrity, doctor;
  `LOCAL_KERNELS` as the loader reads it. Public: none.
- get_available_versions, resolve_version_spec_as_ref (kernels._versions): doctor; which versions
  the Hub or the cache holds. Public: none.
- backend, CANN (kernels.backends): doctor, tests; the backend kernels detects on this host
  (`cann91`, ...). Public: none.
- ArchVariant, Torch, Variant, get_variants, get_variants_local, parse_variant, resolve_variants
  (kernels.variants): doctor, tests; kernels' reason for every rejected variant of a local or
  cached repository. Public: `get_kernel_variants`, online only (the doctor uses it for the Hub).

Tested with kernels 0.17.2, the newest release on the package index here; transformers 5.22.2
accepts kernels 0.17.2 to 0.18.0, which is the range pyproject.toml allows. Outside `SUPPORTED`,
importing this module fails with a message naming the installed version and what to install.
"""

from __future__ import annotations

import kernels
from packaging.specifiers import SpecifierSet
from packaging.version import Version

SUPPORTED_RANGE = ">=0.17.2,<0.18.1"
"""The kernels releases this module's private names are used with (transformers 5.22.2's range)."""
SUPPORTED = SpecifierSet(SUPPORTED_RANGE)
TESTED = "0.17.2"


def check_version(version: str = kernels.__version__) -> None:
    """Raise ImportError, saying what to install, when kernels `version` is outside SUPPORTED."""
    if Version(version) not in SUPPORTED:
        raise ImportError(
            f"npu-hub-kernels needs kernels{SUPPORTED_RANGE} (tested with {TESTED}); kernels {version} is installed. "
            f"Install a supported release: pip install 'kernels{SUPPORTED_RANGE}'."
        )


check_version()

try:
    from kernels._rust import (
        Digest,
        DigestAlgorithm,
        DigestValidationError,
        DigestViolation,
        KernelDependency,
        KernelVersion,
    )
    from kernels._versions import _get_available_versions as get_available_versions
    from kernels._versions import resolve_version_spec_as_ref, revision_or_version
    from kernels.backends import CANN
    from kernels.backends import _backend as backend
    from kernels.deps import DepTreeNode, resolve_kernel_tree
    from kernels.hf_hub import _get_hf_api as get_hf_api
    from kernels.layer.layer import _get_kernel_layer as get_kernel_layer
    from kernels.layer.layer import _validate_layer as validate_layer
    from kernels.load import _get_local_kernel_overrides as get_local_kernel_overrides
    from kernels.load import _parse_local_kernel_overrides as parse_local_kernel_overrides
    from kernels.resolver import (
        HubCacheResolver,
        HubResolver,
        RepoPathsResolver,
        Resolver,
        SequentialResolver,
        resolve_hub_cache_kernel,
        resolve_local_kernel,
    )
    from kernels.validate import AllValidator, ArchValidator, MetadataValidator, default_metadata_validators
    from kernels.variants import (
        ArchVariant,
        Torch,
        Variant,
        get_variants,
        get_variants_local,
        parse_variant,
        resolve_variants,
    )
except ImportError as error:  # pragma: no cover - only with a kernels release that moved a name
    raise ImportError(
        f"kernels {kernels.__version__} no longer has a private name npu-hub-kernels uses ({error}). "
        f"Install kernels=={TESTED}, and report it: mapping/npu_hub_kernels/_kernels_compat.py lists each name."
    ) from error

__all__ = [
    "CANN",
    "SUPPORTED",
    "SUPPORTED_RANGE",
    "TESTED",
    "AllValidator",
    "ArchValidator",
    "ArchVariant",
    "DepTreeNode",
    "Digest",
    "DigestAlgorithm",
    "DigestValidationError",
    "DigestViolation",
    "HubCacheResolver",
    "HubResolver",
    "KernelDependency",
    "KernelVersion",
    "MetadataValidator",
    "RepoPathsResolver",
    "Resolver",
    "SequentialResolver",
    "Torch",
    "Variant",
    "backend",
    "check_version",
    "default_metadata_validators",
    "get_available_versions",
    "get_hf_api",
    "get_kernel_layer",
    "get_local_kernel_overrides",
    "get_variants",
    "get_variants_local",
    "parse_local_kernel_overrides",
    "parse_variant",
    "resolve_hub_cache_kernel",
    "resolve_kernel_tree",
    "resolve_local_kernel",
    "resolve_variants",
    "resolve_version_spec_as_ref",
    "revision_or_version",
    "validate_layer",
]
