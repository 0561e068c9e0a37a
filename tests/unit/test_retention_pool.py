"""Retention priorities on vLLM's REAL block pool (vllm.v1.core.block_pool.BlockPool).

Mirrors the vLLM retention PR's test plan — ordering contract, lazy removal on reuse,
expiry, ownership, sidecar lifecycle, stale heap entries — plus what the PR lacked: a
proof that with no directive the pool is vLLM's LRU bit for bit (same operations on a
plain pool), and a model check of the ordering on random operation sequences.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from sidecar.api.retention_ranges import Protection
from tests.support.engine import requires_vllm

pytestmark = requires_vllm

BLOCK = 4


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def plain_pool(num_blocks: int = 16) -> Any:
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(num_blocks, enable_caching=True, hash_block_size=BLOCK)


def retention_pool(num_blocks: int = 16, clock: Clock | None = None) -> Any:
    from vllm_plugin.retention import install

    pool = plain_pool(num_blocks)
    assert install(pool, clock_s=clock or Clock()) is pool.kvtether_retention
    return pool


def retention(pool: Any) -> Any:
    """The pool's retention handle (the pool itself is vLLM's class while idle)."""
    return pool.kvtether_retention


_requests = 0


@dataclass
class Seq:
    """A request's blocks in the pool: allocated, filled, cached (hashed) like vLLM's
    KV cache manager does for full blocks."""

    pool: Any
    request: Any
    blocks: list[Any] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


def sequence(pool: Any, num_blocks: int, cached: bool = True, tokens: Sequence[int] = ()) -> Seq:
    from tests.support.scheduler import make_request

    global _requests
    _requests += 1
    prompt = list(tokens) or [_requests * 100_000 + i for i in range(num_blocks * BLOCK)]
    request = make_request(f"r{_requests}", prompt, max_tokens=1, block_size=BLOCK)
    blocks = pool.get_new_blocks(num_blocks)
    if cached:
        pool.cache_full_blocks(request, blocks, num_cached_blocks=0, num_full_blocks=num_blocks,
                               block_size=BLOCK, kv_cache_group_id=0)
    return Seq(pool, request, blocks)


def retain(seq: Seq, priority: int, duration_s: float | None = None, scope: str = "s") -> None:
    protections = [Protection(priority, duration_s)] * len(seq.blocks)
    retention(seq.pool).retain(seq.blocks, protections, scope)


def free(seq: Seq) -> None:
    # vLLM frees a request's blocks tail first.
    seq.pool.free_blocks(reversed(seq.blocks))


def hit(seq: Seq) -> list[Any]:
    """A later request with the same prefix: vLLM looks the blocks up and touches them."""
    found = []
    for block_hash in seq.request.block_hashes[: len(seq.blocks)]:
        cached = seq.pool.get_cached_block(block_hash, [0])
        if cached is None:
            break
        found.append(cached[0])
    seq.pool.touch(found)
    return found


def still_cached(seq: Seq) -> int:
    """How many of the sequence's leading blocks a new request would hit."""
    count = 0
    for block_hash in seq.request.block_hashes[: len(seq.blocks)]:
        if seq.pool.get_cached_block(block_hash, [0]) is None:
            break
        count += 1
    return count


def allocation_order(pool: Any) -> list[int]:
    """The order in which the pool would hand out its free blocks (allocates them all;
    the pool is left empty)."""
    return [b.block_id for b in pool.get_new_blocks(pool.get_num_free_blocks())]


# --- with no directive, vLLM's LRU bit for bit -------------------------------------
def _run_operations(pool: Any, seed: int, with_default_retains: bool) -> list[object]:
    """Random allocations, caching, frees (single and deferred with duplicates),
    prefix hits, hash evictions and resets; returns everything observable."""
    rng = random.Random(seed)
    live: list[Seq] = []
    freed: list[Seq] = []
    seen: list[object] = []
    for _ in range(400):
        op = rng.random()
        free_count = pool.get_num_free_blocks()
        if op < 0.35 and free_count > 0:
            seq = sequence(pool, rng.randint(1, min(4, free_count)), cached=rng.random() < 0.8)
            live.append(seq)
            seen.append(("alloc", seq.ids))
        elif op < 0.6 and live:
            seq = live.pop(rng.randrange(len(live)))
            seconds, scope = rng.choice([None, 5.0]), rng.choice(["", "a"])  # drawn in both runs
            if with_default_retains:
                retain(seq, 35, seconds, scope)
            free(seq)
            freed.append(seq)
        elif op < 0.7 and len(live) >= 2:
            # A deferred free of two requests at once (may repeat shared blocks).
            a, b = live.pop(), live.pop()
            pool.free_blocks(list(reversed(a.blocks)) + list(reversed(b.blocks)))
            freed += [a, b]
        elif op < 0.85 and freed:
            seq = rng.choice(freed)
            touched = hit(seq)
            seen.append(("hit", [b.block_id for b in touched]))
            if touched:
                live.append(Seq(pool, seq.request, touched))
        elif op < 0.9 and pool.get_num_free_blocks() < pool.num_gpu_blocks - 1:
            pool.evict_blocks({rng.randrange(1, pool.num_gpu_blocks)})
        elif op < 0.92 and not live:
            seen.append(("reset", pool.reset_prefix_cache()))
        seen.append(("free", pool.get_num_free_blocks(),
                     [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]))
    return seen


@pytest.mark.parametrize("seed", range(6))
def test_no_directive_is_vllms_lru_bit_for_bit(seed: int) -> None:
    from vllm.v1.core.block_pool import BlockPool

    plain = _run_operations(plain_pool(24), seed, with_default_retains=False)
    retained = retention_pool(24)
    assert _run_operations(retained, seed, with_default_retains=True) == plain
    assert retention(retained).num_retained_entries == 0
    # Not just the same results: the very same code (vLLM's class, nothing in between).
    assert type(retained) is BlockPool


def test_the_scheduler_pool_is_converted_in_place(tmp_path: Any) -> None:
    from vllm.v1.core.block_pool import BlockPool

    from tests.support.engine import tiny_model_dir
    from tests.support.scheduler import build_scheduler
    from vllm_plugin.retention import RetentionBlockPool, install

    scheduler = build_scheduler(tiny_model_dir(), num_blocks=32, block_size=BLOCK)
    pool = scheduler.kv_cache_manager.block_pool
    handle = install(pool, Clock())
    assert handle is not None and install(pool, Clock()) is handle  # idempotent
    assert type(pool) is BlockPool and not handle.active  # vLLM's own, until needed
    seq = sequence(pool, 2)
    retain(seq, 90)
    assert type(pool) is RetentionBlockPool and handle.active
    # Every manager holds the same object: they all see the priorities.
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        assert manager.block_pool is pool
    free(seq)
    pool.get_new_blocks(pool.get_num_free_blocks())  # evicts the protected blocks too
    assert type(pool) is BlockPool and not handle.active


# --- the ordering contract ---------------------------------------------------------
def test_lower_priority_goes_first_ties_least_recently_freed() -> None:
    pool = retention_pool(12)
    uncached = sequence(pool, 1, cached=False)
    high_old, low, default, high_new = (sequence(pool, 2) for _ in range(4))
    retain(high_old, 80)
    retain(low, 10)
    retain(high_new, 80)
    for seq in (high_old, low, default, high_new, uncached):
        free(seq)
    never_used = list(range(1 + 9, 12))  # blocks no request took yet (no hash)
    assert allocation_order(pool) == (
        uncached.ids + never_used
        + list(reversed(low.ids))            # priority 10, tail block first
        + list(reversed(default.ids))        # vLLM's queue: the default 35
        + list(reversed(high_old.ids))       # priority 80, least recently freed first
        + list(reversed(high_new.ids))
    )


def test_free_count_and_usage_include_prioritized_blocks() -> None:
    pool = retention_pool(10)
    seq = sequence(pool, 4)
    retain(seq, 90)
    assert pool.get_num_free_blocks() == 5
    free(seq)
    assert pool.get_num_free_blocks() == 9
    assert pool.get_usage() == 0.0
    assert retention(pool).queued_priority(seq.ids[0]) == 90


def test_protected_blocks_survive_what_evicts_everything_else() -> None:
    pool = retention_pool(16)
    system, context = sequence(pool, 2), sequence(pool, 3)
    retain(system, 100)
    retain(context, 80, duration_s=45)
    free(system)
    free(context)
    # A flood of unrelated requests cycles through the rest of the pool many times.
    for _ in range(20):
        flood = sequence(pool, 5)
        free(flood)
    assert still_cached(system) == 2 and still_cached(context) == 3
    # Under real pressure, the lower priority gives way first.
    sequence(pool, pool.get_num_free_blocks() - 2)
    assert still_cached(system) == 2 and still_cached(context) == 0


# --- reuse (lazy removal) ----------------------------------------------------------
def test_a_reused_block_leaves_the_priority_structure_and_keeps_its_entry() -> None:
    pool = retention_pool(10)
    seq = sequence(pool, 2)
    retain(seq, 70)
    free(seq)
    free_before = pool.get_num_free_blocks()
    touched = hit(seq)
    assert [b.block_id for b in touched] == seq.ids
    assert pool.get_num_free_blocks() == free_before - 2
    assert all(retention(pool).queued_priority(i) is None for i in seq.ids)
    assert retention(pool).entry(seq.ids[0]).protection == Protection(70)
    # Freed again (by the request that hit them), they are queued at 70 again.
    pool.free_blocks(reversed(touched))
    assert [retention(pool).queued_priority(i) for i in seq.ids] == [70, 70]
    assert pool.get_num_free_blocks() == free_before


def test_a_block_held_by_two_requests_is_queued_once_when_both_free_it() -> None:
    pool = retention_pool(8)
    seq = sequence(pool, 2)
    retain(seq, 60)
    other = hit(seq)  # a second request shares both blocks
    pool.free_blocks(list(reversed(seq.blocks)) + list(reversed(other)))  # deferred frees
    assert [retention(pool).queued_priority(i) for i in seq.ids] == [60, 60]
    assert all(b.ref_cnt == 0 for b in seq.blocks)
    assert pool.get_num_free_blocks() == 7


# --- expiry ------------------------------------------------------------------------
def test_an_expired_block_falls_back_to_the_default_at_the_recent_end() -> None:
    clock = Clock()
    pool = retention_pool(10, clock)
    default_old, expiring, default_new = sequence(pool, 2), sequence(pool, 2), sequence(pool, 2)
    retain(expiring, 90, duration_s=10)
    free(default_old)
    free(expiring)
    free(default_new)
    clock.now_s += 9.9
    assert retention(pool).queued_priority(expiring.ids[0]) == 90
    sequence(pool, 3, cached=False)  # takes blocks never used; expiry not reached yet
    clock.now_s += 0.2
    # Reverted to 35 and moved to the most recently used end (TensorRT-LLM's refresh).
    assert allocation_order(pool) == (list(reversed(default_old.ids))
                                      + list(reversed(default_new.ids))
                                      + list(reversed(expiring.ids)))
    assert retention(pool).entry(expiring.ids[0]) is None


def test_duration_counts_from_when_the_block_is_freed() -> None:
    clock = Clock()
    pool = retention_pool(8, clock)
    seq = sequence(pool, 2)
    retain(seq, 90, duration_s=10)
    clock.now_s += 100  # in use all this time: the clock has not started
    free(seq)
    clock.now_s += 9
    assert retention(pool).queued_priority(seq.ids[0]) == 90
    clock.now_s += 1
    pool.get_new_blocks(1)  # any allocation applies expiries
    assert retention(pool).queued_priority(seq.ids[0]) is None
    assert retention(pool).entry(seq.ids[0]) is None


def test_a_stale_expiry_never_demotes_a_block_freed_again() -> None:
    """The PR's generation-counter bug: a block freed at one priority, reused, and
    freed again at another must be ordered by its current priority only."""
    clock = Clock()
    pool = retention_pool(10, clock)
    seq = sequence(pool, 1)
    retain(seq, 50, duration_s=5)
    free(seq)
    touched = hit(seq)  # reused...
    retention(pool).retain(touched, [Protection(90)], "s")  # ...re-protected by its owner, forever
    pool.free_blocks(touched)
    middle = sequence(pool, 1)
    retain(middle, 60)
    free(middle)
    clock.now_s += 6  # the first free's expiry is due: it must not touch the block
    pool.get_new_blocks(pool.get_num_free_blocks() - 2)  # every default block
    assert pool.get_new_blocks(1)[0].block_id == middle.ids[0]  # 60 before 90
    assert retention(pool).queued_priority(seq.ids[0]) == 90


def test_a_stale_queue_entry_cannot_evict_under_an_old_priority() -> None:
    pool = retention_pool(10)
    protected = sequence(pool, 1)
    retain(protected, 50)
    free(protected)
    touched = hit(protected)
    retention(pool).retain(touched, [Protection(90)], "s")
    pool.free_blocks(touched)
    later = sequence(pool, 1)
    retain(later, 60)
    free(later)
    order = allocation_order(pool)
    assert order.index(later.ids[0]) < order.index(protected.ids[0])


# --- the side table's lifecycle ----------------------------------------------------
def test_reallocation_clears_the_entry() -> None:
    pool = retention_pool(6)
    seq = sequence(pool, 2)
    retain(seq, 80)
    free(seq)
    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    assert {b.block_id for b in taken} >= set(seq.ids)
    assert retention(pool).num_retained_entries == 0
    pool.free_blocks(taken)  # freed again, never retained: plain vLLM
    assert retention(pool).queued_priority(seq.ids[0]) is None


def test_evict_blocks_drops_the_entry_and_the_block_goes_first() -> None:
    pool = retention_pool(8)
    seq, other = sequence(pool, 2), sequence(pool, 2)
    retain(seq, 80)
    free(other)
    free(seq)
    pool.evict_blocks({seq.ids[1]})
    assert retention(pool).entry(seq.ids[1]) is None
    assert retention(pool).entry(seq.ids[0]) is not None
    assert allocation_order(pool)[0] == seq.ids[1]


def test_reset_prefix_cache_clears_the_table() -> None:
    pool = retention_pool(8)
    seq = sequence(pool, 3)
    retain(seq, 80, duration_s=30)
    in_use = sequence(pool, 1)
    retain(in_use, 90)
    assert not pool.reset_prefix_cache()  # a block is in use: vLLM refuses, nothing changes
    assert retention(pool).num_retained_entries == 4
    free(seq)
    free(in_use)
    assert pool.reset_prefix_cache()
    assert retention(pool).num_retained_entries == 0
    assert all(retention(pool).queued_priority(i) is None for i in range(8))
    assert pool.get_num_free_blocks() == 7
    assert len(pool.free_block_queue.get_all_free_blocks()) == 7


def test_an_uncached_block_is_never_queued() -> None:
    pool = retention_pool(6)
    seq = sequence(pool, 2, cached=False)
    retain(seq, 100)
    free(seq)
    assert retention(pool).num_retained_entries == 0
    assert allocation_order(pool)[:2] == list(reversed(seq.ids))


# --- priorities that arrive after the request freed its blocks ---------------------
def test_late_priorities_apply_to_blocks_still_holding_the_content() -> None:
    pool = retention_pool(12)
    seq = sequence(pool, 3)
    hashes = [b.block_hash for b in seq.blocks]
    free(seq)  # freed the vLLM way: into its LRU queue
    reused = hit(Seq(pool, seq.request, seq.blocks[:1]))  # block 0: another request's now
    evicted = seq.blocks[2]
    pool.evict_blocks({evicted.block_id})  # block 2: lost its content
    free_before = pool.get_num_free_blocks()
    changed = retention(pool).retain_freed(seq.blocks, hashes, [Protection(90)] * 3, "s")
    assert changed == 2
    assert retention(pool).entry(reused[0].block_id) is not None  # tagged for its next free
    assert retention(pool).queued_priority(seq.ids[1]) == 90      # moved to its priority's queue
    assert retention(pool).entry(evicted.block_id) is None
    assert retention(pool).queued_priority(evicted.block_id) is None
    assert pool.get_num_free_blocks() == free_before
    # Lowered back to the default by its owner: back to vLLM's queue, still free.
    retention(pool).retain_freed(seq.blocks[1:2], hashes[1:2], [Protection(35)], "s")
    assert retention(pool).queued_priority(seq.ids[1]) is None
    assert retention(pool).entry(seq.ids[1]) is None
    assert pool.get_num_free_blocks() == free_before
    assert seq.ids[1] in allocation_order(pool)


def test_late_priorities_keep_a_prefix_head_longest() -> None:
    """Given head first (as the request held them), late priorities requeue the blocks
    tail first, as vLLM frees them: evictions at that priority take the tail first and
    leave the longest prefix a next turn can hit."""
    pool = retention_pool(8)
    seq = sequence(pool, 4)
    hashes = [b.block_hash for b in seq.blocks]
    free(seq)
    assert retention(pool).retain_freed(seq.blocks, hashes, [Protection(90)] * 4, "s") == 4
    # The 3 unprotected free blocks go first; then the protected ones, tail first.
    assert allocation_order(pool)[3:] == list(reversed(seq.ids))


# --- ownership, per block ----------------------------------------------------------
@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        ((80, None, "owner"), (10, None, "owner"), (10, "owner")),    # the owner lowers
        ((80, None, "owner"), (90, None, "other"), (90, "owner")),    # anyone raises
        ((80, None, "owner"), (10, None, "other"), (80, "owner")),    # others cannot lower
        ((80, None, "owner"), (10, None, ""), (80, "owner")),         # nor can anonymous
        ((80, None, "owner"), (35, None, ""), (80, "owner")),         # anonymous clears nothing
        ((80, None, "owner"), (35, None, "owner"), (None, None)),     # the owner clears
        ((80, None, "owner"), (80, 1.0, "other"), (80, "owner")),     # no shortening by others
        ((80, 30.0, "owner"), (80, None, "other"), (80, "owner")),    # lengthening is a raise
        ((60, None, ""), (20, None, "named"), (20, "named")),         # a named scope claims
        ((60, None, ""), (20, None, ""), (60, "")),
    ],
)
def test_ownership_per_block(first: tuple[int, float | None, str],
                             second: tuple[int, float | None, str],
                             expected: tuple[int | None, str | None]) -> None:
    pool = retention_pool(4)
    seq = sequence(pool, 1)
    retention(pool).retain(seq.blocks, [Protection(first[0], first[1])], first[2])
    retention(pool).retain(seq.blocks, [Protection(second[0], second[1])], second[2])
    entry = retention(pool).entry(seq.ids[0])
    if expected[0] is None:
        assert entry is None
    else:
        assert (entry.protection.priority, entry.owner) == expected


def test_a_request_without_directives_leaves_a_shared_block_alone() -> None:
    pool = retention_pool(6)
    seq = sequence(pool, 2)
    retain(seq, 100, scope="dynamo")
    free(seq)
    shared = hit(seq)  # another request's turn: it sends no directive, nothing retains
    pool.free_blocks(reversed(shared))
    assert [retention(pool).queued_priority(i) for i in seq.ids] == [100, 100]


# --- a model of the ordering, on random operation sequences ------------------------
class OrderModel:
    """The contract written plainly: free blocks with no hash first (vLLM prepends
    them), then by priority, least recently freed first; expired → default, newest."""

    def __init__(self, num_blocks: int) -> None:
        self.unhashed = list(range(1, num_blocks))
        self.queues: dict[int, list[int]] = {}

    def freed(self, block_ids: list[int], priority: int | None) -> None:
        if priority is None:
            self.unhashed[:0] = block_ids
        else:
            self.queues.setdefault(priority, []).extend(block_ids)

    def remove(self, block_id: int) -> None:
        for queue in (self.unhashed, *self.queues.values()):
            if block_id in queue:
                queue.remove(block_id)

    def take(self, count: int) -> list[int]:
        order = list(self.unhashed)
        for priority in sorted(self.queues):
            order += self.queues[priority]
        taken = order[:count]
        for block_id in taken:
            self.remove(block_id)
        return taken


@pytest.mark.parametrize("seed", range(8))
def test_allocation_follows_the_ordering_model(seed: int) -> None:
    rng = random.Random(seed)
    clock = Clock()
    pool = retention_pool(20, clock)
    model = OrderModel(20)
    live: list[Seq] = []
    freed: list[Seq] = []
    # What the model knows of each block: its class when freed (None: no hash),
    # its duration, and when a free one expires.
    klass: dict[int, int | None] = {}
    duration: dict[int, float] = {}
    expires_at: dict[int, tuple[float, int]] = {}
    frees = 0

    def model_free(block_ids: list[int]) -> None:
        nonlocal frees
        unhashed = [b for b in block_ids if klass[b] is None]
        model.freed(unhashed, None)
        for block_id in block_ids:
            if klass[block_id] is not None:
                model.freed([block_id], klass[block_id])
                if block_id in duration:
                    frees += 1
                    expires_at[block_id] = (clock.now_s + duration[block_id], frees)

    for _ in range(300):
        clock.now_s += rng.choice([0.0, 0.5, 2.0])
        for block_id, _due in sorted(((b, due) for b, due in expires_at.items()
                                      if due[0] <= clock.now_s), key=lambda item: item[1]):
            # Expired: the default, at the most recently used end; the entry is gone.
            del expires_at[block_id], duration[block_id]
            klass[block_id] = 35
            model.remove(block_id)
            model.freed([block_id], 35)
        op = rng.random()
        if op < 0.4 and pool.get_num_free_blocks():
            count = rng.randint(1, min(3, pool.get_num_free_blocks()))
            expected = model.take(count)
            seq = sequence(pool, count, cached=rng.random() < 0.9,
                           tokens=[rng.randrange(10**9) for _ in range(count * BLOCK)])
            assert seq.ids == expected
            priority = rng.choice([None, 5, 20, 35, 60, 90])
            seconds = rng.choice([None, None, 3.0])
            if priority is not None:
                retain(seq, priority, seconds)
            cached = seq.blocks[0].block_hash is not None
            for block_id in seq.ids:
                expires_at.pop(block_id, None)
                duration.pop(block_id, None)
                klass[block_id] = None if not cached else (priority or 35)
                if cached and priority not in (None, 35) and seconds is not None:
                    duration[block_id] = seconds
            live.append(seq)
        elif op < 0.8 and live:
            seq = live.pop(rng.randrange(len(live)))
            free(seq)
            model_free(list(reversed(seq.ids)))
            freed.append(seq)
        elif freed:
            touched = hit(rng.choice(freed))
            for block in touched:
                model.remove(block.block_id)
                expires_at.pop(block.block_id, None)
            # Reused, then freed right back: the entry survived the reuse.
            pool.free_blocks(reversed(touched))
            model_free([b.block_id for b in reversed(touched)])
    assert model.take(pool.get_num_free_blocks()) == allocation_order(pool)
