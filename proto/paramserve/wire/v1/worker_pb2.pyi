from paramserve.wire.v1 import cluster_pb2 as _cluster_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResourceSpec(_message.Message):
    __slots__ = ("resource_id", "payload")
    RESOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    resource_id: str
    payload: bytes
    def __init__(self, resource_id: _Optional[str] = ..., payload: _Optional[bytes] = ...) -> None: ...

class RunClosureRequest(_message.Message):
    __slots__ = ("closure_id", "attempt", "function_name", "payload", "resources", "cluster", "steps", "worker_index", "num_workers", "cluster_fingerprint", "max_value_age", "overlap_pushes", "read_generation", "max_row_staleness")
    CLOSURE_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_VALUE_AGE_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_PUSHES_FIELD_NUMBER: _ClassVar[int]
    READ_GENERATION_FIELD_NUMBER: _ClassVar[int]
    MAX_ROW_STALENESS_FIELD_NUMBER: _ClassVar[int]
    closure_id: str
    attempt: int
    function_name: str
    payload: bytes
    resources: _containers.RepeatedCompositeFieldContainer[ResourceSpec]
    cluster: _cluster_pb2.ClusterContext
    steps: int
    worker_index: int
    num_workers: int
    cluster_fingerprint: str
    max_value_age: float
    overlap_pushes: bool
    read_generation: int
    max_row_staleness: int
    def __init__(self, closure_id: _Optional[str] = ..., attempt: _Optional[int] = ..., function_name: _Optional[str] = ..., payload: _Optional[bytes] = ..., resources: _Optional[_Iterable[_Union[ResourceSpec, _Mapping]]] = ..., cluster: _Optional[_Union[_cluster_pb2.ClusterContext, _Mapping]] = ..., steps: _Optional[int] = ..., worker_index: _Optional[int] = ..., num_workers: _Optional[int] = ..., cluster_fingerprint: _Optional[str] = ..., max_value_age: _Optional[float] = ..., overlap_pushes: _Optional[bool] = ..., read_generation: _Optional[int] = ..., max_row_staleness: _Optional[int] = ...) -> None: ...

class ClosureFailure(_message.Message):
    __slots__ = ("type", "message", "traceback", "pickled", "missing_resources", "parameter_server", "needs_cluster", "cancelled", "group_failed")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    PICKLED_FIELD_NUMBER: _ClassVar[int]
    MISSING_RESOURCES_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_SERVER_FIELD_NUMBER: _ClassVar[int]
    NEEDS_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    GROUP_FAILED_FIELD_NUMBER: _ClassVar[int]
    type: str
    message: str
    traceback: str
    pickled: bytes
    missing_resources: _containers.RepeatedScalarFieldContainer[str]
    parameter_server: str
    needs_cluster: bool
    cancelled: bool
    group_failed: bool
    def __init__(self, type: _Optional[str] = ..., message: _Optional[str] = ..., traceback: _Optional[str] = ..., pickled: _Optional[bytes] = ..., missing_resources: _Optional[_Iterable[str]] = ..., parameter_server: _Optional[str] = ..., needs_cluster: _Optional[bool] = ..., cancelled: _Optional[bool] = ..., group_failed: _Optional[bool] = ...) -> None: ...

class RunClosureResponse(_message.Message):
    __slots__ = ("result", "error", "worker_incarnation", "resources_held", "pushes_applied", "pushes_duplicate", "seconds", "device", "rows_pulled", "rows_cached", "cached_by_age")
    class CachedByAgeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WORKER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_HELD_FIELD_NUMBER: _ClassVar[int]
    PUSHES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ROWS_PULLED_FIELD_NUMBER: _ClassVar[int]
    ROWS_CACHED_FIELD_NUMBER: _ClassVar[int]
    CACHED_BY_AGE_FIELD_NUMBER: _ClassVar[int]
    result: bytes
    error: ClosureFailure
    worker_incarnation: str
    resources_held: _containers.RepeatedScalarFieldContainer[str]
    pushes_applied: int
    pushes_duplicate: int
    seconds: float
    device: str
    rows_pulled: int
    rows_cached: int
    cached_by_age: _containers.ScalarMap[int, int]
    def __init__(self, result: _Optional[bytes] = ..., error: _Optional[_Union[ClosureFailure, _Mapping]] = ..., worker_incarnation: _Optional[str] = ..., resources_held: _Optional[_Iterable[str]] = ..., pushes_applied: _Optional[int] = ..., pushes_duplicate: _Optional[int] = ..., seconds: _Optional[float] = ..., device: _Optional[str] = ..., rows_pulled: _Optional[int] = ..., rows_cached: _Optional[int] = ..., cached_by_age: _Optional[_Mapping[int, int]] = ...) -> None: ...

class RunClosuresRequest(_message.Message):
    __slots__ = ("closures", "dense")
    CLOSURES_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    closures: _containers.RepeatedCompositeFieldContainer[RunClosureRequest]
    dense: DenseRound
    def __init__(self, closures: _Optional[_Iterable[_Union[RunClosureRequest, _Mapping]]] = ..., dense: _Optional[_Union[DenseRound, _Mapping]] = ...) -> None: ...

class RunClosuresResponse(_message.Message):
    __slots__ = ("results", "dense_state", "group_failed")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    DENSE_STATE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FAILED_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RunClosureResponse]
    dense_state: bytes
    group_failed: bool
    def __init__(self, results: _Optional[_Iterable[_Union[RunClosureResponse, _Mapping]]] = ..., dense_state: _Optional[bytes] = ..., group_failed: _Optional[bool] = ...) -> None: ...

class DenseGroup(_message.Message):
    __slots__ = ("generation", "rank", "world_size", "store_address", "host", "timeout_seconds", "store_secret")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STORE_SECRET_FIELD_NUMBER: _ClassVar[int]
    generation: int
    rank: int
    world_size: int
    store_address: str
    host: str
    timeout_seconds: float
    store_secret: bytes
    def __init__(self, generation: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., store_address: _Optional[str] = ..., host: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., store_secret: _Optional[bytes] = ...) -> None: ...

class DenseRound(_message.Message):
    __slots__ = ("group", "variables", "optimizer", "state_epoch", "initial_state", "read_state")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    STATE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    INITIAL_STATE_FIELD_NUMBER: _ClassVar[int]
    READ_STATE_FIELD_NUMBER: _ClassVar[int]
    group: DenseGroup
    variables: _containers.RepeatedScalarFieldContainer[str]
    optimizer: bytes
    state_epoch: int
    initial_state: bytes
    read_state: bool
    def __init__(self, group: _Optional[_Union[DenseGroup, _Mapping]] = ..., variables: _Optional[_Iterable[str]] = ..., optimizer: _Optional[bytes] = ..., state_epoch: _Optional[int] = ..., initial_state: _Optional[bytes] = ..., read_state: _Optional[bool] = ...) -> None: ...

class CancelClosuresRequest(_message.Message):
    __slots__ = ("closure_ids",)
    CLOSURE_IDS_FIELD_NUMBER: _ClassVar[int]
    closure_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, closure_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CancelClosuresResponse(_message.Message):
    __slots__ = ("running",)
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    running: int
    def __init__(self, running: _Optional[int] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("incarnation", "pid", "resources_held", "closures_run")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_HELD_FIELD_NUMBER: _ClassVar[int]
    CLOSURES_RUN_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    pid: int
    resources_held: _containers.RepeatedScalarFieldContainer[str]
    closures_run: int
    def __init__(self, incarnation: _Optional[str] = ..., pid: _Optional[int] = ..., resources_held: _Optional[_Iterable[str]] = ..., closures_run: _Optional[int] = ...) -> None: ...
