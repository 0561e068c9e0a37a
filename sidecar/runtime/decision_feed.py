"""Decisions as they are taken, for live watchers (Inspect/WatchDecisions).

Publishing a decision costs the same whatever the number of watchers: the decision
joins one ring of the latest ``capacity`` decisions, and a watcher waiting for news is
woken by one shared future. A woken watcher then lets decisions gather for
``batch_interval_s`` before it reads, so each costs the event loop a few wake-ups a
second, not one per engine report. Each watcher reads the ring from its own cursor,
filters and sends at its own pace; the ring is its bounded queue. A watcher more
than ``capacity`` decisions behind has lost decisions and is dropped:
:meth:`Watch.next_batch` raises :class:`FellBehind` and :attr:`Watch.dropped` is set,
also for a watcher stuck in a send that never ends (a peer that does not read),
which a check every ``capacity`` decisions finds.

Contract: one event loop; :meth:`DecisionFeed.publish` never waits and never fails.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from typing import TYPE_CHECKING

from sidecar.telemetry import metrics

if TYPE_CHECKING:
    from sidecar.runtime.decider import Decision

DEFAULT_FEED_CAPACITY = 1024
# Watchers see decisions this much later at most, and the ring must hold what
# engines decide in that time.
DEFAULT_BATCH_INTERVAL_S = 0.05


class FellBehind(Exception):
    """The watcher's unread decisions no longer fit the ring: some are lost."""


class Watch:
    """One watcher's cursor in the feed, and its filter (empty: everything)."""

    def __init__(self, feed: DecisionFeed, engine_id: str = "", job_id: str = "") -> None:
        self._feed = feed
        self.engine_id = engine_id
        self.job_id = job_id
        # Decisions published before this one were read (or predate the watch).
        self.cursor = feed.published
        # Set when the watcher is dropped: whoever serves it ends its stream.
        self.dropped = asyncio.Event()

    async def next_batch(self) -> list[Decision]:
        """The decisions published since the last batch that pass the filter; waits
        until there is one. Raises :class:`FellBehind` once dropped."""
        feed = self._feed
        while True:
            if self.dropped.is_set():
                raise FellBehind
            unread = feed.published - self.cursor
            if unread > len(feed.ring):
                feed.drop(self)
                raise FellBehind
            if unread:
                self.cursor = feed.published
                batch = [decision for decision in itertools.islice(
                    feed.ring, len(feed.ring) - unread, None) if self._wants(decision)]
                if batch:
                    return batch
            # Shielded: a watcher cancelled while it waits must not cancel the
            # future every other waiting watcher shares.
            await asyncio.shield(feed.news())
            if feed.batch_interval_s:
                await asyncio.sleep(feed.batch_interval_s)

    def _wants(self, decision: Decision) -> bool:
        return ((not self.engine_id or decision.engine_id == self.engine_id)
                and (not self.job_id or decision.job_id == self.job_id))


class DecisionFeed:
    def __init__(self, capacity: int = DEFAULT_FEED_CAPACITY,
                 batch_interval_s: float = DEFAULT_BATCH_INTERVAL_S) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self.capacity = capacity
        self.batch_interval_s = batch_interval_s
        self.ring: deque[Decision] = deque(maxlen=capacity)
        # Decisions published while someone watched; the ring holds the latest.
        self.published = 0
        self.watches: set[Watch] = set()
        self._news: asyncio.Future[None] | None = None

    def watch(self, engine_id: str = "", job_id: str = "") -> Watch:
        watch = Watch(self, engine_id, job_id)
        self.watches.add(watch)
        return watch

    def leave(self, watch: Watch) -> None:
        self.watches.discard(watch)
        if not self.watches:
            self.ring.clear()  # nobody reads them: keep no decision alive

    def publish(self, decision: Decision) -> None:
        if not self.watches:
            return
        self.ring.append(decision)
        self.published += 1
        news = self._news
        if news is not None:
            self._news = None
            if not news.done():
                news.set_result(None)
        if self.published % self.capacity == 0:
            # Amortised: a watcher count per ``capacity`` decisions.
            for watch in [w for w in self.watches if self.published - w.cursor > self.capacity]:
                self.drop(watch)

    def drop(self, watch: Watch) -> None:
        if watch in self.watches:
            metrics.DECISION_WATCHERS_DROPPED.inc()
        self.leave(watch)
        watch.dropped.set()

    def news(self) -> asyncio.Future[None]:
        """Done when the next decision is published (shared by every waiting watcher)."""
        if self._news is None or self._news.done():
            self._news = asyncio.get_running_loop().create_future()
        return self._news
