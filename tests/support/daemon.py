"""Start the real daemon (``kvtether serve``) as a subprocess on free ports."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.redis_server import free_port


@dataclass
class DaemonProcess:
    process: subprocess.Popen[str]
    address: str
    metrics_port: int

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def stop(self, signum: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signum)
        return self.process.wait(timeout=timeout_s)


def wait_serving(address: str, timeout_s: float = 20.0, process: subprocess.Popen[str] | None = None
                 ) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"daemon exited with {process.returncode}: "
                                   f"{process.stderr.read() if process.stderr else ''}")
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon at {address} not serving after {timeout_s} s")
            time.sleep(0.1)


def set_autogroup_nice(pid: int, nice: int) -> None:
    """Weight the autogroup (the session) of ``pid`` for the CPU scheduler, as
    ``/proc/PID/autogroup`` takes it: -20 (the largest share) to 19. Raises OSError
    naming the file where the kernel has no autogroups or refuses the value."""
    path = f"/proc/{pid}/autogroup"
    try:
        with open(path, "w") as autogroup:
            autogroup.write(str(nice))
    except OSError as error:
        raise OSError(f"{path}: cannot set nice {nice} ({error.strerror or error}); "
                      "autogroups need Linux with kernel.sched_autogroup_enabled=1, "
                      "a negative value CAP_SYS_NICE") from error


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "sidecar.cli", "serve", *args]


@contextlib.contextmanager
def running_daemon(*args: str, env: dict[str, str] | None = None) -> Iterator[DaemonProcess]:
    port, metrics_port = free_port(), free_port()
    process = subprocess.Popen(
        serve_command("--listen", f"127.0.0.1:{port}", "--metrics-port", str(metrics_port),
                      *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    daemon = DaemonProcess(process, f"127.0.0.1:{port}", metrics_port)
    try:
        wait_serving(daemon.address, process=process)
        yield daemon
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


class DaemonController:
    """A daemon on a fixed address that tests can stop, kill and restart (another
    policy, same address): the engine's link reconnects to whatever serves there."""

    def __init__(self, *extra_args: str, own_session: bool = False,
                 autogroup_nice: int | None = None) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.extra_args = extra_args
        # Its own session puts the daemon in its own Linux autogroup, which the kernel
        # shares CPU with as it does a container's cgroup: apart from the process that
        # drives the engine, as the engine benchmark runs it.
        self.own_session = own_session
        # The autogroup's nice value, as a container's CPU request weights its cgroup
        # (negative: a larger share; Linux, and privileged below 0). None: unchanged.
        self.autogroup_nice = autogroup_nice
        self.process: subprocess.Popen[str] | None = None
        self.policy = ""
        self.params: tuple[str, ...] = ()

    def start(self, policy: str = "continuum", *params: str) -> None:
        """(Re)start with a policy and its ``KEY=VALUE`` parameters."""
        self.stop()
        self.policy = policy
        self.params = params
        flags = [flag for param in params for flag in ("--param", param)]
        self.process = subprocess.Popen(
            serve_command("--listen", self.address, "--metrics-port", "-1",
                          "--policy", policy, *flags, *self.extra_args),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
            start_new_session=self.own_session)
        if self.autogroup_nice is not None:
            try:
                set_autogroup_nice(self.process.pid, self.autogroup_nice)
            except OSError:
                self.kill()  # not left running unweighted, nor orphaned
                raise
        wait_serving(self.address, process=self.process)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.process = None
