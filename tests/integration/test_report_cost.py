"""One caller's reports cost the daemon what the report holds, and nothing that lasts
(issue #64, items 1, 2 and 4), against a real daemon process over real gRPC:

- a snapshot larger than an engine holds is refused at once with RESOURCE_EXHAUSTED
  naming the limit; within raised limits it is applied in slices, and health checks
  answer meanwhile;
- a snapshot of thousands of new jobs costs the same whatever the tracker holds;
- no job stays in flight without a live stream to own it: a unary Step's requests,
  and a request id re-announced under another job, release their jobs;
- refused 1 MB reports leave the daemon's memory where it was.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import engine_session_pb2_grpc, inspect_pb2, inspect_pb2_grpc
from tests.support.daemon import DaemonProcess, running_daemon

KV = pb.KvCapacity(total_blocks=1_000_000, free_blocks=100_000, block_size_tokens=16)


def snapshot(engine_id: str, running: int = 0, waiting: int = 0, pins: int = 0
             ) -> pb.StepReport:
    """A snapshot of new jobs, one request or pin each."""
    report = pb.StepReport(engine_id=engine_id, seq=1, snapshot=True, now_s=10.0, kv=KV)
    for index in range(running + waiting):
        report.new_requests.add(
            request_id=f"{engine_id}/r{index}", job_id=f"{engine_id}/job{index}",
            arrival_s=1.0, prompt_tokens=100, computed_tokens=100 if index < running else 0,
            state=pb.REQUEST_STATE_RUNNING if index < running else pb.REQUEST_STATE_WAITING)
    for index in range(pins):
        report.pins.add(request_id=f"{engine_id}/p{index}", job_id=f"{engine_id}/pin{index}",
                        blocks=2, pinned_at_s=5.0, expires_at_s=1e9, tool="ls")
    return report


def config_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvtether.yaml"
    path.write_text(text)
    return str(path)


class HealthProbe:
    """Health checks back to back on their own channel; the longest wait for one."""

    def __init__(self, address: str) -> None:
        self._address = address
        self._stop = threading.Event()
        self.waits_s: list[float] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with grpc.insecure_channel(self._address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not self._stop.is_set():
                started = time.monotonic()
                stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
                self.waits_s.append(time.monotonic() - started)
                self._stop.wait(0.02)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def in_flight(channel: grpc.Channel, job_id: str) -> int:
    answer = inspect_pb2_grpc.InspectStub(channel).GetJob(
        inspect_pb2.GetJobRequest(job_id=job_id), timeout=10)
    assert answer.found, job_id
    return int(answer.summary.requests_in_flight)


# --- 1: cost bounded by the report ----------------------------------------------------

@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with running_daemon("--log-level", "warning") as process:
        yield process


@pytest.mark.parametrize("report, limit", [
    (snapshot("big-a", running=20_000, pins=3_000), "limits.max_running_per_engine (2048)"),
    (snapshot("big-b", waiting=40_000), "limits.max_waiting_per_engine (8192)"),
    (snapshot("big-c", pins=9_000), "limits.max_pins_per_engine (8192)")])
def test_a_snapshot_larger_than_an_engine_holds_is_refused_at_once_naming_the_limit(
        daemon: DaemonProcess, report: pb.StepReport, limit: str) -> None:
    with daemon.channel() as channel:
        stub = engine_session_pb2_grpc.EngineSessionStub(channel)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            stub.Step(report, timeout=30)
        took_s = time.monotonic() - started
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert limit in (refused.value.details() or "")
    assert took_s < 1.0, f"refusing the snapshot took {took_s:.2f} s"


def test_a_delta_past_a_limit_is_refused_and_the_engine_must_snapshot_again(
        daemon: DaemonProcess) -> None:
    with daemon.channel() as channel:
        stub = engine_session_pb2_grpc.EngineSessionStub(channel)
        stub.Step(snapshot("grow", waiting=8_000), timeout=30)
        more = pb.StepReport(engine_id="grow", seq=2, now_s=11.0, kv=KV)
        for index in range(500):
            more.new_requests.add(request_id=f"grow/more{index}", arrival_s=10.5,
                                  prompt_tokens=10)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Step(more, timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limits.max_waiting_per_engine" in (refused.value.details() or "")
        after = stub.Step(pb.StepReport(engine_id="grow", seq=3, now_s=12.0, kv=KV), timeout=30)
    assert after.resync_requested


def test_health_answers_while_a_large_snapshot_is_applied_in_slices(tmp_path: Path) -> None:
    """With the limits raised past the report, the report is taken, in slices: the
    longest health check stays far below the time the reports took (scanning every
    request for each pin, the 20,000 x 3,000 report alone held the loop for seconds)."""
    config = config_file(tmp_path, "limits:\n  max_running_per_engine: 40000\n"
                                   "  max_waiting_per_engine: 40000\n"
                                   "  max_pins_per_engine: 40000\n")
    with running_daemon("--config", config, "--log-level", "warning") as process, \
            process.channel() as channel:
        stub = engine_session_pb2_grpc.EngineSessionStub(channel)
        stub.Step(snapshot("warm", running=10, pins=10), timeout=30)
        with HealthProbe(process.address) as probe:
            time.sleep(0.2)
            started = time.monotonic()
            stub.Step(snapshot("huge-a", running=20_000, pins=3_000), timeout=120)
            stub.Step(snapshot("huge-b", waiting=30_000), timeout=120)
            took_s = time.monotonic() - started
            time.sleep(0.2)
    longest_s = max(probe.waits_s)
    assert longest_s < 1.0 and longest_s < took_s / 2, (
        f"a health check waited {longest_s:.2f} s while the reports took {took_s:.2f} s")


def test_a_snapshot_of_thousands_of_new_jobs_costs_the_same_past_max_jobs_tracked(
        tmp_path: Path) -> None:
    """Past max_jobs_tracked, a new job must not scan the tracker for an idle job to
    forget (8,000 jobs in flight against a cap of 1,000 made ~30 million steps of it):
    an idle job is found in O(1)."""
    config = config_file(tmp_path, "max_jobs_tracked: 1000\n")
    with running_daemon("--config", config, "--log-level", "warning") as process, \
            process.channel() as channel:
        stub = engine_session_pb2_grpc.EngineSessionStub(channel)
        session = stub.Session(iter([snapshot("crowd", waiting=8_000)]), timeout=120)
        started = time.monotonic()
        answers = list(session)
        took_s = time.monotonic() - started
    assert len(answers) == 1 and not answers[0].resync_requested
    assert took_s < 3.0, f"a snapshot of 8,000 new jobs took {took_s:.2f} s"


# --- 2: nothing in flight without a live owner ----------------------------------------

def test_a_unary_steps_requests_do_not_keep_their_jobs_in_flight(daemon: DaemonProcess) -> None:
    with daemon.channel() as channel:
        stub = engine_session_pb2_grpc.EngineSessionStub(channel)
        stub.Step(snapshot("unary", waiting=3), timeout=30)
        assert in_flight(channel, "unary/job0") == 0
        # The mirror still holds them: the next Step's events apply.
        stub.Step(pb.StepReport(engine_id="unary", seq=2, now_s=11.0, kv=KV, events=[
            pb.RequestEvent(request_id="unary/r0", kind=pb.EVENT_KIND_ADMITTED, at_s=10.5),
            pb.RequestEvent(request_id="unary/r1", kind=pb.EVENT_KIND_FINISHED, at_s=10.8,
                            finish_reason=pb.FINISH_REASON_STOP, output_tokens=5)]),
            timeout=30)
        finished = inspect_pb2_grpc.InspectStub(channel).GetJob(
            inspect_pb2.GetJobRequest(job_id="unary/job1"), timeout=10)
    assert finished.summary.turns_finished == 1


def test_a_request_id_announced_again_under_another_job_releases_the_first_job(
        daemon: DaemonProcess) -> None:
    with daemon.channel() as channel:
        stub = engine_session_pb2_grpc.EngineSessionStub(channel)
        reports = [
            pb.StepReport(engine_id="again", seq=1, snapshot=True, now_s=1.0, kv=KV,
                          new_requests=[pb.NewRequest(request_id="again/r", job_id="first",
                                                      arrival_s=0.5, prompt_tokens=10)]),
            pb.StepReport(engine_id="again", seq=2, now_s=2.0, kv=KV,
                          new_requests=[pb.NewRequest(request_id="again/r", job_id="second",
                                                      arrival_s=1.5, prompt_tokens=10)])]
        sent = threading.Event()

        def requests() -> Iterator[pb.StepReport]:
            yield from reports
            sent.wait(30)  # the stream stays open: its requests are live

        session = stub.Session(requests(), timeout=60)
        for _ in reports:
            next(session)
        try:
            assert in_flight(channel, "second") == 1
            assert in_flight(channel, "first") == 0
        finally:
            sent.set()
            list(session)


# --- 4: refused input costs nothing that lasts ----------------------------------------

def test_refused_one_megabyte_reports_leave_the_daemons_memory_where_it_was(
        daemon: DaemonProcess) -> None:
    """Each refused 1 MB report kept ~34 KB of the daemon for good (grpc.aio's abort
    path): 2,500 of them grew it by ~85 MB. The benchmark sends 20,000."""
    process = psutil.Process(daemon.process.pid)
    report = pb.StepReport(engine_id="x" * 1_000_000, seq=1, snapshot=True, now_s=1.0)
    with daemon.channel() as channel:
        stub = engine_session_pb2_grpc.EngineSessionStub(channel)

        def refuse(calls: int) -> None:
            for _ in range(calls):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Step(report, timeout=30)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        refuse(200)  # the first ones size gRPC's buffers
        before = process.memory_info().rss
        refuse(2_500)
        after = process.memory_info().rss
    assert after < before * 1.2, (
        f"RSS went from {before / 2**20:.0f} to {after / 2**20:.0f} MiB")
