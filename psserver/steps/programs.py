"""Step programs, the server's side: a data-plane connection's recurring steps, checked once and
then run by number (psserver/steps/engine.py compiles and runs them).

A training worker sends the same step every time: the same dense shards pushed, the same shards
read back. Parsing that plan, finding its shards and checking each part against its shard cost a
parameter server more CPU per step than applying the update (about 150 us per part on a small
model). So the client sends a recurring step whole once, as program N of its connection
(``StepPlan.define_program``); the server checks it, keeps it here, and later steps send only
``run_program = N``, their idempotency key and base versions, with the pushed bytes.

What stays per step: the key (exactly-once), the NaN/Inf check of the gradients, the staleness
bound, and the lock-protected apply and read. What a program fixes (its shards' dtypes, shapes
and byte ranges) is checked again whenever the store's shards change
(``ShardStore.catalog_version``): a restored or deleted variable cannot be reached through a
program made before.

A connection holds at most MAX_PROGRAMS programs of at most MAX_PROGRAM_ENTRIES parts and reads
each (psserver/dataplane/frames.py: both sides keep to them), numbered 1..MAX_PROGRAMS by the client
(psserver/dataplane/dataplane_client.py: ProgramNumbers), and they end with it; a client that needs
another reuses a number (the server replaces it).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paramserve.psserver.dataplane import frames as dataplane
from paramserve.psserver.dataplane.frames import MAX_PROGRAMS, fits_a_program
from paramserve.psserver.protocol.errors import InvalidRequestError
from paramserve.psserver.protocol.streams import tensor_view
from paramserve.psserver.store.shard_store import PreparedStep
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2

__all__ = ["PushSlot", "StepProgram", "StepPrograms", "base_versions", "check_program_size"]


def check_program_size(entries: int, plan_bytes: int) -> None:
    """Raises InvalidRequestError for a program of more than MAX_PROGRAM_ENTRIES parts and reads,
    or whose plan is over MAX_PROGRAM_PLAN_BYTES: what a connection's programs keep is bounded."""
    if not fits_a_program(entries):
        raise InvalidRequestError(
            f"a step program holds at most {dataplane.MAX_PROGRAM_ENTRIES} push parts and "
            f"reads; this one has {entries}: send it as a plain StepPlan"
        )
    if plan_bytes > dataplane.MAX_PROGRAM_PLAN_BYTES:
        raise InvalidRequestError(
            f"a step program's plan holds at most {dataplane.MAX_PROGRAM_PLAN_BYTES} bytes; this one has "
            f"{plan_bytes}: send it as a plain StepPlan"
        )


@dataclass(frozen=True)
class PushSlot:
    """Where one push part's values lie in a program's payload."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(eq=False)
class StepProgram:
    """A checked recurring step: its plan (to check again after the shards change), its shards,
    and the byte layout of its payload (``pushes``) and of its reply (``prepared.read_layout``)."""

    plan: ps_pb2.StepPlan
    prepared: PreparedStep
    pushes: tuple[PushSlot, ...]

    @functools.cached_property
    def push_bytes(self) -> int:
        return sum(slot.nbytes for slot in self.pushes)

    @functools.cached_property
    def pull_bytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self.prepared.read_layout)

    def values_in(self, payload: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor | None, bool]:
        """The pushed values in ``payload`` (uint8, ``push_bytes`` long); all of them as one flat
        tensor when they share one floating dtype (one NaN/Inf scan); and whether they are all
        views, which may be kept for the next step in the same buffer (False when a part had to
        be copied to be aligned)."""
        views = [tensor_view(payload, slot.offset, slot.nbytes, slot.dtype, slot.shape) for slot in self.pushes]
        aligned = all(
            view.data_ptr() == payload.data_ptr() + slot.offset for view, slot in zip(views, self.pushes) if slot.nbytes
        )
        dtypes = {slot.dtype for slot in self.pushes}
        flat = None
        if len(dtypes) == 1 and aligned and payload.numel():
            (dtype,) = dtypes
            if dtype.is_floating_point:
                flat = payload.view(dtype)
        return views, flat, aligned

    def reply_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each read's place in the reply buffer (uint8, ``pull_bytes`` long), as a tensor of the
        shard's dtype and shape: the values are copied in with one foreach copy."""
        views, offset = [], 0
        for dtype, shape, nbytes in self.prepared.read_layout:
            views.append(buffer[offset : offset + nbytes].view(dtype).reshape(shape))
            offset += nbytes
        return views


class StepPrograms:
    """One connection's programs, by the client's number (1..MAX_PROGRAMS), and the tensor views
    each has of the connection's payload and reply buffers. The views are kept while the
    connection reuses the same buffers (a step then makes none) and all dropped when either
    changes, so they never hold an old buffer alive. Views of a buffer the connection does not
    reuse (over REUSED_BUFFER_LIMIT, made for one step) are never kept: kept, they would hold
    that step's buffer, a model-sized one, between steps."""

    def __init__(self) -> None:
        self._programs: dict[int, StepProgram] = {}
        self._payload: tuple[int, dict[int, tuple[list[torch.Tensor], torch.Tensor | None]]] = (0, {})
        self._reply: tuple[int, dict[int, list[torch.Tensor]]] = (0, {})

    def define(self, number: int, program: StepProgram) -> StepProgram:
        if not 1 <= number <= MAX_PROGRAMS:
            raise InvalidRequestError(
                f"step program number {number} is out of range: a connection numbers its programs 1..{MAX_PROGRAMS} "
                "(reuse a number to replace a program)"
            )
        self._programs[number] = program
        self._payload, self._reply = (0, {}), (0, {})  # rare; and no view outlives its program
        return program

    def get(self, number: int) -> StepProgram:
        program = self._programs.get(number)
        if program is None:
            raise InvalidRequestError(
                f"step program {number} is not defined on this connection: send the step whole with "
                f"define_program={number} first (programs end with their connection)"
            )
        return program

    def pushed_values(
        self, program: StepProgram, payload: torch.Tensor
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """``program.values_in(payload)``, made once per program and reused payload buffer."""
        if not _reused(payload):
            self._payload = (0, {})
            views, flat, _ = program.values_in(payload)
            return views, flat
        pointer, kept = self._payload
        if pointer != payload.data_ptr():
            kept = {}
            self._payload = (payload.data_ptr(), kept)
        found = kept.get(id(program))
        if found is not None:
            return found
        views, flat, keep = program.values_in(payload)
        if keep:
            kept[id(program)] = (views, flat)
        return views, flat

    def reply_views(self, program: StepProgram, buffer: torch.Tensor) -> list[torch.Tensor]:
        """``program.reply_views(buffer)``, made once per program and reused reply buffer."""
        if not _reused(buffer):
            self._reply = (0, {})
            return program.reply_views(buffer)
        pointer, kept = self._reply
        if pointer != buffer.data_ptr():
            kept = {}
            self._reply = (buffer.data_ptr(), kept)
        views = kept.get(id(program))
        if views is None:
            views = kept[id(program)] = program.reply_views(buffer)
        return views


def _reused(buffer: torch.Tensor) -> bool:
    """Whether a connection keeps ``buffer`` for its next steps (see REUSED_BUFFER_LIMIT)."""
    return buffer.numel() <= dataplane.REUSED_BUFFER_LIMIT


def base_versions(plan: ps_pb2.StepPlan, program: StepProgram) -> Sequence[int]:
    """A run's base version per push part (-1, unknown, when the plan sends none)."""
    if not plan.base_versions:
        return [-1] * len(program.pushes)
    if len(plan.base_versions) != len(program.pushes):
        raise InvalidRequestError(
            f"run_program sent {len(plan.base_versions)} base versions for a program of {len(program.pushes)} "
            "push parts: send one per part, or none"
        )
    return list(plan.base_versions)
