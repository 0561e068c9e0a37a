"""The daemon's mirror of an engine keeps what the policies are shown of a request,
and says which arrivals its view has seen."""

from __future__ import annotations

import pytest

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.estimators.tool_time import ToolTimeEstimator
from sidecar.framework.types import Ordering, PressureOrder, StepView
from sidecar.jobs.tracker import JobTracker
from sidecar.policies.fcfs.policy import FcfsPolicy
from sidecar.runtime.decider import Decider, DecisionLog
from sidecar.runtime.engines import EngineRegistry
from sidecar.runtime.mirror import EngineMirror
from sidecar.runtime.recorder import Recorder
from sidecar.store.embedded import EmbeddedStore


def _event(request_id: str, kind: int, cached_tokens: int = 0) -> pb.RequestEvent:
    return pb.RequestEvent(request_id=request_id, kind=kind, at_s=1.0,
                           cached_tokens=cached_tokens)


def test_a_request_shows_the_prefix_cache_hit_of_its_first_admission() -> None:
    mirror = EngineMirror("e")
    mirror.apply(pb.StepReport(engine_id="e", seq=1, snapshot=True, now_s=1.0, new_requests=[
        pb.NewRequest(request_id="t2", job_id="agent", arrival_s=1.0, prompt_tokens=640,
                      state=pb.REQUEST_STATE_WAITING)]))
    (waiting,) = mirror.waiting()
    assert waiting.cached_tokens == 0, "not admitted yet"

    mirror.apply(pb.StepReport(engine_id="e", seq=2, now_s=2.0, events=[
        _event("t2", pb.EVENT_KIND_ADMITTED, cached_tokens=608)]))
    (running,) = mirror.running()
    assert running.cached_tokens == 608

    # Preempted, then resumed: a resumed request's ADMITTED event carries no hit, and
    # the first admission's stays.
    mirror.apply(pb.StepReport(engine_id="e", seq=3, now_s=3.0, events=[
        _event("t2", pb.EVENT_KIND_PREEMPTED)]))
    mirror.apply(pb.StepReport(engine_id="e", seq=4, now_s=4.0, events=[
        _event("t2", pb.EVENT_KIND_ADMITTED)]))
    (resumed,) = mirror.running()
    assert resumed.cached_tokens == 608


def test_the_waiting_demand_is_shown_when_the_plugin_reports_it() -> None:
    mirror = EngineMirror("e")
    kv = pb.KvCapacity(total_blocks=100, free_blocks=10, block_size_tokens=16)
    mirror.apply(pb.StepReport(engine_id="e", seq=1, snapshot=True, now_s=1.0, kv=kv))
    assert mirror.kv.waiting_demand_blocks is None, "an older plugin: unknown, not 0"
    kv.waiting_demand_blocks = 0
    mirror.apply(pb.StepReport(engine_id="e", seq=2, now_s=2.0, kv=kv))
    assert mirror.kv.waiting_demand_blocks == 0
    kv.waiting_demand_blocks = 37
    mirror.apply(pb.StepReport(engine_id="e", seq=3, now_s=3.0, kv=kv))
    assert mirror.kv.waiting_demand_blocks == 37


def _waiting(request_id: str, arrival_s: float) -> pb.NewRequest:
    return pb.NewRequest(request_id=request_id, job_id=request_id, arrival_s=arrival_s,
                         prompt_tokens=16, state=pb.REQUEST_STATE_WAITING)


def test_the_view_has_seen_the_arrivals_up_to_the_previous_report() -> None:
    mirror = EngineMirror("e")
    mirror.apply(pb.StepReport(engine_id="e", seq=1, snapshot=True, now_s=5.0))
    assert mirror.arrivals_seen_until_s == 5.0, "a first report: nothing before it"

    # The report that ends a step (now 5.3 s) is sent before the requests that
    # arrived during it are added: only what came before the step began is in it.
    mirror.apply(pb.StepReport(engine_id="e", seq=2, now_s=5.3))
    assert mirror.arrivals_seen_until_s == 5.0
    mirror.apply(pb.StepReport(engine_id="e", seq=3, now_s=5.31,
                               new_requests=[_waiting("late", 5.2)]))
    assert mirror.arrivals_seen_until_s == 5.3

    # An engine restarted under the same id: its clock went back, no previous report.
    mirror.apply(pb.StepReport(engine_id="e", seq=1, snapshot=True, now_s=0.5))
    assert mirror.arrivals_seen_until_s == 0.5


class _Recording(FcfsPolicy):
    """FCFS, keeping the views it is shown."""

    def __init__(self) -> None:
        super().__init__()
        self.views: list[StepView] = []

    def order_waiting(self, step: StepView) -> Ordering:
        self.views.append(step)
        return super().order_waiting(step)


def test_a_policy_is_shown_up_to_when_the_arrivals_are_seen() -> None:
    store = EmbeddedStore()
    policy = _Recording()
    recorder = Recorder(store, JobTracker(), ToolTimeEstimator(store), 100, 60.0)
    engines = EngineRegistry(Decider(policy, recorder, DecisionLog()))
    engines.handle(pb.StepReport(engine_id="e", seq=1, snapshot=True, now_s=2.0,
                                 new_requests=[_waiting("a", 1.9)]))
    engines.handle(pb.StepReport(engine_id="e", seq=2, now_s=2.25,
                                 new_requests=[_waiting("b", 2.1)]))
    first, second = policy.views
    assert (first.now_s, first.seen_until_s) == (2.0, 2.0)
    assert (second.now_s, second.seen_until_s) == (2.25, 2.0)


def test_a_policy_is_shown_the_prompt_tokens_the_engine_computes_a_second() -> None:
    store = EmbeddedStore()
    policy = _Recording()
    recorder = Recorder(store, JobTracker(), ToolTimeEstimator(store), 100, 60.0)
    engines = EngineRegistry(Decider(policy, recorder, DecisionLog()))
    # A step every 10 ms computing 24 prompt tokens: 2,400 a second.
    for seq in range(1, 201):
        engines.handle(pb.StepReport(
            engine_id="e", seq=seq, snapshot=seq == 1, now_s=1.0 + 0.01 * seq,
            new_requests=[_waiting(f"r{seq}", 1.0 + 0.01 * seq)],
            work=pb.StepWork(steps=1, busy_s=0.009, prefill_tokens=24, decode_seqs=3)))
    assert policy.views[0].prefill_tokens_per_s is None, "one report: no rate yet"
    assert policy.views[-1].prefill_tokens_per_s == pytest.approx(2_400, rel=0.01)
    # The engine restarted under the same id: its rate starts afresh.
    engines.handle(pb.StepReport(engine_id="e", seq=1, snapshot=True, now_s=0.5,
                                 new_requests=[_waiting("s", 0.4)]))
    assert policy.views[-1].prefill_tokens_per_s is None


class _ListsPins(FcfsPolicy):
    """Every pin may give way under pressure (FCFS pins none: this one is told of
    some)."""

    def order_pins_under_pressure(self, step: StepView) -> PressureOrder:
        return PressureOrder(tuple(p.request_id for p in step.pins), None, "all pins")


def test_a_pressure_order_that_empties_replaces_the_last_one() -> None:
    # The engine keeps the last order it got until a new one comes: an order that
    # empties must be sent, or the engine would release pins from the stale one.
    store = EmbeddedStore()
    recorder = Recorder(store, JobTracker(), ToolTimeEstimator(store), 100, 60.0)
    engines = EngineRegistry(Decider(_ListsPins(), recorder, DecisionLog()))
    pin = pb.PinState(request_id="p", job_id="j", blocks=4, pinned_at_s=1.0,
                      expires_at_s=9.0)
    held = engines.handle(pb.StepReport(engine_id="e", seq=1, snapshot=True, now_s=2.0,
                                        pins=[pin]))
    assert list(held.pressure_release_order.request_ids) == ["p"]
    gone = engines.handle(pb.StepReport(engine_id="e", seq=2, now_s=2.5,
                                        released_pins=["p"]))
    assert gone.HasField("pressure_release_order")
    assert list(gone.pressure_release_order.request_ids) == []
    same = engines.handle(pb.StepReport(engine_id="e", seq=3, now_s=3.0))
    assert not same.HasField("pressure_release_order"), "unchanged: not sent again"


def test_the_mirror_counts_the_blocks_its_pins_hold() -> None:
    mirror = EngineMirror("e")
    mirror.apply(pb.StepReport(engine_id="e", seq=1, snapshot=True, now_s=1.0, pins=[
        pb.PinState(request_id="p1", job_id="j1", blocks=3, expires_at_s=9.0),
        pb.PinState(request_id="p2", job_id="j2", blocks=5, expires_at_s=9.0)]))
    assert mirror.pinned_blocks == 8
    mirror.apply(pb.StepReport(engine_id="e", seq=2, now_s=2.0, released_pins=["p1"]))
    assert mirror.pinned_blocks == 5
    mirror.apply(pb.StepReport(engine_id="e", seq=3, snapshot=True, now_s=3.0))
    assert mirror.pinned_blocks == 0
