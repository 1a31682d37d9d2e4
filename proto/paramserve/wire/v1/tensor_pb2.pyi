from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorMeta(_message.Message):
    __slots__ = ("dtype", "shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ShardRef(_message.Message):
    __slots__ = ("variable", "shard")
    VARIABLE_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    variable: str
    shard: int
    def __init__(self, variable: _Optional[str] = ..., shard: _Optional[int] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "kwargs_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    kwargs_json: str
    def __init__(self, name: _Optional[str] = ..., kwargs_json: _Optional[str] = ...) -> None: ...

class ShardSpec(_message.Message):
    __slots__ = ("ref", "variable_shape", "row_start", "shard_meta", "optimizer", "initializer", "slots", "version", "applied_keys", "optimizer_state_json")
    REF_FIELD_NUMBER: _ClassVar[int]
    VARIABLE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    SHARD_META_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_KEYS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    ref: ShardRef
    variable_shape: _containers.RepeatedScalarFieldContainer[int]
    row_start: int
    shard_meta: TensorMeta
    optimizer: OptimizerSpec
    initializer: Initializer
    slots: _containers.RepeatedCompositeFieldContainer[NamedTensorMeta]
    version: int
    applied_keys: _containers.RepeatedScalarFieldContainer[str]
    optimizer_state_json: str
    def __init__(self, ref: _Optional[_Union[ShardRef, _Mapping]] = ..., variable_shape: _Optional[_Iterable[int]] = ..., row_start: _Optional[int] = ..., shard_meta: _Optional[_Union[TensorMeta, _Mapping]] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., initializer: _Optional[_Union[Initializer, _Mapping]] = ..., slots: _Optional[_Iterable[_Union[NamedTensorMeta, _Mapping]]] = ..., version: _Optional[int] = ..., applied_keys: _Optional[_Iterable[str]] = ..., optimizer_state_json: _Optional[str] = ...) -> None: ...

class NamedTensorMeta(_message.Message):
    __slots__ = ("name", "meta")
    NAME_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    name: str
    meta: TensorMeta
    def __init__(self, name: _Optional[str] = ..., meta: _Optional[_Union[TensorMeta, _Mapping]] = ...) -> None: ...

class Initializer(_message.Message):
    __slots__ = ("kind", "a", "b", "seed")
    KIND_FIELD_NUMBER: _ClassVar[int]
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    kind: str
    a: float
    b: float
    seed: int
    def __init__(self, kind: _Optional[str] = ..., a: _Optional[float] = ..., b: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class PulledPart(_message.Message):
    __slots__ = ("item", "meta", "version")
    ITEM_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    item: int
    meta: TensorMeta
    version: int
    def __init__(self, item: _Optional[int] = ..., meta: _Optional[_Union[TensorMeta, _Mapping]] = ..., version: _Optional[int] = ...) -> None: ...

class PushPart(_message.Message):
    __slots__ = ("ref", "values", "sparse", "num_indices", "base_version")
    REF_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    NUM_INDICES_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    ref: ShardRef
    values: TensorMeta
    sparse: bool
    num_indices: int
    base_version: int
    def __init__(self, ref: _Optional[_Union[ShardRef, _Mapping]] = ..., values: _Optional[_Union[TensorMeta, _Mapping]] = ..., sparse: _Optional[bool] = ..., num_indices: _Optional[int] = ..., base_version: _Optional[int] = ...) -> None: ...

class PartHeader(_message.Message):
    __slots__ = ("shard", "pulled", "push", "dynamic", "payload_bytes")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    PULLED_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    shard: ShardSpec
    pulled: PulledPart
    push: PushPart
    dynamic: DynamicShardHeader
    payload_bytes: int
    def __init__(self, shard: _Optional[_Union[ShardSpec, _Mapping]] = ..., pulled: _Optional[_Union[PulledPart, _Mapping]] = ..., push: _Optional[_Union[PushPart, _Mapping]] = ..., dynamic: _Optional[_Union[DynamicShardHeader, _Mapping]] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PartHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PartHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class DynamicTableConfig(_message.Message):
    __slots__ = ("dim", "dtype", "optimizer", "initializer", "admit_after", "default_row", "ttl_steps", "ttl_seconds", "max_rows", "max_bytes", "admission_width", "block_rows")
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    ADMIT_AFTER_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_ROW_FIELD_NUMBER: _ClassVar[int]
    TTL_STEPS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_WIDTH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ROWS_FIELD_NUMBER: _ClassVar[int]
    dim: int
    dtype: str
    optimizer: OptimizerSpec
    initializer: Initializer
    admit_after: int
    default_row: str
    ttl_steps: int
    ttl_seconds: float
    max_rows: int
    max_bytes: int
    admission_width: int
    block_rows: int
    def __init__(self, dim: _Optional[int] = ..., dtype: _Optional[str] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., initializer: _Optional[_Union[Initializer, _Mapping]] = ..., admit_after: _Optional[int] = ..., default_row: _Optional[str] = ..., ttl_steps: _Optional[int] = ..., ttl_seconds: _Optional[float] = ..., max_rows: _Optional[int] = ..., max_bytes: _Optional[int] = ..., admission_width: _Optional[int] = ..., block_rows: _Optional[int] = ...) -> None: ...

class DynamicShardHeader(_message.Message):
    __slots__ = ("ref", "num_shards", "config", "tensors", "version", "applied_keys", "delta", "lineage", "through")
    REF_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_KEYS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    THROUGH_FIELD_NUMBER: _ClassVar[int]
    ref: ShardRef
    num_shards: int
    config: DynamicTableConfig
    tensors: _containers.RepeatedCompositeFieldContainer[NamedTensorMeta]
    version: int
    applied_keys: _containers.RepeatedScalarFieldContainer[str]
    delta: bool
    lineage: str
    through: int
    def __init__(self, ref: _Optional[_Union[ShardRef, _Mapping]] = ..., num_shards: _Optional[int] = ..., config: _Optional[_Union[DynamicTableConfig, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[NamedTensorMeta, _Mapping]]] = ..., version: _Optional[int] = ..., applied_keys: _Optional[_Iterable[str]] = ..., delta: _Optional[bool] = ..., lineage: _Optional[str] = ..., through: _Optional[int] = ...) -> None: ...
