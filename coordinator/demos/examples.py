"""One training script, every strategy: only the strategy line differs.

    python -m paramserve.coordinator.demos.examples --strategy default
    python -m paramserve.coordinator.demos.examples --strategy one_device
    python -m paramserve.coordinator.demos.examples --strategy mirrored
    python -m paramserve.coordinator.demos.examples --strategy central_storage
    torchrun --nproc-per-node 2 -m paramserve.coordinator.demos.examples --strategy multi_worker
    paramserve launch --ps 2 --workers 2 -- python -m paramserve.coordinator.demos.examples --strategy parameter_server

Trains the digits MLP (scikit-learn's bundled dataset) with ``fit`` and prints
the test accuracy. On a CPU-only machine, mirrored and central_storage use two
CPU replicas; with GPUs they use all of them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

GLOBAL_BATCH = 64
STRATEGIES = ("default", "one_device", "mirrored", "central_storage", "multi_worker", "parameter_server")


def make_strategy(name: str) -> Any:
    """The one line that differs between strategies."""
    from paramserve import coordinator as ps

    gpus = torch.cuda.device_count()
    if name == "default":
        return ps.get_strategy()
    if name == "one_device":
        return ps.OneDeviceStrategy("cuda:0" if gpus else "cpu")
    if name == "mirrored":
        return ps.MirroredStrategy() if gpus > 1 else ps.MirroredStrategy(["cpu:0", "cpu:1"])
    if name == "central_storage":
        return ps.CentralStorageStrategy() if gpus > 1 else ps.CentralStorageStrategy(["cpu:0", "cpu:1"])
    if name == "multi_worker":
        return ps.MultiWorkerMirroredStrategy()
    if name == "parameter_server":
        return ps.ParameterServerStrategy(
            ps.ClusterSpec.from_env(), ps.MinSizePartitioner(max_shards=2), token=os.environ.get("PARAMSERVE_TOKEN")
        )
    raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")


def batches(context) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # type: ignore[no-untyped-def]
    """This input pipeline's endless share of the training set, in per-replica batches."""
    from paramserve.coordinator.demos.digits import digits_split

    x_train, y_train, _, _ = digits_split()
    batch = context.get_per_replica_batch_size(GLOBAL_BATCH)
    mine = torch.arange(context.input_pipeline_id, len(x_train), context.num_input_pipelines)
    # Parameter-server workers all see TensorFlow's input context (1, 0, 1): each shuffles in
    # its own order (by the worker index it also gets) so that workers see different batches.
    generator = torch.Generator().manual_seed(1000 * getattr(context, "worker_index", 0) + context.input_pipeline_id)
    while True:
        order = mine[torch.randperm(len(mine), generator=generator)]
        for start in range(0, len(order) - batch + 1, batch):
            yield x_train[order[start : start + batch]], y_train[order[start : start + batch]]


def main(argv: list[str] | None = None) -> int:
    from paramserve.coordinator import fit
    from paramserve.coordinator.demos.digits import MLP, digits_split

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=STRATEGIES, default="default")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=80)
    args = parser.parse_args(argv)

    strategy = make_strategy(args.strategy)
    torch.manual_seed(0)
    with strategy.scope():
        model = MLP(64)
        optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    _, _, x_test, y_test = digits_split()
    history = fit(
        model,
        optimizer,
        nn.CrossEntropyLoss(reduction="none"),
        batches,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        validation_data=(x_test, y_test),
        strategy=strategy,
        steps_per_execution=4 if args.strategy == "parameter_server" else 1,
        verbose=False,
    )
    print(f"{args.strategy}: test accuracy {history.history['val_accuracy'][-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
