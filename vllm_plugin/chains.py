"""Block-hash chains kept in lexicographic order, each with the prefix it shares with the
one before it.

vLLM hashes a block together with its parent's hash, so a block's hash stands for the
whole prefix up to it: two requests share their first ``k`` blocks exactly when their
``k``-th hashes are equal. In lexicographic order, the most blocks a chain shares with
any chain before it is what it shares with the one right before it (``common``). So
the distinct blocks of all the chains are ``sum(blocks - common)``, read without
comparing every block of every chain; and a chain's ``common`` changes only when a
neighbour comes or goes (O(log) block comparisons each, by bisection).

Pure Python over sequences of hashes: no vLLM here (``vllm_plugin.demand`` feeds it).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

_order_ties = itertools.count()


def prefix_length(holds: Callable[[int], bool], low: int, high: int) -> int:
    """How many leading blocks ``holds`` (by index) for, where it holds for a prefix of
    the blocks: known to hold before ``low`` and not to from ``high`` on. Bisection."""
    while low < high:
        mid = (low + high + 1) // 2
        if holds(mid - 1):
            low = mid
        else:
            high = mid - 1
    return low


def shared_blocks(a: Sequence[Any], a_blocks: int, b: Sequence[Any], b_blocks: int) -> int:
    """How many leading blocks two chains share (of their first ``a_blocks`` /
    ``b_blocks``). Equal hashes at ``k`` mean equal prefixes up to ``k``, so bisection on
    the last equal position finds it; the ends first (a chain repeated or extended,
    chains with nothing in common)."""
    length = min(a_blocks, b_blocks)
    if length == 0 or a[0] != b[0]:
        return 0
    if a[length - 1] == b[length - 1]:
        return length
    return prefix_length(lambda index: bool(a[index] == b[index]), 1, length - 1)


class Chain:
    """One request's chain in the order: the first ``blocks`` hashes of ``hashes`` (a
    list that may grow past them, never change before them) of a request of ``tokens``
    tokens, ``total_blocks`` blocks with the partial last one. ``common`` is maintained
    by ``ChainOrder``; ``in_use_memo`` is its user's, kept here to save a second map."""

    __slots__ = ("blocks", "common", "hashes", "in_use_memo", "tie", "tokens", "total_blocks")

    def __init__(self, hashes: Sequence[Any], blocks: int, tokens: int,
                 block_size: int) -> None:
        self.hashes = hashes
        self.blocks = blocks
        self.tokens = tokens
        self.total_blocks = -(-tokens // block_size)
        self.common = 0
        self.in_use_memo = 0
        # Equal chains (one prompt sent twice) stay distinct entries in a fixed order.
        self.tie = next(_order_ties)

    def __lt__(self, other: Chain) -> bool:
        shared = shared_blocks(self.hashes, self.blocks, other.hashes, other.blocks)
        if shared < self.blocks and shared < other.blocks:
            return bool(self.hashes[shared] < other.hashes[shared])
        if self.blocks != other.blocks:
            return self.blocks < other.blocks  # a prefix sorts before its extensions
        return self.tie < other.tie


class ChainOrder:
    """Chains by key (a request id), in lexicographic order with ``common`` kept."""

    def __init__(self) -> None:
        self._order: list[Chain] = []
        self._by_key: dict[Any, Chain] = {}
        # The chain under a key, or None: the dict's own get (read once per chain at
        # every count, so no method of ours in between).
        self.get: Callable[[Any], Chain | None] = self._by_key.get

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[Chain]:
        return iter(self._order)

    def keys(self) -> Any:
        return self._by_key.keys()

    def add(self, key: Any, chain: Chain) -> None:
        """Adds ``chain`` under ``key``, replacing the chain the key had."""
        self.remove(key)
        order = self._order
        index = bisect.bisect_right(order, chain)
        chain.common = 0
        if index > 0:
            before = order[index - 1]
            chain.common = shared_blocks(before.hashes, before.blocks,
                                         chain.hashes, chain.blocks)
        if index < len(order):
            after = order[index]
            after.common = shared_blocks(chain.hashes, chain.blocks, after.hashes, after.blocks)
        order.insert(index, chain)
        self._by_key[key] = chain

    def remove(self, key: Any) -> None:
        chain = self._by_key.pop(key, None)
        if chain is None:
            return
        order = self._order
        index = bisect.bisect_left(order, chain)
        if index >= len(order) or order[index] is not chain:
            # Only if a chain's hashes changed under it, which vLLM's appends never do;
            # then the count is off, and the engine must still not fail.
            index = next(i for i, other in enumerate(order) if other is chain)
        if index + 1 < len(order):
            # What the neighbours share is the least of what each shared with it.
            after = order[index + 1]
            after.common = min(after.common, chain.common)
        del order[index]

    def clear(self) -> None:
        self._order.clear()
        self._by_key.clear()
