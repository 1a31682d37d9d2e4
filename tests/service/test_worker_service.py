"""The worker service over real gRPC: a worker and a parameter server on port 0 in this process."""

from __future__ import annotations

import os
import threading

import cloudpickle
import grpc
import pytest
import torch
from torch import nn

from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.partition import FixedShardsPartitioner
from paramserve.psserver.protocol.types import ClusterContext
from paramserve.psserver.runtime.security import bearer_metadata
from paramserve.wire.v1 import cluster_pb2, worker_pb2, worker_pb2_grpc
from paramserve.worker.closure_pickling import dumps_closure
from paramserve.worker.core import ClosureRequest
from paramserve.worker.layers import ServerOptimizer, mark_variable
from paramserve.worker.messages import outcome_from_proto, request_to_proto
from paramserve.worker.server import WorkerConfig, build_worker
from paramserve.worker.servicer import SERVICE_NAME

SGD = OptimizerSpec("SGD", {"lr": 0.5})
TOKEN = "worker-secret"


def answer() -> int:
    return 6 * 7


def descend(weight: torch.Tensor, optimizer: ServerOptimizer) -> float:
    loss = (weight**2).sum()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


CLOSURE_ENTERED = threading.Event()
CLOSURE_GATE = threading.Event()


def wait_at_gate() -> bool:
    """Holds the worker busy until the test opens the gate (in-process: same module globals)."""
    CLOSURE_ENTERED.set()
    return CLOSURE_GATE.wait(timeout=30)


def failing_user_code() -> None:
    raise KeyError("no such feature")


@pytest.fixture
def start_worker():
    started = []

    def start(**overrides: object):
        options = {
            "host": "127.0.0.1",
            "port": 0,
            "max_workers": 4,
            "ps_call_timeout": 10.0,
            "ps_retry_deadline": 10.0,
            **overrides,
        }
        worker = build_worker(WorkerConfig(**options))  # type: ignore[arg-type]
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop(grace=0)


class OneClosure:
    """``RunClosures`` with a batch of one, answering that closure's response (as RunClosure would)."""

    def __init__(self, multicallable):
        self._call = multicallable

    def __call__(self, request, **kwargs):
        return self._call(worker_pb2.RunClosuresRequest(closures=[request]), **kwargs).results[0]

    def future(self, request, **kwargs):
        future = self._call.future(worker_pb2.RunClosuresRequest(closures=[request]), **kwargs)
        return type("OneResult", (), {"done": future.done, "result": lambda self: future.result().results[0]})()


class WorkerStubOfOne:
    def __init__(self, channel):
        stub = worker_pb2_grpc.WorkerStub(channel)
        self.RunClosure, self.RunClosures, self.GetInfo = OneClosure(stub.RunClosures), stub.RunClosures, stub.GetInfo


@pytest.fixture
def stub_for():
    channels = []

    def make(worker) -> WorkerStubOfOne:
        channel = grpc.insecure_channel(worker.address)
        channels.append(channel)
        return WorkerStubOfOne(channel)

    yield make
    for channel in channels:
        channel.close()


NO_VARIABLES = ClusterContext()


def run_request(fn, *args, closure_id="c1", cluster=NO_VARIABLES) -> worker_pb2.RunClosureRequest:
    request = ClosureRequest(
        closure_id=closure_id, payload=dumps_closure((fn, args, {})), function_name=fn.__name__, cluster=cluster
    )
    return request_to_proto(request)


def test_run_closure_round_trip(start_worker, stub_for):
    stub = stub_for(start_worker())

    response = stub.RunClosure(run_request(answer), timeout=30)

    outcome = outcome_from_proto(response)
    assert outcome.error is None
    assert cloudpickle.loads(outcome.result) == 42


def test_a_training_closure_updates_the_parameter_server(start_worker, stub_for, start_ps, make_client):
    ps = start_ps()
    client = make_client([ps.address])
    client.create_variable("w", torch.ones(3), optimizer=SGD)
    weight = nn.Parameter(torch.zeros(3))
    mark_variable(weight, "w")
    optimizer = ServerOptimizer(["w"], "SGD", {"lr": 0.5})
    cluster = ClusterContext(client.addresses, client.layouts)
    stub = stub_for(start_worker())

    outcome = outcome_from_proto(stub.RunClosure(run_request(descend, weight, optimizer, cluster=cluster), timeout=30))

    assert outcome.error is None and cloudpickle.loads(outcome.result) == 3.0
    assert outcome.pushes_applied == 1
    torch.testing.assert_close(client.pull(["w"]).tensors["w"], torch.zeros(3))  # 1 - 0.5 * 2


def test_user_errors_come_back_as_outcomes_not_status_codes(start_worker, stub_for):
    stub = stub_for(start_worker())

    outcome = outcome_from_proto(stub.RunClosure(run_request(failing_user_code), timeout=30))

    assert outcome.result is None and outcome.error is not None
    assert outcome.error.type == "builtins.KeyError"
    assert "failing_user_code" in outcome.error.traceback


def test_get_info_reports_the_incarnation_that_ran_the_closure(start_worker, stub_for):
    worker = start_worker()
    stub = stub_for(worker)

    response = stub.RunClosure(run_request(answer), timeout=30)
    info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=30)

    assert info.incarnation == response.worker_incarnation == worker.core.incarnation
    assert info.pid == os.getpid()
    assert info.closures_run == 1
    other = start_worker()
    assert stub_for(other).GetInfo(worker_pb2.GetInfoRequest(), timeout=30).incarnation != info.incarnation


def test_get_info_answers_while_a_closure_runs(start_worker, stub_for):
    stub = stub_for(start_worker())
    CLOSURE_ENTERED.clear()
    CLOSURE_GATE.clear()
    running = stub.RunClosure.future(run_request(wait_at_gate), timeout=30)
    try:
        assert CLOSURE_ENTERED.wait(timeout=30)
        info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
        assert info.closures_run == 0 and not running.done()
    finally:
        CLOSURE_GATE.set()
    assert cloudpickle.loads(running.result().result) is True
    assert stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5).closures_run == 1


def test_token_is_required_when_set(start_worker, stub_for):
    stub = stub_for(start_worker(token=TOKEN))

    with pytest.raises(grpc.RpcError) as missing:
        stub.RunClosure(run_request(answer), timeout=30)
    with pytest.raises(grpc.RpcError) as wrong:
        stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=30, metadata=[("authorization", "Bearer nope")])
    response = stub.RunClosure(run_request(answer), timeout=30, metadata=[bearer_metadata(TOKEN)])

    assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert cloudpickle.loads(response.result) == 42


def test_malformed_requests_get_invalid_argument_and_the_server_stays_up(start_worker, stub_for):
    worker = start_worker()
    stub = stub_for(worker)
    with grpc.insecure_channel(worker.address) as channel:
        raw_run = channel.unary_unary(f"/{SERVICE_NAME}/RunClosures")
        with pytest.raises(grpc.RpcError) as garbage:
            raw_run(b"\xff\xff\xff\xff", timeout=30)
    bad_cluster = cluster_pb2.ClusterContext(  # a shard on a server the cluster does not have
        parameter_servers=["127.0.0.1:1"],
        variables=[
            cluster_pb2.VariableLayout(
                name="w",
                shape=[2],
                dtype="float32",
                shards=[cluster_pb2.ShardPlacement(index=0, server=3, row_start=0, num_rows=2)],
            )
        ],
    )
    requests = [
        worker_pb2.RunClosureRequest(payload=b"x"),  # no closure_id
        worker_pb2.RunClosureRequest(closure_id="c", payload=b"x", steps=-2),
        worker_pb2.RunClosureRequest(closure_id="c", payload=b"x", cluster=bad_cluster),
    ]
    codes = []
    for request in requests:
        with pytest.raises(grpc.RpcError) as caught:
            stub.RunClosure(request, timeout=30)
        codes.append(caught.value.code())

    assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=30).closures_run == 0
    assert cloudpickle.loads(stub.RunClosure(run_request(answer), timeout=30).result) == 42
    rpcs = worker.registry.get_sample_value(
        "paramserve_rpcs_total", {"role": "worker", "method": "RunClosures", "code": "INVALID_ARGUMENT"}
    )
    assert rpcs == 4.0


def test_stop_leaves_no_worker_threads(start_ps, make_client):
    client = make_client([start_ps().address, start_ps().address])  # two servers: the client fans out
    client.create_variable("w", torch.ones(3), optimizer=SGD, partitioner=FixedShardsPartitioner(2))
    weight = nn.Parameter(torch.zeros(3))
    mark_variable(weight, "w")
    cluster = ClusterContext(client.addresses, client.layouts)
    before = set(threading.enumerate())
    worker = build_worker(WorkerConfig(port=0, max_workers=2))
    with grpc.insecure_channel(worker.address) as channel:
        stub = WorkerStubOfOne(channel)
        assert stub.RunClosure(
            run_request(descend, weight, ServerOptimizer(["w"], "SGD", {}), cluster=cluster), timeout=30
        ).HasField("result")
    started = {t.name for t in set(threading.enumerate()) - before}
    # The worker's client overlaps its servers' steps on their data planes in its own thread; the
    # servers serve its connections on theirs.
    serving = [t for t in set(threading.enumerate()) - before if t.name.startswith("paramserve-dataplane")]
    assert len(serving) == 2, started

    worker.stop(grace=0)

    for thread in set(threading.enumerate()) - before:  # a server's connection thread ends once it reads EOF
        if thread.name.startswith("paramserve-dataplane"):
            thread.join(timeout=10)
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not [n for n in left if n.startswith(("paramserve-worker", "paramserve-client", "paramserve-dataplane"))], (
        left
    )


def test_a_batch_runs_in_order_and_stops_at_the_first_failure(start_worker, stub_for):
    stub = stub_for(start_worker())
    batch = worker_pb2.RunClosuresRequest(
        closures=[
            run_request(answer, closure_id="a"),
            run_request(failing_user_code, closure_id="b"),
            run_request(answer, closure_id="c"),
        ]
    )

    results = stub.RunClosures(batch, timeout=30).results

    assert len(results) == 2, "the closure after the failure is not run"
    assert cloudpickle.loads(results[0].result) == 42
    assert results[1].WhichOneof("outcome") == "error" and results[1].error.type.endswith("KeyError")
    assert stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=30).closures_run == 2


def test_the_coordinators_transport_cancels_a_running_closure_and_only_with_the_token(start_worker, stub_for):
    import asyncio

    from paramserve.coordinator.dispatch.worker_transport import GrpcTransport, RpcFailure

    worker = start_worker(token=TOKEN)
    stub = stub_for(worker)
    CLOSURE_ENTERED.clear()
    CLOSURE_GATE.clear()
    request = run_request(wait_at_gate, closure_id="gated")
    request.steps = 2  # a cancellation stops it before its second step
    running = stub.RunClosure.future(request, timeout=30, metadata=[bearer_metadata(TOKEN)])

    async def cancel(token: str | None) -> None:
        transport = GrpcTransport(worker.address, token, 1 << 20)
        try:
            await transport.cancel_closures(["gated"], 10)
        finally:
            await transport.close()

    try:
        assert CLOSURE_ENTERED.wait(timeout=30)
        with pytest.raises(RpcFailure) as refused:
            asyncio.run(cancel("not-the-token"))
        assert refused.value.code == "UNAUTHENTICATED"
        asyncio.run(cancel(TOKEN))
    finally:
        CLOSURE_GATE.set()
    outcome = outcome_from_proto(running.result())
    assert outcome.error is not None and outcome.error.cancelled, outcome
    assert "before step 2" in outcome.error.message


def test_a_cancellation_cut_short_by_a_reset_of_the_connection_is_an_rpc_failure():
    """The dispatcher resets a worker's channel when its run call fails; a cancellation in flight
    on that channel then fails as an RPC (join() goes on), never as the caller's CancelledError."""
    import asyncio

    from paramserve.coordinator.dispatch.worker_transport import GrpcTransport, RpcFailure

    async def scenario() -> str:
        arrived = asyncio.Event()

        async def never_answers(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            arrived.set()
            await asyncio.sleep(60)
            return b""

        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            "paramserve.wire.v1.Worker", {"CancelClosures": grpc.unary_unary_rpc_method_handler(never_answers)}
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        transport = GrpcTransport(f"127.0.0.1:{port}", None, 1 << 20)
        try:
            cancelling = asyncio.ensure_future(transport.cancel_closures(["c"], 30))
            await asyncio.wait_for(arrived.wait(), 30)
            await transport.reset()  # what the dispatcher does when the worker's run call fails
            with pytest.raises(RpcFailure) as failed:
                await asyncio.wait_for(cancelling, 30)
            return failed.value.code
        finally:
            await transport.close()
            await server.stop(0)

    assert asyncio.run(scenario()) == "CANCELLED"
