"""Per-request metadata the client attaches (job id, last step, tool, retention), and
what the plugin reads off a request at its end (finish reason, the tool it called).

Sources, first wins: ``sampling_params.extra_args`` (the OpenAI API's
``extra_body={"vllm_xargs": {...}}``, where ``vllm_plugin.http`` also moves the same
fields sent at the top level of the body; booleans arrive as 0/1), then the actions of
vLLM's KV hint envelope (``Request.kv_hints``, vLLM 0.32 on: :mod:`sidecar.api.kv_hints`),
then vLLM's ``session_id`` (the ``session_id`` field / ``X-Session-ID`` header, or
``AsyncLLM.generate(session_id=...)``) as the job id. A request with none is a job of
its own. Retention comes as ``retention_directives`` (the RFC's list) or
``kv_cache_retention_config`` (TensorRT-LLM's config, as JSON:
:mod:`sidecar.api.retention_dialects`). A malformed field never fails the request: it
is ignored with one warning naming it.

Limits (``sidecar.api.bounds``, the same the daemon enforces) never drop a field the
client meant:

- a tool name is cleaned like one parsed from the model's output
  (:func:`~sidecar.api.bounds.clean_tool_name`: one line, cut at ``MAX_TOOL_CHARS``);
- a job id or retention scope the daemon would refuse (over ``MAX_ID_CHARS``, or with
  control characters) is mapped to a bounded id, ``<prefix>~<sha256 of the whole id>``
  (the prefix is the start of the id with unprintable characters replaced by spaces,
  cut so that the result is at most ``MAX_ID_CHARS`` long). The mapping is
  deterministic, so every turn of the job keeps its job, and two different ids never
  share one; the engine log says so once per id. Inspect and the store show the
  mapped id.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sidecar.api.bounds import MAX_ID_CHARS, FieldError, check_text, clean_tool_name
from sidecar.api.kv_hints import read_kv_hints
from sidecar.api.retention_dialects import TRTLLM_XARGS_KEY, from_trtllm_json
from sidecar.api.retention_ranges import DirectiveError
from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import retention_pb2 as retention_pb
from vllm_plugin.vllm_tool_parser import VllmToolParser

logger = logging.getLogger("kvtether.plugin")

# Separates a mapped id's prefix from the digest of the whole id.
_DIGEST_MARK = "~"
_DIGEST_CHARS = 64  # sha256, hex
# Ids already warned about (their digests), most recent last: one warning per job,
# in bounded memory.
_WARNED_MAX = 1024
_warned: OrderedDict[str, None] = OrderedDict()


@dataclass(frozen=True, slots=True)
class RequestMetadata:
    job_id: str = ""
    is_last_step: bool = False
    tool: str = ""
    retention_directives: tuple[dict[str, Any], ...] = ()
    retention_scope: str = ""
    # Directives already converted (TensorRT-LLM's form, a KV hint action); used when
    # the request sent no retention_directives.
    retention: retention_pb.RetentionConfig | None = None
    # KV hint actions ignored (unknown type or version, or malformed).
    kv_hint_actions_ignored: int = 0
    # Fields refused in KV hint actions otherwise read (Dynamo's block_hashes).
    kv_hint_fields_refused: int = 0


def _warn(request_id: str, field: str, value: object, why: str) -> None:
    logger.warning("kvtether: request %s: ignoring vllm_xargs %s=%r: %s",
                   request_id, field, value, why)


def _text(request_id: str, field: str, value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, str | int):
        _warn(request_id, field, value, "expected a string")
        return ""
    return str(value)


def bounded_id(raw: str) -> str:
    """``raw`` if the daemon accepts it as an id, else its bounded mapping (see the
    module's docstring): deterministic, at most ``MAX_ID_CHARS`` long."""
    try:
        check_text("id", raw)
        return raw
    except FieldError:
        pass
    digest = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()
    prefix = "".join(char if char.isprintable() else " "
                     for char in raw[:MAX_ID_CHARS - len(_DIGEST_MARK) - _DIGEST_CHARS])
    return f"{prefix}{_DIGEST_MARK}{digest}"


def _id(request_id: str, field: str, value: object) -> str:
    raw = _text(request_id, field, value)
    mapped = bounded_id(raw)
    if mapped != raw and mapped not in _warned:
        _warned[mapped] = None
        if len(_warned) > _WARNED_MAX:
            _warned.popitem(last=False)
        logger.warning("kvtether: request %s: vllm_xargs %s %r (%d characters) is over "
                       "%d characters or holds control characters: reported as %r",
                       request_id, field, raw[:32] + "...", len(raw), MAX_ID_CHARS, mapped)
    return mapped


def _flag(request_id: str, field: str, value: object) -> bool:
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("0", "1", "true", "false"):
        return value.strip().lower() in ("1", "true")
    _warn(request_id, field, value, "expected 0/1 or true/false")
    return False


def _directives(request_id: str, value: object) -> tuple[dict[str, Any], ...]:
    # vllm_xargs carries only strings, numbers and lists of them: over the OpenAI API
    # the directives are a JSON string (a list of objects) or a list of JSON strings
    # (one object each); in process they may be the list itself.
    if value is None:
        return ()
    parsed = value
    try:
        if isinstance(value, str):
            parsed = json.loads(value)
        elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            parsed = [json.loads(v) for v in value]
    except json.JSONDecodeError:
        _warn(request_id, "retention_directives", value, "not valid JSON")
        return ()
    if not (isinstance(parsed, list) and all(isinstance(d, dict) for d in parsed)):
        _warn(request_id, "retention_directives", value, "expected a list of objects")
        return ()
    return tuple(parsed)


def _trtllm(request_id: str, value: object) -> retention_pb.RetentionConfig | None:
    if value is None:
        return None
    try:
        return from_trtllm_json(value)
    except DirectiveError as error:
        _warn(request_id, TRTLLM_XARGS_KEY, value, str(error))
        return None


def read_metadata(request: Any, block_size_tokens: int = 0) -> RequestMetadata:
    """Metadata of a vLLM ``Request`` (duck-typed: works on any object with the same
    attributes, e.g. in the in-process twin). ``block_size_tokens``: the engine's block
    size, for KV hint actions that count in blocks (0: unknown)."""
    request_id = str(getattr(request, "request_id", "?"))
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    if not isinstance(extra, dict):
        extra = {}
    # vLLM >= 0.32 carries the KV hint envelope on the request; older ones have none.
    hints = read_kv_hints(getattr(request, "kv_hints", None), block_size_tokens)
    for problem in hints.problems:
        logger.warning("kvtether: request %s: ignoring a KV hint action: %s",
                       request_id, problem)
    for refused in hints.refused:
        _warn_refused_once(request_id, refused)
    job_id = _id(request_id, "job_id", extra.get("job_id"))
    if not job_id:
        job_id = _id(request_id, "kv_hints job_id", hints.job_id or None)
    if not job_id:
        # vLLM >= 0.32 carries the OpenAI session id on the request.
        job_id = _id(request_id, "session_id", getattr(request, "session_id", None))
    directives = _directives(request_id, extra.get("retention_directives"))
    retention = _trtllm(request_id, extra.get(TRTLLM_XARGS_KEY))
    if directives and retention is not None:
        _warn(request_id, TRTLLM_XARGS_KEY, extra.get(TRTLLM_XARGS_KEY),
              "retention_directives is set too, and wins")
        retention = None
    if not directives and retention is None:
        retention = hints.retention
    scope = _id(request_id, "retention_scope", extra.get("retention_scope"))
    if not scope and hints.scope_is_session and retention is hints.retention:
        scope = _id(request_id, "session_id", getattr(request, "session_id", None))
    return RequestMetadata(
        job_id=job_id,
        is_last_step=(_flag(request_id, "is_last_step", extra.get("is_last_step"))
                      or hints.is_last_step),
        tool=clean_tool_name(_text(request_id, "tool", extra.get("tool")) or hints.tool),
        retention_directives=directives,
        retention_scope=scope or _id(request_id, "kv_hints retention_scope",
                                     hints.retention_scope or None),
        retention=retention,
        kv_hint_actions_ignored=hints.ignored,
        kv_hint_fields_refused=len(hints.refused),
    )


# Refused hint fields already warned about (the field path without the request's
# numbers): a publisher sends the same form with every request, so once per field.
_refused_warned: set[str] = set()


def _warn_refused_once(request_id: str, refused: str) -> None:
    field = refused.split(":", 1)[0]
    if field in _refused_warned or len(_refused_warned) >= _WARNED_MAX:
        return
    _refused_warned.add(field)
    logger.warning("kvtether: request %s: reading a KV hint action without %s (counted in "
                   "kv_hint_fields_refused; warned once per field)", request_id, refused)


# Output tokens decoded at finish to find the tool call the turn ended with.
TOOL_TAIL_TOKENS = 512

_FINISH_REASONS = {
    "FINISHED_STOPPED": pb.FINISH_REASON_STOP,
    "FINISHED_LENGTH_CAPPED": pb.FINISH_REASON_LENGTH,
    "FINISHED_ABORTED": pb.FINISH_REASON_ABORT,
    "FINISHED_IGNORED": pb.FINISH_REASON_ABORT,
    "FINISHED_ERROR": pb.FINISH_REASON_ERROR,
}


def finish_reason(status: Any) -> pb.FinishReason:
    """The wire's finish reason for a vLLM ``RequestStatus`` (by name)."""
    return _FINISH_REASONS.get(getattr(status, "name", ""), pb.FINISH_REASON_STOP)


def reportable(request_id: str) -> bool:
    """Whether the daemon accepts ``request_id`` (sidecar.api.bounds); an id it would
    refuse is logged once, here, when its request arrives."""
    try:
        check_text("request_id", request_id, required=True)
        return True
    except FieldError as error:
        logger.warning("kvtether: request %.64r...: not reported to the daemon, vLLM "
                       "schedules it in its own order: %s", request_id, error.problem)
        return False


def tool_at_finish(request: Any, meta: RequestMetadata,
                   decode_tail: Callable[[Sequence[int]], str] | None,
                   parse_tool: Callable[[str | None, str | None], str | None] | None,
                   vllm_parser: VllmToolParser | None = None,
                   ) -> str | None:
    """The tool call a finished turn ended with, parsed from its last output tokens
    (None: no parser, none found, or parsing failed, which never fails the request):
    by vLLM's tool parser when one is configured, and by kvtether's own
    (``parse_tool``) when it finds none."""
    if decode_tail is None or parse_tool is None:
        return None
    try:
        output = request.output_token_ids
        tail = list(output[-TOOL_TAIL_TOKENS:])
        if vllm_parser is not None and not meta.tool:
            params = getattr(request, "sampling_params", None)
            tool = vllm_parser.tool(tail, getattr(params, "all_stop_token_ids", None) or (),
                                    starts_output=len(output) <= TOOL_TAIL_TOKENS)
            if tool:
                return tool
        return parse_tool(meta.tool or None, decode_tail(tail))
    except Exception:  # a parsing failure must never fail the request
        logger.debug("kvtether: tool parsing failed for %s", request.request_id,
                     exc_info=True)
        return None
