"""Initial values the servers fill in themselves (psserver/protocol/initializers.py): each kind, seeded,
and bad arguments refused before anything is allocated."""

from __future__ import annotations

import pytest
import torch

from paramserve.psserver.protocol.errors import InvalidRequestError, ShapeMismatchError
from paramserve.psserver.protocol.initializers import initial_value


def test_initial_value_kinds() -> None:
    assert torch.equal(initial_value((2, 2), torch.float32, "zeros"), torch.zeros(2, 2))
    assert torch.equal(initial_value((2,), torch.int64, "ones"), torch.ones(2, dtype=torch.int64))
    assert torch.equal(
        initial_value((3,), torch.float64, "constant", a=2.5), torch.full((3,), 2.5, dtype=torch.float64)
    )
    uniform = initial_value((1000,), torch.float32, "uniform", a=-1.0, b=2.0, seed=3)
    assert float(uniform.min()) >= -1.0 and float(uniform.max()) < 2.0
    normal = initial_value((10000,), torch.float32, "normal", a=5.0, b=0.1, seed=3)
    assert abs(float(normal.mean()) - 5.0) < 0.01


def test_initial_value_is_seeded() -> None:
    first = initial_value((5, 4), torch.float32, "normal", 0.0, 1.0, seed=7)
    assert torch.equal(first, initial_value((5, 4), torch.float32, "normal", 0.0, 1.0, seed=7))
    assert not torch.equal(first, initial_value((5, 4), torch.float32, "normal", 0.0, 1.0, seed=8))


@pytest.mark.parametrize(
    "args",
    [
        ((2,), torch.float32, "xavier"),
        ((2,), torch.int64, "normal"),
        ((2,), torch.float32, "normal", 0.0, -1.0),
        ((2,), torch.float32, "uniform", 1.0, 0.0),
        ((2,), torch.float32, "constant", float("nan")),
        ((-1,), torch.float32, "zeros"),
    ],
)
def test_initial_value_rejects_bad_arguments(args: tuple) -> None:
    with pytest.raises((InvalidRequestError, ShapeMismatchError)):
        initial_value(*args)
