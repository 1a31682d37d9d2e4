"""What join() promises, as TensorFlow's ClusterCoordinator does (issue 22, items 2, 6 and 7).

- join() raises a closure's error only once nothing scheduled before it runs any more: the
  closures in flight are cancelled on their workers (each stops before its next push) and
  waited for, so none pushes after the error is raised.
- A closure put back while the error is being raised (its worker died) is cancelled, never
  run again after join() raised.
- join() and fetch() are barriers for reads: a closure scheduled after them sees every update
  that finished before them, even though workers may otherwise start a closure from values
  their own last push read back (``max_value_age``).

Real processes on 127.0.0.1 (LocalCluster); closures signal through files in the test's
directory, and the test waits on them with deadlines.
"""

from __future__ import annotations

import os
import pathlib
import sys
import threading
import time

import cloudpickle
import pytest
import torch
from torch import nn

from paramserve.coordinator.cluster_coordinator import ClusterCoordinator
from paramserve.coordinator.errors import ClosureCancelledError, ClosureError
from paramserve.coordinator.remote_value import RemoteValueState
from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules

DEADLINE = 60.0
pytestmark = pytest.mark.timeout(240)


class StepError(Exception):
    pass


# ---------------------------------------------------------------- closures (run on workers)


def wait_for_file(path: str, deadline: float = DEADLINE) -> None:
    end = time.monotonic() + deadline
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.005)


def push_until_cancelled(model: nn.Module, optimizer, started: str) -> str:  # type: ignore[no-untyped-def]
    """Pushes a gradient again and again; only a cancellation (at a push) stops it early."""
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        optimizer.zero_grad()
        (-model.weight.sum()).backward()
        optimizer.step()
        pathlib.Path(started).touch()
    return "ran to its end: never cancelled"


def fail_after(path: str) -> None:
    wait_for_file(path)
    raise StepError("this step failed while another closure was pushing")


def long_without_pushes(marker: str) -> str:
    """Runs until its worker is killed (nothing in it can be cancelled); counts its starts."""
    with open(marker, "a") as out:
        out.write(f"{os.getpid()}\n")
    time.sleep(DEADLINE)
    return "long done"


def add_one(model: nn.Module, optimizer) -> float:  # type: ignore[no-untyped-def]
    """Reads the counter, then adds one to it on the servers."""
    seen = float(model.weight.detach().sum())
    optimizer.zero_grad()
    (-model.weight.sum()).backward()
    optimizer.step()
    return seen


def read_counter(model: nn.Module) -> float:
    return float(model.weight.detach().sum())


def ready_value() -> int:
    return 1


# ---------------------------------------------------------------- helpers


def counter_model(cluster, max_value_age: float = 0.1):  # type: ignore[no-untyped-def]
    strategy = ParameterServerStrategy(cluster.spec, max_value_age=max_value_age)
    with strategy.scope():
        model = nn.Linear(1, 1, bias=False)
        nn.init.zeros_(model.weight)
    return strategy, model, strategy.optimizer(torch.optim.SGD, lr=1.0)


def weight_version(strategy: ParameterServerStrategy) -> int:
    return sum(info.version for infos in strategy.client.list_shards().values() for info in infos)


# ---------------------------------------------------------------- tests


def test_join_cancels_the_closures_in_flight_before_it_raises(start_cluster, tmp_path):
    cluster = start_cluster(num_ps=1, num_workers=2)
    strategy, model, optimizer = counter_model(cluster)
    started = str(tmp_path / "pushing")
    with ClusterCoordinator(strategy) as coordinator:
        pusher = coordinator.schedule(push_until_cancelled, args=(model, optimizer, started))
        failing = coordinator.schedule(fail_after, args=(started,))  # the other worker takes it

        with pytest.raises(ClosureError, match="failed while another closure was pushing"):
            coordinator.join(timeout=DEADLINE)

        # Nothing scheduled before the error runs any more: the pusher was stopped at a push.
        assert failing.state is RemoteValueState.ABORTED
        assert pusher.state is RemoteValueState.CANCELLED
        with pytest.raises(ClosureCancelledError, match="cancelled"):
            pusher.fetch(0)
        assert coordinator.done()
        version = weight_version(strategy)
        assert version > 0
        # A closure's whole round trip later, no push of the cancelled closure has landed.
        assert coordinator.schedule(read_counter, args=(model,)).fetch(DEADLINE) == version
        assert weight_version(strategy) == version
    strategy.close()


def test_a_closure_put_back_while_the_error_is_raised_is_cancelled_not_run_again(start_cluster, tmp_path):
    cluster = start_cluster(num_ps=1, num_workers=2)
    strategy = ParameterServerStrategy(cluster.spec)
    marker = tmp_path / "long-started"
    with ClusterCoordinator(strategy) as coordinator:
        long = coordinator.schedule(long_without_pushes, args=(str(marker),))
        wait_for_file(str(marker))
        failing = coordinator.schedule(fail_after, args=(str(marker),))
        raised: list[BaseException] = []
        joiner = threading.Thread(target=lambda: _join_into(coordinator, raised), name="test-join")
        joiner.start()
        with pytest.raises(ClosureError):
            failing.fetch(DEADLINE)
        # join() waits for the long closure (it cannot be stopped before it ends) ...
        assert long.state is RemoteValueState.NOT_READY and joiner.is_alive()
        pid = int(marker.read_text().split()[0])
        worker = next(p.index for p in cluster.processes if p.pid == pid and p.role == "worker")
        cluster.kill_worker(worker)  # ... until its worker dies
        joiner.join(DEADLINE)
        assert not joiner.is_alive() and len(raised) == 1 and isinstance(raised[0], ClosureError)
        assert "failed while another closure was pushing" in str(raised[0])
        # Its retry was cancelled, not queued again behind the raised error.
        assert long.state is RemoteValueState.CANCELLED
        assert coordinator.schedule(ready_value).fetch(DEADLINE) == 1
        coordinator.join(timeout=DEADLINE)
        assert marker.read_text().split() == [str(pid)], "the cancelled closure ran again"
    strategy.close()


def _join_into(coordinator: ClusterCoordinator, raised: list[BaseException]) -> None:
    try:
        coordinator.join(timeout=DEADLINE)
    except BaseException as exc:  # the test inspects what join() raised
        raised.append(exc)


@pytest.mark.parametrize("barrier", ["join", "fetch"])
def test_join_and_fetch_are_barriers_for_what_workers_read(start_cluster, barrier):
    """TF's tutorial's sequential check: one closure at a time, a barrier between each; every
    closure must see all the updates before it, whichever worker runs it."""
    cluster = start_cluster(num_ps=1, num_workers=3)
    strategy, model, optimizer = counter_model(cluster, max_value_age=60.0)  # reuse whatever it can
    with ClusterCoordinator(strategy) as coordinator:
        seen = []
        for _ in range(12):
            value = coordinator.schedule(add_one, args=(model, optimizer))
            if barrier == "join":
                coordinator.join(timeout=DEADLINE)
                seen.append(value.fetch(0))
            else:
                seen.append(coordinator.fetch(value, timeout=DEADLINE))
        assert seen == [float(i) for i in range(12)]
        assert coordinator.schedule(read_counter, args=(model,)).fetch(DEADLINE) == 12.0
    strategy.close()
