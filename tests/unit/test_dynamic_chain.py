"""Incremental checkpoints of dynamic tables, without processes: what a shard exports as a delta
(psserver/store/dynamic_table.py, its DeletionLog), and the pure decisions of psserver/checkpoint/dynamic_chain.py:
full or delta, which checkpoints make a restore chain, a delta applied to its base."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paramserve.psserver.checkpoint.dynamic_chain import (
    SavedLink,
    SavedTable,
    apply_delta,
    decide_save,
    next_link,
    restore_chain,
)
from paramserve.psserver.dynamic.dynamic_rows import DELETION_LOG_MIN_IDS, DeletionLog
from paramserve.psserver.dynamic.dynamic_types import DynamicSaveMark, DynamicShardState, DynamicTableConfig, rehash
from paramserve.psserver.protocol.errors import CheckpointBaseMissingError, CheckpointError, InvalidRequestError
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.types import ShardRef
from paramserve.psserver.store.dynamic_table import DynamicShard

ADAGRAD = OptimizerSpec("Adagrad", {"lr": 0.3})
REF = ShardRef("t", 0)


def shard(**settings: object) -> DynamicShard:
    config = DynamicTableConfig(**{"dim": 3, "optimizer": ADAGRAD, **settings})  # type: ignore[arg-type]
    return DynamicShard(REF, 1, config, idempotency_capacity=64)


def train(table: DynamicShard, ids: list[int], key: str, now: float = 0.0) -> None:
    batch = torch.tensor(ids)
    table.lookup(batch, now)
    table.push(batch, torch.ones(len(ids), 3) * (1 + len(key) % 3), key, -1, now)


def same(a: DynamicShardState, b: DynamicShardState) -> bool:
    return (
        torch.equal(a.ids, b.ids)
        and torch.equal(a.values, b.values)
        and torch.equal(a.updated, b.updated)
        and a.slots.keys() == b.slots.keys()
        and all(torch.equal(a.slots[k], b.slots[k]) for k in a.slots)
        and a.version == b.version
        and a.applied_keys == b.applied_keys
        and not a.delta
        and not b.delta
    )


# ---------------------------------------------------------------- what a shard exports


def test_rows_made_by_lookups_before_a_save_are_not_in_the_next_delta():
    table = shard()
    table.lookup(torch.arange(50), now=0.0)  # admitted, never pushed
    base = table.export(incremental=True)
    train(table, [7], "a")
    delta = table.export(since=base.mark)
    assert delta.ids.tolist() == [7] and same(apply_delta(base, delta), table.export())


def test_a_delta_holds_the_rows_changed_since_the_mark_and_the_ids_evicted_since():
    table = shard(ttl_steps=4)
    train(table, [1, 2, 3, 4], "a")
    base = table.export(incremental=True)
    assert not base.delta and base.ids.tolist() == [1, 2, 3, 4]
    for n in range(6):  # 1..4 are not updated for 6 steps: past their TTL, evicted
        train(table, [10, 11], f"b{n}")
    train(table, [2], "c")  # admitted again after its eviction: a new row, not a deletion
    delta = table.export(since=base.mark)
    assert delta.delta and delta.ids.tolist() == [2, 10, 11]
    assert delta.deleted.tolist() == [1, 3, 4]
    assert same(apply_delta(base, delta), table.export())


def test_every_sequence_of_saves_rebuilds_the_shard_bit_for_bit():
    """Random lookups, pushes, TTL and capacity evictions, with a save now and then (a delta of
    the last save, marked saved once 'committed'): base + deltas equals a whole export each time."""
    generator = torch.Generator().manual_seed(0)
    table = shard(ttl_steps=12, max_rows=80)
    saved = table.export(incremental=True)
    for step in range(120):
        hot = torch.randint(0, 20, (6,), generator=generator)
        many = int(torch.randint(0, 13 if step < 60 else 4, (1,), generator=generator))  # over the cap, then not
        cold = torch.randint(20, 2000, (many,), generator=generator)
        train(table, torch.cat([hot, cold]).tolist(), f"k{step}")
        if step % 7 == 6:
            delta = table.export(since=saved.mark)
            assert delta.delta
            saved = apply_delta(saved, delta)
            assert same(saved, table.export()), step
            table.mark_saved(saved.mark)
    assert table.stats().evictions_capacity > 0 and table.stats().evictions_ttl > 0


def test_a_failed_save_leaves_its_changes_to_the_next_delta():
    table = shard(max_rows=8)
    train(table, list(range(8)), "a")
    committed = table.export(incremental=True)
    table.mark_saved(committed.mark)
    train(table, [100, 101], "b")  # evicts two rows for room
    table.export(since=committed.mark)  # a save that fails: never marked saved
    train(table, [5], "c")
    delta = table.export(since=committed.mark)  # the next save builds on the last committed one
    assert {100, 101, 5} <= set(delta.ids.tolist()) and delta.deleted.numel() == 2
    assert same(apply_delta(committed, delta), table.export())


def test_a_shard_answers_a_delta_only_for_its_lineage_and_while_its_log_reaches_back():
    table = shard()
    train(table, [1, 2], "a")
    first = table.export(incremental=True)
    assert not table.export(since=dataclasses.replace(first.mark, lineage="another")).delta
    train(table, [3], "b")
    second = table.export(since=first.mark)
    assert second.delta and table.mark_saved(second.mark)
    assert not table.export(since=first.mark).delta, "the log was trimmed past the first mark"
    assert table.export(since=second.mark).delta
    replaced = DynamicShard.from_state(table.export(), 64, now=0.0)
    assert replaced.lineage != table.lineage and not replaced.export(since=second.mark).delta
    assert not replaced.mark_saved(second.mark)


def test_a_shard_never_saved_incrementally_keeps_no_deletions():
    table = shard(ttl_steps=1)
    train(table, [1, 2], "a")
    for n in range(4):
        train(table, [3], f"b{n}")
    mark = DynamicSaveMark(REF, table.lineage, 0)
    assert table.stats().evictions_ttl == 2 and not table.export(since=mark).delta


def test_the_deletion_log_is_bounded_and_then_asks_for_a_full_save():
    log = DeletionLog()
    log.record(1, torch.tensor([1]), live_rows=0)
    assert log.floor is None and log.nbytes == 0, "off until started"
    log.start(4)
    log.record(5, torch.tensor([7, 3]), live_rows=0)
    log.record(6, torch.tensor([3, 9]), live_rows=0)
    assert log.answers(4, 6) and not log.answers(3, 6) and not log.answers(7, 6)
    assert log.since(5).tolist() == [3, 9] and log.since(4).tolist() == [3, 7, 9]
    log.trim(5)
    assert log.since(0).tolist() == [3, 9] and log.floor == 5 and log.nbytes == 16
    log.record(7, torch.arange(DELETION_LOG_MIN_IDS), live_rows=10)
    assert log.nbytes == 0 and log.floor == 7 and not log.answers(6, 8) and log.answers(7, 8)


def test_a_delta_is_never_taken_for_a_whole_shard():
    table = shard()
    train(table, [1], "a")
    delta = table.export(since=table.export(incremental=True).mark)
    with pytest.raises(InvalidRequestError, match="apply it to its base"):
        DynamicShard.from_state(delta, 64, now=0.0)
    with pytest.raises(InvalidRequestError, match="whole shards"):
        rehash([delta], 2)


# ---------------------------------------------------------------- the pure decisions


def test_saves_are_full_every_n_and_whenever_there_is_nothing_to_build_on():
    link = SavedLink("ckpt-00000001", deltas=0, marks={REF: DynamicSaveMark(REF, "l", 3)})
    assert not decide_save(link, 1, True).delta
    assert not decide_save(None, 3, True).delta
    assert "gone" in decide_save(link, 3, False).reason
    delta = decide_save(link, 3, True)
    assert delta.delta and delta.since == link.marks
    assert decide_save(dataclasses.replace(link, deltas=1), 3, True).delta
    assert not decide_save(dataclasses.replace(link, deltas=2), 3, True).delta, "the third save after a full one"


def test_what_a_committed_save_leaves_to_build_on():
    state = shard().export()
    full = next_link(None, decide_save(None, 3, True), "ckpt-00000001", [state])
    assert full == SavedLink("ckpt-00000001", (), 0, {REF: state.mark})
    decision = decide_save(full, 3, True)
    delta = next_link(full, decision, "ckpt-00000002", [dataclasses.replace(state, delta=True)])
    assert delta.needs == ("ckpt-00000001",) and delta.deltas == 1
    again = next_link(delta, decide_save(delta, 3, True), "ckpt-00000003", [dataclasses.replace(state, delta=True)])
    assert again.needs == ("ckpt-00000001", "ckpt-00000002") and again.deltas == 2
    whole = next_link(full, decision, "ckpt-00000002", [state])
    assert whole.needs == () and whole.deltas == 0, "every shard came whole: a full save"


FULL = SavedTable(2, frozenset({0, 1}))


def delta_of(parent: str, shards=(0, 1), num_shards: int = 2) -> SavedTable:
    return SavedTable(num_shards, frozenset(range(num_shards)), frozenset(shards), parent)


def test_a_restore_chain_goes_back_to_the_last_whole_save():
    saved = {"c1": FULL, "c2": delta_of("c1"), "c3": delta_of("c2", shards=(1,)), "c4": FULL}
    assert restore_chain("t", "c3", saved) == ["c1", "c2", "c3"]
    assert restore_chain("t", "c1", saved) == ["c1"]
    assert restore_chain("t", "c4", saved) == ["c4"]


@pytest.mark.parametrize(
    ("saved", "error", "says"),
    [
        ({"c3": delta_of("c2"), "c2": delta_of("c1")}, CheckpointBaseMissingError, "c1, which is gone"),
        ({"c3": delta_of("c2")}, CheckpointBaseMissingError, "c2, which is gone"),
        ({"c3": delta_of("c2"), "c2": None}, CheckpointError, "does not hold dynamic table"),
        ({"c3": delta_of("c2", num_shards=3), "c2": FULL}, CheckpointError, "always of the same servers"),
        ({"c3": delta_of("c2"), "c2": delta_of("c3")}, CheckpointError, "name each other"),
        ({"c3": SavedTable(2, frozenset({0}))}, CheckpointError, "lacks shards"),
        ({"c3": SavedTable(2, frozenset({0, 1}), frozenset({0}))}, CheckpointError, "names no base"),
    ],
)
def test_a_chain_that_does_not_fit_is_refused_with_its_reason(saved, error, says):
    with pytest.raises(error, match=says):
        restore_chain("t", "c3", saved)


def test_a_delta_must_fit_its_base():
    table = shard()
    train(table, [1, 2], "a")
    base = table.export(incremental=True)
    delta = table.export(since=base.mark)
    with pytest.raises(CheckpointError, match="does not fit"):
        apply_delta(dataclasses.replace(base, ref=ShardRef("t", 1)), delta)
    assert apply_delta(delta, base) is base, "a whole state needs no base"
