"""Replicated parameter servers over real gRPC and data planes (psserver/replication/replica.py): a
primary's backup applies every write bit for bit, a backup and a replaced primary serve no
client, a primary whose backup is gone acknowledges nothing until the coordinator decides, a
rejoining server is copied into, and bad replication requests are refused, changing nothing."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from paramserve.psserver.client.calls import CallOptions, Stub
from paramserve.psserver.client.ps_client import ClientConfig, ParameterServerClient
from paramserve.psserver.dynamic.dynamic_types import DynamicTableConfig
from paramserve.psserver.protocol.errors import InvalidRequestError, NotPrimaryError, ParamServeError, ReplicaEpochError
from paramserve.psserver.protocol.metadata import REPLICA_EPOCH_METADATA_KEY, SERVICE_NAME
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.replica_config import ReplicaConfig, ReplicaRole
from paramserve.psserver.protocol.types import RowGradient
from paramserve.psserver.replication.replica_calls import ReplicaCalls
from paramserve.psserver.runtime.channels import channel_options, open_channel
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2

PRIMARY, BACKUP = ReplicaRole.PRIMARY, ReplicaRole.BACKUP


def address(server) -> str:  # type: ignore[no-untyped-def]
    return f"127.0.0.1:{server.port}"


def exported(addr: str) -> dict:  # type: ignore[type-arg]
    stub = Stub(open_channel(addr, None, channel_options(64 << 20)))
    return {state.ref: state for state in stub.export(1 << 20, CallOptions(None, 10, 10))}


def assert_identical(a: dict, b: dict) -> None:  # type: ignore[type-arg]
    assert a.keys() == b.keys()
    for ref, shard in a.items():
        other = b[ref]
        assert torch.equal(shard.value, other.value), ref
        assert shard.slots.keys() == other.slots.keys() and all(
            torch.equal(shard.slots[k], other.slots[k]) for k in shard.slots
        ), ref
        assert (shard.version, list(shard.applied_keys), shard.optimizer) == (
            other.version,
            list(other.applied_keys),
            other.optimizer,
        ), ref


@pytest.fixture
def pair(start_ps):  # type: ignore[no-untyped-def]
    """A primary and its backup at epoch 1, and the calls that configure them."""
    primary, backup = start_ps(), start_ps()
    calls = ReplicaCalls([address(primary), address(backup)], token=None, tls=None)
    calls.configure(address(backup), ReplicaConfig(1, BACKUP))
    calls.configure(address(primary), ReplicaConfig(1, PRIMARY, (address(backup),)))
    yield primary, backup, calls
    calls.close()


@pytest.fixture
def one_client():  # type: ignore[no-untyped-def]
    """Clients on the default route (the data plane) only: for what does not depend on how a
    client reaches the primary (the forwards to the backup always take their own way)."""
    clients: list[ParameterServerClient] = []

    def make(addresses: list[str], **overrides: object) -> ParameterServerClient:
        options = {"call_timeout": 10.0, "retry_deadline": 10.0, **overrides}
        clients.append(ParameterServerClient(addresses, ClientConfig(**options)))  # type: ignore[arg-type]
        return clients[-1]

    yield make
    for client in clients:
        client.close()


def test_a_backup_applies_every_write_of_its_primary_bit_for_bit(pair, make_client) -> None:  # type: ignore[no-untyped-def]
    primary, backup, _ = pair
    client = make_client([address(primary)])
    torch.manual_seed(0)
    client.create_variable("w", torch.randn(64, 8), optimizer=OptimizerSpec("Adam", {"lr": 0.01}))
    client.create_variable("emb", torch.randn(500, 4), optimizer=OptimizerSpec("Adagrad", {"lr": 0.1}))
    client.create_variable("gone", torch.randn(3), optimizer=OptimizerSpec("SGD", {"lr": 0.1}))
    for step in range(12):
        rows = torch.tensor([step, 7, 400 + step])
        client.push({"w": torch.randn(64, 8), "emb": RowGradient(rows, torch.randn(3, 4))}, key=f"k{step}")
        if step == 5:
            client.set_hyperparameters({"lr": 0.5}, variable="w")  # between pushes: in the same order
        if step == 8:  # several variables in one call, forwarded as one
            client.set_hyperparameters_of({"lr": 0.05}, ["emb", "gone"])
    client.push({"w": torch.randn(64, 8)}, key="k3")  # a retry: a duplicate on both
    client.delete_variable("gone")
    assert_identical(exported(address(primary)), exported(address(backup)))
    state = exported(address(backup))
    assert {ref.variable for ref in state} == {"w", "emb"}
    assert all(shard.version == 12 for shard in state.values())
    assert next(s for r, s in state.items() if r.variable == "w").optimizer.kwargs["lr"] == 0.5
    assert next(s for r, s in state.items() if r.variable == "emb").optimizer.kwargs["lr"] == 0.05


def test_writes_sent_another_way_wait_for_the_pushes_before_them(pair, one_client) -> None:  # type: ignore[no-untyped-def]
    """Learning-rate changes (a gRPC call) between pushes that stream from two clients on the
    pipeline: the backup applies each in the primary's order, so it ends bit for bit equal."""
    primary, backup, _ = pair
    clients = [one_client([address(primary)]) for _ in range(2)]
    clients[0].create_variable("w", torch.zeros(1000), optimizer=OptimizerSpec("SGD", {"lr": 1.0, "momentum": 0.5}))
    clients[1].discover()
    stop = threading.Event()

    def push_on(client, name: str) -> None:  # type: ignore[no-untyped-def]
        step = 0
        while not stop.is_set():
            client.push({"w": torch.full((1000,), float(step % 7))}, key=f"{name}-{step}")
            step += 1

    pushers = [threading.Thread(target=push_on, args=(client, f"c{i}")) for i, client in enumerate(clients)]
    for pusher in pushers:
        pusher.start()
    try:
        for change in range(40):
            clients[0].set_hyperparameters({"lr": 0.5 / (1 + change)}, variable="w")
    finally:
        stop.set()
        for pusher in pushers:
            pusher.join(30)
    assert_identical(exported(address(primary)), exported(address(backup)))


def test_a_push_larger_than_a_message_reaches_a_backup_without_a_data_plane(start_ps, one_client) -> None:  # type: ignore[no-untyped-def]
    primary, backup = start_ps(), start_ps(data_port=None)
    calls = ReplicaCalls([address(primary), address(backup)], token=None, tls=None)
    calls.configure(address(backup), ReplicaConfig(1, BACKUP))
    calls.configure(address(primary), ReplicaConfig(1, PRIMARY, (address(backup),)))
    client = one_client([address(primary)])
    client.create_variable("big", torch.zeros(5_000_000), optimizer=OptimizerSpec("SGD", {"lr": 1.0}))
    client.push({"big": torch.ones(5_000_000)}, key="big-1")  # 20 MB: a Push stream to the backup
    client.push({"big": torch.ones(10)[:1].expand(5_000_000).contiguous()}, key="big-2")
    assert_identical(exported(address(primary)), exported(address(backup)))
    calls.close()


def test_a_backup_serves_no_client_and_changes_nothing(pair, make_client) -> None:  # type: ignore[no-untyped-def]
    primary, backup, _ = pair
    make_client([address(primary)]).create_variable("w", torch.zeros(4), optimizer=OptimizerSpec("SGD", {"lr": 1.0}))
    direct = make_client([address(backup)], retry_deadline=0.2)
    direct.adopt_layouts(make_client([address(primary)]).discover())
    with pytest.raises(NotPrimaryError, match="backup"):
        direct.push({"w": torch.ones(4)}, key="from-a-client")
    with pytest.raises(NotPrimaryError, match="backup"):
        direct.pull(["w"])
    assert all(shard.version == 0 for shard in exported(address(backup)).values())


def test_a_replaced_primary_is_fenced_off_and_acknowledges_nothing(pair, make_client) -> None:  # type: ignore[no-untyped-def]
    """A primary cut off from the coordinator while a worker still reaches it: once its backup
    is promoted, the next write it forwards is refused, so it is never acknowledged, and from
    then on the old primary refuses every client."""
    primary, backup, calls = pair
    client = make_client([address(primary)], retry_deadline=0.2)
    client.create_variable("w", torch.zeros(4), optimizer=OptimizerSpec("SGD", {"lr": 1.0}))
    client.push({"w": torch.ones(4)}, key="before")
    calls.configure(address(backup), ReplicaConfig(2, PRIMARY))  # the coordinator promotes the backup
    with pytest.raises(NotPrimaryError, match="replaced"):  # or, retried, "deposed: ... replaced"
        client.push({"w": torch.ones(4)}, key="after")
    with pytest.raises(NotPrimaryError, match="deposed"):
        client.pull(["w"])
    assert "deposed" in calls.state(address(primary), 5).refusing
    promoted = exported(address(backup))
    assert [shard.applied_keys for shard in promoted.values()] == [["before"]], "the refused write is nowhere acked"
    survivor = make_client([address(backup)])
    survivor.adopt_layouts(client.layouts)
    assert survivor.push({"w": torch.ones(4)}, key="after").outcomes[0].applied  # its retry, on the new primary


def test_a_primary_whose_backup_is_gone_waits_for_the_coordinator(start_ps, one_client) -> None:  # type: ignore[no-untyped-def]
    primary, backup = start_ps(), start_ps()
    calls = ReplicaCalls([address(primary), address(backup)], token=None, tls=None)
    calls.configure(address(backup), ReplicaConfig(1, BACKUP))
    calls.configure(address(primary), ReplicaConfig(1, PRIMARY, (address(backup),)))
    client = one_client([address(primary)], retry_deadline=0.2)
    client.create_variable("w", torch.zeros(4), optimizer=OptimizerSpec("SGD", {"lr": 1.0}))
    backup.stop(grace=0)
    with pytest.raises(NotPrimaryError, match="backup .* (did not apply|failed)"):
        client.push({"w": torch.ones(4)}, key="k")
    assert "waiting for the coordinator" in calls.state(address(primary), 5).refusing
    calls.configure(address(primary), ReplicaConfig(2, PRIMARY))  # the coordinator: go on alone
    outcome = client.push({"w": torch.ones(4)}, key="k").outcomes[0]  # the closure's retry, same key
    assert not outcome.applied and outcome.version == 1, "applied once, before the forward failed"
    calls.close()


def test_a_rejoining_server_is_copied_into_while_pushes_go_on(pair, start_ps, one_client) -> None:  # type: ignore[no-untyped-def]
    """The primary copies its shards into a joining backup one at a time while a client keeps
    pushing; every push is acknowledged, and afterwards the three replicas are bit for bit equal."""
    primary, backup, calls = pair
    client = one_client([address(primary)])
    torch.manual_seed(0)
    for index in range(6):  # several shards, so the copy interleaves with the pushes
        client.create_variable(f"w{index}", torch.randn(200, 8), optimizer=OptimizerSpec("Adam", {"lr": 0.1}))
    stale = start_ps()  # it holds something of its own, as a replaced primary would
    one_client([address(stale)]).create_variable("w0", torch.zeros(200, 8), optimizer=OptimizerSpec("SGD", {"lr": 1}))
    joining = ReplicaCalls([address(primary), address(backup), address(stale)], token=None, tls=None)
    stop, pushed = threading.Event(), []

    def push_on() -> None:
        while not stop.is_set():
            step = len(pushed)
            client.push({f"w{i}": torch.randn(200, 8) for i in range(6)}, key=f"k{step}")
            pushed.append(step)

    pusher = threading.Thread(target=push_on)
    pusher.start()
    try:
        wait_until(lambda: len(pushed) >= 3, "pushes running")
        joining.configure(address(stale), ReplicaConfig(1, BACKUP))
        joining.wipe(address(stale), 1)
        both = (address(backup), address(stale))
        joining.configure(address(primary), ReplicaConfig(1, PRIMARY, both, (address(stale),)))
        shards, copied = joining.copy_into(address(primary), address(stale), timeout=30)
        during = len(pushed)
        wait_until(lambda: len(pushed) >= during + 3, "pushes forwarded to the new backup too")
    finally:
        stop.set()
        pusher.join(30)
    assert shards == 6 and copied >= 6 * 200 * 8 * 4 * 3  # values and Adam's two slots
    assert joining.state(address(primary), 5).config == ReplicaConfig(1, PRIMARY, both)  # in sync now
    reference = exported(address(primary))
    assert {shard.version for shard in reference.values()} == {len(pushed)}
    assert_identical(reference, exported(address(backup)))
    assert_identical(reference, exported(address(stale)))
    joining.close()


def test_a_joining_backup_that_fails_is_dropped_and_the_primary_serves_on(pair, start_ps, one_client) -> None:  # type: ignore[no-untyped-def]
    primary, backup, calls = pair
    client = one_client([address(primary)])
    client.create_variable("w", torch.zeros(4), optimizer=OptimizerSpec("SGD", {"lr": 1.0}))
    joiner = start_ps()
    joining = ReplicaCalls([address(primary), address(joiner)], token=None, tls=None)
    joining.configure(address(joiner), ReplicaConfig(1, BACKUP))
    both = (address(backup), address(joiner))
    joining.configure(address(primary), ReplicaConfig(1, PRIMARY, both, (address(joiner),)))
    joiner.stop(grace=0)
    with pytest.raises(ParamServeError):
        joining.copy_into(address(primary), address(joiner), timeout=10)
    state = joining.state(address(primary), 5)
    assert state.config == ReplicaConfig(1, PRIMARY, (address(backup),)) and not state.refusing
    assert client.push({"w": torch.ones(4)}, key="after").outcomes[0].applied
    assert_identical(exported(address(primary)), exported(address(backup)))
    joining.close()


def wait_until(condition, what: str, seconds: float = 30) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds:g}s"
        time.sleep(0.01)


def test_bad_replication_requests_are_refused_and_change_nothing(pair) -> None:  # type: ignore[no-untyped-def]
    primary, backup, calls = pair
    before = calls.state(address(backup), 5)
    with pytest.raises(ReplicaEpochError, match="new epoch"):
        calls.configure(address(backup), ReplicaConfig(1, PRIMARY))  # epoch 1 is taken: a new decision
    calls.configure(address(backup), ReplicaConfig(4, BACKUP))
    with pytest.raises(ReplicaEpochError, match="older"):
        calls.configure(address(backup), ReplicaConfig(3, PRIMARY))
    before = calls.state(address(backup), 5)
    with pytest.raises(ReplicaEpochError, match="forwards to nobody"):
        calls.configure(address(backup), ReplicaConfig(5, BACKUP, (address(primary),)))
    stub = Stub(open_channel(address(backup), None, channel_options(1 << 20)))
    unknown = ps_pb2.ConfigureReplicaRequest(config=ps_pb2.ReplicaConfig(epoch=5, role=7))
    with pytest.raises(grpc.RpcError) as raised:
        stub.unary("ConfigureReplica", unknown, ps_pb2.ConfigureReplicaResponse, CallOptions(None, 5, 5))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "role 7 is unknown" in raised.value.details()
    forged = grpc.insecure_channel(address(backup)).unary_unary(f"/{SERVICE_NAME}/DeleteVariable")
    with pytest.raises(grpc.RpcError) as raised:
        forged(
            ps_pb2.DeleteVariableRequest(variable="w").SerializeToString(),
            metadata=[(REPLICA_EPOCH_METADATA_KEY, "not-a-number")],
            timeout=5,
        )
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert calls.state(address(backup), 5) == before


def test_dynamic_tables_are_refused_on_replicated_servers(pair, one_client) -> None:  # type: ignore[no-untyped-def]
    primary, _, _ = pair
    client = one_client([address(primary)])
    with pytest.raises(InvalidRequestError, match="not replicated"):
        client.dynamic.create("users", DynamicTableConfig(dim=4))
