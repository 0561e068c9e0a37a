"""How many blocks the waiting requests would take from the free pool.

The daemon prices memory by the waiting demand against the free blocks. Summed request
by request, a prefix several waiting requests share, or one a running request holds,
is counted once per request, though admission takes it from the free pool once or not
at all. Where jobs run one script (the calibrated twin workload: 95% of prompt tokens
cached) the sum read 3,000-9,000 blocks on a 3,000-block cache whose waiting requests,
counted here, wanted 300-1,800: memory looked short all the time.

Counted here, a waiting request wants its blocks less the longest prefix that is
already taken care of:

- in use: a running request's or a pin's blocks (``ref_cnt > 0``); admission shares
  them;
- wanted by another waiting request: the first one admitted caches it for the next
  (counted once, by whichever request the count meets first).

A prefix cached in the free pool still counts: admission takes those blocks out of it.

A block's hash chains its whole prefix, and whoever holds a block holds the blocks
before it, so "taken care of" is a prefix of the request's blocks and bisection finds
its end: a few lookups a request, not one a block. The count runs on the engine's
thread, so it runs at most once every ``interval_s`` of the engine's clock, the last
count standing in between (the policy's prices move over seconds, not steps).
"""

from __future__ import annotations

from typing import Any


class WaitingDemand:
    """The waiting requests' demand of one scheduler, re-counted at most every
    ``interval_s``. ``blocks(now_s)`` is None where it cannot be counted (prefix
    caching off, or hash blocks not the size of KV blocks): the daemon then sums each
    request's blocks itself."""

    def __init__(self, scheduler: Any, interval_s: float) -> None:
        self._sched = scheduler
        self._interval_s = interval_s
        pool = scheduler.kv_cache_manager.block_pool
        self._block_size = int(getattr(scheduler, "block_size", 0) or 0)
        self._lookup = getattr(pool, "cached_block_hash_to_block", None)
        self.supported = bool(
            self._block_size > 0 and self._lookup is not None
            and getattr(pool, "enable_caching", False)
            and getattr(pool, "hash_block_size", self._block_size) == self._block_size)
        self._last: int | None = None
        self._counted_at_s = float("-inf")
        if self.supported:
            from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

            self._key = make_block_hash_with_group_id

    def blocks(self, now_s: float) -> int | None:
        if not self.supported:
            return None
        if not self._sched.waiting:
            self._last = None  # the next request to wait is counted at once
            return 0
        stale = (self._last is None or now_s - self._counted_at_s >= self._interval_s
                 or now_s < self._counted_at_s)
        if stale:
            self._last = self.count()
            self._counted_at_s = now_s
        return self._last

    def count(self) -> int:
        """The demand now, counted in full."""
        get_block = self._lookup.get_one_block  # type: ignore[union-attr]
        key = self._key
        size = self._block_size
        ahead: set[Any] = set()

        def taken_care_of(block_hash: Any) -> bool:
            if block_hash in ahead:
                return True
            block = get_block(key(block_hash, 0))
            return block is not None and block.ref_cnt > 0

        demand = 0
        for request in _unordered(self._sched.waiting):
            tokens = int(getattr(request, "num_tokens", 0) or 0)
            hashes = getattr(request, "block_hashes", ())[:tokens // size]
            # The prefix taken care of is low blocks long, low..high. Most requests
            # share all their full blocks (a turn whose context is pinned) or none
            # (nothing cached): the two ends first, then bisection.
            low, high = 0, len(hashes)
            if high and taken_care_of(hashes[-1]):
                low = high
            elif high and not taken_care_of(hashes[0]):
                high = 0
            while low < high:
                mid = (low + high + 1) // 2
                if taken_care_of(hashes[mid - 1]):
                    low = mid
                else:
                    high = mid - 1
            demand += -(-tokens // size) - low
            ahead.update(hashes)
        return demand


def _unordered(waiting: Any) -> Any:
    """The waiting requests in any order: each distinct block is counted once whatever
    the order (the first request holding it counts it), and vLLM's priority queue
    iterates in order by sorting a copy of its heap (a quarter of the count's time at
    200 waiting requests)."""
    heap = getattr(waiting, "_heap", None)
    return heap if isinstance(heap, list) else waiting
