"""Plugin settings, from ``KVTETHER_PLUGIN_*`` environment variables (read once, at start).

- ``KVTETHER_PLUGIN_DAEMON_ADDRESS`` (127.0.0.1:50051): the daemon, host:port or unix:PATH.
- ``KVTETHER_PLUGIN_ENGINE_ID`` (hostname:pid): this engine's name in the daemon.
- ``KVTETHER_PLUGIN_DEADLINE_MS`` (20): longest the engine thread waits for the daemon.
  A busy engine never waits: it sends each step's report and applies the answer at the
  next step (the forward pass hides the round trip). It waits only when it is about to
  go idle, so that releases land before it stops stepping (nothing is queued then).
- ``KVTETHER_PLUGIN_FAIL_MODE`` (open): ``open`` schedules natively at once without a
  fresh decision; ``closed`` first waits up to ``KVTETHER_PLUGIN_CLOSED_WAIT_S`` (1.0)
  for one (then natively all the same: no request fails).
- ``KVTETHER_PLUGIN_PROVISIONAL_PIN_S`` (2.0): a finished turn's blocks are held this
  long until the daemon confirms or releases them.
- ``KVTETHER_PLUGIN_MAX_PIN_S`` (60.0): local bound on any pin, whatever the daemon says.
- ``KVTETHER_PLUGIN_PIN_HEARTBEAT_MS`` (100): while pins are held and nothing else
  changed, a report (so the daemon hears the clock move, to expire and re-value pins)
  goes at most this often, not every step. 0: every step. A pin may then outlive its
  expiry by up to this much, but only while nothing changes (no block allocated or
  freed, no request added or finished, the engine not stalled): when memory matters,
  reports go every step anyway.
- ``KVTETHER_PLUGIN_WAITING_DEMAND_MS`` (100): the blocks the waiting requests would
  take from the free pool (shared prefixes once, ``vllm_plugin.demand``) are counted at
  most this often, the last count reported in between. 0: at every report. Counted
  only while the daemon's policy reads them (its decisions say so: ``adaptive`` does,
  the others do not).
- ``KVTETHER_PLUGIN_WAITING_DEMAND_THREAD`` (link): where the count runs. ``link``:
  on the link's thread as the report goes out, while the engine thread waits on its
  workers (the forward pass releases the GIL), so the count reads the queue a moment
  after the rest of the report. ``engine``: on the engine thread as the report is
  built, everything in it as of one instant (the digital twin, whose steps take no
  time, counts there so that a run is a function of its inputs).
- ``KVTETHER_PLUGIN_TOOL_PARSER`` (unset): the name of a vLLM tool-call parser (as
  ``--tool-call-parser`` takes it) that reads which tool a finished turn called; unset,
  or when it finds none, kvtether's own parsing does (``vllm_plugin.vllm_tool_parser``).
- ``KVTETHER_PLUGIN_ENABLED`` (1): 0 behaves exactly like vLLM's scheduler (no daemon).
- ``KVTETHER_PLUGIN_TLS_CA_FILE``: TLS to the daemon, trusting this CA (PEM).
- ``KVTETHER_PLUGIN_TLS_CERT_FILE`` / ``KVTETHER_PLUGIN_TLS_KEY_FILE``: this engine's
  client certificate and key, for a daemon that requires mutual TLS.
- ``KVTETHER_PLUGIN_TLS_SERVER_NAME``: the name to check the daemon's certificate
  against, when it differs from the address's host.
- ``KVTETHER_PLUGIN_TOKEN`` / ``KVTETHER_PLUGIN_TOKEN_FILE``: the bearer token this engine
  reports with (sent as ``authorization: Bearer <token>``), or a file holding it (e.g. a
  mounted secret; surrounding whitespace is ignored). A daemon with auth tokens needs
  one whose scope its ``auth.engine_scopes`` lists; one without auth ignores it.

A bad value, or a ``KVTETHER_PLUGIN_*`` variable that is none of these (a misspelt
name), stops vLLM at start-up with one line naming the variable (and, for an unknown
one, the nearest valid name): a misconfigured plugin must not silently run without its
daemon. With ``KVTETHER_PLUGIN_ENABLED=0`` no other variable is read.
"""

from __future__ import annotations

import difflib
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

PREFIX = "KVTETHER_PLUGIN_"
# Every variable the plugin reads, less the prefix.
NAMES = (
    "DAEMON_ADDRESS", "ENGINE_ID", "DEADLINE_MS", "FAIL_MODE", "CLOSED_WAIT_S",
    "PROVISIONAL_PIN_S", "MAX_PIN_S", "PIN_HEARTBEAT_MS", "WAITING_DEMAND_MS",
    "WAITING_DEMAND_THREAD", "RETURNED_JOB_PRIORITY", "ENABLED", "TLS_CA_FILE",
    "TLS_CERT_FILE", "TLS_KEY_FILE", "TLS_SERVER_NAME", "TOKEN", "TOKEN_FILE",
    "TOOL_PARSER",
)


class PluginSettingsError(ValueError):
    pass


def _priority(value: float) -> int:
    if value > 100 or value != int(value):
        raise PluginSettingsError(
            f"{PREFIX}RETURNED_JOB_PRIORITY: expected an integer 0-100, got {value:g}")
    return int(value)


@dataclass(frozen=True, slots=True)
class PluginSettings:
    daemon_address: str = "127.0.0.1:50051"
    engine_id: str = ""
    deadline_s: float = 0.020
    fail_closed: bool = False
    closed_wait_s: float = 1.0
    provisional_pin_s: float = 2.0
    max_pin_s: float = 60.0
    pin_heartbeat_s: float = 0.100
    waiting_demand_interval_s: float = 0.100
    # "link" or "engine": the thread that counts the waiting demand.
    waiting_demand_thread: str = "link"
    # Retention priority of a pin released on a report older than its job's return
    # (the blocks are freed, evicted after everything below it; see
    # vllm_plugin.fallback.returned_job_protection).
    returned_job_priority: int = 90
    enabled: bool = True
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_server_name: str = ""
    # vLLM's tool-call parser of this name reads the tool a turn called ("": kvtether's).
    tool_parser: str = ""
    # A secret: kept out of the settings' repr (and so out of logs).
    token: str = field(default="", repr=False)

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca_file or self.tls_cert_file)

    @staticmethod
    def from_env(environ: Mapping[str, str] | None = None) -> PluginSettings:
        env = os.environ if environ is None else environ
        enabled = env.get(PREFIX + "ENABLED", "1").strip().lower()
        if enabled not in ("0", "1", "true", "false", "yes", "no"):
            raise PluginSettingsError(f"{PREFIX}ENABLED: expected 0 or 1, got {enabled!r}")
        if enabled not in ("1", "true", "yes"):
            return PluginSettings(enabled=False)  # vLLM's own scheduler: nothing else read
        _reject_unknown(env)

        def number(name: str, default: float, minimum: float = 0.0) -> float:
            raw = env.get(PREFIX + name)
            if raw is None or raw == "":
                return default
            try:
                value = float(raw)
            except ValueError:
                raise PluginSettingsError(
                    f"{PREFIX}{name}: expected a number, got {raw!r}") from None
            if not value >= minimum or value != value:
                raise PluginSettingsError(f"{PREFIX}{name}: must be >= {minimum}, got {raw!r}")
            return value

        fail_mode = env.get(PREFIX + "FAIL_MODE", "open").strip().lower()
        if fail_mode not in ("open", "closed"):
            raise PluginSettingsError(f"{PREFIX}FAIL_MODE: expected open or closed, got "
                                      f"{fail_mode!r}")
        demand_thread = env.get(PREFIX + "WAITING_DEMAND_THREAD", "link").strip().lower()
        if demand_thread not in ("link", "engine"):
            raise PluginSettingsError(f"{PREFIX}WAITING_DEMAND_THREAD: expected link or "
                                      f"engine, got {demand_thread!r}")
        tls_files = {}
        for name in ("TLS_CA_FILE", "TLS_CERT_FILE", "TLS_KEY_FILE"):
            path = env.get(PREFIX + name, "").strip()
            if path and not os.access(path, os.R_OK):
                raise PluginSettingsError(f"{PREFIX}{name}: cannot read {path!r}")
            tls_files[name.lower()] = path
        if bool(tls_files["tls_cert_file"]) != bool(tls_files["tls_key_file"]):
            raise PluginSettingsError(
                f"{PREFIX}TLS_CERT_FILE and {PREFIX}TLS_KEY_FILE: set both or neither")
        token = _token(env)
        address = env.get(PREFIX + "DAEMON_ADDRESS", "127.0.0.1:50051").strip()
        if not address:
            raise PluginSettingsError(f"{PREFIX}DAEMON_ADDRESS: must not be empty")
        return PluginSettings(
            daemon_address=address,
            engine_id=env.get(PREFIX + "ENGINE_ID") or f"{socket.gethostname()}:{os.getpid()}",
            deadline_s=number("DEADLINE_MS", 20.0) / 1000.0,
            fail_closed=fail_mode == "closed",
            closed_wait_s=number("CLOSED_WAIT_S", 1.0),
            provisional_pin_s=number("PROVISIONAL_PIN_S", 2.0),
            max_pin_s=number("MAX_PIN_S", 60.0),
            pin_heartbeat_s=number("PIN_HEARTBEAT_MS", 100.0) / 1000.0,
            waiting_demand_interval_s=number("WAITING_DEMAND_MS", 100.0) / 1000.0,
            waiting_demand_thread=demand_thread,
            returned_job_priority=_priority(number("RETURNED_JOB_PRIORITY", 90.0)),
            tls_server_name=env.get(PREFIX + "TLS_SERVER_NAME", "").strip(),
            token=token,
            tls_ca_file=tls_files["tls_ca_file"],
            tls_cert_file=tls_files["tls_cert_file"],
            tls_key_file=tls_files["tls_key_file"],
            tool_parser=_tool_parser(env),
        )


def _reject_unknown(env: Mapping[str, str]) -> None:
    """A ``KVTETHER_PLUGIN_*`` variable the plugin does not read is a mistake (a
    misspelt name would otherwise leave its setting at the default, unnoticed)."""
    for variable in sorted(env):
        name = variable.removeprefix(PREFIX)
        if name != variable and name not in NAMES:
            # Matched without the prefix, which every name shares.
            hint = _nearest(name, NAMES, prefix=PREFIX,
                            otherwise="see the plugin settings in docs/operations.md")
            raise PluginSettingsError(f"{variable}: unknown variable; {hint}")


def _nearest(name: str, valid: Sequence[str], *, prefix: str = "", count: int = 1,
             otherwise: str) -> str:
    """``did you mean …?`` with the ``count`` valid names nearest ``name``."""
    nearest = difflib.get_close_matches(name, valid, n=count)
    if not nearest:
        return otherwise
    return "did you mean " + " or ".join(prefix + match for match in nearest) + "?"


def _tool_parser(env: Mapping[str, str]) -> str:
    """TOOL_PARSER's name, checked against the parsers vLLM registers (imported only
    when the variable is set)."""
    name = env.get(PREFIX + "TOOL_PARSER", "").strip()
    if not name:
        return ""
    try:
        from vllm_plugin.vllm_tool_parser import registered_tool_parsers

        valid = registered_tool_parsers()
    except ImportError as error:
        raise PluginSettingsError(f"{PREFIX}TOOL_PARSER: vLLM's tool parsers cannot be "
                                  f"imported ({error})") from None
    if name not in valid:
        hint = _nearest(name, valid, count=3,
                        otherwise="see --tool-call-parser in vllm serve --help")
        raise PluginSettingsError(
            f"{PREFIX}TOOL_PARSER: {name!r} is not a vLLM tool parser; {hint}")
    return name


def _token(env: Mapping[str, str]) -> str:
    """The token from TOKEN or TOKEN_FILE; messages never show it."""
    token = env.get(PREFIX + "TOKEN", "").strip()
    path = env.get(PREFIX + "TOKEN_FILE", "").strip()
    if token and path:
        raise PluginSettingsError(f"{PREFIX}TOKEN and {PREFIX}TOKEN_FILE: set one, not both")
    name = "TOKEN"
    if path:
        name = "TOKEN_FILE"
        try:
            with open(path) as secret:
                token = secret.read().strip()
        except OSError as error:
            raise PluginSettingsError(f"{PREFIX}TOKEN_FILE: cannot read {path!r} "
                                      f"({error.strerror or error})") from None
        if not token:
            raise PluginSettingsError(f"{PREFIX}TOKEN_FILE: {path!r} is empty")
    # gRPC metadata carries printable ASCII only; the daemon's tokens have no spaces.
    if not all(33 <= ord(char) <= 126 for char in token):
        raise PluginSettingsError(f"{PREFIX}{name}: must be printable ASCII without spaces")
    return token
