"""Job history and tool statistics keep being written whatever a caller sends: a turn
the recorder cannot apply is refused at the edge, a record the writer cannot apply is
dropped (logged and counted) and the writer goes on, and a writer task that ends is
restarted by the daemon."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import engine_session_pb2_grpc, inspect_pb2, inspect_pb2_grpc
from sidecar.framework import RequestState, RequestView
from sidecar.telemetry.metrics import REGISTRY
from tests.support.daemon import running_daemon
from tests.support.inprocess import inprocess_daemon

KV = pb.KvCapacity(total_blocks=100, free_blocks=100, block_size_tokens=16)


def metric(port: int, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def step(stub: engine_session_pb2_grpc.EngineSessionStub, report: pb.StepReport
         ) -> grpc.StatusCode:
    try:
        stub.Step(report, timeout=5)
        return grpc.StatusCode.OK
    except grpc.RpcError as error:
        return error.code()  # type: ignore[attr-defined, no-any-return]


def two_turns(stub: engine_session_pb2_grpc.EngineSessionStub, engine_id: str, job_id: str,
              tool: str = "ls", finish_s: float = 2.0, next_arrival_s: float = 3.0
              ) -> list[grpc.StatusCode]:
    """A job's turn that calls ``tool`` and finishes at ``finish_s``, then its next turn
    arriving at ``next_arrival_s``: the arrival measures the tool's time."""
    return [
        step(stub, pb.StepReport(engine_id=engine_id, seq=1, snapshot=True, now_s=1.0, kv=KV,
                                 new_requests=[pb.NewRequest(request_id=f"{job_id}-1",
                                                             job_id=job_id, arrival_s=1.0)])),
        step(stub, pb.StepReport(engine_id=engine_id, seq=2, now_s=2.0, kv=KV, events=[
            pb.RequestEvent(request_id=f"{job_id}-1", kind=pb.EVENT_KIND_FINISHED,
                            at_s=finish_s, finish_reason=pb.FINISH_REASON_STOP, tool=tool,
                            blocks=2)])),
        step(stub, pb.StepReport(engine_id=engine_id, seq=3, now_s=3.0, kv=KV,
                                 new_requests=[pb.NewRequest(request_id=f"{job_id}-2",
                                                             job_id=job_id,
                                                             arrival_s=next_arrival_s)])),
    ]


def turns_of(channel: grpc.Channel, job_id: str, expected: int, timeout_s: float = 5.0
             ) -> list[inspect_pb2.TurnRecord]:
    """The job's turns in its history, once ``expected`` of them are there (writes are
    asynchronous) or when ``timeout_s`` has passed."""
    stub = inspect_pb2_grpc.InspectStub(channel)
    deadline = time.monotonic() + timeout_s
    while True:
        turns = list(stub.GetJob(inspect_pb2.GetJobRequest(job_id=job_id), timeout=5).turns)
        if len(turns) >= expected or time.monotonic() > deadline:
            return turns
        time.sleep(0.1)


def serving(channel: grpc.Channel) -> bool:
    answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=5)
    return answer.status == health_pb2.HealthCheckResponse.SERVING


def test_reserved_tool_name_keeps_history_written() -> None:
    with running_daemon("--policy", "continuum") as daemon, daemon.channel() as channel:
        stub = engine_session_pb2_grpc.EngineSessionStub(channel)
        # A turn whose tool is "*" (the pool of every tool), then the job's next turn.
        codes = two_turns(stub, "engine-star", "job-star", tool="*")
        hint = step(stub, pb.StepReport(
            engine_id="engine-hint", seq=1, snapshot=True, now_s=1.0, kv=KV,
            new_requests=[pb.NewRequest(request_id="h-1", job_id="h", arrival_s=1.0,
                                        tool_hint="*")]))
        # A later job's turns are written, and the daemon says it serves.
        assert two_turns(stub, "engine-later", "job-later") == [grpc.StatusCode.OK] * 3
        assert len(turns_of(channel, "job-later", expected=2)) == 2
        assert serving(channel)
        # The reserved name was refused by name, as a tool and as a tool hint.
        assert codes[1] == grpc.StatusCode.INVALID_ARGUMENT
        assert hint == grpc.StatusCode.INVALID_ARGUMENT
        assert metric(daemon.metrics_port, "kvtether_invalid_reports_total",
                      field="events") == 1
        assert metric(daemon.metrics_port, "kvtether_invalid_reports_total",
                      field="new_requests") == 1


def test_infinite_finish_then_arrival_keeps_history_written() -> None:
    with running_daemon("--policy", "continuum") as daemon, daemon.channel() as channel:
        stub = engine_session_pb2_grpc.EngineSessionStub(channel)
        # A finish at +inf, then the job's next turn arriving at +inf (inf - inf = NaN).
        codes = two_turns(stub, "engine-inf", "job-inf", finish_s=float("inf"),
                          next_arrival_s=float("inf"))
        assert two_turns(stub, "engine-later", "job-later") == [grpc.StatusCode.OK] * 3
        assert len(turns_of(channel, "job-later", expected=2)) == 2
        assert serving(channel)
        # The finish at +inf was refused by name; the arrival then asked for a resync.
        assert codes[1] == grpc.StatusCode.INVALID_ARGUMENT
        assert metric(daemon.metrics_port, "kvtether_invalid_reports_total",
                      field="events") == 1


def _view(request_id: str, job_id: str, arrival_s: float) -> RequestView:
    return RequestView(request_id=request_id, job_id=job_id, is_last_step=False,
                       arrival_s=arrival_s, prompt_tokens=16, state=RequestState.RUNNING)


async def _turns(channel: grpc.aio.Channel, job_id: str, expected: int) -> int:
    stub = inspect_pb2_grpc.InspectStub(channel)
    for _ in range(50):
        answer = await stub.GetJob(inspect_pb2.GetJobRequest(job_id=job_id))
        if len(answer.turns) >= expected:
            break
        await asyncio.sleep(0.1)
    return len(answer.turns)


async def _later_job(channel: grpc.aio.Channel, engine_id: str) -> None:
    stub = engine_session_pb2_grpc.EngineSessionStub(channel)
    await stub.Step(pb.StepReport(engine_id=engine_id, seq=1, snapshot=True, now_s=1.0, kv=KV,
                                  new_requests=[pb.NewRequest(request_id="later-1",
                                                              job_id="later", arrival_s=1.0)]))
    await stub.Step(pb.StepReport(engine_id=engine_id, seq=2, now_s=2.0, kv=KV, events=[
        pb.RequestEvent(request_id="later-1", kind=pb.EVENT_KIND_FINISHED, at_s=2.0,
                        finish_reason=pb.FINISH_REASON_STOP, tool="ls", blocks=2)]))


async def test_writer_drops_a_record_it_cannot_apply_and_goes_on() -> None:
    # Past the edge (as a bug in the daemon itself would): two tool times of the
    # pool's name reach the writer, which cannot apply them. (A NaN or endless one
    # never reaches it: the recorder leaves out what no finished turn can produce.)
    async with inprocess_daemon(policy={"name": "continuum"}) as (daemon, channel):
        recorder = daemon.recorder
        dropped_before = sample("kvtether_recorder_write_errors_total")
        restarts_before = sample("kvtether_background_task_restarts_total", task="recorder")
        with capture_logs() as logs:
            for index, (tool, finish_s, arrival_s) in enumerate((("*", 2.0, 3.0),
                                                                 ("*", 4.0, 5.5))):
                job_id = f"bad-{index}"
                recorder.on_arrival(_view(f"{job_id}-1", job_id, 1.0))
                recorder.on_finish(_view(f"{job_id}-1", job_id, 1.0), finish_s, tool, 1)
                recorder.on_arrival(_view(f"{job_id}-2", job_id, arrival_s))
            await _later_job(channel, "engine-after")
            assert await _turns(channel, "later", expected=1) == 1
        assert sample("kvtether_recorder_write_errors_total") - dropped_before == 2
        dropped = [entry for entry in logs if entry["event"] == "recorder_write_dropped"]
        assert dropped and "ValueError" in dropped[0]["error"]
        # The writer itself never stopped.
        assert sample("kvtether_background_task_restarts_total", task="recorder") \
            == restarts_before


async def test_daemon_restarts_a_writer_that_ended() -> None:
    async with inprocess_daemon(policy={"name": "continuum"}) as (_daemon, channel):
        restarts_before = sample("kvtether_background_task_restarts_total", task="recorder")
        with capture_logs() as logs:
            # The writer's task ends other than at stop (here: cancelled).
            await asyncio.sleep(0.1)  # the daemon's tasks start
            (writer,) = [task for task in asyncio.all_tasks() if task.get_name() == "recorder"]
            writer.cancel()
            await asyncio.sleep(0)
            await _later_job(channel, "engine-restarted")
            assert await _turns(channel, "later", expected=1) == 1
        assert sample("kvtether_background_task_restarts_total", task="recorder") \
            - restarts_before == 1
        assert any(entry["event"] == "background_task_failed"
                   and entry["task"] == "recorder" for entry in logs)
