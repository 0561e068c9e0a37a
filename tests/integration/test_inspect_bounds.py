"""Inspection never holds decisions back and never grows with its callers: against a
real daemon process whose engines hold thousands of pins.

- ListJobs, ListPins and GetToolStats are paged, with a capped limit, and a step
  report sent while the largest ListJobs page is built is answered at once.
- WatchDecisions streams are capped, and a watcher that does not read is dropped
  instead of slowing every decision.
- ListJobs lists what a user expects: the most recently active jobs first, finished
  ones included, however many anonymous requests passed since.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import engine_session_pb2_grpc, inspect_pb2, inspect_pb2_grpc
from tests.support.daemon import DaemonProcess, running_daemon

KV = pb.KvCapacity(total_blocks=1_000_000, free_blocks=900_000, block_size_tokens=16)
ENGINES = 4
PINS_PER_ENGINE = 1500
MAX_LIMIT = 1000
# A step answered later than this waited on inspection: unloaded it takes milliseconds,
# and building the largest ListJobs page in one go takes tens of seconds with this many
# pins.
STEP_BOUND_S = 1.0


def _loaded_engine(stub: engine_session_pb2_grpc.EngineSessionStub, engine_id: str,
                   pins: int) -> None:
    """A snapshot: ``pins`` running requests, one job each, and a pin for each job."""
    report = pb.StepReport(engine_id=engine_id, seq=1, snapshot=True, now_s=1.0, kv=KV)
    for index in range(pins):
        job_id = f"{engine_id}/job{index}"
        report.new_requests.append(pb.NewRequest(
            request_id=f"{engine_id}/run{index}", job_id=job_id, arrival_s=0.5 + index * 1e-4,
            prompt_tokens=600, state=pb.REQUEST_STATE_RUNNING, computed_tokens=600))
        report.pins.append(pb.PinState(
            request_id=f"{engine_id}/pin{index}", job_id=job_id, blocks=40,
            pinned_at_s=0.5, expires_at_s=1e9, tool="pytest"))
    stub.Step(report, timeout=30)


def _turns(stub: engine_session_pb2_grpc.EngineSessionStub, engine_id: str, first_seq: int,
           turns: list[tuple[str, str, bool]]) -> int:
    """Each (request id, job id, is_last_step) arrives in one report and finishes in the
    next; returns the next free seq."""
    seq = first_seq
    for request_id, job_id, last in turns:
        now_s = 1.0 + seq * 0.01
        stub.Step(pb.StepReport(engine_id=engine_id, seq=seq, now_s=now_s, kv=KV, new_requests=[
            pb.NewRequest(request_id=request_id, job_id=job_id, arrival_s=now_s,
                          prompt_tokens=100, is_last_step=last)]), timeout=10)
        stub.Step(pb.StepReport(engine_id=engine_id, seq=seq + 1, now_s=now_s + 0.005, kv=KV,
                                events=[pb.RequestEvent(
                                    request_id=request_id, kind=pb.EVENT_KIND_FINISHED,
                                    at_s=now_s + 0.005, finish_reason=pb.FINISH_REASON_STOP,
                                    output_tokens=10, blocks=8)]), timeout=10)
        seq += 2
    return seq


def _pin_pages(inspect: inspect_pb2_grpc.InspectStub, limit: int
               ) -> Iterator[inspect_pb2.ListPinsResponse]:
    """Every page of ListPins, following the page tokens."""
    token = ""
    while True:
        page = inspect.ListPins(inspect_pb2.ListPinsRequest(limit=limit, page_token=token),
                                timeout=30)
        yield page
        token = page.next_page_token
        if not token:
            return


def _metric(daemon: DaemonProcess, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics",
                                  timeout=10).read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.split("{")[0].split(" ")[0] == name]
    assert values, f"{name} not exported"
    return sum(values)


@pytest.fixture(scope="module")
def pinned() -> Iterator[DaemonProcess]:
    with running_daemon("--log-level", "warning") as daemon, daemon.channel() as channel:
        stub = engine_session_pb2_grpc.EngineSessionStub(channel)
        for index in range(ENGINES):
            _loaded_engine(stub, f"engine-{index}", PINS_PER_ENGINE)
        yield daemon


# --- bounded inspection --------------------------------------------------------------

def test_a_step_is_answered_while_the_largest_list_jobs_page_is_built(
        pinned: DaemonProcess) -> None:
    with pinned.channel() as channel:
        inspect = inspect_pb2_grpc.InspectStub(channel)
        engine = engine_session_pb2_grpc.EngineSessionStub(channel)
        pages: list[inspect_pb2.ListJobsResponse] = []

        def list_jobs() -> None:
            for _ in range(5):
                pages.append(inspect.ListJobs(inspect_pb2.ListJobsRequest(limit=MAX_LIMIT),
                                              timeout=120))

        lister = threading.Thread(target=list_jobs)
        lister.start()
        waits_s = []
        seq = 2
        while lister.is_alive() and len(waits_s) < 50:
            started = time.monotonic()
            engine.Step(pb.StepReport(engine_id="engine-0", seq=seq, now_s=2.0 + seq * 0.01,
                                      kv=KV), timeout=60)
            waits_s.append(time.monotonic() - started)
            seq += 1
        lister.join()
    assert len(pages) == 5 and all(len(page.jobs) == MAX_LIMIT for page in pages)
    assert pages[0].jobs[0].pinned_blocks == 40 and pages[0].jobs[0].engine_id
    assert max(waits_s) < STEP_BOUND_S, (
        f"a step waited {max(waits_s):.2f} s behind ListJobs(limit={MAX_LIMIT})")


@pytest.mark.parametrize("method, request_type", [
    ("ListJobs", inspect_pb2.ListJobsRequest), ("ListPins", inspect_pb2.ListPinsRequest),
    ("GetToolStats", inspect_pb2.GetToolStatsRequest)])
def test_a_limit_above_the_cap_is_refused_naming_it(
        pinned: DaemonProcess, method: str, request_type: Any) -> None:
    with pinned.channel() as channel:
        call = getattr(inspect_pb2_grpc.InspectStub(channel), method)
        with pytest.raises(grpc.RpcError) as refused:
            call(request_type(limit=MAX_LIMIT + 1), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == (
            f"limit: must be at most {MAX_LIMIT}, got {MAX_LIMIT + 1}")
        with pytest.raises(grpc.RpcError) as forged:
            call(request_type(page_token="not-a-token"), timeout=30)
        assert forged.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert forged.value.details().startswith("page_token: ")


def test_list_jobs_and_list_pins_page_through_everything_once(
        pinned: DaemonProcess) -> None:
    with pinned.channel() as channel:
        inspect = inspect_pb2_grpc.InspectStub(channel)
        jobs: list[str] = []
        token = ""
        while True:
            page = inspect.ListJobs(inspect_pb2.ListJobsRequest(limit=700, page_token=token),
                                    timeout=30)
            jobs.extend(job.job_id for job in page.jobs)
            token = page.next_page_token
            if not token:
                break
        assert len(jobs) == len(set(jobs)) == ENGINES * PINS_PER_ENGINE
        # The snapshot's requests arrived in order: the latest first.
        assert jobs[0] == f"engine-{ENGINES - 1}/job{PINS_PER_ENGINE - 1}"

        pins: list[inspect_pb2.PinRecord] = []
        for pin_page in _pin_pages(inspect, MAX_LIMIT):
            assert len(pin_page.pins) <= MAX_LIMIT
            assert pin_page.pinned_blocks == ENGINES * PINS_PER_ENGINE * 40
            pins.extend(pin_page.pins)
        keys = [(pin.engine_id, pin.request_id) for pin in pins]
        assert keys == sorted(set(keys)) and len(keys) == ENGINES * PINS_PER_ENGINE
        first = inspect.ListPins(inspect_pb2.ListPinsRequest(engine_id="engine-2"), timeout=30)
        assert len(first.pins) == 100 and {pin.engine_id for pin in first.pins} == {"engine-2"}
        job = inspect.GetJob(inspect_pb2.GetJobRequest(job_id="engine-1/job7"), timeout=30)
        assert [(pin.request_id, pin.engine_id) for pin in job.pins] == [
            ("engine-1/pin7", "engine-1")]
        assert job.summary.engine_id == "engine-1" and job.summary.pinned_blocks == 40


def test_tool_stats_are_paged_by_tool_name() -> None:
    with running_daemon("--log-level", "warning") as daemon, daemon.channel() as channel:
        engine = engine_session_pb2_grpc.EngineSessionStub(channel)
        tools = [f"tool-{index:03d}" for index in range(30)]
        seq = 1
        engine.Step(pb.StepReport(engine_id="e", seq=seq, snapshot=True, now_s=1.0, kv=KV),
                    timeout=10)
        for index, tool in enumerate(tools):  # each turn calls a tool, the next one measures it
            for turn in range(2):
                seq += 1
                at_s = 1.0 + seq
                request_id = f"j{index}-t{turn}"
                engine.Step(pb.StepReport(engine_id="e", seq=seq, now_s=at_s, kv=KV, new_requests=[
                    pb.NewRequest(request_id=request_id, job_id=f"j{index}", arrival_s=at_s,
                                  prompt_tokens=10)]), timeout=10)
                seq += 1
                engine.Step(pb.StepReport(engine_id="e", seq=seq, now_s=at_s + 0.5, kv=KV, events=[
                    pb.RequestEvent(request_id=request_id, kind=pb.EVENT_KIND_FINISHED,
                                    at_s=at_s + 0.5, finish_reason=pb.FINISH_REASON_STOP,
                                    output_tokens=5, tool=tool, blocks=1)]), timeout=10)
        inspect = inspect_pb2_grpc.InspectStub(channel)
        expected = ["*", *tools]  # "*": every tool pooled
        listed: list[str] = []
        token = ""
        deadline = time.monotonic() + 20
        while True:  # tool statistics reach the store in the background
            page = inspect.GetToolStats(inspect_pb2.GetToolStatsRequest(limit=7,
                                                                        page_token=token),
                                        timeout=30)
            assert len(page.tools) <= 7
            listed.extend(stats.tool for stats in page.tools)
            token = page.next_page_token
            if token:
                continue
            if listed == expected or time.monotonic() > deadline:
                break
            listed = []
            time.sleep(0.2)
        assert listed == expected


# --- capped watchers, dropped when they do not read ----------------------------------

def test_watchers_beyond_the_cap_are_refused_naming_it() -> None:
    env = {"KVTETHER_LIMITS__MAX_WATCHERS": "3"}
    with running_daemon("--log-level", "warning", env=env) as daemon, \
            daemon.channel() as channel:
        inspect = inspect_pb2_grpc.InspectStub(channel)
        watching = [inspect.WatchDecisions(inspect_pb2.WatchDecisionsRequest())
                    for _ in range(3)]
        deadline = time.monotonic() + 10
        while _metric(daemon, "kvtether_decision_watchers") < 3:
            assert time.monotonic() < deadline, "three watchers never connected"
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as refused:
            next(inspect.WatchDecisions(inspect_pb2.WatchDecisionsRequest(), timeout=10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "at most 3" in (refused.value.details() or "")
        assert "limits.max_watchers" in (refused.value.details() or "")
        watching[0].cancel()  # a slot frees when a watcher leaves
        deadline = time.monotonic() + 10
        while _metric(daemon, "kvtether_decision_watchers") > 2:
            assert time.monotonic() < deadline, "a cancelled watcher kept its slot"
            time.sleep(0.05)
        again = inspect.WatchDecisions(inspect_pb2.WatchDecisionsRequest())
        deadline = time.monotonic() + 10
        while _metric(daemon, "kvtether_decision_watchers") < 3:
            assert time.monotonic() < deadline, "no watcher took the free slot"
            time.sleep(0.05)
        engine = engine_session_pb2_grpc.EngineSessionStub(channel)
        engine.Step(pb.StepReport(engine_id="e", seq=1, snapshot=True, now_s=1.0, kv=KV),
                    timeout=10)
        _turns(engine, "e", 2, [("r1", "job", False)])
        assert next(again).request_id == "r1"
        for call in (*watching, again):
            call.cancel()


def _round_trips_s(engine: engine_session_pb2_grpc.EngineSessionStub, engine_id: str,
                   reports: int) -> list[float]:
    """A session of ``reports`` reports, each a turn arriving and the previous one
    finishing (a few decisions each); the engine's round trip per report."""
    def session() -> Iterator[pb.StepReport]:
        for seq in range(1, reports + 1):
            now_s = seq * 0.01
            report = pb.StepReport(engine_id=engine_id, seq=seq, snapshot=seq == 1,
                                   now_s=now_s, kv=KV)
            report.new_requests.append(pb.NewRequest(
                request_id=f"{engine_id}/t{seq}", job_id=f"{engine_id}/j{seq % 7}",
                arrival_s=now_s, prompt_tokens=100))
            if seq > 1:
                report.events.append(pb.RequestEvent(
                    request_id=f"{engine_id}/t{seq - 1}", kind=pb.EVENT_KIND_FINISHED,
                    at_s=now_s, finish_reason=pb.FINISH_REASON_STOP, output_tokens=5,
                    tool="ls", blocks=4))
            sent.set()
            sent_at_s.append(time.monotonic())
            yield report
            answered.wait()
            answered.clear()

    sent, answered = threading.Event(), threading.Event()
    sent_at_s: list[float] = []
    waits_s = []
    for _decision in engine.Session(session()):
        waits_s.append(time.monotonic() - sent_at_s[-1])
        answered.set()
    return waits_s


def test_watchers_that_never_read_are_dropped_and_decisions_keep_their_pace() -> None:
    # 200 watchers from one address: above the default Inspect burst of one caller.
    env = {"KVTETHER_LIMITS__MAX_WATCHERS": "300", "KVTETHER_LIMITS__INSPECT_BURST": "300"}
    with running_daemon("--log-level", "warning", env=env) as daemon, \
            daemon.channel() as channel:
        engine = engine_session_pb2_grpc.EngineSessionStub(channel)
        alone_s = statistics.median(_round_trips_s(engine, "alone", 600))
        with grpc.insecure_channel(daemon.address) as watch_channel:
            inspect = inspect_pb2_grpc.InspectStub(watch_channel)
            idle = [inspect.WatchDecisions(inspect_pb2.WatchDecisionsRequest())
                    for _ in range(200)]
            time.sleep(2.0)  # the streams open (the drop count below shows they did)
            watched_s = _round_trips_s(engine, "watched", 3000)
            later_s = statistics.median(_round_trips_s(engine, "later", 600))
            # Were each decision to wait on unread watchers, 200 of them would make
            # the median round trip ten times longer. Dropped, they cost nothing.
            assert statistics.median(watched_s) < 3 * alone_s + 0.005, (
                alone_s, statistics.median(watched_s))
            assert later_s < 3 * alone_s + 0.005, (alone_s, later_s)
            assert _metric(daemon, "kvtether_decision_watchers_dropped_total") >= 190
            # What a dropped watcher sees once it reads: the decisions it was sent,
            # then the end of its stream, saying why.
            received = 0
            with pytest.raises(grpc.RpcError) as dropped:
                for _record in idle[0]:
                    received += 1
            assert received > 0
            assert dropped.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "behind" in (dropped.value.details() or "")
            for call in idle:
                call.cancel()


# --- ListJobs as a user reads it -----------------------------------------------------

def test_listjobs_keeps_finished_jobs_after_many_anonymous_requests() -> None:
    with running_daemon("--log-level", "warning") as daemon, daemon.channel() as channel:
        engine = engine_session_pb2_grpc.EngineSessionStub(channel)
        engine.Step(pb.StepReport(engine_id="e", seq=1, snapshot=True, now_s=1.0, kv=KV),
                    timeout=10)
        seq = _turns(engine, "e", 2, [("agent-t1", "agent", False),
                                      ("agent-t2", "agent", True),
                                      ("other-t1", "other", False)])
        seq = _turns(engine, "e", seq, [(f"anon-{index}", "", False) for index in range(150)])
        inspect = inspect_pb2_grpc.InspectStub(channel)
        listed = inspect.ListJobs(inspect_pb2.ListJobsRequest(), timeout=10)
        # Most recently active first; the job whose last step finished is still listed.
        assert [job.job_id for job in listed.jobs] == ["other", "agent"]
        assert not listed.next_page_token
        agent = listed.jobs[1]
        assert (agent.turns_finished, agent.requests_in_flight) == (2, 0)
        everything = inspect.ListJobs(inspect_pb2.ListJobsRequest(include_anonymous=True),
                                      timeout=10)
        assert [job.job_id for job in everything.jobs[:2]] == ["anon-149", "anon-148"]
        assert len(everything.jobs) == 100 and everything.next_page_token
        rest = inspect.ListJobs(inspect_pb2.ListJobsRequest(
            include_anonymous=True, page_token=everything.next_page_token), timeout=10)
        assert [job.job_id for job in rest.jobs][-2:] == ["other", "agent"]
        assert len(rest.jobs) == 52 and not rest.next_page_token

        table = subprocess.run(
            [sys.executable, "-m", "sidecar.cli", "inspect", "--address", daemon.address,
             "jobs", "--limit", "1"], capture_output=True, text=True, timeout=30)
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert lines[0].split()[0] == "job" and lines[1].split()[0] == "other"
        assert "more: --page-token" in table.stdout
        token = lines[-1].split("--page-token ")[1].split()[0]
        following = subprocess.run(
            [sys.executable, "-m", "sidecar.cli", "inspect", "--address", daemon.address,
             "jobs", "--limit", "5", "--page-token", token], capture_output=True, text=True,
            timeout=30)
        assert following.returncode == 0, following.stderr
        assert [line.split()[0] for line in following.stdout.splitlines()[1:]] == ["agent"]
        anonymous = subprocess.run(
            [sys.executable, "-m", "sidecar.cli", "inspect", "--address", daemon.address,
             "jobs", "--anonymous", "--limit", "3"], capture_output=True, text=True,
            timeout=30)
        assert anonymous.returncode == 0, anonymous.stderr
        assert [line.split()[0] for line in anonymous.stdout.splitlines()[1:4]] == [
            "anon-149", "anon-148", "anon-147"]


def test_pages_of_pins_with_the_longest_ids_are_read_to_the_end() -> None:
    # A ListPins page token names the last pin's engine and request ids; with ids of
    # the longest length the daemon accepts, the token is longer than an id may be,
    # and the next page must still be read.
    engine_id = "e" * 256
    with running_daemon("--log-level", "warning") as daemon, daemon.channel() as channel:
        stub = engine_session_pb2_grpc.EngineSessionStub(channel)
        report = pb.StepReport(engine_id=engine_id, seq=1, snapshot=True, now_s=1.0, kv=KV)
        for index in range(3):
            report.pins.append(pb.PinState(
                request_id=f"{index}" + "r" * 255, job_id=f"job{index}", blocks=4,
                pinned_at_s=0.5, expires_at_s=1e9))
        stub.Step(report, timeout=30)
        pages = list(_pin_pages(inspect_pb2_grpc.InspectStub(channel), limit=1))
        assert [pin.request_id[:1] for page in pages for pin in page.pins] == ["0", "1", "2"]
        assert all(len(page.next_page_token) > 256 for page in pages[:-1])
