"""The gRPC face of one parameter server: translates wire messages to ShardStore calls.

Handlers take and return raw bytes (see rpc.MetricsInterceptor); bulk data
moves through psserver.streams. Every error leaves through the boundary in rpc.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np
import torch
from google.protobuf.message import DecodeError

from paramserve.psserver import checkpoint, convert
from paramserve.psserver.errors import InvalidRequestError, MessageTooLargeError, VariableNotFoundError
from paramserve.psserver.programs import PushSlot, StepProgram, StepPrograms, base_versions, check_program_size
from paramserve.psserver.security import checkpoint_root, confined_path
from paramserve.psserver.serving import parse, stream_boundary, unary_boundary
from paramserve.psserver.store import Pulled, ShardPush, ShardStore
from paramserve.psserver.streams import (
    byte_buffer,
    decode_step_request,
    encode_parts,
    encode_step_reply,
    meta_nbytes,
    meta_of,
    push_part_bytes,
    read_parts,
    tensor_from_bytes,
    tensor_payload,
)
from paramserve.psserver.tensors import dtype_from_name, writable_byte_view
from paramserve.psserver.types import ShardInfo, ShardRef, ShardState
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2

_Reply = TypeVar("_Reply")

SERVICE_NAME = "paramserve.wire.v1.ParameterServer"
IDEMPOTENCY_METADATA_KEY = "paramserve-idempotency-key"


DEFAULT_MAX_PUSH_BYTES = 1 << 30
"""``--max-push-bytes``: the largest gradient part one push may declare (1 GiB)."""
DEFAULT_MAX_PULL_BYTES = 1 << 30
"""``--max-pull-bytes``: the most tensor bytes one read request may ask for (1 GiB)."""
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


def half_the_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
        return 1 << 34


class ParameterServerServicer:
    """Serves one ShardStore. ``chunk_bytes`` bounds each outgoing chunk's data; ``limits``
    what one request may ask (an int: ``max_push_bytes``, the other limits at their defaults)."""

    def __init__(self, store: ShardStore, chunk_bytes: int, limits: ServicerLimits | int | None = None):
        self._store = store
        self._chunk_bytes = chunk_bytes
        if limits is None or isinstance(limits, int):
            limits = ServicerLimits() if limits is None else ServicerLimits(max_push_bytes=limits)
        self._limits = limits
        self._max_push_bytes = limits.max_push_bytes
        self._shard_limit = limits.shard_limit()
        self._root = checkpoint_root(limits.checkpoint_root) if limits.checkpoint_root is not None else None
        self.data_plane = ps_pb2.DataPlaneInfo()
        """What GetDataPlane answers: set by whoever starts the data plane (port 0: none)."""

    # -- creation

    @unary_boundary
    def CreateShards(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        return _shards_response(self._store.create_shards(self._received_shards(chunks)))

    @unary_boundary
    def ReplaceShards(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        return _shards_response(self._store.replace_shards(self._received_shards(chunks)))

    def _received_shards(self, chunks: Iterator[bytes]) -> list[ShardState]:
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
        request = parse(ps_pb2.PullRequest, raw)
        chunk_bytes = self._chunk_size(request.chunk_bytes)
        reads = [(convert.ref_from_proto(item.ref), _wire_rows(item.row_indices) if item.sparse else None)
                 for item in request.items]
        self._check_read_bytes(reads, self._limits.max_pull_bytes, "--max-pull-bytes")
        for index, (item, (_, rows)) in enumerate(zip(request.items, reads)):
            yield from self._pulled_chunks(index, item, rows, chunk_bytes)

    def _check_read_bytes(self, reads: Sequence[tuple[ShardRef, torch.Tensor | None]], limit: int, flag: str) -> None:
        """Refuses, before reading anything, a request whose reply would pass ``limit`` bytes."""
        self._store.check_reads(reads)
        total = sum(self._store.rows_nbytes(ref, None if rows is None else rows.numel()) for ref, rows in reads)
        if total > limit:
            raise MessageTooLargeError(
                f"the reads of this request add up to {total} bytes; this server sends at most {limit} per "
                f"request ({flag}): read fewer shards or rows per request"
            )

    def _pulled_chunks(self, index: int, item: ps_pb2.PullItem, rows: torch.Tensor | None,
                       chunk_bytes: int) -> list[bytes]:
        """One item's chunks. A whole shard is cut into chunks under its lock: the
        chunks are the consistent snapshot, with no clone in between."""
        ref = convert.ref_from_proto(item.ref)
        if rows is not None:
            pulled = self._store.pull_rows(ref, rows)
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
        request = parse(ps_pb2.ListShardsRequest, raw)
        infos = [] if request.incarnation_only else self._store.list_shards()
        return ps_pb2.ListShardsResponse(
            shards=[convert.info_to_proto(i) for i in infos], incarnation=self._store.incarnation
        ).SerializeToString()

    # -- updates

    @unary_boundary
    def Push(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        key = dict(context.invocation_metadata()).get(IDEMPOTENCY_METADATA_KEY, "")
        return ps_pb2.PushResponse(results=self._push(chunks, str(key))).SerializeToString()

    @unary_boundary
    def Step(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        return self.step_exchange(raw)

    def step_exchange(self, raw: bytes | memoryview) -> bytes:
        """A Step RPC's exchange: a packed StepRequest's bytes -> the packed StepReply's."""
        plan, payload = decode_step_request(raw)
        pushes = self._packed_pushes(plan.push, payload) if plan.push else []
        return self._step(plan, pushes, len(payload), encode_step_reply)

    def step_frames(self, plan_bytes: memoryview, payload: torch.Tensor, reply_buffer: Callable[[int], torch.Tensor],
                    programs: StepPrograms | None = None) -> tuple[bytes, memoryview]:
        """A data-plane step (psserver/dataplane.py): the StepPlan's bytes and the pushed bytes
        (a uint8 tensor the pushes read in place) -> the StepOutcome's bytes and the pulled
        bytes, copied under the shards' locks into ``reply_buffer(n)``. ``programs``: the
        connection's step programs (psserver/programs.py)."""
        try:
            plan = ps_pb2.StepPlan.FromString(bytes(plan_bytes))
        except DecodeError as err:
            raise InvalidRequestError(f"malformed StepPlan ({len(plan_bytes)} bytes): {err}") from None
        if plan.define_program or plan.run_program:
            if programs is None:
                raise InvalidRequestError("step programs run on the data plane only: send the StepPlan whole")
            return self._program_step(plan, payload, reply_buffer, programs)
        pushes = self._pushes_in(plan.push, payload) if plan.push else []

        def reply(outcome: ps_pb2.StepOutcome, values: list[memoryview]) -> tuple[bytes, memoryview]:
            buffer = reply_buffer(sum(len(v) for v in values))
            target = buffer.numpy()
            offset = 0
            for value in values:
                target[offset : offset + len(value)] = np.frombuffer(value, dtype=np.uint8)
                offset += len(value)
            return outcome.SerializeToString(), writable_byte_view(buffer)

        return self._step(plan, pushes, payload.numel(), reply)

    def _step(self, plan: ps_pb2.StepPlan, pushes: list[ShardPush], payload_bytes: int,
              reply: Callable[[ps_pb2.StepOutcome, list[memoryview]], _Reply]) -> _Reply:
        """Validates the reads, applies ``pushes`` (exactly once per key), then builds the reply
        with ``reply(outcome, values)`` under the read shards' locks: one consistent read."""
        if plan.define_program or plan.run_program or plan.base_versions:
            raise InvalidRequestError(
                "step programs (define_program, run_program, base_versions) run on the data plane only: "
                "send the StepPlan whole, each part's base version in its PushPart"
            )
        reads = [(convert.ref_from_proto(i.ref), _wire_rows(i.row_indices) if i.sparse else None) for i in plan.pull]
        self._check_step_reads(reads)  # a bad or oversized read fails the step before the push changes anything
        if not plan.push and payload_bytes:
            raise InvalidRequestError(f"the payload holds {payload_bytes} bytes but the plan pushes nothing")
        pushed = self._apply(pushes, plan.idempotency_key) if plan.push else []
        dense = [ref for ref, rows in reads if rows is None]
        rows = {i: self._store.pull_rows(ref, r) for i, (ref, r) in enumerate(reads) if r is not None}

        def locked(live: dict[ShardRef, Pulled]) -> _Reply:
            outcome = ps_pb2.StepOutcome(pushed=pushed)
            values = []
            for index, (ref, _) in enumerate(reads):
                pulled = rows[index] if index in rows else live[ref]
                outcome.pulled.append(tensor_pb2.PulledPart(item=index, meta=meta_of(pulled.value), version=pulled.version))
                values.append(tensor_payload(pulled.value))
            return reply(outcome, values)

        return self._store.read_many(dense, locked)

    def _check_step_reads(self, reads: Sequence[tuple[ShardRef, torch.Tensor | None]]) -> None:
        """A step's reads must fit its reply: one message, with room for its header."""
        self._check_read_bytes(reads, min(self._limits.max_pull_bytes, self._limits.max_reply_bytes - (1 << 20)),
                               "the largest message it sends, --max-message-bytes")

    def _program_step(self, plan: ps_pb2.StepPlan, payload: torch.Tensor, reply_buffer: Callable[[int], torch.Tensor],
                      programs: StepPrograms) -> tuple[bytes, memoryview]:
        """Defines program ``plan.define_program`` from ``plan`` and runs it, or runs program
        ``plan.run_program`` (checked again first if the store's shards changed since)."""
        if plan.define_program:
            if plan.run_program or plan.base_versions:
                raise InvalidRequestError("a plan defines a step program (its parts carry their base versions) "
                                          "or runs one, not both")
            program = programs.define(plan.define_program, self._compile(plan, payload.numel()))
            bases: Sequence[int] = [int(part.base_version) for part in plan.push]
        else:
            if plan.push or plan.pull:
                raise InvalidRequestError("run_program sends only its key, base versions and bytes: the parts and "
                                          "reads were defined with define_program")
            program = programs.get(plan.run_program)
            if program.prepared.generation != self._store.generation:
                program = programs.define(plan.run_program, self._compile(program.plan, program.push_bytes))
            bases = base_versions(plan, program)
        if payload.numel() != program.push_bytes:
            raise InvalidRequestError(f"the payload holds {payload.numel()} bytes but the step program pushes "
                                      f"{program.push_bytes}")
        pushed = []
        if program.pushes:
            values, flat = programs.pushed_values(program, payload)
            pushed = self._store.push_prepared(program.prepared, values, bases, plan.idempotency_key, flat=flat)

        def locked(pulled: list[Pulled]) -> tuple[bytes, memoryview]:
            buffer = reply_buffer(program.pull_bytes)
            if pulled:
                torch._foreach_copy_(programs.reply_views(program, buffer), [p.value for p in pulled])
            outcome = ps_pb2.StepOutcome(program=ps_pb2.ProgramOutcome(
                applied=[o.applied for o in pushed], versions=[o.version for o in pushed],
                staleness=[o.staleness for o in pushed], pulled_versions=[p.version for p in pulled]))
            return outcome.SerializeToString(), writable_byte_view(buffer)

        return self._store.read_prepared(program.prepared, locked)

    def _compile(self, plan: ps_pb2.StepPlan, payload_bytes: int) -> StepProgram:
        """``plan`` checked as a step program: dense pushes and whole-shard reads, every check a
        plain step makes that does not depend on the step's bytes."""
        check_program_size(len(plan.push) + len(plan.pull))
        if any(part.sparse for part in plan.push) or any(item.sparse for item in plan.pull):
            raise InvalidRequestError("a step program pushes and reads whole shards only: send a step with "
                                      "sparse rows as a plain StepPlan")
        sizes = self._check_parts(plan.push, payload_bytes)
        reads = [convert.ref_from_proto(item.ref) for item in plan.pull]
        self._check_step_reads([(ref, None) for ref in reads])
        slots, offset = [], 0
        for part, size in zip(plan.push, sizes):
            slots.append(PushSlot(offset, size, dtype_from_name(part.values.dtype), tuple(int(d) for d in part.values.shape)))
            offset += size
        prepared = self._store.prepare_step([(convert.ref_from_proto(part.ref), slot.dtype, slot.shape)
                                             for part, slot in zip(plan.push, slots)], reads)
        kept = ps_pb2.StepPlan(push=plan.push, pull=plan.pull)
        return StepProgram(kept, prepared, tuple(slots))

    @unary_boundary
    def GetDataPlane(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        parse(ps_pb2.GetDataPlaneRequest, raw)
        return self.data_plane.SerializeToString()

    def _packed_pushes(self, parts: Sequence[tensor_pb2.PushPart], payload: memoryview) -> list[ShardPush]:
        """The pushes of a Step RPC: each part's bytes are its slice of the one payload, copied
        once into one buffer (so tensors are aligned and outlive the request), once every part
        fits its shard."""
        sizes = self._check_parts(parts, len(payload))
        for part in parts:
            self._check_against_shard(part)
        buffer = byte_buffer(len(payload))
        buffer.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
        return self._slice_pushes(parts, sizes, buffer)

    def _pushes_in(self, parts: Sequence[tensor_pb2.PushPart], buffer: torch.Tensor) -> list[ShardPush]:
        """The pushes whose bytes lie back to back in ``buffer`` (uint8, already received within
        the frame limit), read in place; the store checks each against its shard before any applies."""
        return self._slice_pushes(parts, self._check_parts(parts, buffer.numel()), buffer)

    def _slice_pushes(self, parts: Sequence[tensor_pb2.PushPart], sizes: list[int], buffer: torch.Tensor) -> list[ShardPush]:
        pushes, offset = [], 0
        for part, size in zip(parts, sizes):
            pushes.append(self._push_from_part(part, buffer[offset : offset + size]))
            offset += size
        return pushes

    def _check_parts(self, parts: Sequence[tensor_pb2.PushPart], payload_bytes: int) -> list[int]:
        """Each part's size, once together they fill the payload."""
        sizes = [self._checked_push_bytes(part) for part in parts]
        if sum(sizes) != payload_bytes:
            raise InvalidRequestError(
                f"the payload holds {payload_bytes} bytes but the plan's push parts describe {sum(sizes)}"
            )
        return sizes

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

    def _allocate_push(self, header: tensor_pb2.PartHeader) -> torch.Tensor:
        """Room for one pushed part, once its header fits the shard it names: a part that cannot
        apply is refused before its bytes are received."""
        if header.WhichOneof("kind") != "push":
            raise InvalidRequestError("Push takes parts with PushPart headers")
        expected = self._checked_push_bytes(header.push)
        self._check_against_shard(header.push)
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
            raise MessageTooLargeError(
                f"push part of {expected} bytes exceeds this server's limit of {self._max_push_bytes} "
                "(--max-push-bytes): split the variable into more shards or raise the limit",
                variable=push.ref.variable,
            )
        return expected

    def _check_against_shard(self, push: tensor_pb2.PushPart) -> None:
        self._store.check_push_header(
            convert.ref_from_proto(push.ref), dtype_from_name(push.values.dtype), tuple(push.values.shape),
            int(push.num_indices) if push.sparse else None,
        )

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
        values = _hyperparameters(request.values_json)
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
        directory = confined_path(self._root, request.directory, authenticated=self._limits.authenticated)
        states = self._store.export(None)
        path = checkpoint.save_checkpoint(directory, states, keep=request.keep)
        return ps_pb2.SaveResponse(path=str(path), shards=len(states)).SerializeToString()

    @unary_boundary
    def Restore(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        request = parse(ps_pb2.RestoreRequest, raw)
        path = checkpoint.resolve(confined_path(self._root, request.path, authenticated=self._limits.authenticated))
        checkpoint.sweep_leftovers(path.parent)  # what interrupted saves left beside it
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


def _wire_rows(raw: bytes) -> torch.Tensor:
    """Row indices from a request; each row once (a request repeating one row could ask for
    any amount of data; paramserve's client sends them de-duplicated)."""
    rows = convert.rows_from_bytes(raw)
    if rows.numel() > 1 and torch.unique(rows).numel() != rows.numel():
        raise InvalidRequestError("a read names some rows more than once; de-duplicate the row indices "
                                  "(torch.unique(rows, return_inverse=True) restores their order afterwards)")
    return rows


def _hyperparameters(text: str) -> dict[str, float | int | bool | list[float | int]]:
    """The ``values_json`` of SetHyperparameters: a flat JSON object whose values are numbers,
    booleans or lists of numbers (e.g. ``betas``); raises InvalidRequestError naming what is not."""
    if len(text) > MAX_JSON_CHARS:
        raise InvalidRequestError(f"values_json has {len(text)} characters; the limit is {MAX_JSON_CHARS}")
    try:
        values = json.loads(text)
    except RecursionError:
        raise InvalidRequestError("values_json nests too deeply; send a flat object such as {\"lr\": 0.01}") from None
    except ValueError as err:  # JSONDecodeError, and integers beyond Python's digit limit
        raise InvalidRequestError(f"values_json is not a JSON object of numbers: {err}") from None
    if not isinstance(values, dict):
        raise InvalidRequestError('values_json must be a JSON object such as {"lr": 0.01}')
    for name, value in values.items():
        items = value if isinstance(value, list) else [value]
        if not all(_is_number(item) for item in items) or (isinstance(value, list) and len(value) > 16):
            raise InvalidRequestError(
                f"hyperparameter {name!r} must be a number, a boolean or a short list of numbers, "
                f"got {_preview(value)}"
            )
    return values


def _is_number(value: object) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, int):
        return abs(value) < 1 << 63
    return isinstance(value, float) and value == value and abs(value) != float("inf")


def _preview(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _pulled_part_chunks(index: int, value: torch.Tensor, version: int, chunk_bytes: int) -> list[bytes]:
    part = tensor_pb2.PulledPart(item=index, meta=meta_of(value), version=version)
    return list(encode_parts([(tensor_pb2.PartHeader(pulled=part), [tensor_payload(value)])], chunk_bytes))


def _shards_response(infos: Sequence[ShardInfo]) -> bytes:
    return ps_pb2.CreateShardsResponse(shards=[convert.info_to_proto(i) for i in infos]).SerializeToString()


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
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
