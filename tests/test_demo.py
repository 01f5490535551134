"""make demo's script, so that the main job cannot rot: it must load, kernelize and report OK."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.slow
def test_demo_reports_every_model_kernelized(built_cards, tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), "--build", str(built_cards), "--org", "demo-org"],
        capture_output=True,
        text=True,
        timeout=600,
        env={
            "PATH": "/usr/bin:/bin",
            "HOME": str(tmp_path),
            "HF_HUB_CACHE": str(tmp_path / "hub"),
            "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"],  # one torch thread per process (tests/conftest.py)
        },
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "host: CPU, torch_npu emulated" in out
    assert "get_kernel('demo-org/npu-rms-norm', version=1) -> variant torch213-cxx11-cann91-" in out
    assert "llama then .train()" in out and "gemma3_text kernelize" in out
    assert "OK: every model fused" in out
    attention = [line for line in out.splitlines() if "window 4, padded" in line]
    assert len(attention) == 2 and all("npu_fusion_attention 2" in line for line in attention), attention
