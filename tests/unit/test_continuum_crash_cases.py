"""The two inputs that crash vllm-continuum (KeyError on ``history[-1]["func_call"]``)
run clean here, through the tracker and every policy hook, as the runtime drives them:

1. requests with no job id;
2. several requests of one job in flight at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from sidecar.framework.protocols import Policy
from sidecar.framework.types import (
    FinishInput,
    KvView,
    PinView,
    RequestState,
    RequestView,
    RetainAction,
    StepView,
)
from sidecar.jobs.tracker import JobTracker, MeasuredToolTime, effective_job_id
from sidecar.policies.registry import available_policies, build_policy
from tests.unit.builders import distribution


@dataclass
class MiniEngine:
    """Just enough of the runtime: live requests, pins, the tracker, one policy."""

    policy: Policy
    free_blocks: int = 0
    tracker: JobTracker = field(default_factory=JobTracker)
    live: dict[str, RequestView] = field(default_factory=dict)
    pins: dict[str, PinView] = field(default_factory=dict)
    measured: list[MeasuredToolTime] = field(default_factory=list)
    # Per finished request: the pins held when it finished, and the other pins its
    # finish released (superseded as its job's older pins).
    held_at_finish: dict[str, set[str]] = field(default_factory=dict)
    superseded: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def arrive(self, request_id: str, job_id: str | None, at_s: float, last: bool = False) -> None:
        sample = self.tracker.on_arrival(job_id, request_id, at_s)
        if sample is not None:
            self.measured.append(sample)
        self.live[request_id] = RequestView(
            request_id=request_id,
            job_id=effective_job_id(job_id, request_id),
            is_last_step=last,
            arrival_s=at_s,
            prompt_tokens=64,
            state=RequestState.RUNNING,
        )

    def step(self, now_s: float) -> StepView:
        requests = list(self.live.values())
        pins = list(self.pins.values())
        jobs = self.tracker.views(r.job_id for r in requests)
        jobs.update(self.tracker.views(p.job_id for p in pins))
        view = StepView(
            engine_id="e",
            now_s=now_s,
            kv=KvView(total_blocks=100, free_blocks=self.free_blocks, block_size_tokens=16),
            waiting=tuple(requests),
            running=tuple(requests[:1]),
            pins=tuple(pins),
            jobs=jobs,
        )
        # Every per-step hook must accept the step and answer permutations of it.
        assert sorted(self.policy.order_waiting(view).request_ids) == sorted(self.live)
        assert list(self.policy.order_victims(view).request_ids) == [
            r.request_id for r in requests[:1]
        ]
        for release in (self.policy.expire(view), self.policy.release_under_pressure(view)):
            for request_id in release.request_ids:
                self.pins.pop(request_id, None)
        return view

    def finish(self, request_id: str, at_s: float, tool: str | None) -> RetainAction:
        request = self.live.pop(request_id)
        self.tracker.on_finish(request.job_id, request_id, at_s, tool, request.is_last_step)
        decision = self.policy.on_finish(
            FinishInput(
                step=self.step(at_s),
                request=request,
                output_tokens=8,
                blocks=4,
                tool=tool,
                tool_times=distribution(tool, [0.2, 0.3]) if tool else None,
                global_tool_times=distribution("*", [0.2, 0.3]),
            )
        )
        self.held_at_finish[request_id] = set(self.pins)
        self.superseded[request_id] = tuple(decision.release_pins)
        for old in decision.release_pins:
            self.pins.pop(old, None)
        if decision.action is RetainAction.PIN:
            self.pins[request_id] = PinView(
                request_id, request.job_id, 4, at_s, at_s + decision.ttl_s, tool
            )
        return decision.action


POLICIES = list(available_policies())


@pytest.mark.parametrize("name", POLICIES)
def test_requests_without_job_id_are_jobs_of_their_own(name: str) -> None:
    # Memory idle: the pins stay while the other job-less requests finish.
    engine = MiniEngine(build_policy(name, {}), free_blocks=100)
    engine.arrive("req-1", None, 0.0)
    engine.arrive("req-2", "", 0.5)  # an empty job id is no job id either
    engine.step(0.6)
    engine.finish("req-1", 1.0, tool="ls")
    engine.arrive("req-3", None, 1.1)
    engine.step(1.2)
    engine.finish("req-2", 1.3, tool=None)
    engine.finish("req-3", 1.4, tool="cat")
    engine.step(10.0)

    assert engine.measured == []  # a one-request job has no next turn to measure
    view = engine.tracker.view("req-1")
    assert view is not None
    assert (view.turns_finished, view.requests_in_flight) == (1, 0)
    # Nothing was shared between the job-less requests: no finish superseded another
    # request's pin. None was pinned either, though two ended with a tool call: a
    # request with no job has no next turn to keep its blocks for.
    assert engine.superseded == {"req-1": (), "req-2": (), "req-3": ()}
    assert engine.held_at_finish == {"req-1": set(), "req-2": set(), "req-3": set()}
    assert engine.pins == {}


@pytest.mark.parametrize("name", POLICIES)
def test_concurrent_requests_of_one_job(name: str) -> None:
    engine = MiniEngine(build_policy(name, {}))
    engine.arrive("a-1", "a", 0.0)
    engine.arrive("a-2", "a", 0.1)  # in flight together: Continuum's crash
    view = engine.tracker.view("a")
    assert view is not None and view.requests_in_flight == 2
    engine.step(0.2)
    first = engine.finish("a-1", 1.0, tool="ls")
    engine.arrive("a-3", "a", 1.1)  # arrives while a-2 still runs
    second = engine.finish("a-2", 1.2, tool="cat")
    engine.step(1.3)
    engine.arrive("a-4", "a", 1.5)
    engine.finish("a-3", 2.0, tool=None)
    engine.finish("a-4", 2.5, tool=None)
    engine.step(3.0)

    # Tool times: a-3 ends the ls call (1.1 - 1.0), a-4 the cat call (1.5 - 1.2).
    assert [(m.tool, round(m.duration_s, 6)) for m in engine.measured] == [
        ("ls", 0.1),
        ("cat", 0.3),
    ]
    view = engine.tracker.view("a")
    assert view is not None
    assert (view.turns_finished, view.requests_in_flight) == (4, 0)
    if name == "fcfs":
        assert engine.pins == {}
    else:
        if name in ("continuum", "contextserve"):
            assert first is second is RetainAction.PIN
        else:  # adaptive: no free block and requests waiting: a pin may not repay
            assert {first, second} <= {RetainAction.PIN, RetainAction.SOFT_RETAIN}
        # Each finish superseded the job's older pin: at most one pin per job.
        assert len([p for p in engine.pins.values() if p.job_id == "a"]) <= 1
