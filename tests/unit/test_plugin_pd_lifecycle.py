"""The plugin on the prefill side of a P/D pair: vLLM's real scheduler with its
NixlConnector's scheduler side (no model, no transfer), driven as vLLM's own
``tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py`` drives it. Every
request finishes after one token, and vLLM keeps it, finished, in
``scheduler.requests`` until the connector says its KV was sent. The daemon's rank
for it (decided while it waited, landing after its finish) and a snapshot report must
leave it there: never queued again, never reported waiting."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest

from sidecar.api.v1 import engine_session_pb2 as pb
from tests.support.engine import requires_vllm, tiny_model_dir

pytestmark = requires_vllm

BLOCK = 16
REMOTE_DECODE = {"do_remote_prefill": False, "do_remote_decode": True}


@pytest.fixture
def prefill_engine(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The plugin's scheduler on a prefill instance, its daemon out of reach."""
    from tests.support.scheduler import build_scheduler
    from vllm_plugin.scheduler import KvtetherScheduler

    monkeypatch.setenv("KVTETHER_PLUGIN_DAEMON_ADDRESS", "127.0.0.1:1")
    scheduler = build_scheduler(tiny_model_dir(), num_blocks=64, block_size=BLOCK,
                                scheduler_cls=KvtetherScheduler,
                                kv_connector="NixlConnector")
    assert scheduler.kvtether is not None
    yield scheduler
    scheduler.shutdown()


def prefill(scheduler: Any, request_id: str) -> Any:
    """Add a remote-decode request and run its one step: it finishes, its KV held."""
    from tests.support.scheduler import make_request, step

    request = make_request(request_id, list(range(2 * BLOCK + 8)), max_tokens=1,
                           block_size=BLOCK, kv_transfer_params=dict(REMOTE_DECODE))
    scheduler.add_request(request)
    step(scheduler)
    assert request.is_finished() and request_id in scheduler.requests
    return request


def finish_sending(scheduler: Any, request_id: str) -> None:
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

    output = copy.deepcopy(EMPTY_MODEL_RUNNER_OUTPUT)
    output.kv_connector_output = KVConnectorOutput(finished_sending={request_id})
    scheduler.update_from_output(scheduler.schedule(), output)


def test_a_rank_landing_after_a_prefill_finish_leaves_the_request_finished(
        prefill_engine: Any) -> None:
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
    from vllm.v1.request import RequestStatus

    from tests.support.scheduler import free_blocks

    scheduler = prefill_engine
    start_free = free_blocks(scheduler)
    request = prefill(scheduler, "prefill-1")
    # The daemon ranked it while it waited; its answer arrives after the finish.
    scheduler.kvtether.decisions.apply([pb.StepDecision(
        seq=1, priorities=[pb.RequestPriority(request_id="prefill-1", priority=5)])])
    # vLLM schedules on while the KV is sent (it raised "Invalid request status:
    # FINISHED_LENGTH_CAPPED" when the plugin had queued the finished request again).
    output = scheduler.schedule()
    assert not output.scheduled_new_reqs
    assert not scheduler.waiting and not scheduler.kv_holding_waiting
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    scheduler.update_from_output(output, EMPTY_MODEL_RUNNER_OUTPUT)
    finish_sending(scheduler, "prefill-1")
    assert not scheduler.requests
    assert free_blocks(scheduler) == start_free, "every block is back"


def test_a_snapshot_reports_no_finished_request_as_waiting(prefill_engine: Any) -> None:
    from tests.support.scheduler import make_request

    scheduler = prefill_engine
    prefill(scheduler, "prefill-1")
    scheduler.add_request(make_request("waiting-1", list(range(BLOCK)), max_tokens=1,
                                       block_size=BLOCK))
    reports = scheduler.kvtether.reports
    reports.link = SimpleNamespace(connected=True, needs_snapshot=True)
    snapshot = reports.build({})
    assert snapshot is not None and snapshot.snapshot
    states = {new.request_id: new.state for new in snapshot.new_requests}
    assert states == {"waiting-1": pb.REQUEST_STATE_WAITING}
