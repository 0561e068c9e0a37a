"""Applying the daemon's decisions: priorities, retention, pins, and its standing orders.

The daemon decides on the last report and its answer lands a step or more later.
A RELEASE of a job's newest pin answering a report older than the job's latest
request is stale (the answer crossed the request in flight): the blocks are freed
all the same, cached at the fallback's priority (``fallback.returned_job_protection``).
Engine thread only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sidecar.api.retention_ranges import Protection
from sidecar.api.v1 import engine_session_pb2 as pb
from vllm_plugin.demand import WaitingDemand
from vllm_plugin.fallback import capped_expiry_s, returned_job_protection
from vllm_plugin.link import DaemonLink
from vllm_plugin.pins import Pin, PinTable
from vllm_plugin.provisional import ProvisionalCache
from vllm_plugin.ranks import rank_of, ranked
from vllm_plugin.reports import is_queued, is_running
from vllm_plugin.request_retention import RequestRetention
from vllm_plugin.settings import PluginSettings
from vllm_plugin.timing import AnswerLag

# Jobs whose latest request's report seq is remembered (stale-release check).
MAX_JOBS_REMEMBERED = 4096


@dataclass(slots=True)
class DaemonOrders:
    """What the daemon's policy last asked of the engine; each stands until the next
    decision says otherwise."""

    provisional_pins: bool = False  # hold finished turns until the daemon decides
    provisional_cache: bool = False  # ...cached at the top priority rather than held
    # Pins to release, first to last, when a running request's allocation fails.
    pressure_order: list[str] = field(default_factory=list)
    # Release for allocations only while at most this many requests run (None: always).
    pressure_max_running: int | None = None


class DecisionApplier:
    """Applies each ``StepDecision`` as it comes, in order."""

    def __init__(self, scheduler: Any, settings: PluginSettings, link: DaemonLink,
                 pins: PinTable, released: list[str], retention: RequestRetention,
                 provisional: ProvisionalCache | None, waiting_demand: WaitingDemand,
                 answer_lag: AnswerLag) -> None:
        self.sched = scheduler
        self.settings = settings
        self.link = link
        self.pin_table = pins
        self.released = released
        self.retention = retention
        self.provisional = provisional
        self.waiting_demand = waiting_demand
        self.answer_lag = answer_lag
        self.orders = DaemonOrders()
        self.stale_releases_retained = 0
        # Per job, the seq of the report that carried its latest request. A release
        # answering an older report was decided without knowing the job is back.
        self._job_reported_seq: dict[str, int] = {}

    def remember_reported(self, report: pb.StepReport) -> None:
        for new in report.new_requests:
            job_id = new.job_id or new.request_id
            self._job_reported_seq.pop(job_id, None)  # re-insert: newest last
            self._job_reported_seq[job_id] = report.seq
        while len(self._job_reported_seq) > MAX_JOBS_REMEMBERED:
            del self._job_reported_seq[next(iter(self._job_reported_seq))]

    def apply(self, decisions: Iterable[pb.StepDecision]) -> None:
        orders = self.orders
        for decision in decisions:
            self.answer_lag.answered(decision.seq)
            if decision.resync_requested:
                continue
            orders.provisional_pins = decision.provisional_pins
            orders.provisional_cache = decision.provisional_cache
            if self.waiting_demand.enabled != decision.count_waiting_demand:
                # Stopped, it drops the waiting requests' hashes it holds.
                self.waiting_demand.enable(decision.count_waiting_demand)
            if decision.HasField("pressure_release_order"):
                order = decision.pressure_release_order
                orders.pressure_order = list(order.request_ids)
                orders.pressure_max_running = (order.max_running
                                               if order.HasField("max_running") else None)
            if decision.priorities:
                self._apply_priorities(decision.priorities)
            for retention in decision.retention:
                self.retention.set(retention)
            self.retention.answered(decision.seq)
            for pin_decision in decision.pins:
                self._apply_pin(pin_decision, decision.seq)

    def _apply_pin(self, decision: pb.PinDecision, answered_seq: int) -> None:
        pin = self.pin_table.pins.get(decision.request_id)
        if pin is None:
            if (self.provisional is not None
                    and decision.request_id in self.provisional.waiting
                    and self._decide_cached(decision, answered_seq)):
                return
            if decision.action == pb.PIN_ACTION_PIN and self.link.connected:
                # Not held here (never pinned, or released since): say so, or the
                # daemon would count blocks that are free.
                self.released.append(decision.request_id)
            return
        if decision.action == pb.PIN_ACTION_PIN:
            self.pin_table.count_provisional(pin)
            pin.confirmed = True
            pin.release_at_s = capped_expiry_s(pin.pinned_at_s, decision.expires_at_s,
                                               self.settings.max_pin_s)
        elif decision.action == pb.PIN_ACTION_RELEASE:
            protection = _protection_of(decision)
            if self._is_stale(pin.job_id, pin.pinned_at_s, answered_seq):
                self.stale_releases_retained += 1
                protection = returned_job_protection(protection,
                                                     self.settings.returned_job_priority)
            if protection is not None:
                self._soft_retain(pin, protection)
            self.pin_table.release(pin, local=False)

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
                      release_at_s=capped_expiry_s(kept.finished_at_s, decision.expires_at_s,
                                                   self.settings.max_pin_s),
                      confirmed=True, last_sched_seq=kept.last_sched_seq, tool=kept.tool)
            self.pin_table.pins[pin.request_id] = pin
            return True
        protection = _protection_of(decision)
        if self._is_stale(kept.job_id, kept.finished_at_s, answered_seq):
            self.stale_releases_retained += 1
            protection = returned_job_protection(protection,
                                                 self.settings.returned_job_priority)
        self.provisional.release(decision.request_id, protection)
        return True

    def _is_stale(self, job_id: str, at_s: float, answered_seq: int) -> bool:
        """Whether a release of the job's context made at ``at_s`` answers a report
        older than the job's latest request: the daemon decided while the job looked
        away in a tool, and the job is back. Only the job's newest pin counts; an
        older one is superseded whatever happens."""
        if self._job_reported_seq.get(job_id, 0) <= answered_seq:
            return False
        return all(other.pinned_at_s <= at_s for other in self.pin_table.pins.values()
                   if other.job_id == job_id)

    def _soft_retain(self, pin: Pin, protection: Protection) -> None:
        """A released pin's blocks stay cached at a retention priority (the policy's
        word, anonymous: it raises, never lowers what an owner set)."""
        if self.retention.pool is None:
            return
        self.retention.pool.retain(pin.blocks, [protection] * len(pin.blocks), "")

    def _apply_priorities(self, priorities: Iterable[pb.RequestPriority]) -> None:
        """The daemon's ranks, each inside its request's client priority
        (``vllm_plugin.ranks``). Only live requests take one: a finished request that
        vLLM keeps while its blocks wait to be freed is in no queue, and putting it
        back in one would have vLLM schedule a finished request."""
        requests = self.sched.requests
        queued = []
        for item in priorities:
            request = requests.get(item.request_id)
            if request is None or rank_of(request) == item.priority:
                continue
            if is_running(request):
                request.priority = ranked(request, item.priority)  # victims: max(), no heap
            elif is_queued(request):
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
        for request, rank in queued:
            request.priority = ranked(request, rank)
            if enqueue is not None:
                enqueue(request)
            else:
                self.sched.waiting.add_request(request)


def _protection_of(decision: pb.PinDecision) -> Protection | None:
    """The soft retention a RELEASE names (None: none, vLLM's own priority)."""
    if not decision.HasField("retention_priority"):
        return None
    return Protection(decision.retention_priority,
                      decision.retention_duration_s
                      if decision.HasField("retention_duration_s") else None)
