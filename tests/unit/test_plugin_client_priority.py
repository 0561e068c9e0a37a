"""The client's own priority under the plugin (vLLM's real scheduler, no model): the
first key of vLLM's order, the daemon's ranks ordering requests only inside one
priority value, admission and victims alike; ``Request.priority`` reads as what the
client sent; without the daemon, vLLM's own priority order exactly."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from sidecar.api.v1 import engine_session_pb2 as pb
from tests.support.engine import requires_vllm, tiny_model_dir

pytestmark = requires_vllm

BLOCK = 16


def engine(monkeypatch: pytest.MonkeyPatch, policy: str = "priority", **kwargs: Any) -> Any:
    """The plugin's scheduler, its daemon out of reach (ranks are applied by hand)."""
    from tests.support.scheduler import build_scheduler
    from vllm_plugin.scheduler import KvtetherScheduler

    monkeypatch.setenv("KVTETHER_PLUGIN_DAEMON_ADDRESS", "127.0.0.1:1")
    kwargs.setdefault("num_blocks", 64)
    return build_scheduler(tiny_model_dir(), block_size=BLOCK, policy=policy,
                           scheduler_cls=KvtetherScheduler, **kwargs)


def add(scheduler: Any, request_id: str, priority: int, arrival_time: float,
        tokens: int = BLOCK, max_tokens: int = 4) -> Any:
    from tests.support.scheduler import make_request

    request = make_request(request_id, [hash(request_id) % 1000 + 1] * tokens, max_tokens,
                           BLOCK, arrival_time=arrival_time, priority=priority)
    scheduler.add_request(request)
    return request


def rank(scheduler: Any, ranks: dict[str, int], seq: int = 1) -> None:
    """What the daemon answers: a rank per request."""
    scheduler.kvtether.decisions.apply([pb.StepDecision(seq=seq, priorities=[
        pb.RequestPriority(request_id=request_id, priority=value)
        for request_id, value in ranks.items()])])


def admitted(scheduler: Any) -> list[str]:
    from tests.support.scheduler import step

    return [new.req_id for new in step(scheduler).scheduled_new_reqs]


def test_without_the_daemon_the_order_is_vllms_own_and_priorities_read_as_sent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = engine(monkeypatch)
    try:
        # vLLM's own test_priority_scheduling_mixed_priority_and_arrival.
        for request_id, priority, arrival in (("0", 2, 1.0), ("1", 1, 3.0), ("2", 1, 2.0),
                                              ("3", 0, 4.0)):
            add(scheduler, request_id, priority, arrival)
        assert [r.priority for r in scheduler.waiting] == [0, 1, 1, 2]
        assert admitted(scheduler) == ["3", "2", "1", "0"]
        assert sorted(str(r.priority) for r in scheduler.running) == ["0", "1", "1", "2"]
    finally:
        scheduler.shutdown()


def test_the_daemons_ranks_order_requests_only_inside_one_client_priority(
        monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = engine(monkeypatch, max_num_seqs=1)
    try:
        for request_id, priority, arrival in (("batch-old", 5, 1.0), ("batch-new", 5, 2.0),
                                              ("chat-old", 0, 3.0), ("chat-new", 0, 4.0)):
            add(scheduler, request_id, priority, arrival, max_tokens=1)
        # The daemon prefers the newest of each, and a batch request above every chat.
        rank(scheduler, {"batch-new": -2048, "batch-old": -1024, "chat-new": 0,
                         "chat-old": 1024})
        order = []
        while scheduler.has_unfinished_requests():
            order += admitted(scheduler)
        assert order == ["chat-new", "chat-old", "batch-new", "batch-old"]
    finally:
        scheduler.shutdown()


def test_victims_come_from_the_lowest_client_priority_whatever_the_daemons_ranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.scheduler import step

    # 6 usable blocks: three requests of two blocks each grow until one gives way.
    scheduler = engine(monkeypatch, num_blocks=7, max_num_seqs=3)
    try:
        add(scheduler, "batch", 5, 1.0, tokens=2 * BLOCK - 2, max_tokens=64)
        add(scheduler, "chat-a", 0, 2.0, tokens=2 * BLOCK - 2, max_tokens=64)
        add(scheduler, "chat-b", 0, 3.0, tokens=2 * BLOCK - 2, max_tokens=64)
        step(scheduler)
        assert len(scheduler.running) == 3
        # The daemon would preempt chat-a first, then chat-b, batch last.
        rank(scheduler, {"batch": -1024, "chat-b": 0, "chat-a": 1024})
        preempted: list[str] = []
        while not preempted:
            preempted = list(step(scheduler).preempted_req_ids or ())
        assert preempted == ["batch"], "the lower client priority gives way first"
        while scheduler.running and len(preempted) < 2:
            preempted += list(step(scheduler).preempted_req_ids or ())
        assert preempted[:2] == ["batch", "chat-a"], "then the daemon's order"
    finally:
        scheduler.shutdown()


def test_the_fcfs_policy_is_turned_to_priority_with_one_line(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from vllm.v1.core.sched.request_queue import SchedulingPolicy

    with caplog.at_level(logging.WARNING, logger="kvtether.plugin"):
        scheduler = engine(monkeypatch, policy="fcfs")
    try:
        assert scheduler.policy == SchedulingPolicy.PRIORITY
        assert scheduler.kvtether is not None
        lines = [r.getMessage() for r in caplog.records if r.name == "kvtether.plugin"]
        assert lines == ["kvtether: vLLM's scheduling policy is now 'priority' (it was "
                         "'fcfs'): kvtether orders requests inside each client priority; "
                         "start vLLM with --scheduling-policy priority to say so"]
    finally:
        scheduler.shutdown()
