"""Tensor <-> bytes without copies beyond the one the wire needs, and dtype names.

Tensors cross the wire as raw little-endian bytes plus (dtype name, shape);
never as pickles or repeated floats.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from paramserve.psserver.protocol.errors import DtypeMismatchError, InvalidRequestError, ShapeMismatchError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little endian
    raise ImportError("paramserve's wire format is little endian; this host is not")


def dtype_from_name(name: str) -> torch.dtype:
    """Returns the torch dtype called ``name`` ("float32", ...), or raises DtypeMismatchError."""
    try:
        return DTYPES[name]
    except KeyError:
        raise DtypeMismatchError(f"unsupported dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise DtypeMismatchError(f"unsupported dtype {dtype}; use one of {', '.join(DTYPES)}") from None


def check_shape(shape: Sequence[int], what: str) -> None:
    """Raises ShapeMismatchError naming ``what`` unless every dimension is an int >= 0."""
    if not all(isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 for dim in shape):
        raise ShapeMismatchError(f"{what} must be non-negative ints, got {tuple(shape)}")


def nbytes_of(shape: Sequence[int], dtype: torch.dtype) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * dtype.itemsize


def as_byte_view(tensor: torch.Tensor) -> memoryview:
    """A read-only byte view of a CPU tensor's memory (copies only if it is not contiguous)."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer


def writable_byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (where a socket receives into)."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("writable_byte_view needs a contiguous CPU tensor")
    if tensor.numel() == 0:
        return memoryview(bytearray())
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def tensor_from_buffer(buffer: bytearray | memoryview, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor over ``buffer`` (no copy; the tensor keeps the buffer alive).

    Raises InvalidRequestError when the buffer's size does not match dtype and shape.
    """
    expected = nbytes_of(shape, dtype)
    if len(buffer) != expected:
        raise InvalidRequestError(
            f"payload has {len(buffer)} bytes but a {dtype_name(dtype)} tensor of shape {tuple(shape)} needs {expected}"
        )
    if expected == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(tuple(shape))


def strictly_increasing(values: torch.Tensor) -> bool:
    """Whether a 1-d tensor's values are sorted with no repeats (one pass, no sort): a lookup's
    distinct rows arrive so, and then need no ``torch.unique``."""
    return values.numel() < 2 or bool((values[1:] > values[:-1]).all())
