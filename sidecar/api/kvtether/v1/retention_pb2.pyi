from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenRangeRetention(_message.Message):
    __slots__ = ("token_start", "token_end", "priority", "duration_s")
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    token_start: int
    token_end: int
    priority: int
    duration_s: float
    def __init__(self, token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., priority: _Optional[int] = ..., duration_s: _Optional[float] = ...) -> None: ...

class RetentionConfig(_message.Message):
    __slots__ = ("token_ranges", "decode_priority", "decode_duration_s")
    TOKEN_RANGES_FIELD_NUMBER: _ClassVar[int]
    DECODE_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DECODE_DURATION_S_FIELD_NUMBER: _ClassVar[int]
    token_ranges: _containers.RepeatedCompositeFieldContainer[TokenRangeRetention]
    decode_priority: int
    decode_duration_s: float
    def __init__(self, token_ranges: _Optional[_Iterable[_Union[TokenRangeRetention, _Mapping]]] = ..., decode_priority: _Optional[int] = ..., decode_duration_s: _Optional[float] = ...) -> None: ...

class RetentionTarget(_message.Message):
    __slots__ = ("job_id", "session_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    session_id: str
    def __init__(self, job_id: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class TrtllmTokenRangeRetention(_message.Message):
    __slots__ = ("token_start", "token_end", "priority", "duration_ms")
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    token_start: int
    token_end: int
    priority: int
    duration_ms: float
    def __init__(self, token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., priority: _Optional[int] = ..., duration_ms: _Optional[float] = ...) -> None: ...

class TrtllmRetentionConfig(_message.Message):
    __slots__ = ("token_range_retention_configs", "decode_retention_priority", "decode_duration_ms")
    TOKEN_RANGE_RETENTION_CONFIGS_FIELD_NUMBER: _ClassVar[int]
    DECODE_RETENTION_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DECODE_DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    token_range_retention_configs: _containers.RepeatedCompositeFieldContainer[TrtllmTokenRangeRetention]
    decode_retention_priority: int
    decode_duration_ms: float
    def __init__(self, token_range_retention_configs: _Optional[_Iterable[_Union[TrtllmTokenRangeRetention, _Mapping]]] = ..., decode_retention_priority: _Optional[int] = ..., decode_duration_ms: _Optional[float] = ...) -> None: ...

class SetDirectivesRequest(_message.Message):
    __slots__ = ("target", "config", "scope", "trtllm_config")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    TRTLLM_CONFIG_FIELD_NUMBER: _ClassVar[int]
    target: RetentionTarget
    config: RetentionConfig
    scope: str
    trtllm_config: TrtllmRetentionConfig
    def __init__(self, target: _Optional[_Union[RetentionTarget, _Mapping]] = ..., config: _Optional[_Union[RetentionConfig, _Mapping]] = ..., scope: _Optional[str] = ..., trtllm_config: _Optional[_Union[TrtllmRetentionConfig, _Mapping]] = ...) -> None: ...

class SetDirectivesResponse(_message.Message):
    __slots__ = ("effective", "owner_scope")
    EFFECTIVE_FIELD_NUMBER: _ClassVar[int]
    OWNER_SCOPE_FIELD_NUMBER: _ClassVar[int]
    effective: RetentionConfig
    owner_scope: str
    def __init__(self, effective: _Optional[_Union[RetentionConfig, _Mapping]] = ..., owner_scope: _Optional[str] = ...) -> None: ...

class GetDirectivesRequest(_message.Message):
    __slots__ = ("target",)
    TARGET_FIELD_NUMBER: _ClassVar[int]
    target: RetentionTarget
    def __init__(self, target: _Optional[_Union[RetentionTarget, _Mapping]] = ...) -> None: ...

class GetDirectivesResponse(_message.Message):
    __slots__ = ("found", "config", "owner_scope", "updated_at_unix_s")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    OWNER_SCOPE_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    found: bool
    config: RetentionConfig
    owner_scope: str
    updated_at_unix_s: float
    def __init__(self, found: bool = ..., config: _Optional[_Union[RetentionConfig, _Mapping]] = ..., owner_scope: _Optional[str] = ..., updated_at_unix_s: _Optional[float] = ...) -> None: ...

class ClearDirectivesRequest(_message.Message):
    __slots__ = ("target", "scope")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    target: RetentionTarget
    scope: str
    def __init__(self, target: _Optional[_Union[RetentionTarget, _Mapping]] = ..., scope: _Optional[str] = ...) -> None: ...

class ClearDirectivesResponse(_message.Message):
    __slots__ = ("cleared",)
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    cleared: bool
    def __init__(self, cleared: bool = ...) -> None: ...

class AnnounceToolCallRequest(_message.Message):
    __slots__ = ("job_id", "tool", "expected_duration_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_DURATION_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    tool: str
    expected_duration_s: float
    def __init__(self, job_id: _Optional[str] = ..., tool: _Optional[str] = ..., expected_duration_s: _Optional[float] = ...) -> None: ...

class AnnounceToolCallResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
