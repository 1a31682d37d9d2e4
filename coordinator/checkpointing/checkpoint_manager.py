"""Checkpoints written by the coordinator, and plain torch ``state_dict`` export/import.

The coordinator reads every shard (value, optimizer slots, version, idempotency
window) from the servers over RPC, with dispatch paused between closures (a
consistent cut), and writes one checkpoint with psserver.checkpoint (atomic: a
crash mid-save leaves the last good one). A checkpoint is whole or not written:
the export must hold every shard of every checkpointed variable, from servers that
did not restart during it, and a save never overlaps a parameter server's recovery
(the strategy's ``state_change`` lock); when a server was lost during the export, the
save has it recovered and exports again. A restore lays the variables out for the
*current* servers and partitioner, cuts each new shard from the saved rows, optimizer
slots included (so a checkpoint from 2 servers restores onto 3), and replaces the
servers' shards exactly (ReplaceShards), live or fresh. Everything a restore reads is checked
first (each file confined to its checkpoint and matching its SHA-256, every tensor against the
model's layout, each delta against the chain it extends, each shard as a server would check it),
so a checkpoint that does not fit raises CheckpointError before any server or worker changes.

Dynamic tables may be saved incrementally (``full_every`` > 1): between full saves, a save
holds only the rows changed since the save before it and the ids evicted since
(psserver/checkpoint/dynamic_chain.py decides; the servers answer the export). Such a checkpoint needs the
ones before it back to the last full save; pruning keeps them, and a restore reads the chain.
The servers are told a save's marks only once it is committed, so a save that fails leaves the
next one to hold its changes too.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch
from torch import nn

from paramserve.coordinator.checkpointing.checkpointed_variables import CheckpointedVariables
from paramserve.coordinator.checkpointing.dense_checkpoint import (
    DENSE_EXTRA_KEY,
    check_dense_state,
    read_checkpoint_state,
    write_checkpoint_state,
)
from paramserve.psserver.checkpoint import dynamic_checkpoint
from paramserve.psserver.checkpoint import shard_files as checkpoint
from paramserve.psserver.checkpoint.dynamic_chain import SaveDecision, SavedLink, decide_save, next_link
from paramserve.psserver.dynamic.dynamic_types import DynamicSaveMark, DynamicShardState, rehash
from paramserve.psserver.protocol.errors import CheckpointBaseMissingError, CheckpointError, ParamServeError
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.types import ShardRef, ShardState, VariableLayout
from paramserve.psserver.runtime.atomic_files import atomic_torch_save

log = logging.getLogger(__name__)
STEP_KEY = "step"
SAVE_ATTEMPTS = 3
"""Exports one save tries; between two, the servers lost during the export are recovered."""
RECOVERY_WAIT_SECONDS = 600.0
"""How long a save waits for a lost server's recovery before it tries again (at most)."""


@dataclass(frozen=True)
class ExportProblem:
    """Why an export is not a whole checkpoint, and which servers' loss explains it."""

    reason: str
    servers: tuple[str, ...]


@dataclass(frozen=True)
class Export:
    """One consistent cut: the dense shards and dynamic tables to write (named as checkpoints
    name them), the dynamic shards' marks by the servers' refs, or why it is not whole."""

    states: list[ShardState]
    tables: list[DynamicShardState]
    exported: list[DynamicShardState]
    problem: ExportProblem | None = None
    dense: dict[str, Any] | None = None
    """sync_dense: the replicated variables' state (coordinator.strategies.sync_dense)."""


def missing_shards(layouts: Mapping[str, VariableLayout], exported: Sequence[ShardRef]) -> list[tuple[int, ShardRef]]:
    """(server, shard) for each shard of ``layouts`` that ``exported`` lacks: what a server lost."""
    held = set(exported)
    return [
        (shard.server, layout.ref(shard))
        for layout in layouts.values()
        for shard in layout.shards
        if layout.ref(shard) not in held
    ]


def changed_servers(before: Sequence[str | None], after: Sequence[str | None]) -> list[int]:
    """The servers whose incarnation differs between two probes (None: it did not answer)."""
    return [i for i, (b, a) in enumerate(zip(before, after)) if b is not None and a is not None and a != b]


class CheckpointManager:
    """Saves and restores a ParameterServerStrategy's variables in ``directory``.

    Args:
        max_to_keep: checkpoints kept; older ones are deleted after a save (0 keeps all), but
            never one that a kept checkpoint needs (the base of its dynamic tables' deltas).
        full_every: dynamic tables are saved whole every ``full_every`` saves of this manager,
            and as deltas (the rows changed and the ids evicted since the save before) in
            between; 1 (the default) saves them whole every time. Dense variables are always
            saved whole.
    """

    def __init__(
        self,
        strategy: CheckpointedVariables,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int = 3,
        full_every: int = 1,
    ):
        if max_to_keep < 0:
            raise ValueError(f"max_to_keep must be >= 0, got {max_to_keep}")
        if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
            raise ValueError(f"full_every must be an int >= 1, got {full_every!r}")
        self.strategy = strategy
        self.directory = pathlib.Path(directory)
        self.max_to_keep = max_to_keep
        self.full_every = full_every
        self._last: SavedLink | None = None  # the last save committed: what a delta builds on

    @property
    def latest(self) -> pathlib.Path | None:
        return checkpoint.latest_checkpoint(self.directory) if self.directory.exists() else None

    def save(self, step: int, extra: Mapping[str, Any] | None = None) -> pathlib.Path:
        """Writes every variable with its optimizer state; returns the checkpoint's path.

        A consistent cut: the coordinator's dispatch pauses while the servers' shards are
        copied, once the closures running have finished, so every closure finished by then
        has all of its pushes in the checkpoint and none is in it by halves (values,
        optimizer slots, versions and idempotency windows agree across servers). Dispatch
        resumes before the files are written. Whole or not at all: a server lost during the
        export is recovered and the export taken again (up to SAVE_ATTEMPTS times); then
        CheckpointError says what was missing, and no checkpoint was written. With
        ``full_every`` > 1, dynamic tables may be written as deltas of the last save.
        """
        self.strategy.materialize()
        decision = self._decide()
        for attempt in range(1, SAVE_ATTEMPTS + 1):
            export = self._export(decision.since)
            if export.problem is None:
                break
            problem = export.problem
            log.warning(
                "checkpoint of step %d: export %d of %d is not whole (%s)", step, attempt, SAVE_ATTEMPTS, problem.reason
            )
            if attempt == SAVE_ATTEMPTS or not self._recovered(problem):
                raise CheckpointError(f"no checkpoint of step {step} was written: {problem.reason}")
        previous = self._last if decision.delta else None
        parent = previous.name if previous is not None and any(s.delta for s in export.tables) else None
        needs = (*previous.needs, previous.name) if previous is not None and parent is not None else ()
        try:
            path = checkpoint.save_checkpoint(
                self.directory,
                export.states,
                extra={STEP_KEY: int(step), **(extra or {})},
                keep=self.max_to_keep,
                require_whole=True,
                add_files=lambda staged: {
                    dynamic_checkpoint.EXTRA_KEY: dynamic_checkpoint.write_tables(staged, export.tables, parent),
                    **({DENSE_EXTRA_KEY: write_checkpoint_state(staged, export.dense)} if export.dense else {}),
                },
                needs=needs,
            )
        except CheckpointBaseMissingError:
            self._last = None  # its base went away: the next save is full
            raise
        self._last = next_link(previous, decision, path.name, export.exported)
        self._mark_saved(list(self._last.marks.values()))
        kind = f"delta of {parent}" if parent else "full"
        log.info(
            "checkpoint of step %d written to %s (%d shards; dynamic tables: %s)", step, path, len(export.states), kind
        )
        self.strategy.checkpoints.record(step, path, time.time())
        return path

    def _decide(self) -> SaveDecision:
        last = self._last
        whole = last is not None and checkpoint.is_whole(self.directory / last.name)
        decision = decide_save(last, self.full_every, whole)
        if self.full_every > 1:
            log.info("dynamic tables: %s save (%s)", "delta" if decision.delta else "full", decision.reason)
        return decision

    def _mark_saved(self, marks: list[DynamicSaveMark]) -> None:
        """Tells the servers the save holding them up to ``marks`` is committed (best effort:
        a server that misses it keeps more evictions, and the next delta is still right)."""
        if not marks or self.full_every <= 1:
            return
        try:
            self.strategy.client.dynamic.mark_saved(marks)
        except ParamServeError as err:
            log.warning("the servers were not told that a checkpoint was committed: %s", err)

    def _export(self, since: Mapping[ShardRef, DynamicSaveMark]) -> Export:
        """This strategy's checkpointed shards and dynamic tables' live rows (whole, or changes
        after ``since``), named without the run name, and what keeps them from being a whole
        checkpoint (None when nothing does)."""
        strategy, client = self.strategy, self.strategy.client
        with strategy.quiesced(), strategy.state_change():  # paused first: a recovery may need the drain
            layouts = {
                name: layout
                for name, layout in strategy.created_layouts().items()
                if strategy.checkpoint_key(name) is not None
            }
            dynamic = [name for name in strategy.dynamic_tables() if strategy.checkpoint_key(name) is not None]
            dense = None
            if strategy.sync_dense is not None:  # read from the workers between rounds, in this cut
                names = strategy.sync_dense.names()
                dense = strategy.sync_dense.state_for_checkpoint({n: strategy.checkpoint_key(n) or n for n in names})
            before = self._incarnations()
            try:
                exported = client.export()
                incremental = self.full_every > 1
                tables = client.dynamic.export(dynamic, incremental=incremental, since=since) if dynamic else {}
            except ParamServeError as err:
                failed = ExportProblem(f"the export failed: {err}", (err.server,) if err.server else ())
                return Export([], [], [], failed)
            after = self._incarnations()
        refs = [state.ref for states in exported.values() for state in states]
        missing = missing_shards(layouts, refs)
        restarted = changed_servers(before, after)
        if missing or restarted:
            servers = sorted({client.addresses[s] for s, _ in missing} | {client.addresses[s] for s in restarted})
            what = f"{len(missing)} shards are missing (e.g. {missing[0][1]})" if missing else "servers restarted"
            problem = ExportProblem(f"{what} on parameter servers {', '.join(servers)}", tuple(servers))
            return Export([], [], [], problem)
        keys = {name: strategy.checkpoint_key(name) for name in [*layouts, *dynamic]}
        return Export(
            [
                dataclasses.replace(state, ref=ShardRef(keys[state.ref.variable] or "", state.ref.shard))
                for states in exported.values()
                for state in states
                if state.ref.variable in keys
            ],
            [
                dataclasses.replace(state, ref=ShardRef(keys[state.ref.variable] or "", state.ref.shard))
                for states in tables.values()
                for state in states
            ],
            [state for states in tables.values() for state in states],
            dense=dense,
        )

    def _incarnations(self) -> list[str | None]:
        client = self.strategy.client
        return [client.probe(server, timeout=5.0).incarnation for server in range(len(client.addresses))]

    def _recovered(self, problem: ExportProblem) -> bool:
        """Has the servers of ``problem`` recovered; False when no coordinator recovers them."""
        coordinator = self.strategy.coordinator
        if coordinator is None or not problem.servers:
            return False
        for server in problem.servers:
            coordinator.report_parameter_server(server)
        return coordinator.parameter_servers_settled(RECOVERY_WAIT_SECONDS)

    def restore_or_initialize(self) -> int | None:
        """Restores the latest whole checkpoint onto the current servers, or, when there is
        none, creates the variables from their initial values, replacing those a run of this
        program that died before its first checkpoint left on the servers
        (``ParameterServerStrategy.initialize``). Returns the restored step (None: initialized)."""
        path = self.latest
        if path is None:
            self.strategy.initialize()
            return None
        return self.restore(path)

    def restore(self, path: str | os.PathLike[str], *, keep_live_settings: bool = False) -> int:
        """Restores ``path`` (a checkpoint, or a directory of them: its latest whole one),
        exactly: every shard of every variable of the model becomes the checkpoint's (values,
        optimizer slots, versions, idempotency windows), on live servers (training paused
        meanwhile; workers then pull) or fresh ones, for any number of servers.
        ``keep_live_settings``: the optimizers keep the hyperparameters in force now instead of
        the checkpoint's (recovery rolling back every server). Raises CheckpointError, before
        anything changes, when the checkpoint does not match the model or is not whole, and
        CheckpointBaseMissingError when it holds dynamic tables as deltas of a checkpoint that
        is gone."""
        resolved = checkpoint.resolve(pathlib.Path(path))
        missing = checkpoint.missing_bases(resolved)
        if missing:
            raise CheckpointBaseMissingError(
                f"checkpoint {resolved} holds dynamic tables as changes since {', '.join(missing)}, which "
                f"{'is' if len(missing) == 1 else 'are'} gone or not whole: restore a checkpoint whose bases are "
                "all there (a full save, or a later one), and never delete a checkpoint that a kept one needs"
            )
        problem = checkpoint.why_not_whole(resolved)
        if problem is not None:
            raise CheckpointError(
                f"checkpoint {resolved} is not whole ({problem}): restore another "
                f"one, e.g. the latest whole one of {resolved.parent}"
            )
        checkpoint.sweep_leftovers(resolved.parent)  # what interrupted saves left beside it
        manifest = checkpoint.read_manifest(resolved)
        keys = {
            name: key for name in self.strategy.variables if (key := self.strategy.checkpoint_key(name)) is not None
        }
        layouts = {name: layout for name, layout in self.strategy.plan_layouts().items() if name in keys}
        _check_compatible(manifest, {keys[name]: layout for name, layout in layouts.items()}, resolved)
        tables = self._dynamic_states(resolved, manifest, keys, keep_live_settings)
        dense = self._dense_state(resolved, manifest)
        states: dict[int, list[ShardState]] = defaultdict(list)
        for name, layout in layouts.items():
            live = self.strategy.live_optimizer(name) if keep_live_settings else None
            for shard in layout.shards:
                rows = shard.num_rows if layout.shape else 1
                state = checkpoint.load_rows(resolved, keys[name], shard.row_start, rows, layout.ref(shard))
                states[shard.server].append(dataclasses.replace(state, optimizer=live) if live is not None else state)
        with self.strategy.quiesced(), self.strategy.state_change():  # everything was checked: now apply
            self.strategy.restore_states(dict(states), layouts)
            if tables:
                self.strategy.restore_dynamic(tables)
            if dense is not None and self.strategy.sync_dense is not None:  # last: it cannot fail
                self.strategy.sync_dense.restore(dense, keys)
            self._last = None  # the servers' shards are new: the next save is full
        self.strategy.materialize()  # variables the checkpoint does not hold (none, once checked)
        step = int(manifest.extra.get(STEP_KEY, 0))
        log.info("restored step %d from %s onto %d parameter servers", step, resolved, self.strategy.cluster.num_ps())
        self.strategy.checkpoints.record(step, resolved, _written_at(resolved))
        return step

    def _dense_state(self, path: pathlib.Path, manifest: checkpoint.Manifest) -> dict[str, Any] | None:
        """sync_dense: the replicated variables' state the checkpoint holds (named by checkpoint
        key). Raises CheckpointError when it lacks one of them (a checkpoint written without
        sync_dense), its file is damaged, or a value or optimizer slot is not of the shape and
        dtype the model's variable has; a strategy without sync_dense ignores it."""
        sync_dense = self.strategy.sync_dense
        if sync_dense is None or not sync_dense.names():
            return None
        entry = manifest.extra.get(DENSE_EXTRA_KEY)
        if not isinstance(entry, Mapping) or not entry:
            raise CheckpointError(
                f"checkpoint {path} holds no replicated dense variables (written without sync_dense?): restore a "
                "checkpoint written by a strategy built like this one"
            )
        state = read_checkpoint_state(path, entry)
        key = {name: self.strategy.checkpoint_key(name) or name for name in sync_dense.names()}
        missing = [name for name in sync_dense.names() if key[name] not in state["values"]]
        if missing:
            raise CheckpointError(f"checkpoint {path} holds no state of the dense variables {missing[:3]}")
        parameters = {key[name]: self.strategy.variables[name].parameter for name in sync_dense.names()}
        check_dense_state(path, state, {k: p for k, p in parameters.items() if p is not None}, self._dense_groups(key))
        return state

    def _dense_groups(self, key: Mapping[str, str]) -> list[tuple[list[str], OptimizerSpec]] | None:
        """The workers' param groups (checkpoint keys, optimizer) as the next round gives them;
        None while the dense variables have no optimizer (the workers then keep none)."""
        assert self.strategy.sync_dense is not None
        try:
            settings = self.strategy.sync_dense.settings()
        except RuntimeError:
            return None
        if not settings.optimizer:
            return None
        cls, groups = cloudpickle.loads(settings.optimizer)  # the coordinator's own settings
        return [([key[name] for name in names], OptimizerSpec(cls.__name__, dict(kwargs))) for names, kwargs in groups]

    def _dynamic_states(
        self, path: pathlib.Path, manifest: checkpoint.Manifest, keys: Mapping[str, str], keep_live_settings: bool
    ) -> dict[int, list[DynamicShardState]]:
        """The model's dynamic tables from checkpoint ``path``, each row on the server it belongs
        to now (stepping with the optimizer settings in force now for ``keep_live_settings``);
        CheckpointError, before anything changes, for a table missing or of another dim."""
        saved = dynamic_checkpoint.read_tables(path, manifest.extra)  # whole: deltas applied
        servers = self.strategy.cluster.num_ps()
        states: dict[int, list[DynamicShardState]] = defaultdict(list)
        for name, table in self.strategy.dynamic_tables().items():
            key = keys.get(name)
            if key is None:
                continue
            if key not in saved:
                raise CheckpointError(f"checkpoint {path} does not hold dynamic table {key!r}")
            config = saved[key][0].config
            if (config.dim, config.dtype) != (table.embedding_dim, table.dtype):
                raise CheckpointError(
                    f"dynamic table {key!r} has rows of {config.dim} {config.dtype} in {path}, "
                    f"{table.embedding_dim} {table.dtype} in the model"
                )
            live = self.strategy.live_optimizer(name) if keep_live_settings else None
            for state in rehash(saved[key], servers):
                state = dataclasses.replace(state, ref=ShardRef(name, state.ref.shard)).with_optimizer(live)
                dynamic_checkpoint.check_restorable(state, path)
                states[state.ref.shard].append(state)
        return dict(states)


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
            f"model that wrote it, or start without it (a new checkpoint directory){_fusion_hint(layouts, manifest)}"
        )


def _fusion_hint(layouts: Mapping[str, Any], manifest: checkpoint.Manifest) -> str:
    """Where the model and the checkpoint differ in whether tables are fused (``fuse_tables``),
    the setting that reads the checkpoint; else nothing."""
    missing = [name for name in layouts if name not in manifest.variables]
    fused_here = any(".fused_tables." in name for name in missing)
    fused_there = any(".fused_tables." in name for name in manifest.variables if name not in layouts)
    if fused_here and not fused_there:
        return (
            "; it was written with a variable per embedding table, this model stores its tables fused: "
            "build the strategy with fuse_tables=False to restore it"
        )
    if fused_there and not fused_here:
        return (
            "; it was written with the embedding tables fused into one variable: build the strategy "
            "with fuse_tables=True (the default) to restore it"
        )
    return ""


# ------------------------------------------------------------------ plain torch state_dicts


def state_dict(strategy: CheckpointedVariables, module: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The current values of a model's variables as a plain torch state_dict, keyed
    as ``module.state_dict()`` is (buffers come from the coordinator's module).
    ShardedEmbedding tables appear as ``<name>.weight``, as an nn.Embedding would."""
    prefix, root = _root(strategy, module)
    strategy.materialize()
    names = [n for n, v in strategy.variables.items() if n.startswith(prefix + ".") or n == prefix]
    pulled = strategy.client.pull([n for n in names if not strategy.variables[n].replicated]).tensors
    if strategy.sync_dense is not None:
        strategy.sync_dense.refresh()  # the replicated variables' values: the module's own

    result: dict[str, torch.Tensor] = {}
    for key, value in root.state_dict().items():
        name = f"{prefix}.{key}"
        result[key] = pulled[name] if name in pulled else value.detach().clone()
    for name, tensor in pulled.items():
        variable = strategy.variables[name]
        for member in variable.fused:  # tables stored as one variable: each its own rows, as its own weight
            result[f"{member.path}.weight"] = tensor[member.offset : member.offset + member.table.num_embeddings]
        if variable.table is not None and not variable.fused:
            key = name[len(prefix) + 1 :] if name != prefix else ""
            result[f"{key}.weight" if key else "weight"] = tensor
    return result


def export_state_dict(
    strategy: CheckpointedVariables, path: str | os.PathLike[str], module: nn.Module | None = None
) -> pathlib.Path:
    """Writes ``state_dict(strategy, module)`` atomically to ``path`` with torch.save:
    ``Net().load_state_dict(torch.load(path, weights_only=True))`` needs no paramserve."""
    return atomic_torch_save(state_dict(strategy, module), path)


def load_state_dict(
    strategy: CheckpointedVariables, values: Mapping[str, torch.Tensor], module: nn.Module | None = None
) -> None:
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


def _root(strategy: CheckpointedVariables, module: nn.Module | None) -> tuple[str, nn.Module]:
    roots = strategy.roots
    if module is None:
        if len(roots) != 1:
            raise ValueError(f"the strategy holds {len(roots)} models; say which one with module=")
        return roots[0]
    for prefix, root in roots:
        if root is module:
            return prefix, root
    raise ValueError(f"{type(module).__name__} was not built inside this strategy's scope()")
