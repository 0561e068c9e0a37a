"""The state store: one interface, two backends (embedded, Redis) with the same behaviour.

Why this shape: every atomic rule kvtether needs is expressed either as one of a few
primitive operations whose atomicity both backends provide natively (commutative
hash increments, capped list appends, TTL'd values), or as a pure Python *rule*
passed to :meth:`Store.transact`. The embedded backend applies a rule under its lock;
the Redis backend applies the very same function inside WATCH/MULTI/EXEC with
retries. So each rule has exactly one implementation, and nothing can drift between
a Lua script and a Python copy of it.

Contracts:
- keys come from ``sidecar.store.keys`` only;
- every key a transition touches shares one hash tag (one Redis Cluster slot);
- ``ttl_ms`` of ``None`` means "no expiry"; expiry is the backend's (PEXPIRE), never a
  sweeper loop;
- values are bytes; callers own their encoding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")


class StoreError(RuntimeError):
    """The backend failed (connection lost, timeout, protocol error)."""


class TransactionConflict(StoreError):
    """A transition kept losing its race and gave up after its retries."""


@dataclass(frozen=True, slots=True)
class Write:
    """One key's new value after a transition; ``value=None`` deletes the key."""

    value: bytes | None
    ttl_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Transition(Generic[T]):
    """What a rule decided: the writes to apply atomically and the value to return."""

    result: T
    writes: Mapping[str, Write] = field(default_factory=dict)


# A rule sees the current values of its keys (None when absent) and decides.
Rule = Callable[[Mapping[str, bytes | None]], Transition[T]]


class Store(Protocol):
    """Async state store. Both backends pass ``tests/integration/test_store.py``."""

    backend_name: str

    async def ping(self) -> None:
        """Raise StoreError if the backend cannot be reached."""
        ...

    async def close(self) -> None: ...

    async def get(self, key: str) -> bytes | None: ...

    async def set(self, key: str, value: bytes, ttl_ms: int | None = None) -> None: ...

    async def delete(self, *keys: str) -> int:
        """Delete keys; return how many existed."""
        ...

    async def pttl(self, key: str) -> int | None:
        """Remaining time to live in ms; None when the key has no expiry or is absent."""
        ...

    async def hincr(
        self, key: str, increments: Mapping[str, float], ttl_ms: int | None = None
    ) -> None:
        """Add each increment to its hash field, all at once (no lost update between
        concurrent writers), then (re)set the key's expiry."""
        ...

    async def hgetall(self, key: str) -> dict[str, float]:
        """All fields of a hash written by :meth:`hincr`; {} when absent."""
        ...

    async def append_capped(
        self, key: str, item: bytes, max_len: int, ttl_ms: int | None = None
    ) -> None:
        """Append to a list, keep only its newest ``max_len`` items, (re)set expiry."""
        ...

    async def list_items(self, key: str) -> list[bytes]:
        """The whole list, oldest first; [] when absent."""
        ...

    async def scan(self, pattern: str, limit: int = 1000) -> list[str]:
        """Up to ``limit`` keys matching a glob pattern (for inspection, never the hot path)."""
        ...

    async def transact(self, keys: Sequence[str], rule: Rule[T]) -> T:
        """Read ``keys``, run ``rule``, apply its writes atomically, return its result.
        Retries on a concurrent change; raises TransactionConflict if it keeps losing."""
        ...
