"""State store: one interface (``base.Store``), an embedded and a Redis backend."""

from __future__ import annotations

from sidecar.store.base import Store, StoreError, TransactionConflict, Transition, Write
from sidecar.store.embedded import DEFAULT_MAX_HISTORIES, EmbeddedStore


async def open_store(redis_url: str | None, timeout_s: float = 2.0,
                     embedded_max_histories: int = DEFAULT_MAX_HISTORIES) -> Store:
    """The Redis backend when a URL is given (connected and pinged), else embedded
    (keeping at most ``embedded_max_histories`` job histories and tool statistics).
    A ``redis+cluster://`` URL selects Redis Cluster (``sidecar.store.redis_url``).

    Raises StoreError naming the URL when Redis does not answer: a daemon configured
    for Redis must not silently run on a private store.
    """
    if not redis_url:
        return EmbeddedStore(max_histories=embedded_max_histories)
    from sidecar.store.redis_store import RedisStore

    return await RedisStore.connect(redis_url, timeout_s=timeout_s)


__all__ = [
    "EmbeddedStore",
    "Store",
    "StoreError",
    "TransactionConflict",
    "Transition",
    "Write",
    "open_store",
]
