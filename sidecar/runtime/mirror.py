"""The daemon's in-memory mirror of one engine: live requests, pins, KV capacity.

Built from the engine's step reports (a snapshot, then deltas) so that a decision
needs no store round trip. Called from the daemon's event loop only.

Contract for deltas (``sidecar.api`` EngineSession): a request appears once in
``new_requests`` before any event names it; events for ids the mirror does not know
are ignored (and counted), never fatal — an engine may report a request the daemon
lost in a restart; the next snapshot repairs the view.
"""

from __future__ import annotations

from collections.abc import KeysView, Sequence
from dataclasses import dataclass, field

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import retention_pb2
from sidecar.framework import EngineCost, KvView, PinView, RequestState, RequestView
from sidecar.jobs import effective_job_id
from sidecar.runtime import slices
from sidecar.runtime.pin_outcomes import PinOutcomes
from sidecar.runtime.steptime import PrefillRate
from sidecar.telemetry.answer_lag import RecentAnswerLags

_STATE = {
    pb.REQUEST_STATE_UNSPECIFIED: RequestState.WAITING,
    pb.REQUEST_STATE_WAITING: RequestState.WAITING,
    pb.REQUEST_STATE_RUNNING: RequestState.RUNNING,
}


@dataclass(slots=True)
class LiveRequest:
    request_id: str
    job_id: str
    is_last_step: bool
    arrival_s: float
    prompt_tokens: int
    state: RequestState
    computed_tokens: int
    tool_hint: str | None
    blocks: int = 0
    # Prefix-cache hit at the first admission (RequestEvent.cached_tokens; a resumed
    # request's ADMITTED event carries none).
    cached_tokens: int = 0
    # Retention directives the request carried (None: none) and the scope it claims.
    retention: retention_pb2.RetentionConfig | None = None
    retention_scope: str = ""
    # The frozen view policies see, rebuilt only when the request changes.
    _view: RequestView | None = None

    def view(self) -> RequestView:
        if self._view is None:
            self._view = RequestView(
                request_id=self.request_id,
                job_id=self.job_id,
                is_last_step=self.is_last_step,
                arrival_s=self.arrival_s,
                prompt_tokens=self.prompt_tokens,
                state=self.state,
                computed_tokens=self.computed_tokens,
                tool_hint=self.tool_hint,
                cached_tokens=self.cached_tokens,
            )
        return self._view

    def move_to(self, state: RequestState) -> None:
        self.state = state
        self._view = None


@dataclass(frozen=True, slots=True)
class Finished:
    """A request that finished in this report, with what the policy needs about it."""

    request: RequestView
    event: pb.RequestEvent


@dataclass(slots=True)
class ReportDelta:
    """What one report changed, for the decider and the history writer."""

    arrived: list[LiveRequest] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    # Live requests that a new_requests entry of the same id but another job replaced:
    # they leave their jobs' in-flight sets (the id now names the other job's request).
    replaced: list[LiveRequest] = field(default_factory=list)
    unknown_ids: int = 0


class EngineMirror:
    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.last_seq = 0
        self.now_s = 0.0
        # The previous report's time: arrivals after it may not be in this one
        # (StepView.arrivals_seen_until_s). None before the first report.
        self.arrivals_seen_until_s: float | None = None
        self.kv = KvView(total_blocks=0, free_blocks=0, block_size_tokens=0)
        self.requests: dict[str, LiveRequest] = {}
        # How many live requests each job has: whether a pin's job has one is a
        # lookup, not a pass over every request (add_pin runs once per pin).
        self._live_by_job: dict[str, int] = {}
        # The frozen views policies read, by state, kept up to date per event so a
        # step view costs two C-level list copies, not a pass over every request.
        self._views: dict[RequestState, dict[str, RequestView]] = {
            RequestState.WAITING: {}, RequestState.RUNNING: {}}
        # Read freely; changed only through add_pin / end_pin (pin_outcomes counts them).
        self.pins: dict[str, PinView] = {}
        # The blocks those pins hold, kept as they change: the daemon's pin gauges add
        # up one number per engine, not every pin, at each report that pins.
        self.pinned_blocks = 0
        self.pin_outcomes = PinOutcomes(engine_id)
        self.counters = pb.EngineCounters()
        # The lags of its recent answers, from the counters (answer_lag.py).
        self.answer_lags = RecentAnswerLags()
        # The engine's step cost as learned so far (EngineRegistry sets it per report).
        self.engine_cost: EngineCost | None = None
        # Prompt tokens its steps computed a second, lately (EngineRegistry feeds it).
        self.prefill_rate = PrefillRate()

    def prefill_time_share(self) -> float | None:
        """The share of its time the engine spent computing prompts lately: the
        prompt tokens a second its reports carried times what a token costs on it as
        learned. None until both are known."""
        per_s = self.prefill_rate.per_s()
        if per_s is None or self.engine_cost is None:
            return None
        return per_s * self.engine_cost.prefill_s_per_token

    def apply(self, report: pb.StepReport) -> ReportDelta:
        """Fold one report into the mirror, all at once. The caller checked its seq."""
        return slices.run(self.apply_steps(report))

    def apply_steps(self, report: pb.StepReport) -> slices.Steps[ReportDelta]:
        """Fold one report into the mirror, yielding between slices of its items
        (:mod:`sidecar.runtime.slices`). The caller checked its seq."""
        if report.snapshot:
            self.requests.clear()
            self._live_by_job.clear()
            self.pins.clear()
            self.pinned_blocks = 0
            self.pin_outcomes.forget()
            for views in self._views.values():
                views.clear()
        self.last_seq = report.seq
        # The plugin reports a step's end before adding what arrived during the step:
        # those come with the next report. A first report, or a clock that went back
        # (the engine restarted), has no previous one: everything is taken as seen.
        previous_s = self.now_s if self.arrivals_seen_until_s is not None else report.now_s
        self.arrivals_seen_until_s = min(previous_s, report.now_s)
        self.now_s = report.now_s
        if report.HasField("kv"):
            self.kv = KvView(
                total_blocks=report.kv.total_blocks,
                free_blocks=report.kv.free_blocks,
                block_size_tokens=report.kv.block_size_tokens,
                admission_stalled=report.kv.admission_stalled,
                waiting_demand_blocks=(report.kv.waiting_demand_blocks
                                       if report.kv.HasField("waiting_demand_blocks")
                                       else None),
            )
        if report.HasField("counters"):
            self.counters.CopyFrom(report.counters)
            self.answer_lags.update(report.counters.answers_by_lag_steps)
        delta = ReportDelta()
        for chunk in slices.chunks(report.new_requests):
            self._add_requests(chunk, delta)
            yield
        for pins in slices.chunks(report.pins):
            for pin in pins:
                self.add_pin(PinView(
                    request_id=pin.request_id,
                    job_id=effective_job_id(pin.job_id, pin.request_id),
                    blocks=pin.blocks,
                    pinned_at_s=pin.pinned_at_s,
                    expires_at_s=pin.expires_at_s,
                    tool=pin.tool or None,
                ))
            yield
        for events in slices.chunks(report.events):
            self._apply_events(events, delta)
            yield
        for request_id in report.released_pins:
            self.end_pin(request_id)
        return delta

    def _add_requests(self, added: Sequence[pb.NewRequest], delta: ReportDelta) -> None:
        for new in added:
            live = LiveRequest(
                request_id=new.request_id,
                job_id=effective_job_id(new.job_id, new.request_id),
                is_last_step=new.is_last_step,
                arrival_s=new.arrival_s,
                prompt_tokens=new.prompt_tokens,
                state=_STATE.get(new.state, RequestState.WAITING),
                computed_tokens=new.computed_tokens,
                tool_hint=new.tool_hint or None,
                retention=new.retention if new.HasField("retention") else None,
                retention_scope=new.retention_scope,
            )
            # A duplicate id replaces the old entry: the engine's word is the truth.
            replaced = self.requests.get(new.request_id)
            if replaced is not None:
                self._views[replaced.state].pop(new.request_id, None)
                self._forget_live(replaced)
                if replaced.job_id != live.job_id:
                    delta.replaced.append(replaced)
            self.requests[new.request_id] = live
            self._live_by_job[live.job_id] = self._live_by_job.get(live.job_id, 0) + 1
            self._views[live.state][new.request_id] = live.view()
            self.pin_outcomes.job_returned(live.job_id, live.arrival_s)
            delta.arrived.append(live)

    def _apply_events(self, events: Sequence[pb.RequestEvent], delta: ReportDelta) -> None:
        for event in events:
            known = self.requests.get(event.request_id)
            if known is None:
                delta.unknown_ids += 1
                continue
            known.blocks = event.blocks
            if event.kind == pb.EVENT_KIND_ADMITTED:
                if event.cached_tokens:
                    known.cached_tokens = event.cached_tokens
                self._move(known, RequestState.RUNNING)
            elif event.kind == pb.EVENT_KIND_PREEMPTED:
                self._move(known, RequestState.WAITING)
            elif event.kind == pb.EVENT_KIND_FINISHED:
                del self.requests[event.request_id]
                self._views[known.state].pop(event.request_id, None)
                self._forget_live(known)
                delta.finished.append(Finished(request=known.view(), event=event))

    def add_pin(self, pin: PinView) -> None:
        replaced = self.pins.get(pin.request_id)
        if replaced is not None:
            self.pinned_blocks -= replaced.blocks
        self.pins[pin.request_id] = pin
        self.pinned_blocks += pin.blocks
        self.pin_outcomes.pinned(pin)
        # The job's next request may have arrived before its pin was decided (a tool
        # back within the report): the pin holds its context all the same.
        if self._live_by_job.get(pin.job_id):
            self.pin_outcomes.job_returned(pin.job_id, pin.pinned_at_s)

    def _forget_live(self, live: LiveRequest) -> None:
        left = self._live_by_job[live.job_id] - 1
        if left:
            self._live_by_job[live.job_id] = left
        else:
            del self._live_by_job[live.job_id]

    def end_pin(self, request_id: str) -> PinView | None:
        """The pin is released (by the daemon or the engine); None: not held."""
        pin = self.pins.pop(request_id, None)
        if pin is not None:
            self.pinned_blocks -= pin.blocks
            self.pin_outcomes.ended(request_id, self.now_s)
        return pin

    def _move(self, live: LiveRequest, state: RequestState) -> None:
        self._views[live.state].pop(live.request_id, None)
        live.move_to(state)
        self._views[state][live.request_id] = live.view()

    def waiting_ids(self) -> KeysView[str]:
        return self._views[RequestState.WAITING].keys()

    def running_ids(self) -> KeysView[str]:
        return self._views[RequestState.RUNNING].keys()

    def waiting(self) -> list[RequestView]:
        return list(self._views[RequestState.WAITING].values())

    def running(self) -> list[RequestView]:
        return list(self._views[RequestState.RUNNING].values())
