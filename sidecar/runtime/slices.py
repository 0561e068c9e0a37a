"""A report's work in bounded slices, so that one large report never holds the event loop.

The work of one report is written as a generator that yields after every
:data:`SLICE_ITEMS` items it handled (:func:`chunks`); :func:`run_async` gives the event
loop back at each yield (health checks, other engines' reports and Inspect answer in
between), :func:`run` does all of it at once (tests, callers off the loop).

Contract: between two yields the work touches only the state of the report's own
engine, and the caller holds that engine's lock across the whole run, so that no other
report of that engine sees a half-applied one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")
# Items (requests, pins, events, decisions) handled between two yields: about 2-5 ms of
# the event loop on a slow core, far below a health check's timeout.
SLICE_ITEMS = 1000

Steps = Generator[None, None, T]


def chunks(items: Sequence[T], size: int = SLICE_ITEMS) -> Iterator[Sequence[T]]:
    """``items`` in slices of ``size``; the caller yields after each."""
    for start in range(0, len(items), size):
        yield items[start:start + size]


def run(steps: Steps[T]) -> T:
    """All of the work at once; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


async def run_async(steps: Steps[T]) -> T:
    """The work, giving the event loop back between slices; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        await asyncio.sleep(0)


class Stopwatch:
    """The time a sliced piece of work spends, less the time it gives away at its yields."""

    def __init__(self) -> None:
        self._spent_ns = 0
        self._since_ns = time.perf_counter_ns()

    def steps(self, steps: Steps[T]) -> Steps[T]:
        """``steps`` as they are, timed: what runs between its yields counts."""
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            self._spent_ns += time.perf_counter_ns() - self._since_ns
            yield
            self._since_ns = time.perf_counter_ns()

    def spent_ns(self) -> int:
        return self._spent_ns + time.perf_counter_ns() - self._since_ns
