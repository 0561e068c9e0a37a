"""docs/routing.md's configuration is what the routers read and what kvtether serves.

The endpoint picker's configuration names only plugins llm-d-router registers, with
the parameters they take, and routes on the header vLLM reads as the job; the
llm-d-router chart values select the pods the kvtether chart renders; the Dynamo
snippets use the router flags and request fields Dynamo documents, and start the
workers with the plugin's scheduler class.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml
from markdown_it import MarkdownIt

import vllm_plugin
from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import engine_session_pb2_grpc
from tests.integration.test_metrics import scrape
from tests.support.daemon import running_daemon
from tests.support.k8s_tools import ROOT, helm_template

DOC = ROOT / "docs" / "routing.md"
# Plugin types llm-d-router v0.10.0 registers (cmd/epp/runner/runner.go and the plugins'
# *Type constants) that the page may use: scorers, pickers, profile handlers, filters.
EPP_PLUGIN_TYPES = {
    "session-affinity-scorer", "session-affinity-filter", "prefix-cache-scorer",
    "precise-prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer",
    "load-aware-scorer", "max-score-picker", "random-picker", "weighted-random-picker",
    "single-profile-handler", "decode-filter",
}
PICKERS = {"max-score-picker", "random-picker", "weighted-random-picker"}
PROFILE_HANDLERS = {"single-profile-handler"}
EPP_API_VERSIONS = {"llm-d.ai/v1alpha1"}
SESSION_AFFINITY_STRATEGIES = {"encoded_endpoint_header", "session_id"}
# vLLM reads the OpenAI request's session id from this header; kvtether names the job
# by it when vllm_xargs carries no job_id (vllm_plugin/metadata.py).
VLLM_SESSION_HEADER = "x-session-id"
# Dynamo: docs/components/router/router-configuration.md and frontend/nvext.md.
DYNAMO_FRONTEND_FLAGS = {"--router-mode", "--router-session-affinity-ttl-secs"}
DYNAMO_SESSION_ACTIONS = {"bind"}


def code_blocks(language: str) -> list[str]:
    tokens = MarkdownIt().parse(DOC.read_text())
    return [t.content for t in tokens if t.type == "fence" and t.info.strip() == language]


def yaml_blocks() -> list[Any]:
    return [yaml.safe_load(block) for block in code_blocks("yaml")]


def check_epp_config(config: dict[str, Any], where: str) -> None:
    assert config["apiVersion"] in EPP_API_VERSIONS and config["kind"] == "EndpointPickerConfig"
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    unknown = {p["type"] for p in plugins.values()} - EPP_PLUGIN_TYPES
    assert not unknown, f"{where}: plugin types {unknown} are not llm-d-router's"
    for plugin in plugins.values():
        if plugin["type"].startswith("session-affinity-"):
            params = plugin.get("parameters", {})
            assert params.get("strategy") in SESSION_AFFINITY_STRATEGIES, params
            if params["strategy"] == "session_id":
                sources = params["sessionIdConfig"]["sources"]
                assert all(len(source) == 1 and {"header", "attribute"} >= set(source)
                           for source in sources), sources
                assert sources[0] == {"header": VLLM_SESSION_HEADER}, (
                    f"{where}: the picker binds sessions by {sources[0]}, vLLM and kvtether "
                    f"name the job by {VLLM_SESSION_HEADER}")
                assert params["sessionIdConfig"]["evictionTtlSeconds"] > 60, (
                    f"{where}: a session binding must outlive the longest pin (60 s)")
    (profile,) = config["schedulingProfiles"]
    refs = [item["pluginRef"] for item in profile["plugins"]]
    assert set(refs) <= set(plugins), f"{where}: profile refers to {set(refs) - set(plugins)}"
    assert len(set(refs) & PICKERS) == 1, f"{where}: the profile needs one picker"
    assert len({p["type"] for p in plugins.values()} & PROFILE_HANDLERS) == 1
    weights = {item["pluginRef"]: float(item["weight"]) for item in profile["plugins"]
               if "weight" in item}
    affinity = [name for name in weights if plugins[name]["type"] == "session-affinity-scorer"]
    assert affinity, f"{where}: no session-affinity-scorer in the profile"
    others = sum(w for name, w in weights.items() if name not in affinity)
    assert weights[affinity[0]] > others, (
        f"{where}: session affinity weighs {weights[affinity[0]]}, the other scorers "
        f"{others}: load could send a job's turn away from its pin")


def test_endpoint_picker_configs_use_llm_d_router_plugins() -> None:
    configs = [b for b in yaml_blocks() if isinstance(b, dict) and b.get("kind")]
    assert configs, "docs/routing.md has no EndpointPickerConfig"
    for config in configs:
        check_epp_config(config, "EndpointPickerConfig block")


def test_llm_d_router_chart_values_select_the_kvtether_pods(tmp_path: Path) -> None:
    (values,) = [b for b in yaml_blocks() if isinstance(b, dict) and "router" in b]
    router = values["router"]
    epp = router["epp"]
    assert epp["flags"]["allow-experimental-plugins"] is True, (
        "the session-affinity plugins are Alpha: the picker needs --allow-experimental-plugins")
    embedded = yaml.safe_load(epp["pluginsCustomConfig"][epp["pluginsConfigFile"]])
    check_epp_config(embedded, "router.epp.pluginsCustomConfig")
    configs = [b for b in yaml_blocks() if isinstance(b, dict) and b.get("kind")]
    assert embedded in configs, "the chart values embed another picker configuration"

    objects = helm_template({}, tmp_path, release="kvt")
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = router["modelServers"]["matchLabels"]
    assert selector.items() <= labels.items(), (
        f"the router selects {selector}, the kvtether chart's pods carry {labels}")
    (engine,) = deployment["spec"]["template"]["spec"]["containers"]
    served = {p["containerPort"] for p in engine["ports"]}
    assert {p["number"] for p in router["modelServers"]["targetPorts"]} <= served


def test_dynamo_commands_use_the_router_flags_and_the_plugin() -> None:
    (script,) = code_blocks("bash")
    lines = [shlex.split(line) for line in script.replace("\\\n", " ").splitlines() if line]
    frontend = next(words for words in lines if "dynamo.frontend" in words)
    flags = {w for w in frontend if w.startswith("--")}
    assert flags == DYNAMO_FRONTEND_FLAGS, flags
    assert frontend[frontend.index("--router-mode") + 1] == "kv"
    assert int(frontend[frontend.index("--router-session-affinity-ttl-secs") + 1]) > 60
    worker = next(words for words in lines if "dynamo.vllm" in words)
    assert worker[worker.index("--scheduler-cls") + 1] == vllm_plugin.SCHEDULER_CLS
    assert worker[worker.index("--scheduling-policy") + 1] == "priority"
    address = next(w for w in worker if w.startswith("KVTETHER_PLUGIN_DAEMON_ADDRESS="))
    assert address.split("=", 1)[1].startswith("unix:")


def test_dynamo_session_control_body_is_router_only_affinity() -> None:
    (body,) = [json.loads(block) for block in code_blocks("json")]
    control = body["nvext"]["session_control"]
    assert set(control) == {"session_id", "action", "timeout"}
    assert control["action"] in DYNAMO_SESSION_ACTIONS, (
        "open/close start engine-side streaming sessions, which vLLM workers do not have")
    assert isinstance(control["timeout"], int) and control["timeout"] > 60


def test_client_example_sends_the_job_id_as_the_session_header() -> None:
    (example,) = code_blocks("python")
    header = re.search(r'"X-Session-ID":\s*"([^"]+)"', example)
    job = re.search(r'"job_id":\s*"([^"]+)"', example)
    assert header and job and header[1] == job[1], (
        "the client example must name the job the same way in the header and vllm_xargs")


def _pin_two_jobs_one_comes_back(stub: engine_session_pb2_grpc.EngineSessionStub,
                                 round_number: int, seq: int) -> int:
    """One engine's round: two jobs' turns finish and are pinned; one job's next turn
    comes back while its pin holds, the other's pin is released first. Returns the
    next sequence number."""
    kv = pb.KvCapacity(total_blocks=100, free_blocks=50, block_size_tokens=16)
    back, away = f"back-{round_number}", f"away-{round_number}"
    now_s = 10.0 * round_number

    def step(**fields: object) -> None:
        nonlocal seq, now_s
        seq, now_s = seq + 1, now_s + 1.0
        stub.Step(pb.StepReport(engine_id="pod-a", seq=seq, snapshot=seq == 1, now_s=now_s,
                                kv=kv, **fields))  # type: ignore[arg-type]

    step(new_requests=[pb.NewRequest(request_id=f"{job}-0", job_id=job, arrival_s=now_s)
                       for job in (back, away)])
    step(events=[pb.RequestEvent(request_id=f"{job}-0", kind=pb.EVENT_KIND_ADMITTED,
                                 at_s=now_s) for job in (back, away)])
    step(events=[pb.RequestEvent(request_id=f"{job}-0", kind=pb.EVENT_KIND_FINISHED,
                                 at_s=now_s, tool="ls", blocks=4,
                                 finish_reason=pb.FINISH_REASON_STOP)
                 for job in (back, away)])
    # The returning job's next turn arrives while its pin holds; the other job's pin
    # is released (expired on the engine) before its next turn.
    step(new_requests=[pb.NewRequest(request_id=f"{back}-1", job_id=back, arrival_s=now_s)],
         released_pins=[f"{away}-0"])
    step(released_pins=[f"{back}-0"])
    return seq


def _as_scraped(families: dict[str, Any], names: tuple[str, ...]) -> dict[str, float]:
    """Samples of ``names`` in promtool's series notation, with the labels Prometheus'
    Kubernetes scrape adds to a daemon target."""
    target = {"job": "kvtether", "namespace": "inference", "instance": "10.0.0.1:9400"}
    series = {}
    for name in names:
        for (sample, *labels), value in families[name][1].items():
            pairs = sorted({**target, **dict(labels)}.items())
            series[sample + "{" + ", ".join(f'{k}="{v}"' for k, v in pairs) + "}"] = value
    return series


def test_the_unreturned_pin_query_returns_each_engines_share_from_a_live_daemon(
        tmp_path: Path) -> None:
    """The page's PromQL, evaluated by promtool on what a real daemon exported at two
    scrapes a minute apart: one engine, whose daemon ended 4 pins between them, 2 of
    them released before their job came back (the share 0.5)."""
    (query,) = code_blocks("promql")
    with running_daemon("--policy", "continuum") as daemon:
        stub = engine_session_pb2_grpc.EngineSessionStub(daemon.channel())
        seq = _pin_two_jobs_one_comes_back(stub, 1, 0)
        names = ("kvtether_pins_unreturned", "kvtether_pins_ended")
        first = _as_scraped(scrape(daemon.metrics_port), names)
        seq = _pin_two_jobs_one_comes_back(stub, 2, seq)
        _pin_two_jobs_one_comes_back(stub, 3, seq)
        second = _as_scraped(scrape(daemon.metrics_port), names)
    assert sorted(first) == sorted(second), (first, second)
    assert second['kvtether_pins_unreturned_total{engine_id="pod-a", instance="10.0.0.1:9400",'
                  ' job="kvtether", namespace="inference"}'] == 3.0, second
    rule_test = {
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{"series": name, "values": f"{first[name]} {second[name]}"}
                             for name in sorted(first)],
            "promql_expr_test": [{
                "expr": query.strip(),
                "eval_time": "1m",
                "exp_samples": [{"labels": '{engine_id="pod-a", instance="10.0.0.1:9400", '
                                           'job="kvtether", namespace="inference"}',
                                 "value": 0.5}],
            }],
        }],
    }
    (tmp_path / "query.test.yml").write_text(yaml.safe_dump(rule_test, sort_keys=False))
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: scripts/dev.sh test installs Debian's prometheus"
    done = subprocess.run([promtool, "test", "rules", "query.test.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"{query}\n{done.stdout}{done.stderr}"
