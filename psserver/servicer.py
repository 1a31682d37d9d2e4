"""The gRPC face of one parameter server: translates wire messages to ShardStore and StepEngine calls.

Handlers take and return raw bytes (see serving.MetricsInterceptor); bulk data
moves through psserver.streams. What a step means (Step, Push, and Pull's
checks) is psserver/steps/engine.py's, shared with the data plane. Every error leaves
through the boundary in psserver.error_boundary.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import torch

from paramserve.psserver.checkpoint import shard_files as checkpoint
from paramserve.psserver.dynamic import dynamic_wire
from paramserve.psserver.dynamic.dynamic_types import DynamicStats, DynamicTableConfig, block_bytes_within
from paramserve.psserver.protocol import convert
from paramserve.psserver.protocol.errors import InvalidRequestError, MessageTooLargeError, VariableNotFoundError
from paramserve.psserver.protocol.metadata import IDEMPOTENCY_METADATA_KEY, REPLICA_EPOCH_METADATA_KEY, SERVICE_NAME
from paramserve.psserver.protocol.streams import (
    byte_buffer,
    encode_parts,
    meta_nbytes,
    meta_of,
    read_parts,
    tensor_payload,
)
from paramserve.psserver.protocol.types import ShardInfo, ShardState
from paramserve.psserver.replication.replica import Replica
from paramserve.psserver.runtime.error_boundary import parse, stream_boundary, unary_boundary
from paramserve.psserver.runtime.memory import resident_bytes
from paramserve.psserver.runtime.security import checkpoint_root, confined_path
from paramserve.psserver.steps.engine import (
    DEFAULT_MAX_PULL_BYTES,
    DEFAULT_MAX_PUSH_BYTES,
    StepEngine,
    StepLimits,
    reads_of,
)
from paramserve.psserver.store.shard_store import ShardStore
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2

MAX_JSON_CHARS = 64 << 10
"""The longest ``values_json`` SetHyperparameters takes."""


@dataclass(frozen=True)
class ServicerLimits:
    """What one request may ask of a parameter server; every limit is checked before anything
    is allocated for the request. Defaults are the ``paramserve ps`` flags' defaults."""

    max_push_bytes: int = DEFAULT_MAX_PUSH_BYTES
    max_pull_bytes: int = DEFAULT_MAX_PULL_BYTES
    max_shard_bytes: int | None = None
    """Largest shard (value and optimizer slots) CreateShards may declare; None: half this
    machine's memory (a shard larger than the memory would fail as it is filled)."""
    max_reply_bytes: int = 64 << 20
    """Largest unary reply (a Step's reads): the server's send limit."""
    checkpoint_root: pathlib.Path | None = None
    """Save and Restore stay under it (psserver.security.confined_path)."""
    authenticated: bool = True
    """Whether callers must present the token: a server without one and without a
    checkpoint root refuses Save and Restore."""

    def shard_limit(self) -> int:
        return self.max_shard_bytes if self.max_shard_bytes is not None else half_the_memory()

    def step_limits(self) -> StepLimits:
        """The limits that bound one step (psserver/steps/engine.py)."""
        return StepLimits(self.max_push_bytes, self.max_pull_bytes, self.max_reply_bytes)


def half_the_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
        return 1 << 34


class DataPlaneListing:
    """Where clients find this server's step data plane: what GetDataPlane answers. Given both
    to the servicer and to whoever starts the data plane (psserver/server.py), which is built
    after the gRPC service it reports its health and metrics to, and so after the servicer:
    it ``publish``es its address once it is bound. Until then, and on a server without a data
    plane, it lists none (port 0), and clients step over gRPC."""

    def __init__(self) -> None:
        self._info = ps_pb2.DataPlaneInfo()

    def publish(self, info: ps_pb2.DataPlaneInfo) -> None:
        self._info = info

    @property
    def info(self) -> ps_pb2.DataPlaneInfo:
        return self._info


class ParameterServerServicer:
    """Serves one ShardStore, its steps through ``steps`` (the engine the data plane shares).
    ``chunk_bytes`` bounds each outgoing chunk's data; ``limits`` what one request may ask;
    ``replica`` is this server's place in its shard group; ``data_plane`` lists the step data
    plane's address for GetDataPlane."""

    def __init__(
        self,
        store: ShardStore,
        steps: StepEngine,
        chunk_bytes: int,
        limits: ServicerLimits,
        replica: Replica,
        data_plane: DataPlaneListing,
    ):
        self._store = store
        self._replica = replica
        self._steps = steps
        self._chunk_bytes = chunk_bytes
        self._limits = limits
        self._shard_limit = limits.shard_limit()
        self._root = checkpoint_root(limits.checkpoint_root) if limits.checkpoint_root is not None else None
        self._data_plane = data_plane

    # -- creation

    @unary_boundary
    def CreateShards(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        self._admit(context)
        return _shards_response(self._store.create_shards(self._received_shards(chunks), owned=True))

    @unary_boundary
    def ReplaceShards(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        self._admit(context)
        return _shards_response(self._store.replace_shards(self._received_shards(chunks), owned=True))

    def _received_shards(self, chunks: Iterator[bytes]) -> list[ShardState]:
        """The shards of a Create or Replace stream: views into a buffer allocated for each part
        (or values filled by an initializer), which the store may keep without copying."""
        return [
            convert.shard_state_from_part(header.shard, payload)
            for header, payload in read_parts(chunks, self._allocate_shard)
        ]

    def _allocate_shard(self, header: tensor_pb2.PartHeader) -> torch.Tensor:
        if header.WhichOneof("kind") != "shard":
            raise InvalidRequestError("CreateShards takes parts with ShardSpec headers")
        spec = header.shard
        size = meta_nbytes(spec.shard_meta) + sum(meta_nbytes(slot.meta) for slot in spec.slots)
        if size > self._shard_limit:
            raise MessageTooLargeError(
                f"shard {spec.ref.shard} would hold {size} bytes (value and slots); this server's limit is "
                f"{self._shard_limit} (--max-shard-bytes): use more shards (a partitioner) or raise the limit",
                variable=spec.ref.variable,
            )
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
        self._admit(context)
        request = parse(ps_pb2.PullRequest, raw)
        chunk_bytes = self._chunk_size(request.chunk_bytes)
        reads = reads_of(request.items)
        self._steps.check_pull(reads)
        for index, (item, (_, rows)) in enumerate(zip(request.items, reads)):
            yield from self._pulled_chunks(index, item, rows, chunk_bytes)

    def _pulled_chunks(
        self, index: int, item: ps_pb2.PullItem, rows: torch.Tensor | None, chunk_bytes: int
    ) -> Iterable[bytes]:
        """One item's chunks. Rows are gathered into a copy, cut into chunks as the stream
        sends them (the reply is held once, not twice). A whole shard is cut into chunks under
        its lock: the chunks are the consistent snapshot, with no clone in between."""
        ref = convert.ref_from_proto(item.ref)
        if rows is not None:
            pulled = self._store.pull_rows(ref, rows)
            return _pulled_part_chunks(index, pulled.value, pulled.version, chunk_bytes)
        return self._store.read(
            ref, lambda value, version: list(_pulled_part_chunks(index, value, version, chunk_bytes))
        )

    @stream_boundary
    def ExportShards(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        request = parse(ps_pb2.ExportShardsRequest, raw)
        refs = [convert.ref_from_proto(r) for r in request.refs] or None
        states = self._store.export(refs)
        yield from encode_parts((convert.shard_part(state) for state in states), self._chunk_size(request.chunk_bytes))

    @unary_boundary
    def ListShards(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        request = parse(ps_pb2.ListShardsRequest, raw)
        if request.incarnation_only:  # the liveness probe: as cheap as it gets
            return ps_pb2.ListShardsResponse(incarnation=self._store.incarnation).SerializeToString()
        return ps_pb2.ListShardsResponse(
            shards=[convert.info_to_proto(i) for i in self._store.list_shards()],
            incarnation=self._store.incarnation,
            resident_bytes=resident_bytes(),
        ).SerializeToString()

    # -- updates

    @unary_boundary
    def Push(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        self._admit(context)
        key = dict(context.invocation_metadata()).get(IDEMPOTENCY_METADATA_KEY, "")
        results = self._steps.push(read_parts(chunks, self._steps.allocate_push), str(key))
        return ps_pb2.PushResponse(results=results).SerializeToString()

    @unary_boundary
    def Step(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        return self._steps.run_request(raw)  # admitted by its plan's replica_epoch

    @unary_boundary
    def GetDataPlane(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        parse(ps_pb2.GetDataPlaneRequest, raw)
        return self._data_plane.info.SerializeToString()

    @unary_boundary
    def SetHyperparameters(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        self._admit(context)
        request = parse(ps_pb2.SetHyperparametersRequest, raw)
        values = _hyperparameters(request.values_json)
        names = [name for name in (request.variable, *request.variables) if name]
        updated = self._store.set_hyperparameters_of(names or [None], values)  # none named: every variable
        return ps_pb2.SetHyperparametersResponse(shards_updated=updated).SerializeToString()

    @unary_boundary
    def DeleteVariable(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        self._admit(context)
        request = parse(ps_pb2.DeleteVariableRequest, raw)
        deleted = self._store.delete_variable(request.variable)
        if not deleted:
            raise VariableNotFoundError("no shard of this variable on this server", variable=request.variable)
        return ps_pb2.DeleteVariableResponse(shards_deleted=deleted).SerializeToString()

    # -- dynamic tables (lookups and pushes travel as steps)

    @unary_boundary
    def CreateDynamicTable(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        self._admit(context)
        request = parse(ps_pb2.CreateDynamicTableRequest, raw)
        ref = convert.ref_from_proto(request.ref)
        config = dynamic_wire.config_from_proto(request.config)
        self._check_allocation(ref.variable, config)
        self._store.create_dynamic(ref, int(request.num_shards), config)
        return _dynamic_response([self._store.dynamic.get(ref).stats()])

    @stream_boundary
    def ExportDynamicTables(self, raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        request = parse(ps_pb2.ExportDynamicTablesRequest, raw)
        refs = [convert.ref_from_proto(r) for r in request.refs] or None
        since = {mark.ref: mark for mark in map(dynamic_wire.mark_from_proto, request.since)}
        states = self._store.dynamic.export(refs, since, bool(request.incremental))
        parts = (dynamic_wire.shard_part(state) for state in states)
        yield from encode_parts(parts, self._chunk_size(request.chunk_bytes))

    @unary_boundary
    def ReplaceDynamicTables(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        self._admit(context)
        states = [
            dynamic_wire.shard_from_part(header.dynamic, payload)
            for header, payload in read_parts(chunks, self._allocate_dynamic)
        ]
        for state in states:
            self._check_allocation(state.ref.variable, state.config)
        return _dynamic_response(self._store.dynamic.replace(states))

    def _check_allocation(self, variable: str, config: DynamicTableConfig) -> None:
        largest = config.largest_allocation(block_bytes_within(self._shard_limit))
        if largest > self._shard_limit:
            raise MessageTooLargeError(
                f"a shard of this dynamic table would allocate about {largest} bytes at once (an arena block: "
                "dim x block_rows; the admission sketch: admission_width, else 4 x max_rows; or the id index of "
                f"its most rows: max_rows, max_bytes); this server's limit is {self._shard_limit} "
                "(--max-shard-bytes): lower those settings, use more servers, or raise the limit",
                variable=variable,
            )

    def _allocate_dynamic(self, header: tensor_pb2.PartHeader) -> torch.Tensor:
        if header.WhichOneof("kind") != "dynamic":
            raise InvalidRequestError("ReplaceDynamicTables takes parts with DynamicShardHeader headers")
        size = dynamic_wire.shard_payload_bytes(header.dynamic)
        if size > self._shard_limit or header.payload_bytes != size:
            raise MessageTooLargeError(
                f"a dynamic shard part declares {header.payload_bytes} bytes, its tensors {size}; "
                f"this server's limit is {self._shard_limit} (--max-shard-bytes)",
                variable=header.dynamic.ref.variable,
            )
        return byte_buffer(size)

    @unary_boundary
    def ListDynamicTables(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        parse(ps_pb2.ListDynamicTablesRequest, raw)
        return _dynamic_response(self._store.dynamic.stats())

    @unary_boundary
    def MarkDynamicTablesSaved(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        request = parse(ps_pb2.MarkDynamicTablesSavedRequest, raw)
        marks = [dynamic_wire.mark_from_proto(mark) for mark in request.marks]
        return _dynamic_response(self._store.dynamic.mark_saved(marks))

    # -- checkpoints on the server's filesystem

    @unary_boundary
    def Save(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        self._admit(context)
        request = parse(ps_pb2.SaveRequest, raw)
        if not request.directory:
            raise InvalidRequestError("Save needs a directory")
        tables = sorted(self._store.dynamic.names())
        if tables:  # a checkpoint without them would restore as whole and lose every row
            raise InvalidRequestError(
                f"Save writes dense and row shards only, and this server holds dynamic tables {tables[:5]}: "
                "save through the coordinator's CheckpointManager, which checkpoints them (whole or as deltas)"
            )
        directory = confined_path(self._root, request.directory, authenticated=self._limits.authenticated)
        states = self._store.export(None)
        path = checkpoint.save_checkpoint(directory, states, keep=request.keep)
        return ps_pb2.SaveResponse(path=str(path), shards=len(states)).SerializeToString()

    @unary_boundary
    def Restore(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        self._admit(context)
        request = parse(ps_pb2.RestoreRequest, raw)
        path = checkpoint.resolve(confined_path(self._root, request.path, authenticated=self._limits.authenticated))
        checkpoint.sweep_leftovers(path.parent)  # what interrupted saves left beside it
        states = [
            checkpoint.load_rows(path, t.ref.variable, int(t.row_start), int(t.num_rows), convert.ref_from_proto(t.ref))
            for t in request.targets
        ]
        infos = self._store.replace_shards(states)
        return ps_pb2.RestoreResponse(shards=[convert.info_to_proto(i) for i in infos]).SerializeToString()

    # -- replication (psserver/replication/replica.py)

    @unary_boundary
    def ConfigureReplica(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        request = parse(ps_pb2.ConfigureReplicaRequest, raw)
        if not request.query:
            self._replica.configure(convert.replica_config_from_proto(request.config))
        config, refusing = self._replica.state()
        return ps_pb2.ConfigureReplicaResponse(
            config=convert.replica_config_to_proto(config), incarnation=self._store.incarnation, refusing=refusing
        ).SerializeToString()

    @unary_boundary
    def CopyShards(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        request = parse(ps_pb2.CopyShardsRequest, raw)
        count, size = self._replica.copy_to(request.target, self._store.shards(), self._store.current)
        return ps_pb2.CopyShardsResponse(shards=count, bytes=size).SerializeToString()

    def _admit(self, context: grpc.ServicerContext) -> None:
        """A client's call is served by a primary (or a server not replicated); a write its
        primary forwarded, by a backup of the primary's epoch."""
        epoch = _replica_epoch(context)
        if epoch is None:
            self._replica.admit_client()
        else:
            self._replica.admit_forwarded(epoch)

    def _chunk_size(self, requested: int) -> int:
        if requested < 0:
            raise InvalidRequestError(f"chunk_bytes must not be negative, got {requested}")
        return min(requested, self._chunk_bytes) if requested else self._chunk_bytes


def _hyperparameters(text: str) -> dict[str, float | int | bool | list[float | int]]:
    """The ``values_json`` of SetHyperparameters: a flat JSON object whose values are numbers,
    booleans or lists of numbers (e.g. ``betas``); raises InvalidRequestError naming what is not."""
    if len(text) > MAX_JSON_CHARS:
        raise InvalidRequestError(f"values_json has {len(text)} characters; the limit is {MAX_JSON_CHARS}")
    try:
        values = json.loads(text)
    except RecursionError:
        raise InvalidRequestError('values_json nests too deeply; send a flat object such as {"lr": 0.01}') from None
    except ValueError as err:  # JSONDecodeError, and integers beyond Python's digit limit
        raise InvalidRequestError(f"values_json is not a JSON object of numbers: {err}") from None
    if not isinstance(values, dict):
        raise InvalidRequestError('values_json must be a JSON object such as {"lr": 0.01}')
    for name, value in values.items():
        items = value if isinstance(value, list) else [value]
        if not all(_is_number(item) for item in items) or (isinstance(value, list) and len(value) > 16):
            raise InvalidRequestError(
                f"hyperparameter {name!r} must be a number, a boolean or a short list of numbers, got {_preview(value)}"
            )
    return values


def _replica_epoch(context: grpc.ServicerContext) -> int | None:
    """The epoch a forwarded write carries (None: a client's call)."""
    for key, value in context.invocation_metadata():
        if key == REPLICA_EPOCH_METADATA_KEY:
            text = value if isinstance(value, str) else value.decode("ascii", "replace")
            if not text.isdigit() or len(text) > 18:
                raise InvalidRequestError(f"{REPLICA_EPOCH_METADATA_KEY} must be a non-negative integer")
            return int(text)
    return None


def _is_number(value: object) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, int):
        return abs(value) < 1 << 63
    return isinstance(value, float) and value == value and abs(value) != float("inf")


def _preview(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _pulled_part_chunks(index: int, value: torch.Tensor, version: int, chunk_bytes: int) -> Iterator[bytes]:
    part = tensor_pb2.PulledPart(item=index, meta=meta_of(value), version=version)
    return encode_parts([(tensor_pb2.PartHeader(pulled=part), [tensor_payload(value)])], chunk_bytes)


def _shards_response(infos: Sequence[ShardInfo]) -> bytes:
    return ps_pb2.CreateShardsResponse(shards=[convert.info_to_proto(i) for i in infos]).SerializeToString()


def _dynamic_response(stats: Sequence[DynamicStats]) -> bytes:
    return ps_pb2.DynamicTablesResponse(tables=[dynamic_wire.stats_to_proto(s) for s in stats]).SerializeToString()


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
        "GetDataPlane": grpc.unary_unary_rpc_method_handler(servicer.GetDataPlane),
        "CreateDynamicTable": grpc.unary_unary_rpc_method_handler(servicer.CreateDynamicTable),
        "ExportDynamicTables": grpc.unary_stream_rpc_method_handler(servicer.ExportDynamicTables),
        "ReplaceDynamicTables": grpc.stream_unary_rpc_method_handler(servicer.ReplaceDynamicTables),
        "ListDynamicTables": grpc.unary_unary_rpc_method_handler(servicer.ListDynamicTables),
        "MarkDynamicTablesSaved": grpc.unary_unary_rpc_method_handler(servicer.MarkDynamicTablesSaved),
        "ConfigureReplica": grpc.unary_unary_rpc_method_handler(servicer.ConfigureReplica),
        "CopyShards": grpc.unary_unary_rpc_method_handler(servicer.CopyShards),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
