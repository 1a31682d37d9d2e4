"""A recommendation model trained with parameter servers: what they are for.

    python examples/recommendation.py [--steps 600] [--rows 100000] [--sync-dense]

A DLRM-shaped click-through model (paramserve.coordinator.demos.recommendation): 26 categorical
features, each with an embedding table that lives only on the parameter servers, 13 dense
features through a bottom MLP, everything concatenated into a top MLP that predicts a click.
The data is synthetic and Criteo-like (ids follow a power law; a hidden model decides the
clicks), generated on each worker. Training is asynchronous: 2 parameter servers hold the
tables and the layers and apply Adagrad; 2 workers run the steps the coordinator schedules.
The script prints the held-out AUC before and after training, and the throughput.

``--sync-dense`` trains hybrid: the MLPs are replicated on the workers and averaged every step by
an all-reduce among them (synchronous), the tables stay on the servers (asynchronous).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from paramserve.coordinator import (
    ClusterCoordinator,
    LocalCluster,
    MinSizePartitioner,
    ParameterServerStrategy,
    ShardedEmbeddingCollection,
)
from paramserve.coordinator.demos.recommendation import DLRM, ClickData, WorkerClicks, auc, criteo_rows, train_clicks

BATCH = 256


def held_out_auc(model: torch.nn.Module, rows: list[int]) -> float:
    """AUC on batches no worker trains on; the coordinator reads the rows it needs from the servers."""
    batches = ClickData(rows, BATCH).batches(stream=10_000, count=8)
    with torch.no_grad():
        scores = torch.cat([model(batch.dense, batch.features()) for batch in batches])
    return auc(scores, torch.cat([batch.clicked for batch in batches]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600, help="training steps (over both workers)")
    parser.add_argument("--rows", type=int, default=100_000, help="the largest table's rows")
    parser.add_argument("--sync-dense", action="store_true", help="hybrid: the MLPs all-reduced on the workers")
    args = parser.parse_args(argv)
    rows = criteo_rows(args.rows)

    with LocalCluster(num_ps=2, num_workers=2) as cluster:
        # As TensorFlow's tutorial partitions: shards of at least 256 KiB, at most one per server.
        # The tables are split over both servers; each small layer lives whole on one of them.
        partitioner = MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)
        strategy = ParameterServerStrategy(cluster.spec, variable_partitioner=partitioner, sync_dense=args.sync_dense)
        torch.manual_seed(0)
        with strategy.scope():
            # The 26 tables are one ShardedEmbeddingCollection: a step reads all of them in one
            # exchange per server and pushes their gradients, summed per row, in one.
            model = DLRM(rows, embeddings=ShardedEmbeddingCollection)
        optimizer = strategy.optimizer(torch.optim.Adagrad, lr=0.05)
        with ClusterCoordinator(strategy) as coordinator:
            before = held_out_auc(model, rows)
            batches = iter(coordinator.create_per_worker_dataset(WorkerClicks(rows)))
            start = time.perf_counter()
            losses = [coordinator.schedule(train_clicks, args=(batches, model, optimizer)) for _ in range(args.steps)]
            coordinator.join()
            seconds = time.perf_counter() - start
            after = held_out_auc(model, rows)
        strategy.close()
    print(f"trained {args.steps} steps of {BATCH} in {seconds:.1f} s: {args.steps * BATCH / seconds:,.0f} samples/s")
    print(f"loss {float(losses[0].fetch()):.4f} -> {float(losses[-1].fetch()):.4f}")
    print(json.dumps({"auc_before": round(before, 4), "auc_after": round(after, 4)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
