"""The Redis backend: state shared by every daemon replica and outliving each of them,
on one Redis server or on Redis Cluster (``redis+cluster://`` URLs, see
``sidecar.store.redis_url``).

Atomicity, per operation — one code path for both deployments:
- ``hincr`` / ``append_capped``: one MULTI/EXEC (HINCRBYFLOAT…, PEXPIRE; RPUSH, LTRIM,
  PEXPIRE). Increments commute, so concurrent writers lose nothing.
- ``transact``: WATCH the keys and read them, run the rule (the same Python function the
  embedded backend runs), MULTI/EXEC its writes; on a concurrent change, retry.
Both run on one connection to the server that owns the keys: the server itself, or on
a cluster the master owning the keys' slot. Keys of one transition share a hash tag
(``sidecar.store.keys``), hence one slot, so WATCH/MULTI/EXEC keeps its meaning on a
cluster; a transition over keys of two slots is refused on both deployments.

Why not redis-py's cluster pipeline: redis-py 8.1's ``ClusterPipeline(transaction=True)``
does WATCH, but runs every watched or queued command in a new thread with its own event
loop and joins it, blocking the daemon's loop: a transition takes several times as
long as here, and transitions racing on one key some 25 times as long (see
docs/decisions/). Here a transition is two round trips (WATCH + GETs, then MULTI … EXEC)
on a connection taken from redis-py's own pool for the owning master. Other commands use
``RedisCluster``, which follows MOVED redirections itself.

On a cluster, every call rides out topology changes — a failover, a slot moved — for up
to the store's timeout: it refreshes the slot map and retries. On one server, a call that
finds its connection lost is retried once on a fresh one (a restarted server leaves
every pooled connection dead); any other failure raises StoreError at once; callers
(the recorder) retry.

Durability: Redis replicates asynchronously. With ``replica_acks=N`` in the URL, a
transition is acknowledged only after ``WAIT N timeout`` on the same connection
confirmed N replicas have it, so it survives the loss of its master to a failover; when
the timeout passes first (no replica in sync, e.g. right after a failover), the write is
kept on the master, acknowledged, and logged (``store_write_unreplicated``).

A Redis that keeps its data in memory only (neither ``appendonly`` nor a ``save``
schedule, on the server or a cluster master) loses every acknowledged write when it
restarts: the store says so once, at connect (``store_not_persistent``); one that
refuses ``CONFIG`` (managed services) gets an info line instead
(``store_persistence_unknown``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import redis.asyncio as aioredis
import structlog
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MasterDownError,
    MaxConnectionsError,
    MovedError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sidecar.store.base import Rule, StoreError, TransactionConflict
from sidecar.store.redis_url import parse_redis_url, redact

T = TypeVar("T")

log = structlog.get_logger("kvtether.store")

# What a Redis deployment throws while its topology changes (a master lost, its replica
# promoted, slots moving): worth a retry on a cluster once the slot map is refreshed.
TOPOLOGY_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError, RedisTimeoutError, OSError, MovedError, AskError, TryAgainError,
    ClusterDownError, MasterDownError, SlotNotCoveredError, MaxConnectionsError,
)
# Everything a Redis call may raise that is the backend's fault, never the caller's.
BACKEND_ERRORS: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError)

Command = tuple[Any, ...]
# A plan: the watched keys' values → (the caller's result, the commands for MULTI/EXEC).
Plan = Callable[[list[bytes | None]], tuple[T, list[Command]]]


class _Conflict(Exception):
    """EXEC answered nil: a watched key changed since WATCH."""


class _Connections(Protocol):
    """Where a key's atomic block runs, and how to recover from a topology change."""

    def limit(self) -> Any:
        """Async context manager held around each call: callers beyond the pool's size
        wait here (a cluster node's pool raises instead of waiting)."""
        ...

    def lease(self, key: str) -> Any:
        """Async context manager: a connection to the server owning ``key``."""
        ...

    async def recover(self, error: BaseException, attempt: int, started_s: float) -> bool:
        """After a failed call: True to retry it (after refreshing what is needed)."""
        ...


class _ServerConnections:
    """One Redis server: connections from the client's blocking pool."""

    def __init__(self, pool: aioredis.ConnectionPool) -> None:
        self._pool = pool

    def limit(self) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()  # the blocking pool itself makes callers wait

    @contextlib.asynccontextmanager
    async def lease(self, key: str) -> AsyncIterator[AbstractConnection]:
        connection = await self._pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            yield connection
        except BaseException:
            await connection.disconnect()  # its state (WATCH, unread replies) is unknown
            raise
        finally:
            await self._pool.release(connection)

    async def recover(self, error: BaseException, attempt: int, started_s: float) -> bool:
        """Once, after a lost connection: a restarted server (or a proxy cutting idle
        connections) leaves every pooled connection dead, and each one's first use
        fails although the server answers. Drop the idle ones and retry on a fresh
        connection; a server that is really down fails the retry too.

        A stale connection fails before its command reaches the server, so the retry
        applies it once. A connection lost mid-command (the server crashed while
        answering) may have applied it: a transition re-reads its keys and re-plans,
        but an increment may then count twice, against losing it with the crash."""
        if attempt != 1 or not isinstance(error, RedisConnectionError | ConnectionError):
            return False
        with contextlib.suppress(*BACKEND_ERRORS):
            await self._pool.disconnect(inuse_connections=False)
        return True


class _ClusterConnections:
    """Redis Cluster: the connection pool of the master that owns the key's slot."""

    def __init__(self, client: RedisCluster, retry_window_s: float,
                 max_connections: int) -> None:
        self._client = client
        self._retry_window_s = retry_window_s
        # No call holds more than one connection of a node, so this many calls in
        # flight never exhaust a node's pool of max_connections.
        self._in_flight = asyncio.Semaphore(max_connections)

    def limit(self) -> asyncio.Semaphore:
        return self._in_flight

    @contextlib.asynccontextmanager
    async def lease(self, key: str) -> AsyncIterator[AbstractConnection]:
        await self._client.initialize()  # no-op unless the topology is unknown or stale
        node = self._client.nodes_manager.get_node_from_slot(key_slot(key.encode()))
        connection = node.acquire_connection()
        try:
            yield connection
        except BaseException:
            await connection.disconnect()
            raise
        finally:
            node.release(connection)

    async def recover(self, error: BaseException, attempt: int, started_s: float) -> bool:
        if not isinstance(error, TOPOLOGY_ERRORS):
            return False
        if time.monotonic() - started_s > self._retry_window_s:
            return False
        if isinstance(error, MaxConnectionsError):
            await asyncio.sleep(0.01)  # another client of this node's pool: not topology
            return True
        if not isinstance(error, MovedError | AskError):
            # A master is unreachable or the cluster is electing: give it a moment.
            await asyncio.sleep(min(0.05 * 2**attempt, 0.5))
        # No node may answer yet: then the next attempt fails and comes back here.
        with contextlib.suppress(*BACKEND_ERRORS):
            await self._client.nodes_manager.initialize()
        return True


class RedisStore:
    # Optimistic transitions retried this many times before giving up: enough for
    # a handful of daemons racing on one key.
    MAX_TRANSACTION_ATTEMPTS = 32
    # At most one store_write_unreplicated line per this many seconds.
    UNREPLICATED_LOG_INTERVAL_S = 10.0

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        url: str,
        connections: _Connections,
        *,
        cluster: bool = False,
        replica_acks: int = 0,
        replica_ack_timeout_ms: int = 100,
    ) -> None:
        self._client = client
        self._connections = connections
        self.url = url
        self.cluster = cluster
        self.backend_name = "redis-cluster" if cluster else "redis"
        self.replica_acks = replica_acks
        self.replica_ack_timeout_ms = replica_ack_timeout_ms
        self._unreplicated_writes = 0
        self._unreplicated_logged_s = float("-inf")

    @classmethod
    async def connect(
        cls, url: str, timeout_s: float = 2.0, max_connections: int = 32
    ) -> RedisStore:
        """Connect and ping; raise StoreError naming the URL if Redis does not answer.

        A ``redis+cluster://`` URL connects to Redis Cluster (any node is a seed); a
        ``redis://`` URL naming a cluster node is refused, since keys of the other
        nodes' slots would fail."""
        try:
            target = parse_redis_url(url)
            client: aioredis.Redis | RedisCluster
            connections: _Connections
            if target.cluster:
                client = RedisCluster.from_url(
                    target.client_url,
                    max_connections=max_connections,
                    socket_timeout=timeout_s,
                    socket_connect_timeout=timeout_s,
                )
                connections = _ClusterConnections(client, retry_window_s=timeout_s,
                                                  max_connections=max_connections)
            else:
                # A blocking pool: under a burst, callers wait for a connection
                # instead of failing with "Too many connections".
                pool = aioredis.BlockingConnectionPool.from_url(
                    target.client_url,
                    max_connections=max_connections,
                    timeout=timeout_s,
                    socket_timeout=timeout_s,
                    socket_connect_timeout=timeout_s,
                )
                client = aioredis.Redis(connection_pool=pool)
                connections = _ServerConnections(pool)
        except (ValueError, RedisError, RedisClusterException) as error:
            raise StoreError(f"bad Redis URL {redact(url)!r}: {error}") from error
        store = cls(client, url, connections, cluster=target.cluster,
                    replica_acks=target.replica_acks,
                    replica_ack_timeout_ms=target.replica_ack_timeout_ms)
        try:
            await store.ping()
            if not target.cluster:
                await store._refuse_cluster_node()
        except BaseException:
            await store.close()
            raise
        await store._warn_unless_persistent()
        return store

    async def ping(self) -> None:
        try:
            if isinstance(self._client, RedisCluster):
                await self._client.initialize()
            await self._client.ping()
        except BACKEND_ERRORS as error:
            raise StoreError(f"Redis at {redact(self.url)} unreachable: {error}") from error

    async def _refuse_cluster_node(self) -> None:
        try:
            info = await self._client.info("cluster")
        except RedisError:
            return  # INFO not allowed to this user: nothing to check
        if info.get("cluster_enabled") in (1, "1"):
            raise StoreError(
                f"Redis at {redact(self.url)} is a Redis Cluster node: use a "
                f"{'rediss' if self.url.startswith('rediss') else 'redis'}+cluster:// URL")

    async def _warn_unless_persistent(self) -> None:
        """One warning naming the servers that keep their data in memory only; never a
        failure (a store that cannot tell serves all the same)."""
        try:
            volatile = [name for name, settings in (await self._persistence()).items()
                        if settings.get("appendonly") != "yes" and not settings.get("save")]
        except BACKEND_ERRORS as error:
            log.info("store_persistence_unknown", url=redact(self.url),
                     detail=f"CONFIG GET refused ({error}): make sure Redis persists its "
                            "data, or a restart loses acknowledged retention directives")
            return
        if volatile:
            log.warning(
                "store_not_persistent", url=redact(self.url), nodes=volatile,
                risk="a Redis restart loses every acknowledged retention directive, job "
                     "history and tool statistic",
                fix="turn on persistence: appendonly yes (or a save schedule) in redis.conf, "
                    "or CONFIG SET appendonly yes and CONFIG REWRITE")

    async def _persistence(self) -> dict[str, dict[str, str]]:
        """Per server or cluster master (host:port), its ``appendonly`` and ``save``
        settings: a master's data is what a restart can lose."""
        names = ("appendonly", "save")
        if isinstance(self._client, RedisCluster):
            return {node.name: {name: _text((await self._client.config_get(
                        name, target_nodes=node)).get(name)) for name in names}
                    for node in self._client.get_primaries()}
        return {redact(self.url): {name: _text((await self._client.config_get(name)).get(name))
                                   for name in names}}

    async def close(self) -> None:
        if isinstance(self._client, RedisCluster):
            await self._client.aclose()
        else:
            await self._client.aclose(close_connection_pool=True)  # the pool is ours

    async def get(self, key: str) -> bytes | None:
        value = await self._call(lambda: self._client.get(key))
        return None if value is None else bytes(value)

    async def set(self, key: str, value: bytes, ttl_ms: int | None = None) -> None:
        await self._call(lambda: self._client.set(key, value, px=ttl_ms))

    async def delete(self, *keys: str) -> int:
        if not keys:
            return 0
        return int(await self._call(lambda: self._client.delete(*keys)))

    async def pttl(self, key: str) -> int | None:
        remaining = int(await self._call(lambda: self._client.pttl(key)))
        # -2: no such key; -1: no expiry.
        return None if remaining < 0 else remaining

    async def hincr(
        self, key: str, increments: Mapping[str, float], ttl_ms: int | None = None
    ) -> None:
        commands: list[Command] = [
            ("HINCRBYFLOAT", key, name, float(delta)) for name, delta in increments.items()]
        if ttl_ms is not None:
            commands.append(("PEXPIRE", key, ttl_ms))
        await self._atomic([key], (), lambda _values: (None, commands))

    async def hgetall(self, key: str) -> dict[str, float]:
        fields = await self._call(lambda: self._client.hgetall(key))
        return {name.decode(): float(value) for name, value in fields.items()}

    async def append_capped(
        self, key: str, item: bytes, max_len: int, ttl_ms: int | None = None
    ) -> None:
        commands: list[Command] = [("RPUSH", key, item), ("LTRIM", key, -max_len, -1)]
        if ttl_ms is not None:
            commands.append(("PEXPIRE", key, ttl_ms))
        await self._atomic([key], (), lambda _values: (None, commands))

    async def list_items(self, key: str) -> list[bytes]:
        items = await self._call(lambda: self._client.lrange(key, 0, -1))
        return [bytes(item) for item in items]

    async def scan(self, pattern: str, limit: int = 1000) -> list[str]:
        async def scan_all() -> list[str]:
            keys: list[str] = []
            # On a cluster, scan_iter walks every master in turn.
            async for key in self._client.scan_iter(match=pattern, count=500):
                keys.append(key.decode())
                if len(keys) >= limit:
                    break
            return keys

        return await self._call(scan_all)  # type: ignore[no-any-return]

    async def transact(self, keys: Sequence[str], rule: Rule[T]) -> T:
        declared = list(keys)

        def plan(values: list[bytes | None]) -> tuple[T, list[Command]]:
            current = {key: None if value is None else bytes(value)
                       for key, value in zip(declared, values, strict=True)}
            transition = rule(current)
            commands: list[Command] = []
            for key, write in transition.writes.items():
                if key not in current:
                    raise ValueError(f"rule wrote {key!r}, which it did not declare")
                if write.value is None:
                    commands.append(("DEL", key))
                elif write.ttl_ms is None:
                    commands.append(("SET", key, write.value))
                else:
                    commands.append(("SET", key, write.value, "PX", write.ttl_ms))
            return transition.result, commands

        return await self._atomic(declared, declared, plan, wait_for_replicas=True)

    # --- internals ----------------------------------------------------------------
    async def _atomic(self, keys: Sequence[str], watched: Sequence[str], plan: Plan[T],
                      wait_for_replicas: bool = False) -> T:
        """Run ``plan`` on the values of ``watched`` and its commands in MULTI/EXEC, on
        the connection of the server owning ``keys``; retry lost races and, on a
        cluster, topology changes."""
        if not keys:
            raise ValueError("an atomic store operation needs at least one key")
        if len({key_slot(key.encode()) for key in keys}) > 1:
            raise ValueError(f"keys {list(keys)} do not share a hash tag: one transition "
                             "must stay on one Redis Cluster slot (see sidecar.store.keys)")
        wait = self.replica_acks if wait_for_replicas else 0
        conflicts = failures = 0
        started_s = time.monotonic()
        while True:
            try:
                async with self._connections.limit(), \
                        self._connections.lease(keys[0]) as connection:
                    return await self._exchange(connection, watched, plan, wait)
            except _Conflict:
                conflicts += 1
                if conflicts >= self.MAX_TRANSACTION_ATTEMPTS:
                    raise TransactionConflict(
                        f"transition on {list(keys)} lost {conflicts} races in a row") from None
            except BACKEND_ERRORS as error:
                failures += 1
                if not await self._connections.recover(error, failures, started_s):
                    raise StoreError(f"Redis transaction failed: {error}") from error

    async def _exchange(self, connection: AbstractConnection, watched: Sequence[str], plan: Plan[T],
                        wait_replicas: int) -> T:
        """Two round trips: WATCH + GETs, then MULTI … EXEC (+ WAIT)."""
        values: list[bytes | None] = []
        if watched:
            await connection.send_packed_command(connection.pack_commands(
                [("WATCH", *watched), *(("GET", key) for key in watched)]))
            await connection.read_response()
            values = [await connection.read_response() for _ in watched]
        result, commands = plan(values)
        batch: list[Command] = [("MULTI",), *commands, ("EXEC",)]
        if wait_replicas:
            batch.append(("WAIT", wait_replicas, self.replica_ack_timeout_ms))
        await connection.send_packed_command(connection.pack_commands(batch))
        await connection.read_response()  # OK to MULTI
        for _ in commands:
            await connection.read_response()  # QUEUED, or an error raised here
        replies = await connection.read_response()
        acked = await connection.read_response() if wait_replicas else None
        if replies is None:
            raise _Conflict
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        if acked is not None and int(acked) < wait_replicas:
            self._unreplicated(commands, int(acked), wait_replicas)
        return result

    def _unreplicated(self, commands: list[Command], acked: int, wanted: int) -> None:
        self._unreplicated_writes += 1
        now_s = time.monotonic()
        if now_s - self._unreplicated_logged_s >= self.UNREPLICATED_LOG_INTERVAL_S:
            self._unreplicated_logged_s = now_s
            log.warning("store_write_unreplicated", key=str(commands[0][1]) if commands else "",
                        replicas_acked=acked, replicas_wanted=wanted,
                        timeout_ms=self.replica_ack_timeout_ms,
                        writes_so_far=self._unreplicated_writes)

    @property
    def unreplicated_writes(self) -> int:
        """Transitions acknowledged before ``replica_acks`` replicas confirmed them."""
        return self._unreplicated_writes

    async def _call(self, call: Callable[[], Awaitable[Any]]) -> Any:
        failures = 0
        started_s = time.monotonic()
        while True:
            try:
                async with self._connections.limit():
                    return await call()
            except BACKEND_ERRORS as error:
                failures += 1
                if not await self._connections.recover(error, failures, started_s):
                    raise StoreError(f"Redis call failed: {error}") from error


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


def _redact(url: str) -> str:
    """Kept for callers of the old name (``sidecar.config``)."""
    return redact(url)
