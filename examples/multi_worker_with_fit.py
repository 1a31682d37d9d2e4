"""Multi-worker training with fit and MultiWorkerMirroredStrategy: TensorFlow's tutorial, in paramserve,
with its fault tolerance: BackupAndRestore, and a worker killed mid-training.

Read it beside the TensorFlow tutorial: the same sections in the same order. Every worker
runs this same script with its own TF_CONFIG (``--worker``); run without it, the script is
the cluster manager: it starts the workers on 127.0.0.1, and when one dies (``--kill-at-epoch``
kills worker 1 there, once) it restarts them all, and they resume from the backup.

    python examples/multi_worker_with_fit.py --epochs 4 --kill-at-epoch 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paramserve.coordinator import MultiWorkerMirroredStrategy, callbacks, evaluate, fit
from paramserve.coordinator.demos.digits import digits_split
from paramserve.coordinator.strategies import CommunicationOptions

KILLED_ENV = "EXAMPLE_KILL_AT_EPOCH"


# ------------------------------------------------------------------ the worker (the tutorial's code)


def mnist_dataset(batch_size: int) -> DataLoader:
    """The digits training set in global batches, shuffled alike on every worker (same seed)."""
    x_train, y_train, _, _ = digits_split()
    return DataLoader(
        TensorDataset(x_train, y_train), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(0)
    )


def build_and_compile_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


class KillAtEpoch(callbacks.Callback):
    """Fault injection: worker 1 dies (SIGKILL, no cleanup) as ``epoch`` begins."""

    def __init__(self, epoch: int, rank: int):
        self.epoch, self.rank = epoch, rank

    def on_epoch_begin(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        if self.rank == 1 and epoch == self.epoch:
            print(f"worker 1: killed at the start of epoch {epoch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def worker(args: argparse.Namespace) -> None:
    # Multi-worker configuration: TF_CONFIG (set by the cluster manager) names the cluster and this task
    tf_config = json.loads(os.environ["TF_CONFIG"])
    per_worker_batch_size = 32
    num_workers = len(tf_config["cluster"]["worker"])
    global_batch_size = per_worker_batch_size * num_workers

    # Choose the right strategy; collectives give up after 60 s (a dead peer is usually noticed at once)
    strategy = MultiWorkerMirroredStrategy(CommunicationOptions(timeout_seconds=60))
    multi_worker_dataset = mnist_dataset(global_batch_size)

    # Train the model: build it in the scope; fit splits each global batch across the workers
    torch.manual_seed(0)
    with strategy.scope():
        multi_worker_model, optimizer = build_and_compile_model()
    callback_list: list[callbacks.Callback] = [callbacks.BackupAndRestore(backup_dir=args.backup_dir)]
    if os.environ.get(KILLED_ENV):
        callback_list.append(KillAtEpoch(int(os.environ[KILLED_ENV]), strategy.rank))
    history = fit(
        multi_worker_model,
        optimizer,
        nn.CrossEntropyLoss(reduction="none"),
        multi_worker_dataset,
        epochs=args.epochs,
        steps_per_epoch=20,
        callbacks=callback_list,
        verbose=False,
    )

    _, _, x_test, y_test = digits_split()
    loss, accuracy = evaluate(multi_worker_model, nn.CrossEntropyLoss(reduction="none"), x_test, y_test)
    if strategy.is_chief:  # the chief reports (and writes files)
        with open(args.result, "w") as file:
            json.dump({"epochs_run": history.epoch, "loss": loss, "accuracy": accuracy}, file)
    strategy.close()


# ------------------------------------------------------------------ the cluster manager


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_workers(args: argparse.Namespace, workdir: str, attempt: int, kill_at_epoch: int | None) -> bool:
    """Starts the workers with their TF_CONFIG; True when all of them finished well. When one
    dies the others are stopped (they would wait for it), as a cluster manager does."""
    cluster = {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(args.num_workers)]}
    processes = []
    for index in range(args.num_workers):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        if kill_at_epoch is not None:
            env[KILLED_ENV] = str(kill_at_epoch)
        log = open(os.path.join(workdir, f"worker-{index}-attempt-{attempt}.log"), "w")
        command = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            "--epochs",
            str(args.epochs),
            "--backup-dir",
            os.path.join(workdir, "backup"),
            "--result",
            os.path.join(workdir, "result.json"),
        ]
        processes.append((subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + args.timeout
    try:
        while any(p.poll() is None for p, _ in processes):
            if any(p.poll() not in (None, 0) for p, _ in processes) or time.monotonic() > deadline:
                return False
            time.sleep(0.1)  # a cluster manager's watch loop, bounded by the deadline
        return all(p.returncode == 0 for p, _ in processes)
    finally:
        for process, log in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
            log.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--kill-at-epoch", type=int, help="worker 1 dies as this epoch begins (first attempt only)")
    parser.add_argument("--workdir", help="backup, logs and results (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one attempt may take")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backup-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    workdir = args.workdir or tempfile.mkdtemp(prefix="multi-worker-")
    os.makedirs(workdir, exist_ok=True)
    attempts = 0
    for attempt in range(3):
        attempts += 1
        if run_workers(args, workdir, attempt, args.kill_at_epoch if attempt == 0 else None):
            break
        print(f"attempt {attempt + 1}: a worker died; restarting every worker from the backup")
    else:
        raise RuntimeError(f"training did not complete; see the logs in {workdir}")
    with open(os.path.join(workdir, "result.json")) as file:
        result = {**json.load(file), "attempts": attempts}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
