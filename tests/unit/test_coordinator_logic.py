"""The coordinator's logic without processes or network: failure decisions, lifecycles,
the closure queue, fetch_structure, and one dispatcher stepped by hand over a transport double."""

from __future__ import annotations

import asyncio
import collections
import pickle
import threading
from dataclasses import dataclass, field

import cloudpickle
import pytest

from paramserve.coordinator.dispatch.batching import BatchSizer
from paramserve.coordinator.dispatch.closures import (
    Closure,
    ClosureQueue,
    ClosureState,
    find_resource_ids,
)
from paramserve.coordinator.dispatch.dispatch_loop import THREAD_NAME, DispatchLoop
from paramserve.coordinator.dispatch.dispatcher import Dispatcher, ResourceSpecs, WireContext, WorkerState
from paramserve.coordinator.dispatch.failures import (
    Action,
    FailurePolicy,
    decide_on_closure_error,
    decide_on_rpc_failure,
)
from paramserve.coordinator.dispatch.worker_transport import RpcFailure
from paramserve.coordinator.errors import (
    ClosureCancelledError,
    ClosureError,
    CoordinatorClosedError,
    InvalidTransitionError,
    OutOfRangeError,
    ParameterServerUnavailableError,
    WorkerRejectedError,
    WorkerUnavailableError,
    closure_error_from_remote,
)
from paramserve.coordinator.remote_value import (
    PerWorkerValues,
    RemoteValue,
    RemoteValueState,
    fetch_structure,
)
from paramserve.wire.v1 import cluster_pb2, worker_pb2
from paramserve.worker.resources import PerWorkerResource

POLICY = FailurePolicy(max_attempts=3, max_resource_resends=2)

ERRORS = "paramserve.psserver.protocol.errors"


@dataclass
class ErrorData:
    type: str = "builtins.ValueError"
    message: str = "boom"
    traceback: str = "Traceback (most recent call last):\n  in step\nValueError: boom"
    pickled: bytes = b""
    missing_resources: tuple[str, ...] = ()
    parameter_server: str = ""
    needs_cluster: bool = False
    cancelled: bool = False
    group_failed: bool = False


def _closure(name: str = "step", resources: frozenset[str] = frozenset()) -> Closure:
    return Closure(name, b"payload", resources)


# ---------------------------------------------------------------- failure decisions


@pytest.mark.parametrize("code", ["UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "INTERNAL"])
def test_transport_failures_retry_elsewhere_until_max_attempts(code):
    assert decide_on_rpc_failure(code, 1, POLICY).action is Action.RETRY_ELSEWHERE
    assert decide_on_rpc_failure(code, 2, POLICY).action is Action.RETRY_ELSEWHERE
    last = decide_on_rpc_failure(code, 3, POLICY)
    assert last.action is Action.RAISE and last.error_type is WorkerUnavailableError
    assert code in last.reason and "3 of 3" in last.reason


@pytest.mark.parametrize("code", ["UNAUTHENTICATED", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"])
def test_refusals_raise_at_once(code):
    decision = decide_on_rpc_failure(code, 1, POLICY)
    assert decision.action is Action.RAISE and decision.error_type is WorkerRejectedError
    assert code in decision.reason


def test_missing_resources_are_resent_without_counting_an_attempt():
    error = ErrorData(missing_resources=("r1",))
    decision = decide_on_closure_error(error, resends=0, known_resources={"r1"}, policy=POLICY)
    assert decision.action is Action.RESEND and "r1" in decision.reason
    exhausted = decide_on_closure_error(error, resends=2, known_resources={"r1"}, policy=POLICY)
    assert exhausted.action is Action.RAISE and exhausted.error_type is ClosureError


def test_missing_resources_the_coordinator_does_not_know_raise():
    error = ErrorData(missing_resources=("r1", "other"))
    decision = decide_on_closure_error(error, resends=0, known_resources={"r1"}, policy=POLICY)
    assert decision.action is Action.RAISE and "other" in decision.reason


def test_parameter_server_failures_raise_a_typed_error_naming_the_server():
    error = ErrorData(
        type="paramserve.psserver.protocol.errors.ServerUnavailableError", parameter_server="10.0.0.1:2222"
    )
    decision = decide_on_closure_error(error, resends=0, known_resources=(), policy=POLICY)
    assert decision.action is Action.RAISE and decision.error_type is ParameterServerUnavailableError
    built = closure_error_from_remote(
        decision.error_type, error, function_name="step", closure_id="c1", worker="w:1", server=error.parameter_server
    )
    assert isinstance(built, ClosureError) and built.server == "10.0.0.1:2222"
    assert "10.0.0.1:2222" in str(built)


def test_a_server_failure_met_before_a_restore_runs_again_at_once_without_a_new_recovery():
    """A closure sent before a recovery finished may report the failure that recovery repaired:
    it runs again with the new cluster context instead of setting off another recovery."""
    error = ErrorData(
        type="paramserve.psserver.protocol.errors.VariableNotFoundError", parameter_server="10.0.0.1:2222"
    )

    def decide(resends, restored):
        return decide_on_closure_error(
            error,
            resends=resends,
            known_resources=(),
            policy=POLICY,
            servers_recover=True,
            restored_since_sent=restored,
        )

    assert decide(0, restored=True).action is Action.RESEND and "restored since" in decide(0, True).reason
    assert decide(0, restored=False).action is Action.AWAIT_SERVER
    assert decide(POLICY.max_resource_resends, restored=True).action is Action.AWAIT_SERVER, "bounded"


def test_with_recovery_a_parameter_server_failure_waits_for_it_a_bounded_number_of_times():
    error = ErrorData(
        type="paramserve.psserver.protocol.errors.VariableNotFoundError", parameter_server="10.0.0.1:2222"
    )
    waits = [
        decide_on_closure_error(
            error, resends=0, known_resources=(), policy=POLICY, server_waits=n, servers_recover=True
        )
        for n in range(POLICY.max_server_waits + 1)
    ]
    assert [d.action for d in waits[:-1]] == [Action.AWAIT_SERVER] * POLICY.max_server_waits
    assert "10.0.0.1:2222" in waits[0].reason
    assert waits[-1].action is Action.RAISE and waits[-1].error_type is ParameterServerUnavailableError


def test_a_dispatcher_puts_closures_back_and_reports_the_server_when_recovery_is_on():
    queue = ClosureQueue(16)
    for name in ("first", "second"):
        queue.put(Closure(name, b""), timeout=1)
    batch = queue.take("w:1", 2)
    reported: list[str] = []
    failure = worker_pb2.ClosureFailure(
        type="paramserve.psserver.protocol.errors.ServerUnavailableError",
        message="gone",
        parameter_server="10.0.0.1:2222",
    )

    class Failing(_HealthyTransport):
        async def run_closures(self, request, timeout):
            return worker_pb2.RunClosuresResponse(
                results=[worker_pb2.RunClosureResponse(error=failure, worker_incarnation="inc")]
            )

    dispatcher = Dispatcher(
        "w:1",
        0,
        queue=queue,
        specs=ResourceSpecs(),
        transport=Failing(),
        cluster_context=lambda: CONTEXT,
        num_workers=lambda: 1,
        policy=POLICY,
        server_failed=reported.append,
    )
    asyncio.run(dispatcher.run(batch))

    assert reported == ["10.0.0.1:2222"]
    assert queue.num_queued == 2 and queue.num_in_flight == 0 and queue.take_error() is None
    assert [c.function_name for c in queue.take("w:1", 2)] == ["first", "second"], "back at the front, in order"
    assert [c.server_waits for c in batch] == [1, 0]


def test_stop_iteration_is_out_of_range_and_user_errors_are_closure_errors():
    stop = decide_on_closure_error(
        ErrorData(type="builtins.StopIteration"), resends=0, known_resources=(), policy=POLICY
    )
    assert stop.error_type is OutOfRangeError and issubclass(OutOfRangeError, ClosureError)
    user = decide_on_closure_error(ErrorData(), resends=0, known_resources=(), policy=POLICY)
    assert user.action is Action.RAISE and user.error_type is ClosureError


def test_decisions_read_the_proto_too():
    proto = worker_pb2.ClosureFailure(type="builtins.KeyError", missing_resources=["r"])
    assert decide_on_closure_error(proto, resends=0, known_resources={"r"}, policy=POLICY).action is Action.RESEND


def test_failure_policy_rejects_nonsense():
    with pytest.raises(ValueError):
        FailurePolicy(max_attempts=0)
    with pytest.raises(ValueError):
        FailurePolicy(closure_timeout=0)


# ---------------------------------------------------------------- errors


def test_closure_error_shows_everything_and_chains_the_original():
    original = ValueError("boom")
    data = ErrorData(pickled=cloudpickle.dumps(original))
    error = closure_error_from_remote(ClosureError, data, function_name="train_step", closure_id="abc123", worker="h:1")
    text = str(error)
    for part in ("builtins.ValueError", "boom", "train_step", "abc123", "h:1", "Remote traceback", "in step"):
        assert part in text
    assert isinstance(error.remote_exception, ValueError) and error.__cause__ is error.remote_exception
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is ClosureError and again.closure_id == "abc123"


def test_an_exception_that_does_not_unpickle_keeps_the_text():
    error = closure_error_from_remote(
        ClosureError, ErrorData(pickled=b"garbage"), function_name="f", closure_id="c", worker="w"
    )
    assert error.remote_exception is None and error.__cause__ is None and "boom" in str(error)


# ---------------------------------------------------------------- lifecycles


def test_remote_value_transitions_once():
    value = RemoteValue("c1", "step")
    assert value.state is RemoteValueState.NOT_READY and not value.done()
    value.set_result(42)
    assert value.state is RemoteValueState.READY and value.fetch() == 42 and value.get() == 42
    with pytest.raises(InvalidTransitionError, match="READY to ABORTED"):
        value.set_error(RuntimeError("late"))


def test_remote_value_fetch_raises_the_error_or_times_out_naming_the_closure():
    failed = RemoteValue("c2", "step")
    failed.set_error(ClosureError(remote_type="builtins.ValueError", message="boom"))
    with pytest.raises(ClosureError):
        failed.fetch()
    pending = RemoteValue("c3", "slow_step")
    with pytest.raises(TimeoutError, match="slow_step.*c3"):
        pending.fetch(timeout=0)


def test_remote_values_cannot_be_sent_to_workers():
    with pytest.raises(TypeError, match="fetch"):
        pickle.dumps(RemoteValue("c", "f"))


def test_closure_transitions_follow_the_table():
    closure = _closure()
    with pytest.raises(InvalidTransitionError, match="QUEUED to SUCCEEDED"):
        closure.transition(ClosureState.SUCCEEDED)
    closure.transition(ClosureState.RUNNING)
    closure.transition(ClosureState.QUEUED)  # a retry
    closure.cancel(RuntimeError("shutdown"))
    assert closure.remote_value.state is RemoteValueState.CANCELLED
    with pytest.raises(InvalidTransitionError):
        closure.transition(ClosureState.RUNNING)


# ---------------------------------------------------------------- queue


def test_queue_is_fifo_batches_are_taken_in_order_and_put_back_first():
    queue = ClosureQueue(10)
    wakes = []
    queue.set_waker(lambda: wakes.append(queue.num_queued))
    a, b, c = _closure("a"), _closure("b"), _closure("c")
    for closure in (a, b, c):
        queue.put(closure, timeout=0)
    assert wakes == [1, 2, 3], "every put wakes the dispatch loop"
    batch = queue.take("w0", 2)
    assert batch == [a, b] and queue.num_in_flight == 2 and {x.state for x in batch} == {ClosureState.RUNNING}
    queue.put_back(batch)
    assert queue.take("w0", 5) == [a, b, c] and queue.take("w0", 5) == []


def test_a_full_queue_times_out_naming_the_closure():
    queue = ClosureQueue(1)
    queue.put(_closure("a"), timeout=0)
    with pytest.raises(TimeoutError, match="could not schedule b"):
        queue.put(_closure("b"), timeout=0)


def test_cancel_all_cancels_every_queued_closure():
    queue = ClosureQueue(10)
    closures = [_closure(str(i)) for i in range(3)]
    for closure in closures:
        queue.put(closure, timeout=0)
    assert queue.cancel_all(RuntimeError("because")) == 3
    for closure in closures:
        assert closure.state is ClosureState.CANCELLED
        assert closure.remote_value.state is RemoteValueState.CANCELLED
        with pytest.raises(ClosureCancelledError) as info:
            closure.remote_value.fetch()
        assert isinstance(info.value.__cause__, RuntimeError)
    assert queue.idle() and queue.wait_idle(0)


def test_the_first_failure_is_kept_once_and_cancels_the_queued_and_the_put_back():
    queue = ClosureQueue(10)
    failing, queued, sibling = _closure("failing"), _closure("queued"), _closure("sibling")
    for closure in (failing, sibling, queued):
        queue.put(closure, timeout=0)
    running, later = queue.take("w0", 2)
    assert not queue.wait_idle(0)
    error = ClosureError(remote_type="builtins.ValueError", message="boom")
    assert queue.fail(running, error)
    assert failing.remote_value.state is RemoteValueState.ABORTED
    assert queued.remote_value.state is RemoteValueState.CANCELLED
    queue.put_back([later])  # a closure of the failed one's batch, not run: cancelled, not retried
    assert sibling.remote_value.state is RemoteValueState.CANCELLED
    assert queue.take_error() is error and queue.take_error() is None
    assert queue.wait_idle(0)


def test_put_after_a_failure_cancels_the_closure_for_the_caller_to_raise():
    queue = ClosureQueue(10)
    queue.put(_closure("f"), timeout=0)
    [running] = queue.take("w", 1)
    queue.fail(running, ClosureError(remote_type="E", message="m"))
    late = _closure("late")
    queue.put(late, timeout=0)
    assert late.state is ClosureState.CANCELLED and queue.num_queued == 0


def test_close_rejects_puts_cancels_put_backs_and_gives_nothing_more():
    queue = ClosureQueue(10)
    queue.put(_closure("a"), timeout=0)
    queue.put(_closure("b"), timeout=0)
    running = queue.take("w", 1)
    assert queue.close(CoordinatorClosedError("closed")) == 1
    with pytest.raises(CoordinatorClosedError):
        queue.put(_closure("c"), timeout=0)
    queue.put_back(running)
    assert running[0].state is ClosureState.CANCELLED
    assert queue.take("w", 1) == []


def test_in_flight_snapshot_names_the_worker():
    queue = ClosureQueue(10)
    closure = _closure("step")
    queue.put(closure, timeout=0)
    queue.take("10.0.0.9:1", 1)
    [flight] = queue.in_flight()
    assert (flight.function_name, flight.worker, flight.closure_id) == ("step", "10.0.0.9:1", closure.closure_id)


# ---------------------------------------------------------------- structures and resources


def test_fetch_structure_maps_nested_remote_values():
    Pair = collections.namedtuple("Pair", "left right")
    values = [RemoteValue(str(i), "f") for i in range(4)]
    for i, value in enumerate(values):
        value.set_result(i * 10)
    structure = {"a": [values[0], (values[1], "plain")], "b": Pair(values[2], 7), "c": PerWorkerValues((values[3], 5))}
    assert fetch_structure(structure) == {"a": [0, (10, "plain")], "b": Pair(20, 7), "c": (30, 5)}
    assert isinstance(fetch_structure(structure)["b"], Pair)


def test_fetch_structure_times_out_on_a_value_not_ready():
    with pytest.raises(TimeoutError):
        fetch_structure([RemoteValue("c", "f")], timeout=0)


def test_find_resource_ids_walks_arguments_and_captured_values():
    r1, r2, r3 = PerWorkerResource("r1"), PerWorkerResource("r2"), PerWorkerResource("r3")

    def step(x):
        return next(r3), x

    assert find_resource_ids(step, ([{"it": r1}],), {"k": (r2,)}) == {"r1", "r2", "r3"}
    assert find_resource_ids(len, (), {}) == frozenset()


# ---------------------------------------------------------------- a dispatcher, one call at a time


@dataclass
class FakeTransport:
    """Replies from a script, one entry per call: a list of RunClosureResponse (one per closure
    answered), an RpcFailure to raise, or a callable run during the call that returns one of those."""

    script: list[object] = field(default_factory=list)
    serving: list[bool] = field(default_factory=lambda: [True])
    requests: list[worker_pb2.RunClosuresRequest] = field(default_factory=list)
    resets: int = 0
    closed: bool = False
    cancelled: list[str] = field(default_factory=list)

    async def run_closures(self, request, timeout):
        self.requests.append(request)
        reply = self.script.pop(0)
        if callable(reply):
            reply = await reply()
        if isinstance(reply, RpcFailure):
            raise reply
        return worker_pb2.RunClosuresResponse(results=reply)

    async def is_serving(self, timeout):
        return self.serving.pop(0) if len(self.serving) > 1 else self.serving[0]

    async def cancel_closures(self, closure_ids, timeout):
        self.cancelled.extend(closure_ids)

    async def reset(self):
        self.resets += 1

    async def close(self):
        self.closed = True


class _HealthyTransport:
    """The rest of a WorkerTransport for doubles that only script run_closures: always serving."""

    async def is_serving(self, timeout):
        return True

    async def cancel_closures(self, closure_ids, timeout):
        pass

    async def reset(self):
        pass

    async def close(self):
        pass


def _ok(value, incarnation="inc-1", held=()):
    return worker_pb2.RunClosureResponse(
        result=cloudpickle.dumps(value), worker_incarnation=incarnation, resources_held=list(held)
    )


CONTEXT = WireContext("fingerprint-1", cluster_pb2.ClusterContext(parameter_servers=["ps:1"]))


def _dispatcher(transport, queue, specs=None, policy=POLICY):
    return Dispatcher(
        "w:0",
        0,
        queue=queue,
        specs=specs or ResourceSpecs(),
        transport=transport,
        cluster_context=lambda: CONTEXT,
        num_workers=lambda: 2,
        policy=policy,
    )


def _run(dispatcher, queue, limit=8):
    """Gives ``dispatcher`` a batch of up to ``limit`` queued closures and runs it to the end."""
    asyncio.run(dispatcher.run(queue.take(dispatcher.address, limit)))


def _queued(queue, *closures):
    for closure in closures:
        queue.put(closure, timeout=0)
    return closures


def _sent(request):
    return [r.closure_id for r in request.closures]


def test_a_batch_runs_in_one_call_and_sets_every_value():
    queue, transport = ClosureQueue(10), FakeTransport([[_ok(1), _ok(2), _ok(3)]])
    closures = _queued(queue, _closure("a"), _closure("b"), _closure("c"))
    _run(_dispatcher(transport, queue), queue)
    assert [c.remote_value.fetch(0) for c in closures] == [1, 2, 3]
    [request] = transport.requests
    assert _sent(request) == [c.closure_id for c in closures]
    assert [(r.attempt, r.num_workers) for r in request.closures] == [(0, 2)] * 3


def test_a_cluster_context_that_cannot_be_built_fails_the_batch_instead_of_hanging():
    def broken():
        raise RuntimeError("the servers hold another layout")

    queue, transport = ClosureQueue(10), FakeTransport([])
    closures = _queued(queue, _closure("a"), _closure("b"))
    dispatcher = Dispatcher(
        "w:0",
        0,
        queue=queue,
        specs=ResourceSpecs(),
        transport=transport,
        cluster_context=broken,
        num_workers=lambda: 2,
        policy=POLICY,
    )
    _run(dispatcher, queue)
    assert transport.requests == [] and queue.num_in_flight == 0
    with pytest.raises(ClosureError, match="another layout"):
        closures[0].remote_value.fetch(0)


def test_the_cluster_context_travels_once_per_worker_incarnation():
    needs = worker_pb2.RunClosureResponse(
        error=worker_pb2.ClosureFailure(needs_cluster=True), worker_incarnation="inc-2"
    )
    queue = ClosureQueue(10)
    transport = FakeTransport(
        [[_ok(1)], [_ok(2)], [needs], [_ok(3, incarnation="inc-2")], [_ok(4, incarnation="inc-2")]]
    )
    dispatcher = _dispatcher(transport, queue)
    closures = _queued(queue, *(_closure() for _ in range(4)))

    for _ in closures:
        _run(dispatcher, queue, limit=1)

    sent = [(r.closures[0].cluster_fingerprint, r.closures[0].HasField("cluster")) for r in transport.requests]
    assert sent == [
        ("fingerprint-1", True),  # first contact: the context travels
        ("fingerprint-1", False),  # the worker holds it: only its fingerprint
        ("fingerprint-1", False),  # ... but the worker restarted and asks for it
        ("fingerprint-1", True),  # resent with it, on the same worker, for the same closure
        ("fingerprint-1", False),
    ]
    assert [c.remote_value.fetch() for c in closures] == [1, 2, 3, 4]
    assert closures[2].attempt == 0, "asking for the context is not a failed attempt"


def test_a_worker_failure_puts_the_batch_back_first_marks_the_worker_down_then_probes_it_up():
    specs = ResourceSpecs()
    specs.add("r1", b"make-it")
    queue = ClosureQueue(10)
    transport = FakeTransport(
        [
            [_ok(1, held=["r1"])],
            RpcFailure("UNAVAILABLE", "connection reset"),
            [_ok(2, held=["r1"]), _ok(3, held=["r1"])],
        ],
        serving=[False, True],
    )
    dispatcher = _dispatcher(transport, queue, specs)
    first, second, third, fourth = _queued(queue, *(_closure(n, frozenset({"r1"})) for n in ("1", "2", "3", "4")))
    _run(dispatcher, queue, limit=1)  # first: creates r1
    assert [s.resource_id for s in transport.requests[0].closures[0].resources] == ["r1"]
    _run(dispatcher, queue, limit=2)  # second and third: the worker dies
    assert dispatcher.state is WorkerState.DOWN and transport.resets == 1
    assert (second.state, third.state) == (ClosureState.QUEUED, ClosureState.QUEUED)
    assert (second.attempt, third.attempt) == (1, 1)
    assert asyncio.run(dispatcher.probe()) and dispatcher.state is WorkerState.UP  # not serving, then serving
    _run(dispatcher, queue, limit=2)  # the retries come first, in order, with r1 again (a DOWN worker holds nothing)
    retry = transport.requests[2]
    assert _sent(retry) == [second.closure_id, third.closure_id] and retry.closures[0].attempt == 1
    assert [s.resource_id for s in retry.closures[0].resources] == ["r1"]
    assert (second.remote_value.fetch(0), third.remote_value.fetch(0)) == (2, 3)
    assert fourth.state is ClosureState.QUEUED


def test_missing_resources_are_resent_on_the_same_worker():
    specs = ResourceSpecs()
    specs.add("r1", b"make-it")
    missing = worker_pb2.RunClosureResponse(
        error=worker_pb2.ClosureFailure(type="ResourceMissingError", missing_resources=["r1"]), worker_incarnation="new"
    )
    queue = ClosureQueue(10)
    transport = FakeTransport([[_ok("a")], [missing], [_ok("b", incarnation="new", held=["r1"])]])
    # the reference was captured where find_resource_ids does not look: the second closure asks for it
    first, second = _queued(queue, _closure("step"), _closure("step"))
    _run(_dispatcher(transport, queue, specs), queue)
    assert _sent(transport.requests[1]) == [second.closure_id], "the first closure is done: only the rest is resent"
    assert second.remote_value.fetch(0) == "b" and second.attempt == 0 and second.resends == 1
    assert [s.resource_id for s in transport.requests[2].closures[0].resources] == ["r1"]


def test_missing_resources_are_resent_on_the_same_worker_in_one_batch():
    specs = ResourceSpecs()
    specs.add("r1", b"make-it")
    missing = worker_pb2.RunClosureResponse(
        error=worker_pb2.ClosureFailure(type="ResourceMissingError", missing_resources=["r1"]), worker_incarnation="new"
    )
    queue = ClosureQueue(10)
    transport = FakeTransport([[_ok("a"), missing], [_ok("b", incarnation="new", held=["r1"])]])
    first, second = _queued(queue, _closure("step"), _closure("step"))
    _run(_dispatcher(transport, queue, specs), queue)
    assert first.remote_value.fetch(0) == "a" and second.remote_value.fetch(0) == "b"
    assert _sent(transport.requests[1]) == [second.closure_id]
    assert [s.resource_id for s in transport.requests[1].closures[0].resources] == ["r1"]


def test_a_user_error_fails_the_closure_and_cancels_the_rest_of_its_batch():
    reply = worker_pb2.RunClosureResponse(
        error=worker_pb2.ClosureFailure(
            type="builtins.ZeroDivisionError", message="division by zero", traceback="in train_step"
        )
    )
    queue = ClosureQueue(10)
    done, failing, not_run = _queued(queue, _closure("a"), _closure("train_step"), _closure("c"))
    _run(_dispatcher(FakeTransport([[_ok(1), reply]]), queue), queue)
    assert done.remote_value.fetch(0) == 1
    with pytest.raises(ClosureError, match="ZeroDivisionError") as info:
        failing.remote_value.fetch(0)
    assert info.value.worker == "w:0" and "in train_step" in info.value.remote_traceback
    assert not_run.state is ClosureState.CANCELLED, "TF cancels what comes after an error"
    assert queue.take_error() is info.value


def test_attempts_run_out_into_worker_unavailable():
    queue = ClosureQueue(10)
    closure = _closure()
    closure.attempt = POLICY.max_attempts - 1
    queue.put(closure, timeout=0)
    _run(_dispatcher(FakeTransport([RpcFailure("UNAVAILABLE", "gone")]), queue), queue)
    with pytest.raises(WorkerUnavailableError, match="UNAVAILABLE"):
        closure.remote_value.fetch(0)


def test_a_dispatcher_cancelled_during_a_call_puts_its_batch_back():
    queue = ClosureQueue(10)
    closures = _queued(queue, _closure("a"), _closure("b"))
    entered = asyncio.Event

    async def scenario():
        started = entered()

        async def hang():
            started.set()
            await asyncio.sleep(3600)

        dispatcher = _dispatcher(FakeTransport([hang]), queue)
        task = asyncio.ensure_future(dispatcher.run(queue.take("w:0", 2)))
        await started.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return dispatcher

    dispatcher = asyncio.run(scenario())
    assert [c.state for c in closures] == [ClosureState.QUEUED] * 2 and [c.attempt for c in closures] == [0, 0]
    assert queue.take("w", 2) == list(closures), "back at the front, in order"
    assert dispatcher.state is WorkerState.UP  # not the worker's fault


# ---------------------------------------------------------------- the dispatch loop


def test_batches_form_only_from_short_closures_under_a_backlog():
    sizer = BatchSizer(max_batch=8, target_seconds=0.01)
    assert sizer.size(queued=100, workers=1) == 1, "no batch until a closure's duration is known"
    sizer.observe(0.001)
    assert sizer.size(queued=100, workers=1) == 8, "1 ms closures: up to max_batch"
    assert sizer.size(queued=9, workers=3) == 3, "no more than one worker's share"
    assert sizer.size(queued=1, workers=1) == 1
    for _ in range(30):
        sizer.observe(2.0)  # closures that wait on something: never held behind one another
    assert sizer.size(queued=100, workers=1) == 1
    for _ in range(60):
        sizer.observe(0.004)
    assert sizer.size(queued=100, workers=1) == 2, "about target_seconds of work per batch"


def test_closures_shorter_than_a_call_are_batched_even_while_workers_are_free():
    sizer = BatchSizer(max_batch=8, target_seconds=0.1)
    sizer.observe(0.0001)
    assert sizer.call_overhead == 0.0
    assert sizer.size(queued=10, workers=256) == 1, "no call measured yet: one worker's share"
    sizer.observe_call(0.0005 + 0.0003, closure_seconds=0.0003)  # 0.5 ms beyond its closures
    assert sizer.call_overhead == 0.0005
    assert sizer.size(queued=10, workers=256) == 5, "5 closures of 0.1 ms cost what one call does"
    assert sizer.size(queued=3, workers=256) == 3, "never more than is queued"
    assert sizer.size(queued=100, workers=256) == 5
    assert sizer.size(queued=100, workers=2) == 8, "a worker's share, up to max_batch"
    for _ in range(60):
        sizer.observe(0.004)  # closures longer than a call: spread over the free workers
    assert sizer.size(queued=10, workers=256) == 1
    sizer.observe_call(-1.0, closure_seconds=0.0)  # a clock step back is ignored
    assert sizer.call_overhead == 0.0005


class AnsweringTransport(_HealthyTransport):
    """A worker that answers every closure with its own id, after yielding to the loop."""

    def __init__(self, address: str):
        self.address, self.batches = address, []

    async def run_closures(self, request, timeout):
        self.batches.append(len(request.closures))
        await asyncio.sleep(0)
        return worker_pb2.RunClosuresResponse(results=[_ok(r.closure_id) for r in request.closures])


def test_one_thread_dispatches_to_a_hundred_workers_in_bounded_batches():
    queue, transports = ClosureQueue(1000), {}

    def connect(address):
        transports[address] = AnsweringTransport(address)
        return transports[address]

    threads_before = {t.ident for t in threading.enumerate()}
    loop = DispatchLoop(
        queue=queue,
        specs=ResourceSpecs(),
        policy=POLICY,
        transport_factory=connect,
        cluster_context=lambda: CONTEXT,
        max_batch=4,
    )
    try:
        for i in range(100):
            loop.add_worker(f"w:{i}")
        closures = _queued(queue, *(_closure(str(i)) for i in range(1000 - 1)))
        assert [c.remote_value.fetch(30) for c in closures] == [c.closure_id for c in closures]
        new_threads = [t.name for t in threading.enumerate() if t.ident not in threads_before]
        assert new_threads.count(THREAD_NAME) == 1 and len(new_threads) <= 4, new_threads  # + grpc's own, if any
        batches = [size for t in transports.values() for size in t.batches]
        assert sum(batches) == len(closures) and max(batches) <= 4
        assert sum(1 for t in transports.values() if t.batches) > 50, "work spreads over the workers"
        assert [d.index for d in loop.dispatchers()] == list(range(100))
    finally:
        assert loop.stop(10)
    assert not loop.thread.is_alive()


def test_a_dense_round_that_cannot_be_prepared_fails_its_closures_with_the_reason():
    """Hybrid training whose dense variables have no optimizer: join() must raise the reason,
    not wait for a round that will never form."""
    from paramserve.coordinator.dispatch.dense_rounds import DenseRounds

    def settings():
        raise RuntimeError("sync_dense: dense variables ['w'] have no optimizer: build the torch optimizer ...")

    queue = ClosureQueue(10)
    transport = FakeTransport([])
    dense = DenseRounds(settings, lambda: b"", rendezvous_host="127.0.0.1", timeout=5)
    loop = DispatchLoop(
        queue=queue,
        specs=ResourceSpecs(),
        policy=POLICY,
        transport_factory=lambda address: transport,
        cluster_context=lambda: CONTEXT,
        dense=dense,
    )
    try:
        loop.add_worker("w:0")
        closures = _queued(queue, _closure("a"), _closure("b"), _closure("c"))
        assert queue.wait_idle(10), "the round's closures stayed queued"
        for closure in closures:
            with pytest.raises((ClosureError, ClosureCancelledError)) as raised:
                closure.remote_value.fetch(10)
            assert "have no optimizer" in str(raised.value)
        assert "have no optimizer" in str(queue.take_error())
        assert transport.requests == [], "nothing was sent to a worker"
    finally:
        assert loop.stop(10)
        dense.close()


def test_a_joining_worker_is_probed_often_and_a_failed_one_with_backoff():
    from paramserve.coordinator.dispatch.failures import probe_delay

    policy = FailurePolicy(probe_initial_backoff=0.1, probe_max_backoff=5.0, join_probe_interval=0.1)
    assert [probe_delay(policy, joining=True, attempt=n) for n in (1, 5, 50)] == [0.1, 0.1, 0.1]
    assert [probe_delay(policy, joining=False, attempt=n) for n in (1, 2, 3, 10)] == [0.1, 0.2, 0.4, 5.0]
    with pytest.raises(ValueError):
        FailurePolicy(join_probe_interval=0)


def test_a_worker_added_with_probe_first_gets_closures_only_once_it_serves():
    queue = ClosureQueue(10)
    fast = FailurePolicy(max_attempts=3, probe_initial_backoff=0.01, probe_max_backoff=0.02, probe_jitter=0.0)
    transport = FakeTransport([[_ok("a")]], serving=[False, False, True])
    loop = DispatchLoop(
        queue=queue,
        specs=ResourceSpecs(),
        policy=fast,
        transport_factory=lambda address: transport,
        cluster_context=lambda: CONTEXT,
    )
    try:
        [closure] = _queued(queue, _closure("a"))
        dispatcher = loop.add_worker("w:0", probe_first=True)
        assert closure.remote_value.fetch(10) == "a"
        assert dispatcher.state is WorkerState.UP and transport.serving == [True]  # probed until it served
        [request] = transport.requests
        assert request.closures[0].attempt == 0, "a worker still starting costs no closure an attempt"
    finally:
        assert loop.stop(10)


# ---------------------------------------------------------------- the coordinator's lifecycle and join()


class _StubStrategy:
    """What ClusterCoordinator needs of a strategy, for two workers that are test doubles."""

    def __init__(self, workers=("w0:1", "w1:1")):
        from paramserve.coordinator.cluster import ClusterSpec
        from paramserve.psserver.protocol.types import ClusterContext

        self.cluster = ClusterSpec(parameter_servers=("ps0:1",), workers=tuple(workers))
        self.token = "a-token"  # the doubles' addresses are not loopback: replies must be signed
        self.tls = None
        self.max_value_age = 0.0
        self.overlap_pushes = False
        self.max_row_staleness = 0
        self.sync_dense = None
        self._context = ClusterContext(("ps0:1",))

    def cluster_context(self):
        return self._context

    def attach_coordinator(self, coordinator):
        return None  # no variables on parameter servers: nothing to recover


class _ByFunctionName(_HealthyTransport):
    """A worker double that behaves by the closure's function name: "slow" waits for ``release``,
    "bad" fails with a user error, anything else succeeds with its name."""

    def __init__(self, release: threading.Event):
        self._release = release

    async def run_closures(self, request, timeout):
        results = []
        for closure in request.closures:
            if closure.function_name == "slow":
                await asyncio.get_running_loop().run_in_executor(None, self._release.wait, 60)
            if closure.function_name == "bad":
                failure = worker_pb2.ClosureFailure(type="builtins.ValueError", message="bad input", traceback="...")
                results.append(worker_pb2.RunClosureResponse(error=failure, worker_incarnation="inc"))
                break
            results.append(_ok(closure.function_name, incarnation="inc"))
        return worker_pb2.RunClosuresResponse(results=results)


def slow():
    return "slow"


def bad():
    return "bad"


class _CancellableByFunctionName(_ByFunctionName):
    """Like _ByFunctionName, and a "slow" closure that is cancelled answers as cancelled (a real
    worker stops it at its next push or step)."""

    def __init__(self, release: threading.Event):
        super().__init__(release)
        self.cancelled: list[str] = []

    async def cancel_closures(self, closure_ids, timeout):
        self.cancelled.extend(closure_ids)
        self._release.set()

    async def run_closures(self, request, timeout):
        reply = await super().run_closures(request, timeout)
        for closure, result in zip(request.closures, reply.results):
            if closure.closure_id in self.cancelled:
                result.ClearField("result")
                result.error.CopyFrom(worker_pb2.ClosureFailure(type="ClosureCancelled", cancelled=True))
        return reply


def test_join_cancels_the_closures_still_running_then_raises_the_first_error():
    from paramserve.coordinator.cluster_coordinator import ClusterCoordinator

    release = threading.Event()
    transports: list[_CancellableByFunctionName] = []

    def transport(address):
        transports.append(_CancellableByFunctionName(release))
        return transports[-1]

    with ClusterCoordinator(_StubStrategy(), transport_factory=transport) as coordinator:
        running = coordinator.schedule(slow)
        failing = coordinator.schedule(bad)
        with pytest.raises(ClosureError, match="bad input"):
            coordinator.join(timeout=30)
        # TF: nothing scheduled before the error still runs when it is raised.
        assert [c for t in transports for c in t.cancelled] == [running.closure_id]
        assert running.state is RemoteValueState.CANCELLED and failing.state is RemoteValueState.ABORTED
        assert coordinator.done()
        assert coordinator.schedule(slow).fetch(timeout=30) == "slow", "the error was raised once"


def test_decisions_cancel_a_closure_its_worker_answered_as_cancelled():
    decision = decide_on_closure_error(
        ErrorData(cancelled=True, missing_resources=("r",)), resends=0, known_resources={"r"}, policy=POLICY
    )
    assert decision.action is Action.CANCEL and "cancelled" in decision.reason


def test_closures_put_back_while_an_error_is_pending_are_cancelled_until_it_is_taken():
    queue = ClosureQueue(10)
    for name in ("failing", "running"):
        queue.put(_closure(name), timeout=0)
    failing, running = queue.take("w0", 1) + queue.take("w1", 1)
    error = ClosureError(remote_type="builtins.ValueError", message="boom")
    queue.fail(failing, error)
    assert queue.pending_error() is error and not queue.wait_settled(0), "one closure still runs"
    queue.put_back([running])  # its worker died (or it was cancelled there) while the error is pending
    assert running.remote_value.state is RemoteValueState.CANCELLED
    assert queue.wait_settled(0) and queue.take_error() is error and queue.pending_error() is None


def test_a_read_barrier_starts_a_new_generation_for_the_closures_queued_after_it():
    queue = ClosureQueue(10)
    before, after = _closure("before"), _closure("after")
    queue.put(before, timeout=0)
    queue.read_barrier()
    queue.put(after, timeout=0)
    assert (before.read_generation, after.read_generation) == (0, 1)


def test_a_dispatcher_sends_each_closures_read_generation_and_asks_its_worker_to_cancel_its_batch():
    queue = ClosureQueue(10)
    other, first, second = _queued(queue, _closure("other"), _closure("a"), _closure("b"))
    second.read_generation = 3
    [elsewhere] = queue.take("w:9", 1)
    batch = queue.take("w:0", 2)
    queue.fail(elsewhere, ClosureError(remote_type="E", message="an earlier failure"))  # its error is pending
    transport = FakeTransport()
    dispatcher = _dispatcher(transport, queue)

    async def cancelled_after_the_first():
        await dispatcher.cancel_running(1.0)  # what join() asks while the call runs
        cancelled = worker_pb2.ClosureFailure(type="ClosureCancelled", cancelled=True)
        return [_ok("a"), worker_pb2.RunClosureResponse(error=cancelled, worker_incarnation="inc-1")]

    transport.script = [cancelled_after_the_first]
    asyncio.run(dispatcher.run(batch))
    assert [r.read_generation for r in transport.requests[0].closures] == [0, 3]
    assert transport.cancelled == [first.closure_id, second.closure_id]
    assert first.remote_value.state is RemoteValueState.READY
    assert second.remote_value.state is RemoteValueState.CANCELLED, "put back while the error is pending"
    assert queue.wait_settled(0)


def test_schedule_never_raises_the_error_of_the_closure_it_queued():
    """A worker that fails a closure the moment it arrives: schedule() returns its RemoteValue
    (the error is join()'s to raise), however the dispatch thread and the caller interleave."""
    from paramserve.coordinator.cluster_coordinator import ClusterCoordinator

    release = threading.Event()
    with ClusterCoordinator(_StubStrategy(), transport_factory=lambda address: _ByFunctionName(release)) as coordinator:
        for _ in range(300):
            value = coordinator.schedule(bad)  # never raises: nothing failed before it was queued
            with pytest.raises(ClosureError, match="bad input"):
                coordinator.join(timeout=30)
            with pytest.raises(ClosureError, match="bad input"):
                value.fetch(timeout=30)


def test_a_dropped_coordinator_stops_its_dispatch_thread():
    import gc

    from paramserve.coordinator.cluster_coordinator import ClusterCoordinator

    def dispatch_threads():
        return [t for t in threading.enumerate() if t.name == THREAD_NAME]

    before = len(dispatch_threads())
    release = threading.Event()
    release.set()
    for _ in range(20):
        coordinator = ClusterCoordinator(_StubStrategy(), transport_factory=lambda address: _ByFunctionName(release))
        coordinator.schedule(slow).fetch(timeout=30)
        del coordinator  # no shutdown()
    gc.collect()
    assert len(dispatch_threads()) == before, "weakref.finalize stopped each dropped coordinator's thread"


class _DenseStub:
    """Hybrid training's dense variables as a coordinator finds them on its strategy."""

    timeout = 5.0
    rendezvous_host = "127.0.0.1"

    def __init__(self) -> None:
        from paramserve.coordinator.dispatch.dense_rounds import DenseRoundsLink

        self.rounds = DenseRoundsLink()

    def settings(self):
        from paramserve.coordinator.dispatch.dense_rounds import DenseSettings

        return DenseSettings((), b"", 0)

    def initial_state(self):
        return b""


def test_a_coordinator_connects_its_dense_rounds_to_the_strategy_when_it_is_built():
    from paramserve.coordinator.cluster_coordinator import ClusterCoordinator

    strategy = _StubStrategy()
    strategy.sync_dense = _DenseStub()
    assert not strategy.sync_dense.rounds.connected
    with ClusterCoordinator(strategy, transport_factory=lambda address: _HealthyTransport()):
        assert strategy.sync_dense.rounds.connected
        assert strategy.sync_dense.rounds.rounds_done() == 0


def test_parameter_server_recovery_cannot_be_built_without_its_observer():
    from paramserve.coordinator.recovery.ps_recovery import ParameterServerRecovery
    from paramserve.coordinator.recovery.recovery_policy import RecoveryPolicy

    with pytest.raises(TypeError, match="observer"):
        ParameterServerRecovery(object(), queue=ClosureQueue(1), policy=RecoveryPolicy())  # type: ignore[call-arg]


def test_a_dispatcher_tells_where_its_worker_computes_once_and_again_when_it_changes():
    devices: list[tuple[str, str]] = []

    class Observer(_RecordingObserverBase):
        def worker_device(self, address, device):
            devices.append((address, device))

    queue = ClosureQueue(10)
    _queued(queue, _closure("a"), _closure("b"), _closure("c"))
    on = [worker_pb2.RunClosureResponse(result=cloudpickle.dumps(1), worker_incarnation="i", device=d) for d in "xxy"]
    transport = FakeTransport(script=[[on[0]], [on[1]], [on[2]]])
    dispatcher = Dispatcher(
        "w:0",
        0,
        queue=queue,
        specs=ResourceSpecs(),
        transport=transport,
        cluster_context=lambda: CONTEXT,
        num_workers=lambda: 1,
        policy=POLICY,
        observer=Observer(),
    )
    for _ in range(3):
        _run(dispatcher, queue, limit=1)
    assert devices == [("w:0", "x"), ("w:0", "y")]


class _RecordingObserverBase:
    def closure_scheduled(self, closure):
        pass

    def closure_finished(self, closure):
        pass

    def closure_retried(self, closure, code):
        pass

    def worker_state(self, address, state):
        pass

    def worker_device(self, address, device):
        pass
