"""The API-server middleware (``vllm_plugin.http``) in front of a real FastAPI app
shaped like vLLM's: the same ``vllm_xargs`` field type, JSON bodies, SSE streams.
What a client notices: its top-level fields arrive in ``vllm_xargs``, a request
without them is untouched, a malformed one gets vLLM's 400 naming the field, and a
streamed answer still arrives chunk by chunk."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from vllm_plugin.http import ClientFieldsMiddleware
from vllm_plugin.metadata import read_metadata


class OpenAIBody(BaseModel):
    """What vLLM's request models declare for the engine's extra arguments."""

    model_config = ConfigDict(extra="allow")
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    stream: bool = False


def vllm_like_app(release: asyncio.Event | None = None) -> FastAPI:
    app = FastAPI()

    async def endpoint(request: Request) -> Any:
        raw = await request.body()
        try:
            body = OpenAIBody.model_validate_json(raw)
        except ValidationError as error:
            return JSONResponse({"error": {"message": str(error), "code": 400}}, 400)
        if body.stream:
            async def chunks() -> AsyncIterator[bytes]:
                yield b"data: first\n\n"
                if release is not None:
                    await release.wait()
                yield b"data: [DONE]\n\n"
            return StreamingResponse(chunks(), media_type="text/event-stream")
        return JSONResponse({"raw": raw.decode(), "vllm_xargs": body.vllm_xargs,
                             "ignored": sorted(body.model_extra or {}),
                             "content_length": request.headers.get("content-length")})

    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize"):
        app.post(path)(endpoint)
    return app


@pytest.fixture
def api() -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=ClientFieldsMiddleware(vllm_like_app()))
    return httpx.AsyncClient(transport=transport, base_url="http://vllm")


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "go"}]}


def engine_side(xargs: dict[str, Any]) -> Any:
    """What the engine plugin reads off a request carrying these ``vllm_xargs``."""
    class Params:
        extra_args = xargs

    class EngineRequest:
        request_id = "chatcmpl-1"
        sampling_params = Params()

    return read_metadata(EngineRequest())


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
async def test_continuum_fields_reach_the_engine_as_vllm_xargs(
        api: httpx.AsyncClient, path: str) -> None:
    answer = await api.post(path, json={**CHAT, "job_id": "job_0042", "is_last_step": False,
                                        "tool": "pytest"})
    assert answer.status_code == 200
    echoed = answer.json()
    assert echoed["vllm_xargs"] == {"job_id": "job_0042", "is_last_step": 0, "tool": "pytest"}
    assert echoed["ignored"] == ["messages", "model"], "moved fields are not left for vLLM"
    assert int(echoed["content_length"]) == len(echoed["raw"].encode())
    meta = engine_side(echoed["vllm_xargs"])
    assert (meta.job_id, meta.is_last_step, meta.tool) == ("job_0042", False, "pytest")


async def test_retention_api_fields_reach_the_engine(api: httpx.AsyncClient) -> None:
    directives = [{"start": 0, "end": None, "priority": 70, "duration": 30}]
    answer = await api.post("/v1/chat/completions", json={
        **CHAT, "retention_directives": directives, "retention_scope": "session-9",
        "is_last_step": True})
    xargs = answer.json()["vllm_xargs"]
    meta = engine_side(xargs)
    assert meta.retention_directives == tuple(directives)
    assert meta.retention_scope == "session-9" and meta.is_last_step is True


async def test_explicit_vllm_xargs_win_field_by_field(api: httpx.AsyncClient) -> None:
    answer = await api.post("/v1/chat/completions", json={
        **CHAT, "job_id": "from-top", "tool": "ls",
        "vllm_xargs": {"job_id": "explicit", "custom": 3}})
    assert answer.json()["vllm_xargs"] == {"job_id": "explicit", "tool": "ls", "custom": 3}


@pytest.mark.parametrize("body", [
    json.dumps(CHAT, indent=3).encode(),
    b'{"model": "tiny", "prompt": "x", "vllm_xargs": {"job_id": "j", "is_last_step": 1}}',
    # Named, but not at the top level, or null there: nothing to move.
    b'{"model":"tiny","messages":[{"role":"tool","content":"{\\"job_id\\": 1}"}],"tool":null}',
    b'{"model": "tiny", "job_id": ',  # not JSON: vLLM answers it
    b'["job_id"]',
])
async def test_a_request_with_nothing_to_move_passes_byte_for_byte(
        api: httpx.AsyncClient, body: bytes) -> None:
    received: list[bytes] = []
    inner = vllm_like_app()

    async def recording(scope: Any, receive: Any, send: Any) -> None:
        async def spy() -> Any:
            message = await receive()
            received.append(message.get("body", b""))
            return message
        await inner(scope, spy, send)

    transport = httpx.ASGITransport(app=ClientFieldsMiddleware(recording))
    async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
        await client.post("/v1/completions", content=body,
                          headers={"content-type": "application/json"})
    assert b"".join(received) == body


@pytest.mark.parametrize(("fields", "param", "problem"), [
    ({"job_id": ["job", 1]}, "job_id", "expected a string"),
    ({"job_id": "x" * 300}, "job_id", "300 characters exceed the limit of 256"),
    ({"retention_scope": "a\nb"}, "retention_scope", "control characters"),
    ({"tool": "*"}, "tool", "reserved"),
    ({"is_last_step": "yes"}, "is_last_step", "expected true or false"),
    ({"retention_directives": "[]"}, "retention_directives", "expected a list of objects"),
    ({"retention_directives": [7]}, "retention_directives[0]", "expected an object"),
    ({"retention_directives": [{"start": 0, "priority": 150}]},
     "retention_directives[0].priority", "150 is outside 0-100"),
    ({"retention_directives": [{"start": 0}]}, "retention_directives[0].priority", "required"),
    ({"retention_directives": [{"start": 0, "end": 64, "priority": 90},
                               {"start": 64, "end": 32, "priority": 50}]},
     "retention_directives[1].end", "must exceed token_start"),
    ({"retention_directives": [{"start": 0, "priority": 70, "duration": -1}]},
     "retention_directives[0].duration", "non-negative"),
    ({"retention_directives": [{"start": 0, "end": 100, "priority": 30},
                               {"start": 100, "end": 200, "priority": 80}]},
     "retention_directives", "priority rises to 80"),
    ({"retention_directives": [{"start": 0, "priority": 30, "duration": 10**400}]},
     "retention_directives[0].duration", "too large"),
    ({"retention_directives": [{"begin": 0, "priority": 30}]},
     "retention_directives[0].begin", "unknown field"),
    ({"retention_directives": [{"priority": 50}] * 17}, "retention_directives",
     "17 ranges exceed the limit of 16"),
])
async def test_a_malformed_field_gets_vllms_400_naming_it(
        api: httpx.AsyncClient, fields: dict[str, Any], param: str, problem: str) -> None:
    answer = await api.post("/v1/chat/completions", json={**CHAT, **fields})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == param and error["code"] == 400 and error["type"] == "Bad Request"
    assert error["message"].startswith(f"{param}: ") and problem in error["message"]


async def test_a_streamed_answer_arrives_chunk_by_chunk() -> None:
    release = asyncio.Event()
    app = ClientFieldsMiddleware(vllm_like_app(release))
    body = json.dumps({**CHAT, "stream": True, "job_id": "j", "is_last_step": True}).encode()
    pending = [{"type": "http.request", "body": body[:10], "more_body": True},
               {"type": "http.request", "body": body[10:], "more_body": False}]
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        await asyncio.Event().wait()  # the client stays connected
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
            # The first chunk reaches the client while the app still holds the second.
            release.set()

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "root_path": "", "query_string": b"", "http_version": "1.1",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    assert chunks == [b"data: first\n\n", b"data: [DONE]\n\n"]


async def test_other_paths_and_oversized_bodies_are_not_inspected(
        api: httpx.AsyncClient) -> None:
    answer = await api.post("/tokenize", json={**CHAT, "job_id": ["not", "checked"]})
    assert answer.status_code == 200 and "job_id" in answer.json()["ignored"]
    small = httpx.ASGITransport(app=ClientFieldsMiddleware(vllm_like_app(), max_body_bytes=64))
    async with httpx.AsyncClient(transport=small, base_url="http://vllm") as client:
        big = await client.post("/v1/chat/completions", json={**CHAT, "job_id": "j" * 80})
    assert big.status_code == 200 and big.json()["vllm_xargs"] is None


async def test_a_disabled_plugin_lets_every_request_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTETHER_PLUGIN_ENABLED", "0")
    transport = httpx.ASGITransport(app=ClientFieldsMiddleware(vllm_like_app()))
    async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
        answer = await client.post("/v1/chat/completions", json={**CHAT, "is_last_step": "?"})
    assert answer.status_code == 200 and answer.json()["vllm_xargs"] is None


async def test_a_fault_in_the_middleware_never_fails_the_request(
        api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(value: object) -> list[dict[str, Any]]:
        raise RuntimeError("a bug")

    monkeypatch.setattr("vllm_plugin.http.check_directives", broken)
    body = json.dumps({**CHAT, "retention_directives": [{"priority": 70}]})
    answer = await api.post("/v1/chat/completions", content=body)
    assert answer.status_code == 200 and answer.json()["raw"] == body
