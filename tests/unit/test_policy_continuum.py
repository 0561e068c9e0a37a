"""continuum: the reference semantics of vllm-continuum, rule by rule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.framework.protocols import Policy
from sidecar.framework.types import RetainAction
from sidecar.policies.registry import build_policy
from tests.unit.builders import StepBuilder, step


@pytest.fixture
def continuum() -> Policy:
    return build_policy("continuum", {})


def admitted(policy: Policy, s: StepBuilder) -> list[str]:
    return list(policy.order_waiting(s.build()).request_ids)


def victims(policy: Policy, s: StepBuilder) -> list[str]:
    return list(policy.order_victims(s.build()).request_ids)


# --- admission ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("s", "expected"),
    [
        pytest.param(
            step()
            .waiting("b1", job="b", arrive=5.0)
            .waiting("a3", job="a", arrive=9.0)
            .job("a", first_arrival=0.0)
            .job("b", first_arrival=4.0),
            ["a3", "b1"],
            id="job-level-fcfs-older-job-first-even-if-its-request-is-newer",
        ),
        pytest.param(
            step()
            .waiting("b1", job="b", arrive=1.0)
            .waiting("c1", job="c", arrive=2.0)
            .waiting("a1", job="a", arrive=3.0)
            .pin("p-c", job="c")
            .pin("p-a", job="a")
            .job("a", first_arrival=3.0)
            .job("b", first_arrival=1.0)
            .job("c", first_arrival=2.0),
            ["c1", "a1", "b1"],
            id="pinned-jobs-first-earliest-pinned-job-first",
        ),
        pytest.param(
            step()
            .waiting("a2", job="a", arrive=7.0)
            .waiting("a1", job="a", arrive=6.0)
            .waiting("b1", job="b", arrive=6.5)
            .job("a", first_arrival=0.0)
            .job("b", first_arrival=6.5),
            ["a1", "a2", "b1"],
            id="within-a-job-by-arrival",
        ),
        pytest.param(
            step()
            .waiting("b1", job="b", arrive=2.0)
            .waiting("a2", job="a", arrive=3.0)
            .running("a1", job="a", arrive=1.0),
            ["a2", "b1"],
            id="no-job-view-falls-back-to-earliest-request-of-the-job-in-the-step",
        ),
    ],
)
def test_admission_order(continuum: Policy, s: StepBuilder, expected: list[str]) -> None:
    assert admitted(continuum, s) == expected


# --- preemption --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("s", "expected"),
    [
        pytest.param(
            step()
            .running("old-job", job="a", arrive=8.0)
            .running("new-job-last", job="c", arrive=1.0, last=True)
            .running("new-job", job="b", arrive=2.0)
            .job("a", first_arrival=0.0)
            .job("b", first_arrival=5.0)
            .job("c", first_arrival=9.0),
            ["new-job", "old-job", "new-job-last"],
            id="newest-non-last-step-job-first-by-job-first-arrival",
        ),
        pytest.param(
            step()
            .running("a", job="a", arrive=1.0, last=True)
            .running("b", job="b", arrive=2.0, last=True)
            .job("a", first_arrival=1.0)
            .job("b", first_arrival=2.0),
            ["b", "a"],
            id="all-last-steps-newest-job-first",
        ),
        pytest.param(
            step()
            .running("a1", job="a", arrive=1.0)
            .running("a2", job="a", arrive=3.0)
            .job("a", first_arrival=0.0),
            ["a2", "a1"],
            id="within-a-job-newest-request-first",
        ),
    ],
)
def test_victim_order(continuum: Policy, s: StepBuilder, expected: list[str]) -> None:
    assert victims(continuum, s) == expected


# --- finish: pin, replace, release ------------------------------------------------


def test_pins_a_fast_tool_for_two_seconds(continuum: Policy) -> None:
    s = step().running("r", job="a")
    decision = continuum.on_finish(s.finish("r", tool="ls", samples_s=[0.1, 0.2, 0.15]))
    assert decision.action is RetainAction.PIN
    assert decision.ttl_s == 2.0


def test_does_not_pin_a_tool_slower_than_two_seconds_on_average(continuum: Policy) -> None:
    s = step().running("r", job="a")
    decision = continuum.on_finish(s.finish("r", tool="pytest", samples_s=[3.0, 4.0, 5.0]))
    assert decision.action is RetainAction.RELEASE


def test_pins_a_tool_seen_for_the_first_time_like_the_reference(continuum: Policy) -> None:
    s = step().running("r", job="a")
    assert continuum.on_finish(s.finish("r", tool="ls")).action is RetainAction.PIN
    strict = build_policy("continuum", {"pin_unmeasured_tools": False})
    assert strict.on_finish(s.finish("r", tool="ls")).action is RetainAction.RELEASE


def test_no_tool_call_means_no_pin(continuum: Policy) -> None:
    s = step().running("r", job="a")
    decision = continuum.on_finish(s.finish("r", tool=None))
    assert decision.action is RetainAction.RELEASE
    assert "no tool" in decision.reason


def test_last_step_releases_and_drops_the_jobs_pin(continuum: Policy) -> None:
    s = step().running("r5", job="a", last=True).pin("r4", job="a", blocks=25)
    decision = continuum.on_finish(s.finish("r5", tool="pytest", samples_s=[0.1]))
    assert decision.action is RetainAction.RELEASE
    assert decision.release_pins == ("r4",)


def test_new_finish_replaces_the_jobs_older_pin(continuum: Policy) -> None:
    s = step().running("r2", job="a").pin("r1", job="a").pin("x1", job="x")
    decision = continuum.on_finish(s.finish("r2", tool="cat", samples_s=[0.1]))
    assert decision.action is RetainAction.PIN
    assert decision.release_pins == ("r1",)  # the other job's pin stays


def test_fixed_ttl_and_threshold_are_parameters() -> None:
    policy = build_policy("continuum", {"fixed_ttl_s": 5.0, "fixed_threshold_s": 10.0})
    s = step().running("r", job="a")
    decision = policy.on_finish(s.finish("r", tool="pytest", samples_s=[3.0, 4.0]))
    assert (decision.action, decision.ttl_s) == (RetainAction.PIN, 5.0)


# --- expiry ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("s", "expected"),
    [
        pytest.param(step(now=10).pin("p", job="a", expires=9.0), ["p"], id="expired-no-waiter"),
        pytest.param(
            step(now=10).pin("p", job="a", expires=9.0).waiting("w", job="a"),
            [],
            id="expired-but-its-job-waits",
        ),
        pytest.param(
            step(now=10).pin("p", job="a", expires=9.0).running("r", job="a"),
            ["p"],
            id="expired-job-running-not-waiting",
        ),
        pytest.param(step(now=10).pin("p", job="a", expires=11.0), [], id="not-expired"),
        pytest.param(
            step(now=10).pin("p", job="a", expires=9.0).waiting("w", job="b"),
            ["p"],
            id="another-job-waiting",
        ),
    ],
)
def test_expiry(continuum: Policy, s: StepBuilder, expected: list[str]) -> None:
    assert list(continuum.expire(s.build()).request_ids) == expected


# --- steal under pressure ------------------------------------------------------------


def _pressure_step(running: int, free_blocks: int) -> StepBuilder:
    s = step(now=0.0, total_blocks=100, free_blocks=free_blocks, block_size=16)
    for i in range(running):
        s.running(f"r{i}", job=f"run{i}", arrive=float(i))
    # The head-of-line request needs 10 blocks (160 prompt tokens).
    s.waiting("w", job="w", arrive=10.0, prompt=160)
    s.pin("soon", job="x", blocks=5, expires=10.0)
    s.pin("late", job="y", blocks=5, expires=30.0)
    s.pin("middle", job="z", blocks=5, expires=20.0)
    return s


@pytest.mark.parametrize(
    ("running", "free_blocks", "expected"),
    [
        pytest.param(1, 2, ["late", "middle"], id="one-running-8-short-latest-expiry-first"),
        pytest.param(0, 7, ["late"], id="none-running-3-short"),
        pytest.param(2, 0, [], id="two-running-no-steal"),
        pytest.param(1, 10, [], id="head-fits-no-steal"),
    ],
)
def test_steals_pins_when_at_most_one_runs(
    continuum: Policy, running: int, free_blocks: int, expected: list[str]
) -> None:
    stolen = continuum.release_under_pressure(_pressure_step(running, free_blocks).build())
    assert list(stolen.request_ids) == expected


def test_steal_keeps_the_pin_the_next_request_reuses(continuum: Policy) -> None:
    s = (
        step(total_blocks=100, free_blocks=2, block_size=16)
        .running("r", job="r")
        .waiting("a2", job="a", prompt=160)  # 10 blocks, 6 of them pinned for job a
        .pin("a1", job="a", blocks=6, expires=99.0)
        .pin("b1", job="b", blocks=3, expires=50.0)
    )
    assert list(continuum.release_under_pressure(s.build()).request_ids) == ["b1"]


def test_steal_for_a_lone_runner_with_no_free_block(continuum: Policy) -> None:
    s = (
        step(free_blocks=0)
        .running("r", job="r")
        .pin("p1", job="a", expires=5.0)
        .pin("p2", job="b", expires=6.0)
    )
    assert list(continuum.release_under_pressure(s.build()).request_ids) == ["p2"]


def test_steal_uses_admission_order_for_the_head(continuum: Policy) -> None:
    # The pinned job's small request is admitted first and fits: nothing to steal,
    # although a bigger, earlier-arrived request of another job would not fit.
    s = (
        step(total_blocks=100, free_blocks=3, block_size=16)
        .waiting("big", job="b", arrive=0.0, prompt=1600)
        .waiting("small", job="a", arrive=5.0, prompt=32)
        .pin("a0", job="a", blocks=1)
    )
    assert list(continuum.release_under_pressure(s.build()).request_ids) == []


# --- cdf TTL mode --------------------------------------------------------------------


@pytest.fixture
def cdf() -> Policy:
    return build_policy("continuum", {"ttl_mode": "cdf"})


def test_cdf_pins_a_fast_tool_for_about_its_high_quantile(cdf: Policy) -> None:
    samples = [0.1 + 0.001 * i for i in range(100)]  # 0.100 .. 0.199 s
    s = step(total_blocks=1000).running("r", job="a", prompt=1000)
    decision = cdf.on_finish(s.finish("r", tool="ls", samples_s=samples, blocks=64))
    assert decision.action is RetainAction.PIN
    # The 0.99 quantile (0.198 s) within the sketch's 2 % accuracy: the cost of
    # holding 6 % of the cache for 0.2 s is far below a 0.1 s re-prefill.
    assert decision.ttl_s == pytest.approx(0.198, rel=0.021)


def test_cdf_does_not_pin_when_memory_costs_more_than_recompute(cdf: Policy) -> None:
    samples = [20.0 + 0.2 * i for i in range(100)]  # 20-40 s
    s = step(total_blocks=1000).running("r", job="a", prompt=1000)
    decision = cdf.on_finish(s.finish("r", tool="slowtool", samples_s=samples, blocks=64))
    assert decision.action is RetainAction.RELEASE
    assert "no TTL repays" in decision.reason


def test_cdf_pins_a_slow_tool_when_the_context_is_big_and_memory_cheap(cdf: Policy) -> None:
    samples = [20.0 + 0.2 * i for i in range(100)]
    s = step(total_blocks=100_000).running("r", job="a", prompt=20_000)
    decision = cdf.on_finish(s.finish("r", tool="slowtool", samples_s=samples, blocks=2))
    assert decision.action is RetainAction.PIN
    assert decision.ttl_s == 30.0  # capped at max_ttl_s


def test_cdf_uses_the_global_distribution_on_cold_start(cdf: Policy) -> None:
    s = step().running("r", job="a", prompt=1000)
    finished = s.finish(
        "r", tool="newtool", samples_s=[9.0, 9.0], global_samples_s=[0.5] * 50, blocks=4
    )
    decision = cdf.on_finish(finished)
    assert decision.action is RetainAction.PIN
    assert decision.ttl_s == pytest.approx(0.5, rel=0.021)
    assert "cold start" in decision.reason


def test_cdf_uses_the_tools_own_distribution_with_enough_samples(cdf: Policy) -> None:
    s = step().running("r", job="a", prompt=1000)
    finished = s.finish("r", tool="cat", samples_s=[0.2] * 5, global_samples_s=[0.5] * 50, blocks=4)
    assert cdf.on_finish(finished).ttl_s == pytest.approx(0.2, rel=0.021)


def test_cdf_without_any_sample_does_not_pin(cdf: Policy) -> None:
    s = step().running("r", job="a")
    assert cdf.on_finish(s.finish("r", tool="ls")).action is RetainAction.RELEASE


def test_cdf_last_step_and_no_tool_release(cdf: Policy) -> None:
    s = step().running("last", job="a", last=True).running("plain", job="b")
    assert cdf.on_finish(s.finish("last", tool="ls", samples_s=[0.1] * 9)).action is (
        RetainAction.RELEASE
    )
    assert cdf.on_finish(s.finish("plain", tool=None)).action is RetainAction.RELEASE


def test_steal_when_nothing_runs_and_a_request_still_waits(continuum: Policy) -> None:
    # By the estimate the head fits (5 blocks, 5 free), yet it is still waiting with
    # nothing running: vLLM refused it (its watermark). Without a steal the engine would
    # idle until a TTL ends, so one pin goes, latest expiry first.
    s = (
        step(total_blocks=48, free_blocks=5, block_size=16)
        .waiting("head", job="h", prompt=80)
        .pin("p-early", job="a", blocks=7, expires=5.0)
        .pin("p-late", job="b", blocks=7, expires=9.0)
    )
    # Just arrived, not yet tried: nothing to steal.
    assert list(continuum.release_under_pressure(s.build()).request_ids) == []
    stalled = s.build()
    stalled = replace(stalled, kv=replace(stalled.kv, admission_stalled=True))
    assert list(continuum.release_under_pressure(stalled).request_ids) == ["p-late"]
