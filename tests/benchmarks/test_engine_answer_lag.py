"""How late the daemon's answers landed on a real engine, as ``benchmarks.engine``
records it, and the twin's CPU setup taking that lag from a run (``--like``): its
median, or each answer's drawn from the run's histogram (``--answer-lag-drawn``)."""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.common.engine_runs import late_answer_share, median_answer_lag_steps
from benchmarks.twin.cpu import CpuSetup, answer_lag_lines
from benchmarks.twin.lag import DrawnLag, fit, replay
from benchmarks.twin.simulator import _answer_every_report

# Real engine runs on older CPUs, kept as test data: they record what the twin replays.
ENGINE_RUNS = Path(__file__).resolve().parent / "data" / "engine_runs"
REAL_RUN = ENGINE_RUNS / "d077e0a-epyc-noavx512-rounds12.json"


@pytest.mark.parametrize(("by_lag", "median"), [
    ({"0": 0, "1": 10, "2": 3}, 1),
    ({"0": 1, "1": 4, "2": 5, "3": 2}, 2),  # 12 answers: the 6th lands 2 steps late
    ({"1": 1, "7": 9}, 7),  # the last bucket: 7 steps or more
    ({"1": 0.5, "2": 0.25, "3": 0.25}, 1),  # means over rounds are fractional
])
def test_the_median_lag_is_the_step_half_the_answers_had_landed_by(
        by_lag: dict[str, float], median: int) -> None:
    assert median_answer_lag_steps({"answers_by_lag_steps": by_lag}) == median


def test_a_run_that_did_not_record_the_lag_has_none() -> None:
    assert median_answer_lag_steps({}) is None
    assert median_answer_lag_steps({"answers_by_lag_steps": None}) is None
    assert median_answer_lag_steps({"answers_by_lag_steps": {"1": 0}}) is None


def test_the_late_share_is_what_adaptive_caches_by() -> None:
    # 3 or more steps after the report, as the daemon counts it (sidecar/telemetry/answer_lag.py).
    assert late_answer_share({"answers_by_lag_steps": {"1": 6, "2": 2, "3": 1, "7": 1}}) == 0.2
    assert late_answer_share({"answers_by_lag_steps": {"0": 1, "2": 3}}) == 0.0
    assert late_answer_share({"answers_by_lag_steps": {"1": 0}}) is None
    assert late_answer_share({}) is None


def test_the_twin_applies_a_runs_median_lag_less_the_step_it_always_waits(
        tmp_path: Path) -> None:
    # The twin applies an answer at the next step (lag 1); a run whose answers took a
    # median of 3 steps is modelled by holding each back 2 more.
    data = json.loads(REAL_RUN.read_text())
    assert CpuSetup.like(REAL_RUN).answer_lag_steps == 0, "recorded before the lag was"
    data["policies"]["fcfs"]["answers_by_lag_steps"] = {"1": 10, "2": 20, "3": 40, "4": 5}
    run = tmp_path / "run.json"
    run.write_text(json.dumps(data))
    assert CpuSetup.like(run).answer_lag_steps == 2
    data["policies"]["fcfs"]["answers_by_lag_steps"] = {"0": 30, "1": 10}
    run.write_text(json.dumps(data))
    assert CpuSetup.like(run).answer_lag_steps == 0, "answers on time: nothing held back"



RUN_17 = ENGINE_RUNS / "5e3f9ee-epyc17-noavx512-vary-seed-rounds10.json"


def _lags(weights: list[float], tail_mean_steps: float, seed: int, n: int) -> list[int]:
    draw = DrawnLag(weights, tail_mean_steps, seed)
    return [draw() for _ in range(n)]


def test_a_drawn_lag_follows_the_engines_histogram() -> None:
    # A quarter of the answers applied 1 step after their report, three quarters 3.
    lags = _lags([0, 10, 0, 30], 0.0, seed=1, n=4000)
    assert set(lags) == {1, 3}
    assert abs(lags.count(3) / len(lags) - 0.75) < 0.03
    assert lags == _lags([0, 10, 0, 30], 0.0, seed=1, n=4000), "a seed draws the same"
    assert lags != _lags([0, 10, 0, 30], 0.0, seed=2, n=4000)


def test_the_last_buckets_draws_go_on_by_the_tails_mean() -> None:
    # Every answer in the last bucket (7 steps or more): 7, plus the tail.
    assert set(_lags([0] * 7 + [1], 0.0, seed=0, n=100)) == {7}
    lags = _lags([0] * 7 + [1], 5.0, seed=0, n=20_000)
    assert min(lags) == 7
    assert abs(statistics.fmean(lags) - 12.0) < 0.3


@pytest.mark.parametrize(("weights", "tail", "named"), [
    ([], 0.0, "answers by lag []"),
    ([0, 0], 0.0, "not all 0"),
    ([1, -1], 0.0, "need counts >= 0"),
    ([1, 1], -1.0, "tail mean -1.0 steps"),
])
def test_a_lag_that_cannot_be_drawn_is_named(weights: list[float], tail: float,
                                             named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        DrawnLag(weights, tail, seed=0)


def test_answers_kept_in_order_land_later_than_drawn() -> None:
    # One report in 50 stalls the daemon 20 steps: the reports sent during the stall
    # land with it, 19, 18, ... steps late.
    landed = replay([0, 49, 0, 0, 0, 0, 0, 1], tail_mean_steps=13.0, seed=3).shares
    assert landed[1] < 0.98 * 49 / 50
    assert sum(landed[3:7]) > 0.03, "the stall's last reports land 3-6 steps late"
    assert landed[7] > 0.15


def test_the_fit_recovers_the_lags_a_stalling_daemon_drew() -> None:
    # A run recorded what a known process makes; the fit finds lags that land the
    # same, and from the order alone, how long the stalls were.
    drawn = [0.4, 0.15, 0.42, 0.0, 0.0, 0.0, 0.02, 0.01]
    recorded = replay(drawn, tail_mean_steps=16.0, steps=20_000, seed=7).shares
    fitted = fit(recorded)
    assert fitted.error < 0.01
    assert fitted.tail_mean_steps in (12.0, 16.0, 24.0)
    assert abs(fitted.draw_shares[7] - 0.01) < 0.005
    # Without the tail no shares land as recorded: too many in 3-6, or too few at 7+.
    assert fit(recorded, tail_means_steps=(0.0,)).error > 2 * fitted.error
    with pytest.raises(ValueError, match="not all 0"):
        fit([0.0, 0.0])


def test_an_answer_overdue_leaves_the_steps_it_is_late_for_without_one() -> None:
    # Every answer 3 steps late: each leaves one step (its report's step + 2) stale. On
    # every step that is every step; with reports on half of them, half.
    every = replay([0, 0, 0, 1], tail_mean_steps=0.0, steps=10_000, seed=1)
    half = replay([0, 0, 0, 1], tail_mean_steps=0.0, steps=10_000, seed=1, report_share=0.5)
    assert every.shares == half.shares == [0.0, 0.0, 0.0, 1.0]
    assert every.fallback_share == pytest.approx(1.0, abs=0.001)
    assert half.fallback_share == pytest.approx(0.5, abs=0.02)
    # Answers 2 steps late are the normal lag of a report in flight: none stale.
    assert replay([0, 0, 1], tail_mean_steps=0.0, steps=1_000).fallback_share == 0.0
    with pytest.raises(ValueError, match=re.escape("report share 0.0")):
        replay([1], tail_mean_steps=0.0, report_share=0.0)


def test_the_fit_at_the_runs_report_share_lands_its_stale_steps_too() -> None:
    # A daemon that stalls long while the engine reports on 30% of its steps: a
    # stall holds back few reports, and leaves many steps stale.
    drawn = [0.1, 0.3, 0.55, 0.0, 0.0, 0.0, 0.0, 0.05]
    run = replay(drawn, tail_mean_steps=24.0, steps=30_000, seed=7, report_share=0.3)
    tails = (0.0, 4.0, 24.0, 48.0)
    fitted = fit(run.shares, tails, iterations=12, steps=3_000, report_share=0.3,
                 fallback_share=run.fallback_share)
    assert fitted.error < 0.03
    assert fitted.report_share == 0.3
    assert fitted.fallback_share == pytest.approx(run.fallback_share, abs=0.05)
    # The same shares fitted as if the engine reported every step, then replayed with
    # reports on 30% of the steps (what the twin did before): stalls as short in steps
    # as the answers they held back at one report a step, so far fewer stale steps.
    per_step = fit(run.shares, tails, iterations=12, steps=3_000)
    replayed = replay(per_step.draw_shares, per_step.tail_mean_steps, steps=30_000, seed=7,
                      report_share=0.3)
    assert replayed.fallback_share < 0.6 * run.fallback_share
    with pytest.raises(ValueError, match=re.escape("fallback share 1.5")):
        fit(run.shares, tails, fallback_share=1.5)


def test_an_idle_wait_lands_its_answer_at_once_and_ends_the_stall() -> None:
    # Every report drawn 30 steps late; the engine goes idle on a tenth of the steps and
    # waits: its own answer lands 0 steps late, and so does all sent before it.
    stalled = replay([0, 0, 0, 0, 0, 0, 0, 1], tail_mean_steps=0.0, steps=20_000, seed=2,
                     report_share=0.3)
    waits = replay([0, 0, 0, 0, 0, 0, 0, 1], tail_mean_steps=0.0, steps=20_000, seed=2,
                   report_share=0.3, wait_share=0.1)
    assert stalled.shares[0] == 0.0 and stalled.shares[7] == 1.0
    assert waits.shares[0] == pytest.approx(0.1 / 0.4, abs=0.02)
    # 7 or more steps to the next wait: about half the gaps between waits.
    assert 0.3 < waits.shares[7] < 0.7
    assert waits.fallback_share < 0.8 * stalled.fallback_share
    with pytest.raises(ValueError, match=re.escape("wait share 0.8")):
        replay([1], tail_mean_steps=0.0, report_share=0.3, wait_share=0.8)


def test_the_fit_with_idle_waits_draws_no_answer_on_time() -> None:
    # A run whose answers on time were all waited for: the fit draws the rest from
    # 1 step on, and with the waits lands as the run did.
    drawn = [0.0, 0.5, 0.4, 0.0, 0.0, 0.0, 0.05, 0.05]
    run = replay(drawn, tail_mean_steps=24.0, steps=30_000, seed=7, report_share=0.2,
                 wait_share=0.08)
    fitted = fit(run.shares, (0.0, 24.0), iterations=12, steps=3_000, report_share=0.2,
                 fallback_share=run.fallback_share, wait_share=0.08)
    assert fitted.draw_shares[0] == 0.0 and fitted.wait_share == 0.08
    assert fitted.error < 0.03
    assert fitted.fallback_share == pytest.approx(run.fallback_share, abs=0.05)
    with pytest.raises(ValueError, match="none 1 or more steps late"):
        fit([5.0, 0.0], wait_share=0.1)


def test_answers_the_plugin_waits_for_land_at_once_with_all_before_them() -> None:
    # Every answer drawn 5 steps late; at step 3 the engine goes idle and the plugin
    # waits: the daemon has the CPU, so they all come now, the one to this step's
    # report 0 steps late, and none is left to land later.
    agent = SimpleNamespace(answer_lag=SimpleNamespace(step_index=0, sent_at_step={}),
                            settings=SimpleNamespace(deadline_s=0.02))
    sent: list[SimpleNamespace] = []
    agent.link = SimpleNamespace(take_decisions=lambda wait_s: sent[-1:])
    _answer_every_report(agent, lambda: 5)
    applied = []
    for step in range(1, 6):
        agent.answer_lag.step_index = step
        sent.append(SimpleNamespace(seq=step))
        agent.answer_lag.sent_at_step[step] = step
        idle = step == 3
        applied.append([answer.seq for answer in
                        agent.link.take_decisions(0.02 if idle else 0.0)])
    assert applied == [[], [], [1, 2, 3], [], []]


def test_drawn_answers_land_steps_after_their_report_and_in_order() -> None:
    # A report each step; the first's answer drawn 4 steps late, the rest 1: the second
    # cannot overtake the first (one stream, in order), and none lands before its step.
    agent = SimpleNamespace(answer_lag=SimpleNamespace(step_index=0, sent_at_step={}),
                            settings=SimpleNamespace(deadline_s=10.0))
    sent: list[SimpleNamespace] = []
    agent.link = SimpleNamespace(take_decisions=lambda wait_s: sent[-1:])
    lags = iter([4, 1, 1, 1, 1, 1])
    _answer_every_report(agent, lambda: next(lags))
    applied = []
    for step in range(1, 7):
        agent.answer_lag.step_index = step
        applied.append([answer.seq for answer in agent.link.take_decisions(0.0)])
        sent.append(SimpleNamespace(seq=step))  # the report at this step's end...
        agent.answer_lag.sent_at_step[step] = step  # ...answered by the next look
    # Report 1 (step 1) is due at step 5; reports 2-4, due a step after theirs, wait
    # behind it; report 5 lands on time.
    assert applied == [[], [], [], [], [1, 2, 3, 4], [5]]


def test_the_twin_draws_each_policys_lag_from_the_runs_own() -> None:
    data = json.loads(RUN_17.read_text())
    setup = replace(CpuSetup.like(RUN_17), draw_answer_lag=True)
    adaptive = data["policies"]["adaptive"]
    assert setup.like_answer_lags["adaptive"] == [
        adaptive["answers_by_lag_steps"][str(k)] for k in range(8)]
    assert setup.like_fallback_steps["adaptive"] == adaptive["fallback_steps"]
    assert setup.lags_of("adaptive@provisional_cache=true") == setup.like_answer_lags["adaptive"]
    # A policy the run did not have draws from FCFS's.
    assert setup.lags_of("contextserve") == setup.like_answer_lags["fcfs"]
    assert isinstance(setup.answer_lag("adaptive", seed=0), DrawnLag)
    # A run from before the engine's steps were recorded: fitted at a report a step.
    assert "adaptive" not in setup.like_engine_steps
    assert setup.fitted_lag("adaptive").report_share == 1.0
    # With the twin's idle waits measured, those take their share of the steps.
    measured = replace(setup, twin_wait_shares={"adaptive": 0.03}).fitted_lag("adaptive")
    assert (measured.wait_share, measured.report_share) == (0.03, 0.97)
    assert measured.draw_shares[0] == 0.0
    assert CpuSetup.like(RUN_17).answer_lag("adaptive", seed=0) == 1, "its median, 2, less 1"
    with pytest.raises(ValueError, match="no answers by lag to draw from"):
        CpuSetup(draw_answer_lag=True).answer_lag("fcfs", seed=0)


def test_the_lags_are_fitted_with_the_runs_idle_waits() -> None:
    # The run's idle waits a round go out on their share of the steps, the other
    # reports on theirs; a run that records no idle waits counts them among its
    # answers 0 steps late.
    setup = CpuSetup(draw_answer_lag=True, answer_lag_tail_steps=4.0,
                     like_answer_lags={"fcfs": [25.0, 50.0, 20.0, 0, 0, 0, 0, 5.0]},
                     like_engine_steps={"fcfs": 400.0}, like_reports={"fcfs": 100.0},
                     like_fallback_steps={"fcfs": 40.0}, like_idle_waits={"fcfs": 26.0})
    fitted = setup.fitted_lag("fcfs")
    assert fitted.draw_shares[0] == 0.0
    assert (fitted.wait_share, fitted.report_share) == (26 / 400, 74 / 400)
    older = replace(setup, like_idle_waits={})
    assert (older.fitted_lag("fcfs").wait_share,
            older.fitted_lag("fcfs").report_share) == (25 / 400, 75 / 400)


def test_the_fit_places_the_waits_where_the_twin_has_them() -> None:
    # Measured on a first run, the twin's own idle waits a step replace the engine's
    # (its engine goes idle less often): the fit's replay ends as many stalls as the
    # twin's waits will.
    setup = CpuSetup(draw_answer_lag=True, answer_lag_tail_steps=4.0,
                     like_answer_lags={"fcfs": [25.0, 50.0, 20.0, 0, 0, 0, 0, 5.0]},
                     like_engine_steps={"fcfs": 400.0}, like_reports={"fcfs": 100.0},
                     like_fallback_steps={"fcfs": 40.0}, like_idle_waits={"fcfs": 26.0},
                     twin_wait_shares={"fcfs": 0.02})
    fitted = setup.fitted_lag("fcfs")
    assert (fitted.wait_share, fitted.report_share) == (0.02, 74 / 400)
    assert replace(setup, twin_wait_shares={}).fitted_lag("fcfs").wait_share == 26 / 400


def test_the_twins_lags_are_printed_beside_the_runs() -> None:
    setup = CpuSetup(like_answer_lags={"fcfs": [6, 30, 10]},
                     like_fallback_steps={"fcfs": 12.0}, like_engine_steps={"fcfs": 48.0},
                     like_idle_waits={"fcfs": 7.0})
    runs = {"fcfs": [{"answers_by_lag_steps": [2, 8, 0], "fallback_steps": 0, "steps": 10,
                      "idle_waits": 2},
                     {"answers_by_lag_steps": [0, 5, 5], "fallback_steps": 4, "steps": 30,
                      "idle_waits": 1}]}
    header, twin, engine = answer_lag_lines(setup, runs)
    assert header.split()[-9:] == ["0", "1", "2+", "fallback", "steps", "of", "steps",
                                   "idle", "waits"]
    # Fallback steps, steps and waits a run, averaged over the seeds: 2 of 20, 1.5.
    assert twin.split() == ["fcfs", "(twin)", "10.0%", "65.0%", "25.0%", "2", "10.0%", "2"]
    assert engine.split() == ["fcfs", "(--like", "run)", "13.0%", "65.2%", "21.7%", "12",
                              "25.0%", "7"]
    # A run recorded before the engine's steps and waits were: no share, no waits.
    older = answer_lag_lines(CpuSetup(like_answer_lags={"fcfs": [0, 30, 10]},
                                      like_fallback_steps={"fcfs": 12.0}), runs)[2]
    assert older.split()[-3:] == ["12", "-", "-"]
    assert answer_lag_lines(CpuSetup(), {"fcfs": [{}]}) == []
