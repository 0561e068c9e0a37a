"""Request-rate limits per caller, as a gRPC server interceptor.

Each limited service (Retention, EngineSession, Inspect) has its own budget per
caller: the scope a valid bearer token authenticates, else the address the call comes
from (without the client's port, which changes with every connection; every
Unix-socket client is one caller). A caller with a bad token is limited by its address
before the service refuses it. A token bucket per key; beyond it the call ends with
RESOURCE_EXHAUSTED and changes nothing. A streaming call counts once, when it opens
(an engine's Session stream is one call however many reports it carries). Buckets are
kept for the most recently seen keys only, so memory stays bounded whoever calls.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from sidecar.retention.auth import Authenticator, Unauthenticated
from sidecar.server.handlers import gated, rewrapped

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


class KeyedBuckets:
    """A token bucket per key (a caller, an engine id), for the ``MAX_TRACKED_CALLERS``
    most recently seen keys: a key forgotten starts again with a full bucket."""

    def __init__(self, rate_per_s: float, burst: int,
                 clock_s: Callable[[], float] = time.monotonic) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock_s = clock_s
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def allow(self, key: str) -> bool:
        """Takes one from ``key``'s bucket; False: it is empty."""
        now_s = self._clock_s()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = TokenBucket(self.rate_per_s, self.burst, now_s)
            self._buckets[key] = bucket
            if len(self._buckets) > MAX_TRACKED_CALLERS:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return bucket.take(now_s)


@dataclass(frozen=True, slots=True)
class CallLimit:
    """Calls to the methods under ``prefix`` (``/kvtether.v1.Retention/``), per caller."""

    prefix: str
    rate_per_s: float
    burst: int
    # The settings that set it, for the refusal (``limits.retention_calls_per_s``).
    setting: str


def caller_key(context: grpc.aio.ServicerContext, authenticator: Authenticator) -> str:
    """Whom a call counts against: its token's scope, else its address."""
    if authenticator.enabled:
        # Without a valid token the service refuses the call itself.
        with contextlib.suppress(Unauthenticated):
            return f"scope:{authenticator.scope_of(context.invocation_metadata())}"
    return f"address:{peer_address(context.peer())}"


class RateLimitInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, limits: Sequence[CallLimit], authenticator: Authenticator,
                 clock_s: Callable[[], float] = time.monotonic) -> None:
        self._limits = [(limit, KeyedBuckets(limit.rate_per_s, limit.burst, clock_s))
                        for limit in limits]
        self._authenticator = authenticator

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        found = [(limit, buckets) for limit, buckets in self._limits
                 if method.startswith(limit.prefix)]
        if handler is None or not found:
            return handler
        limit, buckets = found[0]
        authenticator = self._authenticator

        async def gate(context: grpc.aio.ServicerContext) -> None:
            if not buckets.allow(caller_key(context, authenticator)):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"rate limit: more than {limit.rate_per_s:g} calls/s "
                                    f"(burst {limit.burst}) for this caller ({limit.setting})")

        return rewrapped(handler, lambda behavior, _kind: gated(behavior, gate))
