"""``python -m benchmarks.twin run|sweep|calibrate|workload`` — see README.md."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.common.progress import Progress
from benchmarks.common.results import describe_machine, provenance, write_json, write_result
from benchmarks.twin import workload as wl
from benchmarks.twin.calibration import calibrate_once
from benchmarks.twin.point import make_workload, run_point
from benchmarks.twin.steptime import LLAMA_31_8B, RTX_5090, Efficiency, StepTimeModel
from sidecar.policies.registry import available_policies

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "twin"
# Every registered policy (sidecar/policies/registry.py): a new one is swept too.
SWEEP_POLICIES = available_policies()
SWEEP_JPS = (1.0, 2.0, 4.0, 8.0, 12.0)
SWEEP_BLOCKS = (5402, 3000, 9000, 13000)
# --quick: CI scale, a few seconds a point.
QUICK_DURATION_S = 15.0
QUICK_JPS = (2.0, 8.0)


# --- one point ------------------------------------------------------------------------

def _efficiency(args: argparse.Namespace) -> Efficiency:
    eff = Efficiency()
    changes = {}
    if args.mfu is not None:
        changes["mfu"] = args.mfu
    if args.bandwidth_efficiency is not None:
        changes["bandwidth_efficiency"] = args.bandwidth_efficiency
    if args.step_overhead_ms is not None:
        changes["step_overhead_s"] = args.step_overhead_ms / 1000
    if args.per_seq_overhead_us is not None:
        changes["per_seq_overhead_s"] = args.per_seq_overhead_us / 1e6
    return replace(eff, **changes)


def cmd_run(args: argparse.Namespace) -> int:
    if args.workload is not None:
        workload = wl.load(args.workload)
        jobs_per_s = float(workload.generator.get("jobs_per_s", args.jps))
    else:
        workload = make_workload(args.kind, args.jps, args.seed,
                                 QUICK_DURATION_S if args.quick else args.duration_s,
                                 args.jobs, args.answer_agreement)
        jobs_per_s = args.jps
    summary, wall_s = run_point(workload, args.policy, jobs_per_s, args.blocks,
                                _efficiency(args), args.param, progress=not args.quiet)
    if args.out is not None:
        write_json(args.out, summary, compact=True)
    brief = {k: summary[k] for k in ("policy", "jps", "num_jobs", "avg_duration_s",
                                     "median_duration_s", "p90_duration_s", "p95_duration_s",
                                     "prefix_cache_hit_rate", "preemptions",
                                     "pinned_blocks_max")}
    print(json.dumps({**brief, "wall_s": round(wall_s, 1)}))
    return 0


# --- sweep ----------------------------------------------------------------------------

def machine_info() -> dict[str, Any]:
    """What a sweep or calibration ran with and on: :func:`provenance` and vLLM's version."""
    import vllm

    return {**provenance(), "vllm": vllm.__version__}


def _point_path(out_dir: Path, label: str, blocks: int, policy: str, jps: float) -> Path:
    return out_dir / "points" / label / f"blocks{blocks}" / f"{policy}-{jps:g}jps.json"


def cmd_sweep(args: argparse.Namespace) -> int:
    out_dir: Path = args.out_dir
    label = args.label or (f"{args.kind}" + (f"-agree{args.answer_agreement:g}"
                                             if args.answer_agreement else ""))
    if args.seed and not args.label:
        label += f"-seed{args.seed}"
    if args.quick:
        label += "-quick"
    jps_list = args.jps or (QUICK_JPS if args.quick else SWEEP_JPS)
    blocks_list = args.blocks or ((5402,) if args.quick else SWEEP_BLOCKS)
    duration_s = QUICK_DURATION_S if args.quick else args.duration_s
    efficiency = _efficiency(args)
    timings_path = out_dir / "points" / label / "timings.json"
    timings: dict[str, float] = (json.loads(timings_path.read_text())
                                 if timings_path.exists() else {})
    command = "python -m benchmarks.twin " + " ".join(sys.argv[1:])
    # Points already written are kept (unless --force): the progress counts the others.
    todo = [(blocks, jps, policy) for blocks in blocks_list for jps in jps_list
            for policy in args.policies
            if args.force or not _point_path(out_dir, label, blocks, policy, jps).exists()]
    workload, workload_key = None, None
    with Progress(f"twin sweep {label}", total=len(todo), unit="point") as progress:
        for blocks, jps, policy in todo:
            if workload is None or workload_key != (blocks, jps):
                workload = make_workload(args.kind, jps, args.seed, duration_s, None,
                                         args.answer_agreement)
                workload_key = (blocks, jps)
            started = time.perf_counter()
            summary, _ = run_point(workload, policy, jps, blocks, efficiency,
                                   progress=args.progress)
            elapsed = time.perf_counter() - started
            write_json(_point_path(out_dir, label, blocks, policy, jps), summary, compact=True)
            timings[f"blocks{blocks}/{policy}-{jps:g}jps"] = round(elapsed, 1)
            write_json(timings_path, timings)
            progress.round_done(
                f"blocks={blocks} {policy} {jps:g} jps: avg {summary['avg_duration_s']} s, "
                f"hit {summary['prefix_cache_hit_rate']}, preemptions "
                f"{summary['preemptions']} ({elapsed:.0f} s)", advance=1)
    meta_path = out_dir / "points" / label / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"runs": []}
    meta.update({"label": label, "kind": args.kind, "answer_agreement": args.answer_agreement,
                 "seed": args.seed, "duration_s": duration_s,
                 "efficiency": asdict(efficiency)})
    # Every invocation that wrote points here, in order (a label fills up over several).
    meta["runs"].append({"command": command, **machine_info(), "policies": list(args.policies),
                         "jps": list(jps_list), "blocks": list(blocks_list)})
    write_json(meta_path, meta)
    _render(out_dir, label)
    return 0


def _render(out_dir: Path, label: str) -> None:
    from benchmarks.twin.plots import load_points, plot_sweep, plot_timeseries, write_summary

    write_summary(out_dir, label)
    plot_sweep(out_dir, label)
    points = load_points(out_dir, label)
    for blocks, jps in sorted({(p["_blocks"], p["jps"]) for p in points}):
        if blocks == 5402 and jps in (8.0, 12.0):
            plot_timeseries(out_dir, label, blocks, jps)


def cmd_plot(args: argparse.Namespace) -> int:
    _render(args.out_dir, args.label)
    return 0


# --- calibration ----------------------------------------------------------------------

def _calibration_markdown(report: dict[str, Any]) -> str:
    lines = ["# FCFS calibration of the twin", "",
             f"- command: `{report['command']}`",
             f"- kvtether {report['kvtether_git_rev']}, vLLM {report['vllm']}, "
             f"Python {report['python']}; {describe_machine(report['machine'])}; "
             f"{report['date_utc']}",
             f"- step-time model: {json.dumps(report['step_time_model'])}",
             f"- efficiencies: {json.dumps(report['efficiency'])}",
             f"- answer lengths (tokens, mean per turn): "
             f"{json.dumps(report['answer_tokens'])}", ""]
    for case in report["cases"]:
        lines += [f"## {case['policy']}, answer_agreement {case['answer_agreement']:g}, "
                  f"seed {case['seed']}: {case['within_10_pct']}/{case['figures']} within "
                  f"10%, mean |off| {case['mean_abs_off_pct']}%", "",
                  "| jobs/s | figure | target (RTX 5090) | twin | off |", "|---|---|---|---|---|"]
        for row in case["rows"]:
            lines.append(f"| {row['jps']:g} | {row['figure']} | {row['target']:g} | "
                         f"{row['twin']:g} | {row['off_pct']:+.1f}% |")
        for jps, run in case["runs"].items():
            lines.append("")
            lines.append(f"{jps} jobs/s: {run['num_jobs']} jobs, prefix-cache hit "
                         f"{run['prefix_cache_hit_rate']}, preemptions {run['preemptions']}, "
                         f"KV usage avg {run['kv_usage_avg']}, jobs in flight avg "
                         f"{run['jobs_in_flight_avg']} (max {run['jobs_in_flight_max']}).")
        lines.append("")
    return "\n".join(lines)


def cmd_calibrate(args: argparse.Namespace) -> int:
    efficiency = _efficiency(args)
    if args.fit:
        from benchmarks.twin.fit import fit

        start = {k + 1: spec.output_tokens_mean for k, spec in enumerate(wl.REFERENCE_TURNS)}
        best = fit(efficiency, start)
        best.pop("results")
        print(json.dumps(best))
        print("Put answer_tokens into REFERENCE_TURNS and answer_agreement into "
              "REFERENCE_ANSWER_AGREEMENT (benchmarks/twin/workload.py), then run calibrate.")
        return 0
    agreement = (wl.REFERENCE_ANSWER_AGREEMENT if args.answer_agreement is None
                 else args.answer_agreement)
    cases = [calibrate_once(args.policy, agreement, seed, efficiency, args.progress)
             for seed in args.seeds]
    if args.distinct:
        cases.append(calibrate_once(args.policy, 0.0, args.seeds[0], efficiency,
                                    args.progress))
    step_model = StepTimeModel.derive(RTX_5090, LLAMA_31_8B, efficiency)
    report = {
        "cases": cases,
        "efficiency": asdict(efficiency),
        "step_time_model": step_model.as_dict(),
        "answer_tokens": {k + 1: spec.output_tokens_mean
                          for k, spec in enumerate(wl.REFERENCE_TURNS)},
        "vllm": machine_info()["vllm"],
        "command": "python -m benchmarks.twin " + " ".join(sys.argv[1:]),
    }
    for case in cases:
        print(f"{case['policy']}, answer_agreement {case['answer_agreement']:g}, "
              f"seed {case['seed']}:")
        print(f"{'jps':>4}  {'figure':38s} {'target':>8} {'twin':>8} {'off':>7}")
        for row in case["rows"]:
            print(f"{row['jps']:4g}  {row['figure']:38s} {row['target']:8g} "
                  f"{row['twin']:8g} {row['off_pct']:+6.1f}%")
        print(f"{case['within_10_pct']}/{case['figures']} figures within 10%\n")
    if args.out_dir is not None:
        name = f"calibration-{args.policy}"
        document = write_result(args.out_dir / f"{name}.json", report)
        (args.out_dir / f"{name}.md").write_text(_calibration_markdown(document))
    return 0


# --- workload files -------------------------------------------------------------------

def cmd_workload(args: argparse.Namespace) -> int:
    if args.action == "check":
        try:
            loaded = wl.load(args.file)
        except wl.WorkloadError as error:
            print(f"{args.file}: {error}", file=sys.stderr)
            return 2
        turns = sum(len(j.turns) for j in loaded.jobs)
        print(f"{args.file}: ok, {len(loaded.jobs)} jobs, {turns} turns, longest context "
              f"{loaded.max_context_tokens} tokens")
        return 0
    workload = make_workload(args.kind, args.jps, args.seed, args.duration_s, args.jobs,
                             args.answer_agreement)
    workload.save(args.file)
    print(f"{args.file}: {len(workload.jobs)} jobs")
    return 0


# --- parser ---------------------------------------------------------------------------

def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("step-time model (defaults: the FCFS calibration)")
    group.add_argument("--mfu", type=float)
    group.add_argument("--bandwidth-efficiency", type=float)
    group.add_argument("--step-overhead-ms", type=float)
    group.add_argument("--per-seq-overhead-us", type=float)


def _add_workload_flags(parser: argparse.ArgumentParser, single: bool = True) -> None:
    parser.add_argument("--kind", choices=sorted(wl.GENERATORS), default="reference")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--answer-agreement", type=float, default=0.0,
                        help="0: jobs share no token (default); p: one script, each short "
                             "answer the common one with probability p")
    parser.add_argument("--duration-s", type=float, default=100.0,
                        help="arrival window (default 100 s)")
    if single:
        parser.add_argument("--jobs", type=int, help="exactly this many jobs instead")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.twin", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="one policy at one load")
    run.add_argument("--policy", choices=("native", *SWEEP_POLICIES), required=True)
    run.add_argument("--jps", type=float, default=8.0, help="job arrivals per second")
    run.add_argument("--blocks", type=int, default=5402, help="KV cache blocks of 16 tokens")
    run.add_argument("--workload", type=Path, help="replay this workload file instead")
    run.add_argument("--param", action="append", default=[],
                     help="policy parameter KEY=VALUE for kvtether serve")
    run.add_argument("--out", type=Path, help="write the result JSON here")
    run.add_argument("--quick", action="store_true", help=f"{QUICK_DURATION_S:g} s of arrivals")
    run.add_argument("--quiet", action="store_true")
    _add_workload_flags(run)
    _add_model_flags(run)

    sweep = commands.add_parser("sweep", help="policies x jobs/s x KV sizes, plots, summary")
    sweep.add_argument("--policies", nargs="+", default=list(SWEEP_POLICIES),
                       choices=("native", *SWEEP_POLICIES))
    sweep.add_argument("--jps", type=float, nargs="+")
    sweep.add_argument("--blocks", type=int, nargs="+")
    sweep.add_argument("--out-dir", type=Path, default=RESULTS)
    sweep.add_argument("--label", help="results sub-folder (default: the workload's name)")
    sweep.add_argument("--quick", action="store_true",
                       help=f"CI scale: {QUICK_DURATION_S:g} s of arrivals, 2 and 8 jps, "
                            "5402 blocks")
    sweep.add_argument("--force", action="store_true", help="re-run points already written")
    sweep.add_argument("--progress", action="store_true")
    _add_workload_flags(sweep, single=False)
    _add_model_flags(sweep)

    calibrate = commands.add_parser("calibrate", help="FCFS against the RTX 5090 figures")
    calibrate.add_argument("--policy", choices=("native", "fcfs"), default="native",
                           help="native: vLLM's own FCFS; fcfs: through kvtether")
    calibrate.add_argument("--answer-agreement", type=float,
                           help=f"default: the fitted {wl.REFERENCE_ANSWER_AGREEMENT}")
    calibrate.add_argument("--seeds", type=int, nargs="+", default=[0])
    calibrate.add_argument("--distinct", action="store_true",
                           help="also run jobs that share nothing (answer_agreement 0)")
    calibrate.add_argument("--fit", action="store_true",
                           help="fit answer lengths and agreement (slow; native FCFS only)")
    calibrate.add_argument("--out-dir", type=Path, default=RESULTS)
    calibrate.add_argument("--progress", action="store_true")
    _add_model_flags(calibrate)

    plot = commands.add_parser("plot", help="re-render a sweep's summary and plots")
    plot.add_argument("label", help="the sweep's results sub-folder, e.g. reference")
    plot.add_argument("--out-dir", type=Path, default=RESULTS)

    pack = commands.add_parser(
        "pack", help="pack swept labels into points/<label>.json.xz, the form git keeps")
    pack.add_argument("labels", nargs="+", help="sweep labels, e.g. reference-agree0.966")
    pack.add_argument("--out-dir", type=Path, default=RESULTS)

    criteria = commands.add_parser(
        "criteria", help="the adaptive policy's acceptance criteria on swept labels")
    criteria.add_argument("labels", nargs="+", help="sweep labels, e.g. reference-agree0.966")
    criteria.add_argument("--tolerance", type=float, default=0.02,
                          help="noise band on the average-duration ratio (default 2%%)")
    criteria.add_argument("--out-dir", type=Path, default=RESULTS)
    criteria.add_argument("--out", type=Path, help="also write the report here (Markdown)")

    cpu = commands.add_parser(
        "cpu", help="the real-engine benchmark's setup (vLLM's CPU build) over seeds")
    cpu.add_argument("--like", type=Path,
                     help="a benchmarks.engine result: its workload, its FCFS's learned "
                          "step costs, time outside vLLM's scheduler and median decision "
                          "lag (flags override)")
    cpu.add_argument("--policies", default="fcfs,continuum,adaptive",
                     help="comma-separated; the first is the baseline; NAME@KEY=VALUE "
                          "sets a parameter")
    cpu.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1")
    cpu.add_argument("--jobs-per-s", type=float)
    cpu.add_argument("--time-scale", type=float, help="tool times x this")
    cpu.add_argument("--blocks", type=int, help="KV blocks of 128 tokens")
    cpu.add_argument("--step-s", type=float, help="a step's fixed cost")
    cpu.add_argument("--prefill-s-per-token", type=float)
    cpu.add_argument("--attention-s-per-pair", type=float,
                     help="attention's cost per (query, key) token pair, apart from "
                          "--prefill-s-per-token (default 0: in it, as the daemon "
                          "learns it); python -m benchmarks.engine.attention measures both")
    cpu.add_argument("--gap-s", type=float,
                     help="seconds a turn spends outside vLLM's scheduler (the client, "
                          "HTTP, the API server)")
    cpu.add_argument("--api-busy-rate", type=float,
                     help="the share of the API server's pace left while the engine "
                          "computes a step (default 0.1, fitted to the CPU engine's idle "
                          "waits; 1: --gap-s a fixed delay before each request)")
    cpu.add_argument("--answer-lag-steps", type=int,
                     help="the daemon's answers land this many steps after the next "
                          "(default 0, or --like's run's median lag less 1)")
    cpu.add_argument("--answer-lag-drawn", action="store_true",
                     help="draw each answer's lag to land as --like's run's answers did for "
                          "the policy (their spread, not their median; held pins re-reported "
                          "at the plugin's heartbeat, as on the engine)")
    cpu.add_argument("--answer-lag-tail-steps", type=float,
                     help="with --answer-lag-drawn: mean steps past the run's last lag "
                          "bucket (7 or more) its draws go on (default: fitted)")
    cpu.add_argument("--pin-heartbeat-ms", type=float,
                     help="while pins are held the plugin reports at least this often "
                          "(twin clock; default 0, every step, or with --answer-lag-drawn "
                          "the plugin's own default, as the engine ran)")
    cpu.add_argument("--out", type=Path, help="write the per-seed figures here (JSON)")

    workload = commands.add_parser("workload", help="generate or check a workload file")
    workload.add_argument("action", choices=("generate", "check"))
    workload.add_argument("file", type=Path)
    workload.add_argument("--jps", type=float, default=8.0)
    _add_workload_flags(workload)
    return parser


def cmd_pack(args: argparse.Namespace) -> int:
    from benchmarks.twin.packs import write_pack

    for label in args.labels:
        path = write_pack(args.out_dir / "points", label)
        print(f"{label}: {path} ({path.stat().st_size / 1e3:.0f} kB); commit it and delete "
              f"the folder {args.out_dir / 'points' / label}")
    return 0


def cmd_criteria(args: argparse.Namespace) -> int:
    """Print (and optionally write) the criteria table; exit 1 when a point misses."""
    from benchmarks.twin.criteria import report

    text, all_pass = report(args.out_dir / "points", args.labels, args.tolerance)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0 if all_pass else 1


def cmd_cpu(args: argparse.Namespace) -> int:
    from benchmarks.twin.cpu import (
        CpuSetup,
        compare,
        report,
        result_json,
        with_api_delay,
        with_overrides,
        with_twin_waits,
    )

    try:
        setup = CpuSetup.like(args.like) if args.like is not None else CpuSetup()
    except ValueError as error:
        raise SystemExit(f"--like: {error}") from error
    setup = with_overrides(setup, jobs_per_s=args.jobs_per_s, time_scale=args.time_scale,
                           blocks=args.blocks, step_s=args.step_s,
                           prefill_s_per_token=args.prefill_s_per_token,
                           attention_s_per_pair=args.attention_s_per_pair, gap_s=args.gap_s,
                           api_busy_rate=args.api_busy_rate,
                           answer_lag_steps=args.answer_lag_steps,
                           draw_answer_lag=args.answer_lag_drawn or None,
                           answer_lag_tail_steps=args.answer_lag_tail_steps)
    heartbeat_ms = args.pin_heartbeat_ms
    if heartbeat_ms is None and setup.draw_answer_lag:
        from vllm_plugin.settings import PluginSettings

        heartbeat_ms = PluginSettings().pin_heartbeat_s * 1000.0
    setup = with_overrides(setup, pin_heartbeat_ms=heartbeat_ms)
    if not setup.pin_heartbeat_ms >= 0.0:
        raise SystemExit(f"--pin-heartbeat-ms: {setup.pin_heartbeat_ms} must be >= 0")
    if setup.answer_lag_steps < 0:
        raise SystemExit(f"--answer-lag-steps: {setup.answer_lag_steps} must be >= 0")
    if setup.answer_lag_tail_steps is not None and not setup.answer_lag_tail_steps >= 0.0:
        raise SystemExit(f"--answer-lag-tail-steps: {setup.answer_lag_tail_steps} must be "
                         ">= 0")
    if args.answer_lag_tail_steps is not None and not setup.draw_answer_lag:
        raise SystemExit("--answer-lag-tail-steps: only with --answer-lag-drawn")
    if setup.draw_answer_lag and args.answer_lag_steps is not None:
        raise SystemExit("--answer-lag-drawn: draws every answer's lag; drop "
                         "--answer-lag-steps")
    if setup.draw_answer_lag and not setup.like_answer_lags:
        raise SystemExit("--answer-lag-drawn: needs --like with a run that recorded its "
                         "answers by lag (answers_by_lag_steps)")
    if args.seeds < 1:
        raise SystemExit(f"--seeds: {args.seeds} must be >= 1")
    if not 0.0 < setup.api_busy_rate <= 1.0:
        raise SystemExit(f"--api-busy-rate: {setup.api_busy_rate} must be in (0, 1]")
    if not setup.gap_s >= 0.0:
        raise SystemExit(f"--gap-s: {setup.gap_s} must be >= 0")
    if not setup.attention_s_per_pair >= 0.0:
        raise SystemExit(f"--attention-s-per-pair: {setup.attention_s_per_pair} must be >= 0")
    policies = [p for p in args.policies.split(",") if p]
    for policy in policies:
        if policy.split("@")[0] not in SWEEP_POLICIES:
            raise SystemExit(f"--policies: {policy!r} is not one of {', '.join(SWEEP_POLICIES)}")

    def say(line: str) -> None:
        print(f"  {line}", file=sys.stderr, flush=True)

    setup = with_api_delay(setup, seeds=range(min(args.seeds, 3)), say=say)
    setup = with_twin_waits(setup, policies, seed=0, say=say)
    runs = compare(setup, policies, range(args.seeds), say=say)
    print(report(setup, runs, policies[0]))
    if args.out is not None:
        write_result(args.out, result_json(setup, runs))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the daemon subprocess is stopped with us.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    handler = {"run": cmd_run, "sweep": cmd_sweep, "calibrate": cmd_calibrate,
               "plot": cmd_plot, "pack": cmd_pack, "criteria": cmd_criteria,
               "workload": cmd_workload, "cpu": cmd_cpu}[args.command]
    return handler(args)
