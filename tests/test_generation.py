"""generate() and padded batches on every tiny family: kernelized on the npu, token for token what eager gives.

A left-padded batch (what generate() takes for prompts of different lengths) with its attention_mask, greedy
decoding with the KV cache, in float32: the kernelized model must pick the same tokens as the eager model on the
host, with logits equal within float32 rounding at every step, and every step (the prompt, then one token at a
time from the cache) must have run the fused ops a forward of test_mapping runs.
"""

from __future__ import annotations

import pytest
import torch
from kernels import Mode, kernelize
from test_mapping import expected_calls

from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import TINY_CONFIGS, tiny_causal_lm, token_ids

NEW_TOKENS = 3
PAD = 0  # the tiny configs' pad_token_id
INTERLEAVED_ROTARY = {"glm4", "cohere", "helium"}
"""Families whose RoPE runs npu_rotary_mul in 'interleave' mode, which takes no per-batch cos/sin: a left-padded
prompt has positions per row, so its RoPE runs eagerly; one token at a time, the cos/sin of each row fit a form."""


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 7 and 4 tokens, the shorter one padded on the left: (input_ids, attention_mask)."""
    ids = token_ids(batch=2, seq=7).clamp(min=PAD + 3)  # no pad, bos or eos token inside the prompts
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = PAD, 0
    return ids, mask


def greedy(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens and the logits of each step, on the host."""
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=PAD,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[:, ids.shape[1] :].cpu(), torch.stack(out.logits, dim=1).float().cpu()


def padded_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One forward of the padded batch: the logits of the real (unpadded) positions, on the host."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float().cpu()
    return logits[mask.bool()]


MOE_FAMILIES = {"qwen3_moe", "deepseek_v3", "qwen2_moe", "mixtral", "olmoe"}
"""Their test takes over 5 s on two busy cores."""


@pytest.mark.parametrize(
    "model_type", [pytest.param(t, marks=[pytest.mark.slow] * (t in MOE_FAMILIES)) for t in TINY_CONFIGS]
)
def test_left_padded_batch_and_generate_are_token_identical_to_eager(npu_kernels, model_type):
    ids, mask = left_padded_batch()
    eager = tiny_causal_lm(model_type)
    eager_tokens, eager_logits = greedy(eager, ids, mask)
    model = kernelize(tiny_causal_lm(model_type).to("npu"), mode=Mode.INFERENCE, device="npu")
    torch.testing.assert_close(padded_logits(model, ids, mask), padded_logits(eager, ids, mask), rtol=1e-5, atol=1e-5)
    with emulation.count_op_calls() as calls:
        tokens, logits = greedy(model, ids, mask)
    expected = {op: n * NEW_TOKENS for op, n in expected_calls(model_type, model).items()}  # each step fused
    if model_type in INTERLEAVED_ROTARY:
        expected["npu_rotary_mul"] -= expected["npu_rotary_mul"] // NEW_TOKENS  # not in the prompt's forward
    assert calls == expected
    assert torch.equal(tokens, eager_tokens)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)
