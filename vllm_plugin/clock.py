"""The engine side's one clock.

vLLM stamps a request's arrival with ``time.time()`` and the daemon decides on the
times the plugin reports, so every part of the plugin that reads the time reads this
clock: step timing, reports, the pin table's bounds, the provisional cache's bounds
and the retention pool's durations. They all hold the same :class:`EngineClock`, so
replacing its source (the twin runs the engine on a virtual clock from 0) reaches
every one of them at once; a part never holds a clock of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class EngineClock:
    """Seconds on the engine's clock: called like ``time.time``, which it reads
    unless :meth:`replace` gave it another source."""

    __slots__ = ("_source",)

    def __init__(self, source: Callable[[], float] = time.time) -> None:
        self._source = source

    def __call__(self) -> float:
        return self._source()

    def replace(self, source: Callable[[], float]) -> None:
        """Read ``source`` from now on, in every part holding this clock."""
        self._source = source
