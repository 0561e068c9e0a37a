"""A run's figures, in the reference benchmark's JSON schema plus the twin's extras.

Reference fields (``ab_benchmark.py``'s output): ``policy``, ``jps``,
``avg_duration_s``, ``median_duration_s``, ``p90_duration_s``, ``p95_duration_s``,
``per_turn_avg_latency_ms``, ``per_turn_avg_prompt_tokens``, ``job_durations``.
A job's duration is its last answer's time minus its arrival (tool times included); a
turn's latency is its answer's time minus the turn's arrival. Percentiles interpolate
linearly (numpy's default).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.common.stats import percentile
from benchmarks.twin.simulator import SimResult

# TTFT histogram bucket upper edges (ms); the last bucket is open.
TTFT_BUCKETS_MS = (50, 100, 200, 500, 1000, 2000, 5000, 10_000, 30_000, 100_000)


def histogram(values: Sequence[float], edges: Sequence[float]) -> dict[str, int]:
    """Counts per bucket, keyed "<=edge" and ">last" (empty buckets kept: a fixed shape)."""
    counts = {f"<={edge:g}": 0 for edge in edges}
    counts[f">{edges[-1]:g}"] = 0
    for value in values:
        for edge in edges:
            if value <= edge:
                counts[f"<={edge:g}"] += 1
                break
        else:
            counts[f">{edges[-1]:g}"] += 1
    return counts


def _r(value: float, digits: int = 3) -> float:
    return round(value, digits)


def summarize(result: SimResult, policy: str, jobs_per_s: float) -> dict[str, Any]:
    durations = [finish - arrival for arrival, finish in
                 zip(result.job_arrival_s, result.job_finish_s, strict=True)
                 if finish is not None]
    turns = list(result.turns.values())
    by_turn: dict[int, list[Any]] = {}
    for record in turns:
        by_turn.setdefault(record.turn, []).append(record)
    done = [t for t in turns if t.finish_s is not None]
    ttft_ms = [1000 * (t.first_token_s - t.arrival_s) for t in done
               if t.first_token_s is not None]
    prompt_total = sum(t.prompt_tokens for t in turns)
    cached_total = sum(t.cached_tokens or 0 for t in turns)
    samples = result.samples
    out: dict[str, Any] = {
        "policy": policy,
        "jps": jobs_per_s,
        "avg_duration_s": _r(statistics.fmean(durations)) if durations else None,
        "median_duration_s": _r(statistics.median(durations)) if durations else None,
        "p90_duration_s": _r(percentile(durations, 0.9)),
        "p95_duration_s": _r(percentile(durations, 0.95)),
        "per_turn_avg_latency_ms": {
            str(k): round(statistics.fmean(1000 * (t.finish_s - t.arrival_s)
                                           for t in records if t.finish_s is not None))
            for k, records in sorted(by_turn.items())},
        "per_turn_avg_prompt_tokens": {
            str(k): round(statistics.fmean(t.prompt_tokens for t in records))
            for k, records in sorted(by_turn.items())},
        "job_durations": [_r(d) for d in durations],
        # --- the twin's extras ---
        "num_jobs": len(result.job_arrival_s),
        "completed_jobs": len(durations),
        "p99_duration_s": _r(percentile(durations, 0.99)),
        "max_duration_s": _r(max(durations)) if durations else None,
        "prefix_cache_hit_rate": _r(cached_total / prompt_total, 4) if prompt_total else None,
        "per_turn_prefix_cache_hit_rate": {
            str(k): _r(sum(t.cached_tokens or 0 for t in records)
                       / sum(t.prompt_tokens for t in records), 4)
            for k, records in sorted(by_turn.items())},
        "recomputed_prompt_tokens": prompt_total - cached_total,
        "preemptions": result.preemptions,
        "preempted_requests": sum(1 for t in turns if t.preemptions),
        "ttft_ms": {
            "avg": round(statistics.fmean(ttft_ms)) if ttft_ms else None,
            "p50": round(percentile(ttft_ms, 0.5)),
            "p90": round(percentile(ttft_ms, 0.9)),
            "p95": round(percentile(ttft_ms, 0.95)),
            "p99": round(percentile(ttft_ms, 0.99)),
            "max": round(max(ttft_ms)) if ttft_ms else None,
        },
        "ttft_ms_histogram": histogram(ttft_ms, TTFT_BUCKETS_MS),
        "per_turn_avg_ttft_ms": {
            str(k): round(statistics.fmean(1000 * (t.first_token_s - t.arrival_s)
                                           for t in records if t.first_token_s is not None))
            for k, records in sorted(by_turn.items())},
        "kv_usage_avg": _r(statistics.fmean(s.kv_usage for s in samples), 4)
        if samples else None,
        "jobs_in_flight_avg": _r(statistics.fmean(s.jobs_in_flight for s in samples), 1)
        if samples else None,
        "jobs_in_flight_max": max((s.jobs_in_flight for s in samples), default=0),
        "pinned_blocks_avg": _r(statistics.fmean(s.pinned_blocks for s in samples), 1)
        if samples else None,
        "pinned_blocks_max": max((s.pinned_blocks for s in samples), default=0),
        # Of those, the blocks finished turns held awaiting the daemon's word on a pin.
        "provisional_blocks_avg": _r(result.provisional_block_s / result.end_s, 2)
        if result.end_s > 0 else None,
        "engine": {
            "steps": result.steps,
            "idle_steps": result.idle_steps,
            "busy_s": _r(result.busy_s),
            "end_s": _r(result.end_s),
            "prefill_tokens": result.prefill_tokens,
            "decode_tokens": result.decode_tokens,
            "pins_at_end": result.pins_at_end,
            "leaked_blocks": result.leaked_blocks,
            "plugin_counters": result.plugin_counters,
            "answers_by_lag_steps": result.answers_by_lag_steps,
        },
        # Every 0.5 s of virtual time: [t_s, running, waiting, pinned_blocks, pins,
        # free_blocks, kv_usage, jobs_in_flight].
        "timeseries_columns": ["t_s", "running", "waiting", "pinned_blocks", "pins",
                               "free_blocks", "kv_usage", "jobs_in_flight"],
        "timeseries": [[s.t_s, s.running, s.waiting, s.pinned_blocks, s.pins,
                        s.free_blocks, s.kv_usage, s.jobs_in_flight] for s in samples],
    }
    return out
