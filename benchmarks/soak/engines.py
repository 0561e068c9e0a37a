"""One simulated engine per process, paced like a real one: a step every
1/``steps_per_s`` seconds, its report sent on a Session stream, the decision applied.

Latency is measured at the client, from just before the report is written to the
stream to the moment its decision is read. An engine that falls behind its schedule
(the machine is busy) skips the missed ticks and counts them, as a real engine's steps
do not wait for the daemon.
"""

from __future__ import annotations

import asyncio
import resource
import time
from array import array
from dataclasses import asdict
from typing import Any

import grpc

from sidecar.api.v1 import engine_session_pb2_grpc
from tests.support.simulated_engine import SimulatedEngine, WorkloadShape

# A real engine would have fallen back to vLLM's own scheduling long before: here an
# answer this late is an error, and the engine opens a new stream.
ANSWER_TIMEOUT_S = 10.0


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"no answer within {ANSWER_TIMEOUT_S:g} s"


def run_engine(address: str, engine_id: str, seed: int, shape: WorkloadShape,
               steps_per_s: float, start_at: float, duration_s: float, results: Any) -> None:
    """Process entry: runs until ``start_at + duration_s`` (wall clock), then puts its
    samples on ``results``."""
    results.put(asyncio.run(_run(address, engine_id, seed, shape, steps_per_s, start_at,
                                 duration_s)))


async def _run(address: str, engine_id: str, seed: int, shape: WorkloadShape,
               steps_per_s: float, start_at: float, duration_s: float) -> dict[str, Any]:
    engine = SimulatedEngine(engine_id, seed=seed, shape=shape)
    # Wall-clock offsets of each answered report from start_at, and its latency (s).
    sent_at = array("d")
    latency = array("d")
    errors: list[str] = []
    skipped_ticks = 0
    tick_s = 1.0 / steps_per_s
    await asyncio.sleep(max(0.0, start_at - time.time()))
    origin = time.monotonic()
    end = origin + duration_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_session_pb2_grpc.EngineSessionStub(channel)
        call = stub.Session()
        tick = 0
        while True:
            due = origin + tick * tick_s
            now = time.monotonic()
            if now >= end:
                break
            if due > now:
                await asyncio.sleep(due - now)
            elif now - due > tick_s:  # more than a whole tick late: skip what was missed
                missed = int((now - due) / tick_s)
                skipped_ticks += missed
                tick += missed
            engine_now_s = time.monotonic() - origin
            report = engine.step(engine_now_s)
            started = time.perf_counter()
            try:
                await call.write(report)
                decision = await asyncio.wait_for(call.read(), ANSWER_TIMEOUT_S)
            except (grpc.aio.AioRpcError, TimeoutError) as error:
                errors.append(f"{engine_now_s:.1f}s {_describe(error)}")
                call.cancel()
                call = stub.Session()  # a new stream: the daemon asks for a snapshot
                tick += 1
                continue
            if decision is grpc.aio.EOF:
                errors.append(f"{engine_now_s:.1f}s stream ended by the daemon")
                call = stub.Session()
                tick += 1
                continue
            latency.append(time.perf_counter() - started)
            sent_at.append(engine_now_s)
            if decision.seq != report.seq:
                errors.append(f"{engine_now_s:.1f}s answer for seq {decision.seq}, "
                              f"sent {report.seq}")
            engine.apply(decision)
            tick += 1
        await call.done_writing()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"engine_id": engine_id, "process_cpu_s": usage.ru_utime + usage.ru_stime,
            "sent_at": sent_at.tobytes(),
            "latency": latency.tobytes(), "errors": errors, "skipped_ticks": skipped_ticks,
            "counters": asdict(engine.counters), "live_jobs_at_end": engine.live_jobs}
