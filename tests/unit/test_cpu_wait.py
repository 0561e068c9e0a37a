"""The event-loop thread's wait for a CPU, read from Linux's schedstat."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from sidecar.telemetry.cpu_wait import NAME, CpuWaitWatch, ThreadCpuWait, run_delay_s


def test_run_delay_is_the_second_number_in_seconds(tmp_path: Path) -> None:
    schedstat = tmp_path / "schedstat"
    schedstat.write_text("8214000 1500000000 37\n")
    assert run_delay_s(schedstat) == 1.5


@pytest.mark.parametrize("text", ["8214000\n", "8214000 -1 3\n", "a b c\n"])
def test_a_schedstat_not_as_linux_writes_it_names_the_file(tmp_path: Path, text: str) -> None:
    schedstat = tmp_path / "schedstat"
    schedstat.write_text(text)
    with pytest.raises(ValueError, match="schedstat: expected 3 numbers"):
        run_delay_s(schedstat)


def test_nothing_is_exported_before_a_thread_is_watched() -> None:
    assert list(ThreadCpuWait().collect()) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux schedstat")
def test_the_watched_thread_is_the_one_that_asked() -> None:
    """The daemon watches its event-loop thread: the counter must be that thread's,
    not the scraping thread's (scrapes run on the metrics server's thread)."""
    collector = ThreadCpuWait()
    watcher = threading.Thread(target=collector.watch_current_thread)
    watcher.start()
    watcher.join()
    if collector._schedstat is None:
        pytest.skip("kernel without CONFIG_SCHED_INFO")
    assert collector._schedstat.parent.name == str(watcher.native_id)
    # The thread has ended: the collector exports nothing rather than failing a scrape.
    # join() returns as the thread's Python side finishes; the kernel removes its task
    # a moment later (seen under load in CI), so wait for that first.
    deadline_s = time.monotonic() + 5.0
    while collector._schedstat.exists() and time.monotonic() < deadline_s:
        time.sleep(0.01)
    assert list(collector.collect()) == []

    assert collector.watch_current_thread()
    (family,) = collector.collect()
    assert family.name == NAME
    assert family.samples[0].value >= 0.0


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _watch_file(tmp_path: Path) -> tuple[Path, ThreadCpuWait]:
    schedstat = tmp_path / "schedstat"
    schedstat.write_text("0 0 0\n")
    source = ThreadCpuWait()
    source._schedstat = schedstat  # a thread's file, written by the test
    return schedstat, source


def test_a_starved_event_loop_is_logged_once_per_quiet_period(tmp_path: Path) -> None:
    schedstat, source = _watch_file(tmp_path)
    clock = _Clock()
    watch = CpuWaitWatch(source, warn_share=0.10, quiet_s=600.0, clock=clock)
    with capture_logs() as logs:
        assert watch.check() is None  # the first check only takes a reading
        clock.now_s, _ = 60.0, schedstat.write_text("0 3000000000 0\n")  # 3 s of 60
        assert watch.check() == pytest.approx(0.05)
        assert logs == []
        clock.now_s, _ = 120.0, schedstat.write_text("0 21000000000 0\n")  # 18 s of 60
        assert watch.check() == pytest.approx(0.30)
        clock.now_s, _ = 180.0, schedstat.write_text("0 39000000000 0\n")  # again
        assert watch.check() == pytest.approx(0.30)
    # Once, with the share and what to do: the second is within the quiet period.
    assert [entry["event"] for entry in logs] == ["daemon_cpu_starved"]
    assert logs[0]["log_level"] == "warning"
    assert logs[0]["waited_share"] == 0.3
    assert "CPU request" in logs[0]["detail"]
    clock.now_s, _ = 720.0, schedstat.write_text("0 200000000000 0\n")
    with capture_logs() as later:
        watch.check()
    assert [entry["event"] for entry in later] == ["daemon_cpu_starved"]


def test_a_thread_that_ended_is_not_a_starved_one(tmp_path: Path) -> None:
    schedstat, source = _watch_file(tmp_path)
    clock = _Clock()
    watch = CpuWaitWatch(source, clock=clock)
    watch.check()
    schedstat.unlink()
    clock.now_s = 60.0
    with capture_logs() as logs:
        assert watch.check() is None
    assert logs == []
