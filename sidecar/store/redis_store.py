"""The Redis backend: state shared by every daemon replica and outliving each of them.

Atomicity, per operation:
- ``hincr`` / ``append_capped``: one MULTI/EXEC pipeline (HINCRBYFLOAT…, PEXPIRE;
  RPUSH, LTRIM, PEXPIRE). Increments commute, so concurrent writers lose nothing.
- ``transact``: WATCH the keys, read them, run the rule (the same Python function the
  embedded backend runs), MULTI/EXEC its writes; on a concurrent change, retry.
Keys of one transition share a hash tag (``sidecar.store.keys``), so the same code
runs on Redis Cluster.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError

from sidecar.store.base import Rule, StoreError, TransactionConflict

T = TypeVar("T")


class RedisStore:
    backend_name = "redis"

    # Optimistic transitions retried this many times before giving up: enough for
    # a handful of daemons racing on one key.
    MAX_TRANSACTION_ATTEMPTS = 32

    def __init__(self, client: aioredis.Redis, url: str) -> None:
        self._client = client
        self.url = url

    @classmethod
    async def connect(
        cls, url: str, timeout_s: float = 2.0, max_connections: int = 32
    ) -> RedisStore:
        """Connect and ping; raise StoreError naming the URL if Redis does not answer."""
        try:
            # A blocking pool: under a burst, callers wait for a connection
            # instead of failing with "Too many connections".
            pool = aioredis.BlockingConnectionPool.from_url(
                url,
                max_connections=max_connections,
                timeout=timeout_s,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
            )
            client = aioredis.Redis(connection_pool=pool)
        except (ValueError, RedisError) as error:
            raise StoreError(f"bad Redis URL {_redact(url)!r}: {error}") from error
        store = cls(client, url)
        await store.ping()
        return store

    async def ping(self) -> None:
        try:
            await self._client.ping()
        except (RedisError, OSError) as error:
            raise StoreError(f"Redis at {_redact(self.url)} unreachable: {error}") from error

    async def close(self) -> None:
        await self._client.aclose()

    async def get(self, key: str) -> bytes | None:
        value = await self._call(self._client.get(key))
        return None if value is None else bytes(value)

    async def set(self, key: str, value: bytes, ttl_ms: int | None = None) -> None:
        await self._call(self._client.set(key, value, px=ttl_ms))

    async def delete(self, *keys: str) -> int:
        if not keys:
            return 0
        return int(await self._call(self._client.delete(*keys)))

    async def pttl(self, key: str) -> int | None:
        remaining = int(await self._call(self._client.pttl(key)))
        # -2: no such key; -1: no expiry.
        return None if remaining < 0 else remaining

    async def hincr(
        self, key: str, increments: Mapping[str, float], ttl_ms: int | None = None
    ) -> None:
        async with self._client.pipeline(transaction=True) as pipe:
            for name, delta in increments.items():
                pipe.hincrbyfloat(key, name, float(delta))
            if ttl_ms is not None:
                pipe.pexpire(key, ttl_ms)
            await self._call(pipe.execute())

    async def hgetall(self, key: str) -> dict[str, float]:
        fields = await self._call(self._client.hgetall(key))
        return {name.decode(): float(value) for name, value in fields.items()}

    async def append_capped(
        self, key: str, item: bytes, max_len: int, ttl_ms: int | None = None
    ) -> None:
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.rpush(key, item)
            pipe.ltrim(key, -max_len, -1)
            if ttl_ms is not None:
                pipe.pexpire(key, ttl_ms)
            await self._call(pipe.execute())

    async def list_items(self, key: str) -> list[bytes]:
        return [bytes(item) for item in await self._call(self._client.lrange(key, 0, -1))]

    async def scan(self, pattern: str, limit: int = 1000) -> list[str]:
        keys: list[str] = []
        try:
            async for key in self._client.scan_iter(match=pattern, count=500):
                keys.append(key.decode())
                if len(keys) >= limit:
                    break
        except (RedisError, OSError) as error:
            raise StoreError(f"Redis scan failed: {error}") from error
        return keys

    async def transact(self, keys: Sequence[str], rule: Rule[T]) -> T:
        for _ in range(self.MAX_TRANSACTION_ATTEMPTS):
            try:
                async with self._client.pipeline(transaction=True) as pipe:
                    await pipe.watch(*keys)
                    values = [await pipe.get(key) for key in keys]
                    current: dict[str, bytes | None] = {
                        key: None if value is None else _as_bytes(value)
                        for key, value in zip(keys, values, strict=True)
                    }
                    transition = rule(current)
                    pipe.multi()  # type: ignore[no-untyped-call]
                    for key, write in transition.writes.items():
                        if key not in current:
                            raise ValueError(f"rule wrote {key!r}, which it did not declare")
                        if write.value is None:
                            pipe.delete(key)
                        else:
                            pipe.set(key, write.value, px=write.ttl_ms)
                    await pipe.execute()
                    return transition.result
            except WatchError:
                continue
            except (RedisError, OSError) as error:
                raise StoreError(f"Redis transaction failed: {error}") from error
        raise TransactionConflict(
            f"transition on {list(keys)} lost {self.MAX_TRANSACTION_ATTEMPTS} races in a row"
        )

    async def _call(self, awaitable: Any) -> Any:
        try:
            return await awaitable
        except (RedisError, OSError) as error:
            raise StoreError(f"Redis call failed: {error}") from error


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    credentials, _, host = rest.rpartition("@")
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user + ':***' if user else '***'}@{host}"
