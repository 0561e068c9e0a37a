"""adaptive: pins valued by tool time given elapsed time, memory pressure and recompute
cost; job-level admission with a bound on waiting."""

from __future__ import annotations

import math

import pytest

from sidecar.framework.protocols import Policy
from sidecar.framework.types import FinishInput, RetainAction, StepView
from sidecar.policies.adaptive.forecast import FcfsRecompute
from sidecar.policies.adaptive.value import memory_pressure
from sidecar.policies.registry import PolicyConfigError, build_policy
from tests.unit.builders import StepBuilder, distribution, step

FAST = [0.08, 0.1, 0.12, 0.09, 0.11, 0.1]  # ls: ~0.1 s
SLOW = [10.0, 12.0, 14.0, 11.0, 13.0, 12.5]  # a build: ~12 s
UNIFORM_1_TO_10 = [1.0 + 0.25 * i for i in range(37)]  # 1 .. 10 s, evenly


@pytest.fixture
def adaptive() -> Policy:
    return build_policy("adaptive", {})


# --- the tool-time distribution, conditioned on elapsed time ------------------------


def test_conditional_probability_rises_as_a_bounded_tool_runs() -> None:
    times = distribution("make", UNIFORM_1_TO_10)
    assert times is not None
    fresh = times.probability_within_given(0.0, 2.0)
    late = times.probability_within_given(8.0, 2.0)
    assert fresh < 0.2, "started now: rarely back within 2 s"
    assert late > 0.9, "has run 8 of at most ~10 s: almost surely back within 2 s"
    assert times.probability_within_given(0.0, 60.0) == pytest.approx(1.0)


def test_a_tool_running_past_every_sample_is_not_expected_back() -> None:
    times = distribution("make", UNIFORM_1_TO_10)
    assert times is not None
    assert times.probability_within_given(30.0, 10.0) == 0.0
    assert times.expected_remaining_s(30.0, 10.0) == 10.0


def _from_samples(elapsed_s: float, horizon_s: float) -> tuple[float, float]:
    """P(back within horizon_s | ran elapsed_s) and E[min(T - elapsed_s, horizon_s) |
    T > elapsed_s], counted on the samples themselves."""
    alive = [t for t in UNIFORM_1_TO_10 if t > elapsed_s]
    back = sum(1 for t in alive if t <= elapsed_s + horizon_s) / len(alive)
    held = sum(min(t - elapsed_s, horizon_s) for t in alive) / len(alive)
    return back, held


def test_expected_hold_matches_the_samples_and_the_mean() -> None:
    times = distribution("make", UNIFORM_1_TO_10)
    assert times is not None
    mean_s = sum(UNIFORM_1_TO_10) / len(UNIFORM_1_TO_10)
    # Unbounded horizon from the start: the mean, up to the sketch's bucket width.
    assert times.expected_remaining_s(0.0, 1000.0) == pytest.approx(mean_s, rel=0.05)
    for elapsed_s in (0.0, 2.0, 5.0, 7.0):
        for horizon_s in (0.5, 2.0, 8.0):
            _, held_s = _from_samples(elapsed_s, horizon_s)
            assert times.expected_remaining_s(elapsed_s, horizon_s) == pytest.approx(
                held_s, rel=0.05), (elapsed_s, horizon_s)
    assert times.survival(0.0) == 1.0 and times.survival(100.0) == 0.0


def test_the_outlook_of_several_horizons_matches_the_samples() -> None:
    times = distribution("make", UNIFORM_1_TO_10)
    assert times is not None
    horizons = (0.25, 1.0, 4.0, 16.0, 30.0)
    for elapsed_s in (0.0, 2.0, 5.0, 7.0):
        outlook = times.conditional_outlook(elapsed_s, horizons)
        assert len(outlook) == len(horizons)
        for horizon_s, (back, held_s) in zip(horizons, outlook, strict=True):
            expected_back, expected_held_s = _from_samples(elapsed_s, horizon_s)
            assert back == pytest.approx(expected_back, abs=0.04), (elapsed_s, horizon_s)
            assert held_s == pytest.approx(expected_held_s, rel=0.06), (elapsed_s, horizon_s)
    # Past every sample: not expected back at any horizon, held the whole horizon.
    assert times.conditional_outlook(12.0, horizons) == tuple((0.0, h) for h in horizons)


def test_an_empty_distribution_answers_nan() -> None:
    from sidecar.framework.types import ToolTimeDistribution

    empty = ToolTimeDistribution("x", 0, 0.0, 0.0, 1.02)
    assert math.isnan(empty.probability_within_given(1.0, 1.0))
    assert math.isnan(empty.expected_remaining_s(1.0, 1.0))


# --- finish: pin, soft-retain or release ---------------------------------------------


def test_idle_memory_pins_until_the_tool_is_surely_back(adaptive: Policy) -> None:
    s = step(now=10, total_blocks=1000, free_blocks=900).running("r1", job="a", prompt=800)
    fast = adaptive.on_finish(s.finish("r1", tool="ls", samples_s=FAST, blocks=50))
    assert fast.action is RetainAction.PIN
    assert fast.ttl_s == 0.25, "the shortest horizon by which every ls is back"
    slow = adaptive.on_finish(s.finish("r1", tool="make", samples_s=SLOW, blocks=50))
    assert slow.action is RetainAction.PIN, "a pin costs nothing while nobody waits"
    assert slow.ttl_s == 16.0, "the shortest horizon by which every build is back"


def _short_memory() -> StepBuilder:
    """No block free, one request running and one waiting for 100 blocks."""
    return (step(now=10, total_blocks=1000, free_blocks=0)
            .running("r1", job="a", prompt=1600)
            .waiting("w1", job="b", prompt=1600))


def test_short_memory_pins_a_fast_tool_for_a_short_horizon(adaptive: Policy) -> None:
    s = _short_memory()
    decision = adaptive.on_finish(s.finish("r1", tool="ls", samples_s=FAST, blocks=100))
    assert decision.action is RetainAction.PIN
    assert decision.ttl_s <= 1.0, "~0.1 s tool: a short pin gets nearly all the benefit"


def test_short_memory_soft_retains_a_slow_tool(adaptive: Policy) -> None:
    s = _short_memory()
    decision = adaptive.on_finish(s.finish("r1", tool="make", samples_s=SLOW, blocks=100))
    assert decision.action is RetainAction.SOFT_RETAIN
    assert decision.retention_priority is not None
    assert 35 < decision.retention_priority <= 90, "kept cached after vLLM's own blocks"


def test_last_step_is_released_and_supersedes_older_pins(adaptive: Policy) -> None:
    s = step(now=10).running("r2", job="a", last=True).pin("r1", job="a", blocks=4)
    decision = adaptive.on_finish(s.finish("r2", tool=None))
    assert decision.action is RetainAction.RELEASE
    assert decision.release_pins == ("r1",)


def _engine(engine_id: str = "engine-0", late: float | None = None) -> StepView:
    """A step of ``engine_id`` whose recent answers landed ``late`` (share 3 or more
    steps late; None: none counted yet)."""
    return step(now=10).on_engine(engine_id).late_answers(late).build()


def test_auto_holds_finished_turns_while_most_recent_finishes_are_pinned() -> None:
    """provisional_cache=auto: the engine holds a finished turn's blocks while the
    daemon decides when the policy has mostly been pinning that engine's turns, and
    caches them once most of its recent answers there were releases
    (sidecar/policies/adaptive/waiting.py)."""
    policy = build_policy("adaptive", {"provisional_cache": "auto"})
    s = _short_memory()  # engine-0
    assert policy.caches_provisional_pins(_engine()) is False, "no answer yet: held"
    for _ in range(3):
        assert policy.on_finish(s.finish("r1", tool="ls", samples_s=FAST,
                                         blocks=100)).action is RetainAction.PIN
    assert policy.caches_provisional_pins(_engine()) is False
    for released in range(1, 5):
        assert policy.on_finish(s.finish("r1", tool="make", samples_s=SLOW,
                                         blocks=100)).action is RetainAction.SOFT_RETAIN
        assert policy.caches_provisional_pins(_engine()) is (released > 3), released
    # Last turns are no pin question: they do not move the share.
    policy.on_finish(step(now=10).running("r9", job="z", last=True).finish("r9"))
    assert policy.caches_provisional_pins(_engine()) is True
    assert policy.caches_provisional_pins(_engine("engine-1")) is False, "per engine"
    fixed = build_policy("adaptive", {"provisional_cache": "true"})
    assert fixed.caches_provisional_pins(_engine()) is True
    assert build_policy("adaptive", {"provisional_cache": "false"}).caches_provisional_pins(
        _engine()) is False


def test_auto_caches_finished_turns_while_the_engines_answers_run_late() -> None:
    """provisional_cache=auto caches, whatever the pin share, while a tenth or more of
    the engine's recent answers landed 3 or more steps late: held, every finished
    turn's blocks would wait out the daemon's stalls (waiting.py)."""
    policy = build_policy("adaptive", {"provisional_cache": "auto"})
    s = _short_memory()
    for _ in range(3):
        assert policy.on_finish(s.finish("r1", tool="ls", samples_s=FAST,
                                         blocks=100)).action is RetainAction.PIN
    assert policy.caches_provisional_pins(_engine(late=0.0)) is False
    assert policy.caches_provisional_pins(_engine(late=0.09)) is False
    assert policy.caches_provisional_pins(_engine(late=0.1)) is True
    assert policy.caches_provisional_pins(_engine("engine-1", late=0.3)) is True, (
        "late before any finish: cached")
    assert policy.caches_provisional_pins(_engine(late=None)) is False
    # A mode set by hand is kept, late or not.
    held = build_policy("adaptive", {"provisional_cache": "false"})
    assert held.caches_provisional_pins(_engine(late=0.5)) is False


def _released_big_context(policy: Policy) -> None:
    """Job "big" held a pin of 10 of 24 blocks for ls, which ran past every sample:
    the pin is released (its context stays cached while the job is in its tool)."""
    s = (step(now=20.0, total_blocks=24, free_blocks=14).times("ls", FAST)
         .pin("p-big", job="big", blocks=10, pinned_at=10.0, expires=40.0, tool="ls"))
    assert policy.release_under_pressure(s.build()).request_ids == ("p-big",)


def _idle_finish(tool: str, samples_s: list[float]) -> FinishInput:
    """Nothing waits; 8 blocks free, fewer than the 10 big's cached context wants."""
    s = step(now=20.1, total_blocks=24, free_blocks=8).running("r1", job="a", prompt=700)
    return s.finish("r1", tool=tool, samples_s=samples_s, blocks=6)


def test_a_pin_that_would_push_out_a_released_context_is_priced(adaptive: Policy) -> None:
    # Nothing waits: by the waiting demand alone a pin costs nothing (the first test
    # pins a build for 16 s). But the 6 blocks it holds are room big's cached context
    # needs to stay cached: a 12 s build's pin is not worth that.
    _released_big_context(adaptive)
    slow = adaptive.on_finish(_idle_finish("make", SLOW))
    assert slow.action is RetainAction.SOFT_RETAIN
    fast = adaptive.on_finish(_idle_finish("ls", FAST))
    assert fast.action is RetainAction.PIN, "a 0.1 s tool displaces little: still pinned"

    # With no context released, the same finish is pinned: the released context is
    # what priced it.
    nothing_released = build_policy("adaptive", {})
    assert nothing_released.on_finish(_idle_finish("make", SLOW)).action is RetainAction.PIN


def test_released_contexts_price_memory_only_while_the_waiting_requests_fit() -> None:
    idle = step(now=10, total_blocks=1000, free_blocks=900).build()
    assert memory_pressure(idle, 1.0, released_blocks=800).price == 0.0, "all stay cached"
    assert memory_pressure(idle, 1.0, released_blocks=1000).price == pytest.approx(0.1)
    # 100 blocks wanted, 50 free: the waiting request evicts cached contexts whatever
    # the pins do; the price is its shortfall alone.
    short = (step(now=10, total_blocks=1000, free_blocks=50)
             .waiting("w", job="b", prompt=1600).build())
    assert memory_pressure(short, 1.0).price == pytest.approx(0.5)
    assert memory_pressure(short, 1.0, released_blocks=5000).price == pytest.approx(0.5)


def test_the_price_takes_the_plugins_demand_that_counts_shared_prefixes_once() -> None:
    # Ten turns of one script wait, 100 blocks each by their prompts, on 50 free
    # blocks. Summed, they want 1,000 blocks: memory looks 95% short.
    queue = step(now=10, total_blocks=1000, free_blocks=50)
    for i in range(10):
        queue = queue.waiting(f"w{i}", job=f"j{i}", prompt=1600)
    assert memory_pressure(queue.build(), 1.0).price == pytest.approx(0.95)
    # The plugin saw they share 90 blocks with running requests and each other: 40
    # blocks of their own fit in the 50 free; nothing is short.
    assert memory_pressure(queue.demand(40).build(), 1.0).price == 0.0
    assert memory_pressure(queue.demand(100).build(), 1.0).price == pytest.approx(0.5)


def test_a_released_context_stops_counting_once_its_job_is_back(adaptive: Policy) -> None:
    _released_big_context(adaptive)
    s = (step(now=20.1, total_blocks=24, free_blocks=8).running("r1", job="a", prompt=700)
         .waiting("big-2", job="big", prompt=100, arrive=20.05))
    # big's next turn is back (its 7 blocks fit in the 8 free): its context is no
    # longer one a pin displaces, memory is idle, and the build is pinned again.
    assert adaptive.on_finish(s.finish("r1", tool="make", samples_s=SLOW,
                                       blocks=6)).action is RetainAction.PIN


def test_released_contexts_are_forgotten_past_the_horizon_or_once_back() -> None:
    from sidecar.policies.adaptive.forecast import ReleasedContexts

    released = ReleasedContexts(horizon_s=30.0)
    released.record("e", "a", blocks=10, now_s=0.0)
    released.record("e", "b", blocks=4, now_s=5.0)
    released.record("other-engine", "c", blocks=7, now_s=5.0)
    assert released.blocks("e", 10.0, back_jobs=[], pinned_jobs=["b"]) == 10, "b is pinned"
    assert released.blocks("e", 10.0, back_jobs=[], pinned_jobs=[]) == 14
    assert released.blocks("e", 31.0, back_jobs=[], pinned_jobs=[]) == 4, "a: past 30 s"
    assert released.blocks("e", 31.0, back_jobs=["b"], pinned_jobs=[]) == 0
    # Forgotten, not skipped: released again later, each counts once.
    released.record("e", "b", blocks=6, now_s=32.0)
    assert released.blocks("e", 33.0, back_jobs=[], pinned_jobs=[]) == 6
    assert released.blocks("other-engine", 6.0, back_jobs=[], pinned_jobs=[]) == 7


# --- every step: pins re-valued ------------------------------------------------------


def test_idle_memory_keeps_a_fresh_pin(adaptive: Policy) -> None:
    s = (step(now=10.05, free_blocks=900).times("ls", FAST)
         .pin("p1", job="a", blocks=50, pinned_at=10.0, expires=40.0, tool="ls"))
    assert adaptive.release_under_pressure(s.build()).request_ids == ()


def test_a_pin_whose_tool_ran_past_every_sample_is_released_soft(adaptive: Policy) -> None:
    s = (step(now=20.0, free_blocks=900).times("ls", FAST)
         .pin("p1", job="a", blocks=50, pinned_at=10.0, expires=40.0, tool="ls"))
    # Even with memory idle: the job is off its measured schedule, and a soft release
    # keeps the blocks cached (a hit if it comes back) while freeing them for a burst.
    release = adaptive.release_under_pressure(s.build())
    assert release.request_ids == ("p1",)
    assert release.retention_priorities["p1"] == 36, "unlikely back: lowest retention"


def test_a_job_back_during_the_step_just_reported_keeps_its_pin(adaptive: Policy) -> None:
    # ls takes ~0.1 s and has run 0.3 s by now: past every sample. But the report
    # ending this step (0.25 s long) holds only what arrived before it began, and the
    # tool had run 0.05 s then: the job may be back, its next turn not shown yet.
    s = (step(now=10.3, total_blocks=1000, free_blocks=0).times("ls", FAST)
         .pin("p1", job="a", blocks=50, pinned_at=10.0, expires=40.0, tool="ls")
         .running("r", job="c", prompt=320)
         .waiting("w", job="d", arrive=9.0, prompt=3200).job("d", 9.0))
    assert adaptive.release_under_pressure(s.seen_until(10.05).build()).request_ids == ()
    # Once a report has seen past the tool's longest time, the job is late: released.
    assert adaptive.release_under_pressure(s.seen_until(10.3).build()).request_ids == ("p1",)


def test_a_pin_expires_once_its_horizon_ended_before_what_the_step_has_seen(
        adaptive: Policy) -> None:
    s = (step(now=10.3).times("ls", FAST)
         .pin("p1", job="a", blocks=50, pinned_at=10.0, expires=10.25, tool="ls"))
    # The horizon ended during the step just reported: the job may be back unseen.
    assert adaptive.expire(s.seen_until(10.05).build()).request_ids == ()
    assert adaptive.expire(s.seen_until(10.3).build()).request_ids == ("p1",)


def test_growing_shortage_releases_the_slow_tools_pin_first(adaptive: Policy) -> None:
    base = (step(now=11.0, total_blocks=1000, free_blocks=0)
            .times("ls", FAST).times("make", SLOW)
            .pin("fast", job="a", blocks=100, pinned_at=11.0, tool="ls")
            .pin("slow", job="b", blocks=100, pinned_at=10.0, tool="make")
            .running("r", job="c", prompt=320)
            .waiting("w", job="d", arrive=10.9, prompt=3200)
            .job("a", first_arrival=1.0).job("b", first_arrival=2.0).job("d", 10.9))
    assert list(adaptive.release_under_pressure(base.build()).request_ids) == ["slow"]


def test_a_pin_whose_job_already_waits_is_kept(adaptive: Policy) -> None:
    s = (step(now=20.0, free_blocks=0).times("ls", FAST)
         .pin("p1", job="a", blocks=50, pinned_at=10.0, expires=40.0, tool="ls")
         .waiting("a2", job="a", prompt=900))
    assert adaptive.release_under_pressure(s.build()).request_ids == ()


def test_an_overdue_head_request_gets_the_blocks_it_needs(adaptive: Policy) -> None:
    # Fair share: max(5 jobs x 11 ms, mean wait (9 + 6 x 0.1) / 7 s, 1 s) = 1.37 s; no
    # block free: the bound is 2 x (1 + full shortage) = 4 fair shares, 5.5 s. The new
    # job has waited 9 s and needs 10 blocks that only pins hold.
    s = (step(now=19.0, total_blocks=100, free_blocks=0).times("ls", FAST)
         .pin("p1", job="a", blocks=6, pinned_at=18.9, tool="ls")
         .pin("p2", job="b", blocks=6, pinned_at=18.9, tool="ls")
         .running("r", job="c", prompt=16)
         .waiting("new", job="d", arrive=10.0, prompt=160)
         .job("e", first_arrival=1.0))
    for i in range(6):
        s.waiting(f"e{i}", job="e", arrive=18.9, prompt=16)
    release = adaptive.release_under_pressure(s.build())
    assert sorted(release.request_ids) == ["p1", "p2"]


def test_a_request_that_does_not_fit_waits_for_running_ones_not_for_pins(
        adaptive: Policy) -> None:
    # The first request to admit (job h, holding 5 blocks) needs 5 more; none is free,
    # but a request runs and it has not waited past its fair share: the other jobs'
    # pins (fast tools, worth their memory) stay. Taking them for it turned overload
    # into thrashing in the twin.
    s = (step(now=15.0, total_blocks=40, free_blocks=0).times("ls", FAST)
         .pin("older", job="o", blocks=15, pinned_at=14.95, tool="ls")
         .pin("h1", job="h", blocks=5, pinned_at=14.8, tool="ls")
         .pin("younger", job="y", blocks=15, pinned_at=14.95, tool="ls")
         .running("r", job="c", prompt=16)
         .waiting("head", job="h", arrive=14.9, prompt=160)
         .waiting("y2", job="y", arrive=14.9, prompt=300)
         .job("o", first_arrival=1.0).job("h", first_arrival=2.0).job("y", first_arrival=9.0)
         .job("c", first_arrival=0.5))
    assert adaptive.order_waiting(s.build()).request_ids[0] == "head"
    assert adaptive.release_under_pressure(s.build()).request_ids == ()


def test_an_idle_engine_takes_another_waiting_jobs_pin_rather_than_deadlock(
        adaptive: Policy) -> None:
    # Nothing runs and nothing fits: both pinned jobs' next turns wait, each needing
    # blocks the other's pin holds. The head's job keeps its pin; the other job's goes
    # (it is about to be used, so it goes last, but waiting on each other would only
    # end at the engine's 60 s backstop).
    s = (step(now=15.0, total_blocks=24, free_blocks=0).times("ls", FAST).stalled()
         .pin("h1", job="h", blocks=12, pinned_at=14.8, tool="ls")
         .pin("y1", job="y", blocks=12, pinned_at=14.8, tool="ls")
         .waiting("head", job="h", arrive=14.9, prompt=240)
         .waiting("y2", job="y", arrive=14.9, prompt=240)
         .job("h", first_arrival=2.0).job("y", first_arrival=9.0))
    assert adaptive.order_waiting(s.build()).request_ids[0] == "head"
    assert adaptive.release_under_pressure(s.build()).request_ids == ("y1",)


# --- admission: job-level order, bounded waiting --------------------------------------


def _new_job_then_old_turn(now: float, new_waited_s: float,
                           free_blocks: int = 1000) -> StepBuilder:
    """A new job's first request, then the next turn of a job that started at 1 s."""
    return (step(now=now, free_blocks=free_blocks)
            .waiting("new", job="n", arrive=now - new_waited_s, prompt=64)
            .waiting("old2", job="o", arrive=now - 0.1, prompt=64)
            .job("n", first_arrival=now - new_waited_s)
            .job("o", first_arrival=1.0, turns=1))


def test_an_engine_keeping_up_admits_in_arrival_order(adaptive: Policy) -> None:
    # Memory idle and nobody waited 1 s: job order would protect nothing and only
    # delay the new job's first token.
    s = _new_job_then_old_turn(now=10.0, new_waited_s=0.5)
    assert list(adaptive.order_waiting(s.build()).request_ids) == ["new", "old2"]


UNDER_PRESSURE = pytest.mark.parametrize(("new_waited_s", "free_blocks"), [
    (0.5, 4),     # memory short: the waiting requests need more than 4 free blocks
    (1.5, 1000),  # a backlog: the oldest request waited past 1 s (bound: 1.75 s)
])


@UNDER_PRESSURE
def test_under_pressure_the_turn_of_an_older_job_holding_a_pin_goes_first(
        adaptive: Policy, new_waited_s: float, free_blocks: int) -> None:
    # Its context is in memory: admitted first, it uses the pin and frees it.
    s = _new_job_then_old_turn(now=10.0, new_waited_s=new_waited_s, free_blocks=free_blocks)
    ordering = adaptive.order_waiting(s.pin("old1", job="o", blocks=2).build())
    assert list(ordering.request_ids) == ["old2", "new"]
    assert "jobs holding a pin first" in ordering.reason


@UNDER_PRESSURE
def test_under_pressure_an_older_job_holding_nothing_goes_after_the_pins_before_new_jobs(
        adaptive: Policy, new_waited_s: float, free_blocks: int) -> None:
    # By job age: its context is mostly still cached (released at a retention
    # priority), and its later turns going first finish jobs sooner on a saturated
    # engine. A job holding a pin goes before it, oldest job or not.
    s = (_new_job_then_old_turn(now=10.0, new_waited_s=new_waited_s, free_blocks=free_blocks)
         .waiting("held2", job="h", arrive=10.0 - 0.05, prompt=64)
         .job("h", first_arrival=4.0, turns=1)
         .pin("held1", job="h", blocks=2))
    ordering = adaptive.order_waiting(s.build())
    assert list(ordering.request_ids) == ["held2", "old2", "new"]
    assert "then the others, by job age up to 30 s" in ordering.reason
    assert "keeping up" not in ordering.reason


@pytest.mark.parametrize(("credit_s", "order"), [
    # The new job's first turn arrived at 8.5 s, the old job's turn at 9.9 s.
    (None, ["held2", "old2", "new"]),  # the longest pin horizon, 30 s: ranks at 1 s
    (2.0, ["held2", "old2", "new"]),   # ranks at 7.9 s
    (1.0, ["held2", "new", "old2"]),   # ranks at 8.9 s
    (0.0, ["held2", "new", "old2"]),   # arrival order past the jobs holding a pin
])
def test_the_job_age_credit_is_a_parameter(credit_s: float | None, order: list[str]) -> None:
    # An operator whose engine loses more on new jobs' first turns than job order wins
    # on later ones sets how much of a job's age counts; the pins still go first.
    params = {} if credit_s is None else {"job_age_credit_s": credit_s}
    policy = build_policy("adaptive", params)
    s = (_new_job_then_old_turn(now=10.0, new_waited_s=1.5)
         .waiting("held2", job="h", arrive=10.0 - 0.05, prompt=64)
         .job("h", first_arrival=4.0, turns=1)
         .pin("held1", job="h", blocks=2))
    ordering = policy.order_waiting(s.build())
    assert list(ordering.request_ids) == order
    assert f"by job age up to {30.0 if credit_s is None else credit_s:g} s" in ordering.reason


@pytest.mark.parametrize(("prefill_per_s", "order"), [
    (1_000, ["new", "old2"]),  # 10% of its time on prompts: arrival order for it
    (5_000, ["old2", "new"]),  # 50%: saturated, credited its job's age as any other
])
def test_an_older_jobs_turn_that_does_not_fit_is_credited_only_on_an_engine_saturated_by_prefill(
        adaptive: Policy, prefill_per_s: float, order: list[str]) -> None:
    # vLLM's queue stops at the first request that does not fit. With time to spare,
    # the old job's 8-block turn at its head would hold the new job's 1-block first
    # turn behind it for nothing; a saturated engine would only share its time.
    s = (step(now=10.0, free_blocks=4)
         .waiting("new", job="n", arrive=9.5, prompt=16)
         .waiting("old2", job="o", arrive=9.9, prompt=128)
         .job("n", first_arrival=9.5).job("o", first_arrival=1.0, turns=1)
         .engine_cost(1e-4).prefill_rate(prefill_per_s))
    ordering = adaptive.order_waiting(s.build())
    assert list(ordering.request_ids) == order
    share = f"the engine prefills {prefill_per_s * 1e-4:.0%} of its time"
    assert share in ordering.reason


def test_an_older_jobs_turn_that_fits_is_credited_on_an_engine_with_time_to_spare(
        adaptive: Policy) -> None:
    s = (step(now=10.0, free_blocks=8)
         .waiting("new", job="n", arrive=9.5, prompt=16)
         .waiting("old2", job="o", arrive=9.9, prompt=128)
         .job("n", first_arrival=9.5).job("o", first_arrival=1.0, turns=1)
         .demand(12).engine_cost(1e-4).prefill_rate(1_000))
    ordering = adaptive.order_waiting(s.build())
    assert list(ordering.request_ids) == ["old2", "new"]
    assert "those that fit in the free blocks" in ordering.reason


def _queue(now: float, young: int = 4) -> StepBuilder:
    """A new job that has waited 2.5 s behind ``young`` turns of an old job that just
    arrived, one request running."""
    s = step(now=now).waiting("starved", job="n", arrive=now - 2.5).running("r", job="x")
    for i in range(young):
        s.waiting(f"old{i}", job="o", arrive=now - 0.1)
    return s.job("n", first_arrival=now - 2.5).job("o", first_arrival=1.0, turns=1)


def test_a_request_past_its_fair_share_goes_first(adaptive: Policy) -> None:
    # No admission seen yet: the fair share is the least (1 s), the bound 1.75 s < 2.5 s
    # waited.
    ordering = adaptive.order_waiting(_queue(now=20.0).build())
    assert list(ordering.request_ids) == ["starved", "old0", "old1", "old2", "old3"]
    assert "fair share" in ordering.reason


def test_a_memory_shortage_widens_the_bound(adaptive: Policy) -> None:
    # The queue of test_a_request_past_its_fair_share_goes_first, the old job holding
    # a pin, but the waiting requests need blocks and none is free: the bound doubles
    # to 3.5 s, and the new job (2.5 s waited) is not yet overdue: admitting it would
    # displace the working set of the job in flight.
    s = _queue(now=20.0).pin("old-turn", job="o", blocks=1)
    s.free_blocks = 0
    ordering = adaptive.order_waiting(s.build())
    assert list(ordering.request_ids) == ["old0", "old1", "old2", "old3", "starved"]


def test_a_bound_that_does_not_widen_holds_under_a_shortage() -> None:
    # The same shortage with overdue_widening=0: the bound stays 1.75 s, and the new
    # job's request (2.5 s waited) goes first, pins or not.
    s = _queue(now=20.0).pin("old-turn", job="o", blocks=1)
    s.free_blocks = 0
    tail_first = build_policy("adaptive", {"overdue_widening": "0"})
    ordering = tail_first.order_waiting(s.build())
    assert list(ordering.request_ids) == ["starved", "old0", "old1", "old2", "old3"]
    assert "1.75x fair share" in ordering.reason
    # Half the widening: 1.75 x (1 + 0.5) = 2.625 s, and 2.5 s waited is not past it.
    half = build_policy("adaptive", {"overdue_widening": "0.5"})
    assert list(half.order_waiting(s.build()).request_ids)[-1] == "starved"


def _admitting(policy: Policy, per_s: float, until_s: float) -> None:
    """Steps every 0.1 s for a minute up to ``until_s`` in which the engine admits
    ``per_s`` requests a second (each runs one step)."""
    admitted = 0.0
    for tick in range(600):
        now = until_s - 60.0 + 0.1 * tick
        s = step(now=now)
        admitted += per_s * 0.1
        for i in range(int(admitted)):
            s.running(f"adm{tick}-{i}", job=f"done{tick}-{i}")
        admitted -= int(admitted)
        policy.order_waiting(s.build())


def _backlog(now: float) -> StepBuilder:
    """Overloaded: 81 new jobs have waited 20..100 s behind a turn of a job in flight
    (holding a pin: its context is in memory)."""
    s = (step(now=now).running("r", job="x").waiting("cont", job="o", arrive=now - 0.1)
         .pin("kept", job="o", blocks=1))
    for i in range(20, 101):
        s.waiting(f"new{i}", job=f"n{i}", arrive=now - i).job(f"n{i}", now - i)
    return s.job("o", first_arrival=1.0, turns=3)


def test_the_fair_share_is_the_wait_arrival_order_would_give() -> None:
    # 82 requests wait. An engine admitting 10 a second would hold each ~8 s in
    # arrival order: the new job that waited 100 s is far past 2 fair shares.
    fast = build_policy("adaptive", {})
    _admitting(fast, per_s=10.0, until_s=200.0)
    ordering = fast.order_waiting(_backlog(now=200.0).build())
    assert list(ordering.request_ids[:2]) == ["new100", "new99"]
    assert "fair share" in ordering.reason
    # The same queue on an engine admitting 0.5 a second: arrival order would hold
    # each ~164 s, so 100 s is within the bound and the job in flight goes first
    # (forcing the new jobs in would evict the working sets of the jobs in flight).
    slow = build_policy("adaptive", {})
    _admitting(slow, per_s=0.5, until_s=200.0)
    ordering = slow.order_waiting(_backlog(now=200.0).build())
    assert ordering.request_ids[0] == "cont"
    assert "fair share" not in ordering.reason


def test_under_overload_a_job_holding_nothing_gains_at_most_30_s_on_new_jobs() -> None:
    # The backlog of _backlog, its job in flight holding no pin, on an engine admitting
    # 0.5 a second (nobody overdue): its turn ranks as if it had arrived 30 s before
    # it did (the longest pin horizon). New jobs that came earlier than that go first;
    # all its age would have put it before every one, held 81 first turns behind it.
    policy = build_policy("adaptive", {})
    _admitting(policy, per_s=0.5, until_s=200.0)
    s = step(now=200.0).running("r", job="x").waiting("cont", job="o", arrive=199.9)
    for i in range(20, 101):
        s.waiting(f"new{i}", job=f"n{i}", arrive=200.0 - i).job(f"n{i}", 200.0 - i)
    ordered = list(policy.order_waiting(s.job("o", first_arrival=1.0, turns=3).build())
                   .request_ids)
    place = ordered.index("cont")
    assert ordered[:place] == [f"new{i}" for i in range(100, 30, -1)]  # came by 169.9 s
    assert ordered[place + 1:] == [f"new{i}" for i in range(30, 19, -1)]


def test_a_request_arrival_order_would_have_admitted_long_ago_goes_first() -> None:
    # A new job's request arrives at 100 s; the engine goes on admitting, at 0.5 a
    # second, turns of jobs that arrived after it. Arrival order would have admitted
    # it at the first of them (~102 s): its fair share is the least, 1 s. At 200 s
    # 82 requests wait, so L / lambda alone (~164 s) would hold it 330 s more; it has
    # waited 100 s, past 2 fair shares, and goes first.
    policy = build_policy("adaptive", {})
    admitted = 0.0
    for tick in range(1001):
        now = 100.0 + 0.1 * tick
        s = step(now=now).waiting("late", job="n", arrive=100.0).job("n", first_arrival=100.0)
        admitted += 0.05
        if admitted >= 1.0:
            s.running(f"turn{tick}", job=f"o{tick}", arrive=now - 0.05)
            admitted -= 1.0
        if tick < 1000:
            policy.order_waiting(s.build())
    backlog = _backlog(now=200.0).waiting("late", job="n", arrive=100.0)
    ordering = policy.order_waiting(backlog.job("n", first_arrival=100.0).build())
    assert ordering.request_ids[0] == "late"
    assert "fair share" in ordering.reason


def test_the_arrival_order_clock_admits_in_arrival_order_what_the_engine_admitted() -> None:
    from sidecar.policies.adaptive.forecast import ArrivalOrderClock

    clock = ArrivalOrderClock()

    def seen(now: float, waiting: tuple[str, ...], running: tuple[str, ...]) -> dict[str, float]:
        s = step(now=now)
        for rid in waiting:
            s.waiting(rid, job=rid, arrive=float(rid[1:]))
        for rid in running:
            s.running(rid, job=rid, arrive=float(rid[1:]))
        view = s.build()
        return dict(clock.update("e", now, view.waiting, view.running))

    assert seen(1.0, ("a1", "b2", "c3"), ()) == {}, "nothing admitted: nobody due"
    # The engine admits c (the newest): arrival order would have admitted a.
    assert seen(4.0, ("a1", "b2"), ("c3",)) == {"a1": 4.0}
    assert seen(4.0, ("a1", "b2"), ("c3",)) == {"a1": 4.0}, "a step seen twice: the same"
    # b is aborted while waiting: it leaves the queue, and c is next in arrival order.
    assert seen(5.0, ("a1",), ("c3", "d6")) == {"a1": 4.0, "c3": 5.0}
    # c finishes; a re-admission after a preemption is not a new admission.
    assert seen(7.0, ("d6",), ("a1",)) == {"a1": 4.0, "d6": 7.0}
    assert seen(8.0, ("a1",), ("d6",)) == {"a1": 4.0, "d6": 7.0}
    assert clock.update("e", 2.0, (), ()) == {}, "a clock gone back starts afresh"


def test_the_arrival_order_clock_counts_an_admission_at_what_it_is_worth_to_fcfs() -> None:
    from sidecar.policies.adaptive.forecast import ArrivalOrderClock

    clock = ArrivalOrderClock()
    queue = ("a1", "b2", "c3", "d4")
    due: dict[str, float] = {}
    for tick, admitted in enumerate(("x5", "x6", "x7", "x8"), start=1):
        s = step(now=float(tick))
        for rid in queue:
            s.waiting(rid, job=rid, arrive=float(rid[1:]) - 10.0)
        view = s.running(admitted, job=admitted, arrive=float(tick)).build()
        # Each admission of the engine is worth half an admission of FCFS.
        due = dict(clock.update("e", float(tick), view.waiting, view.running,
                                weigh=lambda requests: 0.5))
    # Four admissions, two of arrival order: a at the second step, b at the fourth.
    assert due == {"a1": 2.0, "b2": 4.0}


def _admissions(recompute: FcfsRecompute, now: float, *, cached: int,
                first_turn_cached: int, shortage: float) -> float:
    """A second of steps (0.1 s each) in which the engine admits, each step, one
    continuing turn (2,000 prompt tokens, ``cached`` of them found cached) and, every
    other step, a job's first turn (``first_turn_cached`` found cached)."""
    factor = 1.0
    for tick in range(10):
        t = now + 0.1 * tick
        s = step(now=t).running(f"turn{t}", job=f"old{t}", prompt=2000, cached=cached)
        s.job(f"old{t}", first_arrival=0.0, turns=2)
        if tick % 2 == 0:
            s.running(f"first{t}", job=f"new{t}", prompt=2000, cached=first_turn_cached)
        view = s.build()
        factor = recompute.update("e", t, view.running, lambda r: r.job_id.startswith("new"),
                                  prefill_s_per_token=1e-4, shortage=shortage)
    return factor


def test_fcfs_admits_slower_by_what_it_would_re_compute_of_the_kept_contexts() -> None:
    from sidecar.policies.adaptive.forecast import FcfsRecompute

    def factor_after(seconds: int, **kwargs: object) -> float:
        recompute = FcfsRecompute(window_s=10.0)
        factor = 1.0
        for second in range(seconds):
            factor = _admissions(recompute, float(second), **kwargs)  # type: ignore[arg-type]
        return factor

    # Jobs share nothing (first turns find nothing cached), memory short: each
    # continuing turn's 1,800 cached tokens would be re-computed by FCFS, 0.18 s at
    # 1e-4 s a token, 10 a second: FCFS needs 1.8 s of extra work a second.
    private = factor_after(100, cached=1800, first_turn_cached=0, shortage=1.0)
    assert private == pytest.approx(1.0 / 2.8, rel=0.02)
    # Half as short: half the extra work (with memory idle FCFS keeps contexts too).
    assert factor_after(100, cached=1800, first_turn_cached=0, shortage=0.5) == (
        pytest.approx(1.0 / 1.9, rel=0.02))
    assert factor_after(100, cached=1800, first_turn_cached=0, shortage=0.0) == 1.0
    # Prompts 90% shared (first turns find 1,800 tokens cached): other jobs keep
    # what this engine found, FCFS would re-compute nothing.
    assert factor_after(100, cached=1800, first_turn_cached=1800, shortage=1.0) == (
        pytest.approx(1.0, abs=0.01))
    # Half shared and 1,800 found: 800 lost a turn, counted at the half FCFS must
    # allocate anew.
    assert factor_after(100, cached=1800, first_turn_cached=1000, shortage=1.0) == (
        pytest.approx(1.0 / 1.4, rel=0.02))


def test_fcfs_recompute_is_per_engine_and_starts_afresh_when_the_clock_goes_back() -> None:
    from sidecar.policies.adaptive.forecast import FcfsRecompute

    recompute = FcfsRecompute(window_s=10.0)
    for second in range(20):
        slowed = _admissions(recompute, float(second), cached=1800, first_turn_cached=0,
                             shortage=1.0)
    assert slowed < 0.5
    assert recompute.factor("e") == slowed and recompute.factor("other") == 1.0
    assert recompute.update("e", 1.0, (), lambda r: False, 1e-4, 1.0) == 1.0, (
        "a clock gone back (engine restarted) starts afresh")
    with pytest.raises(ValueError, match="window_s"):
        FcfsRecompute(window_s=0.0)


def _admitting_kept_contexts(policy: Policy, until_s: float, cached: int) -> None:
    """A minute of steps (0.1 s each) in which memory is short and the engine admits
    10 continuing turns a second, each finding ``cached`` of its 8,000 tokens cached
    (kept by the policy: jobs share nothing)."""
    for tick in range(600):
        now = until_s - 60.0 + 0.1 * tick
        s = step(now=now).waiting(f"w{tick}", job=f"w{tick}", arrive=now, prompt=64)
        s.free_blocks = 0
        s.running(f"adm{tick}", job=f"job{tick}", prompt=8000, cached=cached)
        policy.order_waiting(s.job(f"job{tick}", first_arrival=0.0, turns=3).build())


def test_the_fair_share_counts_what_fcfs_would_re_compute() -> None:
    def first_admitted(cached: int) -> str:
        policy = build_policy("adaptive", {})
        _admitting_kept_contexts(policy, until_s=200.0, cached=cached)
        # 41 new jobs have waited 20..60 s behind a turn of a job in flight (holding
        # a pin).
        s = (step(now=200.0).running("r", job="x").waiting("cont", job="o", arrive=199.9)
             .pin("kept", job="o", blocks=1))
        for i in range(20, 61):
            s.waiting(f"new{i}", job=f"n{i}", arrive=200.0 - i).job(f"n{i}", 200.0 - i)
        s.free_blocks = 0
        return policy.order_waiting(s.job("o", first_arrival=1.0, turns=3).build()).request_ids[0]

    # Turns that found nothing cached: FCFS would re-compute nothing more and admits
    # as fast: 42 waiting at 10 a second, ~4 s each in arrival order; 4 shares (memory
    # short) is 17 s and the oldest new job, 60 s, is forced in over the job in flight.
    assert first_admitted(cached=0) == "new60"
    # FCFS would re-compute the 7,900 cached tokens of each (0.79 s, ~8 s a second of
    # extra work): it would admit ~9x slower, hold each ~37 s, and 60 s is within
    # the bound: the job in flight goes first.
    assert first_admitted(cached=7900) == "cont"


def test_the_admission_rate_is_a_time_average_per_engine() -> None:
    from sidecar.policies.adaptive.forecast import AdmissionRate

    rate = AdmissionRate(window_s=10.0)
    assert rate.update("e", 0.0, frozenset()) == 0.0, "no past: unknown"
    running: frozenset[str] = frozenset()
    for tick in range(1, 1001):  # 2 admissions a second for 100 s (ten windows)
        if tick % 5 == 0:
            running = frozenset({f"r{tick}"})
        per_s = rate.update("e", tick * 0.1, running)
    assert per_s == pytest.approx(2.0, rel=0.05)
    assert rate.update("e", 100.0, running) == per_s, "a step seen twice adds nothing"
    assert rate.update("e", 110.0, running) == pytest.approx(per_s * math.exp(-1.0)), (
        "nothing admitted for one window: decays by e^-1")
    assert rate.update("other", 110.0, frozenset({"x"})) == 0.0, "each engine its own"
    assert rate.update("e", 5.0, running) == 0.0, "a clock gone back starts afresh"
    with pytest.raises(ValueError, match="window_s"):
        AdmissionRate(window_s=0.0)


# --- the price a pin pays: the recent average when memory flickers ---------------------


def test_the_price_forecast_is_a_time_weighted_average() -> None:
    from sidecar.policies.adaptive.forecast import PriceForecast

    forecast = PriceForecast(window_s=10.0)
    assert forecast.update("e", 0.0, 1.0) == 1.0, "short now: the current price"
    # Short for 10 s (one time constant), then idle: 1 - e^-1 of the way to 1.
    assert forecast.update("e", 10.0, 0.0) == pytest.approx(1.0 - math.exp(-1.0))
    # Idle for another 10 s: decays by e^-1.
    assert forecast.update("e", 20.0, 0.0) == pytest.approx(
        (1.0 - math.exp(-1.0)) * math.exp(-1.0))
    assert forecast.update("other", 20.0, 0.0) == 0.0, "each engine has its own"
    assert forecast.update("e", 5.0, 0.0) == 0.0, "a clock gone back starts afresh"
    assert PriceForecast(window_s=0.0).update("e", 30.0, 0.25) == 0.25


def _flickering_small_cache(adaptive: Policy, short_s: float) -> FinishInput:
    """A 24-block cache whose waiting requests found no block for ``short_s`` seconds
    until 10 s; now memory is idle and a turn of a 3 s tool finishes holding 12 blocks
    (1,536 tokens, re-computed in 43 ms at 2.8e-5 s/token)."""
    s = step(now=10.0 - short_s, total_blocks=24, free_blocks=0).waiting("w", job="b",
                                                                           prompt=1600)
    adaptive.release_under_pressure(s.build())
    s = (step(now=10.0, total_blocks=24, free_blocks=12).running("r1", job="a", prompt=1500)
         .job("a", first_arrival=1.0))
    return s.finish("r1", tool="grep", samples_s=[2.5, 3.0, 3.5, 3.0, 2.8], blocks=12)


def test_a_pin_after_a_shortage_is_valued_at_the_recent_price() -> None:
    cpu = {"prefill_s_per_token": 2.8e-5}
    flickering = build_policy("adaptive", cpu)
    decision = flickering.on_finish(_flickering_small_cache(flickering, short_s=5.0))
    assert decision.action is RetainAction.SOFT_RETAIN, (
        "half the cache for seconds, against 43 ms of prefill, while requests found "
        "no block 5 s of the last 10: the next request would wait on it")
    assert "price 0.39" in decision.reason
    # Valued at the current (idle) price alone, the same pin looks free.
    current = build_policy("adaptive", {**cpu, "price_window_s": 0.0})
    assert current.on_finish(_flickering_small_cache(current, short_s=5.0)).action is (
        RetainAction.PIN)


def _half_the_cache_at_a_recent_shortage(engine_prefill_s: float | None) -> FinishInput:
    """The flickering small cache (price 0.39 over the next seconds), on an engine
    whose step cost the daemon has (or has not yet) learned."""
    s = (step(now=10.0, total_blocks=24, free_blocks=12).running("r1", job="a", prompt=1500)
         .job("a", first_arrival=1.0))
    if engine_prefill_s is not None:
        s = s.engine_cost(engine_prefill_s)
    return s.finish("r1", tool="grep", samples_s=[2.5, 3.0, 3.5, 3.0, 2.8], blocks=12)


def test_a_context_is_valued_at_what_this_engine_takes_to_recompute_it() -> None:
    def decide(params: dict[str, float], engine_prefill_s: float | None) -> RetainAction:
        policy = build_policy("adaptive", params)
        shortage = step(now=5.0, total_blocks=24, free_blocks=0).waiting("w", job="b",
                                                                         prompt=1600)
        policy.release_under_pressure(shortage.build())
        return policy.on_finish(_half_the_cache_at_a_recent_shortage(engine_prefill_s)).action

    # A slow engine (1e-3 s a token: 1.5 s to recompute the context) learned from its
    # steps: the pin repays half the cache for a 3 s tool.
    assert decide({}, engine_prefill_s=1e-3) is RetainAction.PIN
    # Not learned yet: the default (a GPU's 1e-4 s, 0.15 s to recompute) does not.
    assert decide({}, engine_prefill_s=None) is RetainAction.SOFT_RETAIN
    # A figure the operator set wins over the learned one.
    assert decide({"prefill_s_per_token": 1e-4}, engine_prefill_s=1e-3) is (
        RetainAction.SOFT_RETAIN)


def test_a_pin_that_takes_a_sliver_of_memory_survives_a_recent_shortage(
        adaptive: Policy) -> None:
    # The same recent shortage on a 5,402-block cache with the GPU defaults: 12
    # blocks of 5,402 are worth holding for a 0.15 s re-compute.
    s = step(now=5.0, total_blocks=5402, free_blocks=0).waiting("w", job="b", prompt=1600)
    adaptive.release_under_pressure(s.build())
    s = (step(now=10.0, total_blocks=5402, free_blocks=2000)
         .running("r1", job="a", prompt=1500).job("a", first_arrival=1.0))
    decision = adaptive.on_finish(
        s.finish("r1", tool="grep", samples_s=[2.5, 3.0, 3.5, 3.0, 2.8], blocks=12))
    assert decision.action is RetainAction.PIN


# --- allocation failures: cheap pins give way, valuable ones make vLLM preempt --------


def test_only_pins_worth_less_than_the_victim_give_way(adaptive: Policy) -> None:
    s = (step(now=20.0, free_blocks=0).times("ls", FAST)
         .pin("stale", job="a", blocks=100, pinned_at=10.0, tool="ls")  # ran past all
         .pin("fresh", job="b", blocks=100, pinned_at=20.0, tool="ls")
         .running("victim", job="v", arrive=19.0, prompt=64))
    order = adaptive.order_pins_under_pressure(s.build())
    assert list(order.request_ids) == ["stale"]
    assert order.max_running is None


def test_a_pin_whose_job_is_back_gives_way_last_and_only_if_cheaper_than_the_victim(
        adaptive: Policy) -> None:
    # Job b's tool ran past every sample, but its next turn already waits: its pin is
    # about to be used, whatever the tool's distribution says.
    def pressure(victim_prompt: int) -> list[str]:
        s = (step(now=20.0, free_blocks=0).times("ls", FAST)
             .pin("back", job="b", blocks=100, pinned_at=10.0, tool="ls")
             .waiting("b-next", job="b", arrive=19.9, prompt=1700)
             .pin("in-tool", job="a", blocks=100, pinned_at=20.0, tool="ls")
             .running("victim", job="v", arrive=19.0, prompt=victim_prompt))
        return list(adaptive.order_pins_under_pressure(s.build()).request_ids)

    # A victim dearer than either context: both may go, the returned job's last.
    assert pressure(victim_prompt=64_000) == ["in-tool", "back"]
    # A victim cheaper than re-computing the returned job's context: vLLM preempts it.
    assert "back" not in pressure(victim_prompt=64)


# --- parameters ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"horizons_s": [0.0, 1.0]}, "horizons must be > 0 s"),
        ({"horizons_s": []}, "at least one horizon"),
        ({"soft_retain_lowest": 80, "soft_retain_highest": 40}, "soft_retain_lowest 80 >"),
        ({"fair_share_multiple": 0}, "fair_share_multiple"),
        ({"overdue_widening": -1}, "overdue_widening"),
        ({"admission_window_s": 0}, "admission_window_s"),
        ({"memory_pryce": 1.0}, "memory_pryce"),
        ({"provisional_cache": "sometimes"}, "provisional_cache"),
        # Removed parameters are refused by name, not silently ignored.
        ({"step_s": 0.011}, "step_s"),
        ({"share_counts_fcfs_recompute": False}, "share_counts_fcfs_recompute"),
        ({"price_counts_released_contexts": False}, "price_counts_released_contexts"),
        ({"credit_below_saturation": "none"}, "credit_below_saturation"),
    ],
)
def test_bad_parameters_are_named(params: dict[str, object], message: str) -> None:
    with pytest.raises(PolicyConfigError, match=message):
        build_policy("adaptive", params)


def test_the_wait_follows_the_recent_finishes_only() -> None:
    from sidecar.policies.adaptive.waiting import WINDOW_FINISHES, PinShare

    share = PinShare()
    for _ in range(3 * WINDOW_FINISHES):
        share.record(False)
    assert share.caches()
    for pinned in range(1, WINDOW_FINISHES // 2 + 1):
        share.record(True)
        assert share.caches() is (pinned < WINDOW_FINISHES // 2), pinned


# --- one-shot traffic (docs/decisions/022) -------------------------------------------


def test_a_request_with_no_job_is_released_and_a_jobs_turn_is_kept(adaptive: Policy) -> None:
    """Three tool gaps of about a second measured so far (the cold start): a job's turn
    is kept for its next turn, a request with no job is left to vLLM's order, where
    its cold-start P(back) would once have cached it at the top priority."""
    gaps_s = [0.9, 1.0, 1.1]
    s = (step(now=20.0, total_blocks=32, free_blocks=12, block_size=128).times("ls", gaps_s)
         .running("agent-2", job="agent", arrive=18.0, prompt=640)
         .running("once", job=None, arrive=19.0, prompt=450))
    once = adaptive.on_finish(s.finish("once", tool="ls", samples_s=gaps_s,
                                       global_samples_s=gaps_s, blocks=4))
    assert once.action is RetainAction.RELEASE and once.retention_priority is None
    assert "no job id" in once.reason
    turn = adaptive.on_finish(s.finish("agent-2", tool="ls", samples_s=gaps_s,
                                       global_samples_s=gaps_s, blocks=5))
    assert turn.action is RetainAction.PIN or (
        turn.action is RetainAction.SOFT_RETAIN and (turn.retention_priority or 0) > 35)
