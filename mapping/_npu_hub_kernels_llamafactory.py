"""Registers npu-hub-kernels' `npu_hub` kernel plugin in LLaMA-Factory as soon as its kernel interface is imported.

The registration needs no change to LLaMA-Factory and costs nothing until then.

`install()` runs at interpreter startup (the `npu_hub_kernels_llamafactory.pth` file the package installs into
site-packages) and at `import npu_hub_kernels`. It registers the plugin at once if LLaMA-Factory's kernel interface
is imported already, else when it is imported (an import hook on that one module). This module imports only the
standard library, and `npu_hub_kernels` (torch, kernels, transformers) only once LLaMA-Factory has imported its
kernel interface, which imports them itself: a Python process that never imports LLaMA-Factory's kernels pays one
small import. Nothing here raises: a failure is logged and LLaMA-Factory runs without the plugin.
`NPU_HUB_KERNELS_LLAMAFACTORY=0` turns the registration off.

It lives outside the `npu_hub_kernels` package because importing anything inside the package imports the package
(torch included), which a `.pth` line must not do to every Python process of the environment. A failure is logged
as `npu_hub_kernels.llamafactory`, the plugin's module, so that logging configured for the package reaches it.

`npu_hub_kernels.retag` has an import hook of the same shape (run code right after a module executes); the two are
kept apart on purpose. This one is installed at interpreter start in every process, waits for one fixed module and
is never removed; retag's waits for a set of transformers modules that changes with each `register_npu_kernels`
and is emptied by `unregister_npu_kernels`. One shared hook would have to live here (stdlib-only, outside the
package), so either retag's pending rules would move into this startup module (two owners of retag's state) or
the hook would grow a registry of callbacks that retag adds to and clears, more code than the twenty lines of the
importlib protocol it would save.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from importlib.machinery import PathFinder
from types import ModuleType

INTERFACE_MODULE = "llamafactory.v1.plugins.model_plugins.kernels.interface"
"""LLaMA-Factory v1's kernel interface: where `KernelPlugin` is importable from (0.9.5 and newer)."""
PLUGIN_NAME = "npu_hub"
"""The `kernel_config.name` that selects the cards."""
DISABLE_ENV = "NPU_HUB_KERNELS_LLAMAFACTORY"
"""Set to "0" to leave LLaMA-Factory without the `npu_hub` plugin."""

_attempted: list[ModuleType] = []
"""The interface modules the plugin was registered in, or failed to be (once each)."""


def install() -> None:
    """Register the `npu_hub` plugin now if LLaMA-Factory's kernel interface is imported, else when it is."""
    if os.environ.get(DISABLE_ENV) == "0":
        return
    interface = sys.modules.get(INTERFACE_MODULE)
    if interface is not None:
        register(interface)
    elif not any(isinstance(finder, _RegisterOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())


def register(interface: ModuleType) -> None:
    """Register the `npu_hub` plugin in this imported kernel interface, once; log (never raise) a failure.

    Where the environment cannot run npu-hub-kernels (`environment_problem`), the plugin registered refuses with
    that reason.
    """
    if any(module is interface for module in _attempted):
        return
    _attempted.append(interface)  # first: importing npu_hub_kernels below runs install() again
    try:
        problem = environment_problem()
        if problem is not None:
            register_refusal(interface, problem)
            return
        from npu_hub_kernels.llamafactory import apply_npu_hub_kernels, kernel_class

        register_plugin(interface, apply_npu_hub_kernels, kernel_class)
    except Exception as error:
        import logging

        logging.getLogger("npu_hub_kernels.llamafactory").warning(
            "npu-hub-kernels could not register its LLaMA-Factory kernel plugin 'npu_hub' (%s: %s); LLaMA-Factory "
            "runs without it. Check that npu-hub-kernels and its dependencies import: python -c 'import "
            "npu_hub_kernels'.",
            type(error).__name__,
            error,
        )


DISTRIBUTION = "npu-hub-kernels"
CHECKED = ("transformers", "kernels")
"""The dependencies whose versions decide whether npu-hub-kernels imports at all (its pins in pyproject.toml)."""
LLAMAFACTORY_PINS = (
    "LLaMA-Factory 0.9.5 pins transformers<=5.6.0 (its main branch <=5.8.0), releases that cannot import next to "
    "the kernels 0.17 npu-hub-kernels needs. Install LLaMA-Factory next to a supported stack instead, without its "
    "pins: pip install 'npu-hub-kernels' && pip install --no-deps llamafactory==0.9.5, and set "
    "DISABLE_VERSION_CHECK=1 for LLaMA-Factory's v0 CLI (docs/llamafactory.md)"
)


def environment_problem() -> str | None:
    """Why npu-hub-kernels cannot run in this environment, or None.

    The reason is an installed transformers or kernels outside its pins, read from the installed distributions'
    metadata, without importing either.
    """
    from importlib.metadata import PackageNotFoundError, requires, version

    from packaging.requirements import Requirement

    try:
        pins = [Requirement(line) for line in requires(DISTRIBUTION) or ()]
    except PackageNotFoundError:  # a source checkout on sys.path: nothing installed to read the pins from
        return None
    problems = []
    for pin in pins:
        if pin.name not in CHECKED or pin.marker is not None:
            continue
        try:
            installed = version(pin.name)
        except PackageNotFoundError:
            problems.append(f"{pin.name} is not installed (npu-hub-kernels needs {pin})")
            continue
        if not pin.specifier.contains(installed, prereleases=True):
            problems.append(f"{pin.name} {installed} is installed, npu-hub-kernels needs {pin}")
    if not problems:
        return None
    return f"npu-hub-kernels' plugin 'npu_hub' cannot run here: {'; '.join(problems)}. {LLAMAFACTORY_PINS}."


def register_plugin(interface: ModuleType, function: Callable, kernel_class: Callable[[type], type]) -> None:
    """Register `npu_hub` in the `KernelPlugin` registry of LLaMA-Factory's kernel interface module.

    LLaMA-Factory 0.9.5 registers functions (`KernelPlugin(name).register()` on a function called with `model`
    and `include_kernels`): `function` is registered. Newer LLaMA-Factory registers kernel classes (`BaseKernel`
    subclasses with `check_device` and `_apply`, called as `KernelPlugin(name).apply(model=..., config=kernel_config)`),
    told apart by the `BaseKernel` next to `KernelPlugin`: `kernel_class(BaseKernel)` is registered.
    """
    base_kernel = kernel_class_base(interface)
    plugin = kernel_class(base_kernel) if base_kernel is not None else function
    interface.KernelPlugin(PLUGIN_NAME).register()(plugin)


def register_refusal(interface: ModuleType, problem: str) -> None:
    """Register an `npu_hub` plugin that raises RuntimeError(problem) when LLaMA-Factory uses it.

    Either registry kind is served: 0.9.5's functions, or newer `BaseKernel` classes, which refuse at `check_device`.
    """

    def refuse(*args, **kwargs):
        raise RuntimeError(problem)

    def refusal(base_kernel: type) -> type:
        return type("NpuHubKernelRefusal", (base_kernel,), {"check_device": staticmethod(refuse), "_apply": refuse})

    register_plugin(interface, refuse, refusal)


def kernel_class_base(interface: ModuleType) -> type | None:
    """The `BaseKernel` plugins subclass where the interface's registry takes classes; None where it takes functions.

    The registry takes classes in newer LLaMA-Factory (with `check_device`, next to `KernelPlugin`) and functions
    in 0.9.5.
    """
    base_kernel = getattr(sys.modules[interface.KernelPlugin.__module__], "BaseKernel", None)
    return base_kernel if base_kernel is not None and hasattr(base_kernel, "check_device") else None


class _RegisterOnImport:
    """Import hook: registers the plugin right after LLaMA-Factory's kernel interface module runs."""

    def find_spec(self, fullname, path, target=None):
        if fullname != INTERFACE_MODULE:
            return None
        spec = PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _RegisteringLoader(spec.loader)
        return spec


class _RegisteringLoader:
    """The interface module's own loader, registering the plugin after it executes the module."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def __getattr__(self, name: str):
        return getattr(self._loader, name)  # get_source, get_filename, ...: the loader's own

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        register(module)
