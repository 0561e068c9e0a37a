"""Retention/SetDirectives with TensorRT-LLM's KvCacheRetentionConfig (``trtllm_config``)
over real gRPC: stored converted exactly, read back in kvtether's shape, and refused
with INVALID_ARGUMENT naming the field when malformed or sent with ``config``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf import json_format

from sidecar.api.v1 import retention_pb2 as pb
from sidecar.api.v1 import retention_pb2_grpc
from tests.support.inprocess import inprocess_daemon

SESSION = pb.RetentionTarget(session_id="trt-session")
# The JSON an orchestrator builds from TensorRT-LLM's KvCacheRetentionConfig.
TRTLLM = {"token_range_retention_configs": [
    {"token_start": 0, "token_end": 256, "priority": 100},
    {"token_start": 256, "priority": 80, "duration_ms": 45000}],
    "decode_retention_priority": 30, "decode_duration_ms": 2000}


@pytest.fixture
async def retention() -> AsyncIterator[retention_pb2_grpc.RetentionStub]:
    async with inprocess_daemon() as (_daemon, channel):
        yield retention_pb2_grpc.RetentionStub(channel)


def trtllm(config: dict[str, Any]) -> pb.TrtllmRetentionConfig:
    return json_format.ParseDict(config, pb.TrtllmRetentionConfig())


async def test_trtllm_form_is_stored_converted(
        retention: retention_pb2_grpc.RetentionStub) -> None:
    answer = await retention.SetDirectives(pb.SetDirectivesRequest(
        target=SESSION, trtllm_config=trtllm(TRTLLM), scope="dynamo"))
    read = await retention.GetDirectives(pb.GetDirectivesRequest(target=SESSION))
    assert read.found and read.owner_scope == "dynamo" and read.config == answer.effective
    assert json_format.MessageToDict(read.config, preserving_proto_field_name=True) == {
        "token_ranges": [{"token_end": 256, "priority": 100},
                         {"token_start": 256, "priority": 80, "duration_s": 45.0}],
        "decode_priority": 30, "decode_duration_s": 2.0}


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"config": pb.RetentionConfig(token_ranges=[pb.TokenRangeRetention(priority=90)]),
          "trtllm_config": trtllm(TRTLLM)}, "trtllm_config"),
        ({"trtllm_config": trtllm({"token_range_retention_configs": [
            {"token_start": 0, "priority": 101}]})},
         "trtllm_config.token_range_retention_configs[0].priority"),
        ({"trtllm_config": trtllm({"token_range_retention_configs": [
            {"token_start": 64, "token_end": 32, "priority": 50}]})},
         "trtllm_config.token_range_retention_configs[0].token_end"),
        ({"trtllm_config": trtllm({"token_range_retention_configs": [
            {"token_start": 0, "priority": 50}], "decode_retention_priority": 90})},
         "trtllm_config.decode_retention_priority"),
    ],
)
async def test_malformed_or_doubled_is_invalid_argument_naming_the_field(
        retention: retention_pb2_grpc.RetentionStub, request_fields: dict[str, Any],
        field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await retention.SetDirectives(pb.SetDirectivesRequest(
            target=SESSION, scope="dynamo", **request_fields))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (refused.value.details() or "").startswith(f"{field}: "), refused.value.details()
    assert not (await retention.GetDirectives(pb.GetDirectivesRequest(target=SESSION))).found
