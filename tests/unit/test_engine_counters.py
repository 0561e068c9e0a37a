"""The engines' cumulative counts as Prometheus reads them: counters that go down only
when an engine restarts, and the answer-lag histogram's cumulative buckets."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.server.grpc_metrics import split_method
from sidecar.telemetry.engine_counters import EngineCounterCollector, EngineTotals, lag_buckets


def totals(fallback_steps: int, lags: tuple[int, ...] = (0, 3, 1)) -> EngineTotals:
    return EngineTotals(fallback_steps=fallback_steps, idle_waits=2, idle_waits_missed=1,
                        provisional_block_seconds=0.5, answers_by_lag_steps=lags)


def exposed(collector: EngineCounterCollector) -> dict[tuple[str, str], tuple[str, float]]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {(sample.name, sample.labels.get("le", "")): (family.type, sample.value)
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.labels.get("engine_id") == "pod-a"}


def test_the_last_lag_bucket_is_open_and_bounds_are_written_as_floats() -> None:
    assert lag_buckets([3, 5, 1]) == [("0.0", 3.0), ("1.0", 8.0), ("+Inf", 9.0)]
    assert lag_buckets([4]) == [("+Inf", 4.0)]


def test_an_engine_is_exported_as_its_last_report_counted_and_goes_with_its_session() -> None:
    collector = EngineCounterCollector()
    collector.update("pod-a", totals(40))
    before = exposed(collector)
    assert before[("kvtether_engine_fallback_steps_total", "")] == ("counter", 40)
    assert before[("kvtether_engine_answer_lag_steps_bucket", "1.0")] == ("histogram", 3)
    assert before[("kvtether_engine_answer_lag_steps_count", "")] == ("histogram", 4)
    # The plugin restarted: it counts from 0, and so does the exported counter.
    collector.update("pod-a", totals(2, (0, 1, 0)))
    assert exposed(collector)[("kvtether_engine_fallback_steps_total", "")] == ("counter", 2)
    collector.remove("pod-a")
    assert exposed(collector) == {}


def test_grpc_methods_are_split_into_service_and_method() -> None:
    assert split_method("/kvtether.v1.EngineSession/Session") == (
        "kvtether.v1.EngineSession", "Session")
    assert split_method("/grpc.health.v1.Health/Check") == ("grpc.health.v1.Health", "Check")
    assert split_method("nonsense") == ("unknown", "nonsense")
