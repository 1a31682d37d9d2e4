"""Checkpoints: round trip, re-partitioning on restore, atomicity under interrupted saves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from paramserve.psserver.checkpoint import shard_files as checkpoint
from paramserve.psserver.checkpoint.shard_files import (
    latest_checkpoint,
    load_rows,
    read_manifest,
    resolve,
    save_checkpoint,
    variables,
)
from paramserve.psserver.protocol.errors import CheckpointBaseMissingError, CheckpointError, InvalidRequestError
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.partition import split_rows
from paramserve.psserver.protocol.types import ShardRef, ShardState
from paramserve.psserver.store.shard_store import ShardPush, ShardStore, StoreConfig

ADAM = OptimizerSpec("Adam", {"lr": 0.1, "betas": [0.9, 0.99]})
EMBEDDING = "model/embedding.weight"  # a slash and dots: must be escaped in file names
ROWS, COLS = 10, 4


def _trained_store(num_shards: int = 2, pushes: int = 3) -> ShardStore:
    """An Adam embedding on ``num_shards`` shards, every shard pushed ``pushes`` times."""
    store = ShardStore(StoreConfig())
    full = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))
    store.create_shards(
        [
            ShardState(ShardRef(EMBEDDING, index), (ROWS, COLS), r.start, full[r.start : r.stop].clone(), ADAM)
            for index, r in enumerate(split_rows(ROWS, num_shards))
        ]
    )
    _push_full_gradients(store, num_shards, pushes, seed=1, prefix="train")
    return store


def _push_full_gradients(store: ShardStore, num_shards: int, pushes: int, seed: int, prefix: str) -> None:
    """Pushes the same full-variable gradients whatever the partitioning."""
    generator = torch.Generator().manual_seed(seed)
    for step in range(pushes):
        grad = torch.randn(ROWS, COLS, generator=generator)
        parts = [
            ShardPush(ShardRef(EMBEDDING, index), grad[r.start : r.stop].clone(), None, 0)
            for index, r in enumerate(split_rows(ROWS, num_shards))
        ]
        store.push(parts, f"{prefix}-{step}")


def _full_value(store: ShardStore) -> torch.Tensor:
    states = sorted((s for s in store.export() if s.ref.variable == EMBEDDING), key=lambda s: s.row_start)
    return torch.cat([s.value for s in states])


def _restore(path: Path, num_shards: int) -> ShardStore:
    store = ShardStore(StoreConfig())
    store.create_shards(
        [
            load_rows(path, EMBEDDING, r.start, len(r), ShardRef(EMBEDDING, index))
            for index, r in enumerate(split_rows(ROWS, num_shards))
        ]
    )
    return store


def test_round_trip(tmp_path: Path) -> None:
    store = _trained_store()
    scalar = ShardRef("scale", 0)
    store.create_shards([ShardState(scalar, (), 0, torch.tensor(3.0), OptimizerSpec("SGD", {"lr": 1.0}))])
    store.push([ShardPush(scalar, torch.tensor(1.0), None, 0)], "s")
    saved = store.export()
    path = save_checkpoint(tmp_path, saved, extra={"step": 42})

    assert path == tmp_path / "ckpt-00000001" and latest_checkpoint(tmp_path) == path
    assert (tmp_path / "LATEST").read_text().strip() == "ckpt-00000001"
    manifest = read_manifest(tmp_path)
    assert manifest.extra == {"step": 42}
    assert manifest.variables[EMBEDDING].optimizer == ADAM
    assert manifest.variables[EMBEDDING].dtype == torch.float32
    assert all(file.parent == path for file in path.iterdir()), "escaped names stay inside the checkpoint"
    for state in saved:
        rows = state.value.shape[0] if state.value.dim() else 1
        loaded = load_rows(path, state.ref.variable, state.row_start, rows, state.ref)
        assert torch.equal(loaded.value, state.value)
        assert loaded.slots.keys() == state.slots.keys()
        assert all(torch.equal(loaded.slots[k], state.slots[k]) for k in state.slots)
        assert (loaded.version, loaded.applied_keys, loaded.optimizer) == (
            state.version,
            state.applied_keys,
            state.optimizer,
        )


def test_two_shards_restore_onto_three_with_slots(tmp_path: Path) -> None:
    store = _trained_store(num_shards=2)
    saved = {s.ref.shard: s for s in store.export()}
    path = save_checkpoint(tmp_path, list(saved.values()))

    restored = _restore(path, num_shards=3)
    assert [i.shape for i in restored.list_shards()] == [(4, COLS), (3, COLS), (3, COLS)]
    assert torch.equal(_full_value(restored), _full_value(store))
    middle = restored.export([ShardRef(EMBEDDING, 1)])[0]  # rows [4, 7) straddle saved shards 0 and 1
    expected_exp_avg = torch.cat([saved[0].slots["exp_avg"], saved[1].slots["exp_avg"]])[4:7]
    assert torch.equal(middle.slots["exp_avg"], expected_exp_avg)
    assert torch.equal(middle.slots["step"], saved[0].slots["step"])
    assert middle.version == 3
    assert middle.applied_keys == ["train-0", "train-1", "train-2"]

    # Training continues exactly as it would have on the original partitioning.
    _push_full_gradients(store, 2, pushes=2, seed=9, prefix="more")
    _push_full_gradients(restored, 3, pushes=2, seed=9, prefix="more")
    torch.testing.assert_close(_full_value(restored), _full_value(store), atol=1e-6, rtol=0)


def test_restore_mixes_shards_with_and_without_state(tmp_path: Path) -> None:
    store = ShardStore(StoreConfig())
    store.create_shards(
        [
            ShardState(ShardRef(EMBEDDING, 0), (ROWS, COLS), 0, torch.zeros(5, COLS), ADAM),
            ShardState(ShardRef(EMBEDDING, 1), (ROWS, COLS), 5, torch.zeros(5, COLS), ADAM),
        ]
    )
    store.push([ShardPush(ShardRef(EMBEDDING, 0), torch.ones(5, COLS), None, 0)], "only-shard-0")
    path = save_checkpoint(tmp_path, store.export())
    whole = load_rows(path, EMBEDDING, 0, ROWS, ShardRef(EMBEDDING, 0))
    assert whole.slots["exp_avg"].shape == (ROWS, COLS)
    assert (
        torch.count_nonzero(whole.slots["exp_avg"][5:]) == 0
        and torch.count_nonzero(whole.slots["exp_avg"][:5]) == 5 * COLS
    )
    assert whole.version == 1 and whole.applied_keys == ["only-shard-0"]
    assert float(whole.slots["step"]) == 1.0
    ShardStore(StoreConfig()).create_shards([whole])  # a valid state for the store


def test_missing_rows_and_variables(tmp_path: Path) -> None:
    store = _trained_store(num_shards=2)
    only_first = [s for s in store.export() if s.ref.shard == 0]
    path = save_checkpoint(tmp_path, only_first)
    with pytest.raises(CheckpointError, match=r"row 5 is not in the checkpoint"):
        load_rows(path, EMBEDDING, 3, 4, ShardRef(EMBEDDING, 0))
    with pytest.raises(CheckpointError, match="not in checkpoint"):
        load_rows(path, "nope", 0, 1, ShardRef("nope", 0))
    with pytest.raises(CheckpointError, match="outside"):
        load_rows(path, EMBEDDING, 8, 5, ShardRef(EMBEDDING, 0))
    assert load_rows(path, EMBEDDING, 1, 3, ShardRef(EMBEDDING, 0)).value.shape == (3, COLS)


def test_interrupted_save_leaves_previous_checkpoint(tmp_path: Path) -> None:
    store = _trained_store()
    first = save_checkpoint(tmp_path, store.export(), extra={"step": 1})
    latest_before = (tmp_path / "LATEST").read_bytes()
    _push_full_gradients(store, 2, pushes=1, seed=5, prefix="later")

    class Crash(Exception):
        pass

    def crash() -> None:
        raise Crash

    with pytest.raises(Crash):
        save_checkpoint(tmp_path, store.export(), extra={"step": 2}, before_commit=crash)
    assert (tmp_path / "LATEST").read_bytes() == latest_before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "LATEST", "ckpt-00000001"], "no garbage left"
    assert read_manifest(tmp_path).extra == {"step": 1}
    assert resolve(tmp_path) == first
    assert torch.equal(_full_value(_restore(tmp_path, 2)), _full_value(_trained_store()))


def test_crash_between_commit_and_latest_keeps_latest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _trained_store()
    first = save_checkpoint(tmp_path, store.export())

    def fail(root: Path, name: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "_write_latest", fail)
    with pytest.raises(CheckpointError, match="disk full"):
        save_checkpoint(tmp_path, store.export())
    assert latest_checkpoint(tmp_path) == first
    monkeypatch.undo()
    third = save_checkpoint(tmp_path, store.export())
    assert third.name == "ckpt-00000003" and latest_checkpoint(tmp_path) == third


def test_leftover_tmp_directory_is_not_a_checkpoint(tmp_path: Path) -> None:
    first = save_checkpoint(tmp_path, _trained_store().export())
    # What a kill -9 during a save leaves behind: a complete-looking staging directory.
    staged = tmp_path / ".tmp-deadbeef"
    staged.mkdir()
    (staged / "manifest.json").write_text((first / "manifest.json").read_text())
    (tmp_path / "LATEST").unlink()
    assert latest_checkpoint(tmp_path) == first
    assert save_checkpoint(tmp_path, []).name == "ckpt-00000002"


def test_keep_prunes_old_checkpoints(tmp_path: Path) -> None:
    states = _trained_store().export()
    for step in range(4):
        last = save_checkpoint(tmp_path, states, extra={"step": step}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "LATEST", "ckpt-00000003", "ckpt-00000004"]
    assert latest_checkpoint(tmp_path) == last and read_manifest(tmp_path).extra == {"step": 3}


@pytest.mark.parametrize("make", ["empty", "missing", "file"])
def test_not_a_checkpoint(tmp_path: Path, make: str) -> None:
    target = tmp_path / "target"
    if make == "empty":
        target.mkdir()
    elif make == "file":
        target.write_text("hello")
    with pytest.raises(CheckpointError, match="manifest.json") as raised:
        resolve(target)
    assert "ckpt-NNNNNNNN" in str(raised.value)
    with pytest.raises(CheckpointError):
        variables(target)


def test_malformed_manifest(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, _trained_store().export())
    (path / "manifest.json").write_text("{")
    with pytest.raises(CheckpointError, match="malformed"):
        read_manifest(path)
    (path / "manifest.json").write_text(json.dumps({"format": "paramserve-checkpoint", "format_version": 99}))
    with pytest.raises(CheckpointError, match="version 99"):
        read_manifest(path)


def test_corrupt_shard_file(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, _trained_store().export())
    entry = variables(path)[EMBEDDING]
    (path / entry.shards[0].file).write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="shard file .* does not match its manifest"):
        load_rows(path, EMBEDDING, 0, 2, ShardRef(EMBEDDING, 0))


def test_save_rejects_inconsistent_states_before_writing(tmp_path: Path) -> None:
    a = ShardState(ShardRef("v", 0), (4, 2), 0, torch.zeros(2, 2), None)
    b = ShardState(ShardRef("v", 1), (5, 2), 2, torch.zeros(2, 2), None)
    with pytest.raises(CheckpointError, match="disagree"):
        save_checkpoint(tmp_path, [a, b])
    with pytest.raises(InvalidRequestError, match="JSON"):
        save_checkpoint(tmp_path, [a], extra={"bad": object()})
    with pytest.raises(InvalidRequestError, match="keep"):
        save_checkpoint(tmp_path, [a], keep=-1)
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- whole checkpoints only


def test_a_whole_save_refuses_states_that_leave_rows_out_and_writes_nothing(tmp_path: Path) -> None:
    states = _trained_store(num_shards=2).export()
    first_shard_only = [s for s in states if s.ref.shard == 0]
    with pytest.raises(CheckpointError, match="do not cover the variable exactly"):
        save_checkpoint(tmp_path, first_shard_only, require_whole=True)
    assert latest_checkpoint(tmp_path) is None and not list(tmp_path.glob("ckpt-*"))
    # A server's own save holds only its shards: allowed without require_whole.
    partial = save_checkpoint(tmp_path, first_shard_only)
    assert not checkpoint.is_whole(partial), "a checkpoint missing rows is not whole"


def test_latest_skips_a_checkpoint_that_is_not_whole_for_the_newest_whole_one(tmp_path: Path) -> None:
    states = _trained_store(num_shards=2).export()
    whole = save_checkpoint(tmp_path, states, require_whole=True)
    partial = save_checkpoint(tmp_path, [s for s in states if s.ref.shard == 1])  # LATEST names it
    assert (tmp_path / "LATEST").read_text().strip() == partial.name
    assert checkpoint.is_whole(whole) and not checkpoint.is_whole(partial)
    assert latest_checkpoint(tmp_path) == whole and resolve(tmp_path) == whole
    assert checkpoint.list_checkpoints(tmp_path) == [whole]


def test_a_checkpoint_with_a_shard_file_missing_is_not_whole(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, _trained_store(num_shards=2).export(), require_whole=True)
    assert checkpoint.is_whole(path)
    next(path.glob("*.shard-1.pt")).unlink()
    assert not checkpoint.is_whole(path) and latest_checkpoint(tmp_path) is None


def test_gaps_name_missing_and_doubled_rows() -> None:
    shards = lambda *ranges: tuple(checkpoint.SavedShard(i, a, b - a, "", 0) for i, (a, b) in enumerate(ranges))  # noqa: E731
    variable = lambda *ranges: checkpoint.VariableEntry((10, 2), torch.float32, None, shards(*ranges))  # noqa: E731
    assert checkpoint.gaps(variable((0, 5), (5, 10))) == []
    assert checkpoint.gaps(variable((0, 5))) == [(5, 10)]
    assert checkpoint.gaps(variable((5, 10))) == [(0, 5)]
    assert checkpoint.gaps(variable((0, 6), (5, 10))) == [(5, 6)]
    assert checkpoint.gaps(checkpoint.VariableEntry((), torch.float32, None, shards((0, 1)))) == []


def test_a_checkpoint_that_needs_older_ones_is_whole_only_while_they_are(tmp_path: Path) -> None:
    states = _trained_store().export()
    base = save_checkpoint(tmp_path, states)
    delta = save_checkpoint(tmp_path, states, needs=[base.name])
    assert read_manifest(delta).needs == (base.name,) and checkpoint.is_whole(delta)
    assert checkpoint.missing_bases(delta) == [] and checkpoint.missing_bases(base) == []
    (base / checkpoint.MANIFEST).unlink()
    assert checkpoint.missing_bases(delta) == [base.name] and not checkpoint.is_whole(delta)
    assert latest_checkpoint(tmp_path) is None, "neither can be restored now"


def test_a_save_refuses_to_need_a_checkpoint_that_is_gone_and_writes_nothing(tmp_path: Path) -> None:
    states = _trained_store().export()
    first = save_checkpoint(tmp_path, states)
    with pytest.raises(CheckpointBaseMissingError, match="needs ckpt-00000007"):
        save_checkpoint(tmp_path, states, needs=["ckpt-00000007"])
    with pytest.raises(CheckpointBaseMissingError):
        save_checkpoint(tmp_path, states, needs=["../elsewhere"])
    assert latest_checkpoint(tmp_path) == first and len(checkpoint.list_checkpoints(tmp_path)) == 1


def test_pruning_keeps_what_a_kept_checkpoint_needs(tmp_path: Path) -> None:
    states = _trained_store().export()
    full = save_checkpoint(tmp_path, states, keep=2)
    one = save_checkpoint(tmp_path, states, keep=2, needs=[full.name])
    two = save_checkpoint(tmp_path, states, keep=2, needs=[full.name, one.name])
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [full.name, one.name, two.name]
    save_checkpoint(tmp_path, states, keep=2)  # a full one: the chain before it goes once it is old
    last = save_checkpoint(tmp_path, states, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["ckpt-00000004", last.name]
