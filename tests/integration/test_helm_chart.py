"""The Helm chart (deploy/helm/kvtether) renders what a cluster accepts and runs.

Rendered by the real Helm (``helm template``, ``helm lint --strict``), with the
defaults, with every optional object on, and with TLS, tokens and a Redis URL from
Secrets. The output is checked against each Kubernetes release's API schema from 1.29
on (kubernetes-validate, strict), the ServiceMonitor against the Prometheus Operator
CRD's schema, the daemon's rendered configuration through ``kvtether serve --check``,
and the TLS-and-tokens sidecar is run natively with its own probe. No cluster is needed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import grpc
import pytest
import yaml

import vllm_plugin
from sidecar.api.v1 import (
    engine_session_pb2,
    engine_session_pb2_grpc,
    inspect_pb2,
    inspect_pb2_grpc,
)
from sidecar.config import load_config
from tests.support.certs import CertificateAuthority
from tests.support.cli_args import flag_value, with_flag
from tests.support.daemon import serve_command, wait_serving
from tests.support.k8s_tools import (
    CHART,
    ROOT,
    helm_template,
    helm_template_error,
    kubernetes_versions,
    kustomize,
    prometheus_operator_errors,
    run,
    schema_errors,
    tool,
)
from tests.support.redis_server import free_port
from vllm_plugin.settings import PluginSettings

ENGINE_TOKEN = "engine-token-0123456789abcdef"
OPERATOR_TOKEN = "operator-token-0123456789abcdef"
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "optional-objects-on": {
        "replicaCount": 3,
        "store": {"redisUrl": "redis://redis.cache:6379/0"},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "networkPolicy": {"enabled": True, "metricsFrom": [{"namespaceSelector": {
            "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]},
        "podDisruptionBudget": {"enabled": True},
        "vllm": {"extraArgs": ["--max-model-len", "32768"],
                 "modelCache": {"existingClaim": "hf-cache"}},
    },
    "tls-and-tokens": {
        "auth": {"enabled": True, "existingSecret": "kvtether-auth"},
        "tls": {"enabled": True, "existingSecret": "kvtether-tls", "mutual": True},
        "store": {"redisUrlSecret": {"name": "kvtether-redis", "key": "url"}},
        "daemon": {"policy": {"name": "adaptive", "params": {"adaptive": {"min_samples": 3}}},
                   "config": {"store": {"history_ttl_s": 7200}}},
    },
}


# Sidecar-only mode beside another chart's pods, every optional object on.
SIDECAR_ONLY: dict[str, Any] = {
    "mode": "sidecar-only",
    "targetPods": {"matchLabels": {"llm-d.ai/role": "decode", "kvtether.io/sidecar": "true"}},
    "store": {"redisUrl": "redis://redis.cache:6379/0"},
    "serviceMonitor": {
        "enabled": True, "labels": {"release": "prometheus"},
        "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_label_llm_d_ai_model"],
                         "targetLabel": "model_name"}],
        "metricRelabelings": [{"sourceLabels": ["__name__"], "regex": "python_gc_.*",
                               "action": "drop"}]},
    "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}},
    "dashboard": {"enabled": True},
    "networkPolicy": {"enabled": True, "servingPorts": [8000, 8200]},
    "podDisruptionBudget": {"enabled": True},
}
RULES = ROOT / "deploy" / "prometheus" / "kvtether-rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvtether-dashboard.json"
OTHER_CHARTS = ROOT / "deploy" / "helm" / "other-charts"


def render(name: str, tmp_path: Path, kube_version: str | None = None) -> list[dict[str, Any]]:
    return helm_template(VALUE_SETS[name], tmp_path, kube_version=kube_version)


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind
             and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, rendered {len(found)}"
    return found[0]


def pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "Deployment")["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def containers(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = pod(objects)
    (daemon,) = [c for c in spec["initContainers"] if c["name"] == "kvtether"]
    (engine,) = [c for c in spec["containers"] if c["name"] == "vllm"]
    return daemon, engine


def mounted_from(spec: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    """The pod volume a container mounts at the directory holding path."""
    directory = str(PurePosixPath(path).parent)
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
    return next(v for v in spec["volumes"] if v["name"] == mount["name"])  # type: ignore[no-any-return]


# --- Helm itself -----------------------------------------------------------------------

@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint_passes_strictly(name: str, tmp_path: Path) -> None:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(VALUE_SETS[name]))
    done = run([tool("helm"), "lint", "--strict", str(CHART), "--values", str(values_file)])
    assert done.returncode == 0, f"helm lint --strict ({name}): {done.stdout}{done.stderr}"


@pytest.mark.parametrize(("values", "named"), [
    ({"daemon": {"polcy": {"name": "fcfs"}}}, "polcy"),
    ({"auth": {"enabled": True}}, "/auth/existingSecret"),
    ({"tls": {"enabled": True}}, "/tls/existingSecret"),
    ({"daemon": {"unixSocket": "kvtether.sock"}}, "/daemon/unixSocket"),
    ({"store": {"redisUrl": "http://redis:6379"}}, "/store/redisUrl"),
    ({"serviceMonitor": {"interval": "often"}}, "/serviceMonitor/interval"),
])
def test_values_schema_refuses_bad_values_naming_the_field(values: dict[str, Any], named: str,
                                                           tmp_path: Path) -> None:
    error = helm_template_error(values, tmp_path)
    assert named in error, f"helm's refusal of {values} does not name {named}: {error}"


def test_install_notes_point_several_replicas_at_routing_and_a_shared_store(
        tmp_path: Path) -> None:
    def notes(values: dict[str, Any]) -> str:
        values_file = tmp_path / "notes.yaml"
        values_file.write_text(yaml.safe_dump(values))
        done = run([tool("helm"), "install", "kvt", str(CHART), "--dry-run=client",
                    "--values", str(values_file)])
        assert done.returncode == 0, done.stderr
        return done.stdout.partition("NOTES:")[2]

    single = notes({})
    assert "kvtether inspect --address 127.0.0.1:50051 pins" in single
    assert "docs/routing.md" not in single
    several = notes({"replicaCount": 2})
    assert "docs/routing.md" in several and "store.redisUrl" in several
    shared = notes({"replicaCount": 2, "store": {"redisUrl": "redis://redis:6379/0"}})
    assert "docs/routing.md" in shared and "store.redisUrl" not in shared
    mutual = notes(VALUE_SETS["tls-and-tokens"])
    assert "--tls-ca ca.crt --tls-cert client.crt --tls-key client.key" in mutual
    # With tokens, Inspect answers only a token of a read scope.
    assert "--token-file TOKEN_FILE pins" in mutual and "--token-file" not in single


# --- what the API server accepts ---------------------------------------------------------

@pytest.mark.parametrize("name", VALUE_SETS)
def test_rendered_objects_match_every_supported_kubernetes_api(name: str,
                                                               tmp_path: Path) -> None:
    versions = kubernetes_versions()
    assert versions[0] == "1.29.0" and len(versions) >= 9, versions
    for version in versions:
        errors = schema_errors(render(name, tmp_path, kube_version=version), version)
        assert not errors, f"{name} is invalid in Kubernetes {version}: {errors}"


def test_optional_objects_are_off_by_default_and_on_when_asked(tmp_path: Path) -> None:
    optional = {"ServiceMonitor", "NetworkPolicy", "PodDisruptionBudget"}
    assert not optional & {o["kind"] for o in render("defaults", tmp_path)}
    assert optional <= {o["kind"] for o in render("optional-objects-on", tmp_path)}


def test_servicemonitor_matches_its_crd_and_scrapes_both_metrics_ports(tmp_path: Path) -> None:
    objects = render("optional-objects-on", tmp_path)
    monitor = one(objects, "ServiceMonitor")
    assert prometheus_operator_errors([monitor]) == []
    # The validator does refuse what the CRD forbids.
    broken = {**monitor, "spec": {**monitor["spec"], "endpoints": [{"port": 9400}]}}
    (refusal,) = prometheus_operator_errors([broken])
    assert "port" in refusal, refusal

    selector = monitor["spec"]["selector"]["matchLabels"]
    selected = [s for s in objects if s["kind"] == "Service"
                and selector.items() <= s["metadata"]["labels"].items()]
    port_names = {p["name"]: p for s in selected for p in s["spec"]["ports"]}
    daemon, _ = containers(objects)
    scraped = {e["port"] for e in monitor["spec"]["endpoints"]}
    assert scraped == {"metrics", "http"} and scraped <= set(port_names), (
        f"the ServiceMonitor scrapes ports {scraped}; the Services it selects have "
        f"{sorted(port_names)}")
    assert port_names["metrics"]["targetPort"] == int(flag_value(daemon["args"],
                                                                 "--metrics-port") or 0)
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == ["serving"]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"


def test_network_policy_and_budget_cover_the_pods(tmp_path: Path) -> None:
    objects = render("optional-objects-on", tmp_path)
    labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    policy, budget = one(objects, "NetworkPolicy"), one(objects, "PodDisruptionBudget")
    for item in (policy["spec"]["podSelector"], budget["spec"]["selector"]):
        assert item["matchLabels"].items() <= labels.items()
    daemon, engine = containers(objects)
    opened = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    served = {p["containerPort"] for c in (daemon, engine) for p in c["ports"]}
    assert opened == served, f"the NetworkPolicy opens {opened}, the pod serves {served}"
    # One GPU per replica: a budget of minAvailable would block every node drain.
    assert budget["spec"].get("maxUnavailable") == 1 and "minAvailable" not in budget["spec"]


# --- sidecar-only mode, monitoring objects ----------------------------------------------------

def test_sidecar_only_renders_the_daemons_objects_and_no_vllm(tmp_path: Path) -> None:
    objects = helm_template(SIDECAR_ONLY, tmp_path, release="kvtether")
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == [
        ("ConfigMap", "kvtether-config"), ("ConfigMap", "kvtether-dashboard"),
        ("NetworkPolicy", "kvtether"), ("PodDisruptionBudget", "kvtether"),
        ("PrometheusRule", "kvtether"), ("Service", "kvtether-daemon"),
        ("ServiceMonitor", "kvtether"),
    ]
    selector = SIDECAR_ONLY["targetPods"]["matchLabels"]
    assert one(objects, "Service")["spec"]["selector"] == selector
    assert one(objects, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"] == selector
    assert one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == selector
    # The target pods' own serving ports stay open beside the daemon's: the policy
    # isolates every pod it selects.
    opened = {p["port"] for rule in one(objects, "NetworkPolicy")["spec"]["ingress"]
              for p in rule["ports"]}
    assert opened == {8000, 8200, 50051, 9400}
    config = yaml.safe_load(one(objects, "ConfigMap", "kvtether-config")["data"]["kvtether.yaml"])
    assert config["store"]["redis_url"] == "redis://redis.cache:6379/0"


def test_sidecar_only_lints_and_matches_every_supported_kubernetes_api_and_the_crds(
        tmp_path: Path) -> None:
    values_file = tmp_path / "sidecar-only.yaml"
    values_file.write_text(yaml.safe_dump(SIDECAR_ONLY))
    done = run([tool("helm"), "lint", "--strict", str(CHART), "--values", str(values_file)])
    assert done.returncode == 0, f"helm lint --strict (sidecar-only): {done.stdout}{done.stderr}"
    for version in kubernetes_versions():
        objects = helm_template(SIDECAR_ONLY, tmp_path, kube_version=version)
        errors = schema_errors(objects, version)
        assert not errors, f"sidecar-only is invalid in Kubernetes {version}: {errors}"
    crds = [o for o in objects if o["kind"] in {"ServiceMonitor", "PrometheusRule"}]
    assert len(crds) == 2 and prometheus_operator_errors(crds) == []
    # The validator does refuse what the PrometheusRule CRD forbids.
    rule = one(crds, "PrometheusRule")
    broken = {**rule, "spec": {"groups": [{"name": "g", "rules": [{"alert": "A"}]}]}}
    (refusal,) = prometheus_operator_errors([broken])
    assert "expr" in refusal, refusal


def test_sidecar_only_daemon_config_passes_the_cli_check(tmp_path: Path) -> None:
    objects = helm_template(SIDECAR_ONLY, tmp_path)
    config_file = tmp_path / "kvtether.yaml"
    config = one(objects, "ConfigMap", "kvt-kvtether-config")["data"]["kvtether.yaml"]
    config_file.write_text(config)
    done = subprocess.run(serve_command("--config", str(config_file), "--check"),
                          capture_output=True, text=True, timeout=60, env=clean_env(), cwd=ROOT)
    assert done.returncode == 0 and "configuration ok" in done.stdout, done.stderr


@pytest.mark.parametrize(("values", "named"), [
    ({"mode": "sidecar-only"}, "targetPods"),
    ({"mode": "sidecar-only", "targetPods": {"matchLabels": {}}}, "/targetPods/matchLabels"),
    ({"mode": "sidecar"}, "/mode"),
    ({"mode": "sidecar-only", "targetPods": {"matchLabels": {"app": "vllm"}},
      "networkPolicy": {"enabled": True}}, "networkPolicy.servingPorts"),
    ({"serviceMonitor": {"relabelings": {"targetLabel": "model_name"}}},
     "/serviceMonitor/relabelings"),
])
def test_sidecar_only_refuses_what_would_select_or_close_the_wrong_pods(
        values: dict[str, Any], named: str, tmp_path: Path) -> None:
    error = helm_template_error(values, tmp_path)
    assert named in error, f"helm's refusal of {values} does not name {named}: {error}"


def test_prometheus_rule_and_dashboard_are_the_deploy_files(tmp_path: Path) -> None:
    """One copy: the chart reads deploy/prometheus's rules and deploy/grafana's
    dashboard through links in its files/, so they cannot drift."""
    import json

    for mode in ({"mode": "pod"}, SIDECAR_ONLY):
        objects = helm_template({**mode, "prometheusRule": {"enabled": True},
                                 "dashboard": {"enabled": True}}, tmp_path)
        rule = one(objects, "PrometheusRule")
        assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
        dashboard = [o for o in objects if o["kind"] == "ConfigMap"
                     and o["metadata"]["name"].endswith("-dashboard")]
        (data,) = [d["data"]["kvtether-dashboard.json"] for d in dashboard]
        assert json.loads(data) == json.loads(DASHBOARD.read_text())
        assert dashboard[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    for link, target in (("kvtether-rules.yml", RULES), ("kvtether-dashboard.json", DASHBOARD)):
        assert (CHART / "files" / link).resolve() == target.resolve(), (
            f"the chart's files/{link} is not a link to {target.relative_to(ROOT)}")


@pytest.mark.parametrize("mode", ["pod", "sidecar-only"])
def test_servicemonitor_names_the_daemons_job_kvtether_as_the_alert_expects(
        mode: str, tmp_path: Path) -> None:
    """The ServiceMonitor's jobLabel gives the daemon's target job kvtether and vLLM's
    job vllm: KvtetherDaemonDown takes a down target of job kvtether for a daemon, and
    never vLLM's, down while its model loads."""
    values = SIDECAR_ONLY if mode == "sidecar-only" else VALUE_SETS["optional-objects-on"]
    objects = helm_template(values, tmp_path)
    monitor = one(objects, "ServiceMonitor")
    job_label = monitor["spec"]["jobLabel"]
    jobs = {port["name"]: service["metadata"]["labels"][job_label]
            for service in objects if service["kind"] == "Service"
            for port in service["spec"]["ports"]}
    scraped = {e["port"]: jobs[e["port"]] for e in monitor["spec"]["endpoints"]}
    assert scraped == ({"metrics": "kvtether"} if mode == "sidecar-only"
                       else {"metrics": "kvtether", "http": "vllm"}), scraped
    alerts = {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"]
              for r in g["rules"] if "alert" in r}
    assert 'up{job="kvtether"}' in alerts["KvtetherDaemonDown"]["expr"]
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint.get("relabelings") == values["serviceMonitor"].get("relabelings")
        assert endpoint.get("metricRelabelings") == values["serviceMonitor"].get(
            "metricRelabelings")


# --- the values that add kvtether to other charts' pods -----------------------------------

def _sidecar_without_port_names(container: dict[str, Any]) -> dict[str, Any]:
    """The sidecar with its ports by number only: in other charts' pods they are
    kvt-grpc and kvt-metrics, since llm-d's PodMonitor scrapes every port named
    metrics as vLLM's."""
    return {**container, "ports": sorted(p["containerPort"] for p in container["ports"])}


def test_other_charts_values_carry_the_charts_own_sidecar_and_its_configmap(
        tmp_path: Path) -> None:
    daemon, engine = containers(render("defaults", tmp_path))
    llm_d = yaml.safe_load((OTHER_CHARTS / "llm-d-modelservice.values.yaml").read_text())
    patch = yaml.safe_load(
        (OTHER_CHARTS / "production-stack" / "kvtether-sidecar.patch.yaml").read_text())
    stack = yaml.safe_load((OTHER_CHARTS / "production-stack.values.yaml").read_text())
    (llm_d_sidecar,) = llm_d["decode"]["initContainers"]
    (stack_sidecar,) = patch["spec"]["template"]["spec"]["initContainers"]
    for sidecar in (llm_d_sidecar, stack_sidecar):
        assert _sidecar_without_port_names(sidecar) == _sidecar_without_port_names(daemon)
        assert "metrics" not in {p["name"] for p in sidecar["ports"]}
    # The ConfigMap they mount is the one the kvtether chart renders for them.
    for kvtether_values, volumes in (
            ("kvtether-for-llm-d.values.yaml", llm_d["decode"]["volumes"]),
            ("kvtether-for-production-stack.values.yaml",
             stack["servingEngineSpec"]["modelSpec"][0]["extraVolumes"])):
        values = yaml.safe_load((OTHER_CHARTS / kvtether_values).read_text())
        objects = helm_template(values, tmp_path, release="kvtether")
        config_maps = {o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"}
        mounted = {v["configMap"]["name"] for v in volumes if "configMap" in v}
        assert mounted == {"kvtether-config"} and mounted <= config_maps, (kvtether_values,
                                                                           config_maps)
        assert prometheus_operator_errors(
            [o for o in objects if o["kind"] in {"ServiceMonitor", "PrometheusRule"}]) == []
    # vLLM's side: the plugin's flags and environment as the chart's own pod sets them.
    flags = engine["args"][engine["args"].index("--scheduler-cls"):]
    plugin_env = [e for e in engine["env"] if e["name"].startswith("KVTETHER_PLUGIN_")]
    (llm_d_vllm,) = llm_d["decode"]["containers"]
    stack_model = stack["servingEngineSpec"]["modelSpec"][0]
    assert llm_d_vllm["args"] == flags and stack_model["vllmConfig"]["extraArgs"] == flags
    assert llm_d_vllm["env"] == plugin_env and stack_model["env"] == plugin_env


# --- the pod: sidecar, socket, secrets -------------------------------------------------------

@pytest.mark.parametrize("name", VALUE_SETS)
def test_pod_runs_the_daemon_as_a_native_sidecar_on_a_shared_socket(name: str,
                                                                    tmp_path: Path) -> None:
    objects = render(name, tmp_path)
    spec = pod(objects)
    daemon, engine = containers(objects)
    assert daemon["restartPolicy"] == "Always", "the daemon is not a native sidecar"
    socket_path = flag_value(daemon["args"], "--unix-socket") or ""
    env = {e["name"]: e["value"] for e in engine["env"]
           if e["name"].startswith("KVTETHER_PLUGIN_") and "value" in e}
    if "KVTETHER_PLUGIN_TOKEN_FILE" in env:  # the Secret's file, here
        (tmp_path / "engine-token").write_text(ENGINE_TOKEN)
        env["KVTETHER_PLUGIN_TOKEN_FILE"] = str(tmp_path / "engine-token")
    settings = PluginSettings.from_env(env)
    assert settings.daemon_address == f"unix:{socket_path}"
    volumes = [mounted_from(spec, c, socket_path) for c in (daemon, engine)]
    assert volumes[0] == volumes[1] and "emptyDir" in volumes[0]
    assert flag_value(engine["args"], "--scheduler-cls") == vllm_plugin.SCHEDULER_CLS
    assert flag_value(engine["args"], "--scheduling-policy") == "priority"
    assert flag_value(engine["args"], "--middleware") == vllm_plugin.MIDDLEWARE
    grpc_port = int((flag_value(daemon["args"], "--listen") or "").rpartition(":")[2])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if name == "tls-and-tokens":
            # The kubelet's gRPC probe speaks no TLS: the check goes over the socket.
            assert f"unix:{socket_path}" in daemon[probe]["exec"]["command"][-1]
        else:
            assert daemon[probe]["grpc"]["port"] == grpc_port
    config_volume = mounted_from(spec, daemon, flag_value(daemon["args"], "--config") or "")
    assert config_volume["configMap"]["name"] == one(objects, "ConfigMap")["metadata"]["name"]
    services = [o for o in objects if o["kind"] == "Service"]
    labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for c in (daemon, engine) for p in c["ports"]}
    for service in services:
        assert service["spec"]["selector"].items() <= labels.items()
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            assert ports.get(target, target) in ports.values(), (
                f"Service {service['metadata']['name']} targets {target}; the pod serves {ports}")


@pytest.mark.parametrize("name", VALUE_SETS)
def test_no_mount_lies_inside_another(name: str, tmp_path: Path) -> None:
    # The runtime cannot create a mount point inside a read-only ConfigMap or Secret
    # volume: such a pod never starts.
    for container in containers(render(name, tmp_path)):
        paths = [PurePosixPath(m["mountPath"]) for m in container["volumeMounts"]]
        nested = [(inner, outer) for inner in paths for outer in paths
                  if inner != outer and outer in inner.parents]
        assert not nested, f"{name}: {container['name']} mounts {nested} (inner, outer)"


def test_each_container_gets_only_its_own_secret_keys(tmp_path: Path) -> None:
    objects = render("tls-and-tokens", tmp_path)
    spec = pod(objects)
    daemon, engine = containers(objects)
    config = yaml.safe_load(one(objects, "ConfigMap")["data"]["kvtether.yaml"])
    tokens = mounted_from(spec, daemon, config["auth"]["tokens_file"])["secret"]
    assert tokens["secretName"] == "kvtether-auth"
    assert [i["key"] for i in tokens["items"]] == ["tokens.yaml"]
    engine_env = {e["name"]: e.get("value") for e in engine["env"]}
    engine_token = mounted_from(spec, engine, engine_env["KVTETHER_PLUGIN_TOKEN_FILE"])["secret"]
    assert [i["key"] for i in engine_token["items"]] == ["engine-token"]
    tls = {mounted_from(spec, daemon, config["tls"][key])["secret"]["secretName"]
           for key in ("cert_file", "key_file", "client_ca_file")}
    assert tls == {"kvtether-tls"}
    assert not any(m["name"] in {"kvtether-auth", "kvtether-tls"}
                   for m in engine["volumeMounts"]), "vLLM mounts the daemon's secrets"
    (redis_env,) = daemon["env"]
    assert redis_env["name"] == "KVTETHER_STORE__REDIS_URL"
    assert redis_env["valueFrom"]["secretKeyRef"] == {"name": "kvtether-redis", "key": "url"}


def test_chart_defaults_are_the_kustomize_manifests(tmp_path: Path) -> None:
    chart_daemon, chart_engine = containers(render("defaults", tmp_path))
    kustomized = [o for o in kustomize(ROOT / "deploy" / "k8s")
                  if o["kind"] == "Deployment" and o["metadata"]["name"] == "vllm"]
    spec = kustomized[0]["spec"]["template"]["spec"]
    (k8s_daemon,) = spec["initContainers"]
    (k8s_engine,) = spec["containers"]
    assert chart_daemon["resources"] == k8s_daemon["resources"]
    assert chart_engine["resources"] == k8s_engine["resources"]
    assert chart_daemon["image"] == k8s_daemon["image"]
    assert chart_engine["args"] == k8s_engine["args"]
    for key in ("startupProbe", "readinessProbe", "livenessProbe", "securityContext", "ports"):
        assert chart_daemon[key] == k8s_daemon[key], f"the daemon's {key} differs"
    for key in ("startupProbe", "readinessProbe", "livenessProbe", "ports"):
        assert chart_engine[key] == k8s_engine[key], f"vLLM's {key} differs"
    for flag in ("--listen", "--unix-socket", "--metrics-port", "--metrics-host"):
        assert flag_value(chart_daemon["args"], flag) == flag_value(k8s_daemon["args"], flag)


# --- the daemon as the chart configures it ---------------------------------------------------

def host_copy(objects: list[dict[str, Any]], tmp_path: Path, socket_path: Path
              ) -> tuple[list[str], Path]:
    """The rendered sidecar made runnable here: its config file, TLS files and tokens
    file at temporary paths, free ports, a short socket path. Returns (args, config)."""
    daemon, _ = containers(objects)
    text = one(objects, "ConfigMap")["data"]["kvtether.yaml"]
    config = yaml.safe_load(text)
    if "tls" in config:
        authority = CertificateAuthority(tmp_path, "ca")
        server = authority.issue("server", "localhost", server=True)
        files = {"cert_file": server.cert, "key_file": server.key,
                 "client_ca_file": authority.issued.cert}
        config["tls"] = {key: str(files[key]) for key in config["tls"]}
    if "auth" in config:
        tokens = tmp_path / "tokens.yaml"
        tokens.write_text(yaml.safe_dump({ENGINE_TOKEN: config["auth"]["engine_scopes"][0],
                                          OPERATOR_TOKEN: "operators"}))
        config["auth"]["tokens_file"] = str(tokens)
    config_file = tmp_path / "kvtether.yaml"
    config_file.write_text(yaml.safe_dump(config))
    args = with_flag(daemon["args"], "--config", str(config_file))
    args = with_flag(args, "--unix-socket", str(socket_path))
    args = with_flag(args, "--listen", f"127.0.0.1:{free_port()}")
    return with_flag(args, "--metrics-port", str(free_port())), config_file


@pytest.mark.parametrize("name", VALUE_SETS)
def test_rendered_daemon_configuration_passes_the_cli_check(name: str, tmp_path: Path,
                                                            socket_path: Path) -> None:
    objects = render(name, tmp_path)
    args, config_file = host_copy(objects, tmp_path, socket_path)
    done = subprocess.run(serve_command(*args[1:], "--check"), capture_output=True, text=True,
                          timeout=60, env=clean_env(), cwd=ROOT)
    assert done.returncode == 0 and "configuration ok" in done.stdout, (
        f"{name}: the rendered daemon configuration fails --check: {done.stderr.strip()}")
    policy = load_config(config_file).policy
    wanted = {"defaults": ("continuum", {"ttl_mode": "fixed"}),
              "optional-objects-on": ("continuum", {"ttl_mode": "fixed"}),
              "tls-and-tokens": ("adaptive", {"min_samples": 3})}[name]
    assert (policy.name, dict(policy.params)) == wanted, (
        f"{name}: the daemon runs {policy.name} {policy.params}, the values say {wanted}")


def test_tls_and_tokens_sidecar_serves_the_plugin_and_passes_its_probe(
        tmp_path: Path, socket_path: Path) -> None:
    objects = render("tls-and-tokens", tmp_path)
    daemon, _ = containers(objects)
    args, _ = host_copy(objects, tmp_path, socket_path)
    container_socket = flag_value(daemon["args"], "--unix-socket") or ""
    probe = daemon["readinessProbe"]["exec"]["command"]
    probe = [sys.executable, *probe[1:-1], probe[-1].replace(container_socket, str(socket_path))]
    process = subprocess.Popen(serve_command(*args[1:]), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               env=clean_env())
    try:
        wait_serving(f"unix:{socket_path}", process=process)
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"the chart's probe failed on a serving daemon: {done.stderr}"
        # What the plugin does: report over the socket, with the engine token the chart
        # mounts; another scope's token is refused.
        with grpc.insecure_channel(f"unix:{socket_path}") as channel:
            assert step_code(channel, ENGINE_TOKEN) == grpc.StatusCode.OK
            assert step_code(channel, OPERATOR_TOKEN) == grpc.StatusCode.PERMISSION_DENIED
            # Reading takes a token when tokens are on: the operators' here.
            inspect = inspect_pb2_grpc.InspectStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                inspect.GetPolicy(inspect_pb2.GetPolicyRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            answer = inspect.GetPolicy(inspect_pb2.GetPolicyRequest(), timeout=5,
                                       metadata=[("authorization", f"Bearer {OPERATOR_TOKEN}")])
        assert answer.name == "adaptive"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0, "SIGTERM did not stop the sidecar cleanly"
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=10)
    done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0, "the chart's probe passes with no daemon"


# --- documents agree with the manifests --------------------------------------------------------

def test_documented_resources_are_the_manifests_and_the_chart(tmp_path: Path) -> None:
    # docs/operations.md states the figures; deploy/k8s is their source, the chart's
    # defaults repeat them.
    text = " ".join((ROOT / "docs" / "operations.md").read_text().split())
    daemon = re.search(r"The daemon requests (\S+) CPU and (\S+), with limits of (\S+) CPU "
                       r"and (\S+?)\.", text)
    engine = re.search(r"vLLM requests (\S+) CPU, (\S+) and one `nvidia.com/gpu`, with a "
                       r"(\S+) limit\.", text)
    redis = re.search(r"Redis requests (\S+) and (\S+), with a (\S+) limit\.", text)
    assert daemon and engine and redis, "docs/operations.md no longer states the resources"
    documented = {
        "kvtether": {"requests": {"cpu": daemon[1], "memory": daemon[2]},
                     "limits": {"cpu": daemon[3], "memory": daemon[4]}},
        "vllm": {"requests": {"cpu": engine[1], "memory": engine[2], "nvidia.com/gpu": 1},
                 "limits": {"memory": engine[3], "nvidia.com/gpu": 1}},
        "redis": {"requests": {"cpu": redis[1], "memory": redis[2]},
                  "limits": {"memory": redis[3]}},
    }
    manifests = {c["name"]: c["resources"] for o in kustomize(ROOT / "deploy" / "k8s")
                 if o["kind"] == "Deployment" for spec in [o["spec"]["template"]["spec"]]
                 for c in [*spec.get("initContainers", []), *spec["containers"]]}
    chart = {c["name"]: c["resources"] for c in containers(render("defaults", tmp_path))}
    for name, resources in documented.items():
        assert manifests[name] == resources, (
            f"docs/operations.md gives {name} {resources}, deploy/k8s {manifests[name]}")
        if name in chart:
            assert chart[name] == resources, (
                f"docs/operations.md gives {name} {resources}, the chart {chart[name]}")
    weight = re.search(r"`requests\.cpu` \((\S+)\)", text)
    assert weight and weight[1] == daemon[1], (
        "docs/operations.md's 'CPU for the daemon' names another CPU request")


# --- helpers ------------------------------------------------------------------------------------

@pytest.fixture
def socket_path() -> Iterator[Path]:
    # Unix socket paths are limited to ~108 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="kvt-") as directory:
        yield Path(directory) / "kvtether.sock"


def clean_env() -> dict[str, str]:
    """This process's environment without KVTETHER_* (they would change the config)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVTETHER_")}


def step_code(channel: grpc.Channel, token: str) -> grpc.StatusCode:
    report = engine_session_pb2.StepReport(engine_id="chart-engine", seq=1, snapshot=True,
                                           now_s=1.0)
    try:
        engine_session_pb2_grpc.EngineSessionStub(channel).Step(
            report, metadata=[("authorization", f"Bearer {token}")], timeout=5)
        return grpc.StatusCode.OK
    except grpc.RpcError as error:
        return error.code()  # type: ignore[no-any-return]
