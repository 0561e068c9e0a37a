"""One point of the twin: a workload through one policy on the simulated GPU engine,
the policy deciding in a real daemon (or vLLM's own scheduler, ``native``), summarized
in the reference benchmark's schema."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from benchmarks.twin import workload as wl
from benchmarks.twin.steptime import LLAMA_31_8B, RTX_5090, Efficiency, StepTimeModel


def make_workload(kind: str, jobs_per_s: float, seed: int, duration_s: float | None,
                  num_jobs: int | None, answer_agreement: float) -> wl.Workload:
    return wl.generate(kind, jobs_per_s, seed=seed, duration_s=duration_s, num_jobs=num_jobs,
                       answer_agreement=answer_agreement)


def run_point(workload: wl.Workload, policy: str, jobs_per_s: float, num_blocks: int,
              efficiency: Efficiency, params: Sequence[str] = (),
              progress: bool = False) -> tuple[dict[str, Any], float]:
    """One simulation; the result (reference schema + extras) and its wall time."""
    from benchmarks.twin.daemon import learned_step_costs, running_daemon
    from benchmarks.twin.metrics import summarize
    from benchmarks.twin.simulator import EngineConfig, VirtualClock, build_engine, simulate

    config = EngineConfig(num_blocks=num_blocks)
    if workload.max_context_tokens > config.max_model_len:
        raise SystemExit(f"workload: a context of {workload.max_context_tokens} tokens "
                         f"exceeds max_model_len {config.max_model_len}")
    step_model = StepTimeModel.derive(RTX_5090, LLAMA_31_8B, efficiency)
    clock = VirtualClock()
    say = (lambda line: print(f"  [{policy} {jobs_per_s:g} jps] {line}", file=sys.stderr,
                              flush=True)) if progress else None
    learned: list[dict[str, Any]] = []
    if policy == "native":
        scheduler = build_engine(policy, config, clock, None)
        result = simulate(workload, scheduler, step_model, config, clock, progress=say)
    else:
        with running_daemon(policy, params) as daemon:
            scheduler = build_engine(policy, config, clock, daemon.address)
            try:
                result = simulate(workload, scheduler, step_model, config, clock,
                                  progress=say)
                learned = learned_step_costs(daemon.address)
            finally:
                scheduler.shutdown()
    fallback_steps = result.plugin_counters.get("fallback_steps", 0)
    if fallback_steps:
        raise RuntimeError(f"{policy} at {jobs_per_s:g} jobs/s: {fallback_steps} steps ran "
                           "without the daemon's decision: not a measurement of the policy")
    summary = summarize(result, policy, jobs_per_s)
    # What the daemon learned a step costs, against the model that timed the steps.
    summary["learned_step_cost"] = learned
    summary["setup"] = {
        "workload": workload.name,
        "workload_generator": workload.generator,
        "policy_params": list(params),
        "engine": asdict(config),
        "gpu": asdict(RTX_5090),
        "model": LLAMA_31_8B.name,
        "efficiency": asdict(efficiency),
        "step_time_model": step_model.as_dict(),
    }
    return summary, result.wall_s
