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
