"""Engines that come and go: what a daemon keeps of the engines that left.

    .venv/bin/python -m benchmarks.churn [--engines 300] [--reports 150] [--forget-after-s 3]

vLLM pods restart, scale and roll, and the plugin's default engine id (``host:pid``,
Kubernetes: the pod name) is new every time. Two daemons (adaptive, embedded store)
run side by side and are fed the same engines, one after the other: each engine a new
id that opens a Session stream, sends ``--reports`` step reports (agent turns arriving,
running and finishing with a tool call, its timed work and counters) and leaves. One
daemon forgets an engine ``--forget-after-s`` after it left (``engine_forget_after_s``,
600 s by default; shortened so a run of minutes shows it); the other never does within
the run (a day): a daemon that keeps every engine it ever saw. Every ``--every`` engines it
prints, for both: the ``{engine_id}`` series on /metrics, the size of a scrape and the
daemon's RSS. Writes benchmarks/results/churn/churn.json.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil

from benchmarks.common.results import write_result
from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import engine_session_pb2_grpc
from tests.support.daemon import serve_command, wait_serving
from tests.support.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "churn"
NEVER_S = 86_400.0
KV = pb.KvCapacity(total_blocks=4_000, free_blocks=3_000, block_size_tokens=16)


@dataclass
class Daemon:
    label: str
    process: subprocess.Popen[bytes]
    stub: engine_session_pb2_grpc.EngineSessionStub
    metrics_url: str

    def sample(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read()
        return {"engine_series": sum(1 for line in text.splitlines()
                                     if not line.startswith(b"#") and b'engine_id="' in line),
                "scrape_kib": len(text) / 1024,
                "rss_mib": psutil.Process(self.process.pid).memory_info().rss / 2**20}


@contextmanager
def daemon(label: str, forget_after_s: float,
           env: Mapping[str, str] | None = None) -> Iterator[Daemon]:
    """A ``kvtether serve`` process (adaptive, embedded store) with ``env`` added to
    its KVTETHER_* settings."""
    address, metrics_port = f"127.0.0.1:{free_port()}", free_port()
    process = subprocess.Popen(
        serve_command("--listen", address, "--metrics-port", str(metrics_port),
                      "--policy", "adaptive", "--log-level", "warning"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "KVTETHER_ENGINE_FORGET_AFTER_S": str(forget_after_s),
             **(env or {})})
    try:
        wait_serving(address, timeout_s=60)
        with grpc.insecure_channel(address) as channel:
            yield Daemon(label, process, engine_session_pb2_grpc.EngineSessionStub(channel),
                         f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        process.kill()
        process.wait(timeout=30)


def engine_reports(engine_id: str, count: int, rng: random.Random) -> list[pb.StepReport]:
    """A snapshot, then a report a step: a turn arrives every 4 steps, is admitted, and
    finishes with a tool call; each report carries timed work (so the daemon learns
    the engine's step cost) and the engine's counters."""
    reports = []
    for seq in range(1, count + 1):
        now_s = 0.05 * seq
        prefill = rng.choice((0, 0, rng.randint(16, 2048)))
        decode = rng.randint(0, 64)
        report = pb.StepReport(
            engine_id=engine_id, seq=seq, snapshot=seq == 1, now_s=now_s, kv=KV,
            work=pb.StepWork(steps=1, prefill_tokens=prefill, decode_seqs=decode,
                             busy_s=(0.011 + 1.1e-4 * prefill + 1.4e-4 * decode)
                             * rng.uniform(0.95, 1.05)),
            counters=pb.EngineCounters(fallback_steps=seq // 50,
                                       answers_by_lag_steps=[0, seq, seq // 20]))
        turn, phase = divmod(seq - 1, 4)
        request_id = f"{engine_id}/r{turn}"
        if phase == 0:
            report.new_requests.append(pb.NewRequest(
                request_id=request_id, job_id=f"{engine_id}/j{turn % 5}", arrival_s=now_s,
                prompt_tokens=600, state=pb.REQUEST_STATE_WAITING))
        elif phase == 1:
            report.events.append(pb.RequestEvent(request_id=request_id,
                                                 kind=pb.EVENT_KIND_ADMITTED, at_s=now_s))
        elif phase == 3:
            report.events.append(pb.RequestEvent(
                request_id=request_id, kind=pb.EVENT_KIND_FINISHED, at_s=now_s,
                finish_reason=pb.FINISH_REASON_STOP, output_tokens=40, tool="pytest",
                blocks=40))
        reports.append(report)
    return reports


def run_engine(target: Daemon, reports: list[pb.StepReport]) -> None:
    """One session: every report answered in order, then the stream closes."""
    answers = 0
    for answer in target.stub.Session(iter(reports)):
        if answer.resync_requested:
            raise RuntimeError(f"{target.label}: resync asked at seq {answer.seq}")
        answers += 1
    if answers != len(reports):
        raise RuntimeError(f"{target.label}: {answers} answers to {len(reports)} reports")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.churn",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=300)
    parser.add_argument("--reports", type=int, default=150, help="step reports per engine")
    parser.add_argument("--forget-after-s", type=float, default=3.0)
    parser.add_argument("--every", type=int, default=50, help="print every N engines")
    parser.add_argument("--out", type=Path, default=OUT / "churn.json")
    args = parser.parse_args(argv)
    for name, value, least in (("--engines", args.engines, 1), ("--reports", args.reports, 2),
                               ("--every", args.every, 1)):
        if value < least:
            parser.error(f"{name} must be at least {least}, got {value}")
    if not args.forget_after_s > 0:
        parser.error(f"--forget-after-s must be > 0, got {args.forget_after_s}")

    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    with ExitStack() as stack:
        forgets = stack.enter_context(daemon("forgets", args.forget_after_s))
        keeps = stack.enter_context(daemon("keeps", NEVER_S))
        print(f"{'engines':>7} | {'series':>7} {'scrape KiB':>10} {'RSS MiB':>8} (forgets "
              f"after {args.forget_after_s:g} s) | {'series':>7} {'scrape KiB':>10} "
              f"{'RSS MiB':>8} (never forgets)")
        for index in range(1, args.engines + 1):
            reports = engine_reports(f"pod-{index}", args.reports, rng)
            run_engine(forgets, reports)
            run_engine(keeps, reports)
            if index % args.every == 0 or index == args.engines:
                row: dict[str, Any] = {"engines": index, "elapsed_s": time.monotonic() - started,
                       "forgets": forgets.sample(), "keeps": keeps.sample()}
                rows.append(row)
                f, k = row["forgets"], row["keeps"]
                print(f"{index:>7} | {f['engine_series']:>7} {f['scrape_kib']:>10.1f} "
                      f"{f['rss_mib']:>8.1f}{'':>27} | {k['engine_series']:>7} "
                      f"{k['scrape_kib']:>10.1f} {k['rss_mib']:>8.1f}", flush=True)
    last = rows[-1]
    f, k = last["forgets"], last["keeps"]
    print(f"after {last['engines']} engines ({last['elapsed_s']:.0f} s): never forgetting "
          f"keeps {k['engine_series'] / max(f['engine_series'], 1):.1f}x the {{engine_id}} "
          f"series, a {k['scrape_kib'] / f['scrape_kib']:.2f}x larger scrape, "
          f"{k['rss_mib'] - f['rss_mib']:+.1f} MiB RSS")
    write_result(args.out, {
        "command": "python -m benchmarks.churn " + " ".join(argv if argv is not None
                                                           else sys.argv[1:]),
        "engines": args.engines, "reports_per_engine": args.reports,
        "forget_after_s": args.forget_after_s, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
