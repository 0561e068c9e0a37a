"""``python -m benchmarks.overhead.link_lag``, run as an engineer runs it: the real link
to a real daemon, a report every few ms from a thread busy in Python."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _link_lag(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "benchmarks.overhead.link_lag", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_every_report_sent_is_answered_and_timed() -> None:
    done = _link_lag("--rounds", "1", "--reports", "30", "--period-ms", "5",
                     "--intervals-ms", "0.1")
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = [line for line in done.stdout.splitlines() if line.startswith("0.1 ms")]
    sent, answered, p50, p90, p99, most = (float(v) for v in row.split()[2:])
    assert sent == 200 and 0 < answered <= sent * 1.05
    assert 0 < p50 <= p90 <= p99 <= most


def test_bad_arguments_are_named() -> None:
    done = _link_lag("--intervals-ms", "fast")
    assert done.returncode != 0 and "--intervals-ms" in done.stderr
    done = _link_lag("--period-ms", "0")
    assert done.returncode != 0 and "--period-ms" in done.stderr
