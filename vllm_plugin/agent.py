"""The engine-side agent: reports what the scheduler did, applies what the daemon decided.

It coordinates the parts below and holds no policy; what the engine does without the
daemon's word is ``vllm_plugin.fallback``. Contracts:
- every method is called on the engine thread only (the scheduler's thread);
- it never waits on the network longer than the configured deadline per step;
- every pinned block is released exactly once (``vllm_plugin.pins``);
- an engine never idles on pins: when nothing runs and the first waiting request
  does not fit, pins give way, one per step, without waiting for the daemon
  (``vllm_plugin.pressure``);
- with the daemon slow, gone or restarting, scheduling is vLLM's (fail-open), pins
  expire on their local bound, and the next connection starts with a snapshot
  (``vllm_plugin.reports``);
- the daemon decides on the last report and its answer lands a step later
  (``vllm_plugin.decisions``, ``vllm_plugin.timing``).

Also coordinated: request metadata (``metadata``), the retention side table
(``request_retention``) and the provisional cache (``provisional``). The scheduler is
duck-typed against vLLM 0.32/0.33's ``Scheduler``: ``requests``, ``running``,
``waiting`` / ``kv_holding_waiting`` (request queues), and ``kv_cache_manager``
(``pop_blocks_for_free``, ``get_block_ids``, ``block_pool``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sidecar.api.v1 import engine_session_pb2 as pb
from vllm_plugin import fallback
from vllm_plugin.clock import EngineClock
from vllm_plugin.decisions import DecisionApplier
from vllm_plugin.demand import WaitingDemand
from vllm_plugin.link import DaemonLink
from vllm_plugin.metadata import (
    RequestMetadata,
    finish_reason,
    read_metadata,
    reportable,
    tool_at_finish,
)
from vllm_plugin.pins import Pin, PinTable
from vllm_plugin.pressure import AllocationGuard, PinPressure
from vllm_plugin.provisional import ProvisionalCache
from vllm_plugin.ranks import RankedPriority
from vllm_plugin.reports import ReportBuilder
from vllm_plugin.request_retention import RequestRetention
from vllm_plugin.settings import PluginSettings
from vllm_plugin.timing import AnswerLag, StepTiming
from vllm_plugin.vllm_tool_parser import VllmToolParser


class EngineAgent:
    def __init__(
        self,
        scheduler: Any,
        settings: PluginSettings,
        link: DaemonLink | None = None,
        clock: EngineClock | None = None,
        decode_tail: Callable[[Sequence[int]], str] | None = None,
        parse_tool: Callable[[str | None, str | None], str | None] | None = None,
        vllm_tool_parser: VllmToolParser | None = None,
    ) -> None:
        self.sched = scheduler
        self.settings = settings
        # The one clock every part below reads (vllm_plugin.clock); the scheduler gave
        # the block pool's retention the same one.
        self.clock = clock if clock is not None else EngineClock()
        clock_s = self.clock
        self.link = link if link is not None else DaemonLink.for_settings(settings)
        self._decode_tail = decode_tail
        self._parse_tool = parse_tool
        self._vllm_tool_parser = vllm_tool_parser
        self.block_pool = scheduler.kv_cache_manager.block_pool
        self.waiting_demand = WaitingDemand(scheduler, settings.waiting_demand_interval_s)
        self.metadata: dict[str, RequestMetadata] = {}
        # Live requests whose id the daemon would refuse (vLLM takes a client's own
        # request_id or X-Request-Id, of any length): never reported, so one client
        # cannot get the engine's every report refused; vLLM schedules them in its own
        # order and frees their blocks as it does.
        self._unreported: set[str] = set()
        self.counters = pb.EngineCounters()
        self.answer_lag = AnswerLag(self.counters)
        self.lag_counts = self.answer_lag.counts
        self.timing = StepTiming(clock_s)
        self.allocation = AllocationGuard(scheduler)
        pool_retention = getattr(self.block_pool, "kvtether_retention", None)
        self.retention = RequestRetention(scheduler, pool_retention)
        # Finished turns freed at the top priority while the daemon decides (None:
        # retention not installed, so they are held instead).
        self.provisional = (ProvisionalCache(pool_retention, clock_s)
                            if pool_retention is not None else None)
        self.reports = ReportBuilder(scheduler, settings, self.link, self.counters,
                                     self.waiting_demand, self.metadata, self._unreported,
                                     self.timing, clock_s)
        self.pin_table = PinTable(scheduler, settings, self.link, self.counters,
                                  self.allocation.set, self.reports.released, clock_s)
        self.pins: dict[str, Pin] = self.pin_table.pins
        self.decisions = DecisionApplier(scheduler, settings, self.link, self.pin_table,
                                         self.reports.released, self.retention,
                                         self.provisional, self.waiting_demand,
                                         self.answer_lag)
        self.pressure = PinPressure(scheduler, self.link, self.counters, self.pin_table,
                                    self.decisions.orders, self.allocation, self.metadata)
        self._reported_this_step = False

    @property
    def seq(self) -> int:
        """The seq of the last report built."""
        return self.reports.seq

    @property
    def stale_releases_retained(self) -> int:
        return self.decisions.stale_releases_retained

    # --- hooks called by the scheduler ------------------------------------------------
    def on_add(self, request: Any) -> None:
        """A new request, before vLLM enqueues it."""
        meta = read_metadata(request, int(getattr(self.sched, "block_size", 0) or 0))
        self.metadata[request.request_id] = meta
        self.counters.kv_hint_actions_ignored += meta.kv_hint_actions_ignored
        self.counters.kv_hint_fields_refused += meta.kv_hint_fields_refused
        # The client's priority stays the first key of vLLM's order; the daemon's rank
        # orders requests inside it (vllm_plugin.ranks).
        request.priority = RankedPriority(request.priority)
        if not reportable(request.request_id):
            self._unreported.add(request.request_id)
            return
        if self.link.connected:
            self.reports.new.append(
                self.reports.new_request(request, meta, pb.REQUEST_STATE_WAITING))

    def before_schedule(self) -> None:
        """Apply whatever the daemon answered since the last step; expire local pins.
        Requests that arrived since the last report are reported first. Fail-open,
        their ranks are not waited for: they queue at ``ranks.UNRANKED_RANK`` (behind
        every ranked request of their client priority) until the answer lands, a step or more later.
        Fail-closed, that answer is waited for (``closed_wait_s``) before scheduling."""
        self._reported_this_step = False
        self.answer_lag.step_index += 1
        if self.reports.new:
            self.flush()  # ranks come with the next step; until then they queue last
        # Fail-open: schedule now with what has arrived; fail-closed: wait for it first.
        wait_s = 0.0
        if self.link.waiting_for_answer:
            wait_s = (self.settings.closed_wait_s if self.settings.fail_closed
                      else 0.0)
        self.decisions.apply(self.link.take_decisions(wait_s))
        # On policy: connected, and no answer overdue. Otherwise this step is vLLM's own.
        if not self.link.connected or self.answer_lag.overdue():
            self.counters.fallback_steps += 1
        if self.provisional is not None and self.provisional.waiting:
            self.provisional.expire(self.clock())
        self.pin_table.expire()
        self.pressure.set_allocation_hook()

    def after_schedule(self, output: Any) -> None:
        stalled = not getattr(output, "total_num_scheduled_tokens", 1) and bool(
            len(self.sched.waiting) + len(getattr(self.sched, "kv_holding_waiting", ()))
        )
        # Resolved here, the stall is not the daemon's to resolve: the next step admits.
        self.reports.admission_stalled = stalled and not (
            self.pins and not self.sched.running and self.pressure.release_for_idle_engine())
        if not self.link.connected:
            return
        now_s = self.clock()
        self.timing.start(output, now_s)
        self.reports.scheduled(output, now_s)

    def on_finish(self, request: Any) -> None:
        """A request finished (any reason), before its blocks are freed."""
        meta = self.metadata.get(request.request_id) or RequestMetadata()
        reason = finish_reason(request.status)
        tool = meta.tool
        # A turn cut by max_tokens may end in a tool call too (kvtether's parsing reads a
        # Hermes call cut off once its name is complete).
        if not tool and not meta.is_last_step and reason in (pb.FINISH_REASON_STOP,
                                                             pb.FINISH_REASON_LENGTH):
            tool = tool_at_finish(request, meta, self._decode_tail, self._parse_tool,
                                  self._vllm_tool_parser) or ""
        # Keep the parsed tool for the pin, should one be made right after.
        self.metadata[request.request_id] = RequestMetadata(
            job_id=meta.job_id, is_last_step=meta.is_last_step, tool=tool)
        if self.link.connected:
            self.reports.finished(request, reason, tool)

    def take_blocks(self, request: Any) -> bool:
        """Pin a finished request's blocks instead of freeing them (provisionally, until
        the daemon decides). True: pinned, and the request is removed from the
        scheduler; False: the caller frees them as vLLM does."""
        meta = self.metadata.pop(request.request_id, None) or RequestMetadata()
        if request.request_id in self._unreported:
            self._unreported.discard(request.request_id)
            return False  # the daemon never heard of it: no pin it could decide on
        if fallback.job_is_over(meta.job_id, meta.is_last_step):
            for pin in [p for p in self.pins.values() if p.job_id == meta.job_id]:
                self.pin_table.release(pin, local=True)
            if self.provisional is not None:
                self.provisional.release_job(meta.job_id)
        if not (self.decisions.orders.provisional_pins and self.link.connected
                and fallback.holds_finished_turn(meta.job_id, meta.is_last_step,
                                                 finish_reason(request.status))):
            return False
        if self._cache_provisionally(request, meta):
            return False  # vLLM frees them, queued at the provisional priority
        self.pin_table.hold(request, meta.job_id or request.request_id, meta.tool)
        return True

    def _cache_provisionally(self, request: Any, meta: RequestMetadata) -> bool:
        """Keep the finished turn's blocks cached at the provisional priority instead of
        holding them (vllm_plugin.provisional), when the daemon asks for it and the
        blocks are the plugin's to prioritise: one KV cache group, and no retention
        directives of the request's own (set or still to come)."""
        if (not self.decisions.orders.provisional_cache or self.provisional is None
                or self.retention.awaits_word(request.request_id)):
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
        self.retention.forget(request_id)

    def retain(self, request: Any) -> None:
        """The request's blocks are about to be freed (finish, preemption, pin): give
        them, in the block pool's side table, the priorities the daemon sent for it."""
        self.retention.retain(request)

    def after_update(self) -> None:
        """End of a step: report what changed, once per step. The answer is applied at
        the next ``schedule()`` (a lag of one step; on a GPU the model's forward pass
        hides the round trip) — except when the engine is about to go idle: then the
        answer is waited for (within the deadline) and applied now, because an idle
        engine does not step again and a pin released now must not stay held."""
        if not self._reported_this_step:
            self._reported_this_step = True
            if self.timing.in_flight:  # once per update (this may be called twice)
                self.timing.finish()
            idle = not self.sched.has_unfinished_requests()
            self.flush(wait_s=self.settings.deadline_s if idle else 0.0)

    def flush(self, wait_s: float = 0.0) -> None:
        """Report what changed; wait at most ``wait_s`` for the answer and apply it now
        (the engine going idle: counted, with whether the wait ran out first)."""
        report = self.reports.build(self.pins)
        if report is None:
            return
        if report.snapshot:
            self.retention.reset()
        self.decisions.remember_reported(report)
        if self.link.send(report, self.reports.finish_on_link()):
            self.answer_lag.sent(report)
            self.retention.reported(report)
            if wait_s > 0:
                self.decisions.apply(self.link.take_decisions(wait_s))
                self.counters.idle_waits += 1
                if self.answer_lag.awaits(report.seq):  # not answered in time
                    self.counters.idle_waits_missed += 1

    def on_allocation_failed(self, request: Any) -> bool:
        """An allocation for a running request failed: True if a pin was released for
        it, so vLLM retries before preempting (``vllm_plugin.pressure``)."""
        return self.pressure.on_allocation_failed(request)

    def release_all_pins(self) -> None:
        self.pin_table.release_all()
        if self.provisional is not None:
            self.provisional.clear()

    def close(self) -> None:
        self.release_all_pins()
        self.link.close()
