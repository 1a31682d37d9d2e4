"""Checkpoints written by the coordinator, and plain torch ``state_dict`` export/import.

The coordinator reads every shard (value, optimizer slots, version, idempotency
window) from the servers over RPC, with dispatch paused between closures (a
consistent cut), and writes one checkpoint with psserver.checkpoint (atomic: a
crash mid-save leaves the last good one). A restore lays the variables out for
the *current* servers and partitioner, cuts each new shard from the saved rows,
optimizer slots included (so a checkpoint from 2 servers restores onto 3), and
replaces the servers' shards exactly (ReplaceShards), live or fresh.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paramserve.coordinator.telemetry import CheckpointRecord
from paramserve.psserver import checkpoint
from paramserve.psserver.atomic_files import atomic_torch_save
from paramserve.psserver.errors import CheckpointError
from paramserve.psserver.types import ShardRef, ShardState

if TYPE_CHECKING:
    from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy

log = logging.getLogger(__name__)
STEP_KEY = "step"


class CheckpointManager:
    """Saves and restores a ParameterServerStrategy's variables in ``directory``.

    Args:
        max_to_keep: checkpoints kept; older ones are deleted after a save (0 keeps all).
    """

    def __init__(self, strategy: ParameterServerStrategy, directory: str | os.PathLike[str], *, max_to_keep: int = 3):
        if max_to_keep < 0:
            raise ValueError(f"max_to_keep must be >= 0, got {max_to_keep}")
        self.strategy = strategy
        self.directory = pathlib.Path(directory)
        self.max_to_keep = max_to_keep

    @property
    def latest(self) -> pathlib.Path | None:
        return checkpoint.latest_checkpoint(self.directory) if self.directory.exists() else None

    def save(self, step: int, extra: Mapping[str, Any] | None = None) -> pathlib.Path:
        """Writes every variable with its optimizer state; returns the checkpoint's path.

        A consistent cut: the coordinator's dispatch pauses while the servers' shards are
        copied, once the closures running have finished, so every closure finished by then
        has all of its pushes in the checkpoint and none is in it by halves (values,
        optimizer slots, versions and idempotency windows agree across servers). Dispatch
        resumes before the files are written.
        """
        self.strategy.materialize()
        mine = {name for name, variable in self.strategy.variables.items() if variable.checkpointed}
        with self.strategy.quiesced():
            exported = self.strategy.client.export()
        states = [  # this strategy's variables only (servers may hold other runs'), named without the run name
            dataclasses.replace(state, ref=ShardRef(self.strategy.checkpoint_key(state.ref.variable), state.ref.shard))
            for server_states in exported.values()
            for state in server_states
            if state.ref.variable in mine
        ]
        path = checkpoint.save_checkpoint(
            self.directory, states, extra={STEP_KEY: int(step), **(extra or {})}, keep=self.max_to_keep
        )
        log.info("checkpoint of step %d written to %s (%d shards)", step, path, len(states))
        self.strategy.last_checkpoint = CheckpointRecord(int(step), str(path), time.time())
        return path

    def restore_or_initialize(self) -> int | None:
        """Restores the latest checkpoint onto the current servers, or creates the
        variables from their initial values when there is none. Returns the restored step."""
        path = self.latest
        if path is None:
            self.strategy.materialize()
            return None
        return self.restore(path)

    def restore(self, path: str | os.PathLike[str]) -> int:
        """Restores ``path`` (a checkpoint, or a directory of them: its latest), exactly: every
        shard of every variable of the model becomes the checkpoint's (values, optimizer slots,
        versions, idempotency windows), on live servers (training paused meanwhile; workers
        then pull) or fresh ones, for any number of servers. Raises CheckpointError, before
        anything changes, when the checkpoint does not match the model."""
        resolved = checkpoint.resolve(pathlib.Path(path))
        checkpoint.sweep_leftovers(resolved.parent)  # what interrupted saves left beside it
        manifest = checkpoint.read_manifest(resolved)
        variables = self.strategy.variables
        layouts = {name: layout for name, layout in self.strategy.plan_layouts().items() if variables[name].checkpointed}
        keys = {name: self.strategy.checkpoint_key(name) for name in layouts}
        _check_compatible(manifest, {keys[name]: layout for name, layout in layouts.items()}, resolved)
        states: dict[int, list[ShardState]] = defaultdict(list)
        for name, layout in layouts.items():
            for shard in layout.shards:
                rows = shard.num_rows if layout.shape else 1
                states[shard.server].append(
                    checkpoint.load_rows(resolved, keys[name], shard.row_start, rows, layout.ref(shard)))
        with self.strategy.quiesced():
            self.strategy.restore_states(dict(states), layouts)
        self.strategy.materialize()  # variables the checkpoint does not hold (none, once checked)
        step = int(manifest.extra.get(STEP_KEY, 0))
        log.info("restored step %d from %s onto %d parameter servers", step, resolved, self.strategy.cluster.num_ps())
        self.strategy.last_checkpoint = CheckpointRecord(step, str(resolved), _written_at(resolved))
        return step


def _written_at(path: pathlib.Path) -> float:
    """When the checkpoint at ``path`` was written (its directory's modification time, Unix)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()


def _check_compatible(manifest: checkpoint.Manifest, layouts: Mapping[str, Any], path: pathlib.Path) -> None:
    """Every variable of the model must be in the checkpoint with the same shape and dtype."""
    problems = []
    for name, layout in layouts.items():
        saved = manifest.variables.get(name)
        if saved is None:
            problems.append(f"{name!r} is not in the checkpoint")
        elif tuple(saved.variable_shape) != tuple(layout.shape) or saved.dtype != layout.dtype:
            problems.append(
                f"{name!r} is {tuple(saved.variable_shape)} {saved.dtype} in the checkpoint but "
                f"{tuple(layout.shape)} {layout.dtype} in the model"
            )
    if problems:
        raise CheckpointError(
            f"checkpoint {path} does not match the model: {'; '.join(problems)}. Restore it into the "
            "model that wrote it, or start without it (a new checkpoint directory)"
        )


# ------------------------------------------------------------------ plain torch state_dicts


def state_dict(strategy: ParameterServerStrategy, module: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The current values of a model's variables as a plain torch state_dict, keyed
    as ``module.state_dict()`` is (buffers come from the coordinator's module).
    ShardedEmbedding tables appear as ``<name>.weight``, as an nn.Embedding would."""
    prefix, root = _root(strategy, module)
    strategy.materialize()
    pulled = strategy.client.pull([n for n in strategy.variables if n.startswith(prefix + ".") or n == prefix]).tensors
    result: dict[str, torch.Tensor] = {}
    for key, value in root.state_dict().items():
        name = f"{prefix}.{key}"
        result[key] = pulled[name] if name in pulled else value.detach().clone()
    for name, tensor in pulled.items():
        variable = strategy.variables[name]
        if variable.table is not None:
            key = name[len(prefix) + 1 :] if name != prefix else ""
            result[f"{key}.weight" if key else "weight"] = tensor
    return result


def export_state_dict(strategy: ParameterServerStrategy, path: str | os.PathLike[str], module: nn.Module | None = None) -> pathlib.Path:
    """Writes ``state_dict(strategy, module)`` atomically to ``path`` with torch.save:
    ``Net().load_state_dict(torch.load(path, weights_only=True))`` needs no paramserve."""
    return atomic_torch_save(state_dict(strategy, module), path)


def load_state_dict(strategy: ParameterServerStrategy, values: Mapping[str, torch.Tensor], module: nn.Module | None = None) -> None:
    """Sets a model's variables from a plain state_dict (e.g. pretrained weights) before
    training starts. Everything is checked first; on any mismatch nothing changes."""
    if strategy.materialized:
        raise RuntimeError("load_state_dict() sets initial values: call it before the first schedule()")
    _, root = _root(strategy, module)
    expected = root.state_dict()
    missing = sorted(set(expected) - set(values))
    unexpected = sorted(set(values) - set(expected))
    wrong = [
        f"{k}: {tuple(values[k].shape)} {values[k].dtype} given, {tuple(v.shape)} {v.dtype} expected"
        for k, v in expected.items()
        if k in values and (tuple(values[k].shape) != tuple(v.shape) or values[k].dtype != v.dtype)
    ]
    if missing or unexpected or wrong:
        details = []
        if missing:
            details.append(f"missing keys {missing}")
        if unexpected:
            details.append(f"unexpected keys {unexpected}")
        if wrong:
            details.append("; ".join(wrong))
        raise ValueError(
            f"state_dict does not match {type(root).__name__}: {'; '.join(details)}. Load a state_dict "
            "saved from this model class (export_state_dict writes one)"
        )
    root.load_state_dict(values)


def _root(strategy: ParameterServerStrategy, module: nn.Module | None) -> tuple[str, nn.Module]:
    roots = strategy.roots
    if module is None:
        if len(roots) != 1:
            raise ValueError(f"the strategy holds {len(roots)} models; say which one with module=")
        return roots[0]
    for prefix, root in roots:
        if root is module:
            return prefix, root
    raise ValueError(f"{type(module).__name__} was not built inside this strategy's scope()")
