"""The engine-side agent: reports what the scheduler did, applies what the daemon decided.

It holds no policy. Contracts:
- every method is called on the engine thread only (the scheduler's thread);
- it never waits on the network longer than the configured deadline per step;
- every pinned block is released exactly once: by a daemon RELEASE, by its local
  bound, under allocation pressure, when the engine would idle on it, before
  ``reset_prefix_cache``, or at shutdown;
- an engine never idles on pins: when nothing runs and the first waiting request
  does not fit, pins give way here, one per step, without waiting for the daemon;
- with the daemon slow, gone or restarting, scheduling is vLLM's (fail-open), pins
  expire on their local bound, and the next connection starts with a snapshot;
- the daemon decides on the last report and its answer lands a step later: a RELEASE
  of a job's newest pin answering a report older than the job's latest request frees
  the blocks but keeps them cached at ``returned_job_priority`` (evicted after
  everything below it), so a turn arriving mid-step still finds its context.

The scheduler is duck-typed against vLLM 0.32/0.33's ``Scheduler``: ``requests``,
``running``, ``waiting`` / ``kv_holding_waiting`` (request queues), and
``kv_cache_manager`` (``pop_blocks_for_free``, ``get_block_ids``, ``block_pool``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sidecar.api.bounds import FieldError, check_text
from sidecar.api.retention_ranges import (
    DirectiveError,
    Protection,
    block_protections,
    from_request_directives,
)
from sidecar.api.v1 import engine_session_pb2 as pb
from vllm_plugin.demand import WaitingDemand
from vllm_plugin.link import DaemonLink
from vllm_plugin.metadata import RequestMetadata, read_metadata
from vllm_plugin.provisional import ProvisionalCache
from vllm_plugin.settings import PluginSettings

logger = logging.getLogger("kvtether.plugin")

# Priority of a request the daemon has not ranked yet: behind every ranked request,
# FCFS among themselves (vLLM breaks ties by arrival time). The daemon's values stay
# below this (sidecar.runtime.priorities.PRIORITY_LIMIT).
UNRANKED_PRIORITY = 1 << 30
# Output tokens decoded at finish to find the tool call the turn ended with.
TOOL_TAIL_TOKENS = 512
# Requests reported and not yet answered that the agent remembers (for retention that
# arrives after a request finished); older ones are forgotten.
MAX_UNANSWERED = 4096
# Jobs whose latest request's report seq the agent remembers (stale-release check).
MAX_JOBS_REMEMBERED = 4096
# Buckets of the decision-lag histogram: 0-6 steps, and 7 or more.
LAG_BUCKETS = 8


@dataclass(slots=True)
class Pin:
    request_id: str
    job_id: str
    blocks: list[Any]  # vLLM KVCacheBlocks, allocation order
    pinned_at_s: float
    # Local bound: released when the engine clock passes it, whatever happens.
    release_at_s: float
    confirmed: bool
    last_sched_seq: int
    tool: str


_FINISH_REASONS = {
    "FINISHED_STOPPED": pb.FINISH_REASON_STOP,
    "FINISHED_LENGTH_CAPPED": pb.FINISH_REASON_LENGTH,
    "FINISHED_ABORTED": pb.FINISH_REASON_ABORT,
    "FINISHED_IGNORED": pb.FINISH_REASON_ABORT,
    "FINISHED_ERROR": pb.FINISH_REASON_ERROR,
}


def _finish_reason(status: Any) -> pb.FinishReason:
    return _FINISH_REASONS.get(getattr(status, "name", ""), pb.FINISH_REASON_STOP)


class EngineAgent:
    def __init__(
        self,
        scheduler: Any,
        settings: PluginSettings,
        link: DaemonLink | None = None,
        clock_s: Callable[[], float] = time.time,
        decode_tail: Callable[[Sequence[int]], str] | None = None,
        parse_tool: Callable[[str | None, str | None], str | None] | None = None,
    ) -> None:
        self.sched = scheduler
        self.settings = settings
        self.link = link if link is not None else DaemonLink.for_settings(settings)
        # vLLM stamps arrivals with time.time(); the daemon decides on this clock.
        self.clock_s = clock_s
        self._decode_tail = decode_tail
        self._parse_tool = parse_tool
        self.block_pool = scheduler.kv_cache_manager.block_pool
        self.waiting_demand = WaitingDemand(scheduler, settings.waiting_demand_interval_s)
        self.metadata: dict[str, RequestMetadata] = {}
        self.pins: dict[str, Pin] = {}
        self.seq = 0
        self.counters = pb.EngineCounters()
        self._new: list[pb.NewRequest] = []
        self._events: list[pb.RequestEvent] = []
        self._released: list[str] = []
        self._provisional_pins = False  # until the daemon's policy asks for them
        self._provisional_cache = False  # held, unless the policy asks them cached
        self._pressure_order: list[str] = []
        self._pressure_max_running: int | None = None
        self._last_free_blocks = -1
        self._admission_stalled = False
        self._last_stalled = False  # the admission_stalled of the last report
        self._last_report_s = float("-inf")  # engine clock of the last report sent
        self._reported_this_step = False
        # Installs / removes the pin-aware allocation wrapper (set by the scheduler).
        self.allocation_hook: Callable[[bool], None] | None = None
        self._allocation_hook_on = False
        self._step_allocation_bound = self._allocation_bound()
        # Decision lag: steps between sending a report and applying its answer.
        # lag_counts[k] counts answers applied k steps late (last bucket: >= that);
        # it is the counters' field, so every report carries it to the daemon.
        self.step_index = 0
        self.counters.answers_by_lag_steps.extend([0] * LAG_BUCKETS)
        self.lag_counts = self.counters.answers_by_lag_steps
        self._sent_at_step: dict[int, int] = {}
        # Retention: the effective priorities the daemon sent per live request, applied
        # to its blocks when they are freed (vllm_plugin.retention; None: not installed).
        self.retention: dict[str, pb.BlockRetention] = {}
        self._pool_retention = getattr(self.block_pool, "kvtether_retention", None)
        # Finished turns freed at the top priority while the daemon decides (None:
        # retention not installed, so they are held instead).
        self.provisional = (ProvisionalCache(self._pool_retention, clock_s)
                            if self._pool_retention is not None else None)
        # Requests reported but not yet answered (seq of that report, oldest first), and
        # the cached blocks of those that finished meanwhile: their priorities, if the
        # answer carries any, still apply to whatever of them is still cached.
        self._unanswered: deque[tuple[int, str]] = deque()
        self._unanswered_ids: set[str] = set()
        # Live requests whose id the daemon would refuse (vLLM takes a client's own
        # request_id or X-Request-Id, of any length): never reported, so one client
        # cannot get the engine's every report refused; vLLM schedules them in its own
        # order and frees their blocks as it does.
        self._unreported: set[str] = set()
        self._finished_unanswered: dict[str, _FreedBlocks] = {}
        # Per job, the seq of the report that carried its latest request. A release
        # answering an older report was decided without knowing the job is back (the
        # answer crossed the request in flight): see _release_is_stale.
        self._job_reported_seq: dict[str, int] = {}
        self.stale_releases_retained = 0
        # Steps scheduled and not yet updated: (engine clock at the end of schedule(),
        # prefill tokens, decode requests), oldest first (async scheduling schedules
        # the next step before the last one is updated). Timed steps add to the work
        # the next report carries, from which the daemon learns the step cost.
        self._steps_in_flight: deque[tuple[float, int, int]] = deque()
        self._work = pb.StepWork()

    # --- hooks called by the scheduler ------------------------------------------------
    def on_add(self, request: Any) -> None:
        """A new request, before vLLM enqueues it."""
        meta = read_metadata(request)
        self.metadata[request.request_id] = meta
        request.priority = UNRANKED_PRIORITY
        if not _reportable(request.request_id):
            self._unreported.add(request.request_id)
            return
        if self.link.connected:
            self._new.append(self._new_request(request, meta, pb.REQUEST_STATE_WAITING))

    def before_schedule(self) -> None:
        """Apply whatever the daemon answered since the last step; expire local pins.
        Requests that arrived since the last report are reported first (and their
        ranks waited for, within the deadline), so a new request is admitted in the
        policy's order from its very first step."""
        self._reported_this_step = False
        self.step_index += 1
        if self._new:
            self.flush()  # ranks come with the next step; until then they queue last
        # Fail-open: schedule now with what has arrived; fail-closed: wait for it first.
        wait_s = 0.0
        if self.link.waiting_for_answer:
            wait_s = (self.settings.closed_wait_s if self.settings.fail_closed
                      else 0.0)
        self._apply(self.link.take_decisions(wait_s))
        # On policy: connected, and no answer overdue (one in flight since the last
        # step is the normal one-step lag). Otherwise this step is vLLM's own.
        overdue = any(sent < self.step_index - 1 for sent in self._sent_at_step.values())
        if not self.link.connected or overdue:
            self.counters.fallback_steps += 1
        self._expire_local_pins()
        self._set_allocation_hook(self._pins_may_give_way())

    def after_schedule(self, output: Any) -> None:
        stalled = not getattr(output, "total_num_scheduled_tokens", 1) and bool(
            len(self.sched.waiting) + len(getattr(self.sched, "kv_holding_waiting", ()))
        )
        # Resolved here, the stall is not the daemon's to resolve: the next step admits.
        self._admission_stalled = stalled and not (
            self.pins and not self.sched.running and self._release_for_idle_engine())
        if not self.link.connected:
            return
        now_s = self.clock_s()
        self._start_timing(output, now_s)
        for new in getattr(output, "scheduled_new_reqs", ()):
            # At admission, computed tokens are the prefix-cache hit.
            self._add_event(pb.RequestEvent(
                request_id=new.req_id, kind=pb.EVENT_KIND_ADMITTED, at_s=now_s,
                cached_tokens=int(getattr(new, "num_computed_tokens", 0) or 0)))
        cached = getattr(output, "scheduled_cached_reqs", None)
        for request_id in getattr(cached, "resumed_req_ids", ()) or ():
            self._add_event(pb.RequestEvent(
                request_id=request_id, kind=pb.EVENT_KIND_ADMITTED, at_s=now_s))
        for request_id in getattr(output, "preempted_req_ids", None) or ():
            self._add_event(pb.RequestEvent(
                request_id=request_id, kind=pb.EVENT_KIND_PREEMPTED, at_s=now_s))

    def _add_event(self, event: pb.RequestEvent) -> None:
        if event.request_id not in self._unreported:
            self._events.append(event)

    def on_finish(self, request: Any) -> None:
        """A request finished (any reason), before its blocks are freed."""
        meta = self.metadata.get(request.request_id) or RequestMetadata()
        reason = _finish_reason(request.status)
        tool = meta.tool
        if not tool and not meta.is_last_step and reason == pb.FINISH_REASON_STOP:
            tool = self._tool_of(request, meta) or ""
        # Keep the parsed tool for the pin, should one be made right after.
        self.metadata[request.request_id] = RequestMetadata(
            job_id=meta.job_id, is_last_step=meta.is_last_step, tool=tool)
        if self.link.connected:
            self._add_event(pb.RequestEvent(
                request_id=request.request_id, kind=pb.EVENT_KIND_FINISHED,
                at_s=self.clock_s(), finish_reason=reason,
                output_tokens=getattr(request, "num_output_tokens", 0), tool=tool,
                blocks=self._blocks_of(request.request_id)))

    def take_blocks(self, request: Any) -> bool:
        """Pin a finished request's blocks instead of freeing them (provisionally, until
        the daemon decides). True: pinned, and the request is removed from the
        scheduler; False: the caller frees them as vLLM does."""
        meta = self.metadata.pop(request.request_id, None) or RequestMetadata()
        if request.request_id in self._unreported:
            self._unreported.discard(request.request_id)
            return False  # the daemon never heard of it: no pin it could decide on
        if meta.is_last_step and meta.job_id:
            # The job is over: no pin of it can serve another turn. Released here, not
            # at the daemon's word, so an engine going idle never holds them.
            for pin in [p for p in self.pins.values() if p.job_id == meta.job_id]:
                self._release(pin, local=True)
            if self.provisional is not None:
                self.provisional.release_job(meta.job_id)
        if (
            not self._provisional_pins
            or not self.link.connected
            # A request with no job (no job_id, no session) has no next turn to keep
            # its blocks for: holding them would only squeeze everyone else.
            or not meta.job_id
            or meta.is_last_step
            or _finish_reason(request.status) not in (pb.FINISH_REASON_STOP,
                                                      pb.FINISH_REASON_LENGTH)
        ):
            return False
        if self._cache_provisionally(request, meta):
            return False  # vLLM frees them, queued at the provisional priority
        blocks = self.sched.kv_cache_manager.pop_blocks_for_free(request)
        del self.sched.requests[request.request_id]
        now_s = self.clock_s()
        self.pins[request.request_id] = Pin(
            request_id=request.request_id,
            job_id=meta.job_id or request.request_id,
            blocks=list(blocks),
            pinned_at_s=now_s,
            release_at_s=now_s + self.settings.provisional_pin_s,
            confirmed=False,
            last_sched_seq=getattr(request, "last_sched_seq", 0),
            tool=meta.tool,
        )
        return True

    def _cache_provisionally(self, request: Any, meta: RequestMetadata) -> bool:
        """Keep the finished turn's blocks cached at the provisional priority instead of
        holding them (vllm_plugin.provisional), when the daemon asks for it and the
        blocks are the plugin's to prioritise: one KV cache group, and no retention
        directives of the request's own (set or still to come)."""
        if (not self._provisional_cache or self.provisional is None
                or request.request_id in self.retention
                or request.request_id in self._unanswered_ids):
            return False
        groups = self.sched.kv_cache_manager.get_blocks(request.request_id).blocks
        if len(groups) != 1 or not groups[0]:
            return False
        return self.provisional.keep(
            request.request_id, meta.job_id, groups[0], self.settings.provisional_pin_s,
            getattr(request, "last_sched_seq", 0), meta.tool)

    def forget(self, request_id: str) -> None:
        """A request left without a pin (its blocks were freed the vLLM way)."""
        self.metadata.pop(request_id, None)
        self._unreported.discard(request_id)
        self.retention.pop(request_id, None)

    def retain(self, request: Any) -> None:
        """The request's blocks are about to be freed (finish, preemption, pin): give
        them, in the block pool's side table, the priorities the daemon sent for it."""
        if self._pool_retention is None:
            return
        retention = self.retention.get(request.request_id)
        finished = request.is_finished()
        if retention is None:
            if finished and request.request_id in self._unanswered_ids:
                self._finished_unanswered[request.request_id] = self._freed_blocks(request)
            return
        if finished:
            del self.retention[request.request_id]
        freed = self._freed_blocks(request)
        for block_size, blocks, _hashes in freed.groups:
            protections = block_protections(retention.config, len(blocks), block_size,
                                            freed.prompt_tokens)
            self._pool_retention.retain(blocks, protections, retention.scope)

    def _freed_blocks(self, request: Any) -> _FreedBlocks:
        manager = self.sched.kv_cache_manager
        groups = []
        for group, blocks in enumerate(manager.get_blocks(request.request_id).blocks):
            if blocks:
                groups.append((_block_size(manager, group, default=self.sched.block_size),
                               list(blocks), [block.block_hash for block in blocks]))
        return _FreedBlocks(int(request.num_prompt_tokens), groups)

    def after_update(self) -> None:
        """End of a step: report what changed, once per step. The answer is applied at
        the next ``schedule()`` (a lag of one step; on a GPU the model's forward pass
        hides the round trip) — except when the engine is about to go idle: then the
        answer is waited for (within the deadline) and applied now, because an idle
        engine does not step again and a pin released now must not stay held."""
        if not self._reported_this_step:
            self._reported_this_step = True
            if self._steps_in_flight:  # once per update (this may be called twice)
                self._finish_timing()
            idle = not self.sched.has_unfinished_requests()
            self.flush(wait_s=self.settings.deadline_s if idle else 0.0)

    def _start_timing(self, output: Any, now_s: float) -> None:
        """Remember what this step scheduled, to time it when it is updated. A
        request scheduled one token decodes; more, it computes its prompt (a chunk of
        it, or a re-computation). A step that scheduled nothing is not timed."""
        scheduled = getattr(output, "num_scheduled_tokens", None)
        total = int(getattr(output, "total_num_scheduled_tokens", 0) or 0)
        if not scheduled or total <= 0:
            return
        decode = list(scheduled.values()).count(1)  # C speed: ~150 requests a step
        if len(self._steps_in_flight) >= 4:  # a step never updated (an engine error)
            self._steps_in_flight.popleft()
        self._steps_in_flight.append((now_s, total - decode, decode))

    def _finish_timing(self) -> None:
        """The oldest step in flight is updated: add it to the work to report."""
        started_s, prefill, decode = self._steps_in_flight.popleft()
        work = self._work
        work.steps += 1
        work.busy_s += max(self.clock_s() - started_s, 0.0)
        work.prefill_tokens += prefill
        work.decode_seqs += decode

    def _take_work(self, report: pb.StepReport) -> None:
        if self._work.steps:
            report.work.CopyFrom(self._work)
            self._work.Clear()

    def flush(self, wait_s: float = 0.0) -> None:
        """Report what changed; wait at most ``wait_s`` for the answer and apply it now
        (the engine going idle: counted, with whether the wait ran out first)."""
        report = self._build_report()
        if report is None:
            return
        if self.link.send(report, self._finish_on_link()):
            if report.snapshot:
                self._sent_at_step.clear()  # answers to an older session never come
            self._sent_at_step[report.seq] = self.step_index
            for new in report.new_requests:
                self._unanswered.append((report.seq, new.request_id))
                self._unanswered_ids.add(new.request_id)
            while len(self._unanswered) > MAX_UNANSWERED:  # a daemon that never answers
                _seq, request_id = self._unanswered.popleft()
                self._unanswered_ids.discard(request_id)
                self._finished_unanswered.pop(request_id, None)
            if wait_s > 0:
                self._apply(self.link.take_decisions(wait_s))
                self.counters.idle_waits += 1
                if report.seq in self._sent_at_step:  # not answered in time
                    self.counters.idle_waits_missed += 1

    def on_allocation_failed(self, request: Any) -> bool:
        """An allocation for a running request failed: release the daemon's first
        pressure pin, if any, so vLLM retries before preempting a running request.
        A waiting request's failed admission releases nothing (vLLM just stops
        admitting; it never preempts for one). False: nothing released."""
        if not _is_running(request):
            return False
        if (self._pressure_max_running is not None
                and len(self.sched.running) > self._pressure_max_running):
            return False
        while self._pressure_order:
            pin = self.pins.get(self._pressure_order.pop(0))
            if pin is not None:
                self._release(pin, local=True)
                return True
        if not self.link.connected and self.pins:
            # Daemon gone: vLLM holds no pins, so any pin gives way, oldest first.
            oldest = min(self.pins.values(), key=lambda p: p.pinned_at_s)
            self._release(oldest, local=True)
            return True
        return False

    def release_all_pins(self) -> None:
        for pin in list(self.pins.values()):
            self._release(pin, local=True)
        if self.provisional is not None:
            self.provisional.clear()

    def close(self) -> None:
        self.release_all_pins()
        self.link.close()

    # --- reports --------------------------------------------------------------------
    def _new_request(
        self, request: Any, meta: RequestMetadata, state: pb.RequestState
    ) -> pb.NewRequest:
        return pb.NewRequest(
            request_id=request.request_id,
            job_id=meta.job_id,
            is_last_step=meta.is_last_step,
            arrival_s=float(getattr(request, "arrival_time", 0.0) or 0.0),
            prompt_tokens=int(getattr(request, "num_prompt_tokens", 0) or 0),
            tool_hint=meta.tool,
            state=state,
            computed_tokens=int(getattr(request, "num_computed_tokens", 0) or 0),
            retention=self._retention_config(request.request_id, meta),
            retention_scope=meta.retention_scope,
        )

    @staticmethod
    def _retention_config(request_id: str, meta: RequestMetadata) -> Any:
        """The request's own directives on the wire (None when it sent none); the
        daemon validates their meaning. A shape the wire cannot carry is ignored with
        a warning: the request runs as if it had sent none."""
        if not meta.retention_directives:
            return None
        try:
            return from_request_directives(meta.retention_directives)
        except DirectiveError as error:
            logger.warning("kvtether: request %s: ignoring vllm_xargs %s", request_id, error)
            return None

    def _kv(self) -> pb.KvCapacity:
        return pb.KvCapacity(
            total_blocks=int(self.block_pool.num_gpu_blocks),
            free_blocks=int(self.block_pool.get_num_free_blocks()),
            block_size_tokens=int(getattr(self.sched, "block_size", 0) or 0),
            admission_stalled=self._admission_stalled,
        )

    def _with_demand(self, kv: pb.KvCapacity) -> pb.KvCapacity:
        """``kv`` with the waiting demand counted now, on this thread (at most every
        ``waiting_demand_interval_s``, while the daemon's policy reads it)."""
        demand = self.waiting_demand.blocks(self.clock_s())  # None while not read
        if demand is not None:
            kv.waiting_demand_blocks = demand
        return kv

    def _demand_on_engine(self, kv: pb.KvCapacity) -> pb.KvCapacity:
        """``kv`` for a report being built: with the demand where the engine thread
        counts it (``KVTETHER_PLUGIN_WAITING_DEMAND_THREAD=engine``)."""
        if self.settings.waiting_demand_thread != "engine":
            return kv
        return self._with_demand(kv)

    def _finish_on_link(self) -> Callable[[pb.StepReport], None] | None:
        """What the link's thread adds to a report before it goes out: the waiting
        demand, where the link's thread counts it (the default), while the engine
        thread waits on its workers. As of the report's clock; a count that races the
        engine thread's changes raises, and the report goes without it."""
        if self.settings.waiting_demand_thread != "link" or not self.waiting_demand.enabled:
            return None
        demand = self.waiting_demand

        def finish(report: pb.StepReport) -> None:
            blocks = demand.blocks(report.now_s)
            if blocks is not None:
                report.kv.waiting_demand_blocks = blocks

        return finish

    def _build_report(self) -> pb.StepReport | None:
        if not self.link.connected:
            self._new.clear()
            self._events.clear()
            self._released.clear()
            self._work.Clear()
            return None
        kv = self._kv()
        if self.link.needs_snapshot:
            self.counters.resyncs += 1
            self.seq += 1
            self._new.clear()
            self._events.clear()
            self._released.clear()
            self.retention.clear()  # the daemon sends it again for what it knows
            self._unanswered.clear()  # answers to an older session never come
            self._unanswered_ids.clear()
            self._finished_unanswered.clear()
            report = pb.StepReport(engine_id=self.settings.engine_id, seq=self.seq,
                                   snapshot=True, now_s=self.clock_s(),
                                   kv=self._demand_on_engine(kv), counters=self.counters)
            for request in list(self.sched.requests.values()):
                if request.request_id in self._unreported:
                    continue
                meta = self.metadata.get(request.request_id) or read_metadata(request)
                state = (pb.REQUEST_STATE_RUNNING if _is_running(request)
                         else pb.REQUEST_STATE_WAITING)
                report.new_requests.append(self._new_request(request, meta, state))
            for pin in self.pins.values():
                report.pins.add(request_id=pin.request_id, job_id=pin.job_id,
                                blocks=len(pin.blocks), pinned_at_s=pin.pinned_at_s,
                                expires_at_s=pin.release_at_s, tool=pin.tool)
            self._last_free_blocks = kv.free_blocks
            self._last_stalled = kv.admission_stalled
            self._take_work(report)
            self._remember_reported(report)
            return report
        # Only a change is worth a message; while pins are held the daemon must also
        # hear the clock move (to expire and re-value them), at the heartbeat's rate:
        # a report every step would cost the engine and the daemon CPU for nothing.
        now_s = self.clock_s()
        # A stalled engine (nothing scheduled although requests wait) spins, a step a
        # millisecond: it reports the stall when it begins and ends, not every step.
        # (Every step flooded the daemon with reports it decided in turn, the answer
        # that freed the engine queued behind them, and the daemon took the CPU the
        # engine needed: up to 18,600 reports in an 82 s round on the CPU engine; in
        # a round of 4,514, 88% were stalled spins.)
        changed = bool(self._new or self._events or self._released
                       or kv.free_blocks != self._last_free_blocks
                       or kv.admission_stalled != self._last_stalled)
        heartbeat = bool(self.pins) and (
            now_s - self._last_report_s >= self.settings.pin_heartbeat_s)
        if not (changed or heartbeat):
            return None
        self._last_report_s = now_s
        self.seq += 1
        report = pb.StepReport(engine_id=self.settings.engine_id, seq=self.seq,
                               now_s=now_s, kv=self._demand_on_engine(kv), new_requests=self._new,
                               events=self._events, released_pins=self._released,
                               counters=self.counters)
        self._new.clear()
        self._events.clear()
        self._released.clear()
        self._last_free_blocks = kv.free_blocks
        self._last_stalled = kv.admission_stalled
        self._take_work(report)
        self._remember_reported(report)
        return report

    # --- decisions ------------------------------------------------------------------
    def _apply(self, decisions: Iterable[pb.StepDecision]) -> None:
        for decision in decisions:
            sent_at_step = self._sent_at_step.pop(decision.seq, None)
            if sent_at_step is not None:
                lag = min(self.step_index - sent_at_step, len(self.lag_counts) - 1)
                self.lag_counts[lag] += 1
            if decision.resync_requested:
                continue
            self._provisional_pins = decision.provisional_pins
            self._provisional_cache = decision.provisional_cache
            if self.waiting_demand.enabled != decision.count_waiting_demand:
                # Stopped, it drops the waiting requests' hashes it holds.
                self.waiting_demand.enable(decision.count_waiting_demand)
            if decision.HasField("pressure_release_order"):
                order = decision.pressure_release_order
                self._pressure_order = list(order.request_ids)
                self._pressure_max_running = (order.max_running if order.HasField("max_running")
                                              else None)
            if decision.priorities:
                self._apply_priorities(decision.priorities)
            for retention in decision.retention:
                self._set_retention(retention)
            while self._unanswered and self._unanswered[0][0] <= decision.seq:
                _seq, request_id = self._unanswered.popleft()
                self._unanswered_ids.discard(request_id)
                self._finished_unanswered.pop(request_id, None)
            for pin_decision in decision.pins:
                pin = self.pins.get(pin_decision.request_id)
                if (pin is None and self.provisional is not None
                        and pin_decision.request_id in self.provisional.waiting
                        and self._decide_cached(pin_decision, decision.seq)):
                    continue
                if pin is None:
                    if pin_decision.action == pb.PIN_ACTION_PIN and self.link.connected:
                        # Not held here (never pinned, or released since): say so, or
                        # the daemon would count blocks that are free.
                        self._released.append(pin_decision.request_id)
                    continue
                if pin_decision.action == pb.PIN_ACTION_PIN:
                    self._count_provisional(pin)
                    pin.confirmed = True
                    pin.release_at_s = min(pin_decision.expires_at_s,
                                           pin.pinned_at_s + self.settings.max_pin_s)
                elif pin_decision.action == pb.PIN_ACTION_RELEASE:
                    protection = _protection_of(pin_decision)
                    if self._release_is_stale(pin, decision.seq):
                        self.stale_releases_retained += 1
                        protection = self._for_returned_job(protection)
                    if protection is not None:
                        self._soft_retain(pin, protection)
                    self._release(pin, local=False)

    def _decide_cached(self, decision: pb.PinDecision, answered_seq: int) -> bool:
        """The daemon's word on a turn whose blocks wait cached (``self.provisional``).
        PIN: a confirmed pin of the prefix still cached; False if none is (the caller
        tells the daemon it holds nothing). RELEASE: lowered to the policy's soft
        priority (``returned_job_priority`` if the release is stale)."""
        assert self.provisional is not None
        kept = self.provisional.waiting[decision.request_id]
        if decision.action == pb.PIN_ACTION_PIN:
            blocks = self.provisional.take(decision.request_id)
            if not blocks:
                return False
            pin = Pin(request_id=kept.request_id, job_id=kept.job_id, blocks=blocks,
                      pinned_at_s=kept.finished_at_s,
                      release_at_s=min(decision.expires_at_s,
                                       kept.finished_at_s + self.settings.max_pin_s),
                      confirmed=True, last_sched_seq=kept.last_sched_seq, tool=kept.tool)
            self.pins[pin.request_id] = pin
            return True
        protection = _protection_of(decision)
        if self._is_stale(kept.job_id, kept.finished_at_s, answered_seq):
            self.stale_releases_retained += 1
            protection = self._for_returned_job(protection)
        self.provisional.release(decision.request_id, protection)
        return True

    def _for_returned_job(self, protection: Protection | None) -> Protection:
        """A stale release's retention, held or cached alike: the policy's priority
        raised to ``returned_job_priority``, for the duration the policy named (none:
        until evicted, as any soft retention without one)."""
        if protection is None:
            return Protection(self.settings.returned_job_priority, None)
        return Protection(max(self.settings.returned_job_priority, protection.priority),
                          protection.duration_s)

    def _release_is_stale(self, pin: Pin, answered_seq: int) -> bool:
        """The daemon released ``pin`` on a report older than its job's latest
        request: it decided while the job looked away in a tool, and the job is back
        (measured in the twin: a step of 0.1-0.25 s under prefill load let a third of
        the fast tools' contexts go this way, each recomputed). Only the job's newest
        pin counts; an older one is superseded whatever happens.

        The blocks are freed all the same, cached at ``returned_job_priority``:
        keeping the pin instead (until the daemon re-decides) held memory the waiting
        turn could not yet use on a small cache, and every other request waited behind
        it (CPU engine, 24 blocks: 4.33 s a job against FCFS's 3.55 s; released soft,
        3.58 s with adaptive run alone; the twin keeps most of the gain)."""
        return self._is_stale(pin.job_id, pin.pinned_at_s, answered_seq)

    def _is_stale(self, job_id: str, at_s: float, answered_seq: int) -> bool:
        """A release of the job's newest context (``at_s``) answering a report older
        than the job's latest request (see _release_is_stale)."""
        if self._job_reported_seq.get(job_id, 0) <= answered_seq:
            return False
        return all(other.pinned_at_s <= at_s for other in self.pins.values()
                   if other.job_id == job_id)

    def _remember_reported(self, report: pb.StepReport) -> None:
        for new in report.new_requests:
            job_id = new.job_id or new.request_id
            self._job_reported_seq.pop(job_id, None)  # re-insert: newest last
            self._job_reported_seq[job_id] = report.seq
        while len(self._job_reported_seq) > MAX_JOBS_REMEMBERED:
            del self._job_reported_seq[next(iter(self._job_reported_seq))]

    def _set_retention(self, retention: pb.BlockRetention) -> None:
        if not retention.config.token_ranges and not retention.config.HasField(
                "decode_priority"):
            self.retention.pop(retention.request_id, None)  # withdrawn
        elif retention.request_id in self.sched.requests:
            self.retention[retention.request_id] = retention
        elif (self._pool_retention is not None and (
                freed := self._finished_unanswered.pop(retention.request_id, None)) is not None):
            # Finished before this answer came (a request shorter than the decision
            # lag): what is still cached of it takes its priorities now.
            for block_size, blocks, hashes in freed.groups:
                protections = block_protections(retention.config, len(blocks), block_size,
                                                freed.prompt_tokens)
                self._pool_retention.retain_freed(blocks, hashes, protections,
                                                  retention.scope)

    def _soft_retain(self, pin: Pin, protection: Protection) -> None:
        """A released pin's blocks stay cached at a retention priority (the policy's
        word, anonymous: it raises, never lowers what an owner set)."""
        if self._pool_retention is None:
            return
        self._pool_retention.retain(pin.blocks, [protection] * len(pin.blocks), "")

    def _apply_priorities(self, priorities: Iterable[pb.RequestPriority]) -> None:
        requests = self.sched.requests
        queued = []
        for item in priorities:
            request = requests.get(item.request_id)
            if request is None or request.priority == item.priority:
                continue
            if _is_running(request):
                request.priority = item.priority  # victims: max() over running, no heap
            else:
                queued.append((request, item.priority))
        if not queued:
            return
        # Waiting queues are heaps ordered by (priority, arrival): take the requests
        # out, change them, put them back — never mutate a key inside a heap.
        moved = {request for request, _ in queued}
        queues = [q for q in (getattr(self.sched, "waiting", None),
                              getattr(self.sched, "kv_holding_waiting", None)) if q is not None]
        for queue in queues:
            queue.remove_requests(moved)
        enqueue = getattr(self.sched, "_enqueue_waiting_request", None)  # vLLM 0.32+
        for request, priority in queued:
            request.priority = priority
            if enqueue is not None:
                enqueue(request)
            else:
                self.sched.waiting.add_request(request)

    # --- pins -----------------------------------------------------------------------
    def _expire_local_pins(self) -> None:
        if self.provisional is not None and self.provisional.waiting:
            self.provisional.expire(self.clock_s())
        if not self.pins:
            return
        now_s = self.clock_s()
        for pin in list(self.pins.values()):
            # Connected and confirmed: the daemon decides expiry (it may keep a pin
            # past its TTL while the job's next turn waits); the local bound is the
            # backstop. Disconnected or never confirmed: the local bound decides.
            bound_s = pin.release_at_s
            if pin.confirmed and self.link.connected:
                bound_s = pin.pinned_at_s + self.settings.max_pin_s
            if now_s >= bound_s:
                self.counters.local_pin_expiries += 1
                self._release(pin, local=True)

    def _release_for_idle_engine(self) -> bool:
        """Nothing runs and vLLM admitted nothing: the first waiting request does not
        fit beside the pins. Release one pin (the next step retries admission), in
        the daemon's pressure order (least valuable first), then the pins of jobs
        with no request waiting, then the other waiting jobs', oldest first; the first
        request's own job last (a released pin stays in the prefix cache, so it
        still hits what is not evicted). The daemon would free them too, a round
        trip later, while the engine idled (on the CPU engine with 24 blocks, 90-120
        such stalls a round). False: nothing to release (the request waits on
        something else: a grammar, remote KV)."""
        head = _peek(self.sched.waiting) or _peek(getattr(self.sched, "kv_holding_waiting", None))
        if head is None or getattr(head.status, "name", "") not in ("WAITING", "PREEMPTED"):
            return False
        head_job = self._job_of(head.request_id)
        waiting_jobs = {self._job_of(r.request_id)
                        for r in (*self.sched.waiting,
                                  *getattr(self.sched, "kv_holding_waiting", ()))}
        ranked = {request_id: rank for rank, request_id in enumerate(self._pressure_order)}
        pin = min(self.pins.values(), key=lambda p: (
            bool(head_job) and p.job_id == head_job,
            ranked.get(p.request_id, len(ranked)),
            p.job_id in waiting_jobs,
            p.pinned_at_s))
        self.counters.idle_pin_releases += 1
        self._release(pin, local=True)
        return True

    def _job_of(self, request_id: str) -> str:
        meta = self.metadata.get(request_id)
        return meta.job_id if meta is not None else ""

    def _pins_may_give_way(self) -> bool:
        """Whether a failed allocation this step could release a pin: only then is the
        (per-call) allocation wrapper worth installing."""
        if not self.pins or not self._running_allocation_may_fail():
            return False
        if not self.link.connected:
            return True  # native fallback: any pin gives way
        return bool(self._pressure_order) and (
            self._pressure_max_running is None
            or len(self.sched.running) <= self._pressure_max_running)

    def _running_allocation_may_fail(self) -> bool:
        """Whether a running request's allocation can fail in the coming step: the
        free blocks do not cover the most the step can take. Each running request
        takes at most its new tokens' blocks plus a partial one and its lookahead and
        speculative slots, in every KV cache group, and the new tokens add up to the
        step's token budget at most. (vLLM's watermark holds back only admissions,
        which never release a pin.) Under adaptive, which sends a pressure order with
        every decision, the wrapper was otherwise on at most steps with memory idle:
        ~1 us for each running request's allocation (150 in benchmarks.overhead)."""
        bound = self._step_allocation_bound
        if bound is None:
            return True  # a scheduler of another shape: keep the wrapper
        budget_blocks, per_running = bound
        most_blocks = budget_blocks + len(self.sched.running) * per_running
        return bool(self.block_pool.get_num_free_blocks() <= most_blocks)

    def _allocation_bound(self) -> tuple[int, int] | None:
        """(blocks of the step's token budget, blocks per running request) over every
        KV cache group, from the scheduler's configuration (fixed at start);
        None for a scheduler without it."""
        sched = self.sched
        try:
            size = int(sched.block_size)
            budget_tokens = int(sched.max_num_scheduled_tokens)
            extra_tokens = 1 + int(getattr(sched, "num_lookahead_tokens", 0) or 0) + int(
                getattr(sched, "num_spec_tokens", 0) or 0)
            groups = int(getattr(sched.kv_cache_manager, "num_kv_cache_groups", 1) or 1)
        except (AttributeError, TypeError, ValueError):
            return None
        if size <= 0:
            return None
        return groups * -(-budget_tokens // size), groups * (1 + -(-extra_tokens // size))

    def _set_allocation_hook(self, enabled: bool) -> None:
        if enabled != self._allocation_hook_on and self.allocation_hook is not None:
            self.allocation_hook(enabled)
            self._allocation_hook_on = enabled

    def _release(self, pin: Pin, local: bool) -> None:
        if self.pins.pop(pin.request_id, None) is None:
            return
        self._count_provisional(pin)
        if not self.pins:
            self._set_allocation_hook(False)
        sched = self.sched
        # The request's last step may still be writing these blocks (async
        # scheduling): return them through vLLM's fence, as _free_request_blocks does.
        if getattr(sched, "defer_block_free", False) and (
            pin.last_sched_seq > getattr(sched, "processed_step_seq", pin.last_sched_seq)
        ):
            sched.deferred_frees.append((sched.sched_step_seq, pin.blocks))
        else:
            # Reverse order: the tail blocks are evicted first (vLLM's convention).
            self.block_pool.free_blocks(reversed(pin.blocks))
        if local and self.link.connected:
            self._released.append(pin.request_id)

    def _count_provisional(self, pin: Pin) -> None:
        """The daemon's word (or a local release) ends a provisional pin: count the
        memory-time it held waiting for that word."""
        if not pin.confirmed:
            self.counters.provisional_block_seconds += len(pin.blocks) * max(
                self.clock_s() - pin.pinned_at_s, 0.0)

    def _blocks_of(self, request_id: str) -> int:
        try:
            groups = self.sched.kv_cache_manager.get_block_ids(request_id)
        except (KeyError, AttributeError, AssertionError):
            return 0
        return sum(len(group) for group in groups)

    def _tool_of(self, request: Any, meta: RequestMetadata) -> str | None:
        if self._decode_tail is None or self._parse_tool is None:
            return None
        try:
            tail = list(request.output_token_ids[-TOOL_TAIL_TOKENS:])
            return self._parse_tool(meta.tool or None, self._decode_tail(tail))
        except Exception:  # a parsing failure must never fail the request
            logger.debug("kvtether: tool parsing failed for %s", request.request_id,
                         exc_info=True)
            return None


@dataclass(slots=True)
class _FreedBlocks:
    """A request's blocks as it freed them: per KV cache group, the block size, the
    blocks and the hash each held (to tell later whether it still holds that content)."""

    prompt_tokens: int
    groups: list[tuple[int, list[Any], list[Any]]]


def _protection_of(decision: pb.PinDecision) -> Protection | None:
    """The soft retention a RELEASE names (None: none, vLLM's own priority)."""
    if not decision.HasField("retention_priority"):
        return None
    return Protection(decision.retention_priority,
                      decision.retention_duration_s
                      if decision.HasField("retention_duration_s") else None)


def _reportable(request_id: str) -> bool:
    """Whether the daemon accepts ``request_id`` (sidecar.api.bounds); an id it would
    refuse is logged once, here, when its request arrives."""
    try:
        check_text("request_id", request_id, required=True)
        return True
    except FieldError as error:
        logger.warning("kvtether: request %.64r...: not reported to the daemon, vLLM "
                       "schedules it in its own order: %s", request_id, error.problem)
        return False


def _block_size(manager: Any, group: int, default: int) -> int:
    """Tokens per block of a KV cache group (vLLM 0.32: the group's spec)."""
    try:
        return int(manager.kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size)
    except (AttributeError, IndexError):
        return int(default)


def _peek(queue: Any) -> Any:
    """The request vLLM would try to admit first from a waiting queue, or None."""
    if not queue:
        return None
    return queue.peek_request()


def _is_running(request: Any) -> bool:
    return getattr(getattr(request, "status", None), "name", "") == "RUNNING"
