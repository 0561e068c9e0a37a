"""The store suite: the embedded backend and a real Redis must behave the same."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping

import pytest

from sidecar.store import Store, Transition, Write, keys


async def test_get_set_delete_round_trip(store: Store) -> None:
    key = keys.job_history("get-set")
    assert await store.get(key) is None
    await store.set(key, b"value")
    assert await store.get(key) == b"value"
    assert await store.delete(key, keys.job_history("never-set")) == 1
    assert await store.get(key) is None


async def test_values_expire_by_their_ttl(store: Store) -> None:
    key = keys.engine_pins("ttl")
    await store.set(key, b"pinned", ttl_ms=150)
    remaining = await store.pttl(key)
    assert remaining is not None and 0 < remaining <= 150
    await asyncio.sleep(0.3)
    assert await store.get(key) is None
    assert await store.pttl(key) is None


async def test_hincr_accumulates_and_refreshes_expiry(store: Store) -> None:
    key = keys.tool_stats("pytest")
    await store.hincr(key, {"count": 1, "sum_log_s": 0.5}, ttl_ms=60_000)
    await store.hincr(key, {"count": 1, "sum_log_s": 0.25, "b:3": 1}, ttl_ms=60_000)
    assert await store.hgetall(key) == {"count": 2.0, "sum_log_s": 0.75, "b:3": 1.0}
    assert await store.pttl(key) is not None
    assert await store.hgetall(keys.tool_stats("never")) == {}


async def test_concurrent_hincr_loses_no_update(store: Store) -> None:
    key = keys.tool_stats("concurrent")
    await asyncio.gather(*(store.hincr(key, {"count": 1, "sum": 0.5}) for _ in range(200)))
    assert await store.hgetall(key) == {"count": 200.0, "sum": 100.0}


async def test_append_capped_keeps_newest(store: Store) -> None:
    key = keys.job_history("capped")
    for index in range(10):
        await store.append_capped(key, str(index).encode(), max_len=4, ttl_ms=60_000)
    assert await store.list_items(key) == [b"6", b"7", b"8", b"9"]
    assert await store.list_items(keys.job_history("empty")) == []


async def test_scan_finds_keys_of_one_kind(store: Store) -> None:
    for tool in ("ls", "cat", "we{ird}:tool"):
        await store.hincr(keys.tool_stats(tool), {"count": 1})
    await store.set(keys.job_history("other-kind"), b"x")
    found = await store.scan(keys.pattern_for("stats"))
    assert sorted(found) == sorted(keys.tool_stats(t) for t in ("ls", "cat", "we{ird}:tool"))


def _claim(owner: str) -> Callable[[Mapping[str, bytes | None]], Transition[str]]:
    """A rule: take the key if nobody holds it; report who holds it."""

    def rule(current: Mapping[str, bytes | None]) -> Transition[str]:
        key = keys.retention_directive("race")
        holder = current[key]
        if holder is not None:
            return Transition(result=holder.decode())
        return Transition(result=owner, writes={key: Write(owner.encode(), ttl_ms=60_000)})

    return rule


async def test_transact_applies_the_rule_atomically(store: Store) -> None:
    key = keys.retention_directive("race")
    winners = await asyncio.gather(
        *(store.transact([key], _claim(f"scope-{i}")) for i in range(20))
    )
    # Exactly one claim won and every caller saw the same winner.
    assert len(set(winners)) == 1
    assert await store.get(key) == winners[0].encode()


async def test_transact_deletes_and_counts(store: Store) -> None:
    key = keys.retention_directive("counter")

    def increment(current: dict[str, bytes | None]) -> Transition[int]:
        value = json.loads(current[key] or b"0") + 1
        return Transition(result=value, writes={key: Write(json.dumps(value).encode())})

    results = await asyncio.gather(*(store.transact([key], increment) for _ in range(25)))
    assert sorted(results) == list(range(1, 26))

    def clear(current: dict[str, bytes | None]) -> Transition[bool]:
        return Transition(result=current[key] is not None, writes={key: Write(None)})

    assert await store.transact([key], clear) is True
    assert await store.get(key) is None


async def test_transact_refuses_undeclared_writes(store: Store) -> None:
    declared = keys.retention_directive("declared")

    def sneaky(current: dict[str, bytes | None]) -> Transition[None]:
        return Transition(result=None, writes={keys.retention_directive("other"): Write(b"x")})

    with pytest.raises(ValueError, match="did not declare"):
        await store.transact([declared], sneaky)
    assert await store.get(keys.retention_directive("other")) is None


async def test_keys_escape_hash_tags() -> None:
    # A job id cannot break out of its hash tag or collide with another job's key.
    assert keys.job_history("a}:{b") != keys.job_history("a:b")
    tag = keys.job_history("a}:{b").split("{", 1)[1].split("}", 1)[0]
    assert "{" not in tag and "}" not in tag
