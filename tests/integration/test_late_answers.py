"""A daemon whose answers land late tells the engine to cache finished turns instead of
holding them: adaptive's provisional_cache=auto reads the lags the engine's reports
count (sidecar/policies/adaptive/waiting.py), over a real gRPC session; the operator
reads the share it went by on /metrics."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import engine_session_pb2_grpc
from tests.support.daemon import running_daemon

KV = pb.KvCapacity(total_blocks=100, free_blocks=50, block_size_tokens=16)


def _lags(on_time: int, late: int) -> pb.EngineCounters:
    # Answers applied 1 step after their report, and 7 or more.
    return pb.EngineCounters(answers_by_lag_steps=[0, on_time, 0, 0, 0, 0, 0, late])


def _late_answer_shares(metrics_port: int) -> dict[str, float]:
    """kvtether_engine_late_answer_ratio by engine, as Prometheus would scrape it."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                  timeout=5).read().decode()
    return {sample.labels["engine_id"]: sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "kvtether_engine_late_answer_ratio"
            for sample in family.samples}


def test_the_engine_caches_while_its_answers_run_late_and_holds_once_they_do_not() -> None:
    with running_daemon("--policy", "adaptive") as daemon:
        stub = engine_session_pb2_grpc.EngineSessionStub(daemon.channel())

        def cached(seq: int, counters: pb.EngineCounters) -> bool:
            decision = stub.Step(pb.StepReport(engine_id="cpu-0", seq=seq, snapshot=seq == 1,
                                               now_s=float(seq), kv=KV, counters=counters))
            assert decision.provisional_pins, "adaptive pins finished turns"
            return decision.provisional_cache

        assert cached(1, _lags(10, 0)) is False, "nothing decided yet: held, as before"
        assert _late_answer_shares(daemon.metrics_port) == {}, "no answer counted yet"
        assert cached(2, _lags(30, 0)) is False, "on time: held"
        assert _late_answer_shares(daemon.metrics_port) == {"cpu-0": 0.0}
        # A stall: the next 10 answers land 7 or more steps late.
        assert cached(3, _lags(30, 10)) is True
        assert _late_answer_shares(daemon.metrics_port) == {"cpu-0": 10 / 30}
        # 100 answers on time since: the stall is under a tenth of the recent answers.
        assert cached(4, _lags(130, 10)) is False
        assert _late_answer_shares(daemon.metrics_port) == {"cpu-0": 10 / 130}
        # Another engine behind the same daemon is read on its own.
        other = stub.Step(pb.StepReport(engine_id="gpu-0", seq=1, snapshot=True, now_s=1.0,
                                        kv=KV, counters=_lags(50, 0)))
        assert other.provisional_cache is False
