"""Step reports: what changed on the engine since the last report, or all of it.

A delta report carries the requests that arrived, the events and the pins released
on the engine's own word since the last one; a snapshot (the first report of a
session, after a connection or a refused report) carries every live request and pin
instead. Only a change is worth a message; while pins are held the daemon must also
hear the clock move (to expire and re-value them), at the heartbeat's rate. Engine
thread only, except :meth:`ReportBuilder.finish_on_link`'s function (the link's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from sidecar.api.retention_ranges import DirectiveError, from_request_directives
from sidecar.api.v1 import engine_session_pb2 as pb
from vllm_plugin.demand import WaitingDemand
from vllm_plugin.link import DaemonLink
from vllm_plugin.metadata import RequestMetadata, read_metadata
from vllm_plugin.pins import Pin
from vllm_plugin.settings import PluginSettings
from vllm_plugin.timing import StepTiming

logger = logging.getLogger("kvtether.plugin")


class ReportBuilder:
    """Collects what the next report carries (``new``, ``events``, ``released``) and
    builds it. ``metadata`` and ``unreported`` are the agent's: the requests' metadata,
    and the live requests never reported (ids the daemon would refuse)."""

    def __init__(self, scheduler: Any, settings: PluginSettings, link: DaemonLink,
                 counters: pb.EngineCounters, waiting_demand: WaitingDemand,
                 metadata: Mapping[str, RequestMetadata], unreported: set[str],
                 timing: StepTiming, clock_s: Callable[[], float]) -> None:
        self.sched = scheduler
        self.settings = settings
        self.link = link
        self.counters = counters
        self.waiting_demand = waiting_demand
        self.metadata = metadata
        self.unreported = unreported
        self.timing = timing
        self.clock_s = clock_s
        self.block_pool = scheduler.kv_cache_manager.block_pool
        self.seq = 0
        self.new: list[pb.NewRequest] = []
        self.events: list[pb.RequestEvent] = []
        self.released: list[str] = []
        # Nothing scheduled although requests wait, and not resolved on the engine.
        self.admission_stalled = False
        self._last_free_blocks = -1
        self._last_stalled = False  # the admission_stalled of the last report
        self._last_report_s = float("-inf")  # engine clock of the last delta report

    def add_event(self, event: pb.RequestEvent) -> None:
        if event.request_id not in self.unreported:
            self.events.append(event)

    def scheduled(self, output: Any, now_s: float) -> None:
        """The events of a ``SchedulerOutput``: admissions (new and resumed) and
        preemptions."""
        add_event = self.add_event
        for new in getattr(output, "scheduled_new_reqs", ()):
            # At admission, computed tokens are the prefix-cache hit.
            add_event(pb.RequestEvent(
                request_id=new.req_id, kind=pb.EVENT_KIND_ADMITTED, at_s=now_s,
                cached_tokens=int(getattr(new, "num_computed_tokens", 0) or 0)))
        cached = getattr(output, "scheduled_cached_reqs", None)
        # vLLM 0.34 has no resumed_req_ids: it re-sends a resumed request in full,
        # among the new ones above.
        for request_id in getattr(cached, "resumed_req_ids", ()) or ():
            add_event(pb.RequestEvent(
                request_id=request_id, kind=pb.EVENT_KIND_ADMITTED, at_s=now_s))
        for request_id in getattr(output, "preempted_req_ids", None) or ():
            add_event(pb.RequestEvent(
                request_id=request_id, kind=pb.EVENT_KIND_PREEMPTED, at_s=now_s))

    def finished(self, request: Any, reason: pb.FinishReason, tool: str) -> None:
        """A request finished: its event, with the blocks it holds as it ends."""
        self.add_event(pb.RequestEvent(
            request_id=request.request_id, kind=pb.EVENT_KIND_FINISHED,
            at_s=self.clock_s(), finish_reason=reason,
            output_tokens=getattr(request, "num_output_tokens", 0), tool=tool,
            blocks=self._blocks_of(request.request_id)))

    def _blocks_of(self, request_id: str) -> int:
        try:
            groups = self.sched.kv_cache_manager.get_block_ids(request_id)
        except (KeyError, AttributeError, AssertionError):
            return 0
        return sum(len(group) for group in groups)

    def build(self, pins: Mapping[str, Pin]) -> pb.StepReport | None:
        """The next report, or None: disconnected (what was pending is dropped: the
        next session starts with a snapshot), or nothing worth a message."""
        if not self.link.connected:
            self._clear_pending()
            self.timing.drop()
            return None
        kv = self.kv()
        if self.link.needs_snapshot:
            report = self._snapshot(kv, pins)
        else:
            delta = self._delta(kv, bool(pins))
            if delta is None:
                return None
            report = delta
        self._clear_pending()
        self._last_free_blocks = kv.free_blocks
        self._last_stalled = kv.admission_stalled
        self.timing.take(report)
        return report

    def _clear_pending(self) -> None:
        self.new.clear()
        self.events.clear()
        self.released.clear()

    def _snapshot(self, kv: pb.KvCapacity, pins: Mapping[str, Pin]) -> pb.StepReport:
        self.counters.resyncs += 1
        self.seq += 1
        report = pb.StepReport(engine_id=self.settings.engine_id, seq=self.seq,
                               snapshot=True, now_s=self.clock_s(),
                               kv=self._demand_on_engine(kv), counters=self.counters)
        for request in list(self.sched.requests.values()):
            if request.request_id in self.unreported:
                continue
            if is_running(request):
                state = pb.REQUEST_STATE_RUNNING
            elif is_queued(request):
                state = pb.REQUEST_STATE_WAITING
            else:
                continue  # finished, its blocks not freed yet: gone for the daemon
            meta = self.metadata.get(request.request_id) or read_metadata(
                request, int(getattr(self.sched, "block_size", 0) or 0))
            report.new_requests.append(self.new_request(request, meta, state))
        for pin in pins.values():
            report.pins.add(request_id=pin.request_id, job_id=pin.job_id,
                            blocks=len(pin.blocks), pinned_at_s=pin.pinned_at_s,
                            expires_at_s=pin.release_at_s, tool=pin.tool)
        return report

    def _delta(self, kv: pb.KvCapacity, pins_held: bool) -> pb.StepReport | None:
        now_s = self.clock_s()
        # A stalled engine (nothing scheduled although requests wait) spins, a step a
        # millisecond: it reports the stall when it begins and ends, not every step.
        # A report each step would flood the daemon with reports it decides in turn,
        # queue the answer that frees the engine behind them, and take the CPU the
        # engine needs.
        changed = bool(self.new or self.events or self.released
                       or kv.free_blocks != self._last_free_blocks
                       or kv.admission_stalled != self._last_stalled)
        heartbeat = pins_held and (
            now_s - self._last_report_s >= self.settings.pin_heartbeat_s)
        if not (changed or heartbeat):
            return None
        self._last_report_s = now_s
        self.seq += 1
        return pb.StepReport(engine_id=self.settings.engine_id, seq=self.seq,
                             now_s=now_s, kv=self._demand_on_engine(kv), new_requests=self.new,
                             events=self.events, released_pins=self.released,
                             counters=self.counters)

    def new_request(self, request: Any, meta: RequestMetadata,
                    state: pb.RequestState) -> pb.NewRequest:
        return pb.NewRequest(
            request_id=request.request_id,
            job_id=meta.job_id,
            is_last_step=meta.is_last_step,
            arrival_s=float(getattr(request, "arrival_time", 0.0) or 0.0),
            prompt_tokens=int(getattr(request, "num_prompt_tokens", 0) or 0),
            tool_hint=meta.tool,
            state=state,
            computed_tokens=int(getattr(request, "num_computed_tokens", 0) or 0),
            retention=_retention_config(request.request_id, meta),
            retention_scope=meta.retention_scope,
        )

    def kv(self) -> pb.KvCapacity:
        return pb.KvCapacity(
            total_blocks=int(self.block_pool.num_gpu_blocks),
            free_blocks=int(self.block_pool.get_num_free_blocks()),
            block_size_tokens=int(getattr(self.sched, "block_size", 0) or 0),
            admission_stalled=self.admission_stalled,
        )

    def with_demand(self, kv: pb.KvCapacity) -> pb.KvCapacity:
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
        return self.with_demand(kv)

    def finish_on_link(self) -> Callable[[pb.StepReport], None] | None:
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


def _retention_config(request_id: str, meta: RequestMetadata) -> Any:
    """The request's own directives on the wire (None when it sent none; converted
    ones, from TensorRT-LLM's form or a KV hint, as they are); the daemon
    validates their meaning. A shape the wire cannot carry is ignored with a warning:
    the request runs as if it had sent none."""
    if not meta.retention_directives:
        return meta.retention
    try:
        return from_request_directives(meta.retention_directives)
    except DirectiveError as error:
        logger.warning("kvtether: request %s: ignoring vllm_xargs %s", request_id, error)
        return None


def is_running(request: Any) -> bool:
    return getattr(getattr(request, "status", None), "name", "") == "RUNNING"


def is_queued(request: Any) -> bool:
    """Whether the request waits in one of vLLM's waiting queues (``waiting``,
    ``kv_holding_waiting``): not running and not finished. vLLM keeps a finished
    request in ``scheduler.requests`` while its blocks wait to be freed (the prefill
    side of a P/D pair while the KV connector sends its KV; an abort while it waited
    for remote KV): it runs no more and waits in no queue."""
    return not is_running(request) and not request.is_finished()
