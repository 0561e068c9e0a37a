"""Small builders for table-driven policy and tracker tests.

s = (step(now=10, free_blocks=4)
     .waiting("w1", job="a", arrive=5)
     .running("r1", job="b", arrive=1, last=True)
     .pin("p0", job="a", blocks=3, expires=12))
s.build()                       # -> StepView
s.finish("r1", tool="ls")       # -> FinishInput for a running request

job("a").turn(arrive=0, depart=1, tool="ls").turn(arrive=1.5, depart=2)
replay(tracker, job_a, job_b)   # feeds events in time order
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sidecar.estimators.sketch import LogBucketSketch, add_increments
from sidecar.framework.types import (
    EngineCost,
    FinishInput,
    JobView,
    KvView,
    PinView,
    RequestState,
    RequestView,
    StepView,
    ToolTimeDistribution,
)
from sidecar.jobs.tracker import JobTracker, MeasuredToolTime


def distribution(tool: str, samples_s: Iterable[float]) -> ToolTimeDistribution | None:
    """A tool-time distribution built exactly as the estimator builds it."""
    sketch = LogBucketSketch()
    fields: dict[str, float] = {}
    for sample in samples_s:
        add_increments(fields, sketch.increments(sample))
    return sketch.distribution(tool, fields)


@dataclass
class StepBuilder:
    now: float = 0.0
    total_blocks: int = 1000
    free_blocks: int = 1000
    block_size_tokens: int = 16
    _waiting: list[RequestView] = field(default_factory=list)
    _running: list[RequestView] = field(default_factory=list)
    _pins: list[PinView] = field(default_factory=list)
    _jobs: dict[str, JobView] = field(default_factory=dict)
    _samples: dict[str, list[float]] = field(default_factory=dict)
    _stalled: bool = False
    _demand_blocks: int | None = None
    _engine_cost: EngineCost | None = None
    _seen_until_s: float | None = None
    _prefill_tokens_per_s: float | None = None
    _engine_id: str = "engine-0"
    _late_answer_share: float | None = None

    def _request(
        self,
        state: RequestState,
        request_id: str,
        job: str | None,
        arrive: float,
        prompt: int,
        last: bool,
        computed: int,
        cached: int = 0,
    ) -> RequestView:
        return RequestView(
            request_id=request_id,
            job_id=job if job is not None else request_id,
            is_last_step=last,
            arrival_s=arrive,
            prompt_tokens=prompt,
            state=state,
            computed_tokens=computed,
            cached_tokens=cached,
        )

    def waiting(
        self,
        request_id: str,
        job: str | None = None,
        arrive: float = 0.0,
        prompt: int = 16,
        last: bool = False,
        computed: int = 0,
    ) -> StepBuilder:
        self._waiting.append(
            self._request(RequestState.WAITING, request_id, job, arrive, prompt, last, computed)
        )
        return self

    def running(
        self,
        request_id: str,
        job: str | None = None,
        arrive: float = 0.0,
        prompt: int = 16,
        last: bool = False,
        computed: int = 0,
        cached: int = 0,
    ) -> StepBuilder:
        """A running request; ``cached``: the prefix-cache hit at its admission."""
        self._running.append(self._request(RequestState.RUNNING, request_id, job, arrive,
                                           prompt, last, computed, cached))
        return self

    def pin(
        self,
        request_id: str,
        job: str,
        blocks: int = 1,
        expires: float = 100.0,
        pinned_at: float = 0.0,
        tool: str | None = None,
    ) -> StepBuilder:
        self._pins.append(PinView(request_id, job, blocks, pinned_at, expires, tool))
        return self

    def job(self, job_id: str, first_arrival: float, turns: int = 0,
            departed: float | None = None) -> StepBuilder:
        """An explicit JobView (as the tracker would send); without one, policies fall
        back to the earliest arrival of the job's requests in the step. ``departed``:
        when its latest turn finished."""
        self._jobs[job_id] = JobView(job_id, first_arrival, turns_finished=turns,
                                     last_departure_s=departed)
        return self

    def times(self, tool: str, samples_s: Iterable[float]) -> StepBuilder:
        """Measured durations of ``tool`` (the step's ``tool_times``; every tool's
        samples pooled are its ``global_tool_times``)."""
        self._samples.setdefault(tool, []).extend(samples_s)
        return self

    def engine_cost(self, prefill_s_per_token: float) -> StepBuilder:
        """The step cost the daemon learned for this engine."""
        self._engine_cost = EngineCost(prefill_s_per_token=prefill_s_per_token,
                                       decode_s_per_seq=1e-4, step_s=0.01, steps=5000,
                                       prefill_relative_error=0.01)
        return self

    def prefill_rate(self, tokens_per_s: float) -> StepBuilder:
        """Prompt tokens the engine computed a second lately."""
        self._prefill_tokens_per_s = tokens_per_s
        return self

    def seen_until(self, at_s: float) -> StepBuilder:
        """Arrivals after ``at_s`` are not in this step yet (the previous report's time)."""
        self._seen_until_s = at_s
        return self

    def on_engine(self, engine_id: str) -> StepBuilder:
        """The step of another engine than ``engine-0``."""
        self._engine_id = engine_id
        return self

    def late_answers(self, share: float | None) -> StepBuilder:
        """The share of the engine's recent answers that landed 3 or more steps late."""
        self._late_answer_share = share
        return self

    def stalled(self) -> StepBuilder:
        """The engine's last step admitted nothing although requests waited."""
        self._stalled = True
        return self

    def demand(self, blocks: int) -> StepBuilder:
        """The plugin's count of the blocks the waiting requests would take from the
        free pool (shared prefixes once); unset, the daemon sums each request's."""
        self._demand_blocks = blocks
        return self

    def build(self) -> StepView:
        tool_times = {tool: d for tool, samples in self._samples.items()
                      if (d := distribution(tool, samples)) is not None}
        pooled = [sample for samples in self._samples.values() for sample in samples]
        return StepView(
            engine_id=self._engine_id,
            now_s=self.now,
            kv=KvView(self.total_blocks, self.free_blocks, self.block_size_tokens,
                      admission_stalled=self._stalled,
                      waiting_demand_blocks=self._demand_blocks),
            waiting=tuple(self._waiting),
            running=tuple(self._running),
            pins=tuple(self._pins),
            jobs=dict(self._jobs),
            tool_times=tool_times,
            global_tool_times=distribution("*", pooled) if pooled else None,
            engine_cost=self._engine_cost,
            arrivals_seen_until_s=self._seen_until_s,
            prefill_tokens_per_s=self._prefill_tokens_per_s,
            late_answer_share=self._late_answer_share,
        )

    def finish(
        self,
        request_id: str,
        tool: str | None = None,
        samples_s: Iterable[float] = (),
        global_samples_s: Iterable[float] = (),
        blocks: int = 4,
        output_tokens: int = 8,
    ) -> FinishInput:
        """A running (or waiting) request of this step finishing with ``tool``, whose
        measured durations so far are ``samples_s``."""
        request = next(r for r in (*self._running, *self._waiting) if r.request_id == request_id)
        return FinishInput(
            step=self.build(),
            request=request,
            output_tokens=output_tokens,
            blocks=blocks,
            tool=tool,
            tool_times=distribution(tool, samples_s) if tool is not None else None,
            global_tool_times=distribution("*", global_samples_s),
        )


def step(
    now: float = 0.0, total_blocks: int = 1000, free_blocks: int = 1000, block_size: int = 16
) -> StepBuilder:
    return StepBuilder(now, total_blocks, free_blocks, block_size)


# --- jobs as scripts of turns, for the tracker ------------------------------------


@dataclass(frozen=True)
class Turn:
    job_id: str | None
    request_id: str
    arrive: float
    depart: float | None
    tool: str | None
    last: bool


@dataclass
class JobScript:
    job_id: str | None
    turns: list[Turn] = field(default_factory=list)

    def turn(
        self,
        arrive: float,
        depart: float | None = None,
        tool: str | None = None,
        last: bool = False,
        request_id: str | None = None,
    ) -> JobScript:
        """One request of the job; ``depart=None`` leaves it in flight."""
        rid = request_id or f"{self.job_id or 'anon'}-{len(self.turns)}"
        self.turns.append(Turn(self.job_id, rid, arrive, depart, tool, last))
        return self


def job(job_id: str | None) -> JobScript:
    return JobScript(job_id)


def replay(tracker: JobTracker, *jobs: JobScript) -> list[MeasuredToolTime]:
    """Feed every arrival and finish to ``tracker`` in time order (a finish before an
    arrival at the same instant); return the tool times measured, in order."""
    events: list[tuple[float, int, Turn]] = []
    for script in jobs:
        for turn in script.turns:
            events.append((turn.arrive, 1, turn))
            if turn.depart is not None:
                events.append((turn.depart, 0, turn))
    measured = []
    for at_s, kind, turn in sorted(events, key=lambda e: (e[0], e[1])):
        if kind == 1:
            sample = tracker.on_arrival(turn.job_id, turn.request_id, at_s)
            if sample is not None:
                measured.append(sample)
        else:
            tracker.on_finish(turn.job_id, turn.request_id, at_s, turn.tool, turn.last)
    return measured
