"""A training program SIGKILLed mid-training and started again against the same, still running
cluster resumes from its latest checkpoint with its step counter, and nothing completed before
that checkpoint is lost: once it finishes, every shard has applied exactly the program's steps.

Both shapes are covered: a custom loop (the README's recipe: CheckpointManager's
``restore_or_initialize`` before the first step) and ``fit`` with ``BackupAndRestore``. Each
program is this file run as a script, so that SIGKILL hits a real process.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

TOTAL_STEPS = 120
CHECKPOINT_EVERY = 20
EPOCHS, STEPS_PER_EPOCH = 6, 20
KILL_AFTER = 2  # checkpoints (or epochs) saved before the SIGKILL
DEADLINE = 240.0


# ------------------------------------------------------------------ the training programs


def build():
    from paramserve.coordinator.demos.digits import MLP
    from paramserve.coordinator.strategies.parameter_server import ParameterServerStrategy
    from paramserve.psserver.protocol.partition import FixedShardsPartitioner

    strategy = ParameterServerStrategy(variable_partitioner=FixedShardsPartitioner(2))  # the cluster from the env
    torch.manual_seed(int(os.environ.get("SEED", "0")))  # a different model each run: only the restore makes them agree
    with strategy.scope():
        model = MLP(32)
    return strategy, model, strategy.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)


def custom_loop(checkpoint_dir: str) -> None:
    """The README's recipe."""
    from paramserve.coordinator import CheckpointManager, ClusterCoordinator
    from paramserve.coordinator.demos.digits import train_step, worker_batches

    strategy, model, optimizer = build()
    manager = CheckpointManager(strategy, checkpoint_dir)
    step = manager.restore_or_initialize() or 0  # before the coordinator: the variables exist already
    print(f"start {step}", flush=True)
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(worker_batches))
        while step < TOTAL_STEPS:
            for _ in range(CHECKPOINT_EVERY):
                coordinator.schedule(train_step, args=(batches, model, optimizer))
            coordinator.join()
            step += CHECKPOINT_EVERY
            manager.save(step)
            print(f"saved {step}", flush=True)
    strategy.close()


def keras_fit(checkpoint_dir: str) -> None:
    from paramserve.coordinator.demos.digits import worker_batches
    from paramserve.coordinator.training.callbacks import BackupAndRestore, Callback
    from paramserve.coordinator.training.loops import fit

    class Report(Callback):
        def on_train_begin(self, logs=None):
            print(f"start {self.state.initial_epoch}", flush=True)

        def on_epoch_end(self, epoch, logs=None):
            print(f"saved {epoch + 1}", flush=True)  # after BackupAndRestore's backup of this epoch

    strategy, model, optimizer = build()
    with strategy.scope():
        fit(
            model,
            optimizer,
            nn.CrossEntropyLoss(reduction="none"),
            functools.partial(worker_batches, batch_size=32),
            epochs=EPOCHS,
            steps_per_epoch=STEPS_PER_EPOCH,
            verbose=False,
            callbacks=[BackupAndRestore(checkpoint_dir), Report()],
        )
    strategy.close()


# ------------------------------------------------------------------ the test (the parent process)


class Program:
    """A training program run as a child process; its stdout lines are read as they come."""

    def __init__(self, mode: str, checkpoint_dir: Path, cluster, seed: int, log: Path):
        env = {
            **os.environ,
            "PARAMSERVE_PS": ",".join(cluster.spec.parameter_servers),
            "PARAMSERVE_WORKERS": ",".join(cluster.spec.workers),
            "SEED": str(seed),
        }
        env.pop("PARAMSERVE_TOKEN", None)
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, mode, str(checkpoint_dir)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.strip())
                self._changed.notify_all()
        with self._changed:
            self.lines.append("<eof>")
            self._changed.notify_all()

    def wait_for(self, line: str) -> None:
        with self._changed:
            found = self._changed.wait_for(lambda: line in self.lines or "<eof>" in self.lines, DEADLINE)
        assert found and line in self.lines, f"never printed {line!r}: {self.lines}\n{self.tail()}"

    def finish(self) -> int:
        code = self.proc.wait(DEADLINE)
        self.log.close()
        return code

    def tail(self) -> str:
        return Path(self.log.name).read_text()[-3000:]


def versions(cluster) -> set[int]:
    from paramserve.psserver.client.ps_client import ParameterServerClient

    with ParameterServerClient(cluster.spec.parameter_servers) as client:
        return {info.version for infos in client.list_shards().values() for info in infos}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode, total", [("custom_loop", TOTAL_STEPS), ("keras_fit", EPOCHS * STEPS_PER_EPOCH)])
def test_a_killed_training_program_resumes_from_its_latest_checkpoint(start_cluster, tmp_path, mode, total):
    cluster = start_cluster(num_ps=2, num_workers=2)
    first = Program(mode, tmp_path / "checkpoints", cluster, seed=1, log=tmp_path / "first.log")
    first.wait_for(f"saved {KILL_AFTER}" if mode == "keras_fit" else f"saved {KILL_AFTER * CHECKPOINT_EVERY}")
    first.proc.send_signal(signal.SIGKILL)
    assert first.finish() == -signal.SIGKILL
    saved = [int(line.split()[1]) for line in first.lines if line.startswith("saved")]

    second = Program(mode, tmp_path / "checkpoints", cluster, seed=2, log=tmp_path / "second.log")
    assert second.finish() == 0, second.tail()
    started = int(next(line for line in second.lines if line.startswith("start")).split()[1])
    assert started >= saved[-1] > 0, f"resumed at {started}, the first program saved {saved}"
    assert versions(cluster) == {total}, "each step applied exactly once, counting from the restored checkpoint"


if __name__ == "__main__":
    {"custom_loop": custom_loop, "keras_fit": keras_fit}[sys.argv[1]](sys.argv[2])
