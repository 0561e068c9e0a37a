"""In-memory job state for policies, and tool-time measurement.

A *job* is an agent's sequence of LLM calls ("turns") separated by tool executions.
The tracker turns the engine's arrival / finish events into ``JobView``s and measures
tool times: ``tool time = arrival of the job's next request - departure of the turn
that called the tool``.

Robustness (the two crashes of Continuum's job history cannot happen here):

- A request with no job id (``None`` or empty) is a job of its own, whose id is the
  request id (:func:`effective_job_id`). It is never an error.
- Several requests of one job may be in flight at once (agents fan out): the tracker
  keeps a set of in-flight request ids per job and a separate "pending tool" record,
  instead of assuming the history alternates arrival / departure.
- Events are idempotent: an arrival of a request already in flight (a snapshot replayed
  after a gap) and a repeated finish change nothing.

Memory is bounded: at most ``max_jobs`` jobs are kept; past that, the least recently
active *idle* jobs (no request in flight) are forgotten first. A job with requests in
flight is never dropped (its requests are real and bounded by the engine's capacity),
so the bound can be exceeded only by more jobs in flight than ``max_jobs``. A job whose
last step finished goes to the front of the eviction order: no turn should follow.
Idle jobs are kept in an order of their own, apart from those in flight, so forgetting
one costs O(1) however many jobs are in flight.
Requests count as in flight only while an engine reports them: those of an engine
that left, or that its snapshot no longer lists, are let go (:meth:`on_lost`).

Inspection reads jobs in another order, most recently active first
(:meth:`JobTracker.recent_jobs`): every arrival or finish numbers the job's activity,
and two activity orders are kept, one of the jobs named by a job id and one of the
*anonymous* jobs (a request sent without a job id is a job of its own), so that a run
of anonymous requests does not hide the agent jobs and a job's place in the eviction
order does not hide it either.

Contract: not thread-safe; the runtime calls it from one event loop. Times are engine
seconds, as in ``sidecar.framework.types``.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from sidecar.framework.types import JobView

DEFAULT_MAX_JOBS = 100_000


def effective_job_id(job_id: str | None, request_id: str) -> str:
    """The job a request belongs to: its job id, or, with none, the request's own id
    (a one-request job). The runtime must use the same convention for
    ``RequestView.job_id`` so that policies and the tracker agree."""
    return job_id if job_id else request_id


@dataclass(frozen=True, slots=True)
class MeasuredToolTime:
    """A tool time measured when a job's next request arrived."""

    job_id: str
    tool: str
    duration_s: float
    # Departure of the turn that called the tool, and the arrival that ended it.
    departure_s: float
    arrival_s: float


class _Job:
    __slots__ = (
        "active_seq",
        "anonymous",
        "first_arrival_s",
        "in_flight",
        "job_id",
        "last_departure_s",
        "last_finished_request_id",
        "last_tool",
        "pending_departure_s",
        "pending_tool",
        "turns_finished",
        "view",
    )

    def __init__(self, job_id: str, first_arrival_s: float, anonymous: bool) -> None:
        self.job_id = job_id
        self.first_arrival_s = first_arrival_s
        # A request's own job (no job id given); its place in the activity orders.
        self.anonymous = anonymous
        self.active_seq = 0
        self.turns_finished = 0
        self.last_departure_s: float | None = None
        self.last_tool: str | None = None
        # The latest finished turn that called a tool whose time is not measured yet.
        self.pending_tool: str | None = None
        self.pending_departure_s = 0.0
        # Request ids in flight; None when there are none (most jobs, most of the time).
        self.in_flight: set[str] | None = None
        self.last_finished_request_id: str | None = None
        # JobView cache: policies read views every step, jobs change once per event.
        self.view: JobView | None = None

    def snapshot(self) -> JobView:
        if self.view is None:
            self.view = JobView(
                job_id=self.job_id,
                first_arrival_s=self.first_arrival_s,
                turns_finished=self.turns_finished,
                last_departure_s=self.last_departure_s,
                last_tool=self.last_tool,
                requests_in_flight=len(self.in_flight) if self.in_flight else 0,
            )
        return self.view


class JobTracker:
    def __init__(self, max_jobs: int = DEFAULT_MAX_JOBS) -> None:
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {max_jobs!r}")
        self.max_jobs = max_jobs
        # Every job kept, by id.
        self._jobs: dict[str, _Job] = {}
        # Eviction order of the idle jobs (none in flight): least recently active
        # first, jobs whose last step finished before them. A job in flight is not in
        # it, so eviction never walks past one.
        self._idle: OrderedDict[str, _Job] = OrderedDict()
        # Activity orders, least recently active first, by increasing active_seq.
        self._named_by_activity: OrderedDict[str, _Job] = OrderedDict()
        self._anonymous_by_activity: OrderedDict[str, _Job] = OrderedDict()
        self._activity_seq = 0

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def on_arrival(
        self, job_id: str | None, request_id: str, arrival_s: float
    ) -> MeasuredToolTime | None:
        """A request arrived. Returns the tool time this arrival ends, if any: the
        time since the departure of the job's latest finished turn that called a tool
        not measured yet. An arrival earlier than that departure (events reported out
        of order) measures nothing and leaves the tool pending."""
        job_key = effective_job_id(job_id, request_id)
        job = self._touch(job_key, request_id, arrival_s)
        if job.in_flight is not None and request_id in job.in_flight:
            return None  # replayed arrival
        if job.in_flight is None:
            job.in_flight = set()
            self._idle.pop(job_key, None)
        job.in_flight.add(request_id)
        job.first_arrival_s = min(job.first_arrival_s, arrival_s)
        job.view = None
        if job.pending_tool is None or arrival_s < job.pending_departure_s:
            return None
        measured = MeasuredToolTime(
            job_id=job_key,
            tool=job.pending_tool,
            duration_s=arrival_s - job.pending_departure_s,
            departure_s=job.pending_departure_s,
            arrival_s=arrival_s,
        )
        job.pending_tool = None
        return measured

    def on_finish(
        self,
        job_id: str | None,
        request_id: str,
        departure_s: float,
        tool: str | None,
        is_last_step: bool = False,
    ) -> None:
        """A request finished at ``departure_s`` having called ``tool`` (None: none).
        A finish whose arrival was never seen (daemon restarted mid-request) still
        counts: the job starts at its departure."""
        job_key = effective_job_id(job_id, request_id)
        job = self._touch(job_key, request_id, departure_s)
        in_flight = job.in_flight is not None and request_id in job.in_flight
        if not in_flight and job.last_finished_request_id == request_id:
            return  # repeated finish
        self._leave_flight(job, request_id)
        job.turns_finished += 1
        job.last_finished_request_id = request_id
        # Concurrent turns may finish out of order: the latest departure wins.
        if job.last_departure_s is None or departure_s >= job.last_departure_s:
            job.last_departure_s = departure_s
            job.last_tool = tool
        if tool is not None and departure_s >= job.pending_departure_s:
            job.pending_tool = tool
            job.pending_departure_s = departure_s
        job.view = None
        if is_last_step:
            job.pending_tool = None  # no next turn will measure it
            if job.in_flight is None:
                self._idle.move_to_end(job_key, last=False)  # forget it first

    def on_abort(self, job_id: str | None, request_id: str) -> None:
        """A request left without finishing (aborted, rejected): no turn, no tool."""
        job = self._jobs.get(effective_job_id(job_id, request_id))
        if job is None or job.in_flight is None or request_id not in job.in_flight:
            return
        self._leave_flight(job, request_id)
        job.view = None

    def on_lost(self, requests: Iterable[tuple[str, str]]) -> None:
        """``(job_id, request_id)`` pairs no engine reports any more: the engine's
        session ended, or its new snapshot does not list them. They stop counting as
        in flight, with no turn and no tool; an engine that comes back lists those
        still alive in its snapshot, which puts them back. Jobs past ``max_jobs``
        are then forgotten, idle ones first, as on any arrival."""
        for job_id, request_id in requests:
            self.on_abort(job_id, request_id)
        if len(self._jobs) > self.max_jobs:
            self._evict_idle(len(self._jobs) - self.max_jobs)

    def on_tool_announced(self, job_id: str, tool: str) -> bool:
        """An orchestrator says the job is running ``tool`` now, after its latest
        turn: the tool becomes the job's last tool and the one its next arrival
        measures (the caller's word wins over the parsed output, as a client's tool
        hint does). Only a tracked job between turns changes; nothing is kept of any
        other. Answers whether the job changed."""
        job = self._jobs.get(job_id)
        if job is None or job.last_departure_s is None or job.in_flight:
            return False
        job.last_tool = tool
        job.pending_tool = tool
        job.pending_departure_s = job.last_departure_s
        job.view = None
        return True

    def view(self, job_id: str) -> JobView | None:
        job = self._jobs.get(job_id)
        return None if job is None else job.snapshot()

    def views(self, job_ids: Iterable[str]) -> dict[str, JobView]:
        """Views of the given jobs that are known, e.g. those of a step's requests and
        pins, for ``StepView.jobs``."""
        result: dict[str, JobView] = {}
        jobs = self._jobs
        for job_id in job_ids:
            if job_id not in result:
                job = jobs.get(job_id)
                if job is not None:
                    result[job_id] = job.snapshot()
        return result

    def recent_jobs(self, limit: int, *, active_before: int | None = None,
                    include_anonymous: bool = False) -> list[tuple[str, int]]:
        """Up to ``limit`` (job id, activity number) pairs, most recently active first,
        of the jobs last active before activity number ``active_before`` (None: all).
        Paging by activity number lists each job once, however jobs move meanwhile:
        a job active again moves ahead of the page already read."""
        orders = [self._named_by_activity]
        if include_anonymous:
            orders.append(self._anonymous_by_activity)
        newest_first = [self._active_before(order, active_before) for order in orders]
        merged = newest_first[0] if len(newest_first) == 1 else heapq.merge(
            *newest_first, key=lambda job: -job.active_seq)
        return [(job.job_id, job.active_seq) for job in itertools.islice(merged, limit)]

    @staticmethod
    def _active_before(order: OrderedDict[str, _Job], active_before: int | None
                       ) -> Iterator[_Job]:
        """``order``'s jobs from the newest, from the first active before
        ``active_before``: the order is by activity number, so a bisection finds it in
        a copy of the jobs (taken at C speed) rather than a walk past the newer ones."""
        if active_before is None:
            return reversed(order.values())
        jobs = list(order.values())
        start = bisect.bisect_left(jobs, active_before, key=lambda job: job.active_seq)
        return reversed(jobs[:start])

    def _touch(self, job_id: str, request_id: str, first_seen_s: float) -> _Job:
        self._activity_seq += 1
        job = self._jobs.get(job_id)
        if job is not None:
            if job.in_flight is None:
                self._idle.move_to_end(job_id)
            job.active_seq = self._activity_seq
            if job.anonymous and request_id != job_id:  # a job id named it after all
                job.anonymous = False
                del self._anonymous_by_activity[job_id]
                self._named_by_activity[job_id] = job
            else:
                self._by_activity(job).move_to_end(job_id)
            return job
        if len(self._jobs) >= self.max_jobs:
            self._evict_idle(len(self._jobs) + 1 - self.max_jobs)
        job = _Job(job_id, first_seen_s, anonymous=request_id == job_id)
        job.active_seq = self._activity_seq
        self._jobs[job_id] = job
        self._idle[job_id] = job
        self._by_activity(job)[job_id] = job
        return job

    def _by_activity(self, job: _Job) -> OrderedDict[str, _Job]:
        return self._anonymous_by_activity if job.anonymous else self._named_by_activity

    def _leave_flight(self, job: _Job, request_id: str) -> None:
        """``request_id`` is no longer in flight; a job left with none becomes idle,
        the most recently active one."""
        if job.in_flight is None:
            return
        job.in_flight.discard(request_id)
        if not job.in_flight:
            job.in_flight = None
            self._idle[job.job_id] = job

    def _evict_idle(self, excess: int) -> None:
        """Forget up to ``excess`` idle jobs, least recently active first: O(1) each."""
        for _ in range(min(excess, len(self._idle))):
            job_id, job = self._idle.popitem(last=False)
            del self._jobs[job_id]
            del self._by_activity(job)[job_id]
