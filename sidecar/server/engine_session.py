"""gRPC EngineSession: one bidirectional stream per engine, one decision per report.

With auth tokens configured, both methods need a bearer token of an engine scope
(``auth.engine_scopes``): UNAUTHENTICATED without a valid one, PERMISSION_DENIED for
another scope's, or for an engine id the scope's ``auth.engine_ids`` patterns do not
match. A stream replaced by a newer one of the same engine id ends ABORTED; a unary
Step for an engine with a live stream is FAILED_PRECONDITION; a report larger than the
limits is RESOURCE_EXHAUSTED naming the limit (``sidecar.runtime.engines``).

Taking an engine id over (a Session's snapshot for an id another live Session holds):
with tokens, only a Session of the scope that holds it may (a restarting engine
reconnects with its own token), else PERMISSION_DENIED; with or without tokens, at most
``limits.engine_takeovers_per_min`` takeovers of one id (burst
``limits.engine_takeover_burst``), else RESOURCE_EXHAUSTED. A refused takeover changes
nothing: the live Session keeps the id.

A refused report ends its call with a status set on the context and a plain return,
not ``context.abort``: grpc.aio's abort path keeps native memory of every large request
it refuses (about 34 KB per refused 1 MB report, without end), so a flood of refused
reports would grow the daemon until it is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import engine_session_pb2_grpc
from sidecar.retention.auth import Authenticator, NotAnEngineScope, Unauthenticated
from sidecar.runtime.engines import (
    EngineRegistry,
    EngineStream,
    ReportTooLarge,
    SessionConflict,
    SessionReplaced,
)
from sidecar.runtime.reports import InvalidReport
from sidecar.server.limits import KeyedBuckets
from sidecar.telemetry import metrics

# Defaults of limits.engine_takeovers_per_min / engine_takeover_burst (DaemonConfig).
DEFAULT_TAKEOVERS_PER_MIN = 6.0
DEFAULT_TAKEOVER_BURST = 3


class EngineSessionService(engine_session_pb2_grpc.EngineSessionServicer):
    def __init__(self, engines: EngineRegistry, authenticator: Authenticator | None = None,
                 takeovers_per_min: float = DEFAULT_TAKEOVERS_PER_MIN,
                 takeover_burst: int = DEFAULT_TAKEOVER_BURST) -> None:
        self._engines = engines
        self._auth = authenticator if authenticator is not None else Authenticator({})
        self._takeovers = KeyedBuckets(takeovers_per_min / 60.0, takeover_burst)
        self._takeovers_per_min = takeovers_per_min

    async def _authorize(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's engine scope ("" without tokens); aborts without one."""
        if not self._auth.enabled:
            return ""
        try:
            return self._auth.engine_scope_of(context.invocation_metadata())
        except Unauthenticated as error:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(error))
        except NotAnEngineScope as error:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(error))
        raise AssertionError("unreachable: abort raises")

    async def _check_engine_id(self, scope: str, engine_id: str,
                               context: grpc.aio.ServicerContext) -> None:
        if not self._auth.enabled:
            return
        try:
            self._auth.check_engine_id(scope, engine_id)
        except NotAnEngineScope as error:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(error))

    async def _check_takeover(self, engine_id: str, stream: EngineStream,
                              context: grpc.aio.ServicerContext) -> None:
        """Aborts a snapshot that would end another live Session's hold on
        ``engine_id`` where that is not allowed (see the module's docstring)."""
        owner = self._engines.owner_of(engine_id)
        if owner is None or owner is stream:
            return
        if self._auth.enabled and owner.scope != stream.scope:
            metrics.ENGINE_SESSIONS_REFUSED.inc()
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"engine_id: engine {engine_id[:64]!r} is held by a live Session of another "
                "scope; only a token of the scope that holds it may take it over")
        if not self._takeovers.allow(engine_id):
            metrics.ENGINE_SESSIONS_REFUSED.inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"engine_id: engine {engine_id[:64]!r} was taken over more than "
                f"{self._takeovers_per_min:g} times a minute (limits.engine_takeovers_per_min"
                "); its live Session keeps it")

    async def Session(
        self, request_iterator: AsyncIterator[pb.StepReport], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StepDecision]:
        scope = await self._authorize(context)
        stream = EngineStream(scope)
        ending = _Ending(context)
        # Ends the stream as soon as it is replaced, not at its next report: its peer
        # is usually gone already (the engine reconnected), or must learn at once.
        watch = asyncio.create_task(_end_when_replaced(stream, ending))
        engine_id: str | None = None
        metrics.ENGINE_SESSIONS.inc()
        try:
            async for report in request_iterator:
                if engine_id is None and report.engine_id:
                    await self._check_engine_id(scope, report.engine_id, context)
                    engine_id = report.engine_id
                if report.engine_id and report.engine_id != engine_id:
                    _refuse(context, InvalidReport(
                        "engine_id", f"changed from {engine_id!r} within one session"))
                    return
                if report.snapshot and engine_id is not None:
                    await self._check_takeover(engine_id, stream, context)
                try:
                    decision = await self._engines.handle_async(report, stream)
                except (InvalidReport, ReportTooLarge) as error:
                    _refuse(context, error)
                    return
                except SessionReplaced as error:
                    await ending.abort(grpc.StatusCode.ABORTED, str(error))
                    return  # ended already by the watch
                yield decision
        finally:
            watch.cancel()
            metrics.ENGINE_SESSIONS.dec()
            self._engines.disconnect(engine_id, stream)

    async def Step(
        self, request: pb.StepReport, context: grpc.aio.ServicerContext
    ) -> pb.StepDecision:
        scope = await self._authorize(context)
        if request.engine_id:
            await self._check_engine_id(scope, request.engine_id, context)
        try:
            return await self._engines.handle_async(request)
        except (InvalidReport, ReportTooLarge) as error:
            _refuse(context, error)
            return pb.StepDecision()  # not sent: the status set ends the call
        except SessionConflict as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
            raise  # unreachable: abort raises


class _Ending:
    """Ends a stream once, from its own handler or from the task watching it."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self._ended = False

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        """Raises AbortError, or returns where the stream was ended already."""
        if self._ended:
            return
        self._ended = True
        await self._context.abort(code, details)


async def _end_when_replaced(stream: EngineStream, ending: _Ending) -> None:
    await stream.replaced.wait()
    assert stream.engine_id is not None  # set before any stream can be replaced
    with contextlib.suppress(grpc.aio.AbortError):
        await ending.abort(grpc.StatusCode.ABORTED, str(SessionReplaced(stream.engine_id)))


def _refuse(context: grpc.aio.ServicerContext, error: InvalidReport | ReportTooLarge) -> None:
    """End the call refusing the report (module doc: no abort); the caller returns."""
    metrics.INVALID_REPORTS.labels(error.field.split("[", 1)[0]).inc()
    context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(error, ReportTooLarge)
                     else grpc.StatusCode.INVALID_ARGUMENT)
    context.set_details(str(error))
