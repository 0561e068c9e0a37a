"""How late the daemon's answers landed on a real engine, as ``benchmarks.engine``
records it, and the twin's CPU setup taking that lag from a run (``--like``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.engine.paired import median_answer_lag_steps
from benchmarks.twin.cpu import CpuSetup

ROOT = Path(__file__).resolve().parents[2]
REAL_RUN = (ROOT / "benchmarks" / "results" / "engine" / "runs"
            / "d077e0a-epyc-noavx512-rounds12.json")


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
