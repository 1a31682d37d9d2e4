"""How a client's step travels (psserver/client/step_transport.py), as pure logic: the route each server's
share takes, and a step's order (every data-plane request written before any reply is read, then
the rest, and any broken share, through the retrying path under the same key). No sockets."""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass

import pytest

from paramserve.psserver.client.calls import ServerCalls
from paramserve.psserver.client.step_transport import Route, StepRouter, choose_route, fits_data_plane
from paramserve.psserver.client.step_work import PushPart, ServerWork
from paramserve.psserver.dataplane.frames import TransportError
from paramserve.psserver.protocol.errors import VariableNotFoundError
from paramserve.psserver.protocol.types import PushOutcome, ShardRef

MB = 1 << 20


@pytest.mark.parametrize(
    ("nbytes", "data_plane", "fits", "unary_limit", "route"),
    [
        (10 * MB, True, True, 4 * MB, Route.DATA_PLANE),  # any size its frame takes
        (100 * MB, True, False, 4 * MB, Route.STREAMS),  # over the frame limit, and large
        (2 * MB, True, False, 4 * MB, Route.UNARY),
        (4 * MB, False, False, 4 * MB, Route.UNARY),  # no data plane: one message up to the limit
        (4 * MB + 1, False, False, 4 * MB, Route.STREAMS),
        (0, False, False, 0, Route.UNARY),  # a read of nothing is one message even at limit 0
        (1, False, True, 0, Route.STREAMS),  # "fits" means nothing without a data plane
    ],
)
def test_choose_route(nbytes, data_plane, fits, unary_limit, route):
    assert choose_route(nbytes, data_plane, fits, unary_limit) is route


@pytest.mark.parametrize(
    ("nbytes", "plan_bytes", "limit", "fits"),
    [
        (10 * MB, 4096, 64 * MB, True),
        (64 * MB + 1, 4096, 64 * MB, False),  # its tensors are over the frame
        (MB, MB, 64 * MB, True),  # a plan of MAX_STEP_HEADER_BYTES still fits
        (MB, MB + 1, 64 * MB, False),  # a lookup of ~130k distinct rows: its ids make the plan too large
        (0, 0, None, False),  # no data plane
    ],
)
def test_fits_data_plane(nbytes, plan_bytes, limit, fits):
    assert fits_data_plane(nbytes, plan_bytes, limit) is fits


@dataclass(frozen=True)
class Sent:
    server: int
    key: str


class FakeDataPlane:
    """A data plane that records what happens, in order; ``broken`` servers' replies are lost."""

    def __init__(self, events: list[tuple], limits: dict[int, int | None], broken: set[int] = frozenset()):
        self.events, self.limits, self.broken = events, limits, broken

    def step_limit(self, server: int) -> int | None:
        return self.limits.get(server)

    def send(self, server: int, work: ServerWork, key: str) -> Sent:
        self.events.append(("send", server, key))
        return Sent(server, key)

    def receive(self, sent: Sent):
        self.events.append(("receive", sent.server))
        if sent.server in self.broken:
            raise TransportError("the connection broke")
        return [PushOutcome(ShardRef("w", sent.server), True, 1, 0)], {}

    def run(self, server: int, work: ServerWork, key: str):
        self.events.append(("run", Route.DATA_PLANE, server, key))
        return [PushOutcome(ShardRef("w", server), True, 1, 0)], {}


class FakeTransport:
    def __init__(self, route: Route, events: list[tuple]):
        self.route, self.events = route, events

    def run(self, server: int, work: ServerWork, key: str):
        self.events.append(("run", self.route, server, key))
        return [PushOutcome(ShardRef("w", server), True, 1, 0)], {}


def work_of(nbytes: int) -> ServerWork:
    return ServerWork(parts=[PushPart([memoryview(bytes(nbytes))], -1)])


@pytest.fixture
def calls():
    with futures.ThreadPoolExecutor(4) as pool:
        yield ServerCalls(("a:1", "b:1", "c:1", "d:1"), pool, retry_deadline=5.0)


def test_a_step_writes_every_data_plane_request_before_reading_a_reply_and_retries_the_rest_under_its_key(calls):
    events: list[tuple] = []
    data_plane = FakeDataPlane(events, {0: 8 * MB, 1: 8 * MB, 2: None, 3: None}, broken={1})
    router = StepRouter(
        data_plane,
        FakeTransport(Route.UNARY, events),
        FakeTransport(Route.STREAMS, events),
        unary_limit=MB,
        calls=calls,
    )
    works = {0: work_of(100), 1: work_of(100), 2: work_of(100), 3: work_of(2 * MB)}

    in_flight = router.start(works, "key-1", None)
    assert events == [("send", 0, "key-1"), ("send", 1, "key-1")]  # nothing read yet
    outcomes, _ = in_flight.result()

    assert events[2:4] == [("receive", 0), ("receive", 1)]
    assert set(events[4:]) == {
        ("run", Route.DATA_PLANE, 1, "key-1"),  # its reply was lost: again, same key
        ("run", Route.UNARY, 2, "key-1"),
        ("run", Route.STREAMS, 3, "key-1"),
    }
    assert sorted(o.ref.shard for o in outcomes) == [0, 1, 2, 3]


def test_a_typed_error_of_one_server_is_raised_once_every_share_has_ended(calls):
    events: list[tuple] = []

    class Refusing(FakeDataPlane):
        def receive(self, sent: Sent):
            self.events.append(("receive", sent.server))
            raise VariableNotFoundError("gone", variable="w")

    router = StepRouter(
        Refusing(events, {0: 8 * MB}),
        FakeTransport(Route.UNARY, events),
        FakeTransport(Route.STREAMS, events),
        unary_limit=MB,
        calls=calls,
    )

    with pytest.raises(VariableNotFoundError) as raised:
        router.start({0: work_of(10), 1: work_of(10)}, "k", None).result()

    assert raised.value.server == "a:1"
    assert ("run", Route.UNARY, 1, "k") in events  # the other server's share still ran


def test_without_a_data_plane_nothing_is_sent_ahead(calls):
    events: list[tuple] = []
    router = StepRouter(
        None, FakeTransport(Route.UNARY, events), FakeTransport(Route.STREAMS, events), unary_limit=MB, calls=calls
    )

    in_flight = router.start({0: work_of(10)}, "k", None)
    assert events == []
    in_flight.result()
    assert events == [("run", Route.UNARY, 0, "k")]
