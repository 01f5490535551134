"""Load and concurrency on the emulated npu: registering, kernelizing and unregistering many models leaves no state
behind, and kernelized models run from two threads at once give one thread's numbers with every fused call."""

from __future__ import annotations

import collections
import dataclasses
import faulthandler
import gc
import importlib
import logging
import os
import sys
import threading
import tracemalloc
import weakref
from contextvars import ContextVar
from types import ModuleType

import pytest
import torch
from conftest import run_python
from kernels import Mode, kernelize
from test_mapping import expected_calls
from transformers.models.auto.configuration_auto import model_type_to_module_name

from npu_hub_kernels import _kernels_compat as compat
from npu_hub_kernels import register_npu_kernels, swapped_modules, unregister_npu_kernels
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm as tiny_model
from npu_hub_kernels.testing.tiny_models import token_ids

FAMILIES = ["llama", "qwen3", "qwen3_moe", "gemma3_text"]
"""All four cards and all their layer kinds between them: plain and zero-centred norms, split MLPs, experts."""
STATE_PACKAGES = ("npu_hub_kernels", "kernels")


def _size(value) -> int | None:
    if isinstance(value, ContextVar):
        value = value.get(None)
    if isinstance(
        value, dict | list | set | collections.deque | weakref.WeakKeyDictionary | weakref.WeakValueDictionary
    ):
        return len(value)
    if isinstance(value, weakref.WeakSet):
        return len(value)
    cache_info = getattr(value, "cache_info", None)
    return cache_info().currsize if callable(cache_info) else None


def state_sizes() -> dict[str, int]:
    """The size of every mutable module-level container and lru_cache of npu_hub_kernels and kernels (the
    registry's dicts, kernels' mapping, loaded-kernel and layer caches, ...), found by walking the modules, so a
    container added or moved by a later change is measured too; plus the import machinery the registry touches."""
    sizes = {"sys.meta_path": len(sys.meta_path), "sys.modules": len(sys.modules)}
    for name, module in list(sys.modules.items()):
        if not isinstance(module, ModuleType) or not any(name == p or name.startswith(p + ".") for p in STATE_PACKAGES):
            continue
        for attr, value in list(vars(module).items()):
            if attr.startswith("__") or isinstance(value, ModuleType):
                continue
            owners = [(attr, value)]
            if isinstance(value, type) and value.__module__ == name:  # lru_caches on a class's methods
                owners = [
                    (f"{attr}.{a}", v) for a, v in vars(value).items() if callable(getattr(v, "cache_info", None))
                ]
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):  # a state object (retag's)
                owners = [(f"{attr}.{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
            for label, obj in owners:
                size = _size(obj)
                if size is not None:
                    sizes[f"{name}.{label}"] = size
    return sizes


def class_tags() -> dict[str, object]:
    """What the registry changes on transformers' side for the families: each class's own kernel tags and
    `_kernel_funcs`, and each modeling file's rotary globals (compared by identity)."""
    tags = {}
    for model_type in FAMILIES:
        package = model_type_to_module_name(model_type)
        module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
        for name, obj in vars(module).items():
            if isinstance(obj, type) and obj.__module__ == module.__name__:
                for attr in ("kernel_layer_name", "kernel_condition"):
                    tags[f"{module.__name__}.{name}.{attr}"] = obj.__dict__.get(attr)
                tags[f"{module.__name__}.{name}.kernel_funcs"] = compat.own_kernel_funcs(obj)
            elif name.startswith("apply_rotary_pos_emb"):
                tags[f"{module.__name__}.{name}"] = obj
    return tags


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def register_kernelize_run_unregister(built_cards, cycle: int) -> weakref.ref:
    register_npu_kernels(local_dir=built_cards)
    model = kernelize(tiny_model(FAMILIES[cycle % len(FAMILIES)]).to("npu"), mode=Mode.INFERENCE, device="npu")
    with emulation.count_op_calls() as calls, torch.no_grad():
        model(token_ids().to("npu"))
    assert calls == expected_calls(FAMILIES[cycle % len(FAMILIES)], model), cycle  # it really ran fused
    unregister_npu_kernels()
    return weakref.ref(model)


CYCLES = 30
WARM_UP = 2 * len(FAMILIES)
PYTHON_HEAP_TOLERANCE = 64 * 1024
"""The traced Python heap (tracemalloc: Python objects, not tensor storage) after the cycles, against after the
warm-up. Measured: it moves by a few KiB, up and down (at most 17 KiB over 100 cycles) once warm. One leaked tiny
model costs megabytes of it: leaking one in ten cycles would exceed it many times over
(test_the_measurements_see_a_leaked_model)."""
RESIDENT_TOLERANCE = 32 * 1024 * 1024
RESIDENT_SLOPE_TOLERANCE = 1024 * 1024
"""Resident memory (RSS) after the cycles, against after the warm-up and against halfway. Measured with one torch
thread (as the test runs them): 0.1 MiB above the warm-up after 15 cycles, then flat to the 0.01 MiB through 100
cycles. (With two threads it grew by 7 to 15 MiB over the first 50 cycles, the allocator keeping freed pages,
which a short run cannot tell from a leak.) The second allows 70 KiB a cycle over the last CYCLES // 2 cycles, as
the 100-cycle version allowed 80 KiB over 50. Checked by leaking malloc'd memory no Python object owns in each
cycle: 160 KiB a cycle fails it (2.7 MiB), 80 KiB did in one run of two (1.4 MiB; freed pages the allocator keeps
absorb part of a small leak). Leaked models are caught exactly by the weak references."""


@pytest.mark.slow
def test_kernelize_and_unregister_many_models_leaves_no_state(built_cards):
    """CYCLES register / kernelize / fused forward / unregister cycles over four families: every registry dict and
    cache of npu_hub_kernels and kernels has its warmed-up size, transformers' classes and rotary globals are
    the original objects, every model is freed, and memory does not grow. (30 cycles: each family seven times
    or more after its warm-up; the tolerances above are set for that length.)

    Runs in a fresh interpreter: resident memory depends on what the allocator kept from earlier tests, and in a
    full xdist worker it grew by 2.6 to 3.1 MiB over the last 15 cycles where a fresh process stays flat."""
    out = run_python(
        f"import sys; sys.path.insert(0, 'tests')\n"
        f"from test_load_and_threads import cycle_and_measure; cycle_and_measure({str(built_cards)!r}); print('ok')",
        emulate=True,
        timeout=600,
    )
    assert out.splitlines()[-1] == "ok"


def cycle_and_measure(built_cards: str) -> None:
    """The stress test's body (see test_kernelize_and_unregister_many_models_leaves_no_state), with one torch
    thread: RSS is measured."""
    torch.set_num_threads(1)
    # Logging is off while measuring: kernels' per-kernelize warnings ("No kernel mapping found for layer SiLU")
    # would grow the log handlers' buffers, not ours.
    # Tracing starts before the warm-up: objects that are replaced on every cycle (torch.manual_seed keeps the
    # stack of its last call, ...) are then traced at the baseline too.
    logging.disable(logging.CRITICAL)
    tracemalloc.start()
    try:
        refs = [register_kernelize_run_unregister(built_cards, cycle) for cycle in range(WARM_UP)]
        gc.collect()
        sizes, tags, resident = state_sizes(), class_tags(), resident_bytes()
        baseline = tracemalloc.get_traced_memory()[0]
        refs += [register_kernelize_run_unregister(built_cards, cycle) for cycle in range(CYCLES // 2)]
        gc.collect()
        halfway = resident_bytes()
        refs += [register_kernelize_run_unregister(built_cards, cycle) for cycle in range(CYCLES // 2, CYCLES)]
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
        logging.disable(logging.NOTSET)
    after = state_sizes()
    assert {k: (sizes.get(k), v) for k, v in after.items() if sizes.get(k) != v} == {}
    assert class_tags() == tags
    assert [ref for ref in refs if ref() is not None] == []
    assert grown <= PYTHON_HEAP_TOLERANCE, grown
    assert resident_bytes() - resident <= RESIDENT_TOLERANCE, resident_bytes() - resident
    assert resident_bytes() - halfway <= RESIDENT_SLOPE_TOLERANCE, resident_bytes() - halfway

    # Negative controls: the measurements see registry state, and after unregistering nothing is swapped or fused.
    register_npu_kernels(local_dir=built_cards)
    try:
        assert state_sizes() != after and class_tags() != tags
    finally:
        unregister_npu_kernels()
    for model_type in FAMILIES:
        assert_nothing_runs_fused(tiny_model(model_type).to("npu"))


def assert_nothing_runs_fused(model) -> None:
    with emulation.count_op_calls() as calls, torch.no_grad():
        model(token_ids().to("npu"))
    assert calls == {} and swapped_modules(model) == []


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3"])
def test_unregister_releases_the_rotary_function_of_the_family(built_cards, model_type):
    """Regression: kernelize binds the card's rotary forward on the function-module every model of the family calls
    (a module global: transformers' own for Llama, the registry's for DeepseekV3). unregister_npu_kernels restored
    the registry's, but left transformers' one bound: after unregistering, a Llama never kernelized still ran
    npu_rotary_mul and swapped_modules listed it. Registering again fuses again."""
    register_npu_kernels(local_dir=built_cards)
    try:
        kernelize(tiny_model(model_type).to("npu"), mode=Mode.INFERENCE, device="npu")
    finally:
        unregister_npu_kernels()
    fresh = tiny_model(model_type).to("npu")
    assert_nothing_runs_fused(fresh)
    register_npu_kernels(local_dir=built_cards)
    try:
        kernelize(fresh, mode=Mode.INFERENCE, device="npu")
        with emulation.count_op_calls() as calls, torch.no_grad():
            fresh(token_ids().to("npu"))
        assert calls["npu_rotary_mul"] == 2 * fresh.config.num_hidden_layers
    finally:
        unregister_npu_kernels()


def test_the_measurements_see_a_leaked_model(built_cards):
    """The stress test's instruments can fail: a model kept alive by a global list shows in its weak reference and
    costs more traced Python heap than the stress test's tolerance leaves for CYCLES cycles."""
    leaked = []
    register_npu_kernels(local_dir=built_cards)
    try:
        tracemalloc.start()
        baseline = tracemalloc.get_traced_memory()[0]
        leaked.append(kernelize(tiny_model("llama").to("npu"), mode=Mode.INFERENCE, device="npu"))
        ref = weakref.ref(leaked[0])
        gc.collect()
        one_model = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
        unregister_npu_kernels()
    assert ref() is not None
    assert CYCLES // 10 * one_model > PYTHON_HEAP_TOLERANCE, one_model  # one leak in ten cycles would show
    leaked.clear()
    gc.collect()
    assert ref() is None


# --- Threads ---------------------------------------------------------------------------------------------------


@pytest.fixture
def interleaved():
    """Switch threads as often as the interpreter can, so that two threads' forwards interleave op by op."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


def run_together(*jobs):
    """Run the jobs in threads released at once; return their results (re-raising a thread's exception).

    A thread that never ends holds the test until tests/stuck_tests.py's watchdog ends the process with every
    thread's stack (a thread stuck holding the GIL would stop any timeout written here)."""
    barrier = threading.Barrier(len(jobs))
    results, errors = [None] * len(jobs), []

    def run(index, job):
        try:
            barrier.wait()
            results[index] = job()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index, job)) for index, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


REPEATS = 4


def inference(model, ids):
    def job():
        outs = []
        for _ in range(REPEATS):
            with torch.no_grad():
                outs.append(model(ids.to("npu")).logits.cpu())
        return outs

    return job


def times(calls, n: int) -> dict[str, int]:
    return {op: count * n for op, count in calls.items()}


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_two_threads_forward_one_model(npu_kernels, interleaved, model_type):
    """One kernelized model, never called before, serving two threads: each thread's logits are exactly the
    single-threaded ones, and the fused calls add up."""
    twin = kernelize(tiny_model(model_type).to("npu"), mode=Mode.INFERENCE, device="npu")
    batches = [token_ids(seed=1), token_ids(seed=2)]
    with emulation.count_op_calls() as one_forward, torch.no_grad():
        twin(batches[0].to("npu"))
    expected = [inference(twin, ids)()[0] for ids in batches]
    model = kernelize(tiny_model(model_type).to("npu"), mode=Mode.INFERENCE, device="npu")
    with emulation.count_op_calls() as calls:
        results = run_together(*(inference(model, ids) for ids in batches))
    for outs, want in zip(results, expected, strict=True):
        assert all(torch.equal(out, want) for out in outs)
    assert dict(calls) == times(one_forward, 2 * REPEATS)


def training(model, ids):
    def job():
        model.train()
        losses = []
        for _ in range(REPEATS):
            model.zero_grad()
            loss = model(ids.to("npu"), labels=ids.to("npu")).loss
            loss.backward()
            losses.append(loss.item())
        return losses, {name: p.grad.cpu() for name, p in model.named_parameters() if p.grad is not None}

    return job


def test_two_threads_train_two_models(npu_kernels, interleaved):
    """A dense and an MoE model, each trained (forward and backward) in its own thread at once: each thread's losses
    and gradients are exactly what one thread gets, and the fused calls of both add up."""
    ids = token_ids()
    expected, single = [], collections.Counter()
    for model_type in ("llama", "qwen3_moe"):
        twin = kernelize(tiny_model(model_type).to("npu"), mode=Mode.TRAINING, device="npu")
        with emulation.count_op_calls() as calls:
            expected.append(training(twin, ids)())
        single.update(calls)
    models = [kernelize(tiny_model(t).to("npu"), mode=Mode.TRAINING, device="npu") for t in ("llama", "qwen3_moe")]
    with emulation.count_op_calls() as calls:
        results = run_together(*(training(model, ids) for model in models))
    assert calls == single
    for (losses, grads), (want_losses, want_grads) in zip(results, expected, strict=True):
        assert losses == want_losses
        assert grads.keys() == want_grads.keys() and all(torch.equal(grads[k], want_grads[k]) for k in grads)


FRESH_MODELS = 20


def test_two_threads_first_call_of_fresh_models(npu_kernels, interleaved):
    """Two threads making the first calls of fresh models (an earlier card design changed the weights' layout on the
    first call, and raced there): every fresh model serves both threads, fused, with the single-thread numbers."""
    batches = [token_ids(seed=1), token_ids(seed=2)]
    twin = kernelize(tiny_model("llama").to("npu"), mode=Mode.INFERENCE, device="npu")
    expected = [inference(twin, ids)()[0] for ids in batches]
    with emulation.count_op_calls() as one_forward, torch.no_grad():
        twin(batches[0].to("npu"))
    for _ in range(FRESH_MODELS):
        model = kernelize(tiny_model("llama").to("npu"), mode=Mode.INFERENCE, device="npu")
        with emulation.count_op_calls() as calls:
            results = run_together(*(inference(model, ids) for ids in batches))
        assert dict(calls) == times(one_forward, 2 * REPEATS)
        assert all(torch.equal(out, want) for outs, want in zip(results, expected, strict=True) for out in outs)


SHARED_FORWARDS = 300
DEADLOCK_DEADLINE = 150


@pytest.mark.slow
def test_two_threads_training_one_model_never_deadlock(built_cards):
    """Regression: two threads running training forwards of one model, which create the parameters' gradient
    accumulators afresh on each forward, deadlocked in two runs of three of 200 forwards each. torch holds a tensor's
    autograd mutex while it asks the device guard for a stream; the emulation's guard was torch's Python one, which
    could hand the GIL there to a thread that then waited for the mutex holding the GIL (emulation.device's
    `_NpuDeviceGuard`). CI's run stopped at its limit on it. In a fresh interpreter with a deadline: a deadlock ends
    it with every thread's stack."""
    out = run_python(
        f"import sys; sys.path.insert(0, 'tests')\n"
        f"from test_load_and_threads import train_one_model_from_two_threads\n"
        f"train_one_model_from_two_threads({str(built_cards)!r}); print('ok')",
        emulate=True,
        timeout=2 * DEADLOCK_DEADLINE,
    )
    assert out.splitlines()[-1] == "ok"


def train_one_model_from_two_threads(built_cards: str) -> None:
    """The deadlock test's body: SHARED_FORWARDS training forwards from each of two threads, switching threads as
    often as the interpreter can; a stuck run exits with every thread's stack (faulthandler needs no GIL to)."""
    faulthandler.dump_traceback_later(DEADLOCK_DEADLINE, exit=True)
    register_npu_kernels(local_dir=built_cards)
    model = kernelize(tiny_model("llama").to("npu"), mode=Mode.TRAINING, device="npu").train()
    ids = token_ids().to("npu")
    sys.setswitchinterval(1e-6)

    def job():
        return [model(ids, labels=ids).loss.item() for _ in range(SHARED_FORWARDS)]

    first, second = run_together(job, job)
    faulthandler.cancel_dump_traceback_later()
    assert first == second


def training_losses(model, ids):
    """Training forwards with labels (the loss fused, its gradients made in forward), no backward: threads that share
    a model must not write its gradients at once (torch's own zero_grad and accumulation race there)."""

    def job():
        model.train()
        return [model(ids.to("npu"), labels=ids.to("npu")).loss.item() for _ in range(REPEATS)]

    return job


def test_two_threads_fuse_the_loss_of_one_model_while_a_third_computes_logits(npu_kernels, interleaved):
    """One kernelized model: two threads run training forwards (the loss fused as lm_head's call, lm_head's forward
    stood in for that call) while a third computes logits without grad (lm_head's own forward, in the meantime too):
    each thread's losses and logits are one thread's, the fused calls add up, and lm_head holds no forward of its own
    afterwards."""
    ids = token_ids()
    twin = kernelize(tiny_model("llama").to("npu"), mode=Mode.TRAINING, device="npu")
    with emulation.count_op_calls() as one_training:
        want_losses = training_losses(twin, ids)()
    with emulation.count_op_calls() as one_inference:
        want_logits = inference(twin, ids)()
    assert one_training["npu_cross_entropy_loss"] == REPEATS and "npu_cross_entropy_loss" not in one_inference
    model = kernelize(tiny_model("llama").to("npu"), mode=Mode.TRAINING, device="npu")
    jobs = (training_losses(model, ids), training_losses(model, ids), inference(model, ids))
    with emulation.count_op_calls() as calls:
        losses, losses_too, logits = run_together(*jobs)
    assert losses == losses_too == want_losses
    assert all(torch.equal(got, want) for got, want in zip(logits, want_logits, strict=True))
    assert calls == one_training + one_training + one_inference
    assert "forward" not in vars(model.lm_head)
