"""The Grafana dashboard reads cumulative series with rate()/increase() only, and every
query is scoped by the dashboard's variables, so a restart inside the window does not
read as negative work and two deployments are never summed together."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvtether-dashboard.json"
# A series selector: a metric name and its optional {matchers}.
SELECTOR = re.compile(r"\b(kvtether_\w+|grpc_server_\w+|process_\w+|vllm:[\w:]+)(\{[^}]*\})?")
CUMULATIVE_SUFFIXES = ("_total", "_bucket", "_count", "_sum")
# The functions that read a counter across resets.
RESET_AWARE = ("rate(", "increase(", "irate(")
# Series that describe the daemon as a whole, not one engine: no engine_id label.
NOT_PER_ENGINE = ("kvtether_engine_sessions",)


def queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        panels += [panel, *panel.get("panels", [])]
    return [(panel["title"], target["expr"]) for panel in panels
            for target in panel.get("targets", [])]


def variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}


def per_engine(name: str) -> bool:
    return (name.startswith("kvtether_engine_") and not name.startswith(NOT_PER_ENGINE)) \
        or name.startswith("kvtether_pins_unreturned")


def test_no_delta_or_deriv_and_counters_only_through_rate_or_increase() -> None:
    for title, expr in queries():
        assert not re.search(r"\b(delta|idelta|deriv)\s*\(", expr), (
            f"panel {title!r}: delta()/deriv() read an engine restart as negative work: {expr}")
        for match in SELECTOR.finditer(expr):
            name = match.group(1)
            if not name.endswith(CUMULATIVE_SUFFIXES):
                continue
            before = expr[:match.start()].rstrip()
            after = expr[match.end():]
            assert before.endswith(RESET_AWARE) and after.startswith("["), (
                f"panel {title!r}: {name} is cumulative; read it with rate() or increase(), "
                f"not as a value: {expr}")


def test_every_query_is_scoped_by_job_namespace_model_and_engine() -> None:
    defined = variables()
    for name in ("job", "namespace", "model_name", "engine_id", "vllm_job"):
        assert defined[name]["includeAll"] and defined[name]["allValue"] == ".*", name
    for title, expr in queries():
        selectors = list(SELECTOR.finditer(expr))
        assert selectors, f"panel {title!r} reads no series: {expr}"
        for match in selectors:
            name, matchers = match.group(1), match.group(2) or ""
            job = "$vllm_job" if name.startswith("vllm:") else "$job"
            wanted = [f'job=~"{job}"', 'namespace=~"$namespace"', "$model_name"]
            if per_engine(name):
                wanted.append('engine_id=~"$engine_id"')
            missing = [matcher for matcher in wanted if matcher not in matchers]
            assert not missing, f"panel {title!r}: {name} lacks {missing}: {expr}"


def test_the_variables_are_read_from_the_series_they_filter() -> None:
    defined = variables()
    assert "kvtether_build_info" in defined["job"]["definition"]
    assert '$job' in defined["namespace"]["definition"]
    assert "model_name" in defined["model_name"]["definition"]
    assert "engine_id)" in defined["engine_id"]["definition"]
