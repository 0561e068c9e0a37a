"""A real Redis Cluster for the tests: three masters and three replicas, each a
``redis-server --cluster-enabled yes`` on a free port in a temporary directory, joined
with ``redis-cli --cluster create … --cluster-replicas 1``.

``cluster-node-timeout`` is short (1 s by default) so that a killed master's replica
is promoted within a few seconds (the fault tests rely on it). Nothing is written to
disk but the nodes' cluster configuration files, removed on teardown.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

CLUSTER_URL_SCHEME = "redis+cluster"
# A cluster node also listens on its bus port, port + 10000: both must be free.
BUS_PORT_OFFSET = 10_000


def free_cluster_port(taken: set[int]) -> int:
    """A port whose bus port (+10000) is free too; the kernel's ephemeral range often
    starts above 55535, so the port is drawn from 20000-45000."""
    for _ in range(1000):
        port = random.randint(20_000, 45_000)
        if port in taken or port + BUS_PORT_OFFSET in taken:
            continue
        if _bindable(port) and _bindable(port + BUS_PORT_OFFSET):
            taken.update((port, port + BUS_PORT_OFFSET))
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class ClusterNodeProcess:
    port: int
    process: subprocess.Popen[bytes]

    def client(self, timeout_s: float = 0.5) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout_s,
                           socket_connect_timeout=timeout_s)

    def info(self, section: str) -> dict[str, object]:
        return dict(self.client().info(section))

    def kill(self) -> None:
        """SIGKILL: no goodbye to the cluster, no chance to hand over."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)


@dataclass
class LocalRedisCluster:
    workdir: Path
    nodes: list[ClusterNodeProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        """A seed node; the client discovers the rest (``redis+cluster://host:port``)."""
        return f"{CLUSTER_URL_SCHEME}://127.0.0.1:{self.nodes[0].port}"

    def alive(self) -> list[ClusterNodeProcess]:
        return [node for node in self.nodes if node.process.poll() is None]

    def client(self) -> redis.RedisCluster:
        seed = self.alive()[0]
        return redis.RedisCluster(host="127.0.0.1", port=seed.port, socket_timeout=1.0)

    def node(self, port: int) -> ClusterNodeProcess:
        return next(node for node in self.nodes if node.port == port)

    def master_of(self, key: str) -> ClusterNodeProcess:
        """The node currently serving ``key``'s slot as master."""
        return self.masters_of([key])[0]

    def masters_of(self, keys: list[str]) -> list[ClusterNodeProcess]:
        client = self.client()
        try:
            return [self.node(int(client.get_node_from_key(key, replica=False).port))
                    for key in keys]
        finally:
            client.close()

    def replicas_of(self, master: ClusterNodeProcess) -> list[ClusterNodeProcess]:
        info = master.info("replication")
        count = int(str(info.get("connected_slaves", 0)))
        ports = []
        for index in range(count):
            entry = info[f"slave{index}"]
            ports.append(int(entry["port"] if isinstance(entry, dict) else
                             str(entry).split("port=")[1].split(",")[0]))
        return [self.node(port) for port in ports]

    def flush(self) -> None:
        """Empty every master (replicas follow)."""
        for node in self.alive():
            with contextlib.suppress(redis.RedisError):
                if node.info("replication").get("role") == "master":
                    node.client().flushall()

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node reports ``cluster_state:ok`` and agrees on 3 masters
        covering all 16384 slots."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if all(_state_ok(node) for node in self.alive()):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                states = {node.port: _cluster_info(node) for node in self.alive()}
                raise TimeoutError(f"Redis Cluster not ok after {timeout_s} s: {states}")
            time.sleep(0.1)

    def wait_promoted(self, replica: ClusterNodeProcess, timeout_s: float = 30.0) -> None:
        """Until ``replica`` is a master and the cluster is ok again."""
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(redis.RedisError):
                if replica.info("replication").get("role") == "master":
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {replica.port} was not promoted in {timeout_s} s")
            time.sleep(0.05)
        self.wait_ok(max(1.0, deadline - time.monotonic()))


def _cluster_info(node: ClusterNodeProcess) -> dict[str, str]:
    raw = node.client().execute_command("CLUSTER INFO")  # redis-py parses it to a dict
    return {str(name): str(value) for name, value in dict(raw).items()}


def _state_ok(node: ClusterNodeProcess) -> bool:
    info = _cluster_info(node)
    return (info.get("cluster_state") == "ok"
            and info.get("cluster_slots_ok") == "16384"
            and info.get("cluster_size") == "3")


def _binaries() -> tuple[str, str]:
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        raise RuntimeError("Redis Cluster tests need redis-server and redis-cli "
                           "(Debian's redis-server package, which pulls redis-tools)")
    return server, cli


@contextlib.contextmanager
def redis_cluster(masters: int = 3, replicas_per_master: int = 1,
                  node_timeout_ms: int = 1000) -> Iterator[LocalRedisCluster]:
    """Start a cluster on free ports, wait until it is ok, yield it, tear it down."""
    server, cli = _binaries()
    cluster = LocalRedisCluster(Path(tempfile.mkdtemp(prefix="kvtether-redis-cluster-")))
    taken: set[int] = set()
    try:
        for _ in range(masters * (1 + replicas_per_master)):
            port = free_cluster_port(taken)
            process = subprocess.Popen(
                [server, "--port", str(port), "--bind", "127.0.0.1",
                 "--cluster-enabled", "yes",
                 "--cluster-config-file", f"nodes-{port}.conf",
                 "--cluster-node-timeout", str(node_timeout_ms),
                 # a replica's first sync starts at once (the default waits 5 s)
                 "--repl-diskless-sync-delay", "0",
                 "--appendonly", "no", "--save", "", "--dir", str(cluster.workdir)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            cluster.nodes.append(ClusterNodeProcess(port, process))
        for node in cluster.nodes:
            _wait_ping(node)
        subprocess.run(
            [cli, "--cluster", "create",
             *(f"127.0.0.1:{node.port}" for node in cluster.nodes),
             "--cluster-replicas", str(replicas_per_master), "--cluster-yes"],
            check=True, capture_output=True, timeout=60)
        cluster.wait_ok()
        _wait_replicas_attached(cluster, masters * replicas_per_master)
        yield cluster
    finally:
        for node in cluster.nodes:
            if node.process.poll() is None:
                node.process.terminate()
        for node in cluster.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(timeout=10)
        shutil.rmtree(cluster.workdir, ignore_errors=True)


def _wait_ping(node: ClusterNodeProcess, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            node.client().ping()
            return
        except redis.RedisError:
            if node.process.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _wait_replicas_attached(cluster: LocalRedisCluster, expected: int,
                            timeout_s: float = 30.0) -> None:
    """Until every replica finished its first sync (a failover test needs it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        linked = 0
        for node in cluster.alive():
            info = node.info("replication")
            if info.get("role") == "slave" and info.get("master_link_status") == "up":
                linked += 1
        if linked >= expected:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{linked}/{expected} replicas in sync after {timeout_s} s")
        time.sleep(0.1)


# --- fixtures (imported by tests/conftest.py) -------------------------------------------


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """One Redis Cluster for the whole session (it takes ~2 s to start)."""
    with redis_cluster() as cluster:
        yield cluster.url


@pytest.fixture
def clean_redis_cluster(redis_cluster_url: str) -> str:
    """The session's Redis Cluster, every master emptied before the test."""
    host_port = redis_cluster_url.split("://", 1)[1]
    host, _, port = host_port.rpartition(":")
    client = redis.RedisCluster(host=host, port=int(port))
    try:
        client.flushall(target_nodes=redis.RedisCluster.PRIMARIES)
    finally:
        client.close()
    return redis_cluster_url
