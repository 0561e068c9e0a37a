"""The twin's FCFS against the reference benchmark's FCFS figures (``calibrate``): the
targets, the rows that compare them, one calibration case."""

from __future__ import annotations

from typing import Any

from benchmarks.twin.point import make_workload, run_point
from benchmarks.twin.steptime import Efficiency

# DESIGN.md "Measuring": FCFS on one RTX 5090 (reference A/B benchmark).
CALIBRATION_TARGETS: dict[float, dict[str, Any]] = {
    2.0: {"num_jobs": 206, "avg_duration_s": 6.65, "median_duration_s": 6.63},
    8.0: {"num_jobs": 756, "avg_duration_s": 14.10, "median_duration_s": 14.33,
          "p90_duration_s": 17.02, "p95_duration_s": 17.54,
          "per_turn_avg_latency_ms": {"1": 1263, "2": 735, "3": 574, "4": 1005, "5": 749,
                                      "6": 641, "7": 3732, "8": 1236}},
}


def calibration_rows(results: dict[float, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for jps, target in CALIBRATION_TARGETS.items():
        got = results.get(jps)
        if got is None:
            continue
        for key, want in target.items():
            if key == "num_jobs":
                continue
            if isinstance(want, dict):
                for turn, value in want.items():
                    twin = got[key][turn]
                    rows.append({"jps": jps, "figure": f"turn {turn} latency ms "
                                 f"({got['per_turn_avg_prompt_tokens'][turn]} tokens)",
                                 "target": value, "twin": twin,
                                 "off_pct": round(100 * (twin - value) / value, 1)})
            else:
                twin = got[key]
                rows.append({"jps": jps, "figure": key, "target": want, "twin": twin,
                             "off_pct": round(100 * (twin - want) / want, 1)})
    return rows


def calibrate_once(policy: str, agreement: float, seed: int, efficiency: Efficiency,
                   progress: bool = False) -> dict[str, Any]:
    results: dict[float, dict[str, Any]] = {}
    for jps, target in CALIBRATION_TARGETS.items():
        workload = make_workload("reference", jps, seed, None, target["num_jobs"], agreement)
        summary, wall_s = run_point(workload, policy, jps, 5402, efficiency, progress=progress)
        summary["wall_s"] = round(wall_s, 1)
        results[jps] = summary
    rows = calibration_rows(results)
    return {
        "policy": policy,
        "answer_agreement": agreement,
        "seed": seed,
        "rows": rows,
        "within_10_pct": sum(1 for r in rows if abs(r["off_pct"]) <= 10),
        "figures": len(rows),
        "mean_abs_off_pct": round(sum(abs(r["off_pct"]) for r in rows) / len(rows), 1),
        "runs": {str(jps): {k: r[k] for k in (
            "num_jobs", "avg_duration_s", "median_duration_s", "p90_duration_s",
            "p95_duration_s", "per_turn_avg_latency_ms", "per_turn_avg_prompt_tokens",
            "prefix_cache_hit_rate", "preemptions", "kv_usage_avg", "jobs_in_flight_avg",
            "jobs_in_flight_max", "wall_s")} for jps, r in results.items()},
    }
