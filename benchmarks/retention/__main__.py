"""Retention benchmark: protected sessions' prefix-cache hits and TTFT under an eviction
flood, with and without directives, side by side in one run.

    .venv/bin/python -m benchmarks.retention

Writes benchmarks/results/retention/retention_flood.json and retention_flood.png and
prints a table. See benchmarks/retention/flood.py for the workload and the modes, and
benchmarks/retention/pool_overhead.py for the block pool's own cost.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common.results import write_result

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "retention"



def _plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.retention.flood import MODES

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(results)
    for offset, result in enumerate(results):
        name = result["scenario"]["name"]
        xs = [i + offset * width for i in range(len(MODES))]
        axes[0].bar(xs, [100 * result["modes"][m]["hit_rate"] for m in MODES], width,
                    label=f"{name} flood")
        axes[1].bar(xs, [result["modes"][m]["ttft"]["ms_mean"] for m in MODES], width,
                    label=f"{name} flood")
    for axis, title in zip(axes, ("prefix-cache hit rate of protected turns (%)",
                                  "mean TTFT of protected turns (modelled ms)"), strict=True):
        axis.set_xticks([i + width * (len(results) - 1) / 2 for i in range(len(MODES))],
                        ["no directive", "vllm_xargs", "pushed (gRPC)"])
        axis.set_title(title, fontsize=10)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    # No options: parsing still answers --help and refuses what it does not know,
    # instead of running (and overwriting the committed results).
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from benchmarks.retention.flood import benchmark
    from benchmarks.retention.pool_overhead import measure
    from tests.support.daemon import running_daemon
    from tests.support.launch import tiny_model_dir

    model_dir = tiny_model_dir()
    # Deterministic: each step applies the answer to its own report (fail-closed waits for
    # it), as the in-process tests do; in production the answer lands one step later.
    os.environ["KVTETHER_PLUGIN_FAIL_MODE"] = "closed"
    os.environ["KVTETHER_PLUGIN_DEADLINE_MS"] = "500"
    started = time.monotonic()
    with running_daemon("--policy", "fcfs", "--log-level", "warning") as daemon:
        os.environ["KVTETHER_PLUGIN_DAEMON_ADDRESS"] = daemon.address
        results = list(benchmark(model_dir, daemon.address))
    overhead = measure()
    OUT.mkdir(parents=True, exist_ok=True)
    document = {
        "command": ".venv/bin/python -m benchmarks.retention",
        "wall_s": round(time.monotonic() - started, 1),
        "results": results,
        "pool_overhead": overhead,
    }
    write_result(OUT / "retention_flood.json", document)
    _plot(results, OUT / "retention_flood.png")
    header = (f"{'scenario':<9} {'mode':<7} {'hit rate':>8} {'turns hit':>9} {'system':>6} "
              f"{'TTFT steps':>10} {'TTFT ms':>8} {'p95 ms':>7} {'flood ms':>9} "
              f"{'makespan ms':>11}")
    print(header)
    for result in results:
        for mode, summary in result["modes"].items():
            print(f"{result['scenario']['name']:<9} {mode:<7} {summary['hit_rate']:>8.1%} "
                  f"{summary['turns_with_a_hit']:>9.0%} "
                  f"{summary['turns_hitting_the_system_prompt']:>6.0%} "
                  f"{summary['ttft']['steps_mean']:>10.2f} "
                  f"{summary['ttft']['ms_mean']:>8.1f} {summary['ttft']['ms_p95']:>7.1f} "
                  f"{summary['flood_ttft']['ms_mean']:>9.1f} "
                  f"{summary['modelled_makespan_ms']:>11.0f}")
    print("block pool, ns per request cycle:", overhead["ns_per_cycle"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
