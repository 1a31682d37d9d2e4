"""The seam between a ClusterCoordinator, the strategy it schedules for, and recovery.

Three parties meet here, and each side is declared so that mypy checks both:

- ``CoordinatedStrategy``: what a ClusterCoordinator needs of the strategy it schedules
  closures for (ParameterServerStrategy; tests pass doubles). When a coordinator is made it
  calls ``attach_coordinator(coordinator)``: the strategy learns its coordinator (as a
  ``DispatchControl``) and answers with what parameter-server recovery may restore, or None
  (a strategy whose variables need no recovery, such as a test double).
- ``DispatchControl``: what the strategy asks of its coordinator (pause dispatch for a
  consistent cut, per-worker datasets, and the recovery's state, so that a checkpoint is
  never taken while a server is being restored).
- ``RecoverableVariables``: what ``coordinator.ps_recovery`` needs of the strategy to restore a
  failed parameter server: the client, where each variable lives, which checkpoints exist
  (``CheckpointLog``), the optimizer settings in force now, and the restore itself.

``CheckpointLog`` is the one home of "the latest checkpoint": CheckpointManager records what
it writes and restores there, recovery and ``fit`` read it, telemetry reports its age.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from paramserve.coordinator.cluster import ClusterSpec
from paramserve.coordinator.replica_groups import ParameterServers
from paramserve.psserver.client import ParameterServerClient
from paramserve.psserver.dynamic_types import DynamicShardState
from paramserve.psserver.optimizer_spec import OptimizerSpec
from paramserve.psserver.security import ClientTls
from paramserve.psserver.types import ClusterContext, ShardPlacement, ShardState, VariableLayout

__all__ = [
    "CheckpointLog",
    "CheckpointRecord",
    "CoordinatedStrategy",
    "DispatchControl",
    "RecoverableVariables",
]


@dataclass(frozen=True)
class CheckpointRecord:
    """A checkpoint a CheckpointManager wrote or restored: its step, path and write time (Unix)."""

    step: int
    path: str
    written_at: float


class CheckpointLog:
    """The checkpoints this program wrote or restored, newest last. Thread-safe.

    Recovery restores from ``latest``, or, when that one is gone or not whole, from an older
    checkpoint of the same directories (``candidates``): the directories are remembered for that.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: CheckpointRecord | None = None
        self._directories: list[pathlib.Path] = []

    def record(self, step: int, path: str | os.PathLike[str], written_at: float) -> CheckpointRecord:
        """``path`` (a checkpoint directory such as ``root/ckpt-00000400``) is now the newest."""
        record = CheckpointRecord(int(step), str(path), float(written_at))
        root = pathlib.Path(path).parent
        with self._lock:
            self._latest = record
            if root not in self._directories:
                self._directories.append(root)
        return record

    @property
    def latest(self) -> CheckpointRecord | None:
        with self._lock:
            return self._latest

    def forget(self, directory: str | os.PathLike[str]) -> None:
        """The checkpoints under ``directory`` were deleted (e.g. BackupAndRestore at the end)."""
        root = pathlib.Path(directory)
        with self._lock:
            self._directories = [d for d in self._directories if d != root]
            if self._latest is not None and pathlib.Path(self._latest.path).parent == root:
                self._latest = None

    def candidates(self, list_checkpoints: Callable[[pathlib.Path], Sequence[pathlib.Path]]) -> list[pathlib.Path]:
        """Checkpoints to restore from, best first: the latest, then the others that
        ``list_checkpoints(directory)`` finds in the remembered directories, newest first."""
        with self._lock:
            latest = pathlib.Path(self._latest.path) if self._latest is not None else None
            directories = list(reversed(self._directories))
        ordered: list[pathlib.Path] = [latest] if latest is not None else []
        for directory in directories:
            for path in reversed(list_checkpoints(directory)):
                if path not in ordered:
                    ordered.append(path)
        return ordered


class DispatchControl(Protocol):
    """What a strategy asks of the ClusterCoordinator attached to it."""

    @property
    def closed(self) -> bool:
        """True after the coordinator was shut down."""

    def paused(self, timeout: float | None = None) -> contextlib.AbstractContextManager[None]:
        """Inside, no closure runs on any worker (a consistent cut between closures)."""

    def parameter_servers_settled(self, timeout: float | None = None) -> bool:
        """Waits until no parameter-server recovery is pending or running; False at the timeout."""

    def report_parameter_server(self, address: str) -> None:
        """The server at ``address`` looks lost (e.g. it restarted during a checkpoint's export)."""

    def create_per_worker_dataset(self, dataset_fn: Callable[..., Iterable[Any]]) -> Any:
        """A dataset made on every worker by ``dataset_fn(ctx)``."""


class RecoverableVariables(Protocol):
    """What parameter-server recovery restores: a strategy's variables on the servers."""

    @property
    def client(self) -> ParameterServerClient:
        """The client of the parameter servers the variables live on (the primaries, replicated)."""

    @property
    def servers(self) -> ParameterServers:
        """The servers and, when they are replicated, their groups (coordinator/replica_groups.py)."""

    def servers_moved(self) -> None:
        """A backup took over: the client and the cluster context name the new primaries."""

    @property
    def checkpoints(self) -> CheckpointLog:
        """The checkpoints the program wrote or restored."""

    @property
    def materialized(self) -> bool:
        """Whether the variables exist on the servers (nothing to watch before)."""

    def created_layouts(self) -> dict[str, VariableLayout]:
        """Where each variable that exists on the servers lives."""

    def checkpoint_key(self, name: str) -> str | None:
        """Variable ``name`` as checkpoints store it; None for one no checkpoint holds (a metric's
        state, which starts again from its initial value)."""

    def initial_state(self, name: str, layout: VariableLayout, shard: ShardPlacement) -> ShardState:
        """Shard ``shard`` of a variable no checkpoint holds, at its initial value."""

    def live_optimizer(self, name: str) -> OptimizerSpec | None:
        """The optimizer and hyperparameters the servers apply to ``name`` now (the program may
        have changed the learning rate since the checkpoint was written)."""

    def restore_states(
        self, states_by_server: Mapping[int, Sequence[ShardState]], layouts: Mapping[str, VariableLayout]
    ) -> None:
        """Makes those shards exactly ``states_by_server`` on the servers; workers drop their values."""

    def restore_checkpoint(self, path: pathlib.Path) -> None:
        """Rolls every variable back to checkpoint ``path`` (RecoveryPoint.ALL), keeping the
        optimizer settings in force now."""

    def created_dynamic_tables(self) -> list[str]:
        """The dynamic embedding tables that exist on the servers (they have no layout: every
        server holds one shard of each)."""

    def restore_dynamic(self, states_by_server: Mapping[int, Sequence[DynamicShardState]]) -> None:
        """Makes those dynamic tables' shards exactly ``states_by_server`` on those servers."""

    def state_change(self) -> contextlib.AbstractContextManager[None]:
        """Held while a checkpoint is taken or a server restored: the two never overlap."""


@dataclass(frozen=True)
class DenseSettings:
    """What the strategy says about its replicated variables when a round is built."""

    variables: tuple[str, ...]
    optimizer: bytes
    """cloudpickle of (torch.optim class, [(variable names, keyword arguments)]): a param group
    per set of options."""
    state_epoch: int
    """Counts the strategy's restores of the dense values (a checkpoint restore)."""


class DenseReplication(Protocol):
    """Hybrid training's replicated dense variables (strategies.sync_dense.SyncDense): what the
    coordinator's rounds (coordinator.dense_rounds) need, and how they tell it what happened."""

    timeout: float
    """Seconds a collective waits for the slowest worker before the group is broken."""
    rendezvous_host: str | None
    """The coordinator's host as the workers reach it (None: chosen from the workers' addresses)."""
    rounds_done: Callable[[], int]
    """Set by the coordinator: rounds finished so far."""
    read_state: Callable[[float], bytes] | None
    """Set by the coordinator: reads the workers' dense state between rounds."""

    def settings(self) -> DenseSettings:
        """The replicated variables, their optimizer and the state epoch, for the next round."""

    def initial_state(self) -> bytes:
        """What a worker without state of this epoch starts from."""


class CoordinatedStrategy(Protocol):
    """What a ClusterCoordinator needs of the strategy it schedules for (tests pass doubles)."""

    cluster: ClusterSpec
    token: str | None
    tls: ClientTls | None
    """How to reach workers over TLS (None: plaintext)."""
    max_value_age: float
    """How old (seconds) the values a worker's last push returned may be to start its next closure."""
    overlap_pushes: bool
    """Whether a worker's step computes while its previous push is in flight (worker.pipeline)."""

    @property
    def sync_dense(self) -> DenseReplication | None:
        """Hybrid training's replicated dense variables; None: every variable is on the servers."""

    def cluster_context(self) -> ClusterContext:
        """Where the variables live; called for every RunClosures call (may create variables first)."""

    def attach_coordinator(self, coordinator: DispatchControl) -> RecoverableVariables | None:
        """A new coordinator schedules for this strategy: what recovery may restore, or None."""
