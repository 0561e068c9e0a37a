"""Redis Cluster specifics. The whole store suite (test_store.py,
test_estimators_store.py) also runs on the session's cluster through the ``store``
fixture's ``redis-cluster`` parameter; these tests cover what only a cluster has:
selecting it by URL, transitions pinned to one slot, WATCH across daemons, and
acknowledgement after replication."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
import redis
from structlog.testing import capture_logs

from sidecar.config import ConfigError, load_config
from sidecar.store import StoreError, Transition, Write, keys, open_store
from sidecar.store.redis_store import RedisStore
from sidecar.store.redis_url import parse_redis_url
from tests.integration import test_estimators_store


@pytest.fixture
async def cluster_store(clean_redis_cluster: str) -> AsyncIterator[RedisStore]:
    store = await RedisStore.connect(clean_redis_cluster)
    try:
        yield store
    finally:
        await store.close()


def _client(url: str) -> redis.RedisCluster:
    host, _, port = url.split("://", 1)[1].split("?")[0].rpartition(":")
    return redis.RedisCluster(host=host, port=int(port))


# --- selecting the cluster -------------------------------------------------------------


async def test_a_cluster_url_opens_the_cluster_backend(clean_redis_cluster: str) -> None:
    store = await open_store(clean_redis_cluster)
    try:
        assert store.backend_name == "redis-cluster"
        # Keys of every slot are reachable, whichever node the URL named.
        for index in range(50):
            await store.set(keys.job_history(f"spread-{index}"), b"x")
        client = _client(clean_redis_cluster)
        try:
            spread = {client.keyslot(keys.job_history(f"spread-{i}")) for i in range(50)}
            owners = {client.get_node_from_key(keys.job_history(f"spread-{i}")).name
                      for i in range(50)}
        finally:
            client.close()
        assert len(spread) > 1 and len(owners) == 3  # the keys live on all three masters
        assert len(await store.scan(keys.pattern_for("history"))) == 50
    finally:
        await store.close()


async def test_a_plain_url_naming_a_cluster_node_is_refused(clean_redis_cluster: str) -> None:
    plain = clean_redis_cluster.replace("redis+cluster://", "redis://")
    with pytest.raises(StoreError, match=r"Redis Cluster node: use a redis\+cluster:// URL"):
        await open_store(plain)


async def test_a_cluster_url_naming_a_plain_server_is_refused(clean_redis: str) -> None:
    with pytest.raises(StoreError, match="unreachable"):
        await open_store(clean_redis.replace("redis://", "redis+cluster://").removesuffix("/0"))


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://example:6379", "expected a redis://"),
        ("redis+cluster://example", "names a node's host:port"),
        ("redis+cluster://example:6379/2", "database 0 only"),
        ("redis+cluster://:hunter2@example:6379/2", r"redis\+cluster://\*\*\*@example"),
        ("redis+cluster://example:6379?replica_acks=one", "replica_acks must be a whole"),
        ("redis://example:6379?replica_ack_timeout_ms=0", "at least 1"),
    ],
)
def test_bad_store_urls_stop_the_daemon_with_one_line(url: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as caught:
        load_config(flags={"store": {"redis_url": url}})
    assert str(caught.value).startswith("store.redis_url: ")
    assert "hunter2" not in str(caught.value)


def test_cluster_urls_and_kvtether_options_parse() -> None:
    target = parse_redis_url(
        "rediss+cluster://user:pw@redis-0.redis:6379?replica_acks=1&ssl_cert_reqs=none")
    assert target.cluster and target.replica_acks == 1
    assert target.replica_ack_timeout_ms == 100
    # redis-py gets its own scheme and parameters only.
    assert target.client_url == "rediss://user:pw@redis-0.redis:6379?ssl_cert_reqs=none"
    plain = parse_redis_url("redis://localhost:6379/0")
    assert not plain.cluster and plain.replica_acks == 0
    assert plain.client_url == "redis://localhost:6379/0"
    assert load_config(flags={"store": {"redis_url": "redis+cluster://r:7000"}}).store.redis_url


# --- transitions on one slot ---------------------------------------------------------


async def test_a_transition_over_two_hash_tags_is_refused(cluster_store: RedisStore) -> None:
    a, b = keys.retention_directive("a"), keys.retention_directive("b")

    def both(current: dict[str, bytes | None]) -> Transition[None]:
        return Transition(None, {a: Write(b"1"), b: Write(b"1")})

    with pytest.raises(ValueError, match="do not share a hash tag"):
        await cluster_store.transact([a, b], both)
    assert await cluster_store.get(a) is None and await cluster_store.get(b) is None


async def test_two_daemons_racing_on_one_key_lose_no_update(clean_redis_cluster: str) -> None:
    """WATCH/MULTI/EXEC on the slot's master: two stores (two daemons' connections)
    incrementing one counter through a read-modify-write rule."""
    key = keys.retention_directive("shared-counter")
    stores = [await RedisStore.connect(clean_redis_cluster) for _ in range(2)]

    def increment(current: dict[str, bytes | None]) -> Transition[int]:
        value = json.loads(current[key] or b"0") + 1
        return Transition(result=value, writes={key: Write(json.dumps(value).encode())})

    try:
        results = await asyncio.gather(
            *(stores[i % 2].transact([key], increment) for i in range(40)))
        assert sorted(results) == list(range(1, 41))
        assert await stores[0].get(key) == b"40"
    finally:
        for store in stores:
            await store.close()


async def test_two_daemon_processes_updating_one_tool_lose_no_update_on_a_cluster(
        clean_redis_cluster: str) -> None:
    # The same two processes as on one server (test_estimators_store.py), on the cluster.
    await test_estimators_store.test_two_daemon_processes_updating_one_tool_lose_no_update(
        clean_redis_cluster)


async def test_replica_acks_waits_until_the_replica_has_the_write(
        clean_redis_cluster: str) -> None:
    store = await RedisStore.connect(f"{clean_redis_cluster}?replica_acks=1")
    key = keys.retention_directive("replicated")
    try:
        assert store.replica_acks == 1
        for value in range(20):
            await store.transact([key], lambda _current, v=value: Transition(
                None, {key: Write(str(v).encode(), ttl_ms=60_000)}))
            # Acknowledged means on the replica: read it there (READONLY), no waiting.
            assert _read_on_replica(clean_redis_cluster, key) == str(value).encode()
        assert store.unreplicated_writes == 0
    finally:
        await store.close()


def _read_on_replica(url: str, key: str) -> bytes | None:
    client = _client(url)
    try:
        master = client.get_node_from_key(key, replica=False)
        replica = next(node for node in client.get_replicas()
                       if _master_port_of(node) == master.port)
        connection = redis.Redis(host=replica.host, port=replica.port)
        try:
            connection.execute_command("READONLY")
            value = connection.get(key)
            return None if value is None else bytes(value)
        finally:
            connection.close()
    finally:
        client.close()


def _master_port_of(replica: redis.cluster.ClusterNode) -> int:
    info = redis.Redis(host=replica.host, port=replica.port).info("replication")
    return int(info["master_port"])


# --- errors and limits, on one server and on the cluster -------------------------------


@pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
async def test_a_redis_error_inside_a_transition_is_a_store_error(
        backend: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("clean_redis" if backend == "redis" else "clean_redis_cluster")
    # One connection: each call below must find it clean after the previous one failed.
    store = await RedisStore.connect(url, max_connections=1)
    try:
        not_a_hash, a_list = keys.tool_stats("wrong-type"), keys.retention_directive("a-list")
        await store.set(not_a_hash, b"a string")
        await store.append_capped(a_list, b"item", max_len=4)
        with pytest.raises(StoreError, match="WRONGTYPE"):
            await store.hincr(not_a_hash, {"count": 1})  # fails inside EXEC
        with pytest.raises(StoreError, match="WRONGTYPE"):
            await store.transact([a_list], lambda _c: Transition(None))  # fails at the read
        counter = keys.retention_directive("after-errors")
        assert await store.transact([counter], lambda _c: Transition(
            "ok", {counter: Write(b"1")})) == "ok"
        assert await store.get(not_a_hash) == b"a string"
    finally:
        await store.close()


async def test_more_callers_than_connections_wait_on_a_cluster(clean_redis_cluster: str) -> None:
    # A cluster node's pool raises when exhausted; the store makes callers wait instead,
    # as the blocking pool does on one server.
    store = await RedisStore.connect(clean_redis_cluster, max_connections=2)
    try:
        key = keys.tool_stats("burst")
        await asyncio.gather(*(store.hincr(key, {"count": 1}) for _ in range(100)),
                             *(store.get(keys.job_history(f"burst-{i}")) for i in range(100)))
        assert (await store.hgetall(key))["count"] == 100.0
    finally:
        await store.close()


async def test_redis_cluster_without_persistence_warns(clean_redis_cluster: str) -> None:
    # The test cluster's masters keep everything in memory: one warning names them all.
    with capture_logs() as logs:
        store = await RedisStore.connect(clean_redis_cluster)
        await store.close()
    (warning,) = [entry for entry in logs if entry["event"] == "store_not_persistent"]
    assert warning["log_level"] == "warning"
    assert sorted(warning["nodes"]) == _masters(clean_redis_cluster)  # type: ignore[type-var]


def _masters(url: str) -> list[str]:
    client = _client(url)
    try:
        return sorted(node.name for node in client.get_primaries())
    finally:
        client.close()
