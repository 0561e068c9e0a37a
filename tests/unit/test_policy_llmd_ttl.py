"""llmd-ttl: llm-d's retention heuristic (llm-d-router PR #2928) as a baseline: a job's
turn cached at priority 70 for the 0.9 quantile of a log-normal gap fit."""

from __future__ import annotations

import math

import pytest

from sidecar.framework.types import RetainAction, RetainDecision
from sidecar.policies.llmd_ttl.estimator import GapFit, LogNormalGaps, SessionClock
from sidecar.policies.llmd_ttl.policy import LlmdTtlPolicy
from sidecar.policies.registry import build_policy
from tests.unit.builders import step

Z_90 = 1.2815515655446004  # the standard normal's 0.9 quantile
SEED_Q90_S = math.exp(2.28 + 1.34 * Z_90)  # llm-d's seed: about 54.4 s


def _policy(**params: object) -> LlmdTtlPolicy:
    policy = build_policy("llmd-ttl", params)
    assert isinstance(policy, LlmdTtlPolicy)
    return policy


def _turn(policy: LlmdTtlPolicy, job: str | None, turn: int, arrive: float, finish: float,
          last: bool = False, engine: str = "engine-0") -> RetainDecision:
    """A turn of ``job`` that arrived at ``arrive`` finishing at ``finish``."""
    request_id = f"{job or 'once'}-{turn}"
    s = (step(now=finish).on_engine(engine)
         .running(request_id, job=job, arrive=arrive, last=last))
    if job is not None:
        s.job(job, first_arrival=0.0, turns=turn + 1, departed=finish)
    return policy.on_finish(s.finish(request_id, tool="ls"))


# --- the estimator ------------------------------------------------------------------


def test_quantile_is_the_closed_form() -> None:
    assert GapFit(2.28, 1.34, 0).quantile_s(0.9) == pytest.approx(SEED_Q90_S, rel=1e-12)
    assert GapFit(0.0, 0.5, 7).quantile_s(0.5) == pytest.approx(1.0)
    assert GapFit(1.0, 0.3, 7).quantile_s(0.1) == pytest.approx(math.exp(1.0 - 0.3 * Z_90))


def test_the_seed_holds_until_min_samples_then_each_gap_moves_it_by_the_ema() -> None:
    gaps = LogNormalGaps(2.28, 1.34, ema_factor=0.1, min_samples=20, window_size=200)
    for _ in range(19):
        gaps.observe(1.0)
    assert (gaps.log_mean, gaps.log_std, gaps.observed) == (2.28, 1.34, 19)
    gaps.observe(1.0)  # the 20th: window mean ln 1 = 0, std 0
    assert gaps.log_mean == pytest.approx(2.28 * 0.9)
    assert gaps.log_std == pytest.approx(1.34 * 0.9)
    gaps.observe(1.0)
    assert gaps.log_mean == pytest.approx(2.28 * 0.81)


def test_the_window_keeps_the_latest_gaps_and_the_std_has_a_floor() -> None:
    gaps = LogNormalGaps(0.0, 1.0, ema_factor=1.0, min_samples=2, window_size=3)
    for gap_s in (100.0, 100.0, 100.0, 2.0, 4.0, 8.0):
        gaps.observe(gap_s)
    logs = [math.log(2.0), math.log(4.0), math.log(8.0)]
    mean = sum(logs) / 3
    assert gaps.log_mean == pytest.approx(mean)  # ema 1: the window's own fit
    assert gaps.log_std == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in logs) / 3))
    for _ in range(3):
        gaps.observe(5.0)
    assert gaps.log_std == 0.1, "never a point mass"
    gaps.observe(0.0)
    gaps.observe(-1.0)
    assert gaps.observed == 9, "a gap of 0 s or less is ignored"


def test_a_jobs_gap_runs_from_its_last_activity_and_a_long_idle_is_a_new_session() -> None:
    clock = SessionClock(max_jobs=10, max_idle_s=3600.0)
    assert clock.observe("a", 1.0) is None, "first seen"
    clock.touch("a", 2.0)  # a turn finished
    assert clock.observe("a", 3.5) == pytest.approx(1.5)
    assert clock.observe("a", 3.6) == pytest.approx(0.1), "a second request of the job"
    assert clock.observe("a", 9000.0) is None, "idle past max_idle_s"


def test_past_max_jobs_the_idle_ones_are_swept() -> None:
    clock = SessionClock(max_jobs=2, max_idle_s=10.0)
    clock.touch("old", 0.0)
    clock.touch("recent", 95.0)
    clock.touch("new", 100.0)
    assert set(clock.last_active_s) == {"recent", "new"}


# --- the policy -----------------------------------------------------------------------


def test_a_jobs_turn_is_cached_at_70_for_the_seed_quantile() -> None:
    decision = _turn(_policy(), "agent", 1, arrive=0.0, finish=1.0)
    assert decision.action is RetainAction.SOFT_RETAIN
    assert decision.retention_priority == 70
    assert decision.ttl_s == pytest.approx(SEED_Q90_S)


def test_the_fit_learns_the_jobs_gaps() -> None:
    """Twenty-one turns a second apart (finish at t, next arrival at t + 1): twenty
    gaps of 1 s; the twentieth moves the fit by the EMA step, as llm-d's."""
    policy = _policy()
    decision = None
    for turn in range(21):
        arrive = 2.0 * turn
        decision = _turn(policy, "agent", turn, arrive=arrive, finish=arrive + 1.0)
    assert decision is not None and decision.action is RetainAction.SOFT_RETAIN
    assert decision.ttl_s == pytest.approx(math.exp(2.28 * 0.9 + 1.34 * 0.9 * Z_90))
    assert "20 gaps" in decision.reason


def test_gaps_below_min_gap_are_not_counted() -> None:
    policy = _policy(min_samples=2, window_size=2, ema_factor=1.0)
    _turn(policy, "a", 0, arrive=0.0, finish=1.0)
    _turn(policy, "a", 1, arrive=1.05, finish=2.0)  # 50 ms: timestamp noise
    _turn(policy, "a", 2, arrive=2.0 + 3.0, finish=6.0)
    assert policy.gaps("engine-0").observed == 1


def test_retention_is_clamped() -> None:
    assert _turn(_policy(initial_log_mean=10.0), "a", 1, 0.0, 1.0).ttl_s == 600.0
    assert _turn(_policy(initial_log_mean=-5.0), "a", 1, 0.0, 1.0).ttl_s == 1.0


def test_no_job_and_a_last_step_are_released() -> None:
    policy = _policy()
    once = _turn(policy, None, 0, arrive=0.0, finish=1.0)
    assert once.action is RetainAction.RELEASE and once.retention_priority is None
    last = _turn(policy, "a", 3, arrive=0.0, finish=1.0, last=True)
    assert last.action is RetainAction.RELEASE and last.retention_priority is None


def test_vllms_own_order_and_no_pins() -> None:
    policy, fcfs = _policy(), build_policy("fcfs", {})
    view = (step(now=10.0, free_blocks=0)
            .waiting("w-new", job="b", arrive=9.0).waiting("w-old", job="a", arrive=2.0)
            .running("r-1", job="c", arrive=1.0).running("r-2", job="d", arrive=5.0)
            .pin("p", job="e", blocks=3, expires=9.0)).build()
    assert policy.order_waiting(view) == fcfs.order_waiting(view)
    assert policy.order_victims(view) == fcfs.order_victims(view)
    assert policy.caches_provisional_pins(view) is True, "the engine never holds a turn"


def test_each_engine_learns_its_own_and_forgets_it() -> None:
    policy = _policy(min_samples=2, window_size=2)
    for turn in range(3):
        _turn(policy, "a", turn, arrive=2.0 * turn, finish=2.0 * turn + 1.0, engine="pod-a")
    _turn(policy, "b", 0, arrive=0.0, finish=1.0, engine="pod-b")
    assert policy.gaps("pod-a").observed == 2 and policy.gaps("pod-b").observed == 0
    policy.forget_engine("pod-a")
    assert policy.engines_known() == {"pod-b"}
