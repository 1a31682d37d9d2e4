"""What checkpointing needs of the strategy whose variables it saves and restores.

Checkpointing sits below the strategies, so it declares the members it uses here and
``ParameterServerStrategy`` implements them (mypy checks it where the strategy builds its
CheckpointManager); nothing here imports a strategy. Each signature is the strategy's,
except where its type lives among the strategies: a variable (``CheckpointedVariable``),
hybrid training's dense variables (``CheckpointedDense``) and the coordinator
(``RecoveryControl``) are declared by what is used of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn

    from paramserve.coordinator.checkpointing.checkpoint_log import CheckpointLog
    from paramserve.coordinator.cluster import ClusterSpec
    from paramserve.psserver.client.ps_client import ParameterServerClient
    from paramserve.psserver.dynamic.dynamic_types import DynamicShardState
    from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
    from paramserve.psserver.protocol.types import ShardState, VariableLayout
    from paramserve.worker.dynamic_embedding import DynamicEmbedding
    from paramserve.worker.layers import ShardedEmbedding

__all__ = ["CheckpointedDense", "CheckpointedVariable", "CheckpointedVariables", "FusedTableRows", "RecoveryControl"]


class FusedTableRows(Protocol):
    """One of the tables a fused variable stores (strategies.table_fusion)."""

    @property
    def path(self) -> str:
        """Its place in its model: its key in a state_dict is ``<path>.weight``."""

    @property
    def table(self) -> ShardedEmbedding: ...

    @property
    def offset(self) -> int:
        """Its first row in the variable."""


class CheckpointedVariable(Protocol):
    """One variable of the strategy, as a plain state_dict reads it."""

    @property
    def table(self) -> ShardedEmbedding | None:
        """The embedding table of a row variable (None: dense or dynamic)."""

    @property
    def fused(self) -> Sequence[FusedTableRows]:
        """The tables a fused row variable stores, in row order (empty: not fused)."""

    @property
    def replicated(self) -> bool:
        """Hybrid training: on the workers, never on the servers."""

    @property
    def parameter(self) -> nn.Parameter | None:
        """A dense variable's parameter in the coordinator's model (None for a table)."""


class DenseOptimizer(Protocol):
    """Of the dense rounds' settings (dispatch's ``DenseSettings``), what a restore checks the
    saved optimizer state against."""

    @property
    def optimizer(self) -> bytes:
        """cloudpickle of (torch.optim class, [(variable names, keyword arguments)])."""


class CheckpointedDense(Protocol):
    """Hybrid training's replicated dense variables (strategies/sync_dense.py: ``SyncDense``)."""

    def names(self) -> tuple[str, ...]:
        """The replicated variables."""

    def settings(self) -> DenseOptimizer:
        """What the next round gives the workers (its optimizer); RuntimeError before there is one."""

    def refresh(self) -> None:
        """Makes the coordinator's parameters hold the workers' current values."""

    def state_for_checkpoint(self, keys: Mapping[str, str]) -> dict[str, Any]:
        """The state a checkpoint keeps, its variables named by ``keys``."""

    def restore(self, state: Mapping[str, Any], names: Mapping[str, str]) -> None:
        """Makes ``state`` (a checkpoint's, named by checkpoint key) the dense variables' state."""


class RecoveryControl(Protocol):
    """What a save asks of the coordinator when a server was lost during its export."""

    def report_parameter_server(self, address: str) -> None:
        """The server at ``address`` looks lost: have it checked and recovered."""

    def parameter_servers_settled(self, timeout: float | None = None) -> bool:
        """Waits until no parameter-server recovery is pending or running; False at the timeout."""


class CheckpointedVariables(Protocol):
    """The variables CheckpointManager saves and restores, and ``state_dict``, ``export_state_dict``
    and ``load_state_dict`` read and set (``ParameterServerStrategy``)."""

    @property
    def cluster(self) -> ClusterSpec:
        """The cluster the variables live on."""

    @property
    def client(self) -> ParameterServerClient:
        """The client of the servers that serve: each group's primary when replicated."""

    @property
    def coordinator(self) -> RecoveryControl | None:
        """The live ClusterCoordinator of the strategy, or None."""

    @property
    def checkpoints(self) -> CheckpointLog:
        """The checkpoints the program wrote or restored."""

    @property
    def sync_dense(self) -> CheckpointedDense | None:
        """Hybrid training's replicated dense variables; None: every variable is on the servers."""

    @property
    def variables(self) -> Mapping[str, CheckpointedVariable]:
        """Every variable by name."""

    @property
    def roots(self) -> list[tuple[str, nn.Module]]:
        """The models built in scope, with the prefix of their variables' names."""

    @property
    def materialized(self) -> bool:
        """Whether training started: the variables were created (or restored) on the servers."""

    def materialize(
        self,
        states_by_server: dict[int, list[ShardState]] | None = None,
        layouts: dict[str, VariableLayout] | None = None,
    ) -> None:
        """Creates the variables not yet on the servers."""

    def initialize(self) -> None:
        """Creates the variables from their initial values, replacing an earlier run's."""

    def plan_layouts(self) -> dict[str, VariableLayout]:
        """Where each variable's shards go with the current partitioner and servers."""

    def created_layouts(self) -> dict[str, VariableLayout]:
        """Where each variable that exists on the servers lives."""

    def dynamic_tables(self) -> dict[str, DynamicEmbedding]:
        """The dynamic tables by variable name."""

    def checkpoint_key(self, name: str) -> str | None:
        """Variable ``name`` as checkpoints store it; None for one no checkpoint holds."""

    def live_optimizer(self, name: str) -> OptimizerSpec | None:
        """The optimizer and hyperparameters the servers apply to ``name`` now."""

    def restore_states(
        self, states_by_server: Mapping[int, Sequence[ShardState]], layouts: Mapping[str, VariableLayout]
    ) -> None:
        """Makes the variables of ``layouts`` exactly ``states_by_server`` on the servers."""

    def restore_dynamic(self, states_by_server: Mapping[int, Sequence[DynamicShardState]]) -> None:
        """Makes those dynamic tables exactly those rows on the servers."""

    def quiesced(self, timeout: float | None = None) -> contextlib.AbstractContextManager[None]:
        """Inside, no closure of the strategy runs."""

    def state_change(self) -> contextlib.AbstractContextManager[None]:
        """Held while a checkpoint is taken or a parameter server restored."""
