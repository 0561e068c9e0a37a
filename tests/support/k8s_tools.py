"""The Kubernetes tools the deployment tests run: Helm and kubectl (installed into the
test environment's bin/ by scripts/install_k8s_tools.sh, which scripts/dev.sh test
runs), kubernetes-validate for the API schemas, and the Prometheus Operator CRDs'
schemas (ServiceMonitor, PrometheusRule) through Node."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvtether"
NODE_MODULES = Path(sys.prefix) / "lib" / "k8s-node" / "node_modules"
INSTALL_HINT = ("scripts/dev.sh test installs it (scripts/install_k8s_tools.sh "
                f"{sys.prefix})")
# Kinds kubernetes-validate has schemas for; a CRD's objects are validated apart.
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}


def tool(name: str) -> str:
    """The test environment's own copy of a tool, else one on PATH; a clear failure
    (never a skip) when neither is there."""
    for candidate in (Path(sys.prefix) / "bin" / name, shutil.which(name)):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.fail(f"{name} is not installed: {INSTALL_HINT}")


def run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=120)


def helm_template(values: dict[str, Any], tmp_path: Path, release: str = "kvt",
                  namespace: str = "serving", kube_version: str | None = None
                  ) -> list[dict[str, Any]]:
    """`helm template` of the chart with these values: the objects it renders."""
    values_file = tmp_path / f"values-{len(list(tmp_path.glob('values-*')))}.yaml"
    values_file.write_text(yaml.safe_dump(values))
    args = [tool("helm"), "template", release, str(CHART), "--namespace", namespace,
            "--values", str(values_file)]
    if kube_version:
        args += ["--kube-version", kube_version]
    done = run(args)
    assert done.returncode == 0, f"helm template failed: {done.stderr.strip()}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def helm_template_error(values: dict[str, Any], tmp_path: Path) -> str:
    """What `helm template` says when it refuses these values."""
    values_file = tmp_path / "refused.yaml"
    values_file.write_text(yaml.safe_dump(values))
    done = run([tool("helm"), "template", "kvt", str(CHART), "--values", str(values_file)])
    assert done.returncode != 0, f"helm template accepted {values}"
    return done.stderr


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize`: what `kubectl apply -k` would send."""
    done = run([tool("kubectl"), "kustomize", str(directory)])
    assert done.returncode == 0, f"kubectl kustomize {directory} failed: {done.stderr.strip()}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def kubernetes_versions() -> list[str]:
    """Every minor release kubernetes-validate has schemas for from 1.29 (the first
    with native sidecars on by default; in 1.28 the kubelet would run the daemon as a
    plain init container that never ends) to the newest."""
    from kubernetes_validate import utils

    versions = sorted(set(utils.all_versions()), key=lambda v: tuple(map(int, v.split("."))))
    return [v for v in versions if tuple(map(int, v.split(".")[:2])) >= (1, 29)]


def schema_errors(objects: Iterable[dict[str, Any]], version: str) -> list[str]:
    """Objects that do not match Kubernetes `version`'s API schema, strictly (an
    unknown field fails). CRD kinds are left to their own schema."""
    import kubernetes_validate

    errors = []
    for item in objects:
        if item["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(item, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            errors.append(f"{item['kind']} {item['metadata']['name']}: {error.message}")
    return errors


def prometheus_operator_errors(objects: list[dict[str, Any]]) -> list[str]:
    """ServiceMonitors and PrometheusRules that do not match the Prometheus Operator
    CRDs' schemas."""
    if not NODE_MODULES.is_dir():
        pytest.fail(f"the Prometheus Operator CRD schemas are not installed: {INSTALL_HINT}")
    done = run([tool("node"),
                str(ROOT / "tests" / "support" / "validate_prometheus_operator.mjs"),
                str(NODE_MODULES)], stdin=json.dumps(objects))
    assert done.returncode == 0, f"the CRD validator failed: {done.stderr.strip()}"
    verdicts = done.stdout.splitlines()
    assert len(verdicts) == len(objects), done.stdout
    return [f"{o['kind']} {o['metadata']['name']}: {v}"
            for o, v in zip(objects, verdicts, strict=True) if v != "ok"]
