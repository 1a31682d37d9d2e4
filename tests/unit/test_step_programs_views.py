"""A connection's step programs keep their tensor views of its buffers while the buffers are
the same, and never keep an old buffer: pure logic over a real ShardStore, no sockets."""

from __future__ import annotations

import gc
import weakref

import torch

from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.types import ShardRef, ShardState
from paramserve.psserver.steps.programs import PushSlot, StepProgram, StepPrograms
from paramserve.psserver.store.shard_store import ShardStore
from paramserve.wire.v1 import parameter_server_pb2 as ps_pb2

W, B = ShardRef("w", 0), ShardRef("b", 0)


def program(store: ShardStore) -> StepProgram:
    prepared = store.prepare_step([(W, torch.float32, (2, 3)), (B, torch.float32, (3,))], [W, B])
    return StepProgram(
        ps_pb2.StepPlan(), prepared, (PushSlot(0, 24, torch.float32, (2, 3)), PushSlot(24, 12, torch.float32, (3,)))
    )


def make_store() -> ShardStore:
    store = ShardStore()
    sgd = OptimizerSpec("SGD", {"lr": 0.1})
    store.create_shards([ShardState(W, (2, 3), 0, torch.zeros(2, 3), sgd), ShardState(B, (3,), 0, torch.zeros(3), sgd)])
    return store


def test_views_are_made_once_per_buffer_and_read_its_current_bytes():
    programs, store = StepPrograms(), make_store()
    step = programs.define(1, program(store))
    buffer = torch.zeros(36, dtype=torch.uint8)

    first, flat = programs.pushed_values(step, buffer)
    buffer.view(torch.float32)[:] = torch.arange(9.0)  # the next step's bytes, in the same buffer
    again, _ = programs.pushed_values(step, buffer)

    assert again is first and flat is not None and flat.numel() == 9
    assert torch.equal(first[0], torch.arange(6.0).reshape(2, 3)) and torch.equal(
        first[1], torch.tensor([6.0, 7.0, 8.0])
    )
    assert programs.pushed_values(step, torch.zeros(36, dtype=torch.uint8))[0] is not first  # another buffer


def test_an_old_buffer_is_let_go_once_the_connection_uses_another():
    programs, store = StepPrograms(), make_store()
    step = programs.define(1, program(store))
    old = torch.zeros(36, dtype=torch.uint8)
    programs.pushed_values(step, old)
    programs.reply_views(step, old)
    storage = weakref.ref(old.untyped_storage())
    anchor = old.untyped_storage()  # the weak reference needs the storage object alive until `del`

    new = torch.zeros(36, dtype=torch.uint8)
    programs.pushed_values(step, new)
    programs.reply_views(step, new)
    del old, anchor
    gc.collect()

    assert storage() is None


def test_a_one_step_buffer_is_never_held_between_steps(monkeypatch):
    """A buffer over the reuse limit is made for one step (a large model's gradients or reply):
    its views kept, the server held a model-sized buffer between steps (seen as 44 MB of 133 in
    benchmarks/ps_memory.py)."""
    from paramserve.psserver.dataplane import frames as dataplane

    monkeypatch.setattr(dataplane, "REUSED_BUFFER_LIMIT", 35)
    programs, store = StepPrograms(), make_store()
    step = programs.define(1, program(store))
    payload, reply = torch.zeros(36, dtype=torch.uint8), torch.zeros(36, dtype=torch.uint8)
    views, flat = programs.pushed_values(step, payload)
    replies = programs.reply_views(step, reply)
    assert torch.equal(views[1], torch.zeros(3)) and [tuple(v.shape) for v in replies] == [(2, 3), (3,)]
    held = [weakref.ref(payload.untyped_storage()), weakref.ref(reply.untyped_storage())]
    anchors = [payload.untyped_storage(), reply.untyped_storage()]

    del payload, reply, views, flat, replies, anchors
    gc.collect()

    assert [ref() for ref in held] == [None, None]


def test_a_program_is_checked_again_when_the_store_changes():
    store = make_store()
    step = program(store)
    assert step.prepared.catalog_version == store.catalog_version
    store.delete_variable("b")
    assert step.prepared.catalog_version != store.catalog_version
