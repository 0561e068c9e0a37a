"""How late the daemon's answers come back while the engine thread is busy in Python.

A CPU engine steps every 1-2 ms and sends a report at the end of most steps without
waiting for the answer. The report reaches the daemon, and its answer the engine,
through the link's and gRPC's own threads: about five hand-offs of the GIL each way
round. While the engine thread runs Python it keeps the GIL until the switch interval
(Python's default 5 ms) makes it let go, so the link moves a report every few
intervals, falls behind, and the answers queue. On vLLM's CPU engine a quarter of the
answers came 7 or more steps late (a median 24 ms; ``benchmarks/results/engine``).

This replays that with no engine: the real ``DaemonLink`` to a real daemon (fcfs), a
report every ``--period-ms`` from a thread that otherwise spins in Python, each
answer timed from its report's send to the engine thread taking it. Each switch
interval runs in its own process, the intervals taking turns round after round:

    .venv/bin/python -m benchmarks.overhead.link_lag [--period-ms 2] [--reports 400]
        [--intervals-ms 5,0.1] [--rounds 3]

Prints per interval the answers a second the link carried against the reports a
second sent, and the answer latency (p50, p90, p99, max) pooled over the rounds. A
link that carries fewer than were sent falls further behind with every report: its
latency is then a matter of how long the run lasts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence

from benchmarks.common.stats import percentile


def measure(period_s: float, reports: int) -> dict[str, object]:
    """Milliseconds from each report's send to its answer being taken (in send order),
    and the seconds from the first send to the last answer."""
    from sidecar.api.v1 import engine_session_pb2 as pb
    from tests.support.daemon import running_daemon
    from vllm_plugin.link import DaemonLink

    with running_daemon("--policy", "fcfs", "--metrics-port", "-1") as daemon:
        link = DaemonLink(daemon.address)
        deadline = time.monotonic() + 30
        while not link.connected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no connection to the daemon at {daemon.address}")
            time.sleep(0.01)

        def kv(free_blocks: int) -> pb.KvCapacity:
            return pb.KvCapacity(total_blocks=24, free_blocks=free_blocks, block_size_tokens=128)

        link.send(pb.StepReport(engine_id="bench", seq=1, snapshot=True, now_s=time.time(),
                                kv=kv(20)))
        link.take_decisions(5.0)
        sent_at: dict[int, float] = {}
        latency_ms: dict[int, float] = {}
        started = next_send = time.perf_counter()
        seq = 1
        while len(latency_ms) < reports:
            now = time.perf_counter()
            if now >= next_send and seq <= reports:
                seq += 1
                sent_at[seq] = now
                # A free-block count that moves: a report the daemon decides.
                link.send(pb.StepReport(engine_id="bench", seq=seq, now_s=time.time(),
                                        kv=kv(20 - seq % 2)))
                next_send += period_s
            for decision in link.take_decisions(0.0):
                latency_ms[decision.seq] = (time.perf_counter() - sent_at[decision.seq]) * 1e3
            spin_until = time.perf_counter() + 1e-4  # the engine thread, busy in Python
            while time.perf_counter() < spin_until:
                pass
        elapsed_s = time.perf_counter() - started
        link.close()
    return {"latency_ms": [latency_ms[s] for s in sorted(latency_ms)], "elapsed_s": elapsed_s}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--period-ms", type=float, default=2.0, help="a report this often")
    parser.add_argument("--reports", type=int, default=400, help="reports a round")
    parser.add_argument("--intervals-ms", default="5,0.1",
                        help="GIL switch intervals to compare (5: Python's default)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.period_ms <= 0 or args.reports <= 0 or args.rounds <= 0:
        parser.error("--period-ms, --reports and --rounds must be positive")
    if args.worker is not None:  # one interval, in this process
        sys.setswitchinterval(args.worker / 1000.0)
        print(json.dumps(measure(args.period_ms / 1000.0, args.reports)))
        return 0
    try:
        intervals = [float(v) for v in args.intervals_ms.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--intervals-ms: expected numbers, got {args.intervals_ms!r}")
    if not intervals or min(intervals) <= 0:
        parser.error("--intervals-ms: give one or more positive intervals")
    pooled: dict[float, list[float]] = {interval: [] for interval in intervals}
    elapsed_s: dict[float, float] = {interval: 0.0 for interval in intervals}
    for round_index in range(args.rounds):
        for interval in intervals:
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.overhead.link_lag", "--worker", str(interval),
                 "--period-ms", str(args.period_ms), "--reports", str(args.reports)],
                capture_output=True, text=True, check=True, timeout=600)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            pooled[interval] += result["latency_ms"]
            elapsed_s[interval] += result["elapsed_s"]
            print(f"round {round_index + 1}/{args.rounds}, interval {interval:g} ms: done",
                  file=sys.stderr)
    print(f"answer latency, a report every {args.period_ms:g} ms from a thread busy in "
          f"Python ({args.rounds} rounds x {args.reports} reports)")
    print(f"{'GIL switch interval':<22}{'sent/s':>8}{'answered/s':>12}{'p50 ms':>9}{'p90 ms':>9}"
          f"{'p99 ms':>9}{'max ms':>9}")
    for interval, values in pooled.items():
        print(f"{f'{interval:g} ms':<22}{1000.0 / args.period_ms:>8.0f}"
              f"{len(values) / elapsed_s[interval]:>12.0f}" + "".join(
                  f"{percentile(values, q):>9.2f}" for q in (0.5, 0.9, 0.99))
              + f"{max(values):>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
