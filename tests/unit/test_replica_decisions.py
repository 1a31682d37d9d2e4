"""Replicated parameter servers' pure decisions: a server's configuration and what it admits
(psserver/replication/replica.py), and the coordinator's groups, failovers and rejoins
(coordinator/recovery/replica_groups.py); plus the Replica's forwarding against a fake backup."""

from __future__ import annotations

import pytest
import torch

from paramserve.coordinator.recovery.replica_groups import (
    GroupState,
    group_servers,
    initial_group,
    plan_group,
    rejoin_candidates,
    replica_count,
)
from paramserve.psserver.protocol.errors import (
    InvalidRequestError,
    NotPrimaryError,
    ReplicaEpochError,
    ServerUnavailableError,
)
from paramserve.psserver.protocol.replica_config import ReplicaConfig, ReplicaRole
from paramserve.psserver.protocol.types import ShardRef
from paramserve.psserver.replication.replica import Replica, client_refusal, configure_problem, forward_refusal
from paramserve.psserver.replication.replica_calls import MemberState
from paramserve.psserver.store.shard_store import ShardPush

PRIMARY, BACKUP, STANDALONE = ReplicaRole.PRIMARY, ReplicaRole.BACKUP, ReplicaRole.STANDALONE

# ---------------------------------------------------------------- a server's configuration


def test_epochs_only_go_up_and_one_epoch_names_one_decision() -> None:
    current = ReplicaConfig(3, PRIMARY, ("b:1",))
    assert configure_problem(current, ReplicaConfig(4, BACKUP)) is None
    assert configure_problem(current, current) is None  # a retried call
    assert "older" in (configure_problem(current, ReplicaConfig(2, PRIMARY, ("b:1",))) or "")
    assert "new epoch" in (configure_problem(current, ReplicaConfig(3, BACKUP)) or "")
    assert configure_problem(ReplicaConfig(), ReplicaConfig(1, BACKUP)) is None  # a fresh server


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        (ReplicaConfig(2, BACKUP, ("c:1",)), "forwards to nobody"),
        (ReplicaConfig(2, STANDALONE), "no epoch"),
        (ReplicaConfig(0, PRIMARY), "starts at 1"),
        (ReplicaConfig(2, PRIMARY, ("b:1", "b:1")), "repeat"),
    ],
)
def test_malformed_configurations_are_refused_with_the_reason(config: ReplicaConfig, fragment: str) -> None:
    assert fragment in (configure_problem(ReplicaConfig(1, BACKUP), config) or "")


def test_a_primary_s_backups_change_within_its_epoch_and_roles_do_not() -> None:
    current = ReplicaConfig(3, PRIMARY, ("b:1",))
    joining = ReplicaConfig(3, PRIMARY, ("b:1", "c:1"), ("c:1",))
    assert configure_problem(current, joining) is None  # a backup joins: nobody's role changes
    assert configure_problem(joining, ReplicaConfig(3, PRIMARY)) is None  # the coordinator drops both
    assert "new epoch" in (configure_problem(ReplicaConfig(3, BACKUP), ReplicaConfig(3, PRIMARY)) or "")
    assert "not among the backups" in (configure_problem(current, ReplicaConfig(4, PRIMARY, (), ("c:1",))) or "")


def test_only_a_primary_or_a_standalone_server_serves_clients() -> None:
    assert client_refusal(ReplicaConfig(), "") is None
    assert client_refusal(ReplicaConfig(1, PRIMARY, ("b:1",)), "") is None
    assert "backup" in (client_refusal(ReplicaConfig(1, BACKUP), "") or "")
    assert client_refusal(ReplicaConfig(1, PRIMARY), "deposed") == "deposed"


def test_a_backup_takes_forwarded_writes_of_its_own_epoch_only() -> None:
    assert forward_refusal(ReplicaConfig(2, BACKUP), 2) is None
    assert "epoch 2" in (forward_refusal(ReplicaConfig(2, BACKUP), 1) or "")
    assert "replaced" in (forward_refusal(ReplicaConfig(3, PRIMARY), 2) or "")  # a promoted backup fences
    assert forward_refusal(ReplicaConfig(), 1) is not None


# ---------------------------------------------------------------- Replica, with a fake backup


class FakeForwarder:
    def __init__(self, address: str, fail: Exception | None = None):
        self.address = address
        self.fail = fail
        self.pushes: list[tuple[str, int]] = []
        self.closed = False

    def push(self, pushes, key, epoch):  # type: ignore[no-untyped-def]
        if self.fail is not None:
            raise self.fail
        self.pushes.append((key, epoch))
        return lambda: None

    def shards(self, states, replace, epoch):  # type: ignore[no-untyped-def]
        if self.fail is not None:
            raise self.fail

    def hyperparameters(self, variables, values, epoch):  # type: ignore[no-untyped-def]
        pass

    def delete(self, variable, epoch):  # type: ignore[no-untyped-def]
        pass

    def close(self) -> None:
        self.closed = True


PUSH = [ShardPush(ShardRef("w", 0), torch.zeros(2))]


def test_a_primary_forwards_each_push_at_its_epoch_and_a_backup_forwards_nothing() -> None:
    opened: dict[str, FakeForwarder] = {}
    replica = Replica(lambda address: opened.setdefault(address, FakeForwarder(address)))
    replica.configure(ReplicaConfig(1, PRIMARY, ("b:1",)))
    replica.pushed(PUSH, "k1")()
    assert opened["b:1"].pushes == [("k1", 1)]
    replica.configure(ReplicaConfig(2, BACKUP))
    replica.pushed(PUSH, "k2")()
    assert opened["b:1"].pushes == [("k1", 1)] and opened["b:1"].closed, "a backup forwards nothing"
    with pytest.raises(NotPrimaryError, match="backup"):
        replica.admit_client()


def test_a_primary_whose_forward_is_refused_for_its_epoch_is_deposed() -> None:
    backup = FakeForwarder("b:1", ReplicaEpochError("this backup is the primary of epoch 2"))
    replica = Replica(lambda address: backup)
    replica.configure(ReplicaConfig(1, PRIMARY, ("b:1",)))
    with pytest.raises(NotPrimaryError, match="replaced as primary"):
        replica.pushed(PUSH, "k1")
    with pytest.raises(NotPrimaryError, match="deposed"):
        replica.admit_client()
    replica.configure(ReplicaConfig(3, BACKUP))  # the coordinator's next decision clears it
    replica.admit_forwarded(3)


def test_a_primary_whose_backup_does_not_answer_holds_until_the_next_epoch() -> None:
    backup = FakeForwarder("b:1", ServerUnavailableError("unreachable"))
    replica = Replica(lambda address: backup)
    replica.configure(ReplicaConfig(1, PRIMARY, ("b:1",)))
    with pytest.raises(NotPrimaryError, match="did not apply"):
        replica.pushed(PUSH, "k1")
    config, refusing = replica.state()
    assert "waiting for the coordinator" in refusing and config.epoch == 1
    replica.configure(ReplicaConfig(2, PRIMARY))  # alone
    replica.admit_client()
    assert replica.pushed(PUSH, "k2")() is None


class FakeShard:
    def __init__(self, ref: ShardRef):
        import threading

        self.ref, self.lock = ref, threading.Lock()

    def state(self):  # type: ignore[no-untyped-def]
        from paramserve.psserver.protocol.types import ShardState

        return ShardState(self.ref, (2,), 0, torch.zeros(2))


def test_a_joining_backup_gets_the_writes_of_the_shards_copied_into_it_only() -> None:
    opened: dict[str, FakeForwarder] = {}
    replica = Replica(lambda address: opened.setdefault(address, FakeForwarder(address)))
    replica.configure(ReplicaConfig(1, PRIMARY, ("b:1", "j:1"), ("j:1",)))
    w0, w1 = ShardPush(ShardRef("w", 0), torch.zeros(2)), ShardPush(ShardRef("w", 1), torch.zeros(2))
    replica.pushed([w0, w1], "k1")()
    assert opened["b:1"].pushes == [("k1", 1)] and opened["j:1"].pushes == [], "nothing copied yet"
    shards = [FakeShard(ShardRef("w", 0)), FakeShard(ShardRef("w", 1)), FakeShard(ShardRef("gone", 0))]
    replaced = FakeShard(ShardRef("w", 1))  # restored meanwhile: its replace reached the backup whole
    held = {shards[0].ref: shards[0], shards[1].ref: replaced}
    count, size = replica.copy_to("j:1", shards, current=held.get)
    assert (count, size) == (1, 8), "neither the deleted shard nor the replaced one is copied"
    assert replica.state()[0] == ReplicaConfig(1, PRIMARY, ("b:1", "j:1")), "in sync: no longer joining"
    replica.pushed([w0, w1], "k2")()
    assert opened["j:1"].pushes == [("k2", 1)]


def test_a_joining_backup_that_fails_is_dropped_without_stopping_the_primary() -> None:
    failing = FakeForwarder("j:1", ServerUnavailableError("unreachable"))
    opened = {"b:1": FakeForwarder("b:1"), "j:1": failing}
    replica = Replica(lambda address: opened[address])
    replica.configure(ReplicaConfig(1, PRIMARY, ("b:1", "j:1"), ("j:1",)))
    with pytest.raises(ServerUnavailableError):
        shard = FakeShard(ShardRef("w", 0))
        replica.copy_to("j:1", [shard], current=lambda ref: shard)
    config, refusing = replica.state()
    assert config == ReplicaConfig(1, PRIMARY, ("b:1",)) and refusing == ""
    replica.admit_client()
    with pytest.raises(InvalidRequestError, match="not a joining backup"):
        replica.copy_to("b:1", [], current=lambda ref: None)


def test_a_late_older_decision_changes_nothing() -> None:
    replica = Replica(FakeForwarder)
    replica.configure(ReplicaConfig(5, BACKUP))
    with pytest.raises(ReplicaEpochError, match="older"):
        replica.configure(ReplicaConfig(4, PRIMARY))
    assert replica.state()[0] == ReplicaConfig(5, BACKUP)


# ---------------------------------------------------------------- the coordinator's groups


def test_replica_count_comes_from_the_argument_then_the_environment() -> None:
    assert replica_count(None, {}) == 1
    assert replica_count(None, {"PARAMSERVE_PS_REPLICAS": "2"}) == 2
    assert replica_count(3, {"PARAMSERVE_PS_REPLICAS": "2"}) == 3
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="whole number"):
            replica_count(bad, {})
    with pytest.raises(ValueError, match="PARAMSERVE_PS_REPLICAS"):
        replica_count(None, {"PARAMSERVE_PS_REPLICAS": "two"})


def test_groups_put_the_first_servers_first_and_need_a_multiple() -> None:
    assert group_servers(["a", "b", "c", "d"], 2) == (("a", "c"), ("b", "d"))
    assert group_servers(["a", "b"], 1) == (("a",), ("b",))
    with pytest.raises(ValueError, match="multiple of 2"):
        group_servers(["a", "b", "c"], 2)


FRESH = ReplicaConfig()


def answered(incarnation: str, config: ReplicaConfig = FRESH, refusing: str = "") -> MemberState:
    return MemberState(True, incarnation, config, refusing)


GONE = MemberState(False)
BUSY = MemberState(False, busy=True)
GROUP = GroupState(("p", "b"), "p", ("b",), 4, {"p": "ip", "b": "ib"})


def test_a_group_whose_replicas_all_answer_stays() -> None:
    plan = plan_group(GROUP, {"p": answered("ip"), "b": answered("ib")})
    assert not plan.changed and plan.state == GROUP


def test_a_lost_primary_is_replaced_by_its_backup_at_a_new_epoch() -> None:
    for lost in (GONE, answered("new-incarnation")):  # unreachable, or restarted empty
        plan = plan_group(GROUP, {"p": lost, "b": answered("ib")})
        assert plan.changed and plan.state is not None
        assert (plan.state.primary, plan.state.in_sync, plan.state.epoch) == ("b", (), 5)
        assert plan.state.configs() == {"b": ReplicaConfig(5, PRIMARY, ())}


def test_a_busy_primary_is_not_replaced() -> None:
    assert not plan_group(GROUP, {"p": BUSY, "b": answered("ib")}).changed


def test_a_lost_backup_leaves_the_primary_alone_at_a_new_epoch() -> None:
    plan = plan_group(GROUP, {"p": answered("ip"), "b": GONE})
    assert plan.changed and plan.state is not None
    assert (plan.state.primary, plan.state.in_sync, plan.state.epoch) == ("p", (), 5)


def test_a_primary_that_stopped_after_a_failed_forward_keeps_no_backup_in_sync() -> None:
    """It may hold a write its backup lacks: the backup is copied into again before it counts."""
    stopped = answered("ip", ReplicaConfig(4, PRIMARY, ("b",)), refusing="forwarding a push to backup b failed")
    plan = plan_group(GROUP, {"p": stopped, "b": answered("ib")})
    assert plan.state is not None and plan.state.in_sync == () and plan.state.primary == "p"
    assert rejoin_candidates(plan.state, {"p": stopped, "b": answered("ib")}) == ["b"]


def test_no_member_holding_the_state_means_a_checkpoint() -> None:
    plan = plan_group(GROUP, {"p": GONE, "b": answered("restarted")})
    assert plan.changed and plan.state is None and "no backup" in plan.reason


def test_a_promoted_backup_of_three_rejoins_the_others() -> None:
    """The dead primary may have forwarded its last write to one backup only."""
    group = GroupState(("p", "b", "c"), "p", ("b", "c"), 1, {"p": "ip", "b": "ib", "c": "ic"})
    probes = {"p": GONE, "b": answered("ib"), "c": answered("ic")}
    plan = plan_group(group, probes)
    assert plan.state is not None and (plan.state.primary, plan.state.in_sync) == ("b", ())
    assert rejoin_candidates(plan.state, probes) == ["c"]


def test_members_out_of_sync_that_answer_rejoin() -> None:
    alone = GroupState(("p", "b"), "p", (), 5, {"p": "ip"})
    assert rejoin_candidates(alone, {"p": answered("ip"), "b": answered("fresh")}) == ["b"]
    assert rejoin_candidates(alone, {"p": answered("ip"), "b": GONE}) == []


def test_a_fresh_group_starts_with_its_first_member_primary() -> None:
    probes = {"a": answered("ia"), "c": answered("ic")}
    state = initial_group(("a", "c"), probes)
    assert (state.primary, state.in_sync, state.epoch) == ("a", ("c",), 1)


def test_a_backup_still_joining_when_the_coordinator_restarted_rejoins_afresh() -> None:
    probes = {
        "a": answered("ia", ReplicaConfig(4, PRIMARY, ("c",), ("c",))),
        "c": answered("ic", ReplicaConfig(4, BACKUP)),
    }
    assert initial_group(("a", "c"), probes).in_sync == ()


def test_a_restarted_coordinator_keeps_the_serving_primary_and_its_backups() -> None:
    probes = {
        "a": answered("ia", ReplicaConfig(7, PRIMARY, ("c",)), refusing="deposed"),  # an old primary
        "c": answered("ic", ReplicaConfig(9, PRIMARY, ("a",))),
    }
    state = initial_group(("a", "c"), probes)
    assert (state.primary, state.epoch) == ("c", 10)
    assert state.in_sync == (), "a is not a backup of epoch 9: it rejoins by a copy"
    probes["a"] = answered("ia", ReplicaConfig(9, BACKUP))
    assert initial_group(("a", "c"), probes).in_sync == ("a",)
