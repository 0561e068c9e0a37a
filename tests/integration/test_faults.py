"""Faults on real processes, with vLLM's real scheduler as the engine: Redis killed and
restarted, Redis unreachable when the daemon starts, the daemon frozen past the
deadline. Each: no request fails, the engine keeps stepping (fallback counted), no KV
block leaks, the daemon decides again soon after it is back, and nothing acknowledged
is lost."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from sidecar.api.v1 import retention_pb2, retention_pb2_grpc
from tests.integration.test_plugin_inprocess import BLOCK, Engine, context
from tests.support.daemon import DaemonController, serve_command
from tests.support.engine import requires_vllm, tiny_model_dir
from tests.support.redis_server import RedisProcess

pytestmark = requires_vllm


@pytest.fixture
def redis_process() -> Iterator[RedisProcess]:
    process = RedisProcess()
    yield process
    process.close()


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir()


def run_turns(engine: Engine, prefix: str, jobs: int, turns: int) -> None:
    """Agent jobs, turn by turn; every request must finish (drain raises otherwise)."""
    for turn in range(turns):
        for job in range(jobs):
            engine.add(f"{prefix}-{job}-t{turn}", context(turn + 1, 2 * BLOCK),
                       job=f"{prefix}-{job}", last=turn == turns - 1)
        engine.drain()


def wait_for_decisions(engine: Engine, timeout_s: float = 5.0) -> float:
    """Seconds until the engine's link is back and a report is answered."""
    started = time.monotonic()
    while True:
        probe = f"probe-{time.monotonic_ns()}"
        engine.add(probe, [7, 8, 9], job=probe, last=True)
        before = sum(engine.agent.lag_counts)
        engine.drain()
        if engine.agent.link.connected and sum(engine.agent.lag_counts) > before:
            return time.monotonic() - started
        assert time.monotonic() - started < timeout_s, "no decision after the fault"
        time.sleep(0.05)


def test_redis_killed_and_restarted(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, redis_process: RedisProcess) -> None:
    redis_process.start()
    daemon = DaemonController("--redis-url", redis_process.url)
    daemon.start("continuum")
    engine = Engine(model_dir, daemon, monkeypatch)
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            retention = retention_pb2_grpc.RetentionStub(channel)
            target = retention_pb2.RetentionTarget(session_id="durable")
            config = retention_pb2.RetentionConfig(token_ranges=[
                retention_pb2.TokenRangeRetention(token_start=0, priority=90)])
            retention.SetDirectives(retention_pb2.SetDirectivesRequest(
                target=target, config=config, scope="dynamo"), timeout=5)  # acknowledged
            run_turns(engine, "before", jobs=3, turns=2)

            redis_process.kill()
            # Decisions do not touch the store: the engine stays on policy.
            run_turns(engine, "during", jobs=3, turns=3)
            with pytest.raises(grpc.RpcError) as refused:
                retention.GetDirectives(retention_pb2.GetDirectivesRequest(target=target),
                                        timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

            redis_process.start()
            run_turns(engine, "after", jobs=2, turns=2)
            # The directive acknowledged before the crash survived it.
            read = retention.GetDirectives(retention_pb2.GetDirectivesRequest(target=target),
                                           timeout=5)
            assert read.found and read.owner_scope == "dynamo"
        # Writes queued while Redis was down reached it once it was back: the job
        # histories of the turns run during the outage are there.
        client = redis.Redis.from_url(redis_process.url)
        deadline = time.monotonic() + 10
        while not client.keys("kvt:v1:{job:during-0}:history"):
            assert time.monotonic() < deadline, "queued history writes were lost"
            time.sleep(0.1)
        assert engine.agent.counters.fallback_steps == 0
        assert not engine.agent.pins and engine.free() == engine.start_free
    finally:
        engine.close()
        daemon.stop()


def test_redis_unreachable_at_daemon_start(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, redis_process: RedisProcess) -> None:
    daemon = DaemonController("--redis-url", redis_process.url)
    # Redis is not up: the daemon refuses to start, with one line naming it.
    done = subprocess.run(serve_command("--listen", daemon.address, "--metrics-port", "-1",
                                        "--redis-url", redis_process.url),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and f"127.0.0.1:{redis_process.port}" in done.stderr
    # Meanwhile the engine schedules natively: nothing fails.
    engine = Engine(model_dir, daemon, monkeypatch, wait_connected=False)
    try:
        run_turns(engine, "native", jobs=3, turns=2)
        assert engine.agent.counters.fallback_steps > 0
        redis_process.start()
        daemon.start("continuum")
        assert wait_for_decisions(engine) < 3.0
        run_turns(engine, "back", jobs=2, turns=2)
        assert not engine.agent.pins and engine.free() == engine.start_free
    finally:
        engine.close()
        daemon.stop()


def test_daemon_frozen_past_the_deadline(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    daemon = DaemonController()
    daemon.start("continuum")
    engine = Engine(model_dir, daemon, monkeypatch, FAIL_MODE="open", DEADLINE_MS="5",
                    PROVISIONAL_PIN_S="0.3", MAX_PIN_S="0.5")
    try:
        run_turns(engine, "warm", jobs=2, turns=1)
        assert daemon.process is not None
        daemon.process.send_signal(signal.SIGSTOP)
        missed_before = engine.agent.counters.idle_waits_missed
        started = time.monotonic()
        run_turns(engine, "frozen", jobs=3, turns=3)  # never waits more than a deadline
        steps_taken_s = time.monotonic() - started
        assert engine.agent.counters.fallback_steps > 0
        # Each time the engine went idle it waited its deadline, and the answer never
        # came: counted for the operator (kvtether_engine_idle_waits_missed_total).
        assert engine.agent.counters.idle_waits_missed > missed_before
        time.sleep(0.6)
        engine.add("tick", [1, 2, 3], job="tick", last=True)
        engine.drain()  # local bounds release any pin while the daemon is frozen
        assert not engine.agent.pins and engine.free() == engine.start_free
        daemon.process.send_signal(signal.SIGCONT)
        assert wait_for_decisions(engine) < 3.0
        assert steps_taken_s < 30
    finally:
        if daemon.process is not None:
            daemon.process.send_signal(signal.SIGCONT)
        engine.close()
        daemon.stop()
