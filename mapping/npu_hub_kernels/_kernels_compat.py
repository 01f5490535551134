"""Every private `kernels` API npu-hub-kernels relies on, in one place, with why and the public alternative.

kernels' public API (`get_kernel`, `LayerRepository`, `kernelize`, `get_kernel_variants`, ...) is
used where it is needed. Everything else the project relies on goes through this module and only
this module, so that a kernels release that changes it breaks one file, with a message that says
what to do: private names, private attributes of kernels' objects, the code kernels generates, and
the loader steps the project repeats. tests/test_kernels_compat.py holds every other file to it.

Private names imported (below, each: where it lives in kernels, who uses it, for what, the public
alternative):
- Digest, DigestAlgorithm, DigestValidationError, DigestViolation (kernels._rust): build, integrity,
  publish; a variant's file digest as the loader writes and checks it. Public: none (`Metadata`
  exposes the recorded digest, not the hashing).
- KernelDependency, KernelVersion (kernels._rust), DepTreeNode, resolve_kernel_tree (kernels.deps),
  revision_or_version (kernels._versions): `load_layer_checked`; resolve a repository exactly as
  `get_kernel` does, then check the files before the import. Public: `get_kernel`, which imports
  with no check in between.
- HubCacheResolver, HubResolver, RepoPathsResolver, Resolver, SequentialResolver,
  resolve_hub_cache_kernel, resolve_local_kernel (kernels.resolver): `load_layer_checked` and the
  doctor's loader steps; which variant folder the loader takes, offline and local. Public:
  `get_kernel_variants`, online only.
- AllValidator, ArchValidator, MetadataValidator, default_metadata_validators (kernels.validate):
  `load_layer_checked`, doctor; the loader's metadata checks. Public: none.
- get_hf_api (kernels.hf_hub._get_hf_api): `load_layer_checked`, doctor; the Hub client as kernels
  configures it (its user agent). Public: `huggingface_hub.HfApi`, with another user agent.
- get_kernel_layer (kernels.layer.layer._get_kernel_layer): `load_layer_checked`; the layer class of
  an imported variant as kernelize takes it. Public: `getattr(module.layers, name)`, unvalidated.
- validate_layer (kernels.layer.layer._validate_layer): publish; kernelize's check that a layer
  may replace a forward. Public: none.
- get_local_kernel_overrides, parse_local_kernel_overrides (kernels.load): `load_layer_checked`,
  doctor; `LOCAL_KERNELS` as the loader reads it. Public: none.
- get_available_versions, resolve_version_spec_as_ref (kernels._versions): doctor; which versions
  the Hub or the cache holds, and the commit a version branch names. Public: none.
- backend, CANN (kernels.backends): doctor, tests; the backend kernels detects on this host
  (`cann91`, ...). Public: none.
- ArchVariant, Torch, Variant, get_variants, get_variants_local, parse_variant, resolve_variants
  (kernels.variants): doctor, tests; kernels' reason for every rejected variant of a local or
  cached repository. Public: `get_kernel_variants`, online only (the doctor uses it for the Hub).

Private attributes of kernels' objects (the functions of the section "Private attributes"):
- `LayerRepository._repo_id`, `._trust_remote_code`, `._user_agent` and `._resolve_revision()`
  (the commit of the version branch, resolved once per repository), `LocalLayerRepository._repo_path`:
  `load_layer_checked`, for integrity's repositories; load with the repository's own arguments, as
  its `load()` does. Public: none in kernels 0.17.2 (the constructor arguments are not exposed;
  `str(repository)` names them as text only).
- `LayerRepository._resolve_revision()`, overridden by `HintedLayerRepository`: kernelize calls it first (to log the
  repository, `str(repository)`), before `load`, so a repository the Hub does not have fails there; the override adds
  what to do to that error (integrity's repositories: load built cards or one's own organisation). Public: none.
- `_kernel_funcs`, the dict of function-modules `use_kernelized_func` puts on a module instance and
  `kernelize` reads (through `getattr`, so a class attribute counts too): `kernel_funcs`,
  `own_kernel_funcs`, `set_own_kernel_funcs`; retag attaches rotary function-modules to the
  classes that call them, report lists the ones a module calls, tests check both. Public:
  `use_kernelized_func`, a class decorator that attaches at construction: models built before
  `register_npu_kernels` would not be reached, and nothing can be detached again.
- the forward kernelize binds on a module instance (`layer._replace_forward` sets
  `module.forward` to a method of the layer's forward, or of the class's own when nothing is
  mapped): `instance_forward`, `release_instance_forward`, `is_layer_forward`; report tells from it
  which card layer a module runs and which forward another library set there (any forward set on the
  instance that is not a layer's forward kernelize binds, nor the class's own), retag releases it from
  the shared rotary function-modules. `is_layer_forward` knows the layers kernelize binds as the
  classes of the `layers` module of each kernel kernels loaded (public `get_loaded_kernels`; kernelize
  takes a layer as `getattr(kernel.layers, name)`, `layer._get_kernel_layer`) and the forward kernels
  gives a function-module (its code, as `function_module_function`). Public: none (kernelize returns
  the model, not what it bound).

Private functions wrapped (the section "Private functions wrapped"):
- `layer._replace_forward(module, layer)`, the one step by which kernelize sets `module.forward` (every
  path of `kernelize_layer` and `_conditionally_replace_forward` ends in it, the class's own forward
  included): `keep_forwards`, `stop_keeping_forwards`; retag installs it with the first class it
  retags and removes it with `restore()` (`unregister_npu_kernels`), so that kernelize leaves in place
  a forward another library set on a module of a class npu-hub-kernels retagged (TRL's fused LM head,
  accelerate's autocast wrapper) instead of binding the card's layer over it, and so that a forward
  kernelize binds on a stale deep copy of a shared rotary function-module (a model's `_kernel_funcs`
  entry copied before retag shared them) is bound on the shared original too, which is what the copy's
  code calls. Modules of every other class are bound as kernels binds them. Public: a class's
  `kernel_condition` (retag's condition), which kernelize does not ask for the function-modules it
  reaches through `_kernel_funcs`, and which decides only whether to kernelize, not why; nothing public
  reaches the original of a copy.

Generated code recognised (the section "Generated code"):
- the `nn.Module` class `use_kernel_forward_from_hub` makes of a function (`layer._create_func_module`:
  a class whose `forward` calls the closure variable `func`): `function_module_function`, which
  recognises that forward by its code object and reads `func`; retag tells transformers' rotary
  function-modules from another library's replacement, report finds the function a module calls.
  Public: none (the function-module keeps no public reference to its function).
- the `__init__` `use_kernelized_func` puts on a class (`layer.use_kernelized_func`: it calls the class's own
  `__init__`, then attaches the closure variable `decorator_args`): `attached_at_construction`; tests tell the
  rotary functions transformers attaches from those retag attaches. Public: none but building an instance. Its
  closure variable `orig_init`, the class's own `__init__`: `decorated_init`; the attention table's proofs read
  that `__init__`'s source. Public: none.

Loader steps repeated (the section "Loader steps"), each as kernels 0.17.2 runs it:
- `load_layer_checked`: `LayerRepository.load` (`get_kernel` at the resolved revision) and
  `LocalLayerRepository.load` (`get_local_kernel`), i.e. `load.get_kernel_with_resolver`, with a
  check of every installed variant between installing and importing it; integrity's repositories.
  Public: `get_kernel`/`get_local_kernel`, which import with no step in between.
- `version_commit` (`LayerRepository._resolve_revision` of a version), `local_folder_variant`
  (`RepoPathsResolver`), `cached_variant` (`HubCacheResolver`), `get_kernel_validators`
  (`get_kernel`'s metadata checks): the doctor's steps, so that its answer is the loader's.
  Public: none, but `get_kernel_variants` for the Hub.

Tested with kernels 0.17.2, the newest release on the package index here; transformers 5.22.2
accepts kernels 0.17.2 to 0.18.0, which is the range pyproject.toml allows. Outside `SUPPORTED`,
importing this module fails with a message naming the installed version and what to install.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from pathlib import Path
from types import FunctionType, ModuleType
from typing import TYPE_CHECKING

import kernels
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
from kernels import LayerRepository, LocalLayerRepository, Metadata, get_loaded_kernels, use_kernel_forward_from_hub
from packaging.specifiers import SpecifierSet
from packaging.version import Version

if TYPE_CHECKING:
    from kernels.resolver import LocalKernel
    from torch import nn

SUPPORTED_RANGE = ">=0.17.2,<0.18"
"""The kernels releases this module's private names are used with: transformers 5.22.2's range (its
`is_kernels_available`, import_utils.py KERNELS_MIN_VERSION / KERNELS_MAX_VERSION: 0.18.0 is refused there)."""
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


# Private attributes


def kernel_funcs(module: object) -> dict[str, object]:
    """The function-modules attached to `module` for kernelize, by the name its code calls them by.

    As kernelize reads them: the instance's `_kernel_funcs` (`use_kernelized_func`), else its class's.
    """
    return getattr(module, "_kernel_funcs", {})


def own_kernel_funcs(owner: object) -> dict[str, object] | None:
    """The `_kernel_funcs` a class or module instance holds itself (not inherited); None when it holds none."""
    return owner.__dict__.get("_kernel_funcs")


def set_own_kernel_funcs(owner: object, funcs: dict[str, object] | None) -> None:
    """Make `funcs` the `_kernel_funcs` of a class or of one module instance; None removes the owner's own.

    On a class, kernelize reads it on every instance without its own.
    """
    if funcs is None:
        del owner._kernel_funcs
    else:
        owner._kernel_funcs = funcs


def instance_forward(module: nn.Module) -> object | None:
    """The forward set on `module` itself, where kernelize binds a layer's forward (a method); None if none is."""
    return module.__dict__.get("forward")


def release_instance_forward(module: nn.Module) -> None:
    """Remove the forward kernelize bound on `module`: it calls its class's forward again."""
    del module.forward


def is_layer_forward(function: object) -> bool:
    """Whether `function` is a forward kernelize binds as a layer's.

    Such a forward is the `forward` of a layer class of a kernel kernels has loaded (from any repository,
    npu-hub-kernels' cards or not), or the forward of a kernels function-module.
    """
    if getattr(function, "__code__", None) is _FUNCTION_MODULE_FORWARD:
        return True
    for loaded in get_loaded_kernels():
        layers = getattr(loaded.module, "layers", None)
        if layers is not None and any(
            isinstance(layer, type) and getattr(layer, "forward", None) is function for layer in vars(layers).values()
        ):
            return True
    return False


# Private functions wrapped

ForwardKeeper = Callable[["nn.Module", type], bool]
"""Whether kernelize is to leave the forward of a module as it is (True) instead of binding the given layer's."""
OriginalOf = Callable[["nn.Module"], "nn.Module | None"]
"""The module a given module is a stale copy of, whose forward the code calls in the copy's place; None if none."""

_KERNELS_LAYER = importlib.import_module("kernels.layer.layer")
if list(inspect.signature(getattr(_KERNELS_LAYER, "_replace_forward", lambda: None)).parameters) != ["module", "layer"]:
    raise ImportError(  # pragma: no cover - only with a kernels release that changed how kernelize binds a forward
        f"kernels {kernels.__version__} no longer binds forwards through layer._replace_forward(module, layer), which "
        f"npu-hub-kernels wraps. Install kernels=={TESTED}, and report it: mapping/npu_hub_kernels/_kernels_compat.py."
    )
_forward_keeper: ForwardKeeper | None = None
_original_of: OriginalOf | None = None
_wrapped_replace_forward: Callable[[nn.Module, type], None] = _KERNELS_LAYER._replace_forward
"""The `_replace_forward` `keep_forwards` wrapped: kernels' own, or whatever another library had put there."""


def _replace_forward_unless_kept(module: nn.Module, layer: type) -> None:
    """kernels' `_replace_forward(module, layer)` on `module` and on its original, except where the keeper keeps one.

    The original is what the installed `original_of` names (a stale copy's), if anything."""
    keeper, original_of = _forward_keeper, _original_of
    original = None if original_of is None else original_of(module)
    for target in (module,) if original is None else (module, original):
        if keeper is None or not keeper(target, layer):
            _wrapped_replace_forward(target, layer)


def keep_forwards(keeper: ForwardKeeper, original_of: OriginalOf | None = None) -> None:
    """Make kernelize, from now on, leave the forward of every module for which `keeper(module, layer)` is true.

    It binds neither a layer's forward nor the class's own there. Every other module is bound as kernels binds it.
    With `original_of`, a forward kernelize binds on a module that `original_of(module)` says is a stale copy is
    bound on that original too (unless the keeper keeps the original's): the code calls the original, not the copy.
    """
    global _forward_keeper, _original_of, _wrapped_replace_forward
    if _KERNELS_LAYER._replace_forward is not _replace_forward_unless_kept:
        _wrapped_replace_forward = _KERNELS_LAYER._replace_forward
        _KERNELS_LAYER._replace_forward = _replace_forward_unless_kept
    _forward_keeper, _original_of = keeper, original_of


def stop_keeping_forwards() -> None:
    """Undo `keep_forwards`: kernelize binds every forward as it did before, on the module it is given only."""
    global _forward_keeper, _original_of
    _forward_keeper, _original_of = None, None
    if _KERNELS_LAYER._replace_forward is _replace_forward_unless_kept:
        _KERNELS_LAYER._replace_forward = _wrapped_replace_forward


# Generated code


def _probe():
    """Made a function-module of below, to recognise the forward kernels gives every function-module."""


_FUNCTION_MODULE_FORWARD = type(use_kernel_forward_from_hub("npu-hub-kernels:probe")(_probe)).forward.__code__


def function_module_function(function_module: object) -> FunctionType | None:
    """The plain function a kernels function-module calls; None for anything else.

    A function-module is `use_kernel_forward_from_hub` on a function. "Anything else" includes a function-module
    whose class forward was replaced.
    """
    forward = type(function_module).__dict__.get("forward")
    if not inspect.isfunction(forward) or forward.__code__ is not _FUNCTION_MODULE_FORWARD:
        return None
    return inspect.getclosurevars(forward).nonlocals.get("func")


def attached_at_construction(cls: type) -> tuple[object, ...]:
    """The functions `use_kernelized_func` attaches to every instance of `cls` as it is built (its `_kernel_funcs`).

    They are read from the closure of the `__init__` the decorator put on the class; () for a class it did not
    decorate.
    """
    init = getattr(cls, "__init__", None)
    cells = getattr(init, "__closure__", None) or ()
    return tuple(item for cell in cells if isinstance(cell.cell_contents, tuple) for item in cell.cell_contents)


def decorated_init(cls: type) -> FunctionType | None:
    """The own `__init__` of a class `use_kernelized_func` decorated (its wrapper calls it); None for another class."""
    init = cls.__dict__.get("__init__")
    original = inspect.getclosurevars(init).nonlocals.get("orig_init") if inspect.isfunction(init) else None
    return (
        original if inspect.isfunction(original) and original.__qualname__ == f"{cls.__qualname__}.__init__" else None
    )


# Loader steps

VariantCheck = Callable[[Path, Metadata], object]
"""A check of an installed variant folder against its metadata, made before it is imported; raises to refuse it."""


def get_kernel_validators() -> list[MetadataValidator]:
    """The metadata checks `get_kernel` makes before an import.

    They check python-depends, the minimum kernels version, a clean build and the device architecture.
    """
    return [*default_metadata_validators(), ArchValidator()]


def hub_resolver(trust_remote_code: bool | list[str]) -> Resolver:
    """The resolver `get_kernel` ends with: the Hub cache only when HF_HUB_OFFLINE=1, else the Hub."""
    if constants.HF_HUB_OFFLINE:
        return HubCacheResolver(trust_remote_code=trust_remote_code)
    return HubResolver(trust_remote_code=trust_remote_code)


def version_commit(repo_id: str, version: int, *, local_files_only: bool) -> str:
    """The commit the branch `v<version>` of `repo_id` names, as LayerRepository resolves a version.

    It is read from the Hub's refs, or the cache's when `local_files_only`. Raises ValueError when there is no such
    version.
    """
    return resolve_version_spec_as_ref(repo_id, version, local_files_only=local_files_only).target_commit


def local_folder_variant(folder: Path) -> LocalKernel:
    """The variant kernels takes from a folder of one built card (`RepoPathsResolver`, for LOCAL_KERNELS)."""
    return resolve_local_kernel(folder, backend=None)


def cached_variant(repo_id: str, revision: str) -> LocalKernel:
    """The variant kernels takes from the Hub cache's snapshot of `revision` (`HubCacheResolver`, offline)."""
    return resolve_hub_cache_kernel(get_hf_api(), repo_id, revision=revision, backend=None)


class HintedLayerRepository(LayerRepository):
    """kernels' LayerRepository whose "repository not found" error says what to do: `hint(repo_id)`, added to it.

    The error keeps its type (huggingface_hub's RepositoryNotFoundError); a gated repository's is left as it is."""

    hint: Callable[[str], str]
    """What to do about `repo_id`, as a sentence (a subclass sets it)."""

    def _resolve_revision(self) -> str:
        try:
            return super()._resolve_revision()
        except RepositoryNotFoundError as error:
            if isinstance(error, GatedRepoError):
                raise
            message = f"{error}\n\n{self.hint(self._repo_id)}"
            raise RepositoryNotFoundError(message, response=error.response, server_message=error.server_message) from (
                error
            )


def load_layer_checked(repository: LayerRepository | LocalLayerRepository, check: VariantCheck) -> type[nn.Module]:
    """`repository.load()` as kernels runs it, with `check(variant_path, metadata)` called on every variant.

    `check` sees every variant of the kernel's dependency tree once it is installed (downloaded, when online) and
    before it is imported.

    A LayerRepository loads as `get_kernel` at its resolved revision, a LocalLayerRepository as `get_local_kernel`
    of its folder: the same resolvers and metadata validators, so the same build variant.
    """
    return get_kernel_layer(repository, load_kernel_checked(repository, check))


def load_kernel_checked(repository: LayerRepository | LocalLayerRepository, check: VariantCheck) -> ModuleType:
    """The kernel module `repository` names, loaded as `load_layer_checked` loads it (checked), before any layer."""
    if isinstance(repository, LocalLayerRepository):
        path = repository._repo_path
        api = get_hf_api()
        kernel = KernelDependency(repo_id=str(path), version=KernelVersion.Version(0))
        resolvers = [
            RepoPathsResolver(local_kernels={str(path): path}),
            get_local_kernel_overrides(),
            hub_resolver(False),
        ]
        validators = default_metadata_validators()
    else:
        api = get_hf_api(user_agent=repository._user_agent)
        kernel = KernelDependency(
            repo_id=repository._repo_id,
            version=revision_or_version(revision=repository._resolve_revision(), version=None),
        )
        resolvers = [get_local_kernel_overrides(), hub_resolver(repository._trust_remote_code)]
        validators = get_kernel_validators()
    tree = resolve_kernel_tree(api=api, backend=None, kernel=kernel, resolver=SequentialResolver(resolvers=resolvers))
    tree.validate_metadata(AllValidator(validators=validators))
    installed = tree.install(api=api)
    _check_tree(installed, check)
    return installed.load()


def _check_tree(node: DepTreeNode, check: VariantCheck) -> None:
    check(node.location.variant_path, node.location.metadata)
    for dependency in node.deps.values():
        _check_tree(dependency, check)


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
    "ForwardKeeper",
    "HintedLayerRepository",
    "HubCacheResolver",
    "HubResolver",
    "KernelDependency",
    "KernelVersion",
    "MetadataValidator",
    "OriginalOf",
    "RepoPathsResolver",
    "Resolver",
    "SequentialResolver",
    "Torch",
    "Variant",
    "VariantCheck",
    "attached_at_construction",
    "backend",
    "cached_variant",
    "check_version",
    "default_metadata_validators",
    "function_module_function",
    "get_available_versions",
    "get_hf_api",
    "get_kernel_layer",
    "get_kernel_validators",
    "get_local_kernel_overrides",
    "get_variants",
    "get_variants_local",
    "hub_resolver",
    "instance_forward",
    "is_layer_forward",
    "keep_forwards",
    "kernel_funcs",
    "load_kernel_checked",
    "load_layer_checked",
    "local_folder_variant",
    "own_kernel_funcs",
    "parse_local_kernel_overrides",
    "parse_variant",
    "release_instance_forward",
    "resolve_hub_cache_kernel",
    "resolve_kernel_tree",
    "resolve_local_kernel",
    "resolve_variants",
    "resolve_version_spec_as_ref",
    "revision_or_version",
    "set_own_kernel_funcs",
    "stop_keeping_forwards",
    "validate_layer",
    "version_commit",
]
