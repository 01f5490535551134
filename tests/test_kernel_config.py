"""The cards through transformers' own `KernelConfig`, with no `register_npu_kernels` (transformers 5.22.2, kernels
0.17.2).

What docs/loading.md ("Without this package: transformers' KernelConfig") states, each statement held here, on the
emulated npu with tiny random-weight models:
- a mapping names a tag transformers gives its classes and rotary function-modules (`"RMSNorm"`, `"rotary_pos_emb"`,
  ...) and a card layer, `"<org>/<card>:<layer>"`; every module of the model carrying the tag runs the layer, whatever
  its class computes. A tag no module of the model carries is refused (the cards' own mapping names, untagged
  classes, rotary functions transformers leaves plain or never attaches). The docs' table of the tags a card layer
  computes is re-derived from transformers and the cards' model tables;
- from_pretrained drops the device key of the mapping, refuses more than one, and refuses a model on the host;
- a config holds an entry for the mode the model is in when it is applied: from_pretrained applies it in eval(), so
  after train() nothing fuses; applied after train(), it fuses in both modes. An applied config cannot be reapplied;
- `use_local_kernel=True` fails in from_pretrained and works through set_use_kernels;
- a rotary function-module is shared by every model of its family: kernelizing one fuses the others' rotary;
- offline, kernels skips the publisher check; online (a loopback Hub), a card of a publisher the Hub does not trust
  needs `trust_remote_code=True` in the mapping, or `allow_all_kernels=True` in from_pretrained.

Which modules run a card layer is read from their bound forward (`report.card_layer_of`), and the fused ops are
counted (`emulation.count_op_calls`), next to a negative control where they must not run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import imported_modeling_modules
from hub_server import LoopbackHub, client_env
from huggingface_hub import HfApi, constants
from kernels import Mode
from test_readme import markdown_tables
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, KernelConfig, PreTrainedModel

from npu_hub_kernels import _kernels_compat as compat
from npu_hub_kernels.cards import CARDS
from npu_hub_kernels.models import BY_KERNEL_ID
from npu_hub_kernels.registry import registration
from npu_hub_kernels.report import card_layer_of
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import TINY_WIDTHS, norm_module_count, tiny_causal_lm, token_ids

LOADING_DOC = Path(__file__).resolve().parent.parent / "docs" / "loading.md"
SECTION = "## Without this package: transformers' KernelConfig"


@pytest.fixture(autouse=True)
def no_registration():
    """These tests hold what a process that never called `register_npu_kernels` gets: nothing registered, the
    classes carrying transformers' own tags."""
    from transformers.models.llama import modeling_llama

    assert registration() is None
    assert modeling_llama.LlamaRMSNorm.__dict__.get("kernel_layer_name") == "RMSNorm"


def _function_modules() -> list[nn.Module]:
    """transformers' tagged function-modules (rotary functions) of the modeling files imported so far."""
    return [
        obj
        for name, module in list(sys.modules.items())
        if name.startswith("transformers.models.") and module is not None
        for obj in vars(module).values()
        if isinstance(obj, nn.Module) and "kernel_layer_name" in type(obj).__dict__
    ]


@pytest.fixture(autouse=True)
def function_modules_restored():
    """Put back the forward of every function-module as it was before the test: a function-module is a module global
    every model of its family calls, so the card forward kernelize binds there would stay for the tests that follow."""
    before = {id(fm): compat.instance_forward(fm) for fm in _function_modules()}
    yield
    for function_module in _function_modules():
        forward = before.get(id(function_module))
        if forward is not None:
            function_module.forward = forward
        elif compat.instance_forward(function_module) is not None:
            compat.release_instance_forward(function_module)


def saved(tmp_path: Path, model: PreTrainedModel) -> Path:
    path = tmp_path / "model"
    model.save_pretrained(path)
    return path


def tiny_qwen3_5_moe() -> PreTrainedModel:
    """A 2-layer Qwen3.5-MoE (full attention only), whose norms transformers tags "RMSNormZeroCentered" and whose
    routers "SoftmaxTopKRouter"; norm weights randomised around 0 (they scale by 1 + weight)."""
    config = AutoConfig.for_model(
        "qwen3_5_moe_text",
        **TINY_WIDTHS,
        num_hidden_layers=2,
        layer_types=["full_attention"] * 2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    return model.eval()


def load(path: Path, mapping: dict | None = None, **kwargs) -> PreTrainedModel:
    """`from_pretrained` on the emulated npu with `use_kernels=True` and, if given, a KernelConfig of `mapping`."""
    config = None if mapping is None else KernelConfig(mapping, **kwargs.pop("config_kwargs", {}))
    return AutoModelForCausalLM.from_pretrained(
        path, device_map="npu", use_kernels=True, kernel_config=config, **kwargs
    )


def logits(model: PreTrainedModel) -> tuple[Counter, torch.Tensor]:
    """The fused op calls of one forward (no gradient), and its logits on the host."""
    device = next(model.parameters()).device
    with emulation.count_op_calls() as calls, torch.no_grad():
        out = model(token_ids().to(device)).logits.float().cpu()
    return calls, out


def training_step(model: PreTrainedModel) -> tuple[Counter, torch.Tensor, dict[str, torch.Tensor]]:
    """The fused op calls of a forward and backward with labels, its loss and the gradients (on the host)."""
    model.zero_grad()
    ids = token_ids().to(next(model.parameters()).device)
    with emulation.count_op_calls() as calls:
        loss = model(ids, labels=ids).loss
        loss.backward()
    grads = {name: param.grad.cpu() for name, param in model.named_parameters() if param.grad is not None}
    return calls, loss.detach().cpu(), grads


def card_layers(model: nn.Module) -> Counter:
    """(class name, card layer) -> how many modules of the model run that layer's forward."""
    found = Counter()
    for module in model.modules():
        layer = card_layer_of(module)
        if layer is not None:
            found[(type(module).__name__, layer[1])] += 1
    return found


def entry_modes(config: KernelConfig) -> dict[str, set[Mode]]:
    """Tag -> the modes of the npu entry the applied config holds."""
    return {tag: set(devices["npu"]) for tag, devices in config.kernel_mapping.items()}


def norm_class(model: PreTrainedModel) -> str:
    return next(type(m).__name__ for m in model.modules() if type(m).__name__.endswith("RMSNorm"))


def rms_and_rope(org: str) -> dict[str, str]:
    return {"RMSNorm": f"{org}/npu-rms-norm:RMSNorm", "rotary_pos_emb": f"{org}/npu-rope:RotaryPosEmb"}


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_kernel_config_maps_transformers_tags_onto_card_layers(offline_hub, tmp_path, model_type, caplog):
    source = tiny_causal_lm(model_type)
    path = saved(tmp_path, source)
    plain = AutoModelForCausalLM.from_pretrained(path, device_map="npu")  # negative control: no kernels
    calls, _ = logits(plain)
    assert card_layers(plain) == {} and sum(calls.values()) == 0

    model = load(path, rms_and_rope(offline_hub))
    calls, out = logits(model)
    norms, layers = norm_module_count(model), model.config.num_hidden_layers
    assert card_layers(model) == {(norm_class(model), "RMSNorm"): norms}
    assert calls["npu_rms_norm"] == norms and calls["npu_rotary_mul"] == 2 * layers  # q and k of each layer
    torch.testing.assert_close(out, logits(source)[1], rtol=1e-5, atol=1e-5)
    # Offline, kernels does not ask the Hub whether the publisher is trusted.
    assert f"Skipping publisher trust check for '{offline_hub}/npu-rms-norm'" in caplog.text

    # The rotary function-module is a module global: the model loaded without kernels now runs the card's rotary.
    calls, _ = logits(plain)
    assert calls == {"npu_rotary_mul": 2 * layers}

    # use_kernels=True alone: kernelize loads transformers' own npu entry for "RMSNorm", liger-kernels, which,
    # offline and not cached, raises. The config's entry replaced it above.
    with pytest.raises(ValueError, match="kernels-community/liger-kernels"):
        load(path)


def test_a_local_build_loads_through_set_use_kernels_not_from_pretrained(built_cards, tmp_path):
    source = tiny_causal_lm("qwen3").train()
    path = saved(tmp_path, source)
    mapping = {
        "RMSNorm": f"{built_cards / 'npu-rms-norm'}:RMSNorm",
        "rotary_pos_emb": f"{built_cards / 'npu-rope'}:RotaryPosEmb",
    }
    # from_pretrained turns each entry into (repo, metadata) before the local branch splits it as a string.
    with pytest.raises(AttributeError, match="'tuple' object has no attribute 'split'"):
        load(path, mapping, config_kwargs={"use_local_kernel": True})

    model = AutoModelForCausalLM.from_pretrained(path, device_map="npu")
    model.train()
    model.set_use_kernels(True, KernelConfig(mapping, use_local_kernel=True))
    calls, loss, _ = training_step(model)
    norms = norm_module_count(model)
    assert card_layers(model) == {("Qwen3RMSNorm", "RMSNorm"): norms}
    assert calls["npu_rms_norm"] == norms and calls["npu_rotary_mul"] == 4
    torch.testing.assert_close(loss, training_step(source)[1], rtol=1e-5, atol=1e-5)
    model.eval()
    assert logits(model)[0]["npu_rms_norm"] == norms


def test_zero_centered_norms_and_routers_map_under_their_own_tags(offline_hub, tmp_path):
    source = tiny_qwen3_5_moe()
    path = saved(tmp_path, source)
    mapping = {
        "RMSNormZeroCentered": f"{offline_hub}/npu-rms-norm:RMSNormZeroCentered",
        "SoftmaxTopKRouter": f"{offline_hub}/npu-moe-router:RenormalisedSoftmaxTopKRouter",
    }
    model = load(path, mapping)

    calls, out = logits(model)
    norms = norm_module_count(model)
    assert card_layers(model) == {
        ("Qwen3_5MoeRMSNorm", "RMSNormZeroCentered"): norms,
        ("Qwen3_5MoeTopKRouter", "RenormalisedSoftmaxTopKRouter"): 2,  # no op: the softmax of the top-k logits
    }
    # no grad: zero-centred norms whose weight has x's dtype run as npu_gemma_rms_norm, the others as npu_rms_norm
    assert calls["npu_rms_norm"] + calls["npu_gemma_rms_norm"] == norms
    torch.testing.assert_close(out, logits(source)[1], rtol=1e-5, atol=1e-5)

    # Qwen3.5-MoE's apply_rotary_pos_emb is a plain function: no module of the model carries "rotary_pos_emb".
    with pytest.raises(ValueError, match="Layer rotary_pos_emb is not registered in the model"):
        load(path, {"rotary_pos_emb": f"{offline_hub}/npu-rope:RotaryPosEmb"})


@pytest.mark.parametrize(
    ("model_type", "tag", "layer"),
    [
        ("llama", "npu-rms-norm:RMSNorm", "npu-rms-norm:RMSNorm"),  # the cards' own names: only registration tags them
        ("llama", "SwiGLUMLP", "npu-swiglu:SwiGLUMLP"),  # in transformers' default mapping, but no class carries it
        ("gemma3_text", "RMSNormZeroCentered", "npu-rms-norm:RMSNormZeroCentered"),  # Gemma's norms carry no tag
        ("deepseek_v3", "rotary_pos_emb", "npu-rope:RotaryPosEmb"),  # tagged, but never attached to a module
    ],
)
def test_a_tag_no_module_of_the_model_carries_is_refused(offline_hub, tmp_path, model_type, tag, layer):
    path = saved(tmp_path, tiny_causal_lm(model_type))
    with pytest.raises(ValueError, match=f"Layer {tag} is not registered in the model"):
        load(path, {tag: f"{offline_hub}/{layer}"})


def test_the_tag_decides_the_layer_nothing_checks_it_against_the_class(offline_hub, tmp_path):
    """LlamaRMSNorm computes `weight * normalize(x)`; mapped onto the zero-centered layer, every norm fuses and the
    model computes something else."""
    source = tiny_causal_lm("llama")
    model = load(saved(tmp_path, source), {"RMSNorm": f"{offline_hub}/npu-rms-norm:RMSNormZeroCentered"})

    calls, out = logits(model)
    norms = norm_module_count(model)
    assert card_layers(model) == {("LlamaRMSNorm", "RMSNormZeroCentered"): norms}
    assert calls["npu_gemma_rms_norm"] == norms  # no grad: the zero-centred layer runs as one npu_gemma_rms_norm
    assert (out - logits(source)[1]).abs().max() > 0.1


def test_from_pretrained_drops_the_device_key_and_refuses_a_model_on_the_host(offline_hub, tmp_path):
    path = saved(tmp_path, tiny_causal_lm("llama"))
    repo = f"{offline_hub}/npu-rms-norm:RMSNorm"

    model = load(path, {"RMSNorm": {"cuda": repo}})  # a cuda entry, applied to the npu model
    calls, _ = logits(model)
    assert calls["npu_rms_norm"] == norm_module_count(model)

    with pytest.raises(ValueError, match="Expected exactly one kernel repo"):
        load(path, {"RMSNorm": {"npu": repo, "cuda": repo}})
    with pytest.raises(ValueError, match=r"Only devices in .* are supported, got: cpu"):
        AutoModelForCausalLM.from_pretrained(path, use_kernels=True, kernel_config=KernelConfig({"RMSNorm": repo}))


def test_a_config_applied_in_eval_holds_no_training_entry(offline_hub, tmp_path):
    source = tiny_causal_lm("qwen3")
    path = saved(tmp_path, source)
    config = KernelConfig(rms_and_rope(offline_hub))
    model = AutoModelForCausalLM.from_pretrained(path, device_map="npu", use_kernels=True, kernel_config=config)
    norms = norm_module_count(model)

    assert entry_modes(config) == {"RMSNorm": {Mode.INFERENCE}, "rotary_pos_emb": {Mode.INFERENCE}}
    assert logits(model)[0]["npu_rms_norm"] == norms

    model.train()  # transformers kernelizes again, for TRAINING: the config has no entry for it
    calls, loss, _ = training_step(model)
    assert card_layers(model) == {} and sum(calls.values()) == 0
    torch.testing.assert_close(loss, training_step(source.train())[1])

    model.eval()  # INFERENCE again: the entry is there
    assert logits(model)[0]["npu_rms_norm"] == norms

    # set_use_kernels' `mode` kernelizes for that mode, but the entry still follows model.training.
    other = AutoModelForCausalLM.from_pretrained(path, device_map="npu")
    other_config = KernelConfig(rms_and_rope(offline_hub))
    other.set_use_kernels(True, other_config, mode=Mode.TRAINING)
    assert entry_modes(other_config)["RMSNorm"] == {Mode.INFERENCE}
    assert sum(logits(other)[0].values()) == 0

    # An applied config holds kernels' mapping, which it cannot validate again: it cannot be passed twice.
    with pytest.raises(ValueError, match="must be a valid repo name"):
        model.set_use_kernels(True, config)


def test_a_config_applied_after_train_fuses_in_both_modes(offline_hub, tmp_path):
    """The working order: load, train(), then apply the config. Its TRAINING entry also serves INFERENCE."""
    source = tiny_causal_lm("qwen3").train()
    path = saved(tmp_path, source)
    model = AutoModelForCausalLM.from_pretrained(path, device_map="npu")
    model.train()
    config = KernelConfig(rms_and_rope(offline_hub))
    model.set_use_kernels(True, config)
    norms = norm_module_count(model)

    assert entry_modes(config) == {"RMSNorm": {Mode.TRAINING}, "rotary_pos_emb": {Mode.TRAINING}}
    calls, loss, grads = training_step(model)
    assert card_layers(model) == {("Qwen3RMSNorm", "RMSNorm"): norms}
    assert calls["npu_rms_norm"] == norms and calls["npu_rotary_mul"] == 4
    _, eager_loss, eager_grads = training_step(source)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-4, atol=1e-5, msg=name)

    model.eval()
    assert logits(model)[0]["npu_rms_norm"] == norms
    model.train()
    assert training_step(model)[0]["npu_rms_norm"] == norms

    # The same after from_pretrained applied a config in eval(): a new config, applied after train().
    loaded = load(path, rms_and_rope(offline_hub))
    loaded.train()
    loaded.set_use_kernels(True, KernelConfig(rms_and_rope(offline_hub)))
    assert training_step(loaded)[0]["npu_rms_norm"] == norms


def _tagged_card_layers() -> tuple[dict[tuple[str, str], set[str]], list[tuple[str, str, set[str]]]]:
    """What transformers and the cards' model tables give: (tag, card layer) -> the model types whose modeling files
    hold a class, or a rotary function-module some class attaches, that carries the tag and that the layer's table
    lists; and the (modeling file, tag, layers) whose modules of one tag would need more than one layer."""
    listed = {
        path: f"{CARDS[kernel_id].repo_name}:{layer}"
        for kernel_id, table in BY_KERNEL_ID.items()
        for layer, paths in table.SWAPPED.items()
        for path in paths
    }
    model_types: dict[tuple[str, str], set[str]] = {}
    mixed = []
    for module in imported_modeling_modules():
        model_type, file_name = module.__name__.split(".")[-2:]
        attached = {
            id(function)
            for cls in vars(module).values()
            if isinstance(cls, type)
            for function in compat.attached_at_construction(cls)
        }
        in_file: dict[str, set[str]] = {}
        for name, obj in vars(module).items():
            if isinstance(obj, type) and obj.__module__ == module.__name__:
                tag = obj.__dict__.get("kernel_layer_name")
            elif isinstance(obj, nn.Module) and id(obj) in attached:
                tag = type(obj).__dict__.get("kernel_layer_name")
            else:
                continue
            layer = listed.get(f"{model_type}.{file_name}.{name}")
            if tag is not None and layer is not None:
                in_file.setdefault(tag, set()).add(layer)
                model_types.setdefault((tag, layer), set()).add(model_type)
        mixed += [(module.__name__, tag, layers) for tag, layers in in_file.items() if len(layers) > 1]
    return model_types, mixed


@pytest.mark.slow
def test_the_docs_table_of_tags_is_what_transformers_and_the_model_tables_give():
    section = LOADING_DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    (table,) = [t for t in markdown_tables(section) if t and "transformers tag" in t[0]]
    stated = {
        (row["transformers tag"].strip('"'), row["card layer"]): {
            s.strip() for s in row["model types, for example"].split(",")
        }
        for row in table
    }
    derived, mixed = _tagged_card_layers()
    assert stated.keys() == derived.keys()
    for row, examples in stated.items():
        assert examples <= derived[row], row
    assert mixed == [], "a modeling file whose modules of one tag need different layers: the docs say there is none"


UNTRUSTED_ORG = "npu-cards-untrusted"
TRUSTED_ORG = "npu-cards-trusted"

TRUST_CASES = """
import torch
from transformers import AutoModelForCausalLM, KernelConfig
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm, token_ids


tiny_causal_lm("llama").save_pretrained("model")

def norm_calls(mapping, **kwargs):
    model = AutoModelForCausalLM.from_pretrained(
        "model", device_map="npu", use_kernels=True, kernel_config=KernelConfig(mapping), **kwargs
    )
    with emulation.count_op_calls() as calls, torch.no_grad():
        model(token_ids().to("npu"))
    return calls["npu_rms_norm"]

untrusted, trusted = "UNTRUSTED/npu-rms-norm:RMSNorm", "TRUSTED/npu-rms-norm:RMSNorm"
try:
    result["untrusted"] = norm_calls({"RMSNorm": untrusted})
except ValueError as error:
    result["untrusted"] = str(error)
result["trust_remote_code"] = norm_calls({"RMSNorm": (untrusted, {"version": 1, "trust_remote_code": True})})
result["allow_all_kernels"] = norm_calls({"RMSNorm": untrusted}, allow_all_kernels=True)
result["trusted"] = norm_calls({"RMSNorm": trusted})

def training_norm_calls(mapping):
    model = AutoModelForCausalLM.from_pretrained("model", device_map="npu")
    model.train()
    model.set_use_kernels(True, KernelConfig(mapping))
    ids = token_ids().to("npu")
    with emulation.count_op_calls() as calls:
        model(ids, labels=ids).loss.backward()
    return calls["npu_rms_norm"]

try:
    result["set_use_kernels_untrusted"] = training_norm_calls({"RMSNorm": untrusted})
except ValueError as error:
    result["set_use_kernels_untrusted"] = str(error)
result["set_use_kernels_trust_remote_code"] = training_norm_calls(
    {"RMSNorm": (untrusted, {"version": 1, "trust_remote_code": True})}
)
"""


@pytest.mark.slow
def test_online_a_publisher_the_hub_does_not_trust_needs_trust_remote_code(built_cards, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # to publish: conftest keeps this process offline
    with LoopbackHub(idle_timeout=120) as hub:
        hub.add_org(UNTRUSTED_ORG, kernels_approved=True)
        hub.add_org(TRUSTED_ORG, kernels_approved=True, trusted_kernel_publisher=True)
        token = hub.add_user("publisher", orgs=[UNTRUSTED_ORG, TRUSTED_ORG])
        api = HfApi(endpoint=hub.url, token=token)
        for org in (UNTRUSTED_ORG, TRUSTED_ORG):
            repo_id = f"{org}/npu-rms-norm"
            api.create_repo(repo_id, repo_type="kernel")
            api.create_branch(repo_id, branch="v1", repo_type="kernel")
            api.upload_folder(
                repo_id=repo_id,
                folder_path=built_cards / "npu-rms-norm",
                repo_type="kernel",
                revision="v1",
                ignore_patterns=["*__pycache__*"],
            )
        code = TRUST_CASES.replace("UNTRUSTED", UNTRUSTED_ORG).replace("TRUSTED", TRUSTED_ORG)
        prelude = "import json\nresult = {}\nfrom npu_hub_kernels.testing import emulation\nemulation.install()\n"
        process = subprocess.run(
            [sys.executable, "-c", prelude + code + "\nprint(json.dumps(result))\n"],
            env=client_env(hub.url, tmp_path),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert hub.unrouted == [] and hub.errors == []
    assert process.returncode == 0, f"user process failed:\n{process.stdout}\n{process.stderr}"
    result = json.loads(process.stdout.splitlines()[-1])
    refused = f"Kernel repository '{UNTRUSTED_ORG}/npu-rms-norm' is not from a trusted publisher"
    assert str(result.pop("untrusted")).startswith(refused)
    assert str(result.pop("set_use_kernels_untrusted")).startswith(refused)
    norms = 5  # a 2-layer Llama: two per layer and the final one
    assert result == dict.fromkeys(
        ["trust_remote_code", "allow_all_kernels", "trusted", "set_use_kernels_trust_remote_code"], norms
    )
