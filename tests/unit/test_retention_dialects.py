"""TensorRT-LLM's KvCacheRetentionConfig, converted to kvtether's RetentionConfig exactly,
and every malformed field named in TensorRT-LLM's terms."""

from __future__ import annotations

import json
from typing import Any

import pytest
from google.protobuf import json_format

from sidecar.api.retention_dialects import from_trtllm_json, from_trtllm_message
from sidecar.api.retention_ranges import DirectiveError
from sidecar.api.v1 import retention_pb2 as pb

# What an orchestrator builds: a system prompt kept for 30 s at 100, the rest at 80.
TRTLLM = {
    "token_range_retention_configs": [
        {"token_start": 0, "token_end": 512, "priority": 100, "duration_ms": 30000},
        {"token_start": 512, "token_end": None, "priority": 80, "duration_ms": None},
    ],
    "decode_retention_priority": 20,
    "decode_duration_ms": 1500,
}


def as_dict(config: pb.RetentionConfig) -> dict[str, Any]:
    return json_format.MessageToDict(config, preserving_proto_field_name=True)


def test_converts_milliseconds_open_ends_and_decode_exactly() -> None:
    expected = {
        "token_ranges": [
            {"token_end": 512, "priority": 100, "duration_s": 30.0},
            {"token_start": 512, "priority": 80},
        ],
        "decode_priority": 20,
        "decode_duration_s": 1.5,
    }
    assert as_dict(from_trtllm_json(TRTLLM)) == expected
    assert as_dict(from_trtllm_json(json.dumps(TRTLLM))) == expected


def test_an_absent_decode_priority_is_trtllm_default() -> None:
    config = from_trtllm_json({"token_range_retention_configs": [
        {"token_start": 0, "priority": 90}]})
    assert config.HasField("decode_priority") and config.decode_priority == 35
    assert not config.HasField("decode_duration_s")
    assert not config.token_ranges[0].HasField("token_end")


def test_the_grpc_message_converts_like_the_json() -> None:
    message = json_format.ParseDict(TRTLLM, pb.TrtllmRetentionConfig())
    assert from_trtllm_message(message) == from_trtllm_json(TRTLLM)


def broken(**changes: Any) -> dict[str, Any]:
    config = json.loads(json.dumps(TRTLLM))
    for path, value in changes.items():
        target: Any = config
        *parents, leaf = path.split("__")
        for part in parents:
            target = target[int(part)] if part.isdigit() else target[part]
        target[int(leaf) if leaf.isdigit() else leaf] = value
    return config


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ("{not json", "kv_cache_retention_config"),
        ([1, 2], "kv_cache_retention_config"),
        ({**TRTLLM, "directory": "/tmp"}, "kv_cache_retention_config.directory"),
        ({"token_range_retention_configs": {"token_start": 0}},
         "kv_cache_retention_config.token_range_retention_configs"),
        (broken(token_range_retention_configs__1="x"),
         "kv_cache_retention_config.token_range_retention_configs[1]"),
        (broken(token_range_retention_configs__0__priority=101),
         "kv_cache_retention_config.token_range_retention_configs[0].priority"),
        (broken(token_range_retention_configs__0__priority=None),
         "kv_cache_retention_config.token_range_retention_configs[0].priority"),
        (broken(token_range_retention_configs__0__token_start=-1),
         "kv_cache_retention_config.token_range_retention_configs[0].token_start"),
        (broken(token_range_retention_configs__0__token_end="512"),
         "kv_cache_retention_config.token_range_retention_configs[0].token_end"),
        (broken(token_range_retention_configs__0__duration_ms=-5),
         "kv_cache_retention_config.token_range_retention_configs[0].duration_ms"),
        (broken(token_range_retention_configs__0__seconds=5),
         "kv_cache_retention_config.token_range_retention_configs[0].seconds"),
        (broken(decode_retention_priority=True),
         "kv_cache_retention_config.decode_retention_priority"),
        (broken(decode_duration_ms=float("nan")),
         "kv_cache_retention_config.decode_duration_ms"),
        # Meaning, checked like any RetentionConfig, named in TensorRT-LLM's terms.
        (broken(token_range_retention_configs__0__token_end=0),
         "kv_cache_retention_config.token_range_retention_configs[0].token_end"),
        (broken(decode_retention_priority=90),
         "kv_cache_retention_config.decode_retention_priority"),
    ],
)
def test_malformed_fields_are_named(config: Any, field: str) -> None:
    with pytest.raises(DirectiveError) as caught:
        from_trtllm_json(config)
    assert caught.value.field == field, str(caught.value)
