"""Lookups read when first used (worker.deferred_rows): the pure logic, with a lookup function
standing for the servers (one call here is one exchange per server there)."""

from __future__ import annotations

import pytest
import torch

from paramserve.worker.deferred_rows import PendingRows, close_open_batch, pending_rows


class Tables:
    """Tables as the servers hold them, and the lookups they were asked for (one list per call)."""

    def __init__(self, **shapes: tuple[int, int]):
        self.weights = {name: torch.randn(*shape, requires_grad=True) for name, shape in shapes.items()}
        self.calls: list[dict[str, list[int]]] = []
        self.fail: BaseException | None = None

    def lookup(self, lookups):
        self.calls.append({name: ids.tolist() for name, ids in lookups.items()})
        if self.fail is not None:
            raise self.fail
        return {name: self.weights[name][ids] for name, ids in lookups.items()}

    def rows(self, table: str, ids, owner: object | None = None) -> PendingRows:
        indices = torch.tensor(ids)
        return pending_rows(self.lookup, owner or self, table, indices, self.weights[table].shape[1], torch.float32)


@pytest.fixture(autouse=True)
def fresh_thread_batch():
    close_open_batch()
    yield
    close_open_batch()


def test_lookups_of_separate_tables_are_read_in_one_call_when_first_used_and_train_their_rows():
    tables = Tables(users=(10, 3), items=(20, 3), ads=(5, 3))
    users, items, ads = (
        tables.rows("users", [1, 2, 2]),
        tables.rows("items", [[0, 19], [4, 4]]),
        tables.rows("ads", [3]),
    )
    assert tables.calls == [], "nothing is read before a value is needed"

    joined = torch.cat([users, items.reshape(-1, 3), ads])

    assert tables.calls == [{"users": [1, 2, 2], "items": [0, 19, 4, 4], "ads": [3]}]
    expected = torch.cat(
        [tables.weights["users"][[1, 2, 2]], tables.weights["items"][[0, 19, 4, 4]], tables.weights["ads"][[3]]]
    )
    assert torch.equal(joined, expected)
    joined.sum().backward()
    assert tables.weights["users"].grad[2].tolist() == [2.0, 2.0, 2.0], "a row read twice gets both gradients"
    assert tables.weights["items"].grad[4].tolist() == [2.0, 2.0, 2.0]
    assert tables.weights["items"].grad[1].tolist() == [0.0, 0.0, 0.0]
    assert type(joined) is torch.Tensor, "what is computed from read rows is an ordinary tensor"


def test_two_lookups_of_one_table_are_merged_into_one_and_split_back():
    tables = Tables(users=(10, 2))
    first, second = tables.rows("users", [[1, 2]]), tables.rows("users", [7])
    assert torch.equal(second + 0, tables.weights["users"][[7]])
    assert tables.calls == [{"users": [1, 2, 7]}]
    assert first.shape == (1, 2, 2) and torch.equal(first.resolve(), tables.weights["users"][torch.tensor([[1, 2]])])


def test_shape_and_dtype_are_known_without_reading_the_rows():
    tables = Tables(users=(10, 4))
    rows = tables.rows("users", [[1, 2, 3], [4, 5, 6]])
    facts = (rows.shape, rows.size(), rows.size(1), rows.dim(), rows.ndim, rows.numel(), len(rows), rows.dtype)
    assert facts == (torch.Size([2, 3, 4]), torch.Size([2, 3, 4]), 3, 3, 3, 24, 2, torch.float32)
    assert tables.calls == []
    assert rows.device == torch.device("cpu") and len(tables.calls) == 1, "the device is read from the rows"


def test_a_failed_read_is_raised_by_the_first_use_of_any_rows_of_its_batch():
    tables = Tables(users=(10, 2), items=(10, 2))
    tables.fail = IndexError("id 12 of 'users' is outside its table's [0, 10)")
    users, items = tables.rows("users", [12]), tables.rows("items", [1])
    with pytest.raises(IndexError, match="id 12"):
        users * 2
    with pytest.raises(IndexError, match="id 12"):
        items.sum()
    assert len(tables.calls) == 1, "the batch is read once, and its error kept"


def test_a_step_boundary_closes_the_batch_and_unused_lookups_are_never_read():
    tables = Tables(users=(10, 2))
    unused = tables.rows("users", [1])
    close_open_batch()  # ServerOptimizer.step / zero_grad
    used = tables.rows("users", [2])
    used.sum()
    assert tables.calls == [{"users": [2]}]
    assert unused.shape == (1, 2) and tables.calls == [{"users": [2]}]
    unused.sum()  # a closed batch still reads, apart
    assert tables.calls == [{"users": [2]}, {"users": [1]}]


def test_a_lookup_through_another_access_opens_its_own_batch():
    tables, others = Tables(users=(10, 2)), Tables(users=(10, 2))
    mine, theirs = tables.rows("users", [1]), others.rows("users", [3])
    torch.cat([mine, theirs])
    assert tables.calls == [{"users": [1]}] and others.calls == [{"users": [3]}]


def test_code_that_bypasses_torch_function_is_told_to_resolve_first():
    rows = Tables(users=(10, 2)).rows("users", [1])
    with pytest.raises(RuntimeError, match=r"call \.resolve\(\)"), torch._C.DisableTorchFunctionSubclass():
        rows * 2  # as a C extension calling an operator directly would


def test_a_sharded_embedding_refuses_float_ids_naming_the_fix():
    from paramserve.worker.layers import ShardedEmbedding

    table = ShardedEmbedding(10, 2, name="users")
    with pytest.raises(TypeError, match=r"integer row ids, got a torch.float32 tensor: convert them with \.long\(\)"):
        table(torch.tensor([1.0]))
