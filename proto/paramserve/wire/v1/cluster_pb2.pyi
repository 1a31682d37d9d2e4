from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardPlacement(_message.Message):
    __slots__ = ("index", "server", "row_start", "num_rows")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    index: int
    server: int
    row_start: int
    num_rows: int
    def __init__(self, index: _Optional[int] = ..., server: _Optional[int] = ..., row_start: _Optional[int] = ..., num_rows: _Optional[int] = ...) -> None: ...

class VariableLayout(_message.Message):
    __slots__ = ("name", "shape", "dtype", "shards")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    shards: _containers.RepeatedCompositeFieldContainer[ShardPlacement]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[ShardPlacement, _Mapping]]] = ...) -> None: ...

class ClusterContext(_message.Message):
    __slots__ = ("parameter_servers", "variables", "generation", "failover_seconds")
    PARAMETER_SERVERS_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    FAILOVER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    parameter_servers: _containers.RepeatedScalarFieldContainer[str]
    variables: _containers.RepeatedCompositeFieldContainer[VariableLayout]
    generation: int
    failover_seconds: float
    def __init__(self, parameter_servers: _Optional[_Iterable[str]] = ..., variables: _Optional[_Iterable[_Union[VariableLayout, _Mapping]]] = ..., generation: _Optional[int] = ..., failover_seconds: _Optional[float] = ...) -> None: ...
