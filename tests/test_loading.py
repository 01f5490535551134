"""Loading the cards through the real `kernels` loader: variant choice, offline Hub cache, errors."""

from __future__ import annotations

import json
import platform
import re
import shutil
import subprocess
import sys

import pytest
from conftest import run_python
from hub_server import LoopbackHub, client_env
from kernels import Mode, get_kernel, get_local_kernel, kernelize
from test_mapping import expected_calls
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from npu_hub_kernels import CARDS, ORG_ENV, register_npu_kernels, registration, swapped_modules, unregister_npu_kernels
from npu_hub_kernels.cards import DEFAULT_ORG, resolve_org
from npu_hub_kernels.doctor import diagnose
from npu_hub_kernels.integrity import LOAD_ELSEWHERE, VariantFilesError, not_on_the_hub
from npu_hub_kernels.offline import default_cache_dir, seed_offline_cache
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import norm_module_count, token_ids
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm as tiny_model

ARCH_VARIANT = f"torch213-cxx11-cann91-{platform.machine()}-linux"


@pytest.mark.parametrize("card", [c.repo_name for c in CARDS.values()])
def test_every_card_loads_its_arch_variant_with_its_layers(offline_hub, card):
    module = get_kernel(f"{offline_hub}/{card}", version=1)
    assert module.VARIANT == ARCH_VARIANT
    for layer in next(c for c in CARDS.values() if c.repo_name == card).layers:
        assert isinstance(getattr(module.layers, layer), type), layer


@pytest.fixture(scope="module")
def cpu_host_variants(offline_hub) -> dict[str, str]:
    """The variant get_kernel loads for each card on a plain CPU host, or why it failed.

    One fresh interpreter loads every card in turn (each start costs seconds of importing torch); a card that fails
    is reported with its error and the next one still loads, so each card's test fails on its own.
    """
    code = f"""
import json
from kernels import get_kernel
variants = {{}}
for card in {[c.repo_name for c in CARDS.values()]!r}:
    try:
        variants[card] = get_kernel("{offline_hub}/" + card, version=1).VARIANT
    except Exception as error:
        variants[card] = f"get_kernel failed: {{type(error).__name__}}: {{error}}"
print(json.dumps(variants))
"""
    return json.loads(run_python(code).splitlines()[-1])


@pytest.mark.parametrize("card", [c.repo_name for c in CARDS.values()])
def test_every_card_loads_torch_universal_on_a_cpu_host(cpu_host_variants, card):
    assert cpu_host_variants[card] == "torch-universal"


def test_other_cann_version_falls_back_to_torch_npu(offline_hub):
    emulation.set_cann_version("8.5.0")  # torch 2.13 is only built for CANN 9.1
    try:
        card = get_kernel(f"{offline_hub}/npu-rms-norm", version=1)
    finally:
        emulation.set_cann_version(emulation.DEFAULT_CANN_VERSION)
    assert card.VARIANT == "torch-npu"


def test_missing_variant_error_names_each_variant_and_why(built_cards, tmp_path):
    partial = tmp_path / "npu-rms-norm"
    shutil.copytree(built_cards / "npu-rms-norm", partial)
    for variant in (partial / "build").iterdir():
        if "cann85" not in variant.name:
            shutil.rmtree(variant)
    with pytest.raises(FileNotFoundError) as error:
        get_local_kernel(partial)
    message = str(error.value)
    assert "Cannot find a build variant" in message
    assert "torch29-cxx11-cann85-aarch64-linux" in message and "does not match" in message

    register_npu_kernels(local_dir=tmp_path, kernels="npu_fused_rmsnorm")
    try:
        model = tiny_model("llama").to("npu")
        with pytest.raises(FileNotFoundError, match="torch29-cxx11-cann85"):
            kernelize(model, mode=Mode.INFERENCE, device="npu")
    finally:
        unregister_npu_kernels()


def test_register_from_the_offline_hub_and_kernelize(offline_hub):
    register_npu_kernels(org=offline_hub)
    try:
        model = tiny_model("qwen3").to("npu")
        kernelize(model, mode=Mode.INFERENCE, device="npu")
        with emulation.count_op_calls() as calls:
            model(token_ids().to("npu"))
    finally:
        unregister_npu_kernels()
    assert calls == expected_calls("qwen3", model) and calls["npu_rms_norm"] > 0
    assert {s.variant for s in swapped_modules(model)} == {ARCH_VARIANT}


def test_org_comes_from_argument_then_environment_then_default(monkeypatch):
    monkeypatch.delenv(ORG_ENV, raising=False)
    assert resolve_org(None) == DEFAULT_ORG
    monkeypatch.setenv(ORG_ENV, "my-org")
    assert resolve_org(None) == "my-org"
    assert resolve_org("arg-org") == "arg-org"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"org": ""}, "org='' is not a Hub organisation name"),
        ({"org": "bad org"}, "org='bad org' is not a Hub organisation name"),
        ({"org": "a/b"}, "org='a/b' is not a Hub organisation name"),
        ({"org": "../x"}, "org='../x' is not a Hub organisation name"),
        ({"org": "x" * 97}, "is not a Hub organisation name"),
        ({"version": 0}, "version=0 is not a card version: versions start at 1"),
        ({"version": -1}, "version=-1 is not a card version: versions start at 1"),
        ({"version": 1.5}, "version=1.5 is not a card version: a whole number from 1"),
        ({"version": "1"}, "version='1' is not a card version: a whole number from 1"),
        ({"version": True}, "version=True is not a card version: a whole number from 1"),
    ],
)
def test_register_refuses_a_malformed_org_or_version_at_the_call(offline_hub, kwargs, message):
    """With the doctor's rules and messages, before anything is registered or looked up."""
    with pytest.raises(ValueError, match=re.escape(message)):
        register_npu_kernels(**{"org": offline_hub, **kwargs})
    # Nothing registered: no class carries a card's layer name (kernelize is not asked, since whatever
    # transformers' own mapping holds for "npu" after another test's `use_kernels=True` is not ours to test).
    assert registration() is None
    assert _llama_classes_tagged_by_a_card() == []


def _llama_classes_tagged_by_a_card() -> list[str]:
    """The Llama norm and MLP classes that carry a card's layer name ("<card>:<layer>") for kernelize."""
    tags = [str(getattr(cls, "kernel_layer_name", "")) for cls in (LlamaRMSNorm, LlamaMLP)]
    return [tag for tag in tags if any(tag.startswith(f"{card.repo_name}:") for card in CARDS.values())]


def test_a_registration_tags_the_classes_the_refused_one_leaves_alone(offline_hub):
    """The control of the refused-register check: a registration that goes through is seen by it."""
    register_npu_kernels(org=offline_hub)
    try:
        assert registration() is not None
        assert _llama_classes_tagged_by_a_card() == ["npu-rms-norm:RMSNorm", "npu-swiglu:SwiGLUMLP"]
    finally:
        unregister_npu_kernels()
    assert _llama_classes_tagged_by_a_card() == []


def test_a_malformed_org_from_the_environment_is_refused_by_register(monkeypatch):
    monkeypatch.setenv(ORG_ENV, "my org")
    with pytest.raises(ValueError, match=re.escape(f"{ORG_ENV}='my org' is not a Hub organisation name")):
        register_npu_kernels()


def test_org_from_environment_is_used_for_loading(offline_hub, monkeypatch):
    monkeypatch.setenv(ORG_ENV, offline_hub)
    register_npu_kernels()
    try:
        model = tiny_model("llama").to("npu")
        kernelize(model, mode=Mode.INFERENCE, device="npu")
    finally:
        unregister_npu_kernels()
    assert len(swapped_modules(model, card="npu-rms-norm")) == norm_module_count(model)


def test_local_dir_without_a_build_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="make build"):
        register_npu_kernels(local_dir=tmp_path)


@pytest.mark.slow
def test_cards_not_on_the_hub_say_how_to_load_them_anyway(tmp_path):
    """The README's first sample on a host online, before anyone published the cards to the default organisation:
    kernelize meets huggingface_hub's "repository not found", which names the two fixes (built cards, one's own org);
    the doctor gives them as its hint."""
    code = (
        "from npu_hub_kernels.testing import emulation; emulation.install()\n"
        "import torch\n"
        "from kernels import Mode, kernelize\n"
        "from huggingface_hub.errors import RepositoryNotFoundError\n"
        "from transformers.models.llama.modeling_llama import LlamaRMSNorm\n"
        "from npu_hub_kernels import register_npu_kernels\n"
        "register_npu_kernels(kernels='npu_fused_rmsnorm')\n"
        "try:\n"
        "    kernelize(torch.nn.Sequential(LlamaRMSNorm(8)).to('npu'), device='npu', mode=Mode.INFERENCE)\n"
        "except RepositoryNotFoundError as error:\n"
        "    print(error)\n"
    )
    with LoopbackHub(idle_timeout=60) as hub:
        hub.add_org(DEFAULT_ORG, kernels_approved=True)  # the organisation exists; the cards are not published
        env = client_env(hub.url, tmp_path)  # a user's process: online, nothing cached
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        doctor = [sys.executable, "-m", "npu_hub_kernels", "doctor", "--json"]
        diagnosed = subprocess.run(doctor, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    printed = done.stdout
    assert f"Repository not found: kernel {DEFAULT_ORG}/npu-rms-norm" in printed  # huggingface_hub's own message
    assert f"nothing is published under {DEFAULT_ORG} yet" in printed
    assert 'register_npu_kernels(local_dir="build")' in printed and "make publish ORG=<org>" in printed
    assert not_on_the_hub(f"{DEFAULT_ORG}/npu-rms-norm") in printed
    assert "nothing is published" not in not_on_the_hub("my-org/npu-rms-norm")
    assert diagnosed.returncode == 1, diagnosed.stdout + diagnosed.stderr  # the doctor says the same, once
    report = json.loads(diagnosed.stdout)
    assert all(card["problem"].startswith("not on the Hub, or not visible") for card in report["cards"])
    assert report["hints"] == [LOAD_ELSEWHERE]


FUSED_CALL = "fused = torch_npu.npu_rms_norm(x_op, gamma, epsilon=eps)[0]"


def tampered_rms_norm_copy(built_cards, tmp_path):
    """A folder of built cards whose npu-rms-norm build for this host has one changed line in rms_norm.py."""
    copy = tmp_path / "cards"
    shutil.copytree(built_cards / "npu-rms-norm", copy / "npu-rms-norm", ignore=shutil.ignore_patterns("__pycache__"))
    source = copy / "npu-rms-norm" / "build" / ARCH_VARIANT / "npu_rms_norm" / "rms_norm.py"
    assert FUSED_CALL in source.read_text()
    source.write_text(source.read_text().replace(FUSED_CALL, FUSED_CALL + " * 1.5"))
    return copy


def kernelize_for_npu(model):
    return kernelize(model, mode=Mode.INFERENCE, device="npu")


def test_a_tampered_variant_in_a_local_folder_is_refused_naming_the_file(built_cards, tmp_path):
    register_npu_kernels(local_dir=tampered_rms_norm_copy(built_cards, tmp_path), kernels="npu_fused_rmsnorm")
    try:
        with pytest.raises(VariantFilesError) as error:
            kernelize_for_npu(tiny_model("llama").to("npu"))
    finally:
        unregister_npu_kernels()
    message = str(error.value)
    assert f"build/{ARCH_VARIANT}" in message and "changed: npu_rms_norm/rms_norm.py" in message
    assert "make build" in message
    assert error.value.changed == ["npu_rms_norm/rms_norm.py"] and error.value.missing == error.value.unexpected == []


def test_a_tampered_variant_in_the_offline_hub_cache_is_refused_as_the_doctor_says(built_cards, tmp_path, capsys):
    org = "tampered-cache-org"  # an org of its own: kernelize caches a layer per repository and version
    seed_offline_cache(tampered_rms_norm_copy(built_cards, tmp_path), org)
    register_npu_kernels(org=org, kernels="npu_fused_rmsnorm")
    try:
        with pytest.raises(VariantFilesError) as error:
            kernelize_for_npu(tiny_model("llama").to("npu"))
    finally:
        unregister_npu_kernels()
    message = str(error.value)
    assert "changed: npu_rms_norm/rms_norm.py" in message and "download" in message
    assert str(default_cache_dir()) in message

    report = diagnose(org)
    (card,) = [card for card in report.cards if card.card == "npu-rms-norm"]
    assert not report.ok and card.variant == ARCH_VARIANT
    assert error.value.summary in card.problem  # one check: the doctor's finding is the loader's refusal


def test_missing_and_extra_files_are_named(built_cards, tmp_path):
    copy = tampered_rms_norm_copy(built_cards, tmp_path)
    package = copy / "npu-rms-norm" / "build" / ARCH_VARIANT / "npu_rms_norm"
    (package / "layers.py").unlink()
    (package / "notes.txt").write_text("left behind\n")
    register_npu_kernels(local_dir=copy, kernels="npu_fused_rmsnorm")
    try:
        with pytest.raises(VariantFilesError) as error:
            kernelize_for_npu(tiny_model("llama").to("npu"))
    finally:
        unregister_npu_kernels()
    assert error.value.summary == (
        "changed: npu_rms_norm/rms_norm.py; missing: npu_rms_norm/layers.py; not in the digest: npu_rms_norm/notes.txt"
    )


def test_an_intact_copy_loads_after_a_refused_one(built_cards, tmp_path):
    copy = tampered_rms_norm_copy(built_cards, tmp_path)
    register_npu_kernels(local_dir=copy, kernels="npu_fused_rmsnorm")
    try:
        with pytest.raises(VariantFilesError):
            kernelize_for_npu(tiny_model("llama").to("npu"))
        source = copy / "npu-rms-norm" / "build" / ARCH_VARIANT / "npu_rms_norm" / "rms_norm.py"
        source.write_text(source.read_text().replace(FUSED_CALL + " * 1.5", FUSED_CALL))
        model = kernelize_for_npu(tiny_model("llama").to("npu"))
    finally:
        unregister_npu_kernels()
    assert len(swapped_modules(model, card="npu-rms-norm")) == norm_module_count(model)


@pytest.mark.parametrize("selection", [0, 1, 2.5, object(), [0], ("npu_fused_rope", None), b"npu_fused_rope"])
def test_a_kernel_selection_of_the_wrong_type_says_what_is_accepted(selection):
    with pytest.raises(TypeError) as error:
        register_npu_kernels(kernels=selection)
    message = str(error.value)
    assert message.startswith("kernels=") and '"auto"' in message and "None" in message
    assert "comma-separated" in message and "npu_fused_rmsnorm" in message
