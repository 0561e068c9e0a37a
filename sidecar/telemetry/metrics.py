"""Prometheus metrics of the daemon, in one registry, named by Prometheus conventions:
``kvtether_`` prefix, base units in the name, ``_total`` for counters.

The names and types are pinned by a golden file (tests/golden/metrics.txt): renaming
one breaks dashboards, so it must be deliberate.
"""

from __future__ import annotations

import platform

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)

from sidecar import __version__
from sidecar.telemetry.answer_lag import LATE_ANSWER_STEPS, WINDOW_ANSWERS
from sidecar.telemetry.cpu_wait import ThreadCpuWait
from sidecar.telemetry.engine_counters import EngineCounterCollector

# ``*_created`` series double the exposition and no dashboard reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

REGISTRY = CollectorRegistry(auto_describe=True)
# The standard process_* (CPU, memory, open files, start time) and python_* (GC,
# interpreter) series that Prometheus clients export by default, read at scrape time.
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)

# The release and the interpreter that serve, as Prometheus' build_info convention has
# it: one series set to 1 (a gauge, not an Info, so the name is the same in every
# exposition format). `count by (version)` shows a rolling update.
BUILD_INFO = Gauge(
    "kvtether_build_info",
    "The kvtether release and the Python version of this daemon (always 1).",
    ["version", "python"],
    registry=REGISTRY,
)
BUILD_INFO.labels(version=__version__, python=platform.python_version()).set(1)

# Decisions are expected in tens to hundreds of microseconds.
_DECISION_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1,
)

STEP_REPORTS = Counter(
    "kvtether_step_reports_total", "Step reports received from engines.", registry=REGISTRY
)
# What each report carried: a report can carry several kinds and counts once for each;
# "clock" is a report that carried none (a free-block count that moved, a stall that
# began or ended, a heartbeat while pins are held). Tells which engine event drives the
# report rate, which is the daemon's and the engine's CPU cost.
STEP_REPORT_CONTENTS = Counter(
    "kvtether_step_report_contents_total",
    "Step reports received, by what they carried "
    "(new_requests, events, released_pins, snapshot, clock).",
    ["carried"],
    registry=REGISTRY,
)
SNAPSHOTS = Counter(
    "kvtether_snapshots_total", "Full-state snapshots received from engines.", registry=REGISTRY
)
RESYNCS_REQUESTED = Counter(
    "kvtether_resyncs_requested_total",
    "Snapshots the daemon asked for after a sequence gap or an unknown engine.",
    registry=REGISTRY,
)
DECISION_LATENCY = Histogram(
    "kvtether_decision_latency_seconds",
    "Time to decide one step report.",
    buckets=_DECISION_BUCKETS_S,
    registry=REGISTRY,
)
DECISIONS = Counter(
    "kvtether_decisions_total",
    "Decisions sent to engines, by kind (priority, pin, release).",
    ["kind"],
    registry=REGISTRY,
)
ENGINE_SESSIONS = Gauge(
    "kvtether_engine_sessions", "Engine sessions open now.", registry=REGISTRY
)
# A snapshot on a newer stream for an engine id whose older stream was still open: an
# engine that reconnected before its old connection was found dead, or two engines
# sharing one id (then this keeps rising).
ENGINE_SESSIONS_REPLACED = Counter(
    "kvtether_engine_sessions_replaced_total",
    "Engine sessions ended because a newer session of the same engine id sent a snapshot.",
    registry=REGISTRY,
)
# Snapshots refused because they would have taken an engine id from the live session
# that holds it (another token's scope, or over limits.engine_takeovers_per_min):
# a caller is reporting under an engine id that is not its own.
ENGINE_SESSIONS_REFUSED = Counter(
    "kvtether_engine_sessions_refused_total",
    "Session snapshots refused because another live session holds their engine id "
    "(another scope's token, or too many takeovers of the id a minute).",
    registry=REGISTRY,
)
# Tool times a report implied that no finished turn could have produced (an arrival
# in the future of the engine's clock, or longer than a job's history lives): left
# out of the shared tool statistics.
TOOL_TIMES_REFUSED = Counter(
    "kvtether_tool_times_refused_total",
    "Tool times left out of the tool statistics because no finished turn could have "
    "produced them (an arrival past the engine's clock, or longer than store.history_ttl_s).",
    registry=REGISTRY,
)
PINS_ACTIVE = Gauge(
    "kvtether_pins_active", "Pins held by connected engines.", registry=REGISTRY
)
PINNED_BLOCKS = Gauge(
    "kvtether_pinned_blocks", "KV blocks held by pins on connected engines.", registry=REGISTRY
)
# What pins came to (sidecar/runtime/pin_outcomes.py): a pin pays only if its job's
# next request arrives while it holds. Their ratio, and the block-seconds behind each,
# say whether a policy's pins earn their memory on this workload.
PINS_ENDED = Counter(
    "kvtether_pins_ended_total",
    "Pins released, by outcome: returned (the job's next request arrived while the pin "
    "held its context) or not_returned (released first: memory held for nothing).",
    ["outcome"],
    registry=REGISTRY,
)
# Per engine: a pin there pays only if its job's next turn comes back to that engine,
# which routing decides (docs/metrics.md). Rising on one engine while its jobs are
# served: their next turns go to other engines, or never come.
PINS_UNRETURNED = Counter(
    "kvtether_pins_unreturned_total",
    "Pins the engine released (expired, freed under pressure or by the engine) before "
    "their job's next turn arrived at that engine.",
    ["engine_id"],
    registry=REGISTRY,
)
PIN_BLOCK_SECONDS = Counter(
    "kvtether_pin_block_seconds_total",
    "KV block-seconds pins held, by outcome: from the pin to its job's return, or to its "
    "release when the job did not return.",
    ["outcome"],
    registry=REGISTRY,
)
# The engines' own cumulative counts (fallback steps, idle waits, provisional
# block-seconds, answers by lag), exported from their latest reports as counters and a
# histogram (sidecar/telemetry/engine_counters.py).
ENGINE_COUNTERS = EngineCounterCollector()
REGISTRY.register(ENGINE_COUNTERS)
# The steps an engine reported running, to read its fallback steps against.
ENGINE_STEPS = Counter(
    "kvtether_engine_steps_total",
    "Engine steps that scheduled work, as the engine's reports to this daemon carried them "
    "(steps while no daemon listened are not counted).",
    ["engine_id"],
    registry=REGISTRY,
)
# Whether the daemon's last decision for an engine asked it to keep the turns that
# finish cached at the top retention priority (1) rather than held (0) while it
# decides on their pins (adaptive's provisional_cache=auto changes it as it goes).
ENGINE_FINISHED_TURNS_CACHED = Gauge(
    "kvtether_engine_finished_turns_cached",
    "1 while the daemon asks the engine to keep finished turns' blocks cached at the top "
    "retention priority, 0 while it asks them held, until its word on a pin lands.",
    ["engine_id"],
    registry=REGISTRY,
)
# What adaptive's provisional_cache=auto reads: while a tenth or more of an engine's
# recent answers land late it caches finished turns (sidecar/telemetry/answer_lag.py).
ENGINE_LATE_ANSWER_RATIO = Gauge(
    "kvtether_engine_late_answer_ratio",
    f"Share of the engine's last {WINDOW_ANSWERS} answers it applied {LATE_ANSWER_STEPS} "
    "or more steps after the report they answered (0-1; from the engine-reported lags).",
    ["engine_id"],
    registry=REGISTRY,
)
# An engine's step cost as the daemon learned it from the reports (set once known to
# within 20%; see sidecar/runtime/steptime.py).
ENGINE_PREFILL_S_PER_TOKEN = Gauge(
    "kvtether_engine_prefill_seconds_per_token",
    "Seconds one prompt token costs to compute on the engine, learned from its steps.",
    ["engine_id"],
    registry=REGISTRY,
)
ENGINE_DECODE_S_PER_SEQ = Gauge(
    "kvtether_engine_decode_seconds_per_request",
    "Seconds one decoding request adds to a step of the engine, learned from its steps.",
    ["engine_id"],
    registry=REGISTRY,
)
ENGINE_STEP_S = Gauge(
    "kvtether_engine_step_seconds",
    "Fixed seconds of one step of the engine, learned from its steps.",
    ["engine_id"],
    registry=REGISTRY,
)
# Prompt tokens a second over the last ~10 s times the learned cost of one: the
# adaptive policy reads the same figure against its saturated_prefill_share.
ENGINE_PREFILL_TIME_RATIO = Gauge(
    "kvtether_engine_prefill_time_ratio",
    "Share of the engine's time spent computing prompts over the last ~10 s of its "
    "clock (prompt tokens a second times the learned seconds per token; 0-1).",
    ["engine_id"],
    registry=REGISTRY,
)
STORE_LATENCY = Histogram(
    "kvtether_store_write_seconds", "Time of one background store write.", registry=REGISTRY
)
STORE_ERRORS = Counter(
    "kvtether_store_errors_total", "Store operations that failed.", registry=REGISTRY
)
STORE_WRITES_DROPPED = Counter(
    "kvtether_store_writes_dropped_total",
    "Queued store writes dropped because the store stayed down too long.",
    registry=REGISTRY,
)
RECORDER_WRITE_ERRORS = Counter(
    "kvtether_recorder_write_errors_total",
    "Queued history or tool-time writes dropped because applying them failed other than "
    "in the store (each is logged as recorder_write_dropped).",
    registry=REGISTRY,
)
# A background task of the daemon (the store writer, the engine sweeper) that ended
# other than at stop and was started again; each is logged as background_task_failed.
BACKGROUND_TASK_RESTARTS = Counter(
    "kvtether_background_task_restarts_total",
    "Background tasks restarted after they ended unexpectedly, by task.",
    ["task"],
    registry=REGISTRY,
)
# The event-loop thread's wait for a CPU (kvtether_event_loop_cpu_wait_seconds_total),
# read at scrape time; the daemon names its thread when it starts serving.
EVENT_LOOP_CPU_WAIT = ThreadCpuWait()
REGISTRY.register(EVENT_LOOP_CPU_WAIT)

INVALID_REPORTS = Counter(
    "kvtether_invalid_reports_total",
    "Step reports refused as malformed, by field.",
    ["field"],
    registry=REGISTRY,
)

DECISION_WATCHERS = Gauge(
    "kvtether_decision_watchers",
    "WatchDecisions streams open now (at most limits.max_watchers).",
    registry=REGISTRY,
)
DECISION_WATCHERS_DROPPED = Counter(
    "kvtether_decision_watchers_dropped_total",
    "WatchDecisions streams ended because the watcher fell too far behind.",
    registry=REGISTRY,
)
DECISION_WATCHERS_REFUSED = Counter(
    "kvtether_decision_watchers_refused_total",
    "WatchDecisions streams refused because limits.max_watchers were open.",
    registry=REGISTRY,
)

# gRPC server metrics, named and labelled as go-grpc-prometheus names them (the names
# gRPC dashboards and alerts expect); sidecar/server/grpc_metrics.py counts them. A
# stream (an engine's Session, WatchDecisions) is one call: started when it opens,
# handled with its status when it ends.
_GRPC_LABELS = ["grpc_type", "grpc_service", "grpc_method"]
# Unary calls take well under a millisecond to tens of milliseconds; streams last
# minutes to days and land in the top buckets.
_GRPC_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    5.0, 60.0, 600.0, 3600.0,
)
GRPC_STARTED = Counter(
    "grpc_server_started_total",
    "gRPC calls started on the server, by type, service and method.",
    _GRPC_LABELS,
    registry=REGISTRY,
)
GRPC_HANDLED = Counter(
    "grpc_server_handled_total",
    "gRPC calls completed on the server, by type, service, method and status code.",
    [*_GRPC_LABELS, "grpc_code"],
    registry=REGISTRY,
)
GRPC_HANDLING_SECONDS = Histogram(
    "grpc_server_handling_seconds",
    "Seconds from a gRPC call's start to its end on the server (a stream: its whole "
    "life), by type, service and method.",
    _GRPC_LABELS,
    buckets=_GRPC_BUCKETS_S,
    registry=REGISTRY,
)
