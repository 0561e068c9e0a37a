"""``python -m benchmarks.churn``, run as an engineer runs it: two real daemons fed the
same engines, each engine a new id that reports and leaves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_daemon_that_forgets_keeps_only_the_engines_of_the_last_seconds(
        tmp_path: Path) -> None:
    out = tmp_path / "churn.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.churn", "--engines", "8", "--reports", "120",
         "--forget-after-s", "0.3", "--every", "4", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["engines"] for row in rows] == [4, 8]
    last = rows[-1]
    # Each engine leaves what the daemon learned and counted of it behind once it has
    # gone (its step cost, 3 series, and its steps): the daemon that never forgets
    # holds all eight, the other the last few.
    assert last["keeps"]["engine_series"] == 8 * 4
    assert last["forgets"]["engine_series"] < last["keeps"]["engine_series"]
    assert "never forgetting keeps" in done.stdout


def test_bad_arguments_are_named() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.churn", "--forget-after-s", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--forget-after-s must be > 0" in done.stderr
