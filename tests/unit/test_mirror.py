"""The daemon's mirror of an engine keeps what the policies are shown of a request."""

from __future__ import annotations

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.runtime.mirror import EngineMirror


def _event(request_id: str, kind: int, cached_tokens: int = 0) -> pb.RequestEvent:
    return pb.RequestEvent(request_id=request_id, kind=kind, at_s=1.0,
                           cached_tokens=cached_tokens)


def test_a_request_shows_the_prefix_cache_hit_of_its_first_admission() -> None:
    mirror = EngineMirror("e")
    mirror.apply(pb.StepReport(engine_id="e", seq=1, snapshot=True, now_s=1.0, new_requests=[
        pb.NewRequest(request_id="t2", job_id="agent", arrival_s=1.0, prompt_tokens=640,
                      state=pb.REQUEST_STATE_WAITING)]))
    (waiting,) = mirror.waiting()
    assert waiting.cached_tokens == 0, "not admitted yet"

    mirror.apply(pb.StepReport(engine_id="e", seq=2, now_s=2.0, events=[
        _event("t2", pb.EVENT_KIND_ADMITTED, cached_tokens=608)]))
    (running,) = mirror.running()
    assert running.cached_tokens == 608

    # Preempted, then resumed: a resumed request's ADMITTED event carries no hit, and
    # the first admission's stays.
    mirror.apply(pb.StepReport(engine_id="e", seq=3, now_s=3.0, events=[
        _event("t2", pb.EVENT_KIND_PREEMPTED)]))
    mirror.apply(pb.StepReport(engine_id="e", seq=4, now_s=4.0, events=[
        _event("t2", pb.EVENT_KIND_ADMITTED)]))
    (resumed,) = mirror.running()
    assert resumed.cached_tokens == 608
