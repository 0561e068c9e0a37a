"""What kvtether reads from vLLM's KV hint envelope (``Request.kv_hints``; pure, no I/O).

vLLM (0.32 on) carries an orchestrator's hints on each request as
``vllm.v1.kv_hints.KvHintsEnvelope{protocol_version, message_id, actions}``, each
action ``{action_id, action_type, action_version, payload}`` — attached by callers of
``AsyncLLM.generate(..., kv_hints=...)``. Action types are the publisher's; vLLM
validates none of them. kvtether reads these (types and versions exactly):

``kvtether.job`` version ``1``
    ``{"job_id": str, "is_last_step": bool (false), "tool": str ("")}``: the request
    is a turn of that job (as ``vllm_xargs`` ``job_id`` / ``is_last_step`` / ``tool``).
``kvtether.retention`` version ``1``
    ``{"directives": [{"start", "end", "priority", "duration"}, ...], "scope": str}``
    (the vLLM retention RFC's list, as ``vllm_xargs`` ``retention_directives``), or
    ``{"kv_cache_retention_config": {...TensorRT-LLM's KvCacheRetentionConfig...},
    "scope": str}`` (:mod:`sidecar.api.retention_dialects`); one of the two.
``kv.retain`` version ``1.0`` (what NVIDIA Dynamo publishes)
    ``{"block_hashes": [], "include_current_request": true, "execute_at":
    "request_completion", "priority": int, "ttl_seconds": number}``: this request's
    blocks are retained for ``ttl_seconds`` at :data:`DYNAMO_RETAIN_PRIORITY` (Dynamo's
    ``priority`` is on its KV tier's own scale, which kvtether does not read), owned
    by the request's session (its ``session_id`` is the retention scope).
``kv.evict`` version ``1.0`` (Dynamo)
    ``{"block_hashes": [], "include_current_request": true, ...}``: the session ends
    with this request: its job's last step (its pins are released when it finishes),
    and its blocks go back to the default priority (the session, their owner, lowers
    what its kv.retain raised).

Any other type or version is ignored and counted (never an error: hints are advice).
A malformed action of a type kvtether reads is ignored and counted, with one problem
naming the field (``kv_hints.actions[0].payload.is_last_step``); the request runs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sidecar.api.retention_dialects import TRTLLM_XARGS_KEY, from_trtllm_json
from sidecar.api.retention_ranges import (
    DEFAULT_PRIORITY,
    DirectiveError,
    from_request_directives,
)
from sidecar.api.v1 import retention_pb2 as pb

JOB_ACTION = ("kvtether.job", "1")
RETENTION_ACTION = ("kvtether.retention", "1")
DYNAMO_RETAIN_ACTION = ("kv.retain", "1.0")
DYNAMO_EVICT_ACTION = ("kv.evict", "1.0")
# The priority of blocks a Dynamo kv.retain action keeps: above the default (35),
# below what a caller gives a system prompt (100).
DYNAMO_RETAIN_PRIORITY = 80
_ROOT = "kv_hints"


@dataclass(frozen=True, slots=True)
class HintReading:
    """What a request's hints say; empty fields where they say nothing."""

    job_id: str = ""
    is_last_step: bool = False
    tool: str = ""
    retention: pb.RetentionConfig | None = None
    retention_scope: str = ""
    # The retention is owned by the request's session (Dynamo's actions name no scope).
    scope_is_session: bool = False
    # Actions ignored: unknown type or version, or malformed.
    ignored: int = 0
    # One line per malformed action, naming the field.
    problems: tuple[str, ...] = ()


class _Malformed(ValueError):
    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")


def _get(item: Any, name: str) -> Any:
    # The envelope is a msgspec Struct in vLLM; a mapping from a JSON caller reads alike.
    if isinstance(item, Mapping):
        return item.get(name)
    return getattr(item, name, None)


def _text(where: str, value: Any, required: bool = False) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise _Malformed(where, f"expected a non-empty string, got {value!r}")
    return value


def _flag(where: str, value: Any) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _Malformed(where, f"expected true or false, got {value!r}")
    return value


def _payload(where: str, action: Any, known: frozenset[str]) -> Mapping[str, Any]:
    payload = _get(action, "payload")
    if not isinstance(payload, Mapping):
        raise _Malformed(where, f"expected an object, got {type(payload).__name__}")
    unknown = sorted(set(payload) - known)
    if unknown:
        raise _Malformed(f"{where}.{unknown[0]}", "unknown field")
    return payload


def read_kv_hints(envelope: Any) -> HintReading:
    """Read ``envelope`` (a KvHintsEnvelope, a mapping of the same shape, or None)."""
    if envelope is None:
        return HintReading()
    actions = _get(envelope, "actions")
    if not isinstance(actions, Sequence) or isinstance(actions, str):
        return HintReading(ignored=1, problems=(
            f"{_ROOT}.actions: expected a list, got {type(actions).__name__}",))
    found: dict[str, Any] = {}
    ignored = 0
    problems: list[str] = []
    for index, action in enumerate(actions):
        kind = (_get(action, "action_type"), _get(action, "action_version"))
        where = f"{_ROOT}.actions[{index}].payload"
        try:
            if kind == JOB_ACTION:
                _job(where, action, found)
            elif kind == RETENTION_ACTION:
                _retention(where, action, found)
            elif kind == DYNAMO_RETAIN_ACTION:
                _dynamo(where, action, found, retain=True)
            elif kind == DYNAMO_EVICT_ACTION:
                _dynamo(where, action, found, retain=False)
            else:
                ignored += 1
        except _Malformed as error:
            ignored += 1
            problems.append(str(error))
    return HintReading(ignored=ignored, problems=tuple(problems), **found)


def _job(where: str, action: Any, found: dict[str, Any]) -> None:
    payload = _payload(where, action, frozenset({"job_id", "is_last_step", "tool"}))
    job_id = _text(f"{where}.job_id", payload.get("job_id"), required=True)
    last = _flag(f"{where}.is_last_step", payload.get("is_last_step"))
    tool = _text(f"{where}.tool", payload.get("tool"))
    found["job_id"] = job_id
    found["is_last_step"] = found.get("is_last_step", False) or last
    if tool:
        found["tool"] = tool


def _retention(where: str, action: Any, found: dict[str, Any]) -> None:
    payload = _payload(where, action,
                       frozenset({"directives", TRTLLM_XARGS_KEY, "scope"}))
    directives, trtllm = payload.get("directives"), payload.get(TRTLLM_XARGS_KEY)
    if (directives is None) == (trtllm is None):
        raise _Malformed(where, f"expected one of directives and {TRTLLM_XARGS_KEY}")
    scope = _text(f"{where}.scope", payload.get("scope"))
    try:
        if trtllm is not None:
            config = from_trtllm_json(trtllm, f"{where}.{TRTLLM_XARGS_KEY}")
        else:
            if isinstance(directives, str):
                directives = json.loads(directives)
            if not (isinstance(directives, list)
                    and all(isinstance(item, Mapping) for item in directives)):
                raise _Malformed(f"{where}.directives", "expected a list of objects")
            config = from_request_directives(directives)
    except json.JSONDecodeError:
        raise _Malformed(f"{where}.directives", "not valid JSON") from None
    except DirectiveError as error:
        field = error.field.replace("retention_directives", f"{where}.directives")
        raise _Malformed(field, str(error).split(": ", 1)[1]) from None
    found["retention"] = config
    if scope:
        found["retention_scope"] = scope


def _dynamo(where: str, action: Any, found: dict[str, Any], retain: bool) -> None:
    known = {"block_hashes", "include_current_request", "execute_at"}
    if retain:
        known |= {"priority", "ttl_seconds"}
    payload = _payload(where, action, frozenset(known))
    hashes = payload.get("block_hashes")
    if hashes not in (None, []):
        # Blocks named by hash belong to other requests: the engine reads only this one's.
        raise _Malformed(f"{where}.block_hashes",
                         "only [] is read (the current request's blocks)")
    if payload.get("include_current_request") is not True:
        raise _Malformed(f"{where}.include_current_request", "only true is read")
    found["scope_is_session"] = True
    config = pb.RetentionConfig()
    if not retain:
        found["is_last_step"] = True
        config.token_ranges.add(token_start=0, priority=DEFAULT_PRIORITY)
        found["retention"] = config
        return
    ttl = payload.get("ttl_seconds")
    token_range = config.token_ranges.add(token_start=0, priority=DYNAMO_RETAIN_PRIORITY)
    if ttl is not None:
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not (
            math.isfinite(ttl) and ttl >= 0
        ):
            raise _Malformed(f"{where}.ttl_seconds",
                             f"expected non-negative seconds, got {ttl!r}")
        token_range.duration_s = float(ttl)
    found["retention"] = config
