"""TensorFlow's cluster resolvers, input options, distributed iterators, dataset creators,
per-worker values and partitioners (issue #22), as tf.distribute documents them."""

from __future__ import annotations

import copy
import importlib.util
import json
import pickle
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import paramserve.coordinator as ps
from paramserve.coordinator.cluster import ClusterSpec
from paramserve.coordinator.cluster_coordinator import _call_with_context, _iterator_factory
from paramserve.coordinator.cluster_resolver import (
    ClusterJobs,
    ClusterResolver,
    KubernetesClusterResolver,
    SimpleClusterResolver,
    TFConfigClusterResolver,
)
from paramserve.coordinator.remote_value import PerWorkerValues, fetch_structure
from paramserve.coordinator.strategies import (
    DatasetCreator,
    DistributedIterator,
    InputOptions,
    InputReplicationMode,
    MirroredStrategy,
    MultiWorkerMirroredStrategy,
    OptionalElement,
    ParameterServerStrategy,
    PerReplica,
    TensorSpec,
)
from paramserve.coordinator.strategies.input import (
    DistributedDataset,
    DistributedDatasetsFromFunction,
    pipeline_contexts,
    prefetch_depth,
)
from paramserve.coordinator.strategies.multi_worker_cluster import (
    CollectiveCommunication,
    CommunicationOptions,
    Rendezvous,
    strategy_arguments,
)
from paramserve.coordinator.strategies.step_runners import distribute
from paramserve.psserver.protocol.partition import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
    shard_count,
)
from paramserve.psserver.runtime.tf_config import ClusterSpecError
from paramserve.worker.resources import (
    InputContext,
    WorkerContext,
    experimental_get_current_worker_index,
    using_worker_context,
)

TF_CONFIG = {
    "cluster": {
        "chief": ["chief.example.com:2222"],
        "ps": ["ps0.example.com:2222", "ps1.example.com:2222"],
        "worker": ["worker0.example.com:2222", "worker1.example.com:2222"],
    },
    "task": {"type": "ps", "index": 1},
    "rpc_layer": "grpc",
}


def tf_config_env(config: dict[str, Any] = TF_CONFIG) -> dict[str, str]:
    return {"TF_CONFIG": json.dumps(config)}


# --------------------------------------------------------------------------- partitioners


@pytest.mark.parametrize(
    "partitioner, shape, expected",
    [
        (lambda shape, dtype: [3] + [1] * (len(shape) - 1), (10, 4), 3),  # TF's form
        (lambda shape, dtype: 2, (10, 4), 2),  # paramserve's short form
        (lambda shape, dtype: [8, 1], (5, 4), 5),  # capped by the rows, as TF caps it
        (FixedShardsPartitioner(2), (10, 4), 2),
        (None, (10, 4), 1),
    ],
)
def test_shard_count_reads_tf_and_paramserve_partitioners(partitioner: Any, shape: tuple[int, ...], expected: int):
    assert shard_count(partitioner, shape, torch.float32) == expected


@pytest.mark.parametrize(
    "result, error, problem",
    [
        ("2", TypeError, "return a list with the partitions of every axis"),
        ([2.0, 1], TypeError, "return a list"),
        (True, TypeError, "return a list"),
        ([1, 2], ValueError, "only the first axis is partitioned"),
        ([], ValueError, "only the first axis"),
        ([0, 1], ValueError, "shards >= 1"),
    ],
)
def test_shard_count_refuses_bad_partitioner_results(result: object, error: type[Exception], problem: str):
    with pytest.raises(error, match=problem) as raised:
        shard_count(lambda shape, dtype: result, (10, 4), torch.float32)
    assert "(10, 4)" in str(raised.value)  # names the shape it was asked about


def test_a_tf_style_partitioner_subclass_is_accepted():
    class EveryRowItsOwn(Partitioner):
        def __call__(self, shape: Any, dtype: torch.dtype, axis: int = 0) -> list[int]:
            return [shape[0]] + [1] * (len(shape) - 1)

    assert shard_count(EveryRowItsOwn(), (3, 7), torch.float32) == 3


def test_builtin_partitioners_take_tf_axis_argument():
    assert FixedShardsPartitioner(3)((4, 10), torch.float32, axis=1) == [1, 3]
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=10)((1, 6), torch.float32, axis=1) == [1, 6]
    assert MaxSizePartitioner(max_shard_bytes=8)((1, 6), torch.float32, axis=1) == [1, 3]
    with pytest.raises(ValueError, match="axis 2 is not an axis of shape"):
        FixedShardsPartitioner(2)((4, 10), torch.float32, axis=2)


def test_parameter_server_strategy_lays_out_a_tf_style_partitioner():
    strategy = ParameterServerStrategy(
        SimpleClusterResolver({"ps": ["127.0.0.1:9", "127.0.0.1:11"], "worker": ["127.0.0.1:10"]}),
        variable_partitioner=lambda shape, dtype: [2] + [1] * (len(shape) - 1),
        environ={},
    )
    try:
        with strategy.scope():
            nn.Linear(3, 6)
        layouts = strategy.plan_layouts()
        assert [len(layout.shards) for name, layout in sorted(layouts.items())] == [2, 2]  # bias (6,), weight (6, 3)
    finally:
        strategy.close()


# --------------------------------------------------------------------------- cluster resolvers


def test_cluster_jobs_is_tf_cluster_spec():
    jobs = ClusterJobs({"worker": ["w0:1", "w1:1"], "ps": ["p0:1"]})
    assert jobs.jobs == ["ps", "worker"]
    assert (jobs.num_tasks("worker"), jobs.task_indices("worker"), jobs.task_address("worker", 1)) == (
        2,
        [0, 1],
        "w1:1",
    )
    assert jobs.job_tasks("ps") == ["p0:1"] and jobs.as_dict() == {"worker": ["w0:1", "w1:1"], "ps": ["p0:1"]}
    assert jobs == ClusterJobs(jobs) and bool(jobs) and not ClusterJobs()
    with pytest.raises(ValueError, match="no job 'chief' in the cluster"):
        jobs.num_tasks("chief")
    with pytest.raises(ValueError, match="no task with index 2 in job 'worker'"):
        jobs.task_address("worker", 2)
    with pytest.raises(ClusterSpecError, match="job 'worker' task 0"):
        ClusterJobs({"worker": ["no-port"]})


def test_tf_config_resolver_reads_tf_config_at_every_call():
    environ = tf_config_env()
    resolver = TFConfigClusterResolver(environ=environ)
    assert resolver.cluster_spec().as_dict() == TF_CONFIG["cluster"]
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("ps", 1, "grpc")
    assert resolver.master() == "grpc://ps1.example.com:2222"
    assert resolver.master("worker", 0, rpc_layer="http") == "http://worker0.example.com:2222"
    environ["TF_CONFIG"] = json.dumps({**TF_CONFIG, "task": {"type": "worker", "index": 0}, "environment": "cloud"})
    assert (resolver.task_type, resolver.task_id, resolver.environment) == ("worker", 0, "cloud")


def test_tf_config_resolver_overrides_and_an_unset_tf_config():
    resolver = TFConfigClusterResolver(task_type="chief", task_id=0, rpc_layer="grpc+verbs", environ=tf_config_env())
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("chief", 0, "grpc+verbs")
    resolver.task_type, resolver.task_id = "worker", 1
    assert resolver.master() == "grpc+verbs://worker1.example.com:2222"
    unset = TFConfigClusterResolver(environ={})
    assert not unset.cluster_spec() and unset.master() == "" and unset.task_type is None and unset.rpc_layer is None
    taskless = TFConfigClusterResolver(environ=tf_config_env({"cluster": TF_CONFIG["cluster"]}))
    with pytest.raises(RuntimeError, match="no task to find the master of"):
        taskless.master()
    with pytest.raises(ClusterSpecError, match="not valid JSON"):
        TFConfigClusterResolver(environ={"TF_CONFIG": "{"}).cluster_spec()


def test_simple_cluster_resolver():
    resolver = SimpleClusterResolver(
        {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]},
        master="10.0.0.1:2222",
        task_type="worker",
        task_id=1,
        environment="cloud",
        num_accelerators={"GPU": 2},
        rpc_layer="grpc",
    )
    assert resolver.cluster_spec() == ClusterJobs({"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]})
    assert resolver.master() == "grpc://10.0.0.1:2222" and resolver.master("worker", 1) == "grpc://10.0.0.2:2222"
    assert (resolver.task_type, resolver.task_id, resolver.environment) == ("worker", 1, "cloud")
    assert resolver.num_accelerators() == {"GPU": 2} and SimpleClusterResolver({}).num_accelerators() == {}
    with pytest.raises(ValueError, match="num_accelerators must map kinds to counts"):
        SimpleClusterResolver({}, num_accelerators={"GPU": -1})
    with pytest.raises(ClusterSpecError, match='must list its tasks as "host:port" strings'):
        SimpleClusterResolver({"worker": "10.0.0.1:2222"})  # type: ignore[dict-item]


def pod(name: str, ip: str, phase: str = "Running") -> SimpleNamespace:
    return SimpleNamespace(metadata=SimpleNamespace(name=name), status=SimpleNamespace(phase=phase, pod_ip=ip))


class FakePods:
    """The Kubernetes API's pod listing, in memory."""

    def __init__(self, pods: dict[str, list[SimpleNamespace]]):
        self.pods = pods
        self.selectors: list[str] = []

    def list_pod_for_all_namespaces(self, *, label_selector: str) -> SimpleNamespace:
        self.selectors.append(label_selector)
        return SimpleNamespace(items=self.pods[label_selector])


def test_kubernetes_resolver_lists_running_pods_by_label():
    pods = FakePods(
        {
            "job-name=worker": [pod("worker-1", "10.0.0.3"), pod("worker-0", "fd00::2")],
            "job-name=ps": [pod("ps", "10.0.0.9")],
        }
    )
    resolver = KubernetesClusterResolver(
        {"worker": ["job-name=worker"], "ps": ["job-name=ps"]}, tf_server_port=2222, override_client=pods
    )
    assert resolver.cluster_spec().as_dict() == {"worker": ["[fd00::2]:2222", "10.0.0.3:2222"], "ps": ["10.0.0.9:2222"]}
    assert resolver.master() == ""  # it cannot know its own task
    resolver.task_type, resolver.task_id = "worker", 1
    assert resolver.master() == "grpc://10.0.0.3:2222"
    pods.pods["job-name=ps"] = [pod("ps", "", phase="Pending")]
    with pytest.raises(RuntimeError, match='pod "ps" .* is not running; phase: "Pending"'):
        resolver.cluster_spec()


def test_kubernetes_resolver_finds_a_headless_service_by_dns():
    answers = {"workers.default.svc:2222": frozenset({"10.0.0.5:2222", "10.0.0.4:2222"})}
    resolver = KubernetesClusterResolver(
        job_to_service_mapping={"worker": "workers.default.svc:2222", "ps": "ps.default.svc:2222"},
        resolver=lambda name: answers.get(name, frozenset({"10.0.0.9:2222"})),
    )
    assert resolver.cluster_spec().as_dict() == {"worker": ["10.0.0.4:2222", "10.0.0.5:2222"], "ps": ["10.0.0.9:2222"]}
    spec = ClusterSpec.from_cluster_resolver(resolver)  # workers join and leave through the service
    assert (spec.parameter_servers, spec.workers, spec.worker_service) == (
        ("10.0.0.9:2222",),
        (),
        "workers.default.svc:2222",
    )


def test_kubernetes_resolver_refuses_with_fix():
    with pytest.raises(ValueError, match="in both job_to_label_mapping and job_to_service_mapping"):
        KubernetesClusterResolver(
            {"worker": ["a=b"]}, override_client=FakePods({}), job_to_service_mapping={"worker": "w:1"}
        )
    if importlib.util.find_spec("kubernetes") is None:
        with pytest.raises(ImportError, match="pip install kubernetes"):
            KubernetesClusterResolver({"worker": ["job-name=worker"]})


def test_parameter_server_cluster_from_a_resolver():
    spec = ClusterSpec.from_cluster_resolver(TFConfigClusterResolver(environ=tf_config_env()))
    assert spec == ClusterSpec(
        ("ps0.example.com:2222", "ps1.example.com:2222"),
        ("worker0.example.com:2222", "worker1.example.com:2222"),
        "chief.example.com:2222",
    )
    with pytest.raises(ClusterSpecError, match="no parameter servers .*SimpleClusterResolver.cluster_spec"):
        ClusterSpec.from_cluster_resolver(SimpleClusterResolver({"worker": ["w:1"]}))
    with pytest.raises(ClusterSpecError, match=r"jobs \['master'\]"):
        ClusterSpec.from_cluster_resolver(SimpleClusterResolver({"master": ["m:1"], "ps": ["p:1"], "worker": ["w:1"]}))
    with pytest.raises(TypeError, match="pass a ClusterResolver"):
        ClusterSpec.resolve({"ps": ["p:1"]})  # type: ignore[arg-type]


def test_parameter_server_strategy_takes_tf_arguments():
    resolver = TFConfigClusterResolver(environ=tf_config_env())
    strategy = ParameterServerStrategy(resolver, variable_partitioner=MinSizePartitioner(max_shards=2), environ={})
    try:
        assert strategy.cluster.num_ps() == 2 and strategy.cluster.chief == "chief.example.com:2222"
        assert strategy.cluster_resolver is resolver
    finally:
        strategy.close()
    keyword = ParameterServerStrategy(cluster_resolver=resolver, environ={})
    keyword.close()


def test_multi_worker_rendezvous_from_a_resolver():
    cluster = {"chief": ["127.0.0.1:2000"], "worker": ["127.0.0.1:2001", "127.0.0.1:2002"]}
    rendezvous = Rendezvous.from_cluster_resolver(SimpleClusterResolver(cluster, task_type="worker", task_id=1))
    assert (rendezvous.rank, rendezvous.world_size, rendezvous.init_method()) == (2, 3, "tcp://127.0.0.1:2000")
    with pytest.raises(ClusterSpecError, match="set resolver.task_type"):
        Rendezvous.from_cluster_resolver(SimpleClusterResolver(cluster))
    with pytest.raises(ClusterSpecError, match="has a ps job"):
        Rendezvous.from_cluster_resolver(TFConfigClusterResolver(environ=tf_config_env()))
    with pytest.raises(ClusterSpecError, match="task worker 5 .* is not in its cluster"):
        Rendezvous.from_cluster_resolver(SimpleClusterResolver(cluster, task_type="worker", task_id=5))
    alone = Rendezvous.from_cluster_resolver(SimpleClusterResolver({}))
    assert (alone.rank, alone.world_size) == (0, 1)


def test_multi_worker_strategy_arguments_in_tf_order_and_paramserve_order():
    resolver = SimpleClusterResolver({})
    options = CommunicationOptions(CollectiveCommunication.RING)
    assert strategy_arguments(resolver, options) == (resolver, options)  # TF's order
    assert strategy_arguments(options, resolver) == (resolver, options)  # paramserve's earlier order
    cluster, chosen = strategy_arguments(None, None, communication="NCCL")  # TF's experimental keyword
    assert cluster is None and chosen.implementation is CollectiveCommunication.NCCL
    with pytest.raises(TypeError, match="two CommunicationOptions"):
        strategy_arguments(options, options)
    with pytest.raises(ValueError, match="both choose the implementation"):
        strategy_arguments(resolver, options, communication=CollectiveCommunication.RING)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_multi_worker_strategy_accepts_a_cluster_resolver():
    resolver = SimpleClusterResolver({"worker": [f"127.0.0.1:{free_port()}"]}, task_type="worker", task_id=0)
    strategy = MultiWorkerMirroredStrategy(resolver, communication_options=CommunicationOptions(timeout_seconds=30))
    try:
        assert strategy.num_replicas_in_sync == 1 and strategy.cluster_resolver is resolver
    finally:
        strategy.shutdown()
    with pytest.raises(TypeError, match="pass a ClusterResolver"):
        MultiWorkerMirroredStrategy(cluster_resolver="127.0.0.1:2001")  # type: ignore[arg-type]


def test_bytes_per_pack_sets_how_much_one_gradient_all_reduce_carries(monkeypatch):
    import torch.distributed as dist

    with pytest.raises(ValueError, match="bytes_per_pack"):
        CommunicationOptions(bytes_per_pack=-1)
    resolver = SimpleClusterResolver({"worker": [f"127.0.0.1:{free_port()}"]}, task_type="worker", task_id=0)
    strategy = MultiWorkerMirroredStrategy(resolver, CommunicationOptions(bytes_per_pack=64))  # 16 floats a pack
    calls = []
    original = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, **kw: (calls.append(tensor.numel()), original(tensor, **kw)))
    try:
        params = [torch.nn.Parameter(torch.zeros(10)) for _ in range(3)]
        for index, param in enumerate(params):
            param.grad = torch.full((10,), float(index))
        strategy.all_reduce_gradients(params)
    finally:
        strategy.shutdown()
    assert len(calls) == 3, "three 40-byte gradients do not fit two to a 64-byte pack"
    assert [float(p.grad[0]) for p in params] == [0.0, 1.0, 2.0]


# --------------------------------------------------------------------------- input options


def test_input_options_defaults_are_tensorflows():
    options = InputOptions()
    assert options.experimental_fetch_to_device is True and options.move_to_device is True
    assert options.experimental_replication_mode is InputReplicationMode.PER_WORKER
    assert (options.experimental_place_dataset_on_device, options.experimental_per_replica_buffer_size) == (False, 1)
    assert InputOptions(experimental_fetch_to_device=False).move_to_device is False
    assert InputOptions(move_to_device=False).experimental_fetch_to_device is False
    assert InputOptions(experimental_replication_mode="per_replica").per_replica  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"move_to_device": False, "experimental_fetch_to_device": True}, "disagree"),
        ({"experimental_place_dataset_on_device": True}, "needs experimental_replication_mode"),
        (
            {
                "experimental_replication_mode": InputReplicationMode.PER_REPLICA,
                "experimental_place_dataset_on_device": True,
            },
            "pass experimental_fetch_to_device=False",
        ),
        ({"experimental_per_replica_buffer_size": -1}, "must be an int >= 0"),
        ({"experimental_replication_mode": "PER_HOST"}, "PER_WORKER or PER_REPLICA"),
    ],
)
def test_input_options_refuse_what_tensorflow_refuses(kwargs: dict[str, Any], problem: str):
    with pytest.raises(ValueError, match=problem):
        InputOptions(**kwargs)


PER_REPLICA = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)


def test_per_replica_calls_the_dataset_function_once_per_replica():
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    contexts: list[InputContext] = []

    def dataset_fn(context: InputContext) -> list[torch.Tensor]:
        contexts.append(context)
        return [torch.full((2,), float(context.input_pipeline_id))]

    batch = next(iter(strategy.distribute_datasets_from_function(dataset_fn, PER_REPLICA)))
    assert contexts == [InputContext(2, 0, 2), InputContext(2, 1, 2)]
    assert [part.tolist() for part in strategy.experimental_local_results(batch)] == [[0.0, 0.0], [1.0, 1.0]]
    assert pipeline_contexts([InputContext(1, 0, 2)], 2, InputOptions()) == [InputContext(1, 0, 2)]


def test_per_replica_is_refused_where_input_is_per_worker():
    with pytest.raises(NotImplementedError, match="not supported by experimental_distribute_dataset"):
        MirroredStrategy(devices=["cpu:0", "cpu:1"]).experimental_distribute_dataset([torch.ones(4)], PER_REPLICA)
    strategy = ParameterServerStrategy(ClusterSpec(("127.0.0.1:9",), ("127.0.0.1:10",)), environ={})
    try:
        with pytest.raises(NotImplementedError, match="ParameterServerStrategy.distribute_datasets_from_function"):
            strategy.distribute_datasets_from_function(lambda ctx: [], PER_REPLICA)
    finally:
        strategy.close()
    multi = MultiWorkerMirroredStrategy(Rendezvous(0, 1))
    try:
        with pytest.raises(NotImplementedError, match="MultiWorkerMirroredStrategy.experimental_distribute_dataset"):
            multi.experimental_distribute_dataset([torch.ones(4)], PER_REPLICA)
        with pytest.raises(NotImplementedError, match="MultiWorkerMirroredStrategy.distribute_datasets_from_function"):
            multi.distribute_datasets_from_function(lambda ctx: [], PER_REPLICA)
    finally:
        multi.shutdown()


META = [torch.device("meta"), torch.device("meta")]  # a device other than the CPU, on any machine


def test_fetch_to_device_false_leaves_batches_on_the_cpu():
    batches = [torch.ones(4, 2)]
    fetched = next(iter(DistributedDataset(batches, META)))
    kept = next(iter(DistributedDataset(batches, META, options=InputOptions(experimental_fetch_to_device=False))))
    assert {part.device.type for part in fetched.values} == {"meta"}
    assert {part.device.type for part in kept.values} == {"cpu"}


def test_place_dataset_on_device_makes_and_reads_each_replicas_dataset_there():
    options = InputOptions(
        experimental_replication_mode=InputReplicationMode.PER_REPLICA,
        experimental_place_dataset_on_device=True,
        experimental_fetch_to_device=False,
    )

    def dataset_fn(context: InputContext) -> Iterator[torch.Tensor]:
        made_at_call = torch.zeros(1)
        yield made_at_call
        yield torch.zeros(1)  # made while the dataset is read

    dataset = DistributedDatasetsFromFunction(dataset_fn, [InputContext(1, 0, 2)], META, options)
    assert [{part.device.type for part in step.values} for step in dataset] == [{"meta"}, {"meta"}]


def test_buffer_size_reads_ahead_only_where_batches_reach_an_accelerator():
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert prefetch_depth(InputOptions(experimental_per_replica_buffer_size=3), gpus) == 3
    assert prefetch_depth(InputOptions(experimental_per_replica_buffer_size=3), [torch.device("cpu")]) == 0
    assert prefetch_depth(InputOptions(experimental_fetch_to_device=False), gpus) == 0
    assert prefetch_depth(InputOptions(experimental_per_replica_buffer_size=0), gpus) == 0


# --------------------------------------------------------------------------- distributed iterators


def counting(n: int, taken: list[int]) -> Iterator[torch.Tensor]:
    for i in range(n):
        taken.append(i)
        yield torch.full((2, 3), float(i))


def test_get_next_and_get_next_as_optional():
    iterator = DistributedIterator(counting(2, []))
    assert iterator.get_next().sum().item() == 0.0
    optional = iterator.get_next_as_optional()
    assert optional.has_value() and optional.get_value().sum().item() == 6.0
    end = iterator.get_next_as_optional()
    assert not end.has_value() and end.element_spec == TensorSpec(torch.Size([2, 3]), torch.float32)
    with pytest.raises(ValueError, match="check has_value"):
        end.get_value()
    with pytest.raises(StopIteration):
        iterator.get_next()
    assert OptionalElement.from_value(torch.ones(1)).has_value() and not OptionalElement.empty().has_value()


def test_element_spec_peeks_without_consuming():
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    iterator = iter(strategy.experimental_distribute_dataset([(torch.ones(4, 3), torch.zeros(4, dtype=torch.long))]))
    spec = iterator.element_spec
    features, labels = spec
    assert isinstance(features, PerReplica) and features.values == (TensorSpec(torch.Size([2, 3]), torch.float32),) * 2
    assert labels.values[0] == TensorSpec(torch.Size([2]), torch.int64)
    assert spec[0].values[0].is_compatible_with(next(iterator)[0].values[0])  # the peeked element comes next
    assert DistributedIterator(iter([])).element_spec is None


def test_multi_worker_iterators_have_tf_methods():
    multi = MultiWorkerMirroredStrategy(Rendezvous(0, 1))
    try:
        iterator = iter(multi.experimental_distribute_dataset([torch.ones(4, 2)]))
        assert isinstance(iterator, DistributedIterator)
        assert iterator.element_spec == TensorSpec(torch.Size([4, 2]), torch.float32)
        assert iterator.get_next().shape == (4, 2) and not iterator.get_next_as_optional().has_value()
    finally:
        multi.shutdown()


def test_reading_ahead_takes_elements_early_and_raises_their_errors_in_turn():
    taken: list[int] = []
    iterator = DistributedIterator(counting(5, taken), read_ahead=2)
    next(iterator)
    assert taken == [0, 1, 2]

    def failing() -> Iterator[int]:
        yield 1
        raise OSError("disk gone")

    late = DistributedIterator(failing(), read_ahead=3)
    assert next(late) == 1  # the error read ahead waits for its turn
    with pytest.raises(OSError, match="disk gone"):
        next(late)
    with pytest.raises(ValueError, match="read_ahead must be an int >= 0"):
        DistributedIterator(iter([]), read_ahead=-1)


# --------------------------------------------------------------------------- DatasetCreator


def test_dataset_creator_refuses_with_fix():
    with pytest.raises(TypeError, match="dataset_fn must be callable"):
        DatasetCreator([1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="input_options must be InputOptions"):
        DatasetCreator(lambda ctx: [], input_options={"experimental_fetch_to_device": False})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="return an iterable of batches"):
        DatasetCreator(lambda ctx: 3)(InputContext())  # type: ignore[arg-type,return-value]


def test_dataset_creator_is_distributed_by_its_input_options():
    contexts: list[InputContext] = []

    def dataset_fn(context: InputContext) -> list[torch.Tensor]:
        contexts.append(context)
        return [torch.ones(1)]

    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    next(iter(distribute(strategy, DatasetCreator(dataset_fn, input_options=PER_REPLICA))))
    assert [c.input_pipeline_id for c in contexts] == [0, 1]


def test_dataset_creator_runs_as_a_per_worker_dataset_function():
    seen: list[InputContext] = []

    def dataset_fn(context: InputContext) -> list[int]:
        seen.append(context)
        return [10, 11]

    make_iterator = _iterator_factory(_call_with_context(DatasetCreator(dataset_fn)))
    context = WorkerContext.for_worker(1, 2, "incarnation")
    assert list(make_iterator(context)) == [10, 11] and seen == [context]


def test_a_dataclass_batch_reaches_the_worker_device_field_by_field():
    # A GPU worker moves each batch of a per-worker dataset (nest.to_device); "meta" stands in
    # for the GPU here. ClickBatch is a frozen dataclass, as batch classes often are.
    from paramserve.coordinator import nest
    from paramserve.coordinator.demos.recommendation import ClickData

    batch = ClickData([10, 20], batch_size=4).batches(stream=0, count=1)[0]
    moved = nest.to_device({"batch": batch, "step": 3}, torch.device("meta"))
    assert type(moved["batch"]) is type(batch) and moved["step"] == 3
    assert {moved["batch"].dense.device.type, moved["batch"].ids.device.type} == {"meta"}
    assert moved["batch"].clicked.device.type == "meta" and batch.dense.device.type == "cpu"
    assert moved["batch"].features()["c1"].shape == (4,)
    assert nest.to_device(batch, torch.device("cpu")) is batch  # nothing to move: the batch itself


def test_a_dataclass_field_outside_init_keeps_its_value_when_the_batch_moves():
    import dataclasses

    from paramserve.coordinator import nest

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        seen: int = dataclasses.field(init=False, default=0)

    batch = Batch(torch.ones(2))
    batch.seen = 7
    moved = nest.to_device(batch, torch.device("meta"))
    assert moved.x.device.type == "meta" and moved.seen == 7


# --------------------------------------------------------------------------- per-worker values, worker index


def test_current_worker_index_inside_a_worker_closure_only():
    with pytest.raises(RuntimeError, match="outside a closure running on a worker"):
        experimental_get_current_worker_index()
    with using_worker_context(WorkerContext.for_worker(3, 4, "i")):
        assert ps.experimental_get_current_worker_index() == 3
    with pytest.raises(RuntimeError):
        experimental_get_current_worker_index()


def test_per_worker_values_give_each_worker_its_own():
    values = ps.PerWorkerValues([torch.tensor(0.0), torch.tensor(1.0), torch.tensor(2.0)])
    payload = pickle.dumps({"scale": values})
    with using_worker_context(WorkerContext.for_worker(1, 3, "i")):
        assert pickle.loads(payload)["scale"].item() == 1.0
    with using_worker_context(WorkerContext.for_worker(5, 6, "i")):
        with pytest.raises(IndexError, match="worker 5 got a PerWorkerValues of 3 values"):
            pickle.loads(payload)
    with pytest.raises(RuntimeError, match="outside a closure running on a worker"):
        pickle.loads(payload)
    assert isinstance(copy.deepcopy(values), PerWorkerValues) and isinstance(copy.copy(values), PerWorkerValues)
    assert fetch_structure(values) == tuple(values.values)


def test_new_names_are_exported():
    for name in (
        "ClusterResolver",
        "TFConfigClusterResolver",
        "SimpleClusterResolver",
        "KubernetesClusterResolver",
        "ClusterJobs",
        "PerWorkerValues",
        "experimental_get_current_worker_index",
        "DatasetCreator",
        "Partitioner",
    ):
        assert name in ps.__all__ and getattr(ps, name) is not None
    assert issubclass(TFConfigClusterResolver, ClusterResolver)
