"""Decide one engine step: run the policy hooks over the mirror, build the answer.

Called on the daemon's event loop for every step report. No I/O here: the store
writes a step causes (history events, tool-time samples) are handed to the
:class:`~sidecar.runtime.recorder.Recorder`, which applies them in the background.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections import OrderedDict
from collections.abc import Iterator, KeysView, Mapping
from dataclasses import dataclass, field, replace

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import inspect_pb2
from sidecar.framework import (
    FinishInput,
    JobView,
    Ordering,
    PinView,
    Policy,
    RequestView,
    RetainAction,
    StepView,
)
from sidecar.retention.resolve import RetentionResolver
from sidecar.runtime import slices
from sidecar.runtime.decision_feed import DecisionFeed
from sidecar.runtime.mirror import EngineMirror, LiveRequest, ReportDelta
from sidecar.runtime.priorities import assign_priorities
from sidecar.runtime.recorder import Recorder
from sidecar.runtime.request_ids import response_ids_of


@dataclass(slots=True)
class EngineDecisionState:
    """Per-engine memory of what was sent, so only changes are sent again."""

    sent_priority: dict[str, int] = field(default_factory=dict)
    sent_pressure_order: tuple[tuple[str, ...], int | None] | None = None
    # Retention: what was sent per live request, and the directory generation seen.
    sent_retention: dict[str, bytes] = field(default_factory=dict)
    retention_generation: int = -1


@dataclass(slots=True)
class Decision:
    """One decision as taken, kept as plain values: most are never looked at, so the
    ``DecisionRecord`` (a protobuf, its inputs JSON-encoded) is built only when one is
    read (Explain, GetJob) or watched. A record takes ~15 µs to build and a busy step
    takes a dozen decisions, so building every one would cost several percent of the
    daemon's CPU (see docs/decisions/)."""

    engine_id: str
    request_id: str
    job_id: str
    kind: str
    reason: str
    inputs: Mapping[str, object]
    at_s: float
    seq: int
    policy: str
    _record: inspect_pb2.DecisionRecord | None = field(default=None, repr=False)

    def record(self) -> inspect_pb2.DecisionRecord:
        if self._record is None:
            self._record = inspect_pb2.DecisionRecord(
                engine_id=self.engine_id,
                request_id=self.request_id,
                job_id=self.job_id,
                kind=self.kind,
                reason=self.reason,
                inputs={key: value if isinstance(value, str) else json.dumps(value)
                        for key, value in self.inputs.items()},
                at_s=self.at_s,
                seq=self.seq,
                policy=self.policy,
            )
        return self._record


class DecisionLog:
    """Per request, the latest decision of each kind (for Explain and GetJob: a later
    pin does not hide the retention the request arrived with), and the feed live
    watchers read. A request is found by the id its engine reported or by the id the
    API client got back (:mod:`sidecar.runtime.request_ids`)."""

    # A request keeps one decision per kind, a handful at most (priority, retention,
    # pin or release, ...), each a few values and its inputs (~1-2 KB as a record once
    # read): 10,000 requests are some tens of MiB at most.
    def __init__(self, max_requests: int = 10_000) -> None:
        self._by_request: OrderedDict[str, _RequestDecisions] = OrderedDict()
        # Response id → the engine request ids it names (several when reused, or for
        # the children of a parallel-sampling request); only of requests held above.
        self._by_response_id: dict[str, list[str]] = {}
        self._max_requests = max_requests
        self.feed = DecisionFeed()

    def add(self, decision: Decision) -> None:
        request_id = decision.request_id
        held = self._by_request.get(request_id)
        if held is None:
            held = self._by_request[request_id] = _RequestDecisions(
                response_ids_of(request_id))
            for response_id in held.response_ids:
                self._by_response_id.setdefault(response_id, []).append(request_id)
            while len(self._by_request) > self._max_requests:
                self._forget(*self._by_request.popitem(last=False))
        else:
            self._by_request.move_to_end(request_id)
            held.kinds.pop(decision.kind, None)
        held.kinds[decision.kind] = decision
        self.feed.publish(decision)

    def _forget(self, request_id: str, held: _RequestDecisions) -> None:
        for response_id in held.response_ids:
            named = self._by_response_id[response_id]
            named.remove(request_id)
            if not named:
                del self._by_response_id[response_id]

    def explain(self, request_id: str) -> list[inspect_pb2.DecisionRecord]:
        """The latest decision of each kind for ``request_id`` — the id an engine
        reported, else the id the API client got back (every request it names) —
        oldest first; [] when none is held."""
        return self.explain_page(request_id, self._max_requests)[0]

    def explain_page(self, request_id: str, limit: int, after: str = ""
                     ) -> tuple[list[inspect_pb2.DecisionRecord], str | None]:
        """``explain`` a page at a time, for an API client's id that names many
        requests (vLLM turns one reused ``X-Request-Id`` into as many requests): the
        decisions of at most ``limit`` of them, in the order the log first held them,
        starting after the request ``after`` (from the oldest held when it is gone);
        and the last request of the page when more follow, else None. Work is in
        proportion to the page, not to the requests the id names."""
        if request_id in self._by_request:
            named = [request_id]
        else:
            named = self._by_response_id.get(request_id, [])
        start = 0
        if after:
            with contextlib.suppress(ValueError):
                start = named.index(after) + 1
        page = named[start:start + limit]
        decisions = [decision for name in page
                     for decision in self._by_request[name].kinds.values()]
        if len(page) > 1:  # requests of one response id: on one engine, its clock orders
            decisions.sort(key=lambda decision: (decision.at_s, decision.seq))
        more = start + limit < len(named)
        return [decision.record() for decision in decisions], (page[-1] if more else None)

    def for_job(self, job_id: str, limit: int = 20) -> list[inspect_pb2.DecisionRecord]:
        """The job's latest decisions, newest first: every kind of each request."""
        found: list[inspect_pb2.DecisionRecord] = []
        for held in reversed(self._by_request.values()):
            for decision in reversed(held.kinds.values()):
                if decision.job_id != job_id:
                    break  # a request's decisions all name its job
                if len(found) >= limit:
                    return found
                found.append(decision.record())
        return found


@dataclass(slots=True)
class _RequestDecisions:
    """What the log holds of one request: the ids an API client may know it by, and
    per kind the latest decision (in the order they were taken)."""

    response_ids: tuple[str, ...]
    kinds: dict[str, Decision] = field(default_factory=dict)


class Decider:
    def __init__(self, policy: Policy, recorder: Recorder, log: DecisionLog,
                 retention: RetentionResolver | None = None) -> None:
        self.policy = policy
        self.recorder = recorder
        self.log = log
        self.retention = retention
        self._engines: dict[str, EngineDecisionState] = {}

    def forget(self, engine_id: str) -> None:
        self._engines.pop(engine_id, None)

    def decide(self, mirror: EngineMirror, delta: ReportDelta, seq: int) -> pb.StepDecision:
        """One report's decision, all at once: the policy's hooks in the order
        ``sidecar.framework.protocols`` documents."""
        return slices.run(self.decide_steps(mirror, delta, seq))

    def decide_steps(self, mirror: EngineMirror, delta: ReportDelta, seq: int
                     ) -> slices.Steps[pb.StepDecision]:
        """One report's decision, yielding between slices of the per-request work
        (arrivals, retention, changed priorities; :mod:`sidecar.runtime.slices`).
        ``decide_us`` counts only the time spent deciding, not the time given away."""
        watch = slices.Stopwatch()
        state = self._engines.setdefault(mirror.engine_id, EngineDecisionState())
        decision = pb.StepDecision(
            seq=seq, policy=self.policy.name,
            provisional_pins=self.policy.pins_finished_requests,
            count_waiting_demand=self.policy.reads_waiting_demand)

        if delta.replaced:
            self.recorder.on_lost(live.view() for live in delta.replaced)
        yield from watch.steps(self._record_arrivals(mirror, delta))
        if self.retention is not None:
            yield from watch.steps(self._decide_retention(mirror, delta, state, decision))

        step = yield from watch.steps(self._step_view(mirror))
        decision.provisional_cache = self.policy.caches_provisional_pins(step)
        for finished in delta.finished:
            state.sent_priority.pop(finished.request.request_id, None)
            self._decide_finish(mirror, step, finished.request, finished.event, decision)
            step = replace(step, pins=list(mirror.pins.values()))
        if delta.finished:  # the finished turns changed their jobs' views
            changed = self.recorder.tracker.views(f.request.job_id for f in delta.finished)
            step = replace(step, jobs={**step.jobs, **changed})

        for hook, kind in ((self.policy.expire, "expire"),
                           (self.policy.release_under_pressure, "steal")):
            release = hook(step)
            released = False
            for request_id in release.request_ids:
                pin = mirror.end_pin(request_id)
                if pin is None:
                    continue  # already released: harmless by contract
                released = True
                item = decision.pins.add(request_id=request_id, action=pb.PIN_ACTION_RELEASE)
                inputs: dict[str, object] = {
                    "blocks": pin.blocks, "expires_at_s": pin.expires_at_s,
                    "free_blocks": step.kv.free_blocks, "running": len(step.running),
                    "waiting": len(step.waiting),
                    "admission_stalled": step.kv.admission_stalled}
                if step.kv.waiting_demand_blocks is not None:
                    inputs["waiting_demand_blocks"] = step.kv.waiting_demand_blocks
                priority = release.retention_priorities.get(request_id)
                if priority is not None:
                    _check_priority(priority, hook.__name__)
                    item.retention_priority = priority
                    inputs["retention_priority"] = priority
                self._record(mirror, seq, request_id, pin.job_id, kind, release.reason, inputs)
            if released:
                step = replace(step, pins=list(mirror.pins.values()))
        yield from watch.steps(self._decide_priorities(mirror, step, state, decision))
        order = self.policy.order_pins_under_pressure(step)
        pressure_order = (tuple(order.request_ids), order.max_running)
        if pressure_order != state.sent_pressure_order:
            decision.pressure_release_order.request_ids.extend(pressure_order[0])
            if order.max_running is not None:
                decision.pressure_release_order.max_running = order.max_running
            state.sent_pressure_order = pressure_order
        decision.decide_us = watch.spent_ns() // 1000
        return decision

    # --- pieces ----------------------------------------------------------------------
    def _record_arrivals(self, mirror: EngineMirror, delta: ReportDelta) -> slices.Steps[None]:
        for arrived in slices.chunks(delta.arrived):
            for live in arrived:
                self.recorder.on_arrival(live.view(), engine_now_s=mirror.now_s)
            yield

    def _step_view(self, mirror: EngineMirror) -> slices.Steps[StepView]:
        """The step the policy sees; the jobs' views gathered a slice at a time."""
        waiting = mirror.waiting()
        running = mirror.running()
        pins = list(mirror.pins.values())
        job_ids = list(itertools.chain((r.job_id for r in waiting), (r.job_id for r in running),
                                       (pin.job_id for pin in pins)))
        jobs: dict[str, JobView] = {}
        for chunk in slices.chunks(job_ids):
            jobs.update(self.recorder.tracker.views(chunk))
            if len(job_ids) > slices.SLICE_ITEMS:
                yield
        # Distributions are cached by the estimator: a lookup per distinct pinned tool.
        estimator = self.recorder.estimator
        tool_times = {}
        for tool in {pin.tool for pin in pins if pin.tool}:
            distribution = estimator.distribution(tool)
            if distribution is not None:
                tool_times[tool] = distribution
        return StepView(
            engine_id=mirror.engine_id,
            now_s=mirror.now_s,
            kv=mirror.kv,
            waiting=waiting,
            running=running,
            pins=pins,
            jobs=jobs,
            tool_times=tool_times,
            global_tool_times=estimator.global_distribution(),
            engine_cost=mirror.engine_cost,
            prefill_tokens_per_s=mirror.prefill_rate.per_s(),
            arrivals_seen_until_s=mirror.arrivals_seen_until_s,
            late_answer_share=mirror.answer_lags.late_share(),
        )

    def _decide_finish(
        self,
        mirror: EngineMirror,
        step: StepView,
        request: RequestView,
        event: pb.RequestEvent,
        decision: pb.StepDecision,
    ) -> None:
        tool = request.tool_hint or event.tool or None  # the client's word wins
        if event.finish_reason in (pb.FINISH_REASON_ABORT, pb.FINISH_REASON_ERROR):
            self.recorder.on_abort(request, event.at_s, event.output_tokens)
            # An aborted turn has no next turn to serve: never keep its blocks.
            decision.pins.add(request_id=request.request_id, action=pb.PIN_ACTION_RELEASE)
            self._record(mirror, decision.seq, request.request_id, request.job_id, "release",
                         "aborted or failed request: blocks freed", {"tool": tool or ""})
            return
        self.recorder.on_finish(request, event.at_s, tool, event.output_tokens)
        step = replace(step, jobs={**step.jobs, **self.recorder.tracker.views([request.job_id])})
        estimator = self.recorder.estimator
        finished = FinishInput(
            step=step,
            request=request,
            output_tokens=event.output_tokens,
            blocks=event.blocks,
            tool=tool,
            tool_times=estimator.distribution(tool) if tool else None,
            global_tool_times=estimator.global_distribution(),
        )
        retain = self.policy.on_finish(finished)
        for old in retain.release_pins:
            pin = mirror.end_pin(old)
            if pin is not None:
                decision.pins.add(request_id=old, action=pb.PIN_ACTION_RELEASE)
                self._record(mirror, decision.seq, old, pin.job_id, "release",
                             f"replaced by {request.request_id}: {retain.reason}", {})
        inputs: dict[str, object] = {
            "tool": tool or "",
            "blocks": event.blocks,
            "is_last_step": request.is_last_step,
            "free_blocks": step.kv.free_blocks,
            "total_blocks": step.kv.total_blocks,
        }
        if step.kv.waiting_demand_blocks is not None:
            inputs["waiting_demand_blocks"] = step.kv.waiting_demand_blocks
        if retain.action is RetainAction.PIN and retain.ttl_s > 0:
            expires_at_s = mirror.now_s + retain.ttl_s
            decision.pins.add(
                request_id=request.request_id,
                action=pb.PIN_ACTION_PIN,
                expires_at_s=expires_at_s,
            )
            mirror.add_pin(PinView(
                request_id=request.request_id,
                job_id=request.job_id,
                blocks=event.blocks,
                pinned_at_s=mirror.now_s,
                expires_at_s=expires_at_s,
                tool=tool,
            ))
            self._record(mirror, decision.seq, request.request_id, request.job_id, "pin",
                         retain.reason, {**inputs, "ttl_s": retain.ttl_s})
            return
        release = decision.pins.add(request_id=request.request_id,
                                    action=pb.PIN_ACTION_RELEASE)
        kind = "release"
        if retain.action is RetainAction.SOFT_RETAIN and retain.retention_priority is not None:
            _check_priority(retain.retention_priority, "on_finish")
            release.retention_priority = retain.retention_priority
            if retain.ttl_s > 0:
                release.retention_duration_s = retain.ttl_s
            kind = "soft_retain"
        self._record(mirror, decision.seq, request.request_id, request.job_id, kind,
                     retain.reason, inputs)

    def _decide_retention(
        self,
        mirror: EngineMirror,
        delta: ReportDelta,
        state: EngineDecisionState,
        decision: pb.StepDecision,
    ) -> slices.Steps[None]:
        """Effective retention of the requests that arrived — of every live request
        when pushed directives changed since this engine last heard — sent only when
        it differs from what the engine has."""
        assert self.retention is not None
        for finished in delta.finished:
            state.sent_retention.pop(finished.request.request_id, None)
        candidates: list[LiveRequest] = delta.arrived
        if state.retention_generation != self.retention.generation:
            state.retention_generation = self.retention.generation
            candidates = list(mirror.requests.values())
        for index, live in enumerate(candidates, 1):
            if index % slices.SLICE_ITEMS == 0:
                yield
            effective = self.retention.for_request(live.request_id, live.job_id,
                                                   live.retention, live.retention_scope)
            key = b"" if effective is None else effective.key()
            if state.sent_retention.get(live.request_id, b"") == key:
                continue
            item = decision.retention.add(request_id=live.request_id)
            if effective is not None:
                item.config.CopyFrom(effective.config)
                item.scope = effective.scope
                state.sent_retention[live.request_id] = key
            else:
                state.sent_retention.pop(live.request_id, None)
            reason = (f"priorities set by {effective.source()}" if effective is not None
                      else "directives withdrawn: the policy's and vLLM's own priorities apply")
            self._record(mirror, decision.seq, live.request_id, live.job_id, "retention",
                         reason,
                         {"scope": item.scope, "token_ranges": len(item.config.token_ranges)})

    def _decide_priorities(
        self,
        mirror: EngineMirror,
        step: StepView,
        state: EngineDecisionState,
        decision: pb.StepDecision,
    ) -> slices.Steps[None]:
        waiting = self.policy.order_waiting(step)
        victims = self.policy.order_victims(step)
        waiting_order = _checked(waiting, mirror.waiting_ids(), "order_waiting")
        victim_order = _checked(victims, mirror.running_ids(), "order_victims")
        live = mirror.requests
        arrival = _ArrivalView(live)
        # Victims: vLLM preempts the running request with the *largest* key, so the
        # first victim must end up last in increasing order.
        for order, reason in ((waiting_order, waiting.reason),
                              (list(reversed(victim_order)), victims.reason)):
            changes = assign_priorities(order, arrival, state.sent_priority)
            for index, (request_id, priority) in enumerate(changes.items(), 1):
                if index % slices.SLICE_ITEMS == 0:
                    yield
                decision.priorities.add(request_id=request_id, priority=priority)
                # Only changed priorities are recorded: a stable order costs nothing.
                self._record(mirror, decision.seq, request_id, live[request_id].job_id,
                             "priority", reason, {"priority": priority})
            state.sent_priority.update(changes)

    def _record(
        self,
        mirror: EngineMirror,
        seq: int,
        request_id: str,
        job_id: str,
        kind: str,
        reason: str,
        inputs: dict[str, object],
    ) -> None:
        self.log.add(Decision(mirror.engine_id, request_id, job_id, kind, reason, inputs,
                              mirror.now_s, seq, self.policy.name))


class PolicyContractError(RuntimeError):
    """A policy returned an order that is not a permutation of its input."""


def _check_priority(priority: int, hook: str) -> None:
    if not 0 <= priority <= 100:
        raise PolicyContractError(f"{hook} returned retention priority {priority}; "
                                  "priorities are 0-100")


def _checked(ordering: Ordering, expected: KeysView[str], hook: str) -> list[str]:
    order = list(ordering.request_ids)
    if len(order) != len(expected) or expected != set(order):
        raise PolicyContractError(f"{hook} must return a permutation of its requests")
    return order


class _ArrivalView(Mapping[str, float]):
    """Arrival times straight from the mirror's live requests (no per-step copy)."""

    __slots__ = ("_live",)

    def __init__(self, live: Mapping[str, LiveRequest]) -> None:
        self._live = live

    def __getitem__(self, request_id: str) -> float:
        return self._live[request_id].arrival_s

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def __len__(self) -> int:
        return len(self._live)
