"""The real policy daemon (``kvtether serve``) as a subprocess on a private Unix socket."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Daemon:
    address: str  # for KVTETHER_PLUGIN_DAEMON_ADDRESS
    process: subprocess.Popen[bytes]
    log_path: Path


def _wait_serving(address: str, process: subprocess.Popen[bytes], log_path: Path,
                  timeout_s: float = 60.0) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"kvtether serve exited with {process.returncode}:\n"
                                   + log_path.read_text()[-4000:])
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvtether serve not serving at {address} "
                                   f"after {timeout_s:g} s")
            time.sleep(0.1)


@contextlib.contextmanager
def running_daemon(policy: str, params: Sequence[str] = ()) -> Iterator[Daemon]:
    """``kvtether serve --policy POLICY`` on the embedded store, gRPC on a Unix socket
    only (no TCP port, no metrics port), logs to a file kept until it stops."""
    with tempfile.TemporaryDirectory(prefix="kvtether-twin-") as tmp:
        socket_path = Path(tmp) / "daemon.sock"
        log_path = Path(tmp) / "daemon.log"
        command = [sys.executable, "-m", "sidecar.cli", "serve", "--policy", policy,
                   "--listen", "", "--unix-socket", str(socket_path), "--metrics-port", "-1",
                   "--log-level", "warning"]
        for param in params:
            command += ["--param", param]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, "PYTHONHASHSEED": "0"})
        address = f"unix:{socket_path}"
        try:
            _wait_serving(address, process, log_path)
            yield Daemon(address, process, log_path)
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=5)


def learned_step_costs(address: str) -> list[dict[str, Any]]:
    """The step costs the daemon learned (Inspect.GetPolicy), as an operator reads them."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from sidecar.api.v1 import inspect_pb2, inspect_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        answer = inspect_pb2_grpc.InspectStub(channel).GetPolicy(
            inspect_pb2.GetPolicyRequest(), timeout=10)
    return [MessageToDict(cost, preserving_proto_field_name=True)
            for cost in answer.engine_costs]
