"""The gRPC face of one parameter server: translates wire messages to ShardStore calls.

Handlers take and return raw bytes (see rpc.MetricsInterceptor); bulk data
moves through psserver.streams. Every error leaves through the boundary in rpc.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Iterator, Sequence

import grpc
import numpy as np
import torch

from paramserve.psserver import checkpoint, convert
from paramserve.psserver.errors import InvalidRequestError, VariableNotFoundError
from paramserve.psserver.serving import parse, stream_boundary, unary_boundary
from paramserve.psserver.store import Pulled, ShardPush, ShardStore
from paramserve.psserver.streams import (
    byte_buffer,
    decode_step_request,
    encode_parts,
    encode_step_reply,
    meta_of,
    push_part_bytes,
    read_parts,
    tensor_from_bytes,
    tensor_payload,
)
from paramserve.psserver.types import ShardRef
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2

SERVICE_NAME = "paramserve.wire.v1.ParameterServer"
IDEMPOTENCY_METADATA_KEY = "paramserve-idempotency-key"


class ParameterServerServicer:
    """Serves one ShardStore. ``chunk_bytes`` bounds each outgoing chunk's data."""

    def __init__(self, store: ShardStore, chunk_bytes: int, max_push_bytes: int):
        self._store = store
        self._chunk_bytes = chunk_bytes
        self._max_push_bytes = max_push_bytes

    # -- creation

    @unary_boundary
    def CreateShards(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        states = [
            convert.shard_state_from_part(header.shard, payload)
            for header, payload in read_parts(chunks, self._allocate_shard)
        ]
        infos = self._store.create_shards(states)
        return ps_pb2.CreateShardsResponse(shards=[convert.info_to_proto(i) for i in infos]).SerializeToString()

    @unary_boundary
    def ReplaceShards(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        states = [
            convert.shard_state_from_part(header.shard, payload)
            for header, payload in read_parts(chunks, self._allocate_shard)
        ]
        infos = self._store.replace_shards(states)
        return ps_pb2.CreateShardsResponse(shards=[convert.info_to_proto(i) for i in infos]).SerializeToString()

    def _allocate_shard(self, header: tensor_pb2.PartHeader) -> torch.Tensor:
        if header.WhichOneof("kind") != "shard":
            raise InvalidRequestError("CreateShards takes parts with ShardSpec headers")
        expected = convert.shard_payload_bytes(header.shard)
        if header.payload_bytes != expected:
            raise InvalidRequestError(
                f"shard part declares {header.payload_bytes} payload bytes, its spec needs {expected}",
                variable=header.shard.ref.variable,
            )
        return byte_buffer(expected)

    # -- reads

    @stream_boundary
    def Pull(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        request = parse(ps_pb2.PullRequest, raw)
        chunk_bytes = self._chunk_size(request.chunk_bytes)
        for index, item in enumerate(request.items):
            yield from self._pulled_chunks(index, item, chunk_bytes)

    def _pulled_chunks(self, index: int, item: ps_pb2.PullItem, chunk_bytes: int) -> list[bytes]:
        """One item's chunks. A whole shard is cut into chunks under its lock: the
        chunks are the consistent snapshot, with no clone in between."""
        ref = convert.ref_from_proto(item.ref)
        if item.sparse:
            pulled = self._read_rows(item)
            return _pulled_part_chunks(index, pulled.value, pulled.version, chunk_bytes)
        return self._store.read(ref, lambda value, version: _pulled_part_chunks(index, value, version, chunk_bytes))

    @stream_boundary
    def ExportShards(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        request = parse(ps_pb2.ExportShardsRequest, raw)
        refs = [convert.ref_from_proto(r) for r in request.refs] or None
        states = self._store.export(refs)
        yield from encode_parts(
            (convert.shard_part(state) for state in states), self._chunk_size(request.chunk_bytes)
        )

    @unary_boundary
    def ListShards(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        parse(ps_pb2.ListShardsRequest, raw)
        infos = self._store.list_shards()
        return ps_pb2.ListShardsResponse(shards=[convert.info_to_proto(i) for i in infos]).SerializeToString()

    # -- updates

    @unary_boundary
    def Push(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        key = dict(context.invocation_metadata()).get(IDEMPOTENCY_METADATA_KEY, "")
        return ps_pb2.PushResponse(results=self._push(chunks, str(key))).SerializeToString()

    @unary_boundary
    def Step(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        plan, payload = decode_step_request(raw)
        reads = [(convert.ref_from_proto(i.ref), convert.rows_from_bytes(i.row_indices) if i.sparse else None) for i in plan.pull]
        self._store.check_reads(reads)  # a bad read fails the request before the push changes anything
        pushed = self._apply(self._packed_pushes(plan.push, payload), plan.idempotency_key) if plan.push else []
        if not plan.push and len(payload):
            raise InvalidRequestError(f"the payload holds {len(payload)} bytes but the plan pushes nothing")
        dense = [ref for ref, rows in reads if rows is None]
        rows = {i: self._store.pull_rows(ref, r) for i, (ref, r) in enumerate(reads) if r is not None}

        def reply(live: dict[ShardRef, Pulled]) -> bytes:  # under the dense shards' locks: one consistent read
            outcome = ps_pb2.StepOutcome(pushed=pushed)
            values = []
            for index, (ref, _) in enumerate(reads):
                pulled = rows[index] if index in rows else live[ref]
                outcome.pulled.append(tensor_pb2.PulledPart(item=index, meta=meta_of(pulled.value), version=pulled.version))
                values.append(tensor_payload(pulled.value))
            return encode_step_reply(outcome, values)

        return self._store.read_many(dense, reply)

    def _packed_pushes(self, parts: Sequence[tensor_pb2.PushPart], payload: memoryview) -> list[ShardPush]:
        """The pushes of a Step: each part's bytes are its slice of the one payload, copied once
        into one buffer (so tensors are aligned and outlive the request)."""
        sizes = [self._checked_push_bytes(part) for part in parts]
        if sum(sizes) != len(payload):
            raise InvalidRequestError(
                f"the payload holds {len(payload)} bytes but the plan's push parts describe {sum(sizes)}"
            )
        buffer = byte_buffer(len(payload))
        buffer.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
        pushes, offset = [], 0
        for part, size in zip(parts, sizes):
            pushes.append(self._push_from_part(part, buffer[offset : offset + size]))
            offset += size
        return pushes

    def _push(self, chunks: Iterable[bytes | memoryview], key: str) -> list[ps_pb2.PushResult]:
        pushes = [self._push_from_part(h.push, payload) for h, payload in read_parts(chunks, self._allocate_push)]
        return self._apply(pushes, key)

    def _apply(self, pushes: list[ShardPush], key: str) -> list[ps_pb2.PushResult]:
        if not key:
            raise InvalidRequestError(
                "push without an idempotency key: send it in the StepPlan, or in the "
                f"{IDEMPOTENCY_METADATA_KEY!r} metadata of a Push stream"
            )
        return [
            ps_pb2.PushResult(ref=convert.ref_to_proto(o.ref), applied=o.applied, version=o.version, staleness=o.staleness)
            for o in self._store.push(pushes, key)
        ]

    def _read_rows(self, item: ps_pb2.PullItem) -> Pulled:
        return self._store.pull_rows(convert.ref_from_proto(item.ref), convert.rows_from_bytes(item.row_indices))

    def _allocate_push(self, header: tensor_pb2.PartHeader) -> torch.Tensor:
        if header.WhichOneof("kind") != "push":
            raise InvalidRequestError("Push takes parts with PushPart headers")
        expected = self._checked_push_bytes(header.push)
        if header.payload_bytes != expected:
            raise InvalidRequestError(
                f"push part declares {header.payload_bytes} payload bytes, its header describes {expected}",
                variable=header.push.ref.variable,
            )
        return byte_buffer(expected)

    def _checked_push_bytes(self, push: tensor_pb2.PushPart) -> int:
        """The payload bytes ``push`` describes; raises for a malformed or oversized part."""
        if push.num_indices < 0 or (push.num_indices and not push.sparse):
            raise InvalidRequestError("num_indices must be 0 for a dense push and >= 0 for a sparse one")
        expected = push_part_bytes(push)
        if expected > self._max_push_bytes:
            raise InvalidRequestError(
                f"push part of {expected} bytes exceeds this server's limit of {self._max_push_bytes}; "
                "split the gradient or raise --max-push-bytes",
                variable=push.ref.variable,
            )
        return expected

    def _push_from_part(self, push: tensor_pb2.PushPart, payload: torch.Tensor) -> ShardPush:
        ref = convert.ref_from_proto(push.ref)
        rows = None
        offset = 0
        if push.sparse:
            rows = tensor_from_bytes(payload, tensor_pb2.TensorMeta(dtype="int64", shape=[push.num_indices]))
            offset = push.num_indices * 8
        values = tensor_from_bytes(payload, push.values, offset)
        return ShardPush(ref=ref, values=values, rows=rows, base_version=int(push.base_version))

    @unary_boundary
    def SetHyperparameters(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        request = parse(ps_pb2.SetHyperparametersRequest, raw)
        try:
            values = json.loads(request.values_json)
        except json.JSONDecodeError as err:
            raise InvalidRequestError(f"values_json is not JSON: {err}") from None
        if not isinstance(values, dict):
            raise InvalidRequestError('values_json must be a JSON object such as {"lr": 0.01}')
        updated = self._store.set_hyperparameters(request.variable or None, values)
        return ps_pb2.SetHyperparametersResponse(shards_updated=updated).SerializeToString()

    @unary_boundary
    def DeleteVariable(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        request = parse(ps_pb2.DeleteVariableRequest, raw)
        deleted = self._store.delete_variable(request.variable)
        if not deleted:
            raise VariableNotFoundError("no shard of this variable on this server", variable=request.variable)
        return ps_pb2.DeleteVariableResponse(shards_deleted=deleted).SerializeToString()

    # -- checkpoints on the server's filesystem

    @unary_boundary
    def Save(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        request = parse(ps_pb2.SaveRequest, raw)
        if not request.directory:
            raise InvalidRequestError("Save needs a directory")
        states = self._store.export(None)
        path = checkpoint.save_checkpoint(pathlib.Path(request.directory), states, keep=request.keep)
        return ps_pb2.SaveResponse(path=str(path), shards=len(states)).SerializeToString()

    @unary_boundary
    def Restore(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        request = parse(ps_pb2.RestoreRequest, raw)
        path = checkpoint.resolve(pathlib.Path(request.path))
        states = [
            checkpoint.load_rows(
                path, t.ref.variable, int(t.row_start), int(t.num_rows), convert.ref_from_proto(t.ref)
            )
            for t in request.targets
        ]
        infos = self._store.replace_shards(states)
        return ps_pb2.RestoreResponse(shards=[convert.info_to_proto(i) for i in infos]).SerializeToString()

    def _chunk_size(self, requested: int) -> int:
        if requested < 0:
            raise InvalidRequestError(f"chunk_bytes must not be negative, got {requested}")
        return min(requested, self._chunk_bytes) if requested else self._chunk_bytes


def _pulled_part_chunks(index: int, value: torch.Tensor, version: int, chunk_bytes: int) -> list[bytes]:
    part = tensor_pb2.PulledPart(item=index, meta=meta_of(value), version=version)
    return list(encode_parts([(tensor_pb2.PartHeader(pulled=part), [tensor_payload(value)])], chunk_bytes))


def generic_handler(servicer: ParameterServerServicer) -> grpc.GenericRpcHandler:
    """Registers the servicer with raw-bytes (de)serialisers: it parses messages itself."""
    handlers = {
        "CreateShards": grpc.stream_unary_rpc_method_handler(servicer.CreateShards),
        "ReplaceShards": grpc.stream_unary_rpc_method_handler(servicer.ReplaceShards),
        "Pull": grpc.unary_stream_rpc_method_handler(servicer.Pull),
        "Push": grpc.stream_unary_rpc_method_handler(servicer.Push),
        "Step": grpc.unary_unary_rpc_method_handler(servicer.Step),
        "ExportShards": grpc.unary_stream_rpc_method_handler(servicer.ExportShards),
        "DeleteVariable": grpc.unary_unary_rpc_method_handler(servicer.DeleteVariable),
        "ListShards": grpc.unary_unary_rpc_method_handler(servicer.ListShards),
        "Save": grpc.unary_unary_rpc_method_handler(servicer.Save),
        "Restore": grpc.unary_unary_rpc_method_handler(servicer.Restore),
        "SetHyperparameters": grpc.unary_unary_rpc_method_handler(servicer.SetHyperparameters),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
