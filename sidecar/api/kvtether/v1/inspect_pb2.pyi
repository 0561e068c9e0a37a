from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetPolicyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPolicyResponse(_message.Message):
    __slots__ = ("name", "parameters", "store_backend", "engines", "version", "engine_costs")
    class ParametersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STORE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_COSTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    parameters: _containers.ScalarMap[str, str]
    store_backend: str
    engines: _containers.RepeatedScalarFieldContainer[str]
    version: str
    engine_costs: _containers.RepeatedCompositeFieldContainer[EngineStepCost]
    def __init__(self, name: _Optional[str] = ..., parameters: _Optional[_Mapping[str, str]] = ..., store_backend: _Optional[str] = ..., engines: _Optional[_Iterable[str]] = ..., version: _Optional[str] = ..., engine_costs: _Optional[_Iterable[_Union[EngineStepCost, _Mapping]]] = ...) -> None: ...

class EngineStepCost(_message.Message):
    __slots__ = ("engine_id", "prefill_s_per_token", "decode_s_per_seq", "step_s", "steps", "prefill_relative_error", "prefill_tokens_per_s", "prefill_time_share")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_PER_SEQ_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RELATIVE_ERROR_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TIME_SHARE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    prefill_s_per_token: float
    decode_s_per_seq: float
    step_s: float
    steps: int
    prefill_relative_error: float
    prefill_tokens_per_s: float
    prefill_time_share: float
    def __init__(self, engine_id: _Optional[str] = ..., prefill_s_per_token: _Optional[float] = ..., decode_s_per_seq: _Optional[float] = ..., step_s: _Optional[float] = ..., steps: _Optional[int] = ..., prefill_relative_error: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., prefill_time_share: _Optional[float] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("limit", "page_token", "include_anonymous")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_ANONYMOUS_FIELD_NUMBER: _ClassVar[int]
    limit: int
    page_token: str
    include_anonymous: bool
    def __init__(self, limit: _Optional[int] = ..., page_token: _Optional[str] = ..., include_anonymous: bool = ...) -> None: ...

class JobSummary(_message.Message):
    __slots__ = ("job_id", "first_arrival_s", "turns_finished", "requests_in_flight", "last_tool", "pinned_blocks", "engine_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_ARRIVAL_S_FIELD_NUMBER: _ClassVar[int]
    TURNS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LAST_TOOL_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    first_arrival_s: float
    turns_finished: int
    requests_in_flight: int
    last_tool: str
    pinned_blocks: int
    engine_id: str
    def __init__(self, job_id: _Optional[str] = ..., first_arrival_s: _Optional[float] = ..., turns_finished: _Optional[int] = ..., requests_in_flight: _Optional[int] = ..., last_tool: _Optional[str] = ..., pinned_blocks: _Optional[int] = ..., engine_id: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobSummary]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobSummary, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class TurnRecord(_message.Message):
    __slots__ = ("request_id", "arrival_s", "departure_s", "prompt_tokens", "output_tokens", "tool", "tool_time_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_S_FIELD_NUMBER: _ClassVar[int]
    DEPARTURE_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    TOOL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    arrival_s: float
    departure_s: float
    prompt_tokens: int
    output_tokens: int
    tool: str
    tool_time_s: float
    def __init__(self, request_id: _Optional[str] = ..., arrival_s: _Optional[float] = ..., departure_s: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., tool: _Optional[str] = ..., tool_time_s: _Optional[float] = ...) -> None: ...

class PinRecord(_message.Message):
    __slots__ = ("engine_id", "request_id", "job_id", "blocks", "pinned_at_s", "expires_at_s", "tool")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_AT_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_S_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    job_id: str
    blocks: int
    pinned_at_s: float
    expires_at_s: float
    tool: str
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., job_id: _Optional[str] = ..., blocks: _Optional[int] = ..., pinned_at_s: _Optional[float] = ..., expires_at_s: _Optional[float] = ..., tool: _Optional[str] = ...) -> None: ...

class GetJobResponse(_message.Message):
    __slots__ = ("found", "summary", "turns", "pins", "last_decisions")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    LAST_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    found: bool
    summary: JobSummary
    turns: _containers.RepeatedCompositeFieldContainer[TurnRecord]
    pins: _containers.RepeatedCompositeFieldContainer[PinRecord]
    last_decisions: _containers.RepeatedCompositeFieldContainer[DecisionRecord]
    def __init__(self, found: bool = ..., summary: _Optional[_Union[JobSummary, _Mapping]] = ..., turns: _Optional[_Iterable[_Union[TurnRecord, _Mapping]]] = ..., pins: _Optional[_Iterable[_Union[PinRecord, _Mapping]]] = ..., last_decisions: _Optional[_Iterable[_Union[DecisionRecord, _Mapping]]] = ...) -> None: ...

class ListPinsRequest(_message.Message):
    __slots__ = ("engine_id", "limit", "page_token")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    limit: int
    page_token: str
    def __init__(self, engine_id: _Optional[str] = ..., limit: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListPinsResponse(_message.Message):
    __slots__ = ("pins", "pinned_blocks", "next_page_token")
    PINS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    pins: _containers.RepeatedCompositeFieldContainer[PinRecord]
    pinned_blocks: int
    next_page_token: str
    def __init__(self, pins: _Optional[_Iterable[_Union[PinRecord, _Mapping]]] = ..., pinned_blocks: _Optional[int] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetToolStatsRequest(_message.Message):
    __slots__ = ("tool", "limit", "page_token")
    TOOL_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tool: str
    limit: int
    page_token: str
    def __init__(self, tool: _Optional[str] = ..., limit: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ToolStats(_message.Message):
    __slots__ = ("tool", "count", "mean_s", "p50_s", "p90_s", "p99_s", "mean_log_s", "stddev_log_s")
    TOOL_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MEAN_S_FIELD_NUMBER: _ClassVar[int]
    P50_S_FIELD_NUMBER: _ClassVar[int]
    P90_S_FIELD_NUMBER: _ClassVar[int]
    P99_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOG_S_FIELD_NUMBER: _ClassVar[int]
    STDDEV_LOG_S_FIELD_NUMBER: _ClassVar[int]
    tool: str
    count: int
    mean_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    mean_log_s: float
    stddev_log_s: float
    def __init__(self, tool: _Optional[str] = ..., count: _Optional[int] = ..., mean_s: _Optional[float] = ..., p50_s: _Optional[float] = ..., p90_s: _Optional[float] = ..., p99_s: _Optional[float] = ..., mean_log_s: _Optional[float] = ..., stddev_log_s: _Optional[float] = ...) -> None: ...

class GetToolStatsResponse(_message.Message):
    __slots__ = ("tools", "next_page_token")
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tools: _containers.RepeatedCompositeFieldContainer[ToolStats]
    next_page_token: str
    def __init__(self, tools: _Optional[_Iterable[_Union[ToolStats, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ExplainRequest(_message.Message):
    __slots__ = ("request_id", "limit", "page_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    limit: int
    page_token: str
    def __init__(self, request_id: _Optional[str] = ..., limit: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class DecisionRecord(_message.Message):
    __slots__ = ("engine_id", "request_id", "job_id", "kind", "reason", "inputs", "at_s", "seq", "policy")
    class InputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    AT_S_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    job_id: str
    kind: str
    reason: str
    inputs: _containers.ScalarMap[str, str]
    at_s: float
    seq: int
    policy: str
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., job_id: _Optional[str] = ..., kind: _Optional[str] = ..., reason: _Optional[str] = ..., inputs: _Optional[_Mapping[str, str]] = ..., at_s: _Optional[float] = ..., seq: _Optional[int] = ..., policy: _Optional[str] = ...) -> None: ...

class ExplainResponse(_message.Message):
    __slots__ = ("found", "decision", "decisions", "next_page_token")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    found: bool
    decision: DecisionRecord
    decisions: _containers.RepeatedCompositeFieldContainer[DecisionRecord]
    next_page_token: str
    def __init__(self, found: bool = ..., decision: _Optional[_Union[DecisionRecord, _Mapping]] = ..., decisions: _Optional[_Iterable[_Union[DecisionRecord, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WatchDecisionsRequest(_message.Message):
    __slots__ = ("engine_id", "job_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    job_id: str
    def __init__(self, engine_id: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...
