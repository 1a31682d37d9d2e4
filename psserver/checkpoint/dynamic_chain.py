"""Incremental checkpoints of dynamic tables: the pure decisions, with no I/O.

A checkpoint holds each dynamic table whole, or as a delta of the checkpoint saved before it
(its *parent*): per shard, the rows changed since the parent's export and the ids evicted since
(psserver/store/dynamic_table.py answers such exports). A table's state at a checkpoint is the last
checkpoint that holds it whole, then every delta after it, in order.

- ``decide_save``: is the next save full or a delta? Full every ``full_every`` saves, and
  whenever there is no committed save to build on.
- ``restore_chain``: which checkpoints' files make a table's state at a checkpoint, checked:
  every link there, saved from the same number of servers, no loop.
- ``apply_delta``: one shard's whole state from its base and a delta.
- ``next_link``: what a manager remembers of the save it just committed.

The coordinator's CheckpointManager asks these; psserver/checkpoint/dynamic_checkpoint.py reads and
writes the files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from paramserve.psserver.dynamic.dynamic_types import DynamicSaveMark, DynamicShardState
from paramserve.psserver.protocol.errors import CheckpointBaseMissingError, CheckpointError
from paramserve.psserver.protocol.types import ShardRef

__all__ = [
    "SaveDecision",
    "SavedLink",
    "SavedTable",
    "apply_delta",
    "decide_save",
    "next_link",
    "restore_chain",
]


@dataclass(frozen=True)
class SavedLink:
    """What a checkpoint manager remembers of the last save it committed."""

    name: str
    """The checkpoint's directory name (``ckpt-<N>``)."""
    needs: tuple[str, ...] = ()
    """The older checkpoints it cannot be restored without (its deltas' bases), oldest first."""
    deltas: int = 0
    """Saves since the last full one (0: this one was full)."""
    marks: Mapping[ShardRef, DynamicSaveMark] = field(default_factory=dict)
    """Each dynamic shard's mark at its export, by the servers' refs: a delta asks for what changed after."""


@dataclass(frozen=True)
class SaveDecision:
    delta: bool
    reason: str
    since: Mapping[ShardRef, DynamicSaveMark] = field(default_factory=dict)
    """With ``delta``: the marks the export asks for the changes after."""


def decide_save(previous: SavedLink | None, full_every: int, previous_whole: bool) -> SaveDecision:
    """Whether the next save writes the dynamic tables whole or as deltas of ``previous`` (the
    last save committed; ``previous_whole``: it is still on disk, whole). ``full_every``: a full
    save every that many saves (1: every save is full)."""
    if full_every <= 1:
        return SaveDecision(False, "every save is full (full_every=1)")
    if previous is None:
        return SaveDecision(False, "no committed save to build on")
    if not previous_whole:
        return SaveDecision(False, f"the last save, {previous.name}, is gone or not whole")
    if previous.deltas + 1 >= full_every:
        return SaveDecision(False, f"{previous.deltas + 1} saves since the last full one (full_every={full_every})")
    return SaveDecision(True, f"delta {previous.deltas + 1} of {full_every - 1} after a full save", previous.marks)


def next_link(
    previous: SavedLink | None, decision: SaveDecision, name: str, states: Sequence[DynamicShardState]
) -> SavedLink:
    """What to remember of the save just committed as ``name`` with these exported ``states``
    (by the servers' refs). A save whose every shard came whole (each server replaced since,
    say) is a full one, whatever was decided."""
    marks = {state.ref: state.mark for state in states}
    if previous is None or not decision.delta or not any(state.delta for state in states):
        return SavedLink(name, (), 0, marks)
    return SavedLink(name, (*previous.needs, previous.name), previous.deltas + 1, marks)


@dataclass(frozen=True)
class SavedTable:
    """A dynamic table as one checkpoint lists it."""

    num_shards: int
    shards: frozenset[int]
    """The shards it has a file for."""
    delta_shards: frozenset[int] = frozenset()
    """The shards whose file is a delta of ``parent``'s."""
    parent: str | None = None


def restore_chain(table: str, newest: str, saved: Mapping[str, SavedTable | None]) -> list[str]:
    """The checkpoints whose files of ``table`` make its state at checkpoint ``newest``, oldest
    first: from ``newest`` back through each parent to the first that holds it whole. ``saved``:
    the table as each checkpoint read holds it (None: the checkpoint lacks the table; absent:
    the checkpoint is gone). Raises CheckpointBaseMissingError when a parent is gone, and
    CheckpointError for a chain that does not fit together."""
    chain: list[str] = []
    name = newest
    while True:
        if name in chain:
            raise CheckpointError(f"dynamic table {table!r}: the checkpoints {chain} name each other as bases")
        if name not in saved:
            raise CheckpointBaseMissingError(
                f"dynamic table {table!r} in {chain[-1] if chain else newest} holds only the changes since "
                f"checkpoint {name}, which is gone or unreadable: restore a checkpoint that holds the table "
                "whole, or keep every checkpoint a kept one needs (CheckpointManager's pruning does)"
            )
        entry = saved[name]
        if entry is None:
            raise CheckpointError(f"checkpoint {name} does not hold dynamic table {table!r}")
        if entry.shards != frozenset(range(entry.num_shards)):
            raise CheckpointError(f"dynamic table {table!r} in {name} lacks shards of its {entry.num_shards}")
        if chain:
            child = saved[chain[-1]]
            if child is not None and child.num_shards != entry.num_shards:
                raise CheckpointError(
                    f"dynamic table {table!r}: {chain[-1]} ({child.num_shards} shards) is a delta of {name} "
                    f"({entry.num_shards} shards); a delta is always of the same servers"
                )
        chain.append(name)
        if not entry.delta_shards:
            return chain[::-1]
        if entry.parent is None:
            raise CheckpointError(f"dynamic table {table!r} in {name} holds deltas but names no base")
        name = entry.parent


def apply_delta(base: DynamicShardState, delta: DynamicShardState) -> DynamicShardState:
    """Shard ``delta.ref`` whole: ``base`` (whole, the parent's) less the ids ``delta`` deleted or
    changed, plus its rows, sorted by id; version, shared state and window are the delta's. A
    whole ``delta`` is returned as it is."""
    if not delta.delta:
        return delta
    fits = (base.ref, base.num_shards, set(base.slots)) == (delta.ref, delta.num_shards, set(delta.slots))
    if base.delta or not fits:
        raise CheckpointError(f"a delta of {delta.ref} does not fit its base {base.ref} (shards, slots or kind)")
    kept = ~torch.isin(base.ids, torch.cat([delta.deleted, delta.ids]))
    ids = torch.cat([base.ids[kept], delta.ids])
    order = torch.argsort(ids)

    def merged(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return torch.cat([old[kept], new])[order]

    return dataclasses.replace(
        delta,
        ids=ids[order],
        values=merged(base.values, delta.values),
        updated=merged(base.updated, delta.updated),
        slots={key: merged(base.slots[key], value) for key, value in delta.slots.items()},
        delta=False,
        deleted=torch.empty(0, dtype=torch.int64),
    )
