"""Parameter servers that fail and come back: the coordinator restores them and training goes on.

The decisions are ``coordinator.recovery_policy``'s (pure, unit-tested); this module is the
thread that acts on them. A server is suspected when a closure fails because of it (the
worker could not reach it, or it misses a variable the cluster context places on it: it
restarted empty), when a checkpoint's export finds it lost or restarted, or when the
monitor's probe (one ``ListShards`` call with ``incarnation_only``, every ``probe_interval``)
finds it unreachable ``misses_to_suspect`` times in a row or answering with a new
incarnation. A server that is connected but slow is busy, never suspected for it. Then, on
the thread ``paramserve-ps-recovery``:

1. it takes the strategy's state-change lock (a checkpoint is never taken meanwhile), pauses
   and drains dispatch (``DispatchLoop.paused``): no closure runs, and those that failed
   because of the server wait at the front of the queue;
2. the server is probed until it answers (the replacement Compose, Kubernetes or
   ``paramserve launch`` starts, at the same address or a new one under the same name), for
   up to ``replacement_timeout``;
3. what it lost is restored from the newest whole checkpoint that holds it, at the recovery
   point the policy names (``LOST_SHARDS`` by default; ``ALL`` rolls every server back), with
   the optimizer settings in force now, not the checkpoint's (the program may have changed
   the learning rate since). Its shards of dynamic embedding tables come back as the
   checkpoint holds them (the last full save and its deltas, applied in order), each row on
   the server it belongs to now. A server that lost nothing (a pause, a network blip) is left
   as it is;
4. workers drop the values they hold (a new cluster-context generation) and dispatch
   resumes: the closures put back run again. Their pushes keep their idempotency keys,
   so a push a surviving server applied before the failure is not applied twice.

Recovery thinks in shard groups, numbered as the client numbers its servers (the shards are placed
over the groups): replicated (``ps_replicas`` > 1), a group is a primary and its backups
(coordinator/recovery/replica_groups.py) and a failure is first met by a failover; unreplicated,
each server is a group of one, restored as described above. Here ``group`` is always such a
number, and a ``server`` always an address.

A server that does not come back, or that lost variables no whole checkpoint holds, fails
the queued closures with ParameterServerUnavailableError (raised by the next ``schedule`` or
``join``), naming what to do; the server stays watched, and its next restart is recovered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pathlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from paramserve.coordinator.checkpointing.checkpoint_log import CheckpointLog
from paramserve.coordinator.dispatch.closures import ClosureQueue
from paramserve.coordinator.dispatch.dispatch_loop import DispatchLoop
from paramserve.coordinator.errors import ParameterServerUnavailableError
from paramserve.coordinator.recovery.recovery_policy import (
    CheckpointFacts,
    Probe,
    ProbeResult,
    RecoveryPoint,
    RecoveryPolicy,
    RestorePlan,
    ServerWatch,
    Unrecoverable,
    judge_probe,
    lost_tables,
    lost_variables,
    plan_restore,
)
from paramserve.coordinator.recovery.replica_groups import ParameterServers
from paramserve.psserver.checkpoint import dynamic_checkpoint, shard_files
from paramserve.psserver.client.ps_client import ParameterServerClient
from paramserve.psserver.dynamic.dynamic_types import DynamicShardState, rehash
from paramserve.psserver.protocol.errors import CheckpointError, ParamServeError
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.types import ShardInfo, ShardPlacement, ShardRef, ShardState, VariableLayout

__all__ = ["ParameterServerRecovery", "RecoverableVariables", "RecoveryObserver", "RecoveryOutcome", "THREAD_NAME"]

log = logging.getLogger(__name__)

THREAD_NAME = "paramserve-ps-recovery"


class RecoveryObserver(Protocol):
    def parameter_server_recovering(self, server: str) -> None:
        """Recovery of ``server`` starts: training pauses until it is over."""

    def parameter_server_recovered(self, server: str, result: str, seconds: float) -> None:
        """One recovery ended: ``result`` is "restored", "intact", "failed-over" (a backup took
        over: ``seconds`` from the failure reported to dispatch resuming) or "failed";
        ``seconds`` from the replacement answering to dispatch resuming (0 when it never answered)."""

    def replica_rejoined(self, group: int, member: str, copied_bytes: int, seconds: float) -> None:
        """``member`` rejoined ``group`` as a backup: ``copied_bytes`` piped from the primary."""

    def replicas_in_sync(self, group: int, count: int) -> None:
        """``group`` has ``count`` replicas holding its state now (its primary included)."""


@dataclass(frozen=True)
class RecoveryOutcome:
    server: str
    result: str
    """"restored", "intact" or "failed"."""
    seconds: float
    """From the replacement answering to dispatch resuming (0 when it never answered)."""


class ParameterServerRecovery:
    """Watches the parameter servers of ``variables`` and recovers the ones that fail (see the
    module), telling ``observer`` (the coordinator's telemetry) of each recovery."""

    def __init__(
        self,
        variables: RecoverableVariables,
        *,
        queue: ClosureQueue,
        policy: RecoveryPolicy,
        observer: RecoveryObserver,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._variables = variables
        self._dispatch_loop: DispatchLoop | None = None
        self._queue = queue
        self._policy = policy
        self._observer = observer
        self._clock = clock
        self._primaries = tuple(variables.client.addresses)
        """The address serving each group: its primary (in a group of one, the server)."""
        self._watches = [ServerWatch() for _ in self._primaries]  # each group's primary, unreplicated
        self._suspect_groups: set[int] = set()
        self._groups_to_rejoin: set[int] = set()  # replicated groups with a member to copy into
        self._rejoin_copies: dict[int, threading.Thread] = {}  # groups whose copy runs now, and its thread
        self._recovering = False
        self._cond = threading.Condition()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self.recoveries: list[RecoveryOutcome] = []
        """Every recovery's outcome, in order."""
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)

    def start(self, dispatch_loop: DispatchLoop) -> None:
        """Starts watching; recoveries pause and resume ``dispatch_loop``."""
        self._dispatch_loop = dispatch_loop
        self._thread.start()

    # ---------------------------------------------------------------- from any thread

    def report(self, server: str) -> None:
        """A closure (or a checkpoint's export) failed because of parameter server ``server``
        (its address; another string: every server is suspect). Never blocks."""
        group = self._group_of(server)
        with self._cond:
            if group is not None:
                self._suspect_groups.add(group)
            else:  # e.g. "unknown": the worker could not tell which
                self._suspect_groups.update(range(len(self._primaries)))
            self._cond.notify_all()
        self._wake.set()

    def _group_of(self, server: str) -> int | None:
        """The group whose member (replicated) or primary ``server`` is; None: no group's."""
        groups = self._variables.servers.groups
        group = groups.group_of(server) if groups is not None else None
        if group is None and server in self._primaries:
            group = self._primaries.index(server)
        return group

    def settled(self, timeout: float | None = None) -> bool:
        """Waits until no server is suspected or being recovered; False at the timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._suspect_groups and not self._recovering, timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Stops the recovery thread and waits (up to ``timeout`` each) for it and for the copies
        into rejoining replicas it started: none outlives the coordinator's shutdown."""
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        with self._cond:
            copies = list(self._rejoin_copies.values())
        for copy in copies:
            copy.join(timeout)
        with self._cond:
            self._suspect_groups.clear()
            self._cond.notify_all()

    @property
    def dispatch_loop(self) -> DispatchLoop:
        assert self._dispatch_loop is not None, "start() first"
        return self._dispatch_loop

    # ---------------------------------------------------------------- the recovery thread

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._wake.wait(self._policy.probe_interval)
            self._wake.clear()
            if self._stopped.is_set():
                return
            try:
                self._probe_all()
                for group in self._take_suspect_groups():
                    if self._stopped.is_set():
                        return
                    self._recover(group)
                for group in self._take_groups_to_rejoin():
                    if self._stopped.is_set():
                        return
                    self._rejoin(group)
            except Exception:
                log.exception("parameter-server recovery failed unexpectedly")
            finally:
                with self._cond:
                    self._recovering = False
                    self._cond.notify_all()

    def _take_suspect_groups(self) -> list[int]:
        with self._cond:
            suspects = sorted(self._suspect_groups)
            self._recovering = bool(suspects)
            self._suspect_groups.clear()
            return suspects

    def _take_groups_to_rejoin(self) -> list[int]:
        with self._cond:
            rejoins = sorted(self._groups_to_rejoin)
            self._groups_to_rejoin.clear()
            return rejoins

    def _probe_all(self) -> None:
        """Suspects the groups whose probe says their server restarted or is lost (replicated: whose
        replicas changed), and notes the replicated groups with a member to rejoin."""
        if not self._variables.materialized:
            return
        groups = self._variables.servers.groups
        if groups is not None:
            failing, rejoining = groups.needs_check()
            with self._cond:
                self._suspect_groups.update(failing)
                self._groups_to_rejoin.update(rejoining)
            return
        for group in range(len(self._primaries)):
            probe = self._probe(group)
            self._watches[group], verdict = judge_probe(self._watches[group], probe, self._clock(), self._policy)
            if verdict.suspect:
                log.warning("parameter server %s is suspect: %s", self._primaries[group], verdict.reason)
                with self._cond:
                    self._suspect_groups.add(group)
            elif probe.result is ProbeResult.BUSY:
                log.info("parameter server %s: %s", self._primaries[group], verdict.reason)

    def _probe(self, group: int) -> Probe:
        """One probe of ``group``'s server. Until it has answered once, the probe also lists its
        shards: a server restarted between the variables' creation and the monitor's first answer
        would otherwise have its new, empty incarnation adopted as the one to watch, and never be
        suspected while no closure needs it."""
        first = not self._watches[group].incarnation
        found = self._variables.client.probe(group, self._policy.probe_timeout, shards=first)
        if found.incarnation is None:
            return Probe(ProbeResult.BUSY if found.reachable else ProbeResult.UNREACHABLE)
        missing = 0
        if first:
            try:
                lost, tables = self._lost_on(group, found.shards)
            except ParamServeError:  # gone again since it answered: a miss, its baseline still unset
                return Probe(ProbeResult.UNREACHABLE)
            missing = len(lost) + len(tables)
        return Probe(ProbeResult.ANSWERED, found.incarnation, missing)

    def _recover(self, group: int) -> None:
        if self._variables.servers.groups is not None:
            self._fail_over(group)
            return
        address = self._primaries[group]
        log.warning("recovering parameter server %s: training paused", address)
        self._observer.parameter_server_recovering(address)
        try:
            with self._variables.state_change():
                outcome = self._recover_paused(group)
        except TimeoutError:
            outcome = self._give_up(
                group, Unrecoverable(f"closures still ran {self._policy.replacement_timeout:g}s after it failed")
            )
        except Unrecoverable as exc:
            outcome = self._give_up(group, exc)
        self._observer.parameter_server_recovered(address, outcome.result, outcome.seconds)

    # ---------------------------------------------------------------- replicated groups

    def _fail_over(self, group: int) -> None:
        """Acts on a replicated group's failure (coordinator/recovery/replica_groups.py): a backup takes
        over, or a lost backup is dropped, and closures go on at once; when no replica holds the
        group's state, the member that answers first is restored from a checkpoint."""
        groups = self._variables.servers.groups
        assert groups is not None
        start = self._clock()
        old = self._primaries[group]
        try:
            with self._variables.state_change():
                plan = groups.check(group)
                if plan.state is None:
                    groups.take_over(group, time.monotonic() + self._policy.replacement_timeout)
                    self._moved()
                    self._recover_checkpointed(group)
                    return
                if plan.changed:
                    self._moved()
        except (ParamServeError, TimeoutError) as exc:
            log.warning("parameter-server group %d: failover not done yet (%s); trying again", group, exc)
            with self._cond:
                self._suspect_groups.add(group)  # the next round of the thread tries again
            return
        if plan.changed:
            result = "failed-over" if self._primaries[group] != old else "replica-lost"
            outcome = RecoveryOutcome(old, result, self._clock() - start)
            self.recoveries.append(outcome)  # before training resumes: whoever sees it go on sees this
        self.dispatch_loop.release_server_hold()
        if plan.changed:
            self._observer.parameter_server_recovered(old, outcome.result, outcome.seconds)
            self._observer.replicas_in_sync(group, 1 + len(plan.state.in_sync))

    def _recover_checkpointed(self, group: int) -> None:
        address = self._primaries[group]
        self._observer.parameter_server_recovering(address)
        try:
            outcome = self._recover_paused(group)
        except Unrecoverable as exc:
            outcome = self._give_up(group, exc)
        self._observer.parameter_server_recovered(address, outcome.result, outcome.seconds)

    def _rejoin(self, group: int) -> None:
        """Starts a thread that has the primary copy its shards into the members of ``group``
        that came back, while training goes on (coordinator/recovery/replica_groups.py:
        ``ReplicaGroups.rejoin``): a large copy must not hold up this thread's failovers."""
        with self._cond:
            if group in self._rejoin_copies or self._stopped.is_set():
                return
            copy = threading.Thread(target=self._copy_into, args=(group,), name=f"{THREAD_NAME}-rejoin", daemon=True)
            self._rejoin_copies[group] = copy
            copy.start()  # under the lock: stop() never joins a thread not started

    def _copy_into(self, group: int) -> None:
        groups = self._variables.servers.groups
        assert groups is not None
        try:
            done = groups.rejoin(group, self._policy.replacement_timeout)
        except (ParamServeError, TimeoutError) as exc:
            log.warning("parameter-server group %d: a rejoin failed (%s); trying again", group, exc)
            return
        finally:
            with self._cond:
                self._rejoin_copies.pop(group, None)
        for rejoined in done:
            self._observer.replica_rejoined(group, rejoined.member, rejoined.bytes, rejoined.seconds)
        if done:
            self._observer.replicas_in_sync(group, 1 + len(groups.states()[group].in_sync))

    def _moved(self) -> None:
        """The group's primary changed: the strategy's client and context follow."""
        self._variables.servers_moved()
        self._primaries = tuple(self._variables.client.addresses)

    def _give_up(self, group: int, exc: Unrecoverable) -> RecoveryOutcome:
        address = self._primaries[group]
        log.error("parameter server %s was not recovered: %s", address, exc)
        outcome = RecoveryOutcome(address, "failed", 0.0)
        self.recoveries.append(outcome)  # before the error: whoever sees it sees this too
        self._queue.abort(
            ParameterServerUnavailableError(
                server=address,
                remote_type="paramserve.ParameterServerUnavailable",
                message=str(exc),
            )
        )
        self.dispatch_loop.release_server_hold()
        return outcome

    def _recover_paused(self, group: int) -> RecoveryOutcome:
        address = self._primaries[group]
        with self.dispatch_loop.paused(self._policy.replacement_timeout):
            incarnation, infos = self._wait_for(group)
            answered = self._clock()
            lost, tables = self._lost_on(group, infos)
            plan = self._plan([*lost, *tables])
            log.warning("parameter server %s answers (incarnation %s): %s", address, incarnation[:8], plan.reason)
            self._execute(group, lost, plan)
            self._restore_tables(group, tables, plan)
            self._watches[group] = ServerWatch(incarnation)
            with self._cond:  # what closures reported meanwhile was this failure
                self._suspect_groups.discard(group)
            outcome = RecoveryOutcome(address, "intact" if plan.point is None else "restored", self._clock() - answered)
            self.recoveries.append(outcome)  # before training resumes: whoever sees it go on sees this
            self.dispatch_loop.release_server_hold()
        log.warning(
            "parameter server %s recovered (%s) in %.2fs after it answered: training resumes",
            address,
            outcome.result,
            outcome.seconds,
        )
        return outcome

    def _wait_for(self, group: int) -> tuple[str, list[ShardInfo]]:
        deadline = self._clock() + self._policy.replacement_timeout
        while not self._stopped.is_set():
            found = self._variables.client.probe(group, self._policy.probe_timeout, shards=True)
            if found.incarnation is not None:
                return found.incarnation, found.shards
            if self._clock() >= deadline:
                raise Unrecoverable(
                    f"it did not answer within {self._policy.replacement_timeout:g}s: restart it (Compose, "
                    "Kubernetes and paramserve launch do), or raise RecoveryPolicy.replacement_timeout"
                )
            self._stopped.wait(self._policy.poll_interval)
        raise Unrecoverable("the coordinator shut down while waiting for it")

    def _lost_on(self, group: int, infos: Sequence[ShardInfo]) -> tuple[dict[str, VariableLayout], list[str]]:
        """What ``group``'s server lacks of what was placed on the group: the variables missing from
        the shards it listed (``infos``), and the dynamic tables it does not hold."""
        lost = lost_variables(group, {info.ref for info in infos}, self._variables.created_layouts())
        return lost, self._lost_tables(group)

    def _lost_tables(self, group: int) -> list[str]:
        created = self._variables.created_dynamic_tables()
        if not created:
            return []
        held = self._variables.client.dynamic.stats([group]).get(group, [])
        return lost_tables({stats.ref.variable for stats in held}, created)

    def _plan(self, lost: Sequence[str]) -> RestorePlan:
        keys = {name: self._variables.checkpoint_key(name) for name in lost}
        facts = [_facts(path) for path in self._variables.checkpoints.candidates(shard_files.list_checkpoints)]
        return plan_restore(lost, keys, facts, self._policy.recovery_point)

    def _execute(self, group: int, lost: Mapping[str, VariableLayout], plan: RestorePlan) -> None:
        if plan.point is None:
            return
        if plan.point is RecoveryPoint.ALL and plan.checkpoint is not None:
            self._variables.restore_checkpoint(plan.checkpoint)
            lost = {name: layout for name, layout in lost.items() if self._variables.checkpoint_key(name) is None}
            if not lost:
                return
        states = [
            self._lost_state(name, layout, shard, plan.checkpoint)
            for name, layout in lost.items()
            for shard in layout.shards
            if shard.server == group  # a shard's server is the client's: its group
        ]
        self._variables.restore_states({group: states}, dict(lost))

    def _restore_tables(self, group: int, tables: Sequence[str], plan: RestorePlan) -> None:
        """Makes the group's shards of the dynamic tables it lost the checkpoint's, stepping with
        the optimizer settings in force now (at RecoveryPoint.ALL, ``restore_checkpoint`` did,
        with every other server's)."""
        if not tables or plan.checkpoint is None or plan.point is not RecoveryPoint.LOST_SHARDS:
            return
        try:
            states = _table_shards(plan.checkpoint, group, len(self._primaries), tables, self._variables.checkpoint_key)
        except CheckpointError as exc:
            raise Unrecoverable(f"its dynamic tables cannot be read from {plan.checkpoint}: {exc}") from exc
        live = [state.with_optimizer(self._variables.live_optimizer(state.ref.variable)) for state in states]
        self._variables.restore_dynamic({group: live})

    def _lost_state(self, name: str, layout: VariableLayout, shard: ShardPlacement, path: Path | None) -> ShardState:
        key = self._variables.checkpoint_key(name)
        if key is None or path is None:
            return self._variables.initial_state(name, layout, shard)
        rows = shard.num_rows if layout.shape else 1
        state = shard_files.load_rows(path, key, shard.row_start, rows, layout.ref(shard))
        live = self._variables.live_optimizer(name)
        return dataclasses.replace(state, optimizer=live) if live is not None else state


def _facts(path: Path) -> CheckpointFacts:
    """What a checkpoint candidate holds, for ``plan_restore``."""
    if not shard_files.is_whole(path):
        return CheckpointFacts(path, whole=False)
    manifest = shard_files.read_manifest(path)
    held = [*manifest.variables, *dynamic_checkpoint.table_names(manifest.extra)]
    return CheckpointFacts(path, whole=True, variables=frozenset(held))


def _table_shards(
    path: Path,
    group: int,
    num_groups: int,
    tables: Sequence[str],
    key_of: Callable[[str], str | None],
) -> list[DynamicShardState]:
    """Group ``group``'s shard of each of ``tables`` as checkpoint ``path`` holds them (its chain
    of deltas applied), laid out for ``num_groups`` groups; CheckpointError when unreadable."""
    keys = {name: key for name in tables if (key := key_of(name)) is not None}
    saved = dynamic_checkpoint.read_tables(path, shard_files.read_manifest(path).extra, set(keys.values()))
    states = []
    for name, key in keys.items():
        if key not in saved:
            raise CheckpointError(f"it does not hold dynamic table {key!r}")
        mine = next(state for state in rehash(saved[key], num_groups) if state.ref.shard == group)
        states.append(dataclasses.replace(mine, ref=ShardRef(name, group)))
    return states


class RecoverableVariables(Protocol):
    """What parameter-server recovery restores: a strategy's variables on the servers."""

    @property
    def client(self) -> ParameterServerClient:
        """The client of the parameter servers the variables live on (the primaries, replicated)."""

    @property
    def servers(self) -> ParameterServers:
        """The servers and, when they are replicated, their groups (coordinator/recovery/replica_groups.py)."""

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
        """Makes those shards exactly ``states_by_server`` on the servers (keyed by the client's index
        of a server: recovery passes a group's number, its primary's index); workers drop their values."""

    def restore_checkpoint(self, path: pathlib.Path) -> None:
        """Rolls every variable back to checkpoint ``path`` (RecoveryPoint.ALL), keeping the
        optimizer settings in force now."""

    def created_dynamic_tables(self) -> list[str]:
        """The dynamic embedding tables that exist on the servers (they have no layout: every
        server holds one shard of each)."""

    def restore_dynamic(self, states_by_server: Mapping[int, Sequence[DynamicShardState]]) -> None:
        """Makes those dynamic tables' shards exactly ``states_by_server`` on those servers (keyed as
        for ``restore_states``)."""

    def state_change(self) -> contextlib.AbstractContextManager[None]:
        """Held while a checkpoint is taken or a server restored: the two never overlap."""
