"""The workers' row cache (ParameterServerStrategy(max_row_staleness=s), worker.row_cache) on real
processes: s = 0 is training without it, bit for bit; with it fewer rows travel, every push still
applies once, and no row read before a restore is served after it."""

from __future__ import annotations

import json
import sys
import urllib.request

import cloudpickle
import pytest
import torch

from paramserve.coordinator import (
    CheckpointManager,
    ClusterCoordinator,
    FixedShardsPartitioner,
    ParameterServerStrategy,
    ShardedEmbeddingCollection,
)
from paramserve.coordinator.demos.recommendation import DLRM, ClickData, WorkerClicks, auc, train_clicks

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules

TABLE_ROWS = [1000, 1000, 500, 2000, 1000, 300]


def build(cluster, run_name: str, **options):
    strategy = ParameterServerStrategy(
        cluster.spec, variable_partitioner=FixedShardsPartitioner(2), run_name=run_name, **options
    )
    torch.manual_seed(0)
    with strategy.scope():
        model = DLRM(TABLE_ROWS, embeddings=ShardedEmbeddingCollection)
    return strategy, model, strategy.optimizer(torch.optim.Adagrad, lr=0.05)


def train(strategy, model, optimizer, steps: int, batches=None, seen=None):
    """``steps`` closures; ``seen`` (a dict) gets what the coordinator's status page and metrics
    showed once they ended."""
    with ClusterCoordinator(strategy, status_port=0, metrics_port=0) as coordinator:
        batches = batches or iter(coordinator.create_per_worker_dataset(WorkerClicks(TABLE_ROWS, count=400)))
        for _ in range(steps):
            coordinator.schedule(train_clicks, args=(batches, model, optimizer))
        coordinator.join()
        if seen is not None:
            url = str(coordinator.status_url)
            page = url.replace("/?", "/status.json?") if "/?" in url else url + "status.json"
            seen["status"] = json.loads(urllib.request.urlopen(page, timeout=10).read())
            metrics = f"http://127.0.0.1:{coordinator.metrics_port}/metrics"
            seen["metrics"] = urllib.request.urlopen(metrics, timeout=10).read().decode()
    return batches


def table_values(strategy, model) -> torch.Tensor:
    return strategy.client.pull([model.embeddings.table.variable]).tensors[model.embeddings.table.variable]


def worker_rows(cluster) -> dict[str, float]:
    """Rows the workers' lookups pulled and took from their caches (their /metrics)."""
    totals = {"pulled": 0.0, "cached": 0.0}
    for process in cluster.processes:
        if process.role == "worker":
            text = urllib.request.urlopen(f"http://127.0.0.1:{process.metrics_port}/metrics", timeout=10).read()
            for line in text.decode().splitlines():
                for source in totals:
                    if line.startswith(f'paramserve_worker_rows_total{{source="{source}"}}'):
                        totals[source] += float(line.rsplit(" ", 1)[1])
    return totals


def test_max_row_staleness_zero_trains_exactly_as_without_a_cache_and_a_bound_changes_it(start_cluster):
    cluster = start_cluster(num_ps=2, num_workers=1)
    finals = {}
    for run, options in (("plain", {}), ("zero", {"max_row_staleness": 0}), ("four", {"max_row_staleness": 4})):
        strategy, model, optimizer = build(cluster, run, **options)
        train(strategy, model, optimizer, steps=20)
        finals[run] = table_values(strategy, model)
        strategy.close()
    assert torch.equal(finals["plain"], finals["zero"]), "s = 0 is no cache at all"
    assert not torch.equal(finals["plain"], finals["four"]), "with a bound, cached rows stand in for reads"


def test_with_a_row_cache_fewer_rows_travel_the_model_learns_and_every_push_applies_once(start_cluster):
    steps = 200
    cluster = start_cluster(num_ps=2, num_workers=2, extra_worker_args=["--metrics-port", "0"])
    strategy, model, optimizer = build(cluster, "cached", max_row_staleness=8)
    held_out = ClickData(TABLE_ROWS).batches(stream=999, count=8)

    def held_out_auc() -> float:
        with torch.no_grad():
            scores = torch.cat([model(b.dense, b.features()) for b in held_out])
        return auc(scores, torch.cat([b.clicked for b in held_out]))

    before = held_out_auc()
    seen: dict = {}
    train(strategy, model, optimizer, steps, seen=seen)
    after = held_out_auc()
    rows = worker_rows(cluster)
    assert rows["cached"] > 0.5 * (rows["cached"] + rows["pulled"]), rows  # small tables: most rows repeat
    # The coordinator's page and metrics sum what the workers reported, closure by closure.
    shown = seen["status"]["summary"]["rows"]
    assert (shown["pulled"], shown["cached"]) == (rows["pulled"], rows["cached"])
    assert shown["hit_rate"] == pytest.approx(rows["cached"] / (rows["cached"] + rows["pulled"]), abs=0.01)
    assert sum(shown["ages"].values()) == shown["cached"] and set(shown["ages"]) <= {str(a) for a in range(1, 9)}
    assert f'paramserve_coordinator_rows_total{{source="cached"}} {rows["cached"]}' in seen["metrics"]
    assert after > 0.68 and after > before + 0.15, (before, after)
    versions = {
        info.ref: info.version
        for infos in strategy.client.list_shards().values()
        for info in infos
        if info.ref.variable == model.embeddings.table.variable
    }
    assert set(versions.values()) == {steps}, "every step pushed the table's rows once, cached or not"
    strategy.close()


def read_rows(model, ids):
    """A closure: the table's rows for ``ids`` as this worker's lookup returns them (no push)."""
    return model.embeddings({"c0": ids})["c0"].detach().clone()


def test_no_row_read_before_a_restore_is_served_after_it(start_cluster, tmp_path):
    cluster = start_cluster(num_ps=2, num_workers=1)
    strategy, model, optimizer = build(cluster, "restored", max_row_staleness=1_000_000)
    hot = torch.arange(20)
    manager = CheckpointManager(strategy, tmp_path)
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(WorkerClicks(TABLE_ROWS, count=400)))

        def steps(count: int) -> None:
            for _ in range(count):
                coordinator.schedule(train_clicks, args=(batches, model, optimizer))
            coordinator.join()

        steps(10)
        manager.save(step=10)
        saved = table_values(strategy, model)
        steps(10)  # the worker caches rows newer than the checkpoint
        assert not torch.equal(coordinator.schedule(read_rows, args=(model, hot)).fetch(), saved[hot])
        manager.restore(manager.latest)
        after = coordinator.schedule(read_rows, args=(model, hot)).fetch()
    assert torch.equal(after, saved[hot]), "the worker read the restored rows, not its cached ones"
    strategy.close()
