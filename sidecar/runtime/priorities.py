"""Turn a policy's ordering into vLLM ``Request.priority`` values, changing as few as possible.

vLLM's PRIORITY policy admits the waiting request with the smallest
``(priority, arrival_time)`` and preempts the running request with the largest. A
policy hands us an order; we must give each request an integer priority that
reproduces that order under vLLM's comparator. The engine keeps these values as a
rank inside each request's own client priority (``vllm_plugin/ranks.py``): the
client's priority stays the first key, the order applies among requests of one.

Renumbering by position would change every priority whenever the head of the queue
is admitted, and each change costs a message item and a heap fix-up in the engine.
Instead we keep every previously sent priority that already sits in order — the
longest increasing subsequence of the old keys, O(n log n) — and give new values only
to the rest, interpolated between their kept neighbours. When an order is stable
(requests leave from the head, arrive at the tail) nothing but the new arrivals is
sent. Only when there is no integer room left do we renumber with fresh gaps.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

# Gap between fresh priorities: room for ~10 insertions between two neighbours
# before a renumbering.
PRIORITY_GAP = 1024
# Keep priorities inside int32 (the proto field) with room to spare.
PRIORITY_LIMIT = 1 << 30


def assign_priorities(
    order: Sequence[str],
    arrival_s: Mapping[str, float],
    previous: Mapping[str, int],
) -> dict[str, int]:
    """Priorities for ``order`` (first = smallest key under (priority, arrival_s)).

    ``previous`` holds the priorities sent before; the result holds only the ids whose
    priority must change (or was never sent).
    """
    # Each request's arrival and previous priority, looked up once (a step orders
    # hundreds of requests, twice).
    arrivals = [arrival_s[request_id] for request_id in order]
    sent = [previous.get(request_id) for request_id in order]
    keys: list[tuple[int, float] | None] = [
        (priority, arrival) if priority is not None else None
        for priority, arrival in zip(sent, arrivals, strict=True)
    ]
    kept = _already_ordered(keys)
    if kept is None:
        kept = _longest_increasing(keys)

    changes: dict[str, int] = {}
    position = 0
    while position < len(order):
        if position in kept:
            position += 1
            continue
        # A run of requests [position, end) to place between two kept neighbours.
        end = position
        while end < len(order) and end not in kept:
            end += 1
        low = sent[position - 1] if position > 0 else None
        high = sent[end] if end < len(order) else None
        values = _fill(low, high, end - position)
        if values is None:
            return _renumber(order, previous)
        for offset, value in enumerate(values):
            changes[order[position + offset]] = value
        position = end

    # Equal priorities fall back on arrival time; check the placed runs respect it.
    # Every request has a priority now: kept from before, or placed above.
    final = [changes.get(request_id, priority)
             for request_id, priority in zip(order, sent, strict=True)]
    for index in range(len(order) - 1):
        if (final[index], arrivals[index]) >= (final[index + 1], arrivals[index + 1]):
            return _renumber(order, previous)
    return changes


def _fill(low: int | None, high: int | None, count: int) -> list[int] | None:
    """``count`` strictly increasing ints in the open interval (low, high); None if no room."""
    if low is None and high is None:
        return [index * PRIORITY_GAP for index in range(count)]
    if high is None:
        assert low is not None
        values = [low + (index + 1) * PRIORITY_GAP for index in range(count)]
        return values if values[-1] < PRIORITY_LIMIT else None
    if low is None:
        values = [high - (count - index) * PRIORITY_GAP for index in range(count)]
        return values if values[0] > -PRIORITY_LIMIT else None
    room = high - low - 1
    if room < count:
        return None
    step = (high - low) / (count + 1)
    return [low + int(step * (index + 1)) for index in range(count)]


def _renumber(order: Sequence[str], previous: Mapping[str, int]) -> dict[str, int]:
    fresh = {request_id: index * PRIORITY_GAP for index, request_id in enumerate(order)}
    return {request_id: value for request_id, value in fresh.items()
            if previous.get(request_id) != value}


def _already_ordered(keys: Sequence[tuple[int, float] | None]) -> set[int] | None:
    """Indices of every known key when the known keys already increase (the common
    case: the queue only lost its head or gained a tail); None otherwise. O(n)."""
    kept: set[int] = set()
    previous: tuple[int, float] | None = None
    for index, key in enumerate(keys):
        if key is None:
            continue
        if previous is not None and key <= previous:
            return None
        previous = key
        kept.add(index)
    return kept


def _longest_increasing(keys: Sequence[tuple[int, float] | None]) -> set[int]:
    """Indices of a longest strictly increasing subsequence of the non-None keys."""
    tails: list[tuple[int, float]] = []
    tail_index: list[int] = []
    parent: dict[int, int | None] = {}
    for index, key in enumerate(keys):
        if key is None:
            continue
        slot = bisect.bisect_left(tails, key)
        parent[index] = tail_index[slot - 1] if slot > 0 else None
        if slot == len(tails):
            tails.append(key)
            tail_index.append(index)
        else:
            tails[slot] = key
            tail_index[slot] = index
    chosen: set[int] = set()
    cursor: int | None = tail_index[-1] if tail_index else None
    while cursor is not None:
        chosen.add(cursor)
        cursor = parent[cursor]
    return chosen
