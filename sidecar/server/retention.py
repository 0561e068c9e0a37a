"""gRPC Retention: orchestrators set, read back and clear directives per job or session.

SetDirectives takes the directives in kvtether's shape (``config``) or in
TensorRT-LLM's (``trtllm_config``, converted by :mod:`sidecar.api.retention_dialects`),
one of the two.

A tool call an orchestrator announces names the job's tool in the job tracker (the
job's last tool for policies, and the tool its next arrival's tool time counts for);
the service itself keeps nothing per call.

Who the caller is: with auth tokens configured, the scope of the caller's bearer token
(``authorization: Bearer <token>``) — a mutation without a valid one is
UNAUTHENTICATED and the request's ``scope`` field is ignored; without tokens, the
``scope`` the request claims; then a mutation that sends a bearer token but claims no
scope is INVALID_ARGUMENT, since the token identifies no one and its sender expects it
to (an anonymous directive is one its setter can never clear), and refusing an
anonymous caller says which scope to claim. GetDirectives is a read: with tokens, it
takes a token of a read scope (``sidecar.server.read_access``), else none.

Ownership is decided atomically in the store (``sidecar.retention.directives``); every
accepted change is written through to the directory the decision path reads, so it
applies from the next engine step.
"""

from __future__ import annotations

import time

import grpc
import structlog

from sidecar.api.bounds import FieldError, check_text, check_time, check_tool
from sidecar.api.retention_dialects import from_trtllm_message
from sidecar.api.retention_ownership import ANONYMOUS
from sidecar.api.v1 import retention_pb2 as pb
from sidecar.api.v1 import retention_pb2_grpc
from sidecar.jobs import JobTracker
from sidecar.retention.auth import AUTHORIZATION, Authenticator, Unauthenticated
from sidecar.retention.directives import (
    DirectiveError,
    OwnershipError,
    StoredDirective,
    clear_rule,
    set_rule,
    validate,
)
from sidecar.retention.directory import RetentionDirectory, target_of
from sidecar.server.checks import check_request
from sidecar.store import Store, StoreError, keys

log = structlog.get_logger("kvtether.retention")


class RetentionService(retention_pb2_grpc.RetentionServicer):
    def __init__(
        self,
        store: Store,
        directive_ttl_s: float,
        directory: RetentionDirectory | None = None,
        authenticator: Authenticator | None = None,
        tracker: JobTracker | None = None,
    ) -> None:
        self._store = store
        self._ttl_ms = int(directive_ttl_s * 1000)
        self._directory = directory
        self._auth = authenticator if authenticator is not None else Authenticator({})
        self._tracker = tracker

    async def _caller(self, claimed_scope: str, context: grpc.aio.ServicerContext, *,
                      claims_scope: bool = True) -> str:
        """The caller's scope for a mutation; aborts UNAUTHENTICATED without a valid token,
        and INVALID_ARGUMENT for a token sent without a scope to a daemon that has no
        tokens (``claims_scope``: the request has a scope field)."""
        if not self._auth.enabled:
            if claims_scope and not claimed_scope and _sends_token(context):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "scope: missing, and the authorization header identifies no one: this "
                    "daemon has no auth.tokens, so callers are the scope they claim; add "
                    '"scope": "<your scope>" to the request (or configure auth.tokens)')
            return claimed_scope
        try:
            return self._auth.scope_of(context.invocation_metadata())
        except Unauthenticated as error:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(error))
            raise  # unreachable: abort raises

    async def SetDirectives(
        self, request: pb.SetDirectivesRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetDirectivesResponse:
        scope = await self._caller(request.scope, context)
        await check_request(request, context)
        try:
            target = target_of(request.target)
            config = directives_of(request)
            key = keys.retention_directive(target)
            stored = await self._store.transact(
                [key], set_rule(key, scope, config, time.time(), self._ttl_ms))
        except DirectiveError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except OwnershipError as error:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, self._refusal(error, scope))
        except StoreError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"store: {error}")
        if self._directory is not None:
            self._directory.put(target, stored)
        log.info("retention_set", target=target, scope=scope, owner_scope=stored.owner_scope)
        return pb.SetDirectivesResponse(effective=stored.config, owner_scope=stored.owner_scope)

    async def GetDirectives(
        self, request: pb.GetDirectivesRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetDirectivesResponse:
        await check_request(request, context)
        try:
            raw = await self._store.get(keys.retention_directive(target_of(request.target)))
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
        scope = await self._caller(request.scope, context)
        await check_request(request, context)
        try:
            target = target_of(request.target)
            key = keys.retention_directive(target)
            cleared = await self._store.transact([key], clear_rule(key, scope))
        except DirectiveError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except OwnershipError as error:
            code = (grpc.StatusCode.UNAUTHENTICATED if scope == ANONYMOUS
                    else grpc.StatusCode.PERMISSION_DENIED)
            await context.abort(code, self._refusal(error, scope))
        except StoreError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"store: {error}")
        if cleared and self._directory is not None:
            self._directory.put(target, None)
        if cleared:
            log.info("retention_cleared", target=target, scope=scope)
        return pb.ClearDirectivesResponse(cleared=cleared)

    def _refusal(self, error: OwnershipError, caller: str) -> str:
        """The refusal, and for an anonymous caller what would make it the owner (with
        auth on, no caller is anonymous: every token maps to a named scope)."""
        if caller != ANONYMOUS:
            return str(error)
        claim = "<your scope>" if error.owner == ANONYMOUS else error.owner
        return (f'{error}: add "scope": "{claim}" to the request (this daemon has no '
                "auth.tokens, so callers are the scope they claim and an authorization "
                "header is ignored)")

    async def AnnounceToolCall(
        self, request: pb.AnnounceToolCallRequest, context: grpc.aio.ServicerContext
    ) -> pb.AnnounceToolCallResponse:
        await self._caller("", context, claims_scope=False)
        await check_request(request, context)
        try:
            check_text("job_id", request.job_id, required=True)
            if not request.tool:
                raise FieldError("tool", "must not be empty")
            check_tool("tool", request.tool)
            check_time("expected_duration_s", request.expected_duration_s)
        except FieldError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        # A job the daemon does not track (unknown, or already forgotten) is left
        # alone: keeping announcements of any job id would be memory any caller takes.
        if self._tracker is not None:
            self._tracker.on_tool_announced(request.job_id, request.tool)
        return pb.AnnounceToolCallResponse()


def directives_of(request: pb.SetDirectivesRequest) -> pb.RetentionConfig:
    """The request's directives, from ``config`` or (converted) ``trtllm_config``;
    validated. Raises DirectiveError naming the field."""
    if request.HasField("trtllm_config"):
        if request.HasField("config"):
            raise DirectiveError("trtllm_config",
                                 "set together with config: send one of the two")
        return from_trtllm_message(request.trtllm_config)
    validate(request.config)
    return request.config


def _sends_token(context: grpc.aio.ServicerContext) -> bool:
    return any(key.lower() == AUTHORIZATION for key, _ in context.invocation_metadata() or ())
