"""The engine's own rules without the daemon's word (vllm_plugin.fallback), and the
report builder's pending lists (vllm_plugin.reports), on plain objects."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sidecar.api.retention_ranges import Protection
from sidecar.api.v1 import engine_session_pb2 as pb
from vllm_plugin import fallback
from vllm_plugin.pins import Pin
from vllm_plugin.reports import ReportBuilder
from vllm_plugin.timing import StepTiming


def pin(request_id: str, job_id: str, pinned_at_s: float, *, confirmed: bool = False,
        release_at_s: float = 100.0) -> Pin:
    return Pin(request_id=request_id, job_id=job_id, blocks=[], pinned_at_s=pinned_at_s,
               release_at_s=release_at_s, confirmed=confirmed, last_sched_seq=0, tool="")


def test_a_request_the_daemon_has_not_ranked_queues_behind_every_ranked_one() -> None:
    from sidecar.runtime.priorities import PRIORITY_LIMIT

    # The daemon's ranks are strictly inside (-PRIORITY_LIMIT, PRIORITY_LIMIT).
    from vllm_plugin.ranks import UNRANKED_RANK

    assert UNRANKED_RANK >= PRIORITY_LIMIT


def test_an_idle_engine_releases_in_the_daemons_order_first() -> None:
    pins = [pin("a-1", "a", 1.0), pin("b-1", "b", 2.0), pin("c-1", "c", 3.0)]
    chosen = fallback.idle_release(pins, ["c-1", "b-1"], head_job="", waiting_jobs=set())
    assert chosen.request_id == "c-1"


def test_an_idle_engine_releases_pins_of_jobs_not_waiting_before_waiting_ones() -> None:
    pins = [pin("a-1", "a", 1.0), pin("b-1", "b", 2.0), pin("c-1", "c", 3.0)]
    released = []
    remaining = list(pins)
    while remaining:  # one a step, as the engine does
        chosen = fallback.idle_release(remaining, [], head_job="", waiting_jobs={"a"})
        released.append(chosen.request_id)
        remaining.remove(chosen)
    # b and c have nothing waiting (oldest first), a has a request waiting.
    assert released == ["b-1", "c-1", "a-1"]


def test_an_idle_engine_releases_the_head_requests_own_job_last() -> None:
    pins = [pin("a-1", "a", 1.0), pin("b-1", "b", 2.0)]
    # Even first in the daemon's order, the head request's own job goes last: its
    # context is what the request about to be admitted would hit.
    chosen = fallback.idle_release(pins, ["a-1", "b-1"], head_job="a", waiting_jobs={"a", "b"})
    assert chosen.request_id == "b-1"
    # A head request with no job ranks no pin last.
    chosen = fallback.idle_release(pins, [], head_job="", waiting_jobs=set())
    assert chosen.request_id == "a-1"


def test_with_the_daemon_gone_the_oldest_pin_gives_way() -> None:
    pins = [pin("b-1", "b", 5.0), pin("a-1", "a", 2.0), pin("c-1", "c", 9.0)]
    assert fallback.oldest_pin(pins).request_id == "a-1"


@pytest.mark.parametrize(("policy", "expected"), [
    (None, Protection(50, None)),  # the policy named none: raised, until evicted
    (Protection(10, 3.0), Protection(50, 3.0)),  # raised, the policy's duration kept
    (Protection(80, None), Protection(80, None)),  # never lowered
])
def test_a_stale_release_is_cached_at_least_at_the_returned_jobs_priority(
        policy: Protection | None, expected: Protection) -> None:
    assert fallback.returned_job_protection(policy, returned_job_priority=50) == expected


def test_a_confirmed_pin_is_bounded_by_max_pin_while_connected_else_by_its_own() -> None:
    confirmed = pin("a-1", "a", 10.0, confirmed=True, release_at_s=20.0)
    assert fallback.local_bound_s(confirmed, connected=True, max_pin_s=300.0) == 310.0
    assert fallback.local_bound_s(confirmed, connected=False, max_pin_s=300.0) == 20.0
    provisional = pin("b-1", "b", 10.0, release_at_s=12.0)
    assert fallback.local_bound_s(provisional, connected=True, max_pin_s=300.0) == 12.0


def test_a_confirmed_pins_expiry_never_passes_max_pin() -> None:
    assert fallback.capped_expiry_s(10.0, expires_at_s=50.0, max_pin_s=300.0) == 50.0
    assert fallback.capped_expiry_s(10.0, expires_at_s=1e9, max_pin_s=300.0) == 310.0


def test_only_a_jobs_stopped_or_capped_non_last_turn_is_held() -> None:
    stop, length = pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH
    assert fallback.holds_finished_turn("job", False, stop)
    assert fallback.holds_finished_turn("job", False, length)
    assert not fallback.holds_finished_turn("", False, stop)  # no job: no next turn
    assert not fallback.holds_finished_turn("job", True, stop)  # the job is over
    assert not fallback.holds_finished_turn("job", False, pb.FINISH_REASON_ABORT)
    assert not fallback.holds_finished_turn("job", False, pb.FINISH_REASON_ERROR)
    assert fallback.job_is_over("job", True)
    assert not fallback.job_is_over("", True) and not fallback.job_is_over("job", False)


def _builder(connected: bool = True) -> tuple[ReportBuilder, Any]:
    pool = SimpleNamespace(num_gpu_blocks=16, get_num_free_blocks=lambda: 16)
    scheduler = SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=pool),
                                requests={}, block_size=16)
    link: Any = SimpleNamespace(connected=connected, needs_snapshot=False)
    settings: Any = SimpleNamespace(engine_id="e", waiting_demand_thread="link",
                                    pin_heartbeat_s=0.1)
    demand: Any = SimpleNamespace(enabled=False)
    builder = ReportBuilder(scheduler, settings, link, pb.EngineCounters(), demand,
                            {}, set(), StepTiming(lambda: 1.0), lambda: 1.0)
    return builder, link


def _pend(builder: ReportBuilder, request_id: str) -> None:
    builder.new.append(pb.NewRequest(request_id=request_id))
    builder.add_event(pb.RequestEvent(request_id=request_id, kind=pb.EVENT_KIND_ADMITTED))
    builder.released.append(request_id)


def test_each_report_carries_what_came_since_the_last_and_a_snapshot_drops_it() -> None:
    builder, link = _builder()
    _pend(builder, "r1")
    first = builder.build({})
    assert first is not None and not first.snapshot
    assert [n.request_id for n in first.new_requests] == ["r1"]
    assert list(first.released_pins) == ["r1"] and len(first.events) == 1
    assert builder.build({}) is None, "nothing changed: no report"
    _pend(builder, "r2")
    link.needs_snapshot = True
    snapshot = builder.build({"p": pin("p", "j", 0.5)})
    assert snapshot is not None and snapshot.snapshot and snapshot.seq == first.seq + 1
    # The snapshot lists the live requests and pins anew; what was pending is gone.
    assert not snapshot.events and not snapshot.released_pins
    assert [p.request_id for p in snapshot.pins] == ["p"]
    link.needs_snapshot = False
    _pend(builder, "r3")
    delta = builder.build({})
    assert delta is not None and [n.request_id for n in delta.new_requests] == ["r3"]
    assert list(delta.released_pins) == ["r3"]


def test_nothing_pending_survives_a_disconnection() -> None:
    builder, link = _builder(connected=False)
    _pend(builder, "r1")
    assert builder.build({}) is None
    link.connected = True
    report = builder.build({})
    assert report is not None, "the free blocks are news to a new session"
    assert not report.new_requests and not report.events and not report.released_pins
