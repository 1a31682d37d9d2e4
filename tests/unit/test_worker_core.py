"""WorkerCore against in-memory parameter servers (tests/fake_parameter_servers.py): pure logic,
no gRPC. The worker over real servers and sockets is tests/service/test_worker_service.py."""

from __future__ import annotations

import dataclasses
import pickle
import threading

import cloudpickle
import fake_parameter_servers as fake_servers
import pytest
import torch
from fake_parameter_servers import ADDRESS, FakeParameterServers
from torch import nn

from paramserve.psserver.protocol.errors import InvalidRequestError
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.types import ClusterContext
from paramserve.psserver.runtime import cpus
from paramserve.worker.closure_pickling import dumps_closure
from paramserve.worker.core import ClosureRequest, ResourceSpec, WorkerCore
from paramserve.worker.layers import (
    RefreshBeforeForward,
    ServerOptimizer,
    ShardedEmbedding,
    ShardedEmbeddingCollection,
    mark_variable,
)
from paramserve.worker.resources import PerWorkerResource, ResourceMissingError, WorkerContext, resolve_resource

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


def distributed_linear() -> tuple[nn.Linear, ServerOptimizer]:
    """A model as the coordinator holds it: its parameters stand for variables 'w' and 'b'."""
    return fake_servers.distributed_linear(LR)


def closure_request(servers, fn, *args, closure_id="closure-1", steps=1, resources=(), **kwargs) -> ClosureRequest:
    return ClosureRequest(
        closure_id=closure_id,
        payload=dumps_closure((fn, args, kwargs)),
        function_name=getattr(fn, "__name__", "fn"),
        resources=tuple(resources),
        cluster=servers.cluster if servers is not None else ClusterContext(),
        steps=steps,
        worker_index=1,
        num_workers=2,
    )


def result_of(outcome):
    assert outcome.error is None, outcome.error
    return cloudpickle.loads(outcome.result)


def expected_after_one_step(servers, x, y):
    """What SGD on the servers should produce, computed locally with plain torch."""
    local = servers.local_linear()
    ((local(x) - y) ** 2).mean().backward()
    return servers.value("w") - LR * local.weight.grad, servers.value("b") - LR * local.bias.grad


# ---------------------------------------------------------------- training


def test_a_training_step_pushes_its_gradient_to_the_servers(core, servers):
    model, optimizer = distributed_linear()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    expected_w, expected_b = expected_after_one_step(servers, x, y)

    outcome = core.run_closure(closure_request(servers, train_step, model, optimizer, x, y))

    loss = result_of(outcome)
    assert isinstance(loss, torch.Tensor) and loss.grad_fn is None and loss.ndim == 0
    torch.testing.assert_close(servers.value("w"), expected_w)
    torch.testing.assert_close(servers.value("b"), expected_b)
    assert (outcome.pushes_applied, outcome.pushes_duplicate) == (2, 0)
    assert (servers.version("w"), servers.version("b")) == (1, 1)
    assert servers.opened_for == [(ADDRESS,)], "one client for the cluster's servers"


def test_a_retried_closure_pushes_duplicates_that_the_servers_do_not_apply(core, servers):
    model, optimizer = distributed_linear()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    request = closure_request(servers, train_step, model, optimizer, x, y, closure_id="retried")
    core.run_closure(request)
    after_first = servers.value("w")

    again = core.run_closure(request)

    assert again.error is None
    assert (again.pushes_applied, again.pushes_duplicate) == (0, 2)
    assert servers.traffic.push_keys == ["retried/0", "retried/0"], "a retry resends the same key"
    assert torch.equal(servers.value("w"), after_first)
    assert servers.version("w") == 1
    fresh = core.run_closure(closure_request(servers, train_step, model, optimizer, x, y, closure_id="another"))
    assert fresh.pushes_applied == 2, "a different closure id is a different update"


def test_each_step_starts_from_the_servers_current_values(core, servers):
    w0 = servers.value("w")
    weight = nn.Parameter(torch.zeros(2, 3))
    mark_variable(weight, "w")

    first = result_of(core.run_closure(closure_request(servers, read_parameter, weight)))
    servers.push({"w": torch.ones(2, 3)}, key="another-worker")  # another worker's update
    second = result_of(core.run_closure(closure_request(servers, read_parameter, weight, closure_id="c2")))

    assert torch.equal(first, w0), "the worker read the servers' value, not the coordinator's zeros"
    torch.testing.assert_close(second, w0 - LR * torch.ones(2, 3))


def test_a_forward_after_step_sees_the_updated_values(core, servers):
    model, optimizer = distributed_linear()
    model.register_forward_pre_hook(RefreshBeforeForward())
    x, y = torch.randn(4, 3), torch.randn(4, 2)

    outcome = core.run_closure(closure_request(servers, step_then_predict, model, optimizer, x, y))

    torch.testing.assert_close(result_of(outcome), x @ servers.value("w").T + servers.value("b"))


def test_steps_runs_the_function_that_many_times_with_distinct_push_keys(core, servers):
    model, optimizer = distributed_linear()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    log = PerWorkerResource("log")
    spec = ResourceSpec("log", cloudpickle.dumps(make_log))

    outcome = core.run_closure(
        closure_request(servers, step_and_count, model, optimizer, log, x, y, steps=3, resources=[spec])
    )

    assert result_of(outcome) == 4  # the resource's first entry, then three steps
    assert outcome.pushes_applied == 6
    assert servers.traffic.push_keys == ["closure-1/0", "closure-1/1", "closure-1/2"]
    assert (servers.version("w"), servers.version("b")) == (3, 3)


# ---------------------------------------------------------------- embeddings


def one_table():
    """Servers holding a 1000 x 16 table (SGD), a core, the table's layer and optimizer, and ids."""
    servers = FakeParameterServers()
    table = torch.randn(1000, 16)
    servers.create("table", table, SGD)
    embedding = ShardedEmbedding(1000, 16, name="table")
    optimizer = ServerOptimizer(["table"], "SGD", {"lr": LR})
    return servers, table, WorkerCore(servers.factory), embedding, optimizer, torch.tensor([[3, 999], [3, 500]])


def test_embedding_lookup_pulls_only_its_rows_and_pushes_row_gradients(core):
    servers, table, core, embedding, optimizer, indices = one_table()

    outcome = core.run_closure(closure_request(servers, embed_and_step, embedding, optimizer, indices))

    assert result_of(outcome) == (2, 2, 16)
    assert sorted(servers.traffic.rows_pulled) == [3, 500, 999] and servers.traffic.pulled == []
    expected = table.clone()
    expected[3] -= LR * 2  # looked up twice: gradients summed
    expected[999] -= LR
    expected[500] -= LR
    torch.testing.assert_close(servers.value("table"), expected)
    assert outcome.pushes_applied == 1


def collection_step(collection, optimizer, ids):
    rows = collection(ids)
    sum(r.sum() for r in rows.values()).backward()
    optimizer.step()
    return {feature: tuple(r.shape) for feature, r in rows.items()}


def test_a_collection_reads_every_table_in_one_exchange_and_pushes_summed_rows(core):
    servers = FakeParameterServers()
    table = torch.randn(15, 4)
    servers.create("tables", table, SGD)
    core = WorkerCore(servers.factory)
    collection = ShardedEmbeddingCollection({"a": 10, "b": 5}, 4, name="tables")
    optimizer = ServerOptimizer(["tables"], "SGD", {"lr": LR})
    ids = {"a": torch.tensor([[1, 9]]), "b": torch.tensor([[1, 1]])}

    outcome = core.run_closure(closure_request(servers, collection_step, collection, optimizer, ids))

    assert result_of(outcome) == {"a": (1, 2, 4), "b": (1, 2, 4)}
    assert servers.traffic.row_exchanges == 1
    assert sorted(servers.traffic.rows_pulled) == [1, 9, 11]  # b's row 1 is the table's row 10 + 1
    expected = table.clone()
    expected[[1, 9]] -= LR
    expected[11] -= 2 * LR  # looked up twice: one summed row pushed
    torch.testing.assert_close(servers.value("tables"), expected)


def test_a_collection_refuses_an_id_outside_its_features_table(core):
    servers = FakeParameterServers()
    servers.create("tables", torch.zeros(15, 4), SGD)
    collection = ShardedEmbeddingCollection({"a": 10, "b": 5}, 4, name="tables")
    optimizer = ServerOptimizer(["tables"], "SGD", {"lr": LR})

    outcome = WorkerCore(servers.factory).run_closure(
        closure_request(
            servers, collection_step, collection, optimizer, {"a": torch.tensor([0]), "b": torch.tensor([5])}
        )
    )

    assert outcome.error is not None and outcome.error.type == "builtins.IndexError"
    assert "id 5 of feature 'b'" in outcome.error.message and "[0, 5)" in outcome.error.message
    assert servers.traffic.rows_pulled == [] and servers.version("tables") == 0


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


def test_an_unreachable_parameter_server_is_named_in_the_error(core, servers):
    weight = nn.Parameter(torch.zeros(2, 3))
    mark_variable(weight, "w")
    servers.down = True

    outcome = core.run_closure(closure_request(servers, read_parameter, weight))

    assert outcome.error is not None
    assert outcome.error.parameter_server == ADDRESS
    assert outcome.error.type.endswith("ServerUnavailableError")


# ---------------------------------------------------------------- requests and bookkeeping


def test_malformed_requests_raise_and_change_nothing(core, servers):
    good = closure_request(servers, read_parameter, torch.zeros(1))

    for request in (
        ClosureRequest(closure_id="", payload=good.payload),
        ClosureRequest(closure_id="x", payload=b""),
        ClosureRequest(closure_id="x", payload=good.payload, steps=-1),
    ):
        with pytest.raises(InvalidRequestError):
            core.run_closure(request)
    assert core.info().closures_run == 0


def test_info_names_the_incarnation_and_counts_closures(core, servers):
    first = core.info()
    outcome = core.run_closure(closure_request(None, exploding_user_function, 1))

    assert len(first.incarnation) == 32 and first.closures_run == 0
    assert outcome.worker_incarnation == first.incarnation
    assert core.info().closures_run == 1
    assert WorkerCore(servers.factory).incarnation != first.incarnation


def test_closing_the_core_closes_its_clients(servers):
    core = WorkerCore(servers.factory)
    core.run_closure(closure_request(servers, read_parameter, torch.zeros(1)))

    core.close()

    assert servers.closed


def test_per_worker_resource_pickles_as_a_reference():
    reference = PerWorkerResource("dataset-7")

    function, args = reference.__reduce__()

    assert function is resolve_resource and args == ("dataset-7",)
    with pytest.raises(RuntimeError, match="outside a worker closure"):
        pickle.loads(pickle.dumps(reference))
    assert ResourceMissingError("a", "b").resource_ids == ("a", "b")


def test_parameters_are_shared_across_closures_of_one_worker(core, servers):
    weight = nn.Parameter(torch.zeros(2, 3))
    mark_variable(weight, "w")

    first = result_of(core.run_closure(closure_request(servers, identity_of, weight)))
    second = result_of(core.run_closure(closure_request(servers, identity_of, weight, closure_id="c2")))

    assert first == second and first != id(weight)


def test_paramserve_worker_flags_build_the_config(tmp_path):
    from paramserve.coordinator.commands import cli
    from paramserve.worker import __main__ as worker_main

    (tmp_path / "token").write_text("shared\n")
    (tmp_path / "ps-token").write_text("for-servers\n")
    parser = cli.build_parser()
    shared = parser.parse_args(["worker", "--token-file", str(tmp_path / "token")])
    split = parser.parse_args(
        ["worker", "--token-file", str(tmp_path / "token"), "--ps-token-file", str(tmp_path / "ps-token")]
    )

    shared_config = worker_main.config_from_args(shared, shared.subparser)
    split_config = worker_main.config_from_args(split, split.subparser)

    assert shared.runner is worker_main.run
    assert (shared_config.token, shared_config.effective_ps_token) == ("shared", "shared")
    assert shared_config.torch_threads == cpus.torch_threads(None), "the share of this machine's CPUs"
    assert (split_config.token, split_config.effective_ps_token) == ("shared", "for-servers")


# ---------------------------------------------------------------- what a step starts from


def request_with(servers, *args, closure_id, steps=1, max_value_age=0.0):
    request = closure_request(servers, train_step, *args, closure_id=closure_id, steps=steps)
    return ClosureRequest(**{**request.__dict__, "max_value_age": max_value_age})


def test_later_steps_of_a_closure_start_from_what_the_previous_push_returned(core, servers):
    model, optimizer = distributed_linear()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    local = servers.local_linear()
    reference = torch.optim.SGD(local.parameters(), lr=LR)

    result_of(core.run_closure(request_with(servers, model, optimizer, x, y, closure_id="c", steps=3)))

    for _ in range(3):  # the same three steps in one process
        reference.zero_grad()
        ((local(x) - y) ** 2).mean().backward()
        reference.step()
    torch.testing.assert_close(servers.value("w"), local.weight.detach())
    assert sorted(servers.traffic.pulled) == ["b", "w"], "only the first step pulls"
    assert servers.traffic.read_back == ["w", "b"] * 3, "each push reads back what it changed"


def test_a_closure_pulls_at_its_first_step_unless_the_returned_values_are_young_enough(core, servers):
    model, optimizer = distributed_linear()
    x, y = torch.randn(4, 3), torch.randn(4, 2)

    core.run_closure(request_with(servers, model, optimizer, x, y, closure_id="a"))
    core.run_closure(request_with(servers, model, optimizer, x, y, closure_id="b"))  # max_value_age 0: pulls
    assert sorted(servers.traffic.pulled) == ["b", "b", "w", "w"]

    core.run_closure(request_with(servers, model, optimizer, x, y, closure_id="c", max_value_age=3600.0))
    assert len(servers.traffic.pulled) == 4, "values returned a moment ago start the closure"

    servers.push({"w": torch.ones(2, 3)}, key="another-worker")  # missed by a closure that reuses
    reused = core.run_closure(request_with(servers, model, optimizer, x, y, closure_id="d", max_value_age=3600.0))
    assert len(servers.traffic.pulled) == 4
    assert reused.error is None and servers.version("w") == 5, "its push still applies, one version stale"
    core.run_closure(request_with(servers, model, optimizer, x, y, closure_id="e", max_value_age=1e-9))
    assert len(servers.traffic.pulled) == 6, "values older than max_value_age are pulled again"


def test_a_new_generation_of_the_cluster_context_drops_the_values_a_worker_holds(core, servers):
    model, optimizer = distributed_linear()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    core.run_closure(request_with(servers, model, optimizer, x, y, closure_id="a", max_value_age=3600.0))
    assert len(servers.traffic.pulled) == 2

    restored = ClusterContext(servers.cluster.parameter_servers, servers.cluster.layouts, generation=1)
    assert restored.fingerprint != servers.cluster.fingerprint
    request = request_with(servers, model, optimizer, x, y, closure_id="b", max_value_age=3600.0)
    core.run_closure(ClosureRequest(**{**request.__dict__, "cluster": restored}))
    assert len(servers.traffic.pulled) == 4, "values from before a restore are pulled again"


def test_a_worker_without_the_named_cluster_context_asks_for_it(core, servers):
    weight = nn.Parameter(torch.zeros(2, 3))
    mark_variable(weight, "w")
    full = closure_request(servers, read_parameter, weight)
    by_name = ClosureRequest(**{**full.__dict__, "cluster": None, "cluster_fingerprint": servers.cluster.fingerprint})

    asked = core.run_closure(by_name)
    first = core.run_closure(ClosureRequest(**{**full.__dict__, "cluster_fingerprint": servers.cluster.fingerprint}))
    again = core.run_closure(ClosureRequest(**{**by_name.__dict__, "closure_id": "c2"}))

    assert asked.error is not None and asked.error.needs_cluster and asked.result is None
    assert torch.equal(result_of(first), servers.value("w"))
    assert torch.equal(result_of(again), servers.value("w")), "held under its fingerprint: no resend needed"
    assert core.info().closures_run == 2, "asking for the context is not running the closure"


def return_values() -> dict:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {
        "loss": (base * torch.ones(1, requires_grad=True)).sum(),  # has a grad_fn
        "transposed": base.t(),  # not contiguous
        "bf16": base.to(torch.bfloat16),
        "count": torch.tensor(7),
        "empty": torch.empty(0, 5),
        "complex": torch.ones(2, dtype=torch.complex64),  # no wire dtype: torch's own pickling
    }


def test_result_tensors_arrive_as_detached_values(core, servers):
    values = result_of(core.run_closure(closure_request(servers, return_values)))
    expected = return_values()
    for name, tensor in values.items():
        assert torch.equal(tensor, expected[name].detach()), name
        assert tensor.dtype == expected[name].dtype and tensor.shape == expected[name].shape
        assert tensor.grad_fn is None and not tensor.requires_grad
    values["transposed"].add_(1)  # an independent, writable tensor


def returns_a_local_function():
    scale = 3
    return {"loss": torch.tensor(1.5, requires_grad=True) * 2, "scaled": lambda x: x * scale}


def test_results_the_standard_pickler_refuses_travel_by_value(core, servers):
    values = result_of(core.run_closure(closure_request(servers, returns_a_local_function)))

    assert values["scaled"](2) == 6  # a local function: cloudpickle sent it by value
    assert torch.equal(values["loss"], torch.tensor(3.0)) and not values["loss"].requires_grad


class _Doubling(nn.Module):
    """A module with state of its own beside its layer, and a forward hook."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 2)
        self.scale = 2.0
        self.calls: list[int] = []
        self.register_forward_hook(_count_calls)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.layer(x)


def _count_calls(module: nn.Module, args: object, output: object) -> None:
    module.calls.append(1)  # type: ignore[union-attr]


class _OwnState(nn.Linear):
    def __getstate__(self) -> dict[str, object]:
        return {**super().__getstate__(), "marker": "own"}


def test_modules_travel_without_the_empty_hook_dicts_and_arrive_whole():
    module = _Doubling()
    module.eval()
    plain_size = len(cloudpickle.dumps(module))

    sent = dumps_closure(module)
    arrived = cloudpickle.loads(sent)

    assert len(sent) < plain_size, "the empty hook dicts stay home"
    for (name, before), (_, after) in zip(module.named_modules(), arrived.named_modules()):
        assert set(after.__dict__) == set(before.__dict__), name  # nn.Module.__setstate__ refills them
        assert after.training is False
    x = torch.randn(4, 3)
    assert torch.equal(arrived(x), module(x))
    assert arrived.calls == [1], "the forward hook (a non-empty dict) travelled"
    own = cloudpickle.loads(dumps_closure(_OwnState(2, 2)))
    assert own.marker == "own", "a module with its own pickling keeps it"


# ---------------------------------------------------------------- cancellation (join() raising)

# Module globals: closures pickle these functions by reference, so they share the test's events.
AT_SECOND_PUSH = threading.Event()
GO_ON = threading.Event()


def two_pushes_with_a_pause(model: nn.Module, optimizer: ServerOptimizer, x: torch.Tensor, y: torch.Tensor) -> str:
    train_step(model, optimizer, x, y)
    AT_SECOND_PUSH.set()
    assert GO_ON.wait(30)
    train_step(model, optimizer, x, y)
    return "both pushed"


def test_a_cancelled_closure_stops_before_its_next_push(core, servers):
    model, optimizer = distributed_linear()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    request = closure_request(servers, two_pushes_with_a_pause, model, optimizer, x, y, closure_id="running")
    outcomes: list = []
    runner = threading.Thread(target=lambda: outcomes.extend(core.run_closures([request])), name="test-run")
    runner.start()
    assert AT_SECOND_PUSH.wait(30)
    assert core.cancel(["running", "not-here"]) == 1, "one of the ids is in the batch running"
    GO_ON.set()
    runner.join(30)

    [outcome] = outcomes
    assert outcome.error is not None and outcome.error.cancelled and outcome.result is None
    assert (servers.version("w"), servers.version("b")) == (1, 1), "the second push never left"
    assert core.info().closures_run == 1


def test_a_closure_cancelled_before_it_arrives_does_not_start(core, servers):
    model, optimizer = distributed_linear()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    assert core.cancel(["late"]) == 0
    late = closure_request(servers, train_step, model, optimizer, x, y, closure_id="late")
    after = closure_request(servers, train_step, model, optimizer, x, y, closure_id="after")
    outcomes = core.run_closures([late, after])
    assert [o.error.cancelled for o in outcomes] == [True], "the batch stops at the cancelled closure"
    assert servers.version("w") == 0 and not servers.traffic.pulled


def test_a_worker_forgets_old_cancellations_beyond_a_bound(core, servers):
    from paramserve.worker import core as worker_core

    core.cancel(["oldest"])
    core.cancel([f"id-{i}" for i in range(worker_core._MAX_CANCELLED_IDS)])
    outcome = core.run_closure(closure_request(None, read_parameter, torch.ones(1), closure_id="oldest"))
    assert outcome.error is None, "forgotten: the coordinator never resends a closure it cancelled"


def test_values_read_before_a_barrier_are_not_reused_by_a_closure_after_it(core, servers):
    model, optimizer = distributed_linear()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    core.run_closure(request_with(servers, model, optimizer, x, y, closure_id="a", max_value_age=3600.0))
    assert len(servers.traffic.pulled) == 2
    same = request_with(servers, model, optimizer, x, y, closure_id="b", max_value_age=3600.0)
    core.run_closure(same)
    assert len(servers.traffic.pulled) == 2, "same generation: the returned values start it"
    after = dataclasses.replace(
        request_with(servers, model, optimizer, x, y, closure_id="c", max_value_age=3600.0), read_generation=1
    )
    core.run_closure(after)
    assert len(servers.traffic.pulled) == 4, "a closure after join()/fetch() reads afresh"
    again = dataclasses.replace(after, closure_id="d")
    core.run_closure(again)
    assert len(servers.traffic.pulled) == 4, "values read in its own generation are reused again"


def test_a_row_cache_serves_rows_within_its_bound_every_step_still_pushes_and_a_new_context_empties_it(core):
    servers, table, core, embedding, optimizer, indices = one_table()

    def run(closure_id: str, cluster: ClusterContext | None = None):
        request = closure_request(servers, embed_and_step, embedding, optimizer, indices, closure_id=closure_id)
        request = dataclasses.replace(request, max_row_staleness=2, cluster=cluster or servers.cluster)
        outcome = core.run_closure(request)
        assert result_of(outcome) == (2, 2, 16)
        return outcome

    first = run("a")
    assert servers.traffic.rows_pulled == [3, 500, 999] and first.cache_use.rows_pulled == 3
    second, third = run("b"), run("c")  # steps 2 and 3: rows read at step 1 are 1 and 2 steps old
    assert servers.traffic.rows_pulled == [3, 500, 999], "served from the cache"
    assert second.cache_use.rows_cached == 3 and dict(third.cache_use.ages) == {2: 3}
    run("d")  # step 4: 3 steps old, over the bound: read again
    assert servers.traffic.rows_pulled == [3, 500, 999] * 2
    expected = table.clone()
    expected[3] -= 4 * LR * 2
    expected[[500, 999]] -= 4 * LR
    torch.testing.assert_close(servers.value("table"), expected)  # SGD's step needs no row values
    assert servers.version("table") == 4, "every step pushed once, cached rows or not"

    moved = ClusterContext(servers.cluster.parameter_servers, servers.cluster.layouts, generation=1)
    run("e", moved)  # a restore or a failover: the coordinator's new context
    assert servers.traffic.rows_pulled == [3, 500, 999] * 3, "nothing read before it is served after it"


def test_a_worker_refuses_a_negative_row_staleness(core, servers):
    request = closure_request(servers, read_parameter, torch.zeros(1))
    with pytest.raises(InvalidRequestError, match="max_row_staleness must be >= 0 steps, got -1"):
        core.run_closure(dataclasses.replace(request, max_row_staleness=-1))
