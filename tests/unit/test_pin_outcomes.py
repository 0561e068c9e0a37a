"""The daemon counts what each pin came to: its job back while it held (a saved
re-computation) or released first (memory held for nothing), with the block-seconds
each held — the figures an operator reads to judge a policy's pins."""

from __future__ import annotations

import pytest

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.estimators.tool_time import ToolTimeEstimator
from sidecar.framework.protocols import Policy
from sidecar.framework.types import FinishInput, RetainDecision
from sidecar.jobs.tracker import JobTracker
from sidecar.policies.fcfs.policy import FcfsPolicy
from sidecar.runtime.decider import Decider, DecisionLog
from sidecar.runtime.engines import EngineRegistry
from sidecar.runtime.recorder import Recorder
from sidecar.store.embedded import EmbeddedStore
from sidecar.telemetry.metrics import REGISTRY


class _PinsEveryTurn(FcfsPolicy):
    """Pins every finished turn for 4 s (the base policy's expiry ends it)."""

    pins_finished_requests = True

    def on_finish(self, finished: FinishInput) -> RetainDecision:
        return RetainDecision.pin(4.0, "test: every turn")


def _counted() -> dict[str, float]:
    return {f"{name}:{outcome}": REGISTRY.get_sample_value(
        f"kvtether_{name}_total", {"outcome": outcome}) or 0.0
        for name in ("pins_ended", "pin_block_seconds")
        for outcome in ("returned", "not_returned")}


def _engines(policy: Policy) -> EngineRegistry:
    store = EmbeddedStore()
    recorder = Recorder(store, JobTracker(), ToolTimeEstimator(store), 100, 60.0)
    return EngineRegistry(Decider(policy, recorder, DecisionLog()))


def _new(request_id: str, job_id: str, arrival_s: float) -> pb.NewRequest:
    return pb.NewRequest(request_id=request_id, job_id=job_id, arrival_s=arrival_s,
                         prompt_tokens=512, state=pb.REQUEST_STATE_WAITING)


def _finished(request_id: str, at_s: float, blocks: int) -> pb.RequestEvent:
    return pb.RequestEvent(request_id=request_id, kind=pb.EVENT_KIND_FINISHED, at_s=at_s,
                           finish_reason=pb.FINISH_REASON_STOP, output_tokens=8,
                           tool="grep", blocks=blocks)


def _grew(before: dict[str, float]) -> dict[str, float]:
    return {key: pytest.approx(value - before[key]) for key, value in _counted().items()}


def test_a_pin_whose_job_came_back_counts_until_the_return_and_one_released_first_whole(
) -> None:
    before = _counted()
    engines = _engines(_PinsEveryTurn())
    engines.handle(pb.StepReport(engine_id="e", seq=1, snapshot=True, now_s=0.0,
                                 new_requests=[_new("a1", "a", 0.0), _new("b1", "b", 0.0)]))
    decision = engines.handle(pb.StepReport(engine_id="e", seq=2, now_s=1.0, events=[
        _finished("a1", 1.0, blocks=4), _finished("b1", 1.0, blocks=6)]))
    assert {p.request_id for p in decision.pins if p.action == pb.PIN_ACTION_PIN} == {
        "a1", "b1"}
    # Job a's next turn arrives at 3 s: its pin paid, 4 blocks for 2 s.
    engines.handle(pb.StepReport(engine_id="e", seq=3, now_s=3.0,
                                 new_requests=[_new("a2", "a", 3.0)]))
    # The engine gives b's pin way at 4 s (pressure), before b is back: 6 blocks, 3 s.
    engines.handle(pb.StepReport(engine_id="e", seq=4, now_s=4.0, released_pins=["b1"]))
    # a's turn ends; its new pin replaces the old one, which ends now, counted to 3 s.
    engines.handle(pb.StepReport(engine_id="e", seq=5, now_s=6.0, events=[
        _finished("a2", 6.0, blocks=5)]))
    assert _grew(before) == {
        "pins_ended:returned": 1, "pins_ended:not_returned": 1,
        "pin_block_seconds:returned": 4 * 2.0, "pin_block_seconds:not_returned": 6 * 3.0}


def test_a_pin_decided_after_its_job_is_back_counts_as_returned_at_once() -> None:
    # The tool came back within the report that finished the turn: the next request is
    # already live when the pin is decided, and the pin holds its context.
    before = _counted()
    engines = _engines(_PinsEveryTurn())
    engines.handle(pb.StepReport(engine_id="e", seq=1, snapshot=True, now_s=0.0,
                                 new_requests=[_new("a1", "a", 0.0)]))
    engines.handle(pb.StepReport(engine_id="e", seq=2, now_s=1.0,
                                 new_requests=[_new("a2", "a", 0.9)],
                                 events=[_finished("a1", 0.8, blocks=4)]))
    engines.handle(pb.StepReport(engine_id="e", seq=3, now_s=5.0))  # expired
    assert _grew(before) == {
        "pins_ended:returned": 1, "pins_ended:not_returned": 0,
        "pin_block_seconds:returned": 0.0, "pin_block_seconds:not_returned": 0.0}


def test_a_pin_a_snapshot_reports_keeps_its_pinned_time() -> None:
    # The engine resent its state (a resync): the pin counts from when it was pinned,
    # once; a release of a pin the daemon never saw held counts nothing.
    before = _counted()
    engines = _engines(_PinsEveryTurn())
    engines.handle(pb.StepReport(engine_id="e", seq=1, snapshot=True, now_s=0.0,
                                 new_requests=[_new("a1", "a", 0.0)]))
    engines.handle(pb.StepReport(engine_id="e", seq=2, now_s=1.0,
                                 events=[_finished("a1", 1.0, blocks=4)]))
    engines.handle(pb.StepReport(engine_id="e", seq=1, snapshot=True, now_s=2.0, pins=[
        pb.PinState(request_id="a1", job_id="a", blocks=4, pinned_at_s=1.0,
                    expires_at_s=11.0)]))
    engines.handle(pb.StepReport(engine_id="e", seq=2, now_s=3.0, released_pins=["a1", "x"]))
    assert _grew(before) == {
        "pins_ended:returned": 0, "pins_ended:not_returned": 1,
        "pin_block_seconds:returned": 0.0, "pin_block_seconds:not_returned": 4 * 2.0}


def test_the_wait_the_daemon_asks_of_each_engine_is_exported() -> None:
    """kvtether_engine_finished_turns_cached: what the last decision asked of the
    engine for the turns that finish before the next (1 cached, 0 held)."""
    from sidecar.policies.registry import build_policy

    for policy, engine_id, expected in (
            (build_policy("adaptive", {"provisional_cache": "true"}), "cached-e", 1.0),
            (_PinsEveryTurn(), "held-e", 0.0)):
        engines = _engines(policy)
        engines.handle(pb.StepReport(engine_id=engine_id, seq=1, snapshot=True, now_s=0.0,
                                     new_requests=[_new("a1", "a", 0.0)]))
        assert REGISTRY.get_sample_value("kvtether_engine_finished_turns_cached",
                                         {"engine_id": engine_id}) == expected


def _unreturned(engine_id: str) -> float:
    return REGISTRY.get_sample_value("kvtether_pins_unreturned_total",
                                     {"engine_id": engine_id}) or 0.0


def test_a_pin_whose_job_came_back_to_another_engine_counts_unreturned_on_its_own() -> None:
    """kvtether_pins_unreturned_total{engine}: the job's next turn was routed to another
    engine, so the pin that held its context on the first one paid nothing there."""
    before = {engine_id: _unreturned(engine_id) for engine_id in ("pod-1", "pod-2")}
    engines = _engines(_PinsEveryTurn())
    engines.handle(pb.StepReport(engine_id="pod-1", seq=1, snapshot=True, now_s=0.0,
                                 new_requests=[_new("a1", "a", 0.0)]))
    engines.handle(pb.StepReport(engine_id="pod-2", seq=1, snapshot=True, now_s=0.0))
    decision = engines.handle(pb.StepReport(engine_id="pod-1", seq=2, now_s=1.0,
                                            events=[_finished("a1", 1.0, blocks=4)]))
    assert [p.request_id for p in decision.pins if p.action == pb.PIN_ACTION_PIN] == ["a1"]
    # Job a's next turn reaches pod-2; pod-1's pin expires with nothing back (4 s).
    engines.handle(pb.StepReport(engine_id="pod-2", seq=2, now_s=2.0,
                                 new_requests=[_new("a2", "a", 2.0)]))
    engines.handle(pb.StepReport(engine_id="pod-1", seq=3, now_s=6.0))
    assert _unreturned("pod-1") - before["pod-1"] == 1
    assert _unreturned("pod-2") == before["pod-2"]
