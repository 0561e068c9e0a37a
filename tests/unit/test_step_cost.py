"""The daemon learns an engine's step cost from the work its reports carry."""

from __future__ import annotations

import math
import random

import pytest

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.runtime.reports import InvalidReport, validate_report
from sidecar.runtime.steptime import EngineStepCosts, PrefillRate, StepCostEstimator, StepWork

# The twin's step-time model of Llama-3.1-8B on an RTX 5090 (benchmarks/twin/steptime.py).
STEP_S, PREFILL_S, DECODE_S = 0.011, 1.11e-4, 1.4e-4


def reports(rng: random.Random, count: int, prefill_s: float = PREFILL_S,
            noise: float = 0.05) -> list[StepWork]:
    """Reports of 1-6 steps each, a step decoding 0-250 requests and computing a
    prompt chunk now and then, timed with multiplicative noise."""
    out = []
    for _ in range(count):
        steps = rng.randint(1, 6)
        prefill = decode = 0
        busy_s = 0.0
        for _ in range(steps):
            p = rng.choice((0, 0, rng.randint(16, 2048)))
            d = rng.randint(0, 250)
            prefill += p
            decode += d
            busy_s += (STEP_S + prefill_s * p + DECODE_S * d) * rng.uniform(1 - noise, 1 + noise)
        out.append(StepWork(steps, busy_s, prefill, decode))
    return out


def test_it_recovers_the_step_cost_of_a_busy_engine() -> None:
    estimator = StepCostEstimator()
    for work in reports(random.Random(1), 400):
        estimator.add(work)
    cost = estimator.estimate()
    assert cost is not None
    assert cost.prefill_s_per_token == pytest.approx(PREFILL_S, rel=0.05)
    assert cost.decode_s_per_seq == pytest.approx(DECODE_S, rel=0.1)
    assert cost.step_s == pytest.approx(STEP_S, rel=0.2)
    assert cost.prefill_relative_error < 0.05


def test_no_estimate_until_enough_prompt_work_was_seen() -> None:
    estimator = StepCostEstimator()
    # Decoding only: nothing says what a prompt token costs.
    for work in reports(random.Random(2), 200):
        estimator.add(StepWork(work.steps, work.busy_s - PREFILL_S * work.prefill_tokens,
                               0, work.decode_seqs))
    assert estimator.estimate() is None
    # A few reports with prompts are not enough either.
    estimator = StepCostEstimator()
    for work in reports(random.Random(3), 5):
        estimator.add(work)
    assert estimator.estimate() is None


def test_a_noisy_engine_gets_no_estimate_rather_than_a_wrong_one() -> None:
    estimator = StepCostEstimator(max_relative_error=0.2)
    rng = random.Random(4)
    for _ in range(40):  # step times unrelated to the work
        estimator.add(StepWork(1, rng.uniform(0.001, 1.0), rng.randint(0, 2048),
                               rng.randint(0, 10)))
    assert estimator.estimate() is None


def test_a_new_model_behind_the_same_engine_id_is_learned_again() -> None:
    estimator = StepCostEstimator(window_s=60.0)
    rng = random.Random(5)
    for work in reports(rng, 2000):
        estimator.add(work)
    slow = 4 * PREFILL_S
    for work in reports(rng, 2000, prefill_s=slow):  # minutes of engine work
        estimator.add(work)
    cost = estimator.estimate()
    assert cost is not None
    assert cost.prefill_s_per_token == pytest.approx(slow, rel=0.05)


def test_a_step_cost_that_does_not_grow_with_decoding_is_learned_as_such() -> None:
    # Steps that cost the same whatever they decode: the fit finds no decode cost.
    estimator = StepCostEstimator()
    rng = random.Random(6)
    for _ in range(200):
        prefill = rng.randint(0, 4000)
        estimator.add(StepWork(1, 0.005 + 2e-5 * prefill, prefill, rng.randint(0, 50)))
    cost = estimator.estimate()
    assert cost is not None
    assert cost.decode_s_per_seq == pytest.approx(0.0, abs=1e-12)
    assert cost.prefill_s_per_token == pytest.approx(2e-5, rel=0.01)
    assert cost.step_s == pytest.approx(0.005, rel=0.01)


def test_a_decode_cost_the_data_would_make_negative_is_held_at_zero() -> None:
    """Steps that ran faster the more they decoded (another process's load easing as
    the batch grew): least squares would learn a negative cost a sequence, which would
    make a policy prefer longer batches for nothing. The fit holds it at zero and puts
    the decode work's average into the fixed step cost."""
    estimator = StepCostEstimator()
    rng = random.Random(7)
    for _ in range(400):
        prefill, decode = rng.randint(0, 4000), rng.randint(0, 50)
        estimator.add(StepWork(1, 0.005 + 2e-5 * prefill - 1e-5 * decode, prefill, decode))
    cost = estimator.estimate()
    assert cost is not None
    assert cost.decode_s_per_seq == 0.0
    assert cost.prefill_s_per_token == pytest.approx(2e-5, rel=0.02)
    assert cost.step_s == pytest.approx(0.005 - 1e-5 * 25, rel=0.05)


@pytest.mark.parametrize("busy_s", [-1.0, float("nan"), float("inf")])
def test_a_report_with_an_impossible_step_time_is_refused_by_name(busy_s: float) -> None:
    report = pb.StepReport(engine_id="e", seq=1, snapshot=True, now_s=1.0,
                           work=pb.StepWork(steps=1, busy_s=busy_s))
    with pytest.raises(InvalidReport) as refused:
        validate_report(report)
    assert refused.value.field == "work.busy_s"


def test_each_engine_has_its_own_cost_and_the_longest_silent_is_forgotten() -> None:
    costs = EngineStepCosts(max_engines=2)
    rng = random.Random(7)
    for work in reports(rng, 100):
        costs.add("gpu-a", work)
    for work in reports(rng, 100, prefill_s=3 * PREFILL_S):
        costs.add("gpu-b", work)
    known = costs.estimates()
    assert known["gpu-a"].prefill_s_per_token == pytest.approx(PREFILL_S, rel=0.05)
    assert known["gpu-b"].prefill_s_per_token == pytest.approx(3 * PREFILL_S, rel=0.05)
    costs.add("gpu-a", None)  # a report with no step: gpu-a is still around
    assert costs.add("gpu-c", None).estimate() is None  # gpu-b, silent longest, goes
    assert set(costs.estimates()) == {"gpu-a"}


def test_the_prefill_rate_is_the_prompt_tokens_of_the_last_seconds() -> None:
    rate = PrefillRate(window_s=10.0)
    rate.add(100.0, 5_000)  # the first report: where counting starts
    assert rate.per_s() is None
    # 2,000 prompt tokens a second, reported every 0.1 s: known from the first second,
    # not averaged with the time before the engine's first report.
    for i in range(1, 11):
        rate.add(100.0 + 0.1 * i, 200)
    assert rate.per_s() == pytest.approx(2_000, rel=0.01)
    for i in range(11, 601):
        rate.add(100.0 + 0.1 * i, 200)
    assert rate.per_s() == pytest.approx(2_000, rel=0.01)
    # Then only decoding for one window: the average falls to 1/e of it.
    for i in range(601, 701):
        rate.add(100.0 + 0.1 * i, 0)
    assert rate.per_s() == pytest.approx(2_000 / math.e, rel=0.01)


def test_the_prefill_rate_starts_afresh_when_the_engine_clock_goes_back() -> None:
    rate = PrefillRate(window_s=10.0)
    for i in range(100):
        rate.add(50.0 + 0.1 * i, 500)
    rate.add(1.0, 0)  # a restarted engine
    assert rate.per_s() is None
    rate.add(2.0, 300)
    assert rate.per_s() == pytest.approx(300, rel=0.01)


def test_a_prefill_rate_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window_s must be > 0"):
        PrefillRate(window_s=0.0)
