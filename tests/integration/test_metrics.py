"""/metrics after a run: the names and types are pinned (golden file) and the counts
match what happened."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import sidecar
from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import engine_session_pb2_grpc
from tests.support.daemon import running_daemon

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "metrics.txt"
KV = pb.KvCapacity(total_blocks=100, free_blocks=50, block_size_tokens=16)


def scrape(port: int, prefixes: tuple[str, ...] = ("kvtether_",)
           ) -> dict[str, tuple[str, dict[tuple[tuple[str, str], ...], float]]]:
    """The families on /metrics whose names start with one of ``prefixes``: their type,
    and their samples by name and label pairs."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    families = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(prefixes):
            continue
        samples = {
            (sample.name, *sorted(sample.labels.items())): sample.value  # type: ignore[misc]
            for sample in family.samples
        }
        families[family.name] = (family.type, samples)
    return families


def test_metric_names_types_and_counts() -> None:
    with running_daemon("--policy", "continuum") as daemon:
        stub = engine_session_pb2_grpc.EngineSessionStub(daemon.channel())
        stub.Step(pb.StepReport(engine_id="m", seq=1, snapshot=True, now_s=1.0, kv=KV,
                                new_requests=[pb.NewRequest(request_id="a", job_id="j",
                                                            arrival_s=1.0)]))
        stub.Step(pb.StepReport(engine_id="m", seq=2, now_s=2.0, kv=KV, events=[
            pb.RequestEvent(request_id="a", kind=pb.EVENT_KIND_ADMITTED, at_s=2.0)]))
        stub.Step(pb.StepReport(engine_id="m", seq=3, now_s=3.0, kv=KV, events=[
            pb.RequestEvent(request_id="a", kind=pb.EVENT_KIND_FINISHED, at_s=3.0, tool="ls",
                            blocks=4, finish_reason=pb.FINISH_REASON_STOP)]))
        # A gap: asks for a resync.
        stub.Step(pb.StepReport(engine_id="m", seq=9, now_s=4.0, kv=KV))
        # The daemon's own series and its gRPC server's (the standard process_* and
        # python_* ones vary with the platform: tests/integration/test_metric_types.py).
        families = scrape(daemon.metrics_port, ("kvtether_", "grpc_server_"))

    observed = sorted(f"{name} {kind}" for name, (kind, _) in families.items())
    golden = GOLDEN.read_text().split("\n")
    assert observed == [line for line in golden if line], (
        "metric names or types changed; update tests/golden/metrics.txt deliberately")

    def value(name: str, *labels: tuple[str, str]) -> float:
        family = name.removesuffix("_total").removesuffix("_count")
        return families[family][1][(name, *labels)]

    assert value("kvtether_step_reports_total") == 4
    assert value("kvtether_snapshots_total") == 1
    # What drove the reports: the snapshot carried the new request, two carried events,
    # the gapped one nothing.
    carried = {labels[0][1]: count for (name, *labels), count in
               families["kvtether_step_report_contents"][1].items()}
    assert carried == {"snapshot": 1, "new_requests": 1, "events": 2, "clock": 1}
    assert value("kvtether_resyncs_requested_total") == 1
    assert value("kvtether_decisions_total", ("kind", "pin")) == 1
    assert value("kvtether_pins_active") == 1
    assert value("kvtether_pinned_blocks") == 4
    # Every decided report (not the resync) went through the latency histogram.
    assert value("kvtether_decision_latency_seconds_count") == 3
    # The daemon runs this tree on this interpreter: one build series, set to 1.
    assert families["kvtether_build_info"][1] == {
        ("kvtether_build_info", ("python", platform.python_version()),
         ("version", sidecar.__version__)): 1.0}


def _cpu_wait_s(port: int) -> float:
    return scrape(port)["kvtether_event_loop_cpu_wait_seconds"][1][
        ("kvtether_event_loop_cpu_wait_seconds_total",)]


def _report_for(daemon_stub: engine_session_pb2_grpc.EngineSessionStub, seconds: float
                ) -> int:
    """Step reports back to back for ``seconds``, as an engine stepping fast sends them."""
    reports, seq, started = 0, 100, time.monotonic()
    while time.monotonic() - started < seconds:
        seq += 1
        daemon_stub.Step(pb.StepReport(engine_id="busy", seq=seq, snapshot=True,
                                       now_s=float(seq), kv=KV))
        reports += 1
    return reports


def _loop_thread_wait_s(pid: int) -> float:
    """The daemon's main thread (its event loop: ``asyncio.run`` in ``kvtether serve``)
    run-queue wait, read by this process from /proc."""
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[1]) / 1e9


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="Linux schedstat")
def test_cpu_wait_is_the_event_loops_and_grows_when_starved() -> None:
    """The counter is the event-loop thread's run-queue wait, as /proc reads it from
    outside the daemon at the same moment; with more busy processes than cores it grows
    by more than 10 ms in 1.5 s of reports (a starved thread waits tenths of a second),
    and never by more than the time that passed."""
    hogs_count = 2 * (os.cpu_count() or 1) + 1
    with running_daemon("--policy", "fcfs") as daemon:
        pid = daemon.process.pid
        stub = engine_session_pb2_grpc.EngineSessionStub(daemon.channel())
        _report_for(stub, 0.3)
        for _ in range(3):
            low_s = _loop_thread_wait_s(pid)
            exported_s = _cpu_wait_s(daemon.metrics_port)
            high_s = _loop_thread_wait_s(pid)
            assert low_s <= exported_s <= high_s
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(hogs_count)]
        try:
            before_s = _cpu_wait_s(daemon.metrics_port)
            started = time.monotonic()
            _report_for(stub, 1.5)
            waited_s = _cpu_wait_s(daemon.metrics_port) - before_s
            elapsed_s = time.monotonic() - started
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
    assert 0.01 < waited_s < elapsed_s, (waited_s, elapsed_s)


def test_an_engine_that_left_is_forgotten_with_its_series() -> None:
    """A real daemon, told to forget engines gone for 2 s: an engine's session series
    go when its stream ends, what was learned of it (its step cost) once it has been
    gone that long."""
    import random
    import threading

    from tests.unit.test_step_cost import reports

    def engine_series(port: int) -> set[str]:
        return {name for _family, (_kind, samples) in scrape(port).items()
                for (name, *labels) in samples if ("engine_id", "pod-a") in labels}

    works = reports(random.Random(3), 200)
    stream_may_end = threading.Event()

    def session() -> Iterator[pb.StepReport]:
        for seq, work in enumerate(works, start=1):
            yield pb.StepReport(
                engine_id="pod-a", seq=seq, snapshot=seq == 1, now_s=0.05 * seq, kv=KV,
                work=pb.StepWork(steps=work.steps, busy_s=work.busy_s,
                                 prefill_tokens=work.prefill_tokens,
                                 decode_seqs=work.decode_seqs),
                counters=pb.EngineCounters(fallback_steps=1, answers_by_lag_steps=[0, seq]))
        stream_may_end.wait(10)

    with running_daemon("--policy", "adaptive",
                        env={"KVTETHER_ENGINE_FORGET_AFTER_S": "2"}) as daemon:
        stub = engine_session_pb2_grpc.EngineSessionStub(daemon.channel())
        answers = stub.Session(session())
        for _work, _answer in zip(works, answers, strict=False):  # works first: it
            pass  # ends there, not waiting on a 201st answer
        connected = engine_series(daemon.metrics_port)
        stream_may_end.set()
        assert list(answers) == []
        left_at = time.monotonic()
        learned = {"kvtether_engine_prefill_seconds_per_token", "kvtether_engine_step_seconds",
                   "kvtether_engine_decode_seconds_per_request", "kvtether_engine_steps_total"}
        assert connected == learned | {"kvtether_engine_fallback_steps_total",
                                       "kvtether_engine_answer_lag_steps_bucket",
                                       "kvtether_engine_answer_lag_steps_count",
                                       "kvtether_engine_idle_waits_total",
                                       "kvtether_engine_idle_waits_missed_total",
                                       "kvtether_engine_kv_hint_actions_ignored_total",
                                       "kvtether_engine_kv_hint_fields_refused_total",
                                       "kvtether_engine_finished_turns_cached",
                                       "kvtether_engine_late_answer_ratio",
                                       "kvtether_engine_prefill_time_ratio",
                                       "kvtether_engine_provisional_block_seconds_total"}
        after_leaving = engine_series(daemon.metrics_port)
        while engine_series(daemon.metrics_port) and time.monotonic() - left_at < 10:
            time.sleep(0.05)
        forgotten_after_s = time.monotonic() - left_at
        assert not engine_series(daemon.metrics_port)
    assert after_leaving == learned, "the session's series went with it, the cost stayed"
    assert 2.0 <= forgotten_after_s < 4.0, "forgotten 2 s after leaving, checked every 0.5 s"
