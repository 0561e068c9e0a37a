"""TLS, mutual TLS, a separate Inspect port, rate limits and secrets kept out of logs,
each with its refusal — on real daemon processes and real gRPC clients."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from sidecar.api.credentials import channel_credentials
from sidecar.api.v1 import (
    engine_session_pb2,
    engine_session_pb2_grpc,
    inspect_pb2,
    inspect_pb2_grpc,
    retention_pb2,
    retention_pb2_grpc,
)
from tests.integration.test_daemon_process import GRPCURL
from tests.support.certs import CertificateAuthority, Issued
from tests.support.daemon import DaemonProcess, running_daemon
from tests.support.redis_server import redis_binary
from vllm_plugin.link import DaemonLink

ENGINE_TOKEN = "engine-token-0123456789"
ORCHESTRATOR_TOKEN = "orchestrator-token-0123456789"
ENGINE_AUTH = {"auth": {"tokens": {ENGINE_TOKEN: "engines", ORCHESTRATOR_TOKEN: "dynamo"},
                        "engine_scopes": ["engines"]}}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Issued]:
    directory = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority(directory, "kvtether-test-ca")
    rogue = CertificateAuthority(directory, "rogue-ca")
    return {
        "ca": ca.issued,
        "server": ca.issue("daemon", "kvtether-daemon", server=True),
        "client": ca.issue("engine", "vllm-engine-0", server=False),
        "rogue_client": rogue.issue("intruder", "intruder", server=False),
    }


def daemon_with(
        tmp_path: Path, settings: dict[str, object],
        *args: str) -> contextlib.AbstractContextManager[DaemonProcess]:
    config = tmp_path / "kvtether.yaml"
    config.write_text(yaml.safe_dump(settings))
    return running_daemon("--config", str(config), *args)


def policy_over(address: str, credentials: grpc.ChannelCredentials | None) -> str:
    channel = (grpc.insecure_channel(address) if credentials is None
               else grpc.secure_channel(address, credentials))
    with channel:
        stub = inspect_pb2_grpc.InspectStub(channel)
        return str(stub.GetPolicy(inspect_pb2.GetPolicyRequest(), timeout=3).name)


def refused(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        policy_over(address, credentials)
    return error.value.code()  # type: ignore[no-any-return]


@pytest.fixture
def tls_daemon(tmp_path: Path, pki: dict[str, Issued]) -> Iterator[DaemonProcess]:
    # running_daemon waits for health over plaintext; with TLS it cannot, so this
    # starts the process itself and waits over TLS.
    from tests.support.daemon import serve_command
    from tests.support.redis_server import free_port

    port = free_port()
    config = tmp_path / "tls.yaml"
    config.write_text(yaml.safe_dump({"tls": {"cert_file": str(pki["server"].cert),
                                              "key_file": str(pki["server"].key),
                                              "client_ca_file": str(pki["ca"].cert)}}))
    process = subprocess.Popen(
        serve_command("--config", str(config), "--listen", f"127.0.0.1:{port}",
                      "--metrics-port", "-1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    good = channel_credentials(str(pki["ca"].cert), str(pki["client"].cert),
                               str(pki["client"].key))
    deadline = time.monotonic() + 20
    while True:
        try:
            policy_over(f"127.0.0.1:{port}", good)
            break
        except grpc.RpcError:
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline, "mTLS daemon did not come up"
            time.sleep(0.1)
    yield DaemonProcess(process, f"127.0.0.1:{port}", -1)
    process.terminate()
    process.wait(timeout=10)


def test_mutual_tls_admits_only_clients_of_its_ca(
        tls_daemon: DaemonProcess, pki: dict[str, Issued]) -> None:
    address = tls_daemon.address
    ca = str(pki["ca"].cert)
    assert policy_over(address, channel_credentials(
        ca, str(pki["client"].cert), str(pki["client"].key))) == "continuum"
    # Plaintext, TLS without a client certificate, and a certificate from another CA
    # are all refused before any RPC runs.
    assert refused(address, None) == grpc.StatusCode.UNAVAILABLE
    assert refused(address, channel_credentials(ca)) == grpc.StatusCode.UNAVAILABLE
    assert refused(address, channel_credentials(
        ca, str(pki["rogue_client"].cert), str(pki["rogue_client"].key))
    ) == grpc.StatusCode.UNAVAILABLE


def test_engine_link_and_operators_tools_speak_mutual_tls(
        tls_daemon: DaemonProcess, pki: dict[str, Issued]) -> None:
    credentials = channel_credentials(str(pki["ca"].cert), str(pki["client"].cert),
                                      str(pki["client"].key))
    link = DaemonLink(tls_daemon.address, credentials=credentials)
    try:
        deadline = time.monotonic() + 10
        while not link.connected:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        report = engine_session_pb2.StepReport(engine_id="tls-engine", seq=1, snapshot=True,
                                               now_s=1.0)
        assert link.send(report)
        (decision,) = link.take_decisions(wait_s=3)
        assert decision.seq == 1 and not decision.resync_requested
    finally:
        link.close()
    listed = subprocess.run(
        [GRPCURL, "-cacert", str(pki["ca"].cert), "-cert", str(pki["client"].cert),
         "-key", str(pki["client"].key), tls_daemon.address, "list"],
        capture_output=True, text=True, timeout=30)
    assert listed.returncode == 0 and "kvtether.v1.EngineSession" in listed.stdout
    shown = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "inspect", "--address", tls_daemon.address,
         "--tls-ca", str(pki["ca"].cert), "--tls-cert", str(pki["client"].cert),
         "--tls-key", str(pki["client"].key), "--json", "policy"],
        capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["name"] == "continuum"


def test_bad_tls_configuration_stops_the_daemon(tmp_path: Path, pki: dict[str, Issued]) -> None:
    from tests.support.daemon import serve_command

    for tls, expected in (
        ({"cert_file": str(pki["server"].cert)}, "set both cert_file and key_file"),
        ({"cert_file": str(tmp_path / "missing.crt"), "key_file": str(pki["server"].key)},
         "cannot read"),
        ({"client_ca_file": str(pki["ca"].cert)}, "needs cert_file"),
    ):
        config = tmp_path / "bad.yaml"
        config.write_text(yaml.safe_dump({"tls": tls}))
        done = subprocess.run(serve_command("--config", str(config), "--metrics-port", "-1"),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and expected in done.stderr, done.stderr


def test_inspect_on_its_own_port_only(tmp_path: Path) -> None:
    from tests.support.redis_server import free_port

    inspect_port = free_port()
    with daemon_with(tmp_path, {"listen": {"inspect_tcp": f"127.0.0.1:{inspect_port}"}}) as d:
        inspect_address = f"127.0.0.1:{inspect_port}"
        assert policy_over(inspect_address, None) == "continuum"
        assert refused(d.address, None) == grpc.StatusCode.UNIMPLEMENTED
        main = subprocess.run([GRPCURL, "-plaintext", d.address, "list"],
                              capture_output=True, text=True, timeout=30).stdout.split()
        side = subprocess.run([GRPCURL, "-plaintext", inspect_address, "list"],
                              capture_output=True, text=True, timeout=30).stdout.split()
        assert "kvtether.v1.Inspect" not in main and "kvtether.v1.EngineSession" in main
        assert "kvtether.v1.Inspect" in side and "kvtether.v1.EngineSession" not in side
        assert "kvtether.v1.Retention" not in side  # nothing that mutates state


def test_retention_rate_limit_per_scope(tmp_path: Path) -> None:
    settings = {"auth": {"tokens": {"token-aaaaaaaaaaaaaaaa": "orchestrator-a",
                                    "token-bbbbbbbbbbbbbbbb": "orchestrator-b",
                                    ENGINE_TOKEN: "engines"},
                         "engine_scopes": ["engines"]},
                "limits": {"retention_calls_per_s": 1, "retention_burst": 3}}
    with daemon_with(tmp_path, settings) as daemon, grpc.insecure_channel(
            daemon.address) as channel:
        stub = retention_pb2_grpc.RetentionStub(channel)
        target = retention_pb2.RetentionTarget(session_id="limited")

        def read(token: str) -> grpc.StatusCode:
            try:
                stub.GetDirectives(retention_pb2.GetDirectivesRequest(target=target),
                                   metadata=[("authorization", f"Bearer {token}")], timeout=3)
                return grpc.StatusCode.OK
            except grpc.RpcError as error:
                return error.code()  # type: ignore[no-any-return]

        codes = [read("token-aaaaaaaaaaaaaaaa") for _ in range(5)]
        assert codes[:3] == [grpc.StatusCode.OK] * 3
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes[3:]
        # Another scope has its own budget.
        assert read("token-bbbbbbbbbbbbbbbb") == grpc.StatusCode.OK


def test_secrets_stay_out_of_logs(tmp_path: Path) -> None:
    password, token = "redis-s3cret-pw", "bearer-t0ken-value-0123456789"
    with redis_binary(extra_args=("--requirepass", password)) as (url, _process):
        secured = url.replace("redis://", f"redis://:{password}@")
        settings = {"store": {"redis_url": secured},
                    "auth": {"tokens": {token: "dynamo", ENGINE_TOKEN: "engines"},
                             "engine_scopes": ["engines"]}}
        with daemon_with(tmp_path, settings, "--log-level", "debug") as daemon:
            with grpc.insecure_channel(daemon.address) as channel:
                stub = retention_pb2_grpc.RetentionStub(channel)
                with pytest.raises(grpc.RpcError):
                    stub.ClearDirectives(retention_pb2.ClearDirectivesRequest(
                        target=retention_pb2.RetentionTarget(job_id="j")),
                        metadata=[("authorization", "Bearer wrong-token-0123456789")], timeout=3)
            daemon.stop()
            logs = daemon.process.stderr.read() if daemon.process.stderr else ""
    assert "daemon_serving" in logs and "dynamo" in logs
    assert password not in logs and token not in logs and "wrong-token" not in logs


def engine_call_code(channel: grpc.Channel, method: str, token: str | None) -> grpc.StatusCode:
    stub = engine_session_pb2_grpc.EngineSessionStub(channel)
    metadata = None if token is None else [("authorization", f"Bearer {token}")]
    report = engine_session_pb2.StepReport(engine_id=f"{method}-{token}", seq=1, snapshot=True,
                                           now_s=1.0)
    try:
        if method == "Step":
            stub.Step(report, metadata=metadata, timeout=5)
        else:
            (decision,) = stub.Session(iter([report]), metadata=metadata, timeout=5)
            assert decision.seq == 1 and not decision.resync_requested
        return grpc.StatusCode.OK
    except grpc.RpcError as error:
        return error.code()  # type: ignore[no-any-return]


def test_engine_session_needs_a_token_of_an_engine_scope(tmp_path: Path) -> None:
    with daemon_with(tmp_path, ENGINE_AUTH) as daemon, daemon.channel() as channel:
        for method in ("Session", "Step"):
            assert engine_call_code(channel, method, None) == grpc.StatusCode.UNAUTHENTICATED
            assert engine_call_code(channel, method, "not-a-token-0123456789") == (
                grpc.StatusCode.UNAUTHENTICATED)
            assert engine_call_code(channel, method, ORCHESTRATOR_TOKEN) == (
                grpc.StatusCode.PERMISSION_DENIED)
            assert engine_call_code(channel, method, ENGINE_TOKEN) == grpc.StatusCode.OK
        with pytest.raises(grpc.RpcError) as refused:
            engine_session_pb2_grpc.EngineSessionStub(channel).Step(
                engine_session_pb2.StepReport(engine_id="e", seq=1, snapshot=True),
                metadata=[("authorization", f"Bearer {ORCHESTRATOR_TOKEN}")], timeout=5)
        assert refused.value.details() == (
            "scope 'dynamo' may not report engine steps: auth.engine_scopes lists ['engines']")


def test_an_engine_scope_without_a_token_stops_the_daemon(tmp_path: Path) -> None:
    from tests.support.daemon import serve_command

    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"auth": {"tokens": {ENGINE_TOKEN: "engines"},
                                               "engine_scopes": ["engines", "gpu-pool"]}}))
    done = subprocess.run(serve_command("--config", str(config), "--metrics-port", "-1"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "auth: engine_scopes: scope 'gpu-pool' has no token" in done.stderr, done.stderr


def retention_reads_over_connections(address: str, connections: int, calls_each: int,
                                     token: str | None = None) -> dict[grpc.StatusCode, int]:
    """Each connection its own (no shared subchannel): a new client port each time."""
    codes: dict[grpc.StatusCode, int] = {}
    metadata = None if token is None else [("authorization", f"Bearer {token}")]
    request = retention_pb2.GetDirectivesRequest(
        target=retention_pb2.RetentionTarget(session_id="limited"))
    for _ in range(connections):
        with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]
                                   ) as channel:
            stub = retention_pb2_grpc.RetentionStub(channel)
            for _ in range(calls_each):
                try:
                    stub.GetDirectives(request, metadata=metadata, timeout=5)
                    code = grpc.StatusCode.OK
                except grpc.RpcError as error:
                    code = error.code()
                codes[code] = codes.get(code, 0) + 1
    return codes


def test_anonymous_rate_limit_holds_across_connections(tmp_path: Path) -> None:
    rate_per_s, burst = 5, 10
    with daemon_with(tmp_path, {"limits": {"retention_calls_per_s": rate_per_s,
                                           "retention_burst": burst}}) as daemon:
        started = time.monotonic()
        codes = retention_reads_over_connections(daemon.address, 50, 10)
        elapsed_s = time.monotonic() - started
    assert sum(codes.values()) == 500
    accepted = codes.get(grpc.StatusCode.OK, 0)
    assert accepted <= burst + rate_per_s * elapsed_s + 5, (codes, elapsed_s)
    assert codes[grpc.StatusCode.RESOURCE_EXHAUSTED] == 500 - accepted


def test_bad_tokens_are_limited_by_address_before_the_service_runs(
        tmp_path: Path) -> None:
    rate_per_s, burst = 5, 10
    settings = {**ENGINE_AUTH, "limits": {"retention_calls_per_s": rate_per_s,
                                          "retention_burst": burst}}
    with daemon_with(tmp_path, settings) as daemon:
        started = time.monotonic()
        # Reads need no token; a caller whose token is not valid is keyed by its address.
        codes = retention_reads_over_connections(daemon.address, 20, 10, "wrong-0123456789abc")
        elapsed_s = time.monotonic() - started
        # A valid token is its own caller, whatever the address.
        assert retention_reads_over_connections(daemon.address, 1, 1, ORCHESTRATOR_TOKEN) == {
            grpc.StatusCode.OK: 1}
    assert codes.get(grpc.StatusCode.OK, 0) <= burst + rate_per_s * elapsed_s + 5, codes
    assert codes[grpc.StatusCode.RESOURCE_EXHAUSTED] >= 100, codes
