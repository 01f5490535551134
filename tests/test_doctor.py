"""`python -m npu_hub_kernels doctor`: the variant each card would load here, kernels' reasons, cache and trust.

In this process (conftest: an emulated Ascend host with CANN 9.1.0, offline, the built cards seeded in the
cache as TEST_ORG/<card>) the doctor runs in-process; as a plain CPU host, on other caches or online it
runs as `python -m npu_hub_kernels doctor` in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT
from hub_server import LoopbackHub, client_env
from huggingface_hub import constants
from test_distribution import publish_built_cards

from npu_hub_kernels.__main__ import main
from npu_hub_kernels.cards import CARDS
from npu_hub_kernels.doctor import diagnose, format_report
from npu_hub_kernels.offline import seed_offline_cache
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm

CARD_NAMES = [card.repo_name for card in CARDS.values()]
MACHINE = platform.machine()
OTHER_MACHINE = "aarch64" if MACHINE == "x86_64" else "x86_64"
ARCH_VARIANT = f"torch213-cxx11-cann91-{MACHINE}-linux"
HUB_ORG = "npu-hub-kernels-doctor"
TOKEN = "hf_loopback_doctor"
TRL_HEAD = "trl.trainer.utils.add_fused_lm_head.<locals>._fused_forward"


def doctor_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    """Run the doctor in this process with --json; returns its exit status and report."""
    status = main(["doctor", *args, "--json"])
    return status, json.loads(capsys.readouterr().out)


def doctor_process(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m npu_hub_kernels doctor ARGS` in a fresh interpreter: a plain CPU host."""
    return subprocess.run(
        [sys.executable, "-m", "npu_hub_kernels", "doctor", *args],
        env=env if env is not None else dict(os.environ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def cards_of(report: dict) -> dict[str, dict]:
    return {card["card"]: card for card in report["cards"]}


def variant_count(built_cards: Path) -> int:
    return len(list((built_cards / "npu-rope" / "build").iterdir()))


def test_emulated_ascend_host_loads_the_cann91_build_of_every_card(offline_hub, built_cards, capsys):
    status, report = doctor_json(capsys, "--org", offline_hub)
    assert status == 0 and report["ok"] and report["hints"] == []
    host = report["host"]
    assert (host["backend"], host["cann"]) == ("cann91", "9.1.0")
    assert host["torch_npu"].endswith("(emulated by npu_hub_kernels.testing.emulation)")
    assert report["publisher_trusted"] is None and report["publisher_trust"].startswith("unknown (offline)")
    assert f"trust_remote_code={[f'{offline_hub}/{name}' for name in CARD_NAMES]}" in report["registry_trust"]
    for name, card in cards_of(report).items():
        assert card["repo_id"] == f"{offline_hub}/{name}"
        assert (card["variant"], card["fallbacks"]) == (ARCH_VARIANT, ["torch-npu", "torch-universal"])
        assert card["source"].startswith("Hub cache: ") and card["cached"] is True
        assert card["files"].endswith("files match the metadata.json digest")
        rejected = card["rejected"]
        assert len(rejected) == variant_count(built_cards) - 3
        assert rejected[f"torch29-cxx11-cann91-{MACHINE}-linux"] == (
            "Torch version (2.9) does not match environment Torch version (2.13)"
        )
        assert rejected[f"torch213-cxx11-cann91-{OTHER_MACHINE}-linux"] == (
            f"CPU ({OTHER_MACHINE}) does not match system CPU ({MACHINE})"
        )

    assert main(["doctor", "--org", offline_hub]) == 0
    text = capsys.readouterr().out
    assert text.count(f"\n  loads       {ARCH_VARIANT}\n") == len(CARDS)
    assert re.search(rf"\n    torch29-cxx11-cann91-{MACHINE}-linux +Torch version \(2\.9\) does not match", text)
    rejection_rows = [line for line in text.splitlines() if line.startswith("    torch")]
    assert len(rejection_rows) == variant_count(built_cards) - 3  # listed once, for the first card
    assert len({len(re.match(r" +\S+ +", row).group()) for row in rejection_rows}) == 1  # reasons aligned
    first = next(iter(CARDS.values())).repo_name  # the one whose rejections are listed
    assert f"rejected    {variant_count(built_cards) - 3} variants, as for {first} (same reasons)" in text
    assert text.endswith(f"OK: all {len(CARDS)} cards resolve to a build variant that loads on this host.\n")


def test_built_cards_are_diagnosed_as_local_dir_loads_them_and_a_folder_without_builds_is_named(
    built_cards, tmp_path, capsys
):
    """`--local-dir`: each card's variant from its built folder, its files checked, no Hub asked; a folder without
    built cards fails with the fix (the negative control)."""
    status, report = doctor_json(capsys, "--local-dir", str(built_cards))
    assert status == 0 and report["ok"] and report["local_dir"] == str(built_cards)
    assert report["publisher_trust"].startswith("not asked") and report["registry_trust"].startswith("not needed")
    for name, card in cards_of(report).items():
        assert card["source"] == f"built card: {built_cards / name}" and card["revision"] is None
        assert (card["variant"], card["fallbacks"]) == (ARCH_VARIANT, ["torch-npu", "torch-universal"])
        assert card["files"].endswith("files match the metadata.json digest")
    assert main(["doctor", "--local-dir", str(built_cards)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"npu-hub-kernels doctor: built cards of {built_cards}\n")
    assert f"\nnpu-rope  {built_cards / 'npu-rope'}  (kernel id npu_fused_rope)\n" in text

    status, report = doctor_json(capsys, "--local-dir", str(tmp_path))
    assert status == 1 and not report["ok"]
    assert cards_of(report)["npu-rope"]["problem"] == f"{tmp_path / 'npu-rope'} holds no built card (no build/ folder)"
    assert report["hints"][0].startswith("build the cards (`make build`) and pass the folder that holds npu-")


def test_another_cann_version_falls_back_to_the_generic_npu_build(offline_hub, capsys):
    emulation.set_cann_version("8.5.0")  # torch 2.13 is built for CANN 9.1 only
    try:
        status, report = doctor_json(capsys, "--org", offline_hub)
    finally:
        emulation.set_cann_version(emulation.DEFAULT_CANN_VERSION)
    assert status == 0 and report["host"]["backend"] == "cann85"
    for card in report["cards"]:
        assert (card["variant"], card["fallbacks"]) == ("torch-npu", ["torch-universal"])
        assert card["rejected"][ARCH_VARIANT] == "backend (cann91) does not match selected backend (cann85)"


def test_cpu_host_loads_torch_universal_and_says_why_not_the_npu_builds(offline_hub):
    result = doctor_process("--org", offline_hub, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    host = report["host"]
    assert (host["torch_npu"], host["cann"], host["backend"]) == ("not installed", "not installed", "cpu")
    assert any("torch 2.13 with CANN 9.1" in note and "pip install" in note for note in host["notes"])
    for card in report["cards"]:
        assert (card["variant"], card["fallbacks"], card["problem"]) == ("torch-universal", [], None)
        assert card["rejected"]["torch-npu"] == "backend (npu) does not match system backend (cpu) and is not universal"
        assert card["rejected"][ARCH_VARIANT] == "backend (cann91) does not match selected backend (cpu)"


def test_empty_cache_says_not_cached_and_exits_1_with_a_hint(tmp_path):
    result = doctor_process("--org", "some-org", env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "empty")})
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    for name in CARD_NAMES:
        assert f"  problem     not cached: Version 1 of 'some-org/{name}' is not available in the local cache" in out
    assert f"PROBLEM: {len(CARDS)} of {len(CARDS)} cards would not load on this host. Hints:" in out
    assert "run `make build`, then seed the cache" in out and "seed_offline_cache('build', 'some-org')" in out


def test_a_damaged_cached_variant_fails_with_what_differs(built_cards, tmp_path):
    cache = tmp_path / "cache"
    snapshot = seed_offline_cache(built_cards, "some-org", cache)["some-org/npu-rope"]
    (snapshot / "build" / "torch-universal" / "npu_rope" / "layers.py").unlink()
    result = doctor_process("--org", "some-org", "--json", env={**os.environ, "HF_HUB_CACHE": str(cache)})
    assert result.returncode == 1
    report = json.loads(result.stdout)
    cards = cards_of(report)
    assert "npu_rope/layers.py" in cards["npu-rope"]["problem"]
    assert cards["npu-rope"]["problem"].startswith("the files of build/torch-universal differ from its metadata.json")
    assert cards["npu-rope"]["hint"].startswith(
        f"the copy of build/torch-universal is damaged or partial: replace {snapshot}"
    )
    assert [name for name, card in cards.items() if card["problem"]] == ["npu-rope"]


def _damage(snapshot: Path, damage: str) -> None:
    """Damage the cached npu-rope snapshot the way a broken copy, download or cleanup would."""
    variant = snapshot / "build" / "torch-universal"
    if damage == "missing metadata.json":
        (variant / "metadata.json").unlink()
    elif damage == "corrupt metadata.json":
        (variant / "metadata.json").write_text("{not json")
    elif damage == "empty variant folder":
        shutil.rmtree(variant)
        variant.mkdir()
    elif damage == "dangling blob symlink":  # the Hub cache links snapshot files to blobs/
        (variant / "npu_rope" / "layers.py").unlink()
        (variant / "npu_rope" / "layers.py").symlink_to(snapshot.parent.parent / "blobs" / "0123abcd")
    elif damage == "empty refs/v1":
        (snapshot.parent.parent / "refs" / "v1").write_text("")


DAMAGES = {  # damage -> (the problem the doctor names, its hint)
    "missing metadata.json": ("build/torch-universal/ has no metadata.json", "damaged or partial: replace"),
    "corrupt metadata.json": ("build/torch-universal/metadata.json does not parse", "damaged or partial: replace"),
    "empty variant folder": ("build/torch-universal/ has no metadata.json", "damaged or partial: replace"),
    "dangling blob symlink": (
        "links to missing files (blobs the cache no longer holds): npu_rope/layers.py",
        "damaged or partial: replace",
    ),
    "empty refs/v1": (
        "refs/v1 of damaged-4/npu-rope holds '', not a commit id",
        "seed_offline_cache('build', 'damaged-4')",
    ),
}


@pytest.mark.slow
def test_a_damaged_cache_is_diagnosed_with_a_hint_and_exit_1(built_cards, tmp_path):
    """Each damage in the npu-rope card of its own org (one CPU-host process runs the doctor on each org):
    a report naming it, with a hint, exit status 1, no traceback; the other cards load."""
    cache = tmp_path / "cache"
    orgs = {f"damaged-{index}": damage for index, damage in enumerate(DAMAGES)}
    for org, damage in orgs.items():
        _damage(seed_offline_cache(built_cards, org, cache)[f"{org}/npu-rope"], damage)
    code = (
        "import contextlib, io, json\n"
        "from npu_hub_kernels.__main__ import main\n"
        f"for org in {list(orgs)!r}:\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        status = main(['doctor', '--org', org, '--json'])\n"
        "    print(json.dumps([org, status, json.loads(out.getvalue())]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "HF_HUB_CACHE": str(cache)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    for line in result.stdout.splitlines():
        org, status, report = json.loads(line)
        problem, hint = DAMAGES[orgs[org]]
        cards = cards_of(report)
        assert status == 1, org
        assert problem in cards["npu-rope"]["problem"], (orgs[org], cards["npu-rope"]["problem"])
        assert hint in cards["npu-rope"]["hint"], (orgs[org], cards["npu-rope"]["hint"])
        assert [name for name, card in cards.items() if card["problem"]] == ["npu-rope"]
    assert len(result.stdout.splitlines()) == len(orgs)


def test_local_kernels_folder_is_where_its_card_comes_from(offline_hub, built_cards, monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_KERNELS", f"{offline_hub}/npu-rope={built_cards / 'npu-rope'}")
    status, report = doctor_json(capsys, "--org", offline_hub)
    assert status == 0
    cards = cards_of(report)
    assert cards["npu-rope"]["source"] == f"LOCAL_KERNELS: {built_cards / 'npu-rope'}"
    assert (cards["npu-rope"]["variant"], cards["npu-rope"]["cached"]) == (ARCH_VARIANT, None)
    assert cards["npu-rope"]["files"].endswith("files match the metadata.json digest")
    assert all(card["source"].startswith("Hub cache: ") for name, card in cards.items() if name != "npu-rope")


@pytest.fixture
def hub(built_cards: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LoopbackHub]:
    """A Hub holding every card in HUB_ORG, which the Hub does not mark a trusted kernel publisher."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # conftest keeps this process offline
    with LoopbackHub(idle_timeout=60) as hub:
        hub.add_org(HUB_ORG, kernels_approved=True)
        hub.add_user("publisher", orgs=[HUB_ORG], token=TOKEN)
        publish_built_cards(hub, built_cards, HUB_ORG, TOKEN)
        yield hub
        assert hub.unrouted == [] and hub.errors == []


@pytest.mark.slow
def test_online_host_asks_the_hub_and_names_the_telemetry_trap(hub, tmp_path):
    online = client_env(hub.url, tmp_path)
    result = doctor_process("--org", HUB_ORG, "--json", env=online)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["publisher_trusted"] is False and "`kernels lock` refuses" in report["publisher_trust"]
    for name, card in cards_of(report).items():
        assert (card["source"], card["revision"]) == (f"Hub: {hub.url}", hub.head(f"{HUB_ORG}/{name}", "v1"))
        assert (card["variant"], card["cached"]) == ("torch-universal", False)
        assert card["files"] == "get_kernel downloads build/torch-universal/ on first use"
    assert not (tmp_path / "hub-cache").exists()  # the doctor reads the cache, never writes to it

    trapped = doctor_process("--org", HUB_ORG, "--json", env={**online, "HF_HUB_DISABLE_TELEMETRY": "1"})
    assert trapped.returncode == 1
    report = json.loads(trapped.stdout)
    assert all(card["problem"].startswith("the Hub did not answer: LocalProtocolError") for card in report["cards"])
    assert len(report["hints"]) == 1 and report["hints"][0].startswith("unset HF_HUB_DISABLE_TELEMETRY")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--version", "0"), "argument --version: 0 is not a card version: versions start at 1"),
        (("--version", "-1"), "argument --version: -1 is not a card version: versions start at 1"),
        (("--version", "one"), "argument --version: 'one' is not a card version: a whole number from 1"),
        (("--org", "bad org"), "argument --org: 'bad org' is not a Hub organisation name"),
        (("--org", "an-org/npu-rope"), "argument --org: 'an-org/npu-rope' is not a Hub organisation name"),
        (("--org", "x--y"), "argument --org: 'x--y' is not a Hub organisation name"),
    ],
)
def test_invalid_versions_and_org_names_are_refused_when_parsing(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["doctor", *args])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_a_malformed_org_from_the_environment_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("NPU_HUB_KERNELS_ORG", "my org")
    assert main(["doctor"]) == 2
    captured = capsys.readouterr()
    assert "NPU_HUB_KERNELS_ORG='my org' is not a Hub organisation name" in captured.err and captured.out == ""


def test_a_version_the_cache_does_not_hold_is_named_with_the_versions_it_holds(offline_hub, capsys):
    status, report = doctor_json(capsys, "--org", offline_hub, "--version", "7")
    assert status == 1
    for name, card in cards_of(report).items():
        assert card["problem"] == f"version 7 of {offline_hub}/{name} is not in the cache, which holds v1"
    (hint,) = report["hints"]
    assert "--version 1" in hint and "cannot tell whether version 7 exists" in hint
    assert "seed" not in hint and "download each card" not in hint


def test_given_a_model_it_says_what_fuses_and_which_forward_another_library_set_is_kept(offline_hub, npu_kernels):
    """`diagnose(model=...)`: the modules running each card's layer, counted, and each module of a swapped class that
    keeps another library's forward (TRL's fused LM head here, through a kernelize after it was set): not fused, why,
    and that forward's qualified name; in the text and the JSON alike."""
    from kernels import Mode, kernelize
    from trl.trainer.utils import add_fused_lm_head

    model = kernelize(tiny_causal_lm("llama").to("npu"), mode=Mode.INFERENCE, device="npu")
    add_fused_lm_head(model)
    kernelize(model, mode=Mode.TRAINING, device="npu")
    report = diagnose(offline_hub, model=model)
    assert report.ok and report.model.model_class == "LlamaForCausalLM"
    assert report.model.fused == {"npu-add-rms-norm": 2, "npu-rms-norm": 5, "npu-rope": 2, "npu-swiglu": 2}
    (kept,) = report.model.not_fused
    assert (kept.module, kept.card, kept.forward) == ("<root>", "npu-linear-cross-entropy", TRL_HEAD)
    text = format_report(report)
    kept_row = f"\n  kept        <root> (LlamaForCausalLM): not fused: another library set its forward to {TRL_HEAD}"
    assert kept_row in text
    assert "\n  fused       npu-add-rms-norm 2, npu-rms-norm 5, npu-rope 2, npu-swiglu 2 (modules" in text
    assert json.loads(json.dumps(report.as_dict()))["model"]["not_fused"][0]["forward"] == TRL_HEAD
    assert diagnose(offline_hub).model is None and "\nmodel " not in format_report(diagnose(offline_hub))


def test_given_a_model_it_names_each_module_of_a_left_out_class_with_the_tables_reason(offline_hub, npu_kernels):
    """A module whose class a card's model table leaves out runs no card's layer: `left_out_modules` and the doctor
    name it, with the card and the table's reason (Gemma3's sandwich-norm decoder layers, its soft-capped logits); a
    Llama model, whose classes every card swaps, has none."""
    from kernels import Mode, kernelize

    from npu_hub_kernels import left_out_modules, swapped_modules
    from npu_hub_kernels.models import BY_KERNEL_ID

    model = kernelize(tiny_causal_lm("gemma3_text").to("npu"), mode=Mode.INFERENCE, device="npu")
    reasons = {
        (card.repo_name, path.rpartition(".")[2]): reason
        for kernel_id, card in CARDS.items()
        for path, reason in BY_KERNEL_ID[kernel_id].LEFT_OUT.items()
        if path.startswith("gemma3.modeling_gemma3.")
    }
    left_out = left_out_modules(model)
    assert {m.module_class for m in left_out} >= {"Gemma3DecoderLayer", "Gemma3ForCausalLM"}
    for m in left_out:
        assert m.reason == reasons[m.card, m.module_class], m
    modules = dict(model.named_modules())
    assert all(m.module == "<root>" or m.module in modules for m in left_out)
    swapped = {(s.module, s.card) for s in swapped_modules(model)}
    assert not swapped & {(m.module, m.card) for m in left_out}  # left out by a card: not run by it
    by_card = [m for m in left_out if m.card == "npu-add-rms-norm"]
    assert by_card and left_out_modules(model, card="npu-add-rms-norm") == by_card
    assert left_out_modules(tiny_causal_lm("llama")) == []

    report = diagnose(offline_hub, model=model)
    assert report.model.left_out == left_out
    layer = by_card[0]
    assert f"\n  left out    {layer.module} (Gemma3DecoderLayer, npu-add-rms-norm): {layer.reason}" in format_report(
        report
    )
    assert json.loads(json.dumps(report.as_dict()))["model"]["left_out"][0]["reason"] == left_out[0].reason
