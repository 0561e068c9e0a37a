"""Redis Cluster faults on real processes: a daemon (``kvtether serve`` on a
``redis+cluster://`` URL) keeps deciding while a master is SIGKILLed and its replica is
promoted; what it acknowledged before is still there, and what it writes after lands.

What is guaranteed, and tested here: with ``replica_acks=1`` a retention directive is
acknowledged only once a replica has it (``WAIT 1 100`` on the writing connection), so
it survives its master's death. What is not: Redis replicates asynchronously, so
writes not waited for (job history, tool statistics — queued and retried by the
recorder, acknowledged to nobody) may lose their last milliseconds to a failover; and a
directive acknowledged after WAIT timed out (no replica in sync, e.g. just after a
failover) lives on the master only and is logged (``store_write_unreplicated``).

The cluster here is the module's own (three masters, three replicas, cluster-node-
timeout 1 s), so that killing a node leaves the session's cluster alone.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
import redis

from sidecar.api.v1 import engine_session_pb2_grpc, retention_pb2, retention_pb2_grpc
from sidecar.store import Transition, Write, keys
from sidecar.store.redis_store import RedisStore
from tests.support.daemon import running_daemon
from tests.support.redis_cluster import LocalRedisCluster, redis_cluster
from tests.support.simulated_engine import SimulatedEngine, WorkloadShape


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRedisCluster]:
    with redis_cluster(node_timeout_ms=1000) as started:
        yield started


class Feeder(threading.Thread):
    """A simulated engine on its own thread and event loop: a step every 20 ms on a
    Session stream, each answer awaited at most ``answer_timeout_s``."""

    def __init__(self, address: str, answer_timeout_s: float = 5.0) -> None:
        super().__init__(name="engine-feeder", daemon=True)
        self.address = address
        self.answer_timeout_s = answer_timeout_s
        self.engine = SimulatedEngine("fault-engine", seed=11,
                                      shape=WorkloadShape(job_arrivals_per_s=4.0))
        self.latencies_s: list[float] = []
        self.answered_at: list[float] = []
        self.errors: list[str] = []
        # (monotonic time, job id) of every arrival reported.
        self.arrivals: list[tuple[float, str]] = []
        self._stop_requested = threading.Event()

    def run(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        async with grpc.aio.insecure_channel(self.address) as channel:
            call = engine_session_pb2_grpc.EngineSessionStub(channel).Session()
            origin = time.monotonic()
            while not self._stop_requested.is_set():
                report = self.engine.step(time.monotonic() - origin)
                self.arrivals.extend((time.monotonic(), r.job_id) for r in report.new_requests)
                started = time.monotonic()
                try:
                    await call.write(report)
                    decision = await asyncio.wait_for(call.read(), self.answer_timeout_s)
                except (grpc.aio.AioRpcError, TimeoutError) as error:
                    self.errors.append(f"seq {report.seq}: {error!r}")
                    return
                if decision is grpc.aio.EOF or decision.seq != report.seq:
                    self.errors.append(f"seq {report.seq}: answered {decision!r}")
                    return
                self.latencies_s.append(time.monotonic() - started)
                self.answered_at.append(time.monotonic())
                self.engine.apply(decision)
                await asyncio.sleep(0.02)
            await call.done_writing()

    def stop(self) -> None:
        self._stop_requested.set()
        self.join(timeout=10)


def _config(priority: int) -> retention_pb2.RetentionConfig:
    return retention_pb2.RetentionConfig(token_ranges=[
        retention_pb2.TokenRangeRetention(token_start=0, token_end=1024, priority=priority)])


def _set(stub: retention_pb2_grpc.RetentionStub, session: str, priority: int) -> None:
    stub.SetDirectives(retention_pb2.SetDirectivesRequest(
        target=retention_pb2.RetentionTarget(session_id=session), config=_config(priority),
        scope="orchestrator"), timeout=10)


def _get(stub: retention_pb2_grpc.RetentionStub, session: str
         ) -> retention_pb2.GetDirectivesResponse:
    return stub.GetDirectives(retention_pb2.GetDirectivesRequest(
        target=retention_pb2.RetentionTarget(session_id=session)), timeout=10)


def _on_replica(replica_port: int, key: str) -> bytes | None:
    client = redis.Redis(host="127.0.0.1", port=replica_port)
    try:
        client.execute_command("READONLY")
        value = client.get(key)
        return None if value is None else bytes(value)
    finally:
        client.close()


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


async def test_replica_acks_waits_for_a_replica_and_says_when_it_could_not(
        cluster: LocalRedisCluster) -> None:
    key = keys.retention_directive("session:slow-replica")
    replica = cluster.replicas_of(cluster.master_of(key))[0]
    # Acknowledged within the timeout: not counted. The timeout is generous: on a
    # loaded machine a live replica's acknowledgement can take a quarter of a second.
    patient = await RedisStore.connect(
        f"{cluster.url}?replica_acks=1&replica_ack_timeout_ms=5000")
    try:
        await patient.transact([key], lambda _c: Transition(None, {key: Write(b"in-sync")}))
        assert patient.unreplicated_writes == 0
    finally:
        await patient.close()
    store = await RedisStore.connect(f"{cluster.url}?replica_acks=1&replica_ack_timeout_ms=200")
    try:
        replica.process.send_signal(signal.SIGSTOP)  # in the cluster, but not acking
        try:
            started = time.monotonic()
            await store.transact([key], lambda _c: Transition(None, {key: Write(b"alone")}))
            waited_s = time.monotonic() - started
        finally:
            replica.process.send_signal(signal.SIGCONT)
        # Acknowledged after the timeout, the write on the master only, and counted.
        assert waited_s >= 0.2
        assert store.unreplicated_writes == 1
        assert await store.get(key) == b"alone"
    finally:
        await store.close()


def test_daemon_keeps_deciding_through_a_master_failover(cluster: LocalRedisCluster) -> None:
    before_kill = "before-kill"
    directive_key = keys.retention_directive(f"session:{before_kill}")
    victim = cluster.master_of(directive_key)
    replica = cluster.replicas_of(victim)[0]
    with running_daemon("--redis-url", f"{cluster.url}?replica_acks=1",
                        "--policy", "continuum") as daemon:
        channel = grpc.insecure_channel(daemon.address)
        retention = retention_pb2_grpc.RetentionStub(channel)
        feeder = Feeder(daemon.address)
        feeder.start()
        try:
            _set(retention, before_kill, 90)
            # Acknowledged means replicated (replica_acks=1): the replica has it now.
            assert _on_replica(replica.port, directive_key) is not None
            time.sleep(1.0)  # the engine has been reporting for a while

            killed_at = time.monotonic()
            victim.kill()
            cluster.wait_promoted(replica, timeout_s=30)
            promoted_at = time.monotonic()
            time.sleep(1.0)  # and the engine keeps reporting after the failover

            # What was acknowledged before the kill is still there, read through the daemon.
            kept = _get(retention, before_kill)
            assert kept.found and kept.owner_scope == "orchestrator"
            assert kept.config == _config(90)

            # A directive written after the failover, on a slot the promoted replica serves.
            names = [f"after-kill-{i}" for i in range(200)]
            owners = cluster.masters_of([keys.retention_directive(f"session:{name}")
                                         for name in names])
            after_kill = next(name for name, owner in zip(names, owners, strict=True)
                              if owner.port == replica.port)
            _set(retention, after_kill, 70)
            assert _get(retention, after_kill).found
            _set(retention, before_kill, 95)  # and the old one can be changed again
            assert _get(retention, before_kill).config == _config(95)
        finally:
            feeder.stop()
            channel.close()

        # The engine was answered all along, promptly, with no resync or error. (Gaps
        # between answers also count this test's own threads on a busy machine: the
        # latency of each answer is what the daemon owes.)
        assert feeder.errors == []
        assert feeder.engine.counters.resyncs == 0
        assert max(feeder.latencies_s) < 1.0, max(feeder.latencies_s)
        answered_during = [t for t in feeder.answered_at if killed_at <= t <= promoted_at]
        assert len(answered_during) >= (promoted_at - killed_at) / 0.2

        # History the daemon wrote after the failover landed, on the promoted master too.
        arrived_after = sorted({job for at, job in feeder.arrivals if at > promoted_at})
        owners = cluster.masters_of([keys.job_history(job) for job in arrived_after])
        on_promoted = [job for job, owner in zip(arrived_after, owners, strict=True)
                       if owner.port == replica.port]
        assert on_promoted, "no job of the promoted master's slots arrived after the failover"
        client = cluster.client()
        try:
            deadline = time.monotonic() + 15
            while not all(client.llen(keys.job_history(job)) for job in on_promoted):
                assert time.monotonic() < deadline, "history written after failover missing"
                time.sleep(0.2)
            assert client.hget(keys.tool_stats(keys.GLOBAL_TOOL), "count") is not None
        finally:
            client.close()
        assert _metric(daemon.metrics_port, "kvtether_store_writes_dropped_total") == 0
        assert daemon.stop() == 0
