"""What ``adaptive`` remembers of an engine's recent past (``state.EngineMemory``
holds one of each):

- :class:`PriceForecast`, the price of memory over the next seconds. A pin decided
  now holds its blocks for seconds; the price it pays is the price over those
  seconds, not the one at the step it was decided. Where memory flickers between
  idle and short (a small cache that fits a context or two, requests arriving every
  few hundred milliseconds) the price at any one step is usually 0, and a pin valued
  at it looks free until the next request arrives and waits on it. The best forecast
  of the price over the next seconds is its recent average: an exponential average
  over time, each step's price weighted by how long it lasted.
- :class:`AdmissionRate`, :class:`ArrivalOrderClock` and :class:`FcfsRecompute`, which
  set the bound on waiting (admission.py, ``overdue_request_ids``). By Little's law a
  queue of L requests that the engine admits at λ a second holds each for L / λ
  seconds in arrival order: the wait FCFS would give a request arriving now. For a
  request that has waited a while, the arrival-order clock says when FCFS would have
  admitted it, had it admitted as many requests as the engine did, fewer by what
  FCFS would have re-computed of the contexts this engine kept.
- :class:`ReleasedContexts`, the contexts released while their job is in a tool.

Each is fed by an engine's steps in order; a step seen twice (the same ``now_s``) adds
nothing to it, and a clock that goes back (an engine restarted under the same id)
starts it afresh. All go when the daemon forgets the engine (``PerEngine.forget``).
"""

from __future__ import annotations

import math
import operator
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from sidecar.framework.types import RequestView

_State = TypeVar("_State")
_request_id = operator.attrgetter("request_id")


class PerEngine(Generic[_State]):
    """State kept per engine id, dropped when the daemon forgets the engine
    (``AdaptivePolicy.forget_engine``). No lock: every decision, and every forget,
    runs on the daemon's event-loop thread, one at a time (the policy contract,
    ``sidecar.framework.protocols``)."""

    def __init__(self) -> None:
        self._engines: dict[str, _State] = {}

    def forget(self, engine_id: str) -> None:
        self._engines.pop(engine_id, None)

    @property
    def engine_ids(self) -> frozenset[str]:
        """The engines with state here."""
        return frozenset(self._engines)


@dataclass(slots=True)
class _Average:
    value: float  # the average up to at_s
    price: float  # the price from at_s on, until the next step
    at_s: float


class PriceForecast(PerEngine[_Average]):
    """Per engine, the time-weighted exponential average of the price of memory,
    with a time constant of ``window_s`` (0: no memory, the current price only)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        super().__init__()

    def update(self, engine_id: str, now_s: float, price: float) -> float:
        """Record the price seen at ``now_s``; answer the forecast for the seconds
        ahead: the larger of the current price and the recent average."""
        if self.window_s <= 0.0:
            return price
        average = self._engines.get(engine_id)
        if average is None or now_s < average.at_s:
            # First step, or a clock that went back (an engine restarted under the
            # same id): no past to average.
            average = self._engines[engine_id] = _Average(0.0, price, now_s)
        elapsed_s = now_s - average.at_s
        if elapsed_s > 0.0:
            # The previous price held from at_s until now.
            kept = math.exp(-elapsed_s / self.window_s)
            average.value = kept * average.value + (1.0 - kept) * average.price
            average.at_s = now_s
        average.price = price
        return max(price, average.value)


def _positive_window(window_s: float) -> float:
    """A time constant of an average over time, checked: it divides elapsed time."""
    if not window_s > 0.0:
        raise ValueError(f"window_s must be > 0, got {window_s!r}")
    return window_s


@dataclass(slots=True)
class _Rate:
    per_s: float  # the average rate up to at_s
    at_s: float
    running: frozenset[str]  # the running requests at at_s


class AdmissionRate(PerEngine[_Rate]):
    """Per engine, the requests admitted per second, averaged over time with a time
    constant of ``window_s``. A request is admitted when it first shows among the
    running ones, so steps the policy does not see (the plugin reports a stall once)
    lose no admission, and a step seen twice counts none twice."""

    def __init__(self, window_s: float) -> None:
        self.window_s = _positive_window(window_s)
        super().__init__()

    def update(self, engine_id: str, now_s: float, running_ids: frozenset[str]) -> float:
        """Record the running requests seen at ``now_s``; answer the rate (1/s)."""
        rate = self._engines.get(engine_id)
        if rate is None or now_s < rate.at_s:
            # First step, or a clock that went back: the rate is unknown (0).
            self._engines[engine_id] = _Rate(0.0, now_s, running_ids)
            return 0.0
        admitted = len(running_ids - rate.running)
        # The past decays over the elapsed time; each admission adds 1 / window_s,
        # so a steady λ a second averages to λ.
        kept = math.exp(-(now_s - rate.at_s) / self.window_s)
        rate.per_s = kept * rate.per_s + admitted / self.window_s
        rate.at_s = now_s
        rate.running = running_ids
        return rate.per_s


@dataclass(slots=True)
class _Clock:
    at_s: float
    # Requests waiting or running at the last step (a request absent from it is new).
    live: set[str] = field(default_factory=set)
    # Live requests the engine has admitted at least once (a re-admission after a
    # preemption is not a new admission).
    admitted: set[str] = field(default_factory=set)
    # Requests in arrival order that arrival order has not admitted yet.
    queue: deque[str] = field(default_factory=deque)
    # Admissions the engine made that arrival order has not matched yet, each counted
    # as the share of an FCFS admission it is worth (see ``update``'s ``weigh``).
    unmatched: float = 0.0
    # Live requests arrival order has admitted: when it did.
    due_at_s: dict[str, float] = field(default_factory=dict)


class ArrivalOrderClock(PerEngine[_Clock]):
    """Per engine, when FCFS would have admitted each live request: a virtual FCFS
    that admits, in arrival order, as many requests as the engine really admitted.

    Requests join the virtual queue in arrival order as they first show (waiting or
    running); each admission the engine makes, whichever request it picks, admits
    the head of the virtual queue. A request is *due* at the step the virtual FCFS
    admits it, and its arrival-order wait is that step minus its arrival. Unlike
    ``L / λ`` (the wait of a request arriving now) that wait is fixed once the
    request is due: it does not grow with a backlog that built after it arrived.
    Admissions are counted from the running requests, as in ``AdmissionRate``: a
    step seen twice changes nothing, and steps the policy does not see lose none."""

    def update(self, engine_id: str, now_s: float, waiting: Iterable[RequestView],
               running: Iterable[RequestView],
               weigh: Callable[[list[RequestView]], float] | None = None,
               ) -> Mapping[str, float]:
        """Record the step seen at ``now_s``; answer, for the live requests that
        arrival order would have admitted by now, the time it did (a read-only view,
        valid until the next update).

        ``weigh``, given the requests the engine admitted at this step, answers what
        each is worth in admissions of arrival order (1 unless given: FCFS would
        have admitted as many; ``FcfsRecompute``: fewer, slowed by re-compute)."""
        waiting, running = tuple(waiting), tuple(running)
        clock = self._engines.get(engine_id)
        if clock is None or now_s < clock.at_s:
            # First step, or a clock that went back (engine restarted): afresh.
            clock = self._engines[engine_id] = _Clock(now_s)
        running_ids = set(map(_request_id, running))
        live = set(map(_request_id, waiting))
        live.update(running_ids)
        # Set differences first: most steps bring few new or admitted requests.
        new_ids = live - clock.live
        if new_ids:
            arrived = sorted((r for r in (*waiting, *running) if r.request_id in new_ids),
                             key=lambda r: (r.arrival_s, r.request_id))
            clock.queue.extend(r.request_id for r in arrived)
        admitted = ([r for r in running if r.request_id not in clock.admitted]
                    if running_ids - clock.admitted else [])
        clock.admitted.update(r.request_id for r in admitted)
        if admitted:
            clock.unmatched += len(admitted) * (weigh(admitted) if weigh else 1.0)
        for gone in clock.live - live:
            if gone not in clock.admitted and gone not in clock.due_at_s:
                # Aborted before arrival order reached it: it leaves the virtual
                # queue too (rare, so the linear removal is fine).
                clock.queue.remove(gone)
            clock.admitted.discard(gone)
            clock.due_at_s.pop(gone, None)
        while clock.unmatched >= 1.0 - 1e-9 and clock.queue:
            # A request admitted out of order and gone since still takes its
            # turn here: arrival order would have admitted it then.
            request_id = clock.queue.popleft()
            clock.unmatched -= 1
            if request_id in live:
                clock.due_at_s[request_id] = now_s
        clock.live = live
        clock.at_s = now_s
        return clock.due_at_s


@dataclass(slots=True)
class _Recompute:
    # Average share of a job's first prompt found cached: the part of any prompt
    # other jobs keep in the cache, whatever FCFS does with this job's context.
    shared_fraction: float
    # Average re-compute seconds FCFS would have added per second.
    extra_per_s: float
    at_s: float

    @property
    def factor(self) -> float:
        """The share of this engine's admission rate FCFS would achieve."""
        return 1.0 / (1.0 + self.extra_per_s)


class FcfsRecompute(PerEngine[_Recompute]):
    """Per engine, how much slower than this engine FCFS would admit requests: the
    re-compute of the contexts this engine kept between turns and FCFS, its memory
    short, would have lost (the fair share's virtual FCFS runs at the rate this
    engine admits, divided by the factor this answers).

    What FCFS would have found cached for a continuing turn: the share of a prompt
    other jobs keep warm, estimated from the hit of first turns (a job's first turn
    has no context of its own to find). The rest of what this engine found cached,
    at the learned cost of a prompt token, weighted by how short memory is (with
    memory idle FCFS keeps contexts too), is FCFS's extra work.

    Only the share of a prompt FCFS must allocate anew delays its admissions, so the
    extra work counts ``1 - shared_fraction`` of it: with prompts mostly shared,
    FCFS admits a turn into the few blocks it needs at once and pays the re-compute
    in preemptions of the running requests, not in the wait of the waiting ones.
    The factor assumes the engine busy; its only use is a bound on waiting, which
    matters only when requests queue."""

    # Weight of each new first turn in the average shared fraction.
    SHARED_SMOOTHING = 0.1

    def __init__(self, window_s: float) -> None:
        self.window_s = _positive_window(window_s)
        super().__init__()

    def update(self, engine_id: str, now_s: float, admitted: Iterable[RequestView],
               first_turn: Callable[[RequestView], bool], prefill_s_per_token: float,
               shortage: float) -> float:
        """Record the requests the engine admitted at ``now_s`` (``first_turn`` tells
        a job's first request; ``shortage`` in [0, 1] is how short memory is); answer
        the factor (<= 1) FCFS's admission rate is of this engine's."""
        state = self._engines.get(engine_id)
        if state is None or now_s < state.at_s:
            state = self._engines[engine_id] = _Recompute(0.0, 0.0, now_s)
        lost_tokens = 0.0
        for request in admitted:
            if request.prompt_tokens <= 0:
                continue
            if first_turn(request):
                hit = min(request.cached_tokens / request.prompt_tokens, 1.0)
                state.shared_fraction += self.SHARED_SMOOTHING * (
                    hit - state.shared_fraction)
            else:
                lost_tokens += max(request.cached_tokens
                                   - state.shared_fraction * request.prompt_tokens, 0.0)
        extra_s = (lost_tokens * prefill_s_per_token * min(max(shortage, 0.0), 1.0)
                   * (1.0 - state.shared_fraction))
        # As AdmissionRate: the past decays over the elapsed time, each second
        # of extra work adds 1 / window_s, so a steady x a second averages to x.
        kept = math.exp(-(now_s - state.at_s) / self.window_s)
        state.extra_per_s = kept * state.extra_per_s + extra_s / self.window_s
        state.at_s = now_s
        return state.factor

    def factor(self, engine_id: str) -> float:
        """The factor as of the last update (1 for an engine not seen). It is not
        decayed between updates: while the engine admits nothing, the re-compute FCFS
        would do per admission is unchanged."""
        state = self._engines.get(engine_id)
        return 1.0 if state is None else state.factor


class ReleasedContexts(PerEngine[dict[str, tuple[int, float]]]):
    """Per engine, the contexts ``adaptive`` let go of (cached at a retention priority
    at the finish, or a pin released) while their job is in a tool: what a pin's
    blocks would otherwise keep cached.

    A released context stays in vLLM's free pool, cached, until a new allocation
    evicts it. A pin keeps its blocks out of that pool, so the pool turns over sooner
    and evicts those contexts earlier: while the waiting requests fit in the free
    blocks, a pin does not cost them a block, but may cost another job its context
    (value.py, ``memory_pressure``'s ``released_blocks``). A context counts until its
    job is back (waiting or running), holds a pin again, or ``horizon_s`` has passed:
    the longest a pin is planned for, after which its job is not expected back soon.
    """

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        super().__init__()

    def record(self, engine_id: str, job_id: str, blocks: int, now_s: float) -> None:
        """The job's context of ``blocks`` blocks was released at ``now_s``."""
        if blocks <= 0:
            return
        self._engines.setdefault(engine_id, {})[job_id] = (blocks, now_s)

    def blocks(self, engine_id: str, now_s: float, back_jobs: Iterable[str],
               pinned_jobs: Iterable[str]) -> int:
        """Blocks of the released contexts still expected back: their job is neither
        back (``back_jobs``: waiting or running) nor pinned, within ``horizon_s``.
        Contexts of jobs back or past the horizon are forgotten."""
        released = self._engines.get(engine_id)
        if not released:
            return 0
        for job_id in set(back_jobs) & released.keys():
            del released[job_id]
        pinned = set(pinned_jobs)
        total = 0
        for job_id, (blocks, at_s) in list(released.items()):
            if now_s - at_s > self.horizon_s or now_s < at_s:
                del released[job_id]
            elif job_id not in pinned:
                total += blocks
        return total
