"""Overlapped pushes (worker.pipeline) on WorkerCore, against in-memory parameter servers that
apply a push only when its result is read: what each step computes from, where a failed
push's error goes, and that nothing is in flight once the worker answers. Over real servers
and processes: tests/chaos/test_training_under_failure.py."""

from __future__ import annotations

from typing import Any

import cloudpickle
import fake_parameter_servers as fake_servers
import pytest
import torch
from torch import nn

from paramserve.psserver.protocol.types import PendingExchange, PullResult, PushSummary
from paramserve.worker.closure_pickling import dumps_closure
from paramserve.worker.core import ClosureOutcome, ClosureRequest, blame_failed_push
from paramserve.worker.layers import ServerOptimizer
from paramserve.worker.pipeline import EarlierPushFailed, PushPipeline
from paramserve.worker.results import ClosureFailure

LR = 0.5


def train_step(model: nn.Module, optimizer: ServerOptimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    optimizer.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optimizer.step()
    return loss.item()


def explode() -> None:
    raise ValueError("the user's closure failed")


def distributed_linear() -> tuple[nn.Linear, ServerOptimizer]:
    return fake_servers.distributed_linear(LR)


def request(servers, fn, *args, closure_id: str, overlap: bool = True) -> ClosureRequest:
    return ClosureRequest(
        closure_id=closure_id,
        payload=dumps_closure((fn, args, {})),
        function_name=fn.__name__,
        cluster=servers.cluster,
        max_value_age=3600.0,
        overlap_pushes=overlap,
    )


def test_each_step_computes_from_values_that_miss_the_workers_own_push_in_flight(core, servers):
    model, optimizer = distributed_linear()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    local = servers.local_linear()

    outcomes = core.run_closures(
        [request(servers, train_step, model, optimizer, x, y, closure_id=f"c{i}") for i in range(4)]
    )

    def gradients_at(weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            local.weight.copy_(weight)
            local.bias.copy_(bias)
        local.zero_grad()
        ((local(x) - y) ** 2).mean().backward()
        return local.weight.grad.clone(), local.bias.grad.clone()

    # c0 pulls v0 and leaves its push in flight; c1 has nothing returned to start from, so it
    # settles c0's push and pulls v1; c2 and c3 start from what the previous settle returned.
    v0 = (local.weight.detach().clone(), local.bias.detach().clone())
    g0 = gradients_at(*v0)
    v1 = (v0[0] - LR * g0[0], v0[1] - LR * g0[1])
    g1 = gradients_at(*v1)
    v2 = (v1[0] - LR * g1[0], v1[1] - LR * g1[1])
    g2 = gradients_at(*v1)  # computed while c1's push was in flight: it misses it
    v3 = (v2[0] - LR * g2[0], v2[1] - LR * g2[1])
    g3 = gradients_at(*v2)  # c2's push in flight
    v4 = (v3[0] - LR * g3[0], v3[1] - LR * g3[1])
    torch.testing.assert_close(servers.value("w"), v4[0])
    torch.testing.assert_close(servers.value("b"), v4[1])
    assert [o.error for o in outcomes] == [None] * 4
    assert [o.pushes_applied for o in outcomes] == [2] * 4, "each closure's push counted once it was applied"
    assert servers.traffic.started == 4 and servers.version("w") == 4, "nothing in flight once the worker answers"
    assert sorted(servers.traffic.pulled) == ["b", "b", "w", "w"], "only the first two closures pull"
    assert servers.traffic.push_keys == ["c0/0", "c1/0", "c2/0", "c3/0"]
    assert model.weight.grad is None, "a pushed gradient belongs to its push"


def test_without_overlap_every_push_is_applied_before_the_next_step(core, servers):
    model, optimizer = distributed_linear()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    outcomes = core.run_closures(
        [request(servers, train_step, model, optimizer, x, y, closure_id=f"c{i}", overlap=False) for i in range(3)]
    )
    assert [o.pushes_applied for o in outcomes] == [2] * 3
    assert servers.traffic.started == 0 and servers.version("w") == 3


def test_a_push_that_fails_is_its_own_closures_error_and_the_next_closure_is_not_run(core, servers):
    model, optimizer = distributed_linear()
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    before = servers.value("w").clone()

    outcomes = core.run_closures(
        [
            request(servers, train_step, model, optimizer, torch.full((4, 3), float("nan")), y, closure_id="nan"),
            request(servers, train_step, model, optimizer, x, y, closure_id="next"),
            request(servers, train_step, model, optimizer, x, y, closure_id="never"),
        ]
    )

    assert len(outcomes) == 1, "the closure after the failed push stopped at its own push: not run"
    assert outcomes[0].result is None and "NaN or Inf" in outcomes[0].error.message
    assert outcomes[0].error.type.endswith("NonFiniteGradientError")
    assert servers.traffic.push_keys == ["nan/0"], "the next closure never pushed"
    assert servers.version("w") == 0 and torch.equal(servers.value("w"), before)


def test_a_user_error_after_an_overlapped_push_leaves_that_push_applied(core, servers):
    model, optimizer = distributed_linear()
    x, y = torch.randn(4, 3), torch.randn(4, 2)

    outcomes = core.run_closures(
        [
            request(servers, train_step, model, optimizer, x, y, closure_id="ok"),
            request(servers, explode, closure_id="bad"),
            request(servers, train_step, model, optimizer, x, y, closure_id="cancelled"),
        ]
    )

    assert [o.error is None for o in outcomes] == [True, False]
    assert outcomes[0].pushes_applied == 2 and cloudpickle.loads(outcomes[0].result) > 0
    assert "the user's closure failed" in outcomes[1].error.message
    assert servers.version("w") == 1


# ---------------------------------------------------------------- the pipeline alone


def _exchange(log: list[str], name: str, error: Exception | None = None) -> PendingExchange:
    def finish() -> tuple[PushSummary, PullResult]:
        log.append(f"{name} read")
        if error is not None:
            raise error
        return PushSummary(()), PullResult({}, {})

    return PendingExchange(finish, lambda: log.append(f"{name} abandoned"))


def test_the_pipeline_holds_one_push_and_names_the_owner_of_a_failed_one():
    log: list[str] = []
    pipeline = PushPipeline()
    pipeline.hold("first", _exchange(log, "a"), lambda e: e.result())
    with pytest.raises(RuntimeError, match="in flight already"):
        pipeline.hold("second", _exchange(log, "b"), lambda e: e.result())
    pipeline.settle()
    assert log == ["a read"] and not pipeline.in_flight and pipeline.failure is None
    pipeline.settle()  # nothing in flight: nothing to do

    boom = ValueError("server said no")
    pipeline.hold("second", _exchange(log, "c", boom), lambda e: e.result())
    with pytest.raises(EarlierPushFailed) as raised:
        pipeline.settle()
    assert raised.value.__cause__ is boom and pipeline.failure == ("second", boom)

    pipeline.hold("third", _exchange(log, "d", RuntimeError("later")), lambda e: e.result())
    pipeline.settle_quietly()
    assert pipeline.failure == ("second", boom), "the first failure is the one reported"

    pipeline.hold("fourth", _exchange(log, "e"), lambda e: e.result())
    pipeline.abandon()
    assert log[-1] == "e abandoned" and not pipeline.in_flight


def test_an_exchange_ends_once():
    log: list[str] = []
    exchange = _exchange(log, "a")
    exchange.result()
    with pytest.raises(RuntimeError, match="ended already"):
        exchange.result()
    exchange.abandon()
    assert log == ["a read"] and exchange.done


def _outcome(error: ClosureFailure | None = None) -> ClosureOutcome:
    return ClosureOutcome(
        result=None if error else b"ok",
        error=error,
        worker_incarnation="i",
        resources_held=(),
        pushes_applied=1,
        pushes_duplicate=0,
        seconds=0.0,
        device="cpu",
    )


def test_a_failed_push_fails_its_closure_and_drops_the_runs_after_it():
    owners = [object(), object(), object()]
    runs: list[Any] = [(None, _outcome(), owner) for owner in owners]

    blamed = blame_failed_push(runs, (owners[1], ConnectionError("server went away")))

    assert [access for _, _, access in blamed] == owners[:2], "the closures after it go back to the queue"
    assert blamed[0][1].error is None
    assert blamed[1][1].result is None and "server went away" in blamed[1][1].error.message


def test_a_failed_push_keeps_its_closures_own_earlier_error():
    owner = object()
    group_broke = ClosureFailure(type="GroupFailed", message="a member died", group_failed=True)
    runs: list[Any] = [(None, _outcome(group_broke), owner)]

    assert blame_failed_push(runs, (owner, ConnectionError("server went away")))[0][1].error is group_broke


def test_a_failed_push_whose_closure_went_back_to_the_queue_changes_nothing():
    """A hybrid round whose group broke already cut the runs before the closure of the push."""
    runs: list[Any] = [(None, _outcome(), object())]

    assert blame_failed_push(runs, (object(), ConnectionError("server went away"))) == runs
