"""The engine <-> daemon exchange over a real gRPC server: snapshots, deltas, gaps,
decisions, bad reports."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import engine_session_pb2_grpc, inspect_pb2, inspect_pb2_grpc
from sidecar.server.app import Daemon
from tests.support.daemon import running_daemon
from tests.support.inprocess import inprocess_daemon

KV = pb.KvCapacity(total_blocks=1000, free_blocks=900, block_size_tokens=16)


def new(request_id: str, job_id: str, arrival_s: float, last: bool = False,
        state: int = pb.REQUEST_STATE_WAITING) -> pb.NewRequest:
    return pb.NewRequest(request_id=request_id, job_id=job_id, arrival_s=arrival_s,
                         prompt_tokens=256, is_last_step=last, state=state)


def finished(request_id: str, at_s: float, tool: str = "", blocks: int = 16) -> pb.RequestEvent:
    return pb.RequestEvent(request_id=request_id, kind=pb.EVENT_KIND_FINISHED, at_s=at_s,
                           finish_reason=pb.FINISH_REASON_STOP, output_tokens=40, tool=tool,
                           blocks=blocks)


@pytest.fixture
async def daemon() -> AsyncIterator[tuple[Daemon, grpc.aio.Channel]]:
    async with inprocess_daemon(policy={"name": "continuum"}) as (daemon, channel):
        yield daemon, channel


class Engine:
    """A test engine speaking the Session stream."""

    def __init__(self, channel: grpc.aio.Channel, engine_id: str = "engine-a") -> None:
        self.engine_id = engine_id
        self.seq = 0
        self._outbox: asyncio.Queue[pb.StepReport | None] = asyncio.Queue()
        stub = engine_session_pb2_grpc.EngineSessionStub(channel)
        self.call = stub.Session(self._reports())

    async def _reports(self) -> AsyncIterator[pb.StepReport]:
        while (report := await self._outbox.get()) is not None:
            yield report

    async def send(
        self, snapshot: bool = False, seq: int | None = None, **fields: Any
    ) -> pb.StepDecision:
        self.seq = self.seq + 1 if seq is None else seq
        fields.setdefault("kv", KV)
        fields.setdefault("now_s", float(self.seq))
        await self._outbox.put(pb.StepReport(engine_id=self.engine_id, seq=self.seq,
                                             snapshot=snapshot, **fields))
        return await asyncio.wait_for(self.call.read(), 5)

    async def close(self) -> None:
        await self._outbox.put(None)


async def test_snapshot_then_deltas_are_decided(daemon: tuple[Daemon, grpc.aio.Channel]) -> None:
    _, channel = daemon
    engine = Engine(channel)
    first = await engine.send(snapshot=True, new_requests=[new("r1", "j1", 0.1)])
    assert first.seq == 1 and not first.resync_requested and first.policy == "continuum"
    second = await engine.send(new_requests=[new("r2", "j2", 0.2)])
    assert second.seq == 2 and not second.resync_requested
    await engine.close()


async def test_gap_and_unknown_engine_ask_for_a_snapshot(
        daemon: tuple[Daemon, grpc.aio.Channel]) -> None:
    _, channel = daemon
    engine = Engine(channel, "engine-gap")
    # A delta before any snapshot: the daemon knows nothing of this engine.
    assert (await engine.send(new_requests=[new("r1", "j1", 0.1)])).resync_requested
    await engine.send(snapshot=True, seq=5, new_requests=[new("r1", "j1", 0.1)])
    # seq 7 after 5: report 6 was lost.
    gap = await engine.send(seq=7, new_requests=[new("r2", "j2", 0.2)])
    assert gap.resync_requested and gap.seq == 7 and not gap.priorities
    # The engine answers with a snapshot and decisions resume.
    back = await engine.send(snapshot=True, new_requests=[new("r1", "j1", 0.1),
                                                          new("r2", "j2", 0.2)])
    assert not back.resync_requested and {p.request_id for p in back.priorities} == {"r1", "r2"}
    await engine.close()


async def test_job_fcfs_priorities_and_pin_lifecycle(
        daemon: tuple[Daemon, grpc.aio.Channel]) -> None:
    _, channel = daemon
    engine = Engine(channel, "engine-pins")
    decision = await engine.send(snapshot=True, new_requests=[
        new("old-job-t1", "old", 1.0), new("new-job-t1", "new", 2.0)])
    priority = {p.request_id: p.priority for p in decision.priorities}
    assert priority["old-job-t1"] < priority["new-job-t1"]

    # old-job turn 1 runs and finishes having called `ls`: continuum pins it.
    await engine.send(events=[pb.RequestEvent(request_id="old-job-t1",
                                              kind=pb.EVENT_KIND_ADMITTED, at_s=3.0)])
    kv = pb.KvCapacity(total_blocks=1000, free_blocks=900, block_size_tokens=16,
                       waiting_demand_blocks=12)
    decision = await engine.send(now_s=4.0, kv=kv,
                                 events=[finished("old-job-t1", 4.0, tool="ls")])
    (pin,) = decision.pins
    assert pin.request_id == "old-job-t1" and pin.action == pb.PIN_ACTION_PIN
    assert pin.expires_at_s > 4.0

    # Its next turn arrives after a job that arrived later: the pinned job goes first.
    decision = await engine.send(now_s=4.5, new_requests=[new("other-t1", "other", 4.2),
                                                          new("old-job-t2", "old", 4.4)])
    priority.update({p.request_id: p.priority for p in decision.priorities})
    assert priority["old-job-t2"] < priority["new-job-t1"] < priority["other-t1"]

    # The pin is visible to operators.
    inspect = inspect_pb2_grpc.InspectStub(channel)
    pins = await inspect.ListPins(inspect_pb2.ListPinsRequest())
    assert [(p.request_id, p.blocks) for p in pins.pins] == [("old-job-t1", 16)]
    why = await inspect.Explain(inspect_pb2.ExplainRequest(request_id="old-job-t1"))
    assert why.found and why.decision.kind == "pin" and "ls" in why.decision.inputs["tool"]
    # With the demand the plugin counted (shared prefixes once) it was decided on.
    assert why.decision.inputs["waiting_demand_blocks"] == "12"

    # The last step finishes: no pin for it, and the job's older pin goes.
    await engine.send(events=[pb.RequestEvent(request_id="old-job-t2",
                                              kind=pb.EVENT_KIND_ADMITTED, at_s=5.0)])
    last = await engine.send(now_s=30.0, events=[finished("old-job-t2", 30.0)])
    actions = {(p.request_id, p.action) for p in last.pins}
    assert ("old-job-t1", pb.PIN_ACTION_RELEASE) in actions
    assert ("old-job-t2", pb.PIN_ACTION_PIN) not in actions
    assert not (await inspect.ListPins(inspect_pb2.ListPinsRequest())).pins
    await engine.close()


async def test_stable_queue_sends_only_new_priorities(
        daemon: tuple[Daemon, grpc.aio.Channel]) -> None:
    _, channel = daemon
    engine = Engine(channel, "engine-stable")
    waiting = [new(f"r{i}", f"j{i}", float(i)) for i in range(50)]
    first = await engine.send(snapshot=True, new_requests=waiting)
    assert len(first.priorities) == 50
    # The head is admitted and one request arrives: only the newcomer needs a value.
    decision = await engine.send(
        new_requests=[new("r50", "j50", 50.0)],
        events=[pb.RequestEvent(request_id="r0", kind=pb.EVENT_KIND_ADMITTED, at_s=51.0)])
    assert [p.request_id for p in decision.priorities] == ["r50"]
    await engine.close()


@pytest.mark.parametrize(
    ("report", "field"),
    [
        (pb.StepReport(seq=1, snapshot=True), "engine_id"),
        (pb.StepReport(engine_id="e", seq=0, snapshot=True), "seq"),
        (pb.StepReport(engine_id="e", seq=1, snapshot=True, now_s=-1), "now_s"),
        (pb.StepReport(engine_id="e", seq=1, snapshot=True,
                       kv=pb.KvCapacity(total_blocks=1, free_blocks=2)), "kv.free_blocks"),
        (pb.StepReport(engine_id="e", seq=1, snapshot=True,
                       new_requests=[new("", "j", 0.0)]), "new_requests[0].request_id"),
        (pb.StepReport(engine_id="e", seq=1, snapshot=True,
                       new_requests=[new("x", "j", 0.0), new("x", "j", 0.0)]),
         "new_requests[1].request_id"),
        (pb.StepReport(engine_id="e", seq=1, snapshot=True,
                       events=[pb.RequestEvent(request_id="x")]), "events[0].kind"),
    ],
)
async def test_malformed_reports_are_refused_naming_the_field(
    daemon: tuple[Daemon, grpc.aio.Channel], report: pb.StepReport, field: str
) -> None:
    _, channel = daemon
    stub = engine_session_pb2_grpc.EngineSessionStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Step(report)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(f"{field}:")


async def test_events_for_unknown_requests_are_ignored(
        daemon: tuple[Daemon, grpc.aio.Channel]) -> None:
    _, channel = daemon
    engine = Engine(channel, "engine-unknown")
    await engine.send(snapshot=True)
    decision = await engine.send(events=[finished("never-reported", 2.0, tool="ls")])
    assert not decision.resync_requested and not decision.pins
    await engine.close()


async def test_requests_without_a_job_and_parallel_turns_run_clean(
        daemon: tuple[Daemon, grpc.aio.Channel]) -> None:
    # Continuum crashes on both (KeyError on history[-1]); here they are ordinary.
    _, channel = daemon
    engine = Engine(channel, "engine-crash-cases")
    await engine.send(snapshot=True, new_requests=[
        new("solo-1", "", 1.0), new("solo-2", "", 1.1),
        new("par-a", "parallel", 1.2), new("par-b", "parallel", 1.2)])
    for request_id in ("solo-1", "par-a", "par-b", "solo-2"):
        await engine.send(events=[pb.RequestEvent(request_id=request_id,
                                                  kind=pb.EVENT_KIND_ADMITTED, at_s=2.0)])
    decision = await engine.send(now_s=3.0, events=[
        finished("par-a", 3.0, tool="ls"), finished("par-b", 3.0, tool="cat"),
        finished("solo-1", 3.0), finished("solo-2", 3.0, tool="ls")])
    assert {p.request_id for p in decision.pins} == {"par-a", "par-b", "solo-1", "solo-2"}
    follow_up = await engine.send(now_s=3.1, new_requests=[new("par-c", "parallel", 3.1)])
    assert not follow_up.resync_requested
    await engine.close()


@pytest.fixture
async def daemon_process() -> AsyncIterator[grpc.aio.Channel]:
    with running_daemon("--policy", "continuum") as process:
        channel = grpc.aio.insecure_channel(process.address)
        yield channel
        await channel.close()


async def ended_with(engine: Engine) -> grpc.aio.AioRpcError:
    """The status that ends an engine's stream, which has no answer outstanding."""
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        answer = await asyncio.wait_for(engine.call.read(), 5)
        raise AssertionError(f"the stream was answered: {answer}")
    return ended.value


async def test_a_newer_session_replaces_the_older_one_whose_deltas_never_apply(
        daemon_process: grpc.aio.Channel) -> None:
    channel = daemon_process
    inspect = inspect_pb2_grpc.InspectStub(channel)
    older = Engine(channel, "shared-id")
    await older.send(snapshot=True, new_requests=[new("older-r1", "older-job", 0.1)])
    # The same engine reconnects (or a second engine has the same id): its snapshot wins.
    newer = Engine(channel, "shared-id")
    taken = await newer.send(snapshot=True, new_requests=[new("newer-r1", "newer-job", 0.2)])
    assert not taken.resync_requested
    # The older stream ends on its own, with a status that says why, so nothing it would
    # send next reaches the newer mirror. (A delta sent before that end lands is refused
    # by the registry: tests/unit/test_engine_ownership.py. Writing one here would race
    # the end, and a write that loses fails on the client as INTERNAL.)
    ended = await ended_with(older)
    assert ended.code() == grpc.StatusCode.ABORTED
    assert ended.details() == "engine 'shared-id': replaced by a newer session"
    # The newer engine's state is its own: its delta is decided, nothing of the older's.
    second = await newer.send(new_requests=[new("newer-r2", "newer-job", 2.5)])
    assert not second.resync_requested and [p.request_id for p in second.priorities] == [
        "newer-r2"]
    assert not (await inspect.Explain(inspect_pb2.ExplainRequest(request_id="older-r2"))).found
    assert not (await inspect.ListPins(inspect_pb2.ListPinsRequest())).pins
    await newer.close()


async def test_unary_step_cannot_touch_an_engine_with_a_live_session(
        daemon_process: grpc.aio.Channel) -> None:
    channel = daemon_process
    engine = Engine(channel, "live-engine")
    await engine.send(snapshot=True, new_requests=[new("r1", "j1", 0.1)])
    stub = engine_session_pb2_grpc.EngineSessionStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Step(pb.StepReport(engine_id="live-engine", seq=1, snapshot=True,
                                      now_s=1.5, kv=KV))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'live-engine'" in refused.value.details()
    # The live stream carries on as if nothing had been sent.
    decision = await engine.send(new_requests=[new("r2", "j2", 0.2)])
    assert not decision.resync_requested
    assert [p.request_id for p in decision.priorities] == ["r2"]
    await engine.close()
    # An engine without a live session can still be driven by Step (grpcurl, debugging).
    await asyncio.sleep(0.2)
    alone = await stub.Step(pb.StepReport(engine_id="live-engine", seq=1, snapshot=True,
                                          now_s=3.0, kv=KV))
    assert not alone.resync_requested


async def test_every_key_the_daemon_writes_to_redis_expires(clean_redis: str) -> None:
    """On Redis, histories (and everything else kvtether writes) are bounded by age:
    after jobs ran, tools were timed and a directive was set, no key lacks a TTL."""
    import redis as redis_client

    from sidecar.api.v1 import retention_pb2, retention_pb2_grpc

    async with inprocess_daemon(policy={"name": "continuum"},
                                store={"redis_url": clean_redis}) as (daemon, channel):
        engine = Engine(channel)
        await engine.send(snapshot=True, new_requests=[new("r1", "job", 1.0)])
        await engine.send(events=[finished("r1", 2.0, tool="pytest")])
        # The engine's clock reads the arrivals it reports: the tool time counts.
        await engine.send(new_requests=[new("r2", "job", 5.0), new("solo", "", 5.0)],
                          now_s=5.0)
        await engine.send(events=[finished("r2", 6.0), finished("solo", 6.0)], now_s=6.0)
        await retention_pb2_grpc.RetentionStub(channel).SetDirectives(
            retention_pb2.SetDirectivesRequest(
                target=retention_pb2.RetentionTarget(job_id="job"), scope="orchestrator",
                config=retention_pb2.RetentionConfig(decode_priority=80)))
        await engine.close()
        assert await daemon.recorder.drain()
    client = redis_client.Redis.from_url(clean_redis)
    written = [key.decode() for key in client.scan_iter("kvt:*")]
    assert {key.rsplit(":", 1)[-1] for key in written} >= {"history", "stats", "directive"}
    assert {key: client.pttl(key) for key in written if client.pttl(key) < 0} == {}
