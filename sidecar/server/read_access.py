"""Who may read the daemon's state, as a gRPC server interceptor.

Reading — every Inspect method (policy, jobs and their request ids, pins, tool
statistics, decisions, the live decision feed) and Retention/GetDirectives — shows
what the engines serve. With auth tokens configured it takes a bearer token of a read
scope (``auth.read_scopes``; any configured scope's where none is listed):
UNAUTHENTICATED without a valid token, PERMISSION_DENIED for another scope's. Without
tokens, or with ``auth.inspect_open: true``, reading is open to whoever reaches the
listener. Either way reads are rate-limited per caller (``sidecar.server.limits``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import grpc

from sidecar.retention.auth import Authenticator, NotAReadScope, Unauthenticated
from sidecar.server.handlers import gated, rewrapped

_OPEN_HINT = ("reading takes a token of a read scope while auth tokens are configured "
              "(auth.read_scopes; auth.inspect_open: true leaves it open)")


class ReadAccessInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, prefixes: Sequence[str], authenticator: Authenticator) -> None:
        # Full method names or service prefixes (``/kvtether.v1.Inspect/``).
        self._prefixes = tuple(prefixes)
        self._authenticator = authenticator

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or not method.startswith(self._prefixes):
            return handler
        authenticator = self._authenticator

        async def gate(context: grpc.aio.ServicerContext) -> None:
            try:
                authenticator.read_scope_of(context.invocation_metadata())
            except Unauthenticated as error:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{error}: {_OPEN_HINT}")
            except NotAReadScope as error:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(error))

        return rewrapped(handler, lambda behavior, _kind: gated(behavior, gate))
