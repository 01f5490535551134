"""`python -m npu_hub_kernels selftest` end to end on the emulated device, with its negative controls.

A deliberately wrong emulated op must fail its card's forms and make the card stand down on the next
`register_npu_kernels()` (and not before the result exists); an emulated op that accepts a call the ledger refuses,
or refuses one it accepts, must be reported. The cases are the package's (`npu_hub_kernels.selftest.cases`), which
the ledger tests and the hardware tests read too.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

import pytest
import torch
from kernels import Mode, kernelize
from transformers import AutoConfig

from npu_hub_kernels import CARDS, register_npu_kernels, swapped_modules, unregister_npu_kernels
from npu_hub_kernels.__main__ import main
from npu_hub_kernels.doctor import format_report, model_report
from npu_hub_kernels.selftest import results
from npu_hub_kernels.selftest.cases import cases_of
from npu_hub_kernels.selftest.forms import ALL_LAYERS, Form
from npu_hub_kernels.selftest.run import run_selftest
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.emulation import LEDGER
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm, tiny_config_values, token_ids

RMS_NORM = CARDS["npu_fused_rmsnorm"]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny Llama config.json: the widths the selftest runs at (--model)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    AutoConfig.for_model("llama", **tiny_config_values("llama")).save_pretrained(folder)
    return str(folder)


@pytest.fixture(autouse=True)
def results_dir(tmp_path, monkeypatch):
    """Each test keeps its selftest results in a folder of its own, and leaves nothing registered."""
    monkeypatch.setenv(results.DIR_ENV, str(tmp_path / "selftest"))
    monkeypatch.delenv(results.USE_ENV, raising=False)
    yield tmp_path / "selftest"
    unregister_npu_kernels()


def _selftest(built_cards, tiny_model_dir, card=RMS_NORM):
    return run_selftest(model=tiny_model_dir, quick=True, local_dir=built_cards, cards=[card])


@contextmanager
def _rule_holds(rule_id: str, holds):
    """The emulated device judges `rule_id` by `holds` inside the block (a device that disagrees with the ledger)."""
    rule = next(rule for rule in LEDGER if rule.id == rule_id)
    original = rule.holds
    object.__setattr__(rule, "holds", holds)
    try:
        yield
    finally:
        object.__setattr__(rule, "holds", original)


@contextmanager
def _off_by_five_percent():
    """The emulated npu_rms_norm and npu_gemma_rms_norm are wrong inside the block: outputs 5% too large (and so the
    gradients)."""
    torch_npu = sys.modules["torch_npu"]
    rights = {name: getattr(torch_npu, name) for name in ("npu_rms_norm", "npu_gemma_rms_norm")}

    def wrong(right):
        def call(*args, **kwargs):
            y, rstd = right(*args, **kwargs)
            return y * 1.05, rstd

        return call

    for name, right in rights.items():
        setattr(torch_npu, name, wrong(right))
    try:
        yield
    finally:
        for name, right in rights.items():
            setattr(torch_npu, name, right)


def _rms_norm_swaps(built_cards, **register):
    """The RMSNorm swaps of a tiny Llama kernelized after `register_npu_kernels(**register)`, and its fused calls."""
    register_npu_kernels(local_dir=built_cards, **register)
    model = kernelize(tiny_causal_lm("llama").to("npu"), mode=Mode.INFERENCE, device="npu")
    with emulation.count_op_calls() as calls, torch.no_grad():
        model(token_ids().to("npu"))
    return swapped_modules(model, card=RMS_NORM.repo_name), calls["npu_rms_norm"], model


@pytest.mark.parametrize("card", CARDS.values(), ids=lambda card: card.repo_name)
def test_every_card_has_forms_limits_and_cases_covering_its_layers(card):
    module = cases_of(card)
    assert module is not None, f"add npu_hub_kernels/selftest/cases/{card.python_name}.py"
    assert module.FORMS and all(isinstance(form, Form) for form in module.FORMS.values())
    assert module.LIMITS and module.CASES
    layers = {layer for form in module.FORMS.values() for layer in form.layers}
    if ALL_LAYERS[0] not in layers:
        assert layers <= set(card.layers), f"forms name layers the card does not have: {layers - set(card.layers)}"
        assert set(card.layers) <= layers, f"layers no form runs: {set(card.layers) - layers}"


def test_selftest_passes_the_card_and_reports_what_it_ran(built_cards, tiny_model_dir):
    report = _selftest(built_cards, tiny_model_dir)
    entry = report["cards"][RMS_NORM.repo_name]
    assert report["verdict"] == entry["verdict"] == "pass" and entry["failed"] == {}
    assert {f["form"] for f in entry["forms"]} == set(cases_of(RMS_NORM).FORMS)
    assert {f["dtype"] for f in entry["forms"]} == {"bfloat16", "float16"}
    assert all(f["status"] == "pass" and f["errors"] for f in entry["forms"])
    assert all(p["inside"] == "accepted" and p["past"].startswith("raised DeviceRefusal") for p in entry["probes"])
    assert entry["timings"] and all(t["fused_ms"] > 0 and t["eager_ms"] > 0 for t in entry["timings"])
    assert report["environment"]["device"] == "Ascend910B3" and report["environment"]["emulated"]
    assert entry["variant"].startswith("torch213-cxx11-cann91")


def test_a_wrong_op_fails_its_forms_and_the_card_stands_down_after_the_result_exists(
    built_cards, tiny_model_dir, monkeypatch
):
    with _off_by_five_percent():
        report = _selftest(built_cards, tiny_model_dir)
    entry = report["cards"][RMS_NORM.repo_name]
    assert report["verdict"] == "fail" and set(entry["failed"]) == set(cases_of(RMS_NORM).FORMS)

    swaps, fused_calls, _ = _rms_norm_swaps(built_cards)  # no result kept yet: nothing stands down
    assert swaps and all(swap.variant is not None for swap in swaps) and fused_calls > 0

    assert results.summary().startswith("not run on this host: python -m npu_hub_kernels selftest")
    results.save_result(report)
    assert results.summary().startswith("fail on ") and "npu-rms-norm: plain" in results.summary()
    swaps, fused_calls, model = _rms_norm_swaps(built_cards)
    assert swaps and fused_calls == 0
    assert all(swap.variant is None and swap.eager_reason.startswith(results.REASON_PREFIX) for swap in swaps)
    assert "fused error" in swaps[0].eager_reason
    assert "stood down" in format_report_of(model)

    assert all(swap.variant is not None for swap in _rms_norm_swaps(built_cards, use_selftest=False)[0])
    monkeypatch.setenv(results.USE_ENV, "0")
    assert all(swap.variant is not None for swap in _rms_norm_swaps(built_cards)[0])


def format_report_of(model) -> str:
    """The doctor's lines on what runs in `model` (its model section)."""
    from npu_hub_kernels.doctor import diagnose

    report = diagnose()
    report.model = model_report(model)
    return format_report(report)


def test_a_result_for_another_cann_or_build_is_ignored(built_cards, tiny_model_dir):
    with _off_by_five_percent():
        report = _selftest(built_cards, tiny_model_dir)
    other_build = json.loads(json.dumps(report))
    other_build["cards"][RMS_NORM.repo_name]["digest"] = "0" * 64
    results.save_result(other_build)
    assert all(swap.variant is not None for swap in _rms_norm_swaps(built_cards)[0])

    results.save_result(report)
    emulation.set_cann_version("9.0.0")
    try:
        assert all(swap.variant is not None for swap in _rms_norm_swaps(built_cards)[0])
    finally:
        emulation.set_cann_version(emulation.DEFAULT_CANN_VERSION)
    assert all(swap.variant is None for swap in _rms_norm_swaps(built_cards)[0])  # the control: this CANN's applies


def test_a_device_that_accepts_a_refused_call_is_a_finding_and_one_that_refuses_an_accepted_call_a_bug(
    built_cards, tiny_model_dir
):
    with _rule_holds("npu_rms_norm/x-dtype", lambda call: True):
        report = _selftest(built_cards, tiny_model_dir)
    probes = {probe["rule"]: probe for probe in report["cards"][RMS_NORM.repo_name]["probes"]}
    assert probes["npu_rms_norm/x-dtype"]["past"] == "accepted"
    assert probes["npu_rms_norm/x-dtype"]["finding"].startswith("finding: the device accepts a call the ledger refuses")
    assert [rule for rule, probe in probes.items() if probe["finding"]] == ["npu_rms_norm/x-dtype"]
    assert report["verdict"] == "findings" and report["cards"][RMS_NORM.repo_name]["failed"] == {}

    with _rule_holds("npu_rms_norm/gamma-shape", lambda call: False):
        report = _selftest(built_cards, tiny_model_dir)
    probes = {probe["rule"]: probe for probe in report["cards"][RMS_NORM.repo_name]["probes"]}
    assert probes["npu_rms_norm/gamma-shape"]["finding"].startswith("bug: the device refuses a call the ledger accepts")
    assert report["verdict"] == "fail"  # every form's fused call is refused too: they stand down


def test_command_line_writes_the_json_report_and_prints_the_table(built_cards, tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "report.json"
    argv = ["selftest", "--quick", "--cards", "npu-rms-norm", "--local-dir", str(built_cards),
            "--model", tiny_model_dir, "--json", str(path), "--no-record"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "npu-rms-norm" in out.out and "verdict: pass" in out.out and "[1/1] npu-rms-norm" in out.err
    report = json.loads(path.read_text())
    assert report["schema"] == results.SCHEMA and set(report["cards"]) == {"npu-rms-norm"}
    assert not results.results_dir().exists()  # --no-record
    assert main([*argv[:-1], "--cards", "npu-nothing"]) == 2


def test_the_hardware_tests_read_every_form_and_case_of_the_selftest():
    import test_hardware

    forms = {(card.repo_name, name) for card, name, _ in test_hardware.HARDWARE_FORMS}
    assert forms == {(card.repo_name, name) for card in CARDS.values() for name in cases_of(card).FORMS}
    cases = {rule for rule, _ in test_hardware.HARDWARE_CASES}
    assert cases == {rule for card in CARDS.values() for rule in cases_of(card).CASES}
