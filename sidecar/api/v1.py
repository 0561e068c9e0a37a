"""Short import path for the generated v1 stubs (``proto/kvtether/v1``), e.g.
``from sidecar.api.v1 import engine_session_pb2 as pb``."""

from sidecar.api.kvtether.v1 import (
    engine_session_pb2,
    engine_session_pb2_grpc,
    inspect_pb2,
    inspect_pb2_grpc,
    retention_pb2,
    retention_pb2_grpc,
)

__all__ = [
    "engine_session_pb2",
    "engine_session_pb2_grpc",
    "inspect_pb2",
    "inspect_pb2_grpc",
    "retention_pb2",
    "retention_pb2_grpc",
]
