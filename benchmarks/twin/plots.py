"""Sweep summary (Markdown + JSON) and plots: average job duration vs jobs/s per policy,
and improvement over FCFS, one panel per KV size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.common.results import describe_machine
from benchmarks.twin.packs import read_meta, read_points


def load_points(out_dir: Path, label: str) -> list[dict[str, Any]]:
    points = []
    for key, data in read_points(out_dir / "points", label).items():
        points.append({**data, "_blocks": int(key.split("/")[0].removeprefix("blocks"))})
    return points


def _table(points: list[dict[str, Any]]) -> dict[int, dict[str, dict[float, dict[str, Any]]]]:
    table: dict[int, dict[str, dict[float, dict[str, Any]]]] = {}
    for p in points:
        table.setdefault(p["_blocks"], {}).setdefault(p["policy"], {})[p["jps"]] = p
    return table


def improvement_pct(fcfs_avg_s: float, other_avg_s: float) -> float:
    """The reference plotter's speedup: (fcfs - other) / fcfs * 100."""
    return (fcfs_avg_s - other_avg_s) / fcfs_avg_s * 100.0


def write_summary(out_dir: Path, label: str) -> None:
    points = load_points(out_dir, label)
    meta = read_meta(out_dir / "points", label)
    table = _table(points)
    rows = []
    lines = [f"# Twin sweep `{label}`", ""]
    for run in meta.get("runs", []):
        lines += [f"- `{run['command']}`: kvtether {run['kvtether_git_rev']}, vLLM "
                  f"{run['vllm']}, Python {run['python']}; "
                  f"{describe_machine(run['machine'])}; {run['date_utc']}"]
    lines.append("")
    for blocks in sorted(table):
        policies = table[blocks]
        jps_all = sorted({j for per in policies.values() for j in per})
        lines += [f"## {blocks} KV blocks", "",
                  "| policy | " + " | ".join(f"{j:g} jps" for j in jps_all) + " |",
                  "|---|" + "---|" * len(jps_all)]
        for policy in sorted(policies):
            cells = []
            for j in jps_all:
                p = policies[policy].get(j)
                if p is None:
                    cells.append("")
                    continue
                cell = f"{p['avg_duration_s']:.2f} s"
                fcfs = policies.get("fcfs", {}).get(j)
                if fcfs is not None and policy != "fcfs":
                    ratio = p["avg_duration_s"] / fcfs["avg_duration_s"]
                    cell += f" (x{ratio:.2f})"
                cell += (f", hit {p['prefix_cache_hit_rate']:.2f}, "
                         f"pre {p['preemptions']}")
                cells.append(cell)
                rows.append({"blocks": blocks, "policy": policy, "jps": j,
                             **{k: p[k] for k in ("avg_duration_s", "median_duration_s",
                                                  "p90_duration_s", "p95_duration_s",
                                                  "prefix_cache_hit_rate", "preemptions",
                                                  "pinned_blocks_max", "num_jobs")},
                             "ttft_p95_ms": p["ttft_ms"]["p95"],
                             "ratio_vs_fcfs": None if fcfs is None else round(
                                 p["avg_duration_s"] / fcfs["avg_duration_s"], 4)})
            lines.append(f"| {policy} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["Cells: average job duration (ratio to fcfs), prefix-cache hit rate of prompt "
              "tokens, preemptions.", ""]
    (out_dir / "points" / label).mkdir(parents=True, exist_ok=True)
    (out_dir / "points" / label / "summary.md").write_text("\n".join(lines))
    (out_dir / "points" / label / "summary.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


# One look per policy in every plot; native (vLLM without kvtether) is drawn over fcfs.
STYLE: dict[str, dict[str, Any]] = {
    "fcfs": {"color": "tab:green", "marker": "o"},
    "native": {"color": "black", "marker": "x", "linestyle": "--", "linewidth": 1},
    "continuum": {"color": "tab:orange", "marker": "o"},
    "contextserve": {"color": "tab:blue", "marker": "s"},
    "adaptive": {"color": "tab:red", "marker": "D"},
    "llmd-ttl": {"color": "tab:purple", "marker": "^"},
}
ORDER = ("fcfs", "native", "continuum", "contextserve")


def _ordered(policies: Any) -> list[str]:
    return sorted(policies, key=lambda p: (ORDER.index(p) if p in ORDER else len(ORDER), p))


def plot_sweep(out_dir: Path, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = _table(load_points(out_dir, label))
    if not table:
        return
    sizes = sorted(table)
    fig, axes = plt.subplots(2, len(sizes), figsize=(4.2 * len(sizes), 7.5), squeeze=False)
    for column, blocks in enumerate(sizes):
        policies = table[blocks]
        top, bottom = axes[0][column], axes[1][column]
        for policy in _ordered(policies):
            style = STYLE.get(policy, {"marker": "o"})
            jps = sorted(policies[policy])
            top.plot(jps, [policies[policy][j]["avg_duration_s"] for j in jps], label=policy,
                     **style)
            fcfs = policies.get("fcfs", {})
            if policy != "fcfs" and fcfs:
                common = [j for j in jps if j in fcfs]
                bottom.plot(common, [improvement_pct(fcfs[j]["avg_duration_s"],
                                                     policies[policy][j]["avg_duration_s"])
                                     for j in common], label=policy, **style)
        top.set_title(f"{blocks} blocks x 16 tokens")
        top.set_xlabel("jobs/s")
        top.set_ylabel("average job duration (s)")
        top.set_yscale("log")
        top.grid(alpha=0.3)
        top.legend()
        bottom.axhline(0, color="grey", linewidth=0.8)
        bottom.set_xlabel("jobs/s")
        bottom.set_ylabel("improvement over fcfs (%)")
        bottom.grid(alpha=0.3)
        if bottom.lines[1:]:
            bottom.legend()
    fig.suptitle(f"kvtether twin: Llama-3.1-8B on RTX 5090 (modelled), workload {label}")
    fig.tight_layout()
    fig.savefig(out_dir / f"sweep-{label}.png", dpi=110)
    plt.close(fig)


def plot_timeseries(out_dir: Path, label: str, blocks: int, jps: float) -> Path | None:
    """Pinned blocks, KV usage and running requests over (virtual) time, per policy, at
    one point of a sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in load_points(out_dir, label) if p["_blocks"] == blocks
              and p["jps"] == jps]
    if not points:
        return None
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    by_policy = {p["policy"]: p for p in points}
    for p in (by_policy[name] for name in _ordered(by_policy)):
        style = {k: v for k, v in STYLE.get(p["policy"], {}).items()
                 if k in ("color", "linestyle")}
        columns = p["timeseries_columns"]
        series = list(zip(*p["timeseries"], strict=True))
        t = series[columns.index("t_s")]
        for axis, name in zip(axes, ("pinned_blocks", "kv_usage", "running"), strict=True):
            axis.plot(t, series[columns.index(name)], label=p["policy"], linewidth=1, **style)
    for axis, name in zip(axes, ("pinned blocks (distinct)", "KV usage (blocks held / total)",
                                 "running requests"), strict=True):
        axis.set_ylabel(name)
        axis.grid(alpha=0.3)
    axes[0].legend()
    axes[-1].set_xlabel("virtual time (s)")
    fig.suptitle(f"twin {label}: {jps:g} jobs/s, {blocks} blocks")
    fig.tight_layout()
    path = out_dir / f"timeseries-{label}-blocks{blocks}-{jps:g}jps.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
