"""``python -m benchmarks.inspect_load``, run as an engineer runs it, in miniature: a real
daemon, engine streams holding pins, ListJobs polling and watchers that never read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_measures_both_phases_of_one_run(tmp_path: Path) -> None:
    out = tmp_path / "inspect_load.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.inspect_load", "--engines", "2",
         "--pins-per-engine", "50", "--phase-s", "1.5", "--rounds", "1", "--warmup-s", "1",
         "--watchers", "4", "--client-processes", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    for phase in ("quiet", "inspected"):
        assert result[phase]["reports"] > 10 and result[phase]["p99_ms"] > 0
    assert result["list_jobs"]["calls"] >= 3 and result["list_jobs"]["errors"] == 0
    assert result["list_jobs"]["jobs_per_page"] >= 100  # two engines, fifty pinned jobs each
    assert "inspected / quiet p99" in done.stdout


def test_bad_arguments_are_named() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.inspect_load", "--phase-s", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--phase-s must be > 0" in done.stderr
