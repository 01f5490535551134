"""Tensor parallel (DTensor weights) on 2 ranks of the emulated npu: what the cards leave to eager, and why.

A fused torch_npu op has no DTensor sharding rule, so the cards take the eager path on DTensors, and DTensor shards
that math as usual. Tiny Llama with its MLPs split by torch's `parallelize_module` (gate/up column-wise, down
row-wise, the Megatron layout): logits equal the single-process eager model's, the split MLPs run eager with a
reason naming what they hold, and everything else (norms, rotary) still fuses.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from kernels import Mode

from npu_hub_kernels import apply_npu_kernels
from npu_hub_kernels.report import card_package
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm, token_ids


def tensor_parallel_rank(built_cards: str) -> dict:
    """One rank: eager logits, then the kernelized model with tensor-parallel MLPs: logits, fused calls, reasons."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("hccl")
    mesh = init_device_mesh("npu", (dist.get_world_size(),))
    ids = token_ids().to("npu")
    with torch.no_grad():
        eager = tiny_causal_lm("llama").to("npu")(ids).logits.cpu()
    model = apply_npu_kernels(tiny_causal_lm("llama").to("npu"), mode=Mode.INFERENCE, local_dir=built_cards)
    plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer.mlp, mesh, plan)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 3, mlp.gate_proj.in_features, device="npu")
    reason = card_package(mlp).swiglu_mlp_unavailable_reason(x, mlp.gate_proj, mlp.up_proj, mlp.act_fn)
    with torch.no_grad(), emulation.count_op_calls() as calls:
        logits = model(ids).logits.cpu()
    return {"eager": eager, "logits": logits, "calls": dict(calls), "reason": reason}


@pytest.mark.slow
def test_tensor_parallel_mlps_run_eager_with_the_reason_and_the_rest_fuses(built_cards):
    for rank, result in enumerate(run_distributed(tensor_parallel_rank, str(built_cards), world_size=2)):
        torch.testing.assert_close(result["logits"], result["eager"], rtol=1e-5, atol=1e-5, msg=f"rank {rank}")
        assert "DTensor" in result["reason"] or "not a plain nn.Linear" in result["reason"], result["reason"]
        assert "npu_swiglu" not in result["calls"], result["calls"]
        assert result["calls"]["npu_rms_norm"] > 0 and result["calls"]["npu_rotary_mul"] > 0, result["calls"]
