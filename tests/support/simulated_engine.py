"""A simulated vLLM engine that writes the step reports a real one would: agent jobs
arrive, wait, are admitted when KV blocks allow, decode one token per step, finish
having called a tool, and come back for their next turn once the tool has run; the
engine applies the daemon's priorities and pins as the plugin does.

No I/O and no clock of its own: the caller passes the engine's time to each step, so
the same model drives the soak (wall clock, gRPC) and tests (any clock).

The agent workload follows the one of reference/continuum-kv-pinning-verification.txt,
scaled to an engine of ``total_blocks`` blocks of 16 tokens: a job has 4-10 turns, its
context grows each turn, most tools take 50-300 ms, some 1-5 s (test runs, installs).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from sidecar.api.v1 import engine_session_pb2 as pb

BLOCK_TOKENS = 16

# (tool, lowest s, highest s, weight): what coding agents run between turns.
TOOLS: tuple[tuple[str, float, float, float], ...] = (
    ("ls", 0.05, 0.15, 5), ("cat", 0.05, 0.2, 6), ("grep", 0.05, 0.3, 5),
    ("sed", 0.05, 0.2, 3), ("find", 0.1, 0.5, 2), ("git diff", 0.1, 0.4, 2),
    ("python", 0.3, 2.0, 2), ("pytest", 2.0, 5.0, 2), ("pip install", 1.0, 4.0, 0.5),
    ("make", 1.0, 3.0, 0.5), ("curl", 0.2, 1.5, 1), ("npm test", 2.0, 5.0, 0.5),
)


@dataclass(frozen=True)
class WorkloadShape:
    job_arrivals_per_s: float = 1.0
    turns_min: int = 4
    turns_max: int = 10
    first_prompt_tokens: tuple[int, int] = (300, 900)
    prompt_growth_tokens: tuple[int, int] = (100, 400)
    output_tokens: tuple[int, int] = (20, 200)
    total_blocks: int = 4000


@dataclass
class _Request:
    request_id: str
    job_id: str
    turn: int
    last: bool
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    tool: str
    decoded: int = 0
    blocks: int = 0
    priority: int = 0


@dataclass
class _Job:
    job_id: str
    turns: int
    context_tokens: int
    next_turn: int = 0
    # (time the next turn arrives) once its tool finishes.
    next_arrival_s: float | None = None


@dataclass
class _Pin:
    request_id: str
    job_id: str
    blocks: int
    expires_at_s: float


@dataclass
class EngineCounters:
    reports: int = 0
    arrivals: int = 0
    admissions: int = 0
    finishes: int = 0
    pins_confirmed: int = 0
    pins_released_by_daemon: int = 0
    pins_released_by_engine: int = 0
    resyncs: int = 0
    jobs_done: int = 0


@dataclass
class SimulatedEngine:
    engine_id: str
    seed: int = 0
    shape: WorkloadShape = field(default_factory=WorkloadShape)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)
        self._seq = 0
        self._snapshot_due = True
        self._jobs: dict[str, _Job] = {}
        self._waiting: list[_Request] = []
        self._running: dict[str, _Request] = {}
        self._pins: dict[str, _Pin] = {}
        self._pin_of_job: dict[str, str] = {}
        self._finished: dict[str, _Request] = {}  # awaiting the daemon's pin decision
        self._next_job_s: float | None = None
        self._job_counter = 0
        self._arrived: list[_Request] = []
        self._events: list[pb.RequestEvent] = []
        self._released: list[str] = []
        self.counters = EngineCounters()
        self._tool_weights = [weight for *_rest, weight in TOOLS]

    # --- the step ---------------------------------------------------------------------
    def step(self, now_s: float) -> pb.StepReport:
        """Advance the engine to ``now_s`` by one scheduling step; return its report."""
        self._arrivals(now_s)
        self._expire_pins(now_s)
        self._decode(now_s)
        self._admit(now_s)
        self._seq += 1
        report = pb.StepReport(engine_id=self.engine_id, seq=self._seq, now_s=now_s,
                               kv=pb.KvCapacity(total_blocks=self.shape.total_blocks,
                                                free_blocks=self.free_blocks,
                                                block_size_tokens=BLOCK_TOKENS))
        if self._snapshot_due:
            report.snapshot = True
            report.new_requests.extend(self._live_requests())
            report.pins.extend(pb.PinState(request_id=pin.request_id, job_id=pin.job_id,
                                           blocks=pin.blocks, expires_at_s=pin.expires_at_s)
                               for pin in self._pins.values())
            self._snapshot_due = False
        else:
            report.new_requests.extend(self._new_request(r) for r in self._arrived)
            report.events.extend(self._events)
            report.released_pins.extend(self._released)
        self._arrived, self._events, self._released = [], [], []
        self.counters.reports += 1
        return report

    def apply(self, decision: pb.StepDecision) -> None:
        """Apply the daemon's answer as the plugin does: priorities for the waiting
        queue, pins confirmed or released, a snapshot when asked."""
        if decision.resync_requested:
            self.counters.resyncs += 1
            self._snapshot_due = True
            return
        for priority in decision.priorities:
            request = self._running.get(priority.request_id) or next(
                (r for r in self._waiting if r.request_id == priority.request_id), None)
            if request is not None:
                request.priority = priority.priority
        for pin in decision.pins:
            if pin.action == pb.PIN_ACTION_PIN:
                self._pin(pin.request_id, pin.expires_at_s)
            elif pin.action == pb.PIN_ACTION_RELEASE:
                self._unpin(pin.request_id, by_engine=False)
        # A finished request the daemon did not pin is freed (as with vLLM's own
        # scheduler), its blocks back in the pool.
        self._finished.clear()

    # --- state ------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        used = sum(r.blocks for r in self._running.values())
        used += sum(p.blocks for p in self._pins.values())
        return max(0, self.shape.total_blocks - used)

    @property
    def live_jobs(self) -> int:
        return len(self._jobs)

    # --- internals --------------------------------------------------------------------
    def _arrivals(self, now_s: float) -> None:
        rate = self.shape.job_arrivals_per_s
        if self._next_job_s is None:
            self._next_job_s = now_s + self._random.expovariate(rate)
        while self._next_job_s <= now_s:
            self._job_counter += 1
            job_id = f"{self.engine_id}-job-{self._job_counter}"
            job = _Job(job_id, self._random.randint(self.shape.turns_min, self.shape.turns_max),
                       self._random.randint(*self.shape.first_prompt_tokens))
            self._jobs[job_id] = job
            self._arrive(job, self._next_job_s)
            self._next_job_s += self._random.expovariate(rate)
        for job in list(self._jobs.values()):
            if job.next_arrival_s is not None and job.next_arrival_s <= now_s:
                self._arrive(job, job.next_arrival_s)

    def _arrive(self, job: _Job, at_s: float) -> None:
        job.next_arrival_s = None
        turn = job.next_turn
        job.next_turn += 1
        last = job.next_turn >= job.turns
        tool = "" if last else self._random.choices(TOOLS, self._tool_weights)[0][0]
        request = _Request(f"{job.job_id}-t{turn}", job.job_id, turn, last, at_s,
                           job.context_tokens, self._random.randint(*self.shape.output_tokens),
                           tool)
        # The job's pin, if any, is used by this turn's prefix and let go.
        pinned = self._pin_of_job.get(job.job_id)
        if pinned is not None:
            self._unpin(pinned, by_engine=True)
        self._waiting.append(request)
        self._arrived.append(request)
        self.counters.arrivals += 1

    def _decode(self, now_s: float) -> None:
        for request in list(self._running.values()):
            request.decoded += 1
            request.blocks = _blocks(request.prompt_tokens + request.decoded)
            if request.decoded < request.output_tokens:
                continue
            del self._running[request.request_id]
            self._events.append(pb.RequestEvent(
                request_id=request.request_id, kind=pb.EVENT_KIND_FINISHED, at_s=now_s,
                finish_reason=pb.FINISH_REASON_STOP, output_tokens=request.decoded,
                tool=request.tool, blocks=request.blocks))
            self.counters.finishes += 1
            job = self._jobs[request.job_id]
            job.context_tokens += request.decoded + self._random.randint(
                *self.shape.prompt_growth_tokens)
            if request.last:
                del self._jobs[request.job_id]
                self.counters.jobs_done += 1
            else:
                self._finished[request.request_id] = request
                low, high = next((lo, hi) for name, lo, hi, _ in TOOLS if name == request.tool)
                job.next_arrival_s = now_s + self._random.uniform(low, high)

    def _admit(self, now_s: float) -> None:
        if not self._waiting:
            return
        self._waiting.sort(key=lambda r: (r.priority, r.arrival_s))
        free = self.free_blocks
        admitted = []
        for request in self._waiting:
            need = _blocks(request.prompt_tokens + 1)
            if need > free:
                break  # vLLM's waiting queue is head-of-line: no skipping
            free -= need
            request.blocks = need
            admitted.append(request)
        for request in admitted:
            self._waiting.remove(request)
            self._running[request.request_id] = request
            self._events.append(pb.RequestEvent(request_id=request.request_id,
                                                kind=pb.EVENT_KIND_ADMITTED, at_s=now_s,
                                                blocks=request.blocks))
            self.counters.admissions += 1

    def _pin(self, request_id: str, expires_at_s: float) -> None:
        existing = self._pins.get(request_id)
        if existing is not None:
            existing.expires_at_s = expires_at_s
            return
        request = self._finished.get(request_id)
        if request is None:
            return  # the job's next turn already used it
        previous = self._pin_of_job.get(request.job_id)
        if previous is not None:
            self._unpin(previous, by_engine=True)
        self._pins[request_id] = _Pin(request_id, request.job_id, request.blocks, expires_at_s)
        self._pin_of_job[request.job_id] = request_id
        self.counters.pins_confirmed += 1

    def _unpin(self, request_id: str, by_engine: bool) -> None:
        pin = self._pins.pop(request_id, None)
        if pin is None:
            return
        if self._pin_of_job.get(pin.job_id) == request_id:
            del self._pin_of_job[pin.job_id]
        if by_engine:
            self._released.append(request_id)
            self.counters.pins_released_by_engine += 1
        else:
            self.counters.pins_released_by_daemon += 1

    def _expire_pins(self, now_s: float) -> None:
        for pin in [p for p in self._pins.values() if p.expires_at_s <= now_s]:
            self._unpin(pin.request_id, by_engine=True)

    def _new_request(self, request: _Request,
                     state: int = pb.REQUEST_STATE_UNSPECIFIED) -> pb.NewRequest:
        return pb.NewRequest(request_id=request.request_id, job_id=request.job_id,
                             is_last_step=request.last, arrival_s=request.arrival_s,
                             prompt_tokens=request.prompt_tokens, state=state,
                             computed_tokens=request.decoded)

    def _live_requests(self) -> list[pb.NewRequest]:
        return ([self._new_request(r, pb.REQUEST_STATE_WAITING) for r in self._waiting]
                + [self._new_request(r, pb.REQUEST_STATE_RUNNING)
                   for r in self._running.values()])


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


