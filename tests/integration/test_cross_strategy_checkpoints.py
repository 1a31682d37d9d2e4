"""A model saved under one strategy restores under another, or under none:
mirrored (2 replicas) -> parameter servers -> mirrored (3 replicas) -> plain torch."""

from __future__ import annotations

import torch
from torch import nn

from paramserve.coordinator import (
    ClusterCoordinator,
    MirroredStrategy,
    ParameterServerStrategy,
    export_state_dict,
    load_state_dict,
)
from paramserve.coordinator.demos.digits import MLP, digits_split, train_step, worker_batches
from paramserve.coordinator.strategies import compute_average_loss


def mirrored_steps(strategy, model, optimizer, steps):
    x_train, y_train, _, _ = digits_split()
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    batches = iter(
        strategy.experimental_distribute_dataset(
            [(x_train[i : i + 64], y_train[i : i + 64]) for i in range(0, 64 * steps, 64)]
        )
    )

    def step(x, y):
        optimizer.zero_grad()
        loss = compute_average_loss(loss_fn(model(x), y), global_batch_size=64)
        loss.backward()
        optimizer.step()

    for x, y in batches:
        strategy.run(step, args=(x, y))


def test_mirrored_to_parameter_servers_to_mirrored_to_plain_torch(start_cluster, tmp_path):
    two = MirroredStrategy(["cpu:0", "cpu:1"])
    with two.scope():
        model = MLP(32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mirrored_steps(two, model, optimizer, steps=5)
    torch.save(model.state_dict(), tmp_path / "mirrored.pt")

    cluster = start_cluster(num_ps=2, num_workers=1)
    ps = ParameterServerStrategy(cluster.spec)
    with ps.scope():
        ps_model = MLP(32)
        ps_optimizer = torch.optim.SGD(ps_model.parameters(), lr=0.1)
    load_state_dict(ps, torch.load(tmp_path / "mirrored.pt", weights_only=True), ps_model)
    from paramserve.coordinator.checkpointing.checkpoint_manager import state_dict

    restored = state_dict(ps, ps_model)  # read back from the parameter servers
    saved = torch.load(tmp_path / "mirrored.pt", weights_only=True)
    assert all(torch.equal(restored[k], saved[k]) for k in saved)
    with ClusterCoordinator(ps) as coordinator:
        it = iter(coordinator.create_per_worker_dataset(worker_batches))
        coordinator.schedule(train_step, args=(it, ps_model, ps_optimizer)).fetch(timeout=120)
    export_state_dict(ps, tmp_path / "ps.pt", ps_model)
    after_ps = torch.load(tmp_path / "ps.pt", weights_only=True)
    assert any(not torch.equal(after_ps[k], saved[k]) for k in saved), "the parameter-server step changed nothing"
    ps.close()

    three = MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    with three.scope():
        model3 = MLP(32)
        torch.optim.SGD(model3.parameters(), lr=0.1)
    model3.load_state_dict(after_ps)
    for replica in three.experimental_local_results(model3):
        assert all(torch.equal(replica.state_dict()[k], after_ps[k]) for k in after_ps)

    plain = MLP(32)
    plain.load_state_dict(torch.load(tmp_path / "ps.pt", weights_only=True))
    _, _, x_test, _ = digits_split()
    with torch.no_grad():
        torch.testing.assert_close(plain(x_test[:8]), model3(x_test[:8]))
