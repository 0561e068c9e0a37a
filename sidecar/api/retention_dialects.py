"""Retention directives in other systems' shapes, converted to kvtether's RetentionConfig
(pure; no I/O). Shared by the daemon (``Retention/SetDirectives``' ``trtllm_config``),
the engine plugin (``vllm_xargs`` and KV hint actions) and the API server's middleware.

TensorRT-LLM's ``KvCacheRetentionConfig`` (``tensorrt_llm.llmapi``), as orchestrators
build it and send it as JSON::

    {"token_range_retention_configs": [
        {"token_start": 0, "token_end": 512, "priority": 100, "duration_ms": 30000},
        {"token_start": 512, "token_end": null, "priority": 80}],
     "decode_retention_priority": 35, "decode_duration_ms": null}

converts exactly: ``duration_ms`` / ``decode_duration_ms`` to seconds, ``token_end``
None (or absent) to an open range, ``duration_ms`` None to forever, and
``decode_retention_priority`` to ``decode_priority`` — absent means TensorRT-LLM's
default, 35, which is set explicitly so decode tokens take 35 as they do in
TensorRT-LLM (kvtether would otherwise let an open range reach them). The result is
then validated like any RetentionConfig (:func:`~sidecar.api.retention_ranges.validate`):
a priority that rises along the sequence, or a decode priority above the open range
before it, is refused where TensorRT-LLM would accept it (see docs/compatibility.md).

Errors are :class:`~sidecar.api.retention_ranges.DirectiveError` naming the field in
the source's own terms (``kv_cache_retention_config.token_range_retention_configs[1]
.duration_ms``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from sidecar.api.retention_ranges import (
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    MAX_TOKEN,
    MAX_TOKEN_RANGES,
    DirectiveError,
    validate,
)
from sidecar.api.v1 import retention_pb2 as pb

# What TensorRT-LLM's KvCacheRetentionConfig calls its fields.
TRTLLM_FIELDS = frozenset({"token_range_retention_configs", "decode_retention_priority",
                           "decode_duration_ms"})
TRTLLM_RANGE_FIELDS = frozenset({"token_start", "token_end", "priority", "duration_ms"})
# The vllm_xargs key (and KV hint payload key) that carries one, as JSON or an object.
TRTLLM_XARGS_KEY = "kv_cache_retention_config"
_MS_PER_S = 1000.0


def _integer(where: str, value: Any, highest: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= highest:
        raise DirectiveError(where, f"expected an integer from 0 to {highest}, got {value!r}")
    return value


def _milliseconds(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
        math.isfinite(value) and value >= 0
    ):
        raise DirectiveError(where, f"expected non-negative milliseconds, got {value!r}")
    return float(value) / _MS_PER_S


def from_trtllm_json(value: Any, where: str = TRTLLM_XARGS_KEY) -> pb.RetentionConfig:
    """A TensorRT-LLM config given as a JSON string (``vllm_xargs`` carries only
    strings and numbers) or as the object itself (in process, in a KV hint payload)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise DirectiveError(where, f"not valid JSON: {error.msg}") from None
    if not isinstance(value, Mapping):
        raise DirectiveError(where, f"expected an object, got {type(value).__name__}")
    return from_trtllm_mapping(value, where)


def from_trtllm_mapping(config: Mapping[str, Any],
                        where: str = TRTLLM_XARGS_KEY) -> pb.RetentionConfig:
    """TensorRT-LLM's KvCacheRetentionConfig as a JSON object, converted and validated."""
    unknown = sorted(set(config) - TRTLLM_FIELDS)
    if unknown:
        raise DirectiveError(f"{where}.{unknown[0]}", "unknown field")
    ranges = config.get("token_range_retention_configs")
    if ranges is None:
        ranges = []
    if not isinstance(ranges, list):
        raise DirectiveError(f"{where}.token_range_retention_configs", "expected a list")
    result = pb.RetentionConfig()
    for index, item in enumerate(ranges):
        at = f"{where}.token_range_retention_configs[{index}]"
        if not isinstance(item, Mapping):
            raise DirectiveError(at, "expected an object")
        unknown = sorted(set(item) - TRTLLM_RANGE_FIELDS)
        if unknown:
            raise DirectiveError(f"{at}.{unknown[0]}", "unknown field")
        if item.get("priority") is None:
            raise DirectiveError(f"{at}.priority", "is required")
        token_range = result.token_ranges.add(
            token_start=_integer(f"{at}.token_start", item.get("token_start", 0), MAX_TOKEN),
            priority=_integer(f"{at}.priority", item["priority"], MAX_PRIORITY))
        if item.get("token_end") is not None:
            token_range.token_end = _integer(f"{at}.token_end", item["token_end"], MAX_TOKEN)
        if item.get("duration_ms") is not None:
            token_range.duration_s = _milliseconds(f"{at}.duration_ms", item["duration_ms"])
    decode = config.get("decode_retention_priority")
    result.decode_priority = (DEFAULT_PRIORITY if decode is None else _integer(
        f"{where}.decode_retention_priority", decode, MAX_PRIORITY))
    if config.get("decode_duration_ms") is not None:
        result.decode_duration_s = _milliseconds(f"{where}.decode_duration_ms",
                                                 config["decode_duration_ms"])
    _validate(result, where)
    return result


def from_trtllm_message(config: pb.TrtllmRetentionConfig,
                        where: str = "trtllm_config") -> pb.RetentionConfig:
    """``SetDirectivesRequest.trtllm_config``, converted and validated."""
    as_json: dict[str, Any] = {"token_range_retention_configs": [
        {"token_start": r.token_start, "priority": r.priority,
         "token_end": r.token_end if r.HasField("token_end") else None,
         "duration_ms": r.duration_ms if r.HasField("duration_ms") else None}
        for r in config.token_range_retention_configs]}
    if config.HasField("decode_retention_priority"):
        as_json["decode_retention_priority"] = config.decode_retention_priority
    if config.HasField("decode_duration_ms"):
        as_json["decode_duration_ms"] = config.decode_duration_ms
    return from_trtllm_mapping(as_json, where)


def _validate(config: pb.RetentionConfig, where: str) -> None:
    """:func:`validate`, its error renamed to the source's fields."""
    try:
        validate(config, MAX_TOKEN_RANGES)
    except DirectiveError as error:
        ranges = f"{where}.token_range_retention_configs"
        field = (error.field.replace("config.token_ranges", ranges)
                 .replace("config.decode_priority", f"{where}.decode_retention_priority")
                 .replace("config.decode_duration_s", f"{where}.decode_duration_ms")
                 .replace(".duration_s", ".duration_ms"))
        problem = str(error).split(": ", 1)[1]
        raise DirectiveError(field, problem) from None
