"""The daemon's decision path alone, replayed in one process: CPU per step report.

``python -m benchmarks.overhead`` records the reports a plugin engine sends at 150
running / 200 waiting (``reports.bin`` beside its JSON). This replays them through the
daemon's own ``EngineRegistry`` (mirror, decider, policy, decision log, job tracker,
an embedded store written in the background) with no gRPC and no other process, so a
change to the decision path can be timed without the noise of the 2 shared cores:

    .venv/bin/python benchmarks/overhead/decide_replay.py REPORTS.bin --policy adaptive \\
        [--tree OTHER_CHECKOUT ...] [--rounds 6] [--passes 3]

Each tree (the working tree first, then every ``--tree``) replays the same reports in
its own process, the trees taking turns round after round; a round is ``--passes``
passes over the reports, each starting from a snapshot. It prints per tree the CPU per
report (median over the rounds) of the decision and of the store writes it queued,
and each other tree's decision CPU over the first's, paired by round (mean +-
standard error).

Run as a script (not ``-m``): a worker imports ``sidecar`` from the tree it times,
which need not have this file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
_LENGTH = struct.Struct(">I")


def write_reports(path: Path, reports: list[bytes]) -> None:
    """Serialized step reports, each after its 4-byte big-endian length."""
    with path.open("wb") as out:
        for report in reports:
            out.write(_LENGTH.pack(len(report)))
            out.write(report)


def read_reports(path: Path) -> list[bytes]:
    data = path.read_bytes()
    reports, offset = [], 0
    while offset < len(data):
        if offset + _LENGTH.size > len(data):
            raise ValueError(f"{path}: truncated length at byte {offset}")
        (length,) = _LENGTH.unpack_from(data, offset)
        offset += _LENGTH.size
        if offset + length > len(data):
            raise ValueError(f"{path}: report at byte {offset} runs past the end")
        reports.append(data[offset:offset + length])
        offset += length
    if not reports:
        raise ValueError(f"{path}: no reports")
    return reports


async def _replay(reports: list[bytes], policy_name: str, passes: int) -> dict[str, float]:
    from sidecar.api.v1 import engine_session_pb2 as pb
    from sidecar.estimators.tool_time import ToolTimeEstimator
    from sidecar.jobs import JobTracker
    from sidecar.policies.registry import build_policy
    from sidecar.runtime.decider import Decider, DecisionLog
    from sidecar.runtime.engines import EngineRegistry
    from sidecar.runtime.recorder import Recorder
    from sidecar.store.embedded import EmbeddedStore

    store = EmbeddedStore()
    recorder = Recorder(store, JobTracker(), ToolTimeEstimator(store), 10_000, 3600.0)
    writer = asyncio.get_running_loop().create_task(recorder.run())
    engines = EngineRegistry(Decider(build_policy(policy_name, {}), recorder, DecisionLog()))
    decide_s = writes_s = 0.0
    seq = 0
    for _ in range(passes):
        for index, raw in enumerate(reports):
            report = pb.StepReport.FromString(raw)
            report.snapshot = index == 0  # each pass starts a fresh session state
            seq += 1
            report.seq = seq
            started = time.process_time()
            decision = engines.handle(report)
            decide_s += time.process_time() - started
            if decision.resync_requested:
                raise RuntimeError(f"unexpected resync at seq {seq}")
            started = time.process_time()
            if not await recorder.drain(30.0):
                raise RuntimeError("store writes did not drain")
            writes_s += time.process_time() - started
    writer.cancel()
    count = passes * len(reports)
    return {"decide_us_per_report": decide_s / count * 1e6,
            "writes_us_per_report": writes_s / count * 1e6, "reports": count}


def _worker(args: argparse.Namespace) -> int:
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    result = asyncio.run(_replay(read_reports(args.reports), args.policy, args.passes))
    print(json.dumps(result))
    return 0


def _run_worker(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, str(HERE), str(args.reports.resolve()), "--policy", args.policy,
         "--passes", str(args.passes), "--worker"],
        cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"worker in {tree} failed:\n{done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=Path, help="reports.bin from benchmarks.overhead")
    parser.add_argument("--policy", default="adaptive")
    parser.add_argument("--tree", type=Path, action="append", default=[],
                        help="another checkout to time side by side (repeatable)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    trees = [ROOT, *(tree.resolve() for tree in args.tree)]
    for tree in trees:
        if not (tree / "sidecar").is_dir():
            parser.error(f"--tree {tree}: no sidecar/ package there")
    runs: dict[Path, list[dict[str, float]]] = {tree: [] for tree in trees}
    for round_index in range(args.rounds):
        for tree in trees:
            runs[tree].append(_run_worker(tree, args))
        print(f"  round {round_index + 1}/{args.rounds}: " + ", ".join(
            f"{runs[tree][-1]['decide_us_per_report']:.0f}" for tree in trees)
            + " us a report", file=sys.stderr)
    reports = runs[ROOT][0]["reports"]
    print(f"policy {args.policy}, {reports:.0f} reports a round, {args.rounds} rounds; "
          "CPU a report, median over the rounds")
    print(f"{'tree':<40} {'decide us':>10} {'writes us':>10} {'reports/s/core':>15}")
    for tree in trees:
        decide = statistics.median(r["decide_us_per_report"] for r in runs[tree])
        writes = statistics.median(r["writes_us_per_report"] for r in runs[tree])
        print(f"{tree!s:<40} {decide:>10.0f} {writes:>10.0f} {1e6 / (decide + writes):>15.0f}")
    first = runs[ROOT]
    for tree in trees[1:]:
        ratios = [other["decide_us_per_report"] / mine["decide_us_per_report"]
                  for mine, other in zip(first, runs[tree], strict=True)]
        error = (statistics.stdev(ratios) / math.sqrt(len(ratios))) if len(ratios) > 1 else 0.0
        print(f"decision CPU, {tree} / {ROOT}: {statistics.mean(ratios):.3f} +- {error:.3f} "
              "(paired by round)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
