"""The engine benchmark's reading of a real daemon's metrics: deltas over one policy's
run (``benchmarks.engine``'s ``DaemonLoad``)."""

from __future__ import annotations

import sys

import pytest

from benchmarks.engine.__main__ import DaemonLoad
from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import engine_session_pb2_grpc
from tests.support.daemon import running_daemon

KV = pb.KvCapacity(total_blocks=100, free_blocks=50, block_size_tokens=16)


def test_the_engine_benchmark_reads_one_runs_share_of_the_daemons_metrics() -> None:
    """benchmarks.engine records, per policy run, what the reports carried, the mean
    decision time and the engine's fallback steps: deltas over that run only. The
    engine's counters count from its start: a run that began before the new daemon
    heard from the engine has no fallback count rather than a wrong one."""
    with running_daemon("--policy", "adaptive") as daemon:
        stub = engine_session_pb2_grpc.EngineSessionStub(daemon.channel())
        url = f"http://127.0.0.1:{daemon.metrics_port}"
        too_early = DaemonLoad(daemon.process.pid, url)
        stub.Step(pb.StepReport(engine_id="m", seq=1, snapshot=True, now_s=1.0, kv=KV,
                                counters=pb.EngineCounters(fallback_steps=5,
                                                           answers_by_lag_steps=[0, 4, 1],
                                                           provisional_block_seconds=2.5,
                                                           idle_waits=10,
                                                           idle_waits_missed=1)))
        load = DaemonLoad(daemon.process.pid, url)
        stub.Step(pb.StepReport(engine_id="m", seq=2, now_s=2.0, kv=KV, new_requests=[
            pb.NewRequest(request_id="a", job_id="j", arrival_s=2.0)],
            counters=pb.EngineCounters(fallback_steps=7, answers_by_lag_steps=[0, 5, 1],
                                       provisional_block_seconds=3.0, idle_waits=12,
                                       idle_waits_missed=1)))
        stub.Step(pb.StepReport(engine_id="m", seq=3, now_s=3.0, kv=KV,
                                counters=pb.EngineCounters(fallback_steps=8,
                                                           answers_by_lag_steps=[0, 5, 4],
                                                           provisional_block_seconds=4.0,
                                                           idle_waits=15,
                                                           idle_waits_missed=2)))
        run = load.delta()
        started_too_early = too_early.delta()

    assert started_too_early["fallback_steps"] is None
    assert started_too_early["answers_by_lag_steps"] == {}
    assert run["daemon_reports"] == 2
    assert run["reports_carried"] == {"snapshot": 0, "new_requests": 1, "clock": 1}
    assert run["fallback_steps"] == 3
    assert run["provisional_block_s"] == pytest.approx(1.5), "held awaiting the daemon"
    assert started_too_early["provisional_block_s"] is None
    # The engine waited for 5 answers this run, and one wait ran out.
    assert (run["idle_waits"], run["idle_waits_missed"]) == (5, 1)
    assert started_too_early["idle_waits"] is None
    # This run's answers: one the next step, three two steps late.
    assert run["answers_by_lag_steps"] == {"0": 0, "1": 1, "2": 3}
    assert 0 < run["decision_mean_s"] < 1.0
    # The event-loop thread's wait for a CPU over the run (Linux schedstat).
    if sys.platform.startswith("linux"):
        assert 0.0 <= run["daemon_cpu_wait_s"] < 1.0
    assert run["pins_ended"] == {"returned": 0, "not_returned": 0}, "adaptive pinned nothing"


def test_the_engine_benchmark_reads_what_one_runs_pins_came_to() -> None:
    """A real daemon pins a finished turn (continuum); its job's next turn arrives 2 s
    later, and the turn after replaces the pin: one pin that paid, 2 s of its blocks."""
    with running_daemon("--policy", "continuum") as daemon:
        stub = engine_session_pb2_grpc.EngineSessionStub(daemon.channel())
        load = DaemonLoad(daemon.process.pid, f"http://127.0.0.1:{daemon.metrics_port}")

        def turn(request_id: str, seq: int, at_s: float) -> pb.StepDecision:
            return stub.Step(pb.StepReport(
                engine_id="m", seq=seq, now_s=at_s, kv=KV, snapshot=seq == 1,
                new_requests=[pb.NewRequest(request_id=request_id, job_id="j",
                                            arrival_s=at_s, prompt_tokens=300)]))

        def finished(request_id: str, seq: int, at_s: float) -> pb.StepDecision:
            return stub.Step(pb.StepReport(engine_id="m", seq=seq, now_s=at_s, kv=KV, events=[
                pb.RequestEvent(request_id=request_id, kind=pb.EVENT_KIND_FINISHED,
                                at_s=at_s, finish_reason=pb.FINISH_REASON_STOP,
                                output_tokens=20, tool="web_search", blocks=5)]))

        turn("t1", 1, 1.0)
        pinned = finished("t1", 2, 2.0)
        assert [p.action for p in pinned.pins] == [pb.PIN_ACTION_PIN]
        turn("t2", 3, 4.0)
        finished("t2", 4, 5.0)
        run = load.delta()

    assert run["pins_ended"] == {"returned": 1, "not_returned": 0}
    assert run["pin_block_s"] == {"returned": pytest.approx(5 * 2.0), "not_returned": 0}
