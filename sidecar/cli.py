"""``kvtether``: run the daemon and inspect it.

    kvtether serve [--config FILE] [--policy NAME] [--param KEY=VALUE ...]
                   [--log-format json|console] ...
    kvtether inspect [--address HOST:PORT] [--token-file FILE]
                     policy|jobs|job ID|pins|tools|explain ID|watch
    kvtether policies
    kvtether --version

Every configuration problem ends the process with one line on stderr naming it and
exit code 2; a daemon that cannot reach its Redis exits 3. ``serve`` and ``policies``
need the daemon's extra (``pip install '.[daemon]'`` in a checkout); without it they say
so in one line and exit 2. ``inspect`` needs only the base install, so this module
imports the daemon's modules lazily.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar import __version__

if TYPE_CHECKING:
    from sidecar.config import ConfigError, DaemonConfig

EXIT_CONFIG = 2
EXIT_UNAVAILABLE = 3

# The importable names of the daemon extra's distributions (pyproject.toml).
DAEMON_MODULES = ("grpc_health", "grpc_reflection", "redis", "prometheus_client",
                  "structlog", "pydantic", "pydantic_settings", "yaml")


def _param(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _scalar(value: str) -> Any:
    """A ``--param`` value as a YAML scalar: 2 → int, 2.5 → float, true → bool, cdf → str."""
    import yaml

    return yaml.safe_load(value) if value else value


def missing_daemon_modules() -> list[str]:
    """The daemon extra's modules this environment lacks."""
    return [name for name in DAEMON_MODULES if importlib.util.find_spec(name) is None]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtether", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvtether {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the policy daemon")
    serve.add_argument("--config", type=Path, help="YAML configuration file")
    serve.add_argument("--policy", help="policy name (see `kvtether policies`)")
    serve.add_argument("--param", type=_param, action="append", default=[],
                       metavar="KEY=VALUE", help="a policy parameter (repeatable)")
    serve.add_argument("--listen", help="gRPC host:port ('' disables TCP)")
    serve.add_argument("--unix-socket", help="also serve gRPC on this Unix socket path")
    serve.add_argument("--metrics-port", type=int, help="Prometheus port (0 = any, -1 = off)")
    serve.add_argument("--metrics-host", help="Prometheus bind address")
    serve.add_argument("--redis-url", help="redis://host:port/db (default: embedded store)")
    serve.add_argument("--grace-s", type=float, help="seconds in-flight calls get on SIGTERM")
    serve.add_argument("--log-level", help="debug, info, warning or error")
    serve.add_argument("--log-format", help="json (one object a line) or console")
    serve.add_argument("--check", action="store_true",
                       help="validate the configuration and the policy, then exit")

    inspect = commands.add_parser("inspect", help="print the daemon's state as tables")
    inspect.add_argument("--address", default="127.0.0.1:50051",
                         help="daemon address, host:port or unix:PATH")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of tables")
    inspect.add_argument("--timeout-s", type=float, default=5.0)
    inspect.add_argument("--tls-ca", default="", help="TLS: trust this CA (PEM)")
    inspect.add_argument("--tls-cert", default="", help="mutual TLS: client certificate")
    inspect.add_argument("--tls-key", default="", help="mutual TLS: client key")
    inspect.add_argument("--tls-server-name", default="",
                         help="TLS: name to check the daemon's certificate against")
    inspect.add_argument("--token-file", type=Path,
                         help="a file holding the bearer token of a read scope (a daemon "
                              "with auth tokens needs one); default: $KVTETHER_INSPECT_TOKEN")
    inspect.add_argument("--limit", type=int, default=0,
                         help="jobs, pins, tools, explain: most rows (default 100, at most "
                              "1000)")
    inspect.add_argument("--page-token", default="",
                         help="jobs, pins, tools, explain: the page after the one that "
                              "printed it")
    inspect.add_argument("--anonymous", action="store_true",
                         help="jobs: also list requests sent without a job id")
    inspect.add_argument("what", choices=["policy", "jobs", "job", "pins", "tools", "explain",
                                          "watch"])
    inspect.add_argument("id", nargs="?", help="job id (job) or request id (explain)")

    commands.add_parser("policies", help="list the registered policies and their parameters")
    return parser


# The setting each `serve` flag sets (sidecar/config.py), besides --param.
SERVE_FLAG_SETTINGS = {
    "--policy": "policy.name", "--listen": "listen.tcp", "--unix-socket": "listen.unix_socket",
    "--metrics-port": "metrics.port", "--metrics-host": "metrics.host",
    "--redis-url": "store.redis_url", "--grace-s": "grace_s", "--log-level": "log_level",
    "--log-format": "log_format",
}


def _flag_value(args: argparse.Namespace, flag: str) -> Any:
    return getattr(args, flag.removeprefix("--").replace("-", "_"))


def _serve_flags(args: argparse.Namespace) -> dict[str, Any]:
    flags: dict[str, Any] = {}

    def put(path: str, value: Any) -> None:
        if value is None:
            return
        node = flags
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    for flag, path in SERVE_FLAG_SETTINGS.items():
        put(path, _flag_value(args, flag))
    if args.param:
        put("policy.params", {key: _scalar(value) for key, value in args.param})
    return flags


def _naming_the_flag(error: ConfigError, args: argparse.Namespace) -> str:
    """The error's message, naming the flag when a flag gave the faulty value (flags
    win over the file and the environment)."""
    message = str(error)
    for flag, path in SERVE_FLAG_SETTINGS.items():
        if path == error.setting and _flag_value(args, flag) is not None:
            return f"{flag} ({path}): {message.removeprefix(f'{path}: ')}"
    return message


def parse_serve_config(argv: Sequence[str], config_path: Path | None = None) -> DaemonConfig:
    """The configuration ``kvtether serve ARGV`` would run with (flags, environment,
    file). ``config_path`` reads the file from another path than ``--config`` names
    (e.g. the host copy of a file a container mounts). Raises ConfigError."""
    from sidecar.config import load_config

    args = _parser().parse_args(["serve", *argv])
    return load_config(config_path or args.config, _serve_flags(args))


def _fail(message: str, code: int = EXIT_CONFIG) -> int:
    print(f"kvtether: error: {message}", file=sys.stderr)
    return code


def _run_serve(args: argparse.Namespace) -> int:
    from sidecar.config import ConfigError, load_config
    from sidecar.policies.registry import PolicyConfigError, build_policy
    from sidecar.store import StoreError
    from sidecar.telemetry.logging import configure_logging

    try:
        config = load_config(args.config, _serve_flags(args))
        build_policy(config.policy.name, config.policy.params)
    except ConfigError as error:
        return _fail(_naming_the_flag(error, args))
    except PolicyConfigError as error:
        return _fail(str(error))
    if args.check:
        print(f"configuration ok: policy {config.policy.name}")
        return 0
    configure_logging(config.log_level, config.log_format)
    from sidecar.server.app import serve

    try:
        asyncio.run(serve(config))
    except StoreError as error:
        return _fail(f"store: {error}", EXIT_UNAVAILABLE)
    except OSError as error:
        return _fail(f"listen: {error}", EXIT_UNAVAILABLE)
    return 0


def _run_policies() -> int:
    from sidecar.policies.registry import available_policies, build_policy, policy_parameters

    for name in available_policies():
        params = policy_parameters(build_policy(name, {}))
        rendered = ", ".join(f"{key}={value!r}" for key, value in params.items()) or "-"
        print(f"{name}: {rendered}")
    return 0


# What a shell reports for a command killed by SIGPIPE (128 + 13), as `yes | head` does.
EXIT_READER_GONE = 141


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("serve", "policies") and (missing := missing_daemon_modules()):
        # No package index has kvtether: the extra is installed from where kvtether was.
        return _fail(f"`kvtether {args.command}` needs the daemon's dependencies "
                     f"({', '.join(missing)} missing): install kvtether's daemon extra, "
                     f"pip install '.[daemon]' in its checkout or "
                     f"pip install 'kvtether-{__version__}-py3-none-any.whl[daemon]'")
    if args.command == "serve":
        return _run_serve(args)
    try:
        if args.command == "policies":
            return _run_policies()
        from sidecar.inspect_cli import run_inspect

        return run_inspect(args)
    except BrokenPipeError:
        # `kvtether inspect watch | head`: the reader has gone, so stop without a
        # traceback. Python flushes stdout again at exit; point it at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_READER_GONE


if __name__ == "__main__":
    sys.exit(main())
