"""The decision log: what Explain, GetJob and WatchDecisions read back."""

from __future__ import annotations

import asyncio

from sidecar.api.v1 import inspect_pb2
from sidecar.runtime.decider import Decision, DecisionLog


def _decision(request_id: str, job_id: str, kind: str = "priority",
              inputs: dict[str, object] | None = None, seq: int = 1) -> Decision:
    return Decision("engine-0", request_id, job_id, kind, f"{kind} for {request_id}",
                    inputs if inputs is not None else {"priority": 1024}, 12.5, seq,
                    "adaptive")


def test_explain_reads_the_last_decision_with_its_inputs_as_json() -> None:
    log = DecisionLog()
    log.add(_decision("r1", "j1", "pin", {"tool": "ls", "blocks": 7, "is_last_step": False}))
    log.add(_decision("r1", "j1", "release", {"retention_priority": 80}, seq=2))
    record = log.last("r1")
    assert record is not None
    assert (record.kind, record.seq, record.policy, record.at_s) == ("release", 2, "adaptive", 12.5)
    assert dict(record.inputs) == {"retention_priority": "80"}
    assert log.last("never-seen") is None


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
        assert log.last("r0") is None  # beyond max_requests
        assert log.last("r1") is records[0]  # built once, shared
        return records

    records = asyncio.run(watched())
    assert [(r.request_id, r.kind) for r in records] == [("r1", "pin"), ("r2", "priority")]
    assert records[0].inputs["tool"] == "pytest"
