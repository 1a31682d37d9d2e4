"""Parameter servers that fail and come back: the coordinator restores them and training goes on.

A server is suspected when a closure fails because of it (unreachable, or missing a
variable the cluster context places on it: it restarted empty) or when the monitor's
probe (one ``ListShards`` call with ``incarnation_only``, every ``probe_interval``)
finds it unreachable twice in a row or answering with a new incarnation. Then, on the
thread ``paramserve-ps-recovery``:

1. dispatch is paused and drained (``DispatchLoop.paused``): no closure runs, and those
   that failed because of the server wait at the front of the queue;
2. the server is probed until it answers (the replacement Compose, Kubernetes or
   ``paramserve launch`` starts at the same address), for up to ``replacement_timeout``;
3. what it lost is restored from the strategy's latest checkpoint, at the recovery
   point the policy names: ``LOST_SHARDS`` (the default) puts back only the variables
   the server lost (their steps since that checkpoint are lost; the other servers keep
   theirs), ``ALL`` rolls every server back to the checkpoint (a consistent model, every
   server's steps since it lost). A server that lost nothing (a pause, a network blip)
   is left as it is;
4. workers drop the values they hold (a new cluster-context generation) and dispatch
   resumes: the closures put back run again. Their pushes keep their idempotency keys,
   so a push a surviving server applied before the failure is not applied twice.

A server that does not come back, or that lost variables no checkpoint holds, fails the
queued closures with ParameterServerUnavailableError (raised by the next ``schedule``
or ``join``), naming what to do.
"""

from __future__ import annotations

import enum
import logging
import pathlib
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from paramserve.coordinator.closures import ClosureQueue
from paramserve.coordinator.dispatch import DispatchLoop
from paramserve.coordinator.errors import ParameterServerUnavailableError
from paramserve.coordinator.telemetry import CheckpointRecord
from paramserve.psserver import checkpoint
from paramserve.psserver.client import ParameterServerClient
from paramserve.psserver.types import ShardInfo, ShardRef, ShardState, VariableLayout

__all__ = ["RecoveryObserver", "RecoveryPoint", "RecoveryPolicy", "ParameterServerRecovery", "THREAD_NAME"]

log = logging.getLogger(__name__)

THREAD_NAME = "paramserve-ps-recovery"


class RecoveryPoint(enum.Enum):
    LOST_SHARDS = "lost_shards"
    """Only what the failed server lost goes back to the checkpoint; the others keep training."""
    ALL = "all"
    """Every server goes back to the checkpoint: the model is the checkpoint's, consistent."""


@dataclass(frozen=True)
class RecoveryPolicy:
    """How the coordinator recovers failed parameter servers (times in seconds)."""

    enabled: bool = True
    """False: a failed parameter server fails the closures that used it, as in TF."""
    recovery_point: RecoveryPoint = RecoveryPoint.LOST_SHARDS
    probe_interval: float = 1.0
    """How often the monitor probes every server while the variables exist."""
    probe_timeout: float = 2.0
    """Deadline of one probe; two probes in a row without an answer make a server suspect."""
    poll_interval: float = 0.25
    """How often a failed server is probed while waiting for its replacement."""
    replacement_timeout: float = 600.0
    """How long a failed server may take to come back before the closures fail."""

    def __post_init__(self) -> None:
        if min(self.probe_interval, self.probe_timeout, self.poll_interval, self.replacement_timeout) <= 0:
            raise ValueError("RecoveryPolicy intervals and timeouts must be positive")
        if not isinstance(self.recovery_point, RecoveryPoint):
            object.__setattr__(self, "recovery_point", RecoveryPoint(self.recovery_point))


class RecoveryObserver(Protocol):
    def parameter_server_recovered(self, server: str, result: str, seconds: float) -> None:
        """One recovery ended: ``result`` is "restored", "intact" or "failed"; ``seconds`` from
        the replacement answering to dispatch resuming (0 when it never answered)."""


class RecoverableStrategy(Protocol):
    """What recovery needs of a ParameterServerStrategy."""

    client: ParameterServerClient
    last_checkpoint: CheckpointRecord | None

    @property
    def materialized(self) -> bool: ...

    @property
    def variables(self) -> Mapping[str, Any]: ...

    def is_created(self, name: str) -> bool: ...

    def checkpoint_key(self, name: str) -> str: ...

    def restore_states(self, states_by_server: Mapping[int, Sequence[ShardState]],
                       layouts: Mapping[str, VariableLayout]) -> None: ...


class _Unrecoverable(Exception):
    """The server cannot be restored; the message says why and what to do."""


@dataclass(frozen=True)
class _Outcome:
    result: str
    seconds: float


class ParameterServerRecovery:
    """Watches a strategy's parameter servers and recovers the ones that fail (see the module)."""

    def __init__(
        self,
        strategy: RecoverableStrategy,
        *,
        queue: ClosureQueue,
        policy: RecoveryPolicy,
        observer: RecoveryObserver | None = None,
    ):
        self._strategy = strategy
        self._loop: DispatchLoop | None = None
        self._queue = queue
        self._policy = policy
        self.observer = observer
        self._addresses = tuple(strategy.client.addresses)
        self._suspects: set[int] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._incarnations: dict[int, str] = {}
        self._misses: dict[int, int] = defaultdict(int)
        self.recoveries: list[_Outcome] = []
        """Every recovery's result and duration (replacement answering -> dispatch resuming)."""
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)

    def start(self, loop: DispatchLoop) -> None:
        """Starts watching; recoveries pause and resume ``loop``."""
        self._loop = loop
        self._thread.start()

    # ---------------------------------------------------------------- from any thread

    def report(self, server: str) -> None:
        """A closure failed because of parameter server ``server`` (its address). Never blocks."""
        with self._lock:
            if server in self._addresses:
                self._suspects.add(self._addresses.index(server))
            else:  # e.g. "unknown": the worker could not tell which
                self._suspects.update(range(len(self._addresses)))
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def loop(self) -> DispatchLoop:
        assert self._loop is not None, "start() first"
        return self._loop

    # ---------------------------------------------------------------- the recovery thread

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._wake.wait(self._policy.probe_interval)
            self._wake.clear()
            if self._stopped.is_set():
                return
            try:
                self._probe_all()
                with self._lock:
                    suspects, self._suspects = sorted(self._suspects), set()
                for server in suspects:
                    if self._stopped.is_set():
                        return
                    self._recover(server)
            except Exception:  # noqa: BLE001 - the monitor must outlive any one failure
                log.exception("parameter-server recovery failed unexpectedly")

    def _probe_all(self) -> None:
        """Marks servers suspect that restarted (a new incarnation) or missed two probes."""
        if not self._strategy.materialized:
            return
        for server in range(len(self._addresses)):
            answer = self._strategy.client.probe(server, self._policy.probe_timeout)
            if answer is None:
                self._misses[server] += 1
                if self._misses[server] >= 2:
                    log.warning("parameter server %s missed %d probes", self._addresses[server], self._misses[server])
                    self._suspect(server)
                continue
            self._misses[server] = 0
            incarnation = answer[0]
            known = self._incarnations.setdefault(server, incarnation)
            if known != incarnation:
                log.warning("parameter server %s restarted (incarnation %s -> %s)",
                            self._addresses[server], known[:8], incarnation[:8])
                self._suspect(server)

    def _suspect(self, server: int) -> None:
        with self._lock:
            self._suspects.add(server)

    def _last_checkpoint(self) -> pathlib.Path | None:
        record = self._strategy.last_checkpoint
        return pathlib.Path(record.path) if record is not None else None

    def _recover(self, server: int) -> None:
        address = self._addresses[server]
        log.warning("recovering parameter server %s: training paused", address)
        try:
            outcome = self._recover_paused(server)
        except TimeoutError:
            return self._give_up(server, _Unrecoverable(
                f"closures still ran {self._policy.replacement_timeout:g}s after it failed"))
        except _Unrecoverable as exc:
            return self._give_up(server, exc)
        self._notify(server, outcome)

    def _give_up(self, server: int, exc: _Unrecoverable) -> None:
        address = self._addresses[server]
        log.error("parameter server %s was not recovered: %s", address, exc)
        outcome = _Outcome("failed", 0.0)
        self.recoveries.append(outcome)  # before the error: whoever sees it sees this too
        self._queue.abort(ParameterServerUnavailableError(
            server=address, remote_type="paramserve.ParameterServerUnavailable", message=str(exc),
        ))
        self.loop.release_server_hold()
        self._notify(server, outcome)

    def _notify(self, server: int, outcome: _Outcome) -> None:
        self._misses[server] = 0
        if self.observer is not None:
            self.observer.parameter_server_recovered(self._addresses[server], outcome.result, outcome.seconds)

    def _recover_paused(self, server: int) -> _Outcome:
        address = self._addresses[server]
        with self.loop.paused(self._policy.replacement_timeout):
            answer = self._wait_for(server)
            answered = time.monotonic()
            incarnation, infos = answer
            lost = self._lost_variables(server, infos)
            restarted = self._incarnations.get(server, incarnation) != incarnation
            result = "intact"
            if lost:
                self._restore(server, lost)
                result = "restored"
                log.warning("parameter server %s%s lost %d variables: restored from %s (%s)", address,
                            " restarted and" if restarted else "", len(lost), self._last_checkpoint(),
                            self._policy.recovery_point.value)
            else:
                log.warning("parameter server %s answers again and holds all its shards: nothing to restore", address)
            self._incarnations[server] = incarnation
            with self._lock:  # what closures reported meanwhile was this failure
                self._suspects.discard(server)
            outcome = _Outcome(result, time.monotonic() - answered)
            self.recoveries.append(outcome)  # before training resumes: whoever sees it go on sees this
            self.loop.release_server_hold()
        log.warning("parameter server %s recovered (%s) in %.2fs after it answered: training resumes",
                    address, result, outcome.seconds)
        return outcome

    def _wait_for(self, server: int) -> tuple[str, list[ShardInfo]]:
        deadline = time.monotonic() + self._policy.replacement_timeout
        while not self._stopped.is_set():
            answer = self._strategy.client.probe(server, self._policy.probe_timeout, shards=True)
            if answer is not None:
                return answer
            if time.monotonic() >= deadline:
                break
            self._stopped.wait(self._policy.poll_interval)
        raise _Unrecoverable(
            f"it did not answer within {self._policy.replacement_timeout:g}s: restart it at the same address "
            "(Compose and Kubernetes do; paramserve launch restarts its children), or raise "
            "RecoveryPolicy.replacement_timeout"
        )

    def _lost_variables(self, server: int, infos: Sequence[ShardInfo]) -> dict[str, VariableLayout]:
        """The strategy's variables with a shard on ``server`` that it no longer holds."""
        held = {info.ref for info in infos}
        lost: dict[str, VariableLayout] = {}
        for name, layout in self._strategy.client.layouts.items():
            if not self._strategy.is_created(name):
                continue
            if any(s.server == server and layout.ref(s) not in held for s in layout.shards):
                lost[name] = layout
        return lost

    def _restore(self, server: int, lost: Mapping[str, VariableLayout]) -> None:
        path = self._checkpoint_for(lost)
        if self._policy.recovery_point is RecoveryPoint.ALL and path is not None:
            from paramserve.coordinator.checkpoint_manager import CheckpointManager  # it imports the strategy

            CheckpointManager(self._strategy, path.parent).restore(path)  # type: ignore[arg-type]
            return
        states: list[ShardState] = []
        for name, layout in lost.items():
            variable = self._strategy.variables[name]
            for shard in layout.shards:
                if shard.server != server:
                    continue
                ref = layout.ref(shard)
                if variable.checkpointed:
                    assert path is not None
                    rows = shard.num_rows if layout.shape else 1
                    states.append(checkpoint.load_rows(path, self._strategy.checkpoint_key(name), shard.row_start,
                                                       rows, ref))
                else:
                    states.append(_initial_state(variable, layout, ref, shard.row_start, shard.num_rows))
        self._strategy.restore_states({server: states}, dict(lost))

    def _checkpoint_for(self, lost: Mapping[str, VariableLayout]) -> pathlib.Path | None:
        """The checkpoint to restore ``lost`` from (None when none of them is checkpointed)."""
        needed = [name for name in lost if self._strategy.variables[name].checkpointed]
        if not needed:
            return None
        path = self._last_checkpoint()
        if path is None or not path.exists():
            raise _Unrecoverable(
                f"it restarted without {len(needed)} variables (e.g. {needed[0]!r}) and this program saved no "
                "checkpoint to restore them from: save checkpoints while training (CheckpointManager, or fit's "
                "BackupAndRestore / ModelCheckpoint) so that a restarted parameter server can be restored"
            )
        saved = checkpoint.variables(path)
        missing = [name for name in needed if self._strategy.checkpoint_key(name) not in saved]
        if missing:
            raise _Unrecoverable(
                f"it lost variables the checkpoint {path} does not hold (e.g. {missing[0]!r}, built after it was "
                "saved): save a checkpoint after building every model"
            )
        return path


def _initial_state(variable: Any, layout: VariableLayout, ref: ShardRef, row_start: int, num_rows: int) -> ShardState:
    """A variable no checkpoint holds (a metric's state) starts again from its initial value."""
    value = variable.parameter.detach()
    if layout.shape:
        value = value[row_start : row_start + num_rows]
    return ShardState(ref, layout.shape, row_start, value.clone(), variable.optimizer)
