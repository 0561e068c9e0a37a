"""What a Prometheus server scraping a live daemon gets: what accumulates is a counter or
a histogram (so rate() and increase() apply and an engine restart reads as a counter
reset), the standard process_* and python_* series, and the gRPC server's calls by
method and status code, one per call however many messages a stream carries."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import (
    engine_session_pb2_grpc,
    inspect_pb2,
    inspect_pb2_grpc,
    retention_pb2,
    retention_pb2_grpc,
)
from tests.support.daemon import running_daemon

KV = pb.KvCapacity(total_blocks=100, free_blocks=50, block_size_tokens=16)
SESSION = ("bidi_stream", "kvtether.v1.EngineSession", "Session")
STEP = ("unary", "kvtether.v1.EngineSession", "Step")
WATCH = ("server_stream", "kvtether.v1.Inspect", "WatchDecisions")
# The engines' cumulative counts, and the type each is exported as.
CUMULATIVE = {"kvtether_engine_fallback_steps": "counter",
              "kvtether_engine_idle_waits": "counter",
              "kvtether_engine_idle_waits_missed": "counter",
              "kvtether_engine_provisional_block_seconds": "counter",
              "kvtether_engine_answer_lag_steps": "histogram",
              "kvtether_engine_steps": "counter",
              "kvtether_pins_unreturned": "counter"}


def scrape_all(port: int) -> dict[str, Metric]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict[str, Metric], sample_name: str, **labels: str) -> float | None:
    for family in families.values():
        for sample in family.samples:
            if sample.name == sample_name and sample.labels == labels:
                return sample.value
    return None


def grpc_labels(call: tuple[str, str, str]) -> dict[str, str]:
    return dict(zip(("grpc_type", "grpc_service", "grpc_method"), call, strict=True))


def reports(counters: list[pb.EngineCounters], may_end: threading.Event
            ) -> Iterator[pb.StepReport]:
    """An engine's session: a report for each of ``counters``, then open until
    ``may_end`` (the daemon drops an engine's series when its session ends)."""
    for seq, engine_counters in enumerate(counters, start=1):
        yield pb.StepReport(engine_id="pod-a", seq=seq, snapshot=seq == 1, now_s=float(seq),
                            kv=KV, counters=engine_counters,
                            work=pb.StepWork(steps=2, busy_s=0.01, decode_seqs=2))
    may_end.wait(10)


def test_a_scrape_reads_counters_histograms_standard_and_grpc_series() -> None:
    with running_daemon("--policy", "fcfs") as daemon:
        channel = daemon.channel()
        engine = engine_session_pb2_grpc.EngineSessionStub(channel)
        # An engine's session: three reports on one stream, the counts growing.
        may_end = threading.Event()
        answers = engine.Session(reports([
            pb.EngineCounters(fallback_steps=2, idle_waits=4, idle_waits_missed=1,
                              provisional_block_seconds=1.5,
                              answers_by_lag_steps=[1, 5, 0, 0, 0, 0, 0, 0]),
            pb.EngineCounters(fallback_steps=3, idle_waits=5, idle_waits_missed=1,
                              provisional_block_seconds=2.0,
                              answers_by_lag_steps=[1, 6, 1, 0, 0, 0, 0, 0]),
            pb.EngineCounters(fallback_steps=3, idle_waits=6, idle_waits_missed=2,
                              provisional_block_seconds=2.5,
                              answers_by_lag_steps=[2, 6, 1, 0, 0, 0, 0, 3])], may_end))
        assert [next(answers).seq for _ in range(3)] == [1, 2, 3]
        engine_series = scrape_all(daemon.metrics_port)
        may_end.set()
        assert list(answers) == []
        # A refused call, and a watcher that hangs up.
        with pytest.raises(grpc.RpcError) as refused:
            engine.Step(pb.StepReport(seq=1, snapshot=True, now_s=1.0, kv=KV))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        watch = inspect_pb2_grpc.InspectStub(channel).WatchDecisions(
            inspect_pb2.WatchDecisionsRequest())
        time.sleep(0.3)
        watch.cancel()

        deadline = time.monotonic() + 5
        while True:
            families = scrape_all(daemon.metrics_port)
            if value(families, "grpc_server_handled_total", **grpc_labels(WATCH),
                     grpc_code="CANCELLED") or time.monotonic() > deadline:
                break
            time.sleep(0.05)

    for name, kind in CUMULATIVE.items():
        assert families[name].type == kind, name
    families, ended = engine_series, families
    engine_id = {"engine_id": "pod-a"}
    assert value(families, "kvtether_engine_fallback_steps_total", **engine_id) == 3
    assert value(families, "kvtether_engine_idle_waits_total", **engine_id) == 6
    assert value(families, "kvtether_engine_idle_waits_missed_total", **engine_id) == 2
    assert value(families, "kvtether_engine_provisional_block_seconds_total",
                 **engine_id) == 2.5
    assert value(families, "kvtether_engine_steps_total", **engine_id) == 6
    # Answers by lag [2, 6, 1, 0, 0, 0, 0, 3] as cumulative buckets, the last open.
    lags = "kvtether_engine_answer_lag_steps"
    assert [value(families, f"{lags}_bucket", engine_id="pod-a", le=le)
            for le in ("0.0", "1.0", "2.0", "6.0", "+Inf")] == [2, 8, 9, 9, 12]
    assert value(families, f"{lags}_count", **engine_id) == 12

    # The standard series of every Prometheus client.
    assert families["process_cpu_seconds"].type == "counter"
    assert value(families, "process_resident_memory_bytes") > 0  # type: ignore[operator]
    assert value(families, "process_start_time_seconds") > 0  # type: ignore[operator]
    assert families["python_gc_collections"].type == "counter"
    assert families["python_info"].samples

    # One call per stream, with the code it ended with; the refused one too.
    assert value(families, "grpc_server_started_total", **grpc_labels(SESSION)) == 1
    assert value(families, "grpc_server_handled_total", **grpc_labels(SESSION),
                 grpc_code="OK") is None, "not handled while open"
    families = ended
    assert value(families, "grpc_server_started_total", **grpc_labels(SESSION)) == 1
    assert value(families, "grpc_server_handled_total", **grpc_labels(SESSION),
                 grpc_code="OK") == 1
    assert value(families, "grpc_server_handling_seconds_count", **grpc_labels(SESSION)) == 1
    assert value(families, "grpc_server_handled_total", **grpc_labels(STEP),
                 grpc_code="INVALID_ARGUMENT") == 1
    assert value(families, "grpc_server_handled_total", **grpc_labels(WATCH),
                 grpc_code="CANCELLED") == 1
    assert families["grpc_server_handling_seconds"].type == "histogram"


def test_an_engine_that_restarts_reads_as_a_counter_reset() -> None:
    """A restarted plugin counts from 0 under the same engine id: the exported counter
    goes down, which Prometheus' increase() takes as a reset (see
    deploy/prometheus/tests/)."""
    with running_daemon("--policy", "fcfs") as daemon:
        engine = engine_session_pb2_grpc.EngineSessionStub(daemon.channel())
        read = []
        for fallback_steps in (40, 3):
            may_end = threading.Event()
            answers = engine.Session(reports([pb.EngineCounters(
                fallback_steps=fallback_steps)], may_end))
            next(answers)
            read.append(value(scrape_all(daemon.metrics_port),
                              "kvtether_engine_fallback_steps_total", engine_id="pod-a"))
            may_end.set()
            assert list(answers) == []
    assert read == [40, 3]


def test_calls_the_rate_limit_refuses_count_with_their_code(tmp_path: Path) -> None:
    """The metrics interceptor runs outside the rate limiter: a Retention call it refuses
    counts as RESOURCE_EXHAUSTED, as the caller saw it."""
    config = tmp_path / "kvtether.yaml"
    config.write_text(yaml.safe_dump({"limits": {"retention_calls_per_s": 0.5,
                                                 "retention_burst": 2}}))
    with running_daemon("--config", str(config)) as daemon:
        stub = retention_pb2_grpc.RetentionStub(daemon.channel())
        request = retention_pb2.GetDirectivesRequest(
            target=retention_pb2.RetentionTarget(session_id="limited"))
        seen: dict[str, int] = {}
        for _ in range(6):
            try:
                stub.GetDirectives(request, timeout=5)
                code = "OK"
            except grpc.RpcError as error:
                code = error.code().name
            seen[code] = seen.get(code, 0) + 1
        families = scrape_all(daemon.metrics_port)
    call = grpc_labels(("unary", "kvtether.v1.Retention", "GetDirectives"))
    assert seen.get("RESOURCE_EXHAUSTED", 0) >= 3, seen
    assert {code: value(families, "grpc_server_handled_total", **call, grpc_code=code)
            for code in seen} == seen
