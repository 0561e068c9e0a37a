"""Other systems' clients, unchanged, on a real vLLM engine (CPU build) whose API server
runs kvtether's middleware (``--middleware vllm_plugin.http.ClientFieldsMiddleware``,
on the shared engine: every end-to-end test runs with it).

Each request is sent as its client sends it: Continuum's clients through the OpenAI
client with top-level ``extra_body`` fields (JSON booleans), the vLLM retention API's
fields through the OpenAI client, llm-d's body rewrite as raw JSON over HTTP with its
``x-session-id`` header. What a user notices: the job shows in ``Inspect/GetJob``
with its turns, its context survives a tool gap under an eviction flood, KV usage is
back to 0 after the last step, and a malformed field is answered 400 naming it while
the engine goes on serving.
"""

from __future__ import annotations

import json
import time
from typing import Any

import grpc
import httpx
import openai
import pytest

from sidecar.api.v1 import inspect_pb2, inspect_pb2_grpc
from tests.e2e.conftest import BLOCK_TOKENS, LiveEngine
from tests.e2e.test_engine import client, ensure_policy, flood, kv_usage
from tests.support.client import cached_tokens

# The retention API's example directive, as llm-d's plugin writes it: the whole
# context (no end) at 70 for 30 s after its blocks are freed.
DIRECTIVES = [{"start": 0, "end": None, "priority": 70, "duration": 30}]


def get_job(engine: LiveEngine, job_id: str, turns: int,
            timeout_s: float = 10.0) -> inspect_pb2.GetJobResponse:
    """The daemon's record of ``job_id`` once it holds ``turns`` finished turns (the
    engine reports a step after it happens)."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(engine.daemon.address) as channel:
        inspect = inspect_pb2_grpc.InspectStub(channel)
        while True:
            job = inspect.GetJob(inspect_pb2.GetJobRequest(job_id=job_id), timeout=5)
            finished = [turn for turn in job.turns if turn.departure_s > 0]
            if len(finished) >= turns or time.monotonic() > deadline:
                return job
            time.sleep(0.1)


def conversation(seed: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"agent {seed}: " + "You fix bugs in a repo. " * 30},
            {"role": "user", "content": f"task {seed}: make the failing test pass. " * 12}]


def test_a_continuum_client_job_is_kept_through_a_flood_and_released(
        engine: LiveEngine) -> None:
    # A TTL longer than the flood lasts on a loaded machine (as test_engine's flood test).
    ensure_policy(engine, "continuum", "fixed_ttl_s=30")
    api = client(engine)
    messages = conversation(seed=61)

    def turn(last: bool) -> Any:
        answer = api.chat.completions.create(
            model="tiny", messages=messages, max_tokens=16,
            extra_body={"job_id": "job_0042", "is_last_step": last, "tool": "pytest",
                        "ignore_eos": True})
        messages.extend([{"role": "assistant", "content": answer.choices[0].message.content},
                         {"role": "user", "content": "$ pytest\n1 failed, 3 passed"}])
        return answer

    turn(last=False)
    held = kv_usage(engine)
    flood(engine, tag="continuum-client-flood")
    second = turn(last=True)

    job = get_job(engine, "job_0042", turns=2)
    assert job.found, "the job named by a top-level job_id is the daemon's"
    assert [t.tool for t in job.turns] == ["pytest", "pytest"]
    assert held > 0.0, "the pinned context holds its blocks through the tool gap"
    assert cached_tokens(second) > 0, "the next turn found its context after the flood"
    assert kv_usage(engine) == 0.0, "the last step released the job's KV"


def test_retention_api_directives_keep_context_through_a_flood(engine: LiveEngine) -> None:
    # fcfs pins nothing: only the directives can keep a context.
    ensure_policy(engine, "fcfs")
    api = client(engine)
    web = httpx.Client(base_url=engine.base_url, timeout=120)
    sessions = {name: conversation(seed) for name, seed in
                (("openai", 62), ("llm-d", 63), ("none", 64))}

    def turn(name: str) -> tuple[int, int]:
        """(prompt tokens, cached tokens) of the session's next turn."""
        fields = {"retention_directives": DIRECTIVES, "retention_scope": f"sess-{name}"}
        if name == "openai":  # the OpenAI client with extra_body
            answer = api.chat.completions.create(
                model="tiny", messages=sessions[name], max_tokens=8,
                extra_body={**fields, "ignore_eos": True})
            usage = answer.usage
            reply, prompt, cached = (answer.choices[0].message.content,
                                     usage.prompt_tokens, cached_tokens(answer))
        else:  # llm-d's rewritten body, or no directives at all
            body = {"model": "tiny", "messages": sessions[name], "max_tokens": 8,
                    "ignore_eos": True, **(fields if name == "llm-d" else {})}
            response = web.post("/v1/chat/completions", json=body,
                                headers={"x-session-id": f"sess-{name}"})
            assert response.status_code == 200, response.text
            data = response.json()
            details = data["usage"].get("prompt_tokens_details") or {}
            reply, prompt, cached = (data["choices"][0]["message"]["content"],
                                     data["usage"]["prompt_tokens"],
                                     details.get("cached_tokens") or 0)
        sessions[name] += [{"role": "assistant", "content": reply},
                           {"role": "user", "content": "$ ls\nsrc tests"}]
        return prompt, cached

    first = {name: turn(name) for name in sessions}
    # Waves of 4 requests of 3 blocks fit beside the two protected contexts (2 x 6
    # blocks of 32); 4 waves go through more blocks than the others left free.
    for wave in range(4):
        flood(engine, tag=f"dialect-flood-{wave}", count=4, words=150)
    second = {name: turn(name) for name in sessions}
    print(f"client dialects: turn-2 (prompt, cached) {second}")

    full_blocks = first["openai"][0] // BLOCK_TOKENS * BLOCK_TOKENS
    assert second["openai"][1] >= full_blocks, second
    assert second["llm-d"][1] >= full_blocks, second
    assert second["none"][1] == 0, second
    assert kv_usage(engine) == 0.0, "retained blocks are free blocks: nothing is held"
    # llm-d's session header names the job (vLLM's X-Session-ID).
    assert len(get_job(engine, "sess-llm-d", turns=2).turns) == 2


def test_malformed_fields_get_400_naming_them_and_the_engine_serves_on(
        engine: LiveEngine) -> None:
    ensure_policy(engine, "continuum")
    api = client(engine)
    hello = [{"role": "user", "content": "hello"}]
    for fields, name in (({"is_last_step": "maybe"}, "is_last_step"),
                         ({"retention_directives": [{"start": 0, "priority": 150}]},
                          "retention_directives[0].priority")):
        with pytest.raises(openai.BadRequestError) as refused:
            api.chat.completions.create(model="tiny", messages=hello, max_tokens=4,
                                        extra_body=fields)
        assert refused.value.status_code == 400
        assert f"{name}: " in refused.value.message, refused.value.message

    # The next requests are served: streamed chat, and a completion, each a job's
    # last step.
    stream = api.chat.completions.create(
        model="tiny", messages=hello, max_tokens=8, stream=True,
        extra_body={"job_id": "dialect-stream", "is_last_step": True, "ignore_eos": True})
    assert len([chunk for chunk in stream if chunk.choices]) >= 8
    api.completions.create(model="tiny", prompt="hello", max_tokens=4,
                           extra_body={"job_id": "dialect-completion", "is_last_step": True})
    api.responses.create(model="tiny", input="hello", max_output_tokens=8,
                         extra_body={"job_id": "dialect-responses", "is_last_step": True})
    for job_id in ("dialect-stream", "dialect-completion", "dialect-responses"):
        assert len(get_job(engine, job_id, turns=1).turns) == 1, job_id
    assert kv_usage(engine) == 0.0


def test_tensorrt_llm_retention_configs_keep_context_and_bad_ones_are_named(
        engine: LiveEngine) -> None:
    """TensorRT-LLM's ``KvCacheRetentionConfig`` as an orchestrator builds it: pushed for
    a session with ``Retention/SetDirectives`` (grpcurl, its ``trtllm_config`` field), or
    sent with a request (``vllm_xargs`` ``kv_cache_retention_config``, as JSON)."""
    from tests.e2e.test_retention import grpcurl

    ensure_policy(engine, "fcfs")  # no pins: only the retention configs keep anything
    api = client(engine)
    trtllm = {"token_range_retention_configs": [
        {"token_start": 0, "token_end": None, "priority": 80, "duration_ms": 30_000}],
        "decode_retention_priority": 35}
    target = {"session_id": "trt-pushed"}

    # A malformed config is refused naming the field, in TensorRT-LLM's terms.
    bad = {"token_range_retention_configs": [{"token_start": 0, "priority": 101}]}
    rc, error = grpcurl(engine, "SetDirectives",
                        {"target": target, "trtllm_config": bad, "scope": "dynamo"})
    assert rc != 0 and "InvalidArgument" in error, error
    assert "trtllm_config.token_range_retention_configs[0].priority" in error, error
    # Over gRPC an open end is an unset token_end (proto JSON has no null scalars).
    pushed = {"token_range_retention_configs": [
        {"token_start": 0, "priority": 80, "duration_ms": 30_000}],
        "decode_retention_priority": 35}
    rc, answer = grpcurl(engine, "SetDirectives",
                         {"target": target, "trtllm_config": pushed, "scope": "dynamo"})
    assert rc == 0, answer
    # Read back in kvtether's shape: milliseconds became seconds.
    assert answer["effective"]["token_ranges"][0]["duration_s"] == 30, answer

    sessions = {name: conversation(seed) for name, seed in
                (("trt-pushed", 65), ("trt-xargs", 66), ("trt-none", 67))}

    def turn(name: str) -> Any:
        xargs: dict[str, Any] = {"job_id": name}
        if name == "trt-xargs":
            xargs["kv_cache_retention_config"] = json.dumps(trtllm)
        answer = api.chat.completions.create(
            model="tiny", messages=sessions[name], max_tokens=8,
            extra_body={"vllm_xargs": xargs, "ignore_eos": True})
        sessions[name] += [{"role": "assistant", "content": answer.choices[0].message.content},
                           {"role": "user", "content": "$ make\nok"}]
        return answer

    first = {name: turn(name) for name in sessions}
    for wave in range(4):
        flood(engine, tag=f"trtllm-flood-{wave}", count=4, words=150)
    hits = {name: cached_tokens(turn(name)) for name in sessions}
    print(f"TensorRT-LLM retention configs: turn-2 cached tokens {hits}")

    full_blocks = first["trt-pushed"].usage.prompt_tokens // BLOCK_TOKENS * BLOCK_TOKENS
    assert hits["trt-pushed"] >= full_blocks, hits
    assert hits["trt-xargs"] >= full_blocks, hits
    assert hits["trt-none"] == 0, hits
    assert kv_usage(engine) == 0.0
    rc, _ = grpcurl(engine, "ClearDirectives", {"target": target, "scope": "dynamo"})
    assert rc == 0
