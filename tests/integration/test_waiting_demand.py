"""The waiting demand the plugin reports, counted on vLLM's real scheduler (no model, no
worker) while agent jobs come, run, get preempted and finish: at every step it is the
blocks admission would take from the free pool, each distinct block once."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.support.engine import requires_vllm, tiny_model_dir

pytestmark = requires_vllm

BLOCK = 16


def blocks_admission_would_take(sched: Any) -> int:
    """Brute force: every distinct full block of the waiting prompts whose cached block
    (the one admission would hit) is not in use, each once, and each request's partial
    last block."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    lookup = sched.kv_cache_manager.block_pool.cached_block_hash_to_block
    distinct: set[Any] = set()
    partial = 0
    for request in sched.waiting:
        full = min(len(request.block_hashes), request.num_tokens // BLOCK)
        distinct.update(request.block_hashes[:full])
        partial += -(-request.num_tokens // BLOCK) - full
    in_use = 0
    for block_hash in distinct:
        block = lookup.get_one_block(make_block_hash_with_group_id(block_hash, 0))
        in_use += block is not None and block.ref_cnt > 0
    return len(distinct) - in_use + partial


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_count_is_the_distinct_blocks_not_in_use_at_every_step(seed: int) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from tests.support.scheduler import build_scheduler, make_request, step
    from vllm_plugin.demand import WaitingDemand

    rng = random.Random(seed)
    # A small cache and a big batch: requests wait, run beside each other and are
    # preempted (back in the queue with more tokens).
    sched = build_scheduler(tiny_model_dir(), num_blocks=28, block_size=BLOCK,
                            scheduler_cls=Scheduler, max_num_seqs=8,
                            max_num_batched_tokens=512, policy="fcfs")
    demand = WaitingDemand(sched, interval_s=0.0)
    assert demand.supported
    # The same count through vLLM's key function, as for a key scheme the shortcut of
    # appending the group id to the hash does not fit.
    keyed = WaitingDemand(sched, interval_s=0.0)
    keyed._group_0 = None
    system = [rng.randrange(2, 2000) for _ in range(3 * BLOCK)]  # every job's first blocks
    contexts: dict[str, list[int]] = {}
    counted = preempted = 0
    for index in range(160):
        if rng.random() < 0.5:
            job = f"job-{rng.randrange(12)}"
            context = contexts.setdefault(job, list(system))
            context.extend(rng.randrange(2, 2000) for _ in range(rng.randrange(1, 3 * BLOCK)))
            # Sometimes the same prompt twice, sometimes a job's earlier turn again.
            prompt = list(context[: rng.randrange(len(system), len(context) + 1)])
            sched.add_request(make_request(f"{job}-{index}", prompt, rng.randrange(1, 160),
                                           block_size=BLOCK))
        before = sum(r.num_preemptions for r in sched.requests.values())
        step(sched)
        preempted += sum(r.num_preemptions for r in sched.requests.values()) > before
        # Counted every few steps, as at the interval: what changed in between is seen.
        if sched.waiting and rng.random() < 0.4:
            expected = blocks_admission_would_take(sched)
            assert demand.count() == expected == keyed.count(), f"step {index}"
            counted += 1
    assert counted > 30 and preempted > 0, "the workload waited and preempted"


def test_a_prefix_in_use_that_grows_under_a_waiting_request_is_seen() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from tests.support.scheduler import build_scheduler, make_request, step
    from vllm_plugin.demand import WaitingDemand

    sched = build_scheduler(tiny_model_dir(), num_blocks=64, block_size=BLOCK,
                            scheduler_cls=Scheduler, max_num_seqs=2)
    demand = WaitingDemand(sched, interval_s=0.0)
    context = [300 + i for i in range(8 * BLOCK)]
    tail = [5] * 5

    def add(name: str, prompt: list[int], max_tokens: int, priority: int) -> None:
        sched.add_request(make_request(name, prompt, max_tokens, block_size=BLOCK,
                                       priority=priority))

    add("holds-4", context[:4 * BLOCK] + tail, max_tokens=3, priority=0)
    add("other", [1500 + i for i in range(2 * BLOCK)], max_tokens=200, priority=0)
    step(sched)
    add("waits", context + tail, max_tokens=4, priority=5)  # 8 full blocks and a partial
    assert demand.count() == 9 - 4 == blocks_admission_would_take(sched)
    # A request holding 6 of its blocks goes first when a slot frees.
    add("holds-6", context[:6 * BLOCK] + tail, max_tokens=50, priority=0)
    while "holds-6" not in {r.request_id for r in sched.running}:
        step(sched)
    assert [r.request_id for r in sched.waiting] == ["waits"]
    assert demand.count() == 9 - 6 == blocks_admission_would_take(sched)
