"""Every store key kvtether writes, in one place (like arq's constants module).

Layout: ``kvt:v1:{<tag>}:<kind>``. The ``{…}`` part is a Redis Cluster hash tag: every
key an atomic transition touches shares its tag, so the transition stays on one slot.
Identifiers are escaped so a job id containing ``{``, ``}`` or ``:`` cannot break out
of its tag or collide with another key.
"""

from __future__ import annotations

from sidecar.api.bounds import ALL_TOOLS

PREFIX = "kvt:v1"

# Pseudo-tool whose statistics pool every tool's samples (cold-start fallback); no
# caller may name a tool so (sidecar.api.bounds).
GLOBAL_TOOL = ALL_TOOLS


def _escape(identifier: str) -> str:
    return (
        identifier.replace("%", "%25")
        .replace("{", "%7B")
        .replace("}", "%7D")
        .replace(":", "%3A")
    )


def job_history(job_id: str) -> str:
    """Capped list of a job's turn events (JSON), newest last."""
    return f"{PREFIX}:{{job:{_escape(job_id)}}}:history"


def tool_stats(tool: str) -> str:
    """Hash of a tool's duration statistics: count, sums of log durations, sketch buckets."""
    return f"{PREFIX}:{{tool:{_escape(tool)}}}:stats"


def retention_directive(target: str) -> str:
    """A job's or session's retention directive (JSON) and its owning scope."""
    return f"{PREFIX}:{{retention:{_escape(target)}}}:directive"


def engine_pins(engine_id: str) -> str:
    """Pins an engine holds (JSON), for recovery and inspection."""
    return f"{PREFIX}:{{engine:{_escape(engine_id)}}}:pins"


def pattern_for(kind: str) -> str:
    """Glob matching every key of one kind, e.g. ``pattern_for("stats")``."""
    return f"{PREFIX}:{{*}}:{kind}"


def _unescape(identifier: str) -> str:
    return (
        identifier.replace("%3A", ":")
        .replace("%7D", "}")
        .replace("%7B", "{")
        .replace("%25", "%")
    )


def tool_from_stats_key(key: str) -> str:
    """The tool a ``tool_stats`` key belongs to (inverse of :func:`tool_stats`)."""
    start = key.index("{tool:") + len("{tool:")
    return _unescape(key[start : key.index("}", start)])
