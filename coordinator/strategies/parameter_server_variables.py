"""A ParameterServerStrategy's variables as the coordinator knows them: what one is
(``Variable``), the run name that keeps one run's apart (``check_run_name``), how one is
created on the servers (``create_on_servers``), and which of them the servers hold already
(``held_by_servers``, ``variables_exist_error``).

They are apart from ``parameter_server`` (the strategy, which keeps its variables and decides
when they are created) because they say what one variable is and how it reaches the servers,
and need nothing of the strategy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from paramserve.psserver.client.ps_client import ParameterServerClient, layouts_from_infos
from paramserve.psserver.protocol.errors import VariableExistsError
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.partition import Partitioner
from paramserve.psserver.protocol.types import VariableLayout
from paramserve.wire.v1 import tensor_pb2
from paramserve.worker.dynamic_embedding import DynamicEmbedding
from paramserve.worker.layers import ShardedEmbedding


@dataclass(frozen=True)
class FusedMember:
    """One of the ShardedEmbeddings a fused variable stores (strategies.table_fusion)."""

    path: str
    """Its place in its model (``named_modules``): its key in ``state_dict`` is ``<path>.weight``."""
    table: ShardedEmbedding
    offset: int
    """Its first row in the variable."""


@dataclass
class Variable:
    """One distributed variable as the coordinator knows it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parameter: nn.Parameter | None = None  # dense: the coordinator's own parameter
    table: ShardedEmbedding | None = None  # row variable: never materialised locally (fused: the first)
    fused: tuple[FusedMember, ...] = ()  # the tables a fused variable stores, in row order
    dynamic: DynamicEmbedding | None = None  # a dynamic table: rows by id, no layout
    optimizer: OptimizerSpec | None = None
    checkpointed: bool = True  # a metric's state is not: checkpoints hold the model
    replicated: bool = False  # sync_dense: on the workers, averaged by all-reduce, never on the servers


def create_on_servers(client: ParameterServerClient, variable: Variable, partitioner: Partitioner | None) -> None:
    """Creates ``variable`` on the servers ``client`` reaches, with its optimizer: a dynamic table
    empty, a ShardedEmbedding's rows from its initializer (made on the servers), a dense variable
    from its parameter's value, split into shards by ``partitioner``. Raises what the client's
    create calls raise (VariableExistsError for a name the servers hold)."""
    if variable.dynamic is not None:
        config = dataclasses.replace(variable.dynamic.config, optimizer=variable.optimizer)
        client.dynamic.create(variable.name, config)
        return
    if variable.table is not None:
        table = variable.table
        kind = table.initializer
        a, b = (0.0, table.init_std) if kind == "normal" else (-table.init_std, table.init_std)
        init = tensor_pb2.Initializer(kind=kind, a=a, b=b, seed=table.seed)
        client.create_variable(
            variable.name,
            shape=variable.shape,
            dtype=variable.dtype,
            initializer=init,
            optimizer=variable.optimizer,
            partitioner=partitioner,
        )
        return
    assert variable.parameter is not None
    client.create_variable(
        variable.name,
        variable.parameter.detach(),
        optimizer=variable.optimizer,
        partitioner=partitioner,
    )


def held_by_servers(
    client: ParameterServerClient, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], names: Sequence[str]
) -> dict[str, VariableLayout]:
    """The layouts of those of ``names`` the servers hold. Raises VariableExistsError for one held
    with another shape or dtype than ``shapes`` gives: another model's, never to be touched."""
    layouts = {n: layout for n, layout in layouts_from_infos(client.list_shards()).items() if n in names}
    for name, layout in layouts.items():
        shape, dtype = shapes[name]
        if (layout.shape, layout.dtype) != (shape, dtype):
            raise VariableExistsError(
                f"the servers hold it as {layout.shape} {layout.dtype}, the model builds {shape} "
                f"{dtype}: it belongs to another model; use a new run_name for this one",
                variable=name,
            )
    return layouts


def variables_exist_error(layouts: Mapping[str, VariableLayout]) -> VariableExistsError:
    """What a run that would create variables the servers hold already is told."""
    return VariableExistsError(
        f"{len(layouts)} variables of this model exist on the parameter servers already, e.g. "
        f"{sorted(layouts)[:3]} (from an earlier run?): pass ParameterServerStrategy(run_name=...) a new "
        "name to keep this run's variables apart, reuse_variables=True to train on from their values, or (a "
        "restarted program) call CheckpointManager(strategy, directory).restore_or_initialize() before the "
        "first schedule(): it restores the latest checkpoint, or starts the variables afresh without one",
        variable=sorted(layouts)[0],
    )


def check_run_name(run_name: str | None) -> str | None:
    """``run_name`` when it can prefix variable names (``<run_name>/<model>.<parameter>``).

    Raises:
        ValueError: empty, with surrounding spaces, or with a '/'.
    """
    if run_name is None:
        return None
    if not isinstance(run_name, str) or not run_name.strip() or run_name != run_name.strip() or "/" in run_name:
        raise ValueError(f"run_name must be a non-empty name without '/' or surrounding spaces, got {run_name!r}")
    return run_name
