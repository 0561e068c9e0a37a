"""``python -m benchmarks.engine_attacks``, run as an engineer runs it, in miniature: a
real daemon, a steady engine stream, a health prober and the three attacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_measures_every_attack_of_one_run(tmp_path: Path) -> None:
    out = tmp_path / "engine_attacks.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine_attacks", "--phase-s", "1",
         "--running", "3000", "--pins", "100", "--waiting", "9000", "--refused-calls", "250",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    # Past the default limits: both snapshots of (b) and the one of (a) are refused.
    assert result["attacks"]["a"]["outcome"] == "RESOURCE_EXHAUSTED"
    assert result["attacks"]["b"]["outcome"] == "RESOURCE_EXHAUSTED, RESOURCE_EXHAUSTED"
    assert result["rate_before_per_s"] > 10 and result["rate_after_per_s"] > 0
    assert result["refused_flood"]["codes"] == {"INVALID_ARGUMENT": 50}
    assert "engine reports/s: before" in done.stdout


def test_bad_arguments_are_named() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.engine_attacks", "--phase-s", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--phase-s must be > 0" in done.stderr
