"""The daemon process: build from config, serve gRPC and /metrics, stop gracefully.

Lifecycle (grpc's own examples): start → health SERVING; SIGTERM/SIGINT → health
NOT_SERVING first (so load balancers and probes stop sending), then
``server.stop(grace_s)`` lets in-flight calls finish, then queued store writes are
flushed, then exit 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from sidecar import __version__
from sidecar.api.v1 import (
    engine_session_pb2,
    engine_session_pb2_grpc,
    inspect_pb2,
    inspect_pb2_grpc,
    retention_pb2,
    retention_pb2_grpc,
)
from sidecar.config import DaemonConfig, as_log_fields
from sidecar.estimators.tool_time import ToolTimeEstimator
from sidecar.framework import Policy
from sidecar.jobs import JobTracker
from sidecar.policies.registry import build_policy
from sidecar.retention.auth import Authenticator
from sidecar.retention.directory import RetentionDirectory
from sidecar.retention.resolve import RetentionResolver
from sidecar.runtime.decider import Decider, DecisionLog
from sidecar.runtime.engines import EngineRegistry, ReportLimits
from sidecar.runtime.recorder import Recorder
from sidecar.server.decoding import DecodeErrorInterceptor
from sidecar.server.engine_session import EngineSessionService
from sidecar.server.grpc_metrics import GrpcMetricsInterceptor
from sidecar.server.inspect import InspectService
from sidecar.server.limits import CallLimit, RateLimitInterceptor
from sidecar.server.read_access import ReadAccessInterceptor
from sidecar.server.retention import RetentionService
from sidecar.server.supervise import supervise
from sidecar.server.transport import bind_tcp, server_credentials
from sidecar.store import Store, open_store
from sidecar.telemetry import metrics
from sidecar.telemetry.cpu_wait import CpuWaitWatch
from sidecar.telemetry.metrics import REGISTRY

log = structlog.get_logger("kvtether.daemon")

SERVICE_NAMES = (
    engine_session_pb2.DESCRIPTOR.services_by_name["EngineSession"].full_name,
    retention_pb2.DESCRIPTOR.services_by_name["Retention"].full_name,
    inspect_pb2.DESCRIPTOR.services_by_name["Inspect"].full_name,
)
# What one request or pin of a report takes on the wire at most, with every id and
# name at its length limit (sidecar.api.bounds) in ASCII, and its retention directives.
MAX_REPORT_ITEM_BYTES = 1024
# Room for what is not a request or a pin: the clock, capacity, counters, headers.
MESSAGE_HEADROOM_BYTES = 1024 * 1024


def max_message_bytes(limits: ReportLimits) -> int:
    """The largest message the daemon's gRPC transport takes or sends: the largest
    report ``limits`` allow (every request and pin at ``MAX_REPORT_ITEM_BYTES``). A
    larger one is refused by gRPC itself (RESOURCE_EXHAUSTED) before the daemon holds
    any of it."""
    items = limits.max_running + limits.max_waiting + limits.max_pins
    return items * MAX_REPORT_ITEM_BYTES + MESSAGE_HEADROOM_BYTES


def server_options(limits: ReportLimits) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes(limits)),
        ("grpc.max_send_message_length", max_message_bytes(limits)),
        *SERVER_OPTIONS,
    ]


SERVER_OPTIONS = [
    # Engines keep one stream open for days; keepalives find dead peers.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # gRPC binds with SO_REUSEPORT by default: a second daemon (or the main and
    # inspect listeners given one port) would bind an address in use and the kernel
    # would split connections between them. A port in use is an error here.
    ("grpc.so_reuseport", 0),
]


def _serve(server: grpc.aio.Server, health_servicer: health.aio.HealthServicer,
           services: tuple[str, ...], inspect: InspectService | None = None) -> None:
    """Health and reflection (listing ``services``) on every server; Inspect where given."""
    if inspect is not None:
        inspect_pb2_grpc.add_InspectServicer_to_server(inspect, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*services, health.SERVICE_NAME, reflection.SERVICE_NAME), server)


@dataclass
class Daemon:
    config: DaemonConfig
    policy: Policy
    store: Store
    engines: EngineRegistry
    recorder: Recorder
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    addresses: list[str] = field(default_factory=list)
    # Inspect on its own listener (listen.inspect_tcp), when configured.
    inspect_server: grpc.aio.Server | None = None
    inspect_address: str | None = None
    metrics_port: int | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @classmethod
    async def build(cls, config: DaemonConfig) -> Daemon:
        """Everything that can fail on bad configuration fails here, before serving."""
        policy = build_policy(config.policy.name, config.policy.params)
        store = await open_store(config.store.redis_url, timeout_s=config.store.timeout_s,
                                 embedded_max_histories=config.store.embedded_max_histories)
        tracker = JobTracker(max_jobs=config.max_jobs_tracked)
        estimator = ToolTimeEstimator(store, stats_ttl_s=config.store.tool_stats_ttl_s)
        recorder = Recorder(store, tracker, estimator, config.store.history_max_events,
                            config.store.history_ttl_s)
        decisions = DecisionLog()
        authenticator = Authenticator(config.auth.token_scopes(), config.auth.engine_scopes,
                                      config.auth.engine_ids, config.auth.read_scopes)
        directory = RetentionDirectory(store, max_jobs=config.max_jobs_tracked)
        # With tokens configured, a request's claimed retention_scope counts as anonymous.
        retention = RetentionResolver(directory, trust_request_scopes=not authenticator.enabled)
        report_limits = ReportLimits(max_running=config.limits.max_running_per_engine,
                                     max_waiting=config.limits.max_waiting_per_engine,
                                     max_pins=config.limits.max_pins_per_engine)
        engines = EngineRegistry(Decider(policy, recorder, decisions, retention),
                                 forget_after_s=config.engine_forget_after_s,
                                 limits=report_limits)

        limits = config.limits
        limiter = RateLimitInterceptor([
            CallLimit(f"/{SERVICE_NAMES[0]}/", limits.engine_calls_per_s, limits.engine_burst,
                      "limits.engine_calls_per_s"),
            CallLimit(f"/{SERVICE_NAMES[1]}/", limits.retention_calls_per_s,
                      limits.retention_burst, "limits.retention_calls_per_s"),
            CallLimit(f"/{SERVICE_NAMES[2]}/", limits.inspect_calls_per_s, limits.inspect_burst,
                      "limits.inspect_calls_per_s"),
        ], authenticator)
        # Metrics first: outermost, they count the calls the others refuse. The rate
        # limit before the read check: a caller without a token is limited too.
        interceptors: list[grpc.aio.ServerInterceptor] = [
            GrpcMetricsInterceptor(), DecodeErrorInterceptor(), limiter]
        if authenticator.enabled and not config.auth.inspect_open:
            interceptors.append(ReadAccessInterceptor(
                (f"/{SERVICE_NAMES[2]}/", f"/{SERVICE_NAMES[1]}/GetDirectives"),
                authenticator))
        server = grpc.aio.server(options=server_options(report_limits),
                                 interceptors=interceptors)
        engine_session_pb2_grpc.add_EngineSessionServicer_to_server(
            EngineSessionService(engines, authenticator, limits.engine_takeovers_per_min,
                                 limits.engine_takeover_burst), server)
        retention_pb2_grpc.add_RetentionServicer_to_server(
            RetentionService(store, directive_ttl_s=config.store.history_ttl_s,
                             directory=directory, authenticator=authenticator,
                             tracker=tracker), server)
        inspect = InspectService(config, policy, store, engines, tracker, estimator, decisions)
        health_servicer = health.aio.HealthServicer()
        credentials = server_credentials(config.tls)
        inspect_server = None
        if config.listen.inspect_tcp:
            # Inspect apart: operators get read-only access on their own port (and
            # network policy), engines and orchestrators never share it.
            inspect_server = grpc.aio.server(options=server_options(report_limits),
                                             interceptors=interceptors)
            _serve(inspect_server, health_servicer, SERVICE_NAMES[2:], inspect)
            _serve(server, health_servicer, SERVICE_NAMES[:2])
        else:
            _serve(server, health_servicer, SERVICE_NAMES, inspect)

        daemon = cls(config, policy, store, engines, recorder, server, health_servicer)
        if inspect_server is not None:
            daemon.inspect_server = inspect_server
            daemon.inspect_address = bind_tcp(inspect_server, config.listen.inspect_tcp,
                                              credentials, "listen.inspect_tcp")
        if config.listen.tcp:
            daemon.addresses.append(
                bind_tcp(server, config.listen.tcp, credentials, "listen.tcp"))
        if config.listen.unix_socket:
            server.add_insecure_port(f"unix:{config.listen.unix_socket}")
            daemon.addresses.append(f"unix:{config.listen.unix_socket}")
        if not daemon.addresses:
            raise ValueError("listen: enable listen.tcp or listen.unix_socket")
        return daemon

    async def start(self) -> None:
        # The metrics port first: a port in use stops the daemon before it serves.
        if self.config.metrics.port >= 0:
            address = f"{self.config.metrics.host}:{self.config.metrics.port}"
            try:
                http_server, _thread = start_http_server(
                    self.config.metrics.port, addr=self.config.metrics.host, registry=REGISTRY)
            except OSError as error:
                raise OSError(f"metrics.port: cannot serve /metrics on {address} "
                              f"({error.strerror or error})") from None
            self.metrics_port = int(http_server.server_port)
        await self.server.start()
        if self.inspect_server is not None:
            await self.inspect_server.start()
        if self.config.listen.unix_socket:
            os.chmod(self.config.listen.unix_socket, int(self.config.listen.unix_socket_mode, 8))
        self._start_task("recorder", self.recorder.run)
        self._start_task("forget-engines", self._forget_departed_engines)
        # Decisions run on this thread: export how long it waits for a CPU, and say so
        # in the log when that is long.
        if metrics.EVENT_LOOP_CPU_WAIT.watch_current_thread():
            self._start_task("cpu-wait", CpuWaitWatch(metrics.EVENT_LOOP_CPU_WAIT).run)
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "daemon_serving",
            version=__version__,
            grpc=self.addresses,
            inspect=self.inspect_address or "on the main listeners",
            tls=("mutual" if self.config.tls.client_ca_file
                 else "on" if self.config.tls.enabled else "off"),
            metrics=(f"http://{self.config.metrics.host}:{self.metrics_port}/metrics"
                     if self.metrics_port is not None else None),
            store=self.store.backend_name,
            **as_log_fields(self.config),
        )
        if not (self.config.auth.tokens or self.config.auth.tokens_file):
            log.warning("retention_scopes_unauthenticated",
                        detail="retention scopes are claimed by callers (the request's "
                               "scope field), not authenticated, a bearer token sent "
                               "without a scope is refused, engines report without a "
                               "token (any caller may take an engine id over, a few times "
                               "a minute), and Inspect is open: configure auth.tokens or "
                               "auth.tokens_file, and auth.engine_scopes")
        elif self.config.auth.inspect_open:
            log.warning("inspect_open",
                        detail="auth.inspect_open: Inspect and Retention/GetDirectives "
                               "answer callers without a token")

    def _start_task(self, name: str, start: Callable[[], Coroutine[Any, Any, None]]) -> None:
        # Supervised: a task that ends before stop is logged, counted and restarted.
        # Health stays SERVING meanwhile: decisions do not depend on these tasks, and
        # an engine told NOT_SERVING would stop scheduling by them.
        self._tasks.append(asyncio.create_task(supervise(name, start),
                                               name=f"supervise-{name}"))

    async def _forget_departed_engines(self) -> None:
        """Checks a few times per ``engine_forget_after_s``: an engine is forgotten
        at most a quarter of that late."""
        every_s = min(self.config.engine_forget_after_s / 4, 60.0)
        while True:
            await asyncio.sleep(every_s)
            try:
                self.engines.forget_departed()
            except Exception:  # a policy's forget_engine failed: try again next time
                log.exception("forget_engines_failed")

    async def stop(self) -> None:
        """Health first, then drain in-flight calls within the grace, then flush."""
        log.info("daemon_stopping", grace_s=self.config.grace_s)
        await self.health.enter_graceful_shutdown()
        stops = [self.server.stop(self.config.grace_s)]
        if self.inspect_server is not None:
            stops.append(self.inspect_server.stop(self.config.grace_s))
        await asyncio.gather(*stops)
        flushed = await self.recorder.drain(timeout_s=self.config.grace_s)
        if not flushed:
            log.warning("store_writes_unflushed", pending=self.recorder.pending_writes)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.engines.decider.retention is not None:
            await self.engines.decider.retention.directory.close()
        await self.store.close()
        log.info("daemon_stopped")


async def serve(config: DaemonConfig) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully."""
    daemon = await Daemon.build(config)
    try:
        await daemon.start()
    except BaseException:
        await daemon.stop()  # what did start (listeners, the store) ends cleanly
        raise
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    await stopping.wait()
    await daemon.stop()
