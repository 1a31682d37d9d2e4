"""Dynamic embedding tables on real parameter servers (port 0), over every client transport:
lookups and pushes by id, admission, eviction, exactly-once pushes, export and restore onto
another number of servers, metrics, and bad input that changes nothing."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest

from paramserve.psserver.checkpoint.dynamic_chain import apply_delta
from paramserve.psserver.dynamic.dynamic_rows import initial_rows, owner_of
from paramserve.psserver.dynamic.dynamic_types import DynamicTableConfig, rehash
from paramserve.psserver.protocol.errors import (
    DtypeMismatchError,
    InvalidRequestError,
    ShapeMismatchError,
    VariableExistsError,
)
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.types import RowGradient

DIM = 4
ADAGRAD = OptimizerSpec("Adagrad", {"lr": 0.5})


def config(**overrides: object) -> DynamicTableConfig:
    return DynamicTableConfig(**{"dim": DIM, "optimizer": ADAGRAD, "seed": 7, **overrides})  # type: ignore[arg-type]


@pytest.fixture
def servers(start_ps):
    return [start_ps() for _ in range(2)]


def addresses(servers):
    return [f"127.0.0.1:{s.port}" for s in servers]


def lookup(client, ids, table="users"):
    ids = torch.tensor(ids, dtype=torch.int64)
    found, versions = client.pull_unique_rows({table: ids}, dynamic={table: (DIM, torch.float32)})
    return found[table].gathered(ids.shape), versions


def live_rows(client, table="users"):
    return sum(s.live_rows for stats in client.dynamic.stats().values() for s in stats if s.ref.variable == table)


def test_rows_are_made_on_first_touch_from_the_initializer_and_partitioned_by_hash(servers, make_client):
    client = make_client(addresses(servers))
    client.dynamic.create("users", config())
    ids = [0, -5, 2**62 + 3, 17, 123456789012]
    rows, _ = lookup(client, ids + [17])
    expected = initial_rows(torch.tensor(ids), DIM, "normal", 0.0, 1.0, 7, torch.float32)
    assert torch.equal(rows[:5], expected) and torch.equal(rows[5], rows[3])
    owners = owner_of(torch.tensor(ids), 2)
    held = {s.ref.shard: s.live_rows for stats in client.dynamic.stats().values() for s in stats}
    assert held == {0: int((owners == 0).sum()), 1: int((owners == 1).sum())}
    assert 0 < held[0] < 5, "ids spread over both servers"


def test_a_push_updates_the_touched_rows_once_per_key_with_adagrad(servers, make_client):
    client = make_client(addresses(servers))
    client.dynamic.create("users", config())
    before, versions = lookup(client, [3, 9])
    grad = torch.ones(2, DIM)
    first = client.push({"users": RowGradient(torch.tensor([3, 9]), grad)}, key="k1", base_versions=versions)
    again = client.push({"users": RowGradient(torch.tensor([3, 9]), grad)}, key="k1")
    after, _ = lookup(client, [3, 9])
    reference = torch.nn.Parameter(before.clone())
    optimizer = torch.optim.Adagrad([reference], lr=0.5)
    reference.grad = grad
    optimizer.step()
    assert torch.equal(after, reference.detach())
    assert first.applied >= 1 and again.applied == 0 and again.duplicates == first.applied


def test_an_id_gets_its_row_at_its_nth_lookup_and_reads_the_default_before(servers, make_client):
    client = make_client(addresses(servers))
    client.dynamic.create("users", config(admit_after=3, default_row="shared"))
    first, _ = lookup(client, [42])
    client.push({"users": RowGradient(torch.tensor([42]), torch.ones(1, DIM))}, key="early")
    second, _ = lookup(client, [42])
    assert torch.equal(first, second) and live_rows(client) == 0, "not admitted: shared row, gradient dropped"
    third, _ = lookup(client, [42])
    own = initial_rows(torch.tensor([42]), DIM, "normal", 0.0, 1.0, 7, torch.float32)
    assert torch.equal(third, own) and not torch.equal(third, first) and live_rows(client) == 1


def test_rows_past_their_ttl_are_evicted_and_come_back_as_new(servers, make_client):
    client = make_client(addresses(servers))
    client.dynamic.create("users", config(ttl_steps=5))
    ids = torch.arange(100)
    lookup(client, ids.tolist())
    owners = owner_of(ids, 2)
    kept = torch.stack([ids[owners == 0][0], ids[owners == 1][0]])  # one row updated on each server
    for step in range(20):  # each shard's steps advance; every other row goes stale
        client.push({"users": RowGradient(kept, torch.ones(2, DIM))}, key=f"s{step}")
    stats = [s for per in client.dynamic.stats().values() for s in per]
    assert sum(s.evictions_ttl for s in stats) == 98
    assert live_rows(client) == 2
    again, _ = lookup(client, [50])
    assert torch.equal(again, initial_rows(torch.tensor([50]), DIM, "normal", 0.0, 1.0, 7, torch.float32))


def test_under_a_row_cap_the_least_recently_used_rows_make_room(servers, make_client):
    client = make_client(addresses(servers))
    client.dynamic.create("users", config(max_rows=64))
    for start in range(0, 1000, 50):
        lookup(client, list(range(start, start + 50)))
        lookup(client, [7])  # kept in use: never the least recently used
    per_server = [s.live_rows for per in client.dynamic.stats().values() for s in per]
    assert max(per_server) <= 64
    assert sum(s.evictions_capacity for per in client.dynamic.stats().values() for s in per) > 0
    owner = int(owner_of(torch.tensor([7]), 2))
    export = client.dynamic.export(["users"])
    assert 7 in export[owner][0].ids.tolist(), "a row in use survives"
    assert 960 in torch.cat([s.ids for per in export.values() for s in per]).tolist(), "the newest rows are held"


def test_export_restores_bit_identically_onto_three_servers(servers, start_ps, make_client):
    client = make_client(addresses(servers))
    client.dynamic.create("users", config())
    ids = torch.arange(-40, 40) * 7919
    lookup(client, ids.tolist())
    client.push({"users": RowGradient(ids, torch.randn(ids.numel(), DIM))}, key="a")
    saved = [s for per in client.dynamic.export().values() for s in per]
    three = [start_ps() for _ in range(3)]
    other = make_client(addresses(three))
    other.dynamic.replace({state.ref.shard: [state] for state in rehash(saved, 3)})
    restored = [s for per in other.dynamic.export().values() for s in per]
    assert sorted(s.ref.shard for s in restored) == [0, 1, 2]

    def table(states):
        ids = torch.cat([s.ids for s in states])
        order = torch.argsort(ids)
        return (
            ids[order],
            torch.cat([s.values for s in states])[order],
            torch.cat([s.slots["sum"] for s in states])[order],
        )

    for before, after in zip(table(saved), table(restored)):
        assert torch.equal(before, after)
    rows, _ = lookup(other, ids.tolist())
    assert torch.equal(rows, lookup(client, ids.tolist())[0])


def test_an_incremental_export_sends_the_changes_since_a_mark_and_a_saved_mark_trims(servers, make_client):
    client = make_client(addresses(servers))
    client.dynamic.create("users", config(ttl_steps=3))
    lookup(client, list(range(40)))
    base = {s.ref: s for per in client.dynamic.export(["users"], incremental=True).values() for s in per}
    assert not any(s.delta for s in base.values())
    kept = torch.tensor([0, 1, 2, 3])  # on both servers; the other rows go stale and are evicted
    for step in range(6):
        client.push({"users": RowGradient(kept, torch.ones(4, DIM))}, key=f"s{step}")
    lookup(client, [100, 101])
    marks = {ref: state.mark for ref, state in base.items()}
    deltas = {s.ref: s for per in client.dynamic.export(["users"], since=marks).values() for s in per}
    assert all(s.delta for s in deltas.values())
    assert sorted(torch.cat([s.ids for s in deltas.values()]).tolist()) == [0, 1, 2, 3, 100, 101]
    assert sorted(torch.cat([s.deleted for s in deltas.values()]).tolist()) == list(range(4, 40))
    whole = {s.ref: s for per in client.dynamic.export(["users"]).values() for s in per}
    for ref, delta in deltas.items():
        merged = apply_delta(base[ref], delta)
        assert torch.equal(merged.ids, whole[ref].ids) and torch.equal(merged.values, whole[ref].values)
        assert torch.equal(merged.slots["sum"], whole[ref].slots["sum"]) and merged.version == whole[ref].version
    client.dynamic.mark_saved([delta.mark for delta in deltas.values()])
    again = [s for per in client.dynamic.export(["users"], since=marks).values() for s in per]
    assert not any(s.delta for s in again), "the servers forgot what was evicted before the saved marks"


def test_bad_input_gets_a_specific_error_and_changes_nothing(servers, make_client):
    client = make_client(addresses(servers))
    client.dynamic.create("users", config())
    lookup(client, [1, 2, 3])
    saved = client.dynamic.export()
    with pytest.raises(DtypeMismatchError):
        client.pull_unique_rows({"users": torch.tensor([1.5])}, dynamic={"users": (DIM, torch.float32)})
    with pytest.raises(ShapeMismatchError):
        client.push({"users": RowGradient(torch.tensor([1, 2]), torch.ones(2, DIM + 1))}, key="bad")
    wrong = dict(client._dynamic)
    client._dynamic["users"] = (DIM + 1, torch.float32)  # a client that believes another dim
    with pytest.raises(ShapeMismatchError):
        client.push({"users": RowGradient(torch.tensor([1, 2]), torch.ones(2, DIM + 1))}, key="bad2")
    client._dynamic = wrong
    with pytest.raises(VariableExistsError):
        client.dynamic.create("users", config(dim=8))
    after = client.dynamic.export()
    for server, states in saved.items():
        assert [s.version for s in states] == [s.version for s in after[server]]
        assert all(torch.equal(a.values, b.values) for a, b in zip(states, after[server]))


def test_the_servers_metrics_report_rows_admissions_evictions_and_bytes(servers, make_client):
    client = make_client(addresses(servers))
    client.dynamic.create("users", config(max_rows=8))
    lookup(client, list(range(40)))
    text = "\n".join(generate_latest(server.registry).decode() for server in servers)
    assert 'paramserve_ps_dynamic_rows{table="users"}' in text
    assert 'paramserve_ps_dynamic_admissions_total{table="users"}' in text
    assert 'paramserve_ps_dynamic_evictions_total{reason="capacity",table="users"}' in text
    assert 'paramserve_ps_dynamic_bytes{table="users"}' in text


def test_a_server_side_save_refuses_rather_than_leave_dynamic_tables_out(servers, make_client, tmp_path):
    """The servers' own Save RPC writes dense and row shards only: with a dynamic table it
    would make a checkpoint that looks whole and restores without a single row of it."""
    client = make_client(addresses(servers))
    client.dynamic.create("users", config())
    lookup(client, [1, 2, 3])
    with pytest.raises(InvalidRequestError, match=r"dynamic tables \['users'\].*CheckpointManager"):
        client.save(str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    assert live_rows(client) == 3
