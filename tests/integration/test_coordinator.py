"""ClusterCoordinator against real worker processes (LocalCluster on 127.0.0.1).

Closures that must be running at a known moment block on a ``Gate``: they
connect to a socket of the test, say which worker they run on, and wait
until the test releases them. The test waits on that event with a deadline.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import cloudpickle
import pytest
from coordinator_doubles import FakeStrategy, Gate, check_in

from paramserve.coordinator.cluster_coordinator import ClusterCoordinator, CoordinatorConfig
from paramserve.coordinator.errors import (
    ClosureCancelledError,
    ClosureError,
    CoordinatorClosedError,
    OutOfRangeError,
)
from paramserve.coordinator.local_cluster import LocalCluster
from paramserve.coordinator.remote_value import RemoteValueState

# Workers cannot import this test module: send its functions by value, as a user's __main__ is.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOKEN = "integration-secret"
DEADLINE = 30.0
DISPATCH_THREAD = "paramserve-dispatch"


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(num_ps=1, num_workers=2, token=TOKEN) as local:
        yield local


@pytest.fixture
def coordinator(cluster: LocalCluster) -> Iterator[ClusterCoordinator]:
    with ClusterCoordinator(FakeStrategy(cluster, TOKEN), CoordinatorConfig(log_interval=1.0)) as coord:
        yield coord
    assert not dispatch_threads()


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate(DEADLINE)
    yield g
    g.close()


def dispatch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == DISPATCH_THREAD]


# ---------------------------------------------------------------- closures (run on workers)


def square(x: int) -> int:
    return x * x


def blocked(worker_index: int, gate_address: tuple[str, int], value: object) -> object:
    check_in(gate_address, worker_index)
    return value


class StepError(Exception):
    pass


def exploding_step(x: int) -> int:
    raise StepError(f"step {x} exploded")


def next_item(iterator: Iterator[tuple[int, int]]) -> tuple[int, int]:
    return next(iterator)


def next_item_at_gate(iterator: Iterator[tuple[int, int]], gate_address: tuple[str, int]) -> tuple[int, int]:
    item = next(iterator)
    check_in(gate_address, item[0])
    return item


def shard(ctx) -> list[tuple[int, int]]:
    return [(ctx.worker_index, i) for i in range(ctx.worker_index, 40, ctx.num_workers)]


# ---------------------------------------------------------------- tests


def test_many_closures_return_their_results(coordinator):
    values = [coordinator.schedule(square, args=(i,)) for i in range(200)]
    coordinator.join(timeout=DEADLINE)
    assert coordinator.done()
    assert coordinator.fetch(values) == [i * i for i in range(200)]
    assert all(v.state is RemoteValueState.READY for v in values)
    assert coordinator.schedule(square, kwargs={"x": 3}, steps=4).fetch(DEADLINE) == 9


def test_the_strategy_is_told_about_its_coordinator(cluster):
    strategy = FakeStrategy(cluster, TOKEN)
    with ClusterCoordinator(strategy) as coord:
        assert strategy.attached == [coord] and coord.num_workers == 2


def test_join_raises_the_users_error_and_cancels_the_queued_closures(coordinator, gate):
    worker_index = coordinator.create_per_worker_resource(lambda ctx: ctx.worker_index)
    blockers = [coordinator.schedule(blocked, args=(worker_index, gate.address, i)) for i in range(2)]
    gate.wait_for(lambda arrived: sorted(arrived) == [0, 1])  # both workers are busy
    failing = coordinator.schedule(exploding_step, args=(7,))
    queued = [coordinator.schedule(square, args=(i,)) for i in range(10)]
    gate.release_one()  # one worker frees up and takes the failing closure first

    with pytest.raises(ClosureError):
        failing.fetch(DEADLINE)
    assert [v.state for v in queued] == [RemoteValueState.CANCELLED] * 10
    gate.release()
    with pytest.raises(ClosureError) as info:
        coordinator.join(timeout=DEADLINE)

    error = info.value
    assert error.remote_type.endswith("StepError") and "step 7 exploded" in str(error)
    assert "exploding_step" in error.remote_traceback and "exploding_step" in str(error)
    assert error.closure_id == failing.closure_id and error.worker in coordinator.strategy.cluster.workers
    assert isinstance(error.remote_exception, StepError) and error.__cause__ is error.remote_exception
    assert failing.state is RemoteValueState.ABORTED
    with pytest.raises(ClosureCancelledError) as cancelled:
        queued[0].fetch()
    assert cancelled.value.__cause__ is error
    assert sorted(coordinator.fetch(blockers)) == [0, 1]
    # The error was raised once; training goes on.
    assert coordinator.schedule(square, args=(5,)).fetch(DEADLINE) == 25
    coordinator.join(timeout=DEADLINE)


def test_schedule_raises_a_pending_error(coordinator):
    failing = coordinator.schedule(exploding_step, args=(1,))
    with pytest.raises(ClosureError):
        failing.fetch(DEADLINE)
    with pytest.raises(ClosureError, match="step 1 exploded"):
        coordinator.schedule(square, args=(2,))
    assert coordinator.done()


def test_schedule_rejects_what_cannot_run_at_once(coordinator):
    with pytest.raises(TypeError, match="needs a function"):
        coordinator.schedule(42)
    with pytest.raises(TypeError, match="cannot send this to a worker"):
        coordinator.schedule(square, args=(threading.Lock(),))
    with pytest.raises(ValueError, match="steps"):
        coordinator.schedule(square, args=(1,), steps=0)
    assert coordinator.done()


def test_each_worker_reads_its_own_shard(coordinator, gate):
    iterator = iter(coordinator.create_per_worker_dataset(shard))
    # Two closures that block until both arrived must run on both workers.
    first = [coordinator.schedule(next_item_at_gate, args=(iterator, gate.address)) for _ in range(2)]
    assert sorted(gate.wait_for(lambda arrived: len(arrived) == 2)) == [0, 1]
    gate.release()
    rest = [coordinator.schedule(next_item, args=(iterator,)) for _ in range(20)]
    items = coordinator.fetch(first + rest, timeout=DEADLINE)

    assert len(set(items)) == len(items)  # nothing read twice
    assert {w for w, _ in items} == {0, 1}
    assert all(i % 2 == w for w, i in items)  # worker w reads its shard only


def test_an_exhausted_dataset_raises_out_of_range(coordinator):
    iterator = iter(coordinator.create_per_worker_dataset(lambda: range(3)))  # a dataset_fn without ctx works too
    with pytest.raises(OutOfRangeError, match="StopIteration"):  # from schedule() or join(), whichever comes first
        for _ in range(10):
            coordinator.schedule(next_item, args=(iterator,))
        coordinator.join(timeout=DEADLINE)


def test_fetch_times_out_naming_the_closure(coordinator, gate):
    worker_index = coordinator.create_per_worker_resource(lambda ctx: ctx.worker_index)
    value = coordinator.schedule(blocked, args=(worker_index, gate.address, "late"))
    with pytest.raises(TimeoutError, match=f"blocked.*{value.closure_id}"):
        value.fetch(timeout=0.05)
    assert not coordinator.done()
    gate.release()
    assert value.fetch(DEADLINE) == "late"


def test_shutdown_cancels_what_is_left_and_stops_every_thread(cluster, gate):
    coord = ClusterCoordinator(FakeStrategy(cluster, TOKEN))
    assert len(dispatch_threads()) == 1, "one dispatch thread, however many workers"
    worker_index = coord.create_per_worker_resource(lambda ctx: ctx.worker_index)
    running = [coord.schedule(blocked, args=(worker_index, gate.address, i)) for i in range(2)]
    queued = coord.schedule(square, args=(3,))
    gate.wait_for(lambda arrived: len(arrived) == 2)

    coord.shutdown()
    coord.shutdown()  # idempotent
    assert not dispatch_threads()
    assert {v.state for v in [*running, queued]} == {RemoteValueState.CANCELLED}
    with pytest.raises(CoordinatorClosedError):
        coord.schedule(square, args=(1,))


def test_a_wrong_token_fails_the_closure_without_retrying(cluster):
    with ClusterCoordinator(FakeStrategy(cluster, "wrong")) as coord:
        value = coord.schedule(square, args=(2,))
        with pytest.raises(ClosureError, match="UNAUTHENTICATED"):
            value.fetch(DEADLINE)
        with pytest.raises(ClosureError):
            coord.join(timeout=DEADLINE)


def test_a_worker_added_while_training_runs_gets_closures(start_cluster, gate):
    """The public membership API on one host: LocalCluster.add_worker starts a process,
    ClusterCoordinator.add_worker gives it closures (remove_worker takes it out again)."""
    from coordinator_doubles import item_at_gate, tagged_items

    local = start_cluster(num_ps=1, num_workers=1, token=TOKEN)
    with ClusterCoordinator(FakeStrategy(local, TOKEN)) as coord:
        iterator = iter(coord.create_per_worker_dataset(tagged_items))
        first = coord.schedule(item_at_gate, args=(iterator, gate.address))
        assert gate.wait_for(lambda arrived: len(arrived) == 1) == [0]  # the only worker is busy
        address = local.add_worker()
        assert address in local.spec.workers and coord.num_workers == 1
        coord.add_worker(address)
        second = coord.schedule(item_at_gate, args=(iterator, gate.address))
        assert sorted(gate.wait_for(lambda arrived: len(arrived) == 2)) == [0, 1], "the new worker took it"
        gate.release()
        assert (first.fetch(DEADLINE)[0], second.fetch(DEADLINE)[0]) == (0, 1) and coord.num_workers == 2
        with pytest.raises(ValueError, match="already part of the cluster"):
            coord.add_worker(address)
        coord.remove_worker(address)
        assert coord.num_workers == 1
        assert coord.schedule(item_at_gate, args=(iterator, gate.address)).fetch(DEADLINE)[0] == 0


def index_and_value(value: object) -> tuple[int, object]:
    from paramserve.coordinator import experimental_get_current_worker_index

    return experimental_get_current_worker_index(), value


def test_a_scheduled_function_knows_its_worker_and_gets_that_workers_value(coordinator):
    from paramserve.coordinator import PerWorkerValues

    per_worker = PerWorkerValues(["for worker 0", "for worker 1"])
    results = coordinator.fetch([coordinator.schedule(index_and_value, args=(per_worker,)) for _ in range(40)])
    assert {index for index, _ in results} <= {0, 1}
    assert all(value == f"for worker {index}" for index, value in results), results
