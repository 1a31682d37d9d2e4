"""Replicated parameter servers: one server's place in its shard group (primary-backup).

With ``replicas > 1`` each shard lives on a group of servers: one *primary*, which serves the
clients, and its *backups*, which serve nobody and take only the writes their primary forwards.
The primary applies a write (a push, a create, a replace, a delete, new hyperparameters), then,
still holding the locks of the shards it wrote, forwards it to every backup, which applies the
same write with the same idempotency key; only then is it acknowledged. So every acknowledged
push is on every live replica, the backups apply the pushes of each shard in the primary's
order (the shard's lock orders them), and a backup's values, optimizer slots, versions and
idempotency windows are bit for bit its primary's: the same torch.optim step on the same state
and the same gradient.

One owner decides who is primary: the coordinator (``coordinator/recovery/replica_groups.py``), which
sends each server its ``ReplicaConfig`` with an *epoch* that every decision raises. Fencing
follows from the epoch: a backup takes forwarded writes of its own epoch only, so a primary
that was replaced while cut off from the coordinator has its next forward refused, and from
then on refuses every client itself (*deposed*): it can never acknowledge a write the new
primary lacks. A primary whose forward fails for another reason (a backup gone, or too slow)
does not drop the backup on its own, which would let two primaries act when the backup is in
fact alive and promoted: it *holds*, refusing clients, until the coordinator's next epoch
says which replicas go on. A write applied here whose forward failed is not acknowledged; its
retry, under the same key, is applied once by whichever replica serves then.

The decisions are pure functions (``configure_problem``, ``client_refusal``,
``forward_refusal``); ``Replica`` holds the state and is the store's ``ReplicationSink``. The
forwarding transport is injected (``psserver/replication/replica_forwarder.py``: gRPC), so this module
imports no grpc.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from paramserve.psserver.protocol.errors import InvalidRequestError, NotPrimaryError, ParamServeError, ReplicaEpochError
from paramserve.psserver.protocol.replica_config import ReplicaConfig, ReplicaRole

if TYPE_CHECKING:
    from paramserve.psserver.protocol.types import ShardRef, ShardState
    from paramserve.psserver.store.shard_store import ShardPush
    from paramserve.psserver.store.shards import Shard

__all__ = [
    "Forwarder",
    "Replica",
    "client_refusal",
    "configure_problem",
    "forward_refusal",
]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- pure decisions


def configure_problem(current: ReplicaConfig, new: ReplicaConfig) -> str | None:
    """Why ``new`` cannot replace ``current`` (None: it can). Epochs only go up: an older
    decision arriving late (a retried call, a coordinator that did not see the newer one) must
    not undo a newer one; one epoch names one decision."""
    if new.role is not ReplicaRole.PRIMARY and new.backups:
        return f"a {new.role.value} forwards to nobody; only a primary has backups"
    if new.role is ReplicaRole.STANDALONE and new.epoch != 0:
        return "a standalone server has no epoch (0); a replicated one is a primary or a backup"
    if new.role is not ReplicaRole.STANDALONE and new.epoch < 1:
        return "a replicated server's epoch starts at 1"
    if len(set(new.backups)) != len(new.backups):
        return f"backups repeat an address: {list(new.backups)}"
    if not set(new.joining) <= set(new.backups):
        return f"joining backups {sorted(set(new.joining) - set(new.backups))} are not among the backups"
    if new.epoch < current.epoch:
        return f"epoch {new.epoch} is older than this server's epoch {current.epoch}: a newer decision stands"
    same_roles = new.role is current.role is ReplicaRole.PRIMARY  # its backups change, nobody's role
    if new.epoch == current.epoch and new != current and current.epoch > 0 and not same_roles:
        return f"epoch {new.epoch} was configured already as {_describe(current)}: each decision takes a new epoch"
    return None


def client_refusal(config: ReplicaConfig, stopped: str) -> str | None:
    """Why this server serves no client call now (None: it serves them). ``stopped``: why it
    stopped serving them itself ("" when it did not)."""
    if config.role is ReplicaRole.BACKUP:
        return f"this server is a backup (epoch {config.epoch}): its group's primary serves clients"
    return stopped or None


def forward_refusal(config: ReplicaConfig, epoch: int) -> str | None:
    """Why a write forwarded at ``epoch`` is refused here (None: it is applied)."""
    if config.role is not ReplicaRole.BACKUP:
        return (
            f"this server is the {config.role.value} of epoch {config.epoch}, not a backup: the write forwarded "
            f"at epoch {epoch} comes from a primary that was replaced"
        )
    if epoch != config.epoch:
        return f"this backup is at epoch {config.epoch}: a write forwarded at epoch {epoch} comes from another decision"
    return None


def _state_bytes(state: ShardState) -> int:
    tensors = [state.value, *state.slots.values()]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def _nothing() -> None:
    """The wait of a write that nothing was forwarded for."""


def _describe(config: ReplicaConfig) -> str:
    backups = f" of {', '.join(config.backups)}" if config.backups else ""
    return f"{config.role.value}{backups} at epoch {config.epoch}"


# ---------------------------------------------------------------- the state


class Forwarder(Protocol):
    """Sends writes to one backup, tagged with the primary's epoch; raises ReplicaEpochError when
    the backup refuses the epoch, another ParamServeError when the write did not arrive."""

    @property
    def address(self) -> str: ...

    def push(self, pushes: Sequence[ShardPush], key: str, epoch: int) -> Callable[[], None]:
        """Sends the push (in order with the pushes sent before) and returns what waits until
        the backup applied it, raising as the forward does."""

    def shards(self, states: Sequence[ShardState], replace: bool, epoch: int) -> None: ...

    def hyperparameters(self, variables: Sequence[str | None], values: Mapping[str, Any], epoch: int) -> None: ...

    def delete(self, variable: str, epoch: int) -> None: ...

    def close(self) -> None: ...


class Replica:
    """This server's place in its group, and the store's ``ReplicationSink``: what the store
    writes, a primary forwards (see the module). Thread-safe."""

    def __init__(self, forwarder: Callable[[str], Forwarder], cannot_forward: str | None = None):
        self._open_forwarder = forwarder
        self._cannot_forward = cannot_forward
        self._lock = threading.Lock()
        self._config = ReplicaConfig()
        self._stopped = ""
        self._forwarders: dict[str, Forwarder] = {}
        self._copied: dict[str, set[ShardRef]] = {}
        """Per joining backup, the shards copied into it so far (only their writes go to it)."""

    def configure(self, config: ReplicaConfig) -> ReplicaConfig:
        """Takes the coordinator's decision (ReplicaEpochError when ``configure_problem`` refuses
        it); a primary opens its forwarders to the backups it names."""
        with self._lock:
            problem = configure_problem(self._config, config)
            if problem is not None:
                raise ReplicaEpochError(problem)
            if config.backups and self._cannot_forward:
                raise InvalidRequestError(self._cannot_forward)
            self._copied = {address: set() for address in config.joining}  # a copy starts afresh
            if config == self._config:
                return config  # a retried call
            opened = {address: self._forwarders.pop(address, None) for address in config.backups}
            dropped, self._forwarders = self._forwarders, {}
            for address, forwarder in opened.items():
                self._forwarders[address] = forwarder if forwarder is not None else self._open_forwarder(address)
            self._config, self._stopped = config, ""
        for forwarder in dropped.values():
            forwarder.close()
        log.warning("replica: %s", _describe(config))
        return config

    def state(self) -> tuple[ReplicaConfig, str]:
        """The configuration and why clients are refused ("" when they are not)."""
        with self._lock:
            return self._config, client_refusal(self._config, self._stopped) or ""

    @property
    def replicated(self) -> bool:
        with self._lock:
            return self._config.role is not ReplicaRole.STANDALONE

    def admit_client(self) -> None:
        """Raises NotPrimaryError (UNAVAILABLE: the client retries, then its closure is re-routed)
        unless this server serves clients."""
        with self._lock:
            refusal = client_refusal(self._config, self._stopped)
        if refusal is not None:
            raise NotPrimaryError(refusal)

    def admit_forwarded(self, epoch: int) -> None:
        """Raises ReplicaEpochError unless this server is a backup at ``epoch``."""
        with self._lock:
            refusal = forward_refusal(self._config, epoch)
        if refusal is not None:
            raise ReplicaEpochError(refusal)

    def close(self) -> None:
        with self._lock:
            forwarders, self._forwarders = list(self._forwarders.values()), {}
        for forwarder in forwarders:
            forwarder.close()

    # ---------------------------------------------------------------- the store's sink

    def pushed(self, pushes: Sequence[ShardPush], key: str) -> Callable[[], None]:
        """The store applied ``pushes`` under ``key`` and still holds their shards' locks: they
        are sent now, in that order; the store calls what this returns once it released the
        locks, which waits until every backup applied them (or raises: not acknowledged)."""
        if not pushes:
            return _nothing
        waiters: list[tuple[str, Callable[[], None]]] = []

        def send(forwarder: Forwarder, epoch: int) -> None:
            mine = self._copied_of(forwarder.address, pushes)
            if mine:
                waiters.append((forwarder.address, forwarder.push(mine, key, epoch)))

        config = self._forward("a push", send)
        if config is None:
            return _nothing

        def wait() -> None:
            for address, waiter in waiters:
                self._settle(config, "a push", address, waiter)

        return wait

    def shards_written(self, states: Callable[[], Sequence[ShardState]], replace: bool) -> None:
        what = "a replace of shards" if replace else "a create of shards"
        copies: list[Sequence[ShardState]] = []

        def send(forwarder: Forwarder, epoch: int) -> None:
            if not copies:  # copied once, and only by a primary
                copies.append(states())
            forwarder.shards(copies[0], replace, epoch)
            with self._lock:  # a joining backup holds them now: their writes go to it
                copied = self._copied.get(forwarder.address)
                if copied is not None:
                    copied.update(state.ref for state in copies[0])

        self._forward(what, send)

    def hyperparameters_set(self, variables: Sequence[str | None], values: Mapping[str, Any]) -> None:
        self._forward(
            "new hyperparameters", lambda forwarder, epoch: forwarder.hyperparameters(variables, values, epoch)
        )

    def variable_deleted(self, variable: str) -> None:
        self._forward("a delete", lambda forwarder, epoch: forwarder.delete(variable, epoch))
        with self._lock:
            for copied in self._copied.values():
                copied.difference_update({ref for ref in copied if ref.variable == variable})

    # ---------------------------------------------------------------- a backup joining

    def copy_to(
        self, target: str, shards: Sequence[Shard], current: Callable[[ShardRef], Shard | None]
    ) -> tuple[int, int]:
        """Copies ``shards`` into joining backup ``target``, one at a time under its lock (its
        writes wait meanwhile; the others' go on), each then forwarded to ``target`` too; the
        backup is in sync once the last one is (``joining`` loses it). ``current``: the shard the
        store holds now under a ref: one deleted or replaced meanwhile (a restore, forwarded to
        ``target`` whole) is not copied. Returns the shards and bytes copied. A failure drops
        ``target`` from this primary's backups (a joining backup counts in no decision, so this
        primary goes on serving) and raises; so does a new decision of the coordinator's."""
        with self._lock:
            config = self._config
            forwarder = self._forwarders.get(target)
            if config.role is not ReplicaRole.PRIMARY or target not in config.joining or forwarder is None:
                raise InvalidRequestError(f"{target} is not a joining backup of this server ({_describe(config)})")
        count = size = 0
        try:
            for shard in shards:
                with shard.lock:
                    if current(shard.ref) is not shard:
                        continue
                    state = shard.state()
                    forwarder.shards([state], False, config.epoch)
                    with self._lock:
                        if self._config != config:
                            raise InvalidRequestError(
                                f"the coordinator reconfigured this server while it copied into {target}: "
                                f"{_describe(self._config)}"
                            )
                        self._copied.setdefault(target, set()).add(shard.ref)
                count += 1
                size += _state_bytes(state)
        except ReplicaEpochError as exc:  # the backup was told a newer epoch: this primary was replaced
            self._stop(config, f"this primary was replaced (deposed at epoch {config.epoch}): {exc.message}")
            raise
        except ParamServeError:
            self._leave(config, target)
            raise
        with self._lock:
            if self._config == config:
                self._config = replace(config, joining=tuple(a for a in config.joining if a != target))
                self._copied.pop(target, None)
        log.warning("replica: %s joined: %d shards, %d bytes copied", target, count, size)
        return count, size

    def _leave(self, config: ReplicaConfig, target: str) -> None:
        """Drops joining backup ``target`` (its copy or a forward to it failed)."""
        with self._lock:
            if self._config == config:
                self._config = replace(
                    config,
                    backups=tuple(a for a in config.backups if a != target),
                    joining=tuple(a for a in config.joining if a != target),
                )
                self._copied.pop(target, None)
        log.error("replica: joining backup %s dropped", target)

    def _copied_of(self, address: str, pushes: Sequence[ShardPush]) -> Sequence[ShardPush]:
        """The pushes that go to backup ``address``: all, unless it is joining."""
        with self._lock:
            copied = self._copied.get(address)
            if copied is None:
                return pushes
            return [push for push in pushes if push.ref in copied]

    def refuse_dynamic(self, variable: str) -> None:
        """Dynamic embedding tables are not replicated: their lookups change them (admission
        counts, new rows, recency), which a forward of the writes alone would not copy."""
        if self.replicated:
            raise InvalidRequestError(
                "dynamic embedding tables are not replicated: train them on servers with replicas=1 "
                "(checkpoints and recovery cover them)",
                variable=variable,
            )

    def _forward(self, what: str, send: Callable[[Forwarder, int], None]) -> ReplicaConfig | None:
        """Sends a write to every backup; the configuration it went out under (None: this server
        forwards nothing)."""
        with self._lock:
            config = self._config
            if config.role is not ReplicaRole.PRIMARY:
                return None
            forwarders = [(address, self._forwarders[address]) for address in config.backups]
        for address, forwarder in forwarders:
            self._settle(config, what, address, functools.partial(send, forwarder, config.epoch))
        return config

    def _settle(self, config: ReplicaConfig, what: str, address: str, action: Callable[[], None]) -> None:
        """Runs ``action`` (a send to, or a wait for, backup ``address``). A refusal of this
        primary's epoch deposes it; another failure stops it serving clients until the
        coordinator's next decision (raising NotPrimaryError), unless the backup was only
        joining: that one is dropped and this primary goes on."""
        try:
            action()
        except ReplicaEpochError as exc:
            self._stop(config, f"this primary was replaced (deposed at epoch {config.epoch}): {exc.message}")
            raise NotPrimaryError(f"{what} was not acknowledged: this server was replaced as primary") from exc
        except ParamServeError as exc:
            if address in config.joining:
                log.error("replica: forwarding %s to joining backup %s failed: %s", what, address, exc)
                self._leave(config, address)
                return
            self._stop(
                config,
                f"forwarding {what} to backup {address} failed ({type(exc).__name__}: {exc.message}); "
                "waiting for the coordinator to reconfigure the group",
            )
            raise NotPrimaryError(f"{what} was not acknowledged: backup {address} did not apply it") from exc

    def _stop(self, config: ReplicaConfig, reason: str) -> None:
        """Stops serving clients until the coordinator's next epoch (unless one came meanwhile)."""
        with self._lock:
            if self._config == config and not self._stopped:
                self._stopped = reason
                log.error("replica: %s", reason)
