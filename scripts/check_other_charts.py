"""Renders llm-d's llm-d-modelservice chart and vLLM's production-stack chart with the
values in deploy/helm/other-charts/, and checks the pods they make: the kvtether
daemon as a native sidecar, vLLM with the plugin on the daemon's socket, the ConfigMap
and Service the kvtether chart renders in sidecar-only mode, and every pod valid
against each Kubernetes API from 1.29 on (kubernetes-validate, strict).

Their charts are not part of this repository: point the script at checkouts of them.

    .venv/bin/python scripts/check_other_charts.py \\
        --llm-d-modelservice ../llm-d-modelservice/charts/llm-d-modelservice \\
        --production-stack ../production-stack/helm

production-stack lists two optional dependencies (kube-prometheus-stack and
prometheus-adapter, off by default) that `helm template` wants present; where they
are missing the script renders a copy of the chart with empty stand-ins for them,
which render nothing while off. Helm and kubectl come from scripts/install_k8s_tools.sh.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.k8s_tools import (  # noqa: E402
    helm_template,
    kubernetes_versions,
    run,
    schema_errors,
    tool,
)
from vllm_plugin import MIDDLEWARE, SCHEDULER_CLS  # noqa: E402

OTHER_CHARTS = ROOT / "deploy" / "helm" / "other-charts"
NAMESPACE = "serving"
WORKLOADS = {"Deployment", "StatefulSet"}


def _objects(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def _helm(release: str, chart: Path, values: Path) -> list[dict[str, Any]]:
    done = run([tool("helm"), "template", release, str(chart), "--namespace", NAMESPACE,
                "--values", str(values)])
    if done.returncode != 0:
        sys.exit(f"helm template {chart} failed: {done.stderr.strip()}")
    return _objects(done.stdout)


def render_llm_d(chart: Path) -> list[dict[str, Any]]:
    return _helm("qwen", chart, OTHER_CHARTS / "llm-d-modelservice.values.yaml")


def render_production_stack(chart: Path, work: Path) -> list[dict[str, Any]]:
    copy = work / "vllm-stack"
    shutil.copytree(chart, copy)
    for dependency in yaml.safe_load((copy / "Chart.yaml").read_text()).get("dependencies", []):
        present = list((copy / "charts").glob(f"{dependency['name']}*"))
        if not present:
            stand_in = copy / "charts" / dependency["name"]
            stand_in.mkdir(parents=True)
            (stand_in / "Chart.yaml").write_text(yaml.safe_dump({
                "apiVersion": "v2", "name": dependency["name"],
                "version": dependency["version"]}))
    rendered = _helm("vllm", copy, OTHER_CHARTS / "production-stack.values.yaml")
    kustomization = work / "kustomize"
    shutil.copytree(OTHER_CHARTS / "production-stack", kustomization)
    (kustomization / "rendered.yaml").write_text(yaml.safe_dump_all(rendered))
    done = run([tool("kubectl"), "kustomize", str(kustomization)])
    if done.returncode != 0:
        sys.exit(f"kubectl kustomize failed: {done.stderr.strip()}")
    return _objects(done.stdout)


def kvtether_objects(values_name: str, work: Path) -> list[dict[str, Any]]:
    values = yaml.safe_load((OTHER_CHARTS / values_name).read_text())
    return helm_template(values, work, release="kvtether", namespace=NAMESPACE)


def _mount_volume(pod: dict[str, Any], container: dict[str, Any], directory: str
                  ) -> dict[str, Any]:
    (mount,) = [m for m in container.get("volumeMounts", []) if m["mountPath"] == directory]
    volume: dict[str, Any] = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    return volume


def check_pod(where: str, pod: dict[str, Any], config_map: str) -> list[str]:
    """What is wrong with a pod that should carry kvtether; empty when nothing is."""
    problems = []
    sidecars = [c for c in pod.get("initContainers", []) if c["name"] == "kvtether"]
    engines = [c for c in pod["containers"] if c["name"] == "vllm"]
    if len(sidecars) != 1 or len(engines) != 1:
        return [f"{where}: no kvtether init container or no vllm container"]
    (sidecar,), (engine,) = sidecars, engines
    if sidecar.get("restartPolicy") != "Always":
        problems.append(f"{where}: kvtether is not a native sidecar (restartPolicy)")
    args = sidecar["args"]
    socket = args[args.index("--unix-socket") + 1]
    config = args[args.index("--config") + 1]
    command = [*engine.get("command", []), *engine.get("args", [])]
    for flag, value in (("--scheduler-cls", SCHEDULER_CLS), ("--scheduling-policy", "priority"),
                        ("--middleware", MIDDLEWARE)):
        if flag not in command or command[command.index(flag) + 1] != value:
            problems.append(f"{where}: vLLM runs without {flag} {value}")
    env = {e["name"]: e.get("value") for e in engine.get("env", [])}
    if env.get("KVTETHER_PLUGIN_DAEMON_ADDRESS") != f"unix:{socket}":
        problems.append(f"{where}: the plugin's address is not the daemon's socket {socket}")
    socket_dir = str(PurePosixPath(socket).parent)
    try:
        shared = [_mount_volume(pod, c, socket_dir) for c in (sidecar, engine)]
        if shared[0] != shared[1] or "emptyDir" not in shared[0]:
            problems.append(f"{where}: the socket's directory is not one shared emptyDir")
        mounted = _mount_volume(pod, sidecar, str(PurePosixPath(config).parent))
        if mounted.get("configMap", {}).get("name") != config_map:
            problems.append(f"{where}: the daemon's config is not ConfigMap {config_map}")
    except (ValueError, StopIteration):
        problems.append(f"{where}: a mount the daemon or vLLM needs is missing")
    return problems


def check(name: str, objects: list[dict[str, Any]], kvtether: list[dict[str, Any]]) -> int:
    (service,) = [o for o in kvtether if o["kind"] == "Service"]
    (config_map,) = [o["metadata"]["name"] for o in kvtether if o["kind"] == "ConfigMap"
                     and o["metadata"]["name"].endswith("-config")]
    selector = service["spec"]["selector"]
    problems: list[str] = []
    pods = []
    for workload in objects:
        if workload["kind"] not in WORKLOADS:
            continue
        template = workload["spec"]["template"]
        if selector.items() <= template["metadata"].get("labels", {}).items():
            where = f"{name} {workload['kind']} {workload['metadata']['name']}"
            pods.append(where)
            problems += check_pod(where, template["spec"], config_map)
    if not pods:
        problems.append(f"{name}: no pod carries the labels kvtether's Service selects "
                        f"({selector})")
    versions = kubernetes_versions()
    workloads = [o for o in objects if o["kind"] in WORKLOADS]
    for version in versions:
        problems += [f"{name}, Kubernetes {version}: {error}"
                     for error in schema_errors(workloads, version)]
    for problem in problems:
        print(f"FAIL {problem}")
    if not problems:
        print(f"ok   {name}: the kvtether sidecar in {', '.join(pods)}; "
              f"{len(workloads)} workloads valid in Kubernetes {versions[0]} to {versions[-1]}")
    return len(problems)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llm-d-modelservice", type=Path, required=True,
                        help="llm-d-modelservice's chart directory (charts/llm-d-modelservice)")
    parser.add_argument("--production-stack", type=Path, required=True,
                        help="production-stack's chart directory (helm/)")
    arguments = parser.parse_args()
    failures = 0
    with tempfile.TemporaryDirectory(prefix="kvt-other-charts-") as directory:
        work = Path(directory)
        charts = {"llm-d-modelservice": arguments.llm_d_modelservice,
                  "production-stack": arguments.production_stack}
        for name, chart in charts.items():
            meta = yaml.safe_load((chart / "Chart.yaml").read_text())
            print(f"---- {name}: chart {meta['name']} {meta['version']}")
            if name == "llm-d-modelservice":
                rendered, values = render_llm_d(chart), "kvtether-for-llm-d.values.yaml"
            else:
                rendered = render_production_stack(chart, work)
                values = "kvtether-for-production-stack.values.yaml"
            failures += check(name, rendered, kvtether_objects(values, work))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
