"""Hybrid training's pure decisions: who counts in a step, whose state a new group takes, how
the header travels in the all-reduce, how a round is shared and when the group forms anew."""

from __future__ import annotations

import io
import random
from types import SimpleNamespace

import pytest
import torch

from paramserve.coordinator.dispatch.batching import ROUND_FACTOR, BatchSizer
from paramserve.coordinator.dispatch.dense_rounds import (
    DenseRounds,
    DenseRoundsLink,
    DenseSettings,
    default_rendezvous_host,
    plan_generation,
    round_shares,
)
from paramserve.coordinator.dispatch.failures import Action, FailurePolicy, decide_on_closure_error
from paramserve.worker.dense.group import (
    HEADER_SLOT,
    contributors,
    decode_headers,
    encode_device,
    encode_header,
    key_hash,
    pairwise_exchange,
    state_source,
    step_backend,
    store_endpoint,
    sum_in_rank_order,
)
from paramserve.worker.results import ClosureFailure, GroupFailed, closure_failure


def test_contributors_are_members_stepping_under_keys_not_applied_before() -> None:
    assert contributors([True, True, False], [11, 12, 13], applied=set()) == [0, 1]
    assert contributors([True, True, True], [11, 12, 13], applied={12}) == [0, 2]  # a retried step counts once
    assert contributors([False, False], [0, 0], applied=set()) == []


def test_state_source_is_the_member_with_most_steps_lowest_rank_on_ties() -> None:
    assert state_source([3, 5, 5, -1]) == 1
    assert state_source([0, 0]) == 0
    assert state_source([-1, 7]) == 1


def test_steps_go_over_nccl_only_when_every_member_has_a_gpu_of_its_own() -> None:
    gpu_a, gpu_b = bytes(range(16)), bytes(range(1, 17))
    assert step_backend([encode_device(gpu_a, True), encode_device(gpu_b, True)]) == "nccl"
    assert step_backend([encode_device(gpu_a, True)]) == "nccl"  # a group of one GPU worker
    # Two workers on one GPU: NCCL refuses two ranks on one device; gloo through host memory.
    assert step_backend([encode_device(gpu_a, True), encode_device(gpu_a, True)]) == "gloo"
    assert step_backend([encode_device(gpu_a, True), encode_device(None, True)]) == "gloo"  # one on a CPU
    assert step_backend([encode_device(gpu_a, True), encode_device(gpu_b, False)]) == "gloo"  # a torch without NCCL
    assert step_backend([encode_device(None, False)] * 2) == "gloo"
    assert step_backend([]) == "gloo"


def test_gradients_go_pairwise_only_between_two_members_on_gloo() -> None:
    assert pairwise_exchange(2, "gloo") and pairwise_exchange(1, "gloo")
    # Three or more: a member failing on one peer would leave the others waiting for its vector.
    assert not pairwise_exchange(3, "gloo") and not pairwise_exchange(8, "gloo")
    assert not pairwise_exchange(2, "nccl")  # NCCL's all-reduce runs on the GPUs


def test_every_member_sums_the_same_bits_in_rank_order() -> None:
    torch.manual_seed(0)
    parts = [torch.randn(1000) * 10**k for k in range(4)]  # magnitudes where the order shows
    total = sum_in_rank_order(parts)
    assert torch.equal(total, ((parts[0] + parts[1]) + parts[2]) + parts[3])
    assert torch.equal(sum_in_rank_order(list(parts)), total)  # another member: the same bits
    assert parts[0].abs().max() < 10  # the inputs are left as they were


def test_a_gpu_uuid_survives_its_encoding_into_int64s() -> None:
    uuid = bytes([0xFF] * 8 + [0x80] + [0] * 7)  # halves at the edges of int64
    entry = encode_device(uuid, True)
    assert entry[0] == 1 and all(-(2**63) <= v < 2**63 for v in entry)
    assert entry != encode_device(bytes(16), True)
    assert encode_device(uuid, False) == encode_device(None, True) == [0, 0, 0]


def test_headers_survive_the_sum_of_every_members_slot() -> None:
    rng = random.Random(0)
    world = 5
    expected = [(rng.random() < 0.6, key_hash(f"closure-{rng.random()}/dense/{i}")) for i in range(world)]
    summed = [0.0] * (world * HEADER_SLOT)
    for rank, (stepping, key) in enumerate(expected):
        slot = encode_header(stepping, key)
        for i, value in enumerate(slot):
            summed[rank * HEADER_SLOT + i] += value
    stepping, keys = decode_headers(summed, world)
    assert stepping == [s for s, _ in expected]
    assert keys == [k if s else 0 for s, k in expected]


def test_key_hashes_fit_the_header_and_differ() -> None:
    keys = {key_hash(f"c{i}/dense/0") for i in range(1000)}
    assert len(keys) == 1000
    assert all(0 <= k < 2**63 for k in keys)
    assert key_hash("a/dense/0") == key_hash("a/dense/0")


@pytest.mark.parametrize(
    ("address", "expected"),
    [("127.0.0.1:2", ("127.0.0.1", 2)), ("[::1]:5", ("::1", 5)), ("coordinator.ns:80", ("coordinator.ns", 80))],
)
def test_store_endpoint_parses_host_and_port(address: str, expected: tuple[str, int]) -> None:
    assert store_endpoint(address) == expected


@pytest.mark.parametrize("address", ["", "host", ":5", "host:port"])
def test_store_endpoint_refuses_what_is_not_host_port(address: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        store_endpoint(address)


def test_round_shares_are_even_and_capped() -> None:
    assert round_shares(10, 3, 16) == [4, 3, 3]
    assert round_shares(100, 2, 16) == [16, 16]
    assert round_shares(1, 3, 16) == [1, 0, 0]  # the others still take part, with no closure
    assert round_shares(5, 0, 16) == []
    assert sum(round_shares(37, 4, 8)) == 32


def test_a_new_generation_forms_when_members_change_or_the_group_broke() -> None:
    assert plan_generation(None, ["a", "b"], broken=False, generation=0) == 1
    assert plan_generation(["a", "b"], ["a", "b"], broken=False, generation=1) == 1
    assert plan_generation(["a", "b"], ["a"], broken=False, generation=1) == 2
    assert plan_generation(["a", "b"], ["b", "a"], broken=False, generation=1) == 2  # ranks moved
    assert plan_generation(["a", "b"], ["a", "b"], broken=True, generation=1) == 2


def test_rendezvous_host_is_loopback_only_for_a_local_cluster() -> None:
    assert default_rendezvous_host(["127.0.0.1:5", "localhost:6", "[::1]:7"]) == "127.0.0.1"
    assert default_rendezvous_host(["worker-0.svc:5", "127.0.0.1:6"]) != "127.0.0.1"


def test_a_round_lasts_longer_than_a_batch() -> None:
    sizer = BatchSizer(max_batch=16, target_seconds=0.1)
    assert sizer.round_share(100, 2) == 1  # no duration known yet
    sizer.observe(0.01)
    assert sizer.size(1000, 2) == 10
    assert sizer.round_share(1000, 2) == ROUND_FACTOR * 10
    assert sizer.round_share(7, 2) == 4  # never more than an even share of the queue
    short = BatchSizer(max_batch=16, target_seconds=0.1)
    short.observe(0.0001)
    assert short.round_share(10_000, 2) == 16 * ROUND_FACTOR  # short closures: ROUND_FACTOR batches


def test_a_broken_group_requeues_the_closure_until_attempts_run_out() -> None:
    policy = FailurePolicy(max_attempts=3)
    failure = closure_failure(GroupFailed("the dense group's allreduce failed"))
    assert failure.group_failed
    decision = decide_on_closure_error(failure, resends=0, known_resources=(), policy=policy, attempt=1)
    assert decision.action is Action.REQUEUE
    last = decide_on_closure_error(failure, resends=0, known_resources=(), policy=policy, attempt=3)
    assert last.action is Action.RAISE
    assert "dense group" in last.reason
    user_error = decide_on_closure_error(
        ClosureFailure(type="builtins.ValueError"), resends=0, known_resources=(), policy=policy
    )
    assert user_error.action is Action.RAISE


def test_the_dense_variables_follow_the_rounds_of_the_coordinator_connected_to_their_link() -> None:
    from paramserve.coordinator.strategies.sync_dense import SyncDense

    sync = SyncDense(SimpleNamespace(variables={}), timeout=5.0, rendezvous_host=None)  # type: ignore[arg-type]
    assert isinstance(sync.rounds, DenseRoundsLink) and not sync.rounds.connected
    assert sync.rounds.rounds_done() == 0
    assert sync.current_state() is None, "no coordinator: nothing is read from the workers"
    with pytest.raises(RuntimeError, match="ClusterCoordinator"):
        sync.rounds.read_state(1.0)

    saved = io.BytesIO()
    torch.save({"version": 3, "values": {}, "optimizer": None, "applied": []}, saved)
    reads: list[float] = []

    def read_state(timeout: float) -> bytes:
        reads.append(timeout)
        return saved.getvalue()

    rounds = DenseRounds(lambda: DenseSettings((), b"", 0), lambda: b"", rendezvous_host="127.0.0.1", timeout=5)
    sync.rounds.connect(rounds, read_state)
    assert sync.current_state() is None and reads == [], "no round finished yet: nothing new to read"
    rounds.round_finished()
    state = sync.current_state()
    assert state is not None and state["version"] == 3
    assert sync.current_state() is state and len(reads) == 1, "read at most once per round finished"
