"""Fleet-wide tool-time statistics: store-backed sketches with a local snapshot cache.

Write path (``record``): one sample becomes commutative increments added with
``Store.hincr`` to the tool's hash and to the pooled hash of every tool
(``keys.GLOBAL_TOOL``), each with a TTL so a tool nobody uses any more ages out.
Concurrent writers on any number of daemons lose nothing.

Read path (``distribution``): synchronous, from an in-memory snapshot, with no store
round trip, because it runs on the decision path. A daemon's snapshot follows its own
writes at once; samples other daemons recorded arrive with ``refresh`` (the runtime
calls it off the decision path, e.g. after each arrival of the tool or on a timer).

Contracts: not thread-safe, call from the daemon's event loop; ``record`` raises the
store's ``StoreError`` and leaves the snapshot untouched when the store write fails.
The tool and global hashes are separate keys (separate cluster slots), so a crash
between the two writes can leave the global pool one sample short: it is a
cold-start fallback, and one sample does not matter to it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable

from sidecar.estimators.sketch import LogBucketSketch, add_increments
from sidecar.framework.types import ToolTimeDistribution
from sidecar.store import keys
from sidecar.store.base import Store

DEFAULT_STATS_TTL_S = 7 * 24 * 3600.0
DEFAULT_MAX_CACHED_TOOLS = 10_000


class _Snapshot:
    """One tool's hash as last read or written, and its distribution built lazily."""

    __slots__ = ("distribution", "fields", "stale")

    def __init__(self, fields: dict[str, float]) -> None:
        self.fields = fields
        self.distribution: ToolTimeDistribution | None = None
        self.stale = True


class ToolTimeEstimator:
    def __init__(
        self,
        store: Store,
        *,
        sketch: LogBucketSketch | None = None,
        stats_ttl_s: float = DEFAULT_STATS_TTL_S,
        max_cached_tools: int = DEFAULT_MAX_CACHED_TOOLS,
    ) -> None:
        if stats_ttl_s <= 0 or not math.isfinite(stats_ttl_s):
            raise ValueError(f"stats_ttl_s must be a positive number, got {stats_ttl_s!r}")
        if max_cached_tools < 1:
            raise ValueError(f"max_cached_tools must be >= 1, got {max_cached_tools!r}")
        self._store = store
        self.sketch = sketch or LogBucketSketch()
        self._stats_ttl_ms = int(stats_ttl_s * 1000)
        self._max_cached_tools = max_cached_tools
        # LRU over tools: tool names come from model output, so their number is not
        # bounded by anything we control. The global pool is never evicted.
        self._snapshots: OrderedDict[str, _Snapshot] = OrderedDict()

    async def record(self, tool: str, duration_s: float) -> None:
        """Add one measured duration of ``tool`` to its statistics and the global pool."""
        if tool == keys.GLOBAL_TOOL:
            raise ValueError(f"{keys.GLOBAL_TOOL!r} names the global pool, not a tool")
        if math.isnan(duration_s):
            raise ValueError("duration_s is NaN")
        increments = self.sketch.increments(duration_s)
        await self._store.hincr(keys.tool_stats(tool), increments, self._stats_ttl_ms)
        await self._store.hincr(keys.tool_stats(keys.GLOBAL_TOOL), increments, self._stats_ttl_ms)
        # Follow our own writes locally; a tool seen for the first time is loaded
        # whole (with every daemon's samples, ours included) instead.
        for name in (tool, keys.GLOBAL_TOOL):
            snapshot = self._cached(name)
            if snapshot is None:
                await self.refresh(name)
            else:
                add_increments(snapshot.fields, increments)
                snapshot.stale = True

    def distribution(self, tool: str) -> ToolTimeDistribution | None:
        """The tool's distribution as this daemon last saw it; None when it has none."""
        snapshot = self._cached(tool)
        if snapshot is None:
            return None
        if snapshot.stale:
            snapshot.distribution = self.sketch.distribution(tool, snapshot.fields)
            snapshot.stale = False
        return snapshot.distribution

    def global_distribution(self) -> ToolTimeDistribution | None:
        """Every tool's samples pooled: the cold-start fallback."""
        return self.distribution(keys.GLOBAL_TOOL)

    async def refresh(self, tool: str) -> ToolTimeDistribution | None:
        """Reload the tool's statistics from the store (samples of every daemon)."""
        fields = await self._store.hgetall(keys.tool_stats(tool))
        snapshot = self._cached(tool) or self._add(tool)
        snapshot.fields = fields
        snapshot.stale = True
        return self.distribution(tool)

    async def refresh_all(self) -> None:
        """Reload every cached tool and the global pool (for a periodic task)."""
        for tool in [keys.GLOBAL_TOOL, *self.cached_tools()]:
            await self.refresh(tool)

    def cached_tools(self) -> list[str]:
        """Tools with a local snapshot, least recently used first (global pool excluded)."""
        return [tool for tool in self._snapshots if tool != keys.GLOBAL_TOOL]

    def preload(self, tools: Iterable[str]) -> None:
        """Make tools known so that ``refresh_all`` loads them (e.g. from the tool
        names the daemon sees in pins or hints before any sample is recorded)."""
        for tool in tools:
            if self._cached(tool) is None:
                self._add(tool)

    def _cached(self, tool: str) -> _Snapshot | None:
        snapshot = self._snapshots.get(tool)
        if snapshot is not None:
            self._snapshots.move_to_end(tool)
        return snapshot

    def _add(self, tool: str) -> _Snapshot:
        snapshot = _Snapshot({})
        self._snapshots[tool] = snapshot
        while len(self._snapshots) > self._max_cached_tools + 1:  # +1: the global pool
            oldest = next(iter(self._snapshots))
            if oldest == keys.GLOBAL_TOOL:
                self._snapshots.move_to_end(oldest)
                continue
            del self._snapshots[oldest]
        return snapshot
