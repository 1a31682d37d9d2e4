"""Workers found by name join and leave while closures run (coordinator.discovery).

The cluster names a worker service instead of listing workers; a resolver the test controls
stands in for DNS (Docker's or a Kubernetes headless Service's answer). A worker that appears
gets closures while others are busy; one that disappears mid-closure loses nothing: its
closure runs again on a worker still there, and every closure completes once.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import cloudpickle
import pytest
from coordinator_doubles import FakeStrategy, Gate, item_at_gate, tagged_items

from paramserve.coordinator.cluster import ClusterSpec
from paramserve.coordinator.cluster_coordinator import ClusterCoordinator, CoordinatorConfig
from paramserve.coordinator.dispatch.discovery import THREAD_NAME, DiscoveryPolicy
from paramserve.coordinator.dispatch.failures import FailurePolicy
from paramserve.coordinator.local_cluster import LocalCluster
from paramserve.coordinator.remote_value import RemoteValueState

cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOKEN = "elastic-secret"
DEADLINE = 60.0
SERVICE = "worker.test:6000"


class Dns:
    """What the worker service's name resolves to now."""

    def __init__(self) -> None:
        self.answer: frozenset[str] = frozenset()

    def __call__(self, service: str) -> frozenset[str]:
        assert service == SERVICE
        return self.answer


class ServiceStrategy(FakeStrategy):
    def __init__(self, cluster: LocalCluster) -> None:
        super().__init__(cluster, TOKEN)
        self.cluster = ClusterSpec(cluster.spec.parameter_servers, worker_service=SERVICE)


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(num_ps=1, num_workers=2, token=TOKEN) as local:
        yield local


@pytest.fixture
def dns() -> Dns:
    return Dns()


@pytest.fixture
def coordinator(cluster: LocalCluster, dns: Dns) -> Iterator[ClusterCoordinator]:
    dns.answer = frozenset(cluster.spec.workers[:1])
    config = CoordinatorConfig(
        policy=FailurePolicy(probe_initial_backoff=0.05, probe_max_backoff=0.5, probe_jitter=0.05),
        discovery=DiscoveryPolicy(interval=0.05, removal_grace=0.0),
    )
    with ClusterCoordinator(ServiceStrategy(cluster), config, resolver=dns) as coord:
        yield coord
    assert THREAD_NAME not in [t.name for t in threading.enumerate()]


def wait_until(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
    done = threading.Event()
    for _ in range(int(DEADLINE / 0.02)):
        if predicate():
            return
        done.wait(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_worker_that_appears_while_training_runs_gets_closures(cluster, dns, coordinator) -> None:
    assert coordinator.num_workers == 1  # resolved before the constructor returned
    iterator = iter(coordinator.create_per_worker_dataset(tagged_items))
    gate = Gate(DEADLINE)
    try:
        values = [coordinator.schedule(item_at_gate, args=(iterator, gate.address)) for _ in range(12)]
        gate.wait_for(lambda arrived: len(arrived) == 1)  # the only worker is busy, the rest queue
        dns.answer = frozenset(cluster.spec.workers)
        gate.wait_for(lambda arrived: len(set(arrived)) == 2)  # the new worker took a closure
        gate.release()
        items = coordinator.fetch(values, timeout=DEADLINE)
    finally:
        gate.close()
    assert len({incarnation for _, incarnation, _ in items}) == 2
    scrape = coordinator.telemetry.registry.get_sample_value
    assert scrape("paramserve_coordinator_worker_membership_changes_total", {"change": "joined"}) == 2
    assert scrape("paramserve_coordinator_workers", {"state": "up"}) == 2


def test_a_worker_that_disappears_mid_closure_loses_nothing(cluster, dns, coordinator) -> None:
    dns.answer = frozenset(cluster.spec.workers)
    wait_until(lambda: coordinator.num_workers == 2, "both workers")
    iterator = iter(coordinator.create_per_worker_dataset(tagged_items))
    gate = Gate(DEADLINE)
    try:
        values = [coordinator.schedule(item_at_gate, args=(iterator, gate.address)) for _ in range(20)]
        arrived = gate.wait_for(lambda arrived: len(set(arrived)) == 2)  # each worker runs one
        dns.answer = frozenset(cluster.spec.workers[:1])  # the second one's name is gone
        wait_until(lambda: coordinator.num_workers == 1, "the second worker to leave")
        gate.release()
        coordinator.join(timeout=DEADLINE)
        items = [value.fetch(DEADLINE) for value in values]
    finally:
        gate.close()
    assert {value.state for value in values} == {RemoteValueState.READY}
    assert len(arrived) == 2
    # Every closure, the interrupted one too, completed on the worker that stayed, reading its
    # own stream once each: none lost, none twice.
    assert len({(index, incarnation) for index, incarnation, _ in items}) == 1
    positions = sorted(position for _, _, position in items)
    assert positions == list(range(positions[0], positions[0] + 20))
    scrape = coordinator.telemetry.registry.get_sample_value
    assert scrape("paramserve_coordinator_worker_membership_changes_total", {"change": "left"}) == 1
