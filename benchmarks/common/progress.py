"""Progress of a long benchmark, on stderr so that what it prints on stdout (JSON,
tables) stays clean: a tqdm bar on a terminal; elsewhere (a log file, CI, ``nohup``)
one line each time a round ends, since a bar's carriage returns would make one long
unreadable line there.

    with Progress("engine fcfs round 1/3", total=48, unit="turn") as progress:
        ...; progress.update(1)             # a unit of work (any thread)
        progress.round_done("avg job 12 s") # a round ended: a line, or a note above the bar
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import Any, TextIO


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def progress_line(label: str, done: float, total: float, unit: str, elapsed_s: float,
                  detail: str = "") -> str:
    """One round's line: ``soak: 3/10 min, 3.0 min elapsed, ~7 min left: 2400 reports/s``.
    The time left assumes the remaining units go at the pace of those done."""
    count = f"{round(done, 1):g}/{total:g} {unit if unit in ('s', 'min', 'h') else unit + 's'}"
    parts = [count, f"{_duration(elapsed_s)} elapsed"]
    if 0 < done < total:
        parts.append(f"~{_duration(elapsed_s * (total - done) / done)} left")
    return f"{label}: {', '.join(parts)}" + (f": {detail}" if detail else "")


class Progress:
    """``total`` units of work under ``label``; see the module's docstring. ``tty``
    forces the bar (True) or the lines (False); by default, whether ``stream`` is a
    terminal."""

    def __init__(self, label: str, total: float, unit: str, stream: TextIO | None = None,
                 tty: bool | None = None) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0.0
        self._started_s = time.monotonic()
        self._lock = threading.Lock()
        self._bar: Any = None
        if self.stream.isatty() if tty is None else tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=label, unit=unit, file=self.stream,
                             dynamic_ncols=True)

    def update(self, amount: float = 1.0) -> None:
        with self._lock:
            self.done += amount
            if self._bar is not None:
                self._bar.update(amount)

    def round_done(self, detail: str = "", advance: float = 0.0) -> None:
        """A round ended (after ``advance`` more units): its line, or on a terminal
        ``detail`` written above the bar."""
        with self._lock:
            self.done += advance
            if self._bar is not None:
                self._bar.update(advance)
                if detail:
                    self._bar.write(detail, file=self.stream)
                return
            line = progress_line(self.label, self.done, self.total, self.unit,
                                 time.monotonic() - self._started_s, detail)
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
