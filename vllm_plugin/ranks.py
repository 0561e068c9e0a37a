"""What ``Request.priority`` holds under kvtether: the client's priority, and kvtether's
rank inside it.

vLLM's priority policy orders the waiting heap by ``(priority, arrival_time,
request_id)`` (``Request.__lt__``) and preempts ``max(running, key=(priority,
arrival_time))``. The client's own priority (the OpenAI API's ``priority`` field or
``X-Vllm-Priority`` header, ``AsyncLLM``'s ``priority=``; Dynamo passes its agent hint's
priority negated) stays the first key of that order; the daemon's rank orders requests
only among those of one client priority. Both live in one value,
:class:`RankedPriority`: an ``int`` whose value is the client's priority, so every
reader that compares it with an int, prints it or converts it (LMCache's
``priority_limit``, vLLM's own tests, logs) sees exactly what the client sent, and
which, compared with another request's ``RankedPriority``, orders by
``(client priority, rank)``. vLLM's own code does nothing else with it.

Until the daemon ranks a request (and with no daemon at all) its rank is
:data:`UNRANKED_RANK`, the same for every request: the order is then vLLM's own,
``(client priority, arrival_time)``, bit for bit.
"""

from __future__ import annotations

from typing import Any

# Rank of a request the daemon has not ranked yet: behind every ranked request of its
# client priority, in vLLM's own order (arrival) among themselves, until the daemon's
# ranks come with the next step. The daemon's ranks stay below it
# (``sidecar.runtime.priorities.PRIORITY_LIMIT``).
UNRANKED_RANK = 1 << 30


class RankedPriority(int):
    """The client's priority (the int value) with kvtether's ``rank`` inside it.

    Against a plain int it is its int value; against another ``RankedPriority`` it
    compares ``(client priority, rank)``. Immutable: a new rank is a new value (a
    waiting request is taken out of vLLM's heap before its key changes)."""

    rank: int
    _key: tuple[int, int]

    def __new__(cls, client_priority: int, rank: int = UNRANKED_RANK) -> RankedPriority:
        value = super().__new__(cls, client_priority)
        value.rank = rank
        value._key = (int(client_priority), rank)
        return value

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RankedPriority):
            return self._key == other._key
        return int.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        if isinstance(other, RankedPriority):
            return self._key != other._key
        return int.__ne__(self, other)

    def __lt__(self, other: Any) -> bool:
        if isinstance(other, RankedPriority):
            return self._key < other._key
        return int.__lt__(self, other)

    def __le__(self, other: Any) -> bool:
        if isinstance(other, RankedPriority):
            return self._key <= other._key
        return int.__le__(self, other)

    def __gt__(self, other: Any) -> bool:
        if isinstance(other, RankedPriority):
            return self._key > other._key
        return int.__gt__(self, other)

    def __ge__(self, other: Any) -> bool:
        if isinstance(other, RankedPriority):
            return self._key >= other._key
        return int.__ge__(self, other)

    # Equal values hash alike: equal RankedPriority values have one client priority.
    __hash__ = int.__hash__
    # Printed, formatted and serialised as the client's priority.
    __repr__ = int.__repr__
    __str__ = int.__repr__

    def __reduce__(self) -> tuple[Any, ...]:
        return (RankedPriority, (int(self), self.rank))


def client_priority(request: Any) -> int:
    """The priority the request's client sent."""
    return int(request.priority)


def rank_of(request: Any) -> int:
    """kvtether's rank of the request inside its client priority."""
    priority = request.priority
    return priority.rank if isinstance(priority, RankedPriority) else UNRANKED_RANK


def ranked(request: Any, rank: int) -> RankedPriority:
    """The request's priority with kvtether's ``rank``, its client's priority kept."""
    return RankedPriority(client_priority(request), rank)
