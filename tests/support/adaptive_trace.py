"""Seeded step sequences that drive a policy as the daemon's decider does, and a digest
of every decision it makes along them: what ``tests/unit/test_adaptive_equivalence.py``
compares against ``tests/golden/adaptive_decisions.json``, so that a change meant to
make ``adaptive`` cheaper is shown not to change what it decides.

A scenario is a small engine: agent jobs arrive, wait, are admitted in the policy's
order while their blocks fit, decode, finish a turn (the policy pins, soft-retains or
releases it), run a tool whose measured durations build the tools' distributions, and
come back; pins end as the policy releases or expires them, or when their job's next
turn is admitted. The policy's answers feed back into the next step, so a decision
that differs changes the rest of the sequence, and each scenario starts from one seed.

    python -m tests.support.adaptive_trace --write   # regenerate the golden digests
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from sidecar.estimators.sketch import LogBucketSketch, add_increments
from sidecar.framework.protocols import Policy
from sidecar.framework.types import (
    EngineCost,
    FinishInput,
    JobView,
    KvView,
    Ordering,
    PinRelease,
    PinView,
    PressureOrder,
    RequestState,
    RequestView,
    RetainAction,
    RetainDecision,
    StepView,
    ToolTimeDistribution,
)
from sidecar.policies.registry import build_policy

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "adaptive_decisions.json"
BLOCK_TOKENS = 16
TOOLS = ("ls", "cat", "grep", "pytest", "pip install")
# Median seconds of each tool (log-normal around it).
TOOL_MEDIAN_S = {"ls": 0.1, "cat": 0.15, "grep": 0.3, "pytest": 3.0, "pip install": 6.0}


@dataclass(frozen=True)
class Scenario:
    """One engine's load: how many blocks, how fast jobs arrive, which reports carry
    what (waiting demand, learned cost, prefill rate)."""

    name: str
    seed: int
    steps: int
    total_blocks: int
    jobs_per_s: float
    max_running: int
    demand_reported: bool = True
    engine_cost: bool = False
    late_answers: bool = False
    params: dict[str, object] = field(default_factory=dict)


SCENARIOS = (
    # Memory mostly idle: arrival order while the engine keeps up, pins valued at 0.
    Scenario("roomy", seed=1, steps=300, total_blocks=2400, jobs_per_s=3.0, max_running=24),
    # Memory short: overdue requests, pins released and forced out for a head.
    Scenario("short", seed=2, steps=300, total_blocks=700, jobs_per_s=9.0, max_running=32,
             engine_cost=True),
    # Overloaded: a backlog builds, requests go overdue, pins give way for them.
    Scenario("overload", seed=4, steps=300, total_blocks=900, jobs_per_s=14.0,
             max_running=40, engine_cost=True,
             params={"fair_share_multiple": 0.6, "min_fair_share_s": 0.3}),
    # An older plugin (no waiting demand), answers running late, a fixed prefill cost.
    Scenario("legacy", seed=3, steps=250, total_blocks=1000, jobs_per_s=6.0, max_running=20,
             demand_reported=False, late_answers=True,
             params={"prefill_s_per_token": 2e-4, "job_age_credit_s": 5.0}),
)


@dataclass
class _Job:
    job_id: str
    first_arrival_s: float
    turns: int
    turn: int = 0
    prompt_tokens: int = 0
    turns_finished: int = 0
    back_at_s: float | None = None  # its tool ends then (None: not in a tool)
    tool: str | None = None
    tool_started_s: float = 0.0


@dataclass
class _Live:
    view: RequestView
    decode_steps_left: int
    blocks: int = 0  # held while running


class _Engine:
    """The engine and the daemon's view of it, as far as the policy can tell."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.rng = random.Random(scenario.seed)
        self.now_s = 100.0
        self.seen_until_s = self.now_s
        self.jobs: dict[str, _Job] = {}
        self.waiting: dict[str, _Live] = {}
        self.running: dict[str, _Live] = {}
        self.pins: dict[str, PinView] = {}
        self.samples: dict[str, list[float]] = {}
        self.distributions: dict[str, ToolTimeDistribution] = {}
        self.pooled: ToolTimeDistribution | None = None
        self.next_job = 0
        self.next_arrival_s = self.now_s
        self.stalled = False

    # --- the step's view --------------------------------------------------------------

    def free_blocks(self) -> int:
        used = sum(live.blocks for live in self.running.values())
        used += sum(pin.blocks for pin in self.pins.values())
        return max(self.scenario.total_blocks - used, 0)

    def view(self, engine_id: str) -> StepView:
        scenario = self.scenario
        waiting = tuple(live.view for live in self.waiting.values())
        running = tuple(live.view for live in self.running.values())
        demand = None
        if scenario.demand_reported:
            pinned: dict[str, int] = {}
            for pin in self.pins.values():
                pinned[pin.job_id] = pinned.get(pin.job_id, 0) + pin.blocks
            demand = sum(max(-(-r.prompt_tokens // BLOCK_TOKENS) - pinned.get(r.job_id, 0), 0)
                         for r in waiting)
        # Every ninth job is one the tracker sent no view for (policies fall back on
        # its requests' arrivals).
        jobs = {job_id: JobView(job_id, job.first_arrival_s, job.turns_finished)
                for job_id, job in self.jobs.items() if not job_id.endswith("9")}
        tool_times = {pin.tool: self.distributions[pin.tool] for pin in self.pins.values()
                      if pin.tool in self.distributions}
        cost = (EngineCost(1.1e-4, 2e-3, 0.012, 50, 0.1) if scenario.engine_cost
                and self.now_s > 103.0 else None)
        return StepView(
            engine_id=engine_id,
            now_s=self.now_s,
            kv=KvView(scenario.total_blocks, self.free_blocks(), BLOCK_TOKENS,
                      admission_stalled=self.stalled, waiting_demand_blocks=demand),
            waiting=waiting,
            running=running,
            pins=tuple(self.pins.values()),
            jobs=jobs,
            tool_times=tool_times,
            global_tool_times=self.pooled,
            engine_cost=cost,
            arrivals_seen_until_s=self.seen_until_s,
            prefill_tokens_per_s=None if self.now_s < 101.0 else 2000.0 + 1500.0 * (
                len(self.waiting) > 10),
            late_answer_share=(0.2 if self.now_s % 10 < 5 else 0.0)
            if scenario.late_answers else None,
        )

    # --- what happens between steps ---------------------------------------------------

    def arrive(self, until_s: float) -> None:
        rng = self.rng
        while self.next_arrival_s <= until_s:  # Poisson arrivals of new jobs
            job_id = f"job-{self.next_job}"
            self.next_job += 1
            arrival_s = self.next_arrival_s
            self.next_arrival_s += rng.expovariate(self.scenario.jobs_per_s)
            job = self.jobs[job_id] = _Job(job_id, arrival_s, turns=rng.randrange(1, 6),
                                            prompt_tokens=rng.randrange(100, 900))
            self._send_turn(job, arrival_s)
        for job in self.jobs.values():
            if job.back_at_s is not None and job.back_at_s <= until_s:
                assert job.tool is not None
                self.samples.setdefault(job.tool, []).append(job.back_at_s - job.tool_started_s)
                self._distributions_changed(job.tool)
                job.prompt_tokens += rng.randrange(50, 400)
                self._send_turn(job, job.back_at_s)
        self.seen_until_s = until_s

    def _send_turn(self, job: _Job, arrival_s: float) -> None:
        job.back_at_s = None
        request_id = f"{job.job_id}/{job.turn}"
        view = RequestView(request_id, job.job_id, job.turn == job.turns - 1, arrival_s,
                           job.prompt_tokens, RequestState.WAITING,
                           tool_hint=None)
        self.waiting[request_id] = _Live(view, decode_steps_left=self.rng.randrange(2, 12))

    def _distributions_changed(self, tool: str) -> None:
        self.distributions[tool] = _distribution(tool, self.samples[tool])
        every = [s for samples in self.samples.values() for s in samples]
        self.pooled = _distribution("*", every)

    def admit(self, order: Ordering) -> None:
        free = self.free_blocks()
        admitted_any = False
        for request_id in order.request_ids:
            if len(self.running) >= self.scenario.max_running:
                break
            live = self.waiting[request_id]
            # The job's pin is reused and ends with the admission.
            job_pins = [pin for pin in self.pins.values() if pin.job_id == live.view.job_id]
            reused = sum(pin.blocks for pin in job_pins)
            need = max(-(-live.view.prompt_tokens // BLOCK_TOKENS) - reused, 0) + 1
            if need > free:
                break  # vLLM admits in order and stops at the first that does not fit
            for pin in job_pins:
                del self.pins[pin.request_id]
            free -= need
            live.blocks = need + reused
            cached = min(reused * BLOCK_TOKENS, live.view.prompt_tokens)
            live.view = replace(live.view, state=RequestState.RUNNING, computed_tokens=cached,
                                cached_tokens=cached)
            self.running[request_id] = self.waiting.pop(request_id)
            admitted_any = True
        self.stalled = bool(self.waiting) and not admitted_any and not self.running

    def preempt(self, victims: Ordering) -> None:
        """While the pool is over-full, the first victims go back to waiting."""
        for request_id in victims.request_ids:
            used = sum(live.blocks for live in self.running.values())
            used += sum(pin.blocks for pin in self.pins.values())
            if used <= self.scenario.total_blocks:
                return
            live = self.running.pop(request_id)
            live.blocks = 0
            live.view = replace(live.view, state=RequestState.WAITING, computed_tokens=0)
            self.waiting[request_id] = live

    def decode(self) -> list[_Live]:
        """One decode step: each running request grows; those done finish."""
        finished = []
        for request_id, live in list(self.running.items()):
            live.decode_steps_left -= 1
            if self.rng.random() < 0.3:
                live.blocks += 1
            if live.decode_steps_left <= 0:
                finished.append(self.running.pop(request_id))
        return finished

    def end_turn(self, live: _Live) -> tuple[str | None, int]:
        """The job goes into its tool (or ends); answers (its tool, output tokens)."""
        job = self.jobs[live.view.job_id]
        job.turn += 1
        job.turns_finished += 1
        output_tokens = self.rng.randrange(10, 150)
        job.prompt_tokens = live.view.prompt_tokens + output_tokens
        if live.view.is_last_step:
            del self.jobs[job.job_id]
            return None, output_tokens
        job.tool = TOOLS[self.rng.randrange(len(TOOLS))]
        job.tool_started_s = self.now_s
        job.back_at_s = self.now_s + self.rng.lognormvariate(0.0, 0.7) * TOOL_MEDIAN_S[job.tool]
        return job.tool, output_tokens


def _distribution(tool: str, samples_s: list[float]) -> ToolTimeDistribution:
    sketch = LogBucketSketch()
    fields: dict[str, float] = {}
    for sample in samples_s:
        add_increments(fields, sketch.increments(sample))
    distribution = sketch.distribution(tool, fields)
    assert distribution is not None
    return distribution


# --- what the policy answered, as text ------------------------------------------------


def _ordering(name: str, order: Ordering) -> str:
    return f"{name} {','.join(order.request_ids)} | {order.reason}"


def _release(name: str, release: PinRelease) -> str:
    priorities = ",".join(f"{rid}={priority}" for rid, priority
                          in sorted(release.retention_priorities.items()))
    return f"{name} {','.join(release.request_ids)} [{priorities}] | {release.reason}"


def _pressure(order: PressureOrder) -> str:
    return f"pressure {','.join(order.request_ids)} {order.max_running} | {order.reason}"


def _retain(request_id: str, decision: RetainDecision) -> str:
    return (f"finish {request_id} {decision.action.value} {decision.ttl_s!r} "
            f"{decision.retention_priority} {','.join(decision.release_pins)} | "
            f"{decision.reason}")


def run(scenario: Scenario, policy: Policy | None = None) -> Iterator[list[str]]:
    """Each step's decisions, as lines of text, in the order the decider asks for
    them; the engine applies them before the next step."""
    policy = policy if policy is not None else build_policy("adaptive", scenario.params)
    engine = _Engine(scenario)
    finished: list[_Live] = []
    for index in range(scenario.steps):
        engine.now_s += engine.rng.uniform(0.01, 0.12)
        engine.arrive(engine.now_s - engine.rng.uniform(0.0, 0.01))
        # Every 50th step comes from a second engine behind the same daemon.
        engine_id = "engine-b" if index % 50 == 49 else "engine-a"
        step = engine.view(engine_id)
        lines = [f"step {index} {engine.now_s!r} provisional_cache "
                 f"{policy.caches_provisional_pins(step)}"]
        for live in finished:
            tool, output_tokens = engine.end_turn(live)
            distribution = engine.distributions.get(tool) if tool else None
            decision = policy.on_finish(FinishInput(
                step=step, request=live.view, output_tokens=output_tokens,
                blocks=live.blocks, tool=tool, tool_times=distribution,
                global_tool_times=engine.pooled))
            lines.append(_retain(live.view.request_id, decision))
            for old in decision.release_pins:
                engine.pins.pop(old, None)
            if decision.action is RetainAction.PIN and decision.ttl_s > 0:
                engine.pins[live.view.request_id] = PinView(
                    live.view.request_id, live.view.job_id, live.blocks, engine.now_s,
                    engine.now_s + decision.ttl_s, tool)
            step = replace(step, pins=tuple(engine.pins.values()))
        for name, hook in (("expire", policy.expire),
                           ("release", policy.release_under_pressure)):
            release = hook(step)
            lines.append(_release(name, release))
            if release.request_ids:
                for request_id in release.request_ids:
                    engine.pins.pop(request_id, None)
                step = replace(step, pins=tuple(engine.pins.values()))
        waiting = policy.order_waiting(step)
        victims = policy.order_victims(step)
        lines += [_ordering("waiting", waiting), _ordering("victims", victims),
                  _pressure(policy.order_pins_under_pressure(step))]
        yield lines
        engine.admit(waiting)
        engine.preempt(victims)
        finished = engine.decode()


def digests(scenario: Scenario) -> list[str]:
    """A short digest of each step's decisions."""
    return [hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
            for lines in run(scenario)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help=f"write the digests to {GOLDEN.name} (else print a summary)")
    args = parser.parse_args()
    golden = {scenario.name: digests(scenario) for scenario in SCENARIOS}
    if args.write:
        GOLDEN.write_text(json.dumps(golden, indent=0) + "\n")
        print(f"wrote {GOLDEN}")
    for name, steps in golden.items():
        print(f"{name}: {len(steps)} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
