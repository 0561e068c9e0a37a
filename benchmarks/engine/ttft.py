"""Per-request waits on the real engine: each answer's queue time and time to first
token, as vLLM timed them (``--enable-per-request-metrics`` puts them in the answer),
and a round's summary of them. vLLM's clock runs from the request being queued in
the engine core, so the API server's and the client's share of the machine's cores
does not show in them: what is left is the order and admission a policy chose."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common.stats import percentile


def engine_timings_s(answer: Any) -> dict[str, float]:
    """A request's wait in vLLM's queue and for its first token, from the per-request
    metrics its answer carries (``--enable-per-request-metrics``): ``queue_s`` from
    being queued in the engine core to first scheduled, ``ttft_s`` from queued to the
    first token. Empty where the server sent none."""
    timings = (answer.model_extra or {}).get("metrics") or {}
    queue_ms, first_ms = timings.get("queue_time_ms"), timings.get("time_to_first_token_ms")
    if queue_ms is None or first_ms is None:
        return {}
    return {"queue_s": queue_ms / 1000, "ttft_s": (queue_ms + first_ms) / 1000}


def mean_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.mean(present) if present else None


def distribution(values: list[float | None]) -> dict[str, float] | None:
    """Mean, median, 95th and 99th percentiles (:func:`benchmarks.common.stats.
    percentile`) and maximum; None where a request lacks the figure (a server without
    per-request metrics)."""
    if not values or any(v is None for v in values):
        return None
    present = [v for v in values if v is not None]
    return {"avg": statistics.mean(present), "p50": percentile(present, 0.5),
            "p95": percentile(present, 0.95), "p99": percentile(present, 0.99),
            "max": max(present)}
