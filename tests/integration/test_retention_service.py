"""Retention over real gRPC, on the embedded store and on a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from sidecar.api.v1 import retention_pb2 as pb
from sidecar.api.v1 import retention_pb2_grpc
from tests.support.inprocess import inprocess_daemon

SESSION = pb.RetentionTarget(session_id="s1")


def ranges(*spec: tuple[int, int | None, int]) -> pb.RetentionConfig:
    config = pb.RetentionConfig()
    for start, end, priority in spec:
        token_range = config.token_ranges.add(token_start=start, priority=priority)
        if end is not None:
            token_range.token_end = end
    return config


@pytest.fixture(params=["embedded", "redis"])
async def retention(
        request: pytest.FixtureRequest) -> AsyncIterator[retention_pb2_grpc.RetentionStub]:
    flags = {}
    if request.param == "redis":
        flags = {"store": {"redis_url": request.getfixturevalue("clean_redis")}}
    async with inprocess_daemon(**flags) as (_daemon, channel):
        yield retention_pb2_grpc.RetentionStub(channel)


async def test_set_read_back_and_clear(retention: retention_pb2_grpc.RetentionStub) -> None:
    config = ranges((0, 512, 100), (512, None, 80))
    config.token_ranges[1].duration_s = 45.0
    answer = await retention.SetDirectives(
        pb.SetDirectivesRequest(target=SESSION, config=config, scope="dynamo"))
    assert answer.owner_scope == "dynamo"
    read = await retention.GetDirectives(pb.GetDirectivesRequest(target=SESSION))
    assert read.found and read.owner_scope == "dynamo" and read.config == config
    cleared = await retention.ClearDirectives(
        pb.ClearDirectivesRequest(target=SESSION, scope="dynamo"))
    assert cleared.cleared
    assert not (await retention.GetDirectives(pb.GetDirectivesRequest(target=SESSION))).found


async def test_only_the_owner_lowers_and_clears(
        retention: retention_pb2_grpc.RetentionStub) -> None:
    await retention.SetDirectives(pb.SetDirectivesRequest(
        target=SESSION, config=ranges((0, None, 80)), scope="owner"))
    # Another scope may raise...
    raised = await retention.SetDirectives(pb.SetDirectivesRequest(
        target=SESSION, config=ranges((0, None, 90)), scope="other"))
    assert raised.owner_scope == "owner"
    # ...but not lower.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await retention.SetDirectives(pb.SetDirectivesRequest(
            target=SESSION, config=ranges((0, None, 10)), scope="other"))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await retention.ClearDirectives(pb.ClearDirectivesRequest(target=SESSION, scope="other"))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await retention.ClearDirectives(pb.ClearDirectivesRequest(target=SESSION))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Nothing the refused calls tried changed anything.
    read = await retention.GetDirectives(pb.GetDirectivesRequest(target=SESSION))
    assert read.owner_scope == "owner" and read.config.token_ranges[0].priority == 90


async def test_racing_first_claims_leave_one_owner(
        retention: retention_pb2_grpc.RetentionStub) -> None:
    target = pb.RetentionTarget(job_id="raced")
    # Different scopes try to lower-or-set at once: exactly one owns the result.
    results = await asyncio.gather(*(
        retention.SetDirectives(pb.SetDirectivesRequest(
            target=target, config=ranges((0, None, 50 - i)), scope=f"scope-{i}"))
        for i in range(8)), return_exceptions=True)
    owners = {r.owner_scope for r in results if isinstance(r, pb.SetDirectivesResponse)}
    read = await retention.GetDirectives(pb.GetDirectivesRequest(target=target))
    assert owners == {read.owner_scope}


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (ranges((0, None, 101)), "config.token_ranges[0].priority"),
        (ranges((10, 10, 50)), "config.token_ranges[0].token_end"),
        (ranges((0, 100, 20), (100, None, 90)), "config.token_ranges"),
        (ranges(*[(i, i + 1, 50) for i in range(17)]), "config.token_ranges"),
    ],
)
async def test_invalid_directives_are_refused_naming_the_field(
    retention: retention_pb2_grpc.RetentionStub, config: pb.RetentionConfig, field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await retention.SetDirectives(
            pb.SetDirectivesRequest(target=SESSION, config=config, scope="s"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(field)
    assert not (await retention.GetDirectives(pb.GetDirectivesRequest(target=SESSION))).found


async def test_negative_duration_and_missing_target(
        retention: retention_pb2_grpc.RetentionStub) -> None:
    config = ranges((0, None, 50))
    config.token_ranges[0].duration_s = -1
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await retention.SetDirectives(pb.SetDirectivesRequest(target=SESSION, config=config))
    assert "duration_s" in refused.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await retention.GetDirectives(pb.GetDirectivesRequest())
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("target")


# --- authenticated scopes -------------------------------------------------------------
OWNER_TOKEN = "owner-token-0123456789"
OTHER_TOKEN = "other-token-0123456789"


def bearer(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture(params=["embedded", "redis"])
async def authenticated(
        request: pytest.FixtureRequest) -> AsyncIterator[retention_pb2_grpc.RetentionStub]:
    flags: dict[str, object] = {"auth": {"tokens": {OWNER_TOKEN: "owner",
                                                    OTHER_TOKEN: "other",
                                                    "engine-token-0123456789": "engines"},
                                         "engine_scopes": ["engines"]}}
    if request.param == "redis":
        flags["store"] = {"redis_url": request.getfixturevalue("clean_redis")}
    async with inprocess_daemon(**flags) as (_daemon, channel):
        yield retention_pb2_grpc.RetentionStub(channel)


async def test_with_auth_the_token_decides_the_scope(
        authenticated: retention_pb2_grpc.RetentionStub) -> None:
    # The claimed scope is ignored: the token authenticates "owner".
    answer = await authenticated.SetDirectives(pb.SetDirectivesRequest(
        target=SESSION, config=ranges((0, None, 80)), scope="other"),
        metadata=bearer(OWNER_TOKEN))
    assert answer.owner_scope == "owner"
    # A valid token of another scope may raise, not lower, not clear.
    raised = await authenticated.SetDirectives(pb.SetDirectivesRequest(
        target=SESSION, config=ranges((0, None, 90))), metadata=bearer(OTHER_TOKEN))
    assert raised.owner_scope == "owner"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await authenticated.SetDirectives(pb.SetDirectivesRequest(
            target=SESSION, config=ranges((0, None, 10)), scope="owner"),
            metadata=bearer(OTHER_TOKEN))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await authenticated.ClearDirectives(
            pb.ClearDirectivesRequest(target=SESSION, scope="owner"),
            metadata=bearer(OTHER_TOKEN))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    read = await authenticated.GetDirectives(pb.GetDirectivesRequest(target=SESSION),
                                             metadata=bearer(OTHER_TOKEN))
    assert read.owner_scope == "owner" and read.config.token_ranges[0].priority == 90
    cleared = await authenticated.ClearDirectives(
        pb.ClearDirectivesRequest(target=SESSION), metadata=bearer(OWNER_TOKEN))
    assert cleared.cleared


@pytest.mark.parametrize("metadata", [None, bearer("not-a-configured-token"),
                                      (("authorization", OWNER_TOKEN),)])
async def test_with_auth_mutations_need_a_valid_token(
        authenticated: retention_pb2_grpc.RetentionStub, metadata: tuple[tuple[str, str],
        ...] | None) -> None:
    await authenticated.SetDirectives(pb.SetDirectivesRequest(
        target=SESSION, config=ranges((0, None, 80))), metadata=bearer(OWNER_TOKEN))
    calls = [
        authenticated.SetDirectives(pb.SetDirectivesRequest(
            target=SESSION, config=ranges((0, None, 100)), scope="owner"), metadata=metadata),
        authenticated.ClearDirectives(pb.ClearDirectivesRequest(target=SESSION, scope="owner"),
                                      metadata=metadata),
        authenticated.AnnounceToolCall(pb.AnnounceToolCallRequest(job_id="j", tool="ls"),
                                       metadata=metadata),
    ]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert OWNER_TOKEN not in refused.value.details()
    # Reading takes a token too (any configured scope's here), and nothing changed.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await authenticated.GetDirectives(pb.GetDirectivesRequest(target=SESSION),
                                          metadata=metadata)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    read = await authenticated.GetDirectives(pb.GetDirectivesRequest(target=SESSION),
                                             metadata=bearer(OTHER_TOKEN))
    assert read.owner_scope == "owner" and read.config == ranges((0, None, 80))


async def test_announcements_of_many_jobs_leave_memory_bounded() -> None:
    """An orchestrator (or anyone) announcing tool calls for ever new job ids: what
    the daemon keeps of them stays within its job bound, not one entry per call."""
    import gc
    import tracemalloc

    flags = {"max_jobs_tracked": 50,
             "limits": {"retention_calls_per_s": 1e6, "retention_burst": 100_000}}
    async with inprocess_daemon(**flags) as (daemon, channel):
        retention = retention_pb2_grpc.RetentionStub(channel)

        async def announce(first: int, count: int) -> None:
            for index in range(first, first + count):
                job_id = f"{index:08d}".ljust(256, "j")
                await retention.AnnounceToolCall(pb.AnnounceToolCallRequest(
                    job_id=job_id, tool="pytest", expected_duration_s=30.0))

        await announce(0, 200)  # warm up gRPC's own caches
        tracemalloc.start()
        try:
            # What is kept, not what the cycle collector has yet to free (a handler's
            # finished coroutines and their frames wait for it).
            gc.collect()
            before = tracemalloc.take_snapshot()
            await announce(200, 3_000)
            gc.collect()
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        kept_bytes = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
        # 3,000 job ids of 256 characters are ~1 MB; a bounded daemon keeps ~nothing.
        assert kept_bytes < 200_000
        assert len(daemon.recorder.tracker) <= 50
