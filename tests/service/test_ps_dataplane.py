"""The parameter-server service over real gRPC: one or two servers on port 0 in this process."""

from __future__ import annotations

import grpc
import pytest
import torch

from paramserve.psserver.protocol.errors import DtypeMismatchError, InvalidRequestError, ShapeMismatchError
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.partition import FixedShardsPartitioner
from paramserve.psserver.protocol.types import RowGradient, ShardRef
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2

SGD = OptimizerSpec("SGD", {"lr": 0.5})


def test_dense_variable_is_partitioned_across_servers_and_pulled_whole(start_ps, make_client):
    servers = [start_ps(), start_ps()]
    client = make_client([s.address for s in servers])
    value = torch.randn(101, 33)  # 13 KB per shard: many 4 KiB chunks each

    layout = client.create_variable("emb", value, optimizer=SGD, partitioner=FixedShardsPartitioner(3))

    assert [s.num_rows for s in layout.shards] == [34, 34, 33]
    assert {s.server for s in layout.shards} == {0, 1}
    held = [len(s.store.list_shards()) for s in servers]
    assert sorted(held) == [1, 2]
    pulled = client.pull(["emb"])
    assert torch.equal(pulled.tensors["emb"], value)
    assert pulled.versions == {ShardRef("emb", i): 0 for i in range(3)}


def test_dense_push_applies_sgd_and_counts_versions_and_staleness(start_ps, make_client):
    client = make_client([start_ps().address, start_ps().address])
    value = torch.randn(10, 4)
    client.create_variable("w", value, optimizer=SGD, partitioner=FixedShardsPartitioner(2))
    base = client.pull(["w"])
    gradient = torch.randn(10, 4)

    first = client.push({"w": gradient}, base_versions=base.versions)
    second = client.push({"w": gradient}, base_versions=base.versions)

    assert first.applied == 2 and second.applied == 2
    assert {o.staleness for o in first.outcomes} == {0}
    assert {o.staleness for o in second.outcomes} == {1}
    after = client.pull(["w"])
    torch.testing.assert_close(after.tensors["w"], value - 2 * 0.5 * gradient)
    assert set(after.versions.values()) == {2}


def test_rows_pull_and_sparse_push_touch_only_their_rows(start_ps, make_client):
    client = make_client([start_ps().address, start_ps().address])
    table = torch.randn(50, 8)
    client.create_variable("table", table, optimizer=SGD, partitioner=FixedShardsPartitioner(4))
    indices = torch.tensor([[49, 0], [13, 49]])

    rows = client.pull_rows("table", indices).tensors["table"]
    assert rows.shape == (2, 2, 8)
    assert torch.equal(rows, table[indices])

    grad_rows = torch.ones(3, 8)
    client.push({"table": RowGradient(torch.tensor([3, 30, 3]), grad_rows)})
    after = client.pull(["table"]).tensors["table"]
    expected = table.clone()
    expected[3] -= 0.5 * 2  # duplicate rows sum, as torch's sparse gradients do
    expected[30] -= 0.5
    torch.testing.assert_close(after, expected)


def test_retried_push_with_the_same_key_is_applied_once(start_ps, make_client):
    server = start_ps()
    client = make_client([server.address])
    client.create_variable("w", torch.zeros(4), optimizer=SGD)

    first = client.push({"w": torch.ones(4)}, key="step-7-worker-1")
    again = client.push({"w": torch.ones(4)}, key="step-7-worker-1")

    assert (first.applied, first.duplicates) == (1, 0)
    assert (again.applied, again.duplicates) == (0, 1)
    torch.testing.assert_close(client.pull(["w"]).tensors["w"], torch.full((4,), -0.5))
    applied = server.registry.get_sample_value("paramserve_ps_pushes_total", {"result": "applied"})
    duplicate = server.registry.get_sample_value("paramserve_ps_pushes_total", {"result": "duplicate"})
    assert (applied, duplicate) == (1.0, 1.0)


def test_server_side_initializer_fills_a_table_without_sending_it(start_ps, make_client):
    client = make_client([start_ps().address, start_ps().address])
    init = tensor_pb2.Initializer(kind="normal", a=0.0, b=0.01, seed=3)
    client.create_variable(
        "big", shape=(1000, 16), initializer=init, optimizer=SGD, partitioner=FixedShardsPartitioner(2)
    )

    rows = client.pull_rows("big", torch.arange(0, 1000, 7)).tensors["big"]

    assert rows.shape == (143, 16)
    assert 0.005 < float(rows.std()) < 0.02


def test_layouts_are_rediscovered_by_a_fresh_client(start_ps, make_client):
    addresses = [start_ps().address, start_ps().address]
    creator = make_client(addresses)
    value = torch.randn(9, 2)
    creator.create_variable("v", value, optimizer=SGD, partitioner=FixedShardsPartitioner(3))

    fresh = make_client(addresses)

    assert fresh.discover()["v"] == creator.layout("v")
    assert torch.equal(fresh.pull(["v"]).tensors["v"], value)


def test_scalar_and_non_float_variables_round_trip(start_ps, make_client):
    client = make_client([start_ps().address])
    client.create_variable("step", torch.tensor(7, dtype=torch.int64))
    client.create_variable("half", torch.randn(5, 3).to(torch.bfloat16), optimizer=SGD)

    pulled = client.pull(["step", "half"]).tensors

    assert pulled["step"].item() == 7 and pulled["step"].dtype == torch.int64
    assert pulled["half"].dtype == torch.bfloat16


def test_learning_rate_can_be_changed_on_the_servers(start_ps, make_client):
    client = make_client([start_ps().address])
    client.create_variable("w", torch.zeros(3), optimizer=SGD)

    assert client.set_hyperparameters({"lr": 0.1}) == 1
    client.push({"w": torch.ones(3)})

    torch.testing.assert_close(client.pull(["w"]).tensors["w"], torch.full((3,), -0.1))


def test_one_call_per_server_sets_the_rate_of_the_variables_it_names_and_no_other(start_ps, make_client):
    """What a torch LR scheduler's step sends for a model: every variable of its group at once."""
    client = make_client([start_ps().address, start_ps().address])
    for name in ("a", "b", "c"):
        client.create_variable(name, torch.zeros(4), optimizer=SGD, partitioner=FixedShardsPartitioner(2))

    assert client.set_hyperparameters_of({"lr": 0.25}, ["a", "b"]) == 4  # two shards each
    client.push({name: torch.ones(4) for name in ("a", "b", "c")})

    pulled = client.pull(["a", "b", "c"]).tensors
    torch.testing.assert_close(pulled["a"], torch.full((4,), -0.25))
    torch.testing.assert_close(pulled["b"], torch.full((4,), -0.25))
    torch.testing.assert_close(pulled["c"], torch.full((4,), -0.5), msg="c keeps SGD's 0.5")


def test_a_rate_for_several_variables_one_of_them_unknown_changes_none(start_ps, make_client):
    client = make_client([start_ps().address])
    client.create_variable("a", torch.zeros(4), optimizer=SGD)
    request = ps_pb2.SetHyperparametersRequest(variable="a", variables=["nowhere"], values_json='{"lr": 0.25}')

    with pytest.raises(grpc.RpcError) as refused:  # the raw call: the client would name the variable first
        client._stubs[0].unary("SetHyperparameters", request, ps_pb2.SetHyperparametersResponse, client._options)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    client.push({"a": torch.ones(4)})

    torch.testing.assert_close(client.pull(["a"]).tensors["a"], torch.full((4,), -0.5), msg="a kept its 0.5")


def test_stop_and_close_leave_no_thread_behind(start_ps, make_client):
    import threading

    from paramserve.psserver.client.ps_client import ClientConfig, ParameterServerClient

    server = start_ps()
    client = ParameterServerClient([server.address, server.address], ClientConfig(call_timeout=10))
    client.create_variable("w", torch.zeros(4), optimizer=SGD, partitioner=FixedShardsPartitioner(2))
    client.push({"w": torch.ones(4)})
    client.pull(["w"])
    assert any(t.name.startswith("paramserve-") for t in threading.enumerate())

    client.close()
    server.stop(grace=0)

    left = [t.name for t in threading.enumerate() if t.name.startswith(("paramserve-ps", "paramserve-client"))]
    assert left == []


def rpcs(servers, method: str) -> float:
    return sum(
        s.registry.get_sample_value("paramserve_rpcs_total", {"role": "ps", "method": method, "code": "OK"}) or 0.0
        for s in servers
    )


def test_push_and_pull_returns_the_values_its_push_produced(start_ps, make_client, transport):
    servers = [start_ps(), start_ps()]
    client = make_client([s.address for s in servers])
    value, gradient = torch.randn(10, 4), torch.randn(10, 4)
    client.create_variable("w", value, optimizer=SGD, partitioner=FixedShardsPartitioner(2))
    client.create_variable("b", torch.zeros(3), optimizer=SGD)

    summary, pulled = client.push_and_pull({"w": gradient}, ["w", "b"], key="step-1")

    torch.testing.assert_close(pulled.tensors["w"], value - 0.5 * gradient)
    assert torch.equal(pulled.tensors["b"], torch.zeros(3))
    assert summary.applied == 2
    assert pulled.versions == {ShardRef("w", 0): 1, ShardRef("w", 1): 1, ShardRef("b", 0): 0}
    # One round trip per server when the payload fits one message; a push then a pull stream otherwise.
    expected = {
        "dataplane": {"DataPlaneStep": 2, "Step": 0, "Push": 0, "Pull": 0},
        "unary": {"DataPlaneStep": 0, "Step": 2, "Push": 0, "Pull": 0},
        "streams": {"DataPlaneStep": 0, "Step": 0, "Push": 2, "Pull": 2},
    }[transport]
    assert {method: rpcs(servers, method) for method in expected} == expected
    again, _ = client.push_and_pull({"w": gradient}, ["w"], key="step-1")
    assert again.duplicates == 2, "the same key is applied once"


def test_pulls_land_in_the_host_tensors_the_caller_gives(start_ps, make_client, transport):
    servers = [start_ps(), start_ps()]
    client = make_client([s.address for s in servers])
    value, gradient = torch.randn(10, 4), torch.randn(10, 4)
    client.create_variable("w", value, optimizer=SGD, partitioner=FixedShardsPartitioner(2))
    client.create_variable("b", torch.ones(3), optimizer=SGD)
    into_w, into_b = torch.full((10, 4), float("nan")), torch.full((3,), float("nan"))

    pulled = client.pull(["w", "b"], out={"w": into_w})  # b: allocated by the client
    _, pushed = client.push_and_pull({"w": gradient}, ["w", "b"], key="step-1", out={"w": into_w, "b": into_b})

    assert pulled.tensors["w"] is into_w and pushed.tensors["w"] is into_w and pushed.tensors["b"] is into_b
    torch.testing.assert_close(into_w, value - 0.5 * gradient)
    assert torch.equal(into_b, torch.ones(3)) and torch.equal(pulled.tensors["b"], torch.ones(3))


def test_a_destination_that_does_not_fit_is_refused_before_any_call(start_ps, make_client):
    server = start_ps()
    client = make_client([server.address])
    client.create_variable("w", torch.zeros(4, 2), optimizer=SGD)
    calls = rpcs([server], "Pull") + rpcs([server], "Step")

    with pytest.raises(ShapeMismatchError, match=r"destination has shape \(2, 4\), the servers hold \(4, 2\)"):
        client.pull(["w"], out={"w": torch.empty(2, 4)})
    with pytest.raises(DtypeMismatchError, match="float64"):
        client.pull(["w"], out={"w": torch.empty(4, 2, dtype=torch.float64)})
    with pytest.raises(InvalidRequestError, match="contiguous host tensor"):
        client.pull(["w"], out={"w": torch.empty(2, 4).t()})
    assert rpcs([server], "Pull") + rpcs([server], "Step") == calls
