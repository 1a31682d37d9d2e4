"""Parameter server training with fit and with a custom loop: TensorFlow's tutorial, in paramserve.

Read it beside the TensorFlow tutorial: the same sections in the same order. The cluster:

- default: an in-process-like cluster on 127.0.0.1 (TF: create_in_process_cluster), started here;
- ``--cluster-from-env``: the one ``paramserve launch`` (or PARAMSERVE_PS/PARAMSERVE_WORKERS, or
  TF_CONFIG) describes:
  ``paramserve launch --ps 2 --workers 2 -- python examples/parameter_server_training.py --cluster-from-env``;
- ``--tf-config``: TensorFlow's way: every task gets a TF_CONFIG naming the cluster and its own
  task; this script starts ``paramserve ps`` and ``paramserve worker`` with theirs (they listen
  where their task says) and runs the coordinator as the chief.

scikit-learn's digits stand in for the tutorial's synthetic data.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from paramserve.coordinator import (
    ClusterCoordinator,
    ClusterSpec,
    LocalCluster,
    MinSizePartitioner,
    ParameterServerStrategy,
    ReduceOp,
    SidecarEvaluator,
    callbacks,
    compute_average_loss,
    evaluate,
    fit,
    metrics,
)
from paramserve.coordinator.demos.digits import digits_split

# ------------------------------------------------------------------ the cluster


@contextlib.contextmanager
def in_process_cluster(num_ps: int, num_workers: int) -> Iterator[None]:
    """TF's create_in_process_cluster: servers on this machine, described in the environment."""
    token = secrets.token_hex(16)
    with LocalCluster(num_ps=num_ps, num_workers=num_workers, token=token) as cluster:
        with _environment(
            PARAMSERVE_PS=",".join(cluster.spec.parameter_servers),
            PARAMSERVE_WORKERS=",".join(cluster.spec.workers),
            PARAMSERVE_TOKEN=token,
        ):
            yield


@contextlib.contextmanager
def tf_config_cluster(num_ps: int, num_workers: int, workdir: str) -> Iterator[None]:
    """Every task started with TF_CONFIG: its cluster and its own task; servers take their address from it."""
    cluster = {
        "chief": [f"127.0.0.1:{_free_port()}"],
        "ps": [f"127.0.0.1:{_free_port()}" for _ in range(num_ps)],
        "worker": [f"127.0.0.1:{_free_port()}" for _ in range(num_workers)],
    }
    token = secrets.token_hex(16)
    processes = []
    try:
        for task_type in ("ps", "worker"):
            for index in range(len(cluster[task_type])):
                env = {
                    **os.environ,
                    "PARAMSERVE_TOKEN": token,
                    "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}}),
                }
                port_file = os.path.join(workdir, f"{task_type}-{index}.port")
                processes.append(
                    (
                        port_file,
                        subprocess.Popen(
                            [
                                sys.executable,
                                "-m",
                                "paramserve.coordinator.commands.cli",
                                task_type,
                                "--port-file",
                                port_file,
                            ],
                            env=env,
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        ),
                    )
                )
        for port_file, process in processes:
            _wait_serving(port_file, process)
        chief = json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}})
        with _environment(TF_CONFIG=chief, PARAMSERVE_TOKEN=token, PARAMSERVE_PS=None, PARAMSERVE_WORKERS=None):
            yield
    finally:
        for _, process in processes:
            process.terminate()
        for _, process in processes:
            process.wait(timeout=30)


def _wait_serving(port_file: str, process: subprocess.Popen, deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not os.path.exists(port_file):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"a server did not start (exit status {process.poll()})")
        time.sleep(0.05)  # the server writes its port file once serving


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _environment(**values: str | None) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    _set(values)
    try:
        yield
    finally:
        _set(saved)


def _set(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# ------------------------------------------------------------------ the tutorial


def dataset_fn(input_context: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Runs on each worker: shuffled, repeated batches (TF: shuffle().batch().repeat())."""
    global_batch_size = 64
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)  # 64: one replica per worker
    x, y, _, _ = digits_split()
    generator = torch.Generator().manual_seed(getattr(input_context, "worker_index", 0))
    while True:
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            rows = order[start : start + batch_size]
            yield x[rows], y[rows]


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def train(workdir: str, epochs: int) -> dict[str, float]:
    # Instantiate a ParameterServerStrategy: the cluster and token come from the environment
    variable_partitioner = MinSizePartitioner(min_shard_bytes=(256 << 10), max_shards=2)
    strategy = ParameterServerStrategy(ClusterSpec.from_env(), variable_partitioner=variable_partitioner)
    _, _, x_test, y_test = digits_split()

    # Training with fit: model and optimizer in scope, a dataset function, steps_per_epoch
    torch.manual_seed(0)
    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    working_dir = os.path.join(workdir, "keras_model")
    callback_list = [
        callbacks.TensorBoard(log_dir=os.path.join(working_dir, "log")),
        callbacks.ModelCheckpoint(filepath=os.path.join(working_dir, "ckpt", "ckpt-{epoch}")),
        callbacks.BackupAndRestore(backup_dir=os.path.join(working_dir, "backup")),
    ]
    history = fit(
        model,
        optimizer,
        nn.CrossEntropyLoss(reduction="none"),
        dataset_fn,
        epochs=epochs,
        steps_per_epoch=20,
        steps_per_execution=4,
        callbacks=callback_list,
        verbose=False,
    )
    print("fit:", {k: round(v[-1], 4) for k, v in history.history.items()})

    # Training with a custom training loop: a model built now, after fit, in the same scope
    with strategy.scope():
        loop_model = make_model()
        loop_optimizer = torch.optim.SGD(loop_model.parameters(), lr=0.1)
        accuracy = metrics.Accuracy()
    loss_fn = nn.CrossEntropyLoss(reduction="none")

    def step_fn(iterator: Any) -> torch.Tensor:
        def replica_fn(batch_data: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            loop_optimizer.zero_grad()
            pred = loop_model(batch_data)
            loss = compute_average_loss(loss_fn(pred, labels))
            loss.backward()
            loop_optimizer.step()
            accuracy.update_state(pred, labels)
            return loss

        batch_data, labels = next(iterator)
        losses = strategy.run(replica_fn, args=(batch_data, labels))
        return strategy.reduce(ReduceOp.SUM, losses, axis=None)

    coordinator = ClusterCoordinator(strategy)
    per_worker_dataset = coordinator.create_per_worker_dataset(dataset_fn)  # TF: distribute_datasets_from_function
    per_worker_iterator = iter(per_worker_dataset)
    num_epochs, steps_per_epoch = epochs, 20
    for i in range(num_epochs):
        accuracy.reset_state()
        for _ in range(steps_per_epoch):
            loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
        coordinator.join()  # wait at epoch boundaries
        print(f"Finished epoch {i}, accuracy is {float(accuracy.result()):.3f}.")
    loop_accuracy = float(accuracy.result())
    print(f"Final loss is {float(loss.fetch()):.3f}")
    coordinator.shutdown()

    # Evaluation: inline on the coordinator, and by a sidecar evaluator reading the checkpoints
    _, inline_accuracy = evaluate(model, nn.CrossEntropyLoss(reduction="none"), x_test, y_test)
    sidecar = SidecarEvaluator(
        make_model(), [(x_test, y_test)], os.path.join(working_dir, "ckpt"), log_dir=os.path.join(working_dir, "log")
    )
    evaluation = sidecar.evaluate_latest()
    sidecar.close()
    assert evaluation is not None
    print(
        f"inline accuracy {inline_accuracy:.3f}, sidecar accuracy {evaluation.results['accuracy']:.3f} "
        f"of {evaluation.checkpoint.name}"
    )
    strategy.close()
    return {
        "fit_accuracy": history.history["accuracy"][-1],
        "loop_accuracy": loop_accuracy,
        "inline_accuracy": inline_accuracy,
        "sidecar_accuracy": evaluation.results["accuracy"],
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--cluster-from-env", action="store_true", help="use the cluster the environment describes")
    where.add_argument("--tf-config", action="store_true", help="start every task with a TF_CONFIG")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--workdir", help="checkpoints and logs (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the results as a JSON line at the end")
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="ps-training-")
    if args.cluster_from_env:
        cluster: Any = contextlib.nullcontext()
    elif args.tf_config:
        cluster = tf_config_cluster(num_ps=2, num_workers=2, workdir=workdir)
    else:
        cluster = in_process_cluster(num_ps=2, num_workers=2)
    with cluster:
        results = train(workdir, args.epochs)
    if args.json:
        print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
