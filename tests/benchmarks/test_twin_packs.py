"""A twin sweep reads the same from the folder a sweep writes and from the pack git keeps."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from benchmarks.twin.criteria import load_points, report
from benchmarks.twin.packs import labels, pack_path, read_meta, read_points, write_pack

COMMITTED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "twin"


def _run(avg_s: float) -> dict[str, object]:
    return {"avg_duration_s": avg_s, "p95_duration_s": avg_s * 2, "ttft_ms": {"max": 100.0}}


def _sweep(points_dir: Path, label: str, adaptive_avg_s: float) -> None:
    folder = points_dir / label
    for policy, avg_s in (("fcfs", 10.0), ("continuum", 8.0), ("adaptive", adaptive_avg_s)):
        path = folder / "blocks3000" / f"{policy}-8jps.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_run(avg_s)))
    (folder / "meta.json").write_text(json.dumps({"label": label, "runs": []}))


def test_a_packed_sweep_reads_as_its_folder_did(tmp_path: Path) -> None:
    _sweep(tmp_path, "w", adaptive_avg_s=6.0)
    _sweep(tmp_path, "w-seed1", adaptive_avg_s=9.0)
    from_folders = load_points(tmp_path, "w")
    for label in ("w", "w-seed1"):
        write_pack(tmp_path, label)
        shutil.rmtree(tmp_path / label)
    assert pack_path(tmp_path, "w").exists()
    assert labels(tmp_path, "w-seed*") == ["w-seed1"]
    assert load_points(tmp_path, "w") == from_folders
    [point] = from_folders
    assert (point.blocks, point.jps, point.avg_ratio) == (3000, 8, 0.75)
    assert point.seed_ratios == (9.0 / 8.0,)
    assert read_meta(tmp_path, "w") == {"label": "w", "runs": []}


def test_a_folder_wins_over_its_pack(tmp_path: Path) -> None:
    _sweep(tmp_path, "w", adaptive_avg_s=6.0)
    write_pack(tmp_path, "w")
    _sweep(tmp_path, "w", adaptive_avg_s=7.0)  # a newer sweep into the same label
    assert read_points(tmp_path, "w")["blocks3000/adaptive-8jps"]["avg_duration_s"] == 7.0


def test_the_committed_criteria_are_what_the_committed_packs_give() -> None:
    text, _ = report(COMMITTED / "points",
                     ["reference-agree0.966", "long-agree0.966", "reference"], tolerance=0.02)
    committed = (COMMITTED / "criteria.md").read_text()
    assert [line.rstrip() for line in text.strip().splitlines()] == \
        [line.rstrip() for line in committed.strip().splitlines()]
