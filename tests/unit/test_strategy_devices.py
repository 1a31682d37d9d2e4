"""Where the in-process strategies put things: modules built in scope on the strategy's device,
``run``'s plain-tensor arguments on each replica's device, and nothing else: the code of a
scope, of ``run`` and of input functions builds its tensors where it always would (no
default-device context). On machines without a GPU the "meta" device stands in for one (a
device other than the CPU that every torch has); where CUDA is present the same tests also
run on cuda:0, and the GPU-only tests at the end train for real."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from paramserve.coordinator.strategies import (
    CentralStorageStrategy,
    MirroredStrategy,
    OneDeviceStrategy,
    compute_average_loss,
    get_replica_context,
)
from paramserve.coordinator.strategies import central_storage as central_storage_module
from paramserve.coordinator.strategies import mirrored as mirrored_module
from paramserve.coordinator.strategies import replicated as replicated_module
from paramserve.psserver.runtime import devices

CPU = torch.device("cpu")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ON_A_DEVICE = [pytest.param("meta", id="meta"), pytest.param("cuda:0", id="cuda", marks=needs_gpu)]
Pair = collections.namedtuple("Pair", ["first", "second"])


@pytest.fixture(autouse=True)
def meta_is_a_device(monkeypatch):
    """Strategies accept "meta" (and "meta:N") as a device, as they accept "cuda:N"."""
    real = devices.resolve_device

    def resolve(spec, cuda_devices=None):
        if str(spec).startswith("meta"):
            return str(spec), torch.device("meta")
        return real(spec, cuda_devices)

    for module in (mirrored_module, replicated_module, central_storage_module):  # each resolves device names
        monkeypatch.setattr(module, "resolve_device", resolve)


class Net(nn.Module):
    """Parameters, buffers, and a parameter built from another one in the constructor."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)
        self.decode = nn.Linear(3, 4)
        self.decode.weight = nn.Parameter(self.encode.weight.detach().t().clone())  # already on the device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.norm(self.encode(x)))


def tensor_devices(module: nn.Module) -> set[torch.device]:
    return {t.device for t in [*module.parameters(), *module.buffers()]}


def input_function(seen: list[torch.device]):
    """An input function as users write them (the example's): a CPU generator, randperm, and
    tensors built without a device; it records where such tensors land."""

    def dataset_fn(context):
        seen.append(torch.empty(1).device)
        generator = torch.Generator().manual_seed(0)
        order = torch.randperm(8, generator=generator)  # fails under a CUDA default device
        x = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)[order]
        for start in range(0, 8, 4):
            seen.append(torch.zeros(1).device)
            yield x[start : start + 4]

    return dataset_fn


# ------------------------------------------------------------------ scope: modules placed, nothing else


@pytest.mark.parametrize("device", ON_A_DEVICE)
def test_modules_and_optimizer_state_built_in_scope_land_on_the_strategy_device(device):
    strategy = OneDeviceStrategy(device)
    with strategy.scope():
        model = Net()
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)  # eager state, built from the parameters
        elsewhere = torch.zeros(2)  # not module state: stays where the code says

    assert tensor_devices(model) == {strategy.device}
    assert {s["sum"].device for s in optimizer.state.values()} == {strategy.device}
    assert elsewhere.device == CPU


@needs_gpu
def test_placement_keeps_each_parameter_object():
    """A parameter registered twice (weights tied across modules) stays one object on the GPU."""
    strategy = OneDeviceStrategy("cuda:0")
    with strategy.scope():
        shared = nn.Parameter(torch.ones(3, 3))
        first, second = nn.Linear(3, 3), nn.Linear(3, 3)
        first.weight = shared
        second.weight = shared
    assert first.weight is second.weight is shared and shared.device == strategy.device


@pytest.mark.parametrize("device", ON_A_DEVICE)
def test_replicated_strategies_place_their_copies_on_the_replica_devices(device):
    mirrored = MirroredStrategy(["cpu:0", device])
    central = CentralStorageStrategy([device], parameter_device="cpu")
    try:
        for strategy in (mirrored, central):
            with strategy.scope():
                model = Net()
            copies = strategy.experimental_local_results(model)
            assert [tensor_devices(c) for c in copies] == [{d} for d in strategy.replica_devices]
        assert tensor_devices(model) == {CPU}, "CentralStorage keeps the variables on the parameter device"
    finally:
        mirrored.close()
        central.close()


@pytest.mark.parametrize("device", ON_A_DEVICE)
def test_no_default_device_reaches_scope_code_run_or_input_functions(device):
    seen: list[torch.device] = []
    strategy = OneDeviceStrategy(device)
    with strategy.scope():
        Net()
        batches = strategy.distribute_datasets_from_function(input_function(seen))
        first = next(iter(batches))  # iterated inside the scope, as fit does
        in_run = strategy.run(lambda batch: (torch.empty(1).device, batch.device), args=(first,))

    assert seen and set(seen) == {CPU}, "the input function built its tensors on the CPU"
    assert first.device == strategy.device, "the input pipeline moved the batch to the device"
    assert in_run == (CPU, strategy.device)


@pytest.mark.parametrize("device", ON_A_DEVICE)
def test_replica_threads_have_no_default_device_either(device):
    seen: list[torch.device] = []
    strategy = MirroredStrategy(["cpu:0", device])
    try:
        with strategy.scope():
            batches = iter(strategy.experimental_distribute_dataset(input_function(seen)(None)))
            strategy.run(lambda: seen.append(torch.empty(1).device))
            next(batches)
    finally:
        strategy.close()
    assert seen and set(seen) == {CPU}


# ------------------------------------------------------------------ run: plain tensors on each replica's device


@pytest.mark.parametrize("device", ON_A_DEVICE)
def test_run_moves_plain_tensor_arguments_to_each_replica_and_keeps_their_structure(device):
    x, y = torch.ones(2, 3), torch.zeros(2)
    log: dict[int, tuple] = {}

    def record(*args, **kwargs):
        log[get_replica_context().replica_id_in_sync_group] = (args, kwargs)

    strategy = MirroredStrategy(["cpu:0", device])
    try:
        strategy.run(record, args=(x, [Pair(y, 3)]), kwargs={"named": collections.OrderedDict(a=x, b="text")})
    finally:
        strategy.close()

    on_cpu, on_device = log[0], log[1]
    assert on_cpu[0][0] is x and on_cpu[0][1][0].first is y, "a CPU replica gets the CPU tensors themselves"
    (moved_x, [pair]), kwargs = on_device
    assert moved_x.device == strategy.replica_devices[1] and pair.first.device == strategy.replica_devices[1]
    assert type(pair) is Pair and pair.second == 3
    assert type(kwargs["named"]) is collections.OrderedDict and kwargs["named"]["b"] == "text"
    assert kwargs["named"]["a"].device == strategy.replica_devices[1]


def test_cpu_replicas_get_the_argument_tensors_themselves():
    x = torch.ones(4, 2)
    strategy = MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        same = strategy.run(lambda t: t is x, args=(x,))
    finally:
        strategy.close()
    assert same is True


@pytest.mark.parametrize("device", ON_A_DEVICE)
def test_central_storage_and_one_device_place_run_arguments_too(device):
    x = torch.ones(2, 3)
    central = CentralStorageStrategy([device])
    try:
        assert central.run(lambda t: t.device, args=(x,)) == central.replica_devices[0]
    finally:
        central.close()
    one = OneDeviceStrategy(device)
    assert one.run(lambda t: t.device, kwargs={"t": x}) == one.device


# ------------------------------------------------------------------ real GPUs


def per_example_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum(dim=1)


@needs_gpu
@pytest.mark.parametrize(
    "make_strategy",
    [
        pytest.param(lambda: MirroredStrategy(["cuda:0"]), id="mirrored-cuda"),
        pytest.param(lambda: CentralStorageStrategy(["cuda:0"]), id="central-cuda"),
        pytest.param(lambda: MirroredStrategy(["cuda:0", "cpu:0"]), id="mirrored-cuda-cpu"),
        pytest.param(lambda: OneDeviceStrategy("cuda:0"), id="one-device-cuda"),
    ],
)
def test_run_with_cpu_tensors_trains_on_a_gpu_like_one_cpu(make_strategy):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        per_example_loss(reference, x, y).mean().backward()
        optimizer.step()

    strategy = make_strategy()
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        model.load_state_dict(initial)
        distributed = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(inputs, targets):
        distributed.zero_grad()
        # Every replica gets the whole batch: the global batch is that many copies of it.
        global_batch = len(inputs) * strategy.num_replicas_in_sync
        compute_average_loss(per_example_loss(model, inputs, targets), global_batch_size=global_batch).backward()
        distributed.step()

    try:
        for _ in range(3):
            strategy.run(step, args=(x, y))  # CPU tensors, as the report of issue 8 passed them
    finally:
        strategy.close()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.detach().cpu(), want.detach(), atol=1e-5, rtol=1e-5)
