"""gRPC EngineSession: one bidirectional stream per engine, one decision per report.

With auth tokens configured, both methods need a bearer token of an engine scope
(``auth.engine_scopes``): UNAUTHENTICATED without a valid one, PERMISSION_DENIED for
another scope's. A stream replaced by a newer one of the same engine id ends ABORTED;
a unary Step for an engine with a live stream is FAILED_PRECONDITION; a report larger
than the limits is RESOURCE_EXHAUSTED naming the limit (``sidecar.runtime.engines``).

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
from sidecar.telemetry import metrics


class EngineSessionService(engine_session_pb2_grpc.EngineSessionServicer):
    def __init__(self, engines: EngineRegistry, authenticator: Authenticator | None = None
                 ) -> None:
        self._engines = engines
        self._auth = authenticator if authenticator is not None else Authenticator({})

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if not self._auth.enabled:
            return
        try:
            self._auth.engine_scope_of(context.invocation_metadata())
        except Unauthenticated as error:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(error))
        except NotAnEngineScope as error:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(error))

    async def Session(
        self, request_iterator: AsyncIterator[pb.StepReport], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StepDecision]:
        await self._authorize(context)
        stream = EngineStream()
        ending = _Ending(context)
        # Ends the stream as soon as it is replaced, not at its next report: its peer
        # is usually gone already (the engine reconnected), or must learn at once.
        watch = asyncio.create_task(_end_when_replaced(stream, ending))
        engine_id: str | None = None
        metrics.ENGINE_SESSIONS.inc()
        try:
            async for report in request_iterator:
                engine_id = engine_id or report.engine_id or None
                if report.engine_id and report.engine_id != engine_id:
                    _refuse(context, InvalidReport(
                        "engine_id", f"changed from {engine_id!r} within one session"))
                    return
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
        await self._authorize(context)
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
