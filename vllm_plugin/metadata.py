"""Per-request metadata the client attaches: job id, last step, tool, retention.

Sources, first wins: ``sampling_params.extra_args`` (the OpenAI API's
``extra_body={"vllm_xargs": {...}}``; booleans arrive as 0/1), then vLLM's
``session_id`` (the ``session_id`` field / ``X-Session-ID`` header) as the job id.
A request with none is a job of its own. A malformed field never fails the request:
it is ignored with one warning naming it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("kvtether.plugin")

MAX_ID_CHARS = 256
MAX_TOOL_CHARS = 128


@dataclass(frozen=True, slots=True)
class RequestMetadata:
    job_id: str = ""
    is_last_step: bool = False
    tool: str = ""
    retention_directives: tuple[dict[str, Any], ...] = ()
    retention_scope: str = ""


def _warn(request_id: str, field: str, value: object, why: str) -> None:
    logger.warning("kvtether: request %s: ignoring vllm_xargs %s=%r: %s",
                   request_id, field, value, why)


def _text(request_id: str, field: str, value: object, limit: int) -> str:
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, str | int):
        _warn(request_id, field, value, "expected a string")
        return ""
    text = str(value)
    if len(text) > limit:
        _warn(request_id, field, text[:32] + "...", f"longer than {limit} characters")
        return ""
    return text


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


def read_metadata(request: Any) -> RequestMetadata:
    """Metadata of a vLLM ``Request`` (duck-typed: works on any object with the same
    attributes, e.g. in the in-process twin)."""
    request_id = str(getattr(request, "request_id", "?"))
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    if not isinstance(extra, dict):
        extra = {}
    job_id = _text(request_id, "job_id", extra.get("job_id"), MAX_ID_CHARS)
    if not job_id:
        # vLLM >= 0.32 carries the OpenAI session id on the request.
        job_id = _text(request_id, "session_id", getattr(request, "session_id", None),
                       MAX_ID_CHARS)
    return RequestMetadata(
        job_id=job_id,
        is_last_step=_flag(request_id, "is_last_step", extra.get("is_last_step")),
        tool=_text(request_id, "tool", extra.get("tool"), MAX_TOOL_CHARS),
        retention_directives=_directives(request_id, extra.get("retention_directives")),
        retention_scope=_text(request_id, "retention_scope", extra.get("retention_scope"),
                              MAX_ID_CHARS),
    )
