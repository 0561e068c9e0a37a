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
``kv.retain`` version ``1.0``: two publishers, one type and version, told apart by
the payload's shape (a payload with ``directives`` is vLLM's, any other Dynamo's):

    vLLM's (``vllm/v1/kv_hints/retain.py``)
        ``{"scope": str | null, "directives": [{"start", "end", "priority",
        "duration"} | {"covers_output": true, "priority", "duration"}, ...]}``: token
        ranges of this request at a priority 0-100 on vLLM's scale, where 0 releases
        and unprotected blocks are 0; kvtether's scale puts unprotected blocks at
        :data:`DEFAULT_PRIORITY` (35), so 0 is read as 35 and 1-100 as 36-100
        (:func:`from_vllm_retain_priority`). ``covers_output`` is the generated tail:
        kvtether's decode priority and duration. Several such actions concatenate
        (one scope), as vLLM's parser does.
    NVIDIA Dynamo's (its KV-hint policy example, ``SessionKvHintPolicy`` in
    ``examples/router/kv-hint-policy-example/src/lib.rs``, and its vLLM worker)
        ``{"block_hashes": [str, ...], "include_current_request": bool, "execute_at":
        "request_completion", "priority": int, "ttl_seconds": number,
        "current_request_block_start": int, "current_request_block_count": int}``:
        with ``include_current_request: true``, this request's blocks; with a block
        range, the blocks ``[start, start + count)`` of this request (tokens
        ``start * block size`` on, the engine's block size: Dynamo's router uses its
        worker's). They are retained for ``ttl_seconds`` at
        :data:`DYNAMO_RETAIN_PRIORITY` (Dynamo's ``priority`` is on its KV tier's own
        scale, which kvtether does not read), owned by the request's session.
        ``block_hashes`` (the session lineage's blocks, by Dynamo's hash) are refused:
        kvtether's retention reaches the blocks of the request that carries the
        action, whose prefix holds the lineage it extends; a block named only by hash
        is not looked up (:data:`LINEAGE_REFUSED`). The rest of the action is read.
``kv.evict`` version ``1.0`` (Dynamo)
    ``{"block_hashes": [...], "include_current_request": true, ...}``: the session ends
    with this request: its job's last step (its pins are released when it finishes),
    and its blocks go back to the default priority (the session, their owner, lowers
    what its kv.retain raised). ``block_hashes`` are refused as above.
``vllm.set_priority`` version ``1.0`` (vLLM's ``vllm/v1/kv_hints/actions.py``
``SetPriority``, applied at completion)
    ``{"target": "request_cached", "location": "local_g1", "claim_id": str,
    "revision": int, "value": int | null, "ttl_seconds": number | null}``: this
    request's blocks at ``value`` for ``ttl_seconds`` once it completes, owned by
    ``claim_id`` (kvtether's retention scope: a later value of the same claim may
    lower it); ``value`` null clears the claim (the blocks back to the default).
    vLLM's blocks without a claim are 0 and any integer may be claimed: kvtether
    reads ``value`` as ``35 + value``, within 0-100 (:func:`from_vllm_claim_value`).
    ``revision`` is checked, not compared: the last request to complete wins.

Any other type or version is ignored and counted (never an error: hints are advice).
A malformed action of a type kvtether reads is ignored and counted, with one problem
naming the field (``kv_hints.actions[0].payload.is_last_step``); the request runs. A
refused field of an action otherwise read is counted apart, with its reason
(``HintReading.refused``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar.api.retention_dialects import TRTLLM_XARGS_KEY, from_trtllm_json
from sidecar.api.retention_ranges import (
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    MAX_TOKEN,
    MIN_PRIORITY,
    DirectiveError,
    from_request_directives,
    validate,
)
from sidecar.api.v1 import retention_pb2 as pb

JOB_ACTION = ("kvtether.job", "1")
RETENTION_ACTION = ("kvtether.retention", "1")
# One type and version, two payloads: vLLM's token ranges and Dynamo's blocks.
RETAIN_ACTION = ("kv.retain", "1.0")
DYNAMO_EVICT_ACTION = ("kv.evict", "1.0")
VLLM_SET_PRIORITY_ACTION = ("vllm.set_priority", "1.0")
# The priority of blocks a Dynamo kv.retain action keeps: above the default (35),
# below what a caller gives a system prompt (100).
DYNAMO_RETAIN_PRIORITY = 80
# Why a Dynamo action's block_hashes are not read (the rest of the action is).
LINEAGE_REFUSED = ("blocks named by Dynamo's hash are not looked up; this request's "
                   "own blocks, which hold the lineage it extends, are")
_ROOT = "kv_hints"
_VLLM_RETAIN_DIRECTIVE = frozenset({"start", "end", "priority", "duration", "covers_output"})


def from_vllm_retain_priority(priority: int) -> int:
    """vLLM's ``kv.retain`` priority (0 releases, 1-100 protect; unprotected blocks
    are 0) on kvtether's scale (unprotected: 35): 0 -> 35, 1-100 -> 36-100, order kept."""
    if priority <= 0:
        return DEFAULT_PRIORITY
    span = MAX_PRIORITY - DEFAULT_PRIORITY
    return DEFAULT_PRIORITY + -(-priority * span // MAX_PRIORITY)  # ceil: 1 -> 36


def from_vllm_claim_value(value: int) -> int:
    """A ``vllm.set_priority`` value (any integer; unclaimed blocks are 0) on
    kvtether's scale: ``35 + value``, within 0-100."""
    return max(MIN_PRIORITY, min(MAX_PRIORITY, DEFAULT_PRIORITY + value))


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
    # One line per field refused in an action otherwise read, naming the field and why.
    refused: tuple[str, ...] = ()


class _Malformed(ValueError):
    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")


@dataclass
class _Found:
    """What the actions read so far say (one envelope)."""

    values: dict[str, Any] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)
    # vLLM's kv.retain actions, concatenated: (where, directive) and their scope.
    vllm_directives: list[tuple[str, Mapping[str, Any]]] = field(default_factory=list)
    vllm_scope: str | None = None


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


def _integer(where: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _Malformed(where, f"expected an integer in {low}-{high}, got {value!r}")
    return value


def _seconds(where: str, value: Any, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Malformed(where, f"expected seconds, got {value!r}")
    try:
        seconds = float(value)
    except OverflowError:  # an integer beyond any float
        raise _Malformed(where, "too large") from None
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        raise _Malformed(where, f"expected {'positive' if positive else 'non-negative'} "
                                f"seconds, got {value!r}")
    return seconds


def _payload(where: str, action: Any, known: frozenset[str]) -> Mapping[str, Any]:
    payload = _get(action, "payload")
    if not isinstance(payload, Mapping):
        raise _Malformed(where, f"expected an object, got {type(payload).__name__}")
    unknown = sorted(set(payload) - known)
    if unknown:
        raise _Malformed(f"{where}.{unknown[0]}", "unknown field")
    return payload


def read_kv_hints(envelope: Any, block_size_tokens: int = 0) -> HintReading:
    """Read ``envelope`` (a KvHintsEnvelope, a mapping of the same shape, or None).
    ``block_size_tokens``: the engine's block size, for actions that count in blocks
    (0: unknown, and such a count is malformed)."""
    if envelope is None:
        return HintReading()
    actions = _get(envelope, "actions")
    if not isinstance(actions, Sequence) or isinstance(actions, str):
        return HintReading(ignored=1, problems=(
            f"{_ROOT}.actions: expected a list, got {type(actions).__name__}",))
    found = _Found()
    ignored = 0
    problems: list[str] = []
    for index, action in enumerate(actions):
        kind = (_get(action, "action_type"), _get(action, "action_version"))
        where = f"{_ROOT}.actions[{index}].payload"
        try:
            if kind == JOB_ACTION:
                _job(where, action, found.values)
            elif kind == RETENTION_ACTION:
                _retention(where, action, found.values)
            elif kind == RETAIN_ACTION and _is_vllm_retain(action):
                _vllm_retain(where, action, found)
            elif kind == RETAIN_ACTION:
                _dynamo(where, action, found, block_size_tokens, retain=True)
            elif kind == DYNAMO_EVICT_ACTION:
                _dynamo(where, action, found, block_size_tokens, retain=False)
            elif kind == VLLM_SET_PRIORITY_ACTION:
                _set_priority(where, action, found.values)
            else:
                ignored += 1
        except _Malformed as error:
            ignored += 1
            problems.append(str(error))
    if found.vllm_directives:
        try:
            _vllm_retention(found)
        except _Malformed as error:
            # Their actions are ignored, each counted once.
            ignored += len({at.rsplit(".directives[", 1)[0]
                            for at, _ in found.vllm_directives})
            problems.append(str(error))
    return HintReading(ignored=ignored, problems=tuple(problems),
                       refused=tuple(found.refused), **found.values)


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


def _is_vllm_retain(action: Any) -> bool:
    # vLLM's kv.retain carries token-range directives; Dynamo's never does.
    payload = _get(action, "payload")
    return isinstance(payload, Mapping) and "directives" in payload


def _vllm_retain(where: str, action: Any, found: _Found) -> None:
    payload = _payload(where, action, frozenset({"scope", "directives"}))
    scope = payload.get("scope")
    if scope is not None:
        scope = _text(f"{where}.scope", scope, required=True)
    if found.vllm_directives and scope != found.vllm_scope:
        raise _Malformed(f"{where}.scope", f"{scope!r} differs from {found.vllm_scope!r}, "
                         "the scope of an earlier kv.retain action: one scope an envelope")
    directives = payload.get("directives")
    if not isinstance(directives, list):
        raise _Malformed(f"{where}.directives",
                         f"expected a list, got {type(directives).__name__}")
    for index, item in enumerate(directives):
        at = f"{where}.directives[{index}]"
        if not isinstance(item, Mapping):
            raise _Malformed(at, f"expected an object, got {type(item).__name__}")
        unknown = sorted(set(item) - _VLLM_RETAIN_DIRECTIVE)
        if unknown:
            raise _Malformed(f"{at}.{unknown[0]}", "unknown field")
    found.vllm_scope = scope
    found.vllm_directives.extend((f"{where}.directives[{index}]", item)
                                 for index, item in enumerate(directives))


def _vllm_retention(found: _Found) -> None:
    """vLLM's kv.retain directives (all actions') as one RetentionConfig."""
    config = pb.RetentionConfig()
    origin: list[str] = []  # token range index -> the directive it came from
    decode_at = ""
    for at, item in found.vllm_directives:
        priority = from_vllm_retain_priority(
            _integer(f"{at}.priority", item.get("priority"), MIN_PRIORITY, MAX_PRIORITY))
        duration = item.get("duration")
        duration_s = None if duration is None else _seconds(f"{at}.duration", duration)
        if _flag(f"{at}.covers_output", item.get("covers_output")):
            if "start" in item or "end" in item:
                raise _Malformed(f"{at}.covers_output", "cannot be combined with start or end")
            if decode_at:
                raise _Malformed(f"{at}.covers_output", f"{decode_at} covers the output too")
            decode_at = at
            config.decode_priority = priority
            if duration_s is not None:
                config.decode_duration_s = duration_s
            continue
        token_range = config.token_ranges.add(
            token_start=_integer(f"{at}.start", item.get("start", 0), 0, MAX_TOKEN),
            priority=priority)
        if item.get("end") is not None:
            token_range.token_end = _integer(f"{at}.end", item["end"], 0, MAX_TOKEN)
        if duration_s is not None:
            token_range.duration_s = duration_s
        origin.append(at)
    try:
        validate(config)
    except DirectiveError as error:
        problem = str(error).split(": ", 1)[1]
        if error.field.startswith("config.token_ranges["):
            index = int(error.field.split("[", 1)[1].split("]", 1)[0])
            rest = error.field.split("]", 1)[1].replace("token_end", "end").replace(
                "duration_s", "duration")
            raise _Malformed(origin[index] + rest, problem) from None
        if error.field.startswith("config.decode") and decode_at:
            raise _Malformed(f"{decode_at}.priority", problem) from None
        where = found.vllm_directives[0][0].rsplit("[", 1)[0]
        raise _Malformed(where, problem) from None
    found.values["retention"] = config
    found.values["scope_is_session"] = False
    found.values.pop("retention_scope", None)
    if found.vllm_scope:
        found.values["retention_scope"] = found.vllm_scope


def _dynamo(where: str, action: Any, found: _Found, block_size_tokens: int,
            retain: bool) -> None:
    known = {"block_hashes", "include_current_request", "execute_at"}
    if retain:
        known |= {"priority", "ttl_seconds", "current_request_block_start",
                  "current_request_block_count"}
    payload = _payload(where, action, frozenset(known))
    execute_at = payload.get("execute_at")
    if execute_at not in (None, "request_completion"):
        raise _Malformed(f"{where}.execute_at",
                         f"only \"request_completion\" is read, got {execute_at!r}")
    hashes = payload.get("block_hashes")
    if hashes is not None and not isinstance(hashes, list):
        raise _Malformed(f"{where}.block_hashes",
                         f"expected a list, got {type(hashes).__name__}")
    current = _flag(f"{where}.include_current_request",
                    payload.get("include_current_request"))
    block_range = _block_range(where, payload, block_size_tokens)
    if not current and block_range is None:
        problem = ("names no block of this request (include_current_request false, no "
                   "current_request_block_start)")
        if hashes:
            problem += f"; block_hashes: {LINEAGE_REFUSED}"
        raise _Malformed(f"{where}.include_current_request", problem)
    if hashes:
        found.refused.append(f"{where}.block_hashes: {len(hashes)} blocks: {LINEAGE_REFUSED}")
    ttl = payload.get("ttl_seconds")
    ttl_s = None if ttl is None else _seconds(f"{where}.ttl_seconds", ttl)
    values = found.values
    # The last action that sets retention also says who owns it.
    values["scope_is_session"] = True
    values.pop("retention_scope", None)
    config = pb.RetentionConfig()
    if not retain:
        values["is_last_step"] = True
        config.token_ranges.add(token_start=0, priority=DEFAULT_PRIORITY)
        values["retention"] = config
        return
    if block_range is None:
        token_range = config.token_ranges.add(token_start=0, priority=DYNAMO_RETAIN_PRIORITY)
    else:
        token_range = config.token_ranges.add(token_start=block_range[0],
                                              token_end=block_range[1],
                                              priority=DYNAMO_RETAIN_PRIORITY)
    if ttl_s is not None:
        token_range.duration_s = ttl_s
    values["retention"] = config


def _block_range(where: str, payload: Mapping[str, Any], block_size_tokens: int
                 ) -> tuple[int, int] | None:
    """Dynamo's current_request_block_start / _count as tokens [start, end)."""
    start, count = (payload.get("current_request_block_start"),
                    payload.get("current_request_block_count"))
    if start is None and count is None:
        return None
    if start is None or count is None:
        missing = "start" if start is None else "count"
        raise _Malformed(f"{where}.current_request_block_{missing}",
                         "is required with the other current_request_block field")
    start = _integer(f"{where}.current_request_block_start", start, 0, MAX_TOKEN)
    count = _integer(f"{where}.current_request_block_count", count, 1, MAX_TOKEN)
    if block_size_tokens <= 0:
        raise _Malformed(f"{where}.current_request_block_start",
                         "the engine's block size is unknown")
    end = (start + count) * block_size_tokens
    if end > MAX_TOKEN:
        raise _Malformed(f"{where}.current_request_block_count",
                         f"blocks past token {MAX_TOKEN}")
    return start * block_size_tokens, end


def _set_priority(where: str, action: Any, found: dict[str, Any]) -> None:
    payload = _payload(where, action, frozenset(
        {"target", "location", "claim_id", "revision", "value", "ttl_seconds"}))
    for name, only in (("target", "request_cached"), ("location", "local_g1")):
        if payload.get(name) != only:
            raise _Malformed(f"{where}.{name}", f"only {only!r} is read, got "
                                                f"{payload.get(name)!r}")
    claim_id = _text(f"{where}.claim_id", payload.get("claim_id"), required=True)
    if len(claim_id) > 256:
        raise _Malformed(f"{where}.claim_id", f"{len(claim_id)} characters, over 256")
    _integer(f"{where}.revision", payload.get("revision"), 0, 2**63 - 1)
    if "value" not in payload:
        raise _Malformed(f"{where}.value", "is required (null clears the claim)")
    value, ttl = payload["value"], payload.get("ttl_seconds")
    config = pb.RetentionConfig()
    if value is None:
        if ttl is not None:
            raise _Malformed(f"{where}.ttl_seconds", "clearing a claim (value null) "
                                                     "takes no ttl_seconds")
        config.token_ranges.add(token_start=0, priority=DEFAULT_PRIORITY)
    else:
        value = _integer(f"{where}.value", value, -(2**63), 2**63 - 1)
        if ttl is None:
            raise _Malformed(f"{where}.ttl_seconds", "is required with a value")
        config.token_ranges.add(token_start=0, priority=from_vllm_claim_value(value),
                                duration_s=_seconds(f"{where}.ttl_seconds", ttl,
                                                    positive=True))
    found["retention"] = config
    found["retention_scope"] = claim_id
    found["scope_is_session"] = False
