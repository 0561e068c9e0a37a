"""The engine side of the daemon: sequence checking, mirrors, and one decision per report.

Protocol (see proto/README.md): a session's first report is a snapshot; every other
report carries ``seq = previous + 1``. A report the daemon cannot place — a delta for
an engine it has no mirror of (daemon restarted, session moved), a seq gap, or a delta
from a stream that has not sent this engine's snapshot — is not decided on: the answer
asks for a snapshot (``resync_requested``) and the engine keeps scheduling natively
until it has sent one.

One stream owns an engine id: the one that sent its latest snapshot. A newer stream's
snapshot replaces the owner (an engine that reconnects is heard at once, before the
daemon's keepalive notices that its old connection is dead); the replaced stream is
told so and nothing it sends after is applied. Which newer stream may take an engine
over (the same credential, at a bounded rate) is the server's to decide before the
snapshot gets here (``sidecar.server.engine_session``). A unary Step (grpcurl,
debugging) may drive only an engine that no stream owns.

What a report may hold is bounded (:class:`ReportLimits`): more running or waiting
requests or pins than a real engine keeps is refused whole (:class:`ReportTooLarge`,
``RESOURCE_EXHAUSTED`` on the wire) before any of it is applied, and what is applied is
done in slices that give the event loop back (:mod:`sidecar.runtime.slices`).

A unary Step has no stream whose end says that the engine left, so its requests never
hold their jobs in flight beyond the call that reported them: the daemon decides on
them, keeps them in the engine's mirror for the next Step's events, and lets their jobs
be forgotten as idle ones (``max_jobs_tracked``). Only a Session stream keeps jobs in
flight, until its requests finish or the stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog
from prometheus_client import Counter, Gauge

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.framework import EngineCost
from sidecar.runtime import slices
from sidecar.runtime.decider import Decider
from sidecar.runtime.mirror import EngineMirror, LiveRequest
from sidecar.runtime.reports import validate_report
from sidecar.runtime.steptime import EngineStepCosts, StepWork
from sidecar.telemetry import metrics
from sidecar.telemetry.engine_counters import EngineTotals

log = structlog.get_logger("kvtether.engines")


class EngineStream:
    """One Session stream's claim on an engine id; ``replaced`` is set when a newer
    stream's snapshot takes the engine over. ``scope``: the auth scope the stream
    reports as ("" without tokens), which the server checks a takeover against."""

    __slots__ = ("engine_id", "replaced", "scope")

    def __init__(self, scope: str = "") -> None:
        self.engine_id: str | None = None
        self.replaced = asyncio.Event()
        self.scope = scope


@dataclass(frozen=True, slots=True)
class ReportLimits:
    """The most an engine's report may hold (``limits`` in the daemon's configuration):
    far above what a real engine keeps (vLLM's ``max_num_seqs`` is 256 or 1,024 by
    default), so that one report cannot cost the daemon more than a bounded slice of
    work however it was made."""

    max_running: int = 4096
    max_waiting: int = 16384
    max_pins: int = 16384

    def check_snapshot(self, report: pb.StepReport) -> None:
        running = sum(1 for new in report.new_requests
                      if new.state == pb.REQUEST_STATE_RUNNING)
        self._check("new_requests", running, len(report.new_requests) - running,
                    len(report.pins), "in one snapshot")

    def check_mirror(self, mirror: EngineMirror) -> None:
        self._check("new_requests", len(mirror.running_ids()), len(mirror.waiting_ids()),
                    len(mirror.pins), "after this report")

    def check_delta(self, report: pb.StepReport, mirror: EngineMirror) -> None:
        """Before a delta is applied: the requests it adds cannot fit whatever its
        events do (each request is running or waiting)."""
        added = len(mirror.requests) + len(report.new_requests)
        if added > self.max_running + self.max_waiting:
            raise ReportTooLarge("new_requests", added, "requests (running and waiting)",
                                 self.max_running + self.max_waiting,
                                 "limits.max_running_per_engine + "
                                 "limits.max_waiting_per_engine", "after this report")
        if len(mirror.pins) + len(report.pins) > self.max_pins:
            raise ReportTooLarge("pins", len(mirror.pins) + len(report.pins), "pins",
                                 self.max_pins, "limits.max_pins_per_engine",
                                 "after this report")

    def _check(self, field: str, running: int, waiting: int, pins: int, where: str) -> None:
        for name, count, what, limit, setting in (
                (field, running, "running requests", self.max_running,
                 "limits.max_running_per_engine"),
                (field, waiting, "waiting requests", self.max_waiting,
                 "limits.max_waiting_per_engine"),
                ("pins", pins, "pins", self.max_pins, "limits.max_pins_per_engine")):
            if count > limit:
                raise ReportTooLarge(name, count, what, limit, setting, where)


class ReportTooLarge(Exception):
    """A report that would make an engine's mirror hold more than a limit allows."""

    def __init__(self, field: str, count: int, what: str, limit: int, setting: str,
                 where: str) -> None:
        super().__init__(f"{field}: {count} {what} {where} exceed {setting} ({limit})")
        self.field = field


class SessionConflict(Exception):
    """A report that another stream's ownership of its engine forbids placing."""

    def __init__(self, engine_id: str, problem: str) -> None:
        super().__init__(f"engine {engine_id!r}: {problem}")
        self.engine_id = engine_id


class SessionReplaced(SessionConflict):
    def __init__(self, engine_id: str) -> None:
        super().__init__(engine_id, "replaced by a newer session")


class EngineOwned(SessionConflict):
    def __init__(self, engine_id: str) -> None:
        super().__init__(engine_id, "has a live Session; a unary Step may not change it")


def _count_contents(report: pb.StepReport) -> None:
    carried = [name for name, present in (
        ("snapshot", report.snapshot), ("new_requests", bool(report.new_requests)),
        ("events", bool(report.events)), ("released_pins", bool(report.released_pins)))
        if present]
    for name in carried or ("clock",):
        metrics.STEP_REPORT_CONTENTS.labels(name).inc()


# An engine's series that describe its session (the last decision, the recent answer
# lags; its own counts are in metrics.ENGINE_COUNTERS): removed when the session ends.
_SESSION_GAUGES = (metrics.ENGINE_FINISHED_TURNS_CACHED, metrics.ENGINE_PREFILL_TIME_RATIO,
                   metrics.ENGINE_LATE_ANSWER_RATIO)
# What the daemon learned or counted of an engine: kept across its sessions (a counter
# that outlives a reconnect does not reset), removed when the engine is forgotten.
_LEARNED_SERIES = (metrics.ENGINE_PREFILL_S_PER_TOKEN, metrics.ENGINE_DECODE_S_PER_SEQ,
                   metrics.ENGINE_STEP_S, metrics.ENGINE_STEPS, metrics.PINS_UNRETURNED)
# How long an engine may be gone before the daemon forgets it (DaemonConfig).
DEFAULT_FORGET_AFTER_S = 600.0


def _remove_series(series: Gauge | Counter, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # never set: older prometheus-clients raise
        series.remove(*labels)


class EngineRegistry:
    """Mirrors of the engines talking to this daemon, keyed by engine id.

    Engines come and go with pods (the plugin's default id is ``host:pid``, new at
    every restart). What the daemon learned of an engine (its step cost, the policy's
    state for it) outlives a dropped connection, so an engine that reconnects carries
    on; an engine with no open session that has not reported or left for
    ``forget_after_s`` is forgotten (:meth:`forget_departed`): that state, its mirror,
    its metric series.
    """

    def __init__(self, decider: Decider, forget_after_s: float = DEFAULT_FORGET_AFTER_S,
                 clock_s: Callable[[], float] = time.monotonic,
                 limits: ReportLimits | None = None) -> None:
        if not forget_after_s > 0:
            raise ValueError(f"forget_after_s must be > 0, got {forget_after_s!r}")
        self.decider = decider
        self.forget_after_s = forget_after_s
        self._clock_s = clock_s
        # When each engine last reported or left, whichever is later (this daemon's
        # clock): whom to forget.
        self._last_seen_s: dict[str, float] = {}
        self.mirrors: dict[str, EngineMirror] = {}
        # Each engine's step cost, learned from its reports. Kept across sessions and
        # snapshots: the hardware does not change when the engine reconnects.
        self.step_costs = EngineStepCosts()
        # The live stream that owns each engine (sent its latest snapshot): only its
        # reports change the engine's mirror, and a stale stream closing after the
        # engine reconnected must not drop the new stream's mirror.
        self._owner: dict[str, EngineStream] = {}
        self.limits = limits if limits is not None else ReportLimits()
        # Held across one report's slices, so that two reports of one engine (a stream's
        # and a unary Step's, or two streams') never interleave on its mirror.
        # With the number of reports that hold or wait for each.
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def handle(self, report: pb.StepReport, stream: EngineStream | None = None
               ) -> pb.StepDecision:
        """Validate, place and decide one report, from ``stream`` or (None) a unary
        Step, all at once. Raises InvalidReport, ReportTooLarge, or SessionConflict
        where another stream owns the engine."""
        return slices.run(self._handle_steps(report, stream, time.perf_counter()))

    async def handle_async(self, report: pb.StepReport, stream: EngineStream | None = None
                           ) -> pb.StepDecision:
        """As :meth:`handle`, giving the event loop back between slices of the work."""
        started = time.perf_counter()
        engine_id = report.engine_id
        lock, users = self._locks.get(engine_id, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[engine_id] = (lock, users + 1)
        try:
            async with lock:
                return await slices.run_async(self._handle_steps(report, stream, started))
        finally:
            lock, users = self._locks[engine_id]
            if users == 1:
                del self._locks[engine_id]  # no other report of this engine holds or waits
            else:
                self._locks[engine_id] = (lock, users - 1)

    def _handle_steps(self, report: pb.StepReport, stream: EngineStream | None,
                      started: float) -> slices.Steps[pb.StepDecision]:
        validate_report(report)
        owner = self._owner.get(report.engine_id)
        if stream is None and owner is not None:
            raise EngineOwned(report.engine_id)
        if stream is not None and stream.replaced.is_set():
            raise SessionReplaced(report.engine_id)
        self._last_seen_s[report.engine_id] = self._clock_s()
        metrics.STEP_REPORTS.inc()
        _count_contents(report)
        mirror = self.mirrors.get(report.engine_id)
        if report.snapshot:
            self.limits.check_snapshot(report)
            metrics.SNAPSHOTS.inc()
            if mirror is None:
                log.info("engine_connected", engine_id=report.engine_id, seq=report.seq)
            else:
                listed = {new.request_id for new in report.new_requests}
                self._lose(live for request_id, live in mirror.requests.items()
                           if request_id not in listed)
            mirror = EngineMirror(report.engine_id)
            self.mirrors[report.engine_id] = mirror
            self.decider.forget(report.engine_id)
            if stream is not None:
                self._claim(report.engine_id, stream, owner)
        elif mirror is None or report.seq != mirror.last_seq + 1 or owner is not stream:
            metrics.RESYNCS_REQUESTED.inc()
            log.info("resync_requested", engine_id=report.engine_id, seq=report.seq,
                     expected=None if mirror is None else mirror.last_seq + 1)
            return pb.StepDecision(seq=report.seq, resync_requested=True,
                                   policy=self.decider.policy.name)
        else:
            self.limits.check_delta(report, mirror)
        delta = yield from mirror.apply_steps(report)
        try:
            self.limits.check_mirror(mirror)
        except ReportTooLarge:
            # Applied but not kept: the engine must send a snapshot within the limits.
            self._drop_mirror(report.engine_id)
            raise
        if report.work.steps:
            metrics.ENGINE_STEPS.labels(report.engine_id).inc(report.work.steps)
        mirror.engine_cost = self._learn_step_cost(report)
        mirror.prefill_rate.add(report.now_s, report.work.prefill_tokens)
        share = mirror.prefill_time_share()
        if share is not None:
            metrics.ENGINE_PREFILL_TIME_RATIO.labels(report.engine_id).set(share)
        decision = yield from self.decider.decide_steps(mirror, delta, report.seq)
        if stream is None and delta.arrived:
            self._lose(delta.arrived)  # no stream keeps them in flight (module doc)
        self._count(decision, mirror)
        metrics.DECISION_LATENCY.observe(time.perf_counter() - started)
        return decision

    def owner_of(self, engine_id: str) -> EngineStream | None:
        """The live stream that owns ``engine_id``, if one does."""
        return self._owner.get(engine_id)

    def _claim(self, engine_id: str, stream: EngineStream, owner: EngineStream | None) -> None:
        if owner is not None and owner is not stream:
            owner.replaced.set()
            metrics.ENGINE_SESSIONS_REPLACED.inc()
            log.warning("engine_session_replaced", engine_id=engine_id,
                        detail="a newer session sent this engine's snapshot; the older "
                               "one is ended (a reconnect, or two engines with one id)")
        stream.engine_id = engine_id
        self._owner[engine_id] = stream

    def step_cost_estimates(self) -> dict[str, EngineCost]:
        """Each engine's step cost, where it is known well enough."""
        return self.step_costs.estimates()

    def _learn_step_cost(self, report: pb.StepReport) -> EngineCost | None:
        work = report.work
        estimator = self.step_costs.add(report.engine_id, StepWork(
            work.steps, work.busy_s, work.prefill_tokens, work.decode_seqs)
            if work.steps else None)
        cost = estimator.current()
        if cost is None or cost is estimator.exported:  # not refitted since
            return cost
        estimator.exported = cost
        metrics.ENGINE_PREFILL_S_PER_TOKEN.labels(report.engine_id).set(
            cost.prefill_s_per_token)
        metrics.ENGINE_STEP_S.labels(report.engine_id).set(cost.step_s)
        metrics.ENGINE_DECODE_S_PER_SEQ.labels(report.engine_id).set(cost.decode_s_per_seq)
        logged_s = estimator.logged_prefill_s
        if logged_s is None or abs(cost.prefill_s_per_token - logged_s) > 0.1 * logged_s:
            estimator.logged_prefill_s = cost.prefill_s_per_token
            log.info("engine_step_cost", engine_id=report.engine_id,
                     prefill_s_per_token=f"{cost.prefill_s_per_token:.3g}",
                     decode_s_per_seq=f"{cost.decode_s_per_seq:.3g}",
                     step_s=f"{cost.step_s:.3g}", steps=cost.steps)
        return cost

    def disconnect(self, engine_id: str | None, stream: EngineStream) -> None:
        if engine_id is None or self._owner.get(engine_id) is not stream:
            return
        del self._owner[engine_id]
        self._last_seen_s[engine_id] = self._clock_s()
        self._remove_session_series(engine_id)
        if self._drop_mirror(engine_id):
            log.info("engine_disconnected", engine_id=engine_id)
        self._update_pin_gauges()

    def forget_departed(self) -> list[str]:
        """Forget every engine with no open session that has neither reported nor
        left for ``forget_after_s``; answer their ids. The daemon calls this
        periodically."""
        now_s = self._clock_s()
        departed = [engine_id for engine_id, at_s in self._last_seen_s.items()
                    if now_s - at_s >= self.forget_after_s and engine_id not in self._owner]
        for engine_id in departed:
            self._remove_session_series(engine_id)
            for series in _LEARNED_SERIES:
                _remove_series(series, engine_id)
            self.step_costs.forget(engine_id)
            self._drop_mirror(engine_id)  # a session-less engine still has one
            self.decider.policy.forget_engine(engine_id)
            # Last: an engine whose forgetting failed part way is tried again.
            gone_s = now_s - self._last_seen_s.pop(engine_id)
            log.info("engine_forgotten", engine_id=engine_id, gone_for_s=f"{gone_s:.0f}")
        if departed:
            self._update_pin_gauges()
        return departed

    def _drop_mirror(self, engine_id: str) -> bool:
        """The daemon stops seeing the engine's live requests (its session ended, or
        a session-less engine went silent): they no longer hold their jobs in flight,
        so ``max_jobs_tracked`` bounds the jobs of engines that left. An engine that
        reconnects lists the live ones again in its snapshot. False: no mirror."""
        mirror = self.mirrors.pop(engine_id, None)
        if mirror is None:
            return False
        self.decider.forget(engine_id)
        self._lose(mirror.requests.values())
        return True

    def _lose(self, requests: Iterable[LiveRequest]) -> None:
        self.decider.recorder.on_lost(live.view() for live in requests)

    def _remove_session_series(self, engine_id: str) -> None:
        for gauge in _SESSION_GAUGES:
            _remove_series(gauge, engine_id)
        metrics.ENGINE_COUNTERS.remove(engine_id)

    def _count(self, decision: pb.StepDecision, mirror: EngineMirror) -> None:
        if decision.priorities:
            metrics.DECISIONS.labels("priority").inc(len(decision.priorities))
        for pin in decision.pins:
            metrics.DECISIONS.labels("pin" if pin.action == pb.PIN_ACTION_PIN else "release").inc()
        counters = mirror.counters
        metrics.ENGINE_COUNTERS.update(mirror.engine_id, EngineTotals(
            fallback_steps=counters.fallback_steps, idle_waits=counters.idle_waits,
            idle_waits_missed=counters.idle_waits_missed,
            provisional_block_seconds=counters.provisional_block_seconds,
            answers_by_lag_steps=tuple(counters.answers_by_lag_steps),
            kv_hint_actions_ignored=counters.kv_hint_actions_ignored,
            kv_hint_fields_refused=counters.kv_hint_fields_refused))
        metrics.ENGINE_FINISHED_TURNS_CACHED.labels(mirror.engine_id).set(
            1 if decision.provisional_cache else 0)
        late_share = mirror.answer_lags.late_share()
        if late_share is not None:
            metrics.ENGINE_LATE_ANSWER_RATIO.labels(mirror.engine_id).set(late_share)
        if decision.pins:
            self._update_pin_gauges()

    def _update_pin_gauges(self) -> None:
        metrics.PINS_ACTIVE.set(sum(len(m.pins) for m in self.mirrors.values()))
        metrics.PINNED_BLOCKS.set(sum(m.pinned_blocks for m in self.mirrors.values()))
