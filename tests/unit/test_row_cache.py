"""The workers' row cache (worker.row_cache) as pure logic: which rows it serves, for how long,
what it keeps, and the lookups that go round it (a pull function stands for the servers)."""

from __future__ import annotations

import pytest
import torch

from paramserve.psserver.protocol.types import ShardPlacement, ShardRef, UniqueRows, VariableLayout
from paramserve.worker.row_cache import RowCache, cached_lookup, slot_count


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_a_row_is_served_for_max_staleness_steps_after_its_read_and_not_after():
    cache = RowCache(slots_per_table=64)
    cache.keep("t", 100, ids(3, 7), torch.tensor([[3.0], [7.0]]), ids(5, 6), step=10, generation=0)
    for step, served in ((10, True), (12, True), (13, False)):
        found = cache.find("t", ids(3, 7, 9), step=step, max_staleness=2, generation=0)
        assert found.hit.tolist() == [served, served, False], step
    found = cache.find("t", ids(7, 3), step=11, max_staleness=2, generation=0)
    assert found.rows.tolist() == [[7.0], [3.0]] and found.versions.tolist() == [6, 5] and found.ages.tolist() == [1, 1]


def test_nothing_read_before_the_closures_read_generation_or_with_staleness_zero_is_served():
    cache = RowCache(slots_per_table=64)
    cache.keep("t", 100, ids(3), torch.tensor([[3.0]]), ids(1), step=1, generation=4)
    assert not cache.find("t", ids(3), step=1, max_staleness=5, generation=5).hit.any(), "read before a join()"
    assert cache.find("t", ids(3), step=1, max_staleness=5, generation=4).hit.all()
    assert not cache.find("t", ids(3), step=1, max_staleness=0, generation=4).hit.any()
    cache.clear()
    assert not cache.find("t", ids(3), step=1, max_staleness=5, generation=4).hit.any(), "a restore clears it"


def test_two_ids_of_one_slot_keep_one_whole_entry_and_the_other_misses():
    cache = RowCache(slots_per_table=4)
    cache.keep("t", 100, ids(1, 5, 9), torch.tensor([[1.0], [5.0], [9.0]]), ids(1, 5, 9), step=0, generation=0)
    found = cache.find("t", ids(1, 5, 9), step=0, max_staleness=1, generation=0)
    assert found.hit.tolist() == [False, False, True], "the last id of the slot stays"
    assert found.rows.tolist() == [[9.0]] and found.versions.tolist() == [9], "its row and version, not another's"


def test_a_table_gets_a_slot_per_row_up_to_the_limit_and_memory_is_bounded():
    assert slot_count(10, 64) == 10 and slot_count(10**9, 64) == 64 and slot_count(0, 64) == 1
    cache = RowCache(slots_per_table=64)
    many = torch.arange(10_000)
    cache.keep("t", 10**9, many, torch.zeros(10_000, 16), many, step=0, generation=0)
    assert cache.held_bytes() == 64 * (16 * 4 + 32)
    with pytest.raises(ValueError, match="slots_per_table must be >= 1"):
        RowCache(0)


class Servers:
    """A table of 10 rows in two shards (rows 0-4, 5-9) at versions 3 and 8, and the pulls asked."""

    def __init__(self) -> None:
        self.table = torch.arange(10, dtype=torch.float32).reshape(10, 1) * 10
        self.layout = VariableLayout(
            "t", (10, 1), torch.float32, (ShardPlacement(0, 0, 0, 5), ShardPlacement(1, 1, 5, 5))
        )
        self.versions = {ShardRef("t", 0): 3, ShardRef("t", 1): 8}
        self.pulled: list[list[int]] = []

    def pull(self, lookups, dynamic):
        found = {}
        for name, indices in lookups.items():
            unique, inverse = torch.unique(indices.reshape(-1), sorted=True, return_inverse=True)
            self.pulled.append(unique.tolist())
            found[name] = UniqueRows(unique, inverse, self.table[unique])
        return found, dict(self.versions)


def test_a_cached_lookup_pulls_only_what_the_cache_does_not_serve_and_returns_every_row():
    servers, cache = Servers(), RowCache()
    lookup = {"t": ids(1, 6, 6, 2)}
    rows, versions, use = cached_lookup(
        servers.pull, cache, {"t": servers.layout}, lookup, None, step=1, max_staleness=2, generation=0
    )
    assert servers.pulled == [[1, 2, 6]] and use.rows_pulled == 3 and use.rows_cached == 0
    assert rows["t"].gathered((4,)).reshape(-1).tolist() == [10.0, 60.0, 60.0, 20.0]
    servers.versions = {ShardRef("t", 0): 4, ShardRef("t", 1): 9}  # other workers pushed meanwhile
    rows, versions, use = cached_lookup(
        servers.pull, cache, {"t": servers.layout}, {"t": ids(2, 7)}, None, step=2, max_staleness=2, generation=0
    )
    assert servers.pulled[-1] == [7], "row 2 came from the cache"
    assert rows["t"].gathered((2,)).reshape(-1).tolist() == [20.0, 70.0]
    assert versions == {ShardRef("t", 0): 3, ShardRef("t", 1): 9}, "shard 0's push counts from row 2's older read"
    assert use.rows_cached == 1 and use.rows_pulled == 1 and dict(use.ages) == {1: 1}


def test_a_lookup_the_cache_serves_whole_makes_no_pull_and_dynamic_tables_always_pull():
    servers, cache = Servers(), RowCache()
    layouts = {"t": servers.layout}
    cached_lookup(servers.pull, cache, layouts, {"t": ids(1, 2)}, None, step=1, max_staleness=3, generation=0)
    rows, versions, _ = cached_lookup(
        servers.pull, cache, layouts, {"t": ids(2, 1)}, None, step=2, max_staleness=3, generation=0
    )
    assert servers.pulled == [[1, 2]] and rows["t"].gathered((2,)).reshape(-1).tolist() == [20.0, 10.0]
    assert versions == {ShardRef("t", 0): 3}
    cached_lookup(
        servers.pull, cache, layouts, {"d": ids(4)}, {"d": (1, torch.float32)}, step=2, max_staleness=3, generation=0
    )
    cached_lookup(
        servers.pull, cache, layouts, {"d": ids(4)}, {"d": (1, torch.float32)}, step=2, max_staleness=3, generation=0
    )
    assert servers.pulled[-2:] == [[4], [4]]
