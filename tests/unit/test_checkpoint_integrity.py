"""What a restore trusts of a checkpoint's files, without processes: every file confined to its
checkpoint (no ``..``, no absolute name, no symbolic link), hashed at save and checked at restore,
deltas checked against the chain they extend, every tensor checked against what it restores into,
and every refusal a CheckpointError naming the file (psserver/checkpoint/integrity.py,
shard_files.py, dynamic_checkpoint.py; coordinator/checkpointing/dense_checkpoint.py)."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from pathlib import Path

import pytest
import torch

from paramserve.coordinator.checkpointing.dense_checkpoint import (
    check_dense_state,
    read_checkpoint_state,
    write_checkpoint_state,
)
from paramserve.psserver.checkpoint import dynamic_checkpoint
from paramserve.psserver.checkpoint import shard_files as checkpoint
from paramserve.psserver.dynamic.dynamic_types import DynamicShardState, DynamicTableConfig
from paramserve.psserver.protocol.errors import CheckpointBaseMissingError, CheckpointError
from paramserve.psserver.protocol.optimizer_spec import OptimizerSpec
from paramserve.psserver.protocol.types import ShardRef, ShardState
from paramserve.psserver.store.dynamic_table import DynamicShard

ADAGRAD = OptimizerSpec("Adagrad", {"lr": 0.3})
NAME = "w"


def _forbidden() -> bytes:
    """A torch file whose pickle names a class ``weights_only`` refuses to load."""
    buffer = io.BytesIO()
    torch.save({"value": Path("/etc/passwd")}, buffer)
    return buffer.getvalue()


FORBIDDEN = _forbidden()


def save_dense(root: Path, value: torch.Tensor | None = None) -> Path:
    value = torch.arange(8.0).reshape(4, 2) if value is None else value
    slots = {"sum": torch.ones_like(value), "step": torch.tensor(1.0)}
    state = ShardState(ShardRef(NAME, 0), tuple(value.shape), 0, value, ADAGRAD, slots)
    return checkpoint.save_checkpoint(root, [state])


def manifest_of(path: Path) -> dict:
    return json.loads((path / checkpoint.MANIFEST).read_text())


def rewrite_manifest(path: Path, raw: dict) -> None:
    (path / checkpoint.MANIFEST).write_text(json.dumps(raw))


def shard_entry(raw: dict) -> dict:
    return raw["variables"][NAME]["shards"][0]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def restore(path: Path) -> ShardState:
    return checkpoint.load_rows(path, NAME, 0, 4, ShardRef(NAME, 0))


def outside_file(tmp_path: Path) -> Path:
    """A shard file of another checkpoint, outside the root: values of 42."""
    other = save_dense(tmp_path / "elsewhere", torch.full((4, 2), 42.0))
    return other / shard_entry(manifest_of(other))["file"]


# ---------------------------------------------------------------- confined to the checkpoint


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_a_shard_file_named_outside_its_checkpoint_is_refused(tmp_path, how):
    path, target = save_dense(tmp_path / "root"), outside_file(tmp_path)
    raw = manifest_of(path)
    shard_entry(raw)["file"] = os.path.relpath(target, path) if how == "dotdot" else str(target)
    shard_entry(raw)["sha256"] = sha256(target)  # the attacker's manifest names the right hash
    rewrite_manifest(path, raw)
    with pytest.raises(CheckpointError, match="not a plain name in the checkpoint's directory") as caught:
        restore(path)
    assert repr(shard_entry(raw)["file"]) in str(caught.value)
    assert not checkpoint.is_whole(path) and "not a plain name" in (checkpoint.why_not_whole(path) or "")


@pytest.mark.parametrize("inside", [False, True])
def test_a_shard_file_that_is_a_symbolic_link_is_refused(tmp_path, inside):
    path = save_dense(tmp_path / "root")
    shard = path / shard_entry(manifest_of(path))["file"]
    target = path / "copy.pt" if inside else outside_file(tmp_path)
    if inside:
        target.write_bytes(shard.read_bytes())  # the same bytes: the hash matches
    shard.unlink()
    shard.symlink_to(target)
    with pytest.raises(CheckpointError, match="is a symbolic link") as caught:
        restore(path)
    assert str(shard) in str(caught.value)
    assert not checkpoint.is_whole(path)


def test_a_manifest_that_is_a_symbolic_link_is_refused(tmp_path):
    path, elsewhere = save_dense(tmp_path / "root"), save_dense(tmp_path / "elsewhere")
    (path / checkpoint.MANIFEST).unlink()
    (path / checkpoint.MANIFEST).symlink_to(elsewhere / checkpoint.MANIFEST)
    with pytest.raises(CheckpointError, match="manifest refused: .* is a symbolic link"):
        checkpoint.read_manifest(path)


def test_a_symlinked_checkpoint_directory_is_never_taken_for_the_latest(tmp_path):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    first = save_dense(root)
    outside = save_dense(elsewhere, torch.full((4, 2), 42.0))
    (root / "ckpt-00000009").symlink_to(outside)
    (root / checkpoint.LATEST).write_text("ckpt-00000009\n")
    assert checkpoint.latest_checkpoint(root) == first
    assert checkpoint.list_checkpoints(root) == [first]
    assert torch.equal(checkpoint.load_rows(root, NAME, 0, 4, ShardRef(NAME, 0)).value, torch.arange(8.0).reshape(4, 2))


# ---------------------------------------------------------------- hashed at save, checked at restore


def test_every_file_is_hashed_at_save_and_a_flipped_byte_is_refused(tmp_path):
    path = save_dense(tmp_path)
    raw = manifest_of(path)
    shard = path / shard_entry(raw)["file"]
    assert raw["integrity"] == "sha256" and shard_entry(raw)["sha256"] == sha256(shard)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its manifest") as caught:
        restore(path)
    assert str(shard) in str(caught.value)


def test_a_hashed_manifest_with_a_file_left_unhashed_is_refused(tmp_path):
    path = save_dense(tmp_path)
    raw = manifest_of(path)
    del shard_entry(raw)["sha256"]
    rewrite_manifest(path, raw)
    with pytest.raises(CheckpointError, match="has no SHA-256"):
        restore(path)


def test_a_checkpoint_written_before_hashes_restores_with_a_warning(tmp_path, caplog):
    path = save_dense(tmp_path)
    raw = manifest_of(path)
    del raw["integrity"], shard_entry(raw)["sha256"]
    rewrite_manifest(path, raw)
    with caplog.at_level(logging.WARNING):
        restored = restore(path)
    assert torch.equal(restored.value, torch.arange(8.0).reshape(4, 2))
    assert "written before paramserve hashed checkpoint files" in caplog.text


@pytest.mark.parametrize("payload", [b"not a torch file", FORBIDDEN])
def test_a_file_that_is_no_torch_file_is_a_checkpoint_error_even_with_its_hash(tmp_path, payload):
    path = save_dense(tmp_path)
    raw = manifest_of(path)
    shard = path / shard_entry(raw)["file"]
    shard.write_bytes(payload)
    shard_entry(raw)["sha256"] = sha256(shard)
    rewrite_manifest(path, raw)
    with pytest.raises(CheckpointError, match="cannot be read") as caught:
        restore(path)
    assert str(shard) in str(caught.value)


def test_a_slot_of_the_wrong_shape_is_refused_before_any_server_sees_it(tmp_path):
    path = save_dense(tmp_path)
    raw = manifest_of(path)
    shard = path / shard_entry(raw)["file"]
    contents = torch.load(shard, weights_only=True)
    contents["slots"]["sum"] = torch.ones(1, 1)
    shard.unlink()
    torch.save(contents, shard)
    shard_entry(raw)["sha256"] = sha256(shard)
    rewrite_manifest(path, raw)
    with pytest.raises(CheckpointError, match="slot 'sum' has shape"):
        restore(path)


# ---------------------------------------------------------------- dynamic tables: files and chains


def table_shard(ids: list[int]) -> DynamicShard:
    table = DynamicShard(ShardRef("t", 0), 1, DynamicTableConfig(dim=3, optimizer=ADAGRAD), idempotency_capacity=64)
    train(table, ids, "a")
    return table


def train(table: DynamicShard, ids: list[int], key: str) -> None:
    batch = torch.tensor(ids)
    table.lookup(batch, 0.0)
    table.push(batch, torch.ones(len(ids), 3), key, -1, 0.0)


def save_tables(root: Path, state: DynamicShardState, parent: Path | None = None) -> Path:
    name = parent.name if parent is not None else None
    return checkpoint.save_checkpoint(
        root,
        [],
        add_files=lambda staged: {dynamic_checkpoint.EXTRA_KEY: dynamic_checkpoint.write_tables(staged, [state], name)},
        needs=(name,) if name else (),
    )


def chain(root: Path) -> tuple[DynamicShard, Path, Path]:
    """A table saved whole, then as a delta of that save."""
    table = table_shard([1, 2, 3])
    base = table.export(incremental=True)
    full = save_tables(root, base)
    train(table, [4, 5], "b")
    return table, full, save_tables(root, table.export(since=base.mark), full)


def read(path: Path) -> list[DynamicShardState]:
    return dynamic_checkpoint.read_tables(path, checkpoint.read_manifest(path).extra)["t"]


def table_file(path: Path) -> Path:
    return path / checkpoint.read_manifest(path).extra["dynamic_tables"]["t"]["files"][0]["file"]


def reseal(path: Path, raw: dict | None = None) -> None:
    """The manifest rewritten with its file's hash as it is now (a careful forger's)."""
    raw = raw or manifest_of(path)
    item = raw["extra"]["dynamic_tables"]["t"]["files"][0]
    item["sha256"] = sha256(path / item["file"])
    rewrite_manifest(path, raw)


def test_a_chain_restores_and_names_its_parent_by_hash(tmp_path):
    table, full, delta = chain(tmp_path)
    entry = manifest_of(delta)["extra"]["dynamic_tables"]["t"]
    assert entry["parent"] == full.name and entry["parent_sha256"] == sha256(full / checkpoint.MANIFEST)
    assert all(item["sha256"] == sha256(delta / item["file"]) for item in entry["files"])
    assert torch.equal(read(delta)[0].ids, table.export().ids)


def test_a_delta_with_a_flipped_byte_is_refused(tmp_path):
    _, _, delta = chain(tmp_path)
    file = table_file(delta)
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its manifest") as caught:
        read(delta)
    assert str(file) in str(caught.value)


def test_a_delta_with_repeated_ids_is_refused(tmp_path):
    _, _, delta = chain(tmp_path)
    file = table_file(delta)
    saved = torch.load(file, weights_only=True)
    for key in ("ids", "values", "updated"):
        saved[key] = torch.cat([saved[key], saved[key][-1:]])
    saved["slots"] = {key: torch.cat([value, value[-1:]]) for key, value in saved["slots"].items()}
    file.unlink()
    torch.save(saved, file)
    reseal(delta)
    with pytest.raises(CheckpointError, match=r"ids that are not sorted and distinct \(1 repeated\)") as caught:
        read(delta)
    assert str(file) in str(caught.value)


def copy_over(source: Path, target: Path) -> None:
    """Checkpoint directory ``target`` made a byte-for-byte copy of ``source``."""
    for child in target.iterdir():
        child.unlink()
    for child in source.iterdir():
        (target / child.name).write_bytes(child.read_bytes())


def test_a_delta_of_another_chain_is_refused(tmp_path):
    _, _, delta = chain(tmp_path / "a")
    _, _, foreign = chain(tmp_path / "b")  # another run: the same names, other lineages
    copy_over(foreign, delta)
    with pytest.raises(CheckpointError, match="a delta of another run or chain"):
        read(delta)


def test_a_delta_of_another_lineage_is_refused_when_its_parent_is_unhashed(tmp_path):
    _, _, delta = chain(tmp_path / "a")
    _, _, foreign = chain(tmp_path / "b")
    copy_over(foreign, delta)
    raw = manifest_of(delta)  # as a checkpoint written before files and parents were hashed
    del raw["integrity"], raw["extra"]["dynamic_tables"]["t"]["parent_sha256"]
    del raw["extra"]["dynamic_tables"]["t"]["files"][0]["sha256"]
    rewrite_manifest(delta, raw)
    with pytest.raises(CheckpointError, match=r"the delta of shard 0 \(lineage .*\) does not extend its base"):
        read(delta)


def test_a_parent_named_outside_the_root_is_never_read(tmp_path):
    _, _, delta = chain(tmp_path / "a")
    _, elsewhere, _ = chain(tmp_path / "b")
    raw = manifest_of(delta)
    raw["extra"]["dynamic_tables"]["t"]["parent"] = os.path.relpath(elsewhere, delta.parent)
    rewrite_manifest(delta, raw)
    with pytest.raises(CheckpointBaseMissingError, match="gone or unreadable"):
        read(delta)


def test_a_dynamic_file_that_is_no_torch_file_is_a_checkpoint_error(tmp_path):
    _, full, _ = chain(tmp_path)
    file = table_file(full)
    file.write_bytes(FORBIDDEN)
    reseal(full)
    with pytest.raises(CheckpointError, match="cannot be read: UnpicklingError"):
        read(full)


# ---------------------------------------------------------------- hybrid training's dense state


def dense_state(weight: torch.Tensor, optimizer: dict | None = None) -> dict:
    return {"version": 3, "values": {"out.weight": weight}, "optimizer": optimizer, "applied": [1, 2]}


def adagrad_state(weight: torch.Tensor) -> dict:
    parameter = torch.nn.Parameter(weight.clone())
    optimizer = torch.optim.Adagrad([parameter], lr=0.1)
    parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    return optimizer.state_dict()


LIVE = {"out.weight": torch.zeros(1, 8)}
GROUPS = [(["out.weight"], OptimizerSpec("Adagrad", {"lr": 0.1}))]


def test_a_dense_state_of_the_models_shapes_passes(tmp_path):
    write_checkpoint_state(tmp_path, dense_state(torch.ones(1, 8), adagrad_state(torch.ones(1, 8))))
    state = read_checkpoint_state(tmp_path, {"file": "dense_state.pt", "sha256": sha256(tmp_path / "dense_state.pt")})
    check_dense_state(tmp_path, state, LIVE, GROUPS)


def test_a_dense_value_of_another_shape_is_refused_not_broadcast(tmp_path):
    with pytest.raises(CheckpointError, match=r"holds 'out.weight' as \(1, 1\) torch.float32; the model's is \(1, 8\)"):
        check_dense_state(tmp_path, dense_state(torch.ones(1, 1)), LIVE, GROUPS)


def test_a_dense_optimizer_state_of_another_shape_is_refused(tmp_path):
    state = dense_state(torch.ones(1, 8), adagrad_state(torch.ones(1, 1)))
    with pytest.raises(CheckpointError, match="its optimizer state for variable number 0"):
        check_dense_state(tmp_path, state, LIVE, GROUPS)


@pytest.mark.parametrize("payload", [b"garbage", FORBIDDEN])
def test_a_dense_state_that_is_no_torch_file_is_a_checkpoint_error(tmp_path, payload):
    (tmp_path / "dense_state.pt").write_bytes(payload)
    with pytest.raises(CheckpointError, match="dense state .*dense_state.pt cannot be read"):
        read_checkpoint_state(tmp_path, {"file": "dense_state.pt", "sha256": hashlib.sha256(payload).hexdigest()})


def test_a_dense_state_named_outside_its_checkpoint_is_refused(tmp_path):
    buffer = io.BytesIO()
    torch.save(dense_state(torch.ones(1, 8)), buffer)
    (tmp_path / "secret.pt").write_bytes(buffer.getvalue())
    (tmp_path / "ckpt").mkdir()
    entry = {"file": "../secret.pt", "sha256": hashlib.sha256(buffer.getvalue()).hexdigest()}
    with pytest.raises(CheckpointError, match="not a plain name"):
        read_checkpoint_state(tmp_path / "ckpt", entry)
