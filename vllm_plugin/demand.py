"""How many blocks the waiting requests would take from the free pool.

The daemon prices memory by the waiting demand against the free blocks. Summed request
by request, a prefix several waiting requests share, or one a running request holds,
is counted once per request, though admission takes it from the free pool once or not
at all. Where jobs share most of their prompts (agents running one script) such a sum
is several times the cache while the waiting requests want a fraction of it, and
memory would look short all the time.

Counted here, a waiting request wants its blocks less the longest prefix that is
already taken care of:

- in use: a running request's or a pin's blocks (``ref_cnt > 0``); admission shares
  them;
- wanted by another waiting request: the first one admitted caches it for the next
  (counted once, for one of them).

A prefix cached in the free pool still counts: admission takes those blocks out of it.

A count is a block lookup or two a request, whatever its length:

- shared between waiting requests: the waiting requests' block-hash chains are kept in
  lexicographic order (``vllm_plugin.chains``), where the blocks a request shares with
  any request before it are those it shares with the one right before it. That is
  worked out when a request starts waiting (or leaves), not at every count.
- in use: whoever holds a block holds the blocks before it, so what is in use is a
  prefix of a request's blocks; the one found at the last count is checked at its end
  (usually still right), and bisection finds it where it moved.

So a request is counted for its blocks past the longer of the two prefixes, a cost
that does not grow with the length of its context (``benchmarks.overhead`` times a
count). It runs only while the daemon's policy reads it (the agent asks), at most
once every ``interval_s`` of the engine's clock, the last count standing in between
(the policy's prices move over seconds, not steps).

By default it runs on the link's thread as the report goes out, while the engine
thread waits on its workers; it then reads vLLM's structures as the engine thread
changes them. It copies the waiting queue before walking it, and a lookup that
races a change can raise or read a block a moment old: the agent sends that report
without the count and drops the chains (the next count starts afresh). Everything
here is guarded by one lock: the engine thread only takes it to stop the counting.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm_plugin.chains import Chain, ChainOrder, prefix_length


class WaitingDemand:
    """The waiting requests' demand of one scheduler, re-counted at most every
    ``interval_s``. ``blocks(now_s)`` is None where it cannot be counted (prefix
    caching off, or hash blocks not the size of KV blocks): the daemon then sums each
    request's blocks itself. Called on the engine thread only."""

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
        self._lock = threading.Lock()
        # Counted until the daemon's policy says it does not read it (the agent calls
        # enable): a first report without it would be priced by the per-request sum.
        self._enabled = True
        self._last: int | None = None
        self._counted_at_s = float("-inf")
        # The waiting requests' chains as of the last count, by request id.
        self._chains = ChainOrder()
        self._group_0: bytes | None = None
        if self.supported:
            from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

            self._key = make_block_hash_with_group_id
            self._get_block = self._lookup.get_one_block  # type: ignore[union-attr]
            # vLLM 0.32 keys a group-0 block by its hash and 4 bytes of group id;
            # appending them saves a call per lookup, the count's biggest cost.
            # Another key scheme goes through the call.
            group_0 = make_block_hash_with_group_id(b"", 0)
            probe = b"kvtether"
            if isinstance(group_0, bytes) and make_block_hash_with_group_id(
                    probe, 0) == probe + group_0:
                self._group_0 = group_0

    def blocks(self, now_s: float) -> int | None:
        """The demand as of the engine clock ``now_s``; None while not counted."""
        with self._lock:
            if not self.supported or not self._enabled:
                return None
            if not self._sched.waiting:
                self._drop()  # the next request to wait is counted at once
                return 0
            stale = (self._last is None or now_s - self._counted_at_s >= self._interval_s
                     or now_s < self._counted_at_s)
            if stale:
                try:
                    self._last = self.count()
                except BaseException:
                    self._drop()  # half-updated chains: start afresh next time
                    raise
                self._counted_at_s = now_s
            return self._last

    @property
    def enabled(self) -> bool:
        return self._enabled

    def enable(self, on: bool) -> None:
        """Counts (the default) or stops; stopped, it keeps nothing and ``blocks`` is
        None until enabled again."""
        with self._lock:
            self._enabled = on
            if not on:
                self._drop()  # the chains hold the waiting requests' hashes

    def _drop(self) -> None:
        self._last = None
        self._chains.clear()

    def count(self) -> int:
        """The demand now."""
        self._follow_waiting()
        in_use, bisect = self._in_use, self._bisect_in_use
        demand = 0
        for chain in self._chains:
            covered, blocks = chain.common, chain.blocks
            if covered < blocks:
                # Past what it shares, how far its blocks are in use: usually where the
                # last count found it (the memo), one or two lookups.
                hashes, remembered = chain.hashes, chain.in_use_memo
                if remembered <= covered:
                    if in_use(hashes[covered]):
                        covered = bisect(chain, covered + 1, blocks)
                    else:
                        chain.in_use_memo = covered
                elif not in_use(hashes[remembered - 1]):
                    covered = bisect(chain, covered, remembered - 1)
                elif remembered < blocks and in_use(hashes[remembered]):
                    covered = bisect(chain, remembered + 1, blocks)
                else:
                    covered = remembered
            demand += chain.total_blocks - covered
        return demand

    def _follow_waiting(self) -> None:
        """Brings the chains in line with the waiting queue: requests that came, went,
        or came back with more tokens (preempted since the last count)."""
        chains = self._chains
        known = chains.get
        size = self._block_size
        # A copy (one C call): the engine thread may be changing the queue meanwhile.
        waiting = list(_unordered(self._sched.waiting))
        for request in waiting:
            chain = known(request.request_id)
            tokens = request.num_tokens
            if chain is None or chain.tokens != tokens:
                hashes = request.block_hashes
                chains.add(request.request_id,
                           Chain(hashes, min(len(hashes), tokens // size), tokens, size))
        if len(chains) > len(waiting):
            for request_id in chains.keys() - {request.request_id for request in waiting}:
                chains.remove(request_id)

    def _bisect_in_use(self, chain: Chain, low: int, high: int) -> int:
        """The chain's in-use prefix, known to end between ``low`` and ``high``: blocks
        before ``low`` are in use (or shared, counted anyway), and blocks past ``high``
        are not in use. Remembered for the next count."""
        hashes, in_use = chain.hashes, self._in_use
        chain.in_use_memo = prefix_length(lambda index: in_use(hashes[index]), low, high)
        return chain.in_use_memo

    def _in_use(self, block_hash: Any) -> bool:
        # The block admission would hit (the first cached one of that hash).
        group_0 = self._group_0
        block = self._get_block(block_hash + group_0 if group_0 is not None
                                else self._key(block_hash, 0))
        return block is not None and block.ref_cnt > 0


def _unordered(waiting: Any) -> Any:
    """The waiting requests in any order: the chains are ordered by
    ``vllm_plugin.chains``, and vLLM's priority queue iterates in order by sorting a
    copy of its heap (a quarter of the count's time at 200 waiting requests)."""
    heap = getattr(waiting, "_heap", None)
    return heap if isinstance(heap, list) else waiting
