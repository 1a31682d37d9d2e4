"""The pure parts of dynamic tables: hashing and partitioning, initial rows, the index, the row
arena, admission counting, eviction decisions, and one shard's core with time passed in."""

from __future__ import annotations

import random

import pytest
import torch

from paramserve.psserver.dynamic.dynamic_rows import (
    DELETION_LOG_MIN_IDS,
    MAX_ROWS,
    AdmissionFilter,
    IdIndex,
    RowArena,
    ascending,
    expired,
    initial_rows,
    least_recently_used,
    owner_of,
    splitmix64,
)
from paramserve.psserver.dynamic.dynamic_types import (
    ARENA_BLOCK_COLUMN_BYTES,
    DynamicTableConfig,
    block_bytes_within,
    rehash,
)
from paramserve.psserver.protocol.errors import DtypeMismatchError, InvalidRequestError, NonFiniteGradientError
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.types import ShardRef
from paramserve.psserver.store.dynamic_table import DynamicShard, PushSettings

MASK = (1 << 64) - 1


def reference_splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def test_splitmix64_matches_the_reference_on_every_kind_of_int64():
    values = [0, 1, -1, 2**63 - 1, -(2**63), 123456789, -987654321012]
    assert reference_splitmix64(0) == 0xE220A8397B1DCDAF  # the published first output for seed 0
    assert [h & MASK for h in splitmix64(torch.tensor(values)).tolist()] == [
        reference_splitmix64(v & MASK) for v in values
    ]


def test_owners_are_stable_balanced_and_in_range():
    ids = torch.arange(-50_000, 50_000) * 7
    owners = owner_of(ids, 3)
    assert torch.equal(owners, owner_of(ids.flip(0), 3).flip(0))
    counts = torch.bincount(owners, minlength=3)
    assert int(owners.min()) >= 0 and int(owners.max()) <= 2
    assert float(counts.min()) > 0.97 * ids.numel() / 3
    with pytest.raises(ValueError):
        owner_of(ids, 0)


def test_an_ids_initial_row_depends_on_id_and_seed_only():
    one = initial_rows(torch.tensor([5, 9]), 6, "normal", 0.0, 2.0, 1, torch.float32)
    alone = initial_rows(torch.tensor([9]), 6, "normal", 0.0, 2.0, 1, torch.float32)
    assert torch.equal(one[1], alone[0]) and not torch.equal(one[0], one[1])
    assert not torch.equal(alone, initial_rows(torch.tensor([9]), 6, "normal", 0.0, 2.0, 2, torch.float32))
    many = initial_rows(torch.arange(20_000), 8, "normal", 0.0, 2.0, 0, torch.float64)
    assert abs(float(many.mean())) < 0.05 and abs(float(many.std()) - 2.0) < 0.05
    uniform = initial_rows(torch.arange(1000), 4, "uniform", -0.5, 0.5, 0, torch.float32)
    assert float(uniform.min()) >= -0.5 and float(uniform.max()) < 0.5
    assert torch.equal(initial_rows(torch.arange(3), 2, "zeros", 0, 0, 0, torch.float32), torch.zeros(3, 2))


def test_the_index_agrees_with_a_dict_through_inserts_removals_and_rebuilds():
    rng = random.Random(0)
    index, model = IdIndex(capacity=16), {}
    next_slot = 0
    for _ in range(60):
        fresh = list({rng.randrange(-(2**62), 2**62) for _ in range(rng.randrange(1, 300))} - set(model))
        index.insert(torch.tensor(fresh, dtype=torch.int64), torch.arange(next_slot, next_slot + len(fresh)))
        model.update({key: next_slot + i for i, key in enumerate(fresh)})
        next_slot += len(fresh)
        gone = rng.sample(sorted(model), k=len(model) // 3)
        removed = index.remove(torch.tensor(gone + [7], dtype=torch.int64))  # 7: not held, skipped
        assert sorted(removed.tolist()) == sorted(model.pop(key) for key in gone)
    keys = torch.tensor(sorted(model), dtype=torch.int64)
    assert index.find(keys).tolist() == [model[k] for k in sorted(model)]
    assert index.live == len(model) and index.capacity <= 4 * max(16, len(model)) * 2
    held, slots = index.items()
    assert dict(zip(held.tolist(), slots.tolist())) == model


def test_an_index_at_its_most_buckets_is_rebuilt_in_place_and_never_grows():
    rng = random.Random(1)
    index, model = IdIndex(capacity=16, max_capacity=256), {}
    index.insert(torch.arange(100), torch.arange(100))  # grows to its most buckets at once
    index.remove(torch.arange(100))
    keys, slots = index._keys.data_ptr(), index._slots.data_ptr()
    for round_ in range(40):  # churn: deleted buckets pile up and force rebuilds at the same size
        fresh = list({rng.randrange(-(2**62), 2**62) for _ in range(100 - len(model))} - set(model))
        index.insert(torch.tensor(fresh, dtype=torch.int64), torch.arange(len(fresh)) + 1000 * round_)
        model.update({key: 1000 * round_ + i for i, key in enumerate(fresh)})
        gone = rng.sample(sorted(model), k=60)
        index.remove(torch.tensor(gone, dtype=torch.int64))
        for key in gone:
            del model[key]
    held, at = index.items()
    assert dict(zip(held.tolist(), at.tolist())) == model
    assert index.capacity == 256 and (index._keys.data_ptr(), index._slots.data_ptr()) == (keys, slots)
    with pytest.raises(MemoryError):
        index.insert(torch.arange(10**6, 10**6 + 200), torch.arange(200))


def test_one_cluster_longer_than_every_probe_window_is_walked_to_its_end():
    index = IdIndex(capacity=1024)
    candidates = torch.arange(1, 2_000_000)
    crowded = candidates[index._start(candidates) == 5][:600]  # 600 ids whose probes all start at bucket 5
    assert crowded.numel() == 600
    index.insert(crowded, torch.arange(600))  # every one claims bucket 5 first; one wins each round
    assert index.capacity == 1024 and index.find(crowded).tolist() == list(range(600))
    index.remove(crowded[::2])  # deleted buckets all along the cluster: probes walk past them
    assert index.find(crowded).tolist() == [-1 if i % 2 == 0 else i for i in range(600)]
    absent = candidates[index._start(candidates) == 5][600:610]
    assert index.find(absent).tolist() == [-1] * 10  # found absent only at the empty bucket past the cluster
    index.insert(crowded[::2], torch.arange(1000, 1300))
    assert index.find(crowded).tolist() == [1000 + i // 2 if i % 2 == 0 else i for i in range(600)]
    held, slots = index.items()
    assert dict(zip(held.tolist(), slots.tolist())) == dict(zip(crowded.tolist(), index.find(crowded).tolist()))


@pytest.mark.parametrize("bound", [2**31, 2**40])
def test_ascending_sorts_and_gives_each_values_position_whatever_its_width(bound: int):
    values = torch.randint(0, bound, (1000,))
    values[:10] = bound - 1  # the largest value the bound allows, and repeats of it
    ordered, order = ascending(values, bound)
    assert ordered.dtype == torch.int64 and torch.equal(ordered, torch.sort(values).values)
    assert torch.equal(values[order], ordered) and sorted(order.tolist()) == list(range(1000))


@pytest.mark.parametrize("order", ["ascending", "descending", "shuffled"])
def test_gather_and_scatter_across_blocks_agree_with_one_tensor_in_any_slot_order(order: str):
    free = torch.iinfo(torch.int64).max
    arena = RowArena({"value": ((2,), torch.float32), "used": ((), torch.int64)}, block_rows=8, fill={"used": free})
    slots = arena.allocate(50)
    reference = {"value": torch.zeros(50, 2), "used": torch.full((50,), free)}
    picked = torch.tensor([0, 3, 7, 8, 9, 23, 24, 31, 40, 41, 49])
    picked = {"ascending": picked, "descending": picked.flip(0), "shuffled": picked[torch.randperm(11)]}[order]
    values = {"value": torch.randn(11, 2), "used": torch.arange(11) * 3 - 7}
    for name, written in values.items():
        arena.scatter(name, slots[picked], written)
        reference[name][picked] = written
        assert torch.equal(arena.gather(name, slots[picked]), written)
        assert torch.equal(arena.column(name), reference[name])


@pytest.mark.parametrize("max_bytes", [1 << 20, 3 << 20, 128 << 20, 1 << 30])
def test_a_byte_cap_counts_everything_a_shard_holds(max_bytes: int):
    config = DynamicTableConfig(dim=16, max_bytes=max_bytes)
    rows, buckets = config.capacity(row_bytes=164, sketch_bytes=4096)
    assert rows is not None and buckets is not None and rows <= buckets * IdIndex.REBUILT_LOAD
    held = rows * (164 + 8 + 4 + 17) + 4096 + 8 * DELETION_LOG_MIN_IDS + IdIndex.BUCKET_BYTES * buckets
    assert held <= max_bytes
    assert all(  # no other power of two of buckets leaves room for more rows
        min((max_bytes - 4096 - 8 * DELETION_LOG_MIN_IDS - 12 * (1 << k)) // 193, (1 << k) // 2) <= rows
        for k in range(4, 31)
    )
    assert DynamicTableConfig(dim=16, max_bytes=max_bytes, max_rows=100).capacity(164, 0)[0] == 100
    assert DynamicTableConfig(dim=16, max_rows=100).capacity(164, 0) == (100, None)
    with pytest.raises(InvalidRequestError, match="leaves no room"):
        DynamicTableConfig(dim=16, max_bytes=1000).capacity(164, 0)


def test_the_arena_reuses_freed_slots_and_never_passes_its_cap():
    arena = RowArena({"value": ((3,), torch.float32), "ids": ((), torch.int64)}, block_rows=4, max_rows=10)
    slots = arena.allocate(9)
    arena.scatter("value", slots, torch.arange(27.0).reshape(9, 3))
    assert torch.equal(arena.gather("value", slots.flip(0)), torch.arange(27.0).reshape(9, 3).flip(0))
    arena.release(slots[:5])
    again = arena.allocate(6)
    assert arena.capacity == 10 and arena.live == 10
    assert set(again.tolist()) >= set(slots[:5].tolist())
    with pytest.raises(MemoryError):
        arena.allocate(1)


def test_an_arena_column_reads_its_fill_where_no_row_was_written_and_what_was_written_elsewhere():
    free = torch.iinfo(torch.int64).max
    arena = RowArena({"used": ((), torch.int64), "value": ((2,), torch.float32)}, block_rows=4, fill={"used": free})
    slots = arena.allocate(6)  # two blocks
    assert torch.equal(arena.column("used"), torch.full((6,), free))
    arena.scatter("used", slots[[1, 4]], torch.tensor([7, -3]))
    assert arena.gather("used", slots).tolist() == [free, 7, free, free, -3, free]
    assert arena.column("used", 1).tolist() == [-3, free]  # block 1: the slots handed out, 4 and 5
    arena.release(slots[[1]])
    assert arena.allocate(1).tolist() == [1] and arena.capacity == 6, "a freed slot goes out before a new one"
    with pytest.raises(ValueError, match="integer columns"):
        RowArena({"value": ((2,), torch.float32)}, block_rows=4, fill={"value": 1})


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_an_arena_block_costs_memory_for_the_rows_written_not_for_its_size():
    arena = RowArena({"value": ((16,), torch.float32)}, block_rows=1 << 22)  # a 256 MiB block
    before = _resident_bytes()
    slots = arena.allocate(1000)
    arena.scatter("value", slots, torch.ones(1000, 16))
    grown = _resident_bytes() - before
    assert grown < 32 << 20, f"a block of 256 MiB with 1,000 rows written took {grown >> 20} MiB"
    assert arena.nbytes == 1000 * 16 * 4
    assert torch.equal(arena.gather("value", slots[-3:]), torch.ones(3, 16))


def test_the_admission_filter_never_counts_low_and_forgets_evicted_ids():
    sketch = AdmissionFilter(width=64)
    ids = torch.arange(200)
    for _ in range(3):
        counts = sketch.add(ids)
    assert bool((counts >= 3).all()), "a count-min sketch only over-counts"
    sketch.forget(torch.tensor([5]))
    assert int(sketch.estimate(torch.tensor([5]))) == 0
    wide = AdmissionFilter(width=1 << 16)
    wide.add(torch.tensor([1, 2]))
    assert wide.add(torch.tensor([1])).tolist() == [2] and wide.estimate(torch.tensor([2])).tolist() == [1]


def test_counts_halve_after_ten_sightings_per_counter():
    sketch = AdmissionFilter(width=8, depth=1)
    for _ in range(79):
        sketch.add(torch.tensor([3]))
    assert int(sketch.estimate(torch.tensor([3]))) == 79
    assert int(sketch.add(torch.tensor([3]))) == 80, "the 80th sighting is counted, then every counter halves"
    assert int(sketch.estimate(torch.tensor([3]))) == 40


def test_expiry_by_steps_and_by_seconds():
    updated, at = torch.tensor([0, 5, 10]), torch.tensor([0.0, 50.0, 100.0], dtype=torch.float64)
    assert expired(updated, at, 10, 100.0, 4, None).tolist() == [True, True, False]
    assert expired(updated, at, 10, 100.0, None, 60.0).tolist() == [True, False, False]
    assert expired(updated, at, 10, 100.0, None, None).tolist() == [False, False, False]


def test_least_recently_used_spares_the_rows_the_current_request_uses():
    used = torch.tensor([5, 1, 9, 3, 9])
    assert sorted(least_recently_used(used, 2, protected_from=9).tolist()) == [1, 3]
    assert sorted(least_recently_used(used, 10, protected_from=9).tolist()) == [0, 1, 3]


# ---------------------------------------------------------------- one shard's core

ADAM = OptimizerSpec("Adam", {"lr": 0.1})


def shard(num_shards: int = 1, **settings: object) -> DynamicShard:
    config = DynamicTableConfig(**{"dim": 3, "optimizer": ADAM, **settings})  # type: ignore[arg-type]
    return DynamicShard(ShardRef("t", 0), num_shards, config, idempotency_capacity=16)


def test_admission_counts_lookups_and_drops_gradients_of_ids_without_rows():
    table = shard(admit_after=2)
    ids = torch.tensor([1, 2])
    first, _ = table.lookup(ids, now=0.0)
    assert torch.equal(first, torch.zeros(2, 3)) and table.stats().live_rows == 0
    table.push(ids, torch.ones(2, 3), "k", -1, now=0.0)
    assert table.stats().live_rows == 0, "no row is made by a push"
    second, _ = table.lookup(ids, now=0.0)
    assert torch.equal(second, initial_rows(ids, 3, "normal", 0.0, 1.0, 0, torch.float32))


def test_a_push_is_torch_adam_on_the_touched_rows_and_applies_once_per_key():
    table = shard()
    rows, _ = table.lookup(torch.tensor([4, 8]), now=0.0)
    grads = torch.tensor([[1.0, -2.0, 0.5], [0.0, 1.0, 1.0]])
    applied = table.push(torch.tensor([8, 4, 8]), torch.cat([grads[1:], grads[:1], grads[1:]]), "k", -1, now=1.0)
    duplicate = table.push(torch.tensor([8]), torch.ones(1, 3), "k", -1, now=1.0)
    reference = torch.nn.Parameter(rows.clone())
    optimizer = torch.optim.Adam([reference], lr=0.1)
    reference.grad = torch.stack([grads[0], 2 * grads[1]])
    optimizer.step()
    after, version = table.lookup(torch.tensor([4, 8]), now=1.0)
    assert torch.allclose(after, reference.detach(), atol=1e-7)
    assert applied.applied and not duplicate.applied and version == 1


def test_rows_expire_by_seconds_at_the_next_sweep_and_come_back_as_new():
    table = shard(ttl_seconds=10.0)
    ids = torch.tensor([1, 2, 3])
    table.lookup(ids, now=0.0)
    table.push(torch.tensor([1]), torch.ones(1, 3), "a", -1, now=8.0)
    table.lookup(torch.tensor([99]), now=12.0)  # a sweep is due (every 1 s): 2 and 3 are 12 s old
    held = table.export().ids.tolist()
    assert held == [1, 99] and table.stats().evictions_ttl == 2


def test_a_row_cap_evicts_the_least_recently_used_first():
    table = shard(max_rows=64)
    table.lookup(torch.arange(64), now=0.0)
    table.lookup(torch.arange(32), now=0.0)  # rows 32..63 are now the least recently used
    table.lookup(torch.tensor([1000]), now=0.0)
    held = set(table.export().ids.tolist())
    assert table.stats().live_rows <= 64 and 1000 in held and set(range(32)) <= held
    assert table.stats().evictions_capacity == 2, "a batch of max_rows / 32"


def test_bad_pushes_raise_before_anything_changes():
    table = shard(num_shards=2)
    mine = torch.arange(50)[owner_of(torch.arange(50), 2) == 0][:2]
    other = torch.arange(50)[owner_of(torch.arange(50), 2) == 1][:1]
    table.lookup(mine, now=0.0)
    before = table.export()
    settings = PushSettings()
    with pytest.raises(DtypeMismatchError):
        table.check_push(mine.to(torch.float32), torch.ones(2, 3), -1, "x", settings)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="belongs to shard 1"):
        table.check_push(other, torch.ones(1, 3), -1, "x", settings)
    with pytest.raises(NonFiniteGradientError):
        table.check_push(mine, torch.full((2, 3), float("nan")), -1, "x", settings)
    after = table.export()
    assert torch.equal(before.values, after.values) and before.version == after.version


def test_rehash_moves_every_row_to_its_new_owner_and_keeps_its_age():
    table = shard(ttl_steps=1000)
    table.lookup(torch.arange(40), now=0.0)
    for step in range(3):
        table.push(torch.arange(step, 40, 7), torch.ones(len(range(step, 40, 7)), 3), f"k{step}", -1, now=0.0)
    saved = table.export()
    three = rehash([saved], 3)
    assert [s.ref.shard for s in three] == [0, 1, 2]
    for state in three:
        assert bool((owner_of(state.ids, 3) == state.ref.shard).all())
    ids = torch.cat([s.ids for s in three])
    order = torch.argsort(ids)
    assert torch.equal(ids[order], saved.ids)
    assert torch.equal(torch.cat([s.values for s in three])[order], saved.values)
    assert torch.equal(torch.cat([s.updated for s in three])[order], saved.updated)
    back = rehash(three, 1)[0]
    assert torch.equal(back.ids, saved.ids) and torch.equal(back.slots["exp_avg"], saved.slots["exp_avg"])
    restored = DynamicShard.from_state(back, 16, now=0.0)
    assert torch.equal(restored.export().values, saved.values) and restored.version == saved.version


def test_a_changed_learning_rate_steps_the_next_push_and_bad_values_change_nothing():
    table = shard(optimizer=OptimizerSpec("SGD", {"lr": 0.1}))
    before, _ = table.lookup(torch.tensor([5]), now=0.0)
    for bad, match in [
        ({"lr": -1.0}, "Invalid learning rate"),
        ({"nope": 1.0}, "has no hyperparameter 'nope'"),
        ({"momentum": 0.9}, "changes its state"),  # a momentum slot: the arena has no column for it
        ({}, "no hyperparameters given"),
    ]:
        with pytest.raises(InvalidRequestError, match=match) as raised:
            table.with_hyperparameters(bad)
        assert raised.value.variable == "t"
    assert table.config.optimizer == OptimizerSpec("SGD", {"lr": 0.1})
    table.reconfigure(table.with_hyperparameters({"lr": 0.5}))
    grad = torch.tensor([[1.0, -2.0, 0.25]])
    table.push(torch.tensor([5]), grad, "k", -1, now=0.0)
    after, _ = table.lookup(torch.tensor([5]), now=0.0)
    assert torch.equal(after, before - 0.5 * grad)
    assert table.export().config.optimizer == OptimizerSpec("SGD", {"lr": 0.5})


def test_evictions_for_room_and_by_age_never_pick_a_free_slot():
    table = shard(max_rows=64, ttl_steps=3, block_rows=16)
    for step in range(30):  # new ids every step: room is made again and again, old rows expire
        ids = torch.arange(10 * step, 10 * step + 10 + step % 7)
        table.lookup(ids, now=0.0)
        table.push(ids, torch.ones(ids.numel(), 3), f"k{step}", -1, now=0.0)
        held = table.export().ids
        assert held.numel() == table.stats().live_rows <= 64
        assert set(ids.tolist()) <= set(held.tolist()), "rows this step uses stay"
    assert table.stats().evictions_ttl > 0
    empty = shard(max_rows=4)
    empty.lookup(torch.arange(10), now=0.0)  # more ids than the cap on an empty shard
    assert empty.stats().live_rows == 4


def test_a_servers_default_block_fits_its_allocation_limit():
    assert block_bytes_within(1 << 40) == ARENA_BLOCK_COLUMN_BYTES
    small = 16 << 20  # a server started with --max-shard-bytes 16 MiB
    config = DynamicTableConfig(dim=16)
    assert config.largest_allocation() > small, "the default block alone would be refused there"
    assert config.largest_allocation(block_bytes_within(small)) <= small
    table = DynamicShard(ShardRef("t", 0), 1, config, idempotency_capacity=16, block_bytes=block_bytes_within(small))
    assert table._arena.block_rows * 16 * 4 <= small


def test_the_largest_allocation_is_known_before_any_is_made():
    assert DynamicTableConfig(dim=16).largest_allocation() == 64 << 20  # the default block's widest column
    assert DynamicTableConfig(dim=16, block_rows=10).largest_allocation() == 16 * 8 * 10
    assert DynamicTableConfig(dim=16, max_rows=5).largest_allocation() == 16 * 8 * 5
    assert DynamicTableConfig(dim=1, admit_after=2, max_rows=1 << 30).largest_allocation() == 8 * 4 * (1 << 30)
    assert DynamicTableConfig(dim=1, admit_after=2, admission_width=7, block_rows=3).largest_allocation() == 8 * 7


def test_every_allocation_that_grows_with_the_rows_is_counted_at_the_cap():
    """Issue 43: the arena's list of freed slots (8 bytes a row, made with the shard) and the id
    index (8-byte keys, up to twice the rows rounded up to a power of two) were not counted."""
    assert DynamicTableConfig(dim=4, max_rows=1 << 25).largest_allocation() == 8 * (1 << 26)
    assert DynamicTableConfig(dim=1, max_rows=3000).largest_allocation() == 8 * 8192  # the index, not a block
    capped = DynamicTableConfig(dim=4, max_bytes=1 << 30)  # no max_rows: max_bytes bounds the rows
    assert capped.row_cap() == (1 << 30) // 29 and capped.largest_allocation() == 8 * IdIndex.buckets_for(
        capped.row_cap()
    )
    assert DynamicTableConfig(dim=4).row_cap() is None
    table = shard(dim=1, max_rows=3000)
    table.lookup(torch.arange(3000), now=0.0)  # full: the index at its largest
    assert table.stats().live_rows == 3000
    assert table._index.capacity * IdIndex.KEY_BYTES <= table.config.largest_allocation()


def test_a_max_rows_no_shard_can_index_is_invalid():
    DynamicTableConfig(dim=1, max_rows=MAX_ROWS).validate()
    for rows in (MAX_ROWS + 1, 1 << 40, 1 << 62):
        with pytest.raises(InvalidRequestError, match="max_rows"):
            DynamicTableConfig(dim=1, max_rows=rows).validate()


def test_a_restored_shard_has_the_servers_blocks():
    small = 1 << 20  # a server started with --max-shard-bytes 1 MiB
    table = shard(dim=16)
    table.lookup(torch.arange(10), now=0.0)
    restored = DynamicShard.from_state(table.export(), 16, now=0.0, block_bytes=small)
    assert restored._arena.block_rows * 16 * 4 <= small
