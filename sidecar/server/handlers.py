"""Rebuilding a gRPC method handler around a wrapped behaviour, whatever its kind: what
every server interceptor here does once it has the handler; and a behaviour behind a
gate (a rate limit, a token check) that may refuse the call before it runs.

Contract: every handler is a grpc.aio one (a coroutine, or an async generator of
responses), as the daemon's services, health and reflection are."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import grpc

# The call's kind, as go-grpc-prometheus names it (``grpc_type``).
Kind = Literal["unary", "server_stream", "client_stream", "bidi_stream"]
Behavior = Callable[..., Any]


def rewrapped(handler: grpc.RpcMethodHandler, wrap: Callable[[Behavior, Kind], Behavior],
              request_deserializer: Callable[[bytes], Any] | None = None
              ) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour replaced by ``wrap(behaviour, kind)``, and its
    request deserializer by ``request_deserializer`` when one is given."""
    options = {"request_deserializer": request_deserializer or handler.request_deserializer,
               "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            wrap(handler.unary_unary, "unary"), **options)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            wrap(handler.unary_stream, "server_stream"), **options)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(
            wrap(handler.stream_unary, "client_stream"), **options)
    return grpc.stream_stream_rpc_method_handler(
        wrap(handler.stream_stream, "bidi_stream"), **options)


Gate = Callable[[Any], Awaitable[None]]


def gated(behavior: Behavior, gate: Gate) -> Behavior:
    """``behavior`` run only once ``await gate(context)`` has returned (a gate refuses a
    call by aborting it); of the same kind (an async generator of responses, or a
    coroutine that returns or writes them)."""
    if inspect.isasyncgenfunction(behavior):
        async def responses(request: Any, context: Any) -> AsyncIterator[Any]:
            await gate(context)
            async for response in behavior(request, context):
                yield response

        return responses

    async def response(request: Any, context: Any) -> Any:
        await gate(context)
        return await behavior(request, context)

    return response
