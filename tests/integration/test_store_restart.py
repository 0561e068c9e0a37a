"""A Redis restart seen from the store: every pooled connection dies with the old
server, and the calls made once it is back must not fail for that (an operator's first
``grpcurl`` after a restart must not get UNAVAILABLE from a server that answers)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping

import pytest
from structlog.testing import capture_logs

from sidecar.store.base import StoreError, Transition, Write
from sidecar.store.redis_store import RedisStore
from tests.support.redis_server import RedisProcess, redis_binary


@pytest.fixture
def redis_process() -> Iterator[RedisProcess]:
    process = RedisProcess()
    process.start()
    yield process
    process.close()


def _count_up(values: Mapping[str, bytes | None]) -> Transition[int]:
    count = int(values["counter"] or b"0") + 1
    return Transition(count, {"counter": Write(str(count).encode())})


async def test_calls_after_a_redis_restart_succeed(redis_process: RedisProcess) -> None:
    store = await RedisStore.connect(redis_process.url, timeout_s=2.0, max_connections=8)
    try:
        await store.set("kept", b"before")
        assert await store.transact(["counter"], _count_up) == 1
        # Several calls at once: the pool holds several connections, all to die.
        await asyncio.gather(*(store.get("kept") for _ in range(6)))

        redis_process.kill()
        with pytest.raises(StoreError):
            await store.get("kept")  # down: a clear error, not a hang
        redis_process.start()  # same port and AOF data

        reads = await asyncio.gather(*(store.get("kept") for _ in range(6)))
        assert reads == [b"before"] * 6
        assert await store.transact(["counter"], _count_up) == 2  # applied once
        await store.hincr("tool", {"count": 1.0})
        assert await store.hgetall("tool") == {"count": 1.0}
    finally:
        await store.close()


# --- what a restart would lose ---------------------------------------------------------

async def _connect_logs(url: str) -> list[dict[str, object]]:
    """What the store logs while connecting to ``url`` (it must connect)."""
    with capture_logs() as logs:
        store = await RedisStore.connect(url, timeout_s=2.0)
        await store.close()
    return logs


@pytest.mark.parametrize(("persistence", "warned"), [
    ((), True),                                    # --save "" --appendonly no
    (("--appendonly", "yes"), False),
    (("--save", "3600 1"), False),
])
async def test_redis_without_persistence_warns(persistence: tuple[str, ...],
                                                     warned: bool) -> None:
    with redis_binary(extra_args=persistence) as (url, _process):
        logs = await _connect_logs(url)
    warnings = [entry for entry in logs if entry["event"] == "store_not_persistent"]
    if not warned:
        assert warnings == []
        return
    (warning,) = warnings
    assert warning["log_level"] == "warning"
    assert "restart" in str(warning["risk"]) and "appendonly yes" in str(warning["fix"])


async def test_redis_refusing_config_is_one_info_line() -> None:
    # Managed services refuse CONFIG: the daemon cannot tell, says so once, and serves.
    with redis_binary(extra_args=("--rename-command", "CONFIG", "")) as (url, _process):
        logs = await _connect_logs(url)
    events = [(entry["event"], entry["log_level"]) for entry in logs]
    assert events == [("store_persistence_unknown", "info")]
