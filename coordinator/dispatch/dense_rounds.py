"""Hybrid training on the coordinator: the rounds in which the workers' dense group steps.

Under ``ParameterServerStrategy(sync_dense=True)`` the dense variables are replicated on the
workers and averaged every step by an all-reduce among them (worker.dense_group), so the workers
must step together. The dispatch loop therefore runs *rounds*: it waits until every member of
the group is free, gives each member a share of the queued closures (possibly none) and sends
every member its call at once; the next round starts when every call has answered. Members
need not run the same number of steps (the group's protocol lets a finished member take part
in the others' steps), so any closure works, and a round with fewer closures than members
still completes.

The group is formed anew (a new *generation*) when its membership changes (a worker was lost,
came back or joined) or a round broke it (a member died mid-collective or timed out): the
closures of a broken round go back to the queue, and the members left form the next
generation, synchronising their state from the member that applied the most steps. The
rendezvous store of every generation is one ``RendezvousServer`` the coordinator hosts
(coordinator/dispatch/rendezvous_server.py): listening on the rendezvous host only, answering
members that prove the cluster's token, a namespace per generation. A member whose call fails
(it died, or was removed) gives the generation up there at once: the others, waiting in its
rendezvous for the lost member, fail within milliseconds instead of the group's timeout, and the
next round forms without it.

The pure decisions (``round_shares``, ``plan_generation``) have unit tests; ``DenseRounds``
holds the state they act on.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from paramserve.coordinator.dispatch.rendezvous_server import RendezvousServer
from paramserve.worker.dense.group import DenseRound, GroupSpec

log = logging.getLogger(__name__)

__all__ = [
    "DenseObserver",
    "DenseRounds",
    "DenseRoundsLink",
    "DenseSettings",
    "default_rendezvous_host",
    "plan_generation",
    "round_shares",
]


class DenseObserver(Protocol):
    """Told about the dense group (the coordinator's telemetry: metrics and the status page)."""

    def dense_group_formed(self, generation: int, members: Sequence[str]) -> None: ...

    def dense_round_finished(self, broke: bool) -> None: ...


class _NoDenseObserver:
    def dense_group_formed(self, generation: int, members: Sequence[str]) -> None:
        return None

    def dense_round_finished(self, broke: bool) -> None:
        return None


# ---------------------------------------------------------------- pure decisions


def round_shares(queued: int, members: int, per_member: int) -> list[int]:
    """How many queued closures each of ``members`` gets this round: at most ``per_member``
    each, as even as possible, the first members taking the remainder."""
    if members <= 0:
        return []
    total = min(queued, members * max(1, per_member))
    return [total // members + (1 if i < total % members else 0) for i in range(members)]


def plan_generation(current: Sequence[str] | None, members: Sequence[str], broken: bool, generation: int) -> int:
    """The generation the next round runs in: the current one while its members are the same
    and no round broke it, else the next (the group forms anew)."""
    if current is not None and list(current) == list(members) and not broken:
        return generation
    return generation + 1


def default_rendezvous_host(worker_addresses: Sequence[str]) -> str:
    """Where workers reach the coordinator's store: 127.0.0.1 when every worker is on this
    machine's loopback (a LocalCluster), else this machine's host name."""
    hosts = [address.rpartition(":")[0].strip("[]") for address in worker_addresses]
    if hosts and all(_is_loopback(host) for host in hosts):
        return "127.0.0.1"
    return socket.gethostname()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------- the rounds' state


class DenseRounds:
    """The coordinator's side of the dense group: its store, its generations, each member's
    part of a round. Called on the dispatch loop's thread, except ``read_request`` and
    ``rounds_done`` (any thread). ``token``: the cluster's; the store's members prove it."""

    def __init__(
        self,
        settings: Callable[[], DenseSettings],
        initial_state: Callable[[], bytes],
        *,
        rendezvous_host: str,
        timeout: float,
        observer: DenseObserver | None = None,
        token: str | None = None,
    ):
        self._observer: DenseObserver = observer or _NoDenseObserver()
        self._settings = settings
        self._initial_state = initial_state
        self._host = rendezvous_host
        self._token = token
        self.timeout = float(timeout)
        self._store: RendezvousServer | None = None
        self._members: tuple[str, ...] | None = None
        self._generation = 0
        self._broken = False
        self._epoch_formed = -1
        self._lock = threading.Lock()
        self._rounds_done = 0

    def store(self) -> RendezvousServer:
        """The rendezvous store, hosted on the rendezvous host at the first call."""
        if self._store is None:
            self._store = RendezvousServer(self._host, token=self._token)
            bound = self._store.bound[0]
            log.info("dense group's rendezvous store on %s (bound to %s)", self._store.address, bound)
            if _is_loopback(bound) and not _is_loopback(self._host):
                log.warning(
                    "rendezvous host %s is %s on this machine: workers elsewhere cannot reach the dense group's "
                    "store there; give ParameterServerStrategy(rendezvous_host=) this machine's address",
                    self._host,
                    bound,
                )
        return self._store

    def store_address(self) -> str:
        """The store's ``host:port``, hosting it first."""
        return self.store().address

    def member_rounds(self, members: Sequence[str]) -> list[DenseRound]:
        """Each member's part of the next round (members: worker addresses, in rank order),
        forming a new generation when needed."""
        settings = self._settings()
        broken = self._broken or settings.state_epoch != self._epoch_formed
        generation = plan_generation(self._members, members, broken, self._generation)
        initial = b""
        store = self.store()
        if generation != self._generation or self._members is None:
            self._generation, self._members, self._broken = generation, tuple(members), False
            self._epoch_formed = settings.state_epoch
            initial = self._initial_state()
            store.retire_below(generation)
            log.info("dense group %d forms with %d workers: %s", generation, len(members), ", ".join(members))
            self._observer.dense_group_formed(generation, members)
        return [
            DenseRound(
                group=GroupSpec(
                    generation, rank, len(members), store.address, _host_of(address), self.timeout, store.session
                ),
                variables=settings.variables,
                optimizer=settings.optimizer,
                state_epoch=settings.state_epoch,
                initial_state=initial,
            )
            for rank, address in enumerate(members)
        ]

    def broke(self, reason: str = "a round broke it") -> None:
        """A round broke the group (``reason``: which member, how): the next round forms it anew,
        and the store gives the current generation up now, so that members still in its
        rendezvous (waiting for one that will not come) fail at once."""
        self._broken = True
        if self._store is not None and self._members is not None:
            self._store.abort(self._generation, reason)

    def round_finished(self) -> None:
        with self._lock:
            self._rounds_done += 1
        self._observer.dense_round_finished(self._broken)

    def rounds_done(self) -> int:
        """Rounds finished so far: the dense values changed only if this did."""
        with self._lock:
            return self._rounds_done

    def read_request(self) -> DenseRound:
        """What asks a member for its dense state (it runs nothing and joins no collective)."""
        settings = self._settings()
        group = GroupSpec(self._generation, 0, 1, "unused:0", "", self.timeout)
        return DenseRound(group, settings.variables, settings.optimizer, settings.state_epoch, read_state=True)

    def close(self) -> None:
        """Stops the store (members waiting in it fail at once)."""
        store, self._store = self._store, None
        if store is not None and not store.stop():
            log.error("the dense group's rendezvous store did not stop")


class DenseRoundsLink:
    """How the strategy's replicated dense variables (strategies/sync_dense.py: ``SyncDense``,
    built with the strategy, before any coordinator) follow the rounds of the coordinator that
    runs them: the SyncDense holds one from the start, and each ClusterCoordinator made for the
    strategy, which finds it there, ``connect``s its rounds and its dispatch loop to it when it
    is built (the last one made is the one followed). Until one does, no round has finished and
    the workers' state cannot be read. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rounds: DenseRounds | None = None
        self._read_state: Callable[[float], bytes] | None = None

    def connect(self, rounds: DenseRounds, read_state: Callable[[float], bytes]) -> None:
        """A coordinator's ``rounds``, and ``read_state(timeout)``: its dispatch loop reading the
        workers' dense state between rounds (``DispatchLoop.read_dense_state``)."""
        with self._lock:
            self._rounds, self._read_state = rounds, read_state

    @property
    def connected(self) -> bool:
        with self._lock:
            return self._rounds is not None

    def rounds_done(self) -> int:
        """Rounds the connected coordinator finished so far (0 before one is connected)."""
        with self._lock:
            rounds = self._rounds
        return rounds.rounds_done() if rounds is not None else 0

    def read_state(self, timeout: float) -> bytes:
        """The dense state as a worker of the group holds it (``DispatchLoop.read_dense_state``);
        RuntimeError before a coordinator is connected."""
        with self._lock:
            read = self._read_state
        if read is None:
            raise RuntimeError("no ClusterCoordinator runs this strategy's dense rounds yet")
        return read(timeout)


def _host_of(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


@dataclass(frozen=True)
class DenseSettings:
    """What the strategy says about its replicated variables when a round is built."""

    variables: tuple[str, ...]
    optimizer: bytes
    """cloudpickle of (torch.optim class, [(variable names, keyword arguments)]): a param group
    per set of options."""
    state_epoch: int
    """Counts the strategy's restores of the dense values (a checkpoint restore)."""
