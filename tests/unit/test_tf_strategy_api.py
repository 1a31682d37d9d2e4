"""The rest of tf.distribute's Strategy API on the in-process strategies (issue #22):
``strategy.extended`` (StrategyExtended), ``ReplicaContext.merge_call`` / ``all_gather``,
``Strategy.gather``, ``experimental_distribute_values_from_function`` with ValueContext,
TensorFlow's deprecated spellings, ``cluster_resolver``, ``experimental_set_strategy``,
``num_packs`` and TensorFlow's device names. CPU replicas; processes stood in for by threads."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn

from paramserve.coordinator.strategies import (
    CentralStorageStrategy,
    HierarchicalCopyAllReduce,
    Mirrored,
    MirroredStrategy,
    MultiWorkerMirroredStrategy,
    NcclAllReduce,
    OneDeviceStrategy,
    PerReplica,
    ReduceOp,
    ReductionToOneDevice,
    StrategyExtended,
    SyncOnReadVariable,
    ValueContext,
    experimental_set_strategy,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from paramserve.coordinator.strategies import base as base_module
from paramserve.coordinator.strategies.base import SingleReplicaStrategy
from paramserve.coordinator.strategies.central_storage import default_parameter_device
from paramserve.coordinator.strategies.multi_worker_cluster import Rendezvous

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


@pytest.fixture
def mirrored():
    strategy = MirroredStrategy(["cpu:0", "cpu:1"])
    yield strategy
    strategy.close()


def replica_id() -> int:
    context = get_replica_context()
    assert context is not None
    return context.replica_id_in_sync_group


# ------------------------------------------------------------------ strategy.extended


def test_every_strategy_has_one_extended_with_its_devices():
    one, mirrored = OneDeviceStrategy("cpu"), MirroredStrategy(["cpu:0", "cpu:1"])
    central = CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu")
    try:
        for strategy in (get_strategy(), one, mirrored, central):
            assert isinstance(strategy.extended, StrategyExtended) and strategy.extended is strategy.extended
            assert strategy.extended.experimental_require_static_shapes is False
        assert one.extended.worker_devices == one.extended.parameter_devices == ("cpu:0",)
        assert mirrored.extended.worker_devices == mirrored.extended.parameter_devices == ("cpu:0", "cpu:1")
        assert central.extended.worker_devices == ("cpu:0", "cpu:1")
        assert central.extended.parameter_devices == ("cpu:0",)
        with pytest.raises(RuntimeError, match="OneDeviceStrategy"):  # as TensorFlow's default strategy
            get_strategy().extended.worker_devices  # noqa: B018
    finally:
        mirrored.close()
        central.close()


def test_update_changes_every_copy_of_a_mirrored_variable(mirrored):
    with mirrored.scope():
        model = nn.Linear(2, 3)
    copies = mirrored.experimental_local_results(model.bias)
    expected = model.bias.detach() + 1

    result = mirrored.extended.update(model.bias, lambda v, d: v.add_(d), args=(torch.ones(3),))
    assert isinstance(result, Mirrored) and result.values[0] is copies[0] and result.values[1] is copies[1]
    assert all(torch.equal(c, expected) for c in copies)

    deltas = Mirrored([torch.ones(3), torch.ones(3)])  # one component per copy
    per_copy = mirrored.extended.update(model.bias, lambda v, d: v.add_(d), args=(deltas,), group=False)
    assert isinstance(per_copy, tuple) and len(per_copy) == 2
    assert all(torch.equal(c, expected + 1) for c in copies)


def test_update_of_central_storage_changes_the_central_parameter_once():
    strategy = CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="cpu")
    try:
        with strategy.scope():
            model = nn.Linear(2, 3)
        calls = []

        def add(v, d):
            calls.append(v)
            return v.add_(d)

        result = strategy.extended.update(model.bias, add, args=(torch.ones(3),))
        assert len(calls) == 1 and calls[0] is model.bias and result is model.bias
        assert all(torch.equal(copy, model.bias) for copy in strategy.experimental_local_results(model.bias))
    finally:
        strategy.close()


def test_update_refuses_a_per_replica_argument_and_another_strategys_tensor(mirrored):
    with mirrored.scope():
        model = nn.Linear(2, 3)
    with pytest.raises(ValueError, match="reduce it first"):
        mirrored.extended.update(model.bias, lambda v, d: v.add_(d), args=(PerReplica([torch.ones(3)] * 2),))
    with pytest.raises(ValueError, match="build it in the scope"):
        mirrored.extended.update(torch.zeros(3), lambda v: v.add_(1))
    plain = torch.zeros(2)  # under one replica any tensor is a variable, as in TensorFlow
    assert get_strategy().extended.update(plain, lambda v: v.add_(1)) is plain and plain.tolist() == [1.0, 1.0]


def test_update_inside_run_is_a_merge_point_updating_each_replicas_copy(mirrored):
    with mirrored.scope():
        model = nn.Linear(2, 3)
    expected = model.bias.detach() + 1

    def step():
        return mirrored.extended.update(model.bias, lambda v, d: v.add_(d), args=(torch.ones(3),))

    results = mirrored.run(step)
    copies = mirrored.experimental_local_results(model.bias)
    assert results.values[0] is copies[0] and results.values[1] is copies[1]  # each replica its own copy
    assert all(torch.equal(c, expected) for c in copies)


def test_reduce_to_and_batch_reduce_to(mirrored):
    parts = PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    extended = mirrored.extended
    assert extended.reduce_to("SUM", parts, "/cpu:0").tolist() == [4.0, 6.0]
    mean = extended.reduce_to(ReduceOp.MEAN, parts, parts)  # to the value's own devices: an all-reduce
    assert isinstance(mean, Mirrored) and [m.tolist() for m in mean.values] == [[2.0, 3.0], [2.0, 3.0]]
    with mirrored.scope():
        model = nn.Linear(2, 2)
    assert len(extended.reduce_to("SUM", parts, model.bias).values) == 2  # to each copy of the variable
    doubled = extended.reduce_to("SUM", model.bias, "cpu")  # a mirrored variable's copies summed
    assert torch.allclose(doubled, 2 * model.bias.detach())
    single, several = extended.batch_reduce_to("SUM", [(parts, "cpu"), (parts, ["cpu:0", "cpu:1"])])
    assert single.tolist() == [4.0, 6.0] and isinstance(several, Mirrored)
    assert extended.reduce_to("MEAN", torch.ones(2), "cpu").tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="cannot SUM"):
        extended.reduce_to("SUM", torch.ones(2), "cpu")
    with pytest.raises(ValueError, match="destinations must be"):
        extended.reduce_to("SUM", parts, 3)
    with pytest.raises(RuntimeError, match="cross-replica"):
        mirrored.run(lambda: extended.reduce_to("SUM", parts, "cpu"))
    assert float(get_strategy().extended.reduce_to("SUM", 2.0, "cpu")) == 2.0


def test_variable_created_in_scope_and_value_container(mirrored):
    with mirrored.scope():
        model = nn.BatchNorm1d(3)
    stranger = torch.zeros(3)
    extended = mirrored.extended
    weights = mirrored.experimental_local_results(model.weight)
    means = mirrored.experimental_local_results(model.running_mean)  # buffers have a copy per replica too
    assert len(means) == 2 and means[1] is not model.running_mean
    for variable in (model.weight, weights[1], model.running_mean, means[1]):
        assert extended.variable_created_in_scope(variable)
    assert not extended.variable_created_in_scope(stranger)
    assert extended.value_container(weights[1]) is model.weight
    assert extended.value_container(means[1]) is model.running_mean
    assert any(c is weights[1] for c in mirrored.experimental_local_results(extended.value_container(weights[1])))
    assert extended.value_container(stranger) is stranger
    assert extended.variable_created_in_scope(SyncOnReadVariable(0.0, "SUM", mirrored))
    default = get_strategy().extended  # as TensorFlow's: a variable no strategy created
    assert default.variable_created_in_scope(stranger) and not default.variable_created_in_scope(model.weight)
    one = OneDeviceStrategy("cpu")
    with one.scope():
        linear = nn.Linear(1, 1)
    assert one.extended.variable_created_in_scope(linear.weight)
    assert not one.extended.variable_created_in_scope(model.weight)


def test_colocate_vars_with_accepts_this_strategys_variables_only(mirrored):
    with mirrored.scope():
        model = nn.Linear(2, 2)
        with mirrored.extended.colocate_vars_with(model.weight):
            other = nn.Linear(2, 2)
    assert len(mirrored.experimental_local_results(other.weight)) == 2  # on the same devices: every replica's
    with mirrored.extended.colocate_vars_with(model.weight):
        pass
    with pytest.raises(ValueError, match="another strategy"):
        with get_strategy().extended.colocate_vars_with(model.weight):
            pass


# ------------------------------------------------------------------ ReplicaContext


def test_merge_call_runs_merge_fn_once_in_cross_replica_context_with_merged_arguments():
    strategy = MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    shared, calls = object(), []

    def merge_fn(given, value, same, *, scale):
        calls.append((given, get_replica_context(), in_cross_replica_context(), value, same, scale))
        return PerReplica([v * scale for v in value.values]), "plain"

    def step():
        context = get_replica_context()
        return context.merge_call(merge_fn, args=(torch.tensor(float(replica_id())), shared), kwargs={"scale": 10})

    try:
        scaled, plain = strategy.run(step)
    finally:
        strategy.close()
    assert len(calls) == 1
    given, context, cross, value, same, scale = calls[0]
    assert given is strategy and context is None and cross and same is shared and scale == 10
    assert isinstance(value, PerReplica) and [float(v) for v in value.values] == [0.0, 1.0, 2.0]
    assert [float(v) for v in scaled.values] == [0.0, 10.0, 20.0] and plain == "plain"


def test_merge_call_errors_reach_run(mirrored):
    with pytest.raises(ZeroDivisionError):
        mirrored.run(lambda: get_replica_context().merge_call(lambda s: 1 / 0))
    with pytest.raises(ValueError, match="different number of arguments"):
        mirrored.run(lambda: get_replica_context().merge_call(lambda s, *a: None, args=(1,) * (replica_id() + 1)))
    with pytest.raises(RuntimeError, match="inside its own run"):
        mirrored.run(lambda: get_replica_context().merge_call(lambda s: s.run(lambda: None)))


def test_merge_call_under_one_replica_calls_merge_fn_on_its_arguments():
    seen = []

    def merge_fn(strategy, x):
        seen.append((strategy, in_cross_replica_context()))
        return x + 1

    assert get_replica_context().merge_call(merge_fn, args=(1,)) == 2  # the default replica context
    assert seen == [(get_strategy(), True)]
    one = OneDeviceStrategy("cpu")
    assert one.run(lambda: get_replica_context().merge_call(lambda s: s)) is one


def test_replica_context_properties_are_read_only():
    context = get_replica_context()
    assert context.strategy is get_strategy() and context.replica_id_in_sync_group == 0
    with pytest.raises(AttributeError):
        context.replica_id_in_sync_group = 1


def test_all_gather_concatenates_every_replicas_value_in_order(mirrored):
    shares = PerReplica([torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0], [5.0, 6.0]])])

    def step(x):
        context = get_replica_context()
        return context.all_gather(x, axis=0), context.all_gather({"columns": x[:1].t()}, axis=-1)

    rows, nested = mirrored.run(step, args=(shares,))
    assert [r.tolist() for r in rows.values] == [[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]] * 2
    assert rows.values[0] is not rows.values[1]
    assert nested["columns"].values[1].tolist() == [[1.0, 3.0], [2.0, 4.0]]
    with pytest.raises(ValueError, match="scalar"):
        mirrored.run(lambda: get_replica_context().all_gather(torch.tensor(1.0), 0))
    with pytest.raises(ValueError, match="same shape"):
        mirrored.run(lambda: get_replica_context().all_gather(torch.zeros(1, replica_id() + 1), 0))


def test_all_gather_gradient_is_this_replicas_slice_of_the_summed_gradients(mirrored):
    xs = PerReplica([torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([3.0], requires_grad=True)])
    weights = PerReplica([torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0])])

    def step(x, w):
        (get_replica_context().all_gather(x, 0) * w).sum().backward()
        return x.grad

    grads = mirrored.run(step, args=(xs, weights))
    assert grads.values[0].tolist() == [11.0, 22.0] and grads.values[1].tolist() == [33.0]


# ------------------------------------------------------------------ Strategy.gather, values from a function


def test_gather_concatenates_per_replica_values_along_an_axis(mirrored):
    parts = PerReplica([torch.ones(2, 3), torch.zeros(1, 3)])
    gathered = mirrored.gather(parts, axis=0)
    assert gathered.shape == (3, 3) and gathered.device.type == "cpu"
    assert gathered[:2].eq(1).all() and gathered[2:].eq(0).all()
    assert mirrored.gather(PerReplica([torch.ones(2, 1), torch.zeros(2, 2)]), axis=1).shape == (2, 3)
    assert mirrored.gather({"a": parts}, 0)["a"].shape == (3, 3)
    ids = mirrored.run(lambda: torch.full((1,), float(replica_id())))
    assert mirrored.gather(ids, 0).tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="not a per-replica value"):
        mirrored.gather(torch.ones(2), 0)
    with pytest.raises(ValueError, match="out of range"):
        mirrored.gather(parts, 2)
    with pytest.raises(RuntimeError, match="all_gather"):
        mirrored.run(lambda: mirrored.gather(parts, 0))
    value = torch.ones(2, requires_grad=True)
    one = OneDeviceStrategy("cpu").gather(value, 0)
    assert torch.equal(one, value) and not one.requires_grad


def test_values_from_a_function_give_each_replica_its_own():
    strategy = MirroredStrategy(["cpu:0", "cpu:1"])
    contexts = []

    def value_fn(context):
        contexts.append(context)
        return torch.tensor(float(context.replica_id_in_sync_group))

    try:
        values = strategy.experimental_distribute_values_from_function(value_fn)
        assert contexts == [ValueContext(0, 2), ValueContext(1, 2)]
        assert isinstance(values, PerReplica) and [float(v) for v in values.values] == [0.0, 1.0]
        assert [float(v) for v in strategy.run(lambda v: v * 2, args=(values,)).values] == [0.0, 2.0]
        assert float(strategy.reduce("SUM", values)) == 1.0
    finally:
        strategy.close()
    default = get_strategy().experimental_distribute_values_from_function
    assert default(lambda c: (c.replica_id_in_sync_group, c.num_replicas_in_sync)) == (0, 1)
    assert ValueContext() == ValueContext(0, 1)
    with pytest.raises(ValueError, match="replica id 2"):
        ValueContext(2, 2)


# ------------------------------------------------------------------ processes, stood in for by threads


class _Bus:
    """Sums the tensors of the threads that stand in for processes (an all-reduce)."""

    def __init__(self, parties: int):
        self._barrier = threading.Barrier(parties, timeout=30)
        self._slots: list[torch.Tensor] = [torch.empty(0)] * parties

    def sum(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        self._slots[rank] = tensor.clone()
        self._barrier.wait()
        total = torch.stack(self._slots).sum(dim=0).to(tensor.dtype)
        self._barrier.wait()
        return total


class _OneReplicaOfTwoProcesses(SingleReplicaStrategy):
    """What the base class knows of a strategy spanning processes: its replica id and a sum."""

    def __init__(self, rank: int, bus: _Bus):
        self.rank, self.bus = rank, bus

    @property
    def num_replicas_in_sync(self) -> int:
        return 2

    @property
    def local_replicas(self) -> int:
        return 1

    def local_index(self, replica_id: int) -> int:
        return 0

    def sum_across_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.bus.sum(self.rank, tensor)

    def run(self, fn, args=(), kwargs=None):
        with self._in_replica(self.rank):
            return fn(*args, **(kwargs or {}))


def _as_two_processes(body):
    bus, results, errors = _Bus(2), [None, None], [None, None]

    def process(rank):
        try:
            results[rank] = body(_OneReplicaOfTwoProcesses(rank, bus), rank)
        except Exception as error:
            errors[rank] = error

    threads = [threading.Thread(target=process, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results, errors


def test_strategies_spanning_processes_gather_through_their_cross_process_sum():
    def body(strategy, rank):
        x = torch.tensor([[float(rank), 1.0]])
        in_run = strategy.run(lambda: get_replica_context().all_gather(x, 0))
        flags = strategy.run(lambda: get_replica_context().all_gather(torch.tensor([rank == 1]), 0))
        ids = strategy.experimental_distribute_values_from_function(lambda c: c.replica_id_in_sync_group)
        return in_run, strategy.gather(x + 10, axis=1), flags, ids

    results, errors = _as_two_processes(body)
    assert errors == [None, None]
    for rank, (in_run, gathered, flags, ids) in enumerate(results):
        assert in_run.tolist() == [[0.0, 1.0], [1.0, 1.0]] and gathered.tolist() == [[10.0, 11.0, 11.0, 11.0]]
        assert flags.dtype == torch.bool and flags.tolist() == [False, True] and ids == rank


def test_processes_with_different_shapes_all_refuse_to_gather():
    results, errors = _as_two_processes(
        lambda strategy, rank: strategy.run(lambda: get_replica_context().all_gather(torch.zeros(rank + 1), 0))
    )
    assert all(isinstance(e, ValueError) and "same shapes" in str(e) for e in errors)


def test_multi_worker_mirrored_strategy_inherits_the_api():
    strategy = MultiWorkerMirroredStrategy(cluster_resolver=Rendezvous(0, 1))
    try:
        x = torch.tensor([[1.0, 2.0]])
        assert isinstance(strategy.extended, StrategyExtended) and strategy.cluster_resolver is not None
        assert strategy.gather(x, 0).tolist() == [[1.0, 2.0]]
        doubled = strategy.run(lambda: get_replica_context().merge_call(lambda s, v: v * 2, args=(x,)))
        assert doubled.tolist() == [[2.0, 4.0]]
        assert strategy.run(lambda: get_replica_context().all_gather(x, 1)).tolist() == [[1.0, 2.0]]
        assert strategy.experimental_distribute_values_from_function(lambda c: c.num_replicas_in_sync) == 1
        assert strategy.extended.reduce_to("SUM", x, "cpu").tolist() == [[1.0, 2.0]]
    finally:
        strategy.close()


# ------------------------------------------------------------------ deprecated names, cluster_resolver


def test_tensorflow_deprecated_names_warn_once_naming_the_new_one(monkeypatch):
    monkeypatch.setattr(base_module, "_renamed_warned", set())
    strategy = OneDeviceStrategy("cpu")
    with pytest.warns(DeprecationWarning, match=r"strategy\.run "):
        assert strategy.experimental_run_v2(lambda x: x + 1, args=(1,)) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert strategy.experimental_run_v2(lambda: 3) == 3
    with pytest.warns(DeprecationWarning, match=r"strategy\.distribute_datasets_from_function "):
        batches = list(strategy.experimental_distribute_datasets_from_function(lambda context: [torch.ones(2)]))
    assert len(batches) == 1


def test_in_process_strategies_have_no_cluster_resolver():
    mirrored, central = MirroredStrategy(["cpu:0"]), CentralStorageStrategy(["cpu:0"])
    try:
        for strategy in (get_strategy(), OneDeviceStrategy("cpu"), mirrored, central):
            assert strategy.cluster_resolver is None
    finally:
        mirrored.close()
        central.close()


# ------------------------------------------------------------------ experimental_set_strategy


def test_experimental_set_strategy_makes_a_strategy_current_until_none(mirrored):
    try:
        experimental_set_strategy(mirrored)
        assert get_strategy() is mirrored and has_strategy() and get_replica_context() is None
        seen = []
        other = threading.Thread(target=lambda: seen.append((get_strategy(), get_replica_context())))
        other.start()
        other.join()
        assert seen == [(mirrored, None)]  # current in every thread, in cross-replica context

        model = nn.Linear(2, 1)  # a notebook cell: no `with strategy.scope():` block
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x):
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()

        before = model.weight.detach().clone()
        mirrored.run(step, args=(PerReplica([torch.ones(1, 2), torch.zeros(1, 2)]),))
        copies = mirrored.experimental_local_results(model.weight)
        assert len(copies) == 2 and torch.equal(copies[0], copies[1]) and not torch.equal(copies[0], before)

        with pytest.raises(RuntimeError, match="inside a strategy's scope"):
            with mirrored.scope():
                experimental_set_strategy(None)
        errors = []

        def unset_elsewhere():
            try:
                experimental_set_strategy(None)
            except RuntimeError as error:
                errors.append(error)

        other = threading.Thread(target=unset_elsewhere)
        other.start()
        other.join()
        assert len(errors) == 1 and "another thread" in str(errors[0])
    finally:
        experimental_set_strategy(None)
    assert not has_strategy() and get_replica_context() is not None


# ------------------------------------------------------------------ cross-device ops and device names


class _CountingOps(HierarchicalCopyAllReduce):
    def __init__(self, num_packs: int):
        super().__init__(num_packs=num_packs)
        self.transfers = 0

    def _sum_to_all(self, tensors):
        self.transfers += 1
        return super()._sum_to_all(tensors)


@pytest.mark.parametrize(("num_packs", "transfers"), [(0, 3), (1, 1), (2, 2)])
def test_num_packs_packs_a_batch_all_reduce_with_the_same_sums(num_packs, transfers):
    generator = torch.Generator().manual_seed(0)
    values = [PerReplica([torch.randn(shape, generator=generator) for _ in range(2)]) for shape in [(3, 2), (4,), ()]]
    ops = _CountingOps(num_packs)
    packed = ops.batch_all_reduce("SUM", values)
    assert ops.transfers == transfers
    for value, mirrored in zip(values, packed):
        expected = value.values[0] + value.values[1]
        assert all(torch.equal(m, expected) for m in mirrored.values)


def test_num_packs_must_be_a_non_negative_integer():
    assert HierarchicalCopyAllReduce().num_packs == 1  # TensorFlow's default
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="num_packs"):
            HierarchicalCopyAllReduce(num_packs=bad)
        with pytest.raises(ValueError, match="num_packs"):  # checked before the GPUs are
            NcclAllReduce(num_packs=bad)


@needs_two_gpus
def test_nccl_all_reduce_packs_too():
    values = [PerReplica([torch.full((3,), float(i), device=f"cuda:{i}") for i in range(2)]) for _ in range(3)]
    for mirrored in NcclAllReduce(num_packs=2).batch_all_reduce("SUM", values):
        assert [m.tolist() for m in mirrored.values] == [[1.0, 1.0, 1.0]] * 2


def test_tensorflow_device_names_are_accepted_wherever_a_device_is():
    strategy = MirroredStrategy(["/cpu:0", "/job:worker/replica:0/task:0/device:CPU:1"])
    try:
        assert strategy.device_names == ("cpu:0", "cpu:1")
    finally:
        strategy.close()
    assert OneDeviceStrategy("/device:CPU:0").device_name == "cpu:0"
    central = CentralStorageStrategy(["/cpu:0"], parameter_device="/device:CPU:0")
    try:
        assert central.parameter_device == torch.device("cpu")
    finally:
        central.close()
    assert ReductionToOneDevice("/cpu:0").reduce_to_device == torch.device("cpu")
    parts = PerReplica([torch.ones(1), torch.ones(1)])
    assert ReductionToOneDevice().reduce("SUM", parts, "/device:CPU:0").tolist() == [2.0]
    copies = HierarchicalCopyAllReduce().broadcast(torch.ones(1), ["/cpu:0", "/job:localhost/device:CPU:1"])
    assert len(copies.values) == 2
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            ReductionToOneDevice().reduce("SUM", parts, "/device:GPU:0")


@needs_gpu
def test_tensorflow_gpu_names_name_the_gpu():
    assert OneDeviceStrategy("/gpu:0").device == torch.device("cuda", 0)
    assert ReductionToOneDevice("/device:GPU:0").reduce_to_device == torch.device("cuda", 0)


def test_central_storage_chooses_the_parameter_device_as_tensorflow_does():
    assert default_parameter_device(["cuda:0"], cuda_devices=1) == "cuda:0"  # the one GPU
    assert default_parameter_device(["cuda:0", "cuda:1"], cuda_devices=2) == "cpu"
    assert default_parameter_device(["cpu:0", "cpu:1"], cuda_devices=0) == "cpu"
    strategy = CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device=None)
    try:
        assert strategy.parameter_device == torch.device("cpu")
    finally:
        strategy.close()


def test_a_parameter_server_strategy_names_its_workers_and_servers_and_refuses_colocation():
    from paramserve.coordinator.cluster import ClusterSpec
    from paramserve.coordinator.strategies import ParameterServerStrategy

    strategy = ParameterServerStrategy(
        ClusterSpec(parameter_servers=("127.0.0.1:1", "127.0.0.1:2"), workers=("127.0.0.1:3",))
    )
    try:
        assert strategy.extended.worker_devices == ("127.0.0.1:3",)
        assert strategy.extended.parameter_devices == ("127.0.0.1:1", "127.0.0.1:2")
        with pytest.raises(NotImplementedError, match="FixedShardsPartitioner"):
            with strategy.extended.colocate_vars_with(None):
                pass
    finally:
        strategy.close()
