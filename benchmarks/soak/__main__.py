"""Load and soak: simulated engines feeding one daemon backed by a real Redis, at the
pace of real engines, for minutes.

    .venv/bin/python -m benchmarks.soak [--minutes 10] [--engines 16] [--steps-per-s 30]

Each engine is a process with its own Session stream (tests/support/simulated_engine.py:
agent jobs arrive, are admitted, decode, finish calling tools and come back; the
engine applies the daemon's priorities and pins). An orchestrator pushes retention
directives meanwhile. Writes benchmarks/results/soak/soak.json and soak.png and prints
a per-minute table: client and daemon decision latency, daemon RSS, Redis ops/s and
memory, reports/s, load average; then errors (must be 0), daemon CPU per report,
Redis operations per report, Redis memory per job and per tool.
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path
from typing import Any

import grpc
import redis

from benchmarks.common.progress import Progress
from benchmarks.common.results import write_result
from benchmarks.common.stats import percentile
from benchmarks.soak.engines import run_engine
from benchmarks.soak.monitor import Monitor
from benchmarks.soak.report import per_minute, plot, redis_ops_per_report
from sidecar.api.v1 import retention_pb2, retention_pb2_grpc
from sidecar.store import keys
from tests.support.daemon import serve_command, wait_serving
from tests.support.redis_server import free_port, redis_binary
from tests.support.simulated_engine import EngineCounters, WorkloadShape

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "soak"
# Warnings the soak's own set-up causes, not faults: no auth tokens, and the Redis it
# starts keeps nothing on disk.
EXPECTED_WARNINGS = ("retention_scopes_unauthenticated", "store_not_persistent")


@contextmanager
def _daemon(redis_url: str, policy: str, log_path: Path
            ) -> Iterator[tuple[subprocess.Popen[bytes], str, str]]:
    """``kvtether serve``, its log in a file: a pipe nobody reads while the soak runs
    would fill up and stop the daemon at its next log line."""
    address, metrics_port = f"127.0.0.1:{free_port()}", free_port()
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            serve_command("--listen", address, "--metrics-port", str(metrics_port),
                          "--redis-url", redis_url, "--policy", policy,
                          "--log-level", "warning"),
            stdout=subprocess.DEVNULL, stderr=log_file)
    try:
        wait_serving(address, timeout_s=60)
        yield process, address, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


class Orchestrator(threading.Thread):
    """Pushes retention directives for the engines' jobs at a steady rate (the store's
    atomic transitions under load) and counts failures."""

    def __init__(self, address: str, per_s: float, engines: int, seconds: float) -> None:
        super().__init__(name="soak-orchestrator", daemon=True)
        self.address, self.per_s, self.engines, self.seconds = address, per_s, engines, seconds
        self.calls = 0
        self.errors: list[str] = []
        self.latency_s: list[float] = []

    def run(self) -> None:
        if self.per_s <= 0:
            return
        chooser = random.Random(7)
        config = retention_pb2.RetentionConfig(token_ranges=[
            retention_pb2.TokenRangeRetention(token_start=0, token_end=512, priority=80),
            retention_pb2.TokenRangeRetention(token_start=512, priority=60, duration_s=30.0)])
        origin = time.monotonic()
        with grpc.insecure_channel(self.address) as channel:
            stub = retention_pb2_grpc.RetentionStub(channel)
            while (elapsed := time.monotonic() - origin) < self.seconds:
                # Jobs arrive at about one per second per engine: aim at recent ones.
                job = max(1, int(elapsed) - chooser.randint(0, 30))
                target = retention_pb2.RetentionTarget(
                    job_id=f"sim-{chooser.randrange(self.engines)}-job-{job}")
                started = time.perf_counter()
                try:
                    stub.SetDirectives(retention_pb2.SetDirectivesRequest(
                        target=target, config=config, scope="soak-orchestrator"), timeout=5)
                    self.latency_s.append(time.perf_counter() - started)
                except grpc.RpcError as error:
                    self.errors.append(f"{elapsed:.0f}s {error.code().name}: {error.details()}")
                self.calls += 1
                time.sleep(max(0.0, origin + self.calls / self.per_s - time.monotonic()))


class MinuteProgress(threading.Thread):
    """The soak's progress (benchmarks/common/progress.py): a bar over its minutes on a
    terminal, else a line a minute, each with the daemon's latest figures."""

    def __init__(self, minutes: float, monitor: Monitor) -> None:
        super().__init__(name="soak-progress", daemon=True)
        self.minutes, self.monitor = minutes, monitor
        self.progress = Progress("soak", total=minutes, unit="min")
        self.finished = threading.Event()

    def _figures(self) -> str:
        samples = [s for s in self.monitor.samples[-2:] if "step_reports" in s.get("metrics", {})]
        figures = []
        if len(samples) == 2 and samples[1]["t_s"] > samples[0]["t_s"]:
            reports = samples[1]["metrics"]["step_reports"] - samples[0]["metrics"]["step_reports"]
            figures.append(f"{reports / (samples[1]['t_s'] - samples[0]['t_s']):.0f} reports/s")
        if self.monitor.samples:
            figures.append(f"daemon RSS {self.monitor.samples[-1]['daemon_rss_bytes'] / 2**20:.0f}"
                           " MiB")
        return ", ".join(figures)

    def run(self) -> None:
        started_s, reported_min = time.monotonic(), 0.0
        while True:
            finished = self.finished.wait(1.0)
            elapsed_min = min((time.monotonic() - started_s) / 60.0, self.minutes)
            self.progress.update(elapsed_min - self.progress.done)
            # A line each minute, and one at the end (the engines may finish a little
            # before this clock, or fail early).
            if int(elapsed_min) > int(reported_min) or (finished and elapsed_min > reported_min):
                reported_min = elapsed_min
                self.progress.round_done(self._figures())
            if finished or elapsed_min >= self.minutes:
                break
        self.progress.close()

    def stop(self) -> None:
        self.finished.set()
        self.join(timeout=5)


def _memory_per_key(client: redis.Redis, pattern: str, limit: int = 300) -> dict[str, Any]:
    found = [key for _, key in zip(range(limit), client.scan_iter(match=pattern, count=1000),
                                   strict=False)]
    sizes = [int(client.memory_usage(key) or 0) for key in found]
    return {"keys_sampled": len(sizes),
            "bytes_mean": sum(sizes) / len(sizes) if sizes else None,
            "keys_total": sum(1 for _ in client.scan_iter(match=pattern, count=1000))}


def _versions() -> dict[str, str]:
    server = subprocess.run(["redis-server", "--version"], capture_output=True,
                            text=True).stdout.split()
    return {"grpcio": version("grpcio"), "redis_py": version("redis"),
            "redis_server": next((part.removeprefix("v=") for part in server
                                  if part.startswith("v=")), "?")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--steps-per-s", type=float, default=30.0)
    parser.add_argument("--job-arrivals-per-s", type=float, default=1.0,
                        help="new agent jobs per second per engine")
    parser.add_argument("--directives-per-s", type=float, default=2.0,
                        help="retention directives pushed per second (all engines)")
    parser.add_argument("--policy", default="continuum")
    parser.add_argument("--redis-url", default="",
                        help="an existing Redis (flushed first!); default: start redis-server")
    parser.add_argument("--sample-s", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    # The steady state is measured from the first minute on: a shorter run has none.
    if args.minutes < 2:
        parser.error(f"--minutes must be at least 2 (the first minute is warm-up), "
                     f"got {args.minutes:g}")
    duration_s = args.minutes * 60.0
    shape = WorkloadShape(job_arrivals_per_s=args.job_arrivals_per_s)

    with ExitStack() as stack:
        if args.redis_url:
            redis_url, redis_pid = args.redis_url, None
            redis.Redis.from_url(redis_url).flushall()
        else:
            redis_url, redis_process = stack.enter_context(redis_binary())
            redis_pid = redis_process.pid
        redis.Redis.from_url(redis_url).config_resetstat()
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvt-soak-")))
        daemon_log_path = scratch / "daemon.log"
        daemon, address, metrics_url = stack.enter_context(
            _daemon(redis_url, args.policy, daemon_log_path))
        monitor = Monitor(daemon.pid, metrics_url, redis_url, redis_pid, args.sample_s)
        monitor.sample()  # the daemon before any engine
        context = multiprocessing.get_context("spawn")
        results_queue: Any = context.Queue()
        start_at = time.time() + 8.0  # every engine process is up by then
        engines_start_s = start_at - (time.time() - (time.monotonic() - monitor.origin))
        processes = [
            context.Process(target=run_engine, name=f"sim-{i}",
                            args=(address, f"sim-{i}", i, shape, args.steps_per_s, start_at,
                                  duration_s, results_queue))
            for i in range(args.engines)]
        for process in processes:
            process.start()
        monitor.start()
        orchestrator = Orchestrator(address, args.directives_per_s, args.engines, duration_s)
        time.sleep(max(0.0, start_at - time.time()))
        orchestrator.start()
        print(f"soak: {args.engines} engines x {args.steps_per_s:g} steps/s for "
              f"{args.minutes:g} min, daemon {address}, Redis {redis_url}", file=sys.stderr)
        minutes = MinuteProgress(args.minutes, monitor)
        minutes.start()
        results = []
        collect_until = time.time() + duration_s + 120
        for _ in processes:
            try:
                results.append(results_queue.get(timeout=max(1.0, collect_until - time.time())))
            except queue.Empty:
                break  # counted below as engines that never reported
            print(f"  engine {results[-1]['engine_id']} done", file=sys.stderr)
        minutes.stop()
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        orchestrator.join(timeout=30)
        time.sleep(args.sample_s)  # let queued store writes land
        monitor.stop()
        client = redis.Redis.from_url(redis_url)
        memory = {kind: _memory_per_key(client, keys.pattern_for(kind))
                  for kind in ("history", "stats", "directive")}
        daemon.terminate()
        try:
            daemon_exit: int | None = daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon_exit = None  # did not stop on SIGTERM: an error; killed on the way out
        daemon_log = daemon_log_path.read_text(errors="replace")

    samples = monitor.samples
    rows = per_minute(results, samples, engines_start_s, duration_s)
    # Steady state: from the end of the first minute to the end of the run.
    first = next(s for s in samples if s["t_s"] >= engines_start_s + 60 and "redis" in s)
    last = samples[-1]
    steady_reports = last["metrics"]["step_reports"] - first["metrics"]["step_reports"]
    counters = [r["counters"] for r in results]
    totals = {name: sum(c[name] for c in counters) for name in asdict(EngineCounters())}
    engine_errors = [f"{r['engine_id']}: {e}" for r in results for e in r["errors"]]
    end_metrics = last["metrics"]
    errors = {
        "engine_stream_errors": len(engine_errors),
        "engine_resyncs": totals["resyncs"],
        "orchestrator_errors": len(orchestrator.errors),
        "daemon_store_errors": end_metrics.get("store_errors", 0),
        "daemon_store_writes_dropped": end_metrics.get("store_writes_dropped", 0),
        "daemon_invalid_reports": end_metrics.get("invalid_reports", 0),
        "daemon_exit_code": 1 if daemon_exit is None else daemon_exit,
        "daemon_warnings": sum(1 for line in daemon_log.splitlines()
                               if '"level": "warning"' in line
                               and not any(event in line for event in EXPECTED_WARNINGS)),
        "engines_that_never_reported": args.engines - len(results),
        "monitor_errors": len(monitor.errors),
    }
    errors["total"] = sum(v for k, v in errors.items() if k != "total")
    baseline = samples[0]
    at_30s = next(s for s in samples if s["t_s"] >= engines_start_s + 30)
    rss = {
        "before_engines_mib": baseline["daemon_rss_bytes"] / 2**20,
        "after_30s_mib": at_30s["daemon_rss_bytes"] / 2**20,
        "after_1min_mib": first["daemon_rss_bytes"] / 2**20,
        "end_mib": last["daemon_rss_bytes"] / 2**20,
        "per_engine_mib_at_30s": (at_30s["daemon_rss_bytes"] - baseline["daemon_rss_bytes"])
        / 2**20 / args.engines,
        "growth_after_1min_mib_per_min": (last["daemon_rss_bytes"] - first["daemon_rss_bytes"])
        / 2**20 / max(1e-9, (last["t_s"] - first["t_s"]) / 60),
    }
    jobs_started = sum(r["counters"]["jobs_done"] + r["live_jobs_at_end"] for r in results)
    result: dict[str, Any] = {
        "command": "python -m benchmarks.soak " + " ".join(sys.argv[1:]),
        "versions": _versions(),
        "config": {"minutes": args.minutes, "engines": args.engines,
                   "steps_per_s": args.steps_per_s, "policy": args.policy,
                   "directives_per_s": args.directives_per_s, "workload": asdict(shape),
                   "redis": "redis-server started by the soak (no persistence)"
                   if not args.redis_url else "given"},
        "errors": errors,
        "error_lines": (engine_errors + orchestrator.errors + monitor.errors)[:50],
        "engine_totals": {**totals, "jobs_started": jobs_started,
                          "skipped_ticks": sum(r["skipped_ticks"] for r in results),
                          "engine_processes_cpu_s": sum(r["process_cpu_s"] for r in results)},
        "per_minute": rows,
        "daemon_rss": rss,
        "steady_state": {
            "reports": steady_reports,
            "reports_per_s": steady_reports / max(1e-9, last["t_s"] - first["t_s"]),
            "daemon_cpu_us_per_report": (last["daemon_cpu_s"] - first["daemon_cpu_s"])
            / steady_reports * 1e6,
            "redis_cpu_us_per_report": ((last["redis_cpu_s"] - first["redis_cpu_s"])
                                        / steady_reports * 1e6 if "redis_cpu_s" in last
                                        else None),
            "redis_ops": redis_ops_per_report(first, last),
            "store_writes_per_report": (end_metrics.get("store_writes", 0)
                                        - first["metrics"].get("store_writes", 0))
            / steady_reports,
        },
        "redis_memory": {
            "used_memory_mib_end": last["redis"]["used_memory"] / 2**20,
            "keys_end": last["redis"]["keys"],
            "per_key_kind": memory,
            "used_memory_bytes_per_job_started": (last["redis"]["used_memory"]
                                                  - baseline["redis"]["used_memory"])
            / max(1, jobs_started),
        },
        "orchestrator": {"calls": orchestrator.calls,
                         "latency_ms_p50": _p(orchestrator.latency_s, 0.5),
                         "latency_ms_p99": _p(orchestrator.latency_s, 0.99)},
        "daemon_log_head": daemon_log.splitlines()[:20],
        "engines_start_s": engines_start_s,
        "samples": samples,
    }
    result = write_result(args.out / "soak.json", result)
    plot(result, str(args.out / "soak.png"))
    _print(result, args.out)
    return 0 if errors["total"] == 0 else 1


def _p(values: list[float], q: float) -> float | None:
    return percentile(values, q) * 1000 if values else None


def _print(result: dict[str, Any], out: Path) -> None:
    print(f"\n{'min':>3} {'rep/s':>6} {'cli p50':>8} {'cli p99':>8} {'dmn p50':>8} "
          f"{'dmn p99':>8} {'RSS MiB':>8} {'redis op/s':>10} {'redis MiB':>9} {'load':>5}")
    for row in result["per_minute"]:
        print(f"{row['minute']:>3} {row['reports_per_s']:>6.0f} "
              f"{row['client_latency_ms_p50'] or 0:>8.2f} "
              f"{row['client_latency_ms_p99'] or 0:>8.2f} "
              f"{row.get('daemon_decision_ms_p50') or 0:>8.3f} "
              f"{row.get('daemon_decision_ms_p99') or 0:>8.3f} {row['daemon_rss_mib_end']:>8.1f} "
              f"{row.get('redis_ops_per_s', 0):>10.0f} "
              f"{row.get('redis_used_memory_mib_end', 0):>9.1f} {row['loadavg_1m_end']:>5.2f}")
    steady = result["steady_state"]
    print(f"\nerrors: {result['errors']}")
    print(f"daemon RSS: {result['daemon_rss']}")
    print(f"steady state: {steady['reports_per_s']:.0f} reports/s, daemon "
          f"{steady['daemon_cpu_us_per_report']:.0f} us CPU/report, Redis "
          f"{steady['redis_ops']['per_report']:.2f} ops/report "
          f"{ {k: round(v, 3) for k, v in steady['redis_ops']['by_command'].items()} }")
    print(f"Redis memory: {result['redis_memory']}")
    print(f"wrote {out / 'soak.json'} and {out / 'soak.png'}")


if __name__ == "__main__":
    sys.exit(main())
