"""Workers die and come back while closures run: nothing scheduled is lost.

A worker is SIGKILLed while it runs a closure (known from a ``Gate`` the
closure checks in at); every closure still completes, the restarted worker
is used again, and its per-worker dataset is created again (a new incarnation).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import cloudpickle
import pytest
from coordinator_doubles import FakeStrategy, Gate, Item, item_at_gate, tagged_items

from paramserve.coordinator.cluster_coordinator import ClusterCoordinator, CoordinatorConfig
from paramserve.coordinator.dispatch.failures import FailurePolicy
from paramserve.coordinator.local_cluster import LocalCluster
from paramserve.coordinator.remote_value import RemoteValue, RemoteValueState

cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOKEN = "chaos-secret"
DEADLINE = 60.0
FAST_PROBES = FailurePolicy(probe_initial_backoff=0.05, probe_max_backoff=0.5, probe_jitter=0.05)


# ---------------------------------------------------------------- run on workers


def next_item(iterator: Iterator[Item]) -> Item:
    return next(iterator)


# ---------------------------------------------------------------- helpers


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(num_ps=1, num_workers=2, token=TOKEN) as local:
        yield local


@pytest.fixture
def coordinator(cluster: LocalCluster) -> Iterator[ClusterCoordinator]:
    with ClusterCoordinator(
        FakeStrategy(cluster, TOKEN), CoordinatorConfig(policy=FAST_PROBES, log_interval=2.0)
    ) as coord:
        yield coord
    assert not [t.name for t in threading.enumerate() if t.name == "paramserve-dispatch"]


def items_from_both_workers(coordinator: ClusterCoordinator, iterator: Iterator[Item]) -> dict[int, Item]:
    """One item read on each worker: two closures that wait for each other cannot share a worker.
    The second is scheduled once the first runs, so only the other worker can take it: scheduled
    together while a restarted worker was still DOWN (not yet probed), both went to the same
    worker, the first waiting there for the second for ever."""
    gate = Gate(DEADLINE)
    try:
        values = [coordinator.schedule(item_at_gate, args=(iterator, gate.address))]
        gate.wait_for(lambda arrived: len(arrived) == 1)
        values.append(coordinator.schedule(item_at_gate, args=(iterator, gate.address)))
        gate.wait_for(lambda arrived: sorted(arrived) == [0, 1])
        gate.release()
        items = coordinator.fetch(values, timeout=DEADLINE)
    finally:
        gate.close()
    return {item[0]: item for item in items}


def assert_all_ready(values: list[RemoteValue[Item]]) -> list[Item]:
    items = [v.fetch(DEADLINE) for v in values]
    assert {v.state for v in values} == {RemoteValueState.READY}
    return items


# ---------------------------------------------------------------- tests


def test_closures_survive_a_killed_worker_which_is_used_again_after_restart(cluster, coordinator):
    iterator = iter(coordinator.create_per_worker_dataset(tagged_items))
    before = items_from_both_workers(coordinator, iterator)

    gate = Gate(DEADLINE)
    try:
        values = [coordinator.schedule(item_at_gate, args=(iterator, gate.address)) for _ in range(30)]
        gate.wait_for(lambda arrived: {0, 1} <= set(arrived))  # worker 1 is running a closure
        cluster.kill_worker(1)
        gate.release()
        coordinator.join(timeout=DEADLINE)
    finally:
        gate.close()
    items = assert_all_ready(values)
    # Worker 1 died mid-closure; that closure was retried on worker 0, which read its own stream.
    assert {(w, inc) for w, inc, _ in items} == {(0, before[0][1])}
    positions = sorted(i for _, _, i in items)
    assert positions == list(range(before[0][2] + 1, before[0][2] + 31))  # each item once, none lost

    cluster.restart_worker(1)
    after = items_from_both_workers(coordinator, iterator)
    assert after[1][1] != before[1][1]  # a new process: its dataset was created again...
    assert after[1][2] == 0  # ...from the start
    assert after[0][1] == before[0][1]


def test_a_worker_restarted_between_closures_gets_its_resources_again(cluster, coordinator):
    iterator = iter(coordinator.create_per_worker_dataset(tagged_items))
    before = items_from_both_workers(coordinator, iterator)
    cluster.restart_worker(1)
    after = items_from_both_workers(coordinator, iterator)
    assert after[1][1] != before[1][1] and after[1][2] == 0
    more = [coordinator.schedule(next_item, args=(iterator,)) for _ in range(20)]
    coordinator.join(timeout=DEADLINE)
    assert len(set(assert_all_ready(more))) == 20


def test_closures_wait_while_every_worker_is_down(cluster, coordinator):
    values = [coordinator.schedule(next_item, args=(iter(coordinator.create_per_worker_dataset(tagged_items)),))]
    assert_all_ready(values)
    cluster.kill_worker(0)
    cluster.kill_worker(1)
    iterator = iter(coordinator.create_per_worker_dataset(tagged_items))
    pending = [coordinator.schedule(next_item, args=(iterator,)) for _ in range(5)]
    cluster.restart_worker(0)
    cluster.restart_worker(1)
    coordinator.join(timeout=DEADLINE)
    assert len(set(assert_all_ready(pending))) == 5
