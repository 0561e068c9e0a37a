"""The daemon's sustained step reports per second with 1, 4 and 16 engines feeding it.

Each simulated engine is a process with its own Session stream that replays real
reports (recorded from a plugin engine at 150 running / 200 waiting), renumbered for
its own engine id, as fast as the daemon answers — the way a real engine waits for
each decision. The daemon's CPU time per report gives reports/s per daemon core, which
does not depend on how fast this 2-core machine can run the client processes.
"""

from __future__ import annotations

import multiprocessing
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
