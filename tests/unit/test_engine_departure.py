"""Engines come and go with pods (the plugin's default id, ``host:pid``, is new at every
restart). The daemon keeps what it learned of an engine through a short absence and
forgets it — the policy's state, the step cost, the mirror, the metric series — once the
engine has had no session and sent no report for ``engine_forget_after_s``."""

from __future__ import annotations

import random

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.estimators.tool_time import ToolTimeEstimator
from sidecar.jobs.tracker import JobTracker
from sidecar.policies.adaptive.policy import AdaptivePolicy
from sidecar.policies.registry import build_policy
from sidecar.runtime.decider import Decider, DecisionLog
from sidecar.runtime.engines import EngineRegistry, EngineStream
from sidecar.runtime.recorder import Recorder
from sidecar.store.embedded import EmbeddedStore
from sidecar.telemetry.metrics import REGISTRY
from tests.unit.test_step_cost import reports

FORGET_AFTER_S = 600.0
KV = pb.KvCapacity(total_blocks=400, free_blocks=300, block_size_tokens=16)


class Clock:
    def __init__(self) -> None:
        self.now_s = 1_000.0

    def __call__(self) -> float:
        return self.now_s


def registry(clock: Clock) -> tuple[EngineRegistry, AdaptivePolicy]:
    policy = build_policy("adaptive", {})
    assert isinstance(policy, AdaptivePolicy)
    store = EmbeddedStore()
    recorder = Recorder(store, JobTracker(), ToolTimeEstimator(store), 100, 60.0)
    engines = EngineRegistry(Decider(policy, recorder, DecisionLog()),
                             forget_after_s=FORGET_AFTER_S, clock_s=clock)
    return engines, policy


def engine_series(engine_id: str) -> set[str]:
    """The names of the daemon's metric series labelled with this engine."""
    return {sample.name for family in REGISTRY.collect() for sample in family.samples
            if sample.labels.get("engine_id") == engine_id}


SESSION_SERIES = {"kvtether_engine_fallback_steps_total",
                  "kvtether_engine_answer_lag_steps_bucket",
                  "kvtether_engine_answer_lag_steps_count",
                  "kvtether_engine_idle_waits_total", "kvtether_engine_idle_waits_missed_total",
                  "kvtether_engine_kv_hint_actions_ignored_total",
                  "kvtether_engine_kv_hint_fields_refused_total",
                  "kvtether_engine_finished_turns_cached",
                  "kvtether_engine_late_answer_ratio",
                  "kvtether_engine_prefill_time_ratio",
                  "kvtether_engine_provisional_block_seconds_total"}
LEARNED_SERIES = {"kvtether_engine_prefill_seconds_per_token", "kvtether_engine_step_seconds",
                  "kvtether_engine_decode_seconds_per_request", "kvtether_engine_steps_total"}


def run_engine(engines: EngineRegistry, engine_id: str, session: EngineStream | None,
               seq: int = 1, reports_count: int = 200) -> int:
    """A snapshot, then a report a step: jobs' turns arrive, run and finish with a
    tool call, the engine's counters and timed work ride along. Answers the last seq."""
    rng = random.Random(engine_id)
    works = reports(rng, reports_count)
    for index, work in enumerate(works):
        now_s = 0.05 * (seq + index)
        report = pb.StepReport(
            engine_id=engine_id, seq=seq + index, snapshot=index == 0, now_s=now_s, kv=KV,
            work=pb.StepWork(steps=work.steps, busy_s=work.busy_s,
                             prefill_tokens=work.prefill_tokens, decode_seqs=work.decode_seqs),
            counters=pb.EngineCounters(fallback_steps=index // 50,
                                       answers_by_lag_steps=[0, index, 1],
                                       provisional_block_seconds=0.5 * index))
        turn = index // 4
        request_id = f"{engine_id}-r{turn}"
        if index % 4 == 0:
            report.new_requests.append(pb.NewRequest(
                request_id=request_id, job_id=f"{engine_id}-j{turn % 5}", arrival_s=now_s,
                prompt_tokens=320, state=pb.REQUEST_STATE_WAITING))
        elif index % 4 == 1:
            report.events.append(pb.RequestEvent(request_id=request_id,
                                                 kind=pb.EVENT_KIND_ADMITTED, at_s=now_s))
        elif index % 4 == 3:
            report.events.append(pb.RequestEvent(
                request_id=request_id, kind=pb.EVENT_KIND_FINISHED, at_s=now_s,
                finish_reason=pb.FINISH_REASON_STOP, output_tokens=8, tool="grep",
                blocks=20))
        decision = engines.handle(report, session)
        assert not decision.resync_requested
    return seq + len(works) - 1


def test_an_engine_that_reconnects_carries_on_with_what_was_learned() -> None:
    clock = Clock()
    engines, policy = registry(clock)
    session = EngineStream()
    seq = run_engine(engines, "pod-a", session)
    assert engine_series("pod-a") == SESSION_SERIES | LEARNED_SERIES
    assert "pod-a" in policy.engines_known()

    engines.disconnect("pod-a", session)
    # The session's counters go with it (a new session counts afresh); the step cost
    # and the policy's state stay for the engine's return.
    assert engine_series("pod-a") == LEARNED_SERIES
    assert "pod-a" in engines.step_cost_estimates() and "pod-a" in policy.engines_known()
    clock.now_s += FORGET_AFTER_S - 1
    assert engines.forget_departed() == []

    back = EngineStream()
    run_engine(engines, "pod-a", back, seq=seq + 1, reports_count=8)  # back in time
    clock.now_s += 10 * FORGET_AFTER_S
    assert engines.forget_departed() == [], "an engine with a session open is kept"
    assert "pod-a" in policy.engines_known()
    engines.disconnect("pod-a", back)  # silent for long, but it left only now
    assert engines.forget_departed() == []
    clock.now_s += FORGET_AFTER_S
    assert engines.forget_departed() == ["pod-a"]


def test_engines_gone_for_forget_after_s_are_forgotten_whole() -> None:
    clock = Clock()
    engines, policy = registry(clock)
    left = [f"pod-{n}" for n in range(6)]  # a rolling restart: new ids, old ones gone
    for engine_id in left:
        session = EngineStream()
        run_engine(engines, engine_id, session)
        engines.disconnect(engine_id, session)
    stays = EngineStream()
    run_engine(engines, "pod-new", stays)
    assert set(left) <= policy.engines_known()

    clock.now_s += FORGET_AFTER_S
    assert sorted(engines.forget_departed()) == left
    for engine_id in left:
        assert engine_series(engine_id) == set(), f"{engine_id}'s series outlived it"
        assert engine_id not in engines.step_cost_estimates()
    assert policy.engines_known() == {"pod-new"}
    assert engine_series("pod-new") == SESSION_SERIES | LEARNED_SERIES
    assert engines.forget_departed() == []


def test_an_engine_without_a_session_is_forgotten_once_silent_and_resyncs() -> None:
    """The unary Step call has no session to end: silence alone tells it went. If it
    was only quiet, its next report is answered with a request for a snapshot."""
    clock = Clock()
    engines, policy = registry(clock)
    seq = run_engine(engines, "unary", None, reports_count=40)
    clock.now_s += FORGET_AFTER_S / 2
    assert engines.forget_departed() == []
    clock.now_s += FORGET_AFTER_S / 2
    assert engines.forget_departed() == ["unary"]
    assert "unary" not in engines.mirrors and "unary" not in policy.engines_known()
    late = engines.handle(pb.StepReport(engine_id="unary", seq=seq + 1, now_s=9.0, kv=KV))
    assert late.resync_requested


def live_snapshot(engine_id: str, live_requests: int) -> pb.StepReport:
    """An engine's first report: ``live_requests`` turns of as many jobs, all running."""
    report = pb.StepReport(engine_id=engine_id, seq=1, snapshot=True, now_s=1.0, kv=KV)
    for index in range(live_requests):
        report.new_requests.append(pb.NewRequest(
            request_id=f"{engine_id}-r{index}", job_id=f"{engine_id}-j{index}",
            arrival_s=0.5, prompt_tokens=64, state=pb.REQUEST_STATE_RUNNING))
    return report


def bounded_registry(clock: Clock, max_jobs: int) -> tuple[EngineRegistry, JobTracker]:
    store = EmbeddedStore()
    tracker = JobTracker(max_jobs=max_jobs)
    recorder = Recorder(store, tracker, ToolTimeEstimator(store), 100, 60.0)
    engines = EngineRegistry(Decider(build_policy("fcfs", {}), recorder, DecisionLog()),
                             forget_after_s=FORGET_AFTER_S, clock_s=clock)
    return engines, tracker


def test_jobs_of_departed_engines_do_not_outgrow_max_jobs_tracked() -> None:
    """Bound 200; five engines with 150 live requests each disconnect (their pods were
    replaced): once they are gone, the daemon holds at most the bound, not 950 jobs
    whose requests it can never see finish."""
    clock = Clock()
    engines, tracker = bounded_registry(clock, max_jobs=200)
    for index in range(200):  # idle jobs of earlier traffic fill the bound
        tracker.on_arrival(f"old-{index}", f"old-r{index}", 0.0)
        tracker.on_finish(f"old-{index}", f"old-r{index}", 0.1, None)
    for index in range(5):
        session = EngineStream()
        engines.handle(live_snapshot(f"pod-{index}", 150), session)
        engines.disconnect(f"pod-{index}", session)
    clock.now_s += FORGET_AFTER_S
    assert sorted(engines.forget_departed()) == [f"pod-{index}" for index in range(5)]
    assert len(tracker) <= 200
    for index in range(5):  # what is kept of them is no longer in flight
        view = tracker.view(f"pod-{index}-j0")
        assert view is None or view.requests_in_flight == 0


def test_a_reconnect_within_the_forget_window_counts_each_turn_once() -> None:
    """The engine resends its live requests in the reconnect's snapshot: they are in
    flight again, and a request that finishes afterwards is one turn, with the tool
    time of its job measured once."""
    clock = Clock()
    engines, tracker = bounded_registry(clock, max_jobs=200)
    first = EngineStream()
    engines.handle(live_snapshot("pod-a", 3), first)
    engines.handle(pb.StepReport(engine_id="pod-a", seq=2, now_s=2.0, kv=KV, events=[
        pb.RequestEvent(request_id="pod-a-r0", kind=pb.EVENT_KIND_FINISHED, at_s=2.0,
                        finish_reason=pb.FINISH_REASON_STOP, tool="pytest")]), first)
    engines.disconnect("pod-a", first)
    view = tracker.view("pod-a-j1")
    assert view is not None and view.requests_in_flight == 0

    back = EngineStream()
    reconnect = live_snapshot("pod-a", 3)
    del reconnect.new_requests[0]  # r0 finished before the engine left
    reconnect.now_s = 3.0
    reconnect.new_requests.append(pb.NewRequest(  # j0's next turn, after its tool
        request_id="pod-a-r0b", job_id="pod-a-j0", arrival_s=2.5, prompt_tokens=64))
    engines.handle(reconnect, back)
    view = tracker.view("pod-a-j1")
    assert view is not None and view.requests_in_flight == 1
    engines.handle(pb.StepReport(engine_id="pod-a", seq=2, now_s=4.0, kv=KV, events=[
        pb.RequestEvent(request_id="pod-a-r1", kind=pb.EVENT_KIND_FINISHED, at_s=4.0,
                        finish_reason=pb.FINISH_REASON_STOP)]), back)
    view = tracker.view("pod-a-j1")
    assert view is not None and view.turns_finished == 1 and view.requests_in_flight == 0
    j0 = tracker.view("pod-a-j0")
    assert j0 is not None and j0.turns_finished == 1 and j0.requests_in_flight == 1
