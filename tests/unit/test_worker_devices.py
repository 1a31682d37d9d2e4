"""Where a worker computes (``paramserve worker --device``) and how values reach that device:
the flag and its defaults, the WorkerContext, per-worker dataset batches, and the CPU path
costing nothing. The tests marked ``needs_gpu`` run the worker core on cuda:0 against the
in-memory parameter servers (tests/fake_parameter_servers.py) and skip without CUDA."""

from __future__ import annotations

import collections

import cloudpickle
import fake_parameter_servers as fake_servers
import pytest
import torch
from fake_parameter_servers import FakeParameterServers, linear_servers
from torch import nn

from paramserve.coordinator.cluster_coordinator import _iterator_factory
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.worker.closure_pickling import dumps_closure
from paramserve.worker.core import ClosureRequest, ResourceSpec, WorkerCore
from paramserve.worker.layers import RefreshBeforeForward, ServerOptimizer, ShardedEmbedding, mark_variable
from paramserve.worker.resources import PerWorkerResource, WorkerContext

LR = 0.5
SGD = OptimizerSpec("SGD", {"lr": LR})
CPU = torch.device("cpu")
GPU = torch.device("cuda", 0)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
Batch = collections.namedtuple("Batch", ["x", "y"])


# ---------------------------------------------------------------- closures and resource functions (by reference)


def train_step(model: nn.Module, optimizer: ServerOptimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A step that, like user code on a GPU worker, takes its inputs to the model's device."""
    device = model.weight.device
    optimizer.zero_grad()
    loss = ((model(x.to(device)) - y.to(device)) ** 2).mean()
    loss.backward()
    optimizer.step()
    return loss.detach()


def step_then_state(model: nn.Module, optimizer: ServerOptimizer, x: torch.Tensor, y: torch.Tensor) -> dict:
    train_step(model, optimizer, x, y)
    model(x.to(model.weight.device))  # after step(): the refresh hook pulls the updated values
    return {"weight": model.weight.detach(), "bias": model.bias.detach(), "device": model.weight.device}


def normalized_step(model: nn.Module, optimizer: ServerOptimizer, x: torch.Tensor) -> dict:
    """A model with a buffer (batch-norm statistics): the buffer must follow the variables."""
    optimizer.zero_grad()
    model(x.to(model[0].weight.device)).sum().backward()
    optimizer.step()
    return {"buffer": model[1].running_mean.device, "weight": model[0].weight.device}


def embed_and_step(table: ShardedEmbedding, optimizer: ServerOptimizer, indices: torch.Tensor) -> torch.device:
    rows = table(indices.to(GPU))
    rows.sum().backward()
    optimizer.step()
    return rows.device


def next_batch_where(batches) -> tuple:  # type: ignore[no-untyped-def]
    batch = next(batches)
    return batch.x.device, batch.y["y"].device, batch.y["tag"]


def context_device(ctx: WorkerContext) -> list:
    return [ctx.device]


def first_entry(values: list):  # type: ignore[no-untyped-def]
    return values[0]


def two_batches(ctx: WorkerContext) -> list:
    return [
        Batch(torch.ones(2, 3), {"y": torch.zeros(2), "tag": "first"}),
        Batch(torch.ones(1, 3), {"y": torch.zeros(1), "tag": "second"}),
    ]


# ---------------------------------------------------------------- helpers


def servers_with_linear() -> FakeParameterServers:
    return linear_servers(LR)


def distributed_linear() -> tuple[nn.Linear, ServerOptimizer]:
    return fake_servers.distributed_linear(LR, refresh_hook=True)


def request(servers, fn, *args, closure_id="c1", steps=1, resources=()) -> ClosureRequest:  # type: ignore[no-untyped-def]
    return ClosureRequest(
        closure_id=closure_id,
        payload=dumps_closure((fn, args, {})),
        function_name=fn.__name__,
        resources=tuple(resources),
        cluster=servers.cluster if servers is not None else None,
        steps=steps,
        worker_index=0,
        num_workers=1,
    )


def result_of(outcome):  # type: ignore[no-untyped-def]
    assert outcome.error is None, outcome.error
    return cloudpickle.loads(outcome.result)


def expected_after_steps(servers, x, y, steps=1):  # type: ignore[no-untyped-def]
    """SGD on the servers, computed locally with plain torch on the CPU."""
    local = servers.local_linear()
    for _ in range(steps):
        local.zero_grad()
        ((local(x) - y) ** 2).mean().backward()
        with torch.no_grad():
            for p in local.parameters():
                p -= LR * p.grad
    return local.weight.detach(), local.bias.detach()


# ---------------------------------------------------------------- the CPU path (any machine)


def test_a_cpu_worker_pulls_straight_into_its_parameters_and_pushes_what_it_computed():
    servers = servers_with_linear()
    core = WorkerCore(servers.factory)
    model, optimizer = distributed_linear()
    try:
        result_of(
            core.run_closure(request(servers, train_step, model, optimizer, torch.randn(4, 3), torch.randn(4, 2)))
        )
    finally:
        core.close()
    assert servers.traffic.pulled and servers.traffic.read_back
    assert servers.traffic.destinations and not any(pinned for _, pinned in servers.traffic.destinations), (
        "no pinned buffers on the CPU: the parameters themselves are the destinations"
    )
    assert set(servers.traffic.pushed_from) == {CPU}


def test_resource_functions_see_the_device_closures_compute_on():
    core = WorkerCore(FakeParameterServers().factory)
    spec = ResourceSpec("where", cloudpickle.dumps(context_device))
    try:
        outcome = core.run_closure(request(None, first_entry, PerWorkerResource("where"), resources=[spec]))
    finally:
        core.close()
    assert result_of(outcome) == CPU


def test_a_cpu_workers_dataset_iterator_is_the_datasets_own():
    context = WorkerContext.for_worker(0, 1, "incarnation")
    assert type(_iterator_factory(two_batches)(context)) is type(iter([]))


def test_a_device_workers_dataset_batches_arrive_on_its_device_in_their_structure():
    meta = torch.device("meta")  # a device other than the CPU that every torch has
    context = WorkerContext.for_worker(0, 1, "incarnation", device=meta)

    batches = list(_iterator_factory(two_batches)(context))

    assert [type(b) for b in batches] == [Batch, Batch]
    assert {b.x.device for b in batches} == {b.y["y"].device for b in batches} == {meta}
    assert [b.y["tag"] for b in batches] == ["first", "second"]


def test_a_worker_computes_on_the_cpu_or_a_cuda_gpu():
    with pytest.raises(ValueError, match="CPU or a CUDA GPU"):
        WorkerCore(FakeParameterServers().factory, device=torch.device("meta"))


def parse_worker_flags(argv: list[str]):  # type: ignore[no-untyped-def]
    from paramserve.coordinator.commands import cli
    from paramserve.worker import __main__ as worker_main

    args = cli.build_parser().parse_args(["worker", *argv])
    return worker_main.config_from_args(args, args.subparser)


def test_the_device_flag_builds_the_config():
    assert parse_worker_flags(["--device", "cpu"]).device == CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_asking_for_a_gpu_without_cuda_is_an_error_naming_the_fix(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        parse_worker_flags(["--device", "cuda:0"])
    assert "--device: device 'cuda:0' does not exist" in capsys.readouterr().err
    monkeypatch.setenv("LOCAL_RANK", "1")  # a launcher's variable means nothing without CUDA
    assert parse_worker_flags([]).device == CPU


# ---------------------------------------------------------------- a GPU worker (CUDA only)


@pytest.fixture
def gpu_core():  # type: ignore[no-untyped-def]
    servers = servers_with_linear()
    core = WorkerCore(servers.factory, device=GPU)
    yield core, servers
    core.close()


@needs_gpu
def test_a_gpu_worker_pulls_through_pinned_buffers_and_pushes_host_gradients(gpu_core):
    core, servers = gpu_core
    model, optimizer = distributed_linear()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    expected_w, expected_b = expected_after_steps(servers, x, y)

    loss = result_of(core.run_closure(request(servers, train_step, model, optimizer, x, y)))

    assert isinstance(loss, torch.Tensor) and loss.device == CPU, "results travel as host tensors"
    torch.testing.assert_close(servers.value("w"), expected_w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(servers.value("b"), expected_b, atol=1e-5, rtol=1e-5)
    assert servers.traffic.destinations and all(pinned for _, pinned in servers.traffic.destinations)
    assert set(servers.traffic.pushed_from) == {CPU}


@needs_gpu
def test_a_gpu_workers_overlapped_pushes_end_where_a_cpu_workers_do():
    """overlap_pushes on a GPU: the reply of the push in flight lands in the pinned buffers only
    after the next step's gradients were computed, and those gradients reach their own pinned
    buffers only after that push was settled; the servers end where a CPU worker's do."""
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    finals = {}
    for device in (CPU, GPU):
        servers = servers_with_linear()
        core = WorkerCore(servers.factory, device=device)
        model, optimizer = distributed_linear()
        batch = [
            ClosureRequest(
                **{
                    **request(servers, train_step, model, optimizer, x, y, closure_id=f"c{i}").__dict__,
                    "overlap_pushes": True,
                    "max_value_age": 3600.0,
                }
            )
            for i in range(4)
        ]
        try:
            outcomes = core.run_closures(batch)
        finally:
            core.close()
        assert [o.error for o in outcomes] == [None] * 4 and servers.traffic.started == 4
        finals[device] = (servers.value("w"), servers.value("b"), servers.version("w"))
    torch.testing.assert_close(finals[GPU][:2], finals[CPU][:2], atol=1e-5, rtol=1e-5)
    assert finals[GPU][2] == finals[CPU][2] == 4


@needs_gpu
def test_a_gpu_workers_parameters_hold_the_servers_values_after_each_step(gpu_core):
    core, servers = gpu_core
    model, optimizer = distributed_linear()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    expected_w, expected_b = expected_after_steps(servers, x, y, steps=3)

    state = result_of(core.run_closure(request(servers, step_then_state, model, optimizer, x, y, steps=3)))

    assert state["device"] == GPU, "the closure's distributed parameters live on the worker's device"
    torch.testing.assert_close(servers.value("w"), expected_w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state["weight"], servers.value("w"))  # read back through the pinned buffers
    torch.testing.assert_close(state["bias"], servers.value("b"))
    torch.testing.assert_close(servers.value("b"), expected_b, atol=1e-5, rtol=1e-5)


@needs_gpu
def test_a_gpu_worker_moves_the_buffers_of_a_model_to_its_device():
    servers = FakeParameterServers()
    servers.create("w", torch.randn(3, 4), SGD)
    servers.create("bn_w", torch.ones(3), SGD)
    servers.create("bn_b", torch.zeros(3), SGD)
    core = WorkerCore(servers.factory, device=GPU)
    model = nn.Sequential(nn.Linear(4, 3, bias=False), nn.BatchNorm1d(3))
    for parameter, name in zip(model.parameters(), ["w", "bn_w", "bn_b"]):
        mark_variable(parameter, name)
    model.register_forward_pre_hook(RefreshBeforeForward())
    optimizer = ServerOptimizer(["w", "bn_w", "bn_b"], "SGD", {"lr": LR})
    try:
        devices = result_of(core.run_closure(request(servers, normalized_step, model, optimizer, torch.randn(5, 4))))
    finally:
        core.close()
    assert devices == {"buffer": GPU, "weight": GPU}
    assert servers.version("w") == 1


@needs_gpu
def test_a_gpu_workers_embedding_lookup_returns_device_rows_and_pushes_host_row_gradients():
    servers = FakeParameterServers()
    table = torch.randn(100, 8)
    servers.create("table", table, SGD)
    core = WorkerCore(servers.factory, device=GPU)
    embedding = ShardedEmbedding(100, 8, name="table")
    optimizer = ServerOptimizer(["table"], "SGD", {"lr": LR})
    try:
        device = result_of(
            core.run_closure(request(servers, embed_and_step, embedding, optimizer, torch.tensor([3, 3, 7])))
        )
    finally:
        core.close()
    assert device == GPU
    expected = table.clone()
    expected[3] -= 2 * LR
    expected[7] -= LR
    torch.testing.assert_close(servers.value("table"), expected)
    assert set(servers.traffic.pushed_from) == {CPU}


@needs_gpu
def test_a_gpu_workers_dataset_batches_reach_the_closure_on_its_device(gpu_core):
    core, _ = gpu_core
    batches = PerWorkerResource("batches")
    spec = ResourceSpec("batches", cloudpickle.dumps(_iterator_factory(two_batches)))

    first = core.run_closure(request(None, next_batch_where, batches, resources=[spec]))
    second = core.run_closure(request(None, next_batch_where, batches, closure_id="c2"))

    assert [result_of(o) for o in (first, second)] == [(GPU, GPU, "first"), (GPU, GPU, "second")]


@needs_gpu
def test_a_gpu_workers_resource_functions_see_its_device(gpu_core):
    core, _ = gpu_core
    spec = ResourceSpec("where", cloudpickle.dumps(context_device))
    assert result_of(core.run_closure(request(None, first_entry, PerWorkerResource("where"), resources=[spec]))) == GPU
