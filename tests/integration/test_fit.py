"""One fit() call trains the digits MLP under every strategy; only the strategy differs.

The parameter-server cases run on a LocalCluster of real processes (2 ps, 2 workers);
MultiWorkerMirroredStrategy runs this file as a script in two processes (gloo on 127.0.0.1).
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paramserve.coordinator.checkpointing.checkpoint_manager import CheckpointManager
from paramserve.coordinator.demos.digits import MLP, digits_split, worker_batches
from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy
from paramserve.coordinator.training.callbacks import (
    BackupAndRestore,
    Callback,
    LearningRateScheduler,
    ModelCheckpoint,
    latest_checkpoint,
)
from paramserve.coordinator.training.loops import evaluate, fit, predict
from paramserve.psserver.protocol.partition import FixedShardsPartitioner

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import the test module

LOSS = nn.CrossEntropyLoss(reduction="none")
BATCH = 64
EPOCHS, STEPS_PER_EPOCH, STEPS_PER_EXECUTION = 3, 60, 4


@dataclass
class Setup:
    strategy: Any
    model: nn.Module
    optimizer: Any
    train_data: Any


def in_process(make_strategy: Callable[[], Any]) -> Setup:
    """Model and optimizer built in the strategy's scope; the data a DataLoader of global batches."""
    x_train, y_train, _, _ = digits_split()
    strategy = make_strategy()
    torch.manual_seed(0)
    with strategy.scope():
        model = MLP(64)
        optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    data = DataLoader(
        TensorDataset(x_train, y_train),
        batch_size=BATCH,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(0),
    )
    return Setup(strategy, model, optimizer, data)


def parameter_server(cluster: Any) -> Setup:
    """Variables on the servers; the data a function that every worker runs for its shard."""
    strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=FixedShardsPartitioner(2))
    torch.manual_seed(0)
    with strategy.scope():
        model = MLP(64)
    optimizer = strategy.optimizer(torch.optim.Adam, lr=5e-3)
    return Setup(strategy, model, optimizer, functools.partial(worker_batches, batch_size=BATCH))


def default_strategy() -> Any:
    from paramserve.coordinator.strategies.base import get_strategy

    return get_strategy()


def one_device() -> Any:
    from paramserve.coordinator.strategies.mirrored import OneDeviceStrategy

    return OneDeviceStrategy("cpu")


def mirrored() -> Any:
    from paramserve.coordinator.strategies.mirrored import MirroredStrategy

    return MirroredStrategy(["cpu:0", "cpu:1"])


def central_storage() -> Any:
    from paramserve.coordinator.strategies.central_storage import CentralStorageStrategy

    return CentralStorageStrategy(["cpu:0", "cpu:1"])


STRATEGIES = [
    pytest.param("default", id="default"),
    pytest.param("one_device", id="one_device"),
    pytest.param("mirrored", id="mirrored-2-cpu"),
    pytest.param("central_storage", id="central_storage-2-cpu"),
    pytest.param("parameter_server", id="parameter_server-2ps-2workers", marks=pytest.mark.timeout(300)),
]
IN_PROCESS = {
    "default": default_strategy,
    "one_device": one_device,
    "mirrored": mirrored,
    "central_storage": central_storage,
}


class RaiseAtEpoch(Callback):
    """Fault injection: raises from on_epoch_begin of ``epoch``."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError(f"injected failure at epoch {epoch}")


class AccuracyAtBegin(Callback):
    """Evaluates the model (the variables' values) when training begins, after any restore."""

    def __init__(self, data: Any):
        self.data, self.accuracy = data, None

    def on_train_begin(self, logs=None):
        self.accuracy = evaluate(self.model, LOSS, self.data, strategy=self.state.strategy, return_dict=True)[
            "accuracy"
        ]


def make_setup(name: str, start_cluster: Callable[..., Any]) -> Setup:
    if name == "parameter_server":
        return parameter_server(start_cluster(num_ps=2, num_workers=2))
    return in_process(IN_PROCESS[name])


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_same_fit_call_trains_digits_under_every_strategy(name, start_cluster, tmp_path):
    _, _, x_test, y_test = digits_split()
    setup = make_setup(name, start_cluster)

    history = fit(
        setup.model,
        setup.optimizer,
        LOSS,
        setup.train_data,
        epochs=EPOCHS,
        steps_per_epoch=STEPS_PER_EPOCH,
        steps_per_execution=STEPS_PER_EXECUTION,
        validation_data=(x_test, y_test),
        strategy=setup.strategy,
        verbose=False,
        callbacks=[
            LearningRateScheduler(lambda epoch, lr: 5e-3 * 0.8**epoch),
            ModelCheckpoint(tmp_path / "checkpoints" / "epoch-{epoch:04d}.pt", keep=2),
            BackupAndRestore(tmp_path / "backup"),
        ],
    )

    assert history.epoch == [0, 1, 2]
    assert history.history["val_accuracy"][-1] >= 0.9
    assert history.history["lr"] == pytest.approx([5e-3, 4e-3, 3.2e-3])
    results = evaluate(setup.model, LOSS, (x_test, y_test), strategy=setup.strategy, return_dict=True)
    assert results["accuracy"] >= 0.9
    predicted = predict(setup.model, DataLoader(TensorDataset(x_test), batch_size=120), strategy=setup.strategy)
    assert float((predicted.argmax(dim=1) == y_test).float().mean()) == pytest.approx(results["accuracy"])
    assert not (tmp_path / "backup").exists(), "a completed fit deletes its backup"
    assert_checkpoints_restore(setup, tmp_path / "checkpoints")
    if isinstance(setup.strategy, ParameterServerStrategy):
        versions = {info.version for infos in setup.strategy.client.list_shards().values() for info in infos}
        assert versions == {EPOCHS * STEPS_PER_EPOCH}, "every step must be applied exactly once to every shard"
        setup.strategy.close()


def assert_checkpoints_restore(setup: Setup, directory: Any) -> None:
    latest = latest_checkpoint(directory)
    assert latest is not None and latest.endswith("epoch-0003.pt")
    assert sorted(p.name for p in directory.iterdir()) == ["checkpoint", "epoch-0002.pt", "epoch-0003.pt"]
    if isinstance(setup.strategy, ParameterServerStrategy):  # a directory with a checkpoint of every variable
        assert CheckpointManager(setup.strategy, latest).latest is not None
        return
    saved = torch.load(directory / "epoch-0003.pt", weights_only=True)
    fresh = MLP(64)
    fresh.load_state_dict(saved["model"])
    assert saved["step"] == EPOCHS * STEPS_PER_EPOCH


@pytest.mark.parametrize("make_strategy", [mirrored, central_storage], ids=["mirrored", "central_storage"])
def test_two_replicas_make_the_update_of_one_device_also_on_an_uneven_last_batch(make_strategy):
    x_train, y_train, _, _ = digits_split()
    data = DataLoader(TensorDataset(x_train[:99], y_train[:99]), batch_size=32)  # last batch: 3 rows, split 2 + 1

    def train(strategy: Any) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        with strategy.scope():
            model = MLP(16)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        fit(model, optimizer, LOSS, data, epochs=2, strategy=strategy, verbose=False)
        return model.state_dict()

    one, two = train(default_strategy()), train(make_strategy())

    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make_strategy", [one_device, mirrored, central_storage], ids=["one_device", "mirrored", "central_storage"]
)
def test_an_interrupted_fit_resumes_from_its_backup_under_in_process_strategies(make_strategy, tmp_path):
    _, _, x_test, y_test = digits_split()

    def run(extra: list[Callback]) -> Any:
        setup = in_process(make_strategy)
        return fit(
            setup.model,
            setup.optimizer,
            LOSS,
            setup.train_data,
            epochs=4,
            steps_per_epoch=25,
            validation_data=(x_test, y_test),
            strategy=setup.strategy,
            verbose=False,
            callbacks=[BackupAndRestore(tmp_path / "backup"), *extra],
        )

    first, second = AccuracyAtBegin((x_test, y_test)), AccuracyAtBegin((x_test, y_test))
    with pytest.raises(RuntimeError, match="injected failure at epoch 2"):
        run([first, RaiseAtEpoch(2)])
    history = run([second])

    assert history.epoch == [2, 3]
    assert first.accuracy < 0.5 < 0.8 <= second.accuracy, "the resumed fit must start from the backed-up weights"


@pytest.mark.timeout(300)
def test_parameter_server_fit_resumes_from_its_backup_on_a_new_cluster(start_cluster, tmp_path):
    """The coordinator fails at epoch 2; a new coordinator (new cluster, new variables) resumes there."""
    _, _, x_test, y_test = digits_split()
    backup = tmp_path / "backup"

    def run(extra: list[Callback]) -> Any:
        setup = parameter_server(start_cluster(num_ps=2, num_workers=2))
        try:
            with setup.strategy.scope():  # no strategy=: fit takes the strategy in scope
                return fit(
                    setup.model,
                    setup.optimizer,
                    LOSS,
                    setup.train_data,
                    epochs=4,
                    steps_per_epoch=40,
                    steps_per_execution=STEPS_PER_EXECUTION,
                    validation_data=(x_test, y_test),
                    verbose=False,
                    callbacks=[BackupAndRestore(backup), *extra],
                )
        finally:
            setup.strategy.close()

    first, second = AccuracyAtBegin((x_test, y_test)), AccuracyAtBegin((x_test, y_test))
    with pytest.raises(RuntimeError, match="injected failure at epoch 2"):
        run([first, RaiseAtEpoch(2)])
    assert (backup / "LATEST").exists()  # a checkpoint of every variable, written from the servers' data

    history = run([second])

    assert history.epoch == [2, 3]
    assert first.accuracy < 0.5 < 0.8 <= second.accuracy, "the resumed fit must start from the backed-up variables"
    assert not backup.exists()


# ------------------------------------------------------------------ MultiWorkerMirroredStrategy: two processes

WORLD_SIZE = 2
_CLUSTER_VARS = ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def multi_worker_rank(out_path: str, checkpoint_dir: str) -> None:
    """One rank (a child process, torchrun's environment): the same fit call as above."""
    from paramserve.coordinator.strategies.multi_worker import (
        MultiWorkerMirroredStrategy,
    )

    setup = in_process(MultiWorkerMirroredStrategy)
    _, _, x_test, y_test = digits_split()
    history = fit(
        setup.model,
        setup.optimizer,
        LOSS,
        setup.train_data,
        epochs=EPOCHS,
        steps_per_epoch=STEPS_PER_EPOCH,
        steps_per_execution=STEPS_PER_EXECUTION,
        validation_data=(x_test, y_test),
        strategy=setup.strategy,
        verbose=False,
        callbacks=[
            LearningRateScheduler(lambda epoch, lr: 5e-3 * 0.8**epoch),
            ModelCheckpoint(os.path.join(checkpoint_dir, "epoch-{epoch:04d}.pt"), keep=2),
        ],
    )
    group = weakref.ref(torch.distributed.group.WORLD)
    setup.strategy.shutdown()
    # A group still referenced keeps gloo's threads alive into the interpreter's exit, where they abort it.
    torch.save(
        {
            "rank": setup.strategy.rank,
            "history": history.history,
            "state": setup.model.state_dict(),
            "group_released": group() is None,
        },
        out_path,
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(tmp_path: Any, deadline_s: float = 200.0) -> list[dict]:
    port, base = free_port(), {k: v for k, v in os.environ.items() if k not in _CLUSTER_VARS}
    processes, outputs, logs = [], [], []
    for rank in range(WORLD_SIZE):
        env = {
            **base,
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD_SIZE),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        outputs.append(tmp_path / f"rank-{rank}.pt")
        logs.append(tmp_path / f"rank-{rank}.log")
        with logs[-1].open("w") as log:  # a file, not a pipe: a chatty rank never blocks
            processes.append(
                subprocess.Popen(
                    [sys.executable, __file__, str(outputs[-1]), str(tmp_path / "checkpoints")],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    deadline = time.monotonic() + deadline_s
    try:
        for process in processes:
            process.wait(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for rank, process in enumerate(processes):
        assert process.returncode == 0, (
            f"rank {rank} exited with {process.returncode}:\n{logs[rank].read_text()[-4000:]}"
        )
    return [torch.load(out, weights_only=True) for out in outputs]


@pytest.mark.timeout(300)
def test_the_same_fit_call_trains_digits_under_multi_worker_mirrored_on_two_processes(tmp_path):
    ranks = run_ranks(tmp_path)

    assert sorted(r["rank"] for r in ranks) == [0, 1]
    first, second = ranks
    assert first["history"] == second["history"], "every rank must see the same (all-reduced) logs"
    assert first["group_released"] and second["group_released"], "the process group outlived shutdown()"
    assert first["history"]["val_accuracy"][-1] >= 0.9
    for name, tensor in first["state"].items():
        assert torch.equal(tensor, second["state"][name]), name
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "checkpoint",
        "epoch-0002.pt",
        "epoch-0003.pt",
    ]
    one = in_process(default_strategy)  # one process on the whole global batches: the same training
    fit(
        one.model,
        one.optimizer,
        LOSS,
        one.train_data,
        epochs=EPOCHS,
        steps_per_epoch=STEPS_PER_EPOCH,
        strategy=one.strategy,
        verbose=False,
        callbacks=[LearningRateScheduler(lambda epoch, lr: 5e-3 * 0.8**epoch)],
    )
    for name, tensor in one.model.state_dict().items():
        torch.testing.assert_close(first["state"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)


if __name__ == "__main__":
    multi_worker_rank(sys.argv[1], sys.argv[2])
