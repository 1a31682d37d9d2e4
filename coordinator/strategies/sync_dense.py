"""Hybrid training's dense variables as the coordinator keeps them (``sync_dense=True``).

Under ``ParameterServerStrategy(sync_dense=True)`` the parameters of the modules built in
scope are *replicated* on the workers instead of living on the parameter servers: the workers
average their gradients every step by an all-reduce among themselves and apply the same
optimizer (worker.dense_group), while embedding tables (``ShardedEmbedding``,
``ShardedEmbeddingCollection``, ``DynamicEmbedding``) stay on the servers, asynchronous.

The coordinator's own parameters hold the values the workers start from. Reading them on the
coordinator (a forward pass, ``model_weights``, a checkpoint) fetches the workers' current
state between rounds, at most once per round finished. A restore (a checkpoint) sets them and
starts a new *epoch*: the workers drop what they hold and start from the restored state.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import cloudpickle
import torch
from torch.utils.hooks import RemovableHandle

from paramserve.coordinator.dispatch.dense_rounds import DenseRoundsLink, DenseSettings
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.worker.layers import SettleBeforeForward, variable_name

if TYPE_CHECKING:
    from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy

__all__ = ["SyncDense", "dense_groups"]

READ_TIMEOUT = 600.0
"""How long reading the workers' dense state waits for the round running to end."""


def dense_groups(specs: Sequence[tuple[str, OptimizerSpec | None]]) -> list[tuple[tuple[str, ...], OptimizerSpec]]:
    """The workers' param groups: the replicated variables (in the order given) gathered by their
    optimizer spec (a group per set of options, in order of first appearance)."""
    groups: dict[OptimizerSpec, list[str]] = {}
    for name, spec in specs:
        if spec is not None:
            groups.setdefault(spec, []).append(name)
    return [(tuple(names), spec) for spec, names in groups.items()]


class SyncDense:
    """The coordinator's side of the replicated dense variables of one strategy."""

    def __init__(self, strategy: ParameterServerStrategy, timeout: float, rendezvous_host: str | None):
        if not timeout > 0:
            raise ValueError(f"dense_group_timeout must be > 0 seconds, got {timeout!r}")
        self._strategy = strategy
        self.timeout = float(timeout)
        self.rendezvous_host = rendezvous_host
        self._lock = threading.RLock()
        self._epoch = 0
        self._known: dict[str, Any] | None = None
        """The latest state (values, optimizer state, version, applied keys) read from the
        workers or restored: what a worker without state of the epoch starts from."""
        self._read_at = 0  # rounds_done when the workers' state was last read
        self.rounds = DenseRoundsLink()
        """The rounds of the coordinator that runs this strategy: each ClusterCoordinator made
        for it connects its own when it is built."""

    # ------------------------------------------------------------ what the rounds ask

    def holds(self, name: str) -> bool:
        variable = self._strategy.variables.get(name)
        return variable is not None and variable.replicated

    def settle_hooks(self, root: torch.nn.Module) -> list[RemovableHandle]:
        """A SettleBeforeForward hook on each layer of ``root`` holding its own replicated
        variables: a worker applies a step's average when such a layer next runs."""
        layers = [
            m for m in root.modules() if any(self.holds(str(variable_name(p))) for p in m.parameters(recurse=False))
        ]
        return [layer.register_forward_pre_hook(SettleBeforeForward()) for layer in layers]

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(n for n, v in self._strategy.variables.items() if v.replicated))

    def settings(self) -> DenseSettings:
        """The replicated variables, their optimizer and the epoch, for the next round."""
        variables = self._strategy.variables
        names = self.names()
        specs = {variables[n].optimizer for n in names}
        if None in specs:
            missing = [n for n in names if variables[n].optimizer is None][:3]
            raise RuntimeError(
                f"sync_dense: dense variables {missing} have no optimizer: build the torch optimizer inside "
                "strategy.scope() or declare it with strategy.optimizer(...) before the first schedule()"
            )
        if len({spec.name for spec in specs if spec is not None}) > 1:
            raise RuntimeError(
                "sync_dense: the dense variables must share one optimizer class (the workers apply one "
                f"optimizer to all of them, a param group per set of options); got {sorted(str(s) for s in specs)}"
            )
        groups = dense_groups([(n, variables[n].optimizer) for n in names])
        optimizer = (
            cloudpickle.dumps((getattr(torch.optim, groups[0][1].name), [(g, dict(s.kwargs)) for g, s in groups]))
            if groups
            else b""
        )
        return DenseSettings(names, optimizer, self._epoch)

    def initial_state(self) -> bytes:
        """What a worker without state of this epoch starts from (as torch.save writes
        worker.dense_group's state): the latest state known (restored, or read from the workers),
        else the coordinator's values. A group whose members all hold state ignores it (they
        take the one of the member ahead); a group of new workers only (every worker lost at
        once) goes on from it. Called on the dispatch thread between rounds, without ``_lock``:
        a reader holding it waits for that thread (``read_state`` pauses dispatch)."""
        state = self._known or self._coordinators_state()
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()

    # ------------------------------------------------------------ reading and restoring

    def refresh(self) -> None:
        """Makes the coordinator's parameters hold the workers' current values (before training,
        the coordinator's values are the variables')."""
        state = self.current_state()
        if state is None:
            return
        with torch.no_grad():
            for name, value in state["values"].items():
                if name in self._strategy.variables:
                    self._parameter(name).copy_(value)

    def current_state(self) -> dict[str, Any] | None:
        """The dense state (values, optimizer state, version, applied keys) as the workers hold
        it now, read at most once per round finished; the restored state while no worker holds
        one of this epoch; None before any (the coordinator's values are the state)."""
        with self._lock:
            done = self.rounds.rounds_done()
            if self.rounds.connected and done != self._read_at:
                raw = self.rounds.read_state(READ_TIMEOUT)
                self._read_at = done
                if raw:
                    self._known = torch.load(io.BytesIO(raw), weights_only=True)
            return self._known

    def state_for_checkpoint(self, keys: Mapping[str, str]) -> dict[str, Any]:
        """The state a checkpoint keeps, its variables named by ``keys`` (without the run name)."""
        state = self.current_state() or self._coordinators_state()
        return {**state, "values": {keys[name]: value for name, value in state["values"].items() if name in keys}}

    def restore(self, state: Mapping[str, Any], names: Mapping[str, str]) -> None:
        """Makes ``state`` (a checkpoint's, its variables named by checkpoint key) the dense
        variables' state: the coordinator's values now, the workers' from their next round.
        CheckpointManager checked, before the restore changed anything, that it holds them all."""
        by_key = {key: name for name, key in names.items()}
        values = {by_key[key]: value for key, value in state["values"].items() if key in by_key}
        with self._lock, torch.no_grad():
            for name, value in values.items():
                self._parameter(name).copy_(value)
            self._known = {**state, "values": values}
            self._epoch += 1
            self._read_at = self.rounds.rounds_done()

    def _coordinators_state(self) -> dict[str, Any]:
        """The coordinator's values as a state no step was applied to (before training)."""
        values = {name: self._parameter(name).detach().clone() for name in self.names()}
        return {"version": 0, "values": values, "optimizer": None, "applied": []}

    def _parameter(self, name: str) -> torch.nn.Parameter:
        parameter = self._strategy.variables[name].parameter
        assert parameter is not None
        return parameter
