"""gRPC server metrics: calls started and handled by method and status code, and how
long each took, as go-grpc-prometheus names them (``grpc_server_started_total``,
``grpc_server_handled_total``, ``grpc_server_handling_seconds``).

Written here rather than taken from py-grpc-prometheus: its interceptor is for grpc's
threaded server, and its grpc.aio one awaits every handler, which a streaming handler
(an async generator) is not, and reads the status only from a raised ``RpcError``,
missing codes set by ``context.abort``.

Runs outermost, so a call the other interceptors refuse (rate limit, undecodable
request) counts with the code it ended with. A stream counts once, when it ends.

Contract: every handler is a grpc.aio one (a coroutine, or an async generator of
responses), as the daemon's services, health and reflection are.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from sidecar.server.handlers import rewrapped
from sidecar.telemetry import metrics

Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]


def split_method(full_method: str) -> tuple[str, str]:
    """``/kvtether.v1.EngineSession/Session`` -> ``("kvtether.v1.EngineSession",
    "Session")``; anything else -> ``("unknown", <it>)``."""
    service, slash, method = full_method.removeprefix("/").rpartition("/")
    if not slash or not service or not method:
        return "unknown", full_method
    return service, method


def _code_set(context: grpc.aio.ServicerContext) -> grpc.StatusCode | None:
    """The status the handler set (``set_code``, ``abort``), if it set one."""
    code = context.code()
    if code is None or isinstance(code, grpc.StatusCode):
        return code
    for status in grpc.StatusCode:  # an int on some grpcio releases
        if status.value[0] == code:
            return status
    return grpc.StatusCode.UNKNOWN


def _ended_with(context: grpc.aio.ServicerContext, error: BaseException | None
                ) -> grpc.StatusCode:
    """The status a call ends with: what the handler set, else OK on return; a
    cancelled handler ended because the client went or its deadline passed; any other
    exception is UNKNOWN, as grpc.aio answers it."""
    code = _code_set(context)
    if code is not None:
        return code
    if error is None:
        return grpc.StatusCode.OK
    if isinstance(error, asyncio.CancelledError):
        remaining_s = context.time_remaining()
        if remaining_s is not None and remaining_s <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


class _Call:
    """One call's labels and clock."""

    __slots__ = ("labels", "started_s")

    def __init__(self, labels: tuple[str, str, str]) -> None:
        self.labels = labels
        metrics.GRPC_STARTED.labels(*labels).inc()
        self.started_s = time.perf_counter()

    def end(self, context: grpc.aio.ServicerContext, error: BaseException | None) -> None:
        code = _ended_with(context, error)
        metrics.GRPC_HANDLED.labels(*self.labels, code.name).inc()
        metrics.GRPC_HANDLING_SECONDS.labels(*self.labels).observe(
            time.perf_counter() - self.started_s)


def _measured(behavior: Behavior, labels: tuple[str, str, str]) -> Behavior:
    """``behavior``, counted and timed; of the same kind (an async generator of
    responses, or a coroutine that returns or writes them)."""
    if inspect.isasyncgenfunction(behavior):
        async def responses(request: Any, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[Any]:
            call = _Call(labels)
            try:
                async for response in behavior(request, context):
                    yield response
            except BaseException as error:
                call.end(context, error)
                raise
            call.end(context, None)

        return responses

    async def response(request: Any, context: grpc.aio.ServicerContext) -> Any:
        call = _Call(labels)
        try:
            answer = await behavior(request, context)
        except BaseException as error:
            call.end(context, error)
            raise
        call.end(context, None)
        return answer

    return response


class GrpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:  # no such method: grpc answers UNIMPLEMENTED, uncounted
            return handler
        service, method = split_method(handler_call_details.method or "")
        return rewrapped(handler,
                         lambda behavior, kind: _measured(behavior, (kind, service, method)))
