"""The engine's link to a real daemon process: deltas after a snapshot, and a daemon
killed and restarted mid-session (the link reconnects and resyncs with a snapshot)."""

from __future__ import annotations

import contextlib
import logging
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from sidecar.api.v1 import engine_session_pb2 as pb
from tests.support.daemon import DaemonProcess, running_daemon
from vllm_plugin.link import DaemonLink
from vllm_plugin.settings import PluginSettings

KV = pb.KvCapacity(total_blocks=64, free_blocks=64, block_size_tokens=16)


def wait_until(condition: Callable[[], object], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def report(seq: int, snapshot: bool = False, *requests: str) -> pb.StepReport:
    return pb.StepReport(
        engine_id="link-engine", seq=seq, snapshot=snapshot, now_s=float(seq), kv=KV,
        new_requests=[pb.NewRequest(request_id=r, job_id=f"job-{r}", arrival_s=float(seq))
                      for r in requests])


def test_link_survives_a_daemon_restart() -> None:
    with running_daemon() as daemon:
        link = DaemonLink(daemon.address)
        try:
            wait_until(lambda: link.connected)
            assert link.needs_snapshot
            assert not link.send(report(1, False, "early")), "a delta before the snapshot"
            assert link.send(report(1, True, "a"))
            (first,) = link.take_decisions(wait_s=2.0)
            assert first.seq == 1 and [p.request_id for p in first.priorities] == ["a"]
            assert link.send(report(2, False, "b"))
            (second,) = link.take_decisions(wait_s=2.0)
            assert second.seq == 2 and not second.resync_requested

            daemon.process.send_signal(signal.SIGKILL)
            daemon.process.wait(timeout=10)
            wait_until(lambda: not link.connected)
            assert link.needs_snapshot
            started = time.monotonic()
            # Nothing can be sent while the daemon is gone, and nothing waits.
            assert not link.send(report(3, True, "a", "b"))
            assert link.take_decisions(wait_s=0.5) == []
            assert time.monotonic() - started < 1.0
        finally:
            port = daemon.address.rsplit(":", 1)[1]
        # The daemon comes back on the same address.
        with running_daemon_on(port) as revived:
            wait_until(lambda: link.connected, timeout_s=15)
            assert link.send(report(10, True, "a", "b"))
            (resumed,) = link.take_decisions(wait_s=2.0)
            assert resumed.seq == 10 and not resumed.resync_requested
            assert {p.request_id for p in resumed.priorities} == {"a", "b"}
            assert link.reconnects >= 1
            link.close()
            del revived


def running_daemon_on(port: str) -> contextlib.AbstractContextManager[DaemonProcess]:
    import subprocess

    from tests.support.daemon import serve_command, wait_serving

    @contextlib.contextmanager
    def run() -> Iterator[DaemonProcess]:
        process = subprocess.Popen(
            serve_command("--listen", f"127.0.0.1:{port}", "--metrics-port", "-1"),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            wait_serving(f"127.0.0.1:{port}", process=process)
            yield DaemonProcess(process, f"127.0.0.1:{port}", -1)
        finally:
            process.terminate()
            process.wait(timeout=10)

    return run()


def test_take_decisions_waits_at_most_the_deadline() -> None:
    with running_daemon() as daemon:
        link = DaemonLink(daemon.address)
        try:
            wait_until(lambda: link.connected)
            daemon.process.send_signal(signal.SIGSTOP)  # frozen: accepts, never answers
            try:
                assert link.send(report(1, True, "a"))
                started = time.monotonic()
                assert link.take_decisions(wait_s=0.05) == []
                assert time.monotonic() - started < 0.5
                assert link.waiting_for_answer
            finally:
                daemon.process.send_signal(signal.SIGCONT)
            # Once thawed, the answer arrives and is taken.
            wait_until(lambda: not link.waiting_for_answer)
            (late,) = link.take_decisions(wait_s=0)
            assert late.seq == 1
        finally:
            link.close()


def test_the_plugin_link_sends_its_token_to_an_auth_enabled_daemon(tmp_path: Path) -> None:
    token = "engine-token-0123456789"
    config = tmp_path / "kvtether.yaml"
    config.write_text(yaml.safe_dump({"auth": {"tokens": {token: "engines"},
                                               "engine_scopes": ["engines"]}}))
    token_file = tmp_path / "engine-token"
    token_file.write_text(token + "\n")  # as a mounted secret often ends
    with running_daemon("--config", str(config)) as daemon:
        settings = PluginSettings.from_env({"KVTETHER_PLUGIN_DAEMON_ADDRESS": daemon.address,
                                            "KVTETHER_PLUGIN_TOKEN_FILE": str(token_file)})
        link = DaemonLink.for_settings(settings)
        try:
            wait_until(lambda: link.connected)
            assert link.send(report(1, True, "a"))
            (first,) = link.take_decisions(wait_s=3.0)
            assert first.seq == 1 and [p.request_id for p in first.priorities] == ["a"]
        finally:
            link.close()
        # Without the token the daemon answers nothing: the engine schedules natively.
        # (Its link is connected only between a channel coming up and the session's
        # refusal, so what it sends is queued or dropped, never answered.)
        anonymous = DaemonLink(daemon.address)
        try:
            wait_until(lambda: anonymous.reconnects >= 1)
            anonymous.send(report(1, True, "a"))
            assert anonymous.take_decisions(wait_s=1.0) == []
        finally:
            anonymous.close()


def test_a_link_the_daemon_refuses_warns_once_and_backs_off(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # An engine without the token it needs: every session is refused at once. The link
    # keeps trying (the token may be fixed, the daemon restarted) but at its backoff's
    # pace, and the engine log says why once, not at every try.
    config = tmp_path / "kvtether.yaml"
    config.write_text(yaml.safe_dump({"auth": {"tokens": {"engine-token-0123456789": "engines"},
                                               "engine_scopes": ["engines"]}}))
    drawn = DrawRecorder(3)
    with running_daemon("--config", str(config)) as daemon, \
            caplog.at_level(logging.WARNING, logger="kvtether.plugin"):
        link = DaemonLink(daemon.address, rng=drawn)
        try:
            time.sleep(2.0)
            reconnects = link.reconnects
        finally:
            link.close()
    refusals = [r.getMessage() for r in caplog.records if "session ended" in r.getMessage()]
    assert len(refusals) == 1 and "UNAUTHENTICATED" in refusals[0]
    # Each wait is drawn from [0, step] of the backoff (0.05, 0.1, 0.25, 0.5, 1 s):
    # about 7 tries in 2 s on average over sources, 16 or more about once in a
    # million; not 40.
    assert 1 <= reconnects <= 16
    assert drawn.ranges[:5] == [(0.0, 0.05), (0.0, 0.1), (0.0, 0.25), (0.0, 0.5),
                                (0.0, 1.0)][:len(drawn.ranges)]
    assert all(high <= 1.0 for _, high in drawn.ranges)


class DrawRecorder(random.Random):
    """A seeded source that keeps the range of each wait the link draws."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.ranges: list[tuple[float, float]] = []

    def uniform(self, a: float, b: float) -> float:
        self.ranges.append((a, b))
        return super().uniform(a, b)
