"""The attention card under DeepSpeed Ulysses sequence parallelism, in one process: what `apply_npu_kernels` keeps,
`set_sequence_parallel_attention` (the card's name where accelerate's constructor refuses it) and the doctor's advice.

Against the pinned accelerate 1.15, transformers 5.22.2 and DeepSpeed 0.19; the 2-process run through the Trainer is
tests/test_ulysses_sp_smoke.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from npu_hub_kernels import apply_npu_kernels, set_sequence_parallel_attention
from npu_hub_kernels.doctor import model_report
from npu_hub_kernels.sequence_parallel import sequence_parallel_mismatch
from npu_hub_kernels.testing.tiny_models import tiny_causal_lm, tiny_config_values, token_ids

accelerate = pytest.importorskip("accelerate")
from accelerate.parallelism_config import ParallelismConfig  # noqa: E402
from accelerate.utils import DeepSpeedSequenceParallelConfig  # noqa: E402

CARD = "npu_fused_attention"
LAUNCH_ENV = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2"}
"""What `accelerate launch` passes each process for DeepSpeed sequence parallelism over 2 ranks."""


def sp_config(size: int = 2) -> ParallelismConfig:
    return ParallelismConfig(sp_backend="deepspeed", sp_size=size)


def test_transformers_leaves_no_trace_of_an_explicit_sdpa():
    """Why the rule cannot honour an explicit "sdpa" as such: built with attn_implementation="sdpa" or with none, a
    model's config holds the same implementation and serializes the same (if transformers records the request one
    day, this fails and the rule should read it)."""
    config_values = tiny_config_values("llama")
    chosen = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("llama", **config_values), attn_implementation="sdpa"
    )
    default = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **config_values))
    assert chosen.config._attn_implementation == default.config._attn_implementation == "sdpa"
    assert vars(chosen.config) == vars(default.config)
    assert chosen.config.to_dict() == default.config.to_dict()


def test_apply_keeps_sdpa_another_library_installed_its_function_under(built_cards):
    """DeepSpeed's `register_with_transformers` installs its Ulysses wrapper as ALL_ATTENTION_FUNCTIONS["sdpa"]
    (deepspeed/runtime/sequence_parallel/ulysses_sp.py, 0.19.8); switching such a model to the card would bypass the
    wrapper's all-to-all. apply_npu_kernels keeps "sdpa" and says why, and the wrapper runs; the control: without
    the wrapper the card is selected."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    calls = []

    def ulysses_like_wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        calls.append(query.shape)
        return sdpa(module, query, key, value, attention_mask, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = ulysses_like_wrapper  # what DeepSpeed does, on the shared instance
    try:
        kept = apply_npu_kernels(tiny_causal_lm("llama").to("npu"), kernels=CARD, local_dir=built_cards)
        kept(token_ids().to("npu"))
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert kept.config._attn_implementation == "sdpa" and len(calls) == 2, (kept.config._attn_implementation, calls)
    control = apply_npu_kernels(tiny_causal_lm("llama").to("npu"), kernels=CARD, local_dir=built_cards)
    assert control.config._attn_implementation == CARD


def test_apply_keeps_the_attention_accelerate_launch_names(built_cards, monkeypatch):
    """`accelerate launch` naming "sdpa" for DeepSpeed sequence parallelism is a visible choice: kept (DeepSpeed
    would refuse the card); left unset, the card is selected (name it with set_sequence_parallel_attention)."""
    for name, value in {**LAUNCH_ENV, "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION": "sdpa"}.items():
        monkeypatch.setenv(name, value)
    kept = apply_npu_kernels(tiny_causal_lm("llama").to("npu"), kernels=CARD, local_dir=built_cards)
    assert kept.config._attn_implementation == "sdpa"
    monkeypatch.delenv("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION")
    chosen = apply_npu_kernels(tiny_causal_lm("llama").to("npu"), kernels=CARD, local_dir=built_cards)
    assert chosen.config._attn_implementation == CARD


def test_accelerate_refuses_the_cards_name_in_its_constructor():
    """Why the helper exists: accelerate 1.15 checks sp_attn_implementation against a fixed list at construction
    (if it accepts registered attentions one day, this fails and the docs should say so)."""
    with pytest.raises(ValueError, match="Invalid sp_attn_implementation: npu_fused_attention"):
        DeepSpeedSequenceParallelConfig(sp_attn_implementation=CARD)
    assert sp_config().sp_handler.sp_attn_implementation is None  # unset: DeepSpeed refuses the mismatch


def test_set_sequence_parallel_attention_names_the_card_where_the_run_reads_it(built_cards, tmp_path):
    """On TrainingArguments, a ParallelismConfig or its handler, the card's name by default or a model's; the same
    object back; accelerate's classes untouched."""
    from transformers import TrainingArguments

    model = apply_npu_kernels(tiny_causal_lm("llama").to("npu"), kernels=CARD, local_dir=built_cards)
    arguments = TrainingArguments(output_dir=str(tmp_path), parallelism_config=sp_config(), report_to=[])
    assert set_sequence_parallel_attention(arguments) is arguments
    assert arguments.parallelism_config.sp_handler.sp_attn_implementation == CARD
    config = sp_config()
    assert set_sequence_parallel_attention(config, model).sp_handler.sp_attn_implementation == CARD
    handler = DeepSpeedSequenceParallelConfig()
    assert set_sequence_parallel_attention(handler, "sdpa").sp_attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="Invalid sp_attn_implementation"):  # the class still checks its input
        DeepSpeedSequenceParallelConfig(sp_attn_implementation=CARD)


@pytest.mark.parametrize(
    ("target", "attention", "error", "match"),
    [
        (lambda: sp_config(1), CARD, ValueError, "configures no DeepSpeed sequence parallelism"),
        (sp_config, "eager", ValueError, 'cannot wrap attention "eager"'),
        (sp_config, "no_such_attention", ValueError, "is not registered"),
        (object, CARD, TypeError, "holds no sequence-parallel configuration"),
    ],
)
def test_set_sequence_parallel_attention_refuses_what_cannot_run(built_cards, target, attention, error, match):
    apply_npu_kernels(tiny_causal_lm("llama").to("npu"), kernels=CARD, local_dir=built_cards)  # registers the card
    with pytest.raises(error, match=match):
        set_sequence_parallel_attention(target(), attention)


def test_the_doctor_says_what_to_do_when_sp_names_another_attention(built_cards, monkeypatch):
    """SP naming "sdpa" (or nothing) for a model on the card: the doctor's warning names the helper; after it, or
    when the names agree, no warning; the same from what accelerate launch configures."""
    model = apply_npu_kernels(tiny_causal_lm("llama").to("npu"), kernels=CARD, local_dir=built_cards)
    config = sp_config()
    unset = sequence_parallel_mismatch(model, config)
    assert unset is not None and "wraps attention unset" in unset and "set_sequence_parallel_attention" in unset
    config.sp_handler.sp_attn_implementation = "sdpa"
    warnings = model_report(model, config).warnings
    assert any('wraps attention "sdpa", but the model\'s attention is "npu_fused_attention"' in w for w in warnings)
    assert any('model.set_attn_implementation("sdpa")' in w for w in warnings), warnings
    set_sequence_parallel_attention(config, model)
    assert sequence_parallel_mismatch(model, config) is None
    assert sequence_parallel_mismatch(model, sp_config(1)) is None  # no sequence parallelism
    assert sequence_parallel_mismatch(model) is None  # nothing in the environment
    for name, value in LAUNCH_ENV.items():
        monkeypatch.setenv(name, value)
    launched = sequence_parallel_mismatch(model)
    assert launched is not None and "accelerate launch" in launched and "leave it unset there" in launched


def test_the_cards_function_is_what_ulysses_would_wrap(built_cards):
    """register_with_transformers wraps ALL_ATTENTION_FUNCTIONS[name]: for the card's name, the card's registered
    function (the class-wide registration, no instance override yet), which runs the card's fused attention."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from npu_hub_kernels.attention import CardFunction
    from npu_hub_kernels.testing import emulation

    apply_npu_kernels(tiny_causal_lm("llama").to("npu"), kernels=CARD, local_dir=built_cards)
    function = ALL_ATTENTION_FUNCTIONS[CARD]
    # what DeepSpeed wraps is the shared instance's entry: the card's function (an earlier test in this process may
    # have left an instance entry of its own, which is then what would be wrapped)
    assert isinstance(function, CardFunction) and isinstance(AttentionInterface._global_mapping[CARD], CardFunction)
    q = torch.randn(1, 4, 8, 16).to("npu")
    module = torch.nn.Module()
    module.is_causal, module.training, module.num_key_value_groups = True, False, 1
    with emulation.count_op_calls() as calls:
        function(module, q, q, q, None, dropout=0.0, scaling=0.25)
    assert calls["npu_fusion_attention"] == 1, dict(calls)
