"""What the retention side table costs on vLLM's block pool when no directive exists
(the fast path), and with protected blocks queued, against vLLM's plain ``BlockPool``.

One cycle = what a request does to the pool: ``get_new_blocks``, ``cache_full_blocks``,
``free_blocks`` (tail first), a prefix hit (``get_cached_block`` + ``touch``) and its
free, plus two ``get_num_free_blocks`` calls (the scheduler asks every step). The
variants run interleaved, round after round; the minimum per round is kept (the
machine's noise only ever adds time).
"""

from __future__ import annotations

import time
from typing import Any

from sidecar.api.retention_ranges import Protection

BLOCK = 16
BLOCKS_PER_REQUEST = 8


def _pool(kind: str, num_blocks: int) -> Any:
    from vllm.v1.core.block_pool import BlockPool

    from vllm_plugin.clock import EngineClock
    from vllm_plugin.retention import install

    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=BLOCK)
    if kind != "vllm":
        install(pool, EngineClock())
    return pool


def _requests(count: int) -> list[Any]:
    from tests.support.scheduler import make_request

    return [make_request(f"bench-{i}", [10_000 * i + t for t in range(BLOCK * BLOCKS_PER_REQUEST)],
                         1, BLOCK) for i in range(count)]


def _cycle(pool: Any, request: Any, protect: bool) -> None:
    pool.get_num_free_blocks()
    blocks = pool.get_new_blocks(BLOCKS_PER_REQUEST)
    pool.cache_full_blocks(request, blocks, 0, BLOCKS_PER_REQUEST, BLOCK, 0)
    if protect:
        pool.kvtether_retention.retain(blocks, [Protection(80)] * BLOCKS_PER_REQUEST, "bench")
    pool.free_blocks(reversed(blocks))
    hit = [pool.get_cached_block(h, [0])[0] for h in request.block_hashes[:BLOCKS_PER_REQUEST]]
    pool.touch(hit)
    pool.free_blocks(reversed(hit))
    pool.get_num_free_blocks()


def measure(rounds: int = 7, cycles: int = 400) -> dict[str, Any]:
    requests = _requests(cycles)
    variants = {"vllm": False, "retention_no_directive": False, "retention_protected": True}
    best = {name: float("inf") for name in variants}
    for _ in range(rounds):
        for name, protect in variants.items():
            pool = _pool(name, 1024)
            started = time.perf_counter_ns()
            for request in requests:
                _cycle(pool, request, protect)
            best[name] = min(best[name], (time.perf_counter_ns() - started) / cycles)
    base = best["vllm"]
    return {
        "cycle": f"allocate {BLOCKS_PER_REQUEST} blocks, cache, free, prefix hit, free",
        "ns_per_cycle": {name: round(value) for name, value in best.items()},
        "added_vs_vllm": {name: round(value / base - 1, 3) for name, value in best.items()
                          if name != "vllm"},
    }
