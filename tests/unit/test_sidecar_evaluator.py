"""The sidecar evaluator evaluates each new checkpoint and writes TensorBoard summaries
(issue 11, item 10), from its Python API."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from paramserve.coordinator.demos.digits import MLP, digits_split
from paramserve.coordinator.sidecar_evaluator import SidecarEvaluator
from paramserve.coordinator.training.callbacks import ModelCheckpoint
from paramserve.coordinator.training.loops import evaluate, fit

LOSS = nn.CrossEntropyLoss(reduction="none")


@pytest.mark.parametrize("weights_only", [True, False], ids=["weights", "training-state"])
def test_each_new_checkpoint_is_evaluated_once_and_summarised(tmp_path, weights_only):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y, x_test, y_test = digits_split()
    torch.manual_seed(0)
    model = MLP(16)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    evaluator = SidecarEvaluator(MLP(16), [(x_test, y_test)], tmp_path / "ckpts", log_dir=tmp_path / "logs")
    assert evaluator.evaluate_latest() is None, "nothing to evaluate yet"

    fit(
        model,
        optimizer,
        LOSS,
        x,
        y,
        epochs=2,
        verbose=False,
        callbacks=[ModelCheckpoint(tmp_path / "ckpts" / "ckpt-{epoch:02d}.pt", save_weights_only=weights_only)],
    )
    evaluation = evaluator.evaluate_latest()

    assert evaluation is not None and evaluation.checkpoint.name == "ckpt-02.pt"
    assert evaluation.results == pytest.approx(evaluate(model, LOSS, (x_test, y_test), return_dict=True))
    assert evaluator.evaluate_latest() is None, "a checkpoint is evaluated once"
    evaluator.close()
    events = EventAccumulator(str(tmp_path / "logs" / "validation"))
    events.Reload()
    assert {"epoch_loss", "epoch_accuracy"} <= set(events.Tags()["scalars"])


def test_run_stops_on_request_and_after_max_evaluations(tmp_path):
    x, y, x_test, y_test = digits_split()
    model = MLP(16)
    torch.save(model.state_dict(), tmp_path / "a.pt")
    evaluator = SidecarEvaluator(MLP(16), [(x_test, y_test)], tmp_path, max_evaluations=1, every=0.01)
    assert [e.checkpoint.name for e in evaluator.run()] == ["a.pt"]

    stop = threading.Event()
    waiting = SidecarEvaluator(
        MLP(16), [(x_test, y_test)], tmp_path / "empty", every=0.01, on_evaluation=lambda e: None
    )
    thread = threading.Thread(target=waiting.run, args=(stop,), name="test-evaluator")
    thread.start()
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive() and waiting.evaluations == []


class Hybrid(nn.Module):
    """A table on the parameter servers and dense layers replicated on the workers (sync_dense)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(6, 3)
        self.top = nn.Linear(3, 2)


def write_hybrid_checkpoint(root, model: Hybrid):
    """A checkpoint as CheckpointManager writes one under sync_dense: the table's shards, the dense
    layers in dense_state.pt (named as the servers name variables), its hash in the manifest."""
    from paramserve.coordinator.checkpointing.dense_checkpoint import DENSE_EXTRA_KEY, write_checkpoint_state
    from paramserve.psserver.checkpoint.shard_files import save_checkpoint
    from paramserve.psserver.protocol.types import ShardRef, ShardState

    table = model.table.weight.detach().clone()
    dense = {f"hybrid.top.{name}": value.detach().clone() for name, value in model.top.named_parameters()}
    state = {"version": 3, "values": dense, "optimizer": None, "applied": []}
    return save_checkpoint(
        root,
        [ShardState(ShardRef("hybrid.table", 0), tuple(table.shape), 0, table)],
        extra={"step": 7},
        add_files=lambda staged: {DENSE_EXTRA_KEY: write_checkpoint_state(staged, state)},
    )


def test_a_hybrid_checkpoints_dense_layers_are_read_from_its_dense_state_checked_by_its_hash(tmp_path):
    from paramserve.coordinator.sidecar_evaluator import load_checkpoint_weights
    from paramserve.psserver.protocol.errors import CheckpointError

    torch.manual_seed(0)
    trained = Hybrid()
    path = write_hybrid_checkpoint(tmp_path / "ckpts", trained)

    weights, step = load_checkpoint_weights(path, Hybrid())

    assert step == 7
    assert weights.keys() == trained.state_dict().keys()
    for name, value in trained.state_dict().items():
        assert torch.equal(weights[name], value), name
    data = bytearray((path / "dense_state.pt").read_bytes())
    data[-1] ^= 0xFF  # damaged after the manifest named its hash
    (path / "dense_state.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its manifest"):
        load_checkpoint_weights(path, Hybrid())
