"""What a caller sends is checked at the daemon's edge, against a real daemon process:
every time finite and not negative, every float finite, every enum value defined, every
count within its bound, every string within its length limit, reserved names refused,
undecodable bytes refused; each as INVALID_ARGUMENT naming the field (or the method),
and nothing of a refused request is kept."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator

import grpc
import pytest

from sidecar.api.bounds import MAX_ID_CHARS, MAX_TOOL_CHARS
from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import (
    engine_session_pb2_grpc,
    inspect_pb2,
    inspect_pb2_grpc,
    retention_pb2,
    retention_pb2_grpc,
)
from tests.support.daemon import DaemonProcess, running_daemon

KV = pb.KvCapacity(total_blocks=100, free_blocks=100, block_size_tokens=16)
INF, NAN = float("inf"), float("nan")


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with running_daemon("--policy", "continuum") as process:
        yield process


@pytest.fixture(scope="module")
def channel(daemon: DaemonProcess) -> Iterator[grpc.Channel]:
    with daemon.channel() as channel:
        yield channel


def refusal(call: Callable[[], object]) -> str:
    """The details of the INVALID_ARGUMENT the call ends with."""
    try:
        call()
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error  # type: ignore[attr-defined]
        return error.details() or ""  # type: ignore[attr-defined]
    raise AssertionError("accepted")


def step_refusal(channel: grpc.Channel, **fields: object) -> str:
    """A snapshot report of engine ``edge`` with ``fields``: the refusal's details."""
    fields.setdefault("kv", KV)
    fields.setdefault("now_s", 1.0)
    report = pb.StepReport(engine_id="edge", seq=1, snapshot=True, **fields)  # type: ignore[arg-type]
    stub = engine_session_pb2_grpc.EngineSessionStub(channel)
    return refusal(lambda: stub.Step(report, timeout=10))


def arrival(**fields: object) -> pb.NewRequest:
    return pb.NewRequest(**{"request_id": "r1", "job_id": "j", "arrival_s": 1.0, **fields})


def finish(**fields: object) -> pb.RequestEvent:
    return pb.RequestEvent(**{"request_id": "r1", "kind": pb.EVENT_KIND_FINISHED, "at_s": 1.0,
                              "finish_reason": pb.FINISH_REASON_STOP, **fields})


def pin(**fields: object) -> pb.PinState:
    return pb.PinState(**{"request_id": "p1", "job_id": "j", "blocks": 2, "pinned_at_s": 1.0,
                          "expires_at_s": 2.0, **fields})


def scrape(daemon: DaemonProcess) -> str:
    url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
    return urllib.request.urlopen(url, timeout=5).read().decode()


def test_infinite_now_and_arrival_are_refused(channel: grpc.Channel) -> None:
    assert step_refusal(channel, now_s=INF).startswith("now_s: must be a finite number")
    assert step_refusal(channel, new_requests=[arrival(arrival_s=INF)]).startswith(
        "new_requests[0].arrival_s: must be a finite number")


def test_nan_or_negative_finish_times_are_refused(channel: grpc.Channel) -> None:
    for at_s in (NAN, -1.0, INF):
        details = step_refusal(channel, new_requests=[arrival()], events=[finish(at_s=at_s)])
        assert details.startswith("events[0].at_s: must be a finite number"), details


def test_nan_pin_times_are_refused_and_no_such_pin_is_held(channel: grpc.Channel) -> None:
    assert step_refusal(channel, pins=[pin(expires_at_s=NAN)]).startswith(
        "pins[0].expires_at_s: must be a finite number")
    assert step_refusal(channel, pins=[pin(pinned_at_s=NAN)]).startswith(
        "pins[0].pinned_at_s: must be a finite number")
    assert step_refusal(channel, pins=[pin(expires_at_s=-5.0)]).startswith(
        "pins[0].expires_at_s: must be a finite number >= 0")
    pins = inspect_pb2_grpc.InspectStub(channel).ListPins(
        inspect_pb2.ListPinsRequest(engine_id="edge"), timeout=5)
    assert list(pins.pins) == []  # a pin that never expires is never held


def test_work_fields_beyond_any_step_are_refused(channel: grpc.Channel) -> None:
    for busy_s in (NAN, -1.0, 1e300):
        details = step_refusal(channel, work=pb.StepWork(steps=1, busy_s=busy_s,
                                                         prefill_tokens=10))
        assert details.startswith("work.busy_s: "), details


def test_out_of_range_enum_values_are_refused(channel: grpc.Channel) -> None:
    assert step_refusal(channel, new_requests=[arrival(state=7)]).startswith(
        "new_requests[0].state: 7 is not a RequestState")
    assert step_refusal(channel, new_requests=[arrival()], events=[
        pb.RequestEvent(request_id="r1", kind=9, at_s=1.0)]).startswith(  # type: ignore[arg-type]
        "events[0].kind: 9 is not a EventKind")
    assert step_refusal(channel, new_requests=[arrival()], events=[
        finish(finish_reason=42)]).startswith("events[0].finish_reason: 42 is not a FinishReason")


def test_blocks_above_the_total_are_refused(channel: grpc.Channel) -> None:
    assert step_refusal(channel, kv=pb.KvCapacity(total_blocks=10, free_blocks=11)).startswith(
        "kv.free_blocks: 11 exceed kv.total_blocks 10")
    assert step_refusal(channel, new_requests=[arrival()], events=[finish(blocks=101)]
                        ).startswith("events[0].blocks: 101 exceed kv.total_blocks 100")
    assert step_refusal(channel, pins=[pin(blocks=1_000_000)]).startswith(
        "pins[0].blocks: 1000000 exceed kv.total_blocks 100")


def test_released_pins_count_toward_the_item_limit(channel: grpc.Channel) -> None:
    details = step_refusal(channel, released_pins=["p"] * 100_000)
    assert details.startswith("released_pins: 100000 items in one report"), details


def test_lag_buckets_are_bounded_and_make_no_metric_series_beyond(
        daemon: DaemonProcess, channel: grpc.Channel) -> None:
    # Each bucket of an engine's decision-lag histogram becomes a metric series.
    counters = pb.EngineCounters(answers_by_lag_steps=[1] * 100_000)
    details = step_refusal(channel, counters=counters)
    assert details.startswith("counters.answers_by_lag_steps: 100000 buckets exceed"), details
    assert 'lag="99999"' not in scrape(daemon)


def test_every_float_of_every_request_is_finite(channel: grpc.Channel) -> None:
    counters = pb.EngineCounters(provisional_block_seconds=INF)
    assert step_refusal(channel, counters=counters).startswith(
        "counters.provisional_block_seconds: must be a finite number")
    retention = retention_pb2_grpc.RetentionStub(channel)
    for duration_s in (NAN, INF, -1.0):
        details = refusal(lambda duration_s=duration_s: retention.AnnounceToolCall(
            retention_pb2.AnnounceToolCallRequest(job_id="j", tool="ls",
                                                  expected_duration_s=duration_s), timeout=5))
        assert details.startswith("expected_duration_s: must be a finite number"), details
    config = retention_pb2.RetentionConfig(decode_priority=90, decode_duration_s=INF)
    details = refusal(lambda: retention.SetDirectives(retention_pb2.SetDirectivesRequest(
        target=retention_pb2.RetentionTarget(job_id="j"), config=config, scope="s"), timeout=5))
    assert details.startswith("config.decode_duration_s: must be a "), details


@pytest.mark.parametrize("method", [
    "/kvtether.v1.EngineSession/Step", "/kvtether.v1.EngineSession/Session",
    "/kvtether.v1.Retention/SetDirectives", "/kvtether.v1.Retention/AnnounceToolCall",
    "/kvtether.v1.Inspect/GetJob", "/kvtether.v1.Inspect/WatchDecisions",
])
def test_undecodable_request_bytes_are_invalid_argument(channel: grpc.Channel,
                                                              method: str) -> None:
    garbage = b"\xff\xff\xff\xff"  # a field number 0 with a truncated varint: no message
    if method.endswith("/Session"):
        call = channel.stream_stream(method)
        details = refusal(lambda: list(call(iter([garbage]), timeout=5)))
    elif method.endswith("/WatchDecisions"):
        watch = channel.unary_stream(method)
        details = refusal(lambda: list(watch(garbage, timeout=5)))
    else:
        unary = channel.unary_unary(method)
        details = refusal(lambda: unary(garbage, timeout=5))
    assert details.startswith(f"{method}: the request does not decode"), details


def test_long_engine_id_is_refused_and_creates_no_metric_series(
        daemon: DaemonProcess, channel: grpc.Channel) -> None:
    stub = engine_session_pb2_grpc.EngineSessionStub(channel)
    huge = "e" * 1_000_000
    details = refusal(lambda: stub.Step(pb.StepReport(
        engine_id=huge, seq=1, snapshot=True, now_s=1.0, kv=KV,
        new_requests=[arrival()]), timeout=10))
    assert details == f"engine_id: 1000000 characters exceed the limit of {MAX_ID_CHARS}"
    text = scrape(daemon)
    assert "eeeeeeeeee" not in text
    assert len(text) < 100_000


def test_every_string_of_every_request_has_a_length_limit(channel: grpc.Channel) -> None:
    long_id, long_tool = "x" * (MAX_ID_CHARS + 1), "t" * (MAX_TOOL_CHARS + 1)
    too_long = f"{MAX_ID_CHARS + 1} characters exceed the limit of {MAX_ID_CHARS}"
    assert step_refusal(channel, new_requests=[arrival(job_id=long_id)]) \
        == f"new_requests[0].job_id: {too_long}"
    assert step_refusal(channel, new_requests=[arrival(tool_hint=long_tool)]) \
        == (f"new_requests[0].tool_hint: {MAX_TOOL_CHARS + 1} characters exceed the limit "
            f"of {MAX_TOOL_CHARS}")
    assert step_refusal(channel, released_pins=[long_id]) == f"released_pins[0]: {too_long}"
    retention = retention_pb2_grpc.RetentionStub(channel)
    inspect = inspect_pb2_grpc.InspectStub(channel)
    target = retention_pb2.RetentionTarget(job_id="j")
    config = retention_pb2.RetentionConfig(decode_priority=90)
    for field, call in (
        ("scope", lambda: retention.SetDirectives(retention_pb2.SetDirectivesRequest(
            target=target, config=config, scope=long_id), timeout=5)),
        ("target.session_id", lambda: retention.GetDirectives(retention_pb2.GetDirectivesRequest(
            target=retention_pb2.RetentionTarget(session_id=long_id)), timeout=5)),
        ("target.job_id", lambda: retention.ClearDirectives(
            retention_pb2.ClearDirectivesRequest(
                target=retention_pb2.RetentionTarget(job_id=long_id), scope="s"), timeout=5)),
        ("job_id", lambda: retention.AnnounceToolCall(retention_pb2.AnnounceToolCallRequest(
            job_id=long_id, tool="ls"), timeout=5)),
        ("job_id", lambda: inspect.GetJob(inspect_pb2.GetJobRequest(job_id=long_id), timeout=5)),
        ("request_id", lambda: inspect.Explain(inspect_pb2.ExplainRequest(request_id=long_id),
                                               timeout=5)),
        ("engine_id", lambda: inspect.ListPins(inspect_pb2.ListPinsRequest(engine_id=long_id),
                                               timeout=5)),
        ("job_id", lambda: list(inspect.WatchDecisions(inspect_pb2.WatchDecisionsRequest(
            job_id=long_id), timeout=5))),
    ):
        assert refusal(call) == f"{field}: {too_long}", field
    assert refusal(lambda: inspect.GetToolStats(inspect_pb2.GetToolStatsRequest(tool=long_tool),
                                                timeout=5)).startswith("tool: ")


def test_reserved_tool_name_is_refused_by_announce_tool_call(
        channel: grpc.Channel) -> None:
    retention = retention_pb2_grpc.RetentionStub(channel)
    details = refusal(lambda: retention.AnnounceToolCall(retention_pb2.AnnounceToolCallRequest(
        job_id="j", tool="*", expected_duration_s=1.0), timeout=5))
    assert details.startswith("tool: '*' is reserved"), details
    assert step_refusal(channel, pins=[pin(tool="*")]).startswith("pins[0].tool: '*' is reserved")
