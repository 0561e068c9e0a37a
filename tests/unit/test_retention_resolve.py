"""A request's effective retention: its own directives resolved against those pushed for
its job or session, ownership applied; and the directory the decision path reads."""

from __future__ import annotations

import asyncio
import logging

import pytest

from sidecar.api.v1 import retention_pb2 as pb
from sidecar.retention.directives import StoredDirective, set_rule
from sidecar.retention.directory import RetentionDirectory
from sidecar.retention.resolve import RetentionResolver, resolve
from sidecar.store import EmbeddedStore, keys


def ranges(*spec: tuple[int, int | None, int]) -> pb.RetentionConfig:
    config = pb.RetentionConfig()
    for start, end, priority in spec:
        token_range = config.token_ranges.add(token_start=start, priority=priority)
        if end is not None:
            token_range.token_end = end
    return config


def pushed(config: pb.RetentionConfig, owner: str) -> StoredDirective:
    return StoredDirective(config=config, owner_scope=owner, updated_at_unix_s=0.0)


SYSTEM_AND_CONTEXT = ranges((0, 512, 100), (512, None, 80))


def test_nothing_anywhere_is_no_retention() -> None:
    assert resolve(None, "", []) is None


def test_pushed_directives_apply_with_their_owner() -> None:
    effective = resolve(None, "", [pushed(SYSTEM_AND_CONTEXT, "dynamo")])
    assert effective is not None
    assert effective.config == SYSTEM_AND_CONTEXT and effective.scope == "dynamo"


def test_a_requests_own_directives_apply_with_its_scope() -> None:
    effective = resolve(ranges((0, None, 60)), "agent-7", [])
    assert effective is not None and effective.scope == "agent-7"


def test_another_scope_can_only_raise_what_was_pushed() -> None:
    own = ranges((0, None, 10))  # tries to lower everything
    effective = resolve(own, "intruder", [pushed(SYSTEM_AND_CONTEXT, "dynamo")])
    assert effective is not None
    assert effective.config == SYSTEM_AND_CONTEXT and effective.scope == "dynamo"
    raised = resolve(ranges((0, None, 90)), "", [pushed(SYSTEM_AND_CONTEXT, "dynamo")])
    assert raised is not None
    assert [r.priority for r in raised.config.token_ranges] == [100, 90]


def test_the_owners_request_replaces_what_it_pushed() -> None:
    effective = resolve(ranges((0, None, 20)), "dynamo", [pushed(SYSTEM_AND_CONTEXT, "dynamo")])
    assert effective is not None
    assert effective.config == ranges((0, None, 20)) and effective.scope == "dynamo"


def test_invalid_request_directives_are_ignored_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    directory = RetentionDirectory(EmbeddedStore())
    directory.put("job:j1", pushed(SYSTEM_AND_CONTEXT, "dynamo"))
    resolver = RetentionResolver(directory, trust_request_scopes=True)
    with caplog.at_level(logging.WARNING):
        effective = resolver.for_request("r1", "j1", ranges((0, None, 101)), "dynamo")
    assert effective is not None and effective.config == SYSTEM_AND_CONTEXT
    assert resolver.for_request("r2", "j2", ranges((0, None, 101)), "") is None


def test_untrusted_request_scopes_count_as_anonymous() -> None:
    directory = RetentionDirectory(EmbeddedStore())
    directory.put("session:s1", pushed(SYSTEM_AND_CONTEXT, "dynamo"))
    resolver = RetentionResolver(directory, trust_request_scopes=False)
    # The request claims to be the owner, but auth is on: it cannot lower anything.
    effective = resolver.for_request("r1", "s1", ranges((0, None, 5)), "dynamo")
    assert effective is not None and effective.config == SYSTEM_AND_CONTEXT


def test_the_directory_moves_its_generation_only_on_a_change() -> None:
    directory = RetentionDirectory(EmbeddedStore())
    start = directory.generation
    directory.put("job:j", pushed(SYSTEM_AND_CONTEXT, "dynamo"))
    assert directory.generation == start + 1
    directory.put("job:j", pushed(SYSTEM_AND_CONTEXT, "dynamo"))
    assert directory.generation == start + 1
    directory.put("job:j", None)
    assert directory.generation == start + 2
    assert directory.for_job("j") == []


async def test_directives_set_elsewhere_are_fetched_from_the_store() -> None:
    store = EmbeddedStore()
    key = keys.retention_directive("session:shared")
    await store.transact([key], set_rule(key, "dynamo", SYSTEM_AND_CONTEXT, 0.0, None))
    directory = RetentionDirectory(store, refresh_s=60, fetch=True)
    generation = directory.generation
    assert directory.for_job("shared") == []  # not known yet: fetched in the background
    for _ in range(100):
        if directory.generation != generation:
            break
        await asyncio.sleep(0.01)
    found = directory.for_job("shared")
    assert [d.owner_scope for d in found] == ["dynamo"]
    await directory.close()


async def test_a_fetch_older_than_a_write_through_is_discarded() -> None:
    store = EmbeddedStore()
    key = keys.retention_directive("job:j")
    await store.transact([key], set_rule(key, "old", ranges((0, None, 50)), 0.0, None))
    directory = RetentionDirectory(store, refresh_s=0, fetch=True)
    directory.for_job("j")  # starts a fetch of the old value...
    directory.put("job:j", pushed(SYSTEM_AND_CONTEXT, "new"))  # ...overtaken by a write
    await asyncio.sleep(0.05)
    assert [d.owner_scope for d in directory.for_job("j")] == ["new"]
    await directory.close()


def test_retention_reason_says_what_set_the_priorities() -> None:
    dynamo = [pushed(SYSTEM_AND_CONTEXT, "dynamo")]
    sources = {
        "own only": resolve(ranges((0, None, 60)), "agent-7", []),
        "pushed only": resolve(None, "", dynamo),
        "both": resolve(ranges((0, None, 90)), "", dynamo),
        "owner replaces": resolve(ranges((0, None, 20)), "dynamo", dynamo),
    }
    said = {name: effective.source() for name, effective in sources.items()
            if effective is not None}
    assert said == {
        "own only": "the request's own directives (none pushed for its job or session)",
        "pushed only": "1 directive(s) pushed for its job or session (the request carried "
                       "none)",
        "both": "the request's own directives combined with 1 pushed for its job or "
                "session (per token, the highest priority wins)",
        "owner replaces": "the request's own directives, replacing the 1 its scope "
                          "'dynamo' pushed for its job or session",
    }


async def test_directives_fetched_for_passing_jobs_stay_within_the_job_bound() -> None:
    """On a shared store every job that passes is looked up (job and session): the
    cache keeps the targets of at most ``max_jobs`` jobs, not of every job seen."""
    store = EmbeddedStore()
    key = keys.retention_directive("job:job-999")
    await store.transact([key], set_rule(key, "dynamo", SYSTEM_AND_CONTEXT, 0.0, None))
    directory = RetentionDirectory(store, refresh_s=60, fetch=True, max_jobs=10)
    for index in range(1_000):
        directory.for_job(f"job-{index}")
        await asyncio.sleep(0)
    for _ in range(100):
        if not directory._fetching:
            break
        await asyncio.sleep(0.01)
    assert len(directory._entries) <= 2 * 10
    assert [d.owner_scope for d in directory.for_job("job-999")] == ["dynamo"]
    await directory.close()
