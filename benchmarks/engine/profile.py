"""Where vLLM's engine core spends its Python time during an engine benchmark: attach
py-spy to the ``EngineCore`` process, then sum the samples by component.

    .venv/bin/python -m pip install -e '.[dev,profile]'     # py-spy
    .venv/bin/python -m benchmarks.engine.profile record --out fcfs.txt &
    .venv/bin/python -m benchmarks.engine --policies fcfs --rounds 3 --default-hardware
    .venv/bin/python -m benchmarks.engine.profile summary fcfs.txt adaptive.txt

``record`` waits for the engine core to start, samples it without stopping it
(``--nonblocking``) until it exits, and writes py-spy's raw format (one collapsed
stack and its sample count per line). Run one policy per benchmark run: the samples
carry no time, so a run of several policies cannot be split afterwards. Only Python
threads are sampled; the model itself runs in vLLM's worker process.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

# Component -> a test on one frame ("function (file:line)"); a stack counts for every
# component one of its frames matches, "spin" only by its innermost frame.
COMPONENTS: dict[str, Callable[[str], bool]] = {
    "plugin": lambda frame: "vllm_plugin/" in frame,
    "grpc": lambda frame: "grpc/" in frame,
}
# vLLM's shared-memory queue: the engine core waits on its worker by spinning.
SPIN_LEAVES = ("sched_yield", "SpinCondition.wait")


def summarize(lines: Iterable[str]) -> dict[str, float]:
    """Samples in total and each component's share of them, from py-spy raw lines."""
    total = 0
    counts: collections.Counter[str] = collections.Counter()
    for line in lines:
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        for name, matches in COMPONENTS.items():
            if any(matches(frame) for frame in frames):
                counts[name] += count
        if frames[-1].startswith(SPIN_LEAVES):
            counts["spin"] += count
    shares: dict[str, float] = {"samples": float(total)}
    for name in (*COMPONENTS, "spin"):
        shares[name] = counts[name] / total if total else 0.0
    return shares


def _engine_core_pid(timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = subprocess.run(["pgrep", "-f", "EngineCore"], capture_output=True, text=True)
        pids = [int(pid) for pid in found.stdout.split()]
        if pids:
            return min(pids)
        time.sleep(1.0)
    raise SystemExit(f"no vLLM EngineCore process appeared within {timeout_s:g} s")


def record(out: Path, rate_hz: int, timeout_s: float) -> int:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise SystemExit("py-spy is not installed: .venv/bin/python -m pip install "
                         "'kvtether[profile]'")
    pid = _engine_core_pid(timeout_s)
    time.sleep(2.0)  # let the process finish starting: py-spy reads its interpreter
    print(f"recording vLLM EngineCore pid {pid} into {out}", file=sys.stderr)
    return subprocess.call([py_spy, "record", "--pid", str(pid), "--rate", str(rate_hz),
                            "--nonblocking", "--threads", "--format", "raw",
                            "-o", str(out)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="sample the engine core until it exits")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--rate", type=int, default=50, help="samples a second")
    rec.add_argument("--wait-s", type=float, default=600.0,
                     help="how long to wait for the engine core to start")
    summary = sub.add_parser("summary", help="share of samples by component")
    summary.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args()
    if args.command == "record":
        return record(args.out, args.rate, args.wait_s)
    print(f"{'file':<28}{'samples':>9}{'plugin':>9}{'grpc':>9}{'spin':>9}")
    for path in args.files:
        with path.open() as lines:
            shares = summarize(lines)
        print(f"{path.name:<28}{shares['samples']:>9.0f}{shares['plugin']:>9.1%}"
              f"{shares['grpc']:>9.1%}{shares['spin']:>9.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
