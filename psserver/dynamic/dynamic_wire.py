"""Dynamic tables on the wire: their settings, statistics and shards to and from protobuf and
chunk-stream parts (a shard travels as a DynamicShardHeader and its tensors' raw bytes, as a
dense shard travels as a ShardSpec and its value and slots). The one translation; both sides
use it."""

from __future__ import annotations

import torch

from paramserve.psserver.dynamic.dynamic_types import (
    DynamicSaveMark,
    DynamicShardState,
    DynamicStats,
    DynamicTableConfig,
)
from paramserve.psserver.protocol.convert import optimizer_from_proto, optimizer_to_proto, ref_from_proto, ref_to_proto
from paramserve.psserver.protocol.errors import InvalidRequestError
from paramserve.psserver.protocol.streams import meta_nbytes, meta_of, tensor_from_bytes, tensor_payload
from paramserve.psserver.protocol.tensors import dtype_from_name, dtype_name
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2

__all__ = [
    "config_from_proto",
    "config_to_proto",
    "mark_from_proto",
    "mark_to_proto",
    "shard_from_part",
    "shard_part",
    "shard_payload_bytes",
    "stats_from_proto",
    "stats_to_proto",
]


def config_to_proto(config: DynamicTableConfig) -> tensor_pb2.DynamicTableConfig:
    message = tensor_pb2.DynamicTableConfig(
        dim=config.dim,
        dtype=dtype_name(config.dtype),
        initializer=tensor_pb2.Initializer(kind=config.initializer, a=config.init_a, b=config.init_b, seed=config.seed),
        admit_after=config.admit_after,
        default_row=config.default_row,
        ttl_steps=config.ttl_steps or 0,
        ttl_seconds=config.ttl_seconds or 0.0,
        max_rows=config.max_rows or 0,
        max_bytes=config.max_bytes or 0,
        admission_width=config.admission_width or 0,
        block_rows=config.block_rows or 0,
    )
    optimizer = optimizer_to_proto(config.optimizer)
    if optimizer is not None:
        message.optimizer.CopyFrom(optimizer)
    return message


def config_from_proto(message: tensor_pb2.DynamicTableConfig) -> DynamicTableConfig:
    """The settings a message carries, validated (InvalidRequestError, DtypeMismatchError)."""
    init = message.initializer
    config = DynamicTableConfig(
        dim=int(message.dim),
        dtype=dtype_from_name(message.dtype),
        optimizer=optimizer_from_proto(message.optimizer, message.HasField("optimizer")),
        initializer=init.kind or "normal",
        init_a=float(init.a),
        init_b=float(init.b),
        seed=int(init.seed),
        admit_after=int(message.admit_after) or 1,
        default_row=message.default_row or "zeros",
        ttl_steps=int(message.ttl_steps) or None,
        ttl_seconds=float(message.ttl_seconds) or None,
        max_rows=int(message.max_rows) or None,
        max_bytes=int(message.max_bytes) or None,
        admission_width=int(message.admission_width) or None,
        block_rows=int(message.block_rows) or None,
    )
    config.validate()
    return config


def stats_to_proto(stats: DynamicStats) -> ps_pb2.DynamicTableStats:
    return ps_pb2.DynamicTableStats(
        ref=ref_to_proto(stats.ref),
        num_shards=stats.num_shards,
        config=config_to_proto(stats.config),
        version=stats.version,
        live_rows=stats.live_rows,
        admissions=stats.admissions,
        evictions_ttl=stats.evictions_ttl,
        evictions_capacity=stats.evictions_capacity,
        bytes=stats.bytes,
    )


def stats_from_proto(message: ps_pb2.DynamicTableStats) -> DynamicStats:
    return DynamicStats(
        ref_from_proto(message.ref),
        int(message.num_shards),
        config_from_proto(message.config),
        int(message.version),
        int(message.live_rows),
        int(message.admissions),
        int(message.evictions_ttl),
        int(message.evictions_capacity),
        int(message.bytes),
    )


def mark_to_proto(mark: DynamicSaveMark) -> ps_pb2.DynamicSaveMark:
    return ps_pb2.DynamicSaveMark(ref=ref_to_proto(mark.ref), lineage=mark.lineage, through=mark.through)


def mark_from_proto(message: ps_pb2.DynamicSaveMark) -> DynamicSaveMark:
    return DynamicSaveMark(ref_from_proto(message.ref), message.lineage, int(message.through))


def _tensors(state: DynamicShardState) -> list[tuple[str, torch.Tensor]]:
    return [
        ("ids", state.ids),
        ("updated", state.updated),
        ("value", state.values),
        *((f"slot.{key}", value) for key, value in state.slots.items()),
        *((f"shared.{key}", value) for key, value in state.shared.items()),
        *((("deleted", state.deleted),) if state.delta else ()),
    ]


def shard_part(state: DynamicShardState) -> tuple[tensor_pb2.PartHeader, list[memoryview]]:
    """A stream part carrying one whole dynamic shard."""
    header = tensor_pb2.DynamicShardHeader(
        ref=ref_to_proto(state.ref),
        num_shards=state.num_shards,
        config=config_to_proto(state.config),
        version=state.version,
        applied_keys=list(state.applied_keys),
        delta=state.delta,
        lineage=state.lineage,
        through=state.through,
    )
    pieces = []
    for name, tensor in _tensors(state):
        tensor = tensor.contiguous()
        header.tensors.add(name=name, meta=meta_of(tensor))
        pieces.append(tensor_payload(tensor))
    return tensor_pb2.PartHeader(dynamic=header), pieces


def shard_payload_bytes(header: tensor_pb2.DynamicShardHeader) -> int:
    return sum(meta_nbytes(item.meta) for item in header.tensors)


def shard_from_part(header: tensor_pb2.DynamicShardHeader, payload: torch.Tensor) -> DynamicShardState:
    """The shard a received part holds (views into ``payload``); InvalidRequestError for a part
    whose tensors are not the ones a dynamic shard has."""
    ref = ref_from_proto(header.ref)
    tensors: dict[str, torch.Tensor] = {}
    offset = 0
    for item in header.tensors:
        tensors[item.name] = tensor_from_bytes(payload, item.meta, offset)
        offset += meta_nbytes(item.meta)
    if offset != payload.numel() or not {"ids", "updated", "value"} <= set(tensors):
        raise InvalidRequestError(
            "a dynamic shard part carries ids, updated and value tensors filling its payload", variable=ref.variable
        )
    if ("deleted" in tensors) != header.delta:
        raise InvalidRequestError("a dynamic shard part carries deleted ids if and only if it is a delta")
    return DynamicShardState(
        ref=ref,
        num_shards=int(header.num_shards),
        config=config_from_proto(header.config),
        ids=tensors["ids"],
        values=tensors["value"],
        updated=tensors["updated"],
        slots={name[5:]: t for name, t in tensors.items() if name.startswith("slot.")},
        shared={name[7:]: t for name, t in tensors.items() if name.startswith("shared.")},
        version=int(header.version),
        applied_keys=list(header.applied_keys),
        delta=bool(header.delta),
        deleted=tensors.get("deleted", torch.empty(0, dtype=torch.int64)),
        lineage=header.lineage,
        through=int(header.through),
    )
