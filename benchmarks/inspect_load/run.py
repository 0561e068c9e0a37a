"""Decision latency while the daemon is inspected: ListJobs at its largest page and
idle watchers beside engines that hold thousands of pins.

    .venv/bin/python -m benchmarks.inspect_load [--engines 32] [--pins-per-engine 100]
        [--phase-s 15] [--rounds 2] [--watchers 50] [--list-every-s 0.1]

One real daemon (``kvtether serve``, the default policy, embedded store). ``--engines``
engine streams, spread over ``--client-processes`` processes, each first send a
snapshot holding ``--pins-per-engine`` pins and as many running requests (one job each,
so the daemon tracks engines x pins jobs), then a report every ``--step-interval-s``
(a turn arrives, the previous one is admitted, the one before finishes), waiting for
each answer as an engine does. The decision latency is the engine side's round trip:
from writing a report to reading its decision.

The run alternates two phases of ``--phase-s``, ``--rounds`` times: *quiet* (the
engines only) and *inspected* (the engines, plus one ``ListJobs`` of the largest
page every ``--list-every-s`` and ``--watchers`` ``WatchDecisions`` streams that never
read: half watch every decision, half a job that has none). It prints p50, p99 and
reports/s of both side by side and writes benchmarks/results/inspect_load/inspect_load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import psutil

from benchmarks.common.results import write_result
from benchmarks.common.stats import percentile
from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import engine_session_pb2_grpc, inspect_pb2, inspect_pb2_grpc
from tests.support.daemon import serve_command, wait_serving
from tests.support.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "inspect_load"
KV = pb.KvCapacity(total_blocks=1_000_000, free_blocks=900_000, block_size_tokens=16)
# Pins from the snapshot never expire during a run: the engine clock stays far below.
PIN_EXPIRES_AT_S = 1e9
# The largest ListJobs page the daemon serves.
LIST_LIMIT = 1000


def snapshot(engine_id: str, pins: int) -> pb.StepReport:
    report = pb.StepReport(engine_id=engine_id, seq=1, snapshot=True, now_s=1.0, kv=KV)
    for index in range(pins):
        job_id = f"{engine_id}/job{index}"
        report.new_requests.append(pb.NewRequest(
            request_id=f"{engine_id}/run{index}", job_id=job_id, arrival_s=0.5,
            prompt_tokens=600, state=pb.REQUEST_STATE_RUNNING, computed_tokens=600))
        report.pins.append(pb.PinState(
            request_id=f"{engine_id}/pin{index}", job_id=job_id, blocks=40, pinned_at_s=0.5,
            expires_at_s=PIN_EXPIRES_AT_S, tool="pytest"))
    return report


def step(engine_id: str, seq: int) -> pb.StepReport:
    """Turn ``seq`` arrives, ``seq - 1`` is admitted and ``seq - 2`` finishes."""
    now_s = 1.0 + 0.01 * seq
    report = pb.StepReport(engine_id=engine_id, seq=seq, now_s=now_s, kv=KV)
    report.new_requests.append(pb.NewRequest(
        request_id=f"{engine_id}/turn{seq}", job_id=f"{engine_id}/agent{seq % 20}",
        arrival_s=now_s, prompt_tokens=600, state=pb.REQUEST_STATE_WAITING))
    if seq > 2:
        report.events.append(pb.RequestEvent(request_id=f"{engine_id}/turn{seq - 1}",
                                             kind=pb.EVENT_KIND_ADMITTED, at_s=now_s))
    if seq > 3:
        report.events.append(pb.RequestEvent(
            request_id=f"{engine_id}/turn{seq - 2}", kind=pb.EVENT_KIND_FINISHED,
            at_s=now_s, finish_reason=pb.FINISH_REASON_STOP, output_tokens=40, blocks=40))
    return report


async def _engine(address: str, engine_id: str, pins: int, interval_s: float, end_s: float,
                  samples: list[tuple[float, float]]) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        call = engine_session_pb2_grpc.EngineSessionStub(channel).Session()
        seq = 1
        report = snapshot(engine_id, pins)
        next_s = time.monotonic()
        while True:
            sent_s = time.monotonic()
            await call.write(report)
            answer = await call.read()
            done_s = time.monotonic()
            if answer is grpc.aio.EOF or answer.resync_requested:
                raise RuntimeError(f"{engine_id}: stream ended or resync asked at seq {seq}")
            samples.append((sent_s, done_s - sent_s))
            next_s = max(next_s + interval_s, done_s)
            if next_s >= end_s:
                break
            await asyncio.sleep(next_s - done_s)
            seq += 1
            report = step(engine_id, seq)
        await call.done_writing()


def _client_process(address: str, engine_ids: list[str], pins: int, interval_s: float,
                    end_s: float, results: Any) -> None:
    samples: list[tuple[float, float]] = []

    async def run() -> None:
        await asyncio.gather(*(_engine(address, engine_id, pins, interval_s, end_s, samples)
                               for engine_id in engine_ids))

    asyncio.run(run())
    results.put(samples)


class Inspection:
    """The inspected phase's callers: ListJobs polling and watchers that never read."""

    def __init__(self, address: str, watchers: int, every_s: float) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = inspect_pb2_grpc.InspectStub(self.channel)
        self.watchers = watchers
        self.every_s = every_s
        self.list_s: list[float] = []
        self.list_errors: list[str] = []
        self.jobs_listed = 0
        self._calls: list[Any] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        for index in range(self.watchers):
            # Half watch everything, half a job that never gets a decision.
            request = (inspect_pb2.WatchDecisionsRequest() if index % 2 == 0
                       else inspect_pb2.WatchDecisionsRequest(job_id="no-such-job"))
            self._calls.append(self.stub.WatchDecisions(request))
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                answer = self.stub.ListJobs(inspect_pb2.ListJobsRequest(limit=LIST_LIMIT),
                                            timeout=60)
                self.jobs_listed = len(answer.jobs)
            except grpc.RpcError as error:
                self.list_errors.append(f"{error.code().name}: {error.details()}")
            elapsed = time.monotonic() - started
            self.list_s.append(elapsed)
            self._stop.wait(max(0.0, self.every_s - elapsed))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for call in self._calls:
            call.cancel()
        self._calls.clear()


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _summary(latencies_s: list[float], duration_s: float) -> dict[str, float]:
    return {"reports": len(latencies_s), "reports_per_s": len(latencies_s) / duration_s,
            "p50_ms": percentile(latencies_s, 0.5) * 1e3,
            "p99_ms": percentile(latencies_s, 0.99) * 1e3,
            "max_ms": max(latencies_s, default=float("nan")) * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.inspect_load",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=32)
    parser.add_argument("--pins-per-engine", type=int, default=100)
    parser.add_argument("--step-interval-s", type=float, default=0.1)
    parser.add_argument("--phase-s", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--watchers", type=int, default=50)
    parser.add_argument("--list-every-s", type=float, default=0.1)
    parser.add_argument("--client-processes", type=int, default=4)
    parser.add_argument("--out", type=Path, default=OUT / "inspect_load.json")
    args = parser.parse_args(argv)
    for name, value, least in (("--engines", args.engines, 1), ("--rounds", args.rounds, 1),
                               ("--pins-per-engine", args.pins_per_engine, 0),
                               ("--watchers", args.watchers, 0),
                               ("--client-processes", args.client_processes, 1)):
        if value < least:
            parser.error(f"{name} must be at least {least}, got {value}")
    for name, value in (("--step-interval-s", args.step_interval_s),
                        ("--phase-s", args.phase_s), ("--list-every-s", args.list_every_s)):
        if not value > 0:
            parser.error(f"{name} must be > 0, got {value}")

    address, metrics_port = f"127.0.0.1:{free_port()}", free_port()
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    daemon = subprocess.Popen(
        serve_command("--listen", address, "--metrics-port", str(metrics_port),
                      "--log-level", "warning"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    try:
        wait_serving(address, timeout_s=60)
        spawn = multiprocessing.get_context("spawn")
        results: Any = spawn.Queue()
        started_s = time.monotonic() + 2.0  # the clients' start-up
        phases: list[tuple[str, float, float]] = []
        at_s = started_s + args.warmup_s
        for _ in range(args.rounds):
            for label in ("quiet", "inspected"):
                phases.append((label, at_s, at_s + args.phase_s))
                at_s += args.phase_s
        end_s = at_s
        engine_ids = [f"engine-{index}" for index in range(args.engines)]
        clients = [spawn.Process(target=_client_process, args=(
            address, engine_ids[index::args.client_processes], args.pins_per_engine,
            args.step_interval_s, end_s, results)) for index in range(args.client_processes)]
        for client in clients:
            client.start()
        inspection = Inspection(address, args.watchers, args.list_every_s)
        daemon_cpu_s = {"quiet": 0.0, "inspected": 0.0}
        for label, begin_s, finish_s in phases:
            time.sleep(max(0.0, begin_s - time.monotonic()))
            cpu_before_s = _cpu_s(daemon.pid)
            if label == "inspected":
                inspection.start()
            time.sleep(max(0.0, finish_s - time.monotonic()))
            if label == "inspected":
                inspection.stop()
            daemon_cpu_s[label] += _cpu_s(daemon.pid) - cpu_before_s
        samples: list[tuple[float, float]] = []
        for _ in clients:
            samples.extend(results.get(timeout=120))
        for client in clients:
            client.join(timeout=30)
        try:
            dropped = _metric(metrics_url, "kvtether_decision_watchers_dropped_total")
        except (OSError, ValueError, IndexError):
            dropped = float("nan")
    finally:
        daemon.kill()
        daemon.wait(timeout=30)

    by_phase: dict[str, list[float]] = {"quiet": [], "inspected": []}
    for sent_s, latency_s in samples:
        for label, begin_s, finish_s in phases:
            if begin_s <= sent_s < finish_s:
                by_phase[label].append(latency_s)
    total_s = args.phase_s * args.rounds
    table = {label: _summary(values, total_s) for label, values in by_phase.items()}
    for label, row in table.items():
        row["daemon_cpu_share"] = daemon_cpu_s[label] / total_s
    quiet, inspected = table["quiet"], table["inspected"]
    print(f"{args.engines} engines, {args.engines * args.pins_per_engine} pins, a report every "
          f"{args.step_interval_s:g} s each; {args.rounds} x {args.phase_s:g} s per phase")
    print(f"{'':<42}{'quiet':>12}{'inspected':>12}")
    for key, label in (("p50_ms", "decision round trip p50, ms"),
                       ("p99_ms", "decision round trip p99, ms"),
                       ("max_ms", "decision round trip max, ms"),
                       ("reports_per_s", "reports/s"),
                       ("daemon_cpu_share", "daemon CPU, cores")):
        print(f"{label:<42}{quiet[key]:>12.{3 if key == 'daemon_cpu_share' else 1}f}"
              f"{inspected[key]:>12.{3 if key == 'daemon_cpu_share' else 1}f}")
    list_s = inspection.list_s
    print(f"ListJobs(limit={LIST_LIMIT}): {len(list_s)} calls, {inspection.jobs_listed} jobs "
          f"a page, p50 {percentile(list_s, 0.5) * 1e3:.1f} ms, "
          f"max {max(list_s, default=0) * 1e3:.1f} ms, {len(inspection.list_errors)} errors "
          f"{sorted(set(inspection.list_errors))[:2]}")
    print(f"watchers dropped by the daemon: {dropped:g}")
    ratio = inspected["p99_ms"] / quiet["p99_ms"]
    print(f"inspected / quiet p99: {ratio:.2f}x")
    write_result(args.out, {
        "command": "python -m benchmarks.inspect_load " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "latency": "engine side: round trip from writing a report to reading its decision",
        "engines": args.engines, "pins": args.engines * args.pins_per_engine,
        "step_interval_s": args.step_interval_s, "phase_s": args.phase_s,
        "rounds": args.rounds, "watchers": args.watchers, "list_every_s": args.list_every_s,
        "list_limit": LIST_LIMIT, "quiet": quiet, "inspected": inspected,
        "p99_ratio": ratio,
        "list_jobs": {"calls": len(list_s), "jobs_per_page": inspection.jobs_listed,
                      "p50_ms": percentile(list_s, 0.5) * 1e3,
                      "max_ms": max(list_s, default=float("nan")) * 1e3,
                      "errors": len(inspection.list_errors)},
        "watchers_dropped": dropped})
    return 0

