"""The decision feed: one ring every watcher reads at its own pace; publishing costs the
same whatever the number of watchers, and a watcher too far behind is dropped."""

from __future__ import annotations

import asyncio

import pytest

from sidecar.runtime.decider import Decision
from sidecar.runtime.decision_feed import DecisionFeed, FellBehind


def _decision(index: int, engine_id: str = "e0", job_id: str = "j") -> Decision:
    return Decision(engine_id, f"r{index}", job_id, "priority", "why", {}, 1.0, index, "fcfs")


def test_nothing_is_kept_while_nobody_watches() -> None:
    feed = DecisionFeed(capacity=4)
    for index in range(10):
        feed.publish(_decision(index))
    assert (feed.published, len(feed.ring)) == (0, 0)


def test_each_watcher_reads_what_its_filter_wants_in_order() -> None:
    async def run() -> tuple[list[str], list[str]]:
        feed = DecisionFeed(capacity=8)
        everything, one_job = feed.watch(), feed.watch(job_id="k")
        for index in range(4):
            feed.publish(_decision(index, job_id="k" if index % 2 else "j"))
        return ([d.request_id for d in await everything.next_batch()],
                [d.request_id for d in await one_job.next_batch()])

    assert asyncio.run(run()) == (["r0", "r1", "r2", "r3"], ["r1", "r3"])


def test_a_waiting_watcher_is_woken_by_the_next_decision() -> None:
    async def run() -> list[str]:
        feed = DecisionFeed(batch_interval_s=0.01)
        watch = feed.watch(engine_id="e1")
        waiting = asyncio.create_task(watch.next_batch())
        await asyncio.sleep(0)
        feed.publish(_decision(0, engine_id="e0"))  # not for this watcher: it waits on
        await asyncio.sleep(0.05)
        assert not waiting.done()
        feed.publish(_decision(1, engine_id="e1"))
        return [d.request_id for d in await asyncio.wait_for(waiting, 5)]

    assert asyncio.run(run()) == ["r1"]


def test_a_cancelled_watcher_leaves_the_others_waiting() -> None:
    async def run() -> list[str]:
        feed = DecisionFeed()
        first, second = feed.watch(), feed.watch()
        cancelled = asyncio.create_task(first.next_batch())
        waiting = asyncio.create_task(second.next_batch())
        await asyncio.sleep(0)
        cancelled.cancel()
        feed.leave(first)
        await asyncio.sleep(0)
        assert not waiting.done()
        feed.publish(_decision(0))
        return [d.request_id for d in await asyncio.wait_for(waiting, 5)]

    assert asyncio.run(run()) == ["r0"]


def test_a_watcher_further_behind_than_the_ring_is_dropped() -> None:
    async def run() -> None:
        feed = DecisionFeed(capacity=4)
        reader, stuck = feed.watch(), feed.watch()
        for index in range(4):
            feed.publish(_decision(index))
        assert len(await reader.next_batch()) == 4
        # The stuck watcher never reads: the check every `capacity` decisions drops it
        # (it may be blocked in a send that never ends); the reader, a ring behind at
        # most, stays and loses nothing.
        for index in range(4, 8):
            feed.publish(_decision(index))
        assert stuck.dropped.is_set() and stuck not in feed.watches
        with pytest.raises(FellBehind):
            await stuck.next_batch()
        assert [d.request_id for d in await reader.next_batch()] == ["r4", "r5", "r6", "r7"]
        assert not reader.dropped.is_set()
        # One that falls behind between two checks finds out when it reads.
        for index in range(8, 13):
            feed.publish(_decision(index))
        with pytest.raises(FellBehind):
            await reader.next_batch()
        assert reader.dropped.is_set() and not feed.watches

    asyncio.run(run())
