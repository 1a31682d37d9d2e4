from paramserve.wire.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_ROLE_UNSPECIFIED: _ClassVar[ReplicaRole]
    STANDALONE: _ClassVar[ReplicaRole]
    PRIMARY: _ClassVar[ReplicaRole]
    BACKUP: _ClassVar[ReplicaRole]
REPLICA_ROLE_UNSPECIFIED: ReplicaRole
STANDALONE: ReplicaRole
PRIMARY: ReplicaRole
BACKUP: ReplicaRole

class CreateShardsResponse(_message.Message):
    __slots__ = ("shards",)
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ...) -> None: ...

class PullItem(_message.Message):
    __slots__ = ("ref", "sparse", "row_indices")
    REF_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    ROW_INDICES_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.ShardRef
    sparse: bool
    row_indices: bytes
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.ShardRef, _Mapping]] = ..., sparse: _Optional[bool] = ..., row_indices: _Optional[bytes] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("items", "chunk_bytes")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PullItem]
    chunk_bytes: int
    def __init__(self, items: _Optional[_Iterable[_Union[PullItem, _Mapping]]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class PushResult(_message.Message):
    __slots__ = ("ref", "applied", "version", "staleness")
    REF_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.ShardRef
    applied: bool
    version: int
    staleness: int
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.ShardRef, _Mapping]] = ..., applied: _Optional[bool] = ..., version: _Optional[int] = ..., staleness: _Optional[int] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PushResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PushResult, _Mapping]]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("plan", "payload")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    plan: StepPlan
    payload: bytes
    def __init__(self, plan: _Optional[_Union[StepPlan, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("idempotency_key", "push", "pull", "define_program", "run_program", "base_versions", "replica_epoch")
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    DEFINE_PROGRAM_FIELD_NUMBER: _ClassVar[int]
    RUN_PROGRAM_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_EPOCH_FIELD_NUMBER: _ClassVar[int]
    idempotency_key: str
    push: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.PushPart]
    pull: _containers.RepeatedCompositeFieldContainer[PullItem]
    define_program: int
    run_program: int
    base_versions: _containers.RepeatedScalarFieldContainer[int]
    replica_epoch: int
    def __init__(self, idempotency_key: _Optional[str] = ..., push: _Optional[_Iterable[_Union[_tensor_pb2.PushPart, _Mapping]]] = ..., pull: _Optional[_Iterable[_Union[PullItem, _Mapping]]] = ..., define_program: _Optional[int] = ..., run_program: _Optional[int] = ..., base_versions: _Optional[_Iterable[int]] = ..., replica_epoch: _Optional[int] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("outcome", "payload")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    outcome: StepOutcome
    payload: bytes
    def __init__(self, outcome: _Optional[_Union[StepOutcome, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class StepOutcome(_message.Message):
    __slots__ = ("pushed", "pulled", "program")
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    PULLED_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    pushed: _containers.RepeatedCompositeFieldContainer[PushResult]
    pulled: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.PulledPart]
    program: ProgramOutcome
    def __init__(self, pushed: _Optional[_Iterable[_Union[PushResult, _Mapping]]] = ..., pulled: _Optional[_Iterable[_Union[_tensor_pb2.PulledPart, _Mapping]]] = ..., program: _Optional[_Union[ProgramOutcome, _Mapping]] = ...) -> None: ...

class ProgramOutcome(_message.Message):
    __slots__ = ("applied", "versions", "staleness", "pulled_versions")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    PULLED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    applied: _containers.RepeatedScalarFieldContainer[bool]
    versions: _containers.RepeatedScalarFieldContainer[int]
    staleness: _containers.RepeatedScalarFieldContainer[int]
    pulled_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, applied: _Optional[_Iterable[bool]] = ..., versions: _Optional[_Iterable[int]] = ..., staleness: _Optional[_Iterable[int]] = ..., pulled_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class ExportShardsRequest(_message.Message):
    __slots__ = ("refs", "chunk_bytes")
    REFS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    refs: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.ShardRef]
    chunk_bytes: int
    def __init__(self, refs: _Optional[_Iterable[_Union[_tensor_pb2.ShardRef, _Mapping]]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class DeleteVariableRequest(_message.Message):
    __slots__ = ("variable",)
    VARIABLE_FIELD_NUMBER: _ClassVar[int]
    variable: str
    def __init__(self, variable: _Optional[str] = ...) -> None: ...

class DeleteVariableResponse(_message.Message):
    __slots__ = ("shards_deleted",)
    SHARDS_DELETED_FIELD_NUMBER: _ClassVar[int]
    shards_deleted: int
    def __init__(self, shards_deleted: _Optional[int] = ...) -> None: ...

class ListShardsRequest(_message.Message):
    __slots__ = ("incarnation_only",)
    INCARNATION_ONLY_FIELD_NUMBER: _ClassVar[int]
    incarnation_only: bool
    def __init__(self, incarnation_only: _Optional[bool] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("ref", "variable_shape", "row_start", "shard_meta", "optimizer", "version")
    REF_FIELD_NUMBER: _ClassVar[int]
    VARIABLE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    SHARD_META_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.ShardRef
    variable_shape: _containers.RepeatedScalarFieldContainer[int]
    row_start: int
    shard_meta: _tensor_pb2.TensorMeta
    optimizer: _tensor_pb2.OptimizerSpec
    version: int
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.ShardRef, _Mapping]] = ..., variable_shape: _Optional[_Iterable[int]] = ..., row_start: _Optional[int] = ..., shard_meta: _Optional[_Union[_tensor_pb2.TensorMeta, _Mapping]] = ..., optimizer: _Optional[_Union[_tensor_pb2.OptimizerSpec, _Mapping]] = ..., version: _Optional[int] = ...) -> None: ...

class ListShardsResponse(_message.Message):
    __slots__ = ("shards", "incarnation", "resident_bytes")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    incarnation: str
    resident_bytes: int
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ..., incarnation: _Optional[str] = ..., resident_bytes: _Optional[int] = ...) -> None: ...

class GetDataPlaneRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataPlaneInfo(_message.Message):
    __slots__ = ("port", "max_frame_bytes", "local_socket", "server_pid", "server_uid")
    PORT_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SERVER_PID_FIELD_NUMBER: _ClassVar[int]
    SERVER_UID_FIELD_NUMBER: _ClassVar[int]
    port: int
    max_frame_bytes: int
    local_socket: str
    server_pid: int
    server_uid: int
    def __init__(self, port: _Optional[int] = ..., max_frame_bytes: _Optional[int] = ..., local_socket: _Optional[str] = ..., server_pid: _Optional[int] = ..., server_uid: _Optional[int] = ...) -> None: ...

class DataPlaneError(_message.Message):
    __slots__ = ("error_type", "message", "variable")
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    VARIABLE_FIELD_NUMBER: _ClassVar[int]
    error_type: str
    message: str
    variable: str
    def __init__(self, error_type: _Optional[str] = ..., message: _Optional[str] = ..., variable: _Optional[str] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("directory", "keep")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    directory: str
    keep: int
    def __init__(self, directory: _Optional[str] = ..., keep: _Optional[int] = ...) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ("path", "shards")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    path: str
    shards: int
    def __init__(self, path: _Optional[str] = ..., shards: _Optional[int] = ...) -> None: ...

class RestoreTarget(_message.Message):
    __slots__ = ("ref", "row_start", "num_rows")
    REF_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.ShardRef
    row_start: int
    num_rows: int
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.ShardRef, _Mapping]] = ..., row_start: _Optional[int] = ..., num_rows: _Optional[int] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("path", "targets")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    path: str
    targets: _containers.RepeatedCompositeFieldContainer[RestoreTarget]
    def __init__(self, path: _Optional[str] = ..., targets: _Optional[_Iterable[_Union[RestoreTarget, _Mapping]]] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("shards",)
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ...) -> None: ...

class SetHyperparametersRequest(_message.Message):
    __slots__ = ("variable", "values_json", "variables")
    VARIABLE_FIELD_NUMBER: _ClassVar[int]
    VALUES_JSON_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    variable: str
    values_json: str
    variables: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, variable: _Optional[str] = ..., values_json: _Optional[str] = ..., variables: _Optional[_Iterable[str]] = ...) -> None: ...

class SetHyperparametersResponse(_message.Message):
    __slots__ = ("shards_updated",)
    SHARDS_UPDATED_FIELD_NUMBER: _ClassVar[int]
    shards_updated: int
    def __init__(self, shards_updated: _Optional[int] = ...) -> None: ...

class CreateDynamicTableRequest(_message.Message):
    __slots__ = ("ref", "num_shards", "config")
    REF_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.ShardRef
    num_shards: int
    config: _tensor_pb2.DynamicTableConfig
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.ShardRef, _Mapping]] = ..., num_shards: _Optional[int] = ..., config: _Optional[_Union[_tensor_pb2.DynamicTableConfig, _Mapping]] = ...) -> None: ...

class DynamicTableStats(_message.Message):
    __slots__ = ("ref", "num_shards", "config", "version", "live_rows", "admissions", "evictions_ttl", "evictions_capacity", "bytes")
    REF_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LIVE_ROWS_FIELD_NUMBER: _ClassVar[int]
    ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_TTL_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.ShardRef
    num_shards: int
    config: _tensor_pb2.DynamicTableConfig
    version: int
    live_rows: int
    admissions: int
    evictions_ttl: int
    evictions_capacity: int
    bytes: int
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.ShardRef, _Mapping]] = ..., num_shards: _Optional[int] = ..., config: _Optional[_Union[_tensor_pb2.DynamicTableConfig, _Mapping]] = ..., version: _Optional[int] = ..., live_rows: _Optional[int] = ..., admissions: _Optional[int] = ..., evictions_ttl: _Optional[int] = ..., evictions_capacity: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class DynamicTablesResponse(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[DynamicTableStats]
    def __init__(self, tables: _Optional[_Iterable[_Union[DynamicTableStats, _Mapping]]] = ...) -> None: ...

class ListDynamicTablesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DynamicSaveMark(_message.Message):
    __slots__ = ("ref", "lineage", "through")
    REF_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    THROUGH_FIELD_NUMBER: _ClassVar[int]
    ref: _tensor_pb2.ShardRef
    lineage: str
    through: int
    def __init__(self, ref: _Optional[_Union[_tensor_pb2.ShardRef, _Mapping]] = ..., lineage: _Optional[str] = ..., through: _Optional[int] = ...) -> None: ...

class ExportDynamicTablesRequest(_message.Message):
    __slots__ = ("refs", "chunk_bytes", "incremental", "since")
    REFS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    INCREMENTAL_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    refs: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.ShardRef]
    chunk_bytes: int
    incremental: bool
    since: _containers.RepeatedCompositeFieldContainer[DynamicSaveMark]
    def __init__(self, refs: _Optional[_Iterable[_Union[_tensor_pb2.ShardRef, _Mapping]]] = ..., chunk_bytes: _Optional[int] = ..., incremental: _Optional[bool] = ..., since: _Optional[_Iterable[_Union[DynamicSaveMark, _Mapping]]] = ...) -> None: ...

class MarkDynamicTablesSavedRequest(_message.Message):
    __slots__ = ("marks",)
    MARKS_FIELD_NUMBER: _ClassVar[int]
    marks: _containers.RepeatedCompositeFieldContainer[DynamicSaveMark]
    def __init__(self, marks: _Optional[_Iterable[_Union[DynamicSaveMark, _Mapping]]] = ...) -> None: ...

class ReplicaConfig(_message.Message):
    __slots__ = ("epoch", "role", "backups", "joining")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BACKUPS_FIELD_NUMBER: _ClassVar[int]
    JOINING_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    role: ReplicaRole
    backups: _containers.RepeatedScalarFieldContainer[str]
    joining: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, epoch: _Optional[int] = ..., role: _Optional[_Union[ReplicaRole, str]] = ..., backups: _Optional[_Iterable[str]] = ..., joining: _Optional[_Iterable[str]] = ...) -> None: ...

class ConfigureReplicaRequest(_message.Message):
    __slots__ = ("config", "query")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    config: ReplicaConfig
    query: bool
    def __init__(self, config: _Optional[_Union[ReplicaConfig, _Mapping]] = ..., query: _Optional[bool] = ...) -> None: ...

class ConfigureReplicaResponse(_message.Message):
    __slots__ = ("config", "incarnation", "refusing")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REFUSING_FIELD_NUMBER: _ClassVar[int]
    config: ReplicaConfig
    incarnation: str
    refusing: str
    def __init__(self, config: _Optional[_Union[ReplicaConfig, _Mapping]] = ..., incarnation: _Optional[str] = ..., refusing: _Optional[str] = ...) -> None: ...

class CopyShardsRequest(_message.Message):
    __slots__ = ("target",)
    TARGET_FIELD_NUMBER: _ClassVar[int]
    target: str
    def __init__(self, target: _Optional[str] = ...) -> None: ...

class CopyShardsResponse(_message.Message):
    __slots__ = ("shards", "bytes")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    shards: int
    bytes: int
    def __init__(self, shards: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...
