"""Retention on the engine path, over real gRPC: a request's own directives and those
pushed for its job or session reach the engine as effective priorities
(StepDecision.retention), once, and again only when they change."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import engine_session_pb2_grpc, retention_pb2, retention_pb2_grpc
from tests.support.inprocess import inprocess_daemon

KV = pb.KvCapacity(total_blocks=100, free_blocks=100, block_size_tokens=16)
TOKEN = "orchestrator-token-0123"
ENGINE_TOKEN = "engine-token-0123456789"


def ranges(*spec: tuple[int, int | None, int]) -> retention_pb2.RetentionConfig:
    config = retention_pb2.RetentionConfig()
    for start, end, priority in spec:
        token_range = config.token_ranges.add(token_start=start, priority=priority)
        if end is not None:
            token_range.token_end = end
    return config


class Engine:
    def __init__(self, channel: Any, engine_id: str = "engine-r", token: str = "") -> None:
        self.stub = engine_session_pb2_grpc.EngineSessionStub(channel)
        self.engine_id = engine_id
        self.seq = 0
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None

    async def step(self, **fields: Any) -> pb.StepDecision:
        self.seq += 1
        report = pb.StepReport(engine_id=self.engine_id, seq=self.seq, snapshot=self.seq == 1,
                               now_s=float(self.seq), kv=KV, **fields)
        decision: pb.StepDecision = await self.stub.Step(report, metadata=self.metadata)
        return decision


def retention_of(decision: pb.StepDecision) -> dict[str, tuple[retention_pb2.RetentionConfig,
                                                               str]]:
    return {item.request_id: (item.config, item.scope) for item in decision.retention}


async def test_a_requests_own_directives_come_back_as_its_retention() -> None:
    async with inprocess_daemon(policy={"name": "fcfs"}) as (_daemon, channel):
        engine = Engine(channel)
        own = ranges((0, 256, 100), (256, None, 60))
        decision = await engine.step(new_requests=[
            pb.NewRequest(request_id="r1", job_id="j1", prompt_tokens=300, retention=own,
                          retention_scope="agent"),
            pb.NewRequest(request_id="r2", job_id="j2", prompt_tokens=300)])
        assert retention_of(decision) == {"r1": (own, "agent")}
        # Nothing changed: nothing is sent again.
        assert not (await engine.step(events=[pb.RequestEvent(
            request_id="r1", kind=pb.EVENT_KIND_ADMITTED, at_s=2.0)])).retention


async def test_invalid_request_directives_are_ignored_and_the_request_still_runs() -> None:
    async with inprocess_daemon(policy={"name": "fcfs"}) as (_daemon, channel):
        engine = Engine(channel)
        rising = ranges((0, 100, 20), (100, None, 90))
        decision = await engine.step(new_requests=[
            pb.NewRequest(request_id="bad", job_id="j", prompt_tokens=300, retention=rising)])
        assert not decision.retention
        assert [p.request_id for p in decision.priorities] == ["bad"]


@pytest.mark.parametrize("auth", [False, True])
async def test_pushed_directives_reach_live_and_new_requests(auth: bool) -> None:
    flags: dict[str, Any] = {"policy": {"name": "fcfs"}}
    metadata = None
    if auth:
        flags["auth"] = {"tokens": {TOKEN: "dynamo", ENGINE_TOKEN: "engines"},
                         "engine_scopes": ["engines"]}
        metadata = (("authorization", f"Bearer {TOKEN}"),)
    async with inprocess_daemon(**flags) as (_daemon, channel):
        engine = Engine(channel, token=ENGINE_TOKEN if auth else "")
        retention = retention_pb2_grpc.RetentionStub(channel)
        decision = await engine.step(new_requests=[
            pb.NewRequest(request_id="t1", job_id="s1", prompt_tokens=600,
                          retention=ranges((0, None, 10)), retention_scope="dynamo")])
        first = retention_of(decision)["t1"]
        assert first[0] == ranges((0, None, 10))
        # The orchestrator pushes directives for the session while t1 is live.
        pushed = ranges((0, 512, 100), (512, None, 80))
        pushed.token_ranges[1].duration_s = 45.0
        await retention.SetDirectives(retention_pb2.SetDirectivesRequest(
            target=retention_pb2.RetentionTarget(session_id="s1"), config=pushed,
            scope="dynamo"), metadata=metadata)
        decision = await engine.step()
        if auth:
            # t1's claimed scope is not trusted: its 10 cannot lower the pushed priorities.
            assert retention_of(decision)["t1"] == (pushed, "dynamo")
        else:
            # t1 speaks for the owner: its own directive replaces the pushed one for it,
            # so what the engine has for t1 stands (nothing is sent).
            assert "t1" not in retention_of(decision)
        # A new turn of the session with no directive of its own gets the pushed ones.
        decision = await engine.step(new_requests=[
            pb.NewRequest(request_id="t2", job_id="s1", prompt_tokens=700)])
        assert retention_of(decision)["t2"] == (pushed, "dynamo")
        # Cleared by the owner: withdrawn from the live requests that had only it.
        await retention.ClearDirectives(retention_pb2.ClearDirectivesRequest(
            target=retention_pb2.RetentionTarget(session_id="s1"), scope="dynamo"),
            metadata=metadata)
        decision = await engine.step()
        withdrawn = retention_of(decision)
        assert withdrawn["t2"] == (retention_pb2.RetentionConfig(), "")
        if auth:
            assert withdrawn["t1"][0] == ranges((0, None, 10))
        else:
            assert "t1" not in withdrawn  # unchanged: its own directive all along


async def test_directives_pushed_through_another_daemon_reach_the_engine(clean_redis: str) -> None:
    """Two daemons share a Redis store: directives pushed through one reach an engine
    connected to the other (fetched in the background, sent with a following step)."""
    import asyncio

    flags: dict[str, Any] = {"policy": {"name": "fcfs"}, "store": {"redis_url": clean_redis}}
    async with inprocess_daemon(**flags) as (_a, channel_a), \
            inprocess_daemon(**flags) as (_b, channel_b):
        pushed = ranges((0, None, 90))
        await retention_pb2_grpc.RetentionStub(channel_a).SetDirectives(
            retention_pb2.SetDirectivesRequest(
                target=retention_pb2.RetentionTarget(job_id="shared-job"), config=pushed,
                scope="dynamo"))
        engine = Engine(channel_b)
        decision = await engine.step(new_requests=[
            pb.NewRequest(request_id="x1", job_id="shared-job", prompt_tokens=100)])
        for _ in range(50):
            if decision.retention:
                break
            await asyncio.sleep(0.02)
            decision = await engine.step()
        assert retention_of(decision) == {"x1": (pushed, "dynamo")}
