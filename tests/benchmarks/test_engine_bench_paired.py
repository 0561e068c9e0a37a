"""Pooling engine benchmark runs: rounds pair only within a run, and the per-request
split says whether a difference lies inside vLLM or outside it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.engine.paired import (
    SpeedAdjusted,
    geometric_job_ratio,
    job_ratio,
    load_rounds,
    main,
    request_split,
    speed_adjusted_ratio,
    ttft_ratios,
)


def _round(job_s: float, client_s: float, e2e_s: float, queue_s: float) -> dict[str, object]:
    return {"avg_job_duration_s": job_s, "client_request_mean_s": client_s,
            "vllm_mean_s": {"e2e": e2e_s, "queue": queue_s, "prefill": 0.02, "decode": 0.03},
            "per_turn": {str(t): {} for t in range(1, 9)}}


def _write_run(path: Path, rounds: dict[str, list[dict[str, object]]]) -> Path:
    path.write_text(json.dumps({"policies": {
        policy: {"rounds": policy_rounds} for policy, policy_rounds in rounds.items()}}))
    return path


def test_runs_pool_round_by_round_and_the_machine_drift_cancels(tmp_path: Path) -> None:
    # Run 2 is on a slower machine for everyone: pairing within the run cancels it.
    first = _write_run(tmp_path / "a.json", {
        "fcfs": [_round(4.0, 0.15, 0.08, 0.014), _round(4.4, 0.16, 0.08, 0.014)],
        "adaptive": [_round(4.4, 0.17, 0.08, 0.016), _round(4.4, 0.16, 0.08, 0.016)]})
    second = _write_run(tmp_path / "b.json", {
        "fcfs": [_round(8.0, 0.30, 0.09, 0.020)],
        "adaptive": [_round(8.8, 0.34, 0.09, 0.022)]})
    rounds = load_rounds([first, second])
    assert len(rounds) == 3

    ratio = job_ratio(rounds, "adaptive", "fcfs")
    assert math.isclose(ratio.mean, (1.1 + 1.0 + 1.1) / 3)
    assert ratio.rounds == 3
    assert ratio.upper95 > ratio.mean

    split = request_split(rounds, "adaptive", "fcfs")
    # vLLM's e2e did not move: the whole difference is outside vLLM.
    assert math.isclose(split["vllm e2e"].mean, 0.0, abs_tol=1e-12)
    assert math.isclose(split["outside vllm"].mean, split["client"].mean)
    assert math.isclose(split["client"].mean, (0.02 + 0.0 + 0.04) / 3)
    assert math.isclose(split["  queue"].mean, 0.002)


def test_a_figure_missing_from_older_rounds_is_left_out_of_that_figure(tmp_path: Path) -> None:
    old = {"avg_job_duration_s": 4.0, "per_turn": {}}  # recorded before vLLM's phases
    run = _write_run(tmp_path / "run.json", {
        "fcfs": [old, _round(4.0, 0.15, 0.08, 0.014), _round(4.0, 0.15, 0.08, 0.014)],
        "adaptive": [old, _round(4.0, 0.16, 0.08, 0.014), _round(4.0, 0.18, 0.08, 0.014)]})
    rounds = load_rounds([run])
    assert job_ratio(rounds, "adaptive", "fcfs").rounds == 3
    assert request_split(rounds, "adaptive", "fcfs")["client"].rounds == 2


def test_bad_inputs_name_the_file_and_what_is_wrong(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    not_a_result = tmp_path / "other.json"
    not_a_result.write_text("{}")
    with pytest.raises(SystemExit):
        main([str(not_a_result)])
    assert "other.json: not an engine benchmark result" in capsys.readouterr().err

    uneven = _write_run(tmp_path / "uneven.json", {
        "fcfs": [_round(4.0, 0.15, 0.08, 0.014)] * 2,
        "adaptive": [_round(4.0, 0.15, 0.08, 0.014)]})
    with pytest.raises(SystemExit):
        main([str(uneven)])
    assert "different numbers of rounds" in capsys.readouterr().err

    one_round = _write_run(tmp_path / "one.json", {
        "fcfs": [_round(4.0, 0.15, 0.08, 0.014)], "adaptive": [_round(4.0, 0.15, 0.08, 0.014)]})
    with pytest.raises(SystemExit):
        main([str(one_round), "--baseline", "fcfs"])
    assert "need at least 2 rounds with the baseline 'fcfs', found 1" in capsys.readouterr().err


def test_the_report_prints_the_ratio_and_the_split(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run = _write_run(tmp_path / "run.json", {
        "fcfs": [_round(4.0, 0.15, 0.08, 0.014), _round(4.2, 0.15, 0.08, 0.014)],
        "adaptive": [_round(4.4, 0.17, 0.08, 0.016), _round(4.2, 0.16, 0.08, 0.016)]})
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "2 paired rounds; baseline fcfs" in out
    assert "adaptive / fcfs, average job: 1.050 +- 0.050" in out
    assert "geometric mean 1.049 x/ 1.049" in out  # sqrt(1.1): ratios 1.1 and 1.0
    assert "outside vllm" in out and "x8 turns" in out


def test_the_geometric_mean_reads_the_same_either_way_round(tmp_path: Path) -> None:
    # One round adaptive is twice as slow, the next twice as fast: no difference,
    # which the plain mean of ratios misses both ways (1.25 and 1.25).
    rounds = load_rounds([_write_run(tmp_path / "run.json", {
        "fcfs": [_round(4.0, 0.15, 0.08, 0.014), _round(8.0, 0.15, 0.08, 0.014)],
        "adaptive": [_round(8.0, 0.15, 0.08, 0.014), _round(4.0, 0.15, 0.08, 0.014)]})])
    assert job_ratio(rounds, "adaptive", "fcfs").mean == 1.25
    assert job_ratio(rounds, "fcfs", "adaptive").mean == 1.25
    geometric = geometric_job_ratio(rounds, "adaptive", "fcfs")
    assert math.isclose(geometric.ratio, 1.0)
    assert math.isclose(geometric.factor, 2.0)  # the log ratios +-log 2: stderr log 2
    assert geometric.upper95 > 2.0

    steady = load_rounds([_write_run(tmp_path / "steady.json", {
        "fcfs": [_round(4.0, 0.15, 0.08, 0.014), _round(8.0, 0.15, 0.08, 0.014)],
        "adaptive": [_round(4.4, 0.15, 0.08, 0.014), _round(8.8, 0.15, 0.08, 0.014)]})])
    forward = geometric_job_ratio(steady, "adaptive", "fcfs")
    backward = geometric_job_ratio(steady, "fcfs", "adaptive")
    assert math.isclose(forward.ratio, 1.1) and math.isclose(backward.ratio, 1 / 1.1)


def test_a_disturbed_round_named_on_the_command_line_is_left_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _write_run(tmp_path / "run.json", {
        "fcfs": [_round(4.0, 0.15, 0.08, 0.014), _round(4.0, 0.15, 0.08, 0.014),
                 _round(4.2, 0.15, 0.08, 0.014)],
        # Round 1: something else on the machine doubled adaptive's jobs.
        "adaptive": [_round(8.0, 0.6, 0.08, 0.016), _round(4.4, 0.17, 0.08, 0.016),
                     _round(4.2, 0.16, 0.08, 0.016)]})
    assert main([str(run), "--exclude", f"{run}:1"]) == 0
    out = capsys.readouterr().out
    assert "2 paired rounds; baseline fcfs" in out
    assert "adaptive / fcfs, average job: 1.050 +- 0.050" in out

    for spec, error in ((f"{run}:0", "not FILE:ROUND with ROUND from 1"),
                        (f"{run}:x", "not FILE:ROUND with ROUND from 1"),
                        ("other.json:1", "'other.json' is not one of the results given"),
                        (f"{run}:4", "names a round past its 3")):
        with pytest.raises(SystemExit):
            main([str(run), "--exclude", spec])
        assert error in capsys.readouterr().err


def test_the_first_token_tail_is_paired_by_round_where_it_was_timed(tmp_path: Path) -> None:
    def timed(p99_s: float, max_s: float) -> dict[str, object]:
        return {**_round(4.0, 0.15, 0.08, 0.014),
                "ttft_s": {"avg": 0.1, "p50": 0.05, "p95": 0.2, "p99": p99_s, "max": max_s}}

    untimed = _round(4.0, 0.15, 0.08, 0.014)  # a round from before the engine timed them
    run = _write_run(tmp_path / "run.json", {
        "fcfs": [untimed, timed(0.5, 1.0), timed(0.4, 2.0)],
        "adaptive": [untimed, timed(1.0, 1.5), timed(0.4, 3.0)]})
    ratios = ttft_ratios(load_rounds([run]), "adaptive", "fcfs")
    assert ratios["max"].rounds == 2 and math.isclose(ratios["max"].mean, 1.5)
    assert math.isclose(ratios["p99"].mean, 1.5)  # 2.0 and 1.0
    assert ttft_ratios(load_rounds([run]), "continuum", "fcfs") == {}


def _timed_speed(job_s: float, learned_s_per_token: float) -> dict[str, object]:
    return {**_round(job_s, 0.15, 0.08, 0.014),
            "learned_prefill_s_per_token": learned_s_per_token}


def test_at_equal_speed_the_machines_drift_within_a_round_is_taken_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The policy is 5% faster; each of its runs fell on a machine slower or faster than
    # the baseline's beside it, and its job time followed as speed ** 1.4. The rounds'
    # drift is lopsided, so the plain paired ratio says "slower than the baseline".
    effect, elasticity = 0.95, 1.4
    speeds = [1.25, 1.15, 1.10, 0.95, 1.20, 1.05]
    fcfs, adaptive = [], []
    for index, speed in enumerate(speeds):
        base_s = 10.0 + index
        fcfs.append(_timed_speed(base_s, 6e-5))
        adaptive.append(_timed_speed(base_s * effect * speed ** elasticity, 6e-5 * speed))
    # A round where the daemon learned no cost (0) pairs for the job ratio only.
    fcfs.append(_timed_speed(10.0, 0.0))
    adaptive.append(_timed_speed(10.0, 6e-5))
    run = _write_run(tmp_path / "run.json", {"fcfs": fcfs, "adaptive": adaptive})
    rounds = load_rounds([run])

    assert job_ratio(rounds, "adaptive", "fcfs").mean > 1.0
    adjusted = speed_adjusted_ratio(rounds, "adaptive", "fcfs")
    assert adjusted is not None
    assert adjusted.rounds == len(speeds)
    assert math.isclose(adjusted.ratio, effect, rel_tol=1e-9)
    assert math.isclose(adjusted.slope, elasticity, rel_tol=1e-9)
    assert adjusted.stderr < 1e-9, "the drift explains every round exactly"
    assert math.isclose(adjusted.speed_ratio.mean, sum(speeds) / len(speeds))

    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    # The check comes first: the policy's runs learned a 12% dearer token than the
    # baseline's, and the adjusted ratio rests on the machine, not the policy, doing that.
    assert ("its runs' learned s/token over fcfs's 1.117 +- 0.044; were that all the "
            "machine's, the job ratio at equal speed 0.950 +- 0.000") in out


def test_the_adjustment_needs_four_rounds_with_a_spread_in_speed(tmp_path: Path) -> None:
    def adjusted(speeds: list[float]) -> SpeedAdjusted | None:
        run = _write_run(tmp_path / "run.json", {
            "fcfs": [_timed_speed(10.0, 6e-5) for _ in speeds],
            "adaptive": [_timed_speed(10.0 * (1 + 0.1 * i), 6e-5 * speed)
                         for i, speed in enumerate(speeds)]})
        return speed_adjusted_ratio(load_rounds([run]), "adaptive", "fcfs")

    assert adjusted([1.0, 1.1, 0.9]) is None, "three rounds: no residual left to bound it"
    assert adjusted([1.0, 1.0, 1.0, 1.0]) is None, "one speed: no slope to adjust by"
    four = adjusted([1.0, 1.1, 0.9, 1.05])
    assert isinstance(four, SpeedAdjusted)
    assert four.upper95 > four.ratio > 0 and four.stderr > 0
