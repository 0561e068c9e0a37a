"""The daemon's in-memory view of the directives in the store, for the decision path
(which does no I/O).

- This daemon's Retention service writes through it on every Set and Clear, so a
  directive is in force for the next engine step.
- On a store shared with other daemons (Redis), when a job's request arrives and the
  job's entries are missing or older than ``refresh_s``, they are fetched in the
  background (directives set through another daemon, or before a restart); if one
  changed, ``generation`` moves on and the decider re-sends the effective priorities
  of the live requests. On the embedded store this daemon is the only writer: the
  write-through is the whole truth and nothing is fetched.
- The store keeps each directive under its TTL (PEXPIRE); an entry here is only a
  cache of it, bounded to ``max_entries`` (least recently used dropped first). Where
  directives are fetched, a dropped entry is fetched again when needed, so the cache
  holds no more than the jobs the daemon tracks (``max_jobs``: two targets each);
  every job that passes would otherwise leave its two entries behind.

Called from the daemon's event loop only.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from sidecar.api.retention_ranges import DirectiveError
from sidecar.api.v1 import retention_pb2 as pb
from sidecar.retention.directives import StoredDirective
from sidecar.store import Store, StoreError, keys

log = structlog.get_logger("kvtether.retention")

# What a job id is looked up as: directives pushed for the job and for the session
# (vLLM's session id is the job id when the client names no job).
TARGET_KINDS = ("job", "session")


def target_of(target: pb.RetentionTarget) -> str:
    """``job:<id>`` or ``session:<id>``. Raises DirectiveError naming the field."""
    kind = target.WhichOneof("target")
    if kind is None:
        raise DirectiveError("target", "set job_id or session_id")
    value = getattr(target, kind)
    if not value:
        raise DirectiveError(f"target.{kind}", "must not be empty")
    return f"{kind.removesuffix('_id')}:{value}"


# Background directive refreshes in flight at once, and how often a failing refresh is
# logged (the count of failures since the last line comes with it).
MAX_FETCHES_IN_FLIGHT = 8
FAILURE_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class _Entry:
    directive: StoredDirective | None
    fetched_at_s: float
    # Bumped by every write-through: a fetch that started before one is stale.
    version: int


def _same(a: StoredDirective | None, b: StoredDirective | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.owner_scope == b.owner_scope and (
        a.config.SerializeToString(deterministic=True)
        == b.config.SerializeToString(deterministic=True)
    )


class RetentionDirectory:
    def __init__(
        self,
        store: Store,
        refresh_s: float = 1.0,
        max_entries: int = 100_000,
        clock_s: Callable[[], float] = time.monotonic,
        fetch: bool | None = None,
        max_jobs: int | None = None,
    ) -> None:
        self._store = store
        # None: fetch only from a store other daemons may write (not the embedded one).
        self._fetch_enabled = store.backend_name != "embedded" if fetch is None else fetch
        self._refresh_s = refresh_s
        # Without fetches the entries written through are the whole truth: only
        # max_entries bounds them.
        self._max_entries = (min(max_entries, len(TARGET_KINDS) * max_jobs)
                             if self._fetch_enabled and max_jobs is not None else max_entries)
        self._clock_s = clock_s
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._fetching: dict[str, asyncio.Task[None]] = {}
        # Background refreshes share the store's connection pool with everything else:
        # a few at a time, so a burst (every live job at once) queues here instead.
        self._fetch_slots: asyncio.Semaphore | None = None
        self._failures_logged_at_s = -math.inf
        self._failures_since_log = 0
        # Moves on whenever any entry's directive changes.
        self.generation = 0

    def put(self, target: str, directive: StoredDirective | None) -> None:
        """Write-through: ``target`` now holds ``directive`` (None: cleared)."""
        old = self._entries.get(target)
        version = 0 if old is None else old.version + 1
        self._store_entry(target, _Entry(directive, self._clock_s(), version),
                          changed=not _same(None if old is None else old.directive, directive))

    def for_job(self, job_id: str) -> list[StoredDirective]:
        """The directives pushed for a job (as a job, then as a session), as known now;
        refreshes stale entries in the background."""
        found = []
        stale: list[tuple[str, int]] = []
        now_s = self._clock_s()
        for kind in TARGET_KINDS:
            target = f"{kind}:{job_id}"
            entry = self._entries.get(target)
            if entry is None or now_s - entry.fetched_at_s >= self._refresh_s:
                stale.append((target, -1 if entry is None else entry.version))
            if entry is not None:
                self._entries.move_to_end(target)
                if entry.directive is not None:
                    found.append(entry.directive)
        if stale and self._fetch_enabled:
            self._fetch_later(job_id, stale)
        return found

    async def close(self) -> None:
        tasks = list(self._fetching.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- internals ----------------------------------------------------------------
    def _store_entry(self, target: str, entry: _Entry, changed: bool) -> None:
        self._entries[target] = entry
        self._entries.move_to_end(target)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
        if changed:
            self.generation += 1

    def _fetch_later(self, job_id: str, targets: list[tuple[str, int]]) -> None:
        if job_id in self._fetching:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no event loop (a synchronous caller): write-through only
        task = loop.create_task(self._fetch(targets), name=f"retention-fetch {job_id}")
        self._fetching[job_id] = task
        task.add_done_callback(lambda _done: self._fetching.pop(job_id, None))

    async def _fetch(self, targets: list[tuple[str, int]]) -> None:
        if self._fetch_slots is None:
            self._fetch_slots = asyncio.Semaphore(MAX_FETCHES_IN_FLIGHT)
        async with self._fetch_slots:
            for target, version in targets:
                await self._fetch_one(target, version)

    async def _fetch_one(self, target: str, version: int) -> None:
        try:
            raw = await self._store.get(keys.retention_directive(target))
            directive = StoredDirective.decode(raw) if raw is not None else None
        except (StoreError, ValueError, KeyError) as error:
            # One line per interval at most: a store outage must not flood the log.
            self._failures_since_log += 1
            now_s = self._clock_s()
            if now_s - self._failures_logged_at_s >= FAILURE_LOG_INTERVAL_S:
                log.warning("retention_fetch_failed", target=target, error=str(error),
                            failures=self._failures_since_log)
                self._failures_logged_at_s = now_s
                self._failures_since_log = 0
            directive, failed = None, True
        else:
            failed = False
        current = self._entries.get(target)
        if current is not None and current.version != version:
            return  # written through while fetching: that is newer
        if failed:
            if current is not None:  # keep what we had; try again after refresh_s
                self._store_entry(target, _Entry(current.directive, self._clock_s(),
                                                 current.version), changed=False)
            return
        next_version = 0 if current is None else current.version + 1
        self._store_entry(target, _Entry(directive, self._clock_s(), next_version),
                          changed=not _same(None if current is None else current.directive,
                                            directive))
