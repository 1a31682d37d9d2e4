"""ShardStore: validate-then-mutate, exactly-once pushes, versions and concurrency."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

import pytest
import torch

from paramserve.psserver.protocol.errors import (
    DtypeMismatchError,
    IndexOutOfRangeError,
    InvalidRequestError,
    NonFiniteGradientError,
    ParamServeError,
    ShapeMismatchError,
    StalePushError,
    VariableExistsError,
    VariableNotFoundError,
)
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.types import PushOutcome, ShardRef, ShardState
from paramserve.psserver.store.shard_store import ShardPush, ShardStore, StoreConfig

SGD = OptimizerSpec("SGD", {"lr": 0.5})
W0, W1 = ShardRef("layers.0.weight", 0), ShardRef("layers.0.weight", 1)


def _state(
    ref: ShardRef = W0, rows: int = 4, row_start: int = 0, optimizer: OptimizerSpec | None = SGD, **kwargs
) -> ShardState:
    value = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + row_start * 3
    return ShardState(ref, (8, 3), row_start, value, optimizer, **kwargs)


def _store(**config) -> ShardStore:
    store = ShardStore(StoreConfig(**config))
    store.create_shards([_state(W0), _state(W1, row_start=4)])
    return store


class _Recorder:
    def __init__(self) -> None:
        self.outcomes: list[PushOutcome] = []
        self.rejected: list[ParamServeError] = []

    def on_push(self, outcome: PushOutcome) -> None:
        self.outcomes.append(outcome)

    def on_rejected(self, error: ParamServeError) -> None:
        self.rejected.append(error)


def _snapshot(store: ShardStore) -> list[ShardState]:
    return store.export()


def _assert_unchanged(store: ShardStore, before: list[ShardState]) -> None:
    after = store.export()
    assert [s.ref for s in after] == [s.ref for s in before]
    for old, new in zip(before, after):
        assert torch.equal(old.value, new.value), f"{old.ref} value changed"
        assert old.version == new.version and old.applied_keys == new.applied_keys
        assert old.slots.keys() == new.slots.keys()
        assert all(torch.equal(old.slots[k], new.slots[k]) for k in old.slots)


# -- creation ---------------------------------------------------------------


def test_create_and_info() -> None:
    store = _store()
    info = store.info(W1)
    assert (info.variable_shape, info.row_start, info.shape, info.dtype) == ((8, 3), 4, (4, 3), torch.float32)
    assert info.optimizer == SGD and info.version == 0
    assert [i.ref for i in store.list_shards()] == [W0, W1]


def test_create_copies_the_caller_tensor() -> None:
    state = _state()
    store = ShardStore(StoreConfig())
    store.create_shards([state])
    state.value.fill_(-1)
    assert torch.equal(store.pull(W0).value, _state().value)


def test_retried_create_is_a_no_op() -> None:
    store = _store()
    store.push([ShardPush(W0, torch.ones(4, 3), None, 0)], "k")
    infos = store.create_shards([_state(W0)])
    assert infos[0].version == 1, "the existing shard (with its update) is kept"
    assert torch.equal(store.pull(W0).value, _state().value - 0.5)


@pytest.mark.parametrize(
    "state",
    [
        _state(W0, rows=3),
        _state(W0, optimizer=OptimizerSpec("SGD", {"lr": 0.1})),
        _state(W0, optimizer=None),
    ],
)
def test_create_conflicting_shard_fails(state: ShardState) -> None:
    store = _store()
    with pytest.raises(VariableExistsError) as raised:
        store.create_shards([state])
    assert raised.value.variable == "layers.0.weight"


def test_create_with_other_variable_shape_fails() -> None:
    store = _store()
    other = ShardState(ShardRef("layers.0.weight", 2), (9, 3), 8, torch.zeros(1, 3), SGD)
    with pytest.raises(VariableExistsError, match="delete it first"):
        store.create_shards([other])


def test_a_restore_replaces_values_slots_versions_and_windows_exactly() -> None:
    store = _store(idempotency_capacity=8)
    adam = OptimizerSpec("Adam", {"lr": 0.1})
    donor = ShardStore(StoreConfig(idempotency_capacity=8))
    donor.create_shards([_state(W0, optimizer=adam), _state(W1, row_start=4, optimizer=adam)])
    donor.push([ShardPush(W0, torch.ones(4, 3)), ShardPush(W1, torch.ones(4, 3))], "k1")
    saved = donor.export()
    store.push([ShardPush(W0, torch.full((4, 3), 2.0))], "live-1")
    store.push([ShardPush(W0, torch.full((4, 3), 3.0))], "live-2")

    store.replace_shards(saved)

    for expected, got in zip(saved, store.export()):
        assert torch.equal(got.value, expected.value) and got.version == expected.version == 1
        assert got.optimizer == adam and list(got.applied_keys) == list(expected.applied_keys) == ["k1"]
        assert got.slots.keys() == expected.slots.keys()
        assert all(torch.equal(got.slots[k], expected.slots[k]) for k in got.slots)
    assert not store.push([ShardPush(W0, torch.ones(4, 3))], "k1")[0].applied, "the restored window holds k1"
    assert store.push([ShardPush(W0, torch.ones(4, 3))], "live-1")[0].applied, "keys after the checkpoint are gone"


@pytest.mark.parametrize(
    "restored, error, words",
    [
        (
            [ShardState(W0, (20, 3), 0, torch.zeros(4, 3), SGD), ShardState(W1, (20, 3), 4, torch.zeros(4, 3), SGD)],
            ShapeMismatchError,
            "(20, 3)",
        ),
        (
            [
                ShardState(W0, (8, 3), 0, torch.zeros(4, 3, dtype=torch.float64), SGD),
                ShardState(W1, (8, 3), 4, torch.zeros(4, 3, dtype=torch.float64), SGD),
            ],
            DtypeMismatchError,
            "float64",
        ),
        ([_state(W0)], InvalidRequestError, "also holds shards [1]"),
    ],
    ids=["shape", "dtype", "half_a_variable"],
)
def test_a_restore_that_does_not_fit_the_live_variable_changes_nothing(restored, error, words) -> None:
    store = _store()
    store.push([ShardPush(W0, torch.ones(4, 3))], "k")
    before = _snapshot(store)
    with pytest.raises(error, match=re.escape(words)):
        store.replace_shards(restored)
    _assert_unchanged(store, before)


def test_an_optimizer_whose_step_would_fail_is_refused_at_creation() -> None:
    store = ShardStore()
    for kwargs in ({"betas": (0.9, 0.99, 0.5)}, {"betas": (0.9,)}):
        with pytest.raises(InvalidRequestError, match="Adam"):
            store.create_shards([_state(W0, optimizer=OptimizerSpec("Adam", kwargs))])
    assert store.list_shards() == []


@pytest.mark.parametrize(
    "bad, error",
    [
        (ShardState(ShardRef("", 0), (4, 3), 0, torch.zeros(4, 3), SGD), InvalidRequestError),
        (ShardState(ShardRef("v", -1), (4, 3), 0, torch.zeros(4, 3), SGD), InvalidRequestError),
        (ShardState(ShardRef("v", 0), (4, 3), 0, torch.zeros(4, 2), SGD), ShapeMismatchError),
        (ShardState(ShardRef("v", 0), (4, 3), 2, torch.zeros(3, 3), SGD), InvalidRequestError),
        (ShardState(ShardRef("v", 0), (4, 3), -1, torch.zeros(3, 3), SGD), InvalidRequestError),
        (ShardState(ShardRef("v", 0), (4, 3), 0, torch.zeros(4, 3), OptimizerSpec("Nope", {})), InvalidRequestError),
        (ShardState(ShardRef("v", 0), (4, 3), 0, torch.zeros(4, 3, dtype=torch.int64), SGD), DtypeMismatchError),
        (ShardState(ShardRef("v", 0), (4, 3), 0, torch.zeros(4, 3, dtype=torch.complex64), None), DtypeMismatchError),
        (
            ShardState(ShardRef("v", 0), (4, 3), 0, torch.zeros(4, 3), None, {"sum": torch.zeros(4, 3)}),
            InvalidRequestError,
        ),
        (
            ShardState(
                ShardRef("v", 0),
                (4, 3),
                0,
                torch.zeros(4, 3),
                OptimizerSpec("Adagrad", {}),
                {"sum": torch.zeros(3, 3), "step": torch.tensor(0.0)},
            ),
            ShapeMismatchError,
        ),
        (ShardState(ShardRef("v", 0), (), 0, torch.zeros(2), None), ShapeMismatchError),
    ],
)
def test_bad_create_creates_nothing(bad: ShardState, error: type[Exception]) -> None:
    store = _store()
    good = _state(ShardRef("good", 0))
    with pytest.raises(error):
        store.create_shards([good, bad])
    assert [i.ref for i in store.list_shards()] == [W0, W1], "all or nothing"


def test_create_rejects_same_ref_twice() -> None:
    store = ShardStore(StoreConfig())
    with pytest.raises(InvalidRequestError, match="twice"):
        store.create_shards([_state(W0), _state(W0)])
    assert store.list_shards() == []


def test_scalar_variable() -> None:
    store = ShardStore(StoreConfig())
    ref = ShardRef("scale", 0)
    store.create_shards([ShardState(ref, (), 0, torch.tensor(2.0), SGD)])
    store.push([ShardPush(ref, torch.tensor(1.0), None, 0)], "k")
    assert float(store.pull(ref).value) == 1.5
    with pytest.raises(ShapeMismatchError):
        store.pull_rows(ref, torch.tensor([0]))


def test_create_restores_slots_version_and_keys() -> None:
    store = ShardStore(StoreConfig(idempotency_capacity=2))
    slots = {"sum": torch.full((4, 3), 2.0), "step": torch.tensor(3.0)}
    state = _state(optimizer=OptimizerSpec("Adagrad", {}), slots=slots, version=5, applied_keys=["a", "b", "c"])
    store.create_shards([state])
    exported = store.export([W0])[0]
    assert exported.version == 5 and exported.applied_keys == ["b", "c"]
    assert torch.equal(exported.slots["sum"], slots["sum"]) and float(exported.slots["step"]) == 3.0


# -- reads --------------------------------------------------------------------


def test_pull_is_a_copy() -> None:
    store = _store()
    pulled = store.pull(W0)
    pulled.value.fill_(100)
    assert torch.equal(store.pull(W0).value, _state().value)


def test_pull_rows_in_request_order_with_duplicates() -> None:
    store = _store()
    pulled = store.pull_rows(W1, torch.tensor([3, 0, 3]))
    full = _state(W1, row_start=4).value
    assert torch.equal(pulled.value, full[[3, 0, 3]])
    assert pulled.version == 0


@pytest.mark.parametrize(
    "rows, error, match",
    [
        (torch.tensor([0, 4]), IndexOutOfRangeError, r"row index 4 .*\[0, 4\)"),
        (torch.tensor([-1]), IndexOutOfRangeError, "row index -1"),
        (torch.tensor([0], dtype=torch.int32), InvalidRequestError, "int64"),
        (torch.tensor([[0]]), InvalidRequestError, "1-d"),
    ],
)
def test_pull_rows_rejects_bad_rows(rows: torch.Tensor, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        _store().pull_rows(W0, rows)


def test_unknown_shard_names_variable_and_shard() -> None:
    with pytest.raises(VariableNotFoundError, match="shard 7 of variable 'layers.0.weight'") as raised:
        _store().pull(ShardRef("layers.0.weight", 7))
    assert raised.value.variable == "layers.0.weight"


# -- pushes ---------------------------------------------------------------------


def test_dense_and_sparse_push_apply_sgd() -> None:
    store = _store()
    outcomes = store.push(
        [ShardPush(W0, torch.ones(4, 3), None, 0), ShardPush(W1, torch.ones(2, 3), torch.tensor([1, 1]), 0)], "k1"
    )
    assert [(o.applied, o.version, o.staleness) for o in outcomes] == [(True, 1, 0), (True, 1, 0)]
    assert torch.equal(store.pull(W0).value, _state().value - 0.5)
    expected = _state(W1, row_start=4).value
    expected[1] -= 1.0  # two gradients of ones on row 1, summed, times lr 0.5
    assert torch.equal(store.pull(W1).value, expected)


def test_duplicate_key_is_applied_once() -> None:
    recorder = _Recorder()
    store = ShardStore(StoreConfig(), recorder)
    store.create_shards([_state()])
    push = [ShardPush(W0, torch.ones(4, 3), None, 0)]
    first, second = store.push(push, "same"), store.push(push, "same")
    assert first[0].applied and not second[0].applied
    assert second[0].version == 1
    assert torch.equal(store.pull(W0).value, _state().value - 0.5)
    assert [o.applied for o in recorder.outcomes] == [True, False]


def test_key_forgotten_beyond_window_applies_again() -> None:
    store = ShardStore(StoreConfig(idempotency_capacity=1))
    store.create_shards([_state()])
    push = [ShardPush(W0, torch.ones(4, 3), None, 0)]
    store.push(push, "a")
    store.push(push, "b")
    assert store.push(push, "a")[0].applied


def test_versions_and_staleness() -> None:
    store = _store()
    grad = torch.ones(4, 3)
    for key in ("a", "b", "c"):
        store.push([ShardPush(W0, grad, None, 0)], key)
    outcome = store.push([ShardPush(W0, grad, None, 1)], "d")[0]
    assert (outcome.version, outcome.staleness) == (4, 2)
    assert store.info(W0).version == 4 and store.info(W1).version == 0


def test_staleness_bound() -> None:
    recorder = _Recorder()
    store = ShardStore(StoreConfig(max_staleness=1), recorder)
    store.create_shards([_state()])
    grad = torch.ones(4, 3)
    store.push([ShardPush(W0, grad, None, 0)], "a")
    store.push([ShardPush(W0, grad, None, 0)], "b")  # staleness 1: allowed
    before = _snapshot(store)
    with pytest.raises(StalePushError, match="max_staleness=1"):
        store.push([ShardPush(W0, grad, None, 0)], "c")
    _assert_unchanged(store, before)
    assert isinstance(recorder.rejected[-1], StalePushError)
    # A retry of an applied push is a duplicate, not a stale push.
    assert not store.push([ShardPush(W0, grad, None, 0)], "a")[0].applied
    # An unknown base version (negative) is not bounded and counts as staleness 0.
    assert store.push([ShardPush(W0, grad, None, -1)], "d")[0].staleness == 0


def _bad_pushes() -> list[tuple[str, Callable[[], list[ShardPush]], type[Exception]]]:
    ok = ShardPush(W0, torch.ones(4, 3), None, 0)
    return [
        ("dtype", lambda: [ok, ShardPush(W1, torch.ones(4, 3, dtype=torch.float64), None, 0)], DtypeMismatchError),
        ("dense shape", lambda: [ok, ShardPush(W1, torch.ones(4, 2), None, 0)], ShapeMismatchError),
        ("sparse shape", lambda: [ok, ShardPush(W1, torch.ones(3, 3), torch.tensor([0, 1]), 0)], ShapeMismatchError),
        ("row range", lambda: [ok, ShardPush(W1, torch.ones(1, 3), torch.tensor([4]), 0)], IndexOutOfRangeError),
        (
            "row dtype",
            lambda: [ok, ShardPush(W1, torch.ones(1, 3), torch.tensor([0], dtype=torch.int32), 0)],
            InvalidRequestError,
        ),
        ("nan", lambda: [ok, ShardPush(W1, torch.full((4, 3), float("nan")), None, 0)], NonFiniteGradientError),
        (
            "inf rows",
            lambda: [ok, ShardPush(W1, torch.tensor([[float("inf"), 0, 0]]), torch.tensor([0]), 0)],
            NonFiniteGradientError,
        ),
        (
            "unknown shard",
            lambda: [ok, ShardPush(ShardRef("nope", 0), torch.ones(4, 3), None, 0)],
            VariableNotFoundError,
        ),
        ("same shard twice", lambda: [ok, ok], InvalidRequestError),
        ("non-int base", lambda: [ok, ShardPush(W1, torch.ones(4, 3), None, 1.5)], InvalidRequestError),
    ]


@pytest.mark.parametrize("name, make, error", _bad_pushes(), ids=[case[0] for case in _bad_pushes()])
def test_bad_push_changes_nothing(name: str, make: Callable[[], list[ShardPush]], error: type[Exception]) -> None:
    recorder = _Recorder()
    store = ShardStore(StoreConfig(), recorder)
    store.create_shards([_state(W0, optimizer=OptimizerSpec("Adam", {})), _state(W1, row_start=4)])
    store.push([ShardPush(W0, torch.ones(4, 3), None, 0)], "warm-up")  # so there are slots to protect
    before = _snapshot(store)
    with pytest.raises(error):
        store.push(make(), "key")
    _assert_unchanged(store, before)
    assert len(recorder.rejected) == 1 and isinstance(recorder.rejected[0], error)
    assert [o.applied for o in recorder.outcomes] == [True]


def test_push_without_optimizer_is_rejected() -> None:
    store = ShardStore(StoreConfig())
    ref = ShardRef("frozen", 0)
    store.create_shards([ShardState(ref, (2,), 0, torch.zeros(2), None)])
    with pytest.raises(InvalidRequestError, match="variable frozen has no optimizer; create it with one"):
        store.push([ShardPush(ref, torch.ones(2), None, 0)], "k")
    assert torch.equal(store.pull(ref).value, torch.zeros(2))


@pytest.mark.parametrize("key", ["", None])
def test_push_needs_a_key(key: object) -> None:
    store = _store()
    before = _snapshot(store)
    with pytest.raises(InvalidRequestError, match="idempotency key"):
        store.push([ShardPush(W0, torch.ones(4, 3), None, 0)], key)  # type: ignore[arg-type]
    _assert_unchanged(store, before)


def test_nonfinite_allowed_when_configured() -> None:
    store = _store(allow_nonfinite=True)
    store.push([ShardPush(W0, torch.full((4, 3), float("inf")), None, 0)], "k")
    assert torch.isinf(store.pull(W0).value).all()


def test_concurrent_pushes_to_two_shards() -> None:
    store = _store()
    pushes_per_thread = 200
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def worker(ref: ShardRef, thread: int) -> None:
        try:
            barrier.wait()
            for index in range(pushes_per_thread):
                store.push([ShardPush(ref, torch.ones(2, 3), torch.tensor([0, 3]), 0)], f"{ref}-{thread}-{index}")
                store.pull(ref)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [
        threading.Thread(target=worker, args=(ref, t), name=f"pusher-{ref}-{t}") for ref in (W0, W1) for t in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for ref, row_start in ((W0, 0), (W1, 4)):
        info = store.info(ref)
        assert info.version == 2 * pushes_per_thread
        expected = _state(ref, row_start=row_start).value
        expected[[0, 3]] -= 0.5 * 2 * pushes_per_thread  # no update lost
        assert torch.equal(store.pull(ref).value, expected)


# -- export, delete, hyperparameters -----------------------------------------------


def test_export_is_a_consistent_copy() -> None:
    store = ShardStore(StoreConfig())
    store.create_shards([_state(optimizer=OptimizerSpec("Adam", {"lr": 0.1}))])
    store.push([ShardPush(W0, torch.ones(4, 3), None, 0)], "k")
    exported = store.export()[0]
    assert exported.version == 1 and exported.applied_keys == ["k"]
    assert set(exported.slots) == {"step", "exp_avg", "exp_avg_sq"}
    exported.value.zero_()
    exported.slots["exp_avg"].zero_()
    again = store.export()[0]
    assert not torch.equal(again.value, exported.value) and float(again.slots["exp_avg"].abs().sum()) > 0


def test_export_unknown_ref() -> None:
    with pytest.raises(VariableNotFoundError):
        _store().export([ShardRef("nope", 0)])


def test_delete_variable() -> None:
    store = _store()
    assert store.delete_variable("layers.0.weight") == 2
    assert store.delete_variable("layers.0.weight") == 0
    assert store.list_shards() == []


def test_set_hyperparameters() -> None:
    store = _store()
    assert store.set_hyperparameters("layers.0.weight", {"lr": 1.0}) == 2
    store.push([ShardPush(W0, torch.ones(4, 3), None, 0)], "k")
    assert torch.equal(store.pull(W0).value, _state().value - 1.0)
    assert store.info(W1).optimizer == OptimizerSpec("SGD", {"lr": 1.0})


def test_set_hyperparameters_errors_change_nothing() -> None:
    store = _store()
    with pytest.raises(InvalidRequestError):
        store.set_hyperparameters(None, {"lr": -1.0})
    with pytest.raises(VariableNotFoundError):
        store.set_hyperparameters("nope", {"lr": 1.0})
    assert all(info.optimizer == SGD for info in store.list_shards())


def test_store_config_validation() -> None:
    with pytest.raises(ValueError, match="idempotency_capacity"):
        StoreConfig(idempotency_capacity=0)
    with pytest.raises(ValueError, match="max_staleness"):
        StoreConfig(max_staleness=-1)


def test_all_finite_fast_path_agrees_with_the_exact_scan():
    from paramserve.psserver.store.shards import all_finite

    big = torch.full((1000,), 3e38)  # finite values whose float32 sum overflows to inf
    assert all_finite(big)
    for bad in (float("nan"), float("inf"), float("-inf")):
        values = torch.randn(1000)
        values[517] = bad
        assert not all_finite(values)
        assert not all_finite(values.to(torch.bfloat16))
    mixed = torch.randn(10)
    mixed[2], mixed[7] = float("inf"), float("-inf")  # their sum is NaN: still caught
    assert not all_finite(mixed)
    assert all_finite(torch.randn(7, 3).double())


def test_a_push_whose_later_step_fails_leaves_no_part_applied() -> None:
    store = ShardStore()
    adam, embedding = OptimizerSpec("Adam", {"lr": 0.1}), ShardRef("table", 0)
    store.create_shards(
        [
            _state(W0),
            _state(W1, row_start=4),
            ShardState(ShardRef("b", 0), (3,), 0, torch.ones(3), adam),
            ShardState(embedding, (6, 2), 0, torch.zeros(6, 2), OptimizerSpec("Adagrad", {"lr": 0.1})),
        ]
    )
    store.push([ShardPush(ShardRef("b", 0), torch.ones(3))], "warm")  # Adam state exists: it must come back too
    before = _snapshot(store)
    real, calls = store._grouped.apply_dense, []

    def fail_after_adam(optimizers, grads):
        calls.append(optimizers[0].spec.name)
        real(optimizers, grads)  # applied, then fails: the sparse part and Adam must be undone
        if optimizers[0].spec.name == "Adam":
            raise MemoryError("out of memory")

    store._grouped.apply_dense = fail_after_adam
    pushes = [
        ShardPush(W0, torch.ones(4, 3)),
        ShardPush(W1, torch.ones(4, 3)),
        ShardPush(ShardRef("b", 0), torch.ones(3)),
        ShardPush(embedding, torch.ones(2, 2), rows=torch.tensor([1, 4])),
    ]
    with pytest.raises(ParamServeError, match="undone"):
        store.push(pushes, "k")
    assert calls == ["Adam"], "plain SGD (in place, not copied) runs last: after a failure it never starts"
    _assert_unchanged(store, before)


def test_a_push_whose_last_row_step_fails_leaves_no_part_applied_and_copies_only_what_can_be_undone() -> None:
    store = ShardStore()
    adagrad, adam = OptimizerSpec("Adagrad", {"lr": 0.1}), OptimizerSpec("Adam", {"lr": 0.1})
    first, last = ShardRef("table", 0), ShardRef("other", 0)
    store.create_shards(
        [
            ShardState(ShardRef("b", 0), (3,), 0, torch.ones(3), adam),
            ShardState(first, (6, 2), 0, torch.zeros(6, 2), adagrad),
            ShardState(last, (6, 2), 0, torch.zeros(6, 2), OptimizerSpec("Adagrad", {"lr": 0.2})),
        ]
    )
    store.push([ShardPush(ShardRef("b", 0), torch.ones(3))], "warm")
    before = _snapshot(store)
    real_rows, row_calls = store._grouped.apply_rows, []
    snapshots: list[tuple[str, bool]] = []
    for shard in (first, last, ShardRef("b", 0)):
        optimizer = store._get(shard).optimizer
        real_snapshot = optimizer.snapshot
        optimizer.snapshot = lambda rows=None, _r=real_snapshot, _n=shard.variable: (  # type: ignore[method-assign]
            snapshots.append((_n, rows is not None)) or _r(rows)
        )

    def fail_at_the_last_row_group(optimizers, rows, grads):
        row_calls.append(optimizers[0].spec.kwargs["lr"])
        if len(row_calls) == 2:
            raise MemoryError("out of memory")  # inside the step: nothing of this group was written back
        real_rows(optimizers, rows, grads)

    store._grouped.apply_rows = fail_at_the_last_row_group
    pushes = [
        ShardPush(ShardRef("b", 0), torch.ones(3)),
        ShardPush(first, torch.ones(2, 2), rows=torch.tensor([1, 4])),
        ShardPush(last, torch.ones(2, 2), rows=torch.tensor([0, 5])),
    ]
    with pytest.raises(ParamServeError, match="undone"):
        store.push(pushes, "k")
    assert len(row_calls) == 2
    assert sorted(snapshots) == [("b", False), ("table", True)], "the last row group writes back whole: no copy"
    _assert_unchanged(store, before)


def test_plain_sgd_steps_are_bit_for_bit_torch_optim_sgd() -> None:
    store = ShardStore()
    torch.manual_seed(0)
    values = [torch.randn(4, 3), torch.randn(5)]
    specs = [OptimizerSpec("SGD", {"lr": 0.37}), OptimizerSpec("SGD", {"lr": 0.37, "momentum": 0.0, "dampening": 0.5})]
    store.create_shards(
        [ShardState(ShardRef(f"v{i}", 0), tuple(v.shape), 0, v.clone(), specs[i]) for i, v in enumerate(values)]
    )
    params = [torch.nn.Parameter(v.clone()) for v in values]
    reference = torch.optim.SGD(params, lr=0.37)
    for step in range(3):
        grads = [torch.randn_like(v) for v in values]
        store.push([ShardPush(ShardRef(f"v{i}", 0), g) for i, g in enumerate(grads)], f"k{step}")
        for param, grad in zip(params, grads):
            param.grad = grad
        reference.step()
    for index, param in enumerate(params):
        assert torch.equal(store.pull(ShardRef(f"v{index}", 0)).value, param.detach())


def test_set_hyperparameters_reaches_dynamic_tables_all_or_nothing() -> None:
    from paramserve.psserver.dynamic.dynamic_types import DynamicTableConfig

    store = _store()
    table = ShardRef("table", 0)
    store.create_dynamic(table, 1, DynamicTableConfig(dim=3, optimizer=SGD))
    with pytest.raises(InvalidRequestError, match="changes its state"):  # fine for the dense shards (no state yet)
        store.set_hyperparameters(None, {"momentum": 0.9})
    assert all(info.optimizer == SGD for info in store.list_shards())
    assert store.dynamic.get(table).config.optimizer == SGD
    with pytest.raises(InvalidRequestError) as raised:
        store.set_hyperparameters("table", {"lr": -1.0})
    assert raised.value.variable == "table"
    assert store.set_hyperparameters("table", {"lr": 2.0}) == 1
    assert store.set_hyperparameters(None, {"lr": 1.0}) == 3
    assert store.dynamic.get(table).config.optimizer == OptimizerSpec("SGD", {"lr": 1.0})
