"""The decision log: what Explain, GetJob and WatchDecisions read back."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from sidecar.api.v1 import inspect_pb2
from sidecar.runtime.decider import Decision, DecisionLog
from sidecar.runtime.request_ids import response_ids_of
from tests.support.engine import requires_vllm


def _decision(request_id: str, job_id: str, kind: str = "priority",
              inputs: dict[str, object] | None = None, seq: int = 1) -> Decision:
    return Decision("engine-0", request_id, job_id, kind, f"{kind} for {request_id}",
                    inputs if inputs is not None else {"priority": 1024}, 12.5, seq,
                    "adaptive")


def test_explain_reads_the_last_decision_with_its_inputs_as_json() -> None:
    log = DecisionLog()
    log.add(_decision("r1", "j1", "pin", {"tool": "ls", "blocks": 7, "is_last_step": False}))
    log.add(_decision("r1", "j1", "release", {"retention_priority": 80}, seq=2))
    record = log.explain("r1")[-1]
    assert (record.kind, record.seq, record.policy, record.at_s) == ("release", 2, "adaptive", 12.5)
    assert dict(record.inputs) == {"retention_priority": "80"}
    assert log.explain("never-seen") == []


def test_a_job_lists_its_latest_decisions_first_up_to_the_limit() -> None:
    log = DecisionLog()
    for index in range(5):
        log.add(_decision(f"a{index}", "job-a", seq=index))
        log.add(_decision(f"b{index}", "job-b", seq=index))
    assert [r.request_id for r in log.for_job("job-a", limit=3)] == ["a4", "a3", "a2"]
    assert [r.request_id for r in log.for_job("job-b")] == ["b4", "b3", "b2", "b1", "b0"]
    assert log.for_job("job-c") == []


def test_watchers_get_every_decision_and_the_oldest_requests_are_forgotten() -> None:
    async def watched() -> list[inspect_pb2.DecisionRecord]:
        log = DecisionLog(max_requests=2)
        log.add(_decision("r0", "j"))
        watch = log.feed.watch()
        log.add(_decision("r1", "j", "pin", {"tool": "pytest"}))
        log.add(_decision("r2", "j"))
        records = [decision.record() for decision in await watch.next_batch()]
        assert log.explain("r0") == []  # beyond max_requests
        assert log.explain("r1")[-1] is records[0]  # built once, shared
        return records

    records = asyncio.run(watched())
    assert [(r.request_id, r.kind) for r in records] == [("r1", "pin"), ("r2", "priority")]
    assert records[0].inputs["tool"] == "pytest"


def test_a_requests_retention_decision_is_kept_after_its_pin() -> None:
    # A request's retention is still explained after its pin, and its job lists both.
    log = DecisionLog()
    log.add(_decision("r1", "j1", "retention", {"scope": ""}, seq=1))
    log.add(_decision("r1", "j1", "priority", seq=1))
    log.add(_decision("r1", "j1", "priority", {"priority": 7}, seq=2))
    log.add(_decision("r1", "j1", "pin", {"tool": "ls"}, seq=3))
    assert [(r.kind, r.seq) for r in log.explain("r1")] == [
        ("retention", 1), ("priority", 2), ("pin", 3)]
    assert [r.kind for r in log.for_job("j1")] == ["pin", "priority", "retention"]
    assert [r.kind for r in log.for_job("j1", limit=2)] == ["pin", "priority"]


def test_explain_finds_a_request_by_the_id_the_openai_client_got() -> None:
    # The OpenAI client's id finds the request vLLM scheduled under it plus a suffix.
    log = DecisionLog(max_requests=3)
    log.add(_decision("chatcmpl-7a-1b2c3d4e", "j", "pin"))
    log.add(_decision("0_chatcmpl-n2-00ff00ff", "j", "priority", seq=2))
    log.add(_decision("1_chatcmpl-n2-00ff00ff", "j", "priority", seq=3))
    assert [r.request_id for r in log.explain("chatcmpl-7a")] == ["chatcmpl-7a-1b2c3d4e"]
    # Every child of a parallel-sampling request, the latest last.
    assert [r.seq for r in log.explain("chatcmpl-n2")] == [2, 3]
    assert log.explain("chatcmpl") == [] and log.explain("chatcmpl-7a-1b2c") == []
    # Forgetting a request forgets its other id too: memory stays bounded.
    log.add(_decision("other", "j"))
    assert log.explain("chatcmpl-7a") == [] and log._by_response_id.keys() == {
        "0_chatcmpl-n2", "chatcmpl-n2", "1_chatcmpl-n2"}


@requires_vllm
def test_response_ids_follow_the_installed_vllm() -> None:
    """vLLM's own id assignment, for a request and for the children of one with n > 1."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.parallel_sampling import ParentRequest

    request = SimpleNamespace(request_id="chatcmpl-5b1f0c9e", external_req_id=None,
                              params=SamplingParams(n=2))
    InputProcessor.assign_request_id(request)
    assert request.request_id != "chatcmpl-5b1f0c9e"
    assert "chatcmpl-5b1f0c9e" in response_ids_of(request.request_id)
    parent = ParentRequest(request)  # type: ignore[arg-type]
    for index in range(2):
        child_id, _ = parent.get_child_info(index)
        assert "chatcmpl-5b1f0c9e" in response_ids_of(child_id)
