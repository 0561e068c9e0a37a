"""The engines' own cumulative counts, exported per engine as Prometheus counters and a
histogram.

An engine counts over its plugin's life (``EngineCounters`` in every step report) and
the daemon exports the totals it last received, read at scrape time. A restarted engine
counts from 0 again under the same engine id: a counter reset, which ``rate()`` and
``increase()`` account for (``delta()`` on the same values reads the drop as negative
work). A restarted daemon exports the totals its engines report next, which carry on
from those before it. An engine's series go when its session ends.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


@dataclass(frozen=True, slots=True)
class EngineTotals:
    """One engine's counts since its plugin started, as its last report carried them."""

    fallback_steps: int
    idle_waits: int
    idle_waits_missed: int
    provisional_block_seconds: float
    # Answers applied k steps after their report, at index k; the last index counts
    # that many steps or more.
    answers_by_lag_steps: tuple[int, ...]
    # KV hint actions (vLLM's Request.kv_hints) the engine did not read.
    kv_hint_actions_ignored: int = 0
    # Fields refused in KV hint actions the engine otherwise read.
    kv_hint_fields_refused: int = 0


FALLBACK_STEPS = "kvtether_engine_fallback_steps"
IDLE_WAITS = "kvtether_engine_idle_waits"
IDLE_WAITS_MISSED = "kvtether_engine_idle_waits_missed"
PROVISIONAL_BLOCK_SECONDS = "kvtether_engine_provisional_block_seconds"
ANSWER_LAG = "kvtether_engine_answer_lag_steps"
KV_HINT_ACTIONS_IGNORED = "kvtether_engine_kv_hint_actions_ignored"
KV_HINT_FIELDS_REFUSED = "kvtether_engine_kv_hint_fields_refused"

_HELP = {
    FALLBACK_STEPS: "Steps the engine scheduled natively because no fresh decision came "
                    "(engine-reported).",
    IDLE_WAITS: "Times the engine, going idle, waited for the daemon's answer to its last "
                "report (up to the deadline; engine-reported): those answers applied 0 "
                "steps late.",
    IDLE_WAITS_MISSED: "Of the engine's idle waits for the daemon's answer, those that ran "
                       "out before it came (engine-reported): the daemon slower than the "
                       "deadline.",
    PROVISIONAL_BLOCK_SECONDS: "KV block-seconds the engine held finished requests' blocks "
                               "awaiting the daemon's word on a pin (engine-reported): the "
                               "memory the answer lag costs.",
    KV_HINT_ACTIONS_IGNORED: "KV hint actions (vLLM's Request.kv_hints) the engine ignored: "
                             "of a type or version kvtether does not read, or malformed "
                             "(engine-reported).",
    KV_HINT_FIELDS_REFUSED: "Fields of KV hint actions the engine read but refused, one per "
                            "field and action: NVIDIA Dynamo's block_hashes, blocks named by "
                            "hash that kvtether does not look up (engine-reported).",
    ANSWER_LAG: "Decisions the engine applied, by steps between its report and their "
                "application (le 1.0: by the next step, as designed; the top bucket is open; "
                "engine-reported; no _sum, the top bucket's lags are not known).",
}


def lag_buckets(answers_by_lag_steps: Sequence[int]) -> list[tuple[str, float]]:
    """Prometheus' cumulative ``le`` buckets of per-lag counts whose last entry counts
    that lag or more: ``[3, 5, 1]`` -> ``[("0.0", 3), ("1.0", 8), ("+Inf", 9)]``.
    Bounds are written as Prometheus writes floats, so ``le="1.0"`` selects the same
    series whichever Prometheus version stored it."""
    buckets: list[tuple[str, float]] = []
    total = 0
    for lag, answers in enumerate(answers_by_lag_steps):
        total += answers
        last = lag == len(answers_by_lag_steps) - 1
        bound = "+Inf" if last else floatToGoString(lag)  # type: ignore[no-untyped-call]
        buckets.append((bound, float(total)))
    return buckets


class EngineCounterCollector(Collector):
    """The latest totals of each engine with an open session. ``update`` and ``remove``
    run on the event loop, ``collect`` on the scrape thread: each engine's totals are
    replaced whole, never changed in place, so a scrape reads one report's figures."""

    def __init__(self) -> None:
        self._totals: dict[str, EngineTotals] = {}

    def update(self, engine_id: str, totals: EngineTotals) -> None:
        self._totals[engine_id] = totals

    def remove(self, engine_id: str) -> None:
        self._totals.pop(engine_id, None)

    def engines(self) -> list[str]:
        return list(self._totals)

    def describe(self) -> Iterator[Metric]:
        return self._families({})

    def collect(self) -> Iterator[Metric]:
        return self._families(dict(self._totals))

    def _families(self, totals: dict[str, EngineTotals]) -> Iterator[Metric]:
        counters = {name: CounterMetricFamily(name, _HELP[name], labels=["engine_id"])
                    for name in (FALLBACK_STEPS, IDLE_WAITS, IDLE_WAITS_MISSED,
                                 PROVISIONAL_BLOCK_SECONDS, KV_HINT_ACTIONS_IGNORED,
                                 KV_HINT_FIELDS_REFUSED)}
        lags = HistogramMetricFamily(ANSWER_LAG, _HELP[ANSWER_LAG], labels=["engine_id"])
        for engine_id, engine in sorted(totals.items()):
            counters[FALLBACK_STEPS].add_metric([engine_id], engine.fallback_steps)
            counters[IDLE_WAITS].add_metric([engine_id], engine.idle_waits)
            counters[IDLE_WAITS_MISSED].add_metric([engine_id], engine.idle_waits_missed)
            counters[PROVISIONAL_BLOCK_SECONDS].add_metric(
                [engine_id], engine.provisional_block_seconds)
            counters[KV_HINT_ACTIONS_IGNORED].add_metric([engine_id],
                                                         engine.kv_hint_actions_ignored)
            counters[KV_HINT_FIELDS_REFUSED].add_metric([engine_id],
                                                        engine.kv_hint_fields_refused)
            if engine.answers_by_lag_steps:
                buckets = lag_buckets(engine.answers_by_lag_steps)
                # No _sum: add_metric writes _count only with one.
                lags.add_metric([engine_id], buckets, sum_value=None)
                lags.add_sample(f"{ANSWER_LAG}_count", {"engine_id": engine_id}, buckets[-1][1])
        yield from counters.values()
        yield lags
