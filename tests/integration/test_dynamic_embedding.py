"""A model with a DynamicEmbedding trained through a ClusterCoordinator on real processes: it
learns, ids are admitted and evicted as configured, and a checkpoint restores its live rows
bit for bit onto another number of parameter servers."""

from __future__ import annotations

import sys

import cloudpickle
import torch
from torch import nn

from paramserve.coordinator import CheckpointManager, ClusterCoordinator, DynamicEmbedding, ParameterServerStrategy

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules

HOT = 120  # ids seen throughout: admitted, trained, kept
WARM = range(10_000, 10_060)  # seen in the first batches only: admitted, then past their TTL
COLD = 1 << 40  # ids from here on are seen once: never admitted


def label(ids: torch.Tensor) -> torch.Tensor:
    return ((ids * 2654435761) % 7 < 3).to(torch.float32)  # a per-id fact only an embedding can hold


class ClickStream:
    """A worker's endless batches: hot ids, a unique cold id per example, warm ids at first."""

    def __call__(self, ctx):
        return self._batches(ctx.worker_index)

    def _batches(self, worker):
        generator = torch.Generator().manual_seed(worker)
        step = 0
        while True:
            hot = torch.randint(0, HOT, (24,), generator=generator)
            cold = COLD + torch.arange(8) + 8 * (2 * step + worker)
            warm = torch.tensor(list(WARM)) if step < 3 else torch.empty(0, dtype=torch.int64)
            ids = torch.cat([hot, cold, warm])
            yield ids, label(ids)
            step += 1


class Clicks(nn.Module):
    def __init__(self):
        super().__init__()
        self.ids = DynamicEmbedding(8, name="ids", admit_after=2, ttl_steps=40, init_std=0.1, seed=3)
        self.out = nn.Linear(8, 1)

    def forward(self, ids):
        return self.out(self.ids(ids)).squeeze(-1)


def train_step(batches, model, optimizer):
    ids, clicked = next(batches)
    optimizer.zero_grad()
    loss = nn.functional.binary_cross_entropy_with_logits(model(ids), clicked)
    loss.backward()
    optimizer.step()
    return loss.detach()


def build(spec):
    strategy = ParameterServerStrategy(spec)
    torch.manual_seed(0)
    with strategy.scope():
        model = Clicks()
    optimizer = strategy.optimizer(torch.optim.Adagrad, lr=0.2)
    return strategy, model, optimizer


def live_table(strategy):
    """Every live row of the table, sorted by id: ids, values, Adagrad sums, last-update steps."""
    states = [s for per in strategy.client.dynamic.export(["ids"]).values() for s in per]
    ids = torch.cat([s.ids for s in states])
    order = torch.argsort(ids)
    return [
        ids[order],
        torch.cat([s.values for s in states])[order],
        torch.cat([s.slots["sum"] for s in states])[order],
    ]


def test_a_dynamic_embedding_learns_admits_evicts_and_restores_onto_three_servers(start_cluster, tmp_path):
    cluster = start_cluster(num_ps=2, num_workers=2)
    strategy, model, optimizer = build(cluster.spec)
    with ClusterCoordinator(strategy) as coordinator:
        batches = iter(coordinator.create_per_worker_dataset(ClickStream()))
        losses = [coordinator.schedule(train_step, args=(batches, model, optimizer)) for _ in range(160)]
        coordinator.join()
        stats = [s for per in strategy.client.dynamic.stats().values() for s in per]
        ids, values, sums = live_table(strategy)
        path = CheckpointManager(strategy, tmp_path).save(160)
    hot = torch.arange(HOT)
    with torch.no_grad():
        accuracy = float(((model(hot) > 0).float() == label(hot)).float().mean())
    first, last = (sum(float(v.fetch()) for v in part) / 20 for part in (losses[:20], losses[-20:]))

    assert accuracy > 0.9 and last < first, (accuracy, first, last)
    assert set(hot.tolist()) <= set(ids.tolist()), "every hot id was admitted and kept"
    assert not set(WARM) & set(ids.tolist()), "the warm ids were evicted past their TTL"
    assert sum(s.evictions_ttl for s in stats) >= len(WARM)
    assert sum(s.admissions for s in stats) >= HOT + len(WARM)
    assert int(ids.max()) < COLD, "ids seen once are never admitted (admit_after=2)"
    assert len(stats) == 2 and all(s.live_rows > 0 for s in stats)
    dense = strategy.client.pull(["clicks.out.weight", "clicks.out.bias"]).tensors
    strategy.close()

    three = start_cluster(num_ps=3, num_workers=1)
    restored, _, _ = build(three.spec)
    CheckpointManager(restored, tmp_path).restore(path)
    after = live_table(restored)
    assert all(torch.equal(a, b) for a, b in zip([ids, values, sums], after))
    assert sorted(s.ref.shard for per in restored.client.dynamic.stats().values() for s in per) == [0, 1, 2]
    for name, value in restored.client.pull(list(dense)).tensors.items():
        assert torch.equal(value, dense[name])
    restored.close()
