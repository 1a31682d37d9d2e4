"""Initial values that the servers fill in themselves (an ``Initializer`` on the wire), so that a
huge table never crosses the wire.

Apart from the store because the one translation of shard parts (psserver/protocol/convert.py), which
clients load too, builds them, and a client loads none of the server's modules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from paramserve.psserver.protocol.errors import InvalidRequestError
from paramserve.psserver.protocol.tensors import check_shape, dtype_name

__all__ = ["INITIALIZER_KINDS", "initial_value"]

INITIALIZER_KINDS = ("zeros", "ones", "constant", "normal", "uniform")


def initial_value(
    shape: Sequence[int], dtype: torch.dtype, kind: str, a: float = 0.0, b: float = 1.0, seed: int = 0
) -> Tensor:
    """A new tensor filled on the server, so a huge table never crosses the wire.

    ``kind``: "zeros", "ones", "constant" (value ``a``), "normal" (mean ``a``,
    std ``b``) or "uniform" (in ``[a, b)``); random kinds draw from a
    ``torch.Generator`` seeded with ``seed`` (give each shard its own seed).
    Raises InvalidRequestError for an unknown kind or bad arguments.
    """
    check_shape(shape, "shape")
    dtype_name(dtype)  # DtypeMismatchError for an unsupported dtype
    if kind not in INITIALIZER_KINDS:
        raise InvalidRequestError(f"unknown initializer {kind!r}; use one of {', '.join(INITIALIZER_KINDS)}")
    if not (math.isfinite(a) and math.isfinite(b)):
        raise InvalidRequestError(f"initializer arguments must be finite, got a={a}, b={b}")
    if kind == "zeros":
        return torch.zeros(tuple(shape), dtype=dtype)
    if kind == "ones":
        return torch.ones(tuple(shape), dtype=dtype)
    if kind == "constant":
        return torch.full(tuple(shape), a, dtype=dtype)
    return _random_value(tuple(shape), dtype, kind, a, b, seed)


def _random_value(shape: tuple[int, ...], dtype: torch.dtype, kind: str, a: float, b: float, seed: int) -> Tensor:
    if not dtype.is_floating_point:
        raise InvalidRequestError(f"a {kind} initializer needs a floating-point dtype, not {dtype_name(dtype)}")
    if kind == "normal" and b < 0:
        raise InvalidRequestError(f"a normal initializer needs std b >= 0, got {b}")
    if kind == "uniform" and a > b:
        raise InvalidRequestError(f"a uniform initializer needs a <= b, got a={a}, b={b}")
    generator = torch.Generator().manual_seed(int(seed))
    tensor = torch.empty(shape, dtype=dtype)
    if kind == "normal":
        return tensor.normal_(a, b, generator=generator)
    return tensor.uniform_(a, b, generator=generator)
