"""The main job, end to end: built cards -> offline Hub cache -> real kernels loader -> kernelized models.

    python scripts/demo.py [--org ORG] [--build build]

Runs on an Ascend host (real torch_npu) or, without one, on the CPU emulation of torch_npu. It
prints which build variant the loader picked, what was swapped in each tiny random-weight model
(and, for windowed models with a padded batch, the attention card asked for by name), how often the
fused ops ran, and the largest difference to eager transformers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Before huggingface_hub is imported: this demo reads only the local offline cache it seeds.
os.environ.setdefault("HF_HUB_CACHE", str(ROOT / ".cache" / "hub"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import argparse  # noqa: E402
import logging  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402

from npu_hub_kernels import CARDS, register_npu_kernels, swapped_modules  # noqa: E402
from npu_hub_kernels.cards import resolve_org  # noqa: E402
from npu_hub_kernels.offline import seed_offline_cache  # noqa: E402
from npu_hub_kernels.testing import emulation  # noqa: E402
from npu_hub_kernels.testing.tiny_models import TINY_CONFIGS, tiny_causal_lm, token_ids  # noqa: E402

NOTHING_TO_SWAP = {"gpt2"}
"""Shown as negative controls: GPT-2 has LayerNorm, learned positions and a GELU MLP, so no card applies."""


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.to(next(model.parameters()).device)).logits.float().cpu()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--org", default=None, help="Hub organisation for the cards (default: $NPU_HUB_KERNELS_ORG or npu-hub-kernels)"
    )
    parser.add_argument("--build", type=Path, default=ROOT / "build", help="folder of built cards (make build)")
    args = parser.parse_args()
    org = resolve_org(args.org)
    logging.getLogger("kernels").setLevel(logging.ERROR)  # "no mapping for rotary_pos_emb/SiLU": expected here
    warnings.filterwarnings("ignore")

    on_hardware = emulation.real_npu()
    if not on_hardware:
        emulation.install()
    from kernels import Mode, get_kernel, get_loaded_kernels, kernelize
    from transformers import AutoModelForCausalLM

    print(
        f"host: {'Ascend NPU' if on_hardware else 'CPU, torch_npu emulated'}, torch {torch.__version__}, "
        f"CANN {getattr(torch.version, 'cann', '?')}"
    )
    seeded = seed_offline_cache(args.build, org)
    print(f"offline Hub cache {os.environ['HF_HUB_CACHE']}: {', '.join(seeded)}")

    for card in CARDS.values():
        module = get_kernel(card.repo_id(org), version=1, trust_remote_code=True)
        loaded = next(k for k in get_loaded_kernels() if k.module is module)
        print(f"get_kernel({card.repo_id(org)!r}, version=1) -> variant {module.VARIANT} (id {loaded.metadata.id})")

    register_npu_kernels(org=org)
    ids = token_ids(seq=9)
    rows, attention_rows = [], []
    for model_type in TINY_CONFIGS:
        model = tiny_causal_lm(model_type)
        eager = logits(model, ids)
        kernelize(model.to("npu"), mode=Mode.INFERENCE, device="npu")
        with emulation.count_op_calls() as calls:
            fused = logits(model, ids)
        swaps = swapped_modules(model)
        rows.append((f"{model_type} kernelize", swaps, calls, (fused - eager).abs().max().item()))

    with tempfile.TemporaryDirectory() as saved:
        model = tiny_causal_lm("llama")
        eager = logits(model, ids)
        model.save_pretrained(saved)
        model = AutoModelForCausalLM.from_pretrained(saved, device_map="npu", use_kernels=True)
        for step in ("use_kernels=True", "then .train()", "then .eval()"):
            if step == "then .train()":
                model.train()
            elif step == "then .eval()":
                model.eval()
            with emulation.count_op_calls() as calls:
                fused = logits(model, ids)
            rows.append((f"llama {step}", swapped_modules(model), calls, (fused - eager).abs().max().item()))

    # The attention card is an attention implementation, not a layer: a model asks for it by name. Windowed and
    # hybrid models with a left-padded batch, where transformers' own npu flash path drops the window.
    padded = torch.ones(2, 24, dtype=torch.long)
    padded[0, :5] = 0
    long_ids = token_ids(2, 24)
    for model_type in ("mistral", "gemma3_text"):
        model = tiny_causal_lm(model_type, sliding_window=4).to("npu")
        outputs = {}
        for implementation in ("eager", "npu_fused_attention"):
            model.set_attn_implementation(implementation)
            with emulation.count_op_calls() as calls, torch.no_grad():
                outputs[implementation] = model(long_ids.to("npu"), attention_mask=padded.to("npu")).logits.cpu()
        kept = padded.bool()
        diff = (outputs["npu_fused_attention"] - outputs["eager"])[kept].abs().max().item()
        rows.append((f"{model_type} window 4, padded", [], calls, diff))
        attention_rows.append(f"{model_type} window 4, padded")

    print()
    header = f"{'model / path':<28} {'swapped':>7}  {'layer(s)':<52} {'fused op calls':<50} {'max |diff| vs eager':>19}"
    print(header)
    print("-" * len(header))
    for name, swaps, calls, diff in rows:
        layers = "attn_implementation=npu_fused_attention" if name in attention_rows else None
        layers = layers or ", ".join(sorted({s.layer for s in swaps})) or "-"
        counted = ", ".join(f"{op} {n}" for op, n in sorted(calls.items())) if not on_hardware else "n/a (real ops)"
        print(f"{name:<28} {len(swaps):>7}  {layers:<52} {counted:<50} {diff:>19.2e}")
    variants = sorted({s.variant for _, swaps, _, _ in rows for s in swaps})
    print(f"\nbuild variant in use: {', '.join(variants)}")
    worst = max(diff for *_, diff in rows)
    unswapped = [
        name
        for name, swaps, calls, _ in rows
        if not (calls.get("npu_fusion_attention") if name in attention_rows else swaps)
        and name.split()[0] not in NOTHING_TO_SWAP
    ]
    ok = not unswapped and worst < 1e-4
    print(f"{'OK' if ok else 'PROBLEM'}: every model fused, float32 logits within {worst:.1e} of eager")
    if unswapped:
        print(f"nothing fused in: {', '.join(unswapped)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
