"""Tool-time estimator and job history on a real store: both backends, and two daemon
processes sharing one Redis."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sidecar.estimators.sketch import LogBucketSketch
from sidecar.estimators.tool_time import ToolTimeEstimator
from sidecar.jobs.history import JobEvent, JobHistoryLog, read_job_history
from sidecar.store import Store, keys

REPO_ROOT = Path(__file__).resolve().parents[2]


# --- tool-time estimator -------------------------------------------------------------


async def test_record_updates_the_tool_and_the_global_pool_with_a_ttl(store: Store) -> None:
    estimator = ToolTimeEstimator(store, stats_ttl_s=60.0)
    for duration_s in (0.1, 0.2, 0.3):
        await estimator.record("ls", duration_s)
    await estimator.record("pytest", 4.0)

    tool_fields = await store.hgetall(keys.tool_stats("ls"))
    global_fields = await store.hgetall(keys.tool_stats(keys.GLOBAL_TOOL))
    assert tool_fields["count"] == 3.0
    assert global_fields["count"] == 4.0
    for key in (keys.tool_stats("ls"), keys.tool_stats(keys.GLOBAL_TOOL)):
        remaining_ms = await store.pttl(key)
        assert remaining_ms is not None and 0 < remaining_ms <= 60_000


async def test_distribution_is_read_locally_after_record(store: Store) -> None:
    estimator = ToolTimeEstimator(store)
    assert estimator.distribution("cat") is None
    for duration_s in (0.1, 0.2, 0.3, 0.4):
        await estimator.record("cat", duration_s)
    dist = estimator.distribution("cat")  # synchronous: no store round trip
    assert dist is not None
    assert dist.count == 4
    assert dist.quantile(1.0) == pytest.approx(0.4, rel=0.02)
    pooled = estimator.global_distribution()
    assert pooled is not None and pooled.count == 4


async def test_refresh_brings_other_daemons_samples(store: Store) -> None:
    daemon_a, daemon_b = ToolTimeEstimator(store), ToolTimeEstimator(store)
    await daemon_b.record("grep", 0.5)  # b caches grep before a records
    for _ in range(5):
        await daemon_a.record("grep", 1.0)
    stale = daemon_b.distribution("grep")
    assert stale is not None and stale.count == 1  # b's snapshot is its own until refresh
    fresh = await daemon_b.refresh("grep")
    assert fresh is not None and fresh.count == 6
    await daemon_b.refresh_all()
    pooled = daemon_b.global_distribution()
    assert pooled is not None and pooled.count == 6


async def test_a_tool_recorded_for_the_first_time_is_loaded_whole(store: Store) -> None:
    daemon_a, daemon_b = ToolTimeEstimator(store), ToolTimeEstimator(store)
    for _ in range(3):
        await daemon_a.record("find", 0.2)
    await daemon_b.record("find", 0.3)  # b never saw "find": it loads every sample
    dist = daemon_b.distribution("find")
    assert dist is not None and dist.count == 4


async def test_concurrent_records_lose_nothing(store: Store) -> None:
    daemons = [ToolTimeEstimator(store) for _ in range(2)]
    await asyncio.gather(*(daemons[i % 2].record("sed", 0.1 * (1 + i % 7)) for i in range(200)))
    dist = await daemons[0].refresh("sed")
    assert dist is not None
    assert dist.count == 200
    assert sum(dist.bucket_counts.values()) == 200


async def test_the_global_pool_is_not_a_tool(store: Store) -> None:
    with pytest.raises(ValueError, match="global pool"):
        await ToolTimeEstimator(store).record(keys.GLOBAL_TOOL, 1.0)


# --- job history ---------------------------------------------------------------------


async def test_job_history_round_trip_capped_with_ttl(store: Store) -> None:
    log = JobHistoryLog(store, max_events=4, ttl_s=60.0)
    events = [JobEvent("arrival", "job{1}", f"r{i}", float(i), tool_time_s=0.1) for i in range(6)]
    for event in events:
        await log.append(event)
    assert await log.read("job{1}") == events[-4:]  # newest kept, oldest first
    assert await read_job_history(store, "job{1}") == events[-4:]
    remaining_ms = await store.pttl(keys.job_history("job{1}"))
    assert remaining_ms is not None and 0 < remaining_ms <= 60_000
    assert await log.read("unknown") == []


async def test_job_history_skips_unreadable_items(store: Store) -> None:
    key = keys.job_history("mixed")
    await store.append_capped(key, b"garbage", max_len=10)
    good = JobEvent("finish", "mixed", "r1", 2.0, tool="ls")
    await JobHistoryLog(store).append(good)
    assert await read_job_history(store, "mixed") == [good]


# --- two daemon processes on one Redis ----------------------------------------------

SAMPLES_PER_PROCESS = 300

# A daemon process: connects its own RedisStore, waits for a common start instant,
# then records SAMPLES_PER_PROCESS samples of one tool as fast as it can.
_WORKER = textwrap.dedent(
    """
    import asyncio, sys, time
    from sidecar.estimators.tool_time import ToolTimeEstimator
    from sidecar.store.redis_store import RedisStore

    async def main(url, start_at, offset, count):
        store = await RedisStore.connect(url)
        estimator = ToolTimeEstimator(store)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        for i in range(count):
            await estimator.record("pytest", 0.5 + ((offset + i) % 50) * 0.1)
        await store.close()

    asyncio.run(main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
    """
)


def expected_fields(offsets: list[int]) -> dict[str, float]:
    sketch = LogBucketSketch()
    fields: dict[str, float] = {}
    for offset in offsets:
        for i in range(SAMPLES_PER_PROCESS):
            for name, delta in sketch.increments(0.5 + ((offset + i) % 50) * 0.1).items():
                fields[name] = fields.get(name, 0.0) + delta
    return fields


async def test_two_daemon_processes_updating_one_tool_lose_no_update(clean_redis: str) -> None:
    from sidecar.store.redis_store import RedisStore

    start_at = time.time() + 2.0  # both processes are connected by then
    offsets = [0, 7]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WORKER,
                clean_redis,
                str(start_at),
                str(offset),
                str(SAMPLES_PER_PROCESS),
            ],
            env=env,
            stderr=subprocess.PIPE,
        )
        for offset in offsets
    ]
    for worker in workers:
        _, stderr = await asyncio.to_thread(worker.communicate, timeout=120)
        assert worker.returncode == 0, stderr.decode()

    store = await RedisStore.connect(clean_redis)
    try:
        fields = await store.hgetall(keys.tool_stats("pytest"))
        pooled = await store.hgetall(keys.tool_stats(keys.GLOBAL_TOOL))
    finally:
        await store.close()
    expected = expected_fields(offsets)
    assert fields["count"] == 2 * SAMPLES_PER_PROCESS
    assert pooled["count"] == 2 * SAMPLES_PER_PROCESS
    assert fields.keys() == expected.keys()
    for name, value in expected.items():
        assert math.isclose(fields[name], value, rel_tol=1e-9, abs_tol=1e-9), name
