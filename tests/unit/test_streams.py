"""The wire's hand-written encodings agree with protobuf's (pure logic, no gRPC)."""

from __future__ import annotations

import pytest
import torch

from paramserve.psserver.protocol.errors import InvalidRequestError
from paramserve.psserver.protocol.streams import (
    decode_chunk,
    decode_step_reply,
    decode_step_request,
    encode_parts,
    encode_step_reply,
    encode_step_request,
    meta_of,
    read_parts,
    tensor_payload,
)
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2


def _plan() -> tuple[ps_pb2.StepPlan, list[memoryview]]:
    grads = [torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.ones(5, dtype=torch.float64)]
    plan = ps_pb2.StepPlan(
        idempotency_key="key-1", pull=[ps_pb2.PullItem(ref=tensor_pb2.ShardRef(variable="b", shard=1))]
    )
    for index, grad in enumerate(grads):
        plan.push.append(
            tensor_pb2.PushPart(ref=tensor_pb2.ShardRef(variable=f"v{index}", shard=0), values=meta_of(grad))
        )
    return plan, [tensor_payload(g) for g in grads]


def test_a_packed_step_request_is_the_protobuf_message():
    plan, payload = _plan()
    raw = encode_step_request(plan, payload)
    parsed = ps_pb2.StepRequest.FromString(raw)
    assert parsed.plan == plan
    assert parsed.payload == b"".join(bytes(p) for p in payload)


def test_a_step_request_written_by_protobuf_decodes_the_same():
    plan, payload = _plan()
    joined = b"".join(bytes(p) for p in payload)
    # protobuf may write the fields in another order; a merge of two messages is also valid
    raw = ps_pb2.StepRequest(payload=joined).SerializeToString() + ps_pb2.StepRequest(plan=plan).SerializeToString()
    decoded_plan, decoded_payload = decode_step_request(raw)
    assert decoded_plan == plan
    assert bytes(decoded_payload) == joined


def test_a_step_reply_round_trips():
    outcome = ps_pb2.StepOutcome(
        pushed=[ps_pb2.PushResult(ref=tensor_pb2.ShardRef(variable="v", shard=0), applied=True, version=3)]
    )
    value = torch.randn(4, 2)
    outcome.pulled.append(tensor_pb2.PulledPart(item=0, meta=meta_of(value), version=3))
    decoded, payload = decode_step_reply(encode_step_reply(outcome, [tensor_payload(value)]))
    assert decoded == outcome
    assert torch.equal(torch.frombuffer(bytearray(payload), dtype=torch.float32).reshape(4, 2), value)


def test_garbage_is_an_invalid_request_naming_the_message():
    with pytest.raises(InvalidRequestError, match="malformed StepRequest"):
        decode_step_request(b"\x0a\xff\xff\xff\x0f garbage")


def test_chunked_parts_reassemble_across_chunk_boundaries():
    value = torch.arange(1000, dtype=torch.int64)
    part = tensor_pb2.PartHeader(pulled=tensor_pb2.PulledPart(item=0, meta=meta_of(value)))
    chunks = list(encode_parts([(part, [tensor_payload(value)])], chunk_bytes=3000))
    assert len(chunks) == 3
    assert decode_chunk(chunks[1])[0] is None  # only the first chunk carries the header
    [(header, buffer)] = list(read_parts(chunks, lambda h: torch.empty(h.payload_bytes, dtype=torch.uint8)))
    assert header.payload_bytes == 8000
    assert torch.equal(buffer.view(torch.int64), value)
