"""gRPC Retention: orchestrators set, read back and clear directives per job or session."""

from __future__ import annotations

import time

import grpc
import structlog

from sidecar.api.v1 import retention_pb2 as pb
from sidecar.api.v1 import retention_pb2_grpc
from sidecar.retention.directives import (
    DirectiveError,
    OwnershipError,
    StoredDirective,
    clear_rule,
    set_rule,
    validate,
)
from sidecar.store import Store, StoreError, keys

log = structlog.get_logger("kvtether.retention")


def _target_key(target: pb.RetentionTarget) -> str:
    kind = target.WhichOneof("target")
    if kind is None:
        raise DirectiveError("target", "set job_id or session_id")
    value = getattr(target, kind)
    if not value:
        raise DirectiveError(f"target.{kind}", "must not be empty")
    return keys.retention_directive(f"{kind.removesuffix('_id')}:{value}")


class RetentionService(retention_pb2_grpc.RetentionServicer):
    def __init__(self, store: Store, directive_ttl_s: float) -> None:
        self._store = store
        self._ttl_ms = int(directive_ttl_s * 1000)
        self.tool_announcements: dict[str, tuple[str, float]] = {}

    async def SetDirectives(
        self, request: pb.SetDirectivesRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetDirectivesResponse:
        try:
            key = _target_key(request.target)
            validate(request.config)
            stored = await self._store.transact(
                [key], set_rule(key, request.scope, request.config, time.time(), self._ttl_ms))
        except DirectiveError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except OwnershipError as error:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(error))
        except StoreError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"store: {error}")
        log.info("retention_set", key=key, owner_scope=stored.owner_scope)
        return pb.SetDirectivesResponse(effective=stored.config, owner_scope=stored.owner_scope)

    async def GetDirectives(
        self, request: pb.GetDirectivesRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetDirectivesResponse:
        try:
            raw = await self._store.get(_target_key(request.target))
        except DirectiveError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except StoreError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"store: {error}")
        if raw is None:
            return pb.GetDirectivesResponse(found=False)
        stored = StoredDirective.decode(raw)
        return pb.GetDirectivesResponse(found=True, config=stored.config,
                                        owner_scope=stored.owner_scope,
                                        updated_at_unix_s=stored.updated_at_unix_s)

    async def ClearDirectives(
        self, request: pb.ClearDirectivesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ClearDirectivesResponse:
        try:
            key = _target_key(request.target)
            cleared = await self._store.transact([key], clear_rule(key, request.scope))
        except DirectiveError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except OwnershipError as error:
            code = (grpc.StatusCode.UNAUTHENTICATED if not request.scope
                    else grpc.StatusCode.PERMISSION_DENIED)
            await context.abort(code, str(error))
        except StoreError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"store: {error}")
        return pb.ClearDirectivesResponse(cleared=cleared)

    async def AnnounceToolCall(
        self, request: pb.AnnounceToolCallRequest, context: grpc.aio.ServicerContext
    ) -> pb.AnnounceToolCallResponse:
        if not request.job_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "job_id: must not be empty")
        if not request.tool:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tool: must not be empty")
        if request.expected_duration_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "expected_duration_s: must not be negative")
        self.tool_announcements[request.job_id] = (request.tool, request.expected_duration_s)
        return pb.AnnounceToolCallResponse()
