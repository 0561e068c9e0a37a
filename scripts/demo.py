"""The README's main command: the daemon, a real vLLM engine (CPU build, tiny model) with
the kvtether plugin, and a short multi-turn agent workload, run once with kvtether's
``continuum`` policy and once with ``fcfs`` (vLLM's behaviour) under the same pressure.

    scripts/dev.sh demo [--turns 5] [--serve]      # installs first, then runs
    .venv/bin/python -m scripts.demo [--turns 5]    # from the repository root

Per turn it prints the prompt tokens, the prefix-cache hit, and the KV usage during the
tool gap; then how to inspect the daemon. ``--serve`` keeps the daemon and the engine
running afterwards, for grpcurl and curl, until Ctrl-C.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TOOLS = ["ls", "grep", "cat", "pytest", "sed", "git diff", "pytest"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Daemon:
    """``kvtether serve`` on a fixed address, restartable with another policy."""

    def __init__(self, port: int, metrics_port: int) -> None:
        self.address = f"127.0.0.1:{port}"
        self.metrics_port = metrics_port
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, policy: str) -> None:
        self.stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sidecar.cli", "serve", "--policy", policy,
             "--listen", self.address, "--metrics-port", str(self.metrics_port),
             "--log-level", "error", "--grace-s", "1"])
        deadline = time.monotonic() + 30
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                with contextlib.suppress(grpc.RpcError):
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the daemon did not start ({policy})")
                time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=15)
        self.process = None


@contextlib.contextmanager
def _engine(daemon: Daemon, port: int, log: Path) -> Iterator[str]:
    from tests.support.launch import EngineSpec, start_engine, tiny_model_dir, wait_healthy

    spec = EngineSpec(model_dir=tiny_model_dir(), port=port, daemon_address=daemon.address,
                      num_blocks=32, engine_id="demo-engine", deadline_ms=20)
    process = start_engine(spec, log)
    base_url = f"http://127.0.0.1:{port}"
    try:
        seconds = wait_healthy(base_url, process)
        print(f"vLLM (CPU build, tiny model, kvtether plugin) ready in {seconds:.0f} s "
              f"at {base_url}  (log: {log})")
        yield base_url
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
        if process.poll() is None:
            process.kill()


def _flood(api: object, tag: str, count: int = 16) -> None:
    """Other tenants: concurrent unrelated requests that need more KV than is free."""

    def one(index: int) -> None:
        api.chat.completions.create(  # type: ignore[attr-defined]
            model="tiny", max_tokens=8, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": f"{tag}-{index} " + f"w{index} " * 220}])

    with concurrent.futures.ThreadPoolExecutor(max_workers=count) as pool:
        list(pool.map(one, range(count)))


def _wait_reconnected(daemon: Daemon, api: object, engine_id: str) -> None:
    from sidecar.api.v1 import inspect_pb2, inspect_pb2_grpc

    with grpc.insecure_channel(daemon.address) as channel:
        inspect = inspect_pb2_grpc.InspectStub(channel)
        for _ in range(200):
            if engine_id in inspect.GetPolicy(inspect_pb2.GetPolicyRequest()).engines:
                return
            # An idle engine does not step; a one-token request makes it resync.
            api.completions.create(model="tiny", prompt="ping", max_tokens=1)  # type: ignore[attr-defined]
            time.sleep(0.05)
    raise RuntimeError("the engine did not reconnect to the daemon")


def _run_job(api: object, base_url: str, policy: str, turns: int) -> list[int]:
    from tests.support.client import AgentJob, cached_tokens
    from tests.support.launch import scrape

    job = AgentJob(api, f"demo-{policy}", seed=7 if policy == "continuum" else 8)
    print(f"\n  {policy}: one agent job, {turns} turns; other tenants flood the cache "
          "during each tool call")
    print(f"  {'turn':>4}  {'tool':<9} {'prompt':>6}  {'cached':>6}  "
          f"{'KV used after turn':>18}  {'KV used after tool gap':>22}")
    hits = []
    for turn in range(turns):
        last = turn == turns - 1
        tool = TOOLS[turn % len(TOOLS)]
        answer = job.turn(last=last, tool=tool)
        after_turn = scrape(base_url)["vllm:kv_cache_usage_perc"]
        hits.append(cached_tokens(answer))
        gap = "-"
        if not last:
            time.sleep(0.3)  # the tool runs...
            _flood(api, f"{policy}-{turn}")  # ...while other requests need the memory
            gap = f"{scrape(base_url)['vllm:kv_cache_usage_perc']:.1%}"
        print(f"  {turn + 1:>4}  {tool:<9} {answer.usage.prompt_tokens:>6}  {hits[-1]:>6}  "
              f"{after_turn:>18.1%}  {gap:>22}")
    return hits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--serve", action="store_true",
                        help="keep the daemon and the engine running afterwards")
    args = parser.parse_args()
    import openai

    daemon = Daemon(_free_port(), _free_port())
    log = Path(tempfile.mkdtemp(prefix="kvtether-demo-")) / "vllm.log"
    daemon.start("continuum")
    print(f"kvtether daemon serving on {daemon.address} "
          f"(metrics: http://127.0.0.1:{daemon.metrics_port}/metrics)")
    try:
        with _engine(daemon, _free_port(), log) as base_url:
            api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
            results = {}
            for policy in ("continuum", "fcfs"):
                daemon.start(policy)
                _wait_reconnected(daemon, api, "demo-engine")
                results[policy] = _run_job(api, base_url, policy, args.turns)
            kept = sum(results["continuum"][1:])
            lost = sum(results["fcfs"][1:])
            print(f"\n  prompt tokens served from cache on turns 2-{args.turns}: "
                  f"continuum {kept}, fcfs {lost}")
            print("\nInspect the daemon (the fcfs run is the one it holds now):")
            for command in (
                f".venv/bin/grpcurl -plaintext {daemon.address} list",
                f".venv/bin/grpcurl -plaintext {daemon.address} kvtether.v1.Inspect/ListJobs",
                f".venv/bin/kvtether inspect --address {daemon.address} policy",
                f".venv/bin/kvtether inspect --address {daemon.address} job demo-fcfs",
            ):
                print(f"  {command}")
            subprocess.run([sys.executable, "-m", "sidecar.cli", "inspect", "--address",
                            daemon.address, "job", "demo-fcfs"], check=False)
            if args.serve:
                print(f"\nServing: vLLM at {base_url}/v1, daemon at {daemon.address}. "
                      "Ctrl-C stops both.")
                with contextlib.suppress(KeyboardInterrupt):
                    signal.pause()
    finally:
        daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
