"""Deferred pushes (worker.pipeline): with ``max_row_staleness`` >= 1 a step's push travels with
the next step's lookup, one exchange per server. WorkerCore against in-memory parameter servers
(tests/fake_parameter_servers.py); the same over real processes is
tests/integration/test_row_cache_training.py."""

from __future__ import annotations

import dataclasses

import cloudpickle
import pytest
import torch
from fake_parameter_servers import FakeParameterServers
from torch import nn

from paramserve.psserver.protocol.errors import ServerUnavailableError
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.types import ClusterContext, PendingExchange
from paramserve.worker.closure_pickling import dumps_closure
from paramserve.worker.core import ClosureRequest, WorkerCore
from paramserve.worker.layers import ServerOptimizer, ShardedEmbedding, mark_variable


def dense_step(dense: nn.Linear, optimizer: ServerOptimizer, x: torch.Tensor):
    """A step without lookups."""
    optimizer.zero_grad()
    dense(x).sum().backward()
    optimizer.step()


LR = 0.5
SGD = OptimizerSpec("SGD", {"lr": LR})


def embed_then_dense(table: ShardedEmbedding, dense: nn.Linear, optimizer: ServerOptimizer, ids: torch.Tensor):
    """A DLRM-shaped step: the lookup first, then a dense layer; returns the dense weight it used."""
    optimizer.zero_grad()
    rows = table(ids)
    used = dense.weight.detach().clone()
    dense(rows).sum().backward()
    optimizer.step()
    return used


class Servers(FakeParameterServers):
    """The fake, with the exchange that carries a deferred push made to fail: ``lost_reply``
    applies the push and then fails (its reply lost), ``unreachable`` fails before."""

    def __init__(self) -> None:
        super().__init__()
        self.lost_reply = False
        self.unreachable = False

    def start_push_parts_and_read_rows(self, parts, names, lookups, *, key, dynamic=None):
        pending, found = super().start_push_parts_and_read_rows(parts, names, lookups, key=key, dynamic=dynamic)
        if not (self.lost_reply or self.unreachable):
            return pending, found

        def fail():
            if self.lost_reply:
                pending.result()
            raise ServerUnavailableError("parameter server unreachable (UNAVAILABLE)", server="fake-ps:1")

        return PendingExchange(fail, lambda: None), found


@pytest.fixture()
def setup():
    servers = Servers()
    servers.create("table", torch.randn(100, 4), SGD)
    servers.create("w", torch.randn(2, 4), SGD)
    servers.create("b", torch.randn(2), SGD)
    table = ShardedEmbedding(100, 4, name="table")
    dense = nn.Linear(4, 2)
    mark_variable(dense.weight, "w")
    mark_variable(dense.bias, "b")
    optimizer = ServerOptimizer(["table", "w", "b"], "SGD", {"lr": LR})
    return servers, WorkerCore(servers.factory), (table, dense, optimizer)


def requests(
    servers, model, staleness: int, *, ids=((1, 2), (3, 4), (5, 6)), prefix="c", overlap=False
) -> list[ClosureRequest]:
    """One closure per id pair (distinct rows: no cache hits), ``max_row_staleness=staleness``."""
    return [
        ClosureRequest(
            closure_id=f"{prefix}{n}",
            payload=dumps_closure((embed_then_dense, (*model, torch.tensor(pair)), {})),
            function_name="embed_then_dense",
            cluster=servers.cluster,
            max_row_staleness=staleness,
            overlap_pushes=overlap,
            max_value_age=3600.0,
            worker_index=0,
            num_workers=1,
        )
        for n, pair in enumerate(ids)
    ]


def dense_used(outcomes) -> list[torch.Tensor]:
    for outcome in outcomes:
        assert outcome.error is None, outcome.error
    return [cloudpickle.loads(outcome.result) for outcome in outcomes]


def test_each_push_travels_with_the_next_lookup_applies_once_and_dense_values_lag_one_step(setup):
    servers, core, model = setup
    w0 = servers.value("w").clone()
    outcomes = core.run_closures(requests(servers, model, staleness=1))
    used = dense_used(outcomes)

    assert servers.traffic.merged == 2, "the pushes of closures 1 and 2 rode with the lookups of 2 and 3"
    assert servers.traffic.push_keys == ["c0/0", "c1/0", "c2/0"], "every push once, in order"
    assert [o.pushes_applied for o in outcomes] == [3, 3, 3], "one per shard: table, w and b"
    assert servers.version("w") == servers.version("table") == 3
    torch.testing.assert_close(used[0], w0)
    torch.testing.assert_close(used[1], w0)  # the first push's values arrive with the second lookup
    assert not torch.equal(used[2], w0), "installed at the step boundary: the third step uses them"
    # The batch ends with every value installed: the next batch starts from what the servers hold.
    now, pulls = servers.value("w").clone(), len(servers.traffic.pulled)
    again = core.run_closures(requests(servers, model, staleness=1, ids=((7, 8),), prefix="d"))
    torch.testing.assert_close(dense_used(again)[0], now)
    assert len(servers.traffic.pulled) == pulls, "no pull: the values the last push read back were installed"


def test_max_row_staleness_zero_sends_each_push_on_its_own_and_the_next_step_uses_its_values(setup):
    servers, core, model = setup
    w0 = servers.value("w").clone()
    used = dense_used(core.run_closures(requests(servers, model, staleness=0)))

    assert servers.traffic.merged == 0
    assert servers.traffic.row_exchanges == 3 and servers.traffic.read_back.count("w") == 3
    torch.testing.assert_close(used[0], w0)
    assert not torch.equal(used[1], w0), "today's behaviour: each step starts from its predecessor's push"


def test_a_bad_lookup_after_a_deferred_push_fails_only_its_closure_and_the_push_still_applies(setup):
    servers, core, model = setup
    outcomes = core.run_closures(requests(servers, model, staleness=1, ids=((1, 2), (3, 500))))

    assert outcomes[0].error is None and outcomes[0].pushes_applied == 3
    assert outcomes[1].error is not None and "IndexOutOfRange" in outcomes[1].error.type
    assert "outside [0, 100)" in outcomes[1].error.message
    assert servers.traffic.push_keys == ["c0/0"] and servers.version("table") == 1
    assert servers.traffic.merged == 0, "nothing left with the bad lookup: the push went on its own"


@pytest.mark.parametrize("failure", ["unreachable", "lost_reply"])
def test_a_deferred_push_that_fails_with_the_next_lookup_is_its_own_closures_error_and_a_retry_applies_it_once(
    setup, failure
):
    servers, core, model = setup
    setattr(servers, failure, True)
    outcomes = core.run_closures(requests(servers, model, staleness=1, ids=((1, 2), (3, 4))))

    assert len(outcomes) == 1, "the closure whose lookup carried the push did not run, as far as anyone knows"
    assert outcomes[0].error is not None and outcomes[0].error.parameter_server == "fake-ps:1"
    applied = servers.version("table")
    assert applied == (1 if failure == "lost_reply" else 0)

    setattr(servers, failure, False)  # the coordinator retries both, with their ids
    retried = core.run_closures(requests(servers, model, staleness=1, ids=((1, 2), (3, 4))))
    assert [o.error for o in retried] == [None, None]
    assert servers.version("table") == 2, "the first push applied once, whichever attempt carried it"
    assert sum(o.pushes_duplicate for o in retried) == 3 * applied, "each of its 3 shards, once"


def test_a_new_cluster_context_between_closures_sends_the_deferred_push_on_its_own_client(setup):
    servers, core, model = setup
    batch = requests(servers, model, staleness=1, ids=((1, 2), (3, 4)))
    moved = ClusterContext(servers.cluster.parameter_servers, servers.cluster.layouts, generation=1)
    batch[1] = dataclasses.replace(batch[1], cluster=moved)
    outcomes = core.run_closures(batch)
    dense_used(outcomes)
    assert servers.version("table") == 2 and servers.traffic.push_keys == ["c0/0", "c1/0"]


def test_overlap_pushes_sends_a_push_with_rows_with_the_next_lookup_and_one_without_rows_in_flight(setup):
    servers, core, model = setup
    outcomes = core.run_closures(requests(servers, model, staleness=0, overlap=True))
    dense_used(outcomes)
    assert servers.traffic.merged == 2 and servers.traffic.started == 0
    assert sum(o.cache_use.rows_cached for o in outcomes) == 0, "no bound: no cache"
    assert servers.version("table") == 3

    _, dense, optimizer = model
    x = torch.randn(3, 4)
    batch = [
        dataclasses.replace(request, payload=dumps_closure((dense_step, (dense, optimizer, x), {})))
        for request in requests(servers, model, staleness=0, overlap=True, prefix="d")
    ]
    dense_used(core.run_closures(batch))
    assert servers.traffic.merged == 2 and servers.traffic.started == 3, "no lookup to ride with: in flight"
    assert servers.version("w") == 6


def test_a_step_without_lookups_under_a_row_staleness_bound_waits_for_its_push(setup):
    servers, core, model = setup
    _, dense, optimizer = model
    x = torch.randn(3, 4)
    batch = [
        dataclasses.replace(request, payload=dumps_closure((dense_step, (dense, optimizer, x), {})))
        for request in requests(servers, model, staleness=1)
    ]
    dense_used(core.run_closures(batch))
    assert servers.traffic.merged == 0 and servers.traffic.started == 0
    assert servers.traffic.read_back.count("w") == 3, "each push read back at once, as with s = 0"
