"""KV hint envelopes (vLLM's Request.kv_hints) read into job, last step, tool and
retention, in kvtether's forms and in those their publishers ship (NVIDIA Dynamo's
kv.retain / kv.evict, vLLM's kv.retain and vllm.set_priority, on the payloads their
sources show); unknown actions counted, malformed ones counted and named, refused
fields counted apart; and the plugin's request metadata taking them after vllm_xargs
and before session_id."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from sidecar.api.kv_hints import (
    DYNAMO_RETAIN_PRIORITY,
    LINEAGE_REFUSED,
    from_vllm_claim_value,
    from_vllm_retain_priority,
    read_kv_hints,
)
from vllm_plugin import metadata
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
# What Dynamo's KV-hint policy example emits (ai-dynamo/dynamo
# examples/router/kv-hint-policy-example/src/lib.rs, SessionKvHintPolicy::hint and its
# tests spawn_retention_emits_priority_and_ttl / final_session_emits_deferred_eviction):
# the session lineage's block hashes as decimal strings, next to the current request.
DYNAMO_LINEAGE_RETAIN = {"priority": 3, "ttl_seconds": 2.5, "execute_at": "request_completion",
                         "include_current_request": True, "block_hashes": ["11", "12"]}
DYNAMO_LINEAGE_EVICT = {"execute_at": "request_completion", "include_current_request": True,
                        "block_hashes": ["11", "18446744073709551615"]}
# The same policy with the request's retention block range set (evaluate(): block_hashes
# empty and include_current_request false when the range is given).
DYNAMO_BLOCK_RANGE_RETAIN = {"priority": 3, "ttl_seconds": 2.5,
                             "execute_at": "request_completion",
                             "include_current_request": False, "block_hashes": [],
                             "current_request_block_start": 2,
                             "current_request_block_count": 3}
# vLLM's token-range kv.retain 1.0 (vllm-project/vllm vllm/v1/kv_hints/retain.py and
# tests/v1/kv_hints/test_retain.py, test_single_action_parses_in_order and
# test_covers_output_directive).
VLLM_RETAIN = {"scope": "alice", "directives": [
    {"start": 0, "end": 32, "priority": 80, "duration": 60.0},
    {"start": 32, "end": None, "priority": 40}]}
VLLM_RETAIN_OUTPUT = {"scope": "alice",
                      "directives": [{"covers_output": True, "priority": 70, "duration": 5.0}]}
# vLLM's vllm.set_priority 1.0, applied at completion (vllm-project/vllm
# vllm/v1/kv_hints/README.md "G1 RETAIN via SET_PRIORITY", vllm/v1/kv_hints/actions.py
# SetPriority): a claim, and the same claim cleared (value null, no ttl, next revision).
VLLM_SET_PRIORITY = {"target": "request_cached", "location": "local_g1",
                     "claim_id": "router/session-1", "revision": 1, "value": 10,
                     "ttl_seconds": 60}
VLLM_CLEAR_PRIORITY = {"target": "request_cached", "location": "local_g1",
                       "claim_id": "router/session-1", "revision": 2, "value": None}


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


def ranges(config: Any) -> list[tuple[int, int | None, int, float | None]]:
    return [(r.token_start, r.token_end if r.HasField("token_end") else None, r.priority,
             r.duration_s if r.HasField("duration_s") else None) for r in config.token_ranges]


def test_dynamo_lineage_form_keeps_this_request_and_refuses_the_hashes_counted() -> None:
    retain = read_kv_hints(envelope(action("kv.retain", "1.0", DYNAMO_LINEAGE_RETAIN)))
    assert retain.retention is not None and retain.scope_is_session
    assert ranges(retain.retention) == [(0, None, DYNAMO_RETAIN_PRIORITY, 2.5)]
    assert (retain.ignored, retain.problems) == (0, ())
    assert retain.refused == (
        f"kv_hints.actions[0].payload.block_hashes: 2 blocks: {LINEAGE_REFUSED}",)
    evict = read_kv_hints(envelope(action("kv.evict", "1.0", DYNAMO_LINEAGE_EVICT)))
    assert evict.is_last_step and ranges(evict.retention) == [(0, None, 35, None)]
    assert (evict.ignored, len(evict.refused)) == (0, 1)


def test_dynamo_block_range_is_this_requests_tokens_by_block_size() -> None:
    reading = read_kv_hints(envelope(action("kv.retain", "1.0", DYNAMO_BLOCK_RANGE_RETAIN)),
                            block_size_tokens=16)
    # Blocks 2, 3 and 4: tokens [32, 80); the rest of the request keeps the default.
    assert ranges(reading.retention) == [(32, 80, DYNAMO_RETAIN_PRIORITY, 2.5)]
    assert (reading.ignored, reading.refused) == (0, ())
    unknown_size = read_kv_hints(envelope(action("kv.retain", "1.0",
                                                 DYNAMO_BLOCK_RANGE_RETAIN)))
    assert unknown_size.retention is None and unknown_size.ignored == 1
    assert unknown_size.problems[0].startswith(
        "kv_hints.actions[0].payload.current_request_block_start: ")


def test_vllm_retain_ranges_on_kvtethers_scale() -> None:
    reading = read_kv_hints(envelope(action("kv.retain", "1.0", VLLM_RETAIN)))
    # vLLM's 80 and 40 protect above unprotected blocks (0 there, 35 here).
    assert ranges(reading.retention) == [(0, 32, 87, 60.0), (32, None, 61, None)]
    assert reading.retention_scope == "alice" and not reading.scope_is_session
    assert (reading.ignored, reading.refused) == (0, ())
    output = read_kv_hints(envelope(action("kv.retain", "1.0", VLLM_RETAIN_OUTPUT)))
    assert output.retention is not None and ranges(output.retention) == []
    assert (output.retention.decode_priority, output.retention.decode_duration_s) == (81, 5.0)
    assert [from_vllm_retain_priority(p) for p in (0, 1, 50, 100)] == [35, 36, 68, 100]


def test_vllm_retain_actions_concatenate_under_one_scope() -> None:
    both = read_kv_hints(envelope(
        action("kv.retain", "1.0", {"scope": "alice",
                                    "directives": [{"start": 0, "end": 16, "priority": 90}]}),
        action("kv.retain", "1.0", {"scope": "alice",
                                    "directives": [{"start": 16, "end": 32, "priority": 50}]})))
    assert [r[:3] for r in ranges(both.retention)] == [(0, 16, 94), (16, 32, 68)]
    clash = read_kv_hints(envelope(
        action("kv.retain", "1.0", {"scope": "a", "directives": [{"start": 0, "priority": 9}]}),
        action("kv.retain", "1.0", {"scope": "b", "directives": [{"start": 0, "priority": 9}]})))
    assert clash.problems[0].startswith("kv_hints.actions[1].payload.scope: ")
    assert ranges(clash.retention) == [(0, None, 41, None)]


def test_vllm_set_priority_is_the_claims_retention_and_null_clears_it() -> None:
    claim = read_kv_hints(envelope(action("vllm.set_priority", "1.0", VLLM_SET_PRIORITY)))
    assert ranges(claim.retention) == [(0, None, 45, 60.0)]
    assert claim.retention_scope == "router/session-1" and not claim.scope_is_session
    cleared = read_kv_hints(envelope(action("vllm.set_priority", "1.0", VLLM_CLEAR_PRIORITY)))
    assert ranges(cleared.retention) == [(0, None, 35, None)]
    assert cleared.retention_scope == "router/session-1"
    assert [from_vllm_claim_value(v) for v in (-50, 0, 10, 65, 10**6)] == [0, 35, 45, 100, 100]


def test_the_last_retaining_action_owns_the_retention() -> None:
    claim_last = read_kv_hints(envelope(action("kv.retain", "1.0", DYNAMO_RETAIN),
                                        action("vllm.set_priority", "1.0", VLLM_SET_PRIORITY)))
    assert (claim_last.retention_scope, claim_last.scope_is_session) == (
        "router/session-1", False)
    session_last = read_kv_hints(envelope(action("vllm.set_priority", "1.0", VLLM_SET_PRIORITY),
                                          action("kv.retain", "1.0", DYNAMO_RETAIN)))
    assert (session_last.retention_scope, session_last.scope_is_session) == ("", True)
    assert ranges(session_last.retention) == [(0, None, DYNAMO_RETAIN_PRIORITY, 300.0)]


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
        (action("kv.retain", "1.0", {**DYNAMO_RETAIN, "include_current_request": False,
                                     "block_hashes": ["11"]}),
         "kv_hints.actions[0].payload.include_current_request"),
        (action("kv.retain", "1.0", {**DYNAMO_RETAIN, "current_request_block_start": 2}),
         "kv_hints.actions[0].payload.current_request_block_count"),
        (action("kv.retain", "1.0", {**DYNAMO_RETAIN, "execute_at": "now"}),
         "kv_hints.actions[0].payload.execute_at"),
        # Told apart by shape: directives make it vLLM's, where block_hashes is unknown.
        (action("kv.retain", "1.0", {"directives": [], "block_hashes": []}),
         "kv_hints.actions[0].payload.block_hashes"),
        (action("kv.retain", "1.0", {"directives": [{"start": 0, "priority": 101}]}),
         "kv_hints.actions[0].payload.directives[0].priority"),
        (action("kv.retain", "1.0", {"directives": [{"start": 0, "end": 16, "priority": 30},
                                                    {"start": 16, "priority": 80}]}),
         "kv_hints.actions[0].payload.directives"),
        (action("kv.retain", "1.0", {"directives": [
            {"covers_output": True, "start": 0, "priority": 10}]}),
         "kv_hints.actions[0].payload.directives[0].covers_output"),
        (action("kv.retain", "1.0", {"directives": [{"start": 16, "end": 16, "priority": 9}]}),
         "kv_hints.actions[0].payload.directives[0].end"),
        (action("vllm.set_priority", "1.0", {**VLLM_SET_PRIORITY, "ttl_seconds": None}),
         "kv_hints.actions[0].payload.ttl_seconds"),
        (action("vllm.set_priority", "1.0", {**VLLM_CLEAR_PRIORITY, "ttl_seconds": 5}),
         "kv_hints.actions[0].payload.ttl_seconds"),
        (action("vllm.set_priority", "1.0", {**VLLM_SET_PRIORITY, "target": "hashes"}),
         "kv_hints.actions[0].payload.target"),
        (action("vllm.set_priority", "1.0", {**VLLM_SET_PRIORITY, "claim_id": ""}),
         "kv_hints.actions[0].payload.claim_id"),
        (action("vllm.set_priority", "1.0", {**VLLM_SET_PRIORITY, "revision": -1}),
         "kv_hints.actions[0].payload.revision"),
        (action("vllm.set_priority", "1.0", {**VLLM_SET_PRIORITY, "extra": 1}),
         "kv_hints.actions[0].payload.extra"),
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


def test_refused_fields_are_counted_per_request_and_warned_once(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metadata, "_refused_warned", set())
    lineage = envelope(action("kv.retain", "1.0", DYNAMO_LINEAGE_RETAIN))
    with caplog.at_level(logging.WARNING, logger="kvtether.plugin"):
        metas = [read_metadata(request(None, lineage, session_id="dyn-9"), 16)
                 for _ in range(3)]
    assert [m.kv_hint_fields_refused for m in metas] == [1, 1, 1]
    assert all(m.kv_hint_actions_ignored == 0 and m.retention is not None for m in metas)
    warnings = [r.getMessage() for r in caplog.records
                if "kv_hints.actions[0].payload.block_hashes" in r.getMessage()]
    assert len(warnings) == 1 and "2 blocks" in warnings[0], warnings
    ranged = read_metadata(request(None, envelope(
        action("kv.retain", "1.0", DYNAMO_BLOCK_RANGE_RETAIN)), session_id="dyn-9"), 16)
    assert _retention_config("r1", ranged).token_ranges[0].token_start == 32
    assert ranged.retention_scope == "dyn-9"
