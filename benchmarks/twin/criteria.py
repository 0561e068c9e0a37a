"""The adaptive policy's acceptance criteria, checked on sweep results.

For every point (KV blocks x jobs/s) of a sweep label:

- **avg**: adaptive's average job duration <= the best of fcfs, continuum and, where
  it was swept, llmd-ttl (llm-d's retention heuristic), within the noise band
  (``tolerance``; the seed-to-seed range of that ratio is printed where other seeds
  were swept);
- **tail**: adaptive's p95 job duration and maximum TTFT each <= 1.1x fcfs's;
- **8 jobs/s, 5,402 blocks**: fcfs's average / adaptive's >= 1.5.

    .venv/bin/python -m benchmarks.twin criteria reference-agree0.966 long-agree0.966

Reads each label's points from ``benchmarks/results/twin/points/`` (the sweep's folder or
its committed pack, see :mod:`benchmarks.twin.packs`); writes nothing unless ``--out``
names a Markdown file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.twin.packs import labels, read_points

TAIL_LIMIT = 1.10
SPEEDUP_POINT = (5402, 8)
SPEEDUP_TARGET = 1.5


@dataclass(frozen=True, slots=True)
class Point:
    blocks: int
    jps: int
    fcfs: dict
    continuum: dict
    adaptive: dict
    seed_ratios: tuple[float, ...]  # adaptive / best on other seeds
    llmd_ttl: dict | None = None  # None: not swept at this point

    @property
    def best_avg_s(self) -> float:
        return _best_avg_s(self.fcfs, self.continuum, self.llmd_ttl)

    @property
    def avg_ratio(self) -> float:
        return self.adaptive["avg_duration_s"] / self.best_avg_s

    @property
    def p95_ratio(self) -> float:
        return self.adaptive["p95_duration_s"] / self.fcfs["p95_duration_s"]

    @property
    def ttft_max_ratio(self) -> float:
        return self.adaptive["ttft_ms"]["max"] / max(self.fcfs["ttft_ms"]["max"], 1e-9)


def _best_avg_s(fcfs: dict, continuum: dict, llmd_ttl: dict | None) -> float:
    return min(run["avg_duration_s"] for run in (fcfs, continuum, llmd_ttl) if run is not None)


def _ratio(points: dict[str, dict], blocks: int, jps: int) -> float | None:
    runs = [points.get(f"blocks{blocks}/{policy}-{jps}jps")
            for policy in ("fcfs", "continuum", "adaptive", "llmd-ttl")]
    fcfs, continuum, adaptive, llmd_ttl = runs
    if fcfs is None or continuum is None or adaptive is None:
        return None
    return adaptive["avg_duration_s"] / _best_avg_s(fcfs, continuum, llmd_ttl)


def load_points(points_dir: Path, label: str) -> list[Point]:
    own = read_points(points_dir, label)
    seeds = [read_points(points_dir, seed) for seed in labels(points_dir, f"{label}-seed*")]
    points = []
    for key, adaptive in own.items():
        blocks_name, run = key.split("/")
        if not run.startswith("adaptive-"):
            continue
        blocks = int(blocks_name.removeprefix("blocks"))
        jps = int(run.removeprefix("adaptive-").removesuffix("jps"))
        fcfs = own.get(f"{blocks_name}/fcfs-{jps}jps")
        continuum = own.get(f"{blocks_name}/continuum-{jps}jps")
        if fcfs is None or continuum is None:
            continue
        seed_ratios = tuple(r for seed in seeds if (r := _ratio(seed, blocks, jps)) is not None)
        points.append(Point(blocks, jps, fcfs, continuum, adaptive, seed_ratios,
                            own.get(f"{blocks_name}/llmd-ttl-{jps}jps")))
    return sorted(points, key=lambda p: (p.blocks, p.jps))


def report(points_dir: Path, labels: Sequence[str], tolerance: float) -> tuple[str, bool]:
    lines = [f"Criteria: avg <= min(fcfs, continuum, llmd-ttl where swept) x "
             f"{1 + tolerance:g} (noise band); "
             f"p95 job and max TTFT <= {TAIL_LIMIT:g} x fcfs; fcfs / adaptive >= "
             f"{SPEEDUP_TARGET:g} at {SPEEDUP_POINT[1]} jobs/s, {SPEEDUP_POINT[0]} blocks.", ""]
    all_pass = True
    for label in labels:
        points = load_points(points_dir, label)
        lines += [f"## `{label}`", "",
                  "| blocks | jobs/s | fcfs | continuum | llmd-ttl | adaptive | vs best "
                  "| other seeds | p95 vs fcfs | max TTFT vs fcfs (s) | verdict |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        passed = 0
        for p in points:
            misses = []
            if p.avg_ratio > 1 + tolerance:
                misses.append("avg")
            if p.p95_ratio > TAIL_LIMIT:
                misses.append("p95")
            if p.ttft_max_ratio > TAIL_LIMIT:
                misses.append("TTFT")
            speedup = p.fcfs["avg_duration_s"] / p.adaptive["avg_duration_s"]
            if (p.blocks, p.jps) == SPEEDUP_POINT and speedup < SPEEDUP_TARGET:
                misses.append(f"x{speedup:.2f} < x{SPEEDUP_TARGET:g}")
            passed += not misses
            seeds = (", ".join(f"x{r:.3f}" for r in p.seed_ratios) if p.seed_ratios else "-")
            lines.append(
                f"| {p.blocks} | {p.jps} | {p.fcfs['avg_duration_s']:.2f} s "
                f"| {p.continuum['avg_duration_s']:.2f} s "
                f"| {_seconds(p.llmd_ttl)} | {p.adaptive['avg_duration_s']:.2f} s "
                f"| x{p.avg_ratio:.3f} | {seeds} | x{p.p95_ratio:.2f} "
                f"| x{p.ttft_max_ratio:.2f} ({p.adaptive['ttft_ms']['max'] / 1000:.1f} / "
                f"{p.fcfs['ttft_ms']['max'] / 1000:.1f}) "
                f"| {'pass' if not misses else 'miss: ' + ', '.join(misses)} |")
        all_pass = all_pass and passed == len(points) and bool(points)
        lines += ["", f"{passed} of {len(points)} points pass.", ""]
    return "\n".join(lines), all_pass


def _seconds(run: dict | None) -> str:
    """A run's average job, or a dash where the policy was not swept."""
    return f"{run['avg_duration_s']:.2f} s" if run is not None else "-"
