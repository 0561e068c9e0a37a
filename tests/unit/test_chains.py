"""Block-hash chains in lexicographic order: what each shares with the one before it is
what it shares with any before it, kept right as chains come and go."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_plugin.chains import Chain, ChainOrder, shared_blocks

BLOCK = 4


def chain_hashes(tokens: Sequence[int]) -> list[bytes]:
    """Hashes as vLLM makes them: each full block's hash covers its parent's."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        parent = hashlib.sha256(parent + bytes(tokens[start:start + BLOCK])).digest()
        hashes.append(parent)
    return hashes


def chain(tokens: Sequence[int]) -> Chain:
    hashes = chain_hashes(tokens)
    return Chain(hashes, len(hashes), len(tokens), BLOCK)


def distinct_blocks(chains: list[Chain]) -> int:
    return len({h for c in chains for h in c.hashes[:c.blocks]})


def test_shared_blocks_counts_the_common_prefix() -> None:
    a = chain_hashes([1] * 8 + [2] * 8 + [3] * 4)
    b = chain_hashes([1] * 8 + [2] * 8 + [4] * 4)
    assert shared_blocks(a, len(a), b, len(b)) == 4
    assert shared_blocks(a, len(a), a, len(a)) == 5, "a chain shares all of itself"
    assert shared_blocks(a, 3, b, len(b)) == 3, "only the blocks counted"
    assert shared_blocks(a, len(a), chain_hashes([9] * 20), 5) == 0
    assert shared_blocks(a, 0, b, len(b)) == 0


def test_a_prompt_sent_twice_shares_every_block_and_is_kept_twice() -> None:
    order = ChainOrder()
    order.add("first", chain([5] * 12))
    order.add("again", chain([5] * 12))
    assert len(order) == 2
    commons = [c.common for c in order]
    assert commons == [0, 3]
    order.remove("first")
    assert [c.common for c in order] == [0]


def test_a_key_added_again_replaces_its_chain() -> None:
    order = ChainOrder()
    order.add("r", chain([1] * 8))
    order.add("r", chain([1] * 16))  # preempted, back with more tokens
    assert len(order) == 1 and next(iter(order)).blocks == 4


# A small alphabet and short prompts, so chains share prefixes often.
prompts = st.lists(st.integers(0, 2), min_size=0, max_size=6).map(
    lambda blocks: [token for b in blocks for token in [b] * BLOCK])
operations = st.lists(
    st.tuples(st.sampled_from(["add", "remove"]), st.integers(0, 7), prompts,
              st.integers(0, BLOCK - 1)),
    max_size=40)


@settings(max_examples=300, deadline=None)
@given(operations)
def test_the_order_and_what_each_chain_shares_hold_through_any_changes(
        ops: list[tuple[str, int, list[int], int]]) -> None:
    order = ChainOrder()
    alive: dict[int, Chain] = {}
    for op, key, tokens, tail in ops:
        if op == "add":
            alive[key] = chain(tokens + [7] * tail)  # a partial last block of its own
            order.add(key, alive[key])
        else:
            alive.pop(key, None)
            order.remove(key)
        chains = list(order)
        assert sorted(order.keys()) == sorted(alive)
        assert len(chains) == len(alive)
        for before, after in itertools.pairwise(chains):
            assert not after < before, "out of order"
        for index, current in enumerate(chains):
            # What it shares with the one before is the most it shares with any before.
            expected = max((shared_blocks(c.hashes, c.blocks, current.hashes, current.blocks)
                            for c in chains[:index]), default=0)
            assert current.common == expected
        assert sum(c.blocks - c.common for c in chains) == distinct_blocks(chains)
