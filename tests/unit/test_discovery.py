"""Worker discovery: a DNS name's addresses are the workers (coordinator.discovery)."""

from __future__ import annotations

import threading

import pytest

from paramserve.coordinator.cluster import ClusterSpec, ClusterSpecError
from paramserve.coordinator.cluster_resolver import resolve_dns
from paramserve.coordinator.dispatch.discovery import (
    THREAD_NAME,
    DiscoveryPolicy,
    ResolutionError,
    WorkerDiscovery,
    plan_membership,
)

A, B, C = "10.0.0.1:6000", "10.0.0.2:6000", "10.0.0.3:6000"


def test_new_addresses_join_at_once() -> None:
    plan = plan_membership(10.0, frozenset({A}), frozenset({A, B, C}), {}, removal_grace=5)
    assert (plan.add, plan.remove, dict(plan.absent_since)) == ((B, C), (), {})


def test_a_missing_address_leaves_only_after_the_grace() -> None:
    first = plan_membership(10.0, frozenset({A, B}), frozenset({A}), {}, removal_grace=5)
    assert (first.remove, dict(first.absent_since)) == ((), {B: 10.0})
    later = plan_membership(14.9, frozenset({A, B}), frozenset({A}), first.absent_since, removal_grace=5)
    assert later.remove == () and "kept" in later.reason
    gone = plan_membership(15.0, frozenset({A, B}), frozenset({A}), later.absent_since, removal_grace=5)
    assert (gone.remove, dict(gone.absent_since)) == ((B,), {})


def test_an_address_back_within_the_grace_is_forgotten_as_missing() -> None:
    plan = plan_membership(12.0, frozenset({A, B}), frozenset({A, B}), {B: 10.0}, removal_grace=5)
    assert (plan.add, plan.remove, dict(plan.absent_since)) == ((), (), {})


def test_a_failed_resolution_changes_nothing() -> None:
    plan = plan_membership(99.0, frozenset({A, B}), None, {B: 10.0}, removal_grace=5)
    assert (plan.add, plan.remove, dict(plan.absent_since)) == ((), (), {B: 10.0})


class FakeMembership:
    def __init__(self) -> None:
        self.workers: set[str] = set()

    def add_worker(self, address: str, *, probe_first: bool = False) -> object:
        assert probe_first, "discovered workers are probed before their first closure"
        if address in self.workers:
            raise ValueError(address)
        self.workers.add(address)
        return None

    def remove_worker(self, address: str, timeout: float | None = None) -> None:
        self.workers.remove(address)


class FakeDns:
    def __init__(self, *addresses: str) -> None:
        self.answer: frozenset[str] | None = frozenset(addresses)

    def __call__(self, service: str) -> frozenset[str]:
        assert service == "worker:6000"
        if self.answer is None:
            raise ResolutionError("SERVFAIL")
        return self.answer


def test_discovery_keeps_membership_equal_to_the_answer_but_leaves_static_workers_alone() -> None:
    now = [0.0]
    dns, members = FakeDns(A, B), FakeMembership()
    members.workers.add(C)  # listed in the ClusterSpec
    discovery = WorkerDiscovery(
        "worker:6000",
        members,
        resolver=dns,
        static=frozenset({C}),
        policy=DiscoveryPolicy(interval=1, removal_grace=2),
        clock=lambda: now[0],
    )
    discovery.step()
    assert members.workers == {A, B, C} and discovery.members == {A, B}
    dns.answer = frozenset({A, C})  # B went away; C is static, not discovery's
    discovery.step()
    assert members.workers == {A, B, C}
    dns.answer = None  # a failed lookup does not count as "missing"
    now[0] = 5.0
    discovery.step()
    assert members.workers == {A, B, C}
    dns.answer = frozenset({A})
    discovery.step()
    assert members.workers == {A, C} and discovery.members == {A}


def test_an_address_added_by_someone_else_is_not_discoverys_to_remove() -> None:
    dns, members = FakeDns(A), FakeMembership()
    members.workers.add(A)
    discovery = WorkerDiscovery("worker:6000", members, resolver=dns, policy=DiscoveryPolicy(removal_grace=0))
    discovery.step()
    dns.answer = frozenset()
    discovery.step()
    assert members.workers == {A} and discovery.members == frozenset()


def test_the_discovery_thread_runs_rounds_and_stops() -> None:
    dns, members = FakeDns(A), FakeMembership()
    discovery = WorkerDiscovery("worker:6000", members, resolver=dns, policy=DiscoveryPolicy(interval=0.01))
    discovery.start()
    try:
        dns.answer = frozenset({A, B})
        deadline = threading.Event()
        for _ in range(500):
            if members.workers == {A, B}:
                break
            deadline.wait(0.01)
        assert members.workers == {A, B}
    finally:
        assert discovery.stop(5.0)
    assert THREAD_NAME not in [t.name for t in threading.enumerate()]


def test_resolve_dns_gives_every_address_with_the_port() -> None:
    assert "127.0.0.1:6000" in resolve_dns("localhost:6000")
    assert resolve_dns("127.0.0.1:7") == frozenset({"127.0.0.1:7"})


def test_the_cluster_spec_takes_a_worker_service_instead_of_workers() -> None:
    spec = ClusterSpec.from_env({}, environ={"PARAMSERVE_PS": "ps0:5000", "PARAMSERVE_WORKER_SERVICE": "worker:6000"})
    assert (spec.workers, spec.worker_service) == ((), "worker:6000")
    with pytest.raises(ClusterSpecError, match="worker_service"):
        ClusterSpec(("ps0:5000",), worker_service="worker")
