"""kvtether's API-server side: the request fields other clients send, moved to where
the engine side reads them.

vLLM's OpenAI server hands the engine only ``vllm_xargs`` (as
``sampling_params.extra_args``, which ``vllm_plugin.metadata`` reads). Other clients
put the same meaning at the top level of the body, where vLLM ignores it:

- Continuum's clients: ``job_id``, ``is_last_step`` (a JSON boolean), ``tool``;
- the vLLM retention API (RFC #37003, PR #38514), which llm-d's retention plugin
  writes into each body: ``retention_directives`` (a list of ``{"start", "end",
  "priority", "duration"}``) and ``retention_scope``.

This pure ASGI middleware moves those fields into ``vllm_xargs`` on ``POST``
``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses``. vLLM installs it
with ``--middleware vllm_plugin.http.ClientFieldsMiddleware``. Contract:

- a body with none of the fields reaches vLLM as it came, byte for byte and message
  for message; responses, streamed or not, are never touched;
- a field already in ``vllm_xargs`` wins over the same field at the top level;
- a malformed field is answered HTTP 400 in vLLM's error shape, naming the field
  (``retention_directives[0].priority: 150 is outside 0-100``), by the rules the
  daemon applies (``sidecar.api.bounds``, ``sidecar.api.retention_ranges``);
- a body over ``MAX_BODY_BYTES`` passes through uninspected (logged once), and so
  does every request with ``KVTETHER_PLUGIN_ENABLED=0``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any

from sidecar.api.bounds import FieldError, check_text, check_tool
from sidecar.api.retention_ranges import DirectiveError, from_request_directives, validate
from vllm_plugin.settings import PluginSettings, PluginSettingsError

logger = logging.getLogger("kvtether.plugin")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
# The largest body inspected: a request holds its body twice while it is rewritten
# (the bytes and the parsed object). Larger ones (images, long documents) pass as
# they are.
MAX_BODY_BYTES = 16 * 1024 * 1024
FIELDS = ("job_id", "is_last_step", "tool", "retention_directives", "retention_scope")
# A body naming none of the fields is not parsed at all.
_MARKERS = tuple(f'"{name}"'.encode() for name in FIELDS)
# How a client may spell each field of a directive (retention_ranges' request shape),
# by the name the wire gives it.
_SPELLINGS = {"token_start": ("start", "token_start"), "token_end": ("end", "token_end"),
              "duration_s": ("duration", "duration_s")}
_DIRECTIVE_FIELD = re.compile(r"(?:config\.token_ranges|retention_directives)"
                              r"(?:\[(\d+)\](?:\.(\w+))?)?")
_warned_large = False


class ClientFieldsMiddleware:
    """Moves Continuum's and the retention API's top-level fields into ``vllm_xargs``
    (see the module's docstring)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        # KVTETHER_PLUGIN_ENABLED=0 steps the whole plugin aside: every request passes.
        try:
            self.enabled = PluginSettings.from_env().enabled
        except PluginSettingsError:
            self.enabled = True  # unreachable in vLLM: register() has stopped it, naming it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (not self.enabled or scope["type"] != "http" or scope.get("method") != "POST"
                or scope["path"].removeprefix(scope.get("root_path", "")) not in PATHS
                or _header(scope, b"content-encoding") is not None
                or (_content_length(scope) or 0) > self.max_body_bytes):
            await self.app(scope, receive, send)
            return
        messages, body = await self._read(receive)
        if body is None:
            await self.app(scope, _replay(messages, receive), send)
            return
        try:
            rewritten = rewrite(body)
        except FieldError as error:
            await _bad_request(send, error.field, str(error))
            return
        except Exception:  # a fault here must never fail the request: vLLM gets it as sent
            logger.exception("kvtether: request fields not moved")
            rewritten = None
        if rewritten is None:
            await self.app(scope, _replay(messages, receive), send)
            return
        message = {"type": "http.request", "body": rewritten, "more_body": False}
        await self.app(_with_length(scope, len(rewritten)), _replay([message], receive), send)

    async def _read(self, receive: Receive) -> tuple[list[Message], bytes | None]:
        """The body's messages as received, and the body; None when it is over the
        bound or the client left before sending all of it."""
        global _warned_large
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages, None
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                if not _warned_large:
                    _warned_large = True
                    logger.warning("kvtether: a request body over %d bytes is passed to vLLM "
                                   "without moving its top-level job and retention fields "
                                   "(logged once)", self.max_body_bytes)
                return messages, None
            if not message.get("more_body", False):
                return messages, b"".join(m.get("body", b"") for m in messages)


def rewrite(body: bytes) -> bytes | None:
    """The body with its top-level fields moved into ``vllm_xargs``; None when there is
    nothing to move (or the body is not a JSON object: vLLM answers it). Raises
    FieldError naming a malformed field."""
    if not any(marker in body for marker in _MARKERS):
        return None
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(request, dict):
        return None
    present = {name: request[name] for name in FIELDS if name in request}
    xargs = request.get("vllm_xargs")
    if not present or not (xargs is None or isinstance(xargs, dict)):
        return None  # a vllm_xargs that is not an object: vLLM refuses it itself
    moved = xargs_from_fields(present)
    if not moved:
        return None
    for name in present:
        del request[name]
    request["vllm_xargs"] = {**moved, **(xargs or {})}
    return json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode()


def xargs_from_fields(fields: Mapping[str, Any]) -> dict[str, str | int]:
    """Top-level fields as ``vllm_xargs`` carries them (strings and numbers only:
    booleans as 0/1, the directives as a JSON string); null or empty ones are left
    out. Raises FieldError naming a malformed field."""
    xargs: dict[str, str | int] = {}
    for name in ("job_id", "retention_scope", "tool"):
        value = fields.get(name)
        if value is None or value == "":
            continue
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise FieldError(name, f"expected a string, got {_kind(value)}")
        text = str(value)
        if name == "tool":
            check_tool(name, text)
        else:
            check_text(name, text)
        xargs[name] = text
    last = fields.get("is_last_step")
    if last is not None:
        if not (isinstance(last, bool) or (isinstance(last, int) and last in (0, 1))):
            raise FieldError("is_last_step", f"expected true or false, got {_kind(last)}")
        xargs["is_last_step"] = int(last)
    directives = fields.get("retention_directives")
    if directives is not None and check_directives(directives):
        xargs["retention_directives"] = json.dumps(directives)
    return xargs


def check_directives(value: object) -> list[dict[str, Any]]:
    """The retention API's directive list, checked as the daemon checks it (shape,
    then meaning: priorities 0-100, ends after starts, priorities not rising along
    the sequence, at most ``MAX_TOKEN_RANGES``). Raises FieldError in the client's
    own terms (``retention_directives[1].end``)."""
    if not isinstance(value, list):
        raise FieldError("retention_directives", f"expected a list of objects, got {_kind(value)}")
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise FieldError(f"retention_directives[{index}]",
                             f"expected an object, got {_kind(item)}")
    try:
        validate(from_request_directives(value))
    except DirectiveError as error:
        problem = str(error).removeprefix(f"{error.field}: ")
        raise FieldError(_client_field(error.field, value), problem) from None
    return value


def _client_field(field: str, items: Sequence[Mapping[str, Any]]) -> str:
    """A directive field as the client spelled it: ``config.token_ranges[2].token_end``
    is ``retention_directives[2].end`` for a client that wrote ``end``."""
    match = _DIRECTIVE_FIELD.fullmatch(field)
    if match is None or match[1] is None:
        return "retention_directives"
    index = int(match[1])
    if match[2] is None:
        return f"retention_directives[{index}]"
    spellings = _SPELLINGS.get(match[2], (match[2],))
    spelled = next((name for name in spellings if name in items[index]), spellings[0])
    return f"retention_directives[{index}].{spelled}"


def _kind(value: object) -> str:
    return "null" if value is None else f"{type(value).__name__} {json.dumps(value)[:64]}"


async def _bad_request(send: Send, field: str, message: str) -> None:
    """HTTP 400 with vLLM's own error body (``ErrorResponse``)."""
    body = json.dumps({"error": {"message": message, "type": "Bad Request",
                                 "param": field, "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """``receive`` that first hands out ``messages``, then the client's own (vLLM
    watches for the client leaving while it streams)."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _with_length(scope: Scope, length: int) -> Scope:
    headers = [(key, value) for key, value in scope.get("headers", ())
               if key.lower() not in (b"content-length", b"transfer-encoding")]
    headers.append((b"content-length", str(length).encode()))
    return {**scope, "headers": headers}
