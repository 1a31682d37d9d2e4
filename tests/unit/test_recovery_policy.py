"""The recovery policy's pure decisions (coordinator/recovery/recovery_policy.py): which probes make a
parameter server suspect, what it lost, and where that is restored from."""

from __future__ import annotations

import pathlib

import pytest
import torch

from paramserve.coordinator.checkpointing.checkpoint_log import CheckpointLog
from paramserve.coordinator.recovery.recovery_policy import (
    CheckpointFacts,
    Probe,
    ProbeResult,
    RecoveryPoint,
    RecoveryPolicy,
    ServerWatch,
    Unrecoverable,
    judge_probe,
    lost_tables,
    lost_variables,
    plan_restore,
)
from paramserve.psserver.protocol.types import ShardPlacement, VariableLayout

POLICY = RecoveryPolicy(misses_to_suspect=2)
ANSWER = Probe(ProbeResult.ANSWERED, "incarnation-a")
BUSY = Probe(ProbeResult.BUSY)
UNREACHABLE = Probe(ProbeResult.UNREACHABLE)


def _watch(probes, policy=POLICY, watch=None):
    """Feeds probes one second apart; returns the last watch and every verdict."""
    watch = watch or ServerWatch()
    verdicts = []
    for now, probe in enumerate(probes):
        watch, verdict = judge_probe(watch, probe, float(now), policy)
        verdicts.append(verdict)
    return watch, verdicts


def test_a_server_that_answers_is_not_suspect_and_its_incarnation_is_remembered():
    watch, verdicts = _watch([ANSWER, ANSWER])
    assert [v.suspect for v in verdicts] == [False, False]
    assert watch.incarnation == "incarnation-a"


def test_a_new_incarnation_is_a_restart_at_the_first_probe():
    _, verdicts = _watch([ANSWER, Probe(ProbeResult.ANSWERED, "incarnation-b")])
    assert verdicts[-1].suspect and "restarted" in verdicts[-1].reason


def test_a_first_answer_lacking_what_was_placed_on_the_server_is_a_restart_before_it_was_watched():
    """A server restarted between the variables' creation and the monitor's first answer: its
    empty incarnation is adopted, but suspected for what it lacks; a first answer holding
    everything, or a later answer (judged by incarnation), is not."""
    empty = Probe(ProbeResult.ANSWERED, "incarnation-b", missing=3)
    watch, verdicts = _watch([empty, Probe(ProbeResult.ANSWERED, "incarnation-b")])
    assert [v.suspect for v in verdicts] == [True, False]
    assert "lacks 3 variables" in verdicts[0].reason and watch.incarnation == "incarnation-b"
    _, verdicts = _watch([ANSWER, Probe(ProbeResult.ANSWERED, "incarnation-a", missing=3)])
    assert [v.suspect for v in verdicts] == [False, False]


def test_unreachable_becomes_suspect_only_after_enough_misses_in_a_row():
    _, verdicts = _watch([ANSWER, UNREACHABLE, ANSWER, UNREACHABLE, UNREACHABLE])
    assert [v.suspect for v in verdicts] == [False, False, False, False, True]
    assert "2 times in a row" in verdicts[-1].reason


def test_a_busy_server_is_never_suspect_however_long_it_is_busy():
    watch, verdicts = _watch([ANSWER] + [BUSY] * 50)
    assert not any(v.suspect for v in verdicts)
    assert watch.busy_since == 1.0 and "busy" in verdicts[-1].reason and "49.0s" in verdicts[-1].reason


def test_busy_probes_do_not_count_towards_misses_and_reset_them():
    _, verdicts = _watch([ANSWER, UNREACHABLE, BUSY, UNREACHABLE, BUSY, UNREACHABLE])
    assert not any(v.suspect for v in verdicts)


def test_an_answer_after_being_busy_ends_the_busy_spell():
    watch, _ = _watch([ANSWER, BUSY, BUSY, ANSWER])
    assert watch.busy_since is None and watch.misses == 0


def test_a_server_busy_then_restarted_is_suspect():
    _, verdicts = _watch([ANSWER, BUSY, Probe(ProbeResult.ANSWERED, "incarnation-b")])
    assert verdicts[-1].suspect


def test_the_policy_refuses_nonsense():
    with pytest.raises(ValueError, match="misses_to_suspect"):
        RecoveryPolicy(misses_to_suspect=0)
    with pytest.raises(ValueError, match="positive"):
        RecoveryPolicy(probe_timeout=0)
    assert RecoveryPolicy(recovery_point="all").recovery_point is RecoveryPoint.ALL


def _layout(name, servers):
    shards = tuple(ShardPlacement(i, server, 2 * i, 2) for i, server in enumerate(servers))
    return VariableLayout(name, (2 * len(servers), 3), torch.float32, shards)


LAYOUTS = {"a": _layout("a", [0, 1]), "b": _layout("b", [1]), "c": _layout("c", [0])}


def test_lost_variables_are_those_with_a_shard_placed_on_the_server_that_it_lacks():
    held_by_1 = {LAYOUTS["a"].ref(LAYOUTS["a"].shards[1])}  # restarted holding a's shard only
    assert set(lost_variables(1, held_by_1, LAYOUTS)) == {"b"}
    assert set(lost_variables(1, set(), LAYOUTS)) == {"a", "b"}
    assert (
        lost_variables(0, {LAYOUTS["a"].ref(LAYOUTS["a"].shards[0]), LAYOUTS["c"].ref(LAYOUTS["c"].shards[0])}, LAYOUTS)
        == {}
    )


def test_lost_dynamic_tables_are_the_created_ones_the_server_does_not_list():
    assert lost_tables(held=["users"], created=["users", "items"]) == ["items"]
    assert lost_tables(held=[], created=["users", "items"]) == ["items", "users"]
    assert lost_tables(held=["users", "old"], created=["users"]) == []


def test_a_lost_dynamic_table_comes_from_the_newest_whole_checkpoint_holding_it():
    candidates = [_facts("ckpt-3", whole=False, variables=("a", "users")), _facts("ckpt-2", variables=("a", "users"))]
    plan = plan_restore(
        ["run/a", "run/users"], {"run/a": "a", "run/users": "users"}, candidates, RecoveryPoint.LOST_SHARDS
    )
    assert plan.checkpoint == pathlib.Path("ckpt-2") and plan.point is RecoveryPoint.LOST_SHARDS
    with pytest.raises(Unrecoverable, match="does not hold"):
        plan_restore(["users"], {"users": "users"}, [_facts("ckpt-1")], RecoveryPoint.LOST_SHARDS)


def _facts(name, whole=True, variables=("a", "b")):
    return CheckpointFacts(pathlib.Path(name), whole, frozenset(variables))


def test_nothing_lost_is_nothing_to_restore():
    plan = plan_restore({}, {}, [], RecoveryPoint.LOST_SHARDS)
    assert plan.point is None and plan.checkpoint is None


def test_the_best_whole_checkpoint_holding_every_lost_variable_is_chosen():
    lost = {"a": LAYOUTS["a"], "b": LAYOUTS["b"]}
    candidates = [_facts("ckpt-3", whole=False), _facts("ckpt-2", variables=("a",)), _facts("ckpt-1")]
    plan = plan_restore(lost, {"a": "a", "b": "b"}, candidates, RecoveryPoint.ALL)
    assert plan.checkpoint == pathlib.Path("ckpt-1") and plan.point is RecoveryPoint.ALL


def test_checkpoint_keys_not_variable_names_are_looked_up():
    plan = plan_restore({"run/a": LAYOUTS["a"]}, {"run/a": "a"}, [_facts("ckpt-1")], RecoveryPoint.LOST_SHARDS)
    assert plan.checkpoint == pathlib.Path("ckpt-1")


def test_variables_no_checkpoint_holds_need_no_checkpoint():
    plan = plan_restore({"metric.mean.total": LAYOUTS["c"]}, {"metric.mean.total": None}, [], RecoveryPoint.ALL)
    assert plan.point is RecoveryPoint.LOST_SHARDS and plan.checkpoint is None and "initial values" in plan.reason


@pytest.mark.parametrize(
    ("candidates", "says"),
    [
        ([], "saved no checkpoint"),
        ([_facts("ckpt-2", whole=False)], "is whole"),
        ([_facts("ckpt-2", variables=("a",))], "does not hold (e.g. 'b'"),
    ],
)
def test_an_unrecoverable_loss_says_why_and_what_to_do(candidates, says):
    with pytest.raises(Unrecoverable, match=says.replace("(", r"\(")):
        plan_restore(
            {"a": LAYOUTS["a"], "b": LAYOUTS["b"]}, {"a": "a", "b": "b"}, candidates, RecoveryPoint.LOST_SHARDS
        )


def test_the_checkpoint_log_offers_the_latest_then_the_older_ones_of_its_directories(tmp_path):
    log = CheckpointLog()
    assert log.latest is None and log.candidates(lambda d: []) == []
    log.record(400, tmp_path / "run" / "ckpt-00000004", 10.0)
    listed = {tmp_path / "run": [tmp_path / "run" / f"ckpt-0000000{i}" for i in (1, 2, 3, 4)]}
    assert log.candidates(lambda d: listed.get(d, [])) == [tmp_path / "run" / f"ckpt-0000000{i}" for i in (4, 3, 2, 1)]
    assert log.latest is not None and log.latest.step == 400
    log.forget(tmp_path / "run")
    assert log.latest is None and log.candidates(lambda d: listed.get(d, [])) == []
