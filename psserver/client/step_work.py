"""What one client call does on each parameter server: push parts to apply, then shards to read,
and where each read lands. Built by the client (psserver/client/ps_client.py) and carried by whichever
transport a server's share takes (psserver/client/step_transport.py); nothing here talks to a server.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from paramserve.psserver.dataplane.frames import fits_a_program
from paramserve.psserver.dynamic.dynamic_rows import owner_of
from paramserve.psserver.protocol import convert
from paramserve.psserver.protocol.errors import (
    DtypeMismatchError,
    IndexOutOfRangeError,
    InvalidRequestError,
    ShapeMismatchError,
)
from paramserve.psserver.protocol.streams import meta_of, tensor_payload
from paramserve.psserver.protocol.tensors import as_byte_view, dtype_name
from paramserve.psserver.protocol.types import PushOutcome, RowGradient, ShardRef, UniqueRows, VariableLayout
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2

__all__ = [
    "Exchange",
    "LayoutWire",
    "PushPart",
    "ReadEntry",
    "RowScatter",
    "ServerWork",
    "ShardWire",
    "StepResult",
    "destination_bytes",
    "dynamic_reads",
    "dynamic_row_parts",
    "group_rows",
    "index_error",
    "push_parts",
    "read_destination",
]

StepResult = tuple[list[PushOutcome], dict[ShardRef, int]]
"""One server's step: its push results, and the version each shard read was at."""


@dataclass(frozen=True, eq=False)
class ShardWire:
    """A shard's wire messages, built once per layout (a step reuses them; a step program is
    named by them, compared by identity)."""

    ref: ShardRef
    ref_proto: tensor_pb2.ShardRef
    item: ps_pb2.PullItem
    meta: tensor_pb2.TensorMeta
    """The shard's value as it travels (the layout's dtype)."""
    start: int
    end: int
    """Its bytes within the whole variable's (row-major: shards are row ranges)."""


@dataclass(frozen=True)
class LayoutWire:
    """A layout's per-shard wire messages, built once (a step reuses them)."""

    layout: VariableLayout
    shards: tuple[ShardWire, ...]

    @staticmethod
    def of(layout: VariableLayout) -> LayoutWire:
        element = layout.dtype.itemsize
        row_bytes = element * math.prod(layout.shape[1:]) if layout.shape else element
        shards = []
        for shard in layout.shards:
            ref = layout.ref(shard)
            ref_proto = convert.ref_to_proto(ref)
            shape = layout.shard_shape(shard)
            start = shard.row_start * row_bytes if layout.shape else 0
            end = start + (shard.num_rows * row_bytes if layout.shape else element)
            shards.append(
                ShardWire(
                    ref,
                    ref_proto,
                    ps_pb2.PullItem(ref=ref_proto),
                    tensor_pb2.TensorMeta(dtype=dtype_name(layout.dtype), shape=list(shape)),
                    start,
                    end,
                )
            )
        return LayoutWire(layout, tuple(shards))


class RowScatter:
    """A pull destination that scatters received rows to positions of a larger tensor."""

    def __init__(self, target: torch.Tensor, positions: torch.Tensor):
        self.target = target
        self.positions = positions
        row_elements = math.prod(target.shape[1:]) if target.dim() else 1
        self.nbytes = positions.numel() * row_elements * target.element_size()
        """The bytes the rows arriving here take (asked for at every step: computed once)."""


Destination = torch.Tensor | RowScatter


def destination_bytes(destination: Destination) -> int:
    if isinstance(destination, RowScatter):
        return destination.nbytes
    return destination.numel() * destination.element_size()


@dataclass(slots=True, eq=False)
class PushPart:
    """One push part: its bytes, and either its shard's wire messages (a dense push of a whole
    shard, which a step program names) or its own message (a sparse or converted push)."""

    pieces: list[memoryview]
    base_version: int
    wire: ShardWire | None = None
    built: tensor_pb2.PushPart | None = None

    def message(self) -> tensor_pb2.PushPart:
        if self.built is None:
            assert self.wire is not None
            self.built = tensor_pb2.PushPart(
                ref=self.wire.ref_proto, values=self.wire.meta, base_version=self.base_version
            )
        return self.built


@dataclass(slots=True, eq=False)
class ReadEntry:
    """One shard read of a server's share and where its bytes land."""

    item: ps_pb2.PullItem
    destination: Destination
    ref: ShardRef | None = None
    """The shard, when the caller knows it (else parsed from ``item``)."""
    view: memoryview | None = None
    """The read's bytes in its destination, when they are a contiguous range there (a reply's
    bytes are received straight into it)."""
    wire: ShardWire | None = None
    """The shard's wire messages when the read is of a whole shard (a step program can name it)."""

    def nbytes(self) -> int:
        return len(self.view) if self.view is not None else destination_bytes(self.destination)

    def shard(self) -> ShardRef:
        return self.ref if self.ref is not None else convert.ref_from_proto(self.item.ref)


PLAN_BYTES_PER_ENTRY = 256
"""A generous bound on a StepPlan's bytes per push part or read besides its row ids (its shard's
name, metadata and versions), for ``ServerWork.plan_bytes``."""


@dataclass(eq=False)
class ServerWork:
    """One server's share of an exchange: push parts to apply, then shards to read."""

    parts: list[PushPart] = field(default_factory=list)
    reads: list[ReadEntry] = field(default_factory=list)

    def nbytes(self) -> int:
        """Payload bytes both ways (what decides the route: psserver/client/step_transport.py)."""
        pushed = sum(len(piece) for part in self.parts for piece in part.pieces)
        return pushed + sum(len(r.view) if r.view is not None else destination_bytes(r.destination) for r in self.reads)

    def plan_bytes(self) -> int:
        """About how large this share's StepPlan is (its header on a data plane): the sparse
        reads' row ids, which travel in it, and PLAN_BYTES_PER_ENTRY for each part and read."""
        ids = sum(len(read.item.row_indices) for read in self.reads)
        return ids + PLAN_BYTES_PER_ENTRY * (len(self.parts) + len(self.reads))

    def items(self) -> list[ps_pb2.PullItem]:
        return [read.item for read in self.reads]

    def plan(self, key: str) -> ps_pb2.StepPlan:
        """This share as a whole StepPlan (the Step RPC's, and a data-plane step's unless it is a program)."""
        return ps_pb2.StepPlan(idempotency_key=key, push=[part.message() for part in self.parts], pull=self.items())

    def pushed_bytes(self) -> list[memoryview]:
        """The pushed parts' bytes (not copied), in plan order."""
        return [piece for part in self.parts for piece in part.pieces]

    def signature(self) -> tuple[object, ...] | None:
        """What identifies this work as a step program: its push parts' and reads' shard wires
        (cached per layout, compared by identity), or None when a part or a read is not of a
        whole dense shard with a place to land, or when the step is too large for a program."""
        if not fits_a_program(len(self.parts) + len(self.reads)):
            return None
        wires: list[object] = []
        for part in self.parts:
            if part.wire is None:
                return None
            wires.append(part.wire)
        wires.append(None)  # pushes | reads
        for read in self.reads:
            if read.wire is None or read.view is None:
                return None
            wires.append(read.wire)
        return tuple(wires)


@dataclass
class Exchange:
    """What one client call does on each server, and the tensors its reads fill."""

    by_server: dict[int, ServerWork] = field(default_factory=lambda: defaultdict(ServerWork))
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def push(self, server: int, part: PushPart) -> None:
        self.by_server[server].parts.append(part)

    def read(self, server: int, entry: ReadEntry) -> None:
        self.by_server[server].reads.append(entry)


def read_destination(layout: VariableLayout, given: torch.Tensor | None) -> torch.Tensor:
    """Where a pulled variable lands: the caller's host tensor, checked to fit, or a new one."""
    if given is None:
        return torch.empty(layout.shape, dtype=layout.dtype)
    if tuple(given.shape) != layout.shape:
        raise ShapeMismatchError(
            f"the destination has shape {tuple(given.shape)}, the servers hold {layout.shape}", variable=layout.name
        )
    if given.dtype != layout.dtype:
        raise DtypeMismatchError(
            f"the destination holds {given.dtype}, the servers hold {layout.dtype}", variable=layout.name
        )
    if given.device.type != "cpu" or not given.is_contiguous():
        raise InvalidRequestError(
            f"a pull destination must be a contiguous host tensor, got one on {given.device}", variable=layout.name
        )
    return given


def row_reads(exchange: Exchange, wire: LayoutWire, indices: torch.Tensor) -> UniqueRows:
    """Adds to ``exchange`` the reads of the distinct rows ``indices`` name (each shard's from its
    server); their values land in the result's ``rows``. Raises IndexOutOfRangeError, before
    adding any, for an index outside the table."""
    layout = wire.layout
    flat = indices.reshape(-1).to(torch.int64)
    rows_in_table = layout.shape[0]
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= rows_in_table):
        bad = int(flat[(flat < 0) | (flat >= rows_in_table)][0])
        raise index_error(layout.name, bad, rows_in_table)
    unique, inverse = torch.unique(flat, return_inverse=True)
    rows = torch.empty((unique.numel(), *layout.shape[1:]), dtype=layout.dtype)
    for index, positions in group_rows(layout, unique):
        shard = layout.shards[index]
        local = unique[positions] - shard.row_start
        item = ps_pb2.PullItem(ref=wire.shards[index].ref_proto, sparse=True, row_indices=convert.rows_to_bytes(local))
        exchange.read(shard.server, ReadEntry(item, RowScatter(rows, positions), wire.shards[index].ref))
    return UniqueRows(unique, inverse, rows)


def lookup_reads(
    exchange: Exchange,
    lookups: Mapping[str, torch.Tensor],
    dynamic: Mapping[str, tuple[int, torch.dtype]],
    num_servers: int,
    wire_of: Callable[[str], LayoutWire],
) -> dict[str, UniqueRows]:
    """Adds the reads of every lookup's distinct rows (``dynamic``: the dynamic tables, by id);
    raises, before adding any of a table's, for a bad index."""
    found: dict[str, UniqueRows] = {}
    for name, indices in lookups.items():
        shape = dynamic.get(name)
        if shape is not None:
            found[name] = dynamic_reads(exchange, name, indices, *shape, num_servers)
        else:
            found[name] = row_reads(exchange, wire_of(name), indices)
    return found


def gradient_parts(
    gradients: Mapping[str, torch.Tensor | RowGradient],
    base_versions: Mapping[ShardRef, int],
    dynamic_dims: Mapping[str, int],
    num_servers: int,
    wire_of: Callable[[str], LayoutWire],
) -> list[tuple[int, PushPart]]:
    """(server, part) for every gradient: a dynamic table's row gradient (``dynamic_dims``: their
    row widths) by id, every other as ``push_parts`` cuts it along ``wire_of(name)``."""
    parts: list[tuple[int, PushPart]] = []
    for name, gradient in gradients.items():
        dim = dynamic_dims.get(name)
        if dim is not None and isinstance(gradient, RowGradient):
            parts += dynamic_row_parts(name, gradient, dim, num_servers, base_versions)
        else:
            parts += push_parts(wire_of(name), gradient, base_versions)
    return parts


def push_parts(
    wire: LayoutWire, gradient: torch.Tensor | RowGradient, base_versions: Mapping[ShardRef, int]
) -> Iterator[tuple[int, PushPart]]:
    """(server, part) for every shard a gradient updates: byte ranges of the gradient itself for
    a dense one of the layout's dtype, else converted pieces; the rows each shard holds for a
    row gradient."""
    if isinstance(gradient, RowGradient):
        yield from _row_parts(wire, gradient, base_versions)
        return
    layout = wire.layout
    gradient = gradient.detach().cpu()
    if tuple(gradient.shape) != layout.shape:
        raise ShapeMismatchError(
            f"gradient has shape {tuple(gradient.shape)}, the variable {layout.shape}", variable=layout.name
        )
    if gradient.dtype == layout.dtype and gradient.is_contiguous():  # the common case: byte ranges of one view
        whole = as_byte_view(gradient)
        for shard, shard_wire in zip(layout.shards, wire.shards):
            base = base_versions.get(shard_wire.ref, -1) if base_versions else -1
            yield shard.server, PushPart([whole[shard_wire.start : shard_wire.end]], base, wire=shard_wire)
        return
    for shard in layout.shards:
        piece = gradient[shard.row_start : shard.row_start + shard.num_rows] if layout.shape else gradient
        ref = layout.ref(shard)
        base = base_versions.get(ref, -1)
        part = tensor_pb2.PushPart(ref=convert.ref_to_proto(ref), values=meta_of(piece), base_version=base)
        yield shard.server, PushPart([tensor_payload(piece)], base, built=part)


def _row_parts(
    wire: LayoutWire, gradient: RowGradient, base_versions: Mapping[ShardRef, int]
) -> Iterator[tuple[int, PushPart]]:
    layout = wire.layout
    indices = gradient.indices.reshape(-1).to(torch.int64)
    values = gradient.values.reshape(indices.numel(), *layout.shape[1:]).detach().cpu()
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= layout.shape[0]):
        bad = int(indices[(indices < 0) | (indices >= layout.shape[0])][0])
        raise index_error(layout.name, bad, layout.shape[0])
    for index, positions in group_rows(layout, indices):
        shard, shard_wire = layout.shards[index], wire.shards[index]
        local = (indices[positions] - shard.row_start).contiguous()
        rows_values = values[positions].contiguous()
        base = base_versions.get(shard_wire.ref, -1)
        part = tensor_pb2.PushPart(
            ref=shard_wire.ref_proto,
            values=meta_of(rows_values),
            sparse=True,
            num_indices=local.numel(),
            base_version=base,
        )
        yield shard.server, PushPart([tensor_payload(local), tensor_payload(rows_values)], base, built=part)


def group_rows(layout: VariableLayout, indices: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """(shard index in the layout, positions in ``indices``) for every shard some index falls
    in. Sorted indices (a lookup's distinct rows, the gradient of one lookup) split into one
    range per shard; others are bucketed."""
    count = indices.numel()
    if len(layout.shards) == 1:
        if count:
            yield 0, torch.arange(count)
        return
    if count < 2 or bool((indices[1:] >= indices[:-1]).all()):
        bounds = [*torch.searchsorted(indices, layout.row_starts).tolist(), count]
        for index in range(len(layout.shards)):
            if bounds[index + 1] > bounds[index]:
                yield index, torch.arange(bounds[index], bounds[index + 1])
        return
    owners = torch.bucketize(indices, layout.row_starts, right=True) - 1
    for index in torch.unique(owners).tolist():
        yield index, (owners == index).nonzero().reshape(-1)


def index_error(name: str, index: int, rows: int) -> IndexOutOfRangeError:
    return IndexOutOfRangeError(f"row index {index} is outside [0, {rows})", variable=name)


# ---------------------------------------------------------------- dynamic tables


def _check_ids(name: str, ids: torch.Tensor) -> torch.Tensor:
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise DtypeMismatchError(f"ids of a dynamic table must be integers (int64), got {ids.dtype}", variable=name)
    return ids.reshape(-1).to(torch.int64)


def dynamic_reads(
    exchange: Exchange, name: str, ids: torch.Tensor, dim: int, dtype: torch.dtype, num_servers: int
) -> UniqueRows:
    """Adds the reads of a dynamic table's rows for ``ids`` (any shape, any int64 values): the
    distinct ids, each server's share (``owner_of``: splitmix64) in one read entry."""
    unique, inverse = torch.unique(_check_ids(name, ids), return_inverse=True)
    rows = torch.empty((unique.numel(), dim), dtype=dtype)
    owners = owner_of(unique, num_servers)
    for server in range(num_servers):
        positions = (owners == server).nonzero().reshape(-1)
        if positions.numel():
            ref = ShardRef(name, server)
            item = ps_pb2.PullItem(
                ref=convert.ref_to_proto(ref), sparse=True, row_indices=convert.rows_to_bytes(unique[positions])
            )
            exchange.read(server, ReadEntry(item, RowScatter(rows, positions), ref))
    return UniqueRows(unique, inverse, rows)


def dynamic_row_parts(
    name: str, gradient: RowGradient, dim: int, num_servers: int, base_versions: Mapping[ShardRef, int]
) -> Iterator[tuple[int, PushPart]]:
    """(server, part) for each server a dynamic table's row gradient (rows by id) updates."""
    ids = _check_ids(name, gradient.indices)
    if gradient.values.numel() != ids.numel() * dim:
        raise ShapeMismatchError(
            f"{ids.numel()} ids need gradients of {ids.numel()} x {dim}, got {tuple(gradient.values.shape)}",
            variable=name,
        )
    values = gradient.values.reshape(ids.numel(), dim).detach().cpu()
    owners = owner_of(ids, num_servers)
    for server in range(num_servers):
        positions = (owners == server).nonzero().reshape(-1)
        if not positions.numel():
            continue
        ref = ShardRef(name, server)
        mine, rows = ids[positions].contiguous(), values[positions].contiguous()
        base = base_versions.get(ref, -1)
        part = tensor_pb2.PushPart(
            ref=convert.ref_to_proto(ref),
            values=meta_of(rows),
            sparse=True,
            num_indices=mine.numel(),
            base_version=base,
        )
        yield server, PushPart([tensor_payload(mine), tensor_payload(rows)], base, built=part)
