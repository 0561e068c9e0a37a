"""What ``adaptive`` remembers of an engine's recent past: the price of memory, and
the rate at which the engine admits requests.

The price of memory over the next seconds, forecast from its recent past.

A pin decided now holds its blocks for seconds; the price it pays is the price over
those seconds, not the one at the step it was decided. Where memory flickers between
idle and short — a small cache that fits a context or two, requests arriving every
few hundred milliseconds — the price at any one step is usually 0, and a pin valued
at it looks free until the next request arrives and waits on it. The best forecast
of the price over the next seconds is its recent average: an exponential average over
time, each step's price weighted by how long it lasted.

The admission rate sets the bound on waiting (policy.py, ``fair_share_s``): by Little's
law a queue of L requests that the engine admits at λ a second holds each for L / λ
seconds in arrival order, so that is the wait FCFS would give a request now.

The only state in ``adaptive``: per engine, three floats for the price; two floats and
the ids of the running requests for the rate. A daemon restart starts both at 0
(memory assumed idle, the rate unknown, until steps say otherwise).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass


@dataclass(slots=True)
class _Average:
    value: float  # the average up to at_s
    price: float  # the price from at_s on, until the next step
    at_s: float


class PriceForecast:
    """Per engine, the time-weighted exponential average of the price of memory,
    with a time constant of ``window_s`` (0: no memory, the current price only)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._engines: dict[str, _Average] = {}
        self._lock = threading.Lock()

    def update(self, engine_id: str, now_s: float, price: float) -> float:
        """Record the price seen at ``now_s``; answer the forecast for the seconds
        ahead: the larger of the current price and the recent average."""
        if self.window_s <= 0.0:
            return price
        with self._lock:
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


@dataclass(slots=True)
class _Rate:
    per_s: float  # the average rate up to at_s
    at_s: float
    running: frozenset[str]  # the running requests at at_s


class AdmissionRate:
    """Per engine, the requests admitted per second, averaged over time with a time
    constant of ``window_s``. A request is admitted when it first shows among the
    running ones, so steps the policy does not see (the plugin reports a stall once)
    lose no admission, and a step seen twice counts none twice."""

    def __init__(self, window_s: float) -> None:
        if not window_s > 0.0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = window_s
        self._engines: dict[str, _Rate] = {}
        self._lock = threading.Lock()

    def update(self, engine_id: str, now_s: float, running_ids: frozenset[str]) -> float:
        """Record the running requests seen at ``now_s``; answer the rate (1/s)."""
        with self._lock:
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
