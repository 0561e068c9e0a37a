"""KV hint envelopes (vLLM's Request.kv_hints) read into job, last step, tool and
retention; unknown actions counted, malformed ones counted and named; and the plugin's
request metadata taking them after vllm_xargs and before session_id."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from sidecar.api.kv_hints import DYNAMO_RETAIN_PRIORITY, read_kv_hints
from vllm_plugin.metadata import read_metadata
from vllm_plugin.reports import _retention_config


def action(action_type: str, version: str, payload: Any) -> SimpleNamespace:
    # vLLM's KvHintAction is a msgspec Struct: read by attribute.
    return SimpleNamespace(action_id="a1", action_type=action_type,
                           action_version=version, payload=payload)


def envelope(*actions: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(protocol_version="0.1", message_id="m1", actions=list(actions))


def job(**payload: Any) -> SimpleNamespace:
    return action("kvtether.job", "1", payload)


DYNAMO_RETAIN = {"block_hashes": [], "execute_at": "request_completion",
                 "include_current_request": True, "priority": 10, "ttl_seconds": 300}
DYNAMO_EVICT = {"block_hashes": [], "execute_at": "request_completion",
                "include_current_request": True}


def test_reads_job_and_retention_actions() -> None:
    reading = read_kv_hints(envelope(
        job(job_id="job-7", is_last_step=False, tool="pytest"),
        action("kvtether.retention", "1", {
            "directives": [{"start": 0, "end": 64, "priority": 100},
                           {"start": 64, "priority": 80, "duration": 30}],
            "scope": "router"}),
    ))
    assert (reading.job_id, reading.is_last_step, reading.tool) == ("job-7", False, "pytest")
    assert reading.retention is not None and reading.retention_scope == "router"
    assert [(r.token_start, r.priority) for r in reading.retention.token_ranges] == [
        (0, 100), (64, 80)]
    assert (reading.ignored, reading.problems) == (0, ())


def test_retention_action_takes_trtllm_form() -> None:
    reading = read_kv_hints(envelope(action("kvtether.retention", "1", {
        "kv_cache_retention_config": {"token_range_retention_configs": [
            {"token_start": 0, "token_end": None, "priority": 90, "duration_ms": 2500}]}})))
    assert reading.retention is not None
    assert reading.retention.token_ranges[0].duration_s == 2.5
    assert reading.retention.decode_priority == 35


def test_dynamo_retain_keeps_the_request_and_evict_ends_the_session() -> None:
    retain = read_kv_hints({"protocol_version": "0.1", "message_id": "m",
                            "actions": [{"action_id": "a", "action_type": "kv.retain",
                                         "action_version": "1.0", "payload": DYNAMO_RETAIN}]})
    assert retain.retention is not None and not retain.is_last_step
    only = retain.retention.token_ranges[0]
    assert (only.token_start, only.HasField("token_end"), only.priority, only.duration_s) == (
        0, False, DYNAMO_RETAIN_PRIORITY, 300.0)
    evict = read_kv_hints(envelope(action("kv.evict", "1.0", DYNAMO_EVICT)))
    assert evict.is_last_step and evict.ignored == 0 and evict.retention is not None
    assert [r.priority for r in evict.retention.token_ranges] == [35]
    assert retain.scope_is_session and evict.scope_is_session


def test_unknown_types_and_versions_are_counted_not_read() -> None:
    reading = read_kv_hints(envelope(
        action("kv.source_locations", "1.0", {"anything": 1}),
        action("kvtether.job", "2", {"job_id": "j", "future_field": True}),
        job(job_id="j1"),
    ))
    assert (reading.job_id, reading.ignored, reading.problems) == ("j1", 2, ())


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (job(job_id=""), "kv_hints.actions[0].payload.job_id"),
        (job(job_id="j", is_last_step="yes"), "kv_hints.actions[0].payload.is_last_step"),
        (job(job_id="j", tool=3), "kv_hints.actions[0].payload.tool"),
        (job(job_id="j", jobid="j"), "kv_hints.actions[0].payload.jobid"),
        (action("kvtether.job", "1", ["j"]), "kv_hints.actions[0].payload"),
        (action("kvtether.retention", "1", {"scope": "s"}), "kv_hints.actions[0].payload"),
        (action("kvtether.retention", "1", {"directives": [{"start": 0}]}),
         "kv_hints.actions[0].payload.directives[0].priority"),
        (action("kvtether.retention", "1", {"directives": "[{"}),
         "kv_hints.actions[0].payload.directives"),
        (action("kvtether.retention", "1", {"kv_cache_retention_config": {
            "token_range_retention_configs": [{"token_start": 0, "priority": 500}]}}),
         "kv_hints.actions[0].payload.kv_cache_retention_config"
         ".token_range_retention_configs[0].priority"),
        (action("kv.retain", "1.0", {**DYNAMO_RETAIN, "block_hashes": [12]}),
         "kv_hints.actions[0].payload.block_hashes"),
        (action("kv.retain", "1.0", {**DYNAMO_RETAIN, "ttl_seconds": -1}),
         "kv_hints.actions[0].payload.ttl_seconds"),
        (action("kv.evict", "1.0", {**DYNAMO_EVICT, "include_current_request": False}),
         "kv_hints.actions[0].payload.include_current_request"),
    ],
)
def test_malformed_actions_are_counted_and_named(bad: SimpleNamespace, field: str) -> None:
    reading = read_kv_hints(envelope(bad))
    assert reading.ignored == 1 and len(reading.problems) == 1
    assert reading.problems[0].startswith(f"{field}: "), reading.problems
    assert reading.job_id == "" and reading.retention is None and not reading.is_last_step


def request(extra: Any = None, hints: Any = None, session_id: str | None = None
            ) -> SimpleNamespace:
    return SimpleNamespace(request_id="r1", session_id=session_id, kv_hints=hints,
                           sampling_params=SimpleNamespace(extra_args=extra))


def test_metadata_order_is_xargs_then_hints_then_session() -> None:
    hinted = envelope(job(job_id="from-hint", is_last_step=True, tool="ls"))
    assert read_metadata(request({"job_id": "from-xargs"}, hinted, "s")).job_id == "from-xargs"
    meta = read_metadata(request(None, hinted, "s"))
    assert (meta.job_id, meta.is_last_step, meta.tool) == ("from-hint", True, "ls")
    assert read_metadata(request(None, envelope(), "session-3")).job_id == "session-3"
    # vLLM before 0.32 has no kv_hints attribute at all.
    older = SimpleNamespace(request_id="r", session_id=None,
                            sampling_params=SimpleNamespace(extra_args={"job_id": "j"}))
    assert read_metadata(older).job_id == "j"


def test_metadata_carries_retention_to_the_wire() -> None:
    trtllm = ('{"token_range_retention_configs": [{"token_start": 0, "priority": 90,'
              ' "duration_ms": 45000}]}')
    meta = read_metadata(request({"kv_cache_retention_config": trtllm}))
    wire = _retention_config("r1", meta)
    assert wire is not None and wire.token_ranges[0].duration_s == 45.0
    hinted = read_metadata(request(None, envelope(action("kv.retain", "1.0", DYNAMO_RETAIN)),
                                   session_id="dyn-7"))
    assert _retention_config("r1", hinted).token_ranges[0].priority == DYNAMO_RETAIN_PRIORITY
    # Dynamo's session owns what its actions set, so its close may lower it.
    assert (hinted.job_id, hinted.retention_scope) == ("dyn-7", "dyn-7")


def test_malformed_input_warns_once_naming_the_field_and_the_request_runs(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtether.plugin"):
        meta = read_metadata(request(
            {"kv_cache_retention_config": '{"decode_duration_ms": "soon"}'},
            envelope(job(job_id="j", is_last_step=2), action("other.kind", "9", {}))))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert "kv_hints.actions[0].payload.is_last_step" in warnings[0]
    assert "kv_cache_retention_config.decode_duration_ms" in warnings[1]
    assert meta.retention is None and meta.kv_hint_actions_ignored == 2
