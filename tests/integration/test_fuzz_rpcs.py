"""Every RPC of the three services under random and malformed input (hypothesis), against
a real daemon process: non-finite floats, strings up to a megabyte, the reserved tool
name, enum values no enum defines. The answer is always a decision or a clear status
naming the field, never a crash (UNKNOWN / INTERNAL), and the daemon's state is never
corrupted: afterwards a clean session still gets the right decisions, a new job's
history and tool time are still written, and health says SERVING."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.api.bounds import ALL_TOOLS, MAX_ID_CHARS
from sidecar.api.v1 import (
    engine_session_pb2 as pb,
)
from sidecar.api.v1 import (
    engine_session_pb2_grpc,
    inspect_pb2,
    inspect_pb2_grpc,
    retention_pb2,
    retention_pb2_grpc,
)
from tests.support.daemon import DaemonProcess, running_daemon

FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])
# For calls that wait (a watch that is accepted runs until its deadline).
FUZZ_FEW = settings(FUZZ, max_examples=30)
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
# Retention mutations: refused by ownership, or by the rate limit under this load.
RETENTION_ALLOWED = ALLOWED | {grpc.StatusCode.PERMISSION_DENIED,
                               grpc.StatusCode.UNAUTHENTICATED,
                               grpc.StatusCode.RESOURCE_EXHAUSTED}

# Ids as callers send them, good and bad: empty, over the limit, a megabyte, with
# control characters, the reserved tool name (harmless as an id).
HUGE = "h" * 1_000_000
ids = st.sampled_from(["", "a", "b", "r1", "job-1", "x" * (MAX_ID_CHARS + 1), HUGE, "日本",
                       "a:b{c}", "line\nbreak", ALL_TOOLS])
tools = st.sampled_from(["", "ls", "grep -r", ALL_TOOLS, "t" * 129, HUGE, "tab\there"])
numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0.0, -1.0, 1e308, -1e308, 5.0, math.inf, math.nan]))
uint32 = st.integers(min_value=0, max_value=2**32 - 1)
# Defined values and some no enum defines (proto3 keeps those as they came).
enum_values = st.one_of(st.integers(min_value=0, max_value=7),
                        st.sampled_from([-1, 2**31 - 1]))

retention_configs = st.builds(
    retention_pb2.RetentionConfig,
    token_ranges=st.lists(st.builds(
        retention_pb2.TokenRangeRetention, token_start=uint32, token_end=uint32,
        priority=st.integers(min_value=0, max_value=300), duration_s=numbers), max_size=20),
    decode_priority=st.integers(min_value=0, max_value=300), decode_duration_s=numbers)
new_requests = st.builds(
    pb.NewRequest, request_id=ids, job_id=ids, is_last_step=st.booleans(),
    arrival_s=numbers, prompt_tokens=uint32, tool_hint=tools, state=enum_values,
    computed_tokens=uint32, retention=st.none() | retention_configs, retention_scope=ids)
events = st.builds(
    pb.RequestEvent, request_id=ids, kind=enum_values, at_s=numbers,
    finish_reason=enum_values, output_tokens=uint32, tool=tools, blocks=uint32)
pins = st.builds(pb.PinState, request_id=ids, job_id=ids, blocks=uint32, pinned_at_s=numbers,
                 expires_at_s=numbers, tool=tools)
reports = st.builds(
    pb.StepReport, engine_id=st.sampled_from(["", "fuzz-a", "fuzz-b", HUGE]),
    seq=st.one_of(st.integers(min_value=0, max_value=5), st.just(2**64 - 1)),
    snapshot=st.booleans(), now_s=numbers,
    kv=st.builds(pb.KvCapacity, total_blocks=uint32, free_blocks=uint32,
                 block_size_tokens=uint32, admission_stalled=st.booleans()),
    new_requests=st.lists(new_requests, max_size=6), events=st.lists(events, max_size=6),
    released_pins=st.lists(ids, max_size=3), pins=st.lists(pins, max_size=3),
    counters=st.builds(pb.EngineCounters, provisional_block_seconds=numbers),
    work=st.builds(pb.StepWork, steps=uint32, busy_s=numbers))
targets = st.builds(lambda kind, value: retention_pb2.RetentionTarget(
    **({kind: value} if kind else {})), st.sampled_from(["job_id", "session_id", None]), ids)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    # One client calls as fast as it can: the Inspect rate limit would answer most of
    # the inputs before the service checks them.
    with running_daemon("--policy", "continuum", env={
            "KVTETHER_LIMITS__INSPECT_CALLS_PER_S": "100000",
            "KVTETHER_LIMITS__INSPECT_BURST": "100000"}) as process:
        yield process


@pytest.fixture(scope="module")
def channel(daemon: DaemonProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(daemon.address) as channel:
        yield channel


def code_of(call: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    try:
        call()
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        return error.code(), error.details() or ""  # type: ignore[attr-defined]


@FUZZ
@given(report=reports)
def test_step_reports(channel: grpc.Channel, report: pb.StepReport) -> None:
    stub = engine_session_pb2_grpc.EngineSessionStub(channel)
    code, details = code_of(lambda: stub.Step(report, timeout=5))
    assert code in ALLOWED, (code, details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert ":" in details and details.split(":")[0], details  # names the field


@FUZZ
@given(batch=st.lists(reports, min_size=1, max_size=8))
def test_session_streams(channel: grpc.Channel, batch: list[pb.StepReport]) -> None:
    stub = engine_session_pb2_grpc.EngineSessionStub(channel)
    code, details = code_of(lambda: list(stub.Session(iter(batch), timeout=10)))
    assert code in ALLOWED, (code, details)


@FUZZ
@given(engine_id=st.sampled_from(["fuzz-turns", "fuzz-turns-2"]), tool=tools,
       finish_s=numbers, next_arrival_s=numbers)
def test_turn_sequences(channel: grpc.Channel, engine_id: str, tool: str, finish_s: float,
                        next_arrival_s: float) -> None:
    # A job's turn that calls a tool and finishes, then the job's next turn: the
    # arrival measures the tool's time, which the history writer records.
    stub = engine_session_pb2_grpc.EngineSessionStub(channel)
    kv = pb.KvCapacity(total_blocks=100, free_blocks=100, block_size_tokens=16)
    for report in (
        pb.StepReport(engine_id=engine_id, seq=1, snapshot=True, now_s=1.0, kv=kv,
                      new_requests=[pb.NewRequest(request_id="t1", job_id="fuzz-job",
                                                  arrival_s=1.0)]),
        pb.StepReport(engine_id=engine_id, seq=2, now_s=2.0, kv=kv, events=[pb.RequestEvent(
            request_id="t1", kind=pb.EVENT_KIND_FINISHED, at_s=finish_s, tool=tool,
            finish_reason=pb.FINISH_REASON_STOP, blocks=2)]),
        pb.StepReport(engine_id=engine_id, seq=3, now_s=3.0, kv=kv, new_requests=[
            pb.NewRequest(request_id="t2", job_id="fuzz-job", arrival_s=next_arrival_s)]),
    ):
        code, details = code_of(lambda report=report: stub.Step(report, timeout=5))
        assert code in ALLOWED, (code, details)


@FUZZ
@given(config=retention_configs, scope=ids, target=targets, job_id=ids, tool=tools,
       duration_s=numbers)
def test_retention(channel: grpc.Channel, config: retention_pb2.RetentionConfig, scope: str,
                   target: retention_pb2.RetentionTarget, job_id: str, tool: str,
                   duration_s: float) -> None:
    stub = retention_pb2_grpc.RetentionStub(channel)
    for call in (
        lambda: stub.SetDirectives(retention_pb2.SetDirectivesRequest(
            target=target, config=config, scope=scope), timeout=5),
        lambda: stub.GetDirectives(retention_pb2.GetDirectivesRequest(target=target), timeout=5),
        lambda: stub.ClearDirectives(retention_pb2.ClearDirectivesRequest(
            target=target, scope=scope), timeout=5),
        lambda: stub.AnnounceToolCall(retention_pb2.AnnounceToolCallRequest(
            job_id=job_id, tool=tool, expected_duration_s=duration_s), timeout=5),
    ):
        code, details = code_of(call)
        assert code in RETENTION_ALLOWED, (code, details)


@FUZZ
@given(job_id=ids, request_id=ids, tool=tools, engine_id=ids, limit=uint32)
def test_inspect(channel: grpc.Channel, job_id: str, request_id: str, tool: str,
                 engine_id: str, limit: int) -> None:
    stub = inspect_pb2_grpc.InspectStub(channel)
    for call in (
        lambda: stub.GetPolicy(inspect_pb2.GetPolicyRequest(), timeout=5),
        lambda: stub.ListJobs(inspect_pb2.ListJobsRequest(limit=limit % 2000), timeout=5),
        lambda: stub.GetJob(inspect_pb2.GetJobRequest(job_id=job_id), timeout=5),
        lambda: stub.ListPins(inspect_pb2.ListPinsRequest(engine_id=engine_id), timeout=5),
        lambda: stub.GetToolStats(inspect_pb2.GetToolStatsRequest(tool=tool), timeout=5),
        lambda: stub.Explain(inspect_pb2.ExplainRequest(request_id=request_id), timeout=5),
    ):
        code, details = code_of(call)
        assert code in ALLOWED, (code, details)


@FUZZ_FEW
@given(engine_id=ids, job_id=ids)
def test_watch_decisions(channel: grpc.Channel, engine_id: str, job_id: str) -> None:
    # An accepted watch runs until its deadline: that is its normal end here.
    stub = inspect_pb2_grpc.InspectStub(channel)
    request = inspect_pb2.WatchDecisionsRequest(engine_id=engine_id, job_id=job_id)
    code, details = code_of(lambda: next(stub.WatchDecisions(request, timeout=0.1)))
    assert code in ALLOWED | {grpc.StatusCode.DEADLINE_EXCEEDED}, (code, details)


def test_garbage_bytes_are_refused_cleanly(channel: grpc.Channel) -> None:
    rng = random.Random(7)
    raw = channel.unary_unary("/kvtether.v1.EngineSession/Step")
    for _ in range(50):
        payload = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        code, details = code_of(lambda payload=payload: raw(payload, timeout=5))
        # Not a StepReport at all, or one the edge refuses: INVALID_ARGUMENT either way.
        assert code in ALLOWED, (code, details)


def test_oversized_message_is_refused(channel: grpc.Channel) -> None:
    stub = engine_session_pb2_grpc.EngineSessionStub(channel)
    huge = pb.StepReport(engine_id="huge", seq=1, snapshot=True,
                         new_requests=[pb.NewRequest(request_id="r" * 1000 + str(i))
                                       for i in range(20_000)])
    code, _details = code_of(lambda: stub.Step(huge, timeout=10))
    assert code in {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT}


def test_state_is_sound_after_the_fuzzing(channel: grpc.Channel) -> None:
    # Runs last in this module: after every malformed input above, a clean engine
    # session gets the decisions it should.
    stub = engine_session_pb2_grpc.EngineSessionStub(channel)
    kv = pb.KvCapacity(total_blocks=100, free_blocks=100, block_size_tokens=16)
    first = stub.Step(pb.StepReport(
        engine_id="after-fuzz", seq=1, snapshot=True, now_s=10.0, kv=kv,
        new_requests=[pb.NewRequest(request_id="late", job_id="j2", arrival_s=9.0),
                      pb.NewRequest(request_id="early", job_id="j1", arrival_s=8.0)]))
    priority = {p.request_id: p.priority for p in first.priorities}
    assert priority["early"] < priority["late"]
    finished = stub.Step(pb.StepReport(engine_id="after-fuzz", seq=2, now_s=11.0, kv=kv, events=[
        pb.RequestEvent(request_id="early", kind=pb.EVENT_KIND_ADMITTED, at_s=10.5),
        pb.RequestEvent(request_id="early", kind=pb.EVENT_KIND_FINISHED, at_s=11.0,
                        finish_reason=pb.FINISH_REASON_STOP, tool="ls", blocks=3)]))
    (pin,) = finished.pins
    assert pin.request_id == "early" and pin.action == pb.PIN_ACTION_PIN
    assert math.isfinite(pin.expires_at_s)
    # The job's next turn measures the tool's time: history and tool statistics are
    # still being written (asynchronously: polled briefly).
    stub.Step(pb.StepReport(engine_id="after-fuzz", seq=3, now_s=12.0, kv=kv, new_requests=[
        pb.NewRequest(request_id="early-2", job_id="j1", arrival_s=12.0)]))
    inspect = inspect_pb2_grpc.InspectStub(channel)
    assert eventually(lambda: len(inspect.GetJob(inspect_pb2.GetJobRequest(
        job_id="j1")).turns) == 2), "the new job's turns were not written"
    assert eventually(lambda: any(
        stats.tool == "ls" and stats.count >= 1 for stats in inspect.GetToolStats(
            inspect_pb2.GetToolStatsRequest(tool="ls")).tools)), "tool time not recorded"
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
