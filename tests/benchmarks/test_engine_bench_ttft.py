"""The engine benchmark's first-token waits: read from the per-request metrics vLLM
puts in each answer, summarised per round."""

from __future__ import annotations

import math

import openai.types
import pytest

from benchmarks.engine.ttft import distribution, engine_timings_s


def _answer(metrics: dict[str, float | None] | None) -> openai.types.Completion:
    payload: dict[str, object] = {
        "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny",
        "choices": [{"index": 0, "text": "", "finish_reason": "length", "logprobs": None}]}
    if metrics is not None:
        payload["metrics"] = metrics
    return openai.types.Completion.model_validate(payload)


def test_a_request_waits_from_its_queueing_to_its_first_token() -> None:
    timings = engine_timings_s(_answer({"queue_time_ms": 250.0,
                                         "time_to_first_token_ms": 40.0,
                                         "generation_time_ms": 90.0}))
    assert math.isclose(timings["queue_s"], 0.25)
    assert math.isclose(timings["ttft_s"], 0.29)
    # A server run without --enable-per-request-metrics, or one that lacks a figure.
    assert engine_timings_s(_answer(None)) == {}
    assert engine_timings_s(_answer({"queue_time_ms": 250.0,
                                      "time_to_first_token_ms": None})) == {}


def test_a_round_summary_ranks_its_requests_and_needs_every_one() -> None:
    summary = distribution([float(i) for i in range(1, 101)])  # 1..100 s
    assert summary == pytest.approx({"avg": 50.5, "p50": 50.5, "p95": 95.05, "p99": 99.01,
                                     "max": 100.0})
    assert distribution([0.5]) == {"avg": 0.5, "p50": 0.5, "p95": 0.5, "p99": 0.5,
                                    "max": 0.5}
    assert distribution([0.1, None, 0.3]) is None, "a request untimed: no tail claimed"
    assert distribution([]) is None
