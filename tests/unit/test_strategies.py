"""In-process strategies (OneDevice, Mirrored, CentralStorage): same numbers as one device,
contexts, distributed values, input splitting, and clear errors. CPU replicas; no network."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from paramserve.coordinator.strategies import (
    CentralStorageStrategy,
    HierarchicalCopyAllReduce,
    InputContext,
    InputOptions,
    Mirrored,
    MirroredStrategy,
    NcclAllReduce,
    OneDeviceStrategy,
    PerReplica,
    ReduceOp,
    ReductionToOneDevice,
    SyncOnReadVariable,
    VariableAggregation,
    compute_average_loss,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
    scale_regularization_loss,
)
from paramserve.coordinator.strategies.base import DefaultStrategy
from paramserve.coordinator.strategies.cross_device_ops import CrossDeviceOps
from paramserve.coordinator.strategies.input import DistributedDataset

STEPS = 4
LR, MOMENTUM = 0.1, 0.9
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def per_example_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y, reduction="none").sum(dim=1)


@pytest.fixture
def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(12, 4, generator=generator), torch.randn(12, 3, generator=generator)


@pytest.fixture
def initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return copy.deepcopy(make_mlp().state_dict())


def train_single_device(initial_state, x, y, steps=STEPS) -> nn.Module:
    model = make_mlp()
    model.load_state_dict(initial_state)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for _ in range(steps):
        optimizer.zero_grad()
        per_example_loss(model, x, y).mean().backward()
        optimizer.step()
    return model


def train_with(strategy, initial_state, batches, global_batch_size=None):
    with strategy.scope():
        model = make_mlp()
        model.load_state_dict(initial_state)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def step(batch):
        x, y = batch
        optimizer.zero_grad()
        loss = compute_average_loss(per_example_loss(model, x, y), global_batch_size=global_batch_size)
        loss.backward()
        optimizer.step()
        return loss

    losses = [strategy.run(step, args=(batch,)) for batch in strategy.experimental_distribute_dataset(batches)]
    return model, losses, optimizer


def assert_close_to(model: nn.Module, reference: nn.Module) -> None:
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"parameter {name}")


def assert_replicas_identical(strategy, model: nn.Module) -> None:
    replicas = strategy.experimental_local_results(model)
    assert len(replicas) == strategy.num_replicas_in_sync
    for replica in replicas[1:]:
        assert replica is not replicas[0]
        for a, b in zip(replicas[0].parameters(), replica.parameters()):
            assert a is not b and torch.equal(a, b)


def replica_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if "-replica-" in t.name]


def close_leaves_no_thread(strategy) -> list[str]:
    """Closes ``strategy``; the names of its replica threads still alive after that (none
    expected). Other tests' strategies may still have idle threads, hence not replica_threads()."""
    threads = strategy._threads.threads
    strategy.close()
    return [t.name for t in threads if t.is_alive()]


# ------------------------------------------------------------------ same update as one device


@pytest.mark.parametrize("replicas", [2, 3])
def test_mirrored_training_matches_one_device_and_copies_stay_identical(replicas, data, initial_state):
    x, y = data
    strategy = MirroredStrategy(devices=[f"cpu:{i}" for i in range(replicas)])
    model, losses, _ = train_with(strategy, initial_state, [(x, y)] * STEPS)

    assert_close_to(model, train_single_device(initial_state, x, y))
    assert_replicas_identical(strategy, model)
    assert isinstance(losses[-1], PerReplica) and len(losses[-1].values) == replicas
    full_loss = per_example_loss(train_single_device(initial_state, x, y, STEPS - 1), x, y).mean()
    torch.testing.assert_close(strategy.reduce(ReduceOp.SUM, losses[-1]), full_loss.detach(), atol=1e-5, rtol=0)
    assert close_leaves_no_thread(strategy) == []


def test_central_storage_training_matches_one_device(data, initial_state):
    x, y = data
    strategy = CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"])
    model, _, _ = train_with(strategy, initial_state, [(x, y)] * STEPS)

    assert_close_to(model, train_single_device(initial_state, x, y))
    compute_copies = strategy.experimental_local_results(model)
    assert all(copy_ is not model for copy_ in compute_copies)  # the variables live once, in `model`
    for replica in compute_copies:
        for central, local in zip(model.parameters(), replica.parameters()):
            assert torch.equal(central, local)  # refreshed from the central values after each step


@pytest.mark.parametrize(
    "factory",
    [
        lambda: MirroredStrategy(devices=["cpu:0", "cpu:1"]),
        lambda: CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"]),
    ],
    ids=["mirrored", "central_storage"],
)
def test_a_param_group_added_after_the_scope_closed_trains_as_on_one_device(factory, data, initial_state):
    """torch lets a group join an optimizer at any time (fine-tuning unfreezes layers so): it
    trains on every replica, with its own options, and the optimizer's state_dict holds it."""
    x, y = data
    reference = make_mlp()
    reference.load_state_dict(initial_state)
    ref_opt = torch.optim.SGD(reference[0].parameters(), lr=LR, momentum=MOMENTUM)
    ref_opt.add_param_group({"params": reference[2].parameters(), "lr": LR / 2})
    strategy = factory()
    with strategy.scope():
        model = make_mlp()
        model.load_state_dict(initial_state)
        optimizer = torch.optim.SGD(model[0].parameters(), lr=LR, momentum=MOMENTUM)
    optimizer.add_param_group({"params": model[2].parameters(), "lr": LR / 2})

    def step(batch):
        optimizer.zero_grad()
        compute_average_loss(per_example_loss(model, *batch)).backward()
        optimizer.step()

    for batch in strategy.experimental_distribute_dataset([(x, y)] * STEPS):
        strategy.run(step, args=(batch,))
        ref_opt.zero_grad()
        per_example_loss(reference, x, y).mean().backward()
        ref_opt.step()
    assert_close_to(model, reference)
    saved = optimizer.state_dict()
    assert [group["lr"] for group in saved["param_groups"]] == [LR, LR / 2]
    assert sorted(saved["state"]) == [0, 1, 2, 3]
    want = ref_opt.state_dict()["state"][3]["momentum_buffer"]
    torch.testing.assert_close(saved["state"][3]["momentum_buffer"], want)


def test_a_param_group_of_a_module_built_outside_the_scope_is_refused_and_not_kept(initial_state):
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(RuntimeError, match="no module built in MirroredStrategy.scope"):
        optimizer.add_param_group({"params": nn.Linear(2, 2).parameters()})
    assert len(optimizer.param_groups) == 1


def test_one_device_strategy_runs_once_and_yields_plain_batches(data, initial_state):
    x, y = data
    strategy = OneDeviceStrategy("cpu")
    model, losses, _ = train_with(strategy, initial_state, [(x, y)] * STEPS)
    assert_close_to(model, train_single_device(initial_state, x, y))
    assert isinstance(losses[-1], torch.Tensor)
    assert strategy.num_replicas_in_sync == 1
    reduced = strategy.reduce("SUM", losses[-1])
    assert torch.equal(reduced, losses[-1]) and not reduced.requires_grad


def test_learning_rate_schedule_reaches_every_mirrored_replica(data, initial_state):
    x, y = data
    reference = make_mlp()
    reference.load_state_dict(initial_state)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = make_mlp()
        model.load_state_dict(initial_state)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    def step(batch):
        optimizer.zero_grad()
        compute_average_loss(per_example_loss(model, *batch)).backward()
        optimizer.step()

    for batch in strategy.experimental_distribute_dataset([(x, y)] * 3):
        strategy.run(step, args=(batch,))
        scheduler.step()
        ref_opt.zero_grad()
        per_example_loss(reference, x, y).mean().backward()
        ref_opt.step()
        ref_sched.step()
    assert_close_to(model, reference)
    assert_replicas_identical(strategy, model)


def test_uneven_last_batch_splits_and_matches_one_device_with_explicit_global_batch(data, initial_state):
    x, y = data
    x, y = x[:7], y[:7]
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    (batch,) = list(strategy.experimental_distribute_dataset([(x, y)]))
    assert [part.shape[0] for part in batch[0].values] == [4, 3]  # first replicas get the extra example

    model, _, _ = train_with(strategy, initial_state, [(x, y)] * STEPS, global_batch_size=7)
    assert_close_to(model, train_single_device(initial_state, x, y))


def test_batch_smaller_than_replica_count_gives_empty_shares_that_train(data, initial_state):
    x, y = data
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    (batch,) = list(strategy.experimental_distribute_dataset([(x[:1], y[:1])]))
    assert [part.shape[0] for part in batch[0].values] == [1, 0, 0]
    model, _, _ = train_with(strategy, initial_state, [(x[:1], y[:1])] * 2, global_batch_size=1)
    assert_close_to(model, train_single_device(initial_state, x[:1], y[:1], steps=2))


def test_partial_batch_error_and_drop_options(data):
    x, y = data
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    batches = [(x[:4], y[:4]), (x[:3], y[:3])]
    with pytest.raises(ValueError, match="do not split evenly.*drop_last"):
        list(strategy.experimental_distribute_dataset(batches, options=InputOptions(partial_batch="error")))
    kept = list(strategy.experimental_distribute_dataset(batches, options=InputOptions(partial_batch="drop")))
    assert len(kept) == 1
    with pytest.raises(ValueError, match="partial_batch"):
        InputOptions(partial_batch="pad")


# ------------------------------------------------------------------ contexts and the default strategy


def test_default_strategy_is_a_singleton_current_outside_every_scope():
    default = get_strategy()
    assert isinstance(default, DefaultStrategy) and DefaultStrategy() is default
    assert not has_strategy()
    context = get_replica_context()
    assert context is not None and context.replica_id_in_sync_group == 0 and context.num_replicas_in_sync == 1
    assert not in_cross_replica_context()
    assert default.reduce("SUM", 1.0) == 1.0
    assert default.run(lambda v: v + 1, args=(1,)) == 2


def test_contexts_inside_scope_and_run():
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    optimizer_init = torch.optim.Optimizer.__init__
    with strategy.scope():
        assert torch.optim.Optimizer.__init__ is not optimizer_init  # optimizers are captured only while open
        assert get_strategy() is strategy and has_strategy()
        assert get_replica_context() is None and in_cross_replica_context()

        def probe():
            context = get_replica_context()
            return (
                get_strategy() is strategy,
                in_cross_replica_context(),
                context.replica_id_in_sync_group,
                context.num_replicas_in_sync,
                threading.current_thread().name,
            )

        same_strategy, cross, replica_id, count, thread = strategy.run(probe)  # a tuple of per-replica parts
    assert not has_strategy() and torch.optim.Optimizer.__init__ is optimizer_init
    assert (same_strategy, cross, count) == (True, False, 2)  # equal on every replica: plain values
    assert replica_id.values == (0, 1)
    assert thread.values == ("MirroredStrategy-replica-0", "MirroredStrategy-replica-1")


def test_replica_all_reduce_and_per_replica_arguments():
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    values = PerReplica([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(6.0)])

    def fn(value):
        context = get_replica_context()
        return context.all_reduce(ReduceOp.SUM, value), context.all_reduce("MEAN", {"v": value * 2})

    total, mean = strategy.run(fn, args=(values,))
    assert [float(t) for t in total.values] == [9.0, 9.0, 9.0]
    assert [float(t) for t in mean["v"].values] == [6.0, 6.0, 6.0]
    assert float(strategy.reduce("MEAN", values)) == 3.0
    assert (
        float(strategy.reduce("SUM", PerReplica([torch.ones(2, 3), torch.ones(1, 3), torch.ones(0, 3)]), axis=0).sum())
        == 9.0
    )
    with pytest.raises(ValueError, match="2 per-replica components for 3 replicas"):
        strategy.run(fn, args=(PerReplica([torch.tensor(1.0)] * 2),))


def test_losses_scale_by_global_batch_and_replicas():
    per_example = torch.tensor([1.0, 2.0, 3.0, 6.0])
    assert float(compute_average_loss(per_example)) == 3.0
    assert float(compute_average_loss(per_example, global_batch_size=8)) == 1.5
    assert float(compute_average_loss(per_example, sample_weight=torch.tensor([1.0, 1.0, 0.0, 0.0]))) == 0.75
    with pytest.raises(ValueError, match="reduction='none'"):
        compute_average_loss(per_example.mean())
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    out = strategy.run(lambda: (compute_average_loss(per_example), scale_regularization_loss(torch.tensor(4.0))))
    assert [float(v) for v in out[0].values] == [1.5, 1.5] and [float(v) for v in out[1].values] == [2.0, 2.0]


# ------------------------------------------------------------------ sync-on-read values


@pytest.mark.parametrize("aggregation, expected", [(VariableAggregation.SUM, 6.0), ("MEAN", 3.0)])
def test_sync_on_read_metric_aggregates_when_read_across_replicas(aggregation, expected):
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        metric = SyncOnReadVariable(0.0, aggregation=aggregation)

    def update(value):
        metric.assign_add(value)
        return metric.read_value().clone()  # replica context: the local copy

    local = strategy.run(update, args=(PerReplica([torch.tensor(2.0), torch.tensor(4.0)]),))
    assert [float(v) for v in local.values] == [2.0, 4.0]
    assert float(metric.read_value()) == expected
    metric.assign(0.0)
    assert float(metric.read_value()) == 0.0
    with pytest.raises(RuntimeError, match="inside strategy.run"):
        metric.assign_add(1.0)


def test_batch_norm_running_statistics_are_per_replica_and_aggregate():
    torch.manual_seed(2)
    x = torch.randn(8, 3) * 3 + 1
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    reference = copy.deepcopy(strategy.experimental_local_results(model)[1])  # a plain copy
    strategy.run(model, args=(next(iter(strategy.experimental_distribute_dataset([x]))),))
    reference(x)

    stats = strategy.sync_on_read_buffers(model)
    replicas = strategy.experimental_local_results(model)
    assert not torch.equal(replicas[0][1].running_mean, replicas[1][1].running_mean)  # each its own share
    torch.testing.assert_close(stats["1.running_mean"].read_value(), reference[1].running_mean, atol=1e-6, rtol=0)
    assert int(stats["1.num_batches_tracked"].read_value()) == 1


def test_central_storage_gathers_batch_norm_statistics_into_the_central_module(data):
    x, _ = data
    strategy = CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        optimizer.zero_grad()
        model(batch).sum().backward()
        optimizer.step()

    strategy.run(step, args=(next(iter(strategy.experimental_distribute_dataset([x]))),))
    copies = strategy.experimental_local_results(model)
    expected = (copies[0][1].running_mean + copies[1][1].running_mean) / 2
    torch.testing.assert_close(model[1].running_mean, expected)


# ------------------------------------------------------------------ clear errors


@pytest.mark.parametrize(
    "factory",
    [
        lambda: MirroredStrategy(devices=["cuda:3"]),
        lambda: OneDeviceStrategy("cuda:3"),
        lambda: CentralStorageStrategy(compute_devices=["cpu:0"], parameter_device="cuda:7"),
    ],
)
def test_a_device_this_machine_lacks_is_refused_at_construction(factory):
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has that many GPUs")
    with pytest.raises(ValueError, match="does not exist.*CUDA device"):
        factory()


def test_bad_device_names_are_refused():
    with pytest.raises(ValueError, match="not a device name"):
        OneDeviceStrategy("tpu:0")
    with pytest.raises(ValueError, match="twice"):
        MirroredStrategy(devices=["cpu", "cpu:0"])
    assert OneDeviceStrategy("/job:localhost/replica:0/task:0/device:CPU:0").device == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="NCCL works here")
def test_nccl_without_two_gpus_names_the_fix():
    with pytest.raises(RuntimeError, match="ReductionToOneDevice"):
        NcclAllReduce()
    with pytest.raises(RuntimeError, match="ReductionToOneDevice"):
        MirroredStrategy(devices=["cpu:0", "cpu:1"], cross_device_ops=NcclAllReduce())


def test_a_module_built_outside_the_scope_is_refused_inside_run(data):
    x, _ = data
    outsider = nn.Linear(4, 3)
    stateless = nn.Tanh()  # no parameters: safe to share, so allowed
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with pytest.raises(RuntimeError, match="not built in MirroredStrategy.scope.*inside `with strategy.scope"):
        strategy.run(lambda: outsider(x))
    strategy.run(lambda: stateless(x))
    assert close_leaves_no_thread(strategy) == []


def test_an_optimizer_built_outside_the_scope_is_refused_inside_run(data):
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="SGD was not built in MirroredStrategy.scope"):
        strategy.run(optimizer.step)


def test_an_optimizer_over_parameters_from_outside_the_scope_is_refused_at_scope_exit():
    outsider = make_mlp()
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with pytest.raises(RuntimeError, match="parameter.*of no module built in MirroredStrategy.scope"):
        with strategy.scope():
            torch.optim.SGD(outsider.parameters(), lr=0.1)


def test_optimizer_step_outside_run_is_refused(data):
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="inside strategy.run"):
        optimizer.step()


def test_a_failing_replica_is_reported_with_its_id_and_releases_the_others(data):
    x, y = data
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        if get_replica_context().replica_id_in_sync_group == 1:
            raise ValueError("bad batch")
        compute_average_loss(per_example_loss(model, *batch)).backward()
        optimizer.step()  # replica 0 waits here for replica 1, which never comes

    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    with pytest.raises(ValueError, match="bad batch") as raised:
        strategy.run(step, args=(batch,))
    assert any("replica 1" in note for note in raised.value.__notes__)
    strategy.run(lambda: None)  # the failure released every replica: the strategy is usable again
    assert close_leaves_no_thread(strategy) == []


# ------------------------------------------------------------------ input and reductions


def test_dataset_sharding_takes_every_nth_batch():
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    batches = [torch.full((2, 1), float(i)) for i in range(6)]
    shard = DistributedDataset(batches, strategy.replica_devices, num_input_pipelines=2, input_pipeline_id=1)
    assert [float(b.values[0]) for b in shard] == [1.0, 3.0, 5.0]
    assert len(shard) == 3
    with pytest.raises(TypeError, match="DataLoader"):
        strategy.experimental_distribute_dataset(torch.utils.data.TensorDataset(torch.zeros(4, 1)))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=4)
    first = next(iter(strategy.experimental_distribute_dataset(loader)))
    assert [p.tolist() for p in first[0].values] == [[0.0, 1.0], [2.0, 3.0]]


def test_distribute_datasets_from_function_gives_each_replica_consecutive_batches():
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    seen: list[InputContext] = []

    def dataset_fn(context: InputContext):
        seen.append(context)
        per_replica = context.get_per_replica_batch_size(4)
        return [torch.full((per_replica,), float(i)) for i in range(3)]

    steps = list(strategy.distribute_datasets_from_function(dataset_fn))
    assert seen == [InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=2)]
    assert [[p.tolist() for p in s.values] for s in steps] == [[[0.0, 0.0], [1.0, 1.0]], [[2.0, 2.0], []]]


@pytest.mark.parametrize("ops", [ReductionToOneDevice(), ReductionToOneDevice("cpu"), HierarchicalCopyAllReduce()])
def test_cross_device_ops_reduce_broadcast_and_all_reduce(ops):
    parts = PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    assert ops.reduce("SUM", parts, "cpu").tolist() == [4.0, 6.0]
    mean = ops.reduce(ReduceOp.MEAN, parts, ["cpu", "cpu"])
    assert isinstance(mean, Mirrored) and [m.tolist() for m in mean.values] == [[2.0, 3.0], [2.0, 3.0]]
    assert mean.values[0] is not mean.values[1]
    reduced = ops.all_reduce("SUM", parts)
    assert reduced.values[0] is not reduced.values[1] and reduced.values[1].tolist() == [4.0, 6.0]
    assert ops.batch_reduce("SUM", [(parts, "cpu")])[0].tolist() == [4.0, 6.0]
    with pytest.raises(ValueError, match="different shapes"):
        ops.reduce("SUM", [torch.zeros(2), torch.zeros(3)], "cpu")


def test_a_deep_copy_of_a_mirrored_model_is_a_plain_module():
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = make_mlp()
    clone = copy.deepcopy(model)
    assert type(clone) is nn.Sequential and type(clone[0]) is nn.Linear
    assert strategy.experimental_local_results(clone) == (clone,)


def test_eval_and_load_state_dict_outside_run_reach_every_replica(initial_state):
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = make_mlp()
    model.eval()
    model.load_state_dict(initial_state)
    replicas = strategy.experimental_local_results(model)
    assert not any(r.training or r[0].training for r in replicas)
    assert all(torch.equal(r[0].weight, initial_state["0.weight"]) for r in replicas)


def test_code_reaching_into_the_model_uses_the_replica_copy(data, initial_state):
    """An L2 penalty over model.parameters() inside run must read each replica's own copy."""
    x, y = data
    reference = make_mlp()
    reference.load_state_dict(initial_state)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = make_mlp()
        model.load_state_dict(initial_state)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def l2(module: nn.Module) -> torch.Tensor:
        return sum(p.pow(2).sum() for p in module.parameters()) * 0.01 + module[0].weight.abs().sum() * 0.01

    def step(batch):
        optimizer.zero_grad()
        loss = compute_average_loss(per_example_loss(model, *batch)) + scale_regularization_loss(l2(model))
        loss.backward()
        optimizer.step()

    for batch in strategy.experimental_distribute_dataset([(x, y)] * 3):
        strategy.run(step, args=(batch,))
        ref_opt.zero_grad()
        (per_example_loss(reference, x, y).mean() + l2(reference)).backward()
        ref_opt.step()
    assert_close_to(model, reference)
    assert_replicas_identical(strategy, model)


def test_a_scope_opened_inside_run_is_refused():
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])

    def build():
        with strategy.scope():
            return nn.Linear(2, 2)

    with pytest.raises(RuntimeError, match="scope before calling strategy.run"):
        strategy.run(build)


# ------------------------------------------------------------------ GPUs (skipped on CPU-only machines)


@needs_two_gpus
def test_mirrored_on_two_gpus_matches_one_device(data, initial_state):
    x, y = data
    strategy = MirroredStrategy(devices=["cuda:0", "cuda:1"])
    model, _, _ = train_with(strategy, initial_state, [(x, y)] * STEPS)
    reference = train_single_device(initial_state, x, y)
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=0)
    assert_replicas_identical(strategy, model)


@needs_two_gpus
@pytest.mark.parametrize("ops_factory", [NcclAllReduce, HierarchicalCopyAllReduce])
def test_gpu_all_reduce(ops_factory):
    parts = [torch.tensor([1.0, 2.0], device="cuda:0"), torch.tensor([3.0, 4.0], device="cuda:1")]
    reduced = ops_factory().all_reduce("SUM", parts)
    assert [v.device for v in reduced.values] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert [v.cpu().tolist() for v in reduced.values] == [[4.0, 6.0], [4.0, 6.0]]


def test_a_checkpoint_of_a_mirrored_model_and_optimizer_resumes_exactly(data, initial_state):
    x, y = data
    first = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    model, _, first_optimizer = train_with(first, initial_state, [(x, y)] * 2)
    optimizer_state = first_optimizer.state_dict()
    model_state = copy.deepcopy(model.state_dict())

    second = MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    with second.scope():
        resumed = make_mlp()
        optimizer = torch.optim.SGD(resumed.parameters(), lr=LR, momentum=MOMENTUM)
    resumed.load_state_dict(model_state)
    optimizer.load_state_dict(optimizer_state)  # outside run: every replica's optimizer

    def step(batch):
        optimizer.zero_grad()
        compute_average_loss(per_example_loss(resumed, *batch)).backward()
        optimizer.step()

    for batch in second.experimental_distribute_dataset([(x, y)] * (STEPS - 2)):
        second.run(step, args=(batch,))
    assert_close_to(resumed, train_single_device(initial_state, x, y))
    assert_replicas_identical(second, resumed)


# ------------------------------------------------------------------ replica threads and the gradient sum


def test_replica_threads_are_reused_across_runs_and_joined_at_close():
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    assert strategy._threads.threads == ()  # started by the first run, not before
    names = strategy.run(lambda: threading.current_thread())
    first = names.values
    assert [t.name for t in first] == ["MirroredStrategy-replica-0", "MirroredStrategy-replica-1"]
    assert all(t.is_alive() for t in first)
    assert strategy.run(lambda: threading.current_thread()).values == first  # the same threads

    with pytest.raises(RuntimeError, match="inside its own run"):
        strategy.run(strategy.close)
    strategy.close()
    assert [t for t in first if t.is_alive()] == []
    strategy.close()  # idempotent
    with pytest.raises(RuntimeError, match="was closed"):  # close() ends the strategy
        strategy.run(lambda: None)


def test_replica_threads_of_a_dropped_strategy_exit_without_close():
    import gc

    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    threads = strategy.run(lambda: threading.current_thread()).values
    del strategy
    gc.collect()
    for thread in threads:
        thread.join(timeout=10)
    assert [t.name for t in threads if t.is_alive()] == []


class _PlainSum(CrossDeviceOps):
    """A user's cross-device ops: the strategy must call it (no local fast path)."""

    def __init__(self):
        self.calls = 0

    def batch_all_reduce(self, reduce_op, per_replica_values):
        self.calls += 1
        return super().batch_all_reduce(reduce_op, per_replica_values)


@pytest.mark.parametrize("replicas", [2, 3])
def test_cpu_gradient_sum_is_bitwise_the_cross_device_ops_one(replicas, data, initial_state):
    x, y = data
    devices = [f"cpu:{i}" for i in range(replicas)]
    fast = MirroredStrategy(devices=devices)
    plain = MirroredStrategy(devices=devices, cross_device_ops=_PlainSum())
    assert fast._sums_locally() and not plain._sums_locally()
    fast_model, fast_losses, _ = train_with(fast, initial_state, [(x, y)] * STEPS)
    plain_model, plain_losses, _ = train_with(plain, initial_state, [(x, y)] * STEPS)
    assert plain.cross_device_ops.calls == STEPS
    for a, b in zip(fast_model.parameters(), plain_model.parameters()):
        assert torch.equal(a, b)
    for copy_ in fast.experimental_local_results(fast_model):
        grads = [p.grad for p in copy_.parameters()]
        assert all(g is not None for g in grads)
    # each replica's gradients are tensors of its own (no aliasing across replicas)
    per_replica = [[p.grad for p in m.parameters()] for m in fast.experimental_local_results(fast_model)]
    for other in per_replica[1:]:
        for g0, g in zip(per_replica[0], other):
            assert g.data_ptr() != g0.data_ptr() and torch.equal(g, g0)
    fast.close()
    plain.close()


@pytest.mark.parametrize(
    "make",
    [
        lambda: MirroredStrategy(devices=["cpu:0", "cpu:1"]),
        lambda: CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"]),
    ],
    ids=["mirrored", "central_storage"],
)
def test_the_mean_of_integers_divides_exactly_as_tensorflow_does(make):
    """TF's reduce example: MEAN of 1 and 98 is 49.5, not the floor 49 (issue 22, item 1)."""
    strategy = make()

    def replica_values():
        context = get_replica_context()
        value = torch.tensor([1, 98][context.replica_id_in_sync_group])
        return value, context.all_reduce(ReduceOp.MEAN, value)

    values, all_reduced = strategy.run(replica_values)

    assert strategy.reduce(ReduceOp.MEAN, values, axis=None).item() == 49.5
    assert [v.item() for v in strategy.experimental_local_results(all_reduced)] == [49.5, 49.5]
    assert strategy.reduce(ReduceOp.SUM, values, axis=None).dtype == torch.int64, "SUM keeps the dtype"


def test_a_sync_on_read_variable_without_an_aggregation_refuses_a_cross_replica_read():
    """TF's default aggregation is NONE (issue 22, item 5): no silent SUM."""
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        variable = SyncOnReadVariable(1.0)
    assert variable.aggregation is VariableAggregation.NONE
    with pytest.raises(ValueError, match="aggregation NONE has no cross-replica value"):
        variable.aggregate()
    assert [v.item() for v in strategy.experimental_local_results(variable)] == [1.0, 1.0]


def test_a_short_last_batch_leaves_the_last_replicas_short_as_tensorflow_does():
    """5 examples over 4 replicas: [2, 2, 1, 0], not [2, 1, 1, 1] (issue 22, item 3)."""
    strategy = MirroredStrategy(devices=[f"cpu:{i}" for i in range(4)])
    (batch,) = list(strategy.experimental_distribute_dataset([torch.arange(5)]))
    assert [part.tolist() for part in batch.values] == [[0, 1], [2, 3], [4], []]
    (even,) = list(strategy.experimental_distribute_dataset([torch.arange(8)]))
    assert [part.shape[0] for part in even.values] == [2, 2, 2, 2]
