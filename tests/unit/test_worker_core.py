"""WorkerCore against a real in-process parameter server (no worker gRPC server involved)."""

from __future__ import annotations

import pickle

import cloudpickle
import pytest
import torch
from torch import nn

from paramserve.psserver import convert
from paramserve.psserver.errors import InvalidRequestError, ParamServeError
from paramserve.psserver.optimizer import OptimizerSpec
from paramserve.psserver.partition import FixedShardsPartitioner
from paramserve.psserver.types import ClusterContext
from paramserve.worker.core import (
    ClosureRequest,
    ResourceSpec,
    WorkerCore,
)
from paramserve.worker.resources import (
    PerWorkerResource,
    ResourceMissingError,
    WorkerContext,
    resolve_resource,
)
from paramserve.worker.server import WorkerConfig
from paramserve.worker.variables import (
    RefreshBeforeForward,
    ServerOptimizer,
    ShardedEmbedding,
    dumps_closure,
    mark_variable,
)

LR = 0.5
SGD = OptimizerSpec("SGD", {"lr": LR})


# ---------------------------------------------------------------- closures (module level: pickled by reference)


def train_step(model: nn.Module, optimizer: ServerOptimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optimizer.step()
    return loss


def step_then_predict(model: nn.Module, optimizer: ServerOptimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    train_step(model, optimizer, x, y)
    return model(x)  # after step(): the refresh hook must pull the updated values


def read_parameter(parameter: torch.Tensor) -> torch.Tensor:
    return parameter.detach().clone()


def exploding_user_function(value: int) -> None:
    raise ValueError(f"bad value {value}")


def count_into(log: list, tag: str) -> int:
    log.append(tag)
    return len(log)


def step_and_count(model: nn.Module, optimizer: ServerOptimizer, log: list, x: torch.Tensor, y: torch.Tensor) -> int:
    train_step(model, optimizer, x, y)
    log.append("step")
    return len(log)


def make_log(ctx: WorkerContext) -> list:
    return [f"worker-{ctx.worker_index}-of-{ctx.num_workers}"]


def embed_and_step(table: ShardedEmbedding, optimizer: ServerOptimizer, indices: torch.Tensor) -> tuple:
    rows = table(indices)
    rows.sum().backward()
    optimizer.step()
    return tuple(rows.shape)


def first_entry(log: list) -> str:
    return log[0]


def identity_of(parameter: torch.Tensor) -> int:
    return id(parameter)


def exit_the_process() -> None:
    raise SystemExit(3)


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture
def core():
    worker = WorkerCore(WorkerConfig(ps_call_timeout=10.0, ps_retry_deadline=10.0))
    yield worker
    worker.close()


@pytest.fixture
def ps(start_ps, make_client):
    """One parameter server holding a Linear(3 -> 2) as variables 'w' (2 shards) and 'b'."""
    server = start_ps()
    client = make_client([server.address])
    torch.manual_seed(0)
    client.create_variable("w", torch.randn(2, 3), optimizer=SGD, partitioner=FixedShardsPartitioner(2))
    client.create_variable("b", torch.randn(2), optimizer=SGD)
    return server, client


def distributed_linear() -> tuple[nn.Linear, ServerOptimizer]:
    """A model as the coordinator holds it: its parameters stand for variables 'w' and 'b'."""
    model = nn.Linear(3, 2)
    mark_variable(model.weight, "w")
    mark_variable(model.bias, "b")
    return model, ServerOptimizer(["w", "b"], "SGD", {"lr": LR})


def closure_request(client, fn, *args, closure_id="closure-1", steps=1, resources=(), **kwargs) -> ClosureRequest:
    cluster = ClusterContext(client.addresses, client.layouts) if client else ClusterContext()
    return ClosureRequest(
        closure_id=closure_id,
        payload=dumps_closure((fn, args, kwargs)),
        function_name=getattr(fn, "__name__", "fn"),
        resources=tuple(resources),
        cluster=cluster,
        steps=steps,
        worker_index=1,
        num_workers=2,
    )


def result_of(outcome):
    assert outcome.error is None, outcome.error
    return cloudpickle.loads(outcome.result)


def expected_after_one_step(client, x, y):
    """What SGD on the servers should produce, computed locally with plain torch."""
    values = client.pull(["w", "b"]).tensors
    local = nn.Linear(3, 2)
    with torch.no_grad():
        local.weight.copy_(values["w"])
        local.bias.copy_(values["b"])
    ((local(x) - y) ** 2).mean().backward()
    return values["w"] - LR * local.weight.grad, values["b"] - LR * local.bias.grad


def duplicates_on(server) -> float:
    return server.registry.get_sample_value("paramserve_ps_pushes_total", {"result": "duplicate"}) or 0.0


# ---------------------------------------------------------------- training


def test_a_training_step_pushes_its_gradient_to_the_servers(core, ps):
    server, client = ps
    model, optimizer = distributed_linear()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    expected_w, expected_b = expected_after_one_step(client, x, y)

    outcome = core.run_closure(closure_request(client, train_step, model, optimizer, x, y))

    loss = result_of(outcome)
    assert isinstance(loss, torch.Tensor) and loss.grad_fn is None and loss.ndim == 0
    after = client.pull(["w", "b"])
    torch.testing.assert_close(after.tensors["w"], expected_w)
    torch.testing.assert_close(after.tensors["b"], expected_b)
    assert (outcome.pushes_applied, outcome.pushes_duplicate) == (3, 0)  # w's two shards and b
    assert set(after.versions.values()) == {1}


def test_a_retried_closure_pushes_duplicates_that_the_servers_do_not_apply(core, ps):
    server, client = ps
    model, optimizer = distributed_linear()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    request = closure_request(client, train_step, model, optimizer, x, y, closure_id="retried")
    core.run_closure(request)
    after_first = client.pull(["w", "b"]).tensors

    again = core.run_closure(request)

    assert again.error is None
    assert (again.pushes_applied, again.pushes_duplicate) == (0, 3)
    assert duplicates_on(server) == 3.0
    after_retry = client.pull(["w", "b"])
    assert torch.equal(after_retry.tensors["w"], after_first["w"])
    assert set(after_retry.versions.values()) == {1}
    fresh = core.run_closure(closure_request(client, train_step, model, optimizer, x, y, closure_id="another"))
    assert fresh.pushes_applied == 3, "a different closure id is a different update"


def test_each_step_starts_from_the_servers_current_values(core, ps):
    server, client = ps
    w0 = client.pull(["w"]).tensors["w"]
    weight = nn.Parameter(torch.zeros(2, 3))
    mark_variable(weight, "w")

    first = result_of(core.run_closure(closure_request(client, read_parameter, weight)))
    client.push({"w": torch.ones(2, 3)}, base_versions=client.pull(["w"]).versions)  # another worker's update
    second = result_of(core.run_closure(closure_request(client, read_parameter, weight, closure_id="c2")))

    assert torch.equal(first, w0), "the worker read the servers' value, not the coordinator's zeros"
    torch.testing.assert_close(second, w0 - LR * torch.ones(2, 3))


def test_a_forward_after_step_sees_the_updated_values(core, ps):
    server, client = ps
    model, optimizer = distributed_linear()
    model.register_forward_pre_hook(RefreshBeforeForward())
    x, y = torch.randn(4, 3), torch.randn(4, 2)

    outcome = core.run_closure(closure_request(client, step_then_predict, model, optimizer, x, y))

    after = client.pull(["w", "b"]).tensors
    torch.testing.assert_close(result_of(outcome), x @ after["w"].T + after["b"])


def test_steps_runs_the_function_that_many_times_with_distinct_push_keys(core, ps):
    server, client = ps
    model, optimizer = distributed_linear()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    log = PerWorkerResource("log")
    spec = ResourceSpec("log", cloudpickle.dumps(make_log))

    outcome = core.run_closure(
        closure_request(client, step_and_count, model, optimizer, log, x, y, steps=3, resources=[spec])
    )

    assert result_of(outcome) == 4  # the resource's first entry, then three steps
    assert outcome.pushes_applied == 9
    assert set(client.pull(["w", "b"]).versions.values()) == {3}


# ---------------------------------------------------------------- embeddings


def test_embedding_lookup_pulls_only_its_rows_and_pushes_row_gradients(core, start_ps, make_client):
    server = start_ps()
    client = make_client([server.address])
    table = torch.randn(1000, 16)
    client.create_variable("table", table, optimizer=SGD, partitioner=FixedShardsPartitioner(3))
    embedding = ShardedEmbedding(1000, 16, name="table")
    optimizer = ServerOptimizer(["table"], "SGD", {"lr": LR})
    indices = torch.tensor([[3, 999], [3, 500]])

    outcome = core.run_closure(closure_request(client, embed_and_step, embedding, optimizer, indices))

    assert result_of(outcome) == (2, 2, 16)
    sent = server.registry.get_sample_value("paramserve_sent_bytes_total", {"role": "ps", "method": "Pull"})
    assert sent < 1024, f"a 3-row lookup moved {sent} bytes: the whole 64 KB table was pulled"
    expected = table.clone()
    expected[3] -= LR * 2  # looked up twice: gradients summed
    expected[999] -= LR
    expected[500] -= LR
    torch.testing.assert_close(client.pull(["table"]).tensors["table"], expected)
    assert outcome.pushes_applied == 3  # rows 3, 500, 999 live on three shards


# ---------------------------------------------------------------- errors


def test_user_exception_comes_back_with_the_remote_traceback(core):
    outcome = core.run_closure(closure_request(None, exploding_user_function, 7))

    error = outcome.error
    assert outcome.result is None and error is not None
    assert error.type == "builtins.ValueError"
    assert error.message == "bad value 7"
    assert "exploding_user_function" in error.traceback
    assert isinstance(pickle.loads(error.pickled), ValueError)
    assert not error.missing_resources and not error.parameter_server


def test_sys_exit_in_a_closure_is_an_error_not_an_exit(core):
    outcome = core.run_closure(closure_request(None, exit_the_process))

    assert outcome.error is not None and outcome.error.type == "builtins.SystemExit"


def test_missing_resources_are_reported_then_created_when_sent(core):
    log, other = PerWorkerResource("log"), PerWorkerResource("other")

    missing = core.run_closure(closure_request(None, count_into, log, other))
    assert missing.error is not None
    assert set(missing.error.missing_resources) == {"log", "other"}
    assert missing.resources_held == ()

    specs = [ResourceSpec("log", cloudpickle.dumps(make_log)), ResourceSpec("other", cloudpickle.dumps(make_log))]
    created = core.run_closure(closure_request(None, count_into, log, "a", resources=specs))
    reused = core.run_closure(closure_request(None, count_into, log, "b"))

    assert result_of(created) == 2 and result_of(reused) == 3, "the resource persists across closures"
    assert created.resources_held == ("log", "other")
    assert core.info().resources_held == ("log", "other")


def test_resource_functions_see_the_worker_context(core):
    spec = ResourceSpec("log", cloudpickle.dumps(make_log))

    outcome = core.run_closure(closure_request(None, first_entry, PerWorkerResource("log"), resources=[spec]))

    assert result_of(outcome) == "worker-1-of-2"


def test_an_unreachable_parameter_server_is_named_in_the_error(start_ps, make_client):
    server = start_ps()
    client = make_client([server.address])
    client.create_variable("w", torch.zeros(2, 3), optimizer=SGD)
    weight = nn.Parameter(torch.zeros(2, 3))
    mark_variable(weight, "w")
    request = closure_request(client, read_parameter, weight)
    server.stop(grace=0)
    core = WorkerCore(WorkerConfig(ps_call_timeout=0.5, ps_retry_deadline=0.5))
    try:
        outcome = core.run_closure(request)
    finally:
        core.close()

    assert outcome.error is not None
    assert outcome.error.parameter_server == server.address
    assert outcome.error.type.endswith("ServerUnavailableError")


# ---------------------------------------------------------------- requests and bookkeeping


def test_malformed_requests_raise_and_change_nothing(core, ps):
    server, client = ps
    good = closure_request(client, read_parameter, torch.zeros(1))

    for request in (
        ClosureRequest(closure_id="", payload=good.payload),
        ClosureRequest(closure_id="x", payload=b""),
        ClosureRequest(closure_id="x", payload=good.payload, steps=-1),
    ):
        with pytest.raises(InvalidRequestError):
            core.run_closure(request)
    assert core.info().closures_run == 0


def test_info_names_the_incarnation_and_counts_closures(core):
    first = core.info()
    outcome = core.run_closure(closure_request(None, exploding_user_function, 1))

    assert len(first.incarnation) == 32 and first.closures_run == 0
    assert outcome.worker_incarnation == first.incarnation
    assert core.info().closures_run == 1
    assert WorkerCore(WorkerConfig()).incarnation != first.incarnation


def test_cluster_context_round_trips_through_the_wire(ps):
    server, client = ps
    cluster = ClusterContext(client.addresses, client.layouts)

    message = convert.cluster_to_proto(cluster)

    assert list(message.parameter_servers) == [server.address]
    assert sum(len(v.shards) for v in message.variables) == 3
    assert convert.cluster_from_proto(message) == cluster
    assert convert.cluster_from_proto(message).fingerprint == cluster.fingerprint


def test_malformed_cluster_contexts_are_refused_on_the_way_in(ps):
    server, client = ps
    good = convert.cluster_to_proto(ClusterContext(client.addresses, client.layouts))
    broken = []
    for mutate in (
        lambda m: m.variables[0].shards[0].__setattr__("server", 5),  # no such server
        lambda m: m.variables[0].shards[0].__setattr__("row_start", 1),  # rows not covered from 0
        lambda m: m.variables[0].shards.pop(),  # rows missing
        lambda m: m.variables[0].__setattr__("dtype", "complex1024"),  # unknown dtype
        lambda m: m.variables.append(m.variables[0]),  # a variable twice
    ):
        message = type(good).FromString(good.SerializeToString())
        mutate(message)
        broken.append(message)
    for message in broken:
        with pytest.raises(ParamServeError):
            convert.cluster_from_proto(message)


def test_per_worker_resource_pickles_as_a_reference():
    reference = PerWorkerResource("dataset-7")

    function, args = reference.__reduce__()

    assert function is resolve_resource and args == ("dataset-7",)
    with pytest.raises(RuntimeError, match="outside a worker closure"):
        pickle.loads(pickle.dumps(reference))
    assert ResourceMissingError("a", "b").resource_ids == ("a", "b")


def test_parameters_are_shared_across_closures_of_one_worker(core, ps):
    server, client = ps
    weight = nn.Parameter(torch.zeros(2, 3))
    mark_variable(weight, "w")

    first = result_of(core.run_closure(closure_request(client, identity_of, weight)))
    second = result_of(core.run_closure(closure_request(client, identity_of, weight, closure_id="c2")))

    assert first == second and first != id(weight)


def test_paramserve_worker_flags_build_the_config(tmp_path):
    from paramserve.coordinator.commands import cli
    from paramserve.worker import __main__ as worker_main

    (tmp_path / "token").write_text("shared\n")
    (tmp_path / "ps-token").write_text("for-servers\n")
    parser = cli.build_parser()
    shared = parser.parse_args(["worker", "--token-file", str(tmp_path / "token")])
    split = parser.parse_args(["worker", "--token-file", str(tmp_path / "token"), "--ps-token-file", str(tmp_path / "ps-token")])

    shared_config = worker_main.config_from_args(shared, shared.subparser)
    split_config = worker_main.config_from_args(split, split.subparser)

    assert shared.runner is worker_main.run
    assert (shared_config.token, shared_config.effective_ps_token, shared_config.torch_threads) == ("shared", "shared", 1)
    assert (split_config.token, split_config.effective_ps_token) == ("shared", "for-servers")
