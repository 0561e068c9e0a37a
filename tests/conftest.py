"""Shared fixtures: a real Redis for the session, and the store under test on both backends."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from sidecar.store import EmbeddedStore, Store
from sidecar.store.redis_store import RedisStore
from tests.support.redis_cluster import clean_redis_cluster, redis_cluster_url  # noqa: F401
from tests.support.redis_server import provide_redis_url


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with provide_redis_url() as url:
        yield url


@pytest.fixture
def clean_redis(redis_url: str) -> str:
    """The session's Redis, emptied before the test."""
    redis.Redis.from_url(redis_url).flushdb()
    return redis_url


@pytest.fixture(params=["embedded", "redis", "redis-cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    """The store under test, once per backend: all must behave the same."""
    if request.param == "embedded":
        yield EmbeddedStore()
        return
    url = request.getfixturevalue(
        "clean_redis_cluster" if request.param == "redis-cluster" else "clean_redis")
    backend = await RedisStore.connect(url)
    try:
        yield backend
    finally:
        await backend.close()
