"""Which of a model's ShardedEmbedding tables the servers store as one variable (``fusion_plan``).

A model written with one ``ShardedEmbedding`` per feature (as a TensorFlow user ports
``tf.keras.layers.Embedding``) would otherwise have one variable per table: a step's lookups
already travel together (worker.deferred_rows), but every table is still its own part of every
exchange, its own sparse step on every server and its own gradient to coalesce on every worker,
so a 26-table step paid 26 times what one does (2.6x the servers' CPU of the same model written
with a ShardedEmbeddingCollection, BENCHMARKS.md). Fused, the tables are row ranges of one
variable, as ShardedEmbeddingCollection's are: one lookup, one push, one sparse step.

Which tables fuse (one policy, decided here and nowhere else):

- tables of one model (its root module), adopted when its scope closes;
- named by their place in the model: a table given ``name=`` keeps its own variable (the user
  asked for that name on the servers, in checkpoints and exports);
- of one row layout and initialisation: ``embedding_dim``, ``dtype``, ``initializer``,
  ``init_std`` and ``seed`` equal (the servers fill a variable from one initializer);
- at least two of them: a group of one is left as it is.

The fused variable is ``<model>.fused_tables.<k>`` (k counts the model's groups in the order of
their first table). What stays each table's own: its shape, its ids (checked against its own
rows on the caller's side: the server only sees the fused range), its key in ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from paramserve.coordinator.strategies.parameter_server_variables import FusedMember, Variable
from paramserve.worker.deferred_rows import FusedRange
from paramserve.worker.layers import ShardedEmbedding, VariableAccess

_M = TypeVar("_M", bound=nn.Module)

FUSED_NAME = "fused_tables"
"""The fused variables' name under their model's prefix: ``<model>.fused_tables.<k>``."""


@dataclass(frozen=True)
class TableSpec:
    """What decides whether tables fuse: one of a model's ShardedEmbeddings, as the plan sees it."""

    path: str
    """Its place in the model (``named_modules``)."""
    rows: int
    named: bool
    """Given ``name=`` by its user: never fused."""
    embedding_dim: int
    dtype: torch.dtype
    initializer: str
    init_std: float
    seed: int

    def fusion_key(self) -> tuple[object, ...]:
        return (self.embedding_dim, self.dtype, self.initializer, self.init_std, self.seed)


@dataclass(frozen=True)
class FusedGroup:
    """Tables stored as one variable: ``members`` (indices into the plan's input), each starting
    at its ``offsets`` row of the variable, ``rows`` in all."""

    suffix: str
    """The variable's name under the model's prefix: ``fused_tables.<k>``."""
    members: tuple[int, ...]
    offsets: tuple[int, ...]
    rows: int


def fusion_plan(tables: Sequence[TableSpec]) -> list[FusedGroup]:
    """The groups of ``tables`` (one model's, in ``named_modules`` order) stored as one variable
    each, by the module docstring's policy; tables in no group keep their own variable."""
    by_key: dict[tuple[object, ...], list[int]] = {}
    for index, table in enumerate(tables):
        if not table.named:
            by_key.setdefault(table.fusion_key(), []).append(index)
    groups: list[FusedGroup] = []
    for members in (m for m in by_key.values() if len(m) >= 2):
        offsets, total = [], 0
        for index in members:
            offsets.append(total)
            total += tables[index].rows
        groups.append(FusedGroup(f"{FUSED_NAME}.{len(groups)}", tuple(members), tuple(offsets), total))
    return groups


def fused_variables(
    prefix: str, modules: Sequence[tuple[str, nn.Module]], home: VariableAccess, taken: Mapping[str, Variable]
) -> list[Variable]:
    """The fused variables of a model's ShardedEmbeddings not yet adopted among ``modules``
    (``(path, module)``, in ``named_modules`` order; the model's prefix ``prefix``), each table
    made a row range of one (variable, offset, ``home``). Raises ValueError, changing no table,
    when a fused name is ``taken``."""
    tables = [(q, t) for q, t in modules if isinstance(t, ShardedEmbedding) and not t.adopted()]
    specs = [
        TableSpec(
            q,
            t.num_embeddings,
            t.requested_name is not None,
            t.embedding_dim,
            t.dtype,
            t.initializer,
            t.init_std,
            t.seed,
        )
        for q, t in tables
    ]
    plan = fusion_plan(specs)
    for group in plan:
        name = f"{prefix}.{group.suffix}"
        if name in taken:
            raise ValueError(
                f"{name!r} is the name of the variable that stores {prefix}'s tables, and another variable has "
                "it: rename that one, or build the strategy with fuse_tables=False"
            )
    variables = []
    for group in plan:
        name, members = f"{prefix}.{group.suffix}", []
        for index, offset in zip(group.members, group.offsets):
            path, table = tables[index]
            table.variable, table.home = name, home
            table.fused = FusedRange(offset, table.num_embeddings, f"{prefix}.{path}")
            members.append(FusedMember(path, table, offset))
        first = members[0].table
        variables.append(
            Variable(name, (group.rows, first.embedding_dim), first.dtype, table=first, fused=tuple(members))
        )
    return variables


def unfused(modules: Sequence[tuple[str, _M]], fused: Sequence[Variable]) -> list[tuple[str, _M]]:
    """``modules`` but the tables ``fused`` stores."""
    taken = {id(member.table) for variable in fused for member in variable.fused}
    return [(path, module) for path, module in modules if id(module) not in taken]


def check_whole_groups(given: Sequence[Any], variables: Mapping[str, Variable]) -> None:
    """Raises ValueError when ``given`` (an optimizer's params) holds some tables of a fused
    variable but not all: they share one variable, so they share its optimizer."""
    for item in given:
        if isinstance(item, ShardedEmbedding) and item.fused:
            left_out = [m.table.place for m in variables[item.variable].fused if not any(m.table is g for g in given)]
            if left_out:
                raise ValueError(
                    f"ShardedEmbedding {item.place} is stored with {left_out} as one variable ({item.variable!r}), "
                    "so they share its optimizer: declare it for all of them, or build the strategy with "
                    "fuse_tables=False to give each table its own"
                )
