"""gRPC Inspect: read-only views of the policy, jobs, pins, tool statistics and decisions.

The event loop that serves these answers the engines too: every listing (Explain of
an id that names many requests too) is paged with a capped limit
(:mod:`sidecar.server.paging`), does work in proportion to its page and the engines'
pins (never their product), and gives the loop a turn between chunks; watchers are
capped, share a send budget and are dropped when they fall behind
(:mod:`sidecar.runtime.decision_feed`). Calls are rate-limited per caller
(:mod:`sidecar.server.limits`) and, with auth tokens configured, take a token of a read
scope (:mod:`sidecar.server.read_access`).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from sidecar import __version__
from sidecar.api.bounds import FieldError
from sidecar.api.v1 import inspect_pb2 as pb
from sidecar.api.v1 import inspect_pb2_grpc
from sidecar.config import DaemonConfig
from sidecar.estimators.tool_time import ToolTimeEstimator
from sidecar.framework import EngineCost, PinView, Policy
from sidecar.jobs import JobTracker
from sidecar.jobs.history import read_job_history
from sidecar.policies.registry import policy_parameters
from sidecar.runtime.decider import DecisionLog
from sidecar.runtime.decision_feed import FellBehind, Watch
from sidecar.runtime.engines import EngineRegistry
from sidecar.server.checks import check_request
from sidecar.server.limits import TokenBucket
from sidecar.server.paging import (
    SCAN_CHUNK_ITEMS,
    decode_token,
    encode_token,
    in_chunks,
    page_limit,
)
from sidecar.store import Store, StoreError, keys
from sidecar.telemetry import metrics

# A dropped watcher's end of stream waits behind the records it was sent; a peer
# that never reads never takes them, so the handler gives up waiting after this.
DROPPED_STATUS_FLUSH_S = 1.0
# Longest a watcher over the send budget sleeps before trying again.
WATCH_BUDGET_POLL_S = 0.02


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


@dataclass(slots=True)
class _Holdings:
    """Where jobs run and what they pin, from one pass over the engines' mirrors."""

    engine_of: dict[str, str] = field(default_factory=dict)
    pins_of: dict[str, list[tuple[str, PinView]]] = field(default_factory=dict)
    pinned_blocks: dict[str, int] = field(default_factory=dict)


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
        self._watchers_open = 0
        rate_per_s = config.limits.watch_records_per_s
        # A tenth of a second's sends at once: bursts stay short beside engine reports.
        self._watch_sends = TokenBucket(rate_per_s, max(1, int(rate_per_s / 10)),
                                        time.monotonic())

    async def _holdings(self, job_ids: set[str]) -> _Holdings:
        """The engine and pins of each of ``job_ids``: one pass over every engine's
        requests and pins (each mirror copied before it is read, as engine reports
        change them while the loop is given a turn between mirrors)."""
        holdings = _Holdings()
        engine_of, pins_of, blocks = holdings.engine_of, holdings.pins_of, holdings.pinned_blocks
        scanned = 0
        for mirror in list(self._engines.mirrors.values()):
            engine_id = mirror.engine_id
            requests = list(mirror.requests.values())
            pins = list(mirror.pins.values())
            engine_of.update((r.job_id, engine_id) for r in requests if r.job_id in job_ids)
            for pin in [pin for pin in pins if pin.job_id in job_ids]:
                engine_of[pin.job_id] = engine_id
                pins_of.setdefault(pin.job_id, []).append((engine_id, pin))
                blocks[pin.job_id] = blocks.get(pin.job_id, 0) + pin.blocks
            scanned += len(requests) + len(pins)
            if scanned >= SCAN_CHUNK_ITEMS:
                scanned = 0
                await asyncio.sleep(0)
        return holdings

    def _summary(self, job_id: str, holdings: _Holdings) -> dict[str, Any] | None:
        """A ``JobSummary``'s fields (added to a response in place, not copied into
        it); None for a job the tracker does not know (any more)."""
        view = self._tracker.view(job_id)
        if view is None:
            return None
        return {
            "job_id": job_id,
            "first_arrival_s": view.first_arrival_s,
            "turns_finished": view.turns_finished,
            "requests_in_flight": view.requests_in_flight,
            "last_tool": view.last_tool or "",
            "pinned_blocks": holdings.pinned_blocks.get(job_id, 0),
            "engine_id": holdings.engine_of.get(job_id, ""),
        }

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
        try:
            limit = page_limit(request.limit)
            active_before = (int(decode_token(request.page_token, int)[0])
                             if request.page_token else None)
        except FieldError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        found = self._tracker.recent_jobs(limit + 1, active_before=active_before,
                                          include_anonymous=request.include_anonymous)
        page = found[:limit]
        holdings = await self._holdings({job_id for job_id, _active in page})
        response = pb.ListJobsResponse()
        async for chunk in in_chunks(page):
            for job_id, _active in chunk:
                summary = self._summary(job_id, holdings)
                if summary is not None:  # forgotten since the page was read
                    response.jobs.add(**summary)
        if len(found) > limit:
            response.next_page_token = encode_token(page[-1][1])
        return response

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
        holdings = await self._holdings({request.job_id})
        summary = self._summary(request.job_id, holdings)
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
            summary=pb.JobSummary(**(summary or {"job_id": request.job_id})),
            turns=list(turns.values()),
            pins=[_pin_record(engine_id, pin)
                  for engine_id, pin in holdings.pins_of.get(request.job_id, ())],
            last_decisions=self._decisions.for_job(request.job_id),
        )

    async def ListPins(
        self, request: pb.ListPinsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListPinsResponse:
        await check_request(request, context)
        try:
            limit = page_limit(request.limit)
            after = ([str(value) for value in decode_token(request.page_token, str, str)]
                     if request.page_token else ["", ""])
        except FieldError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        response = pb.ListPinsResponse()
        page: list[tuple[str, PinView]] = []
        more = False
        pinned_blocks = 0
        for engine_id in sorted(self._engines.mirrors):
            mirror = self._engines.mirrors.get(engine_id)
            if mirror is None or (request.engine_id and engine_id != request.engine_id):
                continue  # gone while an earlier engine was listed, or not asked for
            pins = dict(mirror.pins)
            async for pin_chunk in in_chunks(list(pins.values())):
                pinned_blocks += sum(pin.blocks for pin in pin_chunk)
            if more or engine_id < after[0]:
                continue
            request_ids = sorted(pins)
            start = bisect.bisect_right(request_ids, after[1]) if engine_id == after[0] else 0
            taken = request_ids[start:start + limit - len(page) + 1]
            page.extend((engine_id, pins[request_id]) for request_id in taken)
            if len(page) > limit:
                page.pop()
                more = True
        async for chunk in in_chunks(page):
            response.pins.extend(_pin_record(engine_id, pin) for engine_id, pin in chunk)
        response.pinned_blocks = pinned_blocks
        if more:
            response.next_page_token = encode_token(page[-1][0], page[-1][1].request_id)
        return response

    async def GetToolStats(
        self, request: pb.GetToolStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetToolStatsResponse:
        await check_request(request, context)
        try:
            limit = page_limit(request.limit)
            after = str(decode_token(request.page_token, str)[0]) if request.page_token else ""
        except FieldError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        response = pb.GetToolStatsResponse()
        try:
            if request.tool:
                tools = [request.tool]
            else:
                found = await self._store.scan(keys.pattern_for("stats"))
                tools = sorted(keys.tool_from_stats_key(key) for key in found)
            start = bisect.bisect_right(tools, after) if after else 0
            page = tools[start:start + limit]
            async for chunk in in_chunks(page):
                for tool in chunk:
                    distribution = await self._estimator.refresh(tool)
                    if distribution is None or distribution.count == 0:
                        continue
                    response.tools.append(pb.ToolStats(
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
        if start + limit < len(tools):
            response.next_page_token = encode_token(page[-1])
        return response

    async def Explain(
        self, request: pb.ExplainRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExplainResponse:
        await check_request(request, context)
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "request_id: must not be empty")
        try:
            limit = page_limit(request.limit)
            after = str(decode_token(request.page_token, str)[0]) if request.page_token else ""
        except FieldError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        decisions, last = self._decisions.explain_page(request.request_id, limit, after)
        if not decisions:
            return pb.ExplainResponse(found=False)
        return pb.ExplainResponse(found=True, decision=decisions[-1], decisions=decisions,
                                  next_page_token=encode_token(last) if last else "")

    async def WatchDecisions(
        self, request: pb.WatchDecisionsRequest, context: grpc.aio.ServicerContext
    ) -> None:
        await check_request(request, context)
        most = self._config.limits.max_watchers
        if self._watchers_open >= most:
            metrics.DECISION_WATCHERS_REFUSED.inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"WatchDecisions: at most {most} watchers at once "
                                "(limits.max_watchers); try again later")
        feed = self._decisions.feed
        watch = feed.watch(request.engine_id, request.job_id)
        self._watchers_open += 1
        metrics.DECISION_WATCHERS.set(self._watchers_open)
        try:
            # The sends apart, so that a watcher stuck in one (a peer that does not
            # read) is still ended when the feed drops it.
            sender = asyncio.create_task(self._send_decisions(watch, context))
            dropped = asyncio.create_task(watch.dropped.wait())
            try:
                await asyncio.wait({sender, dropped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                sender.cancel()
                dropped.cancel()
                feed.leave(watch)
            if not watch.dropped.is_set():
                sender.result()  # the send failed: the peer is gone
                return
            # The status follows the records already sent; a peer that never reads
            # never gets it, and is not waited for.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"WatchDecisions: this watcher fell more than {feed.capacity} decisions "
                    "behind and was dropped (watchers share limits.watch_records_per_s = "
                    f"{self._config.limits.watch_records_per_s:g} records/s); watch one "
                    "engine_id or job_id, or read faster"), DROPPED_STATUS_FLUSH_S)
        finally:
            self._watchers_open -= 1
            metrics.DECISION_WATCHERS.set(self._watchers_open)

    async def _send_decisions(self, watch: Watch, context: grpc.aio.ServicerContext) -> None:
        """Sends what the watch reads, within the watchers' shared send budget, until
        the feed drops it."""
        budget = self._watch_sends
        try:
            while True:
                for decision in await watch.next_batch():
                    while not budget.take(time.monotonic()):
                        await asyncio.sleep(min(WATCH_BUDGET_POLL_S,
                                                (1.0 - budget.tokens) / budget.rate_per_s))
                    await context.write(decision.record())
        except FellBehind:
            return


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
