"""The engine benchmark records how much of a round the engine was saturated by
prefill, as the daemon saw it: its prefill-share gauge sampled over HTTP, at the
threshold the policy run would have used."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from functools import partial

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from benchmarks.common.engine_runs import saturated_at
from benchmarks.common.engine_runs import summarize_prefill_share as summarize
from benchmarks.engine.__main__ import daemon_gauges
from benchmarks.engine.prefill_share import PREFILL_SHARE_GAUGE, PrefillShareSampler
from sidecar.policies.adaptive.policy import AdaptiveParams
from tests.support.redis_server import free_port


def test_the_threshold_is_the_policys_own_or_adaptives_default() -> None:
    default = AdaptiveParams().saturated_prefill_share
    assert saturated_at("fcfs") == default, "a baseline's rounds: what adaptive would say"
    assert saturated_at("adaptive") == default
    assert saturated_at("adaptive@job_age_credit_s=0") == default
    assert saturated_at("adaptive@saturated_prefill_share=2@job_age_credit_s=0") == 2.0


def test_a_rounds_summary_says_how_long_it_was_saturated() -> None:
    summary = summarize([0.1, 0.5, 0.4, 0.2], threshold=0.4)
    assert summary is not None
    assert math.isclose(summary["mean"], 0.3)
    assert math.isclose(summary["p50"], 0.3)
    assert summary["max"] == 0.5
    # At the threshold counts as saturated, as the policy's own test (>=) does.
    assert summary["time_saturated"] == 0.5
    assert summarize([], threshold=0.4) is None, "no sample: nothing claimed"


@pytest.fixture
def gauge_server() -> Iterator[tuple[Gauge, str]]:
    """The daemon's gauge behind a real /metrics endpoint."""
    registry = CollectorRegistry()
    gauge = Gauge(PREFILL_SHARE_GAUGE, "share", ["engine"], registry=registry)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    yield gauge, f"http://127.0.0.1:{port}"
    server.shutdown()
    thread.join(timeout=5)


def _wait_for(samples: list[float], count: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(samples) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_sampler_reads_the_daemons_gauge_over_http(
        gauge_server: tuple[Gauge, str]) -> None:
    gauge, url = gauge_server
    sampler = PrefillShareSampler(partial(daemon_gauges, url), period_s=0.02)
    sampler.start()
    # Before the daemon has learned a token's cost it exports no sample: none taken.
    time.sleep(0.1)
    assert sampler.samples == []
    gauge.labels("engine-0").set(0.2)
    _wait_for(sampler.samples, 3)
    gauge.labels("engine-0").set(0.6)
    _wait_for(sampler.samples, len(sampler.samples) + 3)
    summary = sampler.finish(threshold=0.4)
    assert not sampler.is_alive()
    assert summary is not None
    assert set(sampler.samples) == {0.2, 0.6}
    assert 0.0 < summary["time_saturated"] < 1.0
    assert summary["max"] == 0.6


def test_a_daemon_that_stops_answering_costs_samples_not_the_round() -> None:
    # Nothing listens on this port: every read fails, the sampler keeps going.
    sampler = PrefillShareSampler(partial(daemon_gauges, f"http://127.0.0.1:{free_port()}"),
                                  period_s=0.02)
    sampler.start()
    time.sleep(0.1)
    assert sampler.is_alive()
    assert sampler.finish(threshold=0.4) is None
