"""The embedded store: everything in this process, nothing outside it.

The default for a first run and for a single daemon. Same behaviour as the Redis
backend (both pass the same suite), including expiries: a key past its deadline is
gone for every reader. Expired keys are dropped lazily when touched and, so memory
stays bounded without a sweeper loop, a few of the oldest deadlines are collected on
every write (amortised O(log n)).

Expiry alone does not bound memory: a day's history TTL holds every job of the day.
So the lists and hashes — what traffic creates one of per job or per tool (histories,
tool statistics) — are also bounded by count: past ``max_histories`` the least
recently written goes first. Plain values (retention directives, acknowledged to
their callers) are not counted and live until their TTL. Redis bounds the same keys
by their TTLs and its own ``maxmemory`` policy.
"""

from __future__ import annotations

import asyncio
import fnmatch
import heapq
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TypeVar

from sidecar.store.base import Rule

T = TypeVar("T")

_Value = bytes | dict[str, float] | list[bytes]

DEFAULT_MAX_HISTORIES = 50_000


class EmbeddedStore:
    backend_name = "embedded"

    # Deadlines collected per write: enough to keep up with any write rate that
    # creates them, small enough to keep a write cheap.
    _COLLECT_PER_WRITE = 8

    def __init__(self, clock_s: object = time.monotonic,
                 max_histories: int = DEFAULT_MAX_HISTORIES) -> None:
        if max_histories < 1:
            raise ValueError(f"max_histories must be >= 1, got {max_histories!r}")
        self._clock_s = clock_s
        self._max_histories = max_histories
        self._values: dict[str, _Value] = {}
        # The list and hash keys, least recently written first.
        self._histories: OrderedDict[str, None] = OrderedDict()
        self._deadline_s: dict[str, float] = {}
        self._deadline_heap: list[tuple[float, str]] = []
        # A plain lock: calls are short and may come from the event loop or a thread.
        self._lock = threading.Lock()

    def _now_s(self) -> float:
        return self._clock_s()  # type: ignore[operator, no-any-return]

    # --- helpers; caller holds the lock -------------------------------------------
    def _live(self, key: str) -> _Value | None:
        deadline = self._deadline_s.get(key)
        if deadline is not None and deadline <= self._now_s():
            self._drop(key)
            return None
        return self._values.get(key)

    def _drop(self, key: str) -> bool:
        self._deadline_s.pop(key, None)
        self._histories.pop(key, None)
        return self._values.pop(key, None) is not None

    def _written_history(self, key: str) -> None:
        """A list or hash was written: it is the most recent; the oldest past the
        bound go."""
        histories = self._histories
        histories[key] = None
        histories.move_to_end(key)
        while len(histories) > self._max_histories:
            self._drop(next(iter(histories)))

    def _expire_in(self, key: str, ttl_ms: int | None) -> None:
        if ttl_ms is None:
            self._deadline_s.pop(key, None)
            return
        deadline = self._now_s() + ttl_ms / 1000.0
        self._deadline_s[key] = deadline
        heapq.heappush(self._deadline_heap, (deadline, key))
        # Refreshing a key's expiry leaves its old heap entry behind; rebuild the heap
        # from the live deadlines when stale entries outnumber them.
        if len(self._deadline_heap) > 2 * len(self._deadline_s) + 64:
            self._deadline_heap = [(d, k) for k, d in self._deadline_s.items()]
            heapq.heapify(self._deadline_heap)

    def _collect(self) -> None:
        now = self._now_s()
        for _ in range(self._COLLECT_PER_WRITE):
            if not self._deadline_heap or self._deadline_heap[0][0] > now:
                return
            deadline, key = heapq.heappop(self._deadline_heap)
            # Heap entries go stale when a key's expiry is refreshed; only the
            # current deadline counts.
            if self._deadline_s.get(key) == deadline:
                self._drop(key)

    def _typed(self, key: str, kind: type) -> _Value | None:
        value = self._live(key)
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"key {key!r} holds a {type(value).__name__}, not a {kind.__name__}")
        return value

    # --- Store --------------------------------------------------------------------
    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def get(self, key: str) -> bytes | None:
        with self._lock:
            value = self._typed(key, bytes)
            return value if isinstance(value, bytes) else None

    async def set(self, key: str, value: bytes, ttl_ms: int | None = None) -> None:
        with self._lock:
            self._histories.pop(key, None)
            self._values[key] = bytes(value)
            self._expire_in(key, ttl_ms)
            self._collect()

    async def delete(self, *keys: str) -> int:
        with self._lock:
            return sum(1 for key in keys if self._live(key) is not None and self._drop(key))

    async def pttl(self, key: str) -> int | None:
        with self._lock:
            if self._live(key) is None or key not in self._deadline_s:
                return None
            return max(0, round((self._deadline_s[key] - self._now_s()) * 1000.0))

    async def hincr(
        self, key: str, increments: Mapping[str, float], ttl_ms: int | None = None
    ) -> None:
        with self._lock:
            fields = self._typed(key, dict)
            if not isinstance(fields, dict):
                fields = {}
                self._values[key] = fields
            for name, delta in increments.items():
                fields[name] = fields.get(name, 0.0) + float(delta)
            self._written_history(key)
            self._expire_in(key, ttl_ms)
            self._collect()

    async def hgetall(self, key: str) -> dict[str, float]:
        with self._lock:
            fields = self._typed(key, dict)
            return dict(fields) if isinstance(fields, dict) else {}

    async def append_capped(
        self, key: str, item: bytes, max_len: int, ttl_ms: int | None = None
    ) -> None:
        with self._lock:
            items = self._typed(key, list)
            if not isinstance(items, list):
                items = []
                self._values[key] = items
            items.append(bytes(item))
            if len(items) > max_len:
                del items[: len(items) - max_len]
            self._written_history(key)
            self._expire_in(key, ttl_ms)
            self._collect()

    async def list_items(self, key: str) -> list[bytes]:
        with self._lock:
            items = self._typed(key, list)
            return list(items) if isinstance(items, list) else []

    async def scan(self, pattern: str, limit: int = 1000) -> list[str]:
        # Matching every key takes ~100 ms on a full store: it runs on a worker thread,
        # over a copy of the keys, so that the event loop that answers engines never
        # waits behind it (nor behind the lock while it runs).
        with self._lock:
            keys = list(self._values)
        matched = await asyncio.to_thread(_matching, keys, pattern)
        with self._lock:
            live = []
            for key in matched:
                if self._live(key) is not None:
                    live.append(key)
                    if len(live) >= limit:
                        break
            return live

    async def transact(self, keys: Sequence[str], rule: Rule[T]) -> T:
        with self._lock:
            current: dict[str, bytes | None] = {}
            for key in keys:
                value = self._typed(key, bytes)
                current[key] = value if isinstance(value, bytes) else None
            transition = rule(current)
            for key, write in transition.writes.items():
                if key not in current:
                    raise ValueError(f"rule wrote {key!r}, which it did not declare")
                if write.value is None:
                    self._drop(key)
                else:
                    self._histories.pop(key, None)
                    self._values[key] = bytes(write.value)
                    self._expire_in(key, write.ttl_ms)
            self._collect()
            return transition.result


def _matching(keys: list[str], pattern: str) -> list[str]:
    return [key for key in keys if fnmatch.fnmatchcase(key, pattern)]
