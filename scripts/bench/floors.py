"""One floor per fused region kind: the region run as the fewest kernels that compute it, each reading its inputs
once and writing its outputs once.

- RMSNorm: 1 op reading x and weight, writing y. Backward: 1 op reading dy, x, weight, writing dx, dweight.
- RoPE: 1 op reading q, k, cos, sin, writing q', k'. Backward: 1 op reading dq', dk', cos, sin, writing dq, dk.
  (npu_apply_rotary_pos_emb is that op in inference; with grad, npu_rotary_mul runs once for q and once for k,
  which the RoPE targets allow: at most 2 ops each way.)
- SwiGLU MLP, with the weights as the model stores them (gate_proj and up_proj: two tensors, never one
  buffer; each parameter's gradient a tensor of its own, as DDP's buckets and FSDP2's reduce-scatter take
  them). Its matmuls stay matmuls (no torch_npu op fuses a matmul with the activation): 4 ops forward, 7
  backward, the cheaper in bytes of two ways to get gate and up (biases counted with their weights):
  - two matmuls writing h [2, T, I] (each reads x), a = swiglu(h) along axis 0 [T, I], y = a @ Wd; backward
    da = dy @ Wd, dWd = dy^T a, dh = swiglu_backward(da, h), dx = dh_gate @ Wg then + dh_up @ Wu (the
    second reads the first's result), dWg = dh_gate^T x, dWu = dh_up^T x;
  - the two weights concatenated for the call (reads and writes both), one matmul writing h [T, 2I] (reads
    x once), the same swiglu and down matmul; backward as above, but dx either as above or as one matmul
    against the weights concatenated again, whichever is cheaper.
  Two matmuls are the cheaper way unless T > 4I (forward) or 3T > 8I (forward and backward).
- MoE experts (P = tokens x top_k token copies): 6 ops: the tokens per expert (reads top_k_index, writes E
  int64 counts), permute (reads x and top_k_index, writes the P copies and their int32 order), grouped
  matmul with every expert's [Wg; Wu], swiglu, grouped matmul with Wd, unpermute (weights and sums each
  token's copies). Backward: 7 ops (unpermute, swiglu, permute, and dX and dW of each grouped matmul).
  Why the counts take an op of their own: the grouped matmuls need the tokens per expert, and no torch_npu
  routing op both returns them and has a backward. The ops that return counts (`npu_moe_init_routing_v2`,
  `npu_moe_compute_expert_tokens`, `npu_moe_re_routing`) are documented for inference and have no
  derivative, while `npu_moe_token_permute`, which has one, returns no counts; a training step computes
  them with a separate op beside it (docs/torch-npu-ops.md, "MoE routing ops and per-expert counts").
- Decoder layer: what runs outside those regions (projections, attention, residual adds), plus every
  region at its floor. "Outside" is the layer's run minus its regions' runs, the least of the eager and
  kernelized runs (an eager region may hand its gradient on in a layout that costs a copy outside it:
  eager RoPE hands dq/dk on as BNSD tensors, which the projections' backward copies).
"""

from __future__ import annotations

import torch
from torch import nn

from .accounting import tensor_bytes
from .regions import Region

Floor = tuple[tuple[int, int], tuple[int, int]]
"""((ops, bytes) forward, (ops, bytes) backward)."""


def _dense(t: torch.Tensor) -> int:
    """Bytes of a dense tensor of t's shape and dtype (an output or a gradient of t)."""
    return t.numel() * t.element_size()


def rms_norm_floor(module: nn.Module, x: torch.Tensor, *_) -> Floor:
    """One op reading x and the weight, writing y; backward one op reading dy, x, weight, writing dx, dweight."""
    x_b, w_b = tensor_bytes(x), tensor_bytes(module.weight)
    return (1, x_b + w_b + _dense(x)), (1, _dense(x) + x_b + w_b + _dense(x) + w_b)


def rope_floor(module: nn.Module, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *_) -> Floor:
    """One op rotating q and k (reads q, k, cos, sin, writes q', k'); backward likewise on the gradients."""
    angles, qk = tensor_bytes(cos) + tensor_bytes(sin), _dense(q) + _dense(k)
    return (1, tensor_bytes(q) + tensor_bytes(k) + angles + qk), (1, qk + angles + qk)


def swiglu_mlp_floor(module: nn.Module, x: torch.Tensor, *_) -> Floor:
    """Gate/up matmuls, swiglu, matmul down, the cheaper of two ways for split weights; backward 7 ops."""
    hidden, inner = module.down_proj.weight.shape
    tokens, size = x.numel() // x.shape[-1], x.element_size()
    w_d = sum(tensor_bytes(p) for p in module.down_proj.parameters())
    w_gu = sum(tensor_bytes(p) for p in module.parameters()) - w_d
    h, a, y = tokens * 2 * inner * size, tokens * inner * size, tokens * hidden * size
    x_b, dx = tensor_bytes(x), _dense(x)
    rest_fwd = (h + a) + (a + w_d + y)  # swiglu, down matmul
    rest_bwd = (y + w_d + a) + (y + a + w_d) + (a + h + h) + (h + 2 * x_b + w_gu)  # da, dWd, dh, dWg and dWu
    dx_two_matmuls = h + w_gu + 3 * dx
    two_matmuls = (2 * x_b + w_gu + h, dx_two_matmuls)
    concatenated = ((2 * w_gu) + (x_b + w_gu + h), min(dx_two_matmuls, (2 * w_gu) + (h + w_gu + dx)))
    fwd = min(two_matmuls[0], concatenated[0]) + rest_fwd
    total = min(sum(two_matmuls), sum(concatenated)) + rest_fwd + rest_bwd
    return (4, fwd), (7, total - fwd)


def experts_floor(module: nn.Module, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Floor:
    """Counts, permute, grouped matmul, swiglu, grouped matmul, unpermute; backward 7 ops (see the module doc).

    The counts op (top_k_index -> E int64 tokens per expert) is part of the floor: the grouped matmuls need the
    counts, and no torch_npu routing op both returns them and has a backward, so a training step computes them
    beside npu_moe_token_permute (docs/torch-npu-ops.md, "MoE routing ops and per-expert counts")."""
    experts, double_inner, hidden = module.gate_up_proj.shape
    copies, size = top_k_index.numel(), x.element_size()
    w_gu, w_d = tensor_bytes(module.gate_up_proj), tensor_bytes(module.down_proj)
    xp, h, a = copies * hidden * size, copies * double_inner * size, copies * double_inner // 2 * size
    order, counts = copies * 4, experts * 8  # int32 order of the copies, int64 tokens per expert
    idx, probs, y, x_b = tensor_bytes(top_k_index), tensor_bytes(top_k_weights), _dense(x), tensor_bytes(x)
    fwd = (idx + counts) + (x_b + idx + xp + order) + (xp + w_gu + counts + h) + (h + a) + (a + w_d + counts + xp)
    fwd += xp + order + probs + y
    bwd = (y + order + xp + probs + xp + probs) + (xp + w_d + counts + a) + (xp + a + counts + w_d) + (a + h + h)
    bwd += (h + w_gu + counts + xp) + (h + xp + counts + w_gu) + (xp + order + _dense(x))
    return (6, fwd), (7, bwd)


FLOORS = {"RMSNorm": rms_norm_floor, "RoPE": rope_floor, "SwiGLU MLP": swiglu_mlp_floor, "MoE experts": experts_floor}
"""The floor of each region kind from its module and call arguments (see the module doc)."""


def floor_of(region: Region, module: nn.Module, phase: str) -> tuple[int, int]:
    """(ops, bytes) of a region at its floor, for the phase."""
    fwd, bwd = FLOORS[region.kind](module, *region.args, *region.kwargs.values())
    return fwd if phase == "fwd" else (fwd[0] + bwd[0], fwd[1] + bwd[1])
