"""Replicated parameter servers, the coordinator's side: which server of each shard group is
primary, which backups hold its state, and what to do when one fails or comes back.

With ``ps_replicas=R`` the N servers form N/R groups: group g is servers g, g + N/R, ... (so
the first N/R servers start as the primaries). Shards are placed over the groups as they are
over servers without replication, and the workers see only the primaries: the cluster
context lists them, so every client path is the one of an unreplicated cluster. What the
servers do with a write is psserver/replication/replica.py's.

The coordinator is the one owner of every decision, each under a new epoch of the group:

- **Failover.** When the primary does not hold the group's state any more (unreachable, or
  answering with a new incarnation: it restarted empty), the first backup that does is promoted
  (``plan_group``): it becomes primary at epoch + 1, the cluster context lists it, and the
  closures put back run again there under their idempotency keys. A backup promoted holds every
  acknowledged push (the primary acknowledged only what every backup applied) and the keys of
  every push it applied, so a retried push is applied once.
- **A backup lost** (unreachable, restarted, or its primary stopped serving because a forward
  to it failed): the primary goes on alone at epoch + 1 and the backup counts as out of sync. A
  primary that stopped serving after a failed forward may hold a write a backup lacks, so every
  backup of such a primary is out of sync.
- **Rejoin** (``rejoin``): a member out of sync that answers again (same or new address under
  the same name) is emptied and becomes a *joining* backup of the group's epoch; the primary
  copies its shards into it one at a time, each under its lock, and from then on forwards that
  shard's writes to it too, so training goes on meanwhile (only the shard being copied waits).
  When the last is copied the member is in sync: the group is whole again.
- **Every replica lost**: no member holds the state; the first member that answers becomes the
  primary, empty, and the checkpoint recovery of coordinator/recovery/ps_recovery.py restores it.

The decisions (``group_servers``, ``plan_group``, ``rejoin_candidates``, ``initial_group``) are
pure and unit-tested; ``ReplicaGroups`` holds the state and makes the calls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from paramserve.psserver.client.ps_client import ClientConfig, ParameterServerClient
from paramserve.psserver.protocol.errors import ParamServeError, ServerUnavailableError
from paramserve.psserver.protocol.replica_config import ReplicaConfig, ReplicaRole
from paramserve.psserver.replication.replica_calls import MemberState, ReplicaCalls

__all__ = [
    "REPLICAS_ENV",
    "GroupPlan",
    "GroupState",
    "ParameterServers",
    "ReplicaGroups",
    "group_servers",
    "initial_group",
    "plan_group",
    "rejoin_candidates",
    "replica_count",
]

log = logging.getLogger(__name__)

REPLICAS_ENV = "PARAMSERVE_PS_REPLICAS"
FAILOVER_SECONDS = 0.5
"""How long a worker retries an unreachable server of a replicated cluster before its closure
fails and is re-routed (ClusterContext.failover_seconds): short, since a backup takes over."""


def replica_count(value: int | None, environ: Mapping[str, str]) -> int:
    """Replicas per shard group: ``value``, else ``PARAMSERVE_PS_REPLICAS``, else 1."""
    if value is None:
        text = environ.get(REPLICAS_ENV, "").strip()
        if not text:
            return 1
        if not text.isdigit():
            raise ValueError(f"{REPLICAS_ENV} must be a whole number >= 1, got {text!r}")
        value = int(text)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ps_replicas must be a whole number >= 1, got {value!r}")
    return value


def group_servers(servers: Sequence[str], replicas: int) -> tuple[tuple[str, ...], ...]:
    """The shard groups of ``servers``: group g is servers g, g + G, g + 2G, ... (G groups)."""
    if replicas < 1 or len(servers) % replicas:
        raise ValueError(
            f"{len(servers)} parameter servers cannot form groups of {replicas} replicas: list a multiple of "
            f"{replicas} servers, or set ps_replicas to a divisor of {len(servers)}"
        )
    count = len(servers) // replicas
    return tuple(tuple(servers[g + j * count] for j in range(replicas)) for g in range(count))


@dataclass(frozen=True)
class GroupState:
    """What the coordinator knows of one group: its members, its primary, the backups that hold
    the primary's state (in forwarding order), its epoch, and each member's incarnation when it
    was last known to hold that state."""

    members: tuple[str, ...]
    primary: str
    in_sync: tuple[str, ...] = ()
    epoch: int = 1
    incarnations: Mapping[str, str] = field(default_factory=dict)

    def configs(self) -> dict[str, ReplicaConfig]:
        """What each member in the group is told at this epoch (backups first, then the primary)."""
        configs = {backup: ReplicaConfig(self.epoch, ReplicaRole.BACKUP) for backup in self.in_sync}
        configs[self.primary] = ReplicaConfig(self.epoch, ReplicaRole.PRIMARY, self.in_sync)
        return configs


@dataclass(frozen=True)
class GroupPlan:
    """``plan_group``'s decision: the group as it goes on (None: no member holds its state) and why."""

    state: GroupState | None
    changed: bool
    reason: str


def _holds_state(state: GroupState, member: str, probes: Mapping[str, MemberState]) -> bool:
    """Whether ``member`` still holds what it held when last in sync: it answers with the same
    incarnation, or it is too busy to answer (there, and holding its shards)."""
    probe = probes.get(member)
    if probe is None:
        return False
    if not probe.answered:
        return probe.busy
    return probe.incarnation == state.incarnations.get(member)


def plan_group(state: GroupState, probes: Mapping[str, MemberState]) -> GroupPlan:
    """The group after its members answered ``probes`` (see the module): the primary kept if it
    holds the state, else the first in-sync backup that does promoted; backups that lost it, or
    whose primary stopped serving after a failed forward, dropped. A change takes a new epoch."""
    if _holds_state(state, state.primary, probes):
        stopped = probes[state.primary].refusing if probes[state.primary].answered else ""
        backups = () if stopped else tuple(b for b in state.in_sync if _holds_state(state, b, probes))
        if backups == state.in_sync and not stopped:
            return GroupPlan(state, False, "every replica in sync answers")
        why = f"primary {state.primary} stopped serving ({stopped})" if stopped else "a backup was lost"
        dropped = [b for b in state.in_sync if b not in backups]
        reason = f"{why}: it goes on with backups {list(backups)}, {dropped} out of sync"
        return GroupPlan(replace(state, in_sync=backups, epoch=state.epoch + 1), True, reason)
    candidates = [b for b in state.in_sync if _holds_state(state, b, probes)]
    if not candidates:
        return GroupPlan(None, True, f"primary {state.primary} lost and no backup holds its state")
    promoted = candidates[0]
    # Other backups may lack a write the old primary forwarded to the promoted one only: rejoin them.
    reason = f"primary {state.primary} lost: backup {promoted} takes over"
    return GroupPlan(replace(state, primary=promoted, in_sync=(), epoch=state.epoch + 1), True, reason)


def rejoin_candidates(state: GroupState, probes: Mapping[str, MemberState]) -> list[str]:
    """Members out of sync that answer: each can be copied into and become a backup."""
    return [
        member
        for member in state.members
        if member != state.primary and member not in state.in_sync and probes.get(member, _GONE).answered
    ]


def initial_group(members: Sequence[str], probes: Mapping[str, MemberState]) -> GroupState:
    """The group a coordinator starts with. Servers never configured: the first member is primary,
    the others its backups, at epoch 1. Servers a previous coordinator configured (a restart):
    the primary of the highest epoch that still serves stays primary, with the backups of its
    epoch that answer; the epoch goes past every member's."""
    epoch = max((p.config.epoch for p in probes.values() if p.answered), default=0) + 1
    answering = {m: p for m, p in probes.items() if p.answered}
    primaries = [
        (p.config.epoch, m) for m, p in answering.items() if p.config.role is ReplicaRole.PRIMARY and not p.refusing
    ]
    incarnations = {m: p.incarnation for m, p in answering.items()}
    if not primaries:
        return GroupState(tuple(members), members[0], tuple(members[1:]), epoch, incarnations)
    primary_epoch, primary = max(primaries)
    serving = answering[primary].config
    backups = tuple(
        b
        for b in serving.backups
        if b in answering
        and b not in serving.joining  # a copy the last coordinator left unfinished: it rejoins afresh
        and answering[b].config == ReplicaConfig(primary_epoch, ReplicaRole.BACKUP)
    )
    return GroupState(tuple(members), primary, backups, epoch, incarnations)


_GONE = MemberState(answered=False)


# ---------------------------------------------------------------- the state


@dataclass(frozen=True)
class Rejoined:
    group: int
    member: str
    bytes: int
    seconds: float


class ReplicaGroups:
    """The groups of a replicated cluster and the calls that change them. Thread-safe (one
    change at a time)."""

    def __init__(self, members_by_group: Sequence[Sequence[str]], calls: ReplicaCalls, *, probe_timeout: float = 0.5):
        self._members = [tuple(members) for members in members_by_group]
        self._calls = calls
        self._probe_timeout = probe_timeout
        self._lock = threading.RLock()
        self._states: list[GroupState] | None = None

    @property
    def replicas(self) -> int:
        return len(self._members[0])

    def members(self) -> tuple[str, ...]:
        return tuple(member for members in self._members for member in members)

    def establish(self, wait: float) -> None:
        """Configures every group (once): fresh servers get their roles at epoch 1; a restarted
        coordinator keeps the primaries that serve, and rejoins the others later. Waits up to
        ``wait`` seconds for every server to answer (they may still be starting)."""
        with self._lock:
            if self._states is not None:
                return
            deadline = time.monotonic() + wait
            states = []
            for members in self._members:
                probes = self._probe(members)
                while not all(probe.answered for probe in probes.values()):
                    if time.monotonic() >= deadline:
                        silent = [m for m in members if not probes[m].answered]
                        raise ServerUnavailableError(
                            f"parameter servers {silent} did not answer within {wait:g}s: start them first "
                            "(a replicated cluster configures every server before training)"
                        )
                    time.sleep(0.2)
                    probes = self._probe(members)
                state = initial_group(members, probes)
                self._apply(state)
                states.append(state)
            self._states = states

    def primaries(self) -> tuple[str, ...]:
        """The primary of each group: the servers the cluster context lists."""
        with self._lock:
            if self._states is None:
                return tuple(members[0] for members in self._members)
            return tuple(state.primary for state in self._states)

    def states(self) -> list[GroupState]:
        with self._lock:
            return list(self._states or ())

    def group_of(self, address: str) -> int | None:
        """The group ``address`` is a member of (None: no member)."""
        for index, members in enumerate(self._members):
            if address in members:
                return index
        return None

    def check(self, group: int) -> GroupPlan:
        """Probes ``group``'s members and acts on ``plan_group``: a promotion or a lost backup
        takes effect (a new epoch on the servers) before this returns."""
        with self._lock:
            state = self._state(group)
            probes = self._probe(state.members)
            plan = plan_group(state, probes)
            if plan.state is not None and plan.changed:
                self._apply(plan.state)
                self._set(group, plan.state)
            if plan.changed:
                log.warning("parameter-server group %d: %s", group, plan.reason)
            return plan

    def needs_check(self) -> tuple[list[int], list[int]]:
        """(groups whose replicas changed: ``check`` them, groups with a member to rejoin),
        from one probe of every member."""
        with self._lock:
            states = list(self._states or ())
        failing, rejoining = [], []
        for index, state in enumerate(states):
            probes = self._probe(state.members)
            if plan_group(state, probes).changed:
                failing.append(index)
            elif rejoin_candidates(state, probes):
                rejoining.append(index)
        return failing, rejoining

    def take_over(self, group: int, deadline: float) -> str:
        """No member holds ``group``'s state: the first member that answers by ``deadline``
        (time.monotonic) becomes its primary, empty, for the checkpoint recovery to restore."""
        with self._lock:
            state = self._state(group)
        while True:
            probes = self._probe(state.members)
            answering = [m for m in state.members if probes[m].answered]
            if answering:
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no server of group {group} ({', '.join(state.members)}) answered")
            time.sleep(0.1)
        primary = answering[0]
        incarnations = {m: probes[m].incarnation for m in answering}
        epoch = max([state.epoch, *(probes[m].config.epoch for m in answering)]) + 1
        taken = GroupState(state.members, primary, (), epoch, incarnations)
        with self._lock:
            self._apply(taken)
            self._set(group, taken)
        log.warning(
            "parameter-server group %d: no replica held its state; %s serves, from a checkpoint", group, primary
        )
        return primary

    def rejoin(self, group: int, copy_timeout: float) -> list[Rejoined]:
        """Makes every member of ``group`` that is out of sync and answers a backup again, while
        training goes on (see the module): it is told its role at the group's epoch and emptied,
        the primary adds it as a joining backup (same epoch: nobody's role changes) and copies
        its shards into it one at a time, forwarding each shard's writes to it from then on.
        The copy runs without this object's lock, so a failover of any group is decided
        meanwhile; a member whose group changed during its copy is not counted (it rejoins later)."""
        with self._lock:
            state = self._state(group)
            candidates = rejoin_candidates(state, self._probe(state.members))
        done = []
        for member in candidates:
            with self._lock:
                state = self._state(group)
                probe = self._calls.state(member, self._probe_timeout)
                if member == state.primary or member in state.in_sync or not probe.answered:
                    continue
                start = time.monotonic()
                self._calls.configure(member, ReplicaConfig(state.epoch, ReplicaRole.BACKUP))
                self._calls.wipe(member, state.epoch)
                backups = (*state.in_sync, member)
                joining = ReplicaConfig(state.epoch, ReplicaRole.PRIMARY, backups, (member,))
                self._calls.configure(state.primary, joining)
            shards, copied = self._calls.copy_into(state.primary, member, copy_timeout)
            with self._lock:
                now = self._state(group)
                if (now.primary, now.epoch, now.in_sync) != (state.primary, state.epoch, state.in_sync):
                    log.warning("parameter-server group %d changed while %s was copied into", group, member)
                    continue
                incarnations = {**now.incarnations, member: probe.incarnation}
                self._set(group, replace(now, in_sync=backups, incarnations=incarnations))
            done.append(Rejoined(group, member, copied, time.monotonic() - start))
            log.warning(
                "parameter-server group %d: %s rejoined as a backup (%d shards, %d bytes copied in %.2fs)",
                group,
                member,
                shards,
                copied,
                done[-1].seconds,
            )
        return done

    def close(self) -> None:
        self._calls.close()

    # ---------------------------------------------------------------- helpers

    def _state(self, group: int) -> GroupState:
        assert self._states is not None, "establish() first"
        return self._states[group]

    def _set(self, group: int, state: GroupState) -> None:
        assert self._states is not None
        self._states[group] = state

    def _probe(self, members: Sequence[str]) -> dict[str, MemberState]:
        return {member: self._calls.state(member, self._probe_timeout) for member in members}

    def _apply(self, state: GroupState) -> None:
        """Tells every member of ``state`` its part (backups before the primary, which forwards
        to them at once). The members out of sync that answer are made backups of the new epoch
        too (forwarded nothing): a replaced primary's last forward to one of them is refused."""
        configs = state.configs()
        for member in state.members:
            if member not in configs:
                try:
                    self._calls.configure(member, ReplicaConfig(state.epoch, ReplicaRole.BACKUP))
                except ParamServeError as exc:  # gone: nothing to fence
                    log.info("parameter-server group member %s not told epoch %d: %s", member, state.epoch, exc)
        for member, config in configs.items():
            self._calls.configure(member, config)


class ParameterServers:
    """The parameter servers as a strategy reaches them: a client of the servers that serve
    clients (each group's primary when replicated) and the groups, if any. A replicated
    cluster's groups are configured at the first use of ``client`` (a restarted coordinator
    finds which members serve then); ``move`` builds the client anew when a backup took over,
    and the old one is closed at the next move or ``close`` (a call in flight on it ends first)."""

    def __init__(self, servers: Sequence[str], replicas: int, config: ClientConfig):
        self.groups = (
            None
            if replicas == 1
            else ReplicaGroups(
                group_servers(servers, replicas),
                ReplicaCalls(
                    servers,
                    token=config.token,
                    tls=config.client_tls(),
                    max_message_bytes=config.max_message_bytes,
                ),
            )
        )
        self._client = ParameterServerClient(self.groups.primaries() if self.groups else servers, config)
        self._established = self.groups is None
        self._lock = threading.Lock()
        self._retired: ParameterServerClient | None = None

    @property
    def client(self) -> ParameterServerClient:
        """The client of the primaries (configuring the groups first, once)."""
        if not self._established:
            with self._lock:
                if not self._established and self.groups is not None:
                    self.groups.establish(self._client.config.retry_deadline)
                    self._move()
                    self._established = True
        return self._client

    @property
    def failover_seconds(self) -> float:
        """What the cluster context tells workers (0: not replicated)."""
        return FAILOVER_SECONDS if self.groups is not None else 0.0

    def move(self) -> bool:
        """A client of the primaries now, if they changed (True then)."""
        with self._lock:
            return self._move()

    def _move(self) -> bool:
        if self.groups is None or self.groups.primaries() == self._client.addresses:
            return False
        old = self._client
        self._client = ParameterServerClient(self.groups.primaries(), old.config)
        self._client.adopt_layouts(old.layouts)
        if self._retired is not None:
            self._retired.close()
        self._retired = old
        return True

    def close(self) -> None:
        self._client.close()
        if self._retired is not None:
            self._retired.close()
        if self.groups is not None:
            self.groups.close()
