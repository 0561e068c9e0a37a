"""What the daemon learns from each step, kept in memory now and in the store soon after.

The decision path updates the in-memory job tracker synchronously (policies read it)
and queues the store writes — history events, tool-time samples — for a background
task, so a slow or failing store never delays a decision. The queue is bounded: when
the store is down for long, the oldest pending writes are dropped and counted
(``kvtether_store_writes_dropped_total``), and the daemon keeps deciding.

A write that fails for any other reason (a record the writer cannot apply) is logged
with its error (``recorder_write_dropped``), counted
(``kvtether_recorder_write_errors_total``) and dropped: one record never stops the
writes after it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable

import structlog

from sidecar.estimators.tool_time import ToolTimeEstimator
from sidecar.framework import RequestView
from sidecar.jobs import JobTracker
from sidecar.jobs.history import JobEvent, JobHistoryLog
from sidecar.jobs.tracker import MeasuredToolTime
from sidecar.store import Store, StoreError
from sidecar.telemetry import metrics

log = structlog.get_logger("kvtether.recorder")

Write = Callable[[], Awaitable[None]]
# How far a request's arrival may be past the engine's clock in the report that
# announces it (vLLM stamps arrivals in the API server's process, the plugin its
# reports in the engine's: one host's clock, read a little apart).
ENGINE_CLOCK_SLACK_S = 1.0


class Recorder:
    # Pending store writes kept while the store is slow or down.
    MAX_PENDING_WRITES = 100_000
    RETRY_BACKOFF_S = (0.05, 0.2, 1.0)
    ERROR_LOG_INTERVAL_S = 10.0

    def __init__(
        self,
        store: Store,
        tracker: JobTracker,
        estimator: ToolTimeEstimator,
        history_max_events: int,
        history_ttl_s: float,
    ) -> None:
        self.store = store
        self.tracker = tracker
        self.estimator = estimator
        self.history = JobHistoryLog(store, max_events=history_max_events, ttl_s=history_ttl_s)
        self.max_tool_time_s = history_ttl_s
        self._pending: deque[Write] = deque()
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        # Writes dropped (failed other than in the store) since the last log line.
        self._errors_unlogged = 0
        self._error_logged_at_s = -math.inf

    # --- called on the decision path (synchronous, no I/O) ------------------------
    def on_arrival(self, request: RequestView, engine_now_s: float | None = None) -> None:
        """``engine_now_s``: the engine's clock in the report that announced the
        request (None: not known, nothing checked against it)."""
        measured = self.tracker.on_arrival(request.job_id, request.request_id, request.arrival_s)
        if measured is not None and not self._possible(measured, engine_now_s):
            metrics.TOOL_TIMES_REFUSED.inc()
            measured = None
        if measured is not None:
            tool, duration_s = measured.tool, measured.duration_s
            self._enqueue(lambda: self.estimator.record(tool, duration_s))
        self._enqueue_history(JobEvent(
            kind="arrival", job_id=request.job_id, request_id=request.request_id,
            at_s=request.arrival_s, is_last_step=request.is_last_step,
            tool_time_s=None if measured is None else measured.duration_s,
            prompt_tokens=request.prompt_tokens,
        ))

    def _possible(self, measured: MeasuredToolTime, engine_now_s: float | None) -> bool:
        """Whether a finished turn could have produced this tool time (tool statistics
        are shared fleet-wide: one engine's impossible figures would move every
        engine's estimates): the arrival that ends it is not in the future of the
        engine's own clock, and it is no longer than a job's history lives
        (``store.history_ttl_s``: turns further apart are not one job's history)."""
        if (engine_now_s is not None
                and measured.arrival_s > engine_now_s + ENGINE_CLOCK_SLACK_S):
            return False
        return measured.duration_s <= self.max_tool_time_s

    def on_finish(self, request: RequestView, departure_s: float, tool: str | None,
                  output_tokens: int) -> None:
        # A turn departs after it arrived: an earlier departure (a clock that went
        # back, or a made-up one) would lengthen the tool time it starts.
        departure_s = max(departure_s, request.arrival_s)
        self.tracker.on_finish(request.job_id, request.request_id, departure_s, tool,
                               is_last_step=request.is_last_step)
        self._enqueue_history(JobEvent(
            kind="finish", job_id=request.job_id, request_id=request.request_id,
            at_s=departure_s, tool=tool, is_last_step=request.is_last_step,
            output_tokens=output_tokens,
        ))

    def on_abort(self, request: RequestView, at_s: float, output_tokens: int) -> None:
        self.tracker.on_abort(request.job_id, request.request_id)
        self._enqueue_history(JobEvent(
            kind="abort", job_id=request.job_id, request_id=request.request_id, at_s=at_s,
            output_tokens=output_tokens))

    def on_lost(self, requests: Iterable[RequestView]) -> None:
        """Requests no engine reports any more leave their jobs' in-flight sets. No
        history event: the request may well be alive on an engine that comes back."""
        self.tracker.on_lost((request.job_id, request.request_id) for request in requests)

    def _enqueue_history(self, event: JobEvent) -> None:
        self._enqueue(lambda: self.history.append(event))

    def _enqueue(self, write: Write) -> None:
        if len(self._pending) >= self.MAX_PENDING_WRITES:
            self._pending.popleft()
            metrics.STORE_WRITES_DROPPED.inc()
        self._pending.append(write)
        self._idle.clear()
        self._wakeup.set()

    # --- background ---------------------------------------------------------------
    async def run(self) -> None:
        """Apply queued writes in order; a write the store failed is retried (with
        backoff) until the store answers, so nothing queued is lost unless the queue
        overflows; a write that failed otherwise is dropped. Returns only if cancelled."""
        failures = 0
        while True:
            if not self._pending:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            write = self._pending[0]
            try:
                with metrics.STORE_LATENCY.time():
                    await write()
            except StoreError as error:
                metrics.STORE_ERRORS.inc()
                failures += 1
                if failures == 1 or failures % 100 == 0:
                    log.warning("store_write_failed", error=str(error), failures=failures,
                                pending=len(self._pending))
                backoff_s = self.RETRY_BACKOFF_S[min(failures, len(self.RETRY_BACKOFF_S)) - 1]
                await asyncio.sleep(backoff_s)
                continue
            except Exception as error:  # the record, not the store: retrying cannot help
                metrics.RECORDER_WRITE_ERRORS.inc()
                self._errors_unlogged += 1
                # Each is counted; a run of them (a bug every record hits) is logged at
                # most once per interval, with how many were dropped since the last line.
                now_s = time.monotonic()
                if now_s - self._error_logged_at_s >= self.ERROR_LOG_INTERVAL_S:
                    log.error("recorder_write_dropped",
                              error=f"{type(error).__name__}: {error}",
                              dropped=self._errors_unlogged, exc_info=error)
                    self._errors_unlogged = 0
                    self._error_logged_at_s = now_s
            else:
                if failures:
                    log.info("store_writes_resumed", after_failures=failures)
                    failures = 0
            # The queue may have dropped its head while the write ran (overflow).
            if self._pending and self._pending[0] is write:
                self._pending.popleft()

    async def drain(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued write reached the store; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    @property
    def pending_writes(self) -> int:
        return len(self._pending)
