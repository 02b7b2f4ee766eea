from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_STORE: _ClassVar[Mode]
    MODE_SELECTIVE: _ClassVar[Mode]
    MODE_RECOMPUTE: _ClassVar[Mode]
    MODE_OFFLOAD: _ClassVar[Mode]
    MODE_COMPRESS: _ClassVar[Mode]
    MODE_TITAN: _ClassVar[Mode]
    MODE_ATTENTION: _ClassVar[Mode]
    MODE_MLP: _ClassVar[Mode]

class MemorySource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_SOURCE_UNSPECIFIED: _ClassVar[MemorySource]
    MEMORY_SOURCE_CUDA_ALLOCATOR: _ClassVar[MemorySource]
    MEMORY_SOURCE_SAVED_TENSORS: _ClassVar[MemorySource]
MODE_UNSPECIFIED: Mode
MODE_STORE: Mode
MODE_SELECTIVE: Mode
MODE_RECOMPUTE: Mode
MODE_OFFLOAD: Mode
MODE_COMPRESS: Mode
MODE_TITAN: Mode
MODE_ATTENTION: Mode
MODE_MLP: Mode
MEMORY_SOURCE_UNSPECIFIED: MemorySource
MEMORY_SOURCE_CUDA_ALLOCATOR: MemorySource
MEMORY_SOURCE_SAVED_TENSORS: MemorySource

class Shape(_message.Message):
    __slots__ = ("batch", "seq_len", "tokens")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    batch: int
    seq_len: int
    tokens: int
    def __init__(self, batch: _Optional[int] = ..., seq_len: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class SizeTerm(_message.Message):
    __slots__ = ("bytes", "batch_exp", "seq_exp")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BATCH_EXP_FIELD_NUMBER: _ClassVar[int]
    SEQ_EXP_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    batch_exp: int
    seq_exp: int
    def __init__(self, bytes: _Optional[int] = ..., batch_exp: _Optional[int] = ..., seq_exp: _Optional[int] = ...) -> None: ...

class ModeCost(_message.Message):
    __slots__ = ("mode", "kept", "transient", "extra_seconds", "released", "fixed_seconds")
    MODE_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    TRANSIENT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    FIXED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    mode: Mode
    kept: _containers.RepeatedCompositeFieldContainer[SizeTerm]
    transient: _containers.RepeatedCompositeFieldContainer[SizeTerm]
    extra_seconds: float
    released: _containers.RepeatedCompositeFieldContainer[SizeTerm]
    fixed_seconds: float
    def __init__(self, mode: _Optional[_Union[Mode, str]] = ..., kept: _Optional[_Iterable[_Union[SizeTerm, _Mapping]]] = ..., transient: _Optional[_Iterable[_Union[SizeTerm, _Mapping]]] = ..., extra_seconds: _Optional[float] = ..., released: _Optional[_Iterable[_Union[SizeTerm, _Mapping]]] = ..., fixed_seconds: _Optional[float] = ...) -> None: ...

class BlockProfile(_message.Message):
    __slots__ = ("index", "name", "saved_bytes", "input_bytes", "forward_seconds", "modes", "in_flight", "stage")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SAVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    INPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MODES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    saved_bytes: int
    input_bytes: int
    forward_seconds: float
    modes: _containers.RepeatedCompositeFieldContainer[ModeCost]
    in_flight: int
    stage: int
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., saved_bytes: _Optional[int] = ..., input_bytes: _Optional[int] = ..., forward_seconds: _Optional[float] = ..., modes: _Optional[_Iterable[_Union[ModeCost, _Mapping]]] = ..., in_flight: _Optional[int] = ..., stage: _Optional[int] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("job_id", "rank", "world_size", "device_name", "device_total_bytes", "model_fingerprint", "blocks", "profile_shape", "budget_bytes", "static_bytes", "memory_source", "margin_ratio", "client_version", "plan_version", "other_activations", "plan", "session_secret", "job_secret", "host", "pid", "other_in_flight")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATIC_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    MARGIN_RATIO_FIELD_NUMBER: _ClassVar[int]
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    OTHER_ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    JOB_SECRET_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    OTHER_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    world_size: int
    device_name: str
    device_total_bytes: int
    model_fingerprint: str
    blocks: _containers.RepeatedCompositeFieldContainer[BlockProfile]
    profile_shape: Shape
    budget_bytes: int
    static_bytes: int
    memory_source: MemorySource
    margin_ratio: float
    client_version: str
    plan_version: int
    other_activations: _containers.RepeatedCompositeFieldContainer[SizeTerm]
    plan: Plan
    session_secret: str
    job_secret: str
    host: str
    pid: int
    other_in_flight: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., device_name: _Optional[str] = ..., device_total_bytes: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[BlockProfile, _Mapping]]] = ..., profile_shape: _Optional[_Union[Shape, _Mapping]] = ..., budget_bytes: _Optional[int] = ..., static_bytes: _Optional[int] = ..., memory_source: _Optional[_Union[MemorySource, str]] = ..., margin_ratio: _Optional[float] = ..., client_version: _Optional[str] = ..., plan_version: _Optional[int] = ..., other_activations: _Optional[_Iterable[_Union[SizeTerm, _Mapping]]] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ..., session_secret: _Optional[str] = ..., job_secret: _Optional[str] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., other_in_flight: _Optional[int] = ...) -> None: ...

class StepStats(_message.Message):
    __slots__ = ("step", "peak_allocated_bytes", "peak_reserved_bytes", "allocated_bytes", "reserved_bytes", "alloc_retries", "oom_count", "free_bytes", "total_bytes", "step_seconds", "plan_version", "shape", "saved_peak_bytes", "budget_bytes", "static_bytes", "inactive_split_bytes", "steps", "mode_seconds", "recompiles", "compile_seconds", "block_modes", "thread_seconds", "routed_bytes")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PEAK_ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOC_RETRIES_FIELD_NUMBER: _ClassVar[int]
    OOM_COUNT_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SAVED_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATIC_BYTES_FIELD_NUMBER: _ClassVar[int]
    INACTIVE_SPLIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECOMPILES_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_MODES_FIELD_NUMBER: _ClassVar[int]
    THREAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    step: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    alloc_retries: int
    oom_count: int
    free_bytes: int
    total_bytes: int
    step_seconds: float
    plan_version: int
    shape: Shape
    saved_peak_bytes: int
    budget_bytes: int
    static_bytes: int
    inactive_split_bytes: int
    steps: int
    mode_seconds: _containers.RepeatedCompositeFieldContainer[ModeSeconds]
    recompiles: int
    compile_seconds: float
    block_modes: _containers.RepeatedScalarFieldContainer[Mode]
    thread_seconds: float
    routed_bytes: int
    def __init__(self, step: _Optional[int] = ..., peak_allocated_bytes: _Optional[int] = ..., peak_reserved_bytes: _Optional[int] = ..., allocated_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., alloc_retries: _Optional[int] = ..., oom_count: _Optional[int] = ..., free_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., step_seconds: _Optional[float] = ..., plan_version: _Optional[int] = ..., shape: _Optional[_Union[Shape, _Mapping]] = ..., saved_peak_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., static_bytes: _Optional[int] = ..., inactive_split_bytes: _Optional[int] = ..., steps: _Optional[int] = ..., mode_seconds: _Optional[_Iterable[_Union[ModeSeconds, _Mapping]]] = ..., recompiles: _Optional[int] = ..., compile_seconds: _Optional[float] = ..., block_modes: _Optional[_Iterable[_Union[Mode, str]]] = ..., thread_seconds: _Optional[float] = ..., routed_bytes: _Optional[int] = ...) -> None: ...

class ModeSeconds(_message.Message):
    __slots__ = ("mode", "blocks", "seconds", "forward_seconds")
    MODE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    mode: Mode
    blocks: int
    seconds: float
    forward_seconds: float
    def __init__(self, mode: _Optional[_Union[Mode, str]] = ..., blocks: _Optional[int] = ..., seconds: _Optional[float] = ..., forward_seconds: _Optional[float] = ...) -> None: ...

class OomEvent(_message.Message):
    __slots__ = ("step", "shape", "plan_version", "message")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    step: int
    shape: Shape
    plan_version: int
    message: str
    def __init__(self, step: _Optional[int] = ..., shape: _Optional[_Union[Shape, _Mapping]] = ..., plan_version: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ClientMessage(_message.Message):
    __slots__ = ("hello", "stats", "oom", "goodbye")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    OOM_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    stats: StepStats
    oom: OomEvent
    goodbye: Goodbye
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., stats: _Optional[_Union[StepStats, _Mapping]] = ..., oom: _Optional[_Union[OomEvent, _Mapping]] = ..., goodbye: _Optional[_Union[Goodbye, _Mapping]] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("version", "checkpoint_every", "checkpoint_blocks", "predicted_peak_bytes", "predicted_overhead_ratio", "reason", "target_bytes", "block_modes", "shape_plans")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_OVERHEAD_RATIO_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TARGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_MODES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_PLANS_FIELD_NUMBER: _ClassVar[int]
    version: int
    checkpoint_every: int
    checkpoint_blocks: _containers.RepeatedScalarFieldContainer[int]
    predicted_peak_bytes: int
    predicted_overhead_ratio: float
    reason: str
    target_bytes: int
    block_modes: _containers.RepeatedScalarFieldContainer[Mode]
    shape_plans: _containers.RepeatedCompositeFieldContainer[ShapePlan]
    def __init__(self, version: _Optional[int] = ..., checkpoint_every: _Optional[int] = ..., checkpoint_blocks: _Optional[_Iterable[int]] = ..., predicted_peak_bytes: _Optional[int] = ..., predicted_overhead_ratio: _Optional[float] = ..., reason: _Optional[str] = ..., target_bytes: _Optional[int] = ..., block_modes: _Optional[_Iterable[_Union[Mode, str]]] = ..., shape_plans: _Optional[_Iterable[_Union[ShapePlan, _Mapping]]] = ...) -> None: ...

class ShapePlan(_message.Message):
    __slots__ = ("max_seq_len", "max_tokens", "block_modes", "predicted_peak_bytes", "predicted_overhead_ratio")
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_MODES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_OVERHEAD_RATIO_FIELD_NUMBER: _ClassVar[int]
    max_seq_len: int
    max_tokens: int
    block_modes: _containers.RepeatedScalarFieldContainer[Mode]
    predicted_peak_bytes: int
    predicted_overhead_ratio: float
    def __init__(self, max_seq_len: _Optional[int] = ..., max_tokens: _Optional[int] = ..., block_modes: _Optional[_Iterable[_Union[Mode, str]]] = ..., predicted_peak_bytes: _Optional[int] = ..., predicted_overhead_ratio: _Optional[float] = ...) -> None: ...

class StepAck(_message.Message):
    __slots__ = ("step", "plan_version", "oom_risk", "report_interval_seconds", "session_secret")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    OOM_RISK_FIELD_NUMBER: _ClassVar[int]
    REPORT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    step: int
    plan_version: int
    oom_risk: float
    report_interval_seconds: float
    session_secret: str
    def __init__(self, step: _Optional[int] = ..., plan_version: _Optional[int] = ..., oom_risk: _Optional[float] = ..., report_interval_seconds: _Optional[float] = ..., session_secret: _Optional[str] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("plan", "ack")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    plan: Plan
    ack: StepAck
    def __init__(self, plan: _Optional[_Union[Plan, _Mapping]] = ..., ack: _Optional[_Union[StepAck, _Mapping]] = ...) -> None: ...
