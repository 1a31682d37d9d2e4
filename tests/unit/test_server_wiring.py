"""A parameter server's parts get their collaborators when they are built (psserver/server.py):
the step engine its admission, the store its replication sink, the servicer the data plane's
listing. Each built any other way either cannot be built or behaves as its server's would."""

from __future__ import annotations

import pytest
import torch

from paramserve.psserver.protocol.errors import NotPrimaryError, ReplicaEpochError
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.replica_config import ReplicaConfig, ReplicaRole
from paramserve.psserver.protocol.types import ShardRef, ShardState
from paramserve.psserver.replication.replica import Replica
from paramserve.psserver.servicer import DataPlaneListing, ParameterServerServicer, ServicerLimits
from paramserve.psserver.steps.engine import StepEngine
from paramserve.psserver.steps.programs import StepPrograms
from paramserve.psserver.store.shard_store import UNREPLICATED, ShardPush, ShardStore
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2

W = ShardRef("w", 0)


class RecordingForwarder:
    """A backup that records what its primary forwards."""

    def __init__(self, address: str):
        self.address = address
        self.pushes: list[tuple[str, int]] = []
        self.states: list[tuple[str, int]] = []

    def push(self, pushes, key, epoch):  # type: ignore[no-untyped-def]
        self.pushes.append((key, epoch))
        return lambda: None

    def shards(self, states, replace, epoch):  # type: ignore[no-untyped-def]
        self.states.extend((state.ref.variable, epoch) for state in states)

    def hyperparameters(self, variables, values, epoch):  # type: ignore[no-untyped-def]
        pass

    def delete(self, variable, epoch):  # type: ignore[no-untyped-def]
        pass

    def close(self) -> None:
        pass


def replica_as(config: ReplicaConfig) -> tuple[Replica, dict[str, RecordingForwarder]]:
    opened: dict[str, RecordingForwarder] = {}
    replica = Replica(lambda address: opened.setdefault(address, RecordingForwarder(address)))
    if config.role is not ReplicaRole.STANDALONE:
        replica.configure(config)
    return replica, opened


def data_plane_step(engine: StepEngine, epoch: int = 0) -> tuple[bytes, memoryview]:
    """An empty data-plane step (no push, no reads), from a client or, at ``epoch``, a primary."""
    plan = memoryview(ps_pb2.StepPlan(replica_epoch=epoch).SerializeToString())
    return engine.run_frames(
        plan, torch.zeros(0, dtype=torch.uint8), lambda n: torch.empty(n, dtype=torch.uint8), StepPrograms()
    )


def state() -> ShardState:
    return ShardState(W, (2,), 0, torch.zeros(2), OptimizerSpec("SGD", {"lr": 1.0}))


# ---------------------------------------------------------------- the step engine and its admission


def test_a_step_engine_cannot_be_built_without_its_admission() -> None:
    with pytest.raises(TypeError, match="admission"):
        StepEngine(ShardStore())  # type: ignore[call-arg]


def test_a_step_engine_on_a_backup_refuses_client_steps_from_construction() -> None:
    replica, _ = replica_as(ReplicaConfig(2, ReplicaRole.BACKUP))
    engine = StepEngine(ShardStore(replication=replica), replica)
    with pytest.raises(NotPrimaryError, match="backup"):
        data_plane_step(engine)
    data_plane_step(engine, epoch=2)  # its primary's forwarded step is admitted
    with pytest.raises(ReplicaEpochError):
        data_plane_step(engine, epoch=1)  # a replaced primary's is not


def test_a_step_engine_on_a_standalone_server_serves_clients_and_refuses_forwarded_steps() -> None:
    replica, _ = replica_as(ReplicaConfig())
    engine = StepEngine(ShardStore(replication=replica), replica)
    data_plane_step(engine)
    with pytest.raises(ReplicaEpochError):
        data_plane_step(engine, epoch=1)


# ---------------------------------------------------------------- the store and its replication


def test_a_store_built_for_a_primary_forwards_its_writes_from_construction() -> None:
    replica, opened = replica_as(ReplicaConfig(1, ReplicaRole.PRIMARY, ("b:1",)))
    store = ShardStore(replication=replica)
    store.create_shards([state()])
    store.push([ShardPush(W, torch.ones(2))], "k1")
    assert opened["b:1"].states == [("w", 1)]
    assert opened["b:1"].pushes == [("k1", 1)]


def test_a_store_of_no_server_is_unreplicated_and_says_so_in_its_signature() -> None:
    import inspect

    assert inspect.signature(ShardStore).parameters["replication"].default is UNREPLICATED
    store = ShardStore()
    store.create_shards([state()])
    assert store.push([ShardPush(W, torch.ones(2))], "k1")[0].applied


# ---------------------------------------------------------------- the servicer and the data plane's listing


def servicer(listing: DataPlaneListing) -> ParameterServerServicer:
    replica, _ = replica_as(ReplicaConfig())
    store = ShardStore(replication=replica)
    return ParameterServerServicer(store, StepEngine(store, replica), 1 << 20, ServicerLimits(), replica, listing)


def test_a_servicer_cannot_be_built_without_the_data_plane_listing() -> None:
    replica, _ = replica_as(ReplicaConfig())
    store = ShardStore(replication=replica)
    with pytest.raises(TypeError, match="data_plane"):
        ParameterServerServicer(store, StepEngine(store, replica), 1 << 20, ServicerLimits(), replica)  # type: ignore[call-arg]


def test_get_data_plane_answers_what_the_listing_holds_none_until_it_is_published() -> None:
    listing = DataPlaneListing()
    serving = servicer(listing)
    request = ps_pb2.GetDataPlaneRequest().SerializeToString()
    assert ps_pb2.DataPlaneInfo.FromString(serving.GetDataPlane(request, None)).port == 0  # type: ignore[arg-type]
    listing.publish(ps_pb2.DataPlaneInfo(port=4321, max_frame_bytes=1 << 20))
    answered = ps_pb2.DataPlaneInfo.FromString(serving.GetDataPlane(request, None))  # type: ignore[arg-type]
    assert (answered.port, answered.max_frame_bytes) == (4321, 1 << 20)
