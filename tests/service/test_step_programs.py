"""Step programs on the data plane (psserver/steps/programs.py), against a real server over real
sockets: a recurring step is defined once and then run by number, with the same results,
exactly-once keys and checks as a whole plan; bad program frames get specific errors and change
nothing; a program follows its shards through a restore and refuses a deleted variable."""

from __future__ import annotations

import socket
import time

import grpc
import pytest
import torch

from paramserve.psserver.client.ps_client import ParameterServerClient
from paramserve.psserver.dataplane import frames as dataplane
from paramserve.psserver.dataplane.dataplane_client import ProgramNumbers
from paramserve.psserver.dataplane.frames import MAX_PROGRAMS
from paramserve.psserver.protocol.errors import NonFiniteGradientError, VariableNotFoundError
from paramserve.psserver.protocol.metadata import SERVICE_NAME
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.partition import FixedShardsPartitioner
from paramserve.psserver.protocol.streams import encode_step_request
from paramserve.psserver.protocol.types import ShardRef
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2
from paramserve.wire.v1 import tensor_pb2
from tests.service.test_dataplane_transport import FrameKind, admitted, error_of, frame, make_client, read_frame

__all__ = ["make_client"]  # the data-plane client fixture, not the transports matrix

SGD = OptimizerSpec("SGD", {"lr": 0.5})


def dense_part(variable: str, shape: list[int], base_version: int = -1) -> tensor_pb2.PushPart:
    return tensor_pb2.PushPart(
        ref=tensor_pb2.ShardRef(variable=variable, shard=0),
        values=tensor_pb2.TensorMeta(dtype="float32", shape=shape),
        base_version=base_version,
    )


def read_item(variable: str) -> ps_pb2.PullItem:
    return ps_pb2.PullItem(ref=tensor_pb2.ShardRef(variable=variable, shard=0))


def step(sock: socket.socket, plan: ps_pb2.StepPlan, payload: bytes = b"") -> tuple[FrameKind, bytes, bytes]:
    sock.sendall(frame(FrameKind.STEP, plan.SerializeToString(), payload))
    return read_frame(sock)


def outcome_of(reply: tuple[FrameKind, bytes, bytes]) -> ps_pb2.ProgramOutcome:
    kind, header, _ = reply
    assert kind is FrameKind.REPLY, error_of(header) if kind is FrameKind.ERROR else kind
    outcome = ps_pb2.StepOutcome.FromString(header)
    assert outcome.HasField("program") and not outcome.pushed and not outcome.pulled
    return outcome.program


def refused(reply: tuple[FrameKind, bytes, bytes], error_type: str, *words: str) -> None:
    kind, header, _ = reply
    assert kind is FrameKind.ERROR
    error = error_of(header)
    assert error.error_type == error_type, error
    for word in words:
        assert word in error.message, error.message


def data_plane_bytes(server) -> float:
    return (
        server.registry.get_sample_value("paramserve_received_bytes_total", {"role": "ps", "method": "DataPlaneStep"})
        or 0.0
    )


def serving_w(start_ps, make_client) -> tuple[ParameterServerClient, socket.socket]:
    """A server holding variable "w" (4 zeros, SGD lr 0.5): a client of it, and an admitted socket."""
    server = start_ps()
    client = make_client([server.address])
    client.create_variable("w", torch.zeros(4), optimizer=SGD)
    return client, admitted(server)


def test_a_program_is_defined_once_then_run_by_number_with_the_same_results(start_ps, make_client):
    server = start_ps()
    make_client([server.address]).create_variable("w", torch.zeros(4), optimizer=SGD)
    make_client([server.address]).create_variable("b", torch.zeros(2), optimizer=SGD)
    sock = admitted(server)
    define = ps_pb2.StepPlan(
        idempotency_key="k1",
        define_program=3,
        push=[dense_part("w", [4]), dense_part("b", [2])],
        pull=[read_item("b"), read_item("w")],
    )
    payload = torch.cat([torch.ones(4), torch.full((2,), 2.0)]).numpy().tobytes()

    first = step(sock, define, payload)
    second = step(sock, ps_pb2.StepPlan(idempotency_key="k2", run_program=3, base_versions=[1, 1]), payload)
    kind, header, pulled = second

    assert list(outcome_of(first).applied) == [True, True] and list(outcome_of(first).versions) == [1, 1]
    run = outcome_of(second)
    assert list(run.applied) == [True, True] and list(run.versions) == [2, 2] and list(run.staleness) == [0, 0]
    assert list(run.pulled_versions) == [2, 2]
    values = torch.frombuffer(bytearray(pulled), dtype=torch.float32)
    assert torch.equal(values, torch.tensor([-2.0, -2.0, -1.0, -1.0, -1.0, -1.0]))  # b then w, as read
    assert len(header) < 40  # the run's reply names no shard


def test_a_run_repeating_a_key_is_answered_without_applying_again(start_ps, make_client):
    client, sock = serving_w(start_ps, make_client)
    payload = torch.ones(4).numpy().tobytes()
    step(sock, ps_pb2.StepPlan(idempotency_key="once", define_program=1, push=[dense_part("w", [4])]), payload)

    again = outcome_of(step(sock, ps_pb2.StepPlan(idempotency_key="once", run_program=1), payload))

    assert list(again.applied) == [False] and list(again.versions) == [1]
    assert torch.equal(client.pull(["w"]).tensors["w"], torch.full((4,), -0.5))


def test_bad_program_frames_get_specific_errors_and_change_nothing(start_ps, make_client):
    client, sock = serving_w(start_ps, make_client)
    ones = torch.ones(4).numpy().tobytes()

    undefined = step(sock, ps_pb2.StepPlan(idempotency_key="k", run_program=7), ones)
    out_of_range = step(
        sock, ps_pb2.StepPlan(idempotency_key="k", define_program=MAX_PROGRAMS + 1, push=[dense_part("w", [4])]), ones
    )
    sparse = step(
        sock,
        ps_pb2.StepPlan(
            idempotency_key="k",
            define_program=1,
            pull=[ps_pb2.PullItem(ref=tensor_pb2.ShardRef(variable="w", shard=0), sparse=True, row_indices=b"")],
        ),
    )
    both = step(
        sock, ps_pb2.StepPlan(idempotency_key="k", define_program=1, run_program=1, push=[dense_part("w", [4])]), ones
    )
    defined = outcome_of(step(sock, ps_pb2.StepPlan(define_program=2, pull=[read_item("w")])))  # a read-only program
    with_parts = step(sock, ps_pb2.StepPlan(idempotency_key="k", run_program=2, push=[dense_part("w", [4])]), ones)
    short = step(sock, ps_pb2.StepPlan(idempotency_key="k", run_program=2), ones)
    step(
        sock,
        ps_pb2.StepPlan(idempotency_key="k0", define_program=5, push=[dense_part("w", [4])]),
        torch.zeros(4).numpy().tobytes(),
    )
    versions = step(sock, ps_pb2.StepPlan(idempotency_key="k", run_program=5, base_versions=[0, 0]), ones)
    no_key = step(sock, ps_pb2.StepPlan(run_program=5), ones)

    refused(undefined, "InvalidRequestError", "program 7 is not defined", "define_program=7")
    refused(out_of_range, "InvalidRequestError", f"1..{MAX_PROGRAMS}")
    refused(sparse, "InvalidRequestError", "whole shards only")
    refused(both, "InvalidRequestError", "not both")
    assert list(defined.pulled_versions) == [0]
    refused(with_parts, "InvalidRequestError", "defined with define_program")
    refused(short, "InvalidRequestError", "16 bytes", "pushes 0")
    refused(versions, "InvalidRequestError", "2 base versions", "1 push parts")
    refused(no_key, "InvalidRequestError", "idempotency key")
    assert client.pull(["w"]).versions == {ShardRef("w", 0): 1}  # only program 5's zeros applied
    assert torch.equal(client.pull(["w"]).tensors["w"], torch.zeros(4))
    assert outcome_of(step(sock, ps_pb2.StepPlan(idempotency_key="k9", run_program=5), ones)).applied == [True]


def test_a_non_finite_gradient_in_a_program_names_its_variable_and_applies_nothing(start_ps, make_client):
    server = start_ps()
    client = make_client([server.address])
    client.create_variable("w", torch.zeros(4), optimizer=SGD)
    client.create_variable("b", torch.zeros(2), optimizer=SGD)
    sock = admitted(server)
    plan = ps_pb2.StepPlan(idempotency_key="k1", define_program=1, push=[dense_part("w", [4]), dense_part("b", [2])])
    outcome_of(step(sock, plan, torch.zeros(6).numpy().tobytes()))
    poisoned = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, float("nan")])

    reply = step(sock, ps_pb2.StepPlan(idempotency_key="k2", run_program=1), poisoned.numpy().tobytes())

    refused(reply, "NonFiniteGradientError", "NaN")
    assert error_of(reply[1]).variable == "b"
    assert client.pull(["w", "b"]).versions == {ShardRef("w", 0): 1, ShardRef("b", 0): 1}


def test_a_program_follows_a_restore_and_refuses_a_deleted_variable(start_ps, make_client):
    server = start_ps()
    trainer = make_client([server.address])
    trainer.create_variable("w", torch.zeros(6, 2), optimizer=SGD, partitioner=FixedShardsPartitioner(2))
    for number in range(3):  # defines the program, then runs it
        trainer.push_and_pull({"w": torch.ones(6, 2)}, ["w"], key=f"k{number}")
    admin = make_client([server.address])
    saved = admin.export()
    trainer.push_and_pull({"w": torch.ones(6, 2)}, ["w"], key="k3")

    admin.load_states(saved, replace=True)  # back to 3 steps: the program's shards are new objects
    _, restored = trainer.push_and_pull({"w": torch.ones(6, 2)}, ["w"], key="k4")
    admin.delete_variable("w")

    assert torch.equal(restored.tensors["w"], torch.full((6, 2), -2.0))
    assert set(restored.versions.values()) == {4}
    with pytest.raises(VariableNotFoundError) as raised:
        trainer.push_and_pull({"w": torch.ones(6, 2)}, ["w"], key="k5")
    assert raised.value.variable == "w"


def test_a_client_trains_through_programs_exactly_as_through_whole_plans(start_ps, make_client):
    server = start_ps()
    torch.manual_seed(0)
    start = {"w": torch.randn(8, 3), "b": torch.randn(3)}
    fast, plain = make_client([server.address]), make_client([server.address], data_plane=False)
    for name, value in start.items():
        fast.create_variable(name, value, optimizer=SGD, partitioner=FixedShardsPartitioner(2))
        plain.create_variable(f"{name}_plain", value, optimizer=SGD, partitioner=FixedShardsPartitioner(2))
    gradients = [{"w": torch.randn(8, 3), "b": torch.randn(3)} for _ in range(5)]

    received = []
    for index, gradient in enumerate(gradients):
        before = data_plane_bytes(server)
        _, by_program = fast.push_and_pull(gradient, ["w", "b"], key=f"f{index}")
        received.append(data_plane_bytes(server) - before)
        _, by_plan = plain.push_and_pull(
            {f"{n}_plain": g for n, g in gradient.items()}, ["w_plain", "b_plain"], key=f"p{index}"
        )
        assert torch.equal(by_program.tensors["w"], by_plan.tensors["w_plain"])
        assert torch.equal(by_program.tensors["b"], by_plan.tensors["b_plain"])
        assert set(by_program.versions.values()) == {index + 1}

    assert len(set(received[1:])) == 1 and received[1] < received[0] - 100  # runs send no parts or reads
    with pytest.raises(NonFiniteGradientError):
        fast.push({"w": torch.full((8, 3), float("inf")), "b": torch.zeros(3)}, key="bad")
    assert set(fast.pull(["w"]).versions.values()) == {5}


def test_a_step_too_large_for_a_program_is_refused_as_one_and_sent_whole(start_ps, make_client, monkeypatch):
    monkeypatch.setattr(dataplane, "MAX_PROGRAM_ENTRIES", 2)
    client, sock = serving_w(start_ps, make_client)
    client.create_variable("b", torch.zeros(2), optimizer=SGD)
    plan = ps_pb2.StepPlan(
        idempotency_key="k", define_program=1, push=[dense_part("w", [4]), dense_part("b", [2])], pull=[read_item("w")]
    )

    refused(step(sock, plan, torch.zeros(6).numpy().tobytes()), "InvalidRequestError", "at most 2", "plain StepPlan")
    _, pulled = client.push_and_pull({"w": torch.ones(4), "b": torch.ones(2)}, ["w", "b"], key="k1")

    assert torch.equal(pulled.tensors["w"], torch.full((4,), -0.5)) and torch.equal(
        pulled.tensors["b"], torch.full((2,), -0.5)
    )


def test_the_step_rpc_refuses_program_fields(start_ps):
    server = start_ps()
    plan = ps_pb2.StepPlan(idempotency_key="k", define_program=1, pull=[read_item("w")])
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(f"/{SERVICE_NAME}/Step")

        with pytest.raises(grpc.RpcError) as raised:
            call(encode_step_request(plan, []), timeout=10)

    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "data plane only" in (raised.value.details() or "")


def test_program_numbers_are_reused_least_recently_used_first():
    numbers = ProgramNumbers()
    signatures = [("step", index) for index in range(MAX_PROGRAMS + 2)]
    for signature in signatures[:MAX_PROGRAMS]:
        number, defined = numbers.number(signature)
        numbers.defined(signature, number)
    assert numbers.number(signatures[0]) == (1, True)  # used again: now the most recent

    assert numbers.number(signatures[MAX_PROGRAMS]) == (2, False)  # signature 1 was least recent
    assert numbers.number(signatures[1]) == (3, False)  # evicted, so it is defined again, elsewhere
    numbers.defined(signatures[1], 2)  # an answer for a number it no longer has changes nothing
    assert numbers.number(signatures[1]) == (3, False)


def test_a_started_exchange_is_applied_while_the_caller_computes_and_an_abandoned_one_at_most_once(
    start_ps, make_client
):
    """start_push_and_pull returns once the requests are sent; the server applies them meanwhile.
    An exchange dropped unread leaves its push applied or not, and the retry under its key
    applies it at most once, on a fresh connection."""
    servers = [start_ps(), start_ps()]
    client = make_client([s.address for s in servers])
    client.create_variable("w", torch.zeros(8), optimizer=SGD, partitioner=FixedShardsPartitioner(2))
    out = torch.empty(8)

    def versions() -> dict[ShardRef, int]:
        return {info.ref: info.version for infos in client.list_shards().values() for info in infos}

    pending = client.start_push_and_pull({"w": torch.ones(8)}, ["w"], key="k1", out={"w": out})
    deadline = time.monotonic() + 10
    while versions() != {ShardRef("w", 0): 1, ShardRef("w", 1): 1}:  # applied before its replies are read
        assert time.monotonic() < deadline and not pending.done
        time.sleep(0.01)
    summary, pulled = pending.result()
    assert summary.applied == 2 and pulled.tensors["w"] is out
    assert torch.equal(out, torch.full((8,), -0.5)) and pending.done

    dropped = client.start_push_and_pull({"w": torch.ones(8)}, ["w"], key="k2", out={"w": out})
    dropped.abandon()
    dropped.abandon()  # once only
    again, _ = client.push_and_pull({"w": torch.ones(8)}, ["w"], key="k2", out={"w": out})
    assert again.applied + again.duplicates == 2
    assert torch.equal(out, torch.full((8,), -1.0)), "k2 applied once on each shard, whichever call applied it"
    assert versions() == {ShardRef("w", 0): 2, ShardRef("w", 1): 2}
