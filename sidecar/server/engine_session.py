"""gRPC EngineSession: one bidirectional stream per engine, one decision per report."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import engine_session_pb2_grpc
from sidecar.runtime.engines import EngineRegistry, InvalidReport
from sidecar.telemetry import metrics


class EngineSessionService(engine_session_pb2_grpc.EngineSessionServicer):
    def __init__(self, engines: EngineRegistry) -> None:
        self._engines = engines

    async def Session(
        self, request_iterator: AsyncIterator[pb.StepReport], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StepDecision]:
        session = object()
        engine_id: str | None = None
        metrics.ENGINE_SESSIONS.inc()
        try:
            async for report in request_iterator:
                engine_id = engine_id or report.engine_id or None
                if report.engine_id and report.engine_id != engine_id:
                    await _refuse(context, InvalidReport(
                        "engine_id", f"changed from {engine_id!r} within one session"))
                try:
                    yield self._engines.handle(report, session)
                except InvalidReport as error:
                    await _refuse(context, error)
        finally:
            metrics.ENGINE_SESSIONS.dec()
            self._engines.disconnect(engine_id, session)

    async def Step(
        self, request: pb.StepReport, context: grpc.aio.ServicerContext
    ) -> pb.StepDecision:
        try:
            return self._engines.handle(request)
        except InvalidReport as error:
            await _refuse(context, error)
            raise  # unreachable: abort raises


async def _refuse(context: grpc.aio.ServicerContext, error: InvalidReport) -> None:
    metrics.INVALID_REPORTS.labels(error.field.split("[", 1)[0]).inc()
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
