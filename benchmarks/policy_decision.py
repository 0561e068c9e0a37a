"""Decision latency of each policy for one engine step, in microseconds.

One step = order_waiting + order_victims + expire + release_under_pressure +
order_pins_under_pressure on a step with 150 running and 200 waiting requests (and 60
pins, their tools' measured distributions), then on_finish for 4
finished requests with measured tool-time distributions. This is the daemon's pure
decision cost, without gRPC or the runtime's bookkeeping.

    .venv/bin/python benchmarks/policy_decision.py [--iterations 2000] [--json] [--out F.json]

The budget is well under 1 ms per step (the engine's exchange deadline is a few ms).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common.results import write_result
from benchmarks.common.stats import percentile
from sidecar.estimators.sketch import LogBucketSketch, add_increments
from sidecar.framework.protocols import Policy
from sidecar.framework.types import (
    FinishInput,
    JobView,
    KvView,
    PinView,
    RequestState,
    RequestView,
    StepView,
    ToolTimeDistribution,
)
from sidecar.policies.registry import build_policy

RUNNING = 150
WAITING = 200
PINS = 60
FINISHES = 4
TOOLS = ("ls", "cat", "grep", "pytest", "search_web", "git status")

POLICIES: dict[str, tuple[str, dict[str, object]]] = {
    "fcfs": ("fcfs", {}),
    "continuum (fixed)": ("continuum", {}),
    "continuum (cdf)": ("continuum", {"ttl_mode": "cdf"}),
    "contextserve": ("contextserve", {}),
    "adaptive": ("adaptive", {}),
}


def _distribution(tool: str, rng: random.Random, samples: int) -> ToolTimeDistribution:
    sketch = LogBucketSketch()
    fields: dict[str, float] = {}
    median_s = {"pytest": 3.0, "search_web": 0.8}.get(tool, 0.1)
    for _ in range(samples):
        add_increments(fields, sketch.increments(rng.lognormvariate(0.0, 0.6) * median_s))
    dist = sketch.distribution(tool, fields)
    assert dist is not None
    return dist


def build_workload(seed: int = 0) -> tuple[StepView, list[FinishInput]]:
    rng = random.Random(seed)
    now_s = 1000.0
    jobs: dict[str, JobView] = {}
    requests: list[RequestView] = []
    for index in range(RUNNING + WAITING):
        # ~250 jobs: some have several requests in flight.
        job_id = f"job-{rng.randrange(250)}"
        arrival_s = now_s - rng.uniform(0.0, 60.0)
        job = jobs.get(job_id)
        if job is None or arrival_s < job.first_arrival_s:
            jobs[job_id] = JobView(job_id, arrival_s - rng.uniform(0.0, 30.0), turns_finished=3)
        requests.append(
            RequestView(
                request_id=f"req-{index}",
                job_id=job_id,
                is_last_step=rng.random() < 0.125,
                arrival_s=arrival_s,
                prompt_tokens=rng.randrange(90, 3000),
                state=RequestState.RUNNING if index < RUNNING else RequestState.WAITING,
            )
        )
    distributions = {tool: _distribution(tool, rng, 200) for tool in TOOLS}
    pooled = _distribution("*", rng, 2000)
    pins = [
        PinView(
            request_id=f"pin-{index}",
            job_id=f"job-{rng.randrange(250)}",
            blocks=rng.randrange(5, 190),
            pinned_at_s=now_s - rng.uniform(0.0, 3.0),
            expires_at_s=now_s + rng.uniform(-1.0, 3.0),
            tool=TOOLS[index % len(TOOLS)],
        )
        for index in range(PINS)
    ]
    step = StepView(
        engine_id="bench",
        now_s=now_s,
        kv=KvView(total_blocks=5402, free_blocks=40, block_size_tokens=16),
        waiting=tuple(requests[RUNNING:]),
        running=tuple(requests[:RUNNING]),
        pins=tuple(pins),
        jobs=jobs,
        tool_times=distributions,
        global_tool_times=pooled,
    )
    finishes = [
        FinishInput(
            step=step,
            request=requests[index],
            output_tokens=64,
            blocks=requests[index].prompt_tokens // 16 + 4,
            tool=TOOLS[index % len(TOOLS)],
            tool_times=distributions[TOOLS[index % len(TOOLS)]],
            global_tool_times=pooled,
        )
        for index in range(FINISHES)
    ]
    return step, finishes


def time_us(action: Callable[[], object], iterations: int) -> list[float]:
    for _ in range(min(100, iterations)):
        action()
    samples = []
    gc.disable()  # measure the decision, not a collector pause that lands in it
    try:
        for _ in range(iterations):
            start = time.perf_counter_ns()
            action()
            samples.append((time.perf_counter_ns() - start) / 1000.0)
    finally:
        gc.enable()
    return samples


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "p50_us": percentile(samples, 0.5),
        "p99_us": percentile(samples, 0.99),
        "max_us": max(samples),
    }


def bench(
    policy: Policy, step: StepView, finishes: list[FinishInput], iterations: int
) -> dict[str, dict[str, float]]:
    # A fresh (shallow) copy of the step per call, as the runtime builds one per
    # report: a policy that memoises per step object must not be timed on a warm memo.
    def step_hooks() -> None:
        view = replace(step)
        policy.order_waiting(view)
        policy.order_victims(view)
        policy.expire(view)
        policy.release_under_pressure(view)
        policy.order_pins_under_pressure(view)

    def finish_hooks() -> None:
        view = replace(step)
        for finished in finishes:
            policy.on_finish(replace(finished, step=view))

    def everything() -> None:
        step_hooks()
        finish_hooks()

    return {
        "step_hooks": summary(time_us(step_hooks, iterations)),
        f"on_finish_x{FINISHES}": summary(time_us(finish_hooks, iterations)),
        "total": summary(time_us(everything, iterations)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--json", action="store_true", help="print raw JSON")
    parser.add_argument("--out", type=Path, help="also write the result (JSON) here")
    args = parser.parse_args()
    step, finishes = build_workload()
    results = {
        label: bench(build_policy(name, params), step, finishes, args.iterations)
        for label, (name, params) in POLICIES.items()
    }
    if args.out is not None:
        write_result(args.out, {"command": "python benchmarks/policy_decision.py "
                                + " ".join(sys.argv[1:]), "iterations": args.iterations,
                                "policies": results})
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"{RUNNING} running, {WAITING} waiting, {PINS} pins; {args.iterations} iterations; "
        f"Python {sys.version.split()[0]}"
    )
    print(f"{'policy':<20} {'part':<14} {'p50 us':>9} {'p99 us':>9} {'max us':>9}")
    for label, parts in results.items():
        for part, numbers in parts.items():
            print(
                f"{label:<20} {part:<14} {numbers['p50_us']:>9.1f} {numbers['p99_us']:>9.1f} "
                f"{numbers['max_us']:>9.1f}"
            )


if __name__ == "__main__":
    main()
