"""The one translation between wire messages and the shared types, for every side.

The parameter server's servicer and client convert shards and pulls here; the
coordinator and the worker convert variable layouts and the cluster context here.
The cores (store, worker core) know no protobuf. Whatever comes from the wire is
validated on the way in: a malformed message raises InvalidRequestError.
"""

from __future__ import annotations

import torch

from paramserve.psserver.protocol.errors import InvalidRequestError
from paramserve.psserver.protocol.initializers import initial_value
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.replica_config import ReplicaConfig, ReplicaRole
from paramserve.psserver.protocol.streams import (
    meta_nbytes,
    meta_of,
    tensor_from_bytes,
    tensor_payload,
)
from paramserve.psserver.protocol.tensors import dtype_from_name, dtype_name
from paramserve.psserver.protocol.types import (
    ClusterContext,
    ShardInfo,
    ShardPlacement,
    ShardRef,
    ShardState,
    VariableLayout,
)
from paramserve.wire.v1 import cluster_pb2, tensor_pb2
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2


def ref_to_proto(ref: ShardRef) -> tensor_pb2.ShardRef:
    return tensor_pb2.ShardRef(variable=ref.variable, shard=ref.shard)


def ref_from_proto(ref: tensor_pb2.ShardRef) -> ShardRef:
    if not ref.variable:
        raise InvalidRequestError("shard reference without a variable name")
    if ref.shard < 0:
        raise InvalidRequestError(f"negative shard index {ref.shard} for variable {ref.variable!r}")
    return ShardRef(ref.variable, int(ref.shard))


def optimizer_to_proto(spec: OptimizerSpec | None) -> tensor_pb2.OptimizerSpec | None:
    if spec is None:
        return None
    return tensor_pb2.OptimizerSpec(name=spec.name, kwargs_json=spec.to_json())


def optimizer_from_proto(message: tensor_pb2.OptimizerSpec, present: bool) -> OptimizerSpec | None:
    if not present or not message.name:
        return None
    return OptimizerSpec.from_json(message.name, message.kwargs_json or "{}")


def shard_part(state: ShardState) -> tuple[tensor_pb2.PartHeader, list[memoryview]]:
    """A stream part carrying a whole shard: value, then every slot."""
    spec = tensor_pb2.ShardSpec(
        ref=ref_to_proto(state.ref),
        variable_shape=list(state.variable_shape),
        row_start=state.row_start,
        shard_meta=meta_of(state.value),
        version=state.version,
        applied_keys=list(state.applied_keys),
    )
    optimizer = optimizer_to_proto(state.optimizer)
    if optimizer is not None:
        spec.optimizer.CopyFrom(optimizer)
    pieces = [tensor_payload(state.value)]
    for name, slot in state.slots.items():
        spec.slots.add(name=name, meta=meta_of(slot))
        pieces.append(tensor_payload(slot))
    return tensor_pb2.PartHeader(shard=spec), pieces


def initialized_shard_part(
    ref: ShardRef,
    variable_shape: tuple[int, ...],
    row_start: int,
    shard_shape: tuple[int, ...],
    dtype: torch.dtype,
    optimizer: OptimizerSpec | None,
    initializer: tensor_pb2.Initializer,
) -> tuple[tensor_pb2.PartHeader, list[memoryview]]:
    """A shard part whose value the server fills itself (no value bytes on the wire)."""
    spec = tensor_pb2.ShardSpec(
        ref=ref_to_proto(ref),
        variable_shape=list(variable_shape),
        row_start=row_start,
        shard_meta=tensor_pb2.TensorMeta(dtype=dtype_name(dtype), shape=list(shard_shape)),
        initializer=initializer,
    )
    optimizer_proto = optimizer_to_proto(optimizer)
    if optimizer_proto is not None:
        spec.optimizer.CopyFrom(optimizer_proto)
    return tensor_pb2.PartHeader(shard=spec), []


def shard_payload_bytes(spec: tensor_pb2.ShardSpec) -> int:
    """Bytes of payload a shard part must carry, computed from its header alone."""
    value = 0 if spec.HasField("initializer") else meta_nbytes(spec.shard_meta)
    return value + sum(meta_nbytes(slot.meta) for slot in spec.slots)


def shard_state_from_part(spec: tensor_pb2.ShardSpec, payload: torch.Tensor) -> ShardState:
    """Builds the core ShardState from a received shard part (views into payload, no copy)."""
    ref = ref_from_proto(spec.ref)
    if payload.numel() != shard_payload_bytes(spec):
        raise InvalidRequestError(
            f"shard part of {ref.variable!r}/{ref.shard} carries {payload.numel()} payload bytes, "
            f"its header describes {shard_payload_bytes(spec)}",
            variable=ref.variable,
        )
    offset = 0
    if spec.HasField("initializer"):
        init = spec.initializer
        value = initial_value(
            tuple(spec.shard_meta.shape),
            dtype_from_name(spec.shard_meta.dtype),
            init.kind,
            init.a,
            init.b,
            init.seed + ref.shard,
        )
    else:
        value = tensor_from_bytes(payload, spec.shard_meta, 0)
        offset = value.numel() * value.element_size()
    slots: dict[str, torch.Tensor] = {}
    for slot in spec.slots:
        slots[slot.name] = tensor_from_bytes(payload, slot.meta, offset)
        offset += meta_nbytes(slot.meta)
    return ShardState(
        ref=ref,
        variable_shape=tuple(int(d) for d in spec.variable_shape),
        row_start=int(spec.row_start),
        value=value,
        optimizer=optimizer_from_proto(spec.optimizer, spec.HasField("optimizer")),
        slots=slots,
        version=int(spec.version),
        applied_keys=list(spec.applied_keys),
    )


def info_to_proto(info: ShardInfo) -> ps_pb2.ShardInfo:
    message = ps_pb2.ShardInfo(
        ref=ref_to_proto(info.ref),
        variable_shape=list(info.variable_shape),
        row_start=info.row_start,
        shard_meta=tensor_pb2.TensorMeta(dtype=dtype_name(info.dtype), shape=list(info.shape)),
        version=info.version,
    )
    optimizer = optimizer_to_proto(info.optimizer)
    if optimizer is not None:
        message.optimizer.CopyFrom(optimizer)
    return message


def info_from_proto(message: ps_pb2.ShardInfo) -> ShardInfo:
    return ShardInfo(
        ref=ref_from_proto(message.ref),
        variable_shape=tuple(int(d) for d in message.variable_shape),
        row_start=int(message.row_start),
        shape=tuple(int(d) for d in message.shard_meta.shape),
        dtype=dtype_from_name(message.shard_meta.dtype),
        optimizer=optimizer_from_proto(message.optimizer, message.HasField("optimizer")),
        version=int(message.version),
    )


def rows_to_bytes(rows: torch.Tensor) -> bytes:
    return tensor_payload(rows.to(torch.int64)).tobytes()


def rows_from_bytes(raw: bytes) -> torch.Tensor:
    if len(raw) % 8:
        raise InvalidRequestError(f"row indices must be int64: {len(raw)} bytes is not a multiple of 8")
    if not raw:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(bytearray(raw), dtype=torch.int64)


# ---------------------------------------------------------------- layouts and the cluster context


def layout_to_proto(layout: VariableLayout) -> cluster_pb2.VariableLayout:
    return cluster_pb2.VariableLayout(
        name=layout.name,
        shape=list(layout.shape),
        dtype=dtype_name(layout.dtype),
        shards=[
            cluster_pb2.ShardPlacement(index=s.index, server=s.server, row_start=s.row_start, num_rows=s.num_rows)
            for s in layout.shards
        ],
    )


def layout_from_proto(message: cluster_pb2.VariableLayout, num_servers: int) -> VariableLayout:
    """Raises InvalidRequestError unless the shards cover the variable's rows once, in order,
    each on one of the ``num_servers`` servers."""
    name = message.name
    if not name:
        raise InvalidRequestError("a variable layout without a name")
    shape = tuple(int(d) for d in message.shape)
    if any(d < 0 for d in shape):
        raise InvalidRequestError(f"negative dimension in shape {shape}", variable=name)
    shards = tuple(
        ShardPlacement(int(s.index), int(s.server), int(s.row_start), int(s.num_rows)) for s in message.shards
    )
    _check_placements(name, shape, shards, num_servers)
    return VariableLayout(name, shape, dtype_from_name(message.dtype), shards)


def _check_placements(name: str, shape: tuple[int, ...], shards: tuple[ShardPlacement, ...], num_servers: int) -> None:
    if not shards:
        raise InvalidRequestError("a variable layout without shards", variable=name)
    rows = shape[0] if shape else 1
    cursor = 0
    for position, shard in enumerate(shards):
        if shard.index != position:
            raise InvalidRequestError(f"shard {position} is numbered {shard.index}", variable=name)
        if not 0 <= shard.server < num_servers:
            raise InvalidRequestError(
                f"shard {shard.index} is placed on server {shard.server}, but the cluster has {num_servers} "
                "parameter servers",
                variable=name,
            )
        if shard.row_start != cursor or shard.num_rows < 0:
            raise InvalidRequestError(
                f"shard {shard.index} holds rows from {shard.row_start} (x{shard.num_rows}); the shards must "
                f"cover the rows in order from 0 (expected {cursor})",
                variable=name,
            )
        cursor += shard.num_rows if shape else 1
    if cursor != rows:
        raise InvalidRequestError(f"the shards hold {cursor} rows of {rows}", variable=name)


def cluster_to_proto(context: ClusterContext) -> cluster_pb2.ClusterContext:
    return cluster_pb2.ClusterContext(
        parameter_servers=list(context.parameter_servers),
        variables=[layout_to_proto(layout) for layout in context.layouts.values()],
        generation=context.generation,
        failover_seconds=context.failover_seconds,
    )


def cluster_from_proto(message: cluster_pb2.ClusterContext) -> ClusterContext:
    """Raises InvalidRequestError (or DtypeMismatchError) for a malformed context."""
    servers = tuple(message.parameter_servers)
    layouts: dict[str, VariableLayout] = {}
    for item in message.variables:
        layout = layout_from_proto(item, len(servers))
        if layout.name in layouts:
            raise InvalidRequestError("the cluster context lists the variable twice", variable=layout.name)
        layouts[layout.name] = layout
    if message.generation < 0:
        raise InvalidRequestError(f"the cluster context's generation must be >= 0, got {message.generation}")
    if not 0 <= message.failover_seconds <= 3600:  # NaN fails too
        raise InvalidRequestError(
            f"the cluster context's failover_seconds must be within [0, 3600], got {message.failover_seconds}"
        )
    return ClusterContext(servers, layouts, int(message.generation), float(message.failover_seconds))


_ROLES = {
    ReplicaRole.STANDALONE: ps_pb2.STANDALONE,
    ReplicaRole.PRIMARY: ps_pb2.PRIMARY,
    ReplicaRole.BACKUP: ps_pb2.BACKUP,
}
MAX_ADDRESS_CHARS = 1024


def replica_config_to_proto(config: ReplicaConfig) -> ps_pb2.ReplicaConfig:
    return ps_pb2.ReplicaConfig(
        epoch=config.epoch, role=_ROLES[config.role], backups=list(config.backups), joining=list(config.joining)
    )


def replica_config_from_proto(message: ps_pb2.ReplicaConfig) -> ReplicaConfig:
    """Raises InvalidRequestError for an unknown role or a malformed backup address."""
    roles = {wire: role for role, wire in _ROLES.items()}
    if message.role not in roles:
        raise InvalidRequestError(f"replica role {message.role} is unknown: set STANDALONE, PRIMARY or BACKUP")
    for address in [*message.backups, *message.joining]:
        if not address or len(address) > MAX_ADDRESS_CHARS or not address.isprintable() or " " in address:
            raise InvalidRequestError(f"backup address {address[:80]!r} is not a host:port")
    return ReplicaConfig(int(message.epoch), roles[message.role], tuple(message.backups), tuple(message.joining))
