"""How long the daemon's event-loop thread waited for a CPU: Linux's schedstat run delay.

Every decision runs on the event-loop thread. When the node's CPUs are saturated (vLLM's
CPU build keeps every core busy) that thread is often ready to run and not running: on
a 2-core VM serving the engine benchmark, its 1 ms sleeps overslept by up to 337 ms, and
the kernel's run-queue wait accounted for all of it (the thread's own CPU time during
those stalls was under 2 ms; benchmarks/results/engine/README.md). The engine then
applies the daemon's answers many steps late. This counter shows that condition
directly: its rate is the fraction of time decisions were held up for a CPU.

``/proc/self/task/<tid>/schedstat`` holds three numbers: nanoseconds on a CPU,
nanoseconds waiting on a run queue, and time slices run. Kernels built without
``CONFIG_SCHED_INFO`` (and every other OS) lack the file; the metric is then absent.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

NAME = "kvtether_event_loop_cpu_wait_seconds"
HELP = ("Seconds the daemon's event-loop thread was ready to run but waited for a CPU "
        "(Linux schedstat run delay). Rising while engines report: the node's CPUs are "
        "saturated and decisions land late; give the daemon a CPU request of its own.")


def run_delay_s(schedstat: Path) -> float:
    """The run-queue wait, in seconds, that a schedstat file reports."""
    fields = schedstat.read_text().split()
    if len(fields) < 2:
        raise ValueError(f"{schedstat}: expected 3 numbers, read {fields!r}")
    return int(fields[1]) / 1e9


class ThreadCpuWait(Collector):
    """Exports one thread's run-queue wait as a counter, read at scrape time (no cost
    to the thread itself). Nothing is exported until ``watch_current_thread``."""

    def __init__(self) -> None:
        self._schedstat: Path | None = None

    def watch_current_thread(self) -> bool:
        """Export the calling thread's wait; False where the kernel does not report it."""
        path = Path(f"/proc/self/task/{threading.get_native_id()}/schedstat")
        try:
            run_delay_s(path)
        except (OSError, ValueError):
            self._schedstat = None
            return False
        self._schedstat = path
        return True

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(NAME, HELP)

    def collect(self) -> Iterator[CounterMetricFamily]:
        if self._schedstat is None:
            return
        try:
            wait_s = run_delay_s(self._schedstat)
        except (OSError, ValueError):  # the thread ended (a daemon stopping)
            return
        yield CounterMetricFamily(NAME, HELP, value=wait_s)
