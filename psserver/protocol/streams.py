"""Chunked tensor streams: the one mechanism every bulk RPC uses.

A stream is a sequence of *parts* (a PartHeader plus a payload of raw bytes),
cut into ``Chunk`` messages of at most ``chunk_bytes`` of data each, so no
message nears gRPC's receive limit or protobuf's 2 GiB ceiling.

Chunks are valid protobuf (``paramserve.wire.v1.Chunk``), but this module
writes and reads their two fields by hand: protobuf's Python runtime copies a
``bytes`` field on parse and on serialise, which measured 3-4x slower than the
raw bytes gRPC carries. Writing costs one copy of the data (the join), reading
none (a memoryview into the received message); anything not in the expected
layout is handed to protobuf itself, so other encoders interoperate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from google.protobuf.message import DecodeError

from paramserve.psserver.protocol.errors import InvalidRequestError
from paramserve.psserver.protocol.tensors import (
    as_byte_view,
    dtype_from_name,
    dtype_name,
    nbytes_of,
)
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2

DEFAULT_CHUNK_BYTES = 4 << 20
_HEADER_TAG = 0x0A  # field 1, wire type 2 (length-delimited)
_DATA_TAG = 0x12  # field 2, wire type 2
_EMPTY = memoryview(b"")

Allocator = Callable[[tensor_pb2.PartHeader], torch.Tensor]
"""Validates a part's header and returns a uint8 tensor of exactly payload_bytes to fill."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while pos < len(view) and shift < 64:
        byte = view[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
    raise ValueError("truncated varint")


def encode_chunk(header: bytes | None, data: memoryview | bytes = _EMPTY) -> bytes:
    """Serialises a Chunk: ``header`` is a serialised PartHeader or None."""
    pieces: list[bytes | memoryview] = []
    if header is not None:
        pieces += [bytes((_HEADER_TAG,)), _varint(len(header)), header]
    if len(data):
        pieces += [bytes((_DATA_TAG,)), _varint(len(data)), data]
    return b"".join(pieces)


def decode_chunk(raw: bytes | memoryview) -> tuple[tensor_pb2.PartHeader | None, memoryview]:
    """Parses a Chunk into (header or None, data view). Raises InvalidRequestError on garbage."""
    try:
        return _decode_fast(memoryview(raw))
    except (ValueError, IndexError):
        pass
    try:
        chunk = tensor_pb2.Chunk.FromString(bytes(raw))
    except DecodeError as err:
        raise InvalidRequestError(
            f"malformed chunk ({len(raw)} bytes): {err}; send paramserve.wire.v1.Chunk messages"
        ) from None
    return (chunk.header if chunk.HasField("header") else None), memoryview(chunk.data)


def _decode_fast(view: memoryview) -> tuple[tensor_pb2.PartHeader | None, memoryview]:
    header: tensor_pb2.PartHeader | None = None
    data = _EMPTY
    pos = 0
    seen: set[int] = set()
    while pos < len(view):
        tag = view[pos]
        if tag not in (_HEADER_TAG, _DATA_TAG) or tag in seen:
            raise ValueError("not the fast layout")  # protobuf parses the general case
        seen.add(tag)
        length, pos = _read_varint(view, pos + 1)
        end = pos + length
        if end > len(view):
            raise ValueError("truncated field")
        if tag == _HEADER_TAG:
            try:
                header = tensor_pb2.PartHeader.FromString(view[pos:end].tobytes())
            except DecodeError:
                raise ValueError("bad header") from None
        else:
            data = view[pos:end]
        pos = end
    return header, data


def encode_parts(
    parts: Iterable[tuple[tensor_pb2.PartHeader, Sequence[memoryview]]],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[bytes]:
    """Yields serialised Chunks for parts of (header, payload pieces).

    A payload may be several byte views (e.g. row indices then values) sent
    back to back; ``header.payload_bytes`` is set to their total.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    for header, pieces in parts:
        header.payload_bytes = sum(len(p) for p in pieces)
        pending: bytes | None = header.SerializeToString()
        for piece in pieces:
            for offset in range(0, len(piece), chunk_bytes):
                yield encode_chunk(pending, piece[offset : offset + chunk_bytes])
                pending = None
        if pending is not None:  # empty payload: the header travels alone
            yield encode_chunk(pending)


def byte_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor (no zero-fill: every byte is about to be written)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def read_parts(
    chunks: Iterable[bytes | memoryview], allocate: Allocator
) -> Iterator[tuple[tensor_pb2.PartHeader, torch.Tensor]]:
    """Reassembles parts from serialised Chunks, yielding (header, filled uint8 buffer).

    ``allocate`` sees each header before any of its payload is stored, so a
    receiver rejects a bad or oversized part before allocating for it.
    """
    header: tensor_pb2.PartHeader | None = None
    target: np.ndarray | None = None
    filled = 0
    buffer = byte_buffer(0)
    for raw in chunks:
        new_header, data = decode_chunk(raw)
        if new_header is not None:
            if header is not None:
                raise InvalidRequestError(f"part ended after {filled} of {header.payload_bytes} payload bytes")
            header, filled = new_header, 0
            if header.payload_bytes < 0:
                raise InvalidRequestError("payload_bytes must not be negative")
            buffer = allocate(header)
            if buffer.numel() != header.payload_bytes:
                raise InvalidRequestError("allocator returned a buffer of the wrong size")
            target = buffer.numpy()
        elif header is None:
            raise InvalidRequestError("a chunk with data arrived before any part header")
        end = filled + len(data)
        if end > header.payload_bytes:
            raise InvalidRequestError(
                f"part carries more than the {header.payload_bytes} payload bytes its header declares"
            )
        if len(data):
            target[filled:end] = np.frombuffer(data, dtype=np.uint8)  # type: ignore[index]
        filled = end
        if filled == header.payload_bytes:
            yield header, buffer
            header = None
    if header is not None:
        raise InvalidRequestError(f"stream ended after {filled} of {header.payload_bytes} payload bytes of a part")


# ---------------------------------------------------------------- a plan and one payload
#
# Exchanges under the unary limit travel as one message each way (a gRPC stream costs a
# thread and a message per chunk on both sides, which dominate a small model's step). Such
# a message is a protobuf plan (field 1) describing every part, then one bytes field
# (field 2) holding the parts' bytes back to back: one protobuf parse and one join per
# message, however many tensors it carries. Written with one copy of the tensor bytes (the
# join), read as a view into the received message.


def pack(plan: bytes, payload: Sequence[bytes | memoryview]) -> bytes:
    """A message of ``plan`` (a serialised message) as field 1 and ``payload``'s pieces,
    joined, as bytes field 2."""
    size = sum(len(p) for p in payload)
    return b"".join([bytes((_HEADER_TAG,)), _varint(len(plan)), plan, bytes((_DATA_TAG,)), _varint(size), *payload])


def unpack(raw: bytes | memoryview) -> tuple[memoryview, memoryview]:
    """(plan bytes, payload) of a packed message. Raises ValueError when ``raw`` is not the
    two fields in that layout (callers then let protobuf parse it)."""
    view = memoryview(raw)
    found: dict[int, memoryview] = {}
    pos = 0
    while pos < len(view):
        tag = view[pos]
        if tag not in (_HEADER_TAG, _DATA_TAG) or tag in found:
            raise ValueError("not the packed layout")
        length, pos = _read_varint(view, pos + 1)
        if pos + length > len(view):
            raise ValueError("truncated field")
        found[tag] = view[pos : pos + length]
        pos += length
    return found.get(_HEADER_TAG, _EMPTY), found.get(_DATA_TAG, _EMPTY)


def encode_step_request(plan: ps_pb2.StepPlan, payload: Sequence[memoryview]) -> bytes:
    """A StepRequest: ``plan`` and its push parts' bytes, in plan order."""
    return pack(plan.SerializeToString(), payload)


def decode_step_request(raw: bytes | memoryview) -> tuple[ps_pb2.StepPlan, memoryview]:
    """(plan, payload) of a StepRequest. Raises InvalidRequestError for garbage."""
    try:
        plan, payload = unpack(raw)
        return ps_pb2.StepPlan.FromString(plan.tobytes()), payload
    except (ValueError, IndexError, DecodeError):
        pass
    try:
        message = ps_pb2.StepRequest.FromString(bytes(raw))
    except DecodeError as err:
        raise InvalidRequestError(f"malformed StepRequest ({len(raw)} bytes): {err}") from None
    return message.plan, memoryview(message.payload)


def encode_step_reply(outcome: ps_pb2.StepOutcome, payload: Sequence[memoryview]) -> bytes:
    """A StepReply: the push's results and the pulled parts' headers, then their bytes."""
    return pack(outcome.SerializeToString(), payload)


def decode_step_reply(raw: bytes | memoryview) -> tuple[ps_pb2.StepOutcome, memoryview]:
    """(outcome, payload) of a StepReply."""
    try:
        outcome, payload = unpack(raw)
        return ps_pb2.StepOutcome.FromString(outcome.tobytes()), payload
    except (ValueError, IndexError, DecodeError):
        pass
    message = ps_pb2.StepReply.FromString(bytes(raw))
    return message.outcome, memoryview(message.payload)


def push_part_bytes(part: tensor_pb2.PushPart) -> int:
    """Payload bytes of a push part: its row indices (sparse) and its values."""
    return part.num_indices * 8 + meta_nbytes(part.values)


def meta_of(tensor: torch.Tensor) -> tensor_pb2.TensorMeta:
    return tensor_pb2.TensorMeta(dtype=dtype_name(tensor.dtype), shape=list(tensor.shape))


MAX_DIMS = 64
"""The most dimensions a tensor on the wire may have (torch's own limit)."""


def meta_nbytes(meta: tensor_pb2.TensorMeta) -> int:
    """Bytes of the tensor ``meta`` describes; raises InvalidRequestError for a shape that is not one."""
    if len(meta.shape) > MAX_DIMS:
        raise InvalidRequestError(f"a tensor shape has {len(meta.shape)} dimensions; at most {MAX_DIMS} are allowed")
    if any(dim < 0 for dim in meta.shape):
        raise InvalidRequestError(f"negative dimension in shape {tuple(meta.shape)}")
    return nbytes_of(meta.shape, dtype_from_name(meta.dtype))


def tensor_from_bytes(buffer: torch.Tensor, meta: tensor_pb2.TensorMeta, offset: int = 0) -> torch.Tensor:
    """Views ``meta``'s tensor inside a uint8 buffer at ``offset`` (no copy)."""
    dtype = dtype_from_name(meta.dtype)
    shape = tuple(int(d) for d in meta.shape)
    if any(d < 0 for d in shape):
        raise InvalidRequestError(f"negative dimension in shape {shape}")
    nbytes = nbytes_of(shape, dtype)
    if offset + nbytes > buffer.numel():
        raise InvalidRequestError(
            f"payload holds {buffer.numel() - offset} bytes but a {meta.dtype} tensor of shape {shape} needs {nbytes}"
        )
    return tensor_view(buffer, offset, nbytes, dtype, shape)


def tensor_view(
    buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """The ``dtype`` tensor of ``shape`` in ``buffer[offset : offset + nbytes]`` (uint8, checked by
    the caller): a view, or a copy where the bytes are not aligned for ``dtype`` (torch views
    need aligned storage)."""
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    piece = buffer[offset : offset + nbytes]
    if dtype.itemsize > 1 and piece.data_ptr() % dtype.itemsize:
        piece = piece.clone()
    return piece.view(dtype).reshape(shape)


def tensor_payload(tensor: torch.Tensor) -> memoryview:
    return as_byte_view(tensor)
