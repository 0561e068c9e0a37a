"""The Prometheus rules load and do what they say, checked by Prometheus' own promtool
(Debian's ``prometheus`` package; ``scripts/dev.sh test`` installs it): the alerts fire
on the series they are meant for, and the dashboard's share panels read the true share
across an engine restart (deploy/prometheus/tests/kvtether-rules.test.yml)."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.unit.test_dashboard_queries import queries

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "kvtether-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "kvtether-rules.test.yml"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
# The dashboard's variables as one deployment sets them: every model and engine of
# job kvtether in namespace inference, read over 10 minutes.
ONE_DEPLOYMENT = {"$vllm_job": "vllm", "$job": "kvtether", "$namespace": "inference",
                  "$model_name": ".*", "$engine_id": ".*", "$__rate_interval": "10m",
                  "$__range": "10m"}
# The panels whose shares the rule tests evaluate across a restart.
SHARE_PANELS = ("Idle waits the daemon missed, by engine", "Fallback step share by engine")


def promtool(*args: str, cwd: Path = ROOT) -> str:
    binary = shutil.which("promtool")
    assert binary, "promtool not found: scripts/dev.sh test installs Debian's prometheus"
    done = subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout


def test_the_rules_are_valid_and_pass_their_unit_tests() -> None:
    assert "SUCCESS: 9 rules found" in promtool("check", "rules", str(RULES))
    assert "SUCCESS" in promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)


def test_prometheus_yml_loads_the_rules_from_beside_it(tmp_path: Path) -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    (pattern,) = config["rule_files"]
    assert fnmatch.fnmatch(f"/etc/prometheus/{RULES.name}", pattern), pattern
    config["rule_files"] = [str(tmp_path / Path(pattern).name)]
    shutil.copy(RULES, tmp_path / RULES.name)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    assert "SUCCESS: 9 rules found" in promtool("check", "config",
                                                str(tmp_path / "prometheus.yml"))


def test_the_rule_tests_evaluate_the_dashboards_own_share_expressions() -> None:
    tested = {case["expr"] for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for case in test.get("promql_expr_test", [])}
    for title in SHARE_PANELS:
        (expr,) = [expr for panel, expr in queries() if panel == title]
        for variable, value in sorted(ONE_DEPLOYMENT.items(), key=lambda kv: -len(kv[0])):
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        assert expr in tested, f"panel {title!r} is not evaluated by {RULE_TESTS.name}: {expr}"
