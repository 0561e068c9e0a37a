"""The mixed benchmark's figures: a one-shot request is a job of one turn, and policies
compare round by round."""

from __future__ import annotations

import pytest

from benchmarks.mixed.figures import AgentTurn, mean_of_rounds, paired, round_figures


def test_the_average_over_all_jobs_counts_a_one_shot_request_as_a_job() -> None:
    figures = round_figures([10.0, 14.0], [1.0, 1.0, 1.0, 3.0],
                            [AgentTurn(1, 2.0, 512, 0), AgentTurn(2, 1.0, 640, 512),
                             AgentTurn(2, 3.0, 640, 256)])
    assert figures["agent_job_s"] == 12.0 and figures["agent_job_max_s"] == 14.0
    assert figures["one_shot_s"] == 1.5
    assert figures["all_jobs_s"] == pytest.approx(30.0 / 6)
    assert figures["agent_turns"]["2"] == {"latency_s": 2.0, "prompt_tokens": 640,
                                           "cached_tokens": 384}


def test_rounds_are_paired_and_one_round_bounds_nothing() -> None:
    def run(all_jobs_s: float) -> dict[str, object]:
        return {"agent_job_s": 1.0, "one_shot_s": 1.0, "all_jobs_s": all_jobs_s,
                "agent_turns": {"1": {"cached_tokens": 0.0}}}

    runs = {"fcfs": [run(4.0), run(8.0)], "adaptive": [run(3.0), run(6.0)]}
    ratio = paired(runs, "fcfs", "all_jobs_s")["adaptive"]
    assert ratio["rounds"] == [0.75, 0.75] and ratio["mean"] == 0.75
    assert ratio["low95"] == ratio["high95"] == 0.75, "no spread between the rounds"
    single = paired({"fcfs": [run(4.0)], "adaptive": [run(3.0)]}, "fcfs", "all_jobs_s")
    assert single["adaptive"]["low95"] is None and single["adaptive"]["mean"] == 0.75
    merged = mean_of_rounds(runs["adaptive"])
    assert merged["all_jobs_s"] == 4.5 and merged["agent_cached_tokens"] == {"1": 0.0}
