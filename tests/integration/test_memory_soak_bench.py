"""``python -m benchmarks.memory_soak``, run as an engineer runs it, for seconds: one real
daemon, engines that leave with live requests, one-request jobs, RSS sampled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_soak_samples_rss_and_gives_a_verdict(tmp_path: Path) -> None:
    out = tmp_path / "memory_soak.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory_soak", "--duration-s", "6", "--cycle-s", "2",
         "--warmup-s", "2", "--jobs", "600", "--live-requests", "30",
         "--sample-every-s", "0.5", "--max-jobs-tracked", "50", "--max-histories", "200",
         "--forget-after-s", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["engines"] == 3 * 5 and result["one_request_jobs"] == 600
    assert result["settings"]["embedded_max_histories"] == 200
    summary = result["summary"]
    assert summary["max_rss_mib"] >= summary["end_rss_mib"] > 0
    assert isinstance(summary["flat"], bool)
    assert len(result["samples"]) >= 6
    assert "at the end of the 2 s warm-up" in done.stdout


def test_bad_arguments_are_named() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.memory_soak", "--warmup-s", "9",
                           "--duration-s", "5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--warmup-s must be in [0, --duration-s)" in done.stderr
