"""Worker discovery: the workers are whatever a DNS name resolves to, now.

A Compose service scaled with ``docker compose up --scale worker=8`` and a Kubernetes
headless Service both answer one name with every worker's address (Kubernetes: every
*ready* pod's). ``WorkerDiscovery`` resolves that name every ``interval`` seconds on its
own thread (``paramserve-discovery``) and changes the coordinator's membership: an address
that appears joins at once and gets closures as soon as its health check says it serves;
one that has been missing for
``removal_grace`` seconds leaves, and the closures it was running go back to the queue
(their ids stay the same, so the parameter servers apply none of their pushes twice).
The grace keeps a worker that restarts in place, or a DNS answer that flaps, from
being dropped and added again; meanwhile the dispatcher's own health probes handle it.

The decision is a pure function of the time, the members and the answer
(``plan_membership``); a resolution that fails (as opposed to a name with no address:
nothing runs) changes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from paramserve.coordinator.cluster_resolver import ResolutionError, Resolver, resolve_dns

__all__ = [
    "DiscoveryPolicy",
    "Membership",
    "MembershipPlan",
    "THREAD_NAME",
    "WorkerDiscovery",
    "plan_membership",
]

log = logging.getLogger(__name__)

THREAD_NAME = "paramserve-discovery"


@dataclass(frozen=True)
class DiscoveryPolicy:
    """How often the name is resolved and how long a missing worker is kept (seconds)."""

    interval: float = 5.0
    removal_grace: float = 15.0

    def __post_init__(self) -> None:
        if not self.interval > 0 or not self.removal_grace >= 0:
            raise ValueError(f"interval must be > 0 and removal_grace >= 0, got {self}")


@dataclass(frozen=True)
class MembershipPlan:
    """What to change: addresses to add and to remove, the new ``absent_since`` (address ->
    when it was first missed), and why."""

    add: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()
    absent_since: Mapping[str, float] = field(default_factory=dict)
    reason: str = ""


def plan_membership(
    now: float,
    members: frozenset[str],
    resolved: frozenset[str] | None,
    absent_since: Mapping[str, float],
    removal_grace: float,
) -> MembershipPlan:
    """Pure: ``members`` are the workers discovery added; ``resolved`` what the name gives
    now (None: the resolution failed, so nothing changes)."""
    if resolved is None:
        return MembershipPlan(absent_since=dict(absent_since), reason="the resolution failed: no change")
    missing = members - resolved
    since = {address: absent_since.get(address, now) for address in missing}
    remove = tuple(sorted(a for a, t in since.items() if now - t >= removal_grace))
    add = tuple(sorted(resolved - members))
    kept = {a: t for a, t in since.items() if a not in remove}
    reasons = []
    if add:
        reasons.append(f"{len(add)} new address(es)")
    if remove:
        reasons.append(f"{len(remove)} missing for {removal_grace:g}s or more")
    if kept:
        reasons.append(f"{len(kept)} missing for less than {removal_grace:g}s, kept")
    return MembershipPlan(add, remove, kept, "; ".join(reasons) or "no change")


class Membership(Protocol):
    """Where workers join and leave (the coordinator's DispatchLoop)."""

    def add_worker(self, address: str, *, probe_first: bool = False) -> object: ...

    def remove_worker(self, address: str, timeout: float | None = None) -> None: ...


class WorkerDiscovery:
    """Keeps ``membership`` equal to what ``service`` resolves to (see the module's docstring).

    ``static`` workers (the ones a ClusterSpec lists) are never added or removed here.
    ``step()`` runs one resolution (tests call it); ``start()`` runs it every
    ``policy.interval`` seconds on the ``paramserve-discovery`` thread until ``stop()``.
    """

    def __init__(
        self,
        service: str,
        membership: Membership,
        *,
        resolver: Resolver = resolve_dns,
        policy: DiscoveryPolicy | None = None,
        static: frozenset[str] = frozenset(),
        clock: Callable[[], float] = time.monotonic,
    ):
        self.service = service
        self.policy = policy or DiscoveryPolicy()
        self._membership = membership
        self._resolver = resolver
        self._static = static
        self._clock = clock
        self._members: set[str] = set()
        self._absent_since: Mapping[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def members(self) -> frozenset[str]:
        """The workers discovery added and has not removed."""
        return frozenset(self._members)

    def step(self) -> MembershipPlan:
        """Resolves the name once and applies the plan; returns it."""
        try:
            resolved: frozenset[str] | None = self._resolver(self.service) - self._static
        except ResolutionError as err:
            log.warning("worker service %s: %s", self.service, err)
            resolved = None
        plan = plan_membership(
            self._clock(), frozenset(self._members), resolved, self._absent_since, self.policy.removal_grace
        )
        self._absent_since = plan.absent_since
        if plan.add or plan.remove:
            log.info("worker service %s: +%s -%s (%s)", self.service, list(plan.add), list(plan.remove), plan.reason)
        for address in plan.remove:
            self._members.discard(address)
            try:
                self._membership.remove_worker(address)
            except KeyError:  # removed by someone else meanwhile
                pass
        for address in plan.add:
            try:
                # probed first: a name may resolve before its worker serves (Docker's DNS lists a
                # container while it starts); a call to it then would cost closures an attempt.
                self._membership.add_worker(address, probe_first=True)
            except ValueError:  # added by someone else meanwhile: not ours to remove later
                continue
            self._members.add(address)
        return plan

    def start(self) -> WorkerDiscovery:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> bool:
        """Stops resolving (the workers stay); returns whether the thread ended within ``timeout``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.policy.interval):
            try:
                self.step()
            except Exception:
                log.exception("worker service %s: discovery round failed", self.service)
