"""The embedded store's memory stays bounded when the same keys are refreshed forever."""

from __future__ import annotations

from sidecar.store import EmbeddedStore, keys


async def test_refreshing_expiries_does_not_grow_the_deadline_heap() -> None:
    store = EmbeddedStore()
    for index in range(10_000):
        await store.hincr(keys.tool_stats(f"tool-{index % 10}"), {"count": 1},
                          ttl_ms=7 * 24 * 3600 * 1000)
    # Ten live keys: the heap holds their deadlines plus bounded slack, not 10,000.
    assert len(store._deadline_heap) <= 2 * 10 + 64 + 1
    assert (await store.hgetall(keys.tool_stats("tool-3")))["count"] == 1000


async def test_job_histories_are_bounded_by_count_oldest_first() -> None:
    """100k one-request jobs within the history TTL: the store keeps at most its
    bound of histories, dropping the least recently written first."""
    store = EmbeddedStore(max_histories=1_000)
    day_ms = 24 * 3600 * 1000
    for index in range(100_000):
        await store.append_capped(keys.job_history(f"job-{index}"), b"{}", 256, day_ms)
    histories = await store.scan(keys.pattern_for("history"), limit=1_000_000)
    assert len(histories) <= 1_000
    assert await store.list_items(keys.job_history("job-99999")) == [b"{}"]
    assert await store.list_items(keys.job_history("job-0")) == []


async def test_the_history_bound_keeps_directives_and_recent_tool_statistics() -> None:
    """Only what traffic creates one of per job or tool is bounded by count: an
    acknowledged directive stays until its TTL, and the pooled statistics, written
    with every sample, stay."""
    store = EmbeddedStore(max_histories=10)
    await store.set(keys.retention_directive("job:kept"), b"directive", ttl_ms=60_000)
    for index in range(100):
        await store.hincr(keys.tool_stats(keys.GLOBAL_TOOL), {"count": 1})
        await store.append_capped(keys.job_history(f"job-{index}"), b"{}", 256, 60_000)
    assert await store.get(keys.retention_directive("job:kept")) == b"directive"
    assert (await store.hgetall(keys.tool_stats(keys.GLOBAL_TOOL)))["count"] == 100
    assert len(await store.scan(keys.pattern_for("history"))) == 9


async def test_a_scan_of_a_full_store_leaves_the_event_loop_free() -> None:
    """Inspect's GetToolStats scans the store for tool statistics; on a full embedded
    store (every job history it may keep) that match takes long, and the event loop
    that answers engines must keep turning meanwhile."""
    import asyncio
    import time

    store = EmbeddedStore(max_histories=200_000)
    for index in range(200_000):
        await store.append_capped(keys.job_history(f"job-{index}"), b"{}", 256, 60_000)
    await store.hincr(keys.tool_stats("ls"), {"count": 1})
    longest_gap_s = 0.0
    scanning = True

    async def tick() -> None:
        nonlocal longest_gap_s
        last_s = time.perf_counter()
        while scanning:
            await asyncio.sleep(0)
            now_s = time.perf_counter()
            longest_gap_s = max(longest_gap_s, now_s - last_s)
            last_s = now_s

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    started_s = time.perf_counter()
    found = await store.scan(keys.pattern_for("stats"))
    scan_s = time.perf_counter() - started_s
    scanning = False
    await ticker
    assert found == [keys.tool_stats("ls")]
    # On the loop, the longest gap would be the whole scan.
    assert longest_gap_s < scan_s / 3, (longest_gap_s, scan_s)
