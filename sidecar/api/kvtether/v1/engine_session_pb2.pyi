from sidecar.api.kvtether.v1 import retention_pb2 as _retention_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_STATE_UNSPECIFIED: _ClassVar[RequestState]
    REQUEST_STATE_WAITING: _ClassVar[RequestState]
    REQUEST_STATE_RUNNING: _ClassVar[RequestState]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_ADMITTED: _ClassVar[EventKind]
    EVENT_KIND_PREEMPTED: _ClassVar[EventKind]
    EVENT_KIND_FINISHED: _ClassVar[EventKind]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class PinAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PIN_ACTION_UNSPECIFIED: _ClassVar[PinAction]
    PIN_ACTION_PIN: _ClassVar[PinAction]
    PIN_ACTION_RELEASE: _ClassVar[PinAction]
REQUEST_STATE_UNSPECIFIED: RequestState
REQUEST_STATE_WAITING: RequestState
REQUEST_STATE_RUNNING: RequestState
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_ADMITTED: EventKind
EVENT_KIND_PREEMPTED: EventKind
EVENT_KIND_FINISHED: EventKind
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
PIN_ACTION_UNSPECIFIED: PinAction
PIN_ACTION_PIN: PinAction
PIN_ACTION_RELEASE: PinAction

class KvCapacity(_message.Message):
    __slots__ = ("total_blocks", "free_blocks", "block_size_tokens", "admission_stalled", "waiting_demand_blocks")
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_STALLED_FIELD_NUMBER: _ClassVar[int]
    WAITING_DEMAND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    total_blocks: int
    free_blocks: int
    block_size_tokens: int
    admission_stalled: bool
    waiting_demand_blocks: int
    def __init__(self, total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., block_size_tokens: _Optional[int] = ..., admission_stalled: bool = ..., waiting_demand_blocks: _Optional[int] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_id", "job_id", "is_last_step", "arrival_s", "prompt_tokens", "tool_hint", "state", "computed_tokens", "retention", "retention_scope")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_HINT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    RETENTION_SCOPE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    job_id: str
    is_last_step: bool
    arrival_s: float
    prompt_tokens: int
    tool_hint: str
    state: RequestState
    computed_tokens: int
    retention: _retention_pb2.RetentionConfig
    retention_scope: str
    def __init__(self, request_id: _Optional[str] = ..., job_id: _Optional[str] = ..., is_last_step: bool = ..., arrival_s: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., tool_hint: _Optional[str] = ..., state: _Optional[_Union[RequestState, str]] = ..., computed_tokens: _Optional[int] = ..., retention: _Optional[_Union[_retention_pb2.RetentionConfig, _Mapping]] = ..., retention_scope: _Optional[str] = ...) -> None: ...

class RequestEvent(_message.Message):
    __slots__ = ("request_id", "kind", "at_s", "finish_reason", "output_tokens", "tool", "blocks", "cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    AT_S_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kind: EventKind
    at_s: float
    finish_reason: FinishReason
    output_tokens: int
    tool: str
    blocks: int
    cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., kind: _Optional[_Union[EventKind, str]] = ..., at_s: _Optional[float] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., output_tokens: _Optional[int] = ..., tool: _Optional[str] = ..., blocks: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class PinState(_message.Message):
    __slots__ = ("request_id", "job_id", "blocks", "pinned_at_s", "expires_at_s", "tool")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_AT_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_S_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    job_id: str
    blocks: int
    pinned_at_s: float
    expires_at_s: float
    tool: str
    def __init__(self, request_id: _Optional[str] = ..., job_id: _Optional[str] = ..., blocks: _Optional[int] = ..., pinned_at_s: _Optional[float] = ..., expires_at_s: _Optional[float] = ..., tool: _Optional[str] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("engine_id", "seq", "snapshot", "now_s", "kv", "new_requests", "events", "released_pins", "pins", "counters", "work")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    NOW_S_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_PINS_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    seq: int
    snapshot: bool
    now_s: float
    kv: KvCapacity
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    events: _containers.RepeatedCompositeFieldContainer[RequestEvent]
    released_pins: _containers.RepeatedScalarFieldContainer[str]
    pins: _containers.RepeatedCompositeFieldContainer[PinState]
    counters: EngineCounters
    work: StepWork
    def __init__(self, engine_id: _Optional[str] = ..., seq: _Optional[int] = ..., snapshot: bool = ..., now_s: _Optional[float] = ..., kv: _Optional[_Union[KvCapacity, _Mapping]] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[RequestEvent, _Mapping]]] = ..., released_pins: _Optional[_Iterable[str]] = ..., pins: _Optional[_Iterable[_Union[PinState, _Mapping]]] = ..., counters: _Optional[_Union[EngineCounters, _Mapping]] = ..., work: _Optional[_Union[StepWork, _Mapping]] = ...) -> None: ...

class StepWork(_message.Message):
    __slots__ = ("steps", "busy_s", "prefill_tokens", "decode_seqs")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SEQS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    busy_s: float
    prefill_tokens: int
    decode_seqs: int
    def __init__(self, steps: _Optional[int] = ..., busy_s: _Optional[float] = ..., prefill_tokens: _Optional[int] = ..., decode_seqs: _Optional[int] = ...) -> None: ...

class EngineCounters(_message.Message):
    __slots__ = ("fallback_steps", "resyncs", "local_pin_expiries", "idle_pin_releases", "answers_by_lag_steps", "provisional_block_seconds", "idle_waits", "idle_waits_missed", "kv_hint_actions_ignored", "kv_hint_fields_refused")
    FALLBACK_STEPS_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PIN_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    IDLE_PIN_RELEASES_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_BY_LAG_STEPS_FIELD_NUMBER: _ClassVar[int]
    PROVISIONAL_BLOCK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_WAITS_FIELD_NUMBER: _ClassVar[int]
    IDLE_WAITS_MISSED_FIELD_NUMBER: _ClassVar[int]
    KV_HINT_ACTIONS_IGNORED_FIELD_NUMBER: _ClassVar[int]
    KV_HINT_FIELDS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    fallback_steps: int
    resyncs: int
    local_pin_expiries: int
    idle_pin_releases: int
    answers_by_lag_steps: _containers.RepeatedScalarFieldContainer[int]
    provisional_block_seconds: float
    idle_waits: int
    idle_waits_missed: int
    kv_hint_actions_ignored: int
    kv_hint_fields_refused: int
    def __init__(self, fallback_steps: _Optional[int] = ..., resyncs: _Optional[int] = ..., local_pin_expiries: _Optional[int] = ..., idle_pin_releases: _Optional[int] = ..., answers_by_lag_steps: _Optional[_Iterable[int]] = ..., provisional_block_seconds: _Optional[float] = ..., idle_waits: _Optional[int] = ..., idle_waits_missed: _Optional[int] = ..., kv_hint_actions_ignored: _Optional[int] = ..., kv_hint_fields_refused: _Optional[int] = ...) -> None: ...

class PinDecision(_message.Message):
    __slots__ = ("request_id", "action", "expires_at_s", "retention_priority", "retention_duration_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_S_FIELD_NUMBER: _ClassVar[int]
    RETENTION_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RETENTION_DURATION_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    action: PinAction
    expires_at_s: float
    retention_priority: int
    retention_duration_s: float
    def __init__(self, request_id: _Optional[str] = ..., action: _Optional[_Union[PinAction, str]] = ..., expires_at_s: _Optional[float] = ..., retention_priority: _Optional[int] = ..., retention_duration_s: _Optional[float] = ...) -> None: ...

class RequestPriority(_message.Message):
    __slots__ = ("request_id", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class BlockRetention(_message.Message):
    __slots__ = ("request_id", "config", "scope")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    config: _retention_pb2.RetentionConfig
    scope: str
    def __init__(self, request_id: _Optional[str] = ..., config: _Optional[_Union[_retention_pb2.RetentionConfig, _Mapping]] = ..., scope: _Optional[str] = ...) -> None: ...

class StepDecision(_message.Message):
    __slots__ = ("seq", "resync_requested", "priorities", "pins", "retention", "policy", "decide_us", "provisional_pins", "pressure_release_order", "count_waiting_demand", "provisional_cache")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESYNC_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    DECIDE_US_FIELD_NUMBER: _ClassVar[int]
    PROVISIONAL_PINS_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_RELEASE_ORDER_FIELD_NUMBER: _ClassVar[int]
    COUNT_WAITING_DEMAND_FIELD_NUMBER: _ClassVar[int]
    PROVISIONAL_CACHE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    resync_requested: bool
    priorities: _containers.RepeatedCompositeFieldContainer[RequestPriority]
    pins: _containers.RepeatedCompositeFieldContainer[PinDecision]
    retention: _containers.RepeatedCompositeFieldContainer[BlockRetention]
    policy: str
    decide_us: int
    provisional_pins: bool
    pressure_release_order: PinOrder
    count_waiting_demand: bool
    provisional_cache: bool
    def __init__(self, seq: _Optional[int] = ..., resync_requested: bool = ..., priorities: _Optional[_Iterable[_Union[RequestPriority, _Mapping]]] = ..., pins: _Optional[_Iterable[_Union[PinDecision, _Mapping]]] = ..., retention: _Optional[_Iterable[_Union[BlockRetention, _Mapping]]] = ..., policy: _Optional[str] = ..., decide_us: _Optional[int] = ..., provisional_pins: bool = ..., pressure_release_order: _Optional[_Union[PinOrder, _Mapping]] = ..., count_waiting_demand: bool = ..., provisional_cache: bool = ...) -> None: ...

class PinOrder(_message.Message):
    __slots__ = ("request_ids", "max_running")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    max_running: int
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., max_running: _Optional[int] = ...) -> None: ...
