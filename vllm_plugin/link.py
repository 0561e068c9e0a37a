"""The engine's link to the daemon: one Session stream, run on a background thread.

The engine thread only ever touches three methods, none of which blocks for long:
``send(report, finish)`` (enqueue), ``take_decisions(wait_s)`` (the decisions that
arrived, waiting at most ``wait_s`` for the answer to the newest report) and
``needs_snapshot`` (the next report must carry the whole state). Everything on the
network — connecting, reconnecting with backoff, reading answers — happens on the
link's own thread, so a slow, frozen or dead daemon costs the engine at most the
wait it chose. ``finish`` completes a report there too, just before it goes out:
work the engine thread hands off (the waiting-demand count), done while the engine
waits on its workers with the GIL released.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import grpc

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import engine_session_pb2_grpc
from vllm_plugin.settings import PluginSettings

logger = logging.getLogger("kvtether.plugin")

_CLOSE = object()
# Reconnect backoff: quick at first (a daemon restart takes ~1 s), capped low so
# the engine is back on policy soon after the daemon returns. Each wait is drawn
# with "full jitter" (AWS, "Exponential Backoff And Jitter"): uniform in [0, step].
# Every engine of a restarted daemon loses its stream at the same instant; with
# fixed waits they would all come back together, each with a full snapshot. Full
# jitter spreads them over the whole step and never waits longer than the step.
# Not equal jitter: it keeps half of each wait fixed, half the spread. Not
# decorrelated jitter (min(cap, uniform(base, 3 x previous wait))): once at the
# 1 s cap, about two waits in three are exactly 1 s, in lockstep again.
_BACKOFF_S = (0.05, 0.1, 0.25, 0.5, 1.0)
# Reports queued while disconnected are dropped: the reconnect starts with a snapshot.
_MAX_QUEUED_REPORTS = 1024

# Completes a report on the link's thread, just before it is sent.
Finish = Callable[[pb.StepReport], None]


class DaemonLink:
    def __init__(self, address: str, connect: bool = True,
                 credentials: grpc.ChannelCredentials | None = None,
                 server_name: str = "", token: str = "",
                 rng: random.Random | None = None) -> None:
        self.address = address
        # The reconnect jitter's source. Each link seeds its own from the OS, so two
        # engines (or two links of one process) never draw the same waits; tests
        # pass a seeded one.
        self._rng = rng if rng is not None else random.Random()
        # TLS (or mutual TLS) to the daemon; None: plaintext (loopback, Unix socket).
        self._credentials = credentials
        self._server_name = server_name
        # The engine's bearer token, sent with every stream; empty: none (auth off).
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        # One outbox per connection: a stream that ended must not consume reports
        # meant for its successor (gRPC may still be draining its request iterator).
        self._outbox: queue.Queue[object] = queue.Queue(_MAX_QUEUED_REPORTS)
        self._decisions: deque[pb.StepDecision] = deque()
        self._answered = threading.Condition()
        self._last_answered_seq = 0
        self._last_sent_seq = 0
        self._snapshot_needed = threading.Event()
        self._snapshot_needed.set()
        self._connected = threading.Event()
        self._closing = threading.Event()
        self.reconnects = 0
        # Reports whose ``finish`` raised (sent without what it adds); the first is logged.
        self.finish_errors = 0
        self._thread = threading.Thread(target=self._run, name="kvtether-link", daemon=True)
        if connect:
            self._thread.start()

    @classmethod
    def for_settings(cls, settings: PluginSettings) -> DaemonLink:
        """The link the plugin's settings describe (address, TLS, token), connecting."""
        credentials = None
        if settings.tls:
            from sidecar.api.credentials import channel_credentials

            credentials = channel_credentials(settings.tls_ca_file, settings.tls_cert_file,
                                              settings.tls_key_file)
        return cls(settings.daemon_address, credentials=credentials,
                   server_name=settings.tls_server_name, token=settings.token)

    # --- engine thread ------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def needs_snapshot(self) -> bool:
        return self._snapshot_needed.is_set()

    def send(self, report: pb.StepReport, finish: Finish | None = None) -> bool:
        """Queue a report; False (and nothing queued) when the daemon is not connected
        or the next report must be a snapshot and this one is not. ``finish(report)``
        runs on the link's side (gRPC's thread that writes the stream) just before the
        report goes out; the engine thread must not change the report after this
        (reading it is safe: each protobuf call holds the GIL). A ``finish`` that
        raises is logged and the report goes out as it is."""
        if not self._connected.is_set():
            return False
        if self._snapshot_needed.is_set():
            if not report.snapshot:
                return False
            self._snapshot_needed.clear()
        try:
            self._outbox.put_nowait((report, finish))
        except queue.Full:
            self._snapshot_needed.set()
            return False
        self._last_sent_seq = report.seq
        return True

    def take_decisions(self, wait_s: float) -> list[pb.StepDecision]:
        """Decisions received since the last call, oldest first. Waits at most
        ``wait_s`` for the answer to the newest report sent."""
        with self._answered:
            if wait_s > 0 and self._last_answered_seq < self._last_sent_seq:
                self._answered.wait_for(
                    lambda: self._last_answered_seq >= self._last_sent_seq
                    or not self._connected.is_set(),
                    timeout=wait_s,
                )
            taken = list(self._decisions)
            self._decisions.clear()
        return taken

    @property
    def waiting_for_answer(self) -> bool:
        return self._last_answered_seq < self._last_sent_seq

    def reconnect_delay_s(self, attempt: int) -> float:
        """Seconds to wait before reconnect ``attempt`` (0: the first after a session
        ended or a connect failed): uniform in [0, the backoff's step], never more
        than its last step (1 s)."""
        step_s = _BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)]
        return self._rng.uniform(0.0, step_s)

    def close(self) -> None:
        self._closing.set()
        self._end_outbox()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    # --- link thread --------------------------------------------------------------
    def _reports(self, outbox: queue.Queue[object]) -> Iterator[pb.StepReport]:
        while True:
            item = outbox.get()
            if item is _CLOSE:
                return
            assert isinstance(item, tuple)
            report: pb.StepReport = item[0]
            finish: Finish | None = item[1]
            if finish is not None:
                try:
                    finish(report)
                except Exception:  # raised out of this iterator, it would end the stream
                    self.finish_errors += 1
                    if self.finish_errors == 1:
                        logger.warning("kvtether: a report went out unfinished",
                                       exc_info=True)
            yield report

    def _run(self) -> None:
        attempt = 0
        ended: str | None = None  # how the last session ended, as logged
        while not self._closing.is_set():
            options: list[tuple[str, object]] = [
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_timeout_ms", 5_000),
                ("grpc.keepalive_permit_without_calls", 1),
            ]
            if self._credentials is None:
                channel = grpc.insecure_channel(self.address, options=options)
            else:
                if self._server_name:
                    options.append(("grpc.ssl_target_name_override", self._server_name))
                channel = grpc.secure_channel(self.address, self._credentials, options=options)
            try:
                grpc.channel_ready_future(channel).result(timeout=1.0)
                stub = engine_session_pb2_grpc.EngineSessionStub(channel)
                outbox: queue.Queue[object] = queue.Queue(_MAX_QUEUED_REPORTS)
                self._outbox = outbox
                self._snapshot_needed.set()
                self._connected.set()
                if attempt or self.reconnects:
                    logger.info("kvtether: connected to daemon at %s", self.address)
                for decision in stub.Session(self._reports(outbox), metadata=self._metadata):
                    # Answered: the daemon takes this engine, so the next reconnect
                    # starts quick again and a new failure is worth a warning.
                    attempt = 0
                    ended = None
                    self._receive(decision)
                if self._closing.is_set():
                    return
            except grpc.FutureTimeoutError:
                pass
            except grpc.RpcError as error:
                if not self._closing.is_set():
                    # A daemon that refuses every session (a bad token, a bad report)
                    # would otherwise log the same line at each reconnect.
                    described = _describe(error)
                    if described != ended:
                        logger.warning("kvtether: daemon session ended: %s", described)
                    ended = described
            finally:
                self._disconnect()
                self._end_outbox()  # ends this connection's request iterator
                channel.close()
            if self._closing.is_set():
                return
            self.reconnects += 1
            time.sleep(self.reconnect_delay_s(attempt))
            attempt += 1

    def _end_outbox(self) -> None:
        with contextlib.suppress(queue.Full):
            self._outbox.put_nowait(_CLOSE)

    def _receive(self, decision: pb.StepDecision) -> None:
        if decision.resync_requested:
            self._snapshot_needed.set()
        with self._answered:
            self._decisions.append(decision)
            self._last_answered_seq = max(self._last_answered_seq, decision.seq)
            self._answered.notify_all()

    def _disconnect(self) -> None:
        self._connected.clear()
        self._snapshot_needed.set()
        with self._answered:
            # Nothing sent before the break will be answered.
            self._last_answered_seq = self._last_sent_seq = 0
            self._answered.notify_all()


def _describe(error: grpc.RpcError) -> str:
    code = getattr(error, "code", lambda: None)()
    details = getattr(error, "details", lambda: "")()
    return f"{getattr(code, 'name', code)}: {details}"
