"""The twin's step-time model: physics of Llama-3.1-8B on an RTX 5090, and the formula."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.twin.steptime import (
    LLAMA_31_8B,
    RTX_5090,
    Efficiency,
    StepShape,
    StepTimeModel,
    shape_of,
)


def test_llama_8b_sizes() -> None:
    # 2 (K and V) * 32 layers * 8 KV heads * 128 dims * 2 bytes.
    assert LLAMA_31_8B.kv_bytes_per_token == 131_072
    # ~8.0e9 parameters, ~16 GB of bf16 weights (vLLM logs 14.99 GiB).
    assert LLAMA_31_8B.total_params == pytest.approx(8.03e9, rel=0.01)
    assert LLAMA_31_8B.weight_bytes / 2**30 == pytest.approx(14.96, abs=0.05)


def test_derived_parameters_follow_the_roofline() -> None:
    eff = Efficiency(bandwidth_efficiency=0.5, mfu=0.25, step_overhead_s=0.003,
                     per_seq_overhead_s=1e-5)
    model = StepTimeModel.derive(RTX_5090, LLAMA_31_8B, eff)
    bandwidth = RTX_5090.memory_bandwidth_bytes_per_s * 0.5
    flops = RTX_5090.dense_bf16_flops * 0.25
    assert model.fixed_s == pytest.approx(LLAMA_31_8B.weight_bytes / bandwidth + 0.003)
    assert model.prefill_s_per_token == pytest.approx(2 * LLAMA_31_8B.body_params / flops)
    assert model.decode_s_per_seq == pytest.approx(
        2 * (LLAMA_31_8B.body_params + LLAMA_31_8B.lm_head_params) / flops + 1e-5)
    assert model.kv_read_s_per_token == pytest.approx(131_072 / bandwidth)


def test_step_time_is_linear_in_each_term() -> None:
    model = StepTimeModel(fixed_s=0.01, prefill_s_per_token=1e-4, decode_s_per_seq=2e-4,
                          kv_read_s_per_token=1e-7)
    shape = StepShape(prefill_tokens=2000, decode_seqs=50, kv_tokens_read=80_000)
    assert model.step_s(shape) == pytest.approx(0.01 + 0.2 + 0.01 + 0.008)
    assert model.step_s(StepShape()) == 0.0  # nothing scheduled: no GPU time


def test_a_full_decode_step_is_about_what_an_rtx_5090_does() -> None:
    # One sequence decoding: all weights read once, ~9-11 ms on 1.79 TB/s.
    model = StepTimeModel.derive()
    assert 0.009 < model.step_s(StepShape(decode_seqs=1, kv_tokens_read=100)) < 0.013
    # A 2,048-token prefill chunk is compute bound: ~0.1-0.3 s at 210 TFLOPS.
    assert 0.1 < model.step_s(StepShape(prefill_tokens=2048, kv_tokens_read=2048)) < 0.3


@pytest.mark.parametrize("field", ["bandwidth_efficiency", "mfu"])
def test_efficiencies_are_fractions(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Efficiency(**{field: 1.5})


def test_shape_of_reads_prefill_decode_and_context_from_the_scheduler_output() -> None:
    # After schedule(), num_computed_tokens already includes the scheduled tokens.
    scheduler = SimpleNamespace(requests={
        "prefill": SimpleNamespace(num_computed_tokens=1500),  # 500 new on a 1,000 hit
        "decode-a": SimpleNamespace(num_computed_tokens=300),
        "decode-b": SimpleNamespace(num_computed_tokens=700),
    })
    output = SimpleNamespace(num_scheduled_tokens={"prefill": 500, "decode-a": 1,
                                                   "decode-b": 1})
    # Attention pairs: 500 queries over the 1,000 cached keys and each other (causal),
    # and each decode's one query over its whole context.
    assert shape_of(scheduler, output) == StepShape(
        prefill_tokens=500, decode_seqs=2, kv_tokens_read=2500,
        attention_pairs=500 * 1000 + 500 * 501 // 2 + 300 + 700)
