"""``python -m benchmarks.twin cpu``'s report: what it prints from the seeds' summaries
(the runs themselves are in tests/integration/test_twin_cpu.py)."""

from __future__ import annotations

from typing import Any

from benchmarks.twin.cpu import CpuSetup, report, turn_latency_lines


def _summary(seed: int, job_s: float, learned: float | None,
             turns_ms: dict[str, int] | None = None) -> dict[str, Any]:
    return {"seed": seed, "avg_duration_s": job_s, "prefix_cache_hit_rate": 0.05,
            "pinned_blocks_avg": 0.0, "provisional_blocks_avg": 0.0,
            "ttft_ms": {"max": 2000}, "learned_prefill_s_per_token": learned,
            "per_turn_avg_latency_ms": turns_ms or {}}


def _line(text: str, policy: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"{policy} "))


def test_the_learned_cost_is_paired_with_the_baselines_by_seed() -> None:
    runs = {"fcfs": [_summary(0, 10.0, 8e-5), _summary(1, 12.0, 9e-5)],
            "adaptive": [_summary(0, 9.0, 8.8e-5), _summary(1, 12.0, 9e-5)]}
    text = report(CpuSetup(attention_s_per_pair=8.89e-8), runs, "fcfs")
    # Jobs 0.9 and 1.0 of FCFS's, learned costs 1.1 and 1.0 of its.
    assert "0.950 +- 0.050" in _line(text, "adaptive")
    assert _line(text, "adaptive").endswith("1.050 +- 0.050")
    assert "8.89e-08 s an attention pair" in text


def test_a_seed_without_a_learned_cost_leaves_the_column_empty() -> None:
    runs = {"fcfs": [_summary(0, 10.0, 8e-5)], "adaptive": [_summary(0, 9.0, None)]}
    assert _line(report(CpuSetup(), runs, "fcfs"), "adaptive").endswith(" -")


def test_turn_latencies_are_averaged_over_the_seeds_in_seconds() -> None:
    runs = {"fcfs": [_summary(0, 10.0, None, {"1": 800, "2": 1000}),
                     _summary(1, 10.0, None, {"1": 1000, "2": 1200})],
            "adaptive": [_summary(0, 9.0, None, {"1": 1200}),
                         _summary(1, 9.0, None, {"1": 1400, "2": 700})]}
    header, fcfs, adaptive = turn_latency_lines(runs)
    assert header.split()[-2:] == ["1", "2"]
    assert fcfs.split()[-2:] == ["0.90", "1.10"]
    assert adaptive.split()[-2:] == ["1.30", "0.70"]  # turn 2: the one seed that had it


def test_no_turn_latencies_print_no_table() -> None:
    assert turn_latency_lines({"fcfs": [_summary(0, 10.0, None)]}) == []
