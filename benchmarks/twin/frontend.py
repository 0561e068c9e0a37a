"""The API server between the client and the engine's scheduler, on the twin's clock.

A request sent at ``sent_s`` reaches the scheduler after ``delay_s`` of the API
server's work (HTTP, the request's checks, the message to the engine core). On the
CPU engine the API server shares the machine's two cores with the engine core, whose
forward pass takes them both: while the engine computes a step, that work goes on at
``busy_rate`` of its pace. Requests sent while the engine computes therefore mostly
reach it after it goes idle, and the engine goes idle after more of its turns than
requests that arrive independently of it would let it. A trace of the 2-core CPU
engine (FCFS, the tiny model, one round): 7.8% of requests found the engine busy against
18.8% in the twin with the time outside vLLM a fixed delay, and of the requests sent
while the engine computed, 30 of 34 reached it after it went idle, a median 10 ms
later (a request sent to an idle engine reached it a median 16 ms after it was sent).

``delay_s`` 0 (the sweeps' GPU engine, whose API server has cores of its own): a
request reaches the scheduler when it is sent.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FrontEnd:
    """The API server: its work a request at its full pace, and the share of that pace
    left while the engine computes a step."""

    delay_s: float = 0.0
    busy_rate: float = 1.0  # share of the API server's pace left while the engine computes

    def __post_init__(self) -> None:
        if not self.delay_s >= 0.0:
            raise ValueError(f"front end: delay_s {self.delay_s!r} must be >= 0")
        if not 0.0 < self.busy_rate <= 1.0:
            raise ValueError(f"front end: busy_rate {self.busy_rate!r} must be in (0, 1]")


@dataclass(slots=True)
class _InApi:
    remaining_s: float  # the API server's work left on it, at its full pace
    order: int
    job_index: int
    turn_index: int
    sent_s: float


class Arrivals:
    """Requests on their way to the scheduler, in the order they are sent (``send``).

    The caller moves the clock with ``advance(to_s, busy)`` (busy: the engine computed
    a step over that time) and adds what ``take_ready`` returns, in the order the
    requests reached the scheduler, the order they were sent breaking ties. A request
    is a (job index, turn index) pair."""

    def __init__(self, front: FrontEnd) -> None:
        self.front = front
        self.now_s = 0.0
        self._order = 0
        self._sent: list[tuple[float, int, int, int]] = []  # (sent_s, order, job, turn)
        self._in_api: list[_InApi] = []
        self._ready: list[tuple[float, int, int, int]] = []  # (reached_s, order, job, turn)
        self.front_s_total = 0.0  # seconds from sent to reached, summed over requests
        self.reached = 0

    def __bool__(self) -> bool:
        return bool(self._sent or self._in_api or self._ready)

    def send(self, sent_s: float, job_index: int, turn_index: int) -> None:
        heapq.heappush(self._sent, (sent_s, self._order, job_index, turn_index))
        self._order += 1

    def advance(self, to_s: float, busy: bool) -> None:
        """The clock moved from ``now_s`` to ``to_s``; the engine computed throughout
        (``busy``) or did not."""
        rate = self.front.busy_rate if busy else 1.0
        elapsed_s = max(to_s - self.now_s, 0.0)
        for request in self._in_api:
            request.remaining_s -= rate * elapsed_s
        while self._sent and self._sent[0][0] <= to_s:
            sent_s, order, job_index, turn_index = heapq.heappop(self._sent)
            if self.front.delay_s <= 0.0:
                self._reach(sent_s, sent_s, order, job_index, turn_index)
            else:
                self._in_api.append(_InApi(self.front.delay_s - rate * (to_s - sent_s),
                                           order, job_index, turn_index, sent_s))
        still = []
        for request in self._in_api:
            if request.remaining_s <= 1e-12:  # done this far before the interval's end
                self._reach(to_s + request.remaining_s / rate, request.sent_s, request.order,
                            request.job_index, request.turn_index)
            else:
                still.append(request)
        self._in_api = still
        self.now_s = max(self.now_s, to_s)

    def _reach(self, reached_s: float, sent_s: float, order: int, job_index: int,
               turn_index: int) -> None:
        heapq.heappush(self._ready, (reached_s, order, job_index, turn_index))
        self.front_s_total += reached_s - sent_s
        self.reached += 1

    def take_ready(self) -> list[tuple[float, int, int]]:
        """The requests that have reached the scheduler by ``now_s``, as (reached_s, job
        index, turn index), first reached first."""
        self.advance(self.now_s, busy=False)  # those sent at now_s, with no delay
        ready = []
        while self._ready:
            reached_s, _order, job_index, turn_index = heapq.heappop(self._ready)
            ready.append((reached_s, job_index, turn_index))
        return ready

    def next_reach_s(self) -> float:
        """When the next request reaches the scheduler if the engine computes nothing
        until then (it sleeps): the API server works at its full pace."""
        times = [self.now_s + request.remaining_s for request in self._in_api]
        if self._sent:
            times.append(self._sent[0][0] + self.front.delay_s)
        if self._ready:
            times.append(self.now_s)
        if not times:
            raise ValueError("no request on its way to the scheduler")
        return max(min(times), self.now_s)
