"""The daemon's sustained step reports per second with 1, 4 and 16 engines feeding it,
for one policy's daemon or several side by side.

Each simulated engine is a process with its own Session stream that replays real
reports (recorded from a plugin engine at 150 running / 200 waiting), renumbered for
its own engine id, as fast as the daemon answers — the way a real engine waits for
each decision. The daemon's CPU time per report gives reports/s per daemon core, which
does not depend on how fast this 2-core machine can run the client processes.
"""

from __future__ import annotations

import math
import multiprocessing
import sys
import time
from typing import Any

import grpc
import psutil

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import engine_session_pb2_grpc


def _engine_process(address: str, engine_id: str, reports: list[bytes], duration_s: float,
                    results: Any) -> None:
    channel = grpc.insecure_channel(address)
    stub = engine_session_pb2_grpc.EngineSessionStub(channel)
    answered = 0
    deadline = time.monotonic() + duration_s

    def stream() -> Any:
        seq = 0
        index = 0
        while time.monotonic() < deadline:
            report = pb.StepReport.FromString(reports[index % len(reports)])
            if index % len(reports) == 0:
                report.snapshot = True  # each replay round starts a fresh session state
            seq += 1
            report.engine_id = engine_id
            report.seq = seq
            index += 1
            yield report
            gate.wait()
            gate.clear()

    import threading

    gate = threading.Event()
    for decision in stub.Session(stream()):
        if decision.resync_requested:
            raise RuntimeError(f"{engine_id}: unexpected resync at seq {decision.seq}")
        answered += 1
        gate.set()
    channel.close()
    results.put(answered)


def measure(address: str, daemon_pid: int, reports: list[bytes], engines: int,
            duration_s: float) -> dict[str, Any]:
    daemon = psutil.Process(daemon_pid)
    results: Any = multiprocessing.Queue()
    processes = [
        multiprocessing.Process(target=_engine_process,
                                args=(address, f"sim-{engines}-{i}", reports, duration_s,
                                      results))
        for i in range(engines)
    ]
    cpu_before = daemon.cpu_times()
    started = time.monotonic()
    for process in processes:
        process.start()
    answered = sum(results.get(timeout=duration_s + 60) for _ in processes)
    for process in processes:
        process.join(timeout=30)
    elapsed_s = time.monotonic() - started
    cpu_after = daemon.cpu_times()
    cpu_s = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    return {
        "engines": engines,
        "reports": answered,
        "elapsed_s": elapsed_s,
        "reports_per_s": answered / elapsed_s,
        "daemon_cpu_s": cpu_s,
        "daemon_cpu_us_per_report": cpu_s / answered * 1e6 if answered else None,
        "reports_per_s_per_daemon_core": answered / cpu_s if cpu_s else None,
        "daemon_rss_mib": daemon.memory_info().rss / 2**20,
    }


ENGINE_COUNTS = (1, 4, 16)


def measure_policies(daemons: dict[str, tuple[str, int]], reports: list[bytes],
                     duration_s: float, rounds: int = 1) -> dict[str, list[dict[str, Any]]]:
    """Per policy, its daemon's throughput (``measure``) with 1, 4 and 16 engines;
    ``daemons`` maps each policy to its daemon's (address, pid). At each engine count
    the policies take turns, ``rounds`` times, so that they share the machine's
    conditions; each point is the round with the median CPU per report, and lists
    every round's CPU per report (``cpu_us_per_report_by_round``)."""
    by_policy: dict[str, list[dict[str, Any]]] = {policy: [] for policy in daemons}
    for count in ENGINE_COUNTS:
        points: dict[str, list[dict[str, Any]]] = {policy: [] for policy in daemons}
        for round_index in range(rounds):
            for policy, (address, pid) in daemons.items():
                print(f"  {policy} daemon throughput with {count} engines "
                      f"(round {round_index + 1}/{rounds})", file=sys.stderr)
                points[policy].append(measure(address, pid, reports, count, duration_s))
        for policy, measured in points.items():
            ranked = sorted(measured, key=_cpu_per_report)
            by_policy[policy].append({
                **ranked[(len(ranked) - 1) // 2], "rounds": rounds,
                "cpu_us_per_report_by_round": [_cpu_per_report(m) for m in measured]})
    return by_policy


def _cpu_per_report(point: dict[str, Any]) -> float:
    cpu_us = point["daemon_cpu_us_per_report"]
    return math.inf if cpu_us is None else float(cpu_us)


def cpu_ratios(by_policy: dict[str, list[dict[str, Any]]]) -> dict[str, list[float | None]]:
    """The first policy's daemon CPU per report over each other's, per engine count:
    ``{"adaptive/continuum": [r1, r4, r16]}`` for policies adaptive, continuum. Each is
    the median of the rounds' ratios, a round's two points measured back to back (a
    load that comes and goes on a shared machine moves both alike)."""
    policies = list(by_policy)
    first = policies[0]
    ratios: dict[str, list[float | None]] = {}
    for other in policies[1:]:
        ratios[f"{first}/{other}"] = [
            _paired_median(mine["cpu_us_per_report_by_round"],
                           theirs["cpu_us_per_report_by_round"])
            for mine, theirs in zip(by_policy[first], by_policy[other], strict=True)]
    return ratios


def _paired_median(mine: list[float], theirs: list[float]) -> float | None:
    ratios = sorted(a / b for a, b in zip(mine, theirs, strict=True)
                    if math.isfinite(a) and math.isfinite(b) and b > 0)
    if not ratios:
        return None
    middle = len(ratios) // 2
    return ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2


def print_throughput(by_policy: dict[str, list[dict[str, Any]]]) -> None:
    print(f"\n{'policy':<14} {'engines':>7} {'reports/s':>10} {'per core':>9} "
          f"{'cpu us/report':>13} {'RSS MiB':>8}")
    for policy, points in by_policy.items():
        for entry in points:
            per_core = entry["reports_per_s_per_daemon_core"]
            cpu_us = entry["daemon_cpu_us_per_report"]
            print(f"{policy:<14} {entry['engines']:>7} {entry['reports_per_s']:>10.0f} "
                  f"{per_core or math.nan:>9.0f} {cpu_us or math.nan:>13.0f} "
                  f"{entry['daemon_rss_mib']:>8.0f}")
    for pair, ratios in cpu_ratios(by_policy).items():
        shown = ", ".join(f"{ratio:.2f} ({count} engines)" if ratio is not None
                          else f"- ({count} engines)"
                          for ratio, count in zip(ratios, ENGINE_COUNTS, strict=True))
        print(f"daemon CPU per report, {pair}: {shown}")
