"""The wire's general rules, checked field by field from each request's descriptor."""

from __future__ import annotations

import pytest
from google.protobuf.message import Message

from sidecar.api.bounds import FieldError
from sidecar.api.messages import check_message
from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import inspect_pb2, retention_pb2

INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(("message", "error"), [
    (pb.StepReport(now_s=INF), "now_s: must be a finite number, got inf"),
    (pb.StepReport(engine_id="e" * 257), "engine_id: 257 characters exceed the limit of 256"),
    (pb.StepReport(events=[pb.RequestEvent(), pb.RequestEvent(at_s=NAN)]),
     "events[1].at_s: must be a finite number, got nan"),
    (pb.StepReport(events=[pb.RequestEvent(tool="t" * 129)]),
     "events[0].tool: 129 characters exceed the limit of 128"),
    (pb.StepReport(new_requests=[pb.NewRequest(state=3)]),
     "new_requests[0].state: 3 is not a RequestState (REQUEST_STATE_UNSPECIFIED, "
     "REQUEST_STATE_WAITING, REQUEST_STATE_RUNNING)"),
    (pb.StepReport(released_pins=["a", "b\n"]),
     "released_pins[1]: must not contain control characters"),
    (pb.StepReport(work=pb.StepWork(busy_s=-INF)),
     "work.busy_s: must be a finite number, got -inf"),
    (pb.StepReport(new_requests=[pb.NewRequest(retention=retention_pb2.RetentionConfig(
        token_ranges=[retention_pb2.TokenRangeRetention(duration_s=NAN)]))]),
     "new_requests[0].retention.token_ranges[0].duration_s: must be a finite number, got nan"),
    (retention_pb2.SetDirectivesRequest(target=retention_pb2.RetentionTarget(
        session_id="s\u2028")), "target.session_id: must not contain control characters"),
    (inspect_pb2.DecisionRecord(inputs={"a": "b" * 300}),
     "inputs['a']: 300 characters exceed the limit of 256"),
])
def test_a_bad_field_is_refused_by_its_name(message: Message, error: str) -> None:
    with pytest.raises(FieldError) as refused:
        check_message(message)
    assert str(refused.value) == error


def test_good_messages_and_skipped_fields_pass() -> None:
    check_message(pb.StepReport(
        engine_id="e", now_s=1.0, released_pins=["p"], kv=pb.KvCapacity(total_blocks=4),
        new_requests=[pb.NewRequest(request_id="r", tool_hint="grep -r", state=2,
                                    arrival_s=0.5)],
        events=[pb.RequestEvent(request_id="r", kind=pb.EVENT_KIND_FINISHED, at_s=1.0)]))
    # Non-ASCII text is text: only control characters are refused.
    check_message(inspect_pb2.GetJobRequest(job_id="日本\u00a0job"))
    skip = frozenset({"new_requests.retention"})
    check_message(pb.StepReport(new_requests=[pb.NewRequest(
        retention=retention_pb2.RetentionConfig(decode_duration_s=INF))]), skip)
