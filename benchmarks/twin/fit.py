"""Fit the reference workload's unpublished facts to the FCFS figures (``calibrate --fit``).

Only vLLM's own FCFS scheduler (``native``) runs here, only against DESIGN.md's FCFS
figures; no other policy is ever run by the fit. The GPU efficiencies are held at the
values given (physical priors); what is fitted is what the reference document does not
say about its workload:

- the mean answer length of each turn (it publishes prompt lengths only): each turn's
  FCFS latency at 8 jobs/s is mostly its answer's decode steps, so the means are moved
  by the ratio target / twin latency;
- how much context jobs share (``answer_agreement``): its client sends every job the
  same script, so jobs whose answers agree share their context. With the answer
  lengths fitted at 8 jobs/s, the 2 jobs/s average decides it (less sharing means
  busier steps at 8 jobs/s, hence shorter fitted answers, hence a lower 2 jobs/s
  average): bisection on log(1 - agreement).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from typing import Any

from benchmarks.twin.steptime import Efficiency

TARGET_TURN_MS = {"1": 1263, "2": 735, "3": 574, "4": 1005, "5": 749, "6": 641, "7": 3732,
                  "8": 1236}


def _point(job: tuple[float, int, dict[str, float], dict[str, Any]]) -> tuple[float, Any]:
    from benchmarks.twin.point import run_point
    from benchmarks.twin.workload import generate

    jps, num_jobs, efficiency, workload_args = job
    workload = generate("reference", jps, seed=0, num_jobs=num_jobs, **workload_args)
    with contextlib.redirect_stderr(io.StringIO()):
        summary, _ = run_point(workload, "native", jps, 5402, Efficiency(**efficiency))
    return jps, summary


def evaluate(pool: ProcessPoolExecutor, efficiency: Efficiency, answer_tokens: dict[int, int],
             agreement: float) -> dict[float, Any]:
    args = {"answer_tokens": answer_tokens, "answer_agreement": agreement}
    eff = asdict(efficiency)
    return dict(pool.map(_point, [(2.0, 206, eff, args), (8.0, 756, eff, args)]))


def loss(results: dict[float, Any]) -> float:
    """Mean |% off| over the calibration figures (job-duration figures weigh 2, each
    turn's latency 1)."""
    from benchmarks.twin.calibration import calibration_rows

    rows = calibration_rows(results)
    weights = [1 if r["figure"].startswith("turn") else 2 for r in rows]
    return sum(abs(r["off_pct"]) * w for r, w in zip(rows, weights, strict=True)) / sum(weights)


def fit_answers(pool: ProcessPoolExecutor, efficiency: Efficiency, agreement: float,
                answer_tokens: dict[int, int], rounds: int = 4,
                log: Any = print) -> tuple[dict[int, int], dict[float, Any]]:
    """Answer lengths that make FCFS's per-turn latency at 8 jobs/s the reference's."""
    results = evaluate(pool, efficiency, answer_tokens, agreement)
    for _ in range(rounds):
        got = results[8.0]["per_turn_avg_latency_ms"]
        if not math.isfinite(results[8.0]["avg_duration_s"]) or results[8.0][
                "avg_duration_s"] > 100:
            break  # overloaded: no answer length fixes that
        answer_tokens = {
            k: max(2, min(150, round(v * (TARGET_TURN_MS[str(k)] / got[str(k)]) ** 0.8)))
            for k, v in answer_tokens.items()}
        results = evaluate(pool, efficiency, answer_tokens, agreement)
        log(f"    answers {answer_tokens}: 2 jps {results[2.0]['avg_duration_s']} s, "
            f"8 jps {results[8.0]['avg_duration_s']} s, loss {loss(results):.1f}")
    return answer_tokens, results


def fit(efficiency: Efficiency, answer_tokens: dict[int, int], low: float = 0.9,
        high: float = 1.0, steps: int = 6, log: Any = print) -> dict[str, Any]:
    """Bisection on the agreement (2 jobs/s average), answers fitted at each step."""
    best: dict[str, Any] | None = None
    with ProcessPoolExecutor(2) as pool:
        for _ in range(steps):
            agreement = 1 - math.sqrt((1 - low) * max(1 - high, 1e-4))
            log(f"  agreement {agreement:.4f}")
            answer_tokens, results = fit_answers(pool, efficiency, agreement,
                                                 dict(answer_tokens), log=log)
            value = loss(results)
            if best is None or value < best["loss"]:
                best = {"loss": value, "answer_agreement": agreement,
                        "answer_tokens": answer_tokens, "results": results}
            if results[8.0]["avg_duration_s"] > 2 * 14.10:
                low = agreement  # overloaded at 8 jps: more must be shared
            elif results[2.0]["avg_duration_s"] > 6.65:
                high = agreement  # answers too long at 2 jps: share less, answer less
            else:
                low = agreement
    assert best is not None
    best["efficiency"] = asdict(efficiency)
    return best


def main() -> None:
    import sys

    efficiency = Efficiency(**json.loads(sys.argv[1])) if len(sys.argv) > 1 else Efficiency()
    from benchmarks.twin.workload import REFERENCE_TURNS

    start = {k + 1: spec.output_tokens_mean for k, spec in enumerate(REFERENCE_TURNS)}
    best = fit(efficiency, start)
    results = best.pop("results")
    print(json.dumps({**best, "avg_2": results[2.0]["avg_duration_s"],
                      "avg_8": results[8.0]["avg_duration_s"]}))


if __name__ == "__main__":
    main()
