"""What the plugin adds to each engine step, measured side by side with vLLM's own scheduler.

Four copies of vLLM's real ``Scheduler`` (no model, no worker) run the same steady
workload, step by step, interleaved so that they share the machine's conditions:

- ``native``       vLLM's scheduler, PRIORITY policy, no plugin;
- ``plugin_tcp``   KvtetherScheduler with the daemon over TCP (continuum policy, or
                   ``--policy``);
- ``plugin_unix``  the same over a Unix socket;
- ``fallback``     the plugin with the daemon unreachable (fail-open).

The steady state is 150 running and 200 waiting requests (``max_num_seqs`` caps the
running set; every finished request is replaced by a new arrival). Timed per step:
``schedule()`` + ``update_from_output()``, the engine-thread work the plugin touches.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from benchmarks.common.stats import percentile

MODES = ("native", "plugin_tcp", "plugin_unix", "fallback")


@dataclass
class LoadShape:
    running: int = 150
    waiting: int = 200
    prompt_tokens: int = 256
    output_tokens: int = 64
    block_size: int = 16
    turns_per_job: int = 4
    seed: int = 0

    @property
    def num_blocks(self) -> int:
        per_request = -(-(self.prompt_tokens + self.output_tokens) // self.block_size) + 1
        # Room for the running set, pins of finished turns, and headroom.
        return self.running * per_request * 2


@dataclass
class Arrivals:
    """The same request stream for every mode: agent jobs of a few turns; a job's turns
    share their first tokens (prefix caching and pins matter) and differ at the end."""

    shape: LoadShape
    rng: random.Random = field(init=False)
    job_counter: int = 0
    # Open jobs: job id -> (next turn, the job's base prompt).
    jobs: dict[str, tuple[int, list[int]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.shape.seed)

    def next(self) -> tuple[str, list[int], dict[str, Any]]:
        shape = self.shape
        if len(self.jobs) > 8 and self.rng.random() < 0.6:
            job_id = self.rng.choice(sorted(self.jobs))
            turn, base = self.jobs[job_id]
        else:
            self.job_counter += 1
            job_id = f"job-{self.job_counter}"
            turn = 0
            base = [self.rng.randrange(2, 2000) for _ in range(shape.prompt_tokens)]
        tail = [self.rng.randrange(2, 2000) for _ in range(16)]
        prompt = base[: shape.prompt_tokens - len(tail)] + tail
        last = turn + 1 >= shape.turns_per_job
        if last:
            self.jobs.pop(job_id, None)
        else:
            self.jobs[job_id] = (turn + 1, base)
        extra = {"job_id": job_id, "is_last_step": int(last), "tool": "ls"}
        return f"{job_id}-t{turn}", prompt, extra


class SteadyEngine:
    """One scheduler kept at the load shape, stepped on demand."""

    def __init__(self, mode: str, model_dir: Any, shape: LoadShape, env: dict[str, str]) -> None:
        from tests.support.scheduler import build_scheduler

        self.mode = mode
        self.shape = shape
        scheduler_cls = None
        if mode != "native":
            from vllm_plugin.scheduler import KvtetherScheduler

            scheduler_cls = KvtetherScheduler
            os.environ.update(env)
        self.sched = build_scheduler(model_dir, num_blocks=shape.num_blocks,
                                     block_size=shape.block_size, scheduler_cls=scheduler_cls,
                                     max_num_seqs=shape.running,
                                     max_num_batched_tokens=8192, max_model_len=4096)
        self.arrivals = Arrivals(shape)
        self.clock_s = 1_000.0
        self.step_times_s: list[float] = []
        # Each waiting-demand count the plugin ran, timed (its share of the steps).
        self.demand_count_s: list[float] = []
        self.recording = False
        agent = self.agent
        if agent is not None and agent.waiting_demand.supported:
            count = agent.waiting_demand.count

            def timed_count() -> int:
                started = time.perf_counter()
                blocks = count()
                if self.recording:
                    self.demand_count_s.append(time.perf_counter() - started)
                return int(blocks)

            agent.waiting_demand.count = timed_count

    @property
    def agent(self) -> Any:
        return getattr(self.sched, "kvtether", None)

    def top_up(self) -> None:
        from tests.support.scheduler import make_request

        target = self.shape.running + self.shape.waiting
        while len(self.sched.requests) < target:
            request_id, prompt, extra = self.arrivals.next()
            self.clock_s += 0.001
            self.sched.add_request(make_request(
                request_id, prompt, self.shape.output_tokens, self.shape.block_size,
                arrival_time=self.clock_s, extra_args=extra))

    def step(self, record: bool, forward_s: float = 0.0) -> None:
        from tests.support.scheduler import model_output

        self.top_up()
        self.recording = record
        started = time.perf_counter()
        output = self.sched.schedule()
        scheduled = time.perf_counter()
        fake = model_output(self.sched, output)  # the worker's part: not timed
        if forward_s > 0:
            # The forward pass: EngineCore waits on the workers (GIL released) while the
            # link's thread receives the daemon's answer.
            time.sleep(forward_s)
        resumed = time.perf_counter()
        self.sched.update_from_output(output, fake)
        done = time.perf_counter()
        if record:
            self.step_times_s.append((scheduled - started) + (done - resumed))


def interleaved(engines: list[SteadyEngine], steps: int, warmup: int,
                forward_s: float = 0.0) -> Iterator[int]:
    for index in range(warmup + steps):
        # Rotate the order so no mode always runs right after another.
        offset = index % len(engines)
        for engine in engines[offset:] + engines[:offset]:
            engine.step(record=index >= warmup, forward_s=forward_s)
        yield index


def summarize(engines: dict[str, SteadyEngine]) -> dict[str, Any]:
    native = engines["native"].step_times_s
    native_p50 = statistics.median(native)
    result: dict[str, Any] = {}
    for mode, engine in engines.items():
        times = engine.step_times_s
        # Paired per step: the same step index ran the same workload in every mode.
        added = [t - n for t, n in zip(times, native, strict=False)]
        entry: dict[str, Any] = {
            "steps": len(times),
            "step_ms_p50": statistics.median(times) * 1e3,
            "step_ms_p99": percentile(times, 0.99) * 1e3,
            "running": len(engine.sched.running),
            "waiting": len(engine.sched.waiting),
        }
        if mode != "native":
            entry.update({
                "added_ms_p50": statistics.median(added) * 1e3,
                "added_ms_p99": percentile(added, 0.99) * 1e3,
                "added_ratio_p50": statistics.median(added) / native_p50,
            })
            agent = engine.agent
            if agent is not None:
                total = sum(agent.lag_counts)
                cumulative = 0
                lag_p99 = len(agent.lag_counts) - 1
                for lag, count in enumerate(agent.lag_counts):
                    cumulative += count
                    if total and cumulative / total >= 0.99:
                        lag_p99 = lag
                        break
                entry.update({
                    "decisions_applied": total,
                    "decision_lag_steps_histogram": list(agent.lag_counts),
                    "decision_lag_steps_p99": lag_p99 if total else None,
                    "fallback_steps": agent.counters.fallback_steps,
                    "pins_held_at_end": len(agent.pins),
                    "demand_counts_per_step": len(engine.demand_count_s) / max(1, len(times)),
                    "demand_count_ms_p50": (statistics.median(engine.demand_count_s) * 1e3
                                            if engine.demand_count_s else None),
                })
        result[mode] = entry
    return result
