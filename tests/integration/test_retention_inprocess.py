"""Retention end to end inside vLLM's real scheduler and block pool (no model, no worker),
with the plugin talking to a real daemon process (fcfs: no pins, so only retention
keeps anything).

A session's system prompt (priority 100) and context (80 for 45 s) survive a flood of
unrelated requests that cycles through every other block — whether the directives come
with the request (vllm_xargs, as the OpenAI API delivers them: a JSON string) or are
pushed for the session over gRPC — and its next turn hits the prefix cache; with no
directive, the same flood evicts them. So does each KV hint form its publishers ship
(Dynamo's lineage and block-range kv.retain, vLLM's kv.retain and vllm.set_priority):
what it names survives the flood.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import retention_pb2, retention_pb2_grpc
from tests.integration.test_plugin_inprocess import Engine
from tests.support.daemon import DaemonProcess, running_daemon
from tests.support.engine import requires_vllm, tiny_model_dir

pytestmark = requires_vllm

BLOCK = 16
SYSTEM_TOKENS = 4 * BLOCK
TURN_TOKENS = 10 * BLOCK
DIRECTIVES = [{"start": 0, "end": SYSTEM_TOKENS, "priority": 100},
              {"start": SYSTEM_TOKENS, "priority": 80, "duration": 45}]


@pytest.fixture(scope="module")
def fcfs() -> Iterator[DaemonProcess]:
    with running_daemon("--policy", "fcfs") as daemon:
        yield daemon


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    made: list[Engine] = []
    model_dir = tiny_model_dir()

    def make(daemon: DaemonProcess, **kwargs: Any) -> Engine:
        engine = Engine(model_dir, daemon, monkeypatch, **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def add(engine: Engine, request_id: str, prompt: list[int], **extra: Any) -> None:
    from tests.support.scheduler import make_request

    engine.sched.add_request(make_request(request_id, prompt, 4, BLOCK, arrival_time=time.time(),
                                          extra_args=extra or None))


def conversation(seed: int, tokens: int) -> list[int]:
    return [100 + seed * 37 + (i % 1400) for i in range(tokens)]


def flood(engine: Engine, waves: int = 5, per_wave: int = 3) -> None:
    """Unrelated requests, a few at a time: each wave fits in the unprotected blocks, and
    together they need more than the whole pool."""
    for wave in range(waves):
        for index in range(per_wave):
            add(engine, f"flood-{wave}-{index}", [1990 - wave * 10 - index] + [1700 + wave] * 48)
        engine.drain()


def session_turns(engine: Engine, session: str, seed: int, **extra: Any) -> int:
    """Turn 1, the flood, turn 2; returns turn 2's prefix-cache hit in tokens."""
    add(engine, f"{session}-t1", conversation(seed, TURN_TOKENS), job_id=session, **extra)
    engine.drain()
    flood(engine)
    add(engine, f"{session}-t2", conversation(seed, TURN_TOKENS + 2 * BLOCK), job_id=session)
    engine.drain()
    return engine.cached_tokens[f"{session}-t2"]


def warm(engine: Engine) -> None:
    add(engine, "warm", [1, 2, 3])
    engine.drain()


def test_directives_keep_a_sessions_context_through_a_flood(
        engines: Callable[..., Engine], fcfs: DaemonProcess) -> None:
    hits = {}
    for case in ("xargs", "pushed", "none"):
        engine = engines(fcfs, num_blocks=40)
        retention = engine.sched.kv_cache_manager.block_pool.kvtether_retention
        warm(engine)
        extra: dict[str, Any] = {}
        if case == "xargs":
            extra = {"retention_directives": json.dumps(DIRECTIVES), "retention_scope": "agent"}
        elif case == "pushed":
            config = retention_pb2.RetentionConfig()
            config.token_ranges.add(token_start=0, token_end=SYSTEM_TOKENS, priority=100)
            config.token_ranges.add(token_start=SYSTEM_TOKENS, priority=80, duration_s=45)
            with grpc.insecure_channel(fcfs.address) as channel:
                retention_pb2_grpc.RetentionStub(channel).SetDirectives(
                    retention_pb2.SetDirectivesRequest(
                        target=retention_pb2.RetentionTarget(session_id="sess-pushed"),
                        config=config, scope="dynamo"), timeout=5)
        hits[case] = session_turns(engine, f"sess-{case}", seed=len(hits), **extra)
        assert engine.free() == engine.start_free, case  # nothing leaked
        if case != "none":
            assert retention.num_retained_entries > 0
        assert engine.sched.reset_prefix_cache()
        assert retention.num_retained_entries == 0
    assert hits["xargs"] >= TURN_TOKENS - BLOCK, hits
    assert hits["pushed"] >= TURN_TOKENS - BLOCK, hits
    assert hits["none"] == 0, hits


def add_hinted(engine: Engine, request_id: str, prompt: list[int], session_id: str,
               *actions: tuple[str, str, dict[str, Any]]) -> None:
    """A request carrying a KV hint envelope and a session id, as an orchestrator's
    ``AsyncLLM.generate(..., session_id=..., kv_hints=...)`` hands it to the engine."""
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    from tests.support.scheduler import make_request

    request = make_request(request_id, prompt, 4, BLOCK, arrival_time=time.time())
    request.kv_hints = KvHintsEnvelope(protocol_version="0.1", message_id=request_id, actions=[
        KvHintAction(action_id=f"a{index}", action_type=kind, action_version=version,
                     payload=payload) for index, (kind, version, payload) in enumerate(actions)])
    request.session_id = session_id
    engine.sched.add_request(request)


# The publishers' own payloads (tests/unit/test_kv_hints.py says where each is from).
HINT_FORMS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "dynamo-lineage": ("kv.retain", "1.0", {
        "priority": 3, "ttl_seconds": 45, "execute_at": "request_completion",
        "include_current_request": True, "block_hashes": ["11", "12"]}),
    "dynamo-block-range": ("kv.retain", "1.0", {
        "priority": 3, "ttl_seconds": 45, "execute_at": "request_completion",
        "include_current_request": False, "block_hashes": [],
        "current_request_block_start": 0, "current_request_block_count": SYSTEM_TOKENS // BLOCK}),
    "vllm-retain": ("kv.retain", "1.0", {"scope": "alice", "directives": [
        {"start": 0, "end": SYSTEM_TOKENS, "priority": 80, "duration": 60.0},
        {"start": SYSTEM_TOKENS, "end": None, "priority": 40}]}),
    "vllm-set-priority": ("vllm.set_priority", "1.0", {
        "target": "request_cached", "location": "local_g1", "claim_id": "router/session-1",
        "revision": 1, "value": 10, "ttl_seconds": 60}),
}


def test_the_publishers_hint_forms_keep_what_they_name_through_a_flood(
        engines: Callable[..., Engine], fcfs: DaemonProcess) -> None:
    hits, refused = {}, {}
    for seed, (name, form) in enumerate(HINT_FORMS.items(), start=20):
        engine = engines(fcfs, num_blocks=40)
        warm(engine)
        session = f"sess-{name}"
        add_hinted(engine, f"{session}-t1", conversation(seed, TURN_TOKENS), session, form)
        engine.drain()
        flood(engine)
        add(engine, f"{session}-t2", conversation(seed, TURN_TOKENS + 2 * BLOCK), job_id=session)
        engine.drain()
        hits[name] = engine.cached_tokens[f"{session}-t2"]
        refused[name] = engine.agent.counters.kv_hint_fields_refused
        assert engine.agent.counters.kv_hint_actions_ignored == 0, name
        assert engine.free() == engine.start_free, name
    # The whole first turn, but for its last partial block...
    for name in ("dynamo-lineage", "vllm-retain", "vllm-set-priority"):
        assert hits[name] >= TURN_TOKENS - BLOCK, hits
    # ...or only the blocks Dynamo's range names: the system prompt's four.
    assert SYSTEM_TOKENS <= hits["dynamo-block-range"] < TURN_TOKENS - BLOCK, hits
    # The lineage's block hashes are refused, counted once for the request.
    assert refused == {"dynamo-lineage": 1, "dynamo-block-range": 0, "vllm-retain": 0,
                       "vllm-set-priority": 0}, refused


def test_a_flood_that_needs_every_block_evicts_the_lower_priority_first(
        engines: Callable[..., Engine], fcfs: DaemonProcess) -> None:
    engine = engines(fcfs, num_blocks=40)
    warm(engine)
    add(engine, "deep-t1", conversation(7, TURN_TOKENS), job_id="deep",
        retention_directives=json.dumps(DIRECTIVES))
    engine.drain()
    # Eight at once (32 blocks) need more than the 29 unprotected ones: the context (80)
    # gives way, tail first, before the system prompt (100), which survives.
    flood(engine, waves=1, per_wave=8)
    add(engine, "deep-t2", conversation(7, TURN_TOKENS + 2 * BLOCK), job_id="deep")
    engine.drain()
    assert SYSTEM_TOKENS <= engine.cached_tokens["deep-t2"] < TURN_TOKENS
    assert engine.free() == engine.start_free


def test_bad_directives_are_ignored_and_the_request_runs(
        engines: Callable[..., Engine], fcfs: DaemonProcess,
        caplog: pytest.LogCaptureFixture) -> None:
    engine = engines(fcfs, num_blocks=40)
    retention = engine.sched.kv_cache_manager.block_pool.kvtether_retention
    add(engine, "bad-json", conversation(8, TURN_TOKENS), job_id="b1",
        retention_directives="{not json")
    add(engine, "bad-shape", conversation(9, TURN_TOKENS), job_id="b2",
        retention_directives=json.dumps([{"start": -5, "priority": 100}]))
    add(engine, "bad-meaning", conversation(10, TURN_TOKENS), job_id="b3",
        retention_directives=json.dumps([{"start": 0, "end": 16, "priority": 10},
                                         {"start": 16, "priority": 90}]))
    engine.drain()
    assert {"bad-json", "bad-shape", "bad-meaning"} <= set(engine.cached_tokens)
    assert retention.num_retained_entries == 0
    assert "retention_directives" in caplog.text


def test_soft_retention_keeps_a_released_pins_blocks_at_its_priority(
        engines: Callable[..., Engine]) -> None:
    with running_daemon("--policy", "continuum") as continuum:
        engine = engines(continuum, num_blocks=40)
        engine.add("soft-t1", conversation(11, TURN_TOKENS), job="soft", last=False)
        engine.drain()
        pin = engine.agent.pins["soft-t1"]
        block_ids = [b.block_id for b in pin.blocks]
        # What the engine does when a policy releases a pin at a retention priority.
        engine.agent.decisions.apply([pb.StepDecision(seq=0, pins=[pb.PinDecision(
            request_id="soft-t1", action=pb.PIN_ACTION_RELEASE, retention_priority=90,
            retention_duration_s=30)])])
        retention = engine.sched.kv_cache_manager.block_pool.kvtether_retention
        queued = [retention.queued_priority(i) for i in block_ids]
        assert queued.count(90) == TURN_TOKENS // BLOCK  # every full (hashed) block
        assert engine.free() == engine.start_free


def test_a_preempted_requests_blocks_keep_its_priorities(
        engines: Callable[..., Engine], fcfs: DaemonProcess) -> None:
    """Preemption frees a request's blocks too (vLLM's _free_request_blocks): they are
    freed at the request's priorities, and its resumption hits them."""
    engine = engines(fcfs, num_blocks=10)
    retention = engine.sched.kv_cache_manager.block_pool.kvtether_retention
    add(engine, "older", conversation(12, 4 * BLOCK), job_id="older")
    engine.step()
    add(engine, "newer", conversation(13, 4 * BLOCK), job_id="newer",
        retention_directives=json.dumps([{"start": 0, "end": 2 * BLOCK, "priority": 100},
                                         {"start": 2 * BLOCK, "priority": 80}]))
    for request_id, max_tokens in (("older", 30), ("newer", 60)):
        request = engine.sched.requests[request_id]
        request.max_tokens = request.sampling_params.max_tokens = max_tokens
    seen_preemption = False
    resumed_hit = -1
    for _ in range(200):
        if not engine.sched.has_unfinished_requests():
            break
        held = engine.sched.kv_cache_manager.get_block_ids("newer")[0] if (
            "newer" in engine.sched.requests) else []
        output = engine.step()
        if "newer" in (output.preempted_req_ids or ()):
            seen_preemption = True
            queued = [retention.queued_priority(block_id) for block_id in held[:4]]
            assert queued == [100, 100, 80, 80], queued
        resumed = [new.num_computed_tokens for new in output.scheduled_new_reqs
                   if new.req_id == "newer" and seen_preemption]
        cached = output.scheduled_cached_reqs
        # vLLM 0.34 re-sends a resumed request in full, among the new ones (above), and
        # its cached requests have no resumed_req_ids.
        resumed_ids = getattr(cached, "resumed_req_ids", None) or ()
        resumed += [tokens for request_id, tokens in zip(cached.req_ids,
                                                         cached.num_computed_tokens, strict=False)
                    if request_id == "newer" and request_id in resumed_ids]
        if resumed:
            resumed_hit = resumed[0]
    assert seen_preemption, "the load should preempt the newer request"
    # The older request's growth took what it needed, lowest priority first: at least the
    # priority-100 head survived for the resumption.
    assert resumed_hit >= 2 * BLOCK, resumed_hit
    assert engine.free() == engine.start_free


def test_priorities_that_arrive_after_a_short_request_finished_still_apply(
        engines: Callable[..., Engine], fcfs: DaemonProcess) -> None:
    """Fail-open (production): the answer to a step's report is applied at the next
    step, so a request done in one step finishes before its priorities arrive; what is
    still cached of it takes them when they do."""
    engine = engines(fcfs, num_blocks=40, FAIL_MODE="open")
    retention = engine.sched.kv_cache_manager.block_pool.kvtether_retention
    late_calls: list[object] = []
    retain_freed = retention.retain_freed
    retention.retain_freed = lambda *args: late_calls.append(args) or retain_freed(*args)
    from tests.support.scheduler import make_request

    engine.sched.add_request(make_request(
        "one-step", conversation(14, TURN_TOKENS), 1, BLOCK, arrival_time=time.time(),
        extra_args={"job_id": "short", "retention_directives": json.dumps(DIRECTIVES)}))
    engine.step()
    assert "one-step" not in engine.sched.requests, "done in its first step"
    deadline = time.monotonic() + 10
    while retention.num_retained_entries < TURN_TOKENS // BLOCK:
        assert time.monotonic() < deadline, "the late priorities never applied"
        engine.step()  # an idle step applies what the daemon answered
        time.sleep(0.01)
    assert late_calls, "applied through the late path"
    assert engine.free() == engine.start_free
    flood(engine)
    add(engine, "short-t2", conversation(14, TURN_TOKENS + 2 * BLOCK), job_id="short")
    engine.drain()
    assert engine.cached_tokens["short-t2"] >= TURN_TOKENS - BLOCK
