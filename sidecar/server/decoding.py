"""Request bytes that do not decode end with ``INVALID_ARGUMENT``, as any other bad input.

grpc.aio decodes a request with the handler's ``request_deserializer`` before the
service runs, and ends the call with ``UNKNOWN`` when that raises: a caller cannot tell
its own malformed message from a fault of the daemon. This interceptor wraps every
handler's deserializer so that a ``DecodeError`` becomes a marker the handler's
wrapper refuses, naming the method, for unary and streaming requests alike.

Contract: every handler is a grpc.aio one (a coroutine, or an async generator of
responses), as the daemon's services, health and reflection are.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from sidecar.server.handlers import rewrapped


class _Undecodable:
    __slots__ = ("error",)

    def __init__(self, error: DecodeError) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except DecodeError as error:
            return _Undecodable(error)

    return decode


async def _refuse(method: str, request: _Undecodable,
                  context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"{method}: the request does not decode ({request.error})")


Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]


def _checked(behavior: Behavior, method: str, streaming_requests: bool) -> Behavior:
    """``behavior`` refusing an undecodable request (or, with ``streaming_requests``,
    the first undecodable one of the stream); of the same kind as ``behavior`` (an
    async generator of responses, or a coroutine that returns or writes them)."""

    async def first(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if not streaming_requests:
            if isinstance(request, _Undecodable):
                await _refuse(method, request, context)
            return request

        async def checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
            async for item in requests:
                if isinstance(item, _Undecodable):
                    await _refuse(method, item, context)
                yield item

        return checked(request)

    if inspect.isasyncgenfunction(behavior):
        async def responses(request: Any, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[Any]:
            async for response in behavior(await first(request, context), context):
                yield response

        return responses

    async def response(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(await first(request, context), context)

    return response


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method or "?"
        # A request stream is read message by message; a single request is decoded first.
        return rewrapped(
            handler,
            lambda behavior, kind: _checked(behavior, method,
                                            kind in ("client_stream", "bidi_stream")),
            request_deserializer=_tolerant(handler.request_deserializer))
