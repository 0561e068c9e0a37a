"""Finished turns kept cached, not held, while the daemon decides on a pin — on vLLM's
real block pool: free for any allocation, evicted after every other free block, taken
back (what is left of them) by a PIN, lowered by a RELEASE."""

from __future__ import annotations

from typing import Any

from sidecar.api.retention_ranges import Protection
from tests.support.engine import requires_vllm
from tests.unit.test_retention_pool import (
    Clock,
    allocation_order,
    free,
    retain,
    retention,
    retention_pool,
    sequence,
    still_cached,
)

pytestmark = requires_vllm


def cached_pool(num_blocks: int) -> tuple[Clock, Any, Any]:
    """A clock, a block pool with retention on that clock, and its provisional cache."""
    from vllm_plugin.provisional import ProvisionalCache

    clock = Clock()
    pool = retention_pool(num_blocks, clock)
    return clock, pool, ProvisionalCache(retention(pool), clock)


def finished(pool: Any, provisional: Any, blocks: int, request_id: str = "t1") -> Any:
    """A finished turn, kept provisionally (2 s bound), then freed as vLLM frees it."""
    seq = sequence(pool, blocks)
    assert provisional.keep(request_id, "job", seq.blocks, 2.0, last_sched_seq=0, tool="ls")
    free(seq)
    return seq


def test_a_kept_turn_is_free_and_evicted_after_every_other_free_block() -> None:
    _clock, pool, provisional = cached_pool(12)
    kept = finished(pool, provisional, 3)
    other = sequence(pool, 2)
    free(other)
    assert pool.get_num_free_blocks() == 11, "nothing held: every allocation may take it"
    order = allocation_order(pool)
    assert order[-3:] == list(reversed(kept.ids)), "the kept turn goes last, tail first"
    assert set(other.ids) < set(order[:-3])


def test_a_pin_takes_back_the_prefix_still_cached() -> None:
    _clock, pool, provisional = cached_pool(8)
    kept = finished(pool, provisional, 4)
    # Everything else and the kept turn's tail block are allocated to others.
    taken = pool.get_new_blocks(pool.get_num_free_blocks() - 3)
    assert kept.blocks[-1] in taken and still_cached(kept) == 3
    pinned = provisional.take("t1")
    assert pinned == kept.blocks[:3]
    assert all(block.ref_cnt == 1 for block in pinned), "held by the pin now"
    assert pool.get_num_free_blocks() == 0
    assert all(retention(pool).entry(b.block_id) is None for b in pinned), (
        "the provisional priority is gone: the pin's release decides what follows")
    assert provisional.take("t1") is None, "decided once"


def test_a_pin_finds_nothing_when_the_head_was_evicted() -> None:
    _clock, pool, provisional = cached_pool(5)  # one is vLLM's null block
    finished(pool, provisional, 4)
    pool.get_new_blocks(4)
    assert provisional.take("t1") == []


def test_a_release_lowers_the_turn_to_the_policys_priority_or_vllms() -> None:
    _clock, pool, provisional = cached_pool(12)
    soft = finished(pool, provisional, 2, "soft")
    plain = finished(pool, provisional, 2, "plain")
    assert provisional.release("soft", Protection(60))
    assert provisional.release("plain")
    handle = retention(pool)
    assert {handle.queued_priority(b.block_id) for b in soft.blocks} == {60}
    assert all(handle.entry(b.block_id).owner == "" for b in soft.blocks), (
        "the policy's soft retention, anonymous as for a held pin")
    assert {handle.queued_priority(b.block_id) for b in plain.blocks} == {None}
    assert all(handle.entry(b.block_id) is None for b in plain.blocks)
    order = allocation_order(pool)
    assert order[-2:] == list(reversed(soft.ids)), "kept at 60, evicted last"
    assert not provisional.release("plain"), "released once"


def test_the_bound_drops_the_priority_and_the_turn() -> None:
    clock, pool, provisional = cached_pool(6)
    kept = finished(pool, provisional, 2)
    clock.now_s += 1.0
    assert provisional.expire(clock()) == 0, "within the bound"
    clock.now_s += 1.5
    assert provisional.expire(clock()) == 1 and not provisional.waiting
    assert all(retention(pool).entry(b.block_id) is None for b in kept.blocks)
    # Lowered to the most recently used end of vLLM's queue, tail first.
    assert allocation_order(pool)[-2:] == list(reversed(kept.ids))


def test_blocks_another_scope_protects_are_not_kept() -> None:
    _clock, pool, provisional = cached_pool(6)
    seq = sequence(pool, 2)
    retain(seq, 70, scope="tenant")
    assert not provisional.keep("t1", "job", seq.blocks, 2.0, last_sched_seq=0, tool="")
    assert not provisional.waiting
    assert all(retention(pool).entry(b.block_id).owner == "tenant" for b in seq.blocks)


def test_a_turn_reusing_a_soft_retained_prefix_is_kept() -> None:
    # The policy soft-retained the previous turn (anonymous); this turn hit those
    # blocks and finished: the plugin takes them over, and a release re-sets them.
    _clock, pool, provisional = cached_pool(8)
    seq = sequence(pool, 2)
    retain(seq, 60, scope="")
    assert provisional.keep("t2", "job", seq.blocks, 2.0, last_sched_seq=0, tool="")
    free(seq)
    from vllm_plugin.provisional import PROVISIONAL_PRIORITY, SCOPE

    handle = retention(pool)
    assert {handle.queued_priority(b.block_id) for b in seq.blocks} == {PROVISIONAL_PRIORITY}
    assert {handle.entry(b.block_id).owner for b in seq.blocks} == {SCOPE}
    assert provisional.release("t2", Protection(50))
    assert {handle.queued_priority(b.block_id) for b in seq.blocks} == {50}
