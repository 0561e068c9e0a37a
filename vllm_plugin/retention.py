"""Retention in the engine: eviction priorities on vLLM's own block pool, kept in a side
table (vLLM's ``KVCacheBlock`` and ``Request`` are untouched).

:func:`install` gives the scheduler's ``BlockPool`` instance a side table and returns
a :class:`Retention` handle; the agent calls :meth:`Retention.retain` with a request's
blocks just before vLLM frees them; everything else happens inside vLLM's own calls.

Contract (what the tests in ``tests/unit/test_retention_pool.py`` hold it to):
- **No directive anywhere** (empty side table): the pool *is* vLLM's ``BlockPool`` —
  same class, same methods, bit for bit and no added cost. The first protected block
  turns the instance into a :class:`RetentionBlockPool` (a subclass: same object,
  same references held by every KV cache manager); when the table is empty again it
  goes back to vLLM's class.
- **Order.** Free blocks go in this order: blocks with no hash (nothing to hit; vLLM
  evicts them first too), then priority < 35 ascending, then vLLM's free queue
  (default priority 35), then priority > 35 ascending. Within one priority, least
  recently freed first (vLLM's LRU), tail blocks of a request before its head.
- **Structures.** Default blocks stay in vLLM's ``free_block_queue``; each other
  priority has its own ``FreeKVCacheBlockQueue`` (vLLM's doubly linked list, O(1)
  remove). Before vLLM's ``get_new_blocks`` / ``touch`` run, the blocks they must see
  are moved into vLLM's queue, so its allocation code (hash eviction, events, metrics,
  reuse watchers) is never copied. ``get_num_free_blocks`` counts both.
- **Reuse.** A block hit from the cache (``touch``) leaves the priority structure; its
  side-table entry stays, so it is queued at its priority again when freed again.
- **Expiry.** A duration runs from the free, on the clock given to :func:`install`
  (the engine's one clock). An expired block moves to the most-recently-used end of
  vLLM's queue (TensorRT-LLM's refresh) and loses its entry. Expiries sit in a heap
  checked lazily; each heap item carries the generation of the free it belongs to,
  so an item left over from an earlier free of the same block (it was reused and
  freed again since) is skipped, never applied.
  Eviction order itself uses no heap: the per-priority queues are exact.
- **Clearing.** A block whose hash is evicted (reallocation, ``evict_blocks``, the
  scheduler's own evictions) loses its entry; ``reset_prefix_cache`` clears the table.
- **Ownership** per block: the first scope to protect a block owns it; other scopes
  may only raise it; anonymous requests lower nothing
  (:mod:`sidecar.api.retention_ownership`, the same rule the daemon's store applies).
- **Limit.** vLLM's simple CPU-offload connector walks ``free_block_queue`` to offload
  blocks near eviction; blocks in the priority queues are invisible to it.

Called on the engine thread only.
"""

from __future__ import annotations

import bisect
import heapq
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

from sidecar.api.retention_ownership import owner_after_set
from sidecar.api.retention_ranges import DEFAULT_PRIORITY, Protection, dominates

logger = logging.getLogger("kvtether.plugin")


@dataclass(frozen=True, slots=True)
class BlockEntry:
    """A block's retention: its protection and the scope that owns it."""

    protection: Protection
    owner: str


# The overrides call vLLM's methods on the base class directly (no super() object per
# call): while active, they run for every allocation, free and prefix hit.
_vllm = BlockPool


class RetentionBlockPool(BlockPool):  # type: ignore[misc]  # vLLM is untyped to mypy
    """vLLM's ``BlockPool`` while some block has a retention entry. Never constructed:
    an installed pool takes this class when its first entry appears (:meth:`retain`)
    and drops it when its last goes (:meth:`_settle`)."""

    def _init_retention(self, clock_s: Callable[[], float]) -> None:
        self.clock_s = clock_s
        # The side table: every block with a non-default protection, in use or free.
        self._entries: dict[int, BlockEntry] = {}
        # Free blocks of a non-default priority: one queue per priority, LRU first.
        self._queues: dict[int, FreeKVCacheBlockQueue] = {}
        self._priorities: list[int] = []  # sorted keys of _queues
        # Block id -> (priority, generation of the free that queued it).
        self._queued: dict[int, tuple[int, int]] = {}
        self._generation = 0
        # (expires_at_s, generation, block_id): lazily checked, stale items skipped.
        self._expiries: list[tuple[float, int, int]] = []

    # --- the agent's calls (through Retention, whatever the class is now) ---------
    def retain(self, blocks: Sequence[Any], protections: Sequence[Protection],
               scope: str) -> int:
        """Give blocks (held by a request about to free them) their protections, under
        the ownership rule. Returns how many entries changed."""
        self.__class__ = RetentionBlockPool
        changed = 0
        for block, protection in zip(blocks, protections, strict=False):
            if block.is_null or block.ref_cnt == 0 or not self._owns(block):
                continue
            changed += self._assign(block, protection, scope)
        self._settle()
        return changed

    def retain_freed(self, blocks: Sequence[Any], block_hashes: Sequence[Any],
                     protections: Sequence[Protection], scope: str) -> int:
        """:meth:`retain` for blocks a request has already freed (its priorities came
        after it finished): a block that still holds the same content (the hash it had
        then) takes the protection; a free one moves to its priority's queue, as if
        freed now. Blocks come as the request held them, head first; they are requeued
        tail first, as vLLM frees them, so that within a priority a prefix's head is
        evicted last. Returns how many entries changed."""
        self.__class__ = RetentionBlockPool
        if self._queued:
            self._expire()
        now_s = self.clock_s()
        changed = 0
        in_freeing_order = list(zip(blocks, block_hashes, protections, strict=False))[::-1]
        for block, block_hash, protection in in_freeing_order:
            if (block.is_null or not self._owns(block) or block_hash is None
                    or block.block_hash != block_hash):
                continue  # evicted since: other content now
            if block.ref_cnt > 0:  # reused since (a prefix hit): tag it for its next free
                changed += self._assign(block, protection, scope)
                continue
            if not self._assign(block, protection, scope):
                continue
            if not self._dequeue(block):
                self.free_block_queue.remove(block)
            entry = self._entries.get(block.block_id)
            if entry is None:
                self.free_block_queue.append(block)
            else:
                self._enqueue(block, entry.protection, now_s)
            changed += 1
        self._settle()
        return changed

    def _settle(self) -> None:
        """Back to vLLM's own class once nothing is retained (nothing is queued either:
        every queued block has an entry)."""
        if not self._entries:
            self.__class__ = _vllm

    def _assign(self, block: Any, protection: Protection, scope: str) -> int:
        """Apply the ownership rule to one block's entry; 1 if it changed, else 0."""
        entry = self._entries.get(block.block_id)
        owner = scope
        if entry is None:
            if protection.is_default:
                return 0
        else:
            if entry.protection == protection and entry.owner == scope:
                return 0
            after = owner_after_set(entry.owner, scope, dominates(protection, entry.protection))
            if after is None:
                return 0  # another scope may not lower it
            owner = after
        if protection.is_default:
            del self._entries[block.block_id]
        else:
            self._entries[block.block_id] = BlockEntry(protection, owner)
        return 1

    # --- vLLM's BlockPool, overridden ---------------------------------------------
    def get_num_free_blocks(self) -> int:
        # vLLM 0.32's count is its free queue's; the priority queues hold the rest.
        return int(self.free_block_queue.num_free_blocks) + len(self._queued)

    def free_blocks(self, ordered_blocks: Iterable[Any], evict_first: bool = False) -> None:
        if evict_first:
            # vLLM 0.34 on (its CPU offload): blocks another tier already holds go to
            # the front of the free queue, retained or not; freed for good, they drop
            # their entries.
            blocks = list(ordered_blocks)
            for block in blocks:
                if self._owns(block) and block.ref_cnt == 1:
                    self._entries.pop(block.block_id, None)
            _vllm.free_blocks(self, blocks, evict_first=True)
        else:
            self._free_retained(ordered_blocks)
        self._settle()

    def _owns(self, block: Any) -> bool:
        # A block's pool: vLLM 0.34 keeps a weak reference to it (KVCacheBlock.pool,
        # BlockPool._weak_self); vLLM 0.33 and before, the pool itself.
        owner, weak_self = block.pool, getattr(self, "_weak_self", None)
        return owner is self or (weak_self is not None and owner is weak_self)

    def _free_retained(self, ordered_blocks: Iterable[Any]) -> None:
        blocks = list(ordered_blocks)
        self._expire()
        # Which protected blocks this call frees for good (a block may appear more
        # than once, e.g. deferred frees of requests sharing a prefix).
        occurrences: Counter[int] = Counter()
        last_seen: dict[int, int] = {}
        for index, block in enumerate(blocks):
            if self._owns(block) and block.block_id in self._entries:
                occurrences[block.block_id] += 1
                last_seen[block.block_id] = index
        queued = []
        for block_id, count in occurrences.items():
            block = self.blocks[block_id]
            if block.ref_cnt != count or block.is_null:
                continue  # still in use after this call
            if block.block_hash is None or not self.enable_caching:
                del self._entries[block_id]  # nothing anyone could hit: vLLM's way
                continue
            queued.append(block_id)
        if not queued:
            _vllm.free_blocks(self, blocks)
            return
        taken = set(queued)
        _vllm.free_blocks(self, [b for b in blocks
                                 if not self._owns(b) or b.block_id not in taken])
        now_s = self.clock_s()
        for block_id in sorted(queued, key=last_seen.__getitem__):  # vLLM's order
            block = self.blocks[block_id]
            block.ref_cnt = 0
            self._enqueue(block, self._entries[block_id].protection, now_s)

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        if self._queued:
            self._expire()
            if self._queued and num_blocks <= self.get_num_free_blocks():
                self._stage(num_blocks)  # (too many: vLLM raises, as it does)
        blocks: list[Any] = _vllm.get_new_blocks(self, num_blocks)
        self._settle()  # reallocation dropped their entries
        return blocks

    def _stage(self, num_blocks: int) -> None:
        """Arrange vLLM's free queue so that its first ``num_blocks`` are the ones to
        evict next, in order; vLLM's own ``get_new_blocks`` then takes exactly them."""
        queue = self.free_block_queue
        if self._priorities[0] > DEFAULT_PRIORITY:
            # Only protected blocks queued: vLLM's queue first, then the lowest priority.
            shortfall = num_blocks - queue.num_free_blocks
            if shortfall > 0:
                queue.append_n(self._take(shortfall, below_default=False))
            return
        # Some priorities are below the default: after the blocks with no hash at the
        # head of vLLM's queue (nothing to lose), before its default ones.
        front: list[Any] = []
        block = queue.fake_free_list_head.next_free_block
        while (len(front) < num_blocks and block is not queue.fake_free_list_tail
               and block.block_hash is None):
            front.append(block)
            block = block.next_free_block
        for block in front:
            queue.remove(block)
        staged = front + self._take(num_blocks - len(front), below_default=True)
        shortfall = num_blocks - len(staged) - queue.num_free_blocks
        if shortfall > 0:
            queue.append_n(self._take(shortfall, below_default=False))
        queue.prepend_n(staged)

    def touch(self, blocks: Sequence[Any]) -> None:
        if self._queued:
            self._expire()
            # vLLM's touch takes free blocks out of its own queue: move them there.
            reused = [b for b in blocks if b.ref_cnt == 0 and self._dequeue(b)]
            if reused:
                self.free_block_queue.append_n(reused)
        _vllm.touch(self, blocks)
        self._settle()

    def _maybe_evict_cached_block(self, block: Any) -> bool:
        if (self._entries and self._entries.pop(block.block_id, None) is not None
                and block.ref_cnt == 0 and self._dequeue(block)):
            # A free protected block lost its hash (evict_blocks): now worthless, it
            # goes where vLLM puts the blocks it reuses first.
            evicted = bool(_vllm._maybe_evict_cached_block(self, block))
            self.free_block_queue.prepend_n([block])
            return evicted
        return bool(_vllm._maybe_evict_cached_block(self, block))

    def evict_blocks(self, block_ids: set[int]) -> None:
        _vllm.evict_blocks(self, block_ids)
        self._settle()

    def reset_prefix_cache(self) -> bool:
        if not _vllm.reset_prefix_cache(self):
            return False
        # Every hash is gone: nothing is left to protect.
        for priority in self._priorities:
            queue = self._queues[priority]
            self.free_block_queue.append_n(queue.popleft_n(queue.num_free_blocks))
        self._init_retention(self.clock_s)
        self._settle()
        return True

    # --- internals ----------------------------------------------------------------
    def _enqueue(self, block: Any, protection: Protection, now_s: float) -> None:
        priority = protection.priority
        queue = self._queues.get(priority)
        if queue is None:
            queue = self._queues[priority] = FreeKVCacheBlockQueue([])
            bisect.insort(self._priorities, priority)
        queue.append(block)
        self._generation += 1
        self._queued[block.block_id] = (priority, self._generation)
        if protection.duration_s is not None:
            heapq.heappush(self._expiries,
                           (now_s + protection.duration_s, self._generation, block.block_id))
            if len(self._expiries) > 2 * len(self._queued) + 1024:
                self._expiries = [item for item in self._expiries
                                  if self._queued.get(item[2], (0, -1))[1] == item[1]]
                heapq.heapify(self._expiries)

    def _dequeue(self, block: Any) -> bool:
        """Take a free block out of its priority queue; False if it is in none."""
        queued = self._queued.pop(block.block_id, None)
        if queued is None:
            return False
        queue = self._queues[queued[0]]
        queue.remove(block)
        if queue.num_free_blocks == 0:
            self._drop_queue(queued[0])
        return True

    def _drop_queue(self, priority: int) -> None:
        del self._queues[priority]
        self._priorities.remove(priority)

    def _take(self, count: int, below_default: bool) -> list[Any]:
        """Up to ``count`` blocks from the lowest priority queues, LRU first: those
        below the default (``below_default``) or above it."""
        taken: list[Any] = []
        for priority in list(self._priorities):
            if count <= 0 or (below_default and priority > DEFAULT_PRIORITY):
                break
            if not below_default and priority < DEFAULT_PRIORITY:
                continue
            queue = self._queues[priority]
            blocks = queue.popleft_n(min(count, queue.num_free_blocks))
            for block in blocks:
                del self._queued[block.block_id]
            if queue.num_free_blocks == 0:
                self._drop_queue(priority)
            count -= len(blocks)
            taken += blocks
        return taken

    def _expire(self) -> None:
        expiries = self._expiries
        if not expiries:
            return
        now_s = self.clock_s()
        while expiries and expiries[0][0] <= now_s:
            _at, generation, block_id = heapq.heappop(expiries)
            queued = self._queued.get(block_id)
            if queued is None or queued[1] != generation:
                continue  # from an earlier free of the block: stale, never applied
            block = self.blocks[block_id]
            self._dequeue(block)
            del self._entries[block_id]
            self.free_block_queue.append(block)


class Retention:
    """The agent's (and the tests') handle on a pool with retention installed. The
    pool is vLLM's own class while nothing is retained, so its retention methods are
    reached through here."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def retain(self, blocks: Sequence[Any], protections: Sequence[Protection],
               scope: str) -> int:
        return RetentionBlockPool.retain(self.pool, blocks, protections, scope)

    def retain_freed(self, blocks: Sequence[Any], block_hashes: Sequence[Any],
                     protections: Sequence[Protection], scope: str) -> int:
        return RetentionBlockPool.retain_freed(self.pool, blocks, block_hashes, protections,
                                               scope)

    @property
    def active(self) -> bool:
        """Whether some block is retained (the pool runs RetentionBlockPool's methods)."""
        return type(self.pool) is RetentionBlockPool

    def entry(self, block_id: int) -> BlockEntry | None:
        return self.pool._entries.get(block_id)  # type: ignore[no-any-return]

    def queued_priority(self, block_id: int) -> int | None:
        """The priority queue a free block sits in; None: vLLM's queue, or in use."""
        queued = self.pool._queued.get(block_id)
        return None if queued is None else int(queued[0])

    @property
    def num_retained_entries(self) -> int:
        return len(self.pool._entries)


def install(pool: Any, clock_s: Callable[[], float]) -> Retention | None:
    """Give the scheduler's own block pool a retention side table (in place: every
    manager holding the pool sees it); the pool stays vLLM's class until something is
    retained. Durations run on ``clock_s``: the engine's one clock
    (``vllm_plugin.clock.EngineClock``), the one the agent stamps pins and provisional
    bounds with. Also reachable as ``pool.kvtether_retention``. None when this pool
    cannot take it: prefix caching off (nothing is retained), or a pool class this
    version does not know (e.g. a connector's); vLLM then runs unchanged."""
    existing = getattr(pool, "kvtether_retention", None)
    if isinstance(existing, Retention):
        return existing
    if type(pool) is not BlockPool:
        logger.warning("kvtether: retention off: unknown block pool class %s",
                       type(pool).__name__)
        return None
    if not pool.enable_caching:
        logger.info("kvtether: retention off: prefix caching is disabled")
        return None
    RetentionBlockPool._init_retention(pool, clock_s)
    handle = Retention(pool)
    pool.kvtether_retention = handle
    return handle
