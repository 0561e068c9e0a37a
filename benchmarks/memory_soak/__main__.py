"""Memory under churn: does the daemon's RSS stay flat while engines come and go and
one-request jobs pass?

    .venv/bin/python -m benchmarks.memory_soak [--duration-s 600] [--jobs 100000]

One real ``kvtether serve`` (adaptive, embedded store; ``--redis-url`` for Redis) with
small bounds, so that they are reached within the warm-up: ``max_jobs_tracked``
(``--max-jobs-tracked``), the embedded store's histories (``--max-histories``) and
``engine_forget_after_s`` (``--forget-after-s``). Every ``--cycle-s`` seconds,
``--engines`` engines with new ids (restarted pods) each open a Session stream, send
a snapshot of ``--live-requests`` running requests of as many jobs, then their share
of the ``--jobs`` one-request jobs (arriving and finishing, 20 a report), and leave
with the snapshot's requests still live. The daemon's RSS (psutil) is sampled every
``--sample-every-s``; the verdict compares the end of the run with the end of the
warm-up (``--warmup-s``): flat if within ``--tolerance`` (10%). Writes
benchmarks/results/memory_soak/memory_soak.json.
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.churn.__main__ import KV, daemon, run_engine
from benchmarks.common.progress import Progress
from benchmarks.common.results import write_result
from sidecar.api.v1 import engine_session_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "memory_soak"
JOBS_PER_REPORT = 20


def engine_reports(engine_id: str, live_requests: int, jobs: int) -> list[pb.StepReport]:
    """A snapshot of ``live_requests`` running requests (jobs of several turns, never
    finished here), then ``jobs`` one-request jobs: each report brings 20 new ones
    and finishes the previous report's."""
    snapshot = pb.StepReport(engine_id=engine_id, seq=1, snapshot=True, now_s=1.0, kv=KV)
    for index in range(live_requests):
        snapshot.new_requests.append(pb.NewRequest(
            request_id=f"{engine_id}/live{index}", job_id=f"{engine_id}/job{index}",
            arrival_s=0.5, prompt_tokens=600, computed_tokens=600,
            state=pb.REQUEST_STATE_RUNNING))
    reports = [snapshot]
    previous: list[str] = []
    for first in range(0, jobs + JOBS_PER_REPORT, JOBS_PER_REPORT):
        seq = len(reports) + 1
        now_s = 1.0 + 0.05 * seq
        report = pb.StepReport(engine_id=engine_id, seq=seq, now_s=now_s, kv=KV)
        for request_id in previous:
            report.events.append(pb.RequestEvent(
                request_id=request_id, kind=pb.EVENT_KIND_FINISHED, at_s=now_s,
                finish_reason=pb.FINISH_REASON_STOP, output_tokens=40, blocks=4))
        # No job id: each request is a job of its own.
        previous = [f"{engine_id}/one{index}"
                    for index in range(first, min(first + JOBS_PER_REPORT, jobs))]
        for request_id in previous:
            report.new_requests.append(pb.NewRequest(
                request_id=request_id, arrival_s=now_s, prompt_tokens=300,
                state=pb.REQUEST_STATE_WAITING))
        reports.append(report)
    return reports


class RssSampler(threading.Thread):
    """The daemon's RSS every ``every_s``, with the traffic sent so far."""

    def __init__(self, pid: int, every_s: float, progress: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self._process = psutil.Process(pid)
        self._every_s = every_s
        self._progress = progress
        self._stopping = threading.Event()
        self.started_s = time.monotonic()
        self.samples: list[dict[str, float]] = []

    def sample(self) -> None:
        self.samples.append({"t_s": round(time.monotonic() - self.started_s, 2),
                             "rss_mib": round(self._process.memory_info().rss / 2**20, 2),
                             **self._progress})

    def run(self) -> None:
        while not self._stopping.wait(self._every_s):
            self.sample()

    def stop(self) -> None:
        self._stopping.set()
        self.join()
        self.sample()


def summarize(samples: list[dict[str, float]], warmup_s: float,
              tolerance: float) -> dict[str, Any]:
    """RSS at the end of the warm-up (the last sample within it) and at the end, the
    maximum after the warm-up, and whether the end is within ``tolerance`` of the
    warm-up's end."""
    warm = [s for s in samples if s["t_s"] <= warmup_s] or samples[:1]
    after = [s for s in samples if s["t_s"] > warmup_s] or samples[-1:]
    warmup_mib, end_mib = warm[-1]["rss_mib"], samples[-1]["rss_mib"]
    return {"warmup_end_rss_mib": warmup_mib, "end_rss_mib": end_mib,
            "max_rss_mib": max(s["rss_mib"] for s in after),
            "start_rss_mib": samples[0]["rss_mib"],
            "growth_after_warmup": round(end_mib / warmup_mib - 1, 4),
            "tolerance": tolerance, "flat": end_mib <= warmup_mib * (1 + tolerance)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory_soak",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--cycle-s", type=float, default=10.0,
                        help="engines connect and disconnect this often")
    parser.add_argument("--engines", type=int, default=5, help="engines a cycle")
    parser.add_argument("--live-requests", type=int, default=150,
                        help="requests each engine holds when it leaves")
    parser.add_argument("--jobs", type=int, default=100_000,
                        help="one-request jobs over the run")
    parser.add_argument("--max-jobs-tracked", type=int, default=1_000)
    parser.add_argument("--max-histories", type=int, default=10_000,
                        help="store.embedded_max_histories; 0 leaves the daemon's default")
    parser.add_argument("--forget-after-s", type=float, default=30.0)
    parser.add_argument("--redis-url", default="", help="run on Redis instead")
    parser.add_argument("--sample-every-s", type=float, default=5.0)
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--out", type=Path, default=OUT / "memory_soak.json")
    args = parser.parse_args(argv)
    for name, value in (("--duration-s", args.duration_s), ("--cycle-s", args.cycle_s),
                        ("--sample-every-s", args.sample_every_s),
                        ("--forget-after-s", args.forget_after_s)):
        if not value > 0:
            parser.error(f"{name} must be > 0, got {value}")
    if not 0 <= args.warmup_s < args.duration_s:
        parser.error(f"--warmup-s must be in [0, --duration-s), got {args.warmup_s}")
    for name, value, least in (("--engines", args.engines, 1),
                               ("--live-requests", args.live_requests, 0),
                               ("--jobs", args.jobs, 0),
                               ("--max-jobs-tracked", args.max_jobs_tracked, 1),
                               ("--max-histories", args.max_histories, 0)):
        if value < least:
            parser.error(f"{name} must be at least {least}, got {value}")

    cycles = max(1, math.floor(args.duration_s / args.cycle_s))
    jobs_per_engine = math.ceil(args.jobs / (cycles * args.engines))
    env = {"KVTETHER_MAX_JOBS_TRACKED": str(args.max_jobs_tracked)}
    if args.max_histories:
        env["KVTETHER_STORE__EMBEDDED_MAX_HISTORIES"] = str(args.max_histories)
    if args.redis_url:
        env["KVTETHER_STORE__REDIS_URL"] = args.redis_url
    progress = {"engines": 0, "one_request_jobs": 0}
    with daemon("memory-soak", args.forget_after_s, env) as target:
        sampler = RssSampler(target.process.pid, args.sample_every_s, progress)
        sampler.sample()
        sampler.start()
        print(f"{cycles} cycles of {args.cycle_s:g} s: {args.engines} engines with "
              f"{args.live_requests} live requests and {jobs_per_engine} one-request jobs "
              f"each", flush=True)
        cycles_done = Progress("memory soak", total=cycles, unit="cycle")
        for cycle in range(cycles):
            cycle_end_s = sampler.started_s + (cycle + 1) * args.cycle_s
            for index in range(args.engines):
                run_engine(target, engine_reports(f"pod-{cycle}-{index}",
                                                  args.live_requests, jobs_per_engine))
                progress["engines"] += 1
                progress["one_request_jobs"] += jobs_per_engine
            behind_s = time.monotonic() - cycle_end_s
            if behind_s > 0:
                print(f"cycle {cycle} ran {behind_s:.1f} s past its {args.cycle_s:g} s",
                      flush=True)
            else:
                time.sleep(-behind_s)
            last = sampler.samples[-1] if sampler.samples else None
            cycles_done.round_done(f"{progress['engines']} engines, "
                                   f"{progress['one_request_jobs']} one-request jobs"
                                   + (f", RSS {last['rss_mib']:.1f} MiB" if last else ""),
                                   advance=1)
            if last is not None and (cycle + 1) % max(1, cycles // 10) == 0:
                print(f"{last['t_s']:>7.0f} s  engines {progress['engines']:>5}  one-request "
                      f"jobs {progress['one_request_jobs']:>7}  RSS {last['rss_mib']:.1f} MiB",
                      flush=True)
        cycles_done.close()
        sampler.stop()
    summary = summarize(sampler.samples, args.warmup_s, args.tolerance)
    print(f"RSS {summary['start_rss_mib']:.1f} MiB at start, "
          f"{summary['warmup_end_rss_mib']:.1f} MiB at the end of the {args.warmup_s:g} s "
          f"warm-up, {summary['end_rss_mib']:.1f} MiB at the end (max "
          f"{summary['max_rss_mib']:.1f} MiB after the warm-up): "
          f"{summary['growth_after_warmup']:+.1%} -> "
          f"{'flat' if summary['flat'] else 'GROWS'} (tolerance {args.tolerance:.0%})")
    write_result(args.out, {
        "command": "python -m benchmarks.memory_soak " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "store": "redis" if args.redis_url else "embedded",
        "settings": {"max_jobs_tracked": args.max_jobs_tracked,
                     "embedded_max_histories": args.max_histories or None,
                     "engine_forget_after_s": args.forget_after_s},
        "cycles": cycles, "cycle_s": args.cycle_s, "engines_per_cycle": args.engines,
        "live_requests": args.live_requests, "jobs_per_engine": jobs_per_engine,
        "engines": progress["engines"], "one_request_jobs": progress["one_request_jobs"],
        "summary": summary, "samples": sampler.samples})
    return 0


if __name__ == "__main__":
    sys.exit(main())
