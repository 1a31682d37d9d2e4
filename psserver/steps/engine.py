"""What a training step means on a parameter server, whichever way it arrives.

A step is a push (gradients under one idempotency key) and reads (shards, whole or by rows)
answered once the push is applied. It reaches a server three ways: a ``Step`` RPC (one packed
StepRequest), a data-plane STEP frame (psserver/dataplane/dataplane_server.py: a StepPlan header, whole or
naming a step program, and the pushed bytes), or a ``Push`` stream then a ``Pull`` stream. The
transports only carry bytes; this engine gives them one meaning: the reads are checked first
(a bad or oversized read fails the step before anything changes), every push part is checked
against its shard, the push is applied exactly once per key, and the reads are answered under
the shards' locks (one consistent cut, copied out with no clone). Step programs are compiled
and run here too, with each data-plane connection's programs kept in the state the data plane
asks ``new_connection`` for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import torch
from google.protobuf.message import DecodeError

from paramserve.psserver.protocol import convert
from paramserve.psserver.protocol.errors import InvalidRequestError, MessageTooLargeError
from paramserve.psserver.protocol.metadata import IDEMPOTENCY_METADATA_KEY
from paramserve.psserver.protocol.streams import (
    byte_buffer,
    decode_step_request,
    encode_step_reply,
    meta_of,
    push_part_bytes,
    tensor_from_bytes,
    tensor_payload,
)
from paramserve.psserver.protocol.tensors import dtype_from_name, strictly_increasing, writable_byte_view
from paramserve.psserver.protocol.types import ShardRef
from paramserve.psserver.steps.programs import PushSlot, StepProgram, StepPrograms, base_versions, check_program_size
from paramserve.psserver.store.shard_store import Pulled, ShardPush, ShardStore
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2

__all__ = ["DEFAULT_MAX_PULL_BYTES", "DEFAULT_MAX_PUSH_BYTES", "Admission", "StepEngine", "StepLimits", "reads_of"]

_Reply = TypeVar("_Reply")

DEFAULT_MAX_PUSH_BYTES = 1 << 30
"""``--max-push-bytes``: the largest gradient part one push may declare (1 GiB)."""
DEFAULT_MAX_PULL_BYTES = 1 << 30
"""``--max-pull-bytes``: the most tensor bytes one read request may ask for (1 GiB)."""

Read = tuple[ShardRef, torch.Tensor | None]
"""A shard to read, and its rows (None: whole)."""


@dataclass(frozen=True)
class StepLimits:
    """What one step may ask of a server, checked before anything is allocated for it."""

    max_push_bytes: int = DEFAULT_MAX_PUSH_BYTES
    max_pull_bytes: int = DEFAULT_MAX_PULL_BYTES
    max_reply_bytes: int = 64 << 20
    """Largest reply sent as one message (a Step's or a data-plane step's reads): the send limit;
    also the most bytes of rows one Pull stream reads, which the server gathers whole before it
    streams them (``--max-message-bytes``)."""


class Admission(Protocol):
    """Who may run a step on this server now: its place in its shard group
    (psserver/replication/replica.py: ``Replica``, which a standalone server has too)."""

    def admit_client(self) -> None:
        """Raises (NotPrimaryError) when this server serves no client now: a backup, or a
        primary that stopped serving them."""

    def admit_forwarded(self, epoch: int) -> None:
        """Raises (ReplicaEpochError) unless this server is a backup at ``epoch``, the epoch a
        step forwarded by its primary carries."""


class StepEngine:
    """Runs steps on one ShardStore for every transport, each admitted first by ``admission``
    (a client's step, or one a primary forwarded). Thread-safe as the store is."""

    def __init__(self, store: ShardStore, admission: Admission, limits: StepLimits | None = None):
        self._store = store
        self._admission = admission
        self._limits = limits or StepLimits()

    # -- the ways a step arrives

    def new_connection(self) -> StepPrograms:
        """The state a data-plane connection keeps between its steps: its step programs."""
        return StepPrograms()

    def run_request(self, raw: bytes | memoryview) -> bytes:
        """A Step RPC: a packed StepRequest's bytes -> the packed StepReply's."""
        plan, payload = decode_step_request(raw)
        self._admit(plan)
        pushes = self._packed_pushes(plan.push, payload) if plan.push else []
        return self._step(plan, pushes, len(payload), encode_step_reply)

    def run_frames(
        self,
        plan_bytes: memoryview,
        payload: torch.Tensor,
        reply_buffer: Callable[[int], torch.Tensor],
        programs: StepPrograms,
    ) -> tuple[bytes, memoryview]:
        """A data-plane step: the StepPlan's bytes and the pushed bytes (a uint8 tensor the pushes
        read in place) -> the StepOutcome's bytes and the pulled bytes, copied under the shards'
        locks into ``reply_buffer(n)``. ``programs``: the connection's (``new_connection``)."""
        try:
            plan = ps_pb2.StepPlan.FromString(bytes(plan_bytes))
        except DecodeError as err:
            raise InvalidRequestError(f"malformed StepPlan ({len(plan_bytes)} bytes): {err}") from None
        self._admit(plan)
        if plan.define_program or plan.run_program:
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

    def _admit(self, plan: ps_pb2.StepPlan) -> None:
        if plan.replica_epoch:
            self._admission.admit_forwarded(int(plan.replica_epoch))
        else:
            self._admission.admit_client()

    def push(self, parts: Iterable[tuple[tensor_pb2.PartHeader, torch.Tensor]], key: str) -> list[ps_pb2.PushResult]:
        """A Push stream's parts (each received into ``allocate_push``'s buffer), applied as one push."""
        return self._apply([self._push_from_part(header.push, payload) for header, payload in parts], key)

    def allocate_push(self, header: tensor_pb2.PartHeader) -> torch.Tensor:
        """Room for one pushed part of a stream, once its header fits the shard it names: a part
        that cannot apply is refused before its bytes are received."""
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

    def check_pull(self, reads: Sequence[Read]) -> None:
        """Refuses, before reading anything, a Pull stream whose reads pass ``max_pull_bytes``, or
        whose reads of rows pass ``max_reply_bytes``: rows (a lookup) are gathered into a copy in
        the server's memory before they stream, so they are bounded as one message is, and a
        small request cannot make the server hold a reply many times its size."""
        sizes = self._read_sizes(reads)
        self._refuse_over(sum(sizes), self._limits.max_pull_bytes, "--max-pull-bytes")
        rows = sum(size for size, (_, wanted) in zip(sizes, reads) if wanted is not None)
        if rows > self._limits.max_reply_bytes:
            raise MessageTooLargeError(
                f"the rows this request reads add up to {rows} bytes, which a server gathers whole before it "
                f"sends them; this server gathers at most {self._limits.max_reply_bytes} per request "
                "(--max-message-bytes): split the lookup into requests of fewer ids, or raise the limit"
            )

    # -- a plain step

    def _step(
        self,
        plan: ps_pb2.StepPlan,
        pushes: list[ShardPush],
        payload_bytes: int,
        reply: Callable[[ps_pb2.StepOutcome, list[memoryview]], _Reply],
    ) -> _Reply:
        """Validates the reads, applies ``pushes`` (exactly once per key), then builds the reply
        with ``reply(outcome, values)`` under the read shards' locks: one consistent read."""
        if plan.define_program or plan.run_program or plan.base_versions:
            raise InvalidRequestError(
                "step programs (define_program, run_program, base_versions) run on the data plane only: "
                "send the StepPlan whole, each part's base version in its PushPart"
            )
        reads = reads_of(plan.pull)
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
                outcome.pulled.append(
                    tensor_pb2.PulledPart(item=index, meta=meta_of(pulled.value), version=pulled.version)
                )
                values.append(tensor_payload(pulled.value))
            return reply(outcome, values)

        return self._store.read_many(dense, locked)

    def _apply(self, pushes: list[ShardPush], key: str) -> list[ps_pb2.PushResult]:
        if not key:
            raise InvalidRequestError(
                "push without an idempotency key: send it in the StepPlan, or in the "
                f"{IDEMPOTENCY_METADATA_KEY!r} metadata of a Push stream"
            )
        return [
            ps_pb2.PushResult(
                ref=convert.ref_to_proto(o.ref), applied=o.applied, version=o.version, staleness=o.staleness
            )
            for o in self._store.push(pushes, key)
        ]

    # -- step programs

    def _program_step(
        self,
        plan: ps_pb2.StepPlan,
        payload: torch.Tensor,
        reply_buffer: Callable[[int], torch.Tensor],
        programs: StepPrograms,
    ) -> tuple[bytes, memoryview]:
        """Defines program ``plan.define_program`` from ``plan`` and runs it, or runs program
        ``plan.run_program`` (checked again first if the store's shards changed since)."""
        program, bases = self._program_of(plan, payload, programs)
        if payload.numel() != program.push_bytes:
            raise InvalidRequestError(
                f"the payload holds {payload.numel()} bytes but the step program pushes {program.push_bytes}"
            )
        pushed = []
        if program.pushes:
            values, flat = programs.pushed_values(program, payload)
            pushed = self._store.push_prepared(
                program.prepared, values, bases, plan.idempotency_key, flat=flat, checked=plan.replica_epoch > 0
            )

        def locked(pulled: list[Pulled]) -> tuple[bytes, memoryview]:
            buffer = reply_buffer(program.pull_bytes)
            if pulled:
                torch._foreach_copy_(programs.reply_views(program, buffer), [p.value for p in pulled])
            outcome = ps_pb2.StepOutcome(
                program=ps_pb2.ProgramOutcome(
                    applied=[o.applied for o in pushed],
                    versions=[o.version for o in pushed],
                    staleness=[o.staleness for o in pushed],
                    pulled_versions=[p.version for p in pulled],
                )
            )
            return outcome.SerializeToString(), writable_byte_view(buffer)

        return self._store.read_prepared(program.prepared, locked)

    def _program_of(
        self, plan: ps_pb2.StepPlan, payload: torch.Tensor, programs: StepPrograms
    ) -> tuple[StepProgram, Sequence[int]]:
        """The program ``plan`` defines or runs, and its push parts' base versions."""
        if plan.define_program:
            if plan.run_program or plan.base_versions:
                raise InvalidRequestError(
                    "a plan defines a step program (its parts carry their base versions) or runs one, not both"
                )
            program = programs.define(plan.define_program, self._compile(plan, payload.numel()))
            return program, [int(part.base_version) for part in plan.push]
        if plan.push or plan.pull:
            raise InvalidRequestError(
                "run_program sends only its key, base versions and bytes: the parts and "
                "reads were defined with define_program"
            )
        program = programs.get(plan.run_program)
        if program.prepared.catalog_version != self._store.catalog_version:
            program = programs.define(plan.run_program, self._compile(program.plan, program.push_bytes))
        return program, base_versions(plan, program)

    def _compile(self, plan: ps_pb2.StepPlan, payload_bytes: int) -> StepProgram:
        """``plan`` checked as a step program: dense pushes and whole-shard reads, every check a
        plain step makes that does not depend on the step's bytes."""
        check_program_size(len(plan.push) + len(plan.pull), plan.ByteSize())
        if any(part.sparse for part in plan.push) or any(item.sparse for item in plan.pull):
            raise InvalidRequestError(
                "a step program pushes and reads whole shards only: send a step with sparse rows as a plain StepPlan"
            )
        sizes = self._check_parts(plan.push, payload_bytes)
        reads = [convert.ref_from_proto(item.ref) for item in plan.pull]
        self._check_step_reads([(ref, None) for ref in reads])
        slots, offset = [], 0
        for part, size in zip(plan.push, sizes):
            slots.append(
                PushSlot(offset, size, dtype_from_name(part.values.dtype), tuple(int(d) for d in part.values.shape))
            )
            offset += size
        prepared = self._store.prepare_step(
            [(convert.ref_from_proto(part.ref), slot.dtype, slot.shape) for part, slot in zip(plan.push, slots)], reads
        )
        kept = ps_pb2.StepPlan(push=plan.push, pull=plan.pull)
        return StepProgram(kept, prepared, tuple(slots))

    # -- checks of reads and push parts

    def _check_step_reads(self, reads: Sequence[Read]) -> None:
        """A step's reads must fit its reply: one message, with room for its header."""
        self._check_read_bytes(
            reads,
            min(self._limits.max_pull_bytes, self._limits.max_reply_bytes - (1 << 20)),
            "the largest message it sends, --max-message-bytes",
        )

    def _check_read_bytes(self, reads: Sequence[Read], limit: int, flag: str) -> None:
        """Refuses, before reading anything, a request whose reply would pass ``limit`` bytes."""
        self._refuse_over(sum(self._read_sizes(reads)), limit, flag)

    def _read_sizes(self, reads: Sequence[Read]) -> list[int]:
        """The bytes each read returns, once the reads are checked (reading nothing)."""
        self._store.check_reads(reads)
        return [self._store.rows_nbytes(ref, None if rows is None else rows.numel()) for ref, rows in reads]

    @staticmethod
    def _refuse_over(total: int, limit: int, flag: str) -> None:
        if total > limit:
            raise MessageTooLargeError(
                f"the reads of this request add up to {total} bytes; this server sends at most {limit} per "
                f"request ({flag}): read fewer shards or rows per request"
            )

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

    def _slice_pushes(
        self, parts: Sequence[tensor_pb2.PushPart], sizes: list[int], buffer: torch.Tensor
    ) -> list[ShardPush]:
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

    def _checked_push_bytes(self, push: tensor_pb2.PushPart) -> int:
        """The payload bytes ``push`` describes; raises for a malformed or oversized part."""
        if push.num_indices < 0 or (push.num_indices and not push.sparse):
            raise InvalidRequestError("num_indices must be 0 for a dense push and >= 0 for a sparse one")
        expected = push_part_bytes(push)
        if expected > self._limits.max_push_bytes:
            raise MessageTooLargeError(
                f"push part of {expected} bytes exceeds this server's limit of {self._limits.max_push_bytes} "
                "(--max-push-bytes): split the variable into more shards or raise the limit",
                variable=push.ref.variable,
            )
        return expected

    def _check_against_shard(self, push: tensor_pb2.PushPart) -> None:
        self._store.check_push_header(
            convert.ref_from_proto(push.ref),
            dtype_from_name(push.values.dtype),
            tuple(push.values.shape),
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


def reads_of(items: Sequence[ps_pb2.PullItem]) -> list[Read]:
    """The shards and rows that read items name (a Step's, a data-plane step's or a Pull's)."""
    return [(convert.ref_from_proto(item.ref), _wire_rows(item.row_indices) if item.sparse else None) for item in items]


def _wire_rows(raw: bytes) -> torch.Tensor:
    """Row indices from a request; each row once (a request repeating one row could ask for
    any amount of data; paramserve's client sends them de-duplicated)."""
    rows = convert.rows_from_bytes(raw)
    if rows.numel() > 1 and not strictly_increasing(rows) and torch.unique(rows).numel() != rows.numel():
        raise InvalidRequestError(
            "a read names some rows more than once; de-duplicate the row indices "
            "(torch.unique(rows, return_inverse=True) restores their order afterwards)"
        )
    return rows
