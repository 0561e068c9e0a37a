"""Who may report for an engine, read the daemon and set its configuration — each with
its refusal, on real daemon processes and real gRPC clients: an engine id bound to its
token, takeovers rate-limited without tokens, engine and Inspect calls rate-limited per
caller, Inspect behind a token of a read scope, Explain paged, misspelt KVTETHER_*
variables, impossible tool times and negative counters refused."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from sidecar.api.v1 import engine_session_pb2 as pb
from sidecar.api.v1 import (
    engine_session_pb2_grpc,
    inspect_pb2,
    inspect_pb2_grpc,
    retention_pb2,
    retention_pb2_grpc,
)
from tests.integration.test_daemon_process import GRPCURL
from tests.integration.test_security import daemon_with
from tests.support.daemon import serve_command

POD_A_TOKEN = "pod-a-token-0123456789"
POD_B_TOKEN = "pod-b-token-0123456789"
SPARE_TOKEN = "spare-engine-token-0123456789"
OPERATOR_TOKEN = "operator-token-0123456789"
ORCHESTRATOR_TOKEN = "orchestrator-token-0123456789"
AUTH = {"auth": {
    "tokens": {POD_A_TOKEN: "pod-a", POD_B_TOKEN: "pod-b", SPARE_TOKEN: "spare",
               OPERATOR_TOKEN: "operators", ORCHESTRATOR_TOKEN: "dynamo"},
    "engine_scopes": ["pod-a", "pod-b", "spare"],
    # pod-b's token reports for pod-b only; spare's for any id.
    "engine_ids": {"pod-a": ["pod-a"], "pod-b": ["pod-b"]},
    "read_scopes": ["operators"],
}}
KV = pb.KvCapacity(total_blocks=100, free_blocks=100, block_size_tokens=16)


def bearer(token: str | None) -> list[tuple[str, str]] | None:
    return None if token is None else [("authorization", f"Bearer {token}")]


def snapshot(engine_id: str, seq: int = 1, now_s: float = 1.0, **fields: object
             ) -> pb.StepReport:
    return pb.StepReport(engine_id=engine_id, seq=seq, snapshot=True, now_s=now_s, kv=KV,
                         **fields)  # type: ignore[arg-type]


class LiveSession:
    """One engine's Session stream, a report at a time, as the plugin keeps it open."""

    def __init__(self, channel: grpc.Channel, token: str | None = None) -> None:
        self._outbox: queue.Queue[pb.StepReport | None] = queue.Queue()
        stub = engine_session_pb2_grpc.EngineSessionStub(channel)
        self._answers = stub.Session(iter(self._outbox.get, None), metadata=bearer(token),
                                     timeout=30)

    def send(self, report: pb.StepReport) -> pb.StepDecision:
        self._outbox.put(report)
        return next(self._answers)  # type: ignore[no-any-return]

    def refusal(self, report: pb.StepReport) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as refused:
            self.send(report)
        return refused.value

    def close(self) -> None:
        self._outbox.put(None)
        self._answers.cancel()


def session_code(channel: grpc.Channel, report: pb.StepReport, token: str | None = None
                 ) -> tuple[grpc.StatusCode, str]:
    """A new stream that sends ``report`` and ends: its status, and its details."""
    stub = engine_session_pb2_grpc.EngineSessionStub(channel)
    try:
        list(stub.Session(iter([report]), metadata=bearer(token), timeout=10))
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        return error.code(), error.details() or ""  # type: ignore[attr-defined]


# --- item 3: an engine id is its credential's ------------------------------------------

def test_an_engine_id_is_taken_over_only_with_the_credential_that_holds_it(
        tmp_path: Path) -> None:
    with daemon_with(tmp_path, AUTH) as daemon, daemon.channel() as channel:
        engine = LiveSession(channel, POD_A_TOKEN)
        assert not engine.send(snapshot("pod-a")).resync_requested
        # Another engine's token, bound to its own id: refused by the pattern.
        code, details = session_code(channel, snapshot("pod-a"), POD_B_TOKEN)
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert details == ("engine_id: scope 'pod-b' may not report for engine 'pod-a': "
                           "auth.engine_ids gives it ['pod-b']")
        # A token that may report for any id: refused while pod-a's session is live.
        for _ in range(5):
            code, details = session_code(channel, snapshot("pod-a"), SPARE_TOKEN)
            assert code == grpc.StatusCode.PERMISSION_DENIED
            assert "held by a live Session of another scope" in details, details
        # The engine's session was never ended: its next report is decided on.
        decision = engine.send(pb.StepReport(engine_id="pod-a", seq=2, now_s=2.0, kv=KV))
        assert decision.seq == 2 and not decision.resync_requested
        # The engine restarting with its own token takes its id over; the old stream ends.
        restarted = LiveSession(channel, POD_A_TOKEN)
        assert not restarted.send(snapshot("pod-a")).resync_requested
        assert engine.refusal(pb.StepReport(engine_id="pod-a", seq=3, now_s=3.0)).code() == (
            grpc.StatusCode.ABORTED)
        # A unary Step is bound by the same patterns.
        with pytest.raises(grpc.RpcError) as refused:
            engine_session_pb2_grpc.EngineSessionStub(channel).Step(
                snapshot("pod-a-shadow"), metadata=bearer(POD_A_TOKEN), timeout=5)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        restarted.close()


def test_a_configuration_of_before_engine_ids_binds_ids_and_guards_reads(
        tmp_path: Path) -> None:
    # Only the settings there were before engine_ids and read_scopes: it still starts,
    # another engine scope's token cannot take a live engine's id, and reading takes a
    # token of any configured scope.
    settings = {"auth": {"tokens": {POD_A_TOKEN: "engines-a", POD_B_TOKEN: "engines-b",
                                    OPERATOR_TOKEN: "operators"},
                         "engine_scopes": ["engines-a", "engines-b"]}}
    with daemon_with(tmp_path, settings) as daemon, daemon.channel() as channel:
        engine = LiveSession(channel, POD_A_TOKEN)
        assert not engine.send(snapshot("pod-a")).resync_requested
        code, details = session_code(channel, snapshot("pod-a"), POD_B_TOKEN)
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        assert not engine.send(pb.StepReport(engine_id="pod-a", seq=2, now_s=2.0)
                               ).resync_requested
        assert _inspect_code(channel, None) == grpc.StatusCode.UNAUTHENTICATED
        assert _inspect_code(channel, OPERATOR_TOKEN) == grpc.StatusCode.OK
        engine.close()


def test_takeovers_without_tokens_are_rate_limited(tmp_path: Path) -> None:
    with daemon_with(tmp_path, {}) as daemon, daemon.channel() as channel:
        engine = LiveSession(channel)
        assert not engine.send(snapshot("pod-a")).resync_requested
        # One caller opening a stream every 40 ms that snapshots pod-a and stays open:
        # each snapshot would end the stream that holds pod-a.
        codes: list[grpc.StatusCode] = []
        details = ""
        holder, streams = engine, [engine]
        for attempt in range(25):
            intruder = LiveSession(channel)
            streams.append(intruder)
            try:
                intruder.send(snapshot("pod-a", now_s=2.0 + attempt))
                codes.append(grpc.StatusCode.OK)
                holder = intruder
            except grpc.RpcError as error:
                codes.append(error.code())
                details = error.details() or ""
            time.sleep(0.04)
        # The refused ones changed nothing: the stream that holds pod-a still reports.
        decision = holder.send(pb.StepReport(engine_id="pod-a", seq=2, now_s=30.0, kv=KV))
        assert not decision.resync_requested
        for stream in streams:
            stream.close()
    # The default budget: 3 at once, then 6 a minute (none more in one second).
    assert codes.count(grpc.StatusCode.OK) <= 3, codes
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 22, codes
    assert "limits.engine_takeovers_per_min" in details, details


def test_engine_calls_are_rate_limited_per_caller(tmp_path: Path) -> None:
    settings = {"limits": {"engine_calls_per_s": 5, "engine_burst": 10}}
    with daemon_with(tmp_path, settings) as daemon, daemon.channel() as channel:
        stub = engine_session_pb2_grpc.EngineSessionStub(channel)
        codes = []
        for index in range(40):
            try:
                stub.Step(snapshot(f"unary-{index}"), timeout=5)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as error:
                codes.append(error.code())
        # Streams count too: one opened per call.
        stream_code, details = session_code(channel, snapshot("streamed"))
    assert codes[:10] == [grpc.StatusCode.OK] * 10
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 20, codes
    assert stream_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limits.engine_calls_per_s" in details, details


# --- item 5: reading takes a token of a read scope -------------------------------------

def _inspect_code(channel: grpc.Channel, token: str | None) -> grpc.StatusCode:
    try:
        inspect_pb2_grpc.InspectStub(channel).GetPolicy(
            inspect_pb2.GetPolicyRequest(), metadata=bearer(token), timeout=5)
        return grpc.StatusCode.OK
    except grpc.RpcError as error:
        return error.code()  # type: ignore[no-any-return]


def test_inspect_needs_a_token_of_a_read_scope_when_tokens_are_on(tmp_path: Path) -> None:
    with daemon_with(tmp_path, AUTH) as daemon, daemon.channel() as channel:
        inspect = inspect_pb2_grpc.InspectStub(channel)
        assert _inspect_code(channel, None) == grpc.StatusCode.UNAUTHENTICATED
        assert _inspect_code(channel, "not-a-token-0123456789") == (
            grpc.StatusCode.UNAUTHENTICATED)
        assert _inspect_code(channel, POD_A_TOKEN) == grpc.StatusCode.PERMISSION_DENIED
        assert _inspect_code(channel, OPERATOR_TOKEN) == grpc.StatusCode.OK
        for call in (
                lambda: inspect.GetJob(inspect_pb2.GetJobRequest(job_id="j"), timeout=5),
                lambda: inspect.ListPins(inspect_pb2.ListPinsRequest(), timeout=5),
                lambda: inspect.GetToolStats(inspect_pb2.GetToolStatsRequest(), timeout=5),
                lambda: inspect.Explain(inspect_pb2.ExplainRequest(request_id="r"), timeout=5),
                lambda: list(inspect.WatchDecisions(inspect_pb2.WatchDecisionsRequest(),
                                                    timeout=5)),
                lambda: retention_pb2_grpc.RetentionStub(channel).GetDirectives(
                    retention_pb2.GetDirectivesRequest(
                        target=retention_pb2.RetentionTarget(job_id="j")), timeout=5)):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "auth.inspect_open" in (refused.value.details() or "")
        # grpcurl and `kvtether inspect` with the operator's token.
        listed = subprocess.run(
            [GRPCURL, "-plaintext", "-H", f"authorization: Bearer {OPERATOR_TOKEN}",
             daemon.address, "kvtether.v1.Inspect/GetPolicy"],
            capture_output=True, text=True, timeout=30)
        assert listed.returncode == 0 and json.loads(listed.stdout)["name"] == "continuum"
        cli = [sys.executable, "-m", "sidecar.cli", "inspect", "--address", daemon.address,
               "--json", "policy"]
        env = {key: value for key, value in os.environ.items()
               if key != "KVTETHER_INSPECT_TOKEN"}
        refused_cli = subprocess.run(cli, capture_output=True, text=True, timeout=30, env=env)
        assert refused_cli.returncode == 1
        assert "UNAUTHENTICATED" in refused_cli.stderr, refused_cli.stderr
        by_env = subprocess.run(cli, capture_output=True, text=True, timeout=30,
                                env={**env, "KVTETHER_INSPECT_TOKEN": OPERATOR_TOKEN})
        assert by_env.returncode == 0, by_env.stderr
        token_file = tmp_path / "token"
        token_file.write_text(OPERATOR_TOKEN + "\n")
        by_file = subprocess.run([*cli[:-2], "--token-file", str(token_file), *cli[-2:]],
                                 capture_output=True, text=True, timeout=30, env=env)
        assert by_file.returncode == 0, by_file.stderr
        assert json.loads(by_file.stdout)["name"] == "continuum"


def test_inspect_open_leaves_reading_open_and_limited(tmp_path: Path) -> None:
    settings = {"auth": {**AUTH["auth"], "inspect_open": True},
                "limits": {"inspect_calls_per_s": 2, "inspect_burst": 5}}
    with daemon_with(tmp_path, settings) as daemon, daemon.channel() as channel:
        codes = [_inspect_code(channel, None) for _ in range(20)]
    assert codes[:5] == [grpc.StatusCode.OK] * 5
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 12, codes


def test_explain_pages_an_id_that_names_many_requests(tmp_path: Path) -> None:
    requests = 450  # one reused X-Request-Id: vLLM schedules each as "same-<8 hex>"
    with daemon_with(tmp_path, {}) as daemon, daemon.channel() as channel:
        engine_session_pb2_grpc.EngineSessionStub(channel).Step(snapshot(
            "reused", new_requests=[
                pb.NewRequest(request_id=f"same-{index:08x}", job_id=f"job-{index}",
                              arrival_s=1.0, prompt_tokens=16)
                for index in range(requests)]), timeout=30)
        inspect = inspect_pb2_grpc.InspectStub(channel)
        seen: list[str] = []
        pages = 0
        token = ""
        while True:
            page = inspect.Explain(inspect_pb2.ExplainRequest(
                request_id="same", limit=200, page_token=token), timeout=10)
            assert page.found
            named = {decision.request_id for decision in page.decisions}
            assert len(named) <= 200
            seen += sorted(named)
            pages += 1
            token = page.next_page_token
            if not token:
                break
        default = inspect.Explain(inspect_pb2.ExplainRequest(request_id="same"), timeout=10)
    assert pages == 3
    assert sorted(seen) == [f"same-{index:08x}" for index in range(requests)]
    assert len({decision.request_id for decision in default.decisions}) == 100
    assert default.next_page_token


# --- item 6: every KVTETHER_* variable is checked --------------------------------------

@pytest.mark.parametrize(("variable", "named"), [
    ("KVTETHER_POLCY__NAME", "did you mean KVTETHER_POLICY__NAME?"),
    ("KVTETHER_AUTH_TOKENS", "did you mean KVTETHER_AUTH__TOKENS?"),
])
@pytest.mark.parametrize("check", [True, False])
def test_a_misspelt_variable_stops_the_daemon(variable: str, named: str, check: bool) -> None:
    done = subprocess.run(
        serve_command("--listen", "127.0.0.1:0", "--metrics-port", "-1",
                      *(["--check"] if check else [])),
        capture_output=True, text=True, timeout=60,
        env={**os.environ, variable: '{"a-token-0123456789abc": "engines"}'})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"kvtether: error: {variable}: unknown variable; {named}"


def test_variables_of_the_plugin_and_the_scripts_are_not_the_daemons() -> None:
    done = subprocess.run(
        serve_command("--check"), capture_output=True, text=True, timeout=60,
        env={**os.environ, "KVTETHER_PLUGIN_DEADLINE_MS": "20", "KVTETHER_VENV": ".venv",
             "KVTETHER_INSPECT_TOKEN": OPERATOR_TOKEN, "KVTETHER_POLICY__NAME": "fcfs"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "configuration ok: policy fcfs"


# --- item 7: tool statistics take only what a finished turn can produce ----------------

def _turns(stub: engine_session_pb2_grpc.EngineSessionStub, engine_id: str,
           first_arrival_s: float, departure_s: float, next_arrival_s: float,
           next_now_s: float) -> None:
    """A job's turn that calls ``ls`` and finishes, then the job's next turn."""
    job = f"{engine_id}-job"
    stub.Step(snapshot(engine_id, now_s=first_arrival_s, new_requests=[pb.NewRequest(
        request_id=f"{job}-t1", job_id=job, arrival_s=first_arrival_s)]), timeout=5)
    stub.Step(pb.StepReport(engine_id=engine_id, seq=2, now_s=max(departure_s, first_arrival_s),
                            kv=KV, events=[pb.RequestEvent(
                                request_id=f"{job}-t1", kind=pb.EVENT_KIND_FINISHED,
                                at_s=departure_s, tool="ls",
                                finish_reason=pb.FINISH_REASON_STOP, blocks=1)]), timeout=5)
    stub.Step(pb.StepReport(engine_id=engine_id, seq=3, now_s=next_now_s, kv=KV,
                            new_requests=[pb.NewRequest(request_id=f"{job}-t2", job_id=job,
                                                        arrival_s=next_arrival_s)]),
              timeout=5)


def test_tool_statistics_take_only_what_a_finished_turn_can_produce(tmp_path: Path) -> None:
    with daemon_with(tmp_path, {}) as daemon, daemon.channel() as channel:
        stub = engine_session_pb2_grpc.EngineSessionStub(channel)
        _turns(stub, "honest", 1.0, 2.0, 4.0, 4.0)  # ls took 2 s
        # An arrival past the engine's own clock in the report that announces it.
        _turns(stub, "future", 1.0, 2.0, 87_670.0, 3.0)
        # A clock that jumps further than a job's history lives (a day by default).
        _turns(stub, "jump", 1.0, 2.0, 100_000.0, 100_000.0)
        # A turn that departs before it arrived.
        _turns(stub, "early", 80_000.0, 0.0, 80_003.0, 80_003.0)
        inspect = inspect_pb2_grpc.InspectStub(channel)
        deadline = time.monotonic() + 10
        while True:  # tool statistics are written in the background
            stats = inspect.GetToolStats(inspect_pb2.GetToolStatsRequest(tool="ls"), timeout=5)
            if (stats.tools and stats.tools[0].count >= 2) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        time.sleep(0.5)
        (ls,) = inspect.GetToolStats(inspect_pb2.GetToolStatsRequest(tool="ls"),
                                     timeout=5).tools
    assert ls.count == 2, ls
    assert ls.p99_s <= 3.5, ls


def test_negative_engine_counters_are_refused(tmp_path: Path) -> None:
    with daemon_with(tmp_path, {}) as daemon, daemon.channel() as channel, \
            pytest.raises(grpc.RpcError) as refused:
        engine_session_pb2_grpc.EngineSessionStub(channel).Step(snapshot(
            "counting", counters=pb.EngineCounters(provisional_block_seconds=-5.0)),
            timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == (
        "counters.provisional_block_seconds: must be a finite number >= 0, got -5.0")
