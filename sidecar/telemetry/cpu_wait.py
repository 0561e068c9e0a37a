"""How long the daemon's event-loop thread waited for a CPU: Linux's schedstat run delay.

Every decision runs on the event-loop thread. When the node's CPUs are saturated (vLLM's
CPU build keeps every core busy) that thread is often ready to run and not running: a
millisecond's sleep can overrun by hundreds of milliseconds, nearly all of it spent in
the kernel's run queue rather than on the thread's own work. The engine then applies
the daemon's answers many steps late. This counter shows that condition directly: its
rate is the fraction of time decisions are held up for a CPU.

``/proc/self/task/<tid>/schedstat`` holds three numbers: nanoseconds on a CPU,
nanoseconds waiting on a run queue, and time slices run. Kernels built without
``CONFIG_SCHED_INFO`` (and every other OS) lack the file; the metric is then absent.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import structlog
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

log = structlog.get_logger("kvtether.daemon")

NAME = "kvtether_event_loop_cpu_wait_seconds"
HELP = ("Seconds the daemon's event-loop thread was ready to run but waited for a CPU "
        "(Linux schedstat run delay). Rising while engines report: the node's CPUs are "
        "saturated and decisions land late; give the daemon a CPU request of its own.")


def run_delay_s(schedstat: Path) -> float:
    """The run-queue wait, in seconds, that a schedstat file reports."""
    fields = schedstat.read_text().split()
    if len(fields) < 2 or not fields[1].isdigit():
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

    def wait_s(self) -> float | None:
        """The watched thread's run-queue wait so far; None when none is watched or
        the thread has ended (a daemon stopping)."""
        if self._schedstat is None:
            return None
        try:
            return run_delay_s(self._schedstat)
        except (OSError, ValueError):
            return None

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(NAME, HELP)

    def collect(self) -> Iterator[CounterMetricFamily]:
        wait_s = self.wait_s()
        if wait_s is not None:
            yield CounterMetricFamily(NAME, HELP, value=wait_s)


class CpuWaitWatch:
    """Logs ``daemon_cpu_starved`` when the watched thread spent more than
    ``warn_share`` of the time since the last check waiting for a CPU, at most once
    every ``quiet_s``: an operator reading only the logs learns why answers land late.
    The daemon checks once a minute. The default ``warn_share``, 10%, is about twice
    the wait at which a daemon sharing busy cores with a CPU engine already applies a
    fifth of its answers 7 or more steps late (see docs/decisions/)."""

    def __init__(self, source: ThreadCpuWait, warn_share: float = 0.10,
                 quiet_s: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._source = source
        self._warn_share = warn_share
        self._quiet_s = quiet_s
        self._clock = clock
        self._last: tuple[float, float] | None = None  # (clock, wait) at the last check
        self._warned_at: float | None = None

    async def run(self, every_s: float = 60.0) -> None:
        """Check now (the first reading) and every ``every_s`` until cancelled."""
        self.check()
        while True:
            await asyncio.sleep(every_s)
            self.check()

    def check(self) -> float | None:
        """The share of the time since the last check spent waiting for a CPU (None on
        the first check, or with nothing to read); logs when it is over the threshold."""
        wait_s, now = self._source.wait_s(), self._clock()
        if wait_s is None:
            self._last = None
            return None
        last, self._last = self._last, (now, wait_s)
        if last is None or now <= last[0]:
            return None
        share = (wait_s - last[1]) / (now - last[0])
        quiet = self._warned_at is not None and now - self._warned_at < self._quiet_s
        if share > self._warn_share and not quiet:
            self._warned_at = now
            log.warning("daemon_cpu_starved", waited_share=round(share, 3),
                        over_s=round(now - last[0], 1),
                        detail="the daemon's event loop waited this share of the time for "
                               "a CPU, so engines apply its decisions late: give it a CPU "
                               "request (or cpu_shares) of its own; see "
                               "kvtether_event_loop_cpu_wait_seconds_total")
        return share
