"""One live stream owns an engine id: a newer stream's snapshot replaces it, nothing
the replaced stream sends is applied, and a unary Step cannot touch an owned engine."""

from __future__ import annotations

import pytest

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.runtime.engines import EngineOwned, EngineStream, SessionReplaced
from tests.unit.test_engine_departure import Clock, registry

KV = pb.KvCapacity(total_blocks=100, free_blocks=100, block_size_tokens=16)


def report(seq: int, snapshot: bool = False, *requests: str) -> pb.StepReport:
    return pb.StepReport(engine_id="e", seq=seq, snapshot=snapshot, now_s=float(seq), kv=KV,
                         new_requests=[pb.NewRequest(request_id=r, job_id=r, arrival_s=1.0)
                                       for r in requests])


def test_a_replaced_stream_changes_nothing_and_learns_why() -> None:
    engines, _policy = registry(Clock())
    older, newer = EngineStream(), EngineStream()
    engines.handle(report(1, True, "old"), older)
    engines.handle(report(1, True, "new"), newer)
    assert older.replaced.is_set() and not newer.replaced.is_set()
    for late in (report(2, False, "late"), report(3, True, "late")):
        with pytest.raises(SessionReplaced, match="engine 'e': replaced by a newer session"):
            engines.handle(late, older)
    assert set(engines.mirrors["e"].requests) == {"new"}
    # The replaced stream closing leaves the newer one's engine in place.
    engines.disconnect("e", older)
    assert "e" in engines.mirrors
    assert not engines.handle(report(2, False, "next"), newer).resync_requested


def test_a_delta_from_a_stream_without_the_snapshot_asks_for_one() -> None:
    engines, _policy = registry(Clock())
    owner, stranger = EngineStream(), EngineStream()
    engines.handle(report(1, True, "a"), owner)
    assert engines.handle(report(2, False, "b"), stranger).resync_requested
    assert set(engines.mirrors["e"].requests) == {"a"}
    assert not engines.handle(report(2, False, "c"), owner).resync_requested


def test_a_unary_step_cannot_change_an_owned_engine() -> None:
    engines, _policy = registry(Clock())
    owner = EngineStream()
    engines.handle(report(1, True, "a"), owner)
    with pytest.raises(EngineOwned, match="engine 'e': has a live Session"):
        engines.handle(report(1, True))
    assert set(engines.mirrors["e"].requests) == {"a"}
    engines.disconnect("e", owner)
    assert not engines.handle(report(1, True)).resync_requested
