"""gRPC Inspect: read-only views of the policy, jobs, pins, tool statistics and decisions."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator

import grpc

from sidecar import __version__
from sidecar.api.v1 import inspect_pb2 as pb
from sidecar.api.v1 import inspect_pb2_grpc
from sidecar.config import DaemonConfig
from sidecar.estimators.tool_time import ToolTimeEstimator
from sidecar.framework import EngineCost, PinView, Policy
from sidecar.jobs import JobTracker
from sidecar.jobs.history import read_job_history
from sidecar.policies.registry import policy_parameters
from sidecar.runtime.decider import DecisionLog
from sidecar.runtime.engines import EngineRegistry
from sidecar.server.checks import check_request
from sidecar.store import Store, StoreError, keys

DEFAULT_LIST_LIMIT = 100
# A watcher that falls this far behind loses the oldest records rather than
# slowing the decision path.
WATCH_QUEUE_RECORDS = 1024


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


class _Watcher:
    def __init__(self, engine_id: str, job_id: str) -> None:
        self.engine_id = engine_id
        self.job_id = job_id
        self.queue: asyncio.Queue[pb.DecisionRecord] = asyncio.Queue(WATCH_QUEUE_RECORDS)

    def offer(self, record: pb.DecisionRecord) -> None:
        if (self.engine_id and record.engine_id != self.engine_id) or (
            self.job_id and record.job_id != self.job_id
        ):
            return
        if self.queue.full():
            self.queue.get_nowait()
        self.queue.put_nowait(record)


class InspectService(inspect_pb2_grpc.InspectServicer):
    def __init__(
        self,
        config: DaemonConfig,
        policy: Policy,
        store: Store,
        engines: EngineRegistry,
        tracker: JobTracker,
        estimator: ToolTimeEstimator,
        decisions: DecisionLog,
    ) -> None:
        self._config = config
        self._policy = policy
        self._store = store
        self._engines = engines
        self._tracker = tracker
        self._estimator = estimator
        self._decisions = decisions

    def _pins(self, engine_id: str = "") -> list[pb.PinRecord]:
        return [
            _pin_record(mirror.engine_id, pin)
            for mirror in self._engines.mirrors.values()
            if not engine_id or mirror.engine_id == engine_id
            for pin in mirror.pins.values()
        ]

    def _job_engines(self) -> dict[str, str]:
        found = {}
        for mirror in self._engines.mirrors.values():
            for request in mirror.requests.values():
                found[request.job_id] = mirror.engine_id
            for pin in mirror.pins.values():
                found[pin.job_id] = mirror.engine_id
        return found

    def _summary(self, job_id: str, engines: dict[str, str]) -> pb.JobSummary | None:
        view = self._tracker.view(job_id)
        if view is None:
            return None
        pinned = sum(p.blocks for p in self._pins() if p.job_id == job_id)
        return pb.JobSummary(
            job_id=job_id,
            first_arrival_s=view.first_arrival_s,
            turns_finished=view.turns_finished,
            requests_in_flight=view.requests_in_flight,
            last_tool=view.last_tool or "",
            pinned_blocks=pinned,
            engine_id=engines.get(job_id, ""),
        )

    async def GetPolicy(
        self, request: pb.GetPolicyRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetPolicyResponse:
        await check_request(request, context)
        parameters = {
            name: value if isinstance(value, str) else json.dumps(value, default=str)
            for name, value in policy_parameters(self._policy).items()
        }
        return pb.GetPolicyResponse(
            name=self._policy.name,
            parameters=parameters,
            store_backend=self._store.backend_name,
            engines=sorted(self._engines.mirrors),
            version=__version__,
            engine_costs=[self._engine_cost(engine_id, cost) for engine_id, cost
                          in sorted(self._engines.step_cost_estimates().items())],
        )

    def _engine_cost(self, engine_id: str, cost: EngineCost) -> pb.EngineStepCost:
        record = pb.EngineStepCost(
            engine_id=engine_id, prefill_s_per_token=cost.prefill_s_per_token,
            decode_s_per_seq=cost.decode_s_per_seq, step_s=cost.step_s, steps=cost.steps,
            prefill_relative_error=cost.prefill_relative_error)
        mirror = self._engines.mirrors.get(engine_id)  # absent: no session now
        per_s = None if mirror is None else mirror.prefill_rate.per_s()
        if per_s is not None:
            record.prefill_tokens_per_s = per_s
            # At the cost listed beside it.
            record.prefill_time_share = per_s * cost.prefill_s_per_token
        return record

    async def ListJobs(
        self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListJobsResponse:
        await check_request(request, context)
        limit = request.limit or DEFAULT_LIST_LIMIT
        engines = self._job_engines()
        jobs = []
        for job_id in self._tracker.recent_job_ids(limit):
            summary = self._summary(job_id, engines)
            if summary is not None:
                jobs.append(summary)
        return pb.ListJobsResponse(jobs=jobs)

    async def GetJob(
        self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetJobResponse:
        await check_request(request, context)
        if not request.job_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "job_id: must not be empty")
        try:
            events = await read_job_history(self._store, request.job_id)
        except StoreError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"store: {error}")
        summary = self._summary(request.job_id, self._job_engines())
        if summary is None and not events:
            return pb.GetJobResponse(found=False)
        turns: dict[str, pb.TurnRecord] = {}
        for event in events:
            turn = turns.setdefault(event.request_id, pb.TurnRecord(request_id=event.request_id))
            if event.kind == "arrival":
                turn.arrival_s = event.at_s
                turn.tool_time_s = event.tool_time_s or 0.0
                turn.prompt_tokens = event.prompt_tokens or 0
            else:
                turn.departure_s = event.at_s
                turn.tool = event.tool or ""
                turn.output_tokens = event.output_tokens or 0
        return pb.GetJobResponse(
            found=True,
            summary=summary or pb.JobSummary(job_id=request.job_id),
            turns=list(turns.values()),
            pins=[p for p in self._pins() if p.job_id == request.job_id],
            last_decisions=self._decisions.for_job(request.job_id),
        )

    async def ListPins(
        self, request: pb.ListPinsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListPinsResponse:
        await check_request(request, context)
        pins = self._pins(request.engine_id)
        return pb.ListPinsResponse(pins=pins, pinned_blocks=sum(p.blocks for p in pins))

    async def GetToolStats(
        self, request: pb.GetToolStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetToolStatsResponse:
        await check_request(request, context)
        try:
            if request.tool:
                tools = [request.tool]
            else:
                found = await self._store.scan(keys.pattern_for("stats"))
                tools = sorted(keys.tool_from_stats_key(key) for key in found)
            stats = []
            for tool in tools:
                distribution = await self._estimator.refresh(tool)
                if distribution is None or distribution.count == 0:
                    continue
                stats.append(pb.ToolStats(
                    tool=tool,
                    count=distribution.count,
                    mean_s=_finite(distribution.mean_s),
                    p50_s=_finite(distribution.quantile(0.5)),
                    p90_s=_finite(distribution.quantile(0.9)),
                    p99_s=_finite(distribution.quantile(0.99)),
                    mean_log_s=_finite(distribution.mean_log_s),
                    stddev_log_s=_finite(math.sqrt(max(distribution.var_log_s, 0.0))),
                ))
        except StoreError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"store: {error}")
        return pb.GetToolStatsResponse(tools=stats)

    async def Explain(
        self, request: pb.ExplainRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExplainResponse:
        await check_request(request, context)
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "request_id: must not be empty")
        decisions = self._decisions.explain(request.request_id)
        if not decisions:
            return pb.ExplainResponse(found=False)
        return pb.ExplainResponse(found=True, decision=decisions[-1], decisions=decisions)

    async def WatchDecisions(
        self, request: pb.WatchDecisionsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecisionRecord]:
        await check_request(request, context)
        watcher = _Watcher(request.engine_id, request.job_id)
        self._decisions.watchers.add(watcher)
        try:
            while True:
                yield await watcher.queue.get()
        finally:
            self._decisions.watchers.discard(watcher)


def _pin_record(engine_id: str, pin: PinView) -> pb.PinRecord:
    return pb.PinRecord(
        engine_id=engine_id,
        request_id=pin.request_id,
        job_id=pin.job_id,
        blocks=pin.blocks,
        pinned_at_s=pin.pinned_at_s,
        expires_at_s=pin.expires_at_s,
        tool=pin.tool or "",
    )
