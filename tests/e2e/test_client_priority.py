"""Two client priority classes on the real engine, under load, with ``continuum``
pinning agent jobs: a request of the higher class (vLLM's ``priority`` field, lower
first) never waits behind one of the lower class, and the jobs keep their pins.

Agent jobs and one-shot batch requests send ``priority=1``; interactive requests
send the default 0. The batch requests fill the KV cache so that some of them wait;
then the interactive ones arrive. Each is streamed, and its first token marks its
admission (a prompt of a few hundred tokens is prefilled in one step)."""

from __future__ import annotations

import concurrent.futures
import threading
import time

from tests.e2e.conftest import LiveEngine
from tests.e2e.test_engine import agent, client, drain, ensure_policy, kv_usage
from tests.support.client import cached_tokens

BATCH = 1
INTERACTIVE = 0


def first_token_s(engine: LiveEngine, tag: str, priority: int, words: int,
                  max_tokens: int, started: threading.Event | None = None) -> float:
    """Stream one request; the monotonic clock at its first token."""
    stream = client(engine).chat.completions.create(
        model="tiny", max_tokens=max_tokens, stream=True,
        messages=[{"role": "user", "content": f"{tag} " + f"{tag}-w " * words}],
        extra_body={"ignore_eos": True, "priority": priority})
    first_s = 0.0
    # vLLM sends a chat stream's first chunk (the role) with the first output, whatever
    # it decodes to (dummy weights may decode to nothing).
    for _chunk in stream:
        if not first_s:
            first_s = time.monotonic()
            if started is not None:
                started.set()
    assert first_s, f"{tag}: no output came"
    return first_s


def test_the_higher_priority_class_never_waits_behind_the_lower_one(
        engine: LiveEngine) -> None:
    # A TTL longer than the run: what is under test is that pins are kept.
    ensure_policy(engine, "continuum", "fixed_ttl_s=30")
    drain(engine)
    jobs = [agent(engine, f"classes-{index}", seed=40 + index) for index in range(2)]
    for job in jobs:  # ~6 blocks each, pinned while their tool runs
        job.turn(last=False, priority=BATCH)
    started = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(max_workers=20) as pool:
        # 10 batch requests of ~3 blocks, growing to ~5: more than the cache holds
        # beside the pins, so some wait.
        batch = [pool.submit(first_token_s, engine, f"batch{index}", BATCH, 260, 250,
                             started) for index in range(10)]
        assert started.wait(60), "no batch request was admitted"
        time.sleep(0.5)  # the first admissions' first tokens are all in
        interactive_sent_s = time.monotonic()
        interactive = [pool.submit(first_token_s, engine, f"chat{index}", INTERACTIVE,
                                   20, 4) for index in range(4)]
        next_turns = [pool.submit(job.turn, False, "ls", 16, BATCH) for job in jobs]
        batch_first_s = [future.result() for future in batch]
        interactive_first_s = [future.result() for future in interactive]
        answers = [future.result() for future in next_turns]
    waited = [first_s for first_s in batch_first_s if first_s > interactive_sent_s]
    assert waited, "no batch request waited: the load did not fill the cache"
    assert max(interactive_first_s) < min(waited), (
        "an interactive request waited behind a batch request",
        sorted(first_s - interactive_sent_s for first_s in interactive_first_s),
        sorted(first_s - interactive_sent_s for first_s in waited))
    assert all(cached_tokens(answer) > 0 for answer in answers), "the jobs kept their pins"
    for job in jobs:
        job.turn(last=True, priority=BATCH)
    drain(engine)
    assert kv_usage(engine) == 0.0
