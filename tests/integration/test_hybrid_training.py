"""Hybrid training (``sync_dense=True``) on real processes: the dense layers replicated on the
workers and all-reduced every step, the tables on the parameter servers.

Checked: it learns; every worker's replica and the coordinator's view are the same values; a
worker killed (SIGKILL) or stopped (SIGTERM) mid-training leaves the group formed anew and no
closure lost; a worker killed while a group forms costs the others seconds, not the rendezvous
timeout; a changed learning rate reaches the workers; a checkpoint holds the dense state and
restores it exactly, onto the workers too, and the sidecar evaluator reads its dense layers; a
replicated table's primary killed mid-training fails over with every push applied exactly once."""

from __future__ import annotations

import os
import signal
import sys
import time

import cloudpickle
import torch

from paramserve.coordinator import (
    CheckpointManager,
    ClusterCoordinator,
    FixedShardsPartitioner,
    ParameterServerStrategy,
    ShardedEmbeddingCollection,
)
from paramserve.coordinator.demos.recommendation import DLRM, ClickData, WorkerClicks, auc, train_clicks
from paramserve.coordinator.sidecar_evaluator import load_checkpoint_weights
from paramserve.psserver.client.calls import CallOptions, Stub
from paramserve.psserver.runtime.channels import channel_options, open_channel

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules

TABLE_ROWS = [1000, 1000, 500, 2000, 1000, 300]


def build(cluster, **options):
    strategy = ParameterServerStrategy(
        cluster.spec, variable_partitioner=FixedShardsPartitioner(2), sync_dense=True, **options
    )
    torch.manual_seed(0)
    with strategy.scope():
        model = DLRM(TABLE_ROWS, embeddings=ShardedEmbeddingCollection)
        # A param group of its own for the top layers: the workers apply each group's options.
        optimizer = torch.optim.Adagrad(
            [{"params": model.bottom.parameters()}, {"params": model.top.parameters(), "lr": 0.04}], lr=0.05
        )
    return strategy, model, optimizer


def dense_values(model):
    """The dense layers' values where this runs (a worker's replica, or the coordinator's view)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def replica_of(model):
    return os.getpid(), dense_values(model)


def replicas(coordinator, model, workers):
    """Every worker's replica: one closure per worker in one round (a round gives each one)."""
    coordinator.join()
    with coordinator.paused(timeout=60):  # queued together: one round takes them all
        values = [coordinator.schedule(replica_of, args=(model,)) for _ in range(workers)]
    coordinator.join()
    found = dict(v.fetch() for v in values)
    assert len(found) == workers, "each worker of the round ran one closure"
    return list(found.values())


def assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def held_out_auc(model):
    batches = ClickData(TABLE_ROWS).batches(stream=999, count=8)
    with torch.no_grad():
        scores = torch.cat([model(b.dense, b.features()) for b in batches])
    return auc(scores, torch.cat([b.clicked for b in batches]))


def test_hybrid_training_learns_with_every_replica_equal_and_takes_a_new_learning_rate(start_cluster):
    cluster = start_cluster(num_ps=2, num_workers=2)
    strategy, model, optimizer = build(cluster)
    initial = dense_values(model)
    with ClusterCoordinator(strategy) as coordinator:
        before = held_out_auc(model)
        batches = iter(coordinator.create_per_worker_dataset(WorkerClicks(TABLE_ROWS, count=100)))
        losses = [coordinator.schedule(train_clicks, args=(batches, model, optimizer)) for _ in range(240)]
        coordinator.join()
        after = held_out_auc(model)  # the coordinator reads the layers from a worker, the rows from the servers
        first, second = replicas(coordinator, model, 2)
        seen_by_coordinator = dense_values(model)
        # A changed learning rate reaches the workers with the next round: at 0 nothing moves.
        strategy.set_learning_rate(optimizer, 0.0)
        for _ in range(20):
            coordinator.schedule(train_clicks, args=(batches, model, optimizer))
        frozen, _ = replicas(coordinator, model, 2)
        strategy.set_learning_rate(optimizer, 0.05)
        for _ in range(20):
            coordinator.schedule(train_clicks, args=(batches, model, optimizer))
        moved, _ = replicas(coordinator, model, 2)
    strategy.close()

    assert after > 0.65 and after > before + 0.1, (before, after)
    first_loss, last_loss = (sum(float(v.fetch()) for v in part) / 20 for part in (losses[:20], losses[-20:]))
    assert last_loss < first_loss
    assert_same(first, second)
    assert_same(first, seen_by_coordinator)
    assert not torch.equal(first["top.0.weight"], initial["top.0.weight"])
    assert not strategy.client.layouts.keys() & set(strategy.sync_dense.names()), "no dense layer on the servers"
    assert_same(frozen, first)
    assert not torch.equal(moved["top.0.weight"], frozen["top.0.weight"])
    for worker in (p for p in cluster.processes if p.role == "worker"):  # CPU workers: no NCCL
        assert "steps all-reduced with gloo" in worker.log_path.read_text(errors="replace")


def test_a_worker_stopped_mid_training_leaves_the_group_formed_anew_and_loses_nothing(start_cluster):
    # SIGTERM: the worker drains and goes; SIGKILL is test_a_restarted_worker_and_a_new_one_join...
    cluster = start_cluster(num_ps=2, num_workers=3)
    strategy, model, optimizer = build(cluster, dense_group_timeout=20.0)
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(WorkerClicks(TABLE_ROWS, count=100)))
        losses = [coordinator.schedule(train_clicks, args=(batches, model, optimizer)) for _ in range(300)]
        losses[40].fetch(timeout=120)  # training is under way
        worker = next(p for p in cluster.processes if p.role == "worker" and p.index == 2)
        os.kill(worker.pid, signal.SIGTERM)
        coordinator.join(timeout=240)
        values = [float(v.fetch()) for v in losses]  # every closure succeeded
        first, second = replicas(coordinator, model, 2)
        metric = coordinator.telemetry.registry.get_sample_value
        seen = (
            metric("paramserve_coordinator_dense_group_generation"),
            metric("paramserve_coordinator_dense_group_members"),
        )
        events = [event.kind for event in coordinator.telemetry.run.view().events]
    strategy.close()

    assert len(values) == 300
    assert_same(first, second)
    assert seen[0] >= 2 and seen[1] == 2  # formed anew, with the two workers left
    assert events.count("dense-group") >= 2 and "dense-group-broke" in events


def test_a_checkpoint_holds_the_dense_state_and_restores_it_exactly_onto_the_workers(start_cluster, tmp_path):
    cluster = start_cluster(num_ps=2, num_workers=2)
    strategy, model, optimizer = build(cluster)
    manager = CheckpointManager(strategy, tmp_path / "ckpt")
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(WorkerClicks(TABLE_ROWS, count=50)))
        for _ in range(40):
            coordinator.schedule(train_clicks, args=(batches, model, optimizer))
        coordinator.join()
        path = manager.save(step=40)
        saved = strategy.model_weights(model)
        after_save = [coordinator.schedule(train_clicks, args=(batches, model, optimizer)) for _ in range(40)]
        coordinator.join()
        moved = strategy.model_weights(model)
        manager.restore(path)
        restored = strategy.model_weights(model)
        on_workers = replicas(coordinator, model, 2)
        # The same steps again from the restored state: the same values as the first time
        # (the optimizer's state was restored too), up to the order pushes reach the tables.
        for _ in range(4):
            coordinator.schedule(train_clicks, args=(batches, model, optimizer))
        coordinator.join()
    strategy.close()

    assert (path / "dense_state.pt").exists()
    assert [float(v.fetch()) for v in after_save]
    assert not torch.equal(saved["top.0.weight"], moved["top.0.weight"])
    for name, value in saved.items():
        assert torch.equal(restored[name], value), name
    for replica in on_workers:
        for name, value in replica.items():
            assert torch.equal(value, saved[name]), name


def test_a_worker_killed_while_the_group_forms_costs_the_others_seconds_not_the_timeout(start_cluster, tmp_path):
    """The rendezvous timeout is 60 s. A worker is SIGKILLed between rounds and a restore makes the
    next round form a new generation with it still a member: its call fails at once, the
    coordinator gives the generation up in its store, and the two others, waiting there for the
    dead worker's address, re-form without it and train on within seconds."""
    cluster = start_cluster(num_ps=2, num_workers=3)
    strategy, model, optimizer = build(cluster, dense_group_timeout=60.0)
    manager = CheckpointManager(strategy, tmp_path / "ckpt")
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(WorkerClicks(TABLE_ROWS, count=100)))
        for _ in range(30):
            coordinator.schedule(train_clicks, args=(batches, model, optimizer))
        coordinator.join(timeout=120)
        path = manager.save(step=30)
        with coordinator.paused(timeout=60):
            cluster.kill_worker(2)  # idle: neither the others nor the coordinator notice yet
            manager.restore(path)  # a new dense epoch: the next round forms a new generation
        started = time.monotonic()
        after = [coordinator.schedule(train_clicks, args=(batches, model, optimizer)) for _ in range(30)]
        coordinator.join(timeout=45)  # raises TimeoutError where the survivors wait out the 60 s
        elapsed = time.monotonic() - started
        first, second = replicas(coordinator, model, 2)
    strategy.close()

    assert elapsed < 15.0, elapsed
    assert len([float(v.fetch()) for v in after]) == 30
    assert_same(first, second)
    survivors = [p for p in cluster.processes if p.role == "worker" and p.index != 2]
    assert any("was given up" in p.log_path.read_text(errors="replace") for p in survivors)


def test_the_sidecar_evaluator_reads_a_hybrid_checkpoints_dense_layers_exactly(start_cluster, tmp_path):
    cluster = start_cluster(num_ps=2, num_workers=2)
    strategy, model, optimizer = build(cluster)
    manager = CheckpointManager(strategy, tmp_path / "ckpt")
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(WorkerClicks(TABLE_ROWS, count=50)))
        for _ in range(20):
            coordinator.schedule(train_clicks, args=(batches, model, optimizer))
        coordinator.join()
        path = manager.save(step=20)
        saved = strategy.model_weights(model)
    strategy.close()

    torch.manual_seed(1)  # the evaluator's own copy, of the class that trained, other initial values
    fresh = DLRM(TABLE_ROWS, embeddings=ShardedEmbeddingCollection)
    weights, step = load_checkpoint_weights(path, fresh)

    assert step == 20
    assert weights.keys() == fresh.state_dict().keys() == {n for n in saved if n.startswith(("bottom.", "top."))}
    for name, value in weights.items():
        assert torch.equal(value, saved[name]), name


def test_a_restarted_worker_and_a_new_one_join_with_the_groups_state(start_cluster):
    cluster = start_cluster(num_ps=2, num_workers=2)
    strategy, model, optimizer = build(cluster, dense_group_timeout=20.0)
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(WorkerClicks(TABLE_ROWS, count=100)))
        first = [coordinator.schedule(train_clicks, args=(batches, model, optimizer)) for _ in range(120)]
        first[30].fetch(timeout=120)
        cluster.kill_worker(1)
        cluster.restart_worker(1)  # the same address, a new process holding no dense state
        coordinator.join(timeout=240)
        coordinator.add_worker(cluster.add_worker())  # a third worker, also without state
        second = [coordinator.schedule(train_clicks, args=(batches, model, optimizer)) for _ in range(60)]
        coordinator.join(timeout=240)
        held = replicas(coordinator, model, 3)
    strategy.close()

    assert len([float(v.fetch()) for v in first + second]) == 180
    assert_same(held[0], held[1])
    assert_same(held[0], held[2])


def export_of(address):
    stub = Stub(open_channel(address, None, channel_options(64 << 20)))
    return {state.ref: state for state in stub.export(1 << 20, CallOptions(None, 30, 30))}


def test_a_tables_primary_killed_mid_training_fails_over_with_every_push_applied_once(start_cluster):
    """Replicated servers under hybrid training: each step's push of the tables is still in
    flight when its closure's next lookup, or the round's end, settles it; a push lost with the
    primary is that closure's error, retried under its key against the new primary."""
    cluster = start_cluster(num_ps=4, num_workers=2)
    strategy, model, optimizer = build(cluster, ps_replicas=2)
    steps = 160
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(WorkerClicks(TABLE_ROWS, count=100)))
        losses = [coordinator.schedule(train_clicks, args=(batches, model, optimizer)) for _ in range(steps)]
        losses[30].fetch(timeout=120)  # training is under way
        primary = strategy.client.addresses[0]
        cluster.kill_ps(cluster.parameter_servers.index(primary))
        coordinator.join(timeout=240)  # raises any error a closure met: there must be none
        values = [float(v.fetch()) for v in losses]
        recoveries = list(coordinator.recovery.recoveries) if coordinator.recovery else []
        first, second = replicas(coordinator, model, 2)
        states = strategy.servers.groups.states()
        exports = {state.primary: export_of(state.primary) for state in states}
    strategy.close()

    assert len(values) == steps
    assert [(r.server, r.result) for r in recoveries] == [(primary, "failed-over")], recoveries
    assert_same(first, second)
    tables = [shard for shards in exports.values() for shard in shards.values()]
    assert len(tables) == 2 and all(shards for shards in exports.values()), "the tables' two shards, one per group"
    for shard in tables:  # every batch touches both halves of the tables (256 Zipf ids per table)
        keys = list(shard.applied_keys)
        assert shard.version == len(keys) == len(set(keys)) == steps, (shard.ref, shard.version, len(set(keys)))
