"""Issue 42: a model's tables of one layout stored as one variable (coordinator.strategies.table_fusion):
the policy, and what each table keeps of its own."""

from __future__ import annotations

import pytest
import torch
from scope_models import CLUSTER, undialled_strategy
from torch import nn

from paramserve.coordinator import ParameterServerStrategy, ShardedEmbedding
from paramserve.coordinator.strategies.table_fusion import TableSpec, fusion_plan
from paramserve.worker.deferred_rows import PendingRows


def spec(path: str, rows: int = 10, *, named: bool = False, dim: int = 4, **overrides: object) -> TableSpec:
    fields: dict[str, object] = {
        "dtype": torch.float32,
        "initializer": "normal",
        "init_std": 1.0,
        "seed": 0,
        **overrides,
    }
    return TableSpec(path, rows, named, dim, **fields)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the policy


def test_tables_of_one_layout_fuse_in_model_order_with_offsets_by_rows():
    plan = fusion_plan([spec("a", 10), spec("b", 5), spec("c", 7)])
    assert len(plan) == 1
    assert plan[0].members == (0, 1, 2) and plan[0].offsets == (0, 10, 15) and plan[0].rows == 22
    assert plan[0].suffix == "fused_tables.0"


@pytest.mark.parametrize(
    "other",
    [
        {"dim": 8},
        {"dtype": torch.float64},
        {"initializer": "uniform"},
        {"init_std": 0.01},
        {"seed": 1},
    ],
    ids=["dim", "dtype", "initializer", "init_std", "seed"],
)
def test_tables_that_differ_in_layout_or_initialisation_never_share_a_variable(other):
    """The servers fill a variable from one initializer, with one row shape and dtype."""
    plan = fusion_plan([spec("a"), spec("b", **other), spec("c"), spec("d", **other)])
    assert [(g.members, g.suffix) for g in plan] == [((0, 2), "fused_tables.0"), ((1, 3), "fused_tables.1")]


def test_a_named_table_keeps_its_own_variable_and_a_group_of_one_is_left_alone():
    plan = fusion_plan([spec("a", named=True), spec("b", named=True), spec("c"), spec("d", dim=8)])
    assert plan == [], "named tables (the user's variable names) and lone tables stay as they are"


# ---------------------------------------------------------------- the strategy


class PerFeature(nn.Module):
    def __init__(self, rows: dict[str, int], **kwargs: object) -> None:
        super().__init__()
        self.tables = nn.ModuleDict({name: ShardedEmbedding(n, 4, **kwargs) for name, n in rows.items()})  # type: ignore[arg-type]
        self.head = nn.Linear(4 * len(rows), 1)


@pytest.fixture
def strategy():
    yield from undialled_strategy()


def test_a_models_tables_become_row_ranges_of_one_variable(strategy):
    with strategy.scope():
        model = PerFeature({"user": 10, "item": 20, "city": 5})
    tables = model.tables
    assert {t.variable for t in tables.values()} == {"perfeature.fused_tables.0"}
    assert [t.row_offset for t in tables.values()] == [0, 10, 30]
    variable = strategy.variables["perfeature.fused_tables.0"]
    assert variable.shape == (35, 4) and [m.path for m in variable.fused] == [
        "tables.user",
        "tables.item",
        "tables.city",
    ]
    assert not any(name.startswith("perfeature.tables.") for name in strategy.variables), "no variable per table"
    assert tables["item"].shape == (20, 4), "each table keeps its own shape"


def test_a_lookup_reads_its_own_rows_of_the_shared_variable_and_an_id_past_its_table_is_refused():
    seen = {}

    class Recording:
        def lookup(self, lookups):
            seen.update(lookups)
            return {name: torch.zeros(*ids.shape, 4) for name, ids in lookups.items()}

    strategy = ParameterServerStrategy(CLUSTER)
    try:
        with strategy.scope():
            model = PerFeature({"user": 10, "item": 20})
        item, recording = model.tables["item"], Recording()
        for table in model.tables.values():
            table.home = recording  # type: ignore[assignment]
        rows = item(torch.tensor([0, 19]))
        assert isinstance(rows, PendingRows) and rows.resolve().shape == (2, 4)
        assert seen["perfeature.fused_tables.0"].tolist() == [10, 29], "moved by the table's offset"
        user_rows, bad = model.tables["user"](torch.tensor([9])), item(torch.tensor([3, 20]))
        seen.clear()
        with pytest.raises(  # read with its batch, at first use, as a server's refusal would be
            IndexError, match=r"id 20 is outside the rows \[0, 20\) of ShardedEmbedding 'perfeature.tables.item'"
        ):
            torch.cat([user_rows, bad])
        assert seen == {}, "nothing read: the whole batch refused"
        with pytest.raises(IndexError, match="id 20 is outside"):
            user_rows.resolve()  # every lookup of the batch carries its error
        with pytest.raises(
            IndexError, match="id -1 is outside the rows \\[0, 10\\) of ShardedEmbedding 'perfeature.tables.user'"
        ):
            model.tables["user"](torch.tensor([-1])).resolve()
    finally:
        strategy.close()


def test_without_fusion_and_for_named_tables_each_table_keeps_its_own_variable():
    strategy = ParameterServerStrategy(CLUSTER, fuse_tables=False)
    try:
        with strategy.scope():
            model = PerFeature({"user": 10, "item": 20})
        assert {t.variable for t in model.tables.values()} == {"perfeature.tables.user", "perfeature.tables.item"}
        assert not any(t.fused for t in model.tables.values())
    finally:
        strategy.close()
    strategy = ParameterServerStrategy(CLUSTER)
    try:
        with strategy.scope():
            model = nn.ModuleDict(
                {"a": ShardedEmbedding(10, 4, name="users"), "b": ShardedEmbedding(10, 4, name="items")}
            )
        assert {t.variable for t in model.values()} == {"users", "items"}  # type: ignore[union-attr]
    finally:
        strategy.close()


def test_an_optimizer_for_some_tables_of_a_fused_variable_is_refused_naming_the_others(strategy):
    """They share one variable, so one optimizer state: half of them on another optimizer cannot be."""
    with strategy.scope():
        model = PerFeature({"user": 10, "item": 20})
    with pytest.raises(ValueError, match=r"perfeature.tables.user is stored with \['perfeature.tables.item'\]"):
        strategy.optimizer(torch.optim.Adagrad, params=[model.tables["user"]], lr=0.1)
    assert strategy.variables["perfeature.fused_tables.0"].optimizer is None, "nothing declared"
    sparse = strategy.optimizer(torch.optim.Adagrad, params=list(model.tables.values()), lr=0.1)
    assert sparse.variables == ("perfeature.fused_tables.0",), "the shared variable, once"


def test_a_build_that_fails_after_fusing_leaves_its_tables_as_they_were(strategy):
    """Two tables asking for one name fail the build after the others were fused: all of it is
    rolled back, the fused tables included, and the strategy stays usable."""
    with pytest.raises(ValueError, match="two variables are named 'same'"), strategy.scope():
        model = PerFeature({"user": 10, "item": 20})
        model.clash = nn.ModuleList([ShardedEmbedding(5, 4, name="same"), ShardedEmbedding(5, 4, name="same")])
    assert all(not t.fused and not t.variable and t.row_offset == 0 and not t.adopted() for t in model.tables.values())
    assert strategy.variables == {}
    with strategy.scope():
        again = PerFeature({"user": 10, "item": 20})
    assert {t.variable for t in again.tables.values()} == {"perfeature.fused_tables.0"}
