"""`python -m npu_hub_kernels selftest` on this machine's CPU emulation of torch_npu (no Ascend device here).

    python scripts/selftest_emulated.py [--tiny] [selftest options]

It installs the emulation, then runs the selftest as an Ascend host would, on the built cards of build/ (`make
build`) unless --local-dir or --org says otherwise, at the selftest's own widths unless --model says otherwise: the
emulation narrows the forms whose matmuls a CPU computes too slowly, and the report says which. `--tiny`: at the
widths of a tiny Qwen3-MoE config instead, where every card has a form to judge, in a few seconds. Results go to a
temporary results folder unless $NPU_HUB_KERNELS_SELFTEST_DIR names one, so that this machine's own cache is left
alone.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from transformers import AutoConfig

from npu_hub_kernels.__main__ import main
from npu_hub_kernels.selftest.results import DIR_ENV
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import tiny_config_values

ROOT = Path(__file__).resolve().parent.parent


def tiny_model_dir(folder: Path) -> Path:
    """A tiny Qwen3-MoE config.json (head dim 64, where the in-place RoPE op applies) in `folder`."""
    config = AutoConfig.for_model("qwen3_moe", **tiny_config_values("qwen3_moe", head_dim=64))
    config.save_pretrained(folder)
    return folder


if __name__ == "__main__":
    emulation.install()
    args = [arg for arg in sys.argv[1:] if arg != "--tiny"]
    with tempfile.TemporaryDirectory(prefix="npu-hub-kernels-selftest-") as scratch:
        os.environ.setdefault(DIR_ENV, str(Path(scratch) / "results"))
        if "--tiny" in sys.argv[1:]:
            args += ["--model", str(tiny_model_dir(Path(scratch) / "tiny-qwen3-moe"))]
        if "--local-dir" not in args and "--org" not in args:
            args += ["--local-dir", str(ROOT / "build")]
        sys.exit(main(["selftest", *args]))
