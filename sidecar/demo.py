"""The README's main command: run the daemon on the embedded store and say how to use it.

    scripts/dev.sh demo [--policy NAME] [--listen HOST:PORT]

Later stages grow this into the full demo (vLLM-CPU engine + plugin + agent workload).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from sidecar.config import ConfigError, load_config
from sidecar.policies.registry import PolicyConfigError
from sidecar.server.app import Daemon
from sidecar.telemetry.logging import configure_logging


def _banner(daemon: Daemon) -> str:
    address = daemon.addresses[0]
    metrics = (f"http://{daemon.config.metrics.host}:{daemon.metrics_port}/metrics"
               if daemon.metrics_port is not None else "off")
    return f"""
kvtether daemon is serving
  policy   {daemon.policy.name}
  store    {daemon.store.backend_name}
  gRPC     {', '.join(daemon.addresses)}
  metrics  {metrics}

Inspect it (in another terminal):
  .venv/bin/grpcurl -plaintext {address} list
  .venv/bin/grpcurl -plaintext {address} kvtether.v1.Inspect/GetPolicy
  .venv/bin/kvtether inspect --address {address} policy

Point a vLLM engine at it:
  KVTETHER_DAEMON_ADDRESS={address} python -m vllm.entrypoints.openai.api_server \\
      --scheduler-cls vllm_plugin.scheduler_factory --scheduling-policy priority ...

Ctrl-C stops it.
"""


async def _run(args: argparse.Namespace) -> int:
    flags = {"listen": {"tcp": args.listen}, "metrics": {"port": args.metrics_port},
             "log_level": "warning"}
    if args.policy:
        flags["policy"] = {"name": args.policy}
    try:
        config = load_config(None, flags)
        daemon = await Daemon.build(config)
    except (ConfigError, PolicyConfigError) as error:
        print(f"kvtether: error: {error}", file=sys.stderr)
        return 2
    await daemon.start()
    print(_banner(daemon), flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    await stopping.wait()
    await daemon.stop()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default=None)
    parser.add_argument("--listen", default="127.0.0.1:50051")
    parser.add_argument("--metrics-port", type=int, default=9400)
    args = parser.parse_args()
    configure_logging("warning")
    return asyncio.run(_run(args))


if __name__ == "__main__":
    sys.exit(main())
