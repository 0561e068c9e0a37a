"""A well-behaved engine's answers while one caller attacks the engine-facing side.

    .venv/bin/python -m benchmarks.engine_attacks [--phase-s 5] [--raised-limits]
        [--refused-calls 20000]

One real daemon (``kvtether serve``, the default policy, embedded store). A
well-behaved engine (its own process) holds one Session stream and sends a small
report as soon as the previous one is answered; a prober checks ``grpc.health.v1``
every 50 ms. Meanwhile one caller, with no token (the default configuration):

- (a) sends one unary ``Step``: a snapshot of ``--running`` (20,000) running requests
  and ``--pins`` (3,000) pins, each of a job of its own;
- (b) sends two unary ``Step`` snapshots of ``--waiting`` (40,000) waiting requests of
  new jobs, each on a fresh engine id;
- (c) sends ``--refused-calls`` unary ``Step`` reports whose engine id is 1 MB, each
  refused, and reads the daemon's RSS before and after.

Each attack is followed by ``--phase-s`` of the engine alone. Reported: the engine's
longest wait for an answer and the longest health check while each attack ran, and
its reports a second before the attacks and after them. With the default limits the
reports of (a) and (b) are refused (``RESOURCE_EXHAUSTED``); ``--raised-limits``
raises ``limits.max_*_per_engine`` past them, so that the daemon takes them, in slices.
Writes benchmarks/results/engine_attacks/engine_attacks[_raised_limits].json.
"""

from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.common.results import write_result
from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import engine_session_pb2_grpc
from tests.support.daemon import serve_command, wait_serving
from tests.support.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "engine_attacks"
KV = pb.KvCapacity(total_blocks=1_000_000, free_blocks=100_000, block_size_tokens=16)
RAISED_LIMITS = ("limits:\n  max_running_per_engine: 100000\n"
                 "  max_waiting_per_engine: 100000\n  max_pins_per_engine: 100000\n")


def attack_snapshot(engine_id: str, running: int = 0, waiting: int = 0, pins: int = 0
                    ) -> pb.StepReport:
    report = pb.StepReport(engine_id=engine_id, seq=1, snapshot=True, now_s=10.0, kv=KV)
    for index in range(running + waiting):
        report.new_requests.add(
            request_id=f"{engine_id}/r{index}", job_id=f"{engine_id}/job{index}",
            arrival_s=1.0, prompt_tokens=100,
            state=pb.REQUEST_STATE_RUNNING if index < running else pb.REQUEST_STATE_WAITING)
    for index in range(pins):
        report.pins.add(request_id=f"{engine_id}/p{index}", job_id=f"{engine_id}/pin{index}",
                        blocks=2, pinned_at_s=5.0, expires_at_s=1e9, tool="ls")
    return report


def _engine_reports(engine_id: str) -> Any:
    """A steady engine: 20 live agent jobs; each report one turn arrives, the previous
    one is admitted and the one before finishes."""
    yield pb.StepReport(engine_id=engine_id, seq=1, snapshot=True, now_s=1.0, kv=KV)
    seq = 2
    while True:
        now_s = 1.0 + 0.01 * seq
        report = pb.StepReport(engine_id=engine_id, seq=seq, now_s=now_s, kv=KV)
        report.new_requests.add(request_id=f"turn{seq}", job_id=f"agent{seq % 20}",
                                arrival_s=now_s, prompt_tokens=600)
        if seq > 2:
            report.events.add(request_id=f"turn{seq - 1}", kind=pb.EVENT_KIND_ADMITTED,
                              at_s=now_s)
        if seq > 3:
            report.events.add(request_id=f"turn{seq - 2}", kind=pb.EVENT_KIND_FINISHED,
                              at_s=now_s, finish_reason=pb.FINISH_REASON_STOP,
                              output_tokens=40, blocks=40)
        yield report
        seq += 1


def _engine_process(address: str, stop: Any, results: Any) -> None:
    """Report back to back until ``stop`` is set; then put (sent_s, latency_s) of each
    answer."""
    samples: list[tuple[float, float]] = []
    with grpc.insecure_channel(address) as channel:
        stub = engine_session_pb2_grpc.EngineSessionStub(channel)
        reports = _engine_reports("steady-engine")
        pending = threading.Semaphore(0)
        sent_s: list[float] = []

        def requests() -> Any:
            for report in reports:
                if stop.is_set():
                    return
                sent_s.append(time.monotonic())
                yield report
                pending.acquire()  # one report in flight at a time, as an engine does

        for _answer in stub.Session(requests()):
            samples.append((sent_s[-1], time.monotonic() - sent_s[-1]))
            pending.release()
    results.put(samples)


class HealthProbe(threading.Thread):
    def __init__(self, address: str, every_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.every_s = every_s
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not self.stop.is_set():
                started = time.monotonic()
                stub.Check(health_pb2.HealthCheckRequest(), timeout=120)
                self.samples.append((started, time.monotonic() - started))
                self.stop.wait(self.every_s)


def _unary(stub: engine_session_pb2_grpc.EngineSessionStub, report: pb.StepReport
           ) -> tuple[str, float]:
    started = time.monotonic()
    try:
        stub.Step(report, timeout=600)
        outcome = "OK"
    except grpc.RpcError as error:
        outcome = error.code().name  # type: ignore[attr-defined]
    return outcome, time.monotonic() - started


def _overlapping_max_ms(samples: list[tuple[float, float]], begin_s: float, end_s: float
                        ) -> float:
    """The longest wait of the calls that were waiting at some time in [begin, end]."""
    waits = [latency for sent, latency in samples if sent <= end_s and sent + latency >= begin_s]
    return max(waits, default=0.0) * 1e3


def _rate(samples: list[tuple[float, float]], begin_s: float, end_s: float) -> float:
    return sum(1 for sent, _ in samples if begin_s <= sent < end_s) / (end_s - begin_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_attacks",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase-s", type=float, default=5.0)
    parser.add_argument("--running", type=int, default=20_000)
    parser.add_argument("--pins", type=int, default=3_000)
    parser.add_argument("--waiting", type=int, default=40_000)
    parser.add_argument("--refused-calls", type=int, default=20_000)
    parser.add_argument("--raised-limits", action="store_true",
                        help="raise limits.max_*_per_engine past the attacks' reports")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not args.phase_s > 0:
        parser.error(f"--phase-s must be > 0, got {args.phase_s}")
    for name in ("running", "pins", "waiting", "refused_calls"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    out = args.out or OUT / ("engine_attacks_raised_limits.json" if args.raised_limits
                             else "engine_attacks.json")

    print("building the attacks' reports ...", flush=True)
    attack_a = attack_snapshot("attacker-a", running=args.running, pins=args.pins)
    attack_b = [attack_snapshot(f"attacker-b{index}", waiting=args.waiting) for index in (1, 2)]
    refused = pb.StepReport(engine_id="x" * 1_000_000, seq=1, snapshot=True, now_s=1.0)

    address = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as scratch:
        extra: list[str] = []
        if args.raised_limits:
            config = Path(scratch) / "kvtether.yaml"
            config.write_text(RAISED_LIMITS)
            extra = ["--config", str(config)]
        daemon = subprocess.Popen(
            serve_command("--listen", address, "--metrics-port", "-1", "--log-level", "warning",
                          *extra), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_serving(address, timeout_s=60)
            result = _run(args, address, daemon.pid, attack_a, attack_b, refused)
        finally:
            daemon.kill()
            daemon.wait(timeout=30)

    before, after = result["rate_before_per_s"], result["rate_after_per_s"]
    print(f"limits {'raised past the attacks' if args.raised_limits else 'as by default'}")
    print(f"{'':<36}{'engine wait max':>16}{'health max':>12}  attack: answer, time")
    for name in ("a", "b"):
        row = result["attacks"][name]
        print(f"{row['label']:<36}{row['engine_wait_max_ms']:>13.1f} ms"
              f"{row['health_max_ms']:>9.1f} ms  {row['outcome']}, {row['took_s']:.2f} s")
    print(f"engine reports/s: before {before:.0f}, after {after:.0f} ({after / before:.2f}x)")
    c = result["refused_flood"]
    print(f"(c) {c['calls']} refused 1 MB reports in {c['took_s']:.0f} s: RSS "
          f"{c['rss_before_mib']:.0f} -> {c['rss_after_mib']:.0f} MiB ({c['rss_ratio']:.2f}x)")
    write_result(out, {
        "command": "python -m benchmarks.engine_attacks " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "latency": "the well-behaved engine's round trip from writing a report to reading "
                   "its decision; a health check's round trip",
        "raised_limits": args.raised_limits, "phase_s": args.phase_s, **result})
    return 0


def _run(args: argparse.Namespace, address: str, pid: int, attack_a: pb.StepReport,
         attack_b: list[pb.StepReport], refused: pb.StepReport) -> dict[str, Any]:
    spawn = multiprocessing.get_context("spawn")
    results: Any = spawn.Queue()
    probe = HealthProbe(address)
    probe.start()
    stop = spawn.Event()
    engine = spawn.Process(target=_engine_process, args=(address, stop, results))
    engine.start()
    time.sleep(2.0)  # the engine's start-up
    windows: dict[str, tuple[float, float]] = {}
    outcomes: dict[str, tuple[str, float]] = {}
    with grpc.insecure_channel(address, options=[
            ("grpc.max_send_message_length", 256 * 2**20)]) as channel:
        stub = engine_session_pb2_grpc.EngineSessionStub(channel)
        before_begin = time.monotonic()
        time.sleep(args.phase_s)
        windows["before"] = (before_begin, time.monotonic())
        begin = time.monotonic()
        outcomes["a"] = _unary(stub, attack_a)
        windows["a"] = (begin, time.monotonic())
        time.sleep(args.phase_s)
        begin = time.monotonic()
        first = _unary(stub, attack_b[0])
        second = _unary(stub, attack_b[1])
        outcomes["b"] = (f"{first[0]}, {second[0]}", first[1] + second[1])
        windows["b"] = (begin, time.monotonic())
        after_begin = time.monotonic()
        time.sleep(args.phase_s)
        windows["after"] = (after_begin, time.monotonic())
        process = psutil.Process(pid)
        flood_begin = time.monotonic()
        for _ in range(min(200, args.refused_calls)):  # gRPC's buffers sized first
            _unary(stub, refused)
        rss_before = process.memory_info().rss
        codes: dict[str, int] = {}
        for _ in range(max(0, args.refused_calls - 200)):
            code, _took = _unary(stub, refused)
            codes[code] = codes.get(code, 0) + 1
        rss_after = process.memory_info().rss
        flood_s = time.monotonic() - flood_begin
    stop.set()  # the engine ends its stream after its next answer, and sends its samples
    samples: list[tuple[float, float]] = results.get(timeout=120)
    engine.join(timeout=30)
    probe.stop.set()
    probe.join()
    labels = {"a": f"(a) {args.running:,} running + {args.pins:,} pins",
              "b": f"(b) 2 x {args.waiting:,} waiting, new jobs"}
    attacks = {}
    for name in ("a", "b"):
        begin, end = windows[name]
        attacks[name] = {
            "label": labels[name], "outcome": outcomes[name][0], "took_s": end - begin,
            "engine_wait_max_ms": _overlapping_max_ms(samples, begin, end),
            "health_max_ms": _overlapping_max_ms(probe.samples, begin, end)}
    return {
        "attacks": attacks,
        "rate_before_per_s": _rate(samples, *windows["before"]),
        "rate_after_per_s": _rate(samples, *windows["after"]),
        "engine_wait_max_ms_before": _overlapping_max_ms(samples, *windows["before"]),
        "health_max_ms_before": _overlapping_max_ms(probe.samples, *windows["before"]),
        "refused_flood": {"calls": args.refused_calls, "codes": codes, "took_s": flood_s,
                          "rss_before_mib": rss_before / 2**20,
                          "rss_after_mib": rss_after / 2**20,
                          "rss_ratio": rss_after / rss_before},
        "engine_reports": len(samples)}
