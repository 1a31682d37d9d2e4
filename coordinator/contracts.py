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
- ``RecoverableVariables`` (declared by recovery, ``coordinator.ps_recovery``) and
  ``DenseSettings`` (declared by dispatch's dense rounds): each package declares the protocol it
  needs, and the strategy implements both; ``CheckpointLog`` lives with checkpointing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from paramserve.coordinator.cluster import ClusterSpec
from paramserve.coordinator.dispatch.dense_rounds import DenseRoundsLink, DenseSettings
from paramserve.coordinator.recovery.ps_recovery import RecoverableVariables
from paramserve.psserver.protocol.types import ClusterContext
from paramserve.psserver.runtime.security import ClientTls

__all__ = [
    "CoordinatedStrategy",
    "DispatchControl",
]


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


class DenseReplication(Protocol):
    """Hybrid training's replicated dense variables (strategies.sync_dense.SyncDense): what the
    coordinator's rounds (coordinator.dense_rounds) need, and how they tell it what happened."""

    timeout: float
    """Seconds a collective waits for the slowest worker before the group is broken."""
    rendezvous_host: str | None
    """The coordinator's host as the workers reach it (None: chosen from the workers' addresses)."""

    @property
    def rounds(self) -> DenseRoundsLink:
        """Where the coordinator connects its rounds: how the variables learn of rounds
        finished and read the workers' dense state between them."""

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
    max_row_staleness: int
    """Steps a worker serves a row it read from its row cache (worker.row_cache; 0: no cache)."""

    @property
    def sync_dense(self) -> DenseReplication | None:
        """Hybrid training's replicated dense variables; None: every variable is on the servers."""

    def cluster_context(self) -> ClusterContext:
        """Where the variables live; called for every RunClosures call (may create variables first)."""

    def attach_coordinator(self, coordinator: DispatchControl) -> RecoverableVariables | None:
        """A new coordinator schedules for this strategy: what recovery may restore, or None."""
