"""From the soak's raw samples to its figures: per-minute latency (client and daemon),
memory over time, Redis operations per report, and a plot."""

from __future__ import annotations

import itertools
import math
from array import array
from typing import Any

from benchmarks.common.stats import percentile

# Commands the soak's own monitoring sends to Redis: not the daemon's load.
MONITOR_COMMANDS = {"info", "memory|usage", "scan", "dbsize", "ping", "config|get",
                    "config|resetstat", "client|setinfo", "hello", "flushall"}


def histogram_quantile(q: float, before: dict[str, float], after: dict[str, float]
                       ) -> float | None:
    """Prometheus' histogram_quantile over the bucket deltas between two scrapes
    (linear within the bucket; the +Inf bucket answers its lower bound)."""
    bounds = sorted((float(le), after[le] - before.get(le, 0.0)) for le in after)
    total = bounds[-1][1] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in bounds:
        if count >= rank:
            if math.isinf(upper):
                return lower
            inside = count - below
            return lower + (upper - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = upper, count
    return lower


def _at(samples: list[dict[str, Any]], t_s: float) -> dict[str, Any]:
    """The last sample taken at or before ``t_s`` (the first one if none)."""
    chosen = samples[0]
    for sample in samples:
        if sample["t_s"] <= t_s + 1e-6:
            chosen = sample
        else:
            break
    return chosen


def engine_samples(results: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    sent_at: list[float] = []
    latency: list[float] = []
    for result in results:
        sent = array("d")
        sent.frombytes(result["sent_at"])
        lat = array("d")
        lat.frombytes(result["latency"])
        sent_at.extend(sent)
        latency.extend(lat)
    return sent_at, latency


def per_minute(results: list[dict[str, Any]], samples: list[dict[str, Any]],
               engines_start_s: float, duration_s: float) -> list[dict[str, Any]]:
    """One row per minute of the run. Client latency from the engines' own samples;
    the daemon's from its histogram; memory and Redis from the monitor's samples."""
    sent_at, latency = engine_samples(results)
    by_minute: dict[int, list[float]] = {}
    for at_s, seconds in zip(sent_at, latency, strict=True):
        by_minute.setdefault(int(at_s // 60), []).append(seconds)
    rows = []
    for minute in range(math.ceil(duration_s / 60 - 1e-9)):
        values = sorted(by_minute.get(minute, []))
        covered_s = min(60.0, duration_s - 60 * minute)
        start = _at(samples, engines_start_s + 60 * minute)
        end = _at(samples, engines_start_s + 60 * minute + covered_s)
        dt = max(1e-9, end["t_s"] - start["t_s"])
        row: dict[str, Any] = {
            "minute": minute + 1,
            "reports": len(values),
            "reports_per_s": len(values) / covered_s,
            "client_latency_ms_p50": _ms(percentile(values, 0.50) if values else None),
            "client_latency_ms_p99": _ms(percentile(values, 0.99) if values else None),
            "client_latency_ms_max": _ms(values[-1] if values else None),
            "daemon_rss_mib_end": end["daemon_rss_bytes"] / 2**20,
            "daemon_cpu_percent": 100 * (end["daemon_cpu_s"] - start["daemon_cpu_s"]) / dt,
            "loadavg_1m_end": end["loadavg"][0],
        }
        if "metrics" in start and "metrics" in end:
            before = start["metrics"]["decision_latency_buckets"]
            after = end["metrics"]["decision_latency_buckets"]
            row["daemon_decision_ms_p50"] = _ms(histogram_quantile(0.50, before, after))
            row["daemon_decision_ms_p99"] = _ms(histogram_quantile(0.99, before, after))
            decided = (end["metrics"].get("decision_latency_count", 0)
                       - start["metrics"].get("decision_latency_count", 0))
            spent = (end["metrics"].get("decision_latency_sum_s", 0)
                     - start["metrics"].get("decision_latency_sum_s", 0))
            row["daemon_decision_ms_mean"] = _ms(spent / decided if decided else None)
        if "redis" in start and "redis" in end:
            row["redis_ops_per_s"] = (daemon_commands(end["redis"]) -
                                      daemon_commands(start["redis"])) / dt
            row["redis_used_memory_mib_end"] = end["redis"]["used_memory"] / 2**20
            row["redis_keys_end"] = end["redis"]["keys"]
        rows.append(row)
    return rows


def daemon_commands(stats: dict[str, Any]) -> int:
    return sum(calls for name, calls in stats["commandstats"].items()
               if name not in MONITOR_COMMANDS)


def redis_ops_per_report(first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    """Redis commands the daemon sent per step report between two samples, by command."""
    reports = last["metrics"]["step_reports"] - first["metrics"]["step_reports"]
    before, after = first["redis"]["commandstats"], last["redis"]["commandstats"]
    by_command = {name: (calls - before.get(name, 0)) / reports
                  for name, calls in sorted(after.items())
                  if name not in MONITOR_COMMANDS and calls - before.get(name, 0) > 0}
    return {"reports": reports, "per_report": sum(by_command.values()),
            "by_command": by_command}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["per_minute"]
    samples = result["samples"]
    start = result["engines_start_s"]
    minutes = [row["minute"] for row in rows]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    latency, memory, redis_axis, load = axes.flat

    for key, label, style in (("client_latency_ms_p50", "client p50", "o-"),
                              ("client_latency_ms_p99", "client p99", "o--"),
                              ("daemon_decision_ms_p50", "daemon p50 (histogram)", "s-"),
                              ("daemon_decision_ms_p99", "daemon p99 (histogram)", "s--")):
        latency.plot(minutes, [row.get(key) for row in rows], style, label=label)
    latency.set_yscale("log")
    latency.set_xlabel("minute")
    latency.set_ylabel("ms")
    latency.set_title("decision latency per minute")
    latency.legend(fontsize=8)

    t_min = [(s["t_s"] - start) / 60 for s in samples]
    memory.plot(t_min, [s["daemon_rss_bytes"] / 2**20 for s in samples], label="daemon RSS")
    memory.plot(t_min, [s.get("redis", {}).get("used_memory", 0) / 2**20 for s in samples],
                label="Redis used_memory")
    memory.axvline(0, color="grey", linestyle=":")
    memory.set_xlabel("minute (engines start at 0)")
    memory.set_ylabel("MiB")
    memory.set_title("memory over time")
    memory.legend(fontsize=8)

    pairs = list(itertools.pairwise(samples))
    mids = [((a["t_s"] + b["t_s"]) / 2 - start) / 60 for a, b in pairs]
    redis_axis.plot(mids, [_rate(a, b, lambda s: daemon_commands(s["redis"]))
                           for a, b in pairs], label="Redis ops/s (daemon's)")
    redis_axis.plot(mids, [_rate(a, b, lambda s: s["metrics"]["step_reports"])
                           for a, b in pairs], label="step reports/s")
    redis_axis.set_xlabel("minute")
    redis_axis.set_title("throughput")
    redis_axis.legend(fontsize=8)

    load.plot(t_min, [s["loadavg"][0] for s in samples], label="load average (1 min)")
    load.plot(mids, [_rate(a, b, lambda s: s["daemon_cpu_s"]) for a, b in pairs],
              label="daemon CPU (cores)")
    load.set_xlabel("minute")
    load.set_title(f"machine: {result['machine']['cpus']} cores, shared")
    load.legend(fontsize=8)
    fig.suptitle(f"soak: {result['config']['engines']} engines x "
                 f"{result['config']['steps_per_s']:g} steps/s → one daemon → Redis, "
                 f"{result['config']['minutes']:g} min")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _rate(a: dict[str, Any], b: dict[str, Any], value: Any) -> float | None:
    try:
        return float((value(b) - value(a)) / max(1e-9, b["t_s"] - a["t_s"]))
    except KeyError:
        return None
