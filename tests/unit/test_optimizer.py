"""ShardOptimizer must compute exactly what torch.optim computes (dense) and what
torch's sparse optimizers compute (lazy row-sparse)."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable, Sequence

import pytest
import torch

from paramserve.psserver.protocol.errors import (
    DtypeMismatchError,
    IndexOutOfRangeError,
    InvalidRequestError,
    ShapeMismatchError,
)
from paramserve.psserver.protocol.optimizer_spec import OPTIMIZER_NAMES, OptimizerSpec
from paramserve.psserver.store.optimizer import ShardOptimizer, in_place_sgd_rate

ROWS, COLS = 6, 3
TOLERANCE = 1e-6


def _gradients(count: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(ROWS, COLS, generator=generator) for _ in range(count)]


def _initial(seed: int = 1) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed))


def _torch_reference(
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], grads: Sequence[torch.Tensor]
) -> torch.Tensor:
    param = torch.nn.Parameter(_initial())
    optimizer = make([param])
    for grad in grads:
        param.grad = grad
        optimizer.step()
    return param.detach()


def _sparse_reference(
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    pushes: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    param = torch.nn.Parameter(_initial())
    optimizer = make([param])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "sparse invariant checks" notice
        for rows, values in pushes:
            param.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), values, (ROWS, COLS))
            optimizer.step()
    return param.detach()


def _sparse_pushes(count: int, seed: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random row subsets with duplicates, so coalescing is exercised."""
    generator = torch.Generator().manual_seed(seed)
    pushes = []
    for _ in range(count):
        rows = torch.randint(0, ROWS, (4,), generator=generator)
        rows[1] = rows[0]  # a guaranteed duplicate
        pushes.append((rows, torch.randn(4, COLS, generator=generator)))
    return pushes


DENSE_CASES = [
    ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ("SGD", {"lr": 0.1, "momentum": 0.5, "dampening": 0.1, "weight_decay": 0.01}),
    ("SGD", {"lr": 0.1, "weight_decay": 0.05}),
    ("Adagrad", {"lr": 0.1}),
    ("Adagrad", {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1, "weight_decay": 0.01}),
    ("Adam", {"lr": 0.01}),
    ("Adam", {"lr": 0.01, "betas": [0.8, 0.9], "amsgrad": True, "weight_decay": 0.01}),
    ("AdamW", {"lr": 0.01}),
    ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.9, "centered": True}),
    ("Adadelta", {}),
    ("Adamax", {"lr": 0.01}),
    ("NAdam", {"lr": 0.01}),
    ("RAdam", {"lr": 0.01}),
]


@pytest.mark.parametrize("name, kwargs", DENSE_CASES, ids=[f"{n}-{k}" for n, k in DENSE_CASES])
def test_dense_matches_torch_optim(name: str, kwargs: dict) -> None:
    grads = _gradients(5)
    torch_kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    expected = _torch_reference(lambda p: getattr(torch.optim, name)(p, **torch_kwargs), grads)
    value = _initial()
    optimizer = ShardOptimizer(OptimizerSpec(name, kwargs), value)
    for grad in grads:
        optimizer.apply_dense(grad)
    torch.testing.assert_close(value, expected, atol=TOLERANCE, rtol=0)
    assert not torch.equal(value, _initial()), "the shard's own tensor is updated in place"


def test_sparse_adam_matches_torch_sparse_adam() -> None:
    pushes = _sparse_pushes(6)
    expected = _sparse_reference(lambda p: torch.optim.SparseAdam(p, lr=0.05), pushes)
    value = _initial()
    optimizer = ShardOptimizer(OptimizerSpec("Adam", {"lr": 0.05}), value)
    for rows, values in pushes:
        optimizer.apply_rows(rows, values)
    torch.testing.assert_close(value, expected, atol=TOLERANCE, rtol=0)
    assert float(optimizer.slots()["step"]) == len(pushes)


def test_sparse_adagrad_matches_torch_sparse_adagrad() -> None:
    pushes = _sparse_pushes(6)
    kwargs = {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1}
    expected = _sparse_reference(lambda p: torch.optim.Adagrad(p, **kwargs), pushes)
    value = _initial()
    optimizer = ShardOptimizer(OptimizerSpec("Adagrad", kwargs), value)
    for rows, values in pushes:
        optimizer.apply_rows(rows, values)
    torch.testing.assert_close(value, expected, atol=TOLERANCE, rtol=0)


def test_sparse_sgd_matches_torch_sgd_with_sparse_gradient() -> None:
    pushes = _sparse_pushes(6)
    expected = _sparse_reference(lambda p: torch.optim.SGD(p, lr=0.1), pushes)
    value = _initial()
    optimizer = ShardOptimizer(OptimizerSpec("SGD", {"lr": 0.1}), value)
    for rows, values in pushes:
        optimizer.apply_rows(rows, values)
    torch.testing.assert_close(value, expected, atol=TOLERANCE, rtol=0)


def test_sparse_push_leaves_untouched_rows_and_slots_alone() -> None:
    value = _initial()
    optimizer = ShardOptimizer(OptimizerSpec("Adam", {"lr": 0.1}), value)
    optimizer.apply_dense(torch.ones(ROWS, COLS))
    before_value, before_slots = value.clone(), optimizer.slots()
    optimizer.apply_rows(torch.tensor([2, 4]), torch.ones(2, COLS))
    untouched = [0, 1, 3, 5]
    assert torch.equal(value[untouched], before_value[untouched])
    assert not torch.equal(value[[2, 4]], before_value[[2, 4]])
    slots = optimizer.slots()
    assert torch.equal(slots["exp_avg"][untouched], before_slots["exp_avg"][untouched])
    assert float(slots["step"]) == float(before_slots["step"]) + 1


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_sparse_push_of_every_row_equals_dense_step(name: str) -> None:
    # With every row pushed (in any order), lazy and dense updates coincide.
    grads = _gradients(4)
    dense_value, sparse_value = _initial(), _initial()
    dense = ShardOptimizer(OptimizerSpec(name, {}), dense_value)
    sparse = ShardOptimizer(OptimizerSpec(name, {}), sparse_value)
    order = torch.tensor([3, 0, 5, 1, 4, 2])
    for grad in grads:
        dense.apply_dense(grad)
        sparse.apply_rows(order, grad[order])
    torch.testing.assert_close(sparse_value, dense_value, atol=TOLERANCE, rtol=0)
    for key, slot in dense.slots().items():
        torch.testing.assert_close(sparse.slots()[key], slot, atol=TOLERANCE, rtol=0)


def test_dense_after_sparse_uses_the_scattered_state() -> None:
    value = _initial()
    optimizer = ShardOptimizer(OptimizerSpec("SGD", {"lr": 0.1, "momentum": 0.9}), value)
    optimizer.apply_rows(torch.tensor([1]), torch.ones(1, COLS))
    buffer = optimizer.slots()["momentum_buffer"]
    assert buffer.shape == (ROWS, COLS)
    assert torch.equal(buffer[1], torch.ones(COLS)) and torch.count_nonzero(buffer[[0, 2, 3, 4, 5]]) == 0
    optimizer.apply_dense(torch.ones(ROWS, COLS))
    assert torch.allclose(optimizer.slots()["momentum_buffer"][1], torch.full((COLS,), 1.9))


def test_slots_round_trip_continues_identically() -> None:
    grads = _gradients(6)
    spec = OptimizerSpec("Adam", {"lr": 0.01, "amsgrad": True})
    original_value = _initial()
    original = ShardOptimizer(spec, original_value)
    for grad in grads[:3]:
        original.apply_dense(grad)
    restored_value = original_value.clone()
    restored = ShardOptimizer(spec, restored_value, original.slots())
    assert set(original.slots()) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    for grad in grads[3:]:
        original.apply_dense(grad)
        restored.apply_dense(grad)
    assert torch.equal(restored_value, original_value)


def test_slots_are_copies() -> None:
    optimizer = ShardOptimizer(OptimizerSpec("Adagrad", {"lr": 0.1}), _initial())
    optimizer.slots()["sum"].fill_(123.0)
    assert float(optimizer.slots()["sum"].max()) == 0.0


def test_load_slots_rejects_wrong_slots_and_keeps_state() -> None:
    optimizer = ShardOptimizer(OptimizerSpec("Adam", {}), _initial())
    optimizer.apply_dense(torch.ones(ROWS, COLS))
    before = optimizer.slots()
    with pytest.raises(InvalidRequestError, match="exp_avg"):
        optimizer.load_slots({"exp_avg": before["exp_avg"]})
    with pytest.raises(ShapeMismatchError):
        optimizer.load_slots({**before, "exp_avg": torch.zeros(ROWS + 1, COLS)})
    with pytest.raises(DtypeMismatchError):
        optimizer.load_slots({**before, "exp_avg": torch.zeros(ROWS, COLS, dtype=torch.float64)})
    after = optimizer.slots()
    assert all(torch.equal(after[key], before[key]) for key in before)


def test_load_empty_slots_resets_state() -> None:
    optimizer = ShardOptimizer(OptimizerSpec("Adagrad", {"initial_accumulator_value": 0.5}), _initial())
    optimizer.apply_dense(torch.ones(ROWS, COLS))
    optimizer.load_slots({})
    assert torch.equal(optimizer.slots()["sum"], torch.full((ROWS, COLS), 0.5))


def test_set_hyperparameters_matches_changing_the_param_group() -> None:
    grads = _gradients(4)
    param = torch.nn.Parameter(_initial())
    reference = torch.optim.Adam([param], lr=0.01)
    value = _initial()
    optimizer = ShardOptimizer(OptimizerSpec("Adam", {"lr": 0.01}), value)
    for index, grad in enumerate(grads):
        if index == 2:
            reference.param_groups[0]["lr"] = 0.1
            optimizer.set_hyperparameters({"lr": 0.1})
        param.grad = grad
        reference.step()
        optimizer.apply_dense(grad)
    torch.testing.assert_close(value, param.detach(), atol=TOLERANCE, rtol=0)
    assert optimizer.spec.kwargs["lr"] == 0.1


@pytest.mark.parametrize(
    "values, match",
    [
        ({"momentum": 0.9}, "no hyperparameter"),
        ({"lr": -1.0}, "learning rate"),
        ({}, "no hyperparameters"),
        ({"fused": True}, "no hyperparameter"),
    ],
)
def test_set_hyperparameters_rejects_bad_values(values: dict, match: str) -> None:
    optimizer = ShardOptimizer(OptimizerSpec("Adam", {"lr": 0.01}), _initial())
    with pytest.raises(InvalidRequestError, match=match):
        optimizer.set_hyperparameters(values)
    assert optimizer.spec == OptimizerSpec("Adam", {"lr": 0.01})


def test_set_hyperparameters_refuses_to_change_existing_state_layout() -> None:
    optimizer = ShardOptimizer(OptimizerSpec("Adam", {}), _initial())
    optimizer.set_hyperparameters({"amsgrad": True})  # no state yet: fine
    optimizer.apply_dense(torch.ones(ROWS, COLS))
    with pytest.raises(InvalidRequestError, match="state"):
        optimizer.set_hyperparameters({"amsgrad": False})
    assert optimizer.spec.kwargs["amsgrad"] is True


def test_apply_checks_gradients() -> None:
    optimizer = ShardOptimizer(OptimizerSpec("SGD", {"lr": 0.1}), _initial())
    with pytest.raises(ShapeMismatchError):
        optimizer.apply_dense(torch.ones(ROWS + 1, COLS))
    with pytest.raises(DtypeMismatchError):
        optimizer.apply_dense(torch.ones(ROWS, COLS, dtype=torch.float64))
    with pytest.raises(IndexOutOfRangeError):
        optimizer.apply_rows(torch.tensor([ROWS]), torch.ones(1, COLS))
    with pytest.raises(InvalidRequestError):
        optimizer.apply_rows(torch.tensor([0], dtype=torch.int32), torch.ones(1, COLS))


def test_integer_shard_is_rejected() -> None:
    with pytest.raises(DtypeMismatchError, match="floating-point"):
        ShardOptimizer(OptimizerSpec("SGD", {"lr": 0.1}), torch.zeros(3, dtype=torch.int64))


class TestOptimizerSpec:
    def test_json_round_trip_and_equality(self) -> None:
        spec = OptimizerSpec.from_json("Adam", '{"lr": 0.01, "betas": [0.8, 0.9]}')
        assert spec == OptimizerSpec("Adam", {"betas": (0.8, 0.9), "lr": 0.01})
        assert spec.kwargs["betas"] == (0.8, 0.9)
        assert OptimizerSpec.from_json(spec.name, spec.to_json()) == spec
        assert hash(spec) == hash(OptimizerSpec("Adam", {"lr": 0.01, "betas": [0.8, 0.9]}))
        assert pickle.loads(pickle.dumps(spec)) == spec

    def test_empty_json_means_defaults(self) -> None:
        assert OptimizerSpec.from_json("SGD", "") == OptimizerSpec("SGD", {})

    def test_kwargs_are_frozen(self) -> None:
        kwargs = {"lr": 0.1}
        spec = OptimizerSpec("SGD", kwargs)
        kwargs["lr"] = 5.0
        assert spec.kwargs["lr"] == 0.1
        with pytest.raises(TypeError):
            spec.kwargs["lr"] = 1.0  # type: ignore[index]

    @pytest.mark.parametrize(
        "name, kwargs_json, match",
        [
            ("LBFGS", "{}", "unknown optimizer"),
            ("__import__('os')", "{}", "unknown optimizer"),
            ("SGD", "{not json", "not valid JSON"),
            ("SGD", "[1, 2]", "JSON object"),
            ("SGD", '{"lr": 0.1, "momentum": -1}', "momentum"),
            ("SGD", '{"lr": 0.1, "nesterov": true}', "Nesterov"),
            ("Adam", '{"lr": -0.1}', "learning rate"),
            ("Adam", '{"lr": NaN}', "finite"),
            ("Adam", '{"lr": "0.1"}', "number"),
            ("Adam", '{"momentum": 0.9}', "no argument 'momentum'"),
            ("Adam", '{"fused": true}', "drop 'fused'"),
            ("Adam", '{"foreach": true}', "drop 'foreach'"),
            ("Adam", '{"capturable": true}', "drop 'capturable'"),
            ("SGD", '{"differentiable": true}', "drop 'differentiable'"),
            ("Adam", '{"betas": {"a": 1}}', "numbers, booleans or lists"),
        ],
    )
    def test_rejects_bad_specs(self, name: str, kwargs_json: str, match: str) -> None:
        with pytest.raises(InvalidRequestError, match=match):
            OptimizerSpec.from_json(name, kwargs_json)

    def test_server_defaults_for_implementation_flags_are_accepted(self) -> None:
        OptimizerSpec("Adam", {"foreach": False, "fused": None, "differentiable": False}).validate()


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_grouped_steps_are_bit_for_bit_one_step_per_shard(name):
    from paramserve.psserver.store.optimizer import GroupedSteps

    spec = OptimizerSpec(name, {"lr": 0.05} if name != "Adadelta" else {})
    alone = [ShardOptimizer(spec, _initial(seed).clone()) for seed in range(3)]
    together = [ShardOptimizer(spec, _initial(seed).clone()) for seed in range(3)]
    grouped = GroupedSteps(capacity=1)
    for step, grads in enumerate(zip(_gradients(4, seed=1), _gradients(4, seed=2), _gradients(4, seed=3))):
        for optimizer, grad in zip(alone, grads):
            optimizer.apply_dense(grad)
        members = together if step % 2 == 0 else together[::-1]  # another group: evicts the first
        grouped.apply_dense(members, grads if step % 2 == 0 else grads[::-1])
    for one, other in zip(alone, together):
        assert torch.equal(one.value, other.value)
        assert one.slots().keys() == other.slots().keys()
        for key, slot in one.slots().items():
            assert torch.equal(slot, other.slots()[key]), key


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_grouped_row_steps_are_bit_for_bit_one_step_per_shard(name):
    """A push touching rows of several shards (a recommendation model's tables) steps them as
    one torch.optim step; each shard ends exactly as its own apply_rows leaves it."""
    from paramserve.psserver.store.optimizer import GroupedSteps

    spec = OptimizerSpec(name, {"lr": 0.05} if name != "Adadelta" else {})
    alone = [ShardOptimizer(spec, _initial(seed).clone()) for seed in range(3)]
    together = [ShardOptimizer(spec, _initial(seed).clone()) for seed in range(3)]
    generator = torch.Generator().manual_seed(7)
    rows_in_shard = alone[0].value.shape[0]
    for _ in range(4):
        rows = [torch.randint(0, rows_in_shard, (5,), generator=generator) for _ in alone]  # duplicates too
        grads = [torch.randn(5, *alone[0].value.shape[1:], generator=generator) for _ in alone]
        for optimizer, r, g in zip(alone, rows, grads):
            optimizer.apply_rows(r, g)
        GroupedSteps().apply_rows(together, rows, grads)
    for one, other in zip(alone, together):
        assert torch.equal(one.value, other.value)
        assert one.slots().keys() == other.slots().keys()
        for key, slot in one.slots().items():
            assert torch.equal(slot, other.slots()[key]), key


@pytest.mark.parametrize("name", ["Adagrad", "Adam", "SGD"])
def test_distinct_sorted_rows_step_exactly_as_the_same_rows_in_any_order(name):
    """A lookup's gradient arrives as distinct rows in order, and skips the sort and the sum."""
    spec = OptimizerSpec(name, {"lr": 0.05})
    ordered, shuffled = ShardOptimizer(spec, _initial().clone()), ShardOptimizer(spec, _initial().clone())
    rows = torch.tensor([0, 2, 3, 5])
    grads = torch.randn(4, *ordered.value.shape[1:], generator=torch.Generator().manual_seed(3))
    order = torch.tensor([2, 0, 3, 1])
    for _ in range(3):
        ordered.apply_rows(rows, grads)
        shuffled.apply_rows(rows[order], grads[order])
    assert torch.equal(ordered.value, shuffled.value)
    for key, slot in ordered.slots().items():
        assert torch.equal(slot, shuffled.slots()[key]), key


def test_a_grouped_row_step_with_a_bad_member_changes_no_shard():
    from paramserve.psserver.store.optimizer import GroupedSteps

    spec = OptimizerSpec("Adagrad", {"lr": 0.05})
    shards = [ShardOptimizer(spec, _initial(seed).clone()) for seed in range(2)]
    before = [s.value.clone() for s in shards]
    dim = shards[0].value.shape[1:]
    with pytest.raises(IndexOutOfRangeError):
        GroupedSteps().apply_rows(shards, [torch.tensor([0]), torch.tensor([10_000])], [torch.ones(1, *dim)] * 2)
    assert all(torch.equal(s.value, b) for s, b in zip(shards, before))
    assert all(not s.slots() or not s.slots()["sum"].any() for s in shards)


def test_only_stateless_sgd_is_stepped_as_an_in_place_add():
    assert in_place_sgd_rate(OptimizerSpec("SGD", {"lr": 0.25})) == 0.25
    assert in_place_sgd_rate(OptimizerSpec("SGD", {"lr": 0.25, "momentum": 0, "dampening": 0.1})) == 0.25
    assert (
        in_place_sgd_rate(OptimizerSpec("SGD", {}))
        == torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]).defaults["lr"]
    )
    for spec in (
        OptimizerSpec("SGD", {"lr": 0.25, "momentum": 0.9}),
        OptimizerSpec("SGD", {"lr": 0.25, "weight_decay": 0.1}),
        OptimizerSpec("SGD", {"lr": 0.25, "maximize": True}),
        OptimizerSpec("Adam", {"lr": 0.25}),
    ):
        assert in_place_sgd_rate(spec) is None, spec


@pytest.mark.parametrize("value", [10**400, -(10**30), float("inf"), float("nan")])
def test_arguments_beyond_a_float_or_an_int64_are_refused_by_name(value) -> None:
    """JSON integers are unbounded: one past what math.isfinite takes was an INTERNAL error."""
    with pytest.raises(InvalidRequestError, match="'lr'"):
        OptimizerSpec("SGD", {"lr": value}).validate()


@pytest.mark.parametrize("name", ["Adagrad", "Adam", "SGD"])
def test_a_step_without_torch_optims_profiling_wrapper_is_bit_for_bit_a_step(name):
    from paramserve.psserver.store.optimizer import step_without_profiling

    torch.manual_seed(0)
    start, grad = torch.randn(5, 3), torch.randn(5, 3)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    optimizers = [getattr(torch.optim, name)([p], lr=0.1) for p in (ours, theirs)]
    for _ in range(3):
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        step_without_profiling(optimizers[0])
        optimizers[1].step()
    assert torch.equal(ours, theirs)
    assert torch.is_grad_enabled(), "the grad mode the step sets is restored"
