"""The event-loop thread's wait for a CPU, read from Linux's schedstat."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from sidecar.telemetry.cpu_wait import NAME, ThreadCpuWait, run_delay_s


def test_run_delay_is_the_second_number_in_seconds(tmp_path: Path) -> None:
    schedstat = tmp_path / "schedstat"
    schedstat.write_text("8214000 1500000000 37\n")
    assert run_delay_s(schedstat) == 1.5


def test_a_short_schedstat_names_the_file(tmp_path: Path) -> None:
    schedstat = tmp_path / "schedstat"
    schedstat.write_text("8214000\n")
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
    assert list(collector.collect()) == []

    assert collector.watch_current_thread()
    (family,) = collector.collect()
    assert family.name == NAME
    assert family.samples[0].value >= 0.0
