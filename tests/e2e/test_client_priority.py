"""Two client priority classes on the real engine, under load, with ``continuum``
pinning agent jobs: a request of the higher class (vLLM's ``priority`` field, lower
first) does not wait behind the lower class's queue, and the jobs keep their pins.

Agent jobs and one-shot batch requests send ``priority=1``; interactive requests send
the default 0. Beside the jobs' pins, batch requests fit two at a time: they run in
pairs, and the others wait. The interactive requests arrive while the first pair
runs. They are served at the first room after they arrive, before the batch
requests queued ahead of them (kvtether's order, job-level FCFS with pinned jobs
first, would put them after every one). Nothing is streamed: the API server, on a
busy machine, would lag in handing new requests to the engine."""

from __future__ import annotations

import concurrent.futures
import time

from tests.e2e.conftest import LiveEngine
from tests.e2e.test_engine import agent, client, drain, ensure_policy, kv_usage
from tests.support.client import cached_tokens

BATCH = 1
INTERACTIVE = 0
BLOCK_TOKENS = 128
# 769 prompt tokens (7 blocks) and 376 output tokens: 9 blocks at the end. Beside two
# pinned jobs (6 blocks each) two fit the 32 blocks, growing into the 6 blocks left,
# and a third does not; an interactive request takes 1 block.
BATCH_PROMPT_TOKENS = 6 * BLOCK_TOKENS + 1
BATCH_OUTPUT_TOKENS = 376


def done_s(engine: LiveEngine, priority: int, prompt: list[int], max_tokens: int) -> float:
    """Send one completion; the monotonic clock when its answer came."""
    client(engine).completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                      extra_body={"ignore_eos": True, "priority": priority})
    return time.monotonic()


def tokens(seed: int, count: int) -> list[int]:
    """A prompt of its own (no prefix shared with another)."""
    return [10 + (seed * 131 + index * 7) % 2000 for index in range(count)]


def test_the_higher_priority_class_does_not_wait_behind_the_lower_one(
        engine: LiveEngine) -> None:
    # A TTL longer than the run: what is under test is that pins are kept.
    ensure_policy(engine, "continuum", "fixed_ttl_s=30")
    drain(engine)
    jobs = [agent(engine, f"classes-{index}", seed=40 + index) for index in range(2)]
    for job in jobs:  # 6 blocks each, pinned while their tool runs
        job.turn(last=False, priority=BATCH)
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        batch = [pool.submit(done_s, engine, BATCH, tokens(index, BATCH_PROMPT_TOKENS),
                             BATCH_OUTPUT_TOKENS) for index in range(6)]
        time.sleep(0.5)  # the first pair runs, four batch requests wait
        interactive = [pool.submit(done_s, engine, INTERACTIVE, tokens(100 + index, 20), 4)
                       for index in range(4)]
        next_turns = [pool.submit(job.turn, False, "ls", 16, BATCH) for job in jobs]
        batch_done_s = sorted(future.result() for future in batch)
        interactive_done_s = sorted(future.result() for future in interactive)
        answers = [future.result() for future in next_turns]
    # The last pair at least was still queued when the interactive requests came.
    after = [s for s in batch_done_s if s > interactive_done_s[-1]]
    assert len(after) >= 2, (
        "the interactive requests waited behind the queued batch requests",
        [round(s - batch_done_s[0], 3) for s in interactive_done_s],
        [round(s - batch_done_s[0], 3) for s in batch_done_s])
    assert all(cached_tokens(answer) > 0 for answer in answers), "the jobs kept their pins"
    for job in jobs:
        job.turn(last=True, priority=BATCH)
    drain(engine)
    assert kv_usage(engine) == 0.0
