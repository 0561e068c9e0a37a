"""Request-rate limits per caller, as a gRPC server interceptor.

Retention calls are limited per caller: the scope a valid bearer token authenticates,
else the address the call comes from (without the client's port, which changes with
every connection; every Unix-socket client is one caller). A caller with a bad token is
limited by its address before the service refuses it. A token bucket per key; beyond it
the call ends with RESOURCE_EXHAUSTED and changes nothing. Buckets are kept for the
most recently seen callers only, so memory stays bounded whoever calls.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from sidecar.retention.auth import Authenticator, Unauthenticated

MAX_TRACKED_CALLERS = 10_000


def peer_address(peer: str) -> str:
    """gRPC's peer string less the client's port: ``ipv4:10.0.0.7:5678`` ->
    ``ipv4:10.0.0.7``, ``ipv6:[::1]:5678`` -> ``ipv6:[::1]``; any Unix socket ->
    ``unix``."""
    scheme, _, rest = peer.partition(":")
    if scheme.startswith("unix"):
        return "unix"
    host, colon, port = rest.rpartition(":")
    if colon and port.isdigit() and (scheme == "ipv4" or host.endswith(("]", "%5D"))):
        return f"{scheme}:{host}"
    return peer


class TokenBucket:
    __slots__ = ("capacity", "rate_per_s", "tokens", "updated_s")

    def __init__(self, rate_per_s: float, capacity: int, now_s: float) -> None:
        self.rate_per_s = rate_per_s
        self.capacity = float(capacity)
        self.tokens = float(capacity)
        self.updated_s = now_s

    def take(self, now_s: float) -> bool:
        self.tokens = min(self.capacity, self.tokens + (now_s - self.updated_s) * self.rate_per_s)
        self.updated_s = now_s
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class RateLimitInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, service_prefix: str, rate_per_s: float, burst: int,
                 authenticator: Authenticator,
                 clock_s: Callable[[], float] = time.monotonic) -> None:
        self._prefix = service_prefix
        self._rate_per_s = rate_per_s
        self._burst = burst
        self._authenticator = authenticator
        self._clock_s = clock_s
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def _allow(self, key: str) -> bool:
        now_s = self._clock_s()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = TokenBucket(self._rate_per_s, self._burst, now_s)
            self._buckets[key] = bucket
            if len(self._buckets) > MAX_TRACKED_CALLERS:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return bucket.take(now_s)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or not method.startswith(self._prefix) or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary
        allow = self._allow
        authenticator = self._authenticator
        metadata = handler_call_details.invocation_metadata

        async def limited(request: Any, context: grpc.aio.ServicerContext) -> Any:
            key = f"address:{peer_address(context.peer())}"
            if authenticator.enabled:
                # Without a valid token the service refuses the call itself.
                with contextlib.suppress(Unauthenticated):
                    key = f"scope:{authenticator.scope_of(metadata)}"
            if not allow(key):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"rate limit: more than {self._rate_per_s:g} calls/s "
                                    f"(burst {self._burst}) for this caller")
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            limited,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
