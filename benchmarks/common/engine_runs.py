"""A run of the engine benchmark (``python -m benchmarks.engine``) as its JSON records
it, read the same way by the engine benchmark's reports and by the twin that replays
the run (``python -m benchmarks.twin cpu --like RUN.json``)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from sidecar.telemetry.answer_lag import LATE_ANSWER_STEPS


def outside_vllm_s(run: dict[str, Any]) -> float | None:
    """A request's mean time outside vLLM: the client's time less vLLM's e2e."""
    client_s = run.get("client_request_mean_s")
    e2e_s = run.get("vllm_mean_s", {}).get("e2e")
    return None if client_s is None or e2e_s is None else client_s - e2e_s


def answers_by_lag(run: dict[str, Any]) -> dict[int, float]:
    """A run's ``answers_by_lag_steps`` keyed by steps late ({"lag": answers} in the
    JSON); empty where it was not recorded."""
    return {int(lag): answers
            for lag, answers in (run.get("answers_by_lag_steps") or {}).items()}


def median_answer_lag_steps(run: dict[str, Any]) -> int | None:
    """The median steps between a report and the application of its answer, from a
    run's ``answers_by_lag_steps`` ({lag: answers}); None where it was not recorded
    (runs before it was, or no answer applied)."""
    by_lag = sorted(answers_by_lag(run).items())
    total = sum(answers for _lag, answers in by_lag)
    if total <= 0:
        return None
    seen = 0.0
    for lag, answers in by_lag:
        seen += answers
        if seen >= total / 2:
            return lag
    return by_lag[-1][0]


def late_answer_share(run: dict[str, Any]) -> float | None:
    """The share of a run's answers applied ``LATE_ANSWER_STEPS`` (3) or more steps
    after their report: what adaptive's ``provisional_cache=auto`` reads over an
    engine's recent answers (caching from 0.1 up); None where not recorded."""
    by_lag = answers_by_lag(run)
    total = sum(by_lag.values())
    if total <= 0:
        return None
    return sum(answers for lag, answers in by_lag.items()
               if lag >= LATE_ANSWER_STEPS) / total


def saturated_at(policy: str) -> float:
    """The share at which ``policy`` (``name[@KEY=VALUE...]``) counts the engine as
    saturated: its ``saturated_prefill_share`` if the spec sets one, else the adaptive
    policy's default, so a baseline's rounds say what adaptive would have called them."""
    from sidecar.policies.adaptive.policy import AdaptiveParams

    for override in policy.split("@")[1:]:
        key, _, value = override.partition("=")
        if key == "saturated_prefill_share":
            return float(value)
    default = AdaptiveParams.model_fields["saturated_prefill_share"].default
    return float(default)


def summarize_prefill_share(samples: Sequence[float], threshold: float) -> dict[str, float] | None:
    """A round's samples of the share: their mean, median and maximum, and the fraction
    of them at or above ``threshold`` (``time_saturated``, the samples being evenly
    spaced). None where the round has no sample."""
    if not samples:
        return None
    return {"mean": statistics.mean(samples), "p50": statistics.median(samples),
            "max": max(samples), "saturated_at": threshold,
            "time_saturated": sum(share >= threshold for share in samples) / len(samples)}
